"""The ``auto`` policy: the plan ckptopt picks when the user names no solver.

One function, :func:`auto`, used by :func:`ckptopt.optimize_checkpoints`, the CLI
and the planning helpers (through ``solve(costs, "auto", budget)``):

* with a budget: the ``budget`` solver (:func:`budget`), the plan with the least
  recomputation whose peak fits, middle segments possibly left unwrapped;
* without: the lowest peak, exact (``dp2``) up to
  :data:`~ckptopt.solvers.limits.AUTO_EXACT_MAX_N` layers and ``linear`` beyond, the
  least recomputation among the plans reaching it; then, where the pass is cheap
  enough (:func:`~ckptopt.solvers.limits.within_tie_break`), plans that also leave
  middle segments unwrapped (:func:`improve_with_stored`): label ``"dp2+stored"``
  when one has a lower (peak, recomputation). With side tensors the stored pass may do
  more work (:data:`~ckptopt.solvers.limits.STORED_SIDE_MAX_WORK`) and counts only where the
  tie-break finished (it runs beside the tie-break, in a thread, where there is a second core).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..costs import ChainCosts
from ..errors import InfeasibleBudget
from ..plan import Plan, Solution
from ..simulator import plan_recompute, simulate
from .exact import dp2, tie_break
from .limits import (AUTO_EXACT_MAX_N, BUDGET_SIDE_BUCKETS, BUDGET_SIDE_MAX_WORK, FRONT_FALLBACK_MAX_N,
                     STORED_SIDE_MAX_WORK, TIE_BREAK_MAX_WORK, spare_core, within_tie_break)
from .linear import linear
from .pareto import FrontPoint, FrontTooLarge, least_recompute, pareto_front

__all__ = ["auto", "budget", "improve_with_stored"]


def budget(costs: ChainCosts, limit: int | None) -> Solution:
    """The ``budget`` solver: least recomputation among plans peaking at most ``limit`` (exact).

    Plans may leave middle segments unwrapped (:attr:`Plan.stored`). With side tensors the
    program is bounded (:func:`_budget_side`): past its work limit the plan (label ``"budget~"``,
    with a warning) fits but may recompute more than the least.

    Raises
    ------
    ValueError
        Without a budget.
    InfeasibleBudget
        With the smallest achievable peak, when no plan fits.
    """
    if limit is None:
        raise ValueError("solver 'budget' needs a memory budget: solve(costs, 'budget', budget=BYTES)")
    if costs.has_side:
        return _budget_side(costs, limit)
    found = least_recompute(costs, limit)
    if found is None:
        if costs.n <= FRONT_FALLBACK_MAX_N:
            lowest = pareto_front(costs, None)[0].peak_bytes
        else:
            lowest = dp2(costs).optimum
        raise InfeasibleBudget(limit, lowest)
    return Solution(found[0], None, found[1], "budget")


def _budget_side(costs: ChainCosts, limit: int) -> Solution:
    """:func:`budget` with side tensors, bounded: the exact Pareto program up to
    ``BUDGET_SIDE_MAX_WORK``; past it, the approximate one (each state keeps one point per
    ``1/BUDGET_SIDE_BUCKETS`` of the budget: its plan fits, it may recompute more than the least),
    with a warning; past that too, the lowest-peak plan. The lowest peak (exact, the side program
    with stored segments) decides first whether any plan fits."""
    from .side_tensors import lowest_peak

    value, checkpoints, stored = lowest_peak(costs, allow_stored=True)
    lowest = value + costs.static
    if lowest > limit:
        raise InfeasibleBudget(limit, lowest)
    try:
        found = least_recompute(costs, limit, max_work=BUDGET_SIDE_MAX_WORK)
        label = "budget"
    except FrontTooLarge:
        grain = max(1, (limit - costs.static) // BUDGET_SIDE_BUCKETS)
        label = "budget~"
        try:
            found = least_recompute(costs, limit, max_work=8 * BUDGET_SIDE_MAX_WORK, grain=grain)
            how = f"an approximate front (one point per {BUDGET_SIDE_BUCKETS}th of the budget and state)"
        except FrontTooLarge:
            found = None
        if found is None:
            found = (checkpoints, stored)
            how = "the lowest-peak plan"
        warnings.warn(
            f"the exact least-recomputation program under this budget passed its work limit "
            f"({BUDGET_SIDE_MAX_WORK:,}: many (peak, recomputation) trade-offs on {costs.n} layers with side "
            f"tensors); the plan is from {how}: it fits the budget, but a plan that recomputes less may exist",
            stacklevel=4)
    if found is None:  # (cannot happen: the lowest-peak plan fits)
        found = (checkpoints, stored)
    return Solution(found[0], None, found[1], label)


def _lowest_with_stored(costs: ChainCosts, peak: int, max_work: int, stop=None) -> FrontPoint | None:
    """The plan, middle segments possibly unwrapped, with the lowest (peak, recomputation) among those
    peaking at most ``peak`` (a peak some plan reaches); None past ``max_work`` (or once ``stop[0]`` is
    set, with side tensors: :func:`~ckptopt.solvers.pareto.pareto_front`)."""
    try:
        front = pareto_front(costs, peak, allow_stored=True, max_work=max_work, stop=stop)
    except FrontTooLarge:
        return None
    if not front:  # cannot happen: a plan reaches the cap
        return None
    best = front[0]
    if simulate(costs, best.checkpoints, best.stored).peak_bytes != best.peak_bytes:
        raise RuntimeError(
            f"internal error: the stored-segment pass reports a peak of {best.peak_bytes} bytes that the "
            "simulator does not reproduce; please report this with the cost model (ChainCosts.to_json)"
        )
    return best


def _stored_pass(costs: ChainCosts, checkpoints: tuple[int, ...], stored: tuple[int, ...],
                 peak: int, max_work: int = TIE_BREAK_MAX_WORK) -> FrontPoint | None:
    """A plan with unwrapped middle segments whose (peak, recomputation) is below the given plan's."""
    if costs.is_additive or not within_tie_break(costs.n):
        return None
    return _below(costs, _lowest_with_stored(costs, peak, max_work), checkpoints, stored, peak)


