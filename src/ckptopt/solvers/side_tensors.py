"""Exact programs for cost models with side tensors (``docs/design.md`` §4-5).

With side tensors the peak is still a prefix objective once the state at a segment start
says which side tensors crossing it an earlier segment already holds (a bit mask over
:attr:`ckptopt.costs.SideArrays.blist`, at most 2^k values for k tensors open there) and
whether the previous segment is stored and keeps the chain tensor (``flag``). With
``V(l, flag, S)`` the lowest peak of layers ``l..n-1`` relative to what earlier segments hold::

    V(l, flag, S) = min over r, kind of c + max(D, held + extra + V(r + 1, flag', S'))

where ``c`` is the chain checkpoint the segment holds, ``D`` its peak with the side terms
(:func:`ckptopt.simulator.side_tensors.side_terms`), ``held`` the side bytes it starts to hold for
later segments, ``S'`` the mask at ``r + 1``, ``extra`` what a stored segment keeps. Each
``D`` is computed from scratch in O(r - l): the program is O(n^3 2^k) in time. A segment is scored
for every mask at once (:func:`_segment_masks`: each tensor open at ``l`` adds to the segment's
terms on its own, so ``k + 1`` passes and one addition per mask and term replace ``2^k`` passes;
the diffusers UNet at 8 tensors per cut, 346 layers, up to 8 open: 0.3 s, against 3.1 s mask by
mask). The Pareto program (least recomputation, budgets, plans with stored segments) runs over
the same states, dropping points no plan within its cap can use (:func:`min_held_side`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..simulator.kernels import BIG, NEG, recompute_span, segment_hold, segment_peak_add, segment_terms
from ..simulator.side_tensors import frame_split, joint_order, side_scratch, side_terms, side_terms_frame
from .fronts import add_point, add_suffix_points, coarsen, front_plans, grow_points, keep_front, points

__all__ = ["state_offsets", "unheld_bits", "dp_side", "pareto_side", "lowest_peak", "solves_within", "front"]

#: :func:`pareto_side` keeps the segments of one layer scored for at most this many (state, segment)
#: pairs at once (three int64 arrays: 48 MB); more masks are scored block by block.
MASK_BUFFER = 2_000_000


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
    if K.qbt[r] < q:  # (as the trigger: from its first read of a saved tensor on)
        q = K.qbt[r]
    if K.qbkt[r] < q:
        q = K.qbkt[r]
    return K.P[r] - K.P[l] + q - K.ck[l]


@njit(cache=True)
def _segment(l, r, kind, flag, S, K, SD, sc):
    """(c, D, held, S2) of segment [l, r] of kind 0 checkpointed, 1 stored, 2 last."""
    unwrapped = kind != 0
    c, live_in = segment_hold(l, r, unwrapped, flag != 0, True, K)
    held, S2 = side_terms(l, r, unwrapped, flag != 0, S, K, SD, sc)
    D = segment_peak_add(l, r, unwrapped, True, K, live_in, flag != 0, sc.fadd, sc.radd, sc.badd, True)[0]
    return c, D, held, S2


@njit(cache=True)
def _segment_masks(l, r, kind, flag, K, SD, sc, ms):
    """:func:`_segment` for every mask ``S`` at ``l`` at once: returns ``c`` and fills ``ms.D[S]``,
    ``ms.held[S]`` and ``ms.S2[S]`` for ``S < 2^nb`` (:class:`MaskScratch`).

    Every addend of a side tensor open at ``l`` and held by no earlier segment is its own (whether
    it is held, read or saved here does not depend on the others), so each term of the segment's
    peak (:func:`ckptopt.simulator.kernels.segment_terms`) is its value with every such tensor held
    before, plus one coefficient per tensor that is not (:func:`_mask_coefficients`); the frame's
    release, not linear in the bytes it holds (``max(pre + x, post)``), is two linear terms.
    Consecutive terms with the same coefficients are one (their largest, :func:`_merged_terms`), and
    each term is summed over all masks at once (one addition per mask, :func:`_over_masks`): ``nb + 1``
    passes of :func:`side_terms_frame` and O(terms x 2^nb), where the masks one by one take 2^nb
    passes. Exact: ``tests/test_side_tensors.py::test_segments_scored_for_every_mask_at_once`` checks
    it against :func:`_segment` for every mask."""
    unwrapped = kind != 0
    c, live_in = segment_hold(l, r, unwrapped, flag != 0, True, K)
    nb = SD.bptr[l + 1] - SD.bptr[l]
    held0, S20, frame0, fsv, anyframe = _mask_coefficients(l, r, unwrapped, flag, live_in, nb, K, SD, sc, ms)
    G = _merged_terms(l, r, flag, nb, fsv, frame0, anyframe, K, SD, sc.joint, ms)
    _over_masks(G, nb, held0, S20, ms)
    return c


@njit(cache=True)
def _mask_coefficients(l, r, unwrapped, flag, live_in, nb, K, SD, sc, ms):
    """The segment's terms with every open tensor held before (``ms.terms``), and per open tensor ``k``
    what not holding it adds to each term, to the held bytes and to the frame's bytes, and the bits it
    clears in the next mask (``ms.coef``, ``dheld``, ``framek``, ``drop``): one pass of
    :func:`side_terms_frame` with every tensor held, then one with each not. Returns ``(held0, S20,
    frame0, fsv, anyframe)``: that first pass's held bytes, next mask, frame bytes and frame layer, and
    whether any tensor changes the frame's bytes."""
    fadd, radd, badd, base3 = sc.fadd, sc.radd, sc.badd, ms.base3
    full = (1 << nb) - 1
    w = r - l + 1
    held0, S20, frame0, fsv = side_terms_frame(l, r, unwrapped, flag != 0, full, K, SD, sc, False)
    segment_terms(l, r, unwrapped, K, live_in, flag != 0, fadd, radd, badd, ms.terms)
    for i in range(l, r + 1):
        base3[i - l] = fadd[i]
        base3[w + i - l] = radd[i]
        base3[2 * w + i - l] = badd[i]
    anyframe = False
    for k in range(nb):
        hk, S2k, fk, _ = side_terms_frame(l, r, unwrapped, flag != 0, full ^ (1 << k), K, SD, sc, False)
        for i in range(l, r + 1):
            ms.coef[k, i - l] = fadd[i] - base3[i - l]
            ms.coef[k, w + i - l] = radd[i] - base3[w + i - l]
            ms.coef[k, 2 * w + i - l] = badd[i] - base3[2 * w + i - l]
        ms.dheld[k] = hk - held0
        ms.drop[k] = S20 & ~S2k
        ms.framek[k] = fk - frame0
        if ms.framek[k] != 0:
            anyframe = True
    return held0, S20, frame0, fsv, anyframe


