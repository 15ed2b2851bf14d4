"""Compiled (numba, nopython) hot loops shared by the simulator and the solvers.

Every kernel reads the tuple ``K = (P, qb, ck, qf, fw, f, G, a, runs, saves, sin, qs, fs)``
built by :attr:`ckptopt.ChainCosts.kernel_arrays` (all int64), plus ``full``
(False for the additive form, where only the backward term exists).

Memory-model note (DESIGN.md section 3), relative to the static bytes and to
the checkpoints held by earlier segments, for a segment ``[l, r]`` with
``H(l, i) = P[i] - P[l]`` (what layers ``l..i-1`` leave saved, by storage):

* backward at layer i:            ``H(l, i) + qb[i]``
* forward at i (wrapped segment): ``f[l]`` at ``i = l``, ``fw[i]`` after
* recompute at i:                 ``G[r] + a[r] + (f[l] | H(l, i) + qf[i])``
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
    P, qb, ck, qf, fw, f, G, a, runs, saves, sin, qs, fs = K
    Pl = P[l]
    best = NEG
    phase = -1
    layer = -1
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
            e = l - 1
            for i in range(r, l - 1, -1):
                if saves[i] != 0:
                    e = i
                    break
            partial = e >= l and runs[e] != 0  # layer e runs only up to its last saved tensor
            if e >= l and runs[e] == 0:
                e -= 1  # e only saves its input: the layer before it runs to its end
            if e >= l:
                base = G[r] + a[r]
                for i in range(l, e + 1):
                    stop = partial and i == e
                    if i == l:
                        v = base + (fs[l] if stop else f[l])
                    else:
                        v = base + P[i] - Pl + (qs[i] if stop else qf[i])
                    if v > best:
                        best, phase, layer = v, 1, i
    for i in range(r, l - 1, -1):
        v = P[i] - Pl + qb[i]
        if v > best:
            best, phase, layer = v, 2, i
    return best, phase, layer


@njit(cache=True)
def simulate_plan(starts, n, full, K):
    """Peak of the plan whose segments start at ``starts`` (sorted, starts[0] == 0).

    Returns (peak without static, phase, layer, segment). O(n).
    """
    ck = K[2]
    held = 0
    best = NEG
    phase = -1
    layer = -1
    seg = -1
    m = starts.shape[0]
    for k in range(m):
        l = starts[k]
        r = starts[k + 1] - 1 if k + 1 < m else n - 1
        c = held_checkpoint(l, r, k == m - 1, full, K)
        held += c
        v, ph, ly = segment_peak(l, r, k == m - 1, full, K, ck[l] - c if k > 0 else 0)
        v += held
        if v > best:
            best, phase, layer, seg = v, ph, ly, k
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
def dp_quadratic(n, full, K):
    """Exact O(n^2) program: the recurrence of dp_cubic, D(l, r) extended as r grows."""
    P, qb, ck, qf, fw, f, G, a, runs, saves, sin, qs, fs = K
    V = np.empty(n + 1, dtype=np.int64)
    V[n] = NEG
    choice = np.empty(n, dtype=np.int64)
    for l in range(n - 1, -1, -1):
        Pl = P[l]
        bwd = NEG
        fwdw = f[l]  # wrapped forward, running max
        pm = f[l]  # running max of the live-forward term (recompute / unwrapped forward)
        pm_prev = NEG
        e_pm = NEG  # pm up to the last layer the recomputation runs
        has_e = False
        bestv = BIG
        bestr = -1
        seg_saves = False
        for r in range(l, n):
            v = P[r] - Pl + qb[r]
            if v > bwd:
                bwd = v
            if saves[r] != 0:
                seg_saves = True
            if full:
                if r > l:
                    if fw[r] > fwdw:
                        fwdw = fw[r]
                    pm_prev = pm
                    v = P[r] - Pl + qf[r]
                    if v > pm:
                        pm = v
                if saves[r] != 0:
                    if runs[r] != 0:
                        # the recomputation ends inside layer r, at its last saved tensor
                        v = fs[l] if r == l else P[r] - Pl + qs[r]
                        e_pm = pm_prev if r > l else NEG
                        if v > e_pm:
                            e_pm = v
                        has_e = True
                    elif r > l:
                        e_pm = pm_prev
                        has_e = True
                if r == n - 1:
                    D = bwd if bwd > pm else pm
                else:
                    D = bwd if bwd > fwdw else fwdw
                    if has_e:
                        v = G[r] + a[r] + e_pm
                        if v > D:
                            D = v
            else:
                D = bwd
            # the checkpoint this segment holds (DESIGN.md section 4)
            if l == 0:
                c = 0
            elif not full:
                c = ck[l]
            elif r == n - 1:
                c = ck[l] if sin[l] != 0 else 0
            else:
                c = ck[l] if seg_saves else 0
            if l > 0 and c == 0:
                v = ck[l] + f[l]  # the input is live while the first layer runs
                if v > D:
                    D = v
            rest = V[r + 1]
            val = c + (D if D > rest else rest)
            if val <= bestv:
                bestv = val
                bestr = r
        V[l] = bestv
        choice[l] = bestr
    return V[0], _plan_from_choice(choice, n)


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
def brute_force(n, full, K):
    """Every one of the 2^(n-1) plans; returns (optimum without static, checkpoints)."""
    starts = np.empty(n, dtype=np.int64)
    best = BIG
    best_mask = 0
    for mask in range(1 << (n - 1)):
        starts[0] = 0
        m = 1
        for j in range(n - 1):
            if (mask >> j) & 1:
                starts[m] = j + 1
                m += 1
        v = simulate_plan(starts[:m], n, full, K)[0]
        if v < best:
            best = v
            best_mask = mask
    out = np.empty(n, dtype=np.int64)
    m = 0
    for j in range(n - 1):
        if (best_mask >> j) & 1:
            out[m] = j + 1
            m += 1
    return best, out[:m]


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
    K = (np.arange(n + 1, dtype=np.int64), one, z, one, one, one, z, one, one, one, one, one, one)
    for full in (True, False):
        segment_peak(0, n - 1, True, full, K, 0)
        simulate_plan(np.array([0, 2], dtype=np.int64), n, full, K)
        dp_cubic(n, full, K)
        dp_quadratic(n, full, K)
        brute_force(n, full, K)
    linear_additive(n, K[0], K[1], K[2])
    chen_greedy_pass(one, 1)
