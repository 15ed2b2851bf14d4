"""Exact programs for cost models with side tensors (``docs/design.md`` §4-5).

With side tensors the peak is still a prefix objective once the state at a segment start
says which side tensors crossing it an earlier segment already holds (a bit mask over
:attr:`ckptopt.costs.SideArrays.blist`, at most 2^k values for k tensors open there) and
whether the previous segment is stored and keeps the chain tensor (``flag``). With
``V(l, flag, S)`` the lowest peak of layers ``l..n-1`` relative to what earlier segments hold::

    V(l, flag, S) = min over r, kind of c + max(D, held + extra + V(r + 1, flag', S'))

where ``c`` is the chain checkpoint the segment holds, ``D`` its peak with the side terms
(:func:`ckptopt.simulator.streams.side_terms`), ``held`` the side bytes it starts to hold for
later segments, ``S'`` the mask at ``r + 1``, ``extra`` what a stored segment keeps. Each
``D`` is computed from scratch in O(r - l): the program is O(n^3 2^k) in time. The Pareto
program (least recomputation, budgets, plans with stored segments) runs over the same states.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..simulator.kernels import BIG, NEG, held_checkpoint, plan_recompute, recompute_span, segment_peak_add
from ..simulator.streams import side_terms, simulate_plan_side
from .rows import grow

__all__ = ["state_offsets", "dp_side", "pareto_side", "brute_side"]


def state_offsets(SD, n: int) -> np.ndarray:
    """``off[l]``: index of state ``(l, flag=0, S=0)``; a boundary with k open side tensors has
    2 * 2^k states (``off[l] + flag * 2^k + S``); ``off[n]`` is the terminal state."""
    counts = np.diff(np.asarray(SD.bptr))[: n + 1]
    sizes = 2 * (1 << counts.astype(np.int64))
    off = np.zeros(n + 2, dtype=np.int64)
    off[1:] = np.cumsum(sizes)
    return off


@njit(cache=True)
def saved_floor(l, r, K):
    """A lower bound on the peak (relative) of any segment ``[l, r']`` with ``r' >= r`` of either kind,
    from layer ``r``'s backward alone when ``r`` saves a tensor: ``H(l, r)`` and the least of its
    backward terms, less the checkpoint (every side addend is non-negative). Taken as a running
    maximum over ``r`` it never decreases, so a solver stops growing a segment once it exceeds the
    best value found: O(n^2) segments become about n times the length of the useful ones."""
    if K.saves[r] == 0:
        return NEG
    q = K.qb[r]
    if K.qbk[r] < q:
        q = K.qbk[r]
    if K.qbf[r] < q:
        q = K.qbf[r]
    if K.qbr[r] < q:
        q = K.qbr[r]
    if K.qbkr[r] < q:
        q = K.qbkr[r]
    return K.P[r] - K.P[l] + q - K.ck[l]


@njit(cache=True)
def _segment(l, r, kind, flag, S, K, SD, fadd, radd, badd, mark):
    """(c, D, held, S2) of segment [l, r] of kind 0 checkpointed, 1 stored, 2 last."""
    unwrapped = kind != 0
    if flag:
        c = 0
        live_in = 0
    else:
        c = held_checkpoint(l, r, unwrapped, True, K)
        live_in = K.ck[l] - c if l > 0 else 0
    held, S2 = side_terms(l, r, unwrapped, S, K, SD, fadd, radd, badd, mark)
    D = segment_peak_add(l, r, unwrapped, True, K, live_in, flag != 0, fadd, radd, badd, True)[0]
    return c, D, held, S2


@njit(cache=True)
def dp_side(n, K, SD, off, allow_stored, max_work, fadd, radd, badd, mark):
    """Lowest peak (without static) and its plan: ``(value, starts_after_0, stored_starts)``.

    ``allow_stored``: segments other than the last may be left unwrapped (rotor's
    forward-all); otherwise every segment but the last is checkpointed (``dp``'s plan space).
    ``max_work`` (0: none): give up, returning value ``NEG``, once the segments scored add up to more
    than this many layers (each costs about its length).
    """
    total = off[n + 1]
    work = 0
    V = np.full(total, BIG, dtype=np.int64)
    choice_r = np.full(total, -1, dtype=np.int64)
    choice_k = np.zeros(total, dtype=np.int64)
    for l in range(n - 1, -1, -1):
        nb = SD.bptr[l + 1] - SD.bptr[l]
        for flag in range(2):
            if flag and (l == 0 or not allow_stored):
                continue
            for S in range(1 << nb):
                st = off[l] + flag * (1 << nb) + S
                best = BIG
                br = -1
                bk = 0
                floor = NEG
                for r in range(l, n):
                    fl = saved_floor(l, r, K)
                    if fl > floor:
                        floor = fl
                    if floor > best:  # no longer segment can do better (ties: kept, the longer wins)
                        break
                    work += r - l + 1
                    if max_work > 0 and work > max_work:
                        return np.int64(NEG), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
                    for kind in range(3):
                        if (kind == 2) != (r == n - 1):
                            continue
                        if kind == 1 and not allow_stored:
                            continue
                        c, D, held, S2 = _segment(l, r, kind, flag, S, K, SD, fadd, radd, badd, mark)
                        if kind == 2:
                            val = c + D
                        else:
                            nb2 = SD.bptr[r + 2] - SD.bptr[r + 1]
                            f2 = 1 if kind == 1 and K.sout[r] != 0 else 0
                            rest = V[off[r + 1] + f2 * (1 << nb2) + S2]
                            if rest >= BIG:
                                continue
                            rest += held
                            if kind == 1:
                                rest += K.P[r] - K.P[l] + K.keep[r]
                            val = c + (D if D > rest else rest)
                        if val <= best:  # ties: the longer segment
                            best = val
                            br = r
                            bk = kind
                V[st] = best
                choice_r[st] = br
                choice_k[st] = bk
    # walk the choices from (0, 0, 0)
    starts = np.empty(n, dtype=np.int64)
    stored = np.empty(n, dtype=np.int64)
    ns = 0
    nst = 0
    l = 0
    flag = 0
    S = 0
    while l < n:
        nb = SD.bptr[l + 1] - SD.bptr[l]
        st = off[l] + flag * (1 << nb) + S
        r = choice_r[st]
        kind = choice_k[st]
        if kind == 1:
            stored[nst] = l
            nst += 1
        c, D, held, S2 = _segment(l, r, kind, flag, S, K, SD, fadd, radd, badd, mark)
        if r < n - 1:
            starts[ns] = r + 1
            ns += 1
        flag = 1 if kind == 1 and K.sout[r] != 0 else 0
        S = S2
        l = r + 1
    return V[off[0]], starts[:ns], stored[:nst]


@njit(cache=True)
def pareto_side(n, K, SD, off, Cpre, cap, allow_stored, max_work, fadd, radd, badd, mark):
    """Every plan Pareto-optimal in (peak, recomputation) with relative peak <= cap, over the states
    of :func:`dp_side`. Returns ``(peaks, recomputes, plans_flat, plan_offsets, stored_flat,
    stored_offsets, complete)`` as :func:`ckptopt.solvers.pareto.pareto_plans` does."""
    total = off[n + 1]
    size = 1024
    pp = np.empty(size, dtype=np.int64)  # pool: peak, recompute, end r, next point, kind
    pr = np.empty(size, dtype=np.int64)
    pc = np.empty(size, dtype=np.int64)
    pn = np.empty(size, dtype=np.int64)
    pk = np.empty(size, dtype=np.int64)
    used = 0
    first = np.zeros(total, dtype=np.int64)
    count = np.zeros(total, dtype=np.int64)
    cp = np.empty(64, dtype=np.int64)
    cr = np.empty(64, dtype=np.int64)
    cc = np.empty(64, dtype=np.int64)
    cn = np.empty(64, dtype=np.int64)
    ck_ = np.empty(64, dtype=np.int64)
    work = 0
    for l in range(n - 1, -1, -1):
        nb = SD.bptr[l + 1] - SD.bptr[l]
        for flag in range(2):
            if flag and (l == 0 or not allow_stored):
                continue
            for S in range(1 << nb):
                st = off[l] + flag * (1 << nb) + S
                first[st] = used
                m = 0
                floor = NEG
                for r in range(l, n):
                    fl = saved_floor(l, r, K)
                    if fl > floor:
                        floor = fl
                    if floor > cap:  # every longer segment peaks above the cap
                        break
                    for kind in range(3):
                        if (kind == 2) != (r == n - 1):
                            continue
                        if kind == 1 and not allow_stored:
                            continue
                        c, D, held, S2 = _segment(l, r, kind, flag, S, K, SD, fadd, radd, badd, mark)
                        work += r - l + 1
                        if c + D > cap:
                            continue
                        need = m + 2
                        if kind == 2:
                            if need > cp.shape[0]:
                                cp, cr, cc, cn, ck_ = (grow(cp, need), grow(cr, need), grow(cc, need),
                                                       grow(cn, need), grow(ck_, need))
                            cp[m] = c + D
                            cr[m] = 0
                            cc[m] = r
                            cn[m] = -1
                            ck_[m] = 2
                            m += 1
                            continue
                        nb2 = SD.bptr[r + 2] - SD.bptr[r + 1]
                        f2 = 1 if kind == 1 and K.sout[r] != 0 else 0
                        nxt = off[r + 1] + f2 * (1 << nb2) + S2
                        extra = held + (K.P[r] - K.P[l] + K.keep[r] if kind == 1 else 0)
                        rc = 0
                        if kind == 0:
                            e = recompute_span(l, r, K)[1]
                            rc = Cpre[e + 1] - Cpre[l] if e >= l else 0
                        s0 = first[nxt]
                        kk = count[nxt]
                        lo = 0
                        hi = kk
                        while lo < hi:  # the first suffix point above D - extra
                            mid = (lo + hi) // 2
                            if extra + pp[s0 + mid] <= D:
                                lo = mid + 1
                            else:
                                hi = mid
                        j = lo
                        need = m + kk - j + 2
                        if need > cp.shape[0]:
                            cp, cr, cc, cn, ck_ = (grow(cp, need), grow(cr, need), grow(cc, need), grow(cn, need),
                                                   grow(ck_, need))
                        if j > 0:
                            cp[m] = c + D
                            cr[m] = rc + pr[s0 + j - 1]
                            cc[m] = r
                            cn[m] = s0 + j - 1
                            ck_[m] = kind
                            m += 1
                        while j < kk and c + extra + pp[s0 + j] <= cap:
                            cp[m] = c + extra + pp[s0 + j]
                            cr[m] = rc + pr[s0 + j]
                            cc[m] = r
                            cn[m] = s0 + j
                            ck_[m] = kind
                            m += 1
                            j += 1
                        if max_work > 0 and work + m > max_work:
                            e0 = np.empty(0, dtype=np.int64)
                            return e0, e0, e0, np.zeros(1, dtype=np.int64), e0, np.zeros(1, dtype=np.int64), False
                if m == 0:
                    count[st] = 0
                    continue
                work += m
                o1 = np.argsort(cr[:m], kind="mergesort")
                o2 = o1[np.argsort(cp[:m][o1], kind="mergesort")]
                if used + m > pp.shape[0]:
                    pp = grow(pp, used + m)
                    pr = grow(pr, used + m)
                    pc = grow(pc, used + m)
                    pn = grow(pn, used + m)
                    pk = grow(pk, used + m)
                best_r = BIG
                for t in range(m):
                    i = o2[t]
                    if cr[i] < best_r:
                        best_r = cr[i]
                        pp[used] = cp[i]
                        pr[used] = cr[i]
                        pc[used] = cc[i]
                        pn[used] = cn[i]
                        pk[used] = ck_[i]
                        used += 1
                count[st] = used - first[st]
    s0 = off[0]
    k0 = count[s0]
    peaks = pp[first[s0]: first[s0] + k0].copy()
    recs = pr[first[s0]: first[s0] + k0].copy()
    offsets = np.zeros(k0 + 1, dtype=np.int64)
    soffsets = np.zeros(k0 + 1, dtype=np.int64)
    flat = np.empty(max(1, k0 * n), dtype=np.int64)
    sflat = np.empty(max(1, k0 * n), dtype=np.int64)
    tot = 0
    stot = 0
    for t in range(k0):
        idx = first[s0] + t
        start = 0
        while True:
            r = pc[idx]
            if pk[idx] == 1:
                sflat[stot] = start
                stot += 1
            if r == n - 1 or pn[idx] < 0:
                break
            flat[tot] = r + 1
            tot += 1
            start = r + 1
            idx = pn[idx]
        offsets[t + 1] = tot
        soffsets[t + 1] = stot
    return peaks, recs, flat[:tot].copy(), offsets, sflat[:stot].copy(), soffsets, True


@njit(cache=True)
def brute_side(n, K, SD, Cpre, fadd, radd, badd, mark):
    """Every checkpoint-only plan; the lowest peak, then the least recomputation, then the smallest mask."""
    starts = np.empty(n, dtype=np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    best = BIG
    best_rec = BIG
    best_mask = 0
    for mask in range(1 << (n - 1)):
        starts[0] = 0
        m = 1
        for j in range(n - 1):
            if (mask >> j) & 1:
                starts[m] = j + 1
                m += 1
        v = simulate_plan_side(starts[:m], zeros[:m], n, K, SD, fadd, radd, badd, mark)[0]
        if v > best:
            continue
        rc = plan_recompute(starts[:m], zeros[:m], n, True, K, Cpre)
        if v < best or rc < best_rec:
            best = v
            best_rec = rc
            best_mask = mask
    out = np.empty(n, dtype=np.int64)
    m = 0
    for j in range(n - 1):
        if (best_mask >> j) & 1:
            out[m] = j + 1
            m += 1
    return best, best_rec, out[:m]



# --------------------------------------------------------------------------
# Python entry points (the arrays every kernel above takes)
# --------------------------------------------------------------------------
def _context(costs):
    from ..simulator.streams import side_scratch

    SD = costs.side_arrays
    return SD, state_offsets(SD, costs.n), side_scratch(costs.n, len(costs.side))


def lowest_peak(costs, allow_stored: bool = False) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(peak without static, checkpoints, stored)`` of the lowest-peak plan (exact)."""
    SD, off, scratch = _context(costs)
    value, starts, stored = dp_side(costs.n, costs.kernel_arrays, SD, off, bool(allow_stored), 0, *scratch)
    return int(value), tuple(int(x) for x in starts), tuple(int(x) for x in stored)


def solves_within(costs, max_work: int) -> bool:
    """Whether :func:`lowest_peak` finishes within ``max_work`` (segment layers scored): the
    side-tensor program is O(n^3 2^k) when nothing prunes (a peak in the loss), far less when
    the saved-bytes bound does, which only the costs tell."""
    SD, off, scratch = _context(costs)
    value, _, _ = dp_side(costs.n, costs.kernel_arrays, SD, off, False, int(max_work), *scratch)
    return int(value) != NEG


def front(costs, cap: int, allow_stored: bool, max_work: int):
    """The arrays of :func:`pareto_side` (relative cap)."""
    SD, off, scratch = _context(costs)
    return pareto_side(costs.n, costs.kernel_arrays, SD, off, costs.compute_prefix, int(cap), bool(allow_stored),
                       int(max_work), *scratch)


def brute(costs) -> tuple[int, tuple[int, ...]]:
    """``(peak without static, checkpoints)`` of the best checkpoint-only plan by trying each."""
    from ..simulator.streams import side_scratch

    value, _, plan = brute_side(costs.n, costs.kernel_arrays, costs.side_arrays, costs.compute_prefix,
                                *side_scratch(costs.n, len(costs.side)))
    return int(value), tuple(int(x) for x in plan)