@njit(cache=True)
def _add_group(ms, G, value, t, nb, frame):
    """Group ``G``: ``value`` plus per open tensor term ``t``'s coefficient (and the frame's, ``frame``)."""
    ms.gbase[G] = value
    for k in range(nb):
        ms.gcoef[G, k] = ms.coef[k, t] + (ms.framek[k] if frame else 0)
    return G + 1


@njit(cache=True)
def _merged_terms(l, r, flag, nb, fsv, frame0, anyframe, K, SD, jn, ms):
    """The segment's terms as groups (``ms.gbase`` plus ``ms.gcoef`` per open tensor not held before),
    consecutive terms with the same coefficients merged into one (their largest); the backward term of
    the layer that lets the frame go (``fsv``) becomes one group per release (the frame's, with the
    recomputed copies let go in one sequence with it, ``jn``) and one after the last. Returns how many."""
    w = r - l + 1
    terms = ms.terms
    joint = jn[0] >= 0  # (the frame layer's joint releases)
    tf = 2 * w + fsv - l if anyframe or frame0 != 0 or joint else -1  # (that backward term)
    G = 0
    for t in range(3 * w):
        v = terms[t]
        if v == NEG:
            continue
        if t == tf:
            x0 = frame0  # (frame0: recomputed copies let go with the frame)
            cnt = jn[0] if joint else 0
            if joint:  # (the checkpoint, counted held with ckf, is one of the frame's bytes)
                ckx = jn[1]
                v -= ckx + (K.ckf[l] if ckx else 0)
                x0 += ckx
            if cnt:
                # one sequence of releases (simulator.side_tensors._joint_add): a term per release, its peak
                # before it plus what is still held then (the frame's bytes, with its coefficients, up
                # to its own), and the peak after the last
                jpre, jpost, jorder = joint_order(SD, fsv, jn)
                top = jpre[cnt] if jpre[cnt] > jpost[cnt] else jpost[cnt]
                rest = x0
                for q in range(cnt):
                    rest += jn[4 + 3 * q]
                held_f = True
                for o in jorder:
                    G = _add_group(ms, G, v + jpre[o] - top + rest, t, nb, held_f)
                    if o == cnt:
                        rest -= x0
                        held_f = False
                    else:
                        rest -= jn[4 + 3 * o]
                G = _add_group(ms, G, v + jpost[jorder[cnt]] - top, t, nb, False)
                continue
            pre, post = frame_split(SD, fsv, l > 0 and flag == 0 and fsv == l)
            if SD.frame_known == 0:
                pre, post = 0, 0
            top = pre if pre > post else post
            # + max(pre + x, post) - top, x the frame's bytes: (pre - top + x) and (post - top)
            G = _add_group(ms, G, v + pre - top + x0, t, nb, True)
            if SD.frame_known != 0:
                G = _add_group(ms, G, v + post - top, t, nb, False)
            continue
        if G > 0 and t - 1 != tf:
            same = True
            for k in range(nb):
                if ms.gcoef[G - 1, k] != ms.coef[k, t]:
                    same = False
                    break
            if same:
                if v > ms.gbase[G - 1]:
                    ms.gbase[G - 1] = v
                continue
        G = _add_group(ms, G, v, t, nb, False)
    return G


