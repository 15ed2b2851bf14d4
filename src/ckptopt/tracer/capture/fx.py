"""The ``torch.fx`` front end: symbolic tracing with opaque leaves where FX fails.

Every submodule FX cannot trace into (data-dependent control flow, a mask built
from a runtime shape) becomes one opaque leaf automatically, and
``leaf_modules=[...]`` names leaves explicitly. The graph keeps the model's own
calling convention (placeholders are the forward's parameters) and returns what the
model returns; it works at any shape the model's Python code handles.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.fx as fx
import torch.nn as nn

from ...errors import TraceError
from ...torch_utils import Inputs
from .base import Captured
from .blocks import leaf_paths
from .functions import functions_note, opaque_functions

__all__ = ["fx_capture"]


class _Retry(Exception):
    def __init__(self, qualname: str, cause: BaseException):
        self.qualname = qualname
        self.cause = cause


class _LeafTracer(fx.Tracer):
    """An FX tracer that treats the named modules (and types) as leaves and
    reports the innermost submodule whose forward cannot be traced."""

    def __init__(self, leaves: set[str], leaf_types: tuple[type, ...]):
        super().__init__()
        self.leaves = leaves
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaves or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        qualname = self.path_of_module(m)
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except _Retry:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure inside this submodule
            raise _Retry(qualname, exc) from exc


def _construct(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if "control flow" in text or "bool" in text and "Proxy" in text:
        return f"data-dependent control flow ({first})"
    return first


def fx_capture(model: nn.Module, inputs: Inputs, leaf_modules: Iterable[str | type] | None = None,
               dynamic_shapes: bool = True) -> Captured:
    """Trace ``model`` with ``torch.fx`` (``inputs`` are not run here: FX traces symbolically, so its graph
    holds no shapes and ``dynamic_shapes`` changes nothing).

    Raises
    ------
    TraceError
        When the model's own forward cannot be traced (naming the construct), or a
        submodule cannot be traced even as an opaque leaf.
    """
    leaf_paths(model, leaf_modules)  # (a misnamed leaf: the arguments' mistake)
    names = {x for x in (leaf_modules or ()) if isinstance(x, str)}
    types = tuple(x for x in (leaf_modules or ()) if isinstance(x, type))
    known = dict(model.named_modules())
    opaque: dict[str, str] = {}
    last: _Retry | None = None
    for _ in range(len(known) + 1):
        tracer = _LeafTracer(names | set(opaque), types)
        try:
            with opaque_functions():
                graph = tracer.trace(model)
        except _Retry as r:
            last = r
            if r.qualname in opaque or r.qualname == "":
                break
            opaque[r.qualname] = _construct(r.cause)
            continue
        except Exception as exc:  # the model's own forward failed
            raise TraceError(
                f"torch.fx cannot trace the forward of {type(model).__name__} itself: {_construct(exc)}. "
                "Only submodules can be made opaque automatically; move the construct into a submodule, "
                "or pass leaf_modules=[...] naming the submodules (e.g. the blocks of a transformer) "
                "to trace at that granularity.",
                node=type(model).__name__,
            ) from exc
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        note = functions_note(gm)
        return Captured(gm, "fx", opaque, lambda call: _bind(placeholders, call), lambda out: out, dynamic=True,
                        training=model.training, notes=[note] if note else [])
    assert last is not None
    raise TraceError(
        f"torch.fx cannot trace submodule {last.qualname!r} even as an opaque layer: {_construct(last.cause)}. "
        "Pass leaf_modules=[...] naming a coarser submodule to treat as one layer.",
        node=last.qualname,
    )


def _bind(placeholders: list[fx.Node], call: Inputs) -> list[Any] | None:
    """The values of the placeholders for ``model(*args, **kwargs)``: positional arguments,
    then keyword arguments by name, then defaults; None when the call does not fit."""
    args, kwargs = call.args, dict(call.kwargs)
    if len(args) > len(placeholders):
        return None
    vals = list(args)
    for n in placeholders[len(args):]:
        name = n.target.lstrip("*")
        if name in kwargs:
            vals.append(kwargs.pop(name))
        elif n.args:
            vals.append(n.args[0])
        else:
            return None
    return None if kwargs else vals
