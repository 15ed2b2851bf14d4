"""Solvers: one registry, one entry point.

Every solver is a pure function of a :class:`~ckptopt.ChainCosts` returning a
plan (segment-start layers); :func:`solve` times it, scores the plan with
:func:`~ckptopt.simulate` and wraps both in a :class:`Plan`. No module here
imports torch.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

from .. import _kernels
from ..costs import ChainCosts
from ..errors import InfeasibleBudget, InvalidCosts, UnknownSolver
from ..simulate import normalize_plan, simulate
from . import baselines, exact
from .linear import linear
from .recompute import TIE_BREAK_MAX_WORK, FrontTooLarge, least_recompute, pareto_front, plan_recompute

__all__ = ["Plan", "SolverInfo", "SOLVERS", "solve", "solver_names", "pareto_front"]


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan and its simulated peak.

    Attributes
    ----------
    checkpoints : tuple of int
        Layers that start a new segment (layer 0 always starts the first).
    peak_bytes : int
        The plan's peak from :func:`~ckptopt.simulate` (static bytes included).
    solver : str
        The registry name that produced it (``"uniform:4"`` keeps its argument).
    solve_seconds : float
        Wall time of the solver alone (compilation excluded, simulation excluded).
    n : int
        Number of layers of the cost model it was made for.
    stored : tuple of int
        Start layers of segments (other than the last) left unwrapped: they
        keep what they save and re-run nothing. Only the ``budget`` solver
        uses them; empty otherwise.
    """

    checkpoints: tuple[int, ...]
    peak_bytes: int
    solver: str
    solve_seconds: float
    n: int
    stored: tuple[int, ...] = ()

    @property
    def wrapped(self) -> tuple[bool, ...]:
        """Per segment: run under ``torch.utils.checkpoint`` (re-run in backward)."""
        kept = set(self.stored)
        last = len(self.checkpoints)
        return tuple(k < last and s not in kept for k, s in enumerate((0,) + self.checkpoints))

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """Inclusive ``(first, last)`` layer pairs of every segment."""
        starts = (0,) + self.checkpoints
        ends = tuple(s - 1 for s in self.checkpoints) + (self.n - 1,)
        return tuple(zip(starts, ends))


@dataclass(frozen=True)
class SolverInfo:
    """A registry entry. ``fn(costs, arg)`` returns ``(checkpoints, optimum or None)``."""

    name: str
    fn: Callable[[ChainCosts, str | None], tuple[tuple[int, ...], int | None]]
    exact: str  # "full": exact for both forms; "additive": exact for the additive form only; "": a heuristic
    description: str
    takes_arg: bool = False


def _baseline(f: Callable[[ChainCosts], tuple[int, ...]]):
    return lambda costs, arg: (f(costs), None)


SOLVERS: Mapping[str, SolverInfo] = {
    info.name: info
    for info in (
        SolverInfo("brute", lambda c, a: exact.brute(c), "full", "every plan; the test oracle (n <= 20)"),
        SolverInfo("dp", lambda c, a: exact.dp(c), "full", "the paper's O(n^3) dynamic program"),
        SolverInfo("dp2", lambda c, a: exact.dp2(c), "full", "exact O(n^2) dynamic program"),
        SolverInfo("linear", lambda c, a: linear(c), "additive", "O(n); exact for the additive form"),
        SolverInfo(
            "budget",
            lambda c, a: _budget_unreachable(),
            "full",
            "least recomputation with peak <= budget (needs budget=); exact",
        ),
        SolverInfo("none", _baseline(baselines.none), "", "no checkpointing"),
        SolverInfo("every", _baseline(baselines.every), "", "checkpoint every layer"),
        SolverInfo("sqrt", _baseline(baselines.sqrt), "", "Chen's sqrt(n) segments, uniform by layer count"),
        SolverInfo("chen-greedy", _baseline(baselines.chen_greedy), "", "Chen et al. 2016 Algorithm 3 with its budget sweep"),
        SolverInfo(
            "uniform",
            lambda c, a: (baselines.uniform(c, baselines.parse_uniform_arg(a)), None),
            "",
            "uniform:K -- K segments of equal layer count (checkpoint_sequential)",
            takes_arg=True,
        ),
    )
}