@njit(cache=True)
def _over_masks(G, nb, held0, S20, ms):
    """Every mask's peak (the largest group, each summed over the masks in one addition per mask: mask
    ``S`` is ``S`` without its lowest bit, less that tensor's coefficient), held bytes and next mask."""
    ns = 1 << nb
    Dout, sums, lowk = ms.D, ms.sums, ms.lowk
    for S in range(ns):
        Dout[S] = NEG
    for g in range(G):
        tot = ms.gbase[g]
        for k in range(nb):
            tot += ms.gcoef[g, k]
        sums[0] = tot
        if tot > Dout[0]:
            Dout[0] = tot
        for S in range(1, ns):
            k = lowk[S]
            v = sums[S ^ (1 << k)] - ms.gcoef[g, k]
            sums[S] = v
            if v > Dout[S]:
                Dout[S] = v
    tot = held0
    lost = 0
    for k in range(nb):
        tot += ms.dheld[k]
        lost |= ms.drop[k]
    ms.held[0] = tot
    ms.S2[0] = S20 & ~lost
    for S in range(1, ns):
        k = lowk[S]
        ms.held[S] = ms.held[S ^ (1 << k)] - ms.dheld[k]
        ms.S2[S] = ms.S2[S ^ (1 << k)] | ms.drop[k]


class MaskScratch(NamedTuple):
    """The work arrays of :func:`_segment_masks` (``nb`` the most tensors open at a boundary, ``t`` the
    segment's terms), and its outputs per mask."""

    terms: np.ndarray  #: (t,) the segment's terms with every open tensor held by an earlier segment
    base3: np.ndarray  #: (t,) the side addends (forward, recompute, backward per layer) so
    coef: np.ndarray  #: (nb, t) what not holding open tensor k before adds to each term
    gbase: np.ndarray  #: (t,) the terms merged where their coefficients agree ...
    gcoef: np.ndarray  #: (t, nb) ... and their coefficients
    dheld: np.ndarray  #: (nb,) per open tensor: what not holding it before changes in the held bytes
    drop: np.ndarray  #: (nb,) ... the bits it clears in the mask at r + 1
    framek: np.ndarray  #: (nb,) ... the change in the bytes the checkpoint's frame holds
    lowk: np.ndarray  #: (2^nb,) per mask: its lowest set bit
    sums: np.ndarray  #: (2^nb,) per mask: a merged term's value (a running sum over the masks)
    D: np.ndarray  #: (2^nb,) out: per mask, the segment's peak
    held: np.ndarray  #: (2^nb,) out: per mask, the side bytes it starts to hold for later segments
    S2: np.ndarray  #: (2^nb,) out: per mask, the mask at r + 1


