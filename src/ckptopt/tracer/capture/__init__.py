"""Capture: the tracer's first stage, the model's forward as a ``torch.fx`` graph.

Two front ends return the same :class:`Captured` (a plain graph, how to bind a
call to it and how to rebuild the model's output), so everything after capture
(propagation, cuts, layer costs, the rewriter) works unchanged on either:

* ``"fx"`` (:mod:`~ckptopt.tracer.capture.fx`): ``torch.fx`` symbolic tracing,
  submodules it cannot trace kept as opaque layers. First choice: module-level
  graphs, the model's own calling convention, any shape.
* ``"export"`` (:mod:`~ckptopt.tracer.capture.export`): ``torch.export`` (non-strict),
  for models whose root forward FX cannot trace (HuggingFace transformers).

``capture="auto"`` tries ``fx`` and falls back to ``export`` when FX cannot trace the
model. A third front end plugs in by adding a function ``f(model, inputs,
leaf_modules) -> Captured`` to :data:`FRONT_ENDS`.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn

from ...errors import TraceError
from ...torch_utils import Inputs
from .base import Captured, module_path
from .export import export_capture
from .fx import fx_capture

__all__ = ["capture", "Captured", "FRONT_ENDS", "CAPTURE_MODES", "module_path", "check_capture_mode"]

FRONT_ENDS: dict[str, Callable[[nn.Module, Inputs, Iterable | None], Captured]] = {
    "fx": fx_capture,
    "export": export_capture,
}
CAPTURE_MODES = ("auto",) + tuple(FRONT_ENDS)


def check_capture_mode(how: str) -> str:
    if how not in CAPTURE_MODES:
        raise ValueError(f"capture={how!r} is not a capture mode; use one of {', '.join(CAPTURE_MODES)}")
    return how


def capture(model: nn.Module, inputs: Inputs, how: str = "auto",
            leaf_modules: Iterable[str | type] | None = None) -> Captured:
    """The model's forward as a graph, by the front end ``how`` names (``"auto"``: FX, then export).

    Raises
    ------
    TraceError
        When the front end fails; with ``"auto"``, when both fail, naming both causes
        and what to try.
    """
    check_capture_mode(how)
    if how != "auto":
        return FRONT_ENDS[how](model, inputs, leaf_modules)
    try:
        return fx_capture(model, inputs, leaf_modules)
    except TraceError as fx_exc:
        if fx_exc.node is None:  # a mistake in the arguments (unknown leaf_modules), not the model
            raise
        try:
            captured = export_capture(model, inputs, leaf_modules)
        except TraceError as ex_exc:
            raise TraceError(
                f"ckptopt cannot capture {type(model).__name__}. torch.fx: {fx_exc} torch.export: {ex_exc}. "
                "Try leaf_modules=[...] naming the submodules FX cannot trace (capture='fx'), or make the "
                "forward exportable (tensors and plain Python values in, no data-dependent control flow; "
                "capture='export').",
                node=fx_exc.node,
            ) from ex_exc
        cause = str(fx_exc).split(": ", 1)[-1].split(". ")[0]
        captured.notes.insert(0, f"torch.fx could not trace it: {cause}")
        return captured
