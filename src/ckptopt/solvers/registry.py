"""Solvers: one registry, one entry point.

Every solver is a pure function of a :class:`~ckptopt.ChainCosts` returning a
:class:`~ckptopt.plan.Solution`; :func:`solve` times it, scores the plan with
:func:`~ckptopt.simulate` and wraps both in a :class:`~ckptopt.Plan`. No module
here imports torch.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

from ..costs import ChainCosts
from ..errors import InfeasibleBudget, InvalidCosts, UnknownSolver
from ..plan import Plan, Solution, normalize_plan, normalize_stored
from ..simulator import kernels as sim_kernels
from ..simulator import simulate
from . import baselines, exact, linear, pareto, policy
from .limits import BRUTE_MAX_N, DP_ROUTINE_MAX_N

__all__ = ["SolverInfo", "SOLVERS", "solve", "solver_names", "lookup", "check_budget", "ensure_compiled"]


@dataclass(frozen=True)
class SolverInfo:
    """A registry entry."""

    name: str
    #: ``fn(costs, arg, budget) -> Solution``; ``arg`` is the text after ``:`` (``uniform:4``), ``budget``
    #: the validated budget in bytes or None
    fn: Callable[[ChainCosts, str | None, int | None], Solution]
    #: ``"full"``: exact for both forms; ``"additive"``: exact for the additive form only; ``""``: a heuristic
    exact: str
    description: str
    takes_arg: bool = False  #: written ``name:ARG``
    #: the solver plans within ``budget`` itself (``budget``, ``auto``); for the others :func:`solve` checks
    #: the plan against it afterwards
    plans_within_budget: bool = False
    #: tables (the CLI, benchmarks) run it by default only up to this many layers (``brute`` refuses beyond)
    max_n: int | None = None


def _baseline(f: Callable[[ChainCosts], tuple[int, ...]]):
    return lambda costs, arg, budget: Solution(f(costs))


SOLVERS: Mapping[str, SolverInfo] = {
    info.name: info
    for info in (
        SolverInfo("auto", lambda c, a, b: policy.auto(c, b), "full",
                   "what optimize_checkpoints picks: dp2 (+ unwrapped segments), or budget with a budget",
                   plans_within_budget=True),
        SolverInfo("brute", lambda c, a, b: exact.brute(c), "full", "every plan; the test oracle (n <= 20)",
                   max_n=BRUTE_MAX_N),
        SolverInfo("dp", lambda c, a, b: exact.dp(c), "full", "the paper's O(n^3) dynamic program",
                   max_n=DP_ROUTINE_MAX_N),
        SolverInfo("dp2", lambda c, a, b: exact.dp2(c), "full", "exact O(n^2) dynamic program"),
        SolverInfo("linear", lambda c, a, b: linear.linear(c), "additive", "O(n); exact for the additive form"),
        SolverInfo("budget", lambda c, a, b: policy.budget(c, b), "full",
                   "least recomputation with peak <= budget (needs budget=); exact (with side tensors up to a work "
                   "limit, then a plan that fits)", plans_within_budget=True),
        SolverInfo("none", _baseline(baselines.none), "", "no checkpointing"),
        SolverInfo("every", _baseline(baselines.every), "", "checkpoint every layer"),
        SolverInfo("sqrt", _baseline(baselines.sqrt), "", "Chen's sqrt(n) segments, uniform by layer count"),
        SolverInfo("chen-greedy", _baseline(baselines.chen_greedy), "",
                   "Chen et al. 2016 Algorithm 3 with its budget sweep"),
        SolverInfo(
            "uniform",
            lambda c, a, b: Solution(baselines.uniform(c, baselines.parse_uniform_arg(a))),
            "",
            "uniform:K -- K segments of equal layer count (checkpoint_sequential)",
            takes_arg=True,
        ),
    )
}


def solver_names() -> list[str]:
    """Names accepted by :func:`solve` (``uniform`` is written ``uniform:K``)."""
    return [n + ":K" if SOLVERS[n].takes_arg else n for n in SOLVERS]


def lookup(solver: str) -> tuple[SolverInfo, str | None]:
    """The registry entry of ``solver`` and its argument; :class:`UnknownSolver` for a bad name."""
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


def check_budget(budget) -> int:
    """A budget in bytes as an int; ``ValueError`` saying what to pass for anything else."""
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


def ensure_compiled() -> None:
    """Compile (or load from numba's on-disk cache) every kernel once, so no solve time includes it."""
    global _warm
    if not _warm:
        sim_kernels.warmup()
        K, cpre = sim_kernels.tiny_instance()
        for engine in (exact, linear, pareto, baselines):
            engine.warmup(K, cpre)
        _warm = True


def _run(costs: ChainCosts, info: SolverInfo, arg: str | None, limit: int | None, label: str) -> Plan:
    ensure_compiled()
    t0 = time.perf_counter()
    sol = info.fn(costs, arg, limit)
    seconds = time.perf_counter() - t0
    checkpoints = normalize_plan(costs, sol.checkpoints)
    stored = normalize_stored(checkpoints, sol.stored)
    peak = simulate(costs, checkpoints, stored).peak_bytes
    name = sol.label or label
    if sol.optimum is not None and sol.optimum != peak:
        raise RuntimeError(
            f"internal error: solver {name!r} reports an optimum of {sol.optimum} bytes but the simulator "
            f"scores its plan at {peak}; please report this with the cost model (ChainCosts.to_json)"
        )
    if info.plans_within_budget and limit is not None and peak > limit:
        raise RuntimeError(
            f"internal error: solver {name!r} chose a plan peaking at {peak} bytes over the budget of {limit}; "
            "please report this with the cost model (ChainCosts.to_json)"
        )
    return Plan(checkpoints, peak, name, seconds, costs.n, stored)


def solve(costs: ChainCosts, solver: str = "linear", budget: int | None = None) -> Plan:
    """Choose checkpoints for a cost model.

    Parameters
    ----------
    costs : ChainCosts
    solver : str
        A name from :data:`SOLVERS`: ``auto``, ``brute``, ``dp``, ``dp2``,
        ``linear``, ``budget``, ``none``, ``every``, ``sqrt``, ``chen-greedy`` or
        ``uniform:K``. The exact solvers (``brute``, ``dp``, ``dp2``) return,
        among the lowest-peak plans, one with the least recomputation
        (:attr:`ChainCosts.c`); ``linear`` does so for the additive form.
        ``budget`` returns the plan with the least recomputation whose peak
        is at most ``budget`` (exact; it needs ``budget``). ``auto`` is what
        :func:`ckptopt.optimize_checkpoints` picks
        (:mod:`ckptopt.solvers.policy`).
    budget : int, optional
        Peak-memory budget in bytes. For ``budget`` and ``auto``, the limit they
        plan within. For the other solvers: if the solver's plan exceeds it, the
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
    info, arg = lookup(solver)
    limit = None if budget is None else check_budget(budget)
    plan = _run(costs, info, arg, limit, solver)
    if info.plans_within_budget or limit is None or plan.peak_bytes <= limit:
        return plan
    best = plan
    if info.exact != "full" and not (info.exact == "additive" and costs.is_additive):
        exact_name = "linear" if costs.is_additive else "dp2"
        best = _run(costs, SOLVERS[exact_name], None, None, exact_name)
    if best.peak_bytes > limit:
        raise InfeasibleBudget(limit, best.peak_bytes)
    warnings.warn(
        f"solver {solver!r} gave a plan peaking at {plan.peak_bytes} bytes, over the budget of {limit}; "
        f"returning the exact optimum from {best.solver!r} ({best.peak_bytes} bytes) instead",
        stacklevel=2,
    )
    return best