def mask_scratch(n: int, max_open: int, n_side: int) -> MaskScratch:
    """:class:`MaskScratch` for ``n`` layers, at most ``max_open`` tensors open at a boundary and
    ``n_side`` side tensors."""
    nb = max(max_open, 1)
    ns = 1 << nb
    lowk = np.zeros(ns, dtype=np.int64)
    for S in range(1, ns):
        lowk[S] = (S & -S).bit_length() - 1
    t = 3 * n + 4 + n_side  # (the frame layer's term: a row per release)

    def z(*shape):
        return np.zeros(shape, dtype=np.int64)
    return MaskScratch(terms=z(t), base3=z(t), coef=z(nb, t), gbase=z(t), gcoef=z(t, nb), dheld=z(nb), drop=z(nb),
                       framek=z(nb), lowk=lowk, sums=z(ns), D=z(ns), held=z(ns), S2=z(ns))


@njit(cache=True, nogil=True)
def dp_side(n, K, SD, off, unheld, allow_stored, max_work, sc, ms, stop):
    """Lowest peak (without static) and its plan: ``(value, starts_after_0, stored_starts)``.

    ``unheld[l]``: the state bits at ``l`` no plan sets (:func:`unheld_bits`); those states are
    skipped.

    ``allow_stored``: segments other than the last may be left unwrapped (rotor's
    forward-all); otherwise every segment but the last is checkpointed (``dp``'s plan space).
    ``max_work`` (0: none): give up, returning value ``NEG``, once the layer passes spent add up to
    more than this (a segment scored for one mask costs its length; for every mask at once, its
    length times the open tensors plus two, plus one per mask). ``stop[0]`` set (by another thread: the
    program runs without the GIL) gives up the same way.

    The states of one layer (every mask, a flag) grow their segments together (:func:`_best_segments`).
    """
    total = off[n + 1]
    V = np.full(total, BIG, dtype=np.int64)
    choice_r = np.full(total, -1, dtype=np.int64)
    choice_k = np.zeros(total, dtype=np.int64)
    nsmax = ms.sums.shape[0]
    best = np.empty(nsmax, dtype=np.int64)
    br = np.empty(nsmax, dtype=np.int64)
    bk = np.empty(nsmax, dtype=np.int64)
    work = 0
    for l in range(n - 1, -1, -1):
        ns = 1 << (SD.bptr[l + 1] - SD.bptr[l])
        for flag in range(2):
            if flag and (l == 0 or not allow_stored):
                continue
            work = _best_segments(l, flag, n, K, SD, off, unheld, allow_stored, max_work, work, V, sc, ms, best, br, bk,
                                  stop)
            if work < 0:
                return np.int64(NEG), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
            for S in range(ns):
                if S & unheld[l]:
                    continue
                st = off[l] + flag * ns + S
                V[st] = best[S]
                choice_r[st] = br[S]
                choice_k[st] = bk[S]
    starts, stored = _plan_of(n, K, SD, off, choice_r, choice_k, sc)
    return V[off[0]], starts, stored


@njit(cache=True)
def _best_segments(l, flag, n, K, SD, off, unheld, allow_stored, max_work, work, V, sc, ms, best, br, bk, stop):
    """For every mask ``S`` of layer ``l``'s states with ``flag``: the best value, last layer and kind of a
    segment starting there (``best``, ``br``, ``bk``), given the values ``V`` of the later states. The
    masks grow their segments together: each segment is scored for all masks still growing at once
    (:func:`_segment_masks`), or mask by mask (:func:`_segment`) once that is cheaper; a mask stops when the
    saved-bytes bound passes its best (ties: the longer segment). Returns the work spent so far, -1 past
    ``max_work``."""
    nb = SD.bptr[l + 1] - SD.bptr[l]
    ns = 1 << nb
    active = np.zeros(ns, dtype=np.bool_)
    nact = 0
    for S in range(ns):
        best[S] = BIG
        br[S] = -1
        bk[S] = 0
        active[S] = (S & unheld[l]) == 0  # (unreachable: V stays BIG)
        if active[S]:
            nact += 1
    floor = NEG
    for r in range(l, n):
        fl = saved_floor(l, r, K)
        if fl > floor:
            floor = fl
        for S in range(ns):
            if active[S] and floor > best[S]:  # no longer segment can do better
                active[S] = False
                nact -= 1
        if nact == 0:
            break
        w = r - l + 1
        masks = (nb + 2) * w + ns < nact * w  # (all masks at once, or the few left one by one)
        kinds = 1 if r == n - 1 or not allow_stored else 2
        work += kinds * ((nb + 2) * w + ns) if masks else w * nact
        if (max_work > 0 and work > max_work) or stop[0] != 0:
            return -1
        for kind in range(3):
            if not _takes(kind, r, n, allow_stored):
                continue
            c = _segment_masks(l, r, kind, flag, K, SD, sc, ms) if masks else 0
            nxt = _next_state(off, SD, K, r, kind) if kind != 2 else 0
            for S in range(ns):
                if not active[S]:
                    continue
                if masks:
                    D, held, S2 = ms.D[S], ms.held[S], ms.S2[S]
                else:
                    c, D, held, S2 = _segment(l, r, kind, flag, S, K, SD, sc)
                if kind == 2:
                    val = c + D
                else:
                    rest = V[nxt + S2]
                    if rest >= BIG:
                        continue
                    rest += held
                    if kind == 1:
                        rest += K.P[r] - K.P[l] + K.keep[r]
                    val = c + (D if D > rest else rest)
                if val <= best[S]:  # ties: the longer segment
                    best[S] = val
                    br[S] = r
                    bk[S] = kind
    return work


