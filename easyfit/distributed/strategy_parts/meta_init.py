"""Nets built on the meta device (FSDP2's `module_construction()`): no memory until `setup`, which materializes one
shard unit at a time under the RNG state the construction started from, so the weights equal the net built whole.

Every module that holds parameters or buffers itself must have `reset_parameters()` (or, as torch's
MultiheadAttention, `_reset_parameters()`) that sets them: it is called children first, in registration order, which
is the order a net built the usual way initializes them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import chain

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

#: set on each module built under the context: the RNG state the construction started from
RNG_ATTRIBUTE = "_easyfit_construction_rng"


class ConstructionRng:
    """The CPU RNG state when the construction registered its first parameter or buffer (a seed set inside the
    context counts), shared by the modules it built: what their initialization would have drawn from."""

    def __init__(self):
        self.state: torch.Tensor | None = None

    def record(self) -> None:
        if self.state is None:
            self.state = torch.get_rng_state()


def on_meta(module: torch.nn.Module) -> bool:
    """The module holds parameters or buffers itself that are on the meta device (others are left as they are)."""
    return any(t.is_meta for t in chain(module.parameters(recurse=False), module.buffers(recurse=False)))


def initializer(module: torch.nn.Module):
    """The module's method that sets its own parameters and buffers, or None."""
    return next((method for method in (getattr(module, name, None) for name in ("reset_parameters",
                                                                              "_reset_parameters"))
                 if callable(method)), None)


def uninitializable(net: torch.nn.Module) -> list[str]:
    """'name (Class)' of each module that holds meta parameters or buffers itself but has no reset_parameters()."""
    return [f"{name or 'the net'} ({type(module).__name__})" for name, module in net.named_modules()
            if on_meta(module) and initializer(module) is None]


def check_initializable(modules: list[str]) -> None:
    if modules:
        raise ValueError(
            f"{', '.join(modules)} hold(s) parameters or buffers but has no reset_parameters(), so a net built on "
            "the meta device (module_construction() of strategy 'fsdp') cannot give them values. Add a "
            "reset_parameters() that sets them, or build the net outside module_construction().")


@contextlib.contextmanager
def on_meta_device() -> Iterator[None]:
    """Build modules on the meta device; tag each with the construction's RNG state, and check at the end that every
    module holding state can be initialized later."""
    rng, built = ConstructionRng(), []

    def tag(module, name, tensor) -> None:
        rng.record()
        if RNG_ATTRIBUTE not in module.__dict__:
            module.__dict__[RNG_ATTRIBUTE] = rng
            built.append(module)

    handles = [register_module_parameter_registration_hook(tag), register_module_buffer_registration_hook(tag)]
    try:
        with torch.device("meta"):
            yield
    finally:
        for handle in handles:
            handle.remove()
    check_initializable([type(module).__name__ for module in built if initializer(module) is None])


def construction_rng(net: torch.nn.Module) -> torch.Tensor:
    """The RNG state the net's construction started from; the current one for a meta net built elsewhere."""
    tagged = (m.__dict__[RNG_ATTRIBUTE] for m in net.modules() if RNG_ATTRIBUTE in m.__dict__)
    return next((rng.state for rng in tagged), torch.get_rng_state())


def post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Children first, in registration order, then the module: the order in which construction initializes them."""
    for child in module.children():
        yield from post_order(child)
    yield module


@contextlib.contextmanager
def keeping_parameters() -> Iterator[None]:
    """Module conversions swap data into each existing Parameter (an optimizer built over it keeps working)."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def initialize(modules: Iterator[torch.nn.Module]) -> list[torch.nn.Module]:
    """Give each module's own meta parameters and buffers CPU memory and their initial values; returns the
    modules."""
    done = []
    with keeping_parameters():
        for module in modules:
            if on_meta(module):
                module.to_empty(device="cpu", recurse=False)
                initializer(module)()
            done.append(module)
    return done


def materialize(net: torch.nn.Module) -> None:
    """A meta net made whole on the CPU, initialized (the global RNG is left as it was)."""
    check_initializable(uninitializable(net))
    with torch.random.fork_rng(devices=[]):
        initialize(post_order(net))


def materialize_sharded(net: torch.nn.Module, units: list[torch.nn.Module], shard: Callable[[torch.nn.Module], None],
                        rng_state: torch.Tensor) -> None:
    """A meta net materialized and sharded one unit at a time (then the rest, and the root): each unit is made whole
    on the CPU, initialized from `rng_state` in construction order, and `shard(unit)` keeps this rank's slice."""
    done: set[int] = set()
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        for unit in units:
            done.update(map(id, initialize(post_order(unit))))
            shard(unit)
        initialize(m for m in post_order(net) if id(m) not in done)
    shard(net)
