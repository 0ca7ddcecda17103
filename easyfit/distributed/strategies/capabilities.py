"""What a backend can do and what the connector and the loop must know about it, declared once per strategy class as
one frozen `Capabilities` (`capabilities = Capabilities(...)`), read as `strategy.capabilities.<name>` or, for short,
`strategy.<name>`. A value that depends on the strategy's options is set in its `__init__`:
`self.capabilities = replace(self.capabilities, ...)`.

A strategy written to the earlier contract, a loose class attribute per flag (`handles_clipping = True`), keeps
working: `Strategy.__init_subclass__` folds such attributes into the class's declaration. A flag written as a
property is refused with an error saying where the value goes now.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Capabilities:
    """One strategy class's flags (the defaults are the base, single-process contract's)."""

    #: its launcher always creates new local processes (spawn, fork), so it cannot join ranks a launcher started
    starts_processes: bool = False
    #: under torchrun / SLURM / ..., devices="auto" means one device per process the launcher started
    uses_launcher_processes: bool = True
    #: the backend accumulates gradients itself: the loop calls `backward` on the undivided loss and `optimizer_step`
    #: after every batch, and the backend decides when the optimizer really steps
    handles_accumulation: bool = False
    #: the backend clips gradients itself (its `setup` configures it from the fit's settings): the loop never calls
    #: `clip_gradients`
    handles_clipping: bool = False
    #: fit / evaluate / predict accept compile=...: the backend's step is plain PyTorch that torch.compile traces.
    #: False: such a call raises a clear error
    supports_compile: bool = False
    #: `optimizer_step` is the plain `optimizer.step()` (through the precision plugin), which compile= may compile;
    #: None: True unless the class defines its own `optimizer_step`
    plain_optimizer_step: bool | None = None
    #: the net's forward can take the targets (loss="model" passes them as labels=); False where the backend runs the
    #: net as a chain of one-input stages (a pipeline)
    forward_takes_targets: bool = True
    #: the loop adds each step's loss to the epoch's sum in the step itself, rather than keeping the losses and summing
    #: them when read: on XLA, summing a varying number of losses would compile a graph for each number read
    sums_losses_per_step: bool = False
    #: a loss over counted items (tokens) trains each step on the mean over the step's items across micro-batches and
    #: ranks (easyfit.training.item_windows); False where the backend combines its micro-batches' losses itself
    counts_items: bool = True
    #: the kind of net built sharded (construction.META, construction.ZERO3) that `setup` trains; None: none
    trains_built_sharded: str | None = None
    #: the running fit's net holds parameter shards, so its forward is a collective (False: whole parameters)
    shards_parameters: bool = False


NAMES = tuple(entry.name for entry in fields(Capabilities))
