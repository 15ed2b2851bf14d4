"""The ``torch.export`` front end (non-strict): for models whose root forward FX cannot trace.

HuggingFace transformers are the case in point: keyword batches, ``ModelOutput``
results and a forward full of Python that ``torch.fx`` symbolic tracing refuses.
``torch.export.export(model, args, kwargs=..., strict=False)`` runs the forward on
fake tensors and records every ATen op; ``ep.module()`` keeps the original
``nn.Parameter`` objects under their own names and trains bit-identically to the
model (dropout included). What this module adds:

* **dynamic shapes**: batch and sequence dimensions (the first two of every tensor
  input) are exported as ``Dim.AUTO``, so the graph runs on other batch sizes and
  sequence lengths; when that fails the export is redone at the example's shapes;
* **a plain graph**: the pytree calling convention of ``ep.module()`` is replaced
  by plain placeholders (the flattened inputs, in order) and a flat output, and the
  specs are kept to bind a call (:attr:`Captured.bind`) and rebuild the model's
  output object (:attr:`Captured.rebuild`);
* ``config.use_cache`` is turned off while exporting (a cache is no training output;
  transformers does the same under gradient checkpointing).

Known limits (PyTorch's and peers' trackers): the mode (``train``/``eval``) is baked
in at export time, so the rewritten module runs the original forward in the other
mode; BatchNorm's running statistics would be updated again by a recomputation, so
a graph with a training BatchNorm is refused.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ...errors import TraceError
from ...torch_utils import Inputs
from .base import Captured

__all__ = ["export_capture"]


def export_capture(model: nn.Module, inputs: Inputs, leaf_modules: Iterable[str | type] | None = None) -> Captured:
    """Capture ``model`` called as ``model(*inputs.args, **inputs.kwargs)`` with ``torch.export``.

    Raises
    ------
    TraceError
        When ``torch.export`` fails (the message names the first line of its error), or
        the graph holds a construct checkpointing would change (a training BatchNorm).
    """
    from torch.export import export

    notes: list[str] = []
    if leaf_modules:
        notes.append("leaf_modules applies to torch.fx only; torch.export captures every op")
    with _no_cache(model, notes):
        try:
            ep = export(model, tuple(inputs.args), kwargs=dict(inputs.kwargs), strict=False,
                        dynamic_shapes=_dynamic_shapes(model, inputs))
            dynamic = True
        except Exception as exc:  # noqa: BLE001 - retried at the example's shapes, reported if that fails too
            first = _first_line(exc)
            try:
                ep = export(model, tuple(inputs.args), kwargs=dict(inputs.kwargs), strict=False)
            except Exception as exc2:
                raise TraceError(f"torch.export cannot capture {type(model).__name__}: {_first_line(exc2)}",
                                 node=type(model).__name__) from exc2
            dynamic = False
            notes.append(f"exported at the example's shapes only (dynamic shapes failed: {first}); "
                         "other shapes run the original forward")
    gm = ep.module(check_guards=False)
    in_spec, out_spec = gm._in_spec, gm._out_spec
    gm.graph._codegen = fx.graph.CodeGen()  # plain placeholders and a flat output; the specs are kept
    gm.recompile()
    _refuse_batch_norm(gm, model)
    example = pytree.tree_flatten((tuple(inputs.args), dict(inputs.kwargs)))[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example):
        raise TraceError(f"torch.export gave {len(placeholders)} graph inputs for {len(example)} call values; "
                         "pass the batch as tensors (and plain Python values)", node=type(model).__name__)

    def bind(call: Inputs) -> list | None:
        if len(call.args) != len(inputs.args) or set(call.kwargs) != set(inputs.kwargs):
            return None
        ordered = (tuple(call.args), {k: call.kwargs[k] for k in inputs.kwargs})
        flat, spec = pytree.tree_flatten(ordered)
        if spec != in_spec or len(flat) != len(example):
            return None
        for got, want in zip(flat, example):
            if isinstance(want, torch.Tensor):
                if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.dim() != want.dim():
                    return None
                if not dynamic and got.shape != want.shape:
                    return None
            elif got is not want and got != want:
                return None  # a non-tensor argument is baked into the graph
        return flat

    return Captured(gm, "export", {}, bind, lambda out: pytree.tree_unflatten(list(out), out_spec),
                    dynamic=dynamic, training=model.training, notes=notes)


def _dynamic_shapes(model: nn.Module, inputs: Inputs) -> dict[str, Any]:
    """``Dim.AUTO`` for the first two dimensions (batch, sequence) of every tensor argument."""
    from torch.export import Dim

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: Dim.AUTO for d in range(min(value.dim(), 2))}
        return None

    bound = inspect.signature(model.forward).bind(*inputs.args, **inputs.kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = inspect.signature(model.forward).parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: pytree.tree_map(spec, v) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(pytree.tree_map(spec, v) for v in value)
        else:
            out[name] = pytree.tree_map(spec, value)
    return out


@contextmanager
def _no_cache(model: nn.Module, notes: list[str]):
    """``config.use_cache = False`` while exporting: a key/value cache is no training output."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    notes.append("captured with config.use_cache=False (no key/value cache while training, as transformers "
                 "does under gradient checkpointing)")
    try:
        yield
    finally:
        config.use_cache = True


def _refuse_batch_norm(gm: fx.GraphModule, model: nn.Module) -> None:
    if not model.training:
        return
    for n in gm.graph.nodes:
        if n.op == "call_function" and "batch_norm" in str(n.target):
            raise TraceError(
                f"{type(model).__name__} runs a BatchNorm in training mode ({n.target}) and was captured with "
                "torch.export: a recomputed segment would update its running statistics a second time. "
                "Pass capture='fx' (with leaf_modules=[...] for the submodules FX cannot trace) to keep "
                "ckptopt's BatchNorm protection.",
                node=n.name,
            )


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
