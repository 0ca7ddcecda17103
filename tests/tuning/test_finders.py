"""model.find_lr and model.find_batch_size: what they find, and that they leave every piece of state as it was."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import easyfit
from easyfit.tuning.batch_size_finder import PeakMemory, is_out_of_memory, largest_that_trains
from easyfit.tuning.lr_finder import suggest_lr

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class OutOfMemoryFrom(nn.Module):
    """A tiny net whose forward raises CUDA's out-of-memory error for batches of `size` samples or more."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        if len(x) >= self.size:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated for a batch of {len(x)})")
        return self.layer(x)


def _state(model: easyfit.Model) -> dict:
    return copy.deepcopy({"net": model.net.state_dict(), "optimizer": model.optimizer.state_dict(),
                          "scheduler": model.scheduler.state_dict(), "rng": torch.get_rng_state(),
                          "history": model.history.history, "epochs": model.completed_epochs})


def _assert_bit_equal(before, after, path="state") -> None:
    if isinstance(before, torch.Tensor):
        assert torch.equal(before, after), path
    elif isinstance(before, dict):
        assert before.keys() == after.keys(), path
        for key in before:
            _assert_bit_equal(before[key], after[key], f"{path}[{key!r}]")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), path
        for index, (one, other) in enumerate(zip(before, after)):
            _assert_bit_equal(one, other, f"{path}[{index}]")
    else:
        assert before == after, path


