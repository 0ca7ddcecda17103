"""Every tensor easyfit creates gets its device from the strategy. On a CUDA run a CPU tensor beside a CUDA one
fails (`Expected all tensors to be on the same device`), and NCCL refuses a CPU tensor in a collective even at world
size 1; on the CPU both pass silently. These tests catch that class of defect without a GPU: a static check of every
tensor factory call, and the meta device standing in for "a device that is not the CPU"."""
from __future__ import annotations

import ast

import pytest
import torch
from code_scan import calls_in_easyfit

from easyfit.training.loop import LossTracker

FACTORIES = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange", "eye", "linspace",
             "rand", "randn", "randint", "randperm", "scalar_tensor"}

#: (module path in easyfit/, function) -> why the tensors it creates belong on the host, whatever device the run uses
HOST_TENSORS = {
    ("data/arrays.py", "as_tensor"): "the user's arrays, converted where they are; batches move to the device later",
    ("saving/checkpoint.py", "as_data"): "numpy arrays in a state, as tensors in a file (loaded with map_location)",
    ("saving/checkpoint.py", "numpy_generator_state"): "a numpy generator's key, kept in a file",
    ("saving/net_weights.py", "from_arrays"): "Keras-style weight arrays, copied into parameters wherever those live",
    ("data/weights.py", "class_weights"): "the class-weight lookup table is indexed on the host, the result moved",
    ("data/weights.py", "_as_weights"): "the user's sample weights, moved with their batch",
    ("data/samplers.py", "index_tensor"): "sample indices select rows on the host",
    ("data/samplers.py", "sampler_indices"): "sample indices select rows on the host",
    ("training/summary.py", "_output_shapes"): "a placeholder that only names the device of a net with no parameters",
    ("compiled/onednn_matmul.py", "_times_faster"): "CPU matrix products timed on the CPU: the choice is a CPU one",
    ("training/epoch_logs.py", "totals"): "the epoch's loss sum before the first batch (a float), moved to be reduced",
    ("saving/export.py", "cut"): "the example an export traces on the CPU, where the plain net is exported",
    ("data/map_style.py", "_numbers_as_tensors"): "a sample's lists of numbers, collated on the host like any sample",
    ("parts/named_metrics.py", "compute"): "a classification metric's value, read to the host with the check of its "
                                            "targets in one read: a tensor on the device would be read again",
}


def names_no_device(call: ast.Call) -> bool:
    """A `torch.<factory>(...)` call without `device=`."""
    function = call.func
    return (isinstance(function, ast.Attribute) and function.attr in FACTORIES and isinstance(function.value, ast.Name)
            and function.value.id == "torch" and not any(keyword.arg == "device" for keyword in call.keywords))


def factory_calls_without_a_device() -> list[tuple[str, str, int]]:
    """(module, enclosing function, line) of each `torch.<factory>(...)` call in easyfit that names no device."""
    return calls_in_easyfit(names_no_device)


def test_every_tensor_easyfit_creates_names_its_device_or_is_a_host_tensor_by_design():
    stray = [f"easyfit/{module}:{line} in {function}()" for module, function, line in factory_calls_without_a_device()
             if (module, function) not in HOST_TENSORS]
    assert not stray, ("these tensors land on the CPU whatever device the run uses; create them with "
                       "device=strategy.root_device (or the device of the tensors they join): " + ", ".join(stray))


def test_the_host_tensor_list_names_only_calls_that_exist():
    found = {(module, function) for module, function, _ in factory_calls_without_a_device()}
    assert set(HOST_TENSORS) <= found, f"no longer in the code: {sorted(set(HOST_TENSORS) - found)}"


class DeviceStrategy:
    """The part of the strategy contract a loss tracker uses, on a device of choice; records what reaches the
    collective and answers with the given totals (a meta tensor holds no numbers to reduce)."""

    def __init__(self, device: str, answer: list[float]):
        self.root_device = torch.device(device)
        self.answer = answer
        self.reduced: list[torch.Tensor] = []

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert tensor.device == self.root_device, f"a collective got a tensor on {tensor.device}"
        self.reduced.append(tensor)
        return torch.tensor(self.answer, dtype=torch.float64)


@pytest.mark.parametrize("losses_on", ["meta", "cpu"])
def test_the_epoch_loss_reaches_its_collective_on_the_strategy_device(losses_on):
    """The epoch's loss over every process (also what a mid-epoch checkpoint stores): one collective on the
    strategy's device, whatever device the losses were computed on."""
    tracker = LossTracker(fold_every=2)
    for size in (4, 4, 2):
        tracker.add(torch.ones((), device=losses_on), size)
    strategy = DeviceStrategy("meta", answer=[30.0, 15.0])
    assert tracker.global_totals(strategy) == (30.0, 15)
    assert tracker.global_mean(strategy) == 2.0
    assert [tuple(tensor.shape) for tensor in strategy.reduced] == [(2,), (2,)]


def test_an_epoch_with_no_samples_anywhere_is_an_error():
    with pytest.raises(ValueError, match="0 samples"):
        LossTracker().global_mean(DeviceStrategy("meta", answer=[0.0, 0.0]))
