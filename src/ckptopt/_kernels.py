"""Compiled (numba, nopython) hot loops shared by the simulator and the solvers.

Every kernel reads the tuple ``K = (P, qb, ck, qf, fw, f, G, a, runs, saves, sin, qs, fs, keep,
sout, rb, ext, qbk)`` built by :attr:`ckptopt.ChainCosts.kernel_arrays` (all int64), plus ``full``
(False for the additive form, where only the backward term exists).

Memory-model note (DESIGN.md section 3), relative to the static bytes and to
the checkpoints held by earlier segments, for a segment ``[l, r]`` with
``H(l, i) = P[i] - P[l]`` (what layers ``l..i-1`` leave saved, by storage):

* backward at layer i:            ``H(l, i) + qb[i]``; in a checkpointed segment,
  ``qb[i]`` alone for the trailing layers after its last saving layer ``j``
  (their backward reads no saved tensor, so it runs before the recomputation)
* forward at i (wrapped segment): ``f[l]`` at ``i = l``, ``fw[i]`` after
* recompute at i:                 ``rb[r] + (f[l] | H(l, i) + qf[i])``, where
  ``rb[r] = G[j] + rg[j]`` is what the backward holds when layer ``j`` first
  reads a saved tensor (``G[r] + a[r]`` when ``j = r`` reads first thing)
  for ``i`` up to the last layer the recomputation runs (it stops once the
  last tensor the segment saves is rebuilt: at the last layer that saves a
  tensor it produces, a last layer that only saves its input is not run),
  where that last layer counts its transient only up to its last saved
  tensor (``fs``/``qs`` instead of ``f``/``qf``)
* forward at i of the last, unwrapped segment: ``f[l] | H(l, i) + qf[i]``
  (it keeps what it saves instead of recomputing).

The plan's peak is ``static + max_k (sum_{j=1..k} c_j + D(l_k, r_k))`` where
``c_j`` is the checkpoint segment ``j`` holds (DESIGN.md section 4, measured):
a checkpointed segment holds its input ``ck[l]`` only if it saves at least
one tensor, and the unwrapped last segment only if its first layer saves its
input. An input nothing holds is still live while the segment's first layer
runs, so the forward term at ``i = l`` then adds it (``live_in``).
Phase codes: 0 forward, 1 recompute, 2 backward.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NEG = -(1 << 62)
BIG = 1 << 62


@njit(cache=True)
def held_checkpoint(l, r, last, full, K):
    """Bytes segment [l, r] holds as its checkpoint (0 for the first segment). O(r - l)."""
    ck, saves, sin = K[2], K[9], K[10]
    if l == 0:
        return 0
    if not full:
        return ck[l]
    if last:
        return ck[l] if sin[l] != 0 else 0
    for i in range(l, r + 1):
        if saves[i] != 0:
            return ck[l]
    return 0


@njit(cache=True)
def segment_peak(l, r, last, full, K, live_in):
    """(peak, phase, layer) of segment [l, r] relative to its checkpoints. O(r - l).

    ``live_in``: bytes of the segment's input that no checkpoint holds but that
    are live while its first layer runs forward.
    """
    P, qb, ck, qf, fw, f, G, a, runs, saves, sin, qs, fs, keep, sout, rb, ext, qbk = K
    Pl = P[l]
    best = NEG
    phase = -1
    layer = -1
    trigger = r  # backward terms after this layer are taken without the segment's saves
    if full:
        if last:
            v = f[l] + live_in
            if v > best:
                best, phase, layer = v, 0, l
            for i in range(l + 1, r + 1):
                v = P[i] - Pl + qf[i]
                if v > best:
                    best, phase, layer = v, 0, i
        else:
            v = f[l] + live_in
            if v > best:
                best, phase, layer = v, 0, l
            for i in range(l + 1, r + 1):
                v = fw[i]
                if v > best:
                    best, phase, layer = v, 0, i
            for i in range(r, l - 1, -1):
                if saves[i] != 0:
                    trigger = i  # layers after it save nothing: their backward runs before the recomputation
                    break
            else:
                trigger = l - 1
            e = l - 1  # the last layer the recomputation reaches: it re-packs dead tensors too
            if trigger >= l:
                for i in range(r, trigger - 1, -1):
                    if ext[i] != 0:
                        e = i
                        break
            partial = e >= l and runs[e] != 0  # layer e runs only up to its last saved tensor
            if e >= l and runs[e] == 0:
                e -= 1  # e only saves its input: the layer before it runs to its end
            if e >= l:
                base = rb[r]
                for i in range(l, e + 1):
                    stop = partial and i == e
                    if i == l:
                        v = base + (fs[l] if stop else f[l])
                    else:
                        v = base + P[i] - Pl + (qs[i] if stop else qf[i])
                    if v > best:
                        best, phase, layer = v, 1, i
    for i in range(r, l - 1, -1):
        q = qb[i]
        if i == l and l > 0 and not last:  # its input stays held by the checkpoint
            q = qbk[i]
        v = P[i] - Pl + q if i <= trigger else q
        if v > best:
            best, phase, layer = v, 2, i
    return best, phase, layer


@njit(cache=True)
def simulate_plan(starts, stored, n, full, K):
    """Peak of the plan whose segments start at ``starts`` (sorted, starts[0] == 0).

    ``stored[k] != 0``: segment ``k`` (not the last) is left unwrapped: it runs
    like the last segment (keeps what its layers save, no recomputation) and
    holds those tensors, ``P[r] - P[l] + keep[r]``, while every later segment
    runs; when it keeps its output, the next segment's input is already held.
    Returns (peak without static, phase, layer, segment). O(n).
    """
    ck = K[2]
    P, keep, sout = K[0], K[13], K[14]
    held = 0
    best = NEG
    phase = -1
    layer = -1
    seg = -1
    m = starts.shape[0]
    prev_keeps = False
    for k in range(m):
        l = starts[k]
        r = starts[k + 1] - 1 if k + 1 < m else n - 1
        last = k == m - 1
        st = last or stored[k] != 0
        if prev_keeps:
            c = 0
            live_in = 0
        else:
            c = held_checkpoint(l, r, st, full, K)
            live_in = ck[l] - c if k > 0 else 0
        held += c
        v, ph, ly = segment_peak(l, r, st, full, K, live_in)
        v += held
        if v > best:
            best, phase, layer, seg = v, ph, ly, k
        if st and not last:
            held += P[r] - P[l] + keep[r]
            prev_keeps = sout[r] != 0
        else:
            prev_keeps = False
    return best, phase, layer, seg


@njit(cache=True)
def _plan_from_choice(choice, n):
    out = np.empty(n, dtype=np.int64)
    m = 0
    l = 0
    while l < n:
        if l > 0:
            out[m] = l
            m += 1
        l = choice[l] + 1
    return out[:m]


@njit(cache=True)
def dp_cubic(n, full, K):
    """O(n^3) dynamic program: every segment cost recomputed from scratch.

    V(l) = min_r c(l, r) + max(D(l, r), V(r+1)), with c(l, r) the checkpoint
    the segment holds; D(l, n-1) is the unwrapped last segment and V(n) = -inf.
    Returns (optimum without static, checkpoints).
    """
    ck = K[2]
    V = np.empty(n + 1, dtype=np.int64)
    V[n] = NEG
    choice = np.empty(n, dtype=np.int64)
    for l in range(n - 1, -1, -1):
        bestv = BIG
        bestr = -1
        for r in range(l, n):
            last = r == n - 1
            c = held_checkpoint(l, r, last, full, K)
            D = segment_peak(l, r, last, full, K, ck[l] - c if l > 0 else 0)[0]
            rest = V[r + 1]
            val = c + (D if D > rest else rest)
            if val <= bestv:  # ties: the longest segment
                bestv = val
                bestr = r
        V[l] = bestv
        choice[l] = bestr
    return V[0], _plan_from_choice(choice, n)


@njit(cache=True)
def segment_row(l, n, full, K, Cpre, Dc, Ds, hold, rec):
    """Every segment ``[l, r]``, r = l..n-1, in O(n - l): each entry costs O(1)
    after the previous one (running maxima; the recomputation term is ``rb[r]``
    plus a running maximum taken up to the last layer the recomputation
    runs, which only moves forward with ``r``).

    Fills, relative to the segment's checkpoints and without the live-input
    term (the caller adds ``ck[l] + f[l]`` when nothing holds the input):

    * ``Dc[r]``: peak of the segment checkpointed (r < n-1);
    * ``Ds[r]``: peak of the segment run unwrapped (the last segment, or a
      stored one): its forward keeps what it saves, no recomputation;
    * ``hold[r]``: the checkpoint it holds when checkpointed (DESIGN.md
      section 4; the unwrapped hold is ``ck[l]`` if ``sin[l]``, for any r);
    * ``rec[r]``: the compute it re-runs when checkpointed, from the prefix
      sums ``Cpre`` of the per-layer compute.
    """
    P, qb, ck, qf, fw, f, G, a, runs, saves, sin, qs, fs, keep, sout, rb, ext, qbk = K
    Pl = P[l]
    bwd = NEG
    bwdc = NEG  # the same for the segment checkpointed: its first layer's input stays held
    bwd_j = NEG  # checkpointed: backward terms up to the last saving layer (with the saves) ...
    tail = NEG  # ... and after it (without: they run before the recomputation)
    fwdw = f[l]  # wrapped forward, running max
    pm = f[l]  # running max of the live-forward term (recompute / unwrapped forward)
    pm_prev = NEG
    e_pm = NEG  # pm up to the last layer the recomputation runs
    has_e = False
    seg_saves = False
    e = l - 1  # last layer the recomputation runs
    for r in range(l, n):
        v = P[r] - Pl + qb[r]
        vc = v
        if r == l and l > 0:
            vc = qbk[l]  # the checkpoint holds the input through the first layer's backward
        if v > bwd:
            bwd = v
        if vc > bwdc:
            bwdc = vc
        if saves[r] != 0:
            seg_saves = True
            bwd_j = bwdc
            tail = NEG
        else:
            qt = qbk[l] if r == l and l > 0 else qb[r]
            if qt > tail:
                tail = qt
        if full:
            if r > l:
                if fw[r] > fwdw:
                    fwdw = fw[r]
                pm_prev = pm
                v = P[r] - Pl + qf[r]
                if v > pm:
                    pm = v
            if ext[r] != 0 and seg_saves:  # a recomputation happens and reaches layer r
                if runs[r] != 0:
                    # the recomputation ends inside layer r, at its last saved tensor
                    v = fs[l] if r == l else P[r] - Pl + qs[r]
                    e_pm = pm_prev if r > l else NEG
                    if v > e_pm:
                        e_pm = v
                    has_e = True
                    e = r
                elif r > l:
                    e_pm = pm_prev
                    has_e = True
                    e = r - 1
            Ds[r] = bwd if bwd > pm else pm
            d = bwd_j if bwd_j > tail else tail
            if fwdw > d:
                d = fwdw
            if has_e:
                v = rb[r] + e_pm
                if v > d:
                    d = v
            Dc[r] = d
        else:
            Ds[r] = bwd
            Dc[r] = bwd
            e = r
        if l == 0:
            hold[r] = 0
        elif not full:
            hold[r] = ck[l]
        else:
            hold[r] = ck[l] if seg_saves else 0
        rec[r] = 0 if e < l else Cpre[e + 1] - Cpre[l]


@njit(cache=True)
def _unwrapped_hold(l, full, K):
    ck, sin = K[2], K[10]
    if l == 0:
        return 0
    if not full:
        return ck[l]
    return ck[l] if sin[l] != 0 else 0


@njit(cache=True)
def dp_quadratic(n, full, K):
    """Exact O(n^2) program: the recurrence of dp_cubic, D(l, r) extended as r grows."""
    ck, f = K[2], K[5]
    V = np.empty(n + 1, dtype=np.int64)
    V[n] = NEG
    choice = np.empty(n, dtype=np.int64)
    Dc = np.empty(n, dtype=np.int64)
    Ds = np.empty(n, dtype=np.int64)
    hold = np.empty(n, dtype=np.int64)
    rec = np.empty(n, dtype=np.int64)
    Cpre = np.zeros(n + 1, dtype=np.int64)
    for l in range(n - 1, -1, -1):
        segment_row(l, n, full, K, Cpre, Dc, Ds, hold, rec)
        bestv = BIG
        bestr = -1
        for r in range(l, n):
            if r == n - 1:
                c = _unwrapped_hold(l, full, K)
                d = Ds[r]
            else:
                c = hold[r]
                d = Dc[r]
            if l > 0 and c == 0:
                v = ck[l] + f[l]  # the input is live while the first layer runs
                if v > d:
                    d = v
            rest = V[r + 1]
            val = c + (d if d > rest else rest)
            if val <= bestv:
                bestv = val
                bestr = r
        V[l] = bestv
        choice[l] = bestr
    return V[0], _plan_from_choice(choice, n)


@njit(cache=True)
def _grow(arr, size):
    out = np.empty(max(2 * arr.shape[0], size), dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


@njit(cache=True)
def _with_live_in(l, c, flag, d, K):
    """A segment that holds nothing of its input still has it live while its first layer runs."""
    ck, f = K[2], K[5]
    if l > 0 and c == 0 and flag == 0:
        v = ck[l] + f[l]
        if v > d:
            return v
    return d


@njit(cache=True)
def min_held_prefix(n, full, K, Cpre, cap, allow_stored):
    """``Hmin[2*l + flag]``: the least bytes held before layer ``l`` over the
    plans whose segments before ``l`` all stay within ``cap`` (BIG when none);
    ``flag`` = 1 when the segment before ``l`` is stored and keeps ``x_{l-1}``.

    A lower bound on what any plan within ``cap`` holds there: a smaller held
    amount admits every continuation a larger one admits, so the minimum over
    predecessors is exact for reachability. O(n^2).
    """
    P, keep, sout = K[0], K[13], K[14]
    Hmin = np.full(2 * n + 2, BIG, dtype=np.int64)
    Hmin[0] = 0
    Dc = np.empty(n, dtype=np.int64)
    Ds = np.empty(n, dtype=np.int64)
    hold = np.empty(n, dtype=np.int64)
    rec = np.empty(n, dtype=np.int64)
    for l in range(n - 1):
        if Hmin[2 * l] >= BIG and Hmin[2 * l + 1] >= BIG:
            continue
        segment_row(l, n, full, K, Cpre, Dc, Ds, hold, rec)
        hu = _unwrapped_hold(l, full, K)
        for flag in range(2):
            H = Hmin[2 * l + flag]
            if H >= BIG:
                continue
            for r in range(l, n - 1):
                c = 0 if flag else hold[r]
                if H + c + _with_live_in(l, c, flag, Dc[r], K) <= cap and H + c < Hmin[2 * (r + 1)]:
                    Hmin[2 * (r + 1)] = H + c
                if allow_stored:
                    c = 0 if flag else hu
                    if H + c + _with_live_in(l, c, flag, Ds[r], K) <= cap:
                        h2 = H + c + P[r] - P[l] + keep[r]
                        s2 = 2 * (r + 1) + (1 if sout[r] != 0 else 0)
                        if h2 < Hmin[s2]:
                            Hmin[s2] = h2
    return Hmin


@njit(cache=True)
def pareto_plans(n, full, K, Cpre, cap, allow_stored, max_work):
    """Every plan that is Pareto-optimal in (peak, recomputation) with peak <= cap.

    ``F(l, flag)``: the Pareto front of the suffix plans from layer ``l`` (a
    segment starting at ``l``; ``flag`` = 1 when the previous segment is stored
    and keeps ``l``'s input), as ``(relative peak, recompute)`` pairs sorted by
    peak ascending and recomputation strictly descending. With ``c`` the
    segment's hold (0 when ``flag``), ``D`` its peak and ``S`` what a stored
    segment keeps::

        checkpointed [l, r]: (c + max(Dc, p'),     rec(l, r) + R')  for (p', R') in F(r+1, 0)
        stored [l, r]:       (c + max(Ds, S + p'), R')              for (p', R') in F(r+1, sout[r])
        last [l, n-1]:       (c + Ds, 0)

    A suffix enters only through ``max`` and ``+``, both monotone, so a
    dominated suffix never helps: the recurrence is exact. For a fixed ``r``
    the suffix points below ``D`` give the same peak, so only the last of them
    (least recomputation) is a candidate. Points whose peak, added to the
    least bytes any plan within ``cap`` holds before ``l``
    (:func:`min_held_prefix`), exceed ``cap`` are dropped.

    Returns ``(peaks, recomputes, plans_flat, plan_offsets, stored_flat,
    stored_offsets, complete)`` for the front at layer 0 (peaks relative to
    the static bytes): plan ``k``'s segment starts after 0 and the starts of
    its stored segments. Time O(n^2 F), F the front size. With ``max_work >
    0`` the program stops once it has generated that many candidate points
    and returns ``complete = False`` with an empty front.
    """
    P, keep, sout = K[0], K[13], K[14]
    Hmin = min_held_prefix(n, full, K, Cpre, cap, allow_stored)
    Dc = np.empty(n, dtype=np.int64)
    Ds = np.empty(n, dtype=np.int64)
    hold = np.empty(n, dtype=np.int64)
    rec = np.empty(n, dtype=np.int64)
    size = 1024
    pp = np.empty(size, dtype=np.int64)  # pool: peak, recompute, end r, next point, kind
    pr = np.empty(size, dtype=np.int64)
    pc = np.empty(size, dtype=np.int64)
    pn = np.empty(size, dtype=np.int64)
    pk = np.empty(size, dtype=np.int64)
    used = 0
    first = np.zeros(2 * n + 2, dtype=np.int64)
    count = np.zeros(2 * n + 2, dtype=np.int64)
    cp = np.empty(64, dtype=np.int64)  # candidates of one state
    cr = np.empty(64, dtype=np.int64)
    cc = np.empty(64, dtype=np.int64)
    cn = np.empty(64, dtype=np.int64)
    ck_ = np.empty(64, dtype=np.int64)
    work = 0
    for l in range(n - 1, -1, -1):
        row_done = False
        hu = _unwrapped_hold(l, full, K)
        for flag in range(2):
            st = 2 * l + flag
            first[st] = used
            if Hmin[st] >= BIG:
                continue
            if not row_done:
                segment_row(l, n, full, K, Cpre, Dc, Ds, hold, rec)
                row_done = True
            work += n - l
            limit = cap - Hmin[st]
            m = 0
            for r in range(l, n):
                if r == n - 1 and m + 1 > cp.shape[0]:
                    cp, cr, cc, cn, ck_ = _grow(cp, m + 2), _grow(cr, m + 2), _grow(cc, m + 2), _grow(cn, m + 2), _grow(ck_, m + 2)
                if r == n - 1:
                    c = 0 if flag else hu
                    d = _with_live_in(l, c, flag, Ds[r], K)
                    if c + d <= limit:
                        cp[m] = c + d
                        cr[m] = 0
                        cc[m] = r
                        cn[m] = -1
                        ck_[m] = 2
                        m += 1
                    continue
                for kind in range(2):
                    if kind == 1 and not allow_stored:
                        break
                    if kind == 0:
                        c = 0 if flag else hold[r]
                        d = _with_live_in(l, c, flag, Dc[r], K)
                        extra = 0
                        rc = rec[r]
                        nxt = 2 * (r + 1)
                    else:
                        c = 0 if flag else hu
                        d = _with_live_in(l, c, flag, Ds[r], K)
                        extra = P[r] - P[l] + keep[r]
                        rc = 0
                        nxt = 2 * (r + 1) + (1 if sout[r] != 0 else 0)
                    if c + d > limit:
                        continue
                    s0 = first[nxt]
                    kk = count[nxt]
                    # j: the first suffix point above d - extra (peaks ascend: binary search)
                    lo = 0
                    hi = kk
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if extra + pp[s0 + mid] <= d:
                            lo = mid + 1
                        else:
                            hi = mid
                    j = lo
                    work += 1
                    need = m + kk - j + 2
                    if need > cp.shape[0]:
                        cp, cr, cc, cn, ck_ = _grow(cp, need), _grow(cr, need), _grow(cc, need), _grow(cn, need), _grow(ck_, need)
                    if j > 0:
                        cp[m] = c + d
                        cr[m] = rc + pr[s0 + j - 1]
                        cc[m] = r
                        cn[m] = s0 + j - 1
                        ck_[m] = kind
                        m += 1
                    while j < kk and c + extra + pp[s0 + j] <= limit:
                        cp[m] = c + extra + pp[s0 + j]
                        cr[m] = rc + pr[s0 + j]
                        cc[m] = r
                        cn[m] = s0 + j
                        ck_[m] = kind
                        m += 1
                        j += 1
                    if max_work > 0 and work + m > max_work:
                        e = np.empty(0, dtype=np.int64)
                        return e, e, e, np.zeros(1, dtype=np.int64), e, np.zeros(1, dtype=np.int64), False
            if m == 0:
                continue
            work += m
            o1 = np.argsort(cr[:m], kind="mergesort")
            o2 = o1[np.argsort(cp[:m][o1], kind="mergesort")]
            if used + m > pp.shape[0]:
                pp = _grow(pp, used + m)
                pr = _grow(pr, used + m)
                pc = _grow(pc, used + m)
                pn = _grow(pn, used + m)
                pk = _grow(pk, used + m)
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
    k0 = count[0]
    peaks = pp[first[0]: first[0] + k0].copy()
    recs = pr[first[0]: first[0] + k0].copy()
    offsets = np.zeros(k0 + 1, dtype=np.int64)
    soffsets = np.zeros(k0 + 1, dtype=np.int64)
    flat = np.empty(max(1, k0 * n), dtype=np.int64)
    sflat = np.empty(max(1, k0 * n), dtype=np.int64)
    tot = 0
    stot = 0
    for t in range(k0):
        idx = first[0] + t
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
def linear_additive(n, P, q, w):
    """O(n) optimum of the additive form. See ``ckptopt.solvers.linear`` for the proof."""
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
    return V[0], _plan_from_choice(choice, n)


@njit(cache=True)
def chen_greedy_pass(sizes, threshold):
    """Chen et al. (2016) Algorithm 3 for one budget ``threshold``.

    Walks the layers in order accumulating output sizes; when the running
    total exceeds the threshold the layer's output becomes a checkpoint (the
    next segment starts after it). Returns (segment starts, saved x, max local y).
    """
    n = sizes.shape[0]
    out = np.empty(n, dtype=np.int64)
    m = 0
    local = 0
    saved = 0
    biggest = 0
    for i in range(n):
        local += sizes[i]
        if local > threshold and i < n - 1:
            saved += sizes[i]
            if local > biggest:
                biggest = local
            local = 0
            out[m] = i + 1
            m += 1
    if local > biggest:
        biggest = local
    return out[:m], saved, biggest


def warmup() -> None:
    """Compile (or load from the on-disk cache) every kernel on a tiny instance."""
    n = 3
    z = np.zeros(n, dtype=np.int64)
    one = np.ones(n, dtype=np.int64)
    K = (np.arange(n + 1, dtype=np.int64), one, z, one, one, one, z, one, one, one, one, one, one, one, one, one,
         one, one)
    cpre = np.arange(n + 1, dtype=np.int64)
    cpre.setflags(write=False)  # as ChainCosts.compute_prefix: read-only arrays are another signature
    for full in (True, False):
        segment_peak(0, n - 1, True, full, K, 0)
        simulate_plan(np.array([0, 2], dtype=np.int64), np.array([1, 0], dtype=np.int64), n, full, K)
        plan_recompute(np.array([0, 2], dtype=np.int64), np.array([1, 0], dtype=np.int64), n, full, K, cpre)
        dp_cubic(n, full, K)
        dp_quadratic(n, full, K)
        for allow in (True, False):
            pareto_plans(n, full, K, cpre, BIG, allow, 0)
        brute_force_lex(n, full, K, cpre)
    linear_additive(n, K[0], K[1], K[2])
    linear_least_recompute(n, K[0], K[1], K[2], BIG)
    chen_greedy_pass(one, 1)


@njit(cache=True)
def plan_recompute(starts, stored, n, full, K, Cpre):
    """Compute a plan adds by re-running its checkpointed segments in backward. O(n)."""
    runs, saves, ext = K[8], K[9], K[16]
    total = 0
    m = starts.shape[0]
    for k in range(m - 1):
        if stored[k] != 0:
            continue
        l = starts[k]
        r = starts[k + 1] - 1
        if not full:
            total += Cpre[r + 1] - Cpre[l]
            continue
        seg_saves = False
        for i in range(l, r + 1):
            if saves[i] != 0:
                seg_saves = True
                break
        e = l - 1
        if seg_saves:  # recomputed up to the last layer that packs anything, a dead tensor too
            for i in range(r, l - 1, -1):
                if ext[i] != 0:
                    e = i
                    break
        if e >= l and runs[e] == 0:
            e -= 1
        if e >= l:
            total += Cpre[e + 1] - Cpre[l]
    return total


@njit(cache=True)
def brute_force_lex(n, full, K, Cpre):
    """Every plan; the lowest peak, then the least recomputation, then the smallest mask."""
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
        v = simulate_plan(starts[:m], zeros[:m], n, full, K)[0]
        if v > best:
            continue
        rc = plan_recompute(starts[:m], zeros[:m], n, full, K, Cpre)
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
