"""compile= on batches whose sizes change (token sequences padded to each batch's longest): the changing dimension is
compiled as dynamic, once, and the fit equals the eager one. The whole-step program hands such a fit to the
separately compiled parts (torch cannot trace a Dropout under torch.func.grad with symbolic sizes), and says so."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch._dynamo.utils
from compile_paths import fast_path
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

import easyfit


class MeanOfTokens(nn.Module):
    """Token ids (0 pads) -> the mean of their embeddings over the real tokens -> 3 classes."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(20, 8, padding_idx=0)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).float()
        return self.head(torch.tanh((self.dropout(self.embedding(ids)) * mask).sum(1) / mask.sum(1)))


def sequences(count: int = 120, shortest: int = 3, longest: int = 30) -> list:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(count):
        length = int(torch.randint(shortest, longest + 1, (1,), generator=generator))
        ids = torch.randint(1, 20, (length,), generator=generator)
        samples.append((ids, int(ids[0]) % 3))
    return samples


def padded(batch):
    ids, labels = zip(*batch)
    return pad_sequence(ids, batch_first=True), torch.tensor(labels)


def _fit(compile, **options):
    torch.manual_seed(0)
    net = MeanOfTokens()
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.5, metrics=["accuracy"])
    loader = DataLoader(sequences(), batch_size=16, collate_fn=padded)   # 8 batches, the last one of 8
    history = model.fit(loader, epochs=3, verbose=0, compile=compile, validation_data=loader, **options)
    return net, model, history.history


@pytest.mark.parametrize("steps_per_execution", [1, pytest.param(3, marks=fast_path)])
def test_padded_batches_of_changing_length_compile_once_and_equal_eager(steps_per_execution):
    eager_net, _, eager = _fit(False)
    torch._dynamo.utils.counters.clear()
    with pytest.warns(UserWarning, match="change size between batches") if steps_per_execution > 1 else \
            contextlib.nullcontext():
        net, model, compiled = _fit({"backend": "aot_eager"}, steps_per_execution=steps_per_execution)
    for key, values in eager.items():
        assert compiled[key] == pytest.approx(values, abs=1e-5), key
    for (name, expected), actual in zip(eager_net.state_dict().items(), net.state_dict().values()):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=name)
    step = next(value for key, value in model.compiled_steps.cache.items() if key[0] == "train")
    assert step.family.free == {(0, 1)}   # the token dimension of the ids, dynamic
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 8, f"{graphs} graphs compiled for 24 batches of 21 lengths"


@fast_path
def test_the_fit_says_what_it_compiled_and_how_long_it_took(capsys):
    _fit({"backend": "aot_eager"}, steps_per_execution=3)   # verbose=0: nothing said
    assert "compile=:" not in capsys.readouterr().out
    torch.manual_seed(0)
    model = easyfit.Model(MeanOfTokens(), "cross_entropy", "sgd", lr=0.5)
    model.fit(DataLoader(sequences(), batch_size=16, collate_fn=padded), epochs=2, verbose=2,
              compile={"backend": "aot_eager"}, steps_per_execution=3)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("compile=:"))
    assert re.fullmatch(r"compile=: \d+ graphs? compiled in \d+\.\d s; [01] whole-step training programs?", line), line


def _programs(model) -> int:
    return sum(len(value) for value in model.compiled_steps.cache.values() if isinstance(value, dict))


def _compiled_equals_eager(loader, epochs: int) -> easyfit.Model:
    """Fits `loader` eagerly, then compiled (aot_eager, 3 steps per program); asserts the Histories agree within 1e-5
    and returns the compiled fit's Model."""
    torch.manual_seed(0)
    eager = easyfit.Model(MeanOfTokens(), "cross_entropy", "sgd", lr=0.5).fit(loader, epochs=epochs, verbose=0)
    torch.manual_seed(0)
    model = easyfit.Model(MeanOfTokens(), "cross_entropy", "sgd", lr=0.5)
    compiled = model.fit(loader, epochs=epochs, verbose=0, compile={"backend": "aot_eager"}, steps_per_execution=3)
    for key, values in eager.history.items():
        assert compiled.history[key] == pytest.approx(values, abs=1e-5), key
    return model


@fast_path
def test_a_loader_whose_first_batches_share_a_length_compiles_no_whole_step_program_for_them():
    """The first 6 batches all hold a sequence of the longest length (30) and pad to it; later ones are shorter. A
    whole-step program compiled for the first batches would be thrown away at the first shorter batch: the first
    epoch runs in parts while the shapes are watched, and a fit whose batches change size compiles no program."""
    samples = sequences(count=160, longest=20)
    for index in range(0, 96, 16):
        samples[index] = (torch.randint(1, 20, (30,), generator=torch.Generator().manual_seed(index)), 1)
    with pytest.warns(UserWarning, match="change size between batches"):
        model = _compiled_equals_eager(DataLoader(samples, batch_size=16, collate_fn=padded), epochs=2)
    assert _programs(model) == 0


@fast_path
def test_a_loader_of_one_shape_trains_in_programs_from_its_second_epoch_as_eagerly():
    x, y = torch.randint(1, 20, (96, 12)), torch.randint(0, 3, (96,))
    model = _compiled_equals_eager(DataLoader(list(zip(x, y)), batch_size=16), epochs=3)
    assert _programs(model) == 1