def _budget_unreachable():
    raise ValueError("solver 'budget' needs a memory budget: solve(costs, 'budget', budget=BYTES)")


def solver_names() -> list[str]:
    """Names accepted by :func:`solve` (``uniform`` is written ``uniform:K``)."""
    return [n + ":K" if SOLVERS[n].takes_arg else n for n in SOLVERS]


def _lookup(solver: str) -> tuple[SolverInfo, str | None]:
    if not isinstance(solver, str):
        raise UnknownSolver(f"solver must be a name (str), got {type(solver).__name__}; valid: {', '.join(solver_names())}")
    name, _, arg = solver.partition(":")
    info = SOLVERS.get(name)
    if info is None:
        raise UnknownSolver(f"unknown solver {solver!r}; valid solvers: {', '.join(solver_names())}")
    if arg and not info.takes_arg:
        raise UnknownSolver(f"solver {name!r} takes no argument (got {solver!r})")
    if info.takes_arg and not arg:
        baselines.parse_uniform_arg(None)
    return info, (arg or None)


def _check_budget(budget) -> int:
    is_number = isinstance(budget, (int, float)) or hasattr(budget, "__index__")  # numpy integers too
    if isinstance(budget, bool) or not is_number:
        raise ValueError(
            f"budget must be a number of bytes, got {budget!r}; for a size like '8GiB' use "
            "ckptopt.units.parse_bytes('8GiB')"
        )
    b = float(budget)
    if math.isnan(b):
        raise ValueError("budget is NaN; give the memory limit in bytes (e.g. 8 * 2**30)")
    if b <= 0:
        raise ValueError(f"budget must be positive bytes, got {budget!r}")
    if math.isinf(b):
        raise ValueError("budget is infinite; pass budget=None for no limit")
    return int(b)


_warm = False


def _ensure_compiled() -> None:
    global _warm
    if not _warm:
        _kernels.warmup()
        _warm = True


def _run(costs: ChainCosts, info: SolverInfo, arg: str | None, label: str) -> Plan:
    _ensure_compiled()
    t0 = time.perf_counter()
    checkpoints, optimum = info.fn(costs, arg)
    seconds = time.perf_counter() - t0
    checkpoints = normalize_plan(costs, checkpoints)
    peak = simulate(costs, checkpoints).peak_bytes
    if optimum is not None and optimum != peak:
        raise RuntimeError(
            f"internal error: solver {label!r} reports an optimum of {optimum} bytes but the simulator "
            f"scores its plan at {peak}; please report this with the cost model (ChainCosts.to_json)"
        )
    return Plan(checkpoints, peak, label, seconds, costs.n)


def solve(costs: ChainCosts, solver: str = "linear", budget: int | None = None) -> Plan:
    """Choose checkpoints for a cost model.

    Parameters
    ----------
    costs : ChainCosts
    solver : str
        A name from :data:`SOLVERS`: ``brute``, ``dp``, ``dp2``, ``linear``,
        ``budget``, ``none``, ``every``, ``sqrt``, ``chen-greedy`` or
        ``uniform:K``. The exact solvers (``brute``, ``dp``, ``dp2``) return,
        among the lowest-peak plans, one with the least recomputation
        (:attr:`ChainCosts.c`); ``linear`` does so for the additive form.
        ``budget`` returns the plan with the least recomputation whose peak
        is at most ``budget`` (exact; it needs ``budget``).
    budget : int, optional
        Peak-memory budget in bytes. For ``budget``, the limit it plans
        within. For the other solvers: if the solver's plan exceeds it, the
        exact optimum is computed; if that fits, it is returned (with a
        warning naming the solver that did not fit). Either way
        :class:`~ckptopt.InfeasibleBudget` is raised with the smallest
        achievable peak when no plan fits.

    Returns
    -------
    Plan

    Raises
    ------
    UnknownSolver, InfeasibleBudget, ProblemTooLarge, ValueError

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 5, 5], h=[10, 10, 10], q=[1, 1, 1])
    >>> p = solve(c, "dp2")
    >>> p.checkpoints, p.peak_bytes
    ((1, 2), 11)
    """
    if not isinstance(costs, ChainCosts):
        raise InvalidCosts(
            f"solve() needs a ChainCosts, got {type(costs).__name__}; build one with ChainCosts(...), "
            "ChainCosts.additive(...) or ChainCosts.from_json(path)"
        )
    info, arg = _lookup(solver)
    limit = None if budget is None else _check_budget(budget)
    if info.name == "budget":
        if limit is None:
            _budget_unreachable()
        return _least_recompute_within(costs, limit)
    plan = _run(costs, info, arg, solver)
    if limit is None or plan.peak_bytes <= limit:
        return plan
    best = plan
    if info.exact != "full" and not (info.exact == "additive" and costs.is_additive):
        exact_name = "linear" if costs.is_additive else "dp2"
        best = _run(costs, SOLVERS[exact_name], None, exact_name)
    if best.peak_bytes > limit:
        raise InfeasibleBudget(limit, best.peak_bytes)
    warnings.warn(
        f"solver {solver!r} gave a plan peaking at {plan.peak_bytes} bytes, over the budget of {limit}; "
        f"returning the exact optimum from {best.solver!r} ({best.peak_bytes} bytes) instead",
        stacklevel=2,
    )
    return best


