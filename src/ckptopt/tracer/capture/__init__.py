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
model (the model's attributes restored in between: FX runs its Python code with proxies).
When capture fails, a forward on a fake-tensor copy tells a batch the model itself rejects
(its own error, as a TypeError or ValueError) from a model the front ends cannot follow.
A third front end plugs in by adding a function ``f(model, inputs, leaf_modules) ->
Captured`` to :data:`FRONT_ENDS`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from ...errors import TraceError
from ...torch_utils import (REWRITE_HINT, Inputs, data_dependent_construct, own_checkpointing_hint,
                            python_state, restore_python_state, source_line)
from ...fake import fake_copy, quiet_fake_errors
from .base import Captured, module_path
from .export import export_capture
from .fx import fx_capture

__all__ = ["capture", "Captured", "FRONT_ENDS", "CAPTURE_MODES", "EXPORT_LOGGERS", "module_path", "check_capture_mode"]

#: ``front_end(model, inputs, leaf_modules, dynamic_shapes)``
FRONT_ENDS: dict[str, Callable[[nn.Module, Inputs, Iterable | None, bool], Captured]] = {
    "fx": fx_capture,
    "export": export_capture,
}
CAPTURE_MODES = ("auto",) + tuple(FRONT_ENDS)


def check_capture_mode(how: str) -> str:
    if how not in CAPTURE_MODES:
        raise ValueError(f"capture={how!r} is not a capture mode; use one of {', '.join(CAPTURE_MODES)}")
    return how


def capture(model: nn.Module, inputs: Inputs, how: str = "auto",
            leaf_modules: Iterable[str | type] | None = None, dynamic_shapes: bool = True) -> Captured:
    """The model's forward as a graph, by the front end ``how`` names (``"auto"``: FX, then export).
    ``dynamic_shapes=False``: an exported graph is for the example's shapes only (faster; FX graphs
    are shape-free either way).

    Raises
    ------
    TypeError, ValueError
        When capture fails and the model itself rejects the batch (an unknown keyword, labels of
        another shape): the model's own error, said to be the batch's.
    TraceError
        When the front end fails; with ``"auto"``, when both fail, naming the construct (and its
        source line) and what to do.
    """
    check_capture_mode(how)
    state = python_state(model)  # FX runs the forward's Python code on the model itself, with proxies
    try:
        with _export_notes_hidden():
            return _capture(model, inputs, how, leaf_modules, state, dynamic_shapes)
    except TraceError as exc:
        if exc.node is None:  # a mistake in the arguments (unknown leaf_modules), not the model
            raise
        restore_python_state(state)
        rejected = _batch_rejected(model, inputs)
        if rejected is not None:
            raise rejected from exc
        raise


#: torch's loggers that speak while ckptopt tries its exports (a dimension specialized to the example's
#: size, a data-dependent expression evaluated with real tensors): what capture makes of them reaches the
#: user as a note or an error naming the construct
EXPORT_LOGGERS = ("torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes",
                   "torch._dynamo", "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _export_notes_hidden():
    """Torch's warning-level log lines hidden while capturing, on loggers the user left at their default
    (one set to INFO or DEBUG, as ``TORCH_LOGS`` does, keeps speaking)."""
    import logging

    changed = []
    for name in EXPORT_LOGGERS:
        lg = logging.getLogger(name)
        if lg.level in (logging.NOTSET, logging.WARNING):
            changed.append((lg, lg.level))
            lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in changed:
            lg.setLevel(level)


def _capture(model: nn.Module, inputs: Inputs, how: str, leaf_modules, state, dynamic_shapes: bool = True) -> Captured:
    if how != "auto":
        with _no_partial_graph() if how == "export" else contextlib.nullcontext():
            return FRONT_ENDS[how](model, inputs, leaf_modules, dynamic_shapes)
    try:
        return fx_capture(model, inputs, leaf_modules, dynamic_shapes)
    except TraceError as exc:
        if exc.node is None:  # a mistake in the arguments (unknown leaf_modules), not the model
            raise
        fx_exc = exc
    # (export runs outside the handler: its errors are not chained to FX's, so each names its own construct)
    restore_python_state(state)  # what FX left in the model's attributes (proxies) is gone before export runs
    try:
        with _no_partial_graph():
            captured = export_capture(model, inputs, leaf_modules, dynamic_shapes)
    except TraceError as ex_exc:
        raise TraceError(_both_failed(model, fx_exc, ex_exc), node=fx_exc.node) from ex_exc
    cause = str(fx_exc).split(": ", 1)[-1].split(". ")[0]
    captured.notes.insert(0, f"torch.fx could not trace it: {cause}")
    return captured


def _both_failed(model: nn.Module, fx_exc: TraceError, ex_exc: TraceError) -> str:
    """Why neither front end captures ``model``: the construct (and its line) and what to do."""
    name = type(model).__name__
    fx_why = str(fx_exc).split(". Only submodules can be made opaque")[0].split(" itself: ", 1)[-1]
    fx_why = fx_why.split(". ")[0].rstrip(".") + (")" if fx_why.count("(") > fx_why.split(". ")[0].count(")") else "")
    ex_why = str(ex_exc).split(f"cannot capture {name}: ", 1)[-1]
    construct, by = data_dependent_construct(ex_exc), ex_exc
    if construct is None and not _in_library_wrapper(source_line(fx_exc.__cause__ or fx_exc)):
        construct, by = data_dependent_construct(fx_exc), fx_exc
    if construct is not None:  # (the line of the front end that met the construct)
        line = source_line(by.__cause__ or by) or source_line(ex_exc.__cause__ or ex_exc)
        return (f"ckptopt cannot capture {name}: its forward runs {construct}"
                f"{' at ' + line if line else ''}, which neither front end can follow "
                f"(torch.fx: {fx_why}; torch.export: {ex_why.split(' (unhinted')[0]}). What to do: "
                f"{getattr(ex_exc, 'fix', '') or REWRITE_HINT}, or {own_checkpointing_hint(model)}.")
    line = source_line(ex_exc.__cause__ or ex_exc)
    where = f" (at {line})" if line else ""
    return (f"ckptopt cannot capture {name}. torch.export: {ex_why.rstrip('.')}{where}. torch.fx: {fx_why}. "
            "What to do: make the "
            "forward exportable (tensors and plain Python values in, no data-dependent control flow; "
            "capture='export'), or pass leaf_modules=[...] naming the submodules FX cannot trace (capture='fx'), "
            f"or {own_checkpointing_hint(model)}.")


def _in_library_wrapper(line: str | None) -> bool:
    """Whether FX met its construct in a library's own decorator, not in the model's code: transformers'
    output wrappers (``transformers/utils/generic.py``) iterate what every forward returns, which FX
    cannot, so there the export's error is the one that names the model's line."""
    return bool(line) and "transformers/utils/" in line


@contextmanager
def _no_partial_graph():
    """torch.export prints the whole partial graph to stderr each time it fails (a thousand lines
    for a transformer; export_capture may try twice) before raising; ckptopt reports the failure
    itself, so those prints are dropped. Everything else written to stderr meanwhile is passed on."""
    buf, real = io.StringIO(), sys.stderr
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except BaseException:
        real.write(_without_graph_listings(buf.getvalue()))
        raise
    else:
        real.write(buf.getvalue())


def _without_graph_listings(text: str) -> str:
    """``text`` less the printed graph modules in it (``def forward(self, ...`` or ``class X(torch.nn.Module):``
    and the indented or blank lines after it)."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("def forward(self") or re.match(r"class \w+\(torch\.nn\.Module\):", line):
            skipping = True
        elif skipping and line.strip() and not line[0].isspace():
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out).strip("\n") + ("\n" if "".join(out).strip() else "")


# exceptions that say the fake run could not follow the model, not that the model refused the batch
_FAKE_LIMITS = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
                "UnsupportedFakeTensorException", "GuardOnDataDependentSymNode", "MetadataMismatchError",
                "NotImplementedError")
_FAKE_LIMIT_TEXT = ("FakeTensor", "fake tensor", "data pointer", "data_ptr",
                    "Couldn't swap",  # (_apply on a fake copy's parameter: a module cast inside forward)
                    "tensor subclass")  # (a fake tensor is one: `.numpy()` refuses it, as it refuses export's)


def _fake_limit(exc: BaseException) -> bool:
    chain = [e for e in (exc, exc.__cause__, exc.__context__) if e is not None]
    return (data_dependent_construct(exc) is not None or any(type(e).__name__ in _FAKE_LIMITS for e in chain)
            or any(t in str(e) for e in chain for t in _FAKE_LIMIT_TEXT))


def _batch_rejected(model: nn.Module, inputs: Inputs) -> Exception | None:
    """The error the model itself raises on this batch (the forward's signature refusing a keyword or
    the number of arguments, or a forward on a fake-tensor copy failing), as a TypeError or ValueError
    that says so; None when the model accepts it or the fake run cannot tell."""
    name = type(model).__name__
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        sig = None
    cause: BaseException | None = None
    if sig is not None:
        try:
            sig.bind(*inputs.args, **inputs.kwargs)
        except TypeError as exc:
            cause = exc
    if cause is None:
        try:
            fake = fake_copy(model, inputs)
        except Exception:  # noqa: BLE001 - a model that cannot be copied: the capture error stands
            return None
        try:
            with quiet_fake_errors(), fake.mode, torch.enable_grad():
                fake.inputs.call(fake.model)
            return None
        except Exception as exc:  # noqa: BLE001 - classified below
            if _fake_limit(exc):
                return None
            cause = exc
    text = str(cause).strip().splitlines()[0].rstrip(".") if str(cause).strip() else type(cause).__name__
    kind = TypeError if isinstance(cause, TypeError) else ValueError
    return kind(
        f"{name} rejects the example batch: {type(cause).__name__}: {text} (the batch: {_batch_summary(inputs)}). "
        "ckptopt runs the batch as the model is called in training (model(**batch) for a dict, model(*batch) "
        "for a tuple); fix the batch so that the model itself runs on it (its keys, shapes and dtypes) and "
        "call ckptopt again."
    )


def _batch_summary(inputs: Inputs) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
        return type(v).__name__
    parts = [f"argument {i}: {one(v)}" for i, v in enumerate(inputs.args)]
    parts += [f"{k}: {one(v)}" for k, v in inputs.kwargs.items()]
    return ", ".join(parts)
