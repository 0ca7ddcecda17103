"""fit(compile=True) with its defaults is never silently wrong where an eager fit is right: a net with both
BatchNorm and Dropout under SGD in several-step programs (inductor once fused a Dropout mask's fill with its use,
before the draw), and changes a callback makes between epochs to what the forward reads (the direct call once
skipped torch.compile's guards, so the first epoch's values stayed compiled in), and a layer frozen between
epochs."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
from compile_paths import fast_path
from sklearn.datasets import load_breast_cancer
from torch import nn

import easyfit
from easyfit.callbacks import Callback


@pytest.fixture(scope="module")
def cancer() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's breast-cancer set, standardised: 569 samples, 30 features, 2 classes."""
    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def _fit(net_maker, data, compile, epochs, momentum=0.0, **options):
    torch.manual_seed(0)
    net = net_maker()
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.05, momentum=momentum))
    history = model.fit(*data, epochs=epochs, batch_size=32, verbose=0, compile=compile, **options)
    return net, history.history


def _assert_same(eager, compiled) -> None:
    (eager_net, eager_history), (net, history) = eager, compiled
    for key, values in eager_history.items():
        assert history[key] == pytest.approx(values, abs=1e-5), key
    for (name, expected), actual in zip(eager_net.state_dict().items(), net.state_dict().values()):
        assert (actual.double() - expected.double()).abs().max().item() <= 1e-5, name


def test_batch_norm_and_dropout_under_sgd_learn_as_eagerly(cancer):
    """The defaults ("auto": 8 steps a program for this small net): each History value and weight equals eager's."""
    def net():
        return nn.Sequential(nn.Linear(30, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2))
    eager = _fit(net, cancer, False, 3, validation_split=0.2)
    compiled = _fit(net, cancer, True, 3, validation_split=0.2)
    assert eager[1]["loss"][-1] < 0.25   # it learns
    _assert_same(eager, compiled)


class Tokens(nn.Module):
    """The 30 features as 5 tokens of 6, through a TransformerEncoderLayer: its attention output, which `dropout1`
    takes, is not contiguous, so eager torch draws that Dropout's mask in another layout than a new tensor's."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x.view(-1, 5, 6))).mean(1))


def test_a_transformer_s_dropout_draws_eager_s_masks_in_the_whole_step_program(cancer):
    """The masks of Dropouts on non-contiguous inputs were drawn in another layout inside the whole-step program
    (traced through torch.func), 1e-2 off in the loss; each History value and weight now equals eager's. The
    graph is rewritten before any backend sees it; aot_eager keeps the test short (inductor took 2.5 min here)."""
    eager = _fit(Tokens, cancer, False, 2)
    compiled = _fit(Tokens, cancer, {"backend": "aot_eager"}, 2)
    _assert_same(eager, compiled)


class Scaled(nn.Module):
    """A forward that reads a plain attribute (a temperature, a curriculum weight) besides a Dropout layer."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(30, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 2))
        self.scale = 1.0

    def forward(self, x):
        return self.body(x) * self.scale


class ChangeTheRun(Callback):
    """Epoch 1: a new scale; epoch 2: another Dropout rate; epoch 3: the Dropout layer put in eval mode."""

    def on_epoch_begin(self, epoch, logs=None):
        net = self.model.net
        if epoch >= 1:
            net.scale = 0.5
        if epoch >= 2:
            net.body[2].p = 0.6
        if epoch >= 3:
            net.body[2].eval()


@fast_path
def test_changes_between_epochs_reach_the_compiled_program(cancer):
    """Four epochs of 4 batches, one 4-step program call each: the compiled fit sees each change as eagerly. The
    guards that catch a change are torch.compile's, before any backend, so aot_eager keeps the test short (inductor
    took 48 CPU-s here); test_compile_differential's inductor families make these changes under inductor."""
    data = (cancer[0][:128], cancer[1][:128])
    eager = _fit(Scaled, data, False, 4, callbacks=[ChangeTheRun()])
    compiled = _fit(Scaled, data, {"backend": "aot_eager"}, 4, steps_per_execution=4, callbacks=[ChangeTheRun()])
    _assert_same(eager, compiled)


class Unfreeze(Callback):
    """Epoch 1 freezes the first layer, epoch 2 unfreezes it: gradual unfreezing."""

    def on_epoch_begin(self, epoch, logs=None):
        self.model.net[0].requires_grad_(epoch != 1)


@fast_path
def test_a_layer_frozen_between_epochs_is_not_updated(cancer):
    """A frozen parameter gets no gradient and no update in the whole-step program (it once kept training)."""
    def net():
        return nn.Sequential(nn.Linear(30, 16), nn.Tanh(), nn.Linear(16, 2))
    data = (cancer[0][:128], cancer[1][:128])
    eager = _fit(net, data, False, 3, 0.9, callbacks=[Unfreeze()])
    compiled = _fit(net, data, {"backend": "aot_eager"}, 3, 0.9, steps_per_execution=4, callbacks=[Unfreeze()])
    _assert_same(eager, compiled)


class Recurrent(nn.Module):
    """An LSTM over the features read as 5 steps of 6: a layer torch.compile does not trace."""

    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.lstm(x.reshape(len(x), 5, 6))[0][:, -1])