def _below(costs: ChainCosts, best: FrontPoint | None, checkpoints: tuple[int, ...], stored: tuple[int, ...],
           peak: int) -> FrontPoint | None:
    """``best`` where its (peak, recomputation) is below that of the plan given (peaking at ``peak``)."""
    if best is None or (best.peak_bytes, best.recompute) >= (peak, plan_recompute(costs, checkpoints, stored)):
        return None
    return best


def _side_tie_break_and_stored(costs: ChainCosts, value: int) -> tuple[Solution | None, FrontPoint | None]:
    """``(tie-break, stored pass)`` at the side-tensor optimum ``value`` (static excluded): the stored pass
    only where the tie-break finishes (None otherwise). Both programs release the GIL, so with a spare core
    the stored pass runs in a thread beside the tie-break (it is capped at the same peak, known before
    either runs) and is stopped when the tie-break does not finish: the answer is the one running them in
    turn gives."""
    if costs.is_additive or not spare_core():
        sol = tie_break(costs, value)
        return sol, (None if sol is None else _stored_pass(costs, sol.checkpoints, (), sol.optimum,
                                                            STORED_SIDE_MAX_WORK))
    stop = np.zeros(1, dtype=np.int64)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(_lowest_with_stored, costs, int(value) + costs.static, STORED_SIDE_MAX_WORK, stop)
        sol = None
        try:
            sol = tie_break(costs, value)
        finally:
            if sol is None:  # (or an error: the stored pass is not needed)
                stop[0] = 1
        best = pending.result()
    if sol is None:
        return None, None
    return sol, _below(costs, best, sol.checkpoints, (), sol.optimum)


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
    t0 = time.perf_counter()
    best = _stored_pass(costs, plan.checkpoints, plan.stored, plan.peak_bytes)
    if best is None:
        return plan
    return Plan(best.checkpoints, best.peak_bytes, plan.solver + "+stored",
                plan.solve_seconds + time.perf_counter() - t0, costs.n, best.stored)


def auto(costs: ChainCosts, limit: int | None = None) -> Solution:
    """The plan ``solver="auto"`` picks (see the module docstring)."""
    if limit is not None:
        return budget(costs, limit)
    if costs.n > AUTO_EXACT_MAX_N:
        return linear(costs)._replace(label="linear")
    if costs.has_side and within_tie_break(costs.n):
        # With side tensors the stored-segment program is the costlier of the two passes (more states over
        # the same cap) and the better paid: on a 4-layer transformers Llama it needs 4.1 million steps and
        # finds a peak 0.6% lower. So it gets STORED_SIDE_MAX_WORK, and is tried only where the tie-break
        # finished (a heuristic: where the smaller program stopped, the larger one stopped too on the models
        # measured, Llamas of 2, 4 and 12 decoder layers and an 8B estimate).
        from .side_tensors import lowest_peak

        value, plan, _ = lowest_peak(costs)
        sol, best = _side_tie_break_and_stored(costs, value)
        if sol is None:
            return Solution(plan, value + costs.static, (), "dp2")
        if best is None:
            return sol._replace(label="dp2")
        return Solution(best.checkpoints, best.peak_bytes, best.stored, "dp2+stored")
    sol = dp2(costs)
    best = _stored_pass(costs, sol.checkpoints, (), sol.optimum)
    if best is None:
        return sol._replace(label="dp2")
    return Solution(best.checkpoints, best.peak_bytes, best.stored, "dp2+stored")