@pytest.fixture
def trained(make_net, classification) -> easyfit.Model:
    """A model one epoch into training (Adam's moments and a schedule's count are set), with dropout in the net."""
    model = easyfit.Model(make_net(dropout=0.2), "cross_entropy", "adam",
                          scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
    model.fit(*classification, epochs=1, verbose=0)
    return model


def test_find_lr_leaves_weights_optimizer_schedule_history_and_rng_bit_for_bit(trained, classification):
    before = _state(trained)
    result = trained.find_lr(*classification, num_steps=30, batch_size=16)
    assert len(result.lrs) == len(result.losses) > 5
    _assert_bit_equal(before, _state(trained))


def test_find_lr_stops_when_the_loss_diverges(make_net, regression):
    model = easyfit.Model(make_net(out_features=1), "mse", "sgd")
    result = model.find_lr(*regression, start_lr=1e-4, end_lr=1e4, num_steps=200, batch_size=8)
    assert len(result.lrs) < 200
    assert result.losses[-1] > 4 * min(result.losses)
    assert result.suggestion is not None and result.suggestion < result.lrs[-1]


def test_suggest_lr_takes_the_steepest_descent_before_the_minimum():
    lrs = [10 ** (exponent / 10) for exponent in range(-60, 1)]   # 1e-6 .. 1
    # flat, then falling fastest around 1e-3, lowest at 1e-1, then rising
    losses = [2.0 - 1.5 / (1 + 10 ** (-(exponent + 30) / 5)) + max(0, exponent + 10) * 0.3
              for exponent in range(-60, 1)]
    assert suggest_lr(lrs, losses) == pytest.approx(1e-3, rel=0.3)
    assert suggest_lr(lrs[:2], losses[:2]) is None


def test_the_lr_curve_plots_with_the_suggestion(trained, classification, tmp_path):
    pytest.importorskip("matplotlib")
    result = trained.find_lr(*classification, num_steps=20, plot=tmp_path / "lr.png")
    assert (tmp_path / "lr.png").stat().st_size > 0 and result.figure is not None


def test_find_lr_on_the_digits_quickstart_suggests_a_rate_at_least_as_good_as_adams_default():
    """The quickstart's net and data: 10 epochs at the suggested rate reach at least the test accuracy of Adam's
    default rate (1e-3), on average over two seeds (measured: 0.979 against 0.973)."""
    pytest.importorskip("sklearn")
    sys.path.insert(0, str(EXAMPLES))
    from quickstart import load_data
    x_train, x_test, y_train, y_test = load_data()

    def model(lr=None, seed: int = 0) -> easyfit.Model:
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
        return easyfit.Model(net, "cross_entropy", "adam", lr=lr)

    def accuracy(lr: float) -> float:
        scores = []
        for seed in (0, 1):
            trained = model(lr, seed)
            trained.fit(x_train, y_train, epochs=10, batch_size=32, seed=seed, verbose=0)
            scores.append((trained.predict(x_test).argmax(1) == y_test).mean())
        return sum(scores) / len(scores)

    suggestion = model().find_lr(x_train, y_train).suggestion
    assert accuracy(suggestion) >= accuracy(1e-3)


def test_find_batch_size_returns_the_size_below_the_first_that_runs_out_of_memory(classification):
    x, y = classification
    model = easyfit.Model(OutOfMemoryFrom(37), "cross_entropy", "sgd")
    before = copy.deepcopy(model.net.state_dict())
    assert model.find_batch_size(x, y, max_batch_size=100) == 36
    _assert_bit_equal(before, model.net.state_dict())


def test_find_batch_size_is_bounded_by_the_data_and_max_batch_size(classification):
    model = easyfit.Model(OutOfMemoryFrom(1000), "cross_entropy", "sgd")
    assert model.find_batch_size(*classification, max_batch_size=50) == 50
    assert model.find_batch_size(*classification, max_memory=2**40) == len(classification[0])


def test_the_search_finds_every_threshold_exactly():
    for threshold in range(2, 130):
        tried: list[int] = []

        def trains(size: int, tried=tried, threshold=threshold) -> bool:
            tried.append(size)
            return size < threshold

        assert largest_that_trains(trains, 1, 128) == min(threshold - 1, 128), threshold
        assert len(tried) <= 16   # doubling, then halving: logarithmic


def test_find_batch_size_refuses_fit_options_it_sets(classification):
    model = easyfit.Model(OutOfMemoryFrom(1000), "cross_entropy", "sgd")
    with pytest.raises(TypeError, match="takes no batch_size"):
        model.find_batch_size(*classification, max_batch_size=8, batch_size=4)
    with pytest.raises(RuntimeError, match="not even a batch of 1"):
        easyfit.Model(OutOfMemoryFrom(1), "cross_entropy", "sgd").find_batch_size(*classification, max_batch_size=8)


def test_other_errors_are_not_taken_for_running_out_of_memory(make_net, classification):
    x, y = classification
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    with pytest.raises(TypeError, match="expects class indices"):
        model.find_batch_size(x, y[:, None].float(), max_batch_size=8)   # a target the loss cannot take
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB"))


def test_peak_memory_sees_a_large_allocation_after_a_reset():
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak resident set is read from /proc (Linux)")
    memory = PeakMemory(torch.device("cpu"))
    try:
        memory.reset()
    except RuntimeError as error:   # a container may forbid resetting it
        pytest.skip(f"the peak resident set cannot be reset here: {error}")
    baseline = memory.peak()
    block = torch.ones(64 * 2**20 // 4)   # 64 MiB, touched
    assert memory.peak() - baseline >= 60 * 2**20
    del block


@pytest.mark.gpu
def test_find_batch_size_on_a_gpu_is_within_2x_of_the_largest_that_trains():
    """With 4 GiB of the GPU's memory allowed (a fifth of a smaller GPU's), the batch found trains, and twice it runs
    out of memory. A fixed share of a 141 GB GPU (28 GB) once held more than half the data set in one batch."""
    device = torch.device("cuda", torch.cuda.current_device())   # the fraction is set per device index
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(0.2, 4 * 2**30 / total), device)
    try:
        net = nn.Sequential(nn.Linear(1024, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 10))
        x, y = torch.randn(2**18, 1024), torch.randint(0, 10, (2**18,))
        model = easyfit.Model(net, "cross_entropy", "adam")
        found = model.find_batch_size(x, y, start=256, accelerator="cuda", devices=1)
        assert found < len(x) // 2, "memory, not the data, must bound the search"
        model.fit(x[:found], y[:found], batch_size=found, epochs=1, verbose=0, accelerator="cuda", devices=1)
        with pytest.raises(torch.OutOfMemoryError):
            model.fit(x[:2 * found], y[:2 * found], batch_size=2 * found, epochs=1, verbose=0, accelerator="cuda",
                      devices=1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
