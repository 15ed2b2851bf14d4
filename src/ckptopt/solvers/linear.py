"""The O(n) solver, exact for the additive form (Hong et al., arXiv 2502.12499)."""

from __future__ import annotations

import numpy as np
from numba import njit

from ..costs import ChainCosts
from ..plan import Solution
from ..simulator.kernels import BIG, NEG
from .rows import plan_from_choice

__all__ = ["linear", "least_recompute_additive"]


def linear(costs: ChainCosts) -> Solution:
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
    Solution
        ``optimum`` is the exact peak for an additive instance and ``None``
        for a full one (the simulator gives the plan's true peak).

    Notes
    -----
    Running time O(n), memory O(n) for the optimum. Among the plans reaching
    it, the one whose last segment starts earliest, which for the additive
    form is the one with the least recomputation (every other segment is
    re-run whole): an O(n log n) second pass,
    :func:`least_recompute_additive`.
    A lead from docs/design.md §5, proved above and checked against
    brute force and the O(n^2) program in the tests.

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 10, 0], h=[16, 7, 8], q=[24, 3, 27])
    >>> linear(c)
    Solution(checkpoints=(2,), optimum=27, stored=(), label=None)
    """
    P, q, w = _additive_arrays(costs)
    value, plan = linear_additive(costs.n, P, q, w)
    cps = tuple(int(x) for x in plan)
    fewer = least_recompute_additive(costs, int(value) + costs.static)
    if fewer is not None:
        cps = fewer
    return Solution(cps, int(value) + costs.static if costs.is_additive else None)


def least_recompute_additive(costs: ChainCosts, max_peak: int) -> tuple[int, ...] | None:
    """The plan within ``max_peak`` whose last segment starts earliest, O(n log n).

    For the additive form every non-last segment is re-run whole, so that is
    the least recomputation exactly. A full model is taken through its
    additive approximation (:meth:`ChainCosts.additive_form`), as :func:`linear`
    does; the simulator scores the result with the full model.
    """
    P, q, w = _additive_arrays(costs)
    L, plan = linear_least_recompute(costs.n, P, q, w, int(max_peak) - costs.static)
    if L < 0:
        return None
    return tuple(int(x) for x in plan)


def _additive_arrays(costs: ChainCosts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(P, q, w)`` of the additive form as writable int64 arrays (one signature for the kernels)."""
    w, h, q = costs.additive_form()
    P = np.concatenate([[0], np.cumsum(h)]).astype(np.int64)
    return P, np.array(q, dtype=np.int64), np.array(w, dtype=np.int64)


# --------------------------------------------------------------------------
# compiled engines
# --------------------------------------------------------------------------

@njit(cache=True)
def linear_additive(n, P, q, w):
    """O(n) optimum of the additive form. See :func:`linear` for the proof."""
    V = np.empty(n + 1, dtype=np.int64)
    V[n] = NEG
    choice = np.empty(n, dtype=np.int64)
    cand = np.empty(n, dtype=np.int64)  # candidate ends; cand[cb] the crossing, cand[ct] the newest
    cb = 0
    ct = -1
    rec = np.empty(n, dtype=np.int64)  # prefix-maximum records of E from l; rec[rt] = l
    rb = 0
    rt = -1
    C = NEG  # max of E over (X, cand[cb]] once those records are folded away
    for l in range(n - 1, -1, -1):
        El = P[l] + q[l]
        while rt >= rb and P[rec[rt]] + q[rec[rt]] <= El:
            rt -= 1
        rt += 1
        rec[rt] = l
        Vn = V[l + 1]
        while ct >= cb and V[cand[ct] + 1] >= Vn:
            ct -= 1
        ct += 1
        cand[ct] = l
        if ct == cb:
            rb = rt
            C = NEG
        else:
            X = cand[cb + 1]
            while rec[rb] > X:
                e = P[rec[rb]] + q[rec[rb]]
                if e > C:
                    C = e
                rb += 1
        # advance the crossing while the next candidate already has D >= V
        while ct > cb and P[rec[rb]] + q[rec[rb]] - P[l] >= V[cand[cb + 1] + 1]:
            cb += 1
            C = NEG
            X = cand[cb + 1] if ct > cb else cand[cb]
            while rec[rb] > X:
                e = P[rec[rb]] + q[rec[rb]]
                if e > C:
                    C = e
                rb += 1
        top = P[rec[rb]] + q[rec[rb]]
        Db = (C if C > top else top) - P[l]
        vb = V[cand[cb] + 1]
        best = Db if Db > vb else vb
        br = cand[cb]
        if ct > cb:
            v1 = V[cand[cb + 1] + 1]
            if v1 < best:
                best = v1
                br = cand[cb + 1]
        V[l] = w[l] + best if l > 0 else best
        choice[l] = br
    return V[0], plan_from_choice(choice, n)


