"""What a layer's measurement depends on, as a key: repeated layers are measured once.

A layer's figures (:func:`ckptopt.tracer.layer_costs.measure_layer`) and FLOPs depend on what it runs and
on the tensors it runs on, never on their names or values (fake tensors have none): the ops in order,
each op's target and arguments, with graph nodes given by position; each tensor's shape, strides,
offset, dtype, device, whether it needs a gradient and is a leaf, and which storage it shares with the
layer's other tensors (parameters, buffers, inputs: storages are what the tracker counts); the
module's training mode; and how the layer sits in the chain (the context keywords: flags, layouts,
side inputs' ranks, of which only the order counts). Two layers with equal keys measure alike, so a model's repeated blocks (an LLM's
decoder layers, a ViT's blocks) are measured once and the other copies take the figures. Anything the
key cannot describe makes it None, and that layer is measured.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..storages import storage_identity, storage_nbytes

__all__ = ["layer_key"]


class _Unkeyable(Exception):
    """A value the key cannot describe by structure."""


class _Keyer:
    def __init__(self):
        self.storages: dict[int, int] = {}  # storage identity -> order of first sight

    def tensor(self, t: torch.Tensor) -> tuple:
        try:
            alias = self.storages.setdefault(storage_identity(t), len(self.storages))
        except (RuntimeError, NotImplementedError) as exc:  # (no storage: a wrapper subclass)
            raise _Unkeyable(type(t).__name__) from exc
        return ("T", type(t).__name__, tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype),
                str(t.device), bool(t.requires_grad), bool(t.is_leaf), alias, storage_nbytes(t))

    def value(self, v: Any, pos: dict | None = None) -> Any:
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, fx.Node):
            if pos is None or v not in pos:
                raise _Unkeyable(v.name)
            return ("%", pos[v])
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(self.value(x, pos) for x in v))
        if isinstance(v, dict):
            return ("dict", tuple((k, self.value(x, pos)) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))))
        if v is None or isinstance(v, (bool, int, float, str, complex, slice, type(Ellipsis))):
            return (type(v).__name__, repr(v))
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(v).__name__, str(v))
        if isinstance(v, torch.Size):
            return ("Size", tuple(v))
        raise _Unkeyable(type(v).__name__)

    def module(self, sub: nn.Module) -> tuple:
        return (type(sub).__qualname__, sub.extra_repr(), sub.training,
                tuple((name, self.tensor(p)) for name, p in sub.named_parameters()),
                tuple((name, self.tensor(b)) for name, b in sub.named_buffers()))

    def graph(self, graph: fx.Graph, gm: nn.Module) -> tuple:
        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        out = []
        for n in nodes:
            if n.op == "get_attr":
                target = self.value(_attr(gm, n.target))
            elif n.op == "call_module":
                target = self.module(gm.get_submodule(n.target))
            elif n.op in ("call_function", "call_method"):
                target = _callable_name(n.target)
            else:  # placeholder, output
                target = n.op
            out.append((n.op, target, self.value(n.args, pos), self.value(n.kwargs, pos)))
        return tuple(out)


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _callable_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module is None or name is None or "<lambda>" in name or "<locals>" in name:
        raise _Unkeyable(repr(target))  # (a closure may differ between layers that look alike)
    return f"{module}.{name}"


def layer_key(module: nn.Module, example_input: torch.Tensor | None, context: dict,
              graph: fx.Graph | None = None) -> tuple | None:
    """The key of one layer's measurement (module docstring), or None where something in it cannot be
    described by structure (then the layer is measured, never shared). ``graph``: the layer's graph, read
    from ``module`` (the model's graph module: the key of the GraphModule ``fx.GraphModule(module, graph)``
    would be, without making it); else ``module`` is the layer's GraphModule."""
    if graph is None:
        if not isinstance(module, fx.GraphModule):  # (the last layer with the loss: measured each time)
            return None
        graph = module.graph
    k = _Keyer()
    try:
        body = k.graph(graph, module)  # (the parameters and buffers it reads come first in the storage order)
        context = dict(context)
        if context.get("side_rank"):  # only the order it gives matters (ties broken by position)
            rank = list(context["side_rank"])
            order = sorted(range(len(rank)), key=lambda i: (rank[i], i))
            context["side_rank"] = tuple(order.index(i) for i in range(len(rank)))
        ctx = tuple((name, k.value(v)) for name, v in sorted(context.items()))
        return (body, module.training, k.value(example_input), ctx)
    except _Unkeyable:
        return None
