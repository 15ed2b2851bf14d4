"""Exact solvers for the full chain model: brute force, O(n^3) and O(n^2) programs."""

from __future__ import annotations

from .. import _kernels
from ..costs import ChainCosts
from ..errors import ProblemTooLarge
from .recompute import TIE_BREAK_MAX_WORK, FrontTooLarge, compute_prefix, least_recompute

__all__ = ["brute", "dp", "dp2", "BRUTE_MAX_N"]

BRUTE_MAX_N = 20


def brute(costs: ChainCosts) -> tuple[tuple[int, ...], int]:
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
    value, _, plan = _kernels.brute_force_lex(costs.n, not costs.is_additive, costs.kernel_arrays,
                                              compute_prefix(costs))
    return tuple(int(x) for x in plan), int(value) + costs.static


def _fewest_recomputed(costs: ChainCosts, value: int, plan) -> tuple[tuple[int, ...], int]:
    """Among the plans reaching the optimum ``value`` (static excluded), the least recomputation."""
    best = None
    if costs.n * costs.n <= 4 * TIE_BREAK_MAX_WORK:  # its O(n^2) part alone would pass the limit
        try:
            best = least_recompute(costs, int(value) + costs.static, allow_stored=False,
                                   max_work=TIE_BREAK_MAX_WORK)
        except FrontTooLarge:
            pass  # too many trade-offs within the optimum: keep the first pass's plan
    if best is None:  # (None cannot happen otherwise: the solver's own plan reaches the optimum)
        return tuple(int(x) for x in plan), int(value) + costs.static
    return best[0], int(value) + costs.static


def dp(costs: ChainCosts) -> tuple[tuple[int, ...], int]:
    """The O(n^3) dynamic program of Hong et al. (arXiv 2502.12499).

    With ``V(l)`` the lowest peak (relative to the checkpoints held before
    it) of layers ``l..n-1`` when a segment starts at ``l``::

        V(l) = min_{r >= l} max(D(l, r), ck[r+1] + V(r+1)),   D(l, n-1) last

    where ``D(l, r)`` is the peak inside segment ``[l, r]`` (forward,
    recomputation and backward terms, DESIGN.md section 3) and ``ck[r+1]``
    the bytes of the next segment's checkpoint, which every later segment
    also holds (the prefix objective). ``D`` may depend on both ends in any
    way; here each ``D(l, r)`` is computed from scratch in O(r - l), as in
    the paper's cubic formulation.

    Among the plans reaching the optimum, the one with the least
    recomputation is returned (:func:`~ckptopt.solvers.recompute.least_recompute`
    with the optimum as the cap: an exact second pass). The pass is bounded
    (``TIE_BREAK_MAX_WORK`` steps, at most about 0.4 s, so it runs only up to
    about 2,800 layers); on an instance with more trade-offs within the
    optimum (seen on random models of a thousand layers, never on the zoo),
    the first pass's plan is kept: its peak is optimal either way.

    Notes
    -----
    Running time O(n^3), memory O(n). Exact for the full model.
    """
    value, plan = _kernels.dp_cubic(costs.n, not costs.is_additive, costs.kernel_arrays)
    return _fewest_recomputed(costs, value, plan)


def dp2(costs: ChainCosts) -> tuple[tuple[int, ...], int]:
    """Exact O(n^2) program: the recurrence of :func:`dp` with ``D(l, r)``
    extended incrementally as ``r`` grows.

    For a fixed ``l`` the backward and forward terms are running maxima; the
    recomputation term is ``G[r] + a[r]`` plus a running maximum taken up to
    the last layer the recomputation runs, which only moves forward with
    ``r``. So each ``D(l, r)`` costs O(1) after ``D(l, r-1)`` (DESIGN.md
    section 5). Among the plans reaching the optimum, the one with the least
    recomputation, as in :func:`dp`.

    Notes
    -----
    Running time O(n^2) for the optimum, memory O(n); the tie-break pass is
    O(n^2 F), F the number of (peak, recomputation) trade-offs within the
    optimum, and bounded as in :func:`dp`. Exact for the full model.
    """
    value, plan = _kernels.dp_quadratic(costs.n, not costs.is_additive, costs.kernel_arrays)
    return _fewest_recomputed(costs, value, plan)
