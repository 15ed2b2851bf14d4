"""Pareto fronts of (peak, recomputation): the machinery both exact Pareto programs share.

:func:`ckptopt.solvers.pareto.pareto_plans` (no side tensors) and
:func:`ckptopt.solvers.side_tensors.pareto_side` (states with held side tensors) keep, per state, the
front of its suffix plans: points sorted by relative peak ascending and recomputation strictly
descending, stored in one pool. A point is a column of :data:`WIDTH` integers (the fields below, one row each: sorting by a field reads contiguous memory); it
continues the suffix point ``NEXT`` of the state after its segment, so a plan is read back by
following ``NEXT`` from a point of the first state.

A state's candidates come from each segment it may take (:func:`add_suffix_points`), and the front
is what no other candidate dominates (:func:`keep_front`). A suffix enters a peak only through ``max``
and ``+``, both monotone: a dominated suffix never helps, and for one segment the suffix points below
its own peak all give that peak, so only the last of them (least recomputation) is a candidate.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..simulator.kernels import BIG

__all__ = ["PEAK", "REC", "END", "NEXT", "KIND", "WIDTH", "points", "grow_points", "add_point", "coarsen",
           "add_suffix_points", "keep_front", "front_plans"]

#: The fields of a point (the pool's rows): its relative peak, its recomputation, the last layer of its segment, the
#: suffix point it continues (-1: none, the segment is the last), and the segment's kind (0
#: checkpointed, 1 stored, 2 the last).
PEAK, REC, END, NEXT, KIND = 0, 1, 2, 3, 4
WIDTH = 5


@njit(cache=True)
def points(size):
    """An empty buffer of ``size`` points."""
    return np.empty((WIDTH, size), dtype=np.int64)


@njit(cache=True)
def grow_points(buf, size):
    """``buf`` copied into a buffer of at least ``size`` points (doubling), or ``buf`` if it has room."""
    if size <= buf.shape[1]:
        return buf
    out = np.empty((WIDTH, max(2 * buf.shape[1], size)), dtype=np.int64)
    out[:, : buf.shape[1]] = buf
    return out


@njit(cache=True)
def add_point(buf, m, peak, rec, end, nxt, kind):
    """Write point ``m`` (``buf`` has room)."""
    buf[PEAK, m] = peak
    buf[REC, m] = rec
    buf[END, m] = end
    buf[NEXT, m] = nxt
    buf[KIND, m] = kind


@njit(cache=True)
def add_suffix_points(cand, m, pool, s0, count, c, D, extra, rc, r, kind, limit):
    """The candidates of one segment ``[l, r]`` of ``kind`` with checkpoint ``c``, peak ``D``, held bytes
    ``extra`` for the suffix and recomputation ``rc``, over the suffix front ``pool[:, s0:s0 + count]``:
    the last suffix point whose peak ``extra`` does not lift above ``D`` (the segment's own peak decides),
    then every later one up to ``limit``. Returns ``(cand, m)``."""
    lo = 0
    hi = count
    while lo < hi:  # the first suffix point above D - extra (peaks ascend)
        mid = (lo + hi) // 2
        if extra + pool[PEAK, s0 + mid] <= D:
            lo = mid + 1
        else:
            hi = mid
    j = lo
    cand = grow_points(cand, m + count - j + 2)
    if j > 0:
        add_point(cand, m, c + D, rc + pool[REC, s0 + j - 1], r, s0 + j - 1, kind)
        m += 1
    while j < count and c + extra + pool[PEAK, s0 + j] <= limit:
        add_point(cand, m, c + extra + pool[PEAK, s0 + j], rc + pool[REC, s0 + j], r, s0 + j, kind)
        m += 1
        j += 1
    return cand, m


@njit(cache=True)
def keep_front(cand, m, pool, used):
    """Append to ``pool`` (from point ``used``) the Pareto front of the ``m`` candidates: by peak ascending
    (ties: least recomputation first), each point that recomputes less than every point before it.
    Returns ``(pool, used)``."""
    o1 = np.argsort(cand[REC, :m], kind="mergesort")
    o2 = o1[np.argsort(cand[PEAK, :m][o1], kind="mergesort")]
    pool = grow_points(pool, used + m)
    best = BIG
    for t in range(m):
        i = o2[t]
        if cand[REC, i] < best:
            best = cand[REC, i]
            for f in range(WIDTH):
                pool[f, used] = cand[f, i]
            used += 1
    return pool, used


@njit(cache=True)
def coarsen(pool, first, used, grain):
    """Keep, of the front ``pool[:, first:used]``, one point per ``grain``-wide bucket of peaks: the one that
    recomputes least (the last of the bucket, recomputation descending). Returns the new end."""
    keep = first
    for i in range(first, used):
        if i == used - 1 or pool[PEAK, i] // grain != pool[PEAK, i + 1] // grain:
            pool[:, keep] = pool[:, i]
            keep += 1
    return keep


@njit(cache=True)
def front_plans(pool, first, count, n):
    """The plans of the front ``pool[:, first:first + count]`` (a first state's): ``(peaks, recomputes,
    plans_flat, plan_offsets, stored_flat, stored_offsets)``; plan ``k``'s segment starts after 0 are
    ``plans_flat[plan_offsets[k]:plan_offsets[k + 1]]``, and likewise the starts of its stored segments."""
    peaks = pool[PEAK, first: first + count].copy()
    recs = pool[REC, first: first + count].copy()
    offsets = np.zeros(count + 1, dtype=np.int64)
    soffsets = np.zeros(count + 1, dtype=np.int64)
    flat = np.empty(max(1, count * n), dtype=np.int64)
    sflat = np.empty(max(1, count * n), dtype=np.int64)
    tot = 0
    stot = 0
    for t in range(count):
        idx = first + t
        start = 0
        while True:
            r = pool[END, idx]
            if pool[KIND, idx] == 1:
                sflat[stot] = start
                stot += 1
            if r == n - 1 or pool[NEXT, idx] < 0:
                break
            flat[tot] = r + 1
            tot += 1
            start = r + 1
            idx = pool[NEXT, idx]
        offsets[t + 1] = tot
        soffsets[t + 1] = stot
    return peaks, recs, flat[:tot].copy(), offsets, sflat[:stot].copy(), soffsets
