"""Exact solvers for the full chain model: brute force, O(n^3) and O(n^2) programs.

Each engine is a compiled kernel next to the function that calls it. Among the
plans reaching the optimum, ``dp`` and ``dp2`` return one with the least
recomputation (an exact second pass, :func:`ckptopt.solvers.pareto.least_recompute`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..costs import ChainCosts
from ..errors import ProblemTooLarge
from ..plan import Solution
from ..sides import SideArrays
from ..simulator.kernels import BIG, NEG, held_checkpoint, plan_recompute, segment_peak, simulate_plan
from ..simulator.side_tensors import side_scratch, simulate_plan_side
from .limits import BRUTE_MAX_N, TIE_BREAK_MAX_WORK, within_tie_break
from .pareto import FrontTooLarge, least_recompute
from .rows import (better_lex, checkpoints_of_mask, plan_from_choice, segment_row, segment_row_buffers, starts_of_mask)
from . import side_tensors

__all__ = ["brute", "dp", "dp2"]


def brute(costs: ChainCosts) -> Solution:
    """Try every plan (2^(n-1) of them) and keep the lowest peak.

    The oracle the tests check every other solver against. Among the plans
    with the lowest peak, the one with the least recomputation; further ties
    go to the plan whose checkpoint bit mask is smallest (layer ``j`` is bit
    ``j-1``).

    Raises
    ------
    ProblemTooLarge
        For ``n > 20`` (over half a million plans): use ``dp2``, which is
        exact and O(n^2).

    Notes
    -----
    Running time O(n 2^n).
    """
    if costs.n > BRUTE_MAX_N:
        raise ProblemTooLarge(
            f"solver 'brute' tries all 2^(n-1) plans and refuses n > {BRUTE_MAX_N} "
            f"(this model has n = {costs.n}); use the exact solver 'dp2' (O(n^2)) or 'dp' instead"
        )
    value, _, plan = brute_force_lex(costs.n, not costs.is_additive, costs.kernel_arrays, costs.compute_prefix,
                                     *_side_context(costs))
    return Solution(tuple(int(x) for x in plan), int(value) + costs.static)


def _side_context(costs: ChainCosts) -> tuple:
    """``(SD, sc, side)``: the side tensors' arrays and scratch for :func:`brute_force_lex` (empty ones for a
    cost model without side tensors, or of the additive form)."""
    n, side = costs.n, costs.side
    return (costs.side_arrays if costs.has_side else SideArrays.build(n, ()), side_scratch(n, len(side)),
            costs.has_side)


def tie_break(costs: ChainCosts, value: int) -> Solution | None:
    """Among the checkpoint-only plans reaching the optimum ``value`` (static excluded), the one with the
    least recomputation; None where the pass is not run (``within_tie_break``) or stops at its work limit
    (``TIE_BREAK_MAX_WORK``: too many trade-offs within the optimum)."""
    if not within_tie_break(costs.n):
        return None
    try:
        best = least_recompute(costs, int(value) + costs.static, allow_stored=False, max_work=TIE_BREAK_MAX_WORK)
    except FrontTooLarge:
        return None
    # (None cannot happen: the first pass's plan reaches the optimum)
    return None if best is None else Solution(best[0], int(value) + costs.static)


def _fewest_recomputed(costs: ChainCosts, value: int, plan) -> Solution:
    """Among the plans reaching the optimum ``value`` (static excluded), the least recomputation
    (:func:`tie_break`), or ``plan`` where that pass does not answer."""
    best = tie_break(costs, value)
    return best if best is not None else Solution(tuple(int(x) for x in plan), int(value) + costs.static)


def dp(costs: ChainCosts) -> Solution:
    """The O(n^3) dynamic program of Hong et al. (arXiv 2502.12499).

    With ``V(l)`` the lowest peak (relative to the checkpoints held before
    it) of layers ``l..n-1`` when a segment starts at ``l``::

        V(l) = min_{r >= l} c(l, r) + max(D(l, r), V(r+1)),   D(l, n-1) unwrapped

    where ``D(l, r)`` is the peak inside segment ``[l, r]`` (forward,
    recomputation and backward terms, ``docs/design.md`` §3) and ``c(l, r)`` the
    checkpoint the segment holds, which every later segment also holds (the
    prefix objective). ``D`` may depend on both ends in any way; here each
    ``D(l, r)`` is computed from scratch in O(r - l), as in the paper's cubic
    formulation.

    Among the plans reaching the optimum, the one with the least
    recomputation is returned (the Pareto program with the optimum as the cap:
    an exact second pass). The pass is bounded (``TIE_BREAK_MAX_WORK`` steps,
    at most about 0.4 s, so it runs only up to about 2,800 layers); on an
    instance with more trade-offs within the optimum than that (a random model
    of a thousand layers may have them; the zoo models need a few thousand
    steps), the first pass's plan is kept: its peak is optimal either way.

    Notes
    -----
    Running time O(n^3), memory O(n). Exact for the full model.
    """
    if costs.has_side:  # the program over (layer, held side tensors) states, O(n^3 2^k)
        value, plan, _ = side_tensors.lowest_peak(costs)
        return _fewest_recomputed(costs, value, plan)
    value, plan = dp_cubic(costs.n, not costs.is_additive, costs.kernel_arrays)
    return _fewest_recomputed(costs, value, plan)


def dp2(costs: ChainCosts) -> Solution:
    """Exact O(n^2) program: the recurrence of :func:`dp` with ``D(l, r)``
    extended incrementally as ``r`` grows (:func:`ckptopt.solvers.rows.segment_row`).

    For a fixed ``l`` the backward and forward terms are running maxima; the
    recomputation term is ``rb[r]`` plus a running maximum taken up to the last
    layer the recomputation runs, which only moves forward with ``r``. So each
    ``D(l, r)`` costs O(1) after ``D(l, r-1)``. Among the plans reaching the
    optimum, the one with the least recomputation, as in :func:`dp`.

    Notes
    -----
    Running time O(n^2) for the optimum, memory O(n); the tie-break pass is
    O(n^2 F), F the number of (peak, recomputation) trade-offs within the
    optimum, and bounded as in :func:`dp`. Exact for the full model.
    """
    if costs.has_side:  # side tensors: the state program of dp (O(n^3 2^k))
        value, plan, _ = side_tensors.lowest_peak(costs)
        return _fewest_recomputed(costs, value, plan)
    value, plan = dp_quadratic(costs.n, not costs.is_additive, costs.kernel_arrays)
    return _fewest_recomputed(costs, value, plan)


# --------------------------------------------------------------------------
# compiled engines
# --------------------------------------------------------------------------
@njit(cache=True)
def dp_cubic(n, full, K):
    """O(n^3) dynamic program: every segment cost recomputed from scratch.

    V(l) = min_r c(l, r) + max(D(l, r), V(r+1)), with c(l, r) the checkpoint
    the segment holds; D(l, n-1) is the unwrapped last segment and V(n) = -inf.
    Returns (optimum without static, checkpoints).
    """
    V = np.empty(n + 1, dtype=np.int64)
    V[n] = NEG
    choice = np.empty(n, dtype=np.int64)
    for l in range(n - 1, -1, -1):
        bestv, bestr = BIG, -1
        for r in range(l, n):
            last = r == n - 1
            c = held_checkpoint(l, r, last, full, K)
            D = segment_peak(l, r, last, full, K, K.ck[l] - c if l > 0 else 0, False)[0]
            rest = V[r + 1]
            val = c + (D if D > rest else rest)
            if val <= bestv:  # ties: the longest segment
                bestv, bestr = val, r
        V[l], choice[l] = bestv, bestr
    return V[0], plan_from_choice(choice, n)


@njit(cache=True)
def dp_quadratic(n, full, K):
    """Exact O(n^2) program: the recurrence of dp_cubic, D(l, r) read from the running maxima of
    :func:`~ckptopt.solvers.rows.segment_row` as r grows (the live input of with_live_in written out: a
    call per (l, r) passing the kernel arrays made the program several times slower)."""
    V = np.empty(n + 1, dtype=np.int64)
    V[n] = NEG
    choice = np.empty(n, dtype=np.int64)
    row = segment_row_buffers(n)
    Dc0, Ds0, hold = row.Dc0, row.Ds0, row.hold
    Cpre = np.zeros(n + 1, dtype=np.int64)
    for l in range(n - 1, -1, -1):
        segment_row(l, n, full, K, Cpre, row)
        bestv, bestr = BIG, -1
        for r in range(l, n):
            if r == n - 1:
                c = held_checkpoint(l, r, True, full, K)
                d = Ds0[r]  # after a checkpointed segment
            else:
                c = hold[r]
                d = Dc0[r]
            if l > 0 and c == 0:  # the input is live while the first layer runs
                v = K.ck[l] + ((K.ff[l] if K.sin[l] == 0 else K.f[l]) if r == n - 1 else K.fc[l])
                if v > d:
                    d = v
            rest = V[r + 1]
            val = c + (d if d > rest else rest)
            if val <= bestv:
                bestv, bestr = val, r
        V[l], choice[l] = bestv, bestr
    return V[0], plan_from_choice(choice, n)


@njit(cache=True)
def brute_force_lex(n, full, K, Cpre, SD, sc, side):
    """Every checkpoint-only plan, each scored by the simulator (with the side tensors of ``SD`` when
    ``side``: full form only); the lowest peak, then the least recomputation, then the smallest mask.
    Returns ``(peak without static, recomputation, checkpoints)``."""
    starts, zeros = np.empty(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    best, best_rec, best_mask = BIG, BIG, 0
    for mask in range(1 << (n - 1)):
        m = starts_of_mask(mask, n, starts)
        if side:
            v = simulate_plan_side(starts[:m], zeros[:m], n, K, SD, sc)[0]
        else:
            v = simulate_plan(starts[:m], zeros[:m], n, full, K)[0]
        if v > best:
            continue
        rc = plan_recompute(starts[:m], zeros[:m], n, full, K, Cpre)
        if better_lex(v, rc, best, best_rec):
            best, best_rec, best_mask = v, rc, mask
    return best, best_rec, checkpoints_of_mask(best_mask, n)


def warmup(K, cpre) -> None:
    """Compile this module's kernels on a tiny instance."""
    n = K.a.shape[0]
    SD, sc = SideArrays.build(n, ()), side_scratch(n, 0)
    for full in (True, False):
        dp_cubic(n, full, K)
        dp_quadratic(n, full, K)
        brute_force_lex(n, full, K, cpre, SD, sc, False)