@njit(cache=True)
def _heap_push(hv, hr, hl, size, v, r, l):
    i = size
    hv[i] = v
    hr[i] = r
    hl[i] = l
    while i > 0:
        p = (i - 1) // 2
        if hv[p] < hv[i] or (hv[p] == hv[i] and hl[p] <= hl[i]):
            break
        hv[p], hv[i] = hv[i], hv[p]
        hr[p], hr[i] = hr[i], hr[p]
        hl[p], hl[i] = hl[i], hl[p]
        i = p
    return size + 1


@njit(cache=True)
def _heap_pop(hv, hr, hl, size):
    size -= 1
    hv[0] = hv[size]
    hr[0] = hr[size]
    hl[0] = hl[size]
    i = 0
    while True:
        a = 2 * i + 1
        b = a + 1
        s = i
        if a < size and (hv[a] < hv[s] or (hv[a] == hv[s] and hl[a] < hl[s])):
            s = a
        if b < size and (hv[b] < hv[s] or (hv[b] == hv[s] and hl[b] < hl[s])):
            s = b
        if s == i:
            break
        hv[s], hv[i] = hv[i], hv[s]
        hr[s], hr[i] = hr[i], hr[s]
        hl[s], hl[i] = hl[i], hl[s]
        i = s
    return size


@njit(cache=True)
def linear_least_recompute(n, P, q, w, cap):
    """Additive form: among plans with peak <= cap, the one whose last segment starts earliest.

    In the additive form every segment but the last is re-run whole, so a
    plan's recomputation is the compute of the layers before its last segment:
    least recomputation = earliest feasible last start ``L`` (for non-negative
    compute). With ``Hmin[l]`` the least checkpoint bytes held before ``l``
    over prefixes whose segments stay within ``cap`` (a smaller held amount
    admits every continuation a larger one does, so the minimum is exact for
    feasibility), ``L`` is the smallest ``l`` with ``Hmin[l] + w[l] + D(l, n-1)
    <= cap``. ``D(l, r) = max E[l..r] - P[l]`` is nondecreasing in ``r``, so
    from ``l`` the feasible ends form a range ``[l, R_l]``, found by descending a
    max segment tree; ``Hmin[r+1]`` is the minimum over the ranges covering
    ``r``, kept in a heap with lazy deletion. O(n log n). Returns
    ``(L, plan)`` or ``(-1, empty)`` when nothing fits.
    """
    E = P[:n] + q
    size = 1
    while size < n:
        size *= 2
    tree = np.full(2 * size, NEG, dtype=np.int64)
    for i in range(n):
        tree[size + i] = E[i]
    for i in range(size - 1, 0, -1):
        tree[i] = tree[2 * i] if tree[2 * i] > tree[2 * i + 1] else tree[2 * i + 1]
    suf = np.empty(n + 1, dtype=np.int64)
    suf[n] = NEG
    for i in range(n - 1, -1, -1):
        suf[i] = E[i] if E[i] > suf[i + 1] else suf[i + 1]
    Hmin = np.full(n, BIG, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    Hmin[0] = 0
    hv = np.empty(n, dtype=np.int64)
    hr = np.empty(n, dtype=np.int64)
    hl = np.empty(n, dtype=np.int64)
    hs = 0
    for r in range(n - 1):
        l = r
        if Hmin[l] < BIG:
            val = Hmin[l] + (w[l] if l > 0 else 0)
            T = cap - val + P[l]  # D(l, r') <= cap - val  <=>  max E[l..r'] <= T
            # first j >= l with E[j] > T (n if none): climb from leaf l, then descend
            j = n
            i = l + size
            while True:
                if tree[i] > T:
                    while i < size:
                        i = 2 * i if tree[2 * i] > T else 2 * i + 1
                    j = i - size
                    break
                while i & 1:  # a right child: go up until a left child
                    i >>= 1
                if i == 0:
                    break
                i += 1  # its right sibling covers the next range
            R = j - 1
            if R > n - 2:
                R = n - 2
            if R >= l:
                hs = _heap_push(hv, hr, hl, hs, val, R, l)
        while hs > 0 and hr[0] < r:
            hs = _heap_pop(hv, hr, hl, hs)
        if hs > 0:
            Hmin[r + 1] = hv[0]
            parent[r + 1] = hl[0]
    L = -1
    for l in range(n):
        if Hmin[l] >= BIG:
            continue
        if Hmin[l] + (w[l] if l > 0 else 0) + suf[l] - P[l] <= cap:
            L = l
            break
    out = np.empty(n, dtype=np.int64)
    m = 0
    if L > 0:
        x = L
        while x > 0:
            out[m] = x
            m += 1
            x = parent[x]
    plan = out[:m][::-1].copy()
    return L, plan


def warmup(K, cpre) -> None:
    """Compile this module's kernels on a tiny instance."""
    n = K.a.shape[0]
    P, q, w = (np.array(x, dtype=np.int64) for x in (K.P, K.qb, K.ck))
    linear_additive(n, P, q, w)
    linear_least_recompute(n, P, q, w, BIG)
