"""Propagation: every node's value on fake tensors (shapes, dtypes, storages; no memory)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..errors import TraceError
from ..torch_utils import (FAKE_VALUES_NOTE, REWRITE_HINT, Inputs, data_dependent_construct,
                           own_checkpointing_hint, source_line)
from ..tracker import StorageTracker
from .capture.base import module_path

__all__ = ["FakeRecorder", "autocast_cache_bytes"]


class FakeRecorder(fx.Interpreter):
    """Runs a graph and keeps the value of every node (``values``)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}
        self.extra_traceback = False  # the errors below name the node themselves

    def _describe(self, n: fx.Node) -> str:
        if n.op == "call_module":
            try:
                kind = type(self.module.get_submodule(n.target)).__name__
            except AttributeError:
                kind = "module"
            return f"submodule {n.target!r} ({kind}, one opaque layer)"
        where = module_path(n)
        return f"graph node {n.name} ({n.target}{', in ' + where if where else ''})"

    def run_node(self, n):
        try:
            out = super().run_node(n)
        except Exception as exc:
            construct = data_dependent_construct(exc)
            if construct is not None:
                line = source_line(exc, n.meta.get("stack_trace"))
                error = TraceError(
                    f"ckptopt cannot measure {self._describe(n)}: it runs {construct}"
                    f"{' at ' + line if line else ''}. {FAKE_VALUES_NOTE}. What to do: {REWRITE_HINT}, "
                    f"or {own_checkpointing_hint()}.",
                    node=n.name,
                )
                error.module_path = n.target if n.op == "call_module" else module_path(n)  # (where it runs)
                # (a graph captured without its source lines: the trace runs again to name the line)
                error.line_unrecorded = line is None and n.op == "call_function" and "stack_trace" not in n.meta
                raise error from exc
            raise TraceError(
                f"running node {n.format_node()} on the example inputs failed: {type(exc).__name__}: {exc}. "
                "Check that the example inputs match what the model expects (shapes, dtypes, devices).",
                node=n.name,
            ) from exc
        self.values[n] = out
        return out


def autocast_cache_bytes(fake_gm: fx.GraphModule, fake_inputs: Inputs, fake_mode) -> int:
    """Bytes of the low-precision weight copies autocast caches for the whole step.

    Under ``torch.autocast`` every cast of a parameter is cached until the
    autocast context exits, so the copies are static memory. Measured by
    running the forward once more (fake, no grad) under a storage tracker and
    keeping what survives once its outputs are dropped. 0 without autocast.
    """
    if not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return 0
    # the propagation run has filled the cache already: empty it so every cast is made, and
    # counted, here (a cached cast would be seen only through a view of it, or not at all)
    torch.clear_autocast_cache()
    tracker = StorageTracker(fake=True)
    with fake_mode, torch.no_grad(), tracker:
        out = fake_inputs.call(fake_gm)
        del out
    left = tracker.current_bytes
    tracker.detach()
    return int(left)
