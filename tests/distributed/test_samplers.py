"""How data is split between ranks: training shares, exact evaluation shares, user samplers, opting out.

Each rank's view comes from a DDPStrategy configured by hand for 2 CPU processes (no process group needed);
one real 2-process run checks that every epoch is shuffled differently and still covers the data once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

from easyfit.data.batches import interleave, make_batches
from easyfit.distributed.strategies.ddp import DDPStrategy
from easyfit.distributed.strategies.parallel import DistributedSamplerWrapper

WORLD_SIZE = 2


@pytest.fixture(autouse=True)
def plain_run(monkeypatch):
    """Ranks come from configure_rank, not from variables of a launcher that may have started pytest."""
    for name in ("EASYFIT_LAUNCHED_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)


def rank(local_rank: int, world_size: int = WORLD_SIZE) -> DDPStrategy:
    strategy = DDPStrategy()
    strategy.configure(accelerator="cpu", parallel_devices=[torch.device("cpu")] * world_size)
    strategy.configure_rank(local_rank)
    return strategy


def shares(make_sampler, world_size: int = WORLD_SIZE) -> list[list[int]]:
    """The indices each rank's sampler yields: make_sampler(strategy) -> sampler."""
    return [list(make_sampler(rank(r, world_size))) for r in range(world_size)]


def seen(batches) -> list[int]:
    """The sample ids (first tensor of each batch) one rank iterates over, in order."""
    return torch.cat([batch[0] for batch in batches]).tolist()


def ids_dataset(length: int) -> TensorDataset:
    return TensorDataset(torch.arange(length), torch.zeros(length))


class Reversed(Sampler):
    """A user's own sampler: last index first; with set_epoch, rotated by the epoch."""

    def __init__(self, length: int):
        self.length, self.epoch = length, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(reversed(range(self.length)))
        return iter(order[self.epoch:] + order[:self.epoch])

    def __len__(self) -> int:
        return self.length


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(8.0).unsqueeze(1))


# ---------------------------------------------------------------- training
def test_training_shares_are_disjoint_and_cover_every_index():
    parts = shares(lambda strategy: strategy.train_sampler(100, shuffle=True, seed=3))
    assert len(parts[0]) == len(parts[1]) == 50
    assert set(parts[0]).isdisjoint(parts[1]) and sorted(parts[0] + parts[1]) == list(range(100))


def test_training_shares_of_an_odd_length_take_equal_steps_and_cover_every_index():
    parts = shares(lambda strategy: strategy.train_sampler(101, shuffle=True, seed=0))
    assert len(parts[0]) == len(parts[1]) == 51   # one index repeated so both ranks step together
    assert set(parts[0]) | set(parts[1]) == set(range(101))


