"""``optimize_checkpoints``: trace, solve, rewrite in one call."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch.nn as nn

from .rewriter import CheckpointedModule, apply_plan
from .simulate import simulate
from .solvers import Plan, _lookup, solve

__all__ = ["optimize_checkpoints", "AUTO_EXACT_MAX_N"]

# dp2 is exact and O(n^2): about a second at n = 15,000 on a 2-core machine
# (benchmarks/RESULTS.md); beyond that "auto" uses the O(n) solver.
AUTO_EXACT_MAX_N = 15_000


def optimize_checkpoints(
    model: nn.Module,
    example_inputs: Any,
    solver: str = "auto",
    budget: int | None = None,
    loss_fn: Callable | None = None,
    leaf_modules: Iterable[str | type] | None = None,
) -> CheckpointedModule:
    """Return ``model`` rewritten to train with the lowest peak memory.

    Parameters
    ----------
    model : nn.Module
        The model, in training mode, on the device it trains on.
    example_inputs : Tensor or tuple
        One batch of positional inputs, at the shapes training will use.
    solver : str
        ``"auto"`` (exact ``dp2`` up to ``AUTO_EXACT_MAX_N`` layers, ``linear``
        beyond) or any name of :data:`ckptopt.SOLVERS`.
    budget : int, optional
        Peak-memory budget in bytes; :class:`ckptopt.InfeasibleBudget` (with
        the smallest achievable peak) when no plan fits.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar`` used for planning (the default,
        ``output.pow(2).mean()``, has an output-sized gradient like most losses).
    leaf_modules : iterable of str or type, optional
        Submodules to trace as opaque layers (see :func:`ckptopt.trace`).

    Returns
    -------
    CheckpointedModule
        Drop-in module sharing ``model``'s parameters and buffers, with
        ``.plan``, ``.predicted_peak_bytes`` and ``.explain()``. When no plan
        beats no checkpointing it runs the model unchanged and says so in
        ``explain()``.

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> fast = optimize_checkpoints(model, torch.randn(32, 64))
    >>> fast(torch.randn(32, 64)).shape
    torch.Size([32, 64])
    """
    from .tracer import trace

    if solver != "auto":
        _lookup(solver)  # fail on a bad name before tracing
    tm = trace(model, example_inputs, loss_fn=loss_fn, leaf_modules=leaf_modules)
    name = solver if solver != "auto" else ("dp2" if tm.n <= AUTO_EXACT_MAX_N else "linear")
    plan = solve(tm.costs, name, budget=budget)
    base = simulate(tm.costs, ())
    if plan.peak_bytes >= base.peak_bytes and plan.checkpoints:
        plan = Plan((), base.peak_bytes, plan.solver, plan.solve_seconds, plan.n)
    return apply_plan(model, tm, plan)