@njit(cache=True)
def _takes(kind, r, n, allow_stored):
    """Whether a segment ending at ``r`` may be of ``kind``: the last (2) exactly when it ends at ``n - 1``,
    stored (1) only where stored segments are allowed."""
    if (kind == 2) != (r == n - 1):
        return False
    return kind != 1 or allow_stored


@njit(cache=True)
def _plan_of(n, K, SD, off, choice_r, choice_k, sc):
    """The plan the choices make from state ``(0, 0, 0)``: ``(starts after 0, stored starts)``."""
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
        c, D, held, S2 = _segment(l, r, kind, flag, S, K, SD, sc)
        if r < n - 1:
            starts[ns] = r + 1
            ns += 1
        flag = 1 if kind == 1 and K.sout[r] != 0 else 0
        S = S2
        l = r + 1
    return starts[:ns], stored[:nst]


@njit(cache=True, nogil=True)
def min_held_side(n, K, SD, off, unheld, cap, allow_stored, max_work, sc, ms, stop):
    """``(H, work)``: ``H[st]`` the least bytes (checkpoints, side tensors, stored segments' saves)
    that any plan whose segments before state ``st``'s layer all fit within ``cap`` holds there
    (``BIG``: no such plan reaches it), as :func:`ckptopt.solvers.pareto.min_held_prefix` without
    side tensors. A suffix point above ``cap - H[st]`` is in no plan within the cap. A forward pass
    over the states, each segment scored as in :func:`dp_side`; ``work`` is ``-1`` past ``max_work`` or
    once ``stop[0]`` is set."""
    total = off[n + 1]
    if cap >= BIG // 2:  # no cap: nothing to prune, every state may be reached
        return np.zeros(total, dtype=np.int64), np.int64(0)
    H = np.full(total, BIG, dtype=np.int64)
    H[off[0]] = 0
    work = 0
    Dm, Hm, S2m = ms.D, ms.held, ms.S2
    for l in range(n - 1):  # (a segment from n - 1 is the last: no state after it)
        nb = SD.bptr[l + 1] - SD.bptr[l]
        ns = 1 << nb
        for flag in range(2):
            if flag and (l == 0 or not allow_stored):
                continue
            hmin = BIG
            nreach = 0
            for S in range(ns):
                h = H[off[l] + flag * ns + S]
                if h < BIG:
                    nreach += 1
                    if h < hmin:
                        hmin = h
            if nreach == 0:
                continue
            floor = NEG
            for r in range(l, n - 1):
                fl = saved_floor(l, r, K)
                if fl > floor:
                    floor = fl
                if floor > cap - hmin:  # no longer segment fits after any prefix that reaches l
                    break
                w = r - l + 1
                masks = (nb + 2) * w + ns < nreach * w
                kinds = 2 if allow_stored else 1
                work += kinds * ((nb + 2) * w + ns) if masks else kinds * w * nreach
                if (max_work > 0 and work > max_work) or stop[0] != 0:
                    return H, np.int64(-1)
                for kind in range(2):
                    if kind == 1 and not allow_stored:
                        continue
                    c = 0
                    if masks:
                        c = _segment_masks(l, r, kind, flag, K, SD, sc, ms)
                    kept = K.P[r] - K.P[l] + K.keep[r] if kind == 1 else 0
                    nxt = _next_state(off, SD, K, r, kind)
                    for S in range(ns):
                        h = H[off[l] + flag * ns + S]
                        if h >= BIG:
                            continue
                        if masks:
                            D = Dm[S]
                            held = Hm[S]
                            S2 = S2m[S]
                        else:
                            c, D, held, S2 = _segment(l, r, kind, flag, S, K, SD, sc)
                        if h + c + D > cap:
                            continue
                        h2 = h + c + held + kept
                        if h2 < H[nxt + S2]:
                            H[nxt + S2] = h2
    return H, np.int64(work)


