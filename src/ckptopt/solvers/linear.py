"""The O(n) solver, exact for the additive form (Hong et al., arXiv 2502.12499)."""

from __future__ import annotations

import numpy as np

from .. import _kernels
from ..costs import ChainCosts
from .recompute import linear_least_recompute

__all__ = ["linear"]


def linear(costs: ChainCosts) -> tuple[tuple[int, ...], int | None]:
    """Lowest-peak plan of the additive form in O(n) time.

    **The form.** With ``P[i] = h[0] + ... + h[i-1]`` and ``E[i] = P[i] + q[i]``,
    a segment ``[l, r]`` costs ``D(l, r) = max_{l<=i<=r} E[i] - P[l]`` (what
    layers ``l..i-1`` left saved plus layer ``i``'s own term) and a plan's peak
    is ``static + max_k (w[l_1] + ... + w[l_k] + D(l_k, r_k))``. The optimum is
    ``static + V(0)`` with ``V(n) = -inf`` and::

        V(l) = w[l] + min_{l <= r < n} max(D(l, r), V(r+1))     (w[0] := 0)

    (a segment at ``l`` pays its checkpoint ``w[l]`` and so does everything
    after it; adding a constant commutes with ``max``).

    **Monotonicity.** ``h >= 0`` gives ``D(l, r) <= D(l, r+1)`` (one more term
    in the max) and ``D(l, r) <= D(l-1, r)`` (every term grows by ``h[l-1]``
    and one is added).

    **Dominance.** For a fixed ``l``, an end ``r`` is dominated by any
    ``r' < r`` with ``V(r'+1) <= V(r+1)``: both arguments of the max are no
    larger. This stays true for every smaller ``l`` (``r'`` remains a legal
    end). So the useful ends form a list ordered by ``r`` whose ``V(r+1)``
    strictly decreases as ``r`` grows. When ``l`` decreases by one, the new end
    ``r = l`` is the smallest; it removes from the small-``r`` side every end
    with ``V(r+1) >= V(l+1)`` and is added there: amortized O(1).

    **Unimodality and the crossing.** Along that list ``D`` is nondecreasing
    and ``V`` strictly decreasing, so the ends with ``D >= V`` form a suffix
    (the large-``r`` side). On it ``max(D, V) = D`` is smallest at its first
    element, the *crossing*; before it ``max(D, V) = V`` is smallest just
    before the crossing. Hence ``min_r max(D, V) = min(D(crossing), V(just
    before))``. Decreasing ``l`` only raises every ``D``, so the suffix only
    grows: the crossing moves toward smaller ``r``. Ends beyond the crossing
    are never optimal again (their ``D`` is at least the crossing's, for every
    smaller ``l``), so they are discarded for good: the list becomes a deque
    whose far end is the crossing, advanced at most n times in total.

    **The range maximum.** ``D(l, r) + P[l] = max E[l..r]`` is needed at two
    ends only: the crossing ``c`` and the end ``c'`` just before it. A second
    stack holds the prefix-maximum records of ``E`` from ``l`` (positions
    whose ``E`` beats every ``E`` between ``l`` and them), restricted to
    positions ``<= c'``; its oldest entry is ``max E[l..c']``. The records in
    ``(c', c]`` are folded into one number ``C = max E over (c', c]``, which
    never changes until the crossing moves (the positions are fixed and
    ``l`` is outside them). Pushing ``E[l]`` pops dominated records; moving
    ``c'`` or ``c`` folds records from the old end. Each position enters and
    leaves each structure once: O(n) in total.

    Parameters
    ----------
    costs : ChainCosts
        Additive form: solved exactly. Full form: its
        :meth:`ChainCosts.additive_form` approximation is solved, and the
        returned plan is scored by the simulator with the full model.

    Returns
    -------
    (checkpoints, optimum) : tuple
        ``optimum`` is the exact peak for an additive instance and ``None``
        for a full one (the simulator gives the plan's true peak).

    Notes
    -----
    Running time O(n), memory O(n) for the optimum. Among the plans reaching
    it, the one whose last segment starts earliest, which for the additive
    form is the one with the least recomputation (every other segment is
    re-run whole): an O(n log n) second pass,
    :func:`~ckptopt.solvers.recompute.linear_least_recompute`.
    A lead from DESIGN.md section 5, proved above and checked against
    brute force and the O(n^2) program in the tests.

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 10, 0], h=[16, 7, 8], q=[24, 3, 27])
    >>> linear(c)
    ((2,), 27)
    """
    w, h, q = costs.additive_form()
    P = np.concatenate([[0], np.cumsum(h)]).astype(np.int64)
    value, plan = _kernels.linear_additive(costs.n, P, np.ascontiguousarray(q, dtype=np.int64),
                                           np.ascontiguousarray(w, dtype=np.int64))
    cps = tuple(int(x) for x in plan)
    fewer = linear_least_recompute(costs, int(value) + costs.static)
    if fewer is not None:
        cps = fewer
    return cps, (int(value) + costs.static if costs.is_additive else None)
