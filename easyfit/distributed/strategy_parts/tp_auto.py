"""plan="auto": the tensor-parallel splits easyfit can prove safe in a plain net, and why the rest stays whole.

What it splits:
- in an nn.Sequential, a Linear, then only elementwise modules (activations, dropout), then a Linear: the first
  column-wise and the second row-wise, so the hidden activations stay split between them;
- an nn.MultiheadAttention (alone or in a TransformerEncoderLayer / DecoderLayer): its heads, and a transformer
  layer's feed-forward pair as above;
- an nn.Embedding by rows (its vocabulary), and an output Linear tied to it column-wise (the same rows);
- any other Linear column-wise with its output gathered (a layer split on its own: same input, same output).
A module is split only where the code around it is known: a parent whose forward easyfit did not write (the user's
module) may read a child's weight itself, so the children of a module whose forward mentions `.weight`, `.bias` or
its parameters stay whole. Sizes that do not divide by the TP size, layers that need their whole weight (an
embedding's padding_idx or max_norm), and every other kind of layer stay whole too, each listed with its reason.
"""
from __future__ import annotations

import inspect

from torch import nn

from easyfit.distributed.strategy_parts.tp_plan import Split, SplitPlan, heads_problem, weight_dims

#: modules that act on each value alone, which may sit between a column-wise and a row-wise Linear
ELEMENTWISE = (nn.Identity, nn.Dropout, nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU,
               nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Mish, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid)
ELEMENTWISE_FUNCTIONS = ("relu", "gelu", "silu", "tanh", "sigmoid")
TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
#: torch's modules whose forward only calls their children (none reads a child's weight while training)
KNOWN = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer,
         *TRANSFORMER_LAYERS)
SPLITTABLE = (nn.Linear, nn.Embedding, nn.MultiheadAttention)
WEIGHT_READS = (".weight", ".bias", "parameters(", "state_dict(", "_parameters")


def reads_weights(module: nn.Module) -> str | None:
    """Why a user's module may read its children's weights in its forward (None: its source shows it does not)."""
    if isinstance(module, KNOWN) or type(module).forward is nn.Module.forward:
        return None
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return f"{type(module).__name__}.forward has no source to read"
    token = next((token for token in WEIGHT_READS if token in source), None)
    return f"{type(module).__name__}.forward reads {token!r} itself" if token else None


def elementwise(activation) -> bool:
    return isinstance(activation, ELEMENTWISE) or getattr(activation, "__name__", None) in ELEMENTWISE_FUNCTIONS


class Planner:
    """One walk over the net, filling a SplitPlan."""

    def __init__(self, net: nn.Module, tp_size: int):
        self.net, self.tp = net, tp_size
        self.plan = SplitPlan(tp_size)
        self.handled: set[str] = set()

    def split(self, path: str, style: str, gather: bool = False) -> None:
        self.plan.splits.append(Split(path, style, gather))
        self.handled.add(path)

    def whole(self, path: str, why: str) -> None:
        self.plan.replicated[path] = why
        self.handled.add(path)

    def visit(self, module: nn.Module, path: str) -> None:
        blocked = reads_weights(module)
        if isinstance(module, nn.Sequential):
            self.pairs(list(module.named_children()), path)
        elif isinstance(module, TRANSFORMER_LAYERS):
            self.transformer_layer(module, path)
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if child_path in self.handled:
                continue
            if blocked and any(True for _ in child.parameters()):
                self.whole(child_path, f"inside {path or 'the net'}, whose {blocked}")
                continue
            if isinstance(child, SPLITTABLE) or not any(True for _ in child.children()):
                self.leaf(child, child_path)
            else:
                self.visit(child, child_path)
        if any(True for _ in module.parameters(recurse=False)) and path not in self.handled and \
                not isinstance(module, SPLITTABLE):
            self.whole(path, f"{type(module).__name__}'s own parameters: no split is known for them")

    def pairs(self, children: list, path: str) -> None:
        """Linear, elementwise modules, Linear in a Sequential: column-wise then row-wise."""
        index = 0
        while index < len(children):
            name, first = children[index]
            after = index + 1
            while after < len(children) and isinstance(children[after][1], ELEMENTWISE):
                after += 1
            if isinstance(first, nn.Linear) and after < len(children) and isinstance(children[after][1], nn.Linear):
                self.pair(f"{path}.{name}" if path else name, first,
                          f"{path}.{children[after][0]}" if path else children[after][0])
                index = after + 1
            else:
                index += 1

    def pair(self, first_path: str, first: nn.Linear, second_path: str) -> None:
        if first.out_features % self.tp:
            return   # each may still be split on its own, as a leaf
        self.split(first_path, "colwise")
        self.split(second_path, "rowwise")

    def transformer_layer(self, layer: nn.Module, path: str) -> None:
        for name in ("self_attn", "multihead_attn"):
            if hasattr(layer, name):
                self.attention(getattr(layer, name), f"{path}.{name}" if path else name)
        activation = layer.activation
        prefix = f"{path}." if path else ""
        if elementwise(activation):
            self.pair(prefix + "linear1", layer.linear1, prefix + "linear2")
        else:
            for name in ("linear1", "linear2"):
                self.whole(prefix + name, f"the activation {activation!r} between them is not known to be "
                                          "elementwise")

    def attention(self, attention: nn.MultiheadAttention, path: str) -> None:
        problem = heads_problem(attention, self.tp)
        self.whole(path, problem) if problem else self.split(path, "heads")
        self.handled.update(f"{path}.{name}" for name, _ in attention.named_modules() if name)

    def leaf(self, module: nn.Module, path: str) -> None:
        if not any(True for _ in module.parameters()):
            return
        if isinstance(module, nn.MultiheadAttention):
            return self.attention(module, path)
        if isinstance(module, nn.Embedding):
            why = next((why for why, bad in (
                (f"its {module.num_embeddings} rows do not divide by {self.tp}", module.num_embeddings % self.tp),
                ("it has a padding_idx, which needs the whole table", module.padding_idx is not None),
                ("it renormalizes rows (max_norm)", module.max_norm is not None),
                ("its gradient is sparse", module.sparse)) if bad), None)
            return self.whole(path, why) if why else self.split(path, "rowwise")
        if isinstance(module, nn.Linear):
            if module.out_features % self.tp:
                return self.whole(path, f"its {module.out_features} outputs do not divide by {self.tp}")
            return self.split(path, "colwise", gather=True)
        self.whole(path, f"no split is known for a {type(module).__name__}")

    def untie(self) -> None:
        """A tied weight split in one holder and not the other (or two ways) stays whole in both."""
        dims = weight_dims(self.net, self.plan)
        for holders in dims.values():
            if len({dim for _, dim in holders}) > 1:
                paths = [path for path, _ in holders]
                for path in paths:
                    self.plan.splits = [split for split in self.plan.splits if split.path != path]
                    self.plan.replicated[path] = f"its weight is tied to {', '.join(p for p in paths if p != path)}"\
                                                 ", which cannot be split the same way"


def auto_plan(net: nn.Module, tp_size: int) -> SplitPlan:
    """The plan "auto" finds for `net` on `tp_size` ranks."""
    planner = Planner(net, tp_size)
    planner.visit(net, "")
    planner.untie()
    return planner.plan
