"""``optimize_checkpoints``: trace, solve, rewrite in one call."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from .errors import TraceError
from .plan import Plan
from .rewriter import CheckpointedModule, apply_plan
from .simulator import simulate
from .solvers.registry import check_budget, lookup, solve
from .torch_utils import fake_copy, normalize_inputs
from .tracer import trace
from .tracer.capture import check_capture_mode

__all__ = ["optimize_checkpoints"]


def optimize_checkpoints(
    model: nn.Module,
    example_inputs: Any,
    solver: str = "auto",
    budget: int | None = None,
    loss_fn: Callable | None = None,
    leaf_modules: Iterable[str | type] | None = None,
    capture: str = "auto",
    calibrate: bool | None = None,
) -> CheckpointedModule:
    """Return ``model`` rewritten to train with the lowest peak memory.

    Parameters
    ----------
    model : nn.Module
        The model, in training mode, on the device it trains on.
    example_inputs : Tensor, tuple or dict
        One training batch as the model is called: a tensor, a tuple of
        positional arguments, or a dict of keyword arguments (``model(**batch)``,
        what a HuggingFace collator yields), at the shapes training will use.
        The returned module is called the same way.
    solver : str
        ``"auto"`` (:mod:`ckptopt.solvers.policy`): without a budget, the lowest
        peak (exact ``dp2`` up to 15,000 layers, ``linear`` beyond), the least
        recomputation among the plans reaching it; up to about 2,800 layers
        the search also covers plans that leave middle segments unwrapped
        (:attr:`Plan.stored`), which sometimes peak lower or recompute less
        (the plan's solver then reads ``"dp2+stored"``). With a budget,
        ``budget``: the plan with the least recomputation whose peak fits.
        Or any name of :data:`ckptopt.SOLVERS` (those search checkpoint-only
        plans, the paper's plan space).
    budget : int or "device", optional
        Peak-memory budget in bytes; :class:`ckptopt.InfeasibleBudget` (with
        the smallest achievable peak) when no plan fits. ``"device"``: what the
        device has free (CUDA: ``torch.cuda.mem_get_info``; CPU: the system's
        available memory) less the headroom the caching allocator needs
        (:func:`ckptopt.planning.headroom`): the plan with the least recomputation
        that fits ("just make it fit").
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar`` used for planning. Default: the output's
        ``loss`` when it carries one (a HuggingFace model given ``labels``), else
        ``output.pow(2).mean()``, which has an output-sized gradient like most losses.
    leaf_modules : iterable of str or type, optional
        Submodules to trace as opaque layers (see :func:`ckptopt.trace`).
    capture : str, default "auto"
        How the forward becomes a graph: ``"fx"`` (``torch.fx``), ``"export"``
        (``torch.export``, non-strict) or ``"auto"``: FX, and export for models
        whose own forward FX cannot trace (HuggingFace transformers).
    calibrate : bool, optional
        Run each layer once on the device (:mod:`ckptopt.calibration`): library
        workspaces and allocator scratch join the predicted peak, and recomputation
        is priced in measured seconds. Default: on CUDA, off elsewhere.

    Returns
    -------
    CheckpointedModule
        Drop-in module sharing ``model``'s parameters and buffers, with
        ``.plan``, ``.predicted_peak_bytes`` and ``.explain()``; attributes it
        does not have fall through to ``model`` (``.config``, ``.generate``).
        It returns what ``model`` returns (a ``ModelOutput``, a dict, a tuple).
        In eval mode, under ``torch.no_grad()`` and for calls that do not match
        the planned signature, a ``torch.export``-captured model runs its own
        forward. When no plan beats no checkpointing it runs the model unchanged
        and says so in ``explain()``.

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> fast = optimize_checkpoints(model, torch.randn(32, 64))
    >>> fast(torch.randn(32, 64)).shape
    torch.Size([32, 64])
    """
    lookup(solver)  # fail on a bad name before tracing
    check_capture_mode(capture)
    if budget is not None and budget != "device":
        check_budget(budget)  # and on a bad budget
    state = _python_state(model) if isinstance(model, nn.Module) else {}
    try:
        tm = trace(model, example_inputs, loss_fn=loss_fn, leaf_modules=leaf_modules, capture=capture)
        _check_forward_has_no_python_side_effects(model, example_inputs)
    finally:
        _restore_python_state(state)  # FX runs the forward's Python code on the model itself
    device = _device_of(model)
    if calibrate if calibrate is not None else device.type == "cuda":
        from .calibration import calibrate as run_calibration

        cal = run_calibration(model, tm, example_inputs)
        tm = dataclasses.replace(tm, costs=cal.apply(tm.costs), calibration=cal)
    if budget == "device":
        from .planning import device_budget

        budget = device_budget(device, calibrated=tm.calibration is not None)
    plan = solve(tm.costs, solver, budget=budget)
    base = simulate(tm.costs, ())
    if plan.peak_bytes >= base.peak_bytes and plan.checkpoints:
        plan = Plan((), base.peak_bytes, plan.solver, plan.solve_seconds, plan.n)
    return apply_plan(model, tm, plan)


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# --------------------------------------------------------------------------
# forwards with Python side effects (a counter, a list that grows)
# --------------------------------------------------------------------------
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _python_state(model: nn.Module) -> dict:
    """``(module path, attribute) -> (object, copy)`` for every plain-Python attribute of every submodule.

    Numbers, strings and None are kept as they are; lists, dicts and sets as
    shallow copies (restored in place, so the user's object stays the same).
    Tensors, modules and nn.Module's own bookkeeping are left out.
    """
    state = {}
    for path, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if attr in _MODULE_INTERNALS:
                continue
            if value is None or isinstance(value, (bool, int, float, str)):
                state[(path, attr)] = (mod, value)
            elif isinstance(value, (list, dict, set)):
                state[(path, attr)] = (mod, type(value)(value))
    return state


def _restore_python_state(state: dict) -> None:
    for (_, attr), (mod, saved) in state.items():
        current = vars(mod).get(attr)
        if isinstance(saved, (list, dict, set)) and type(current) is type(saved):
            current.clear()
            current.update(saved) if not isinstance(saved, list) else current.extend(saved)
        else:
            setattr(mod, attr, saved)


def _changes(before: dict, after: dict) -> list[str]:
    out = []
    for key, (_, old) in before.items():
        new = after.get(key, (None, "<deleted>"))[1]
        if repr(old) != repr(new):
            path, attr = key
            out.append(f"{path or 'the model'}.{attr}: {old!r} -> {new!r}"[:160])
    return out


def _check_forward_has_no_python_side_effects(model: nn.Module, example_inputs: Any) -> None:
    """Raise when running the forward again changes a plain-Python attribute of a submodule.

    A checkpointed segment runs its forward a second time during backward,
    so a forward that counts calls or appends to a list would do it twice
    per step. The forward runs twice on a fake-tensor copy of the model (no
    memory, the model itself is not touched); a change between the first
    and the second run (not a one-time lazy initialization) is an error.
    """
    fake = fake_copy(model, normalize_inputs(example_inputs))
    copy = fake.model
    try:
        with fake.mode, torch.no_grad():
            fake.inputs.call(copy)
            first = _python_state(copy)
            fake.inputs.call(copy)
    except Exception as exc:
        raise TraceError(
            f"running {type(model).__name__} on the example inputs failed: {type(exc).__name__}: {exc}. "
            "Check that the example inputs match what the model's forward expects (number, shapes, dtypes).",
            node=type(model).__name__,
        ) from exc
    changed = _changes(first, _python_state(copy))
    if changed:
        raise TraceError(
            f"the forward of {type(model).__name__} changes Python state each time it runs "
            f"({'; '.join(changed[:3])}). Checkpointing runs a segment's forward again during backward, "
            "so that change would happen twice per training step. Keep such state out of forward "
            "(count steps in the training loop), or, if running it twice is harmless, rewrite "
            "explicitly with ckptopt.apply_plan(model, ckptopt.trace(model, x), ckptopt.solve(...)).",
            node=changed[0].split(":")[0],
        )