def test_each_epoch_is_shuffled_differently_and_the_same_epoch_identically():
    def epoch_order(epoch: int) -> list[int]:
        sampler = rank(0).train_sampler(64, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        return list(sampler)
    assert epoch_order(0) != epoch_order(1) != epoch_order(2)
    assert epoch_order(1) == epoch_order(1)   # a re-created sampler: the order depends on (seed, epoch) only


def test_batches_from_tensors_follow_the_epoch():
    x = torch.arange(40)
    batches = make_batches(x, torch.zeros(40), batch_size=8, strategy=rank(1), train=True, shuffle=True, seed=0)
    first = seen(batches)
    batches.set_epoch(1)
    assert seen(batches) != first and sorted(seen(batches)) != sorted(first)   # a new share, not a new order only
    assert len(first) == 20


def test_no_shuffle_gives_strided_shares_in_order():
    assert shares(lambda strategy: strategy.train_sampler(6, shuffle=False, seed=0)) == [[0, 2, 4], [1, 3, 5]]


# ---------------------------------------------------------------- evaluation: exact, in input order
def test_evaluation_shares_have_no_padded_duplicates():
    parts = shares(lambda strategy: strategy.eval_sampler(101))
    assert (len(parts[0]), len(parts[1])) == (51, 50)
    assert sorted(parts[0] + parts[1]) == list(range(101))


@pytest.mark.parametrize("world_size", [2, 3])
def test_interleave_restores_input_order(world_size):
    x = torch.arange(101 * 2).view(101, 2)
    parts = [x[indices] for indices in shares(lambda strategy: strategy.eval_sampler(101), world_size)]
    torch.testing.assert_close(interleave(parts), x)


def test_a_users_evaluation_loader_is_split_exactly_and_interleaved_back():
    loader = DataLoader(ids_dataset(101), batch_size=8)
    parts = []
    for r in range(WORLD_SIZE):
        batches = make_batches(loader, None, batch_size=8, strategy=rank(r), train=False)
        assert batches.sharded
        parts.append(torch.tensor(seen(batches)))
    assert interleave(parts).tolist() == list(range(101))


# ---------------------------------------------------------------- a user's DataLoader
def test_a_users_own_sampler_is_wrapped_so_each_rank_gets_its_share():
    loader = DataLoader(ids_dataset(10), batch_size=3, sampler=Reversed(10))
    parts = []
    for r in range(WORLD_SIZE):
        batches = make_batches(loader, None, batch_size=3, strategy=rank(r), train=True)
        assert isinstance(batches.loader.sampler, DistributedSamplerWrapper)
        assert batches.loader.batch_size == 3
        parts.append(seen(batches))
    assert parts == [[9, 7, 5, 3, 1], [8, 6, 4, 2, 0]]   # the user's order, dealt out in turn


def test_the_wrapper_passes_the_epoch_to_the_users_sampler():
    loader = DataLoader(ids_dataset(10), batch_size=5, sampler=Reversed(10))
    batches = make_batches(loader, None, batch_size=5, strategy=rank(0), train=True)
    batches.set_epoch(1)
    assert seen(batches) == [8, 6, 4, 2, 0]


def test_a_wrapped_sampler_of_odd_length_gives_both_ranks_as_many_samples():
    parts = [list(DistributedSamplerWrapper(Reversed(5), r, WORLD_SIZE)) for r in range(WORLD_SIZE)]
    assert parts == [[4, 2, 0], [3, 1, 4]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_plain_loader_gets_the_distributed_sampler(shuffle):
    loader = DataLoader(ids_dataset(20), batch_size=4, shuffle=shuffle)
    parts = [seen(make_batches(loader, None, batch_size=4, strategy=rank(r), train=True, seed=0))
             for r in range(WORLD_SIZE)]
    assert sorted(parts[0] + parts[1]) == list(range(20)) and len(parts[0]) == 10
    in_order = parts[0] == list(range(0, 20, 2))
    assert in_order != shuffle


@pytest.mark.parametrize("train", [True, False])
def test_replace_sampler_false_leaves_the_users_loader_alone(train):
    loader = DataLoader(ids_dataset(10), batch_size=4, sampler=Reversed(10))
    batches = make_batches(loader, None, batch_size=4, strategy=rank(1), train=train, replace_sampler=False)
    assert batches.loader is loader and not batches.sharded
    assert seen(batches) == list(reversed(range(10)))   # rank 1 reads everything, as the user's sampler says


def test_an_iterable_dataset_on_two_ranks_warns_and_is_read_whole():
    for data in (Stream(), DataLoader(Stream(), batch_size=4)):
        with pytest.warns(UserWarning, match="cannot be split between processes automatically: every one of the "
                                             "2 processes reads it whole"):
            batches = make_batches(data, None, batch_size=4, strategy=rank(1), train=True)
        assert sum(len(batch) for batch in batches) == 8


# ---------------------------------------------------------------- two real processes
RECORD_SCRIPT = '''
import sys
import torch
import easyfit
from easyfit.callbacks import Callback


class Recorder(torch.nn.Module):
    """Remembers the sample ids (column 0) it trains on."""
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.seen = []

    def forward(self, x):
        self.seen.extend(x[:, 0].long().tolist())
        return self.linear(x)


class SavePerEpoch(Callback):
    def __init__(self):
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.model.net.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(self.model.net.seen)
        torch.save(self.epochs, f"{sys.argv[1]}/rank{self.model.global_rank}.pt")


torch.set_num_threads(1)
x = torch.arange(32.0).unsqueeze(1)
easyfit.Model(Recorder(), "mse", "sgd").fit(x, torch.zeros(32, 1), epochs=3, batch_size=4, verbose=0,
                                           callbacks=[SavePerEpoch()], devices=2, accelerator="cpu",
                                           strategy="ddp_fork")
'''


@pytest.mark.timeout(60)
def test_two_processes_see_every_sample_once_per_epoch_in_a_new_order(tmp_path):
    script = tmp_path / "record.py"
    script.write_text(textwrap.dedent(RECORD_SCRIPT))
    process = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                             timeout=50, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    for epoch in range(3):
        first, second = ranks[0][epoch], ranks[1][epoch]
        assert len(first) == len(second) == 16 and sorted(first + second) == list(range(32))
    for epochs in ranks:
        assert epochs[0] != epochs[1] != epochs[2]


EMPTY_SHARE_SCRIPT = '''
import json
import torch
import easyfit

torch.set_num_threads(1)
torch.manual_seed(0)
x, y = torch.randn(3, 4), torch.tensor([0, 2, 1])
run = dict(verbose=0, devices=2, accelerator="cpu", strategy="ddp_fork")
model = easyfit.Model(torch.nn.Linear(4, 3), "cross_entropy", "sgd", metrics=["accuracy", "f1"])
# one sample: rank 1's share is empty, yet it must build the metrics and join their sync
first = model.evaluate(x[:1], y[:1], **run, return_dict=True)
both = model.evaluate(x, y, **run, return_dict=True)   # would wait for a rank that skipped the first sync
local = easyfit.Model(model.net, "cross_entropy", "sgd", metrics=["accuracy", "f1"])
print(json.dumps([first, local.evaluate(x[:1], y[:1], verbose=0, return_dict=True), both,
                  local.evaluate(x, y, verbose=0, return_dict=True)]))
'''


@pytest.mark.timeout(90)
def test_a_rank_with_no_evaluation_samples_still_joins_the_metric_sync(tmp_path):
    script = tmp_path / "empty_share.py"
    script.write_text(EMPTY_SHARE_SCRIPT)
    process = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    first, expected_first, both, expected_both = json.loads(process.stdout.splitlines()[-1])
    assert first == pytest.approx(expected_first, abs=1e-6) and set(first) == {"loss", "accuracy", "f1"}
    assert both == pytest.approx(expected_both, abs=1e-6)