@njit(cache=True, nogil=True)
def pareto_side(n, K, SD, off, unheld, Cpre, cap, allow_stored, max_work, grain, sc, ms, stop):
    """Every plan Pareto-optimal in (peak, recomputation) with relative peak <= cap, over the states
    of :func:`dp_side`. Returns ``(peaks, recomputes, plans_flat, plan_offsets, stored_flat,
    stored_offsets, complete)`` as :func:`ckptopt.solvers.pareto.pareto_plans` does.

    The segments of one layer's states are scored for every mask at once (:func:`_segment_masks`,
    kept for a block of masks at a time, at most ``MASK_BUFFER`` values) where more of its states are
    reached within the cap than that costs passes, mask by mask otherwise; then each state builds its
    front from its segments' candidates (:func:`~ckptopt.solvers.fronts.add_suffix_points`,
    :func:`~ckptopt.solvers.fronts.keep_front`); ``work`` counts as mask by mask. Points that no
    plan within the cap can use (above ``cap`` less the least any prefix holds there,
    :func:`min_held_side`) are dropped.

    ``grain`` > 0: an approximate front, bounded in size: each state keeps, of its points whose
    relative peaks fall in one ``grain``-wide bucket, only the one that recomputes least. Peaks and
    recomputations stay those of real plans (a plan returned fits the cap); what may be lost is a
    plan with less recomputation. ``stop[0]`` set (by another thread: the program runs without the GIL)
    gives up as past ``max_work``."""
    total = off[n + 1]
    pool = points(1024)  # every state's front (fronts.py)
    used = 0
    first = np.zeros(total, dtype=np.int64)
    count = np.zeros(total, dtype=np.int64)
    cand = points(64)  # the candidates of one state
    Hmin, work = min_held_side(n, K, SD, off, unheld, cap, allow_stored, max_work, sc, ms, stop)
    if work < 0:
        return _no_front()
    floors = np.empty(n, dtype=np.int64)
    for l in range(n - 1, -1, -1):
        nb = SD.bptr[l + 1] - SD.bptr[l]
        ns = 1 << nb
        hmin = BIG
        for st in range(off[l], off[l + 1]):
            first[st] = used
            if Hmin[st] < hmin:
                hmin = Hmin[st]
        if hmin >= BIG:  # no plan within the cap reaches layer l
            continue
        # the segments [l, r] some state may take: beyond rlast every one peaks above the cap
        rlast = l - 1
        floor = NEG
        for r in range(l, n):
            fl = saved_floor(l, r, K)
            if fl > floor:
                floor = fl
            if floor > cap - hmin:
                break
            floors[r - l] = floor
            rlast = r
        rows = 3 * (rlast - l + 1)
        masks = ns > nb + 1 and rows > 0
        block = ns
        if masks and rows * ns > MASK_BUFFER:
            block = max(1, MASK_BUFFER // rows)
        cb = np.empty(max(rows, 1), dtype=np.int64)
        Db = np.empty((max(rows, 1), block if masks else 1), dtype=np.int64)
        Hb = np.empty_like(Db)
        Sb = np.empty_like(Db)
        for flag in range(2):
            if flag and (l == 0 or not allow_stored):
                continue
            # every mask at once costs nb + 2 passes per segment, mask by mask one per state reached; at a cap
            # near the optimum few are (on a Llama of 138 layers, 256 of 7,344 states)
            at_once = masks and _reached(Hmin, off[l] + flag * ns, ns, unheld[l]) > nb + 2
            for S in range(ns):
                st = off[l] + flag * ns + S
                first[st] = used
                if at_once and S % block == 0:  # the next block of masks: every segment scored for them
                    if not _score_block(l, flag, S, ns, block, rlast, n, allow_stored, Hmin, st, K, SD, sc, ms, cb, Db,
                                        Hb, Sb):
                        continue  # (no state of the block is reached: all BIG)
                if S & unheld[l] or Hmin[st] >= BIG:
                    continue  # (unreachable, or only past the cap: no points)
                limit = cap - Hmin[st]  # a suffix point above it is in no plan within the cap
                m = 0
                for r in range(l, rlast + 1):  # the state's candidates: each segment over its suffix front
                    if floors[r - l] > limit:
                        break
                    for kind in range(3):
                        if not _takes(kind, r, n, allow_stored):
                            continue
                        if at_once:
                            q = 3 * (r - l) + kind
                            c, D, held, S2 = cb[q], Db[q, S % block], Hb[q, S % block], Sb[q, S % block]
                        else:
                            c, D, held, S2 = _segment(l, r, kind, flag, S, K, SD, sc)
                        work += r - l + 1
                        if c + D > limit:
                            continue
                        if kind == 2:
                            cand = grow_points(cand, m + 2)
                            add_point(cand, m, c + D, 0, r, -1, 2)
                            m += 1
                            continue
                        # (the next state and the recomputation written out: a call passing the kernel and side
                        # arrays per state and segment costs time here, as _next_state and recompute_span say)
                        nb2 = SD.bptr[r + 2] - SD.bptr[r + 1]
                        nxt = off[r + 1] + (1 << nb2 if kind == 1 and K.sout[r] != 0 else 0) + S2
                        extra = held + (K.P[r] - K.P[l] + K.keep[r] if kind == 1 else 0)
                        rc = 0
                        if kind == 0:
                            e = recompute_span(l, r, K)[1]
                            rc = (Cpre[e + 1] - Cpre[l] if e >= l else 0) + K.cseg[l]
                        cand, m = add_suffix_points(cand, m, pool, first[nxt], count[nxt], c, D, extra, rc, r, kind,
                                                    limit)
                        if (max_work > 0 and work + m > max_work) or stop[0] != 0:
                            return _no_front()
                if m > 0:
                    work += m
                    pool, used = keep_front(cand, m, pool, used)
                    if grain > 0:  # one point per peak bucket: its least recomputation (an approximate front)
                        used = coarsen(pool, first[st], used, grain)
                count[st] = used - first[st]
    peaks, recs, flat, offsets, sflat, soffsets = front_plans(pool, first[off[0]], count[off[0]], n)
    return peaks, recs, flat, offsets, sflat, soffsets, True


@njit(cache=True)
def _reached(Hmin, st0, ns, unheld):
    """How many of the ``ns`` states from ``st0`` (one layer and flag) a plan within the cap reaches."""
    count = 0
    for S in range(ns):
        if not S & unheld and Hmin[st0 + S] < BIG:
            count += 1
    return count


@njit(cache=True)
def _no_front():
    """What :func:`pareto_side` returns when it gives up (``complete`` False)."""
    e0 = np.empty(0, dtype=np.int64)
    return e0, e0, e0, np.zeros(1, dtype=np.int64), e0, np.zeros(1, dtype=np.int64), False


@njit(cache=True)
def _score_block(l, flag, S, ns, block, rlast, n, allow_stored, Hmin, st, K, SD, sc, ms, cb, Db, Hb, Sb):
    """Score every segment ``[l, r]`` (``r <= rlast``) for the block of masks from ``S`` (state ``st``) at once
    (:func:`_segment_masks`), into ``cb`` (the checkpoint) and ``Db``, ``Hb``, ``Sb`` (peak, held bytes, next
    mask per mask of the block), row ``3 (r - l) + kind``. False, scoring nothing, when no state of the
    block is reached within the cap."""
    reached = False
    for t in range(block):
        if S + t < ns and Hmin[st + t] < BIG:
            reached = True
    if not reached:
        return False
    for r in range(l, rlast + 1):
        for kind in range(3):
            if not _takes(kind, r, n, allow_stored):
                continue
            q = 3 * (r - l) + kind
            cb[q] = _segment_masks(l, r, kind, flag, K, SD, sc, ms)
            for t in range(block):
                if S + t < ns:
                    Db[q, t] = ms.D[S + t]
                    Hb[q, t] = ms.held[S + t]
                    Sb[q, t] = ms.S2[S + t]
    return True


@njit(cache=True)
def _next_state(off, SD, K, r, kind):
    """The state after a segment ending at ``r`` with no side tensor held: layer ``r + 1``, flagged when the
    segment is stored and keeps its output (``x_r`` is held, not a checkpoint); the mask of the side tensors
    held then is added to it."""
    nb2 = SD.bptr[r + 2] - SD.bptr[r + 1]
    f2 = 1 if kind == 1 and K.sout[r] != 0 else 0
    return off[r + 1] + f2 * (1 << nb2)


# --------------------------------------------------------------------------
# Python entry points (the arrays every kernel above takes)
# --------------------------------------------------------------------------
def unheld_bits(SD, n: int) -> np.ndarray:
    """``out[l]``: the bits of the state mask at boundary ``l`` that no plan sets. A value made
    before the first layer (a hoisted mask, producer -1) is held by an earlier segment only once
    one of its readers ran: before its first reader its bit is always clear, so the states with
    it set are never reached (BART's decoder masks at every encoder boundary)."""
    out = np.zeros(n + 1, dtype=np.int64)
    for l in range(n + 1):
        b0 = SD.bptr[l]
        for k in range(SD.bptr[l + 1] - b0):
            j = SD.blist[b0 + k]
            if SD.sp[j] < 0 and SD.cu[SD.cptr[j]] >= l:
                out[l] |= 1 << k
    return out


def _context(costs):
    """``(SD, off, unheld, sc, ms)``: what every program of this module takes besides the kernel arrays."""
    SD = costs.side_arrays
    n = costs.n
    max_open = int(np.diff(np.asarray(SD.bptr)).max()) if n else 0
    return (SD, state_offsets(SD, n), unheld_bits(SD, n), side_scratch(n, len(costs.side)),
            mask_scratch(n, max_open, len(costs.side)))


def _memo(costs) -> dict:
    """Results of :func:`lowest_peak` kept with the cost model (immutable, like its arrays): the
    tracer's trial run (:func:`solves_within`) is the solve that follows it."""
    return costs.__dict__.setdefault("_lowest_peak", {})


def lowest_peak(costs, allow_stored: bool = False) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(peak without static, checkpoints, stored)`` of the lowest-peak plan (exact)."""
    memo = _memo(costs)
    if bool(allow_stored) not in memo:
        SD, off, unheld, sc, ms = _context(costs)
        value, starts, stored = dp_side(costs.n, costs.kernel_arrays, SD, off, unheld, bool(allow_stored), 0, sc, ms,
                                        np.zeros(1, dtype=np.int64))
        memo[bool(allow_stored)] = (int(value), tuple(int(x) for x in starts), tuple(int(x) for x in stored))
    return memo[bool(allow_stored)]


def solves_within(costs, max_work: int, stop: np.ndarray | None = None) -> bool:
    """Whether :func:`lowest_peak` finishes within ``max_work`` (layer passes, :func:`dp_side`): the
    side-tensor program is O(n^3 2^k) when nothing prunes (a peak in the loss), far less when
    the saved-bytes bound does, which only the costs tell. A run that finishes is kept as
    :func:`lowest_peak`'s answer. ``stop``: a one-element array another thread sets to 1 to end the run
    early (False then); the program releases the GIL, so trials can run beside other work."""
    SD, off, unheld, sc, ms = _context(costs)
    stop = np.zeros(1, dtype=np.int64) if stop is None else stop
    value, starts, stored = dp_side(costs.n, costs.kernel_arrays, SD, off, unheld, False, int(max_work), sc, ms, stop)
    if int(value) == NEG:
        return False
    _memo(costs)[False] = (int(value), tuple(int(x) for x in starts), tuple(int(x) for x in stored))
    return True


def front(costs, cap: int, allow_stored: bool, max_work: int, grain: int = 0, stop: np.ndarray | None = None):
    """The arrays of :func:`pareto_side` (relative cap; ``grain`` > 0: approximate, see there; ``stop``: a
    one-element array another thread sets to 1 to end the run as past ``max_work``)."""
    SD, off, unheld, sc, ms = _context(costs)
    stop = np.zeros(1, dtype=np.int64) if stop is None else stop
    return pareto_side(costs.n, costs.kernel_arrays, SD, off, unheld, costs.compute_prefix, int(cap), bool(allow_stored),
                       int(max_work), int(grain), sc, ms, stop)