@fast_path
def test_a_step_torch_compile_cannot_trace_declines_to_parts_with_a_notice(cancer):
    """An LSTM net under compile=True's defaults, with a per-step schedule: the whole-step program fails to trace
    (it once stopped the fit); the fit says so once and trains in parts, with eager's numbers and schedule."""
    data = (cancer[0][:160], cancer[1][:160])
    schedule = {"lr_warmup_epochs": 1}
    eager = _fit(Recurrent, data, False, 2, **schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _fit(Recurrent, data, {"backend": "aot_eager"}, 2, **schedule)
    notices = [str(w.message) for w in caught if "cannot make the training step one program here" in str(w.message)]
    # the 4 batches after the eager first one are fewer than a program's 8: the fit once traced the program again
    # for each of them, failing each time
    assert len(notices) == 1 and "Unsupported" in notices[0], notices
    _assert_same(eager, compiled)


@fast_path
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fit_that_declines_the_program_steps_a_compiled_optimizer_as_the_user_made_it(cancer, device):
    """Once the whole-step program is declined, the fit runs as one that never had programs: its optimizer step is
    compiled on its own, and Adam is as the user made it. On a GPU the programs had made it capturable (its step
    counters on the device), which left a Hugging Face GPT-2's eager AdamW steps 2 ms slower."""
    torch.manual_seed(0)
    net = Recurrent()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    model = easyfit.Model(net, "cross_entropy", optimizer)
    with pytest.warns(UserWarning, match="cannot make the training step one program here"):
        model.fit(cancer[0][:160], cancer[1][:160], epochs=2, batch_size=32, verbose=0, accelerator=device,
                  devices=1, compile={"backend": "aot_eager"})
    assert any(key[0] == "optimizer" for key in model.compiled_steps.cache), "the optimizer step was not compiled"
    assert [group["capturable"] for group in optimizer.param_groups] == [False]
    assert {optimizer.state[p]["step"].device.type for p in net.parameters()} == _hand_compiled_adam_counters(device)


def _hand_compiled_adam_counters(device: str) -> set[str]:
    """Where a hand-written loop that steps Adam eagerly, then through torch.compile, keeps the step counters:
    torch.compile moves them to the parameters' device (a GPU's), without making Adam capturable."""
    layer = nn.Linear(2, 1).to(device)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3)
    compiled_step = torch.compile(optimizer.step, backend="aot_eager")
    for step in (optimizer.step, compiled_step):
        layer(torch.ones(1, 2, device=device)).sum().backward()
        step()
    assert [group["capturable"] for group in optimizer.param_groups] == [False]
    return {state["step"].device.type for state in optimizer.state.values()}


class Logging(nn.Module):
    """A net that logs from its forward, as libraries do."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(30, 16), nn.Tanh(), nn.Linear(16, 2))
        self.logger = logging.getLogger("easyfit.tests.logging_net")

    def forward(self, x):
        self.logger.warning("a batch of %d", len(x))
        return self.layers(x)


@fast_path
def test_logging_in_the_forward_does_not_keep_the_step_from_being_one_program(cancer, caplog):
    """torch.compile stops a graph at a logging call: the whole-step program once declined to parts for a net that
    logs (Hugging Face models do, from their loss). The call runs in the eager first step, the rest is one program."""
    from easyfit.utils.torch_internals import compile_totals
    data = (cancer[0][:160], cancer[1][:160])
    eager = _fit(Logging, data, False, 2)
    graphs = compile_totals()[0]
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="easyfit.tests.logging_net"):
        warnings.simplefilter("error")   # no notice of a step in parts
        compiled = _fit(Logging, data, {"backend": "aot_eager"}, 2)
    assert compile_totals()[0] - graphs == 1, "one whole-step program, no graph for parts"
    assert "a batch of 32" in caplog.text   # logged by the eager first step
    _assert_same(eager, compiled)


@fast_path   # the fallback compiles each new optimizer's step anew, as plain torch.compile would
def test_fitting_again_after_compile_reuses_the_programs_and_a_resized_layer_does_not(cancer):
    """Keras' habit: compile() with a new optimizer, then fit again. The second fit compiles nothing and equals a
    fresh eager fit; a layer replaced by one of another size gets programs of its own, with eager's numbers."""
    from easyfit.utils.torch_internals import compile_totals
    data = (cancer[0][:128], cancer[1][:128])

    def net():
        return nn.Sequential(nn.Linear(30, 16), nn.Tanh(), nn.Linear(16, 2))
    torch.manual_seed(0)
    model = easyfit.Model(net(), "cross_entropy", "sgd", lr=0.05, momentum=0.9)
    model.fit(*data, epochs=1, batch_size=32, verbose=0, compile={"backend": "aot_eager"})
    for resized in (False, True):
        torch.manual_seed(0)
        fresh = net()
        if resized:
            fresh[2], model.net[2] = nn.Linear(16, 2, bias=False), nn.Linear(16, 2, bias=False)
            fresh[0], model.net[0] = nn.Linear(30, 16), nn.Linear(30, 16)
        model.net.load_state_dict(fresh.state_dict())
        model.compile(torch.optim.SGD(model.net.parameters(), lr=0.05, momentum=0.9), model.loss_fn)
        before = compile_totals()[0]
        history = model.fit(*data, epochs=2, batch_size=32, verbose=0, compile={"backend": "aot_eager"})
        assert (compile_totals()[0] > before) == resized
        eager = _fit(lambda fresh=fresh: fresh, data, False, 2, 0.9)
        _assert_same(eager, (model.net, history.history))
