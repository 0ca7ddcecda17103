"""A tensor-parallel plan: which modules of a net are split across the TP ranks, and how; what stays whole.

A plan comes from the user as a dict `{"module.path": "colwise" | "rowwise" | "sequence" | "heads" | ParallelStyle}`
(glob patterns allowed), or from the auto planner (tp_auto). Everything here is pure: it needs the net and the TP
size, no process group, so a bad plan is refused before any rank starts.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from easyfit.utils.checks import closest_name

#: the styles a plan names, and the modules each fits
STYLES = {"colwise": (nn.Linear, nn.Embedding), "rowwise": (nn.Linear, nn.Embedding),
          "sequence": (nn.LayerNorm, nn.RMSNorm, nn.Dropout),
          "heads": (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)}


@dataclass(frozen=True)
class Split:
    """One module split across the TP ranks.

    style: "colwise" (output features), "rowwise" (input features; an embedding's vocabulary), "sequence" (the
    activations along the sequence), "heads" (an attention layer's heads), or "custom" (the user's ParallelStyle).
    gather: a colwise layer whose output is gathered whole (a layer split on its own, not the first of a pair).
    """
    path: str
    style: str
    gather: bool = False
    custom: object = None

    def words(self) -> str:
        return "custom " + type(self.custom).__name__ if self.custom is not None else \
            self.style + (" (output gathered)" if self.gather else "")


@dataclass
class SplitPlan:
    """The splits, and each module with parameters left whole on every rank with the reason."""
    tp_size: int
    splits: list[Split] = field(default_factory=list)
    replicated: dict[str, str] = field(default_factory=dict)

    def describe(self, net: nn.Module | None = None) -> str:
        """The plan as lines: each split module (with its layer), then what stays replicated and why."""
        modules = dict(net.named_modules()) if net is not None else {}
        width = max([len(s.path) for s in self.splits] + [len(p) for p in self.replicated] + [4])
        lines = [f"tensor-parallel plan over {self.tp_size} ranks:"]
        lines += [f"  {s.path or '(net)':{width}s}  {s.words():26s} {layer_words(modules.get(s.path))}"
                  for s in self.splits]
        lines += [f"  {path or '(net)':{width}s}  {'replicated':26s} {why}" for path, why in self.replicated.items()]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line for fit's summary line."""
        parts = [f"{len(self.splits)} layers split"]
        if self.replicated:
            parts.append(f"{len(self.replicated)} replicated ({', '.join(self.replicated)})")
        return f"tensor-parallel plan: {'; '.join(parts)}"


def layer_words(module: nn.Module | None) -> str:
    if isinstance(module, nn.Linear):
        return f"Linear({module.in_features}→{module.out_features})"
    if isinstance(module, nn.Embedding):
        return f"Embedding({module.num_embeddings}, {module.embedding_dim})"
    if isinstance(module, nn.MultiheadAttention):
        return f"MultiheadAttention({module.embed_dim}, heads={module.num_heads})"
    return type(module).__name__ if module is not None else ""


def attention_layers(module: nn.Module) -> list[tuple[str, nn.MultiheadAttention]]:
    """(name, layer) of the attention inside a module a "heads" split names (itself, or a transformer layer's)."""
    if isinstance(module, nn.MultiheadAttention):
        return [("", module)]
    return [(name, getattr(module, name)) for name in ("self_attn", "multihead_attn") if hasattr(module, name)]


def heads_problem(attention: nn.MultiheadAttention, tp_size: int) -> str | None:
    """Why an attention layer's heads cannot be split across `tp_size` ranks; None: they can."""
    if attention.num_heads % tp_size:
        return f"its {attention.num_heads} heads do not divide by the tensor-parallel size {tp_size}"
    if not attention._qkv_same_embed_dim:
        return "its keys and values have their own sizes (kdim / vdim)"
    if attention.bias_k is not None or attention.add_zero_attn:
        return "it adds bias_kv or zero attention"
    return None


def check_heads(path: str, module: nn.Module, tp_size: int) -> None:
    for name, attention in attention_layers(module):
        problem = heads_problem(attention, tp_size)
        if problem:
            where = ".".join(part for part in (path, name) if part)
            raise ValueError(f"the plan splits the heads of {where!r} ({layer_words(attention)}), but {problem}: "
                             f"use a tensor_parallel_size that divides {attention.num_heads}, or leave the layer "
                             "out of the plan")


#: the size each style splits, by module kind: (attribute, what it counts)
SPLIT_SIZES = {("colwise", nn.Linear): ("out_features", "output features"),
               ("rowwise", nn.Linear): ("in_features", "input features"),
               ("colwise", nn.Embedding): ("embedding_dim", "embedding dimensions"),
               ("rowwise", nn.Embedding): ("num_embeddings", "rows")}


def check_divides(path: str, module: nn.Module, style: str, tp_size: int) -> None:
    """Refuses a split whose size does not divide by the tensor-parallel size (DTensor fails on it mid-fit)."""
    for (named_style, kind), (attribute, counted) in SPLIT_SIZES.items():
        size = getattr(module, attribute, None)
        if named_style == style and isinstance(module, kind) and size % tp_size:
            raise ValueError(f"the tensor-parallel plan splits {path!r} {style}, but its {size} {counted} do not "
                             f"divide by the tensor-parallel size {tp_size}: leave it out of the plan (it stays "
                             f"whole on every rank), or use a tensor_parallel_size that divides {size}")