def _least_recompute_within(costs: ChainCosts, limit: int) -> Plan:
    """The ``budget`` solver: least recomputation among plans peaking at most ``limit``."""
    _ensure_compiled()
    t0 = time.perf_counter()
    found = least_recompute(costs, limit)
    seconds = time.perf_counter() - t0
    if found is None:
        lowest = pareto_front(costs, None)[0][0] if costs.n <= 2000 else _run(costs, SOLVERS["dp2"], None, "dp2").peak_bytes
        raise InfeasibleBudget(limit, lowest)
    checkpoints, stored = found
    peak = simulate(costs, checkpoints, stored).peak_bytes
    if peak > limit:
        raise RuntimeError(
            f"internal error: solver 'budget' chose a plan peaking at {peak} bytes over the budget of {limit}; "
            "please report this with the cost model (ChainCosts.to_json)"
        )
    return Plan(checkpoints, peak, "budget", seconds, costs.n, stored)


def improve_with_stored(costs: ChainCosts, plan: Plan) -> Plan:
    """``plan`` (an optimum of the checkpoint-only plans), or a better plan that leaves middle
    segments unwrapped ("stored", :attr:`Plan.stored`).

    Over plans with stored segments the lowest peak can be lower (rotor's forward-all step;
    1.8% on the MLP of ``benchmarks/budget_curve.py``) and, at the same peak, the recomputation
    smaller. The Pareto program capped at ``plan``'s peak finds the lowest (peak, recomputation)
    there; its plan is returned when strictly better, ``plan`` otherwise. The pass is bounded
    like ``dp2``'s tie-break (``TIE_BREAK_MAX_WORK``) and skipped for the additive form, which
    does not say what a layer keeps.
    """
    if costs.is_additive or costs.n * costs.n > 4 * TIE_BREAK_MAX_WORK:
        return plan
    _ensure_compiled()
    t0 = time.perf_counter()
    try:
        front = pareto_front(costs, plan.peak_bytes, allow_stored=True, max_work=TIE_BREAK_MAX_WORK)
    except FrontTooLarge:
        return plan
    seconds = time.perf_counter() - t0
    if not front:  # cannot happen: plan itself is within the cap
        return plan
    peak, rec, checkpoints, stored = front[0]
    if (peak, rec) >= (plan.peak_bytes, plan_recompute(costs, plan.checkpoints, plan.stored)):
        return plan
    if simulate(costs, checkpoints, stored).peak_bytes != peak:
        raise RuntimeError(
            f"internal error: the stored-segment pass reports a peak of {peak} bytes that the simulator "
            "does not reproduce; please report this with the cost model (ChainCosts.to_json)"
        )
    return Plan(checkpoints, peak, plan.solver + "+stored", plan.solve_seconds + seconds, costs.n, stored)