def parse_plan(net: nn.Module, plan: dict, tp_size: int) -> SplitPlan:
    """A user's dict plan, its patterns matched against the net's module names, each style checked against the
    module it names."""
    from torch.distributed.tensor.parallel import ParallelStyle
    modules = dict(net.named_modules())
    splits: dict[str, Split] = {}
    for pattern, style in plan.items():
        matched = [path for path in modules if path and fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            names = [path for path in modules if path]
            raise ValueError(f"the tensor-parallel plan names {pattern!r}, which is no module of the net."
                             f"{closest_name(pattern, names)} Its modules: {', '.join(names[:20])}"
                             f"{', ...' if len(names) > 20 else ''}")
        for path in matched:
            if isinstance(style, ParallelStyle):
                splits[path] = Split(path, "custom", custom=style)
                continue
            if style not in STYLES:
                raise ValueError(f"the tensor-parallel plan gives {path!r} the style {style!r}; a style is one of "
                                 f"{', '.join(map(repr, STYLES))} or a torch ParallelStyle")
            if not isinstance(modules[path], STYLES[style]):
                fits = ", ".join(kind.__name__ for kind in STYLES[style])
                raise ValueError(f"the tensor-parallel plan splits {path!r} {style}, but it is a "
                                 f"{type(modules[path]).__name__}: {style!r} fits {fits} only")
            if style == "heads":
                check_heads(path, modules[path], tp_size)
            check_divides(path, modules[path], style, tp_size)
            splits[path] = Split(path, style)
    result = SplitPlan(tp_size, gather_lone_columns([splits[path] for path in modules if path in splits], modules))
    check_ties(net, result)
    return result


def gather_lone_columns(splits: list[Split], modules: dict[str, nn.Module]) -> list[Split]:
    """`splits` in module order, each column-wise Linear that no row-wise Linear follows (the net's output layer, a
    layer split on its own) with its output gathered whole."""
    def lone(index: int, split: Split) -> bool:
        after = splits[index + 1] if index + 1 < len(splits) else None
        return split.style == "colwise" and isinstance(modules[split.path], nn.Linear) and not (
            after is not None and after.style == "rowwise" and isinstance(modules[after.path], nn.Linear))
    return [Split(split.path, split.style, gather=True) if lone(index, split) else split
            for index, split in enumerate(splits)]


def check_sequence_parallel(net: nn.Module, plan: SplitPlan, sequence_parallel: bool) -> None:
    """Under sequence parallelism the activations between the splits hold each rank's part of the sequence, so every
    module with parameters must be in the plan (a norm as "sequence") and attention must take (batch, sequence, ...)
    inputs; "sequence" splits without it would take a whole sequence for a part."""
    styles = {split.path: split.style for split in plan.splits}
    if not sequence_parallel:
        named = [path for path, style in styles.items() if style == "sequence"]
        if named:
            raise ValueError(f"the tensor-parallel plan splits {', '.join(map(repr, named))} along the sequence, "
                             "which needs sequence_parallel=True (the layers around it then pass activations split "
                             "along the sequence)")
        return
    if "sequence" not in styles.values():
        raise ValueError("sequence_parallel=True, but the plan splits nothing along the sequence: give the norms "
                         "between the split layers the style 'sequence'")
    for path, module in net.named_modules():
        inside = any(path == done or path.startswith(done + ".") for done in styles)
        if not inside and any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"sequence_parallel=True: {path!r} ({type(module).__name__}) has parameters but is not "
                             "in the plan, so each rank would train it on its part of the sequence alone; give it a "
                             "style ('sequence' for a norm), or use sequence_parallel=False")
        for name, attention in attention_layers(module) if path in styles else ():
            if not attention.batch_first:
                where = ".".join(part for part in (path, name) if part)
                raise ValueError(f"sequence_parallel=True splits activations along dim 1 (batch, sequence, "
                                 f"features), but {where!r} has batch_first=False: build it with batch_first=True")


#: the dimension of a weight each split shards (None: kept whole)
WEIGHT_DIM = {("colwise", nn.Linear): 0, ("rowwise", nn.Linear): 1, ("colwise", nn.Embedding): 1,
              ("rowwise", nn.Embedding): 0}


def weight_dims(net: nn.Module, plan: SplitPlan) -> dict[int, tuple[str, int | None]]:
    """id(weight) -> (path, the dimension the plan shards it along), for the weights of Linear and Embedding
    layers, split or not."""
    splits = {split.path: split.style for split in plan.splits}
    dims = {}
    for path, module in net.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            dim = WEIGHT_DIM.get((splits.get(path), type(module)))
            dims.setdefault(id(module.weight), []).append((path, dim))
    return dims


def check_ties(net: nn.Module, plan: SplitPlan) -> None:
    """A weight shared by two layers (a tied embedding and output layer) must be split the same way in both."""
    for holders in weight_dims(net, plan).values():
        if len({dim for _, dim in holders}) > 1:
            described = ", ".join(f"{path!r} {'whole' if dim is None else f'along dim {dim}'}"
                                  for path, dim in holders)
            raise ValueError(f"the tensor-parallel plan splits one shared (tied) weight two ways: {described}; "
                             "split a tied embedding 'rowwise' (by vocabulary) and its output layer 'colwise'")


def tied_groups(net: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each parameter two or more modules hold (tied weights): the (module, attribute) pairs, in module order."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in net.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Tie each group again after sharding replaced its parameters: every holder takes the first's."""
    for (first, name), *others in groups:
        shared = getattr(first, name)
        for module, attribute in others:
            setattr(module, attribute, shared)
