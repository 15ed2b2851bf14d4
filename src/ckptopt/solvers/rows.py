"""Compiled building blocks shared by the exact program (``dp2``) and the Pareto program.

:func:`segment_row` gives the cost of every segment ``[l, r]`` for one ``l`` in
O(n - l): the terms of :func:`ckptopt.simulator.kernels.segment_peak` kept as
running maxima as ``r`` grows. Its recomputation end is the rule of
:func:`ckptopt.simulator.kernels.recompute_span` followed incrementally (the
end only moves forward with ``r``); ``dp2`` against ``dp`` and ``brute``, which call
the simulator's kernels, checks the two agree
(``tests/test_solvers.py::test_dp_dp2_brute_agree_on_full_model``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..simulator.kernels import NEG

__all__ = ["SegmentRow", "segment_row_buffers", "segment_row", "with_live_in", "plan_from_choice", "grow",
           "starts_of_mask", "checkpoints_of_mask", "better_lex"]


class SegmentRow(NamedTuple):
    """Per last layer ``r``, the segments ``[l, r]`` of one ``l`` (:func:`segment_row`)."""

    Dc0: np.ndarray  #: peak checkpointed, the input not kept by the previous segment
    Dc1: np.ndarray  #: peak checkpointed, the input kept by a stored previous segment
    Ds0: np.ndarray  #: peak unwrapped (stored or last), the input not kept
    Ds1: np.ndarray  #: peak unwrapped, the input kept
    hold: np.ndarray  #: the checkpoint it holds when checkpointed
    rec: np.ndarray  #: the compute it re-runs when checkpointed


@njit(cache=True)
def segment_row_buffers(n):
    """An empty :class:`SegmentRow` for ``n`` layers."""
    return SegmentRow(np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64),
                      np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64))


@njit(cache=True)
def segment_row(l, n, full, K, Cpre, row):
    """Every segment ``[l, r]``, r = l..n-1, in O(n - l): each entry costs O(1)
    after the previous one (running maxima; the recomputation term is ``rb[r]``
    plus a running maximum taken up to the last layer the recomputation
    runs, which only moves forward with ``r``).

    Fills ``row`` (:class:`SegmentRow`), relative to the segment's checkpoints and without the live-input
    term (the caller adds ``ck[l] + f[l]`` when nothing holds the input), with
    the suffix the flag of the state: 1 when the previous segment is stored and
    keeps the segment's input (then the first layer's backward takes ``qb``), 0
    otherwise (``qbk``: the checkpoint's frame holds it; ``qbf`` unwrapped: nothing does; a
    checkpointed segment's terms take ``qbr``/``qbkr``, its saved tensors being recomputed):

    * ``Dc0[r]``, ``Dc1[r]``: peak of the segment checkpointed (r < n-1); with flag 0
      the layers before its first saving layer run their backward without the
      checkpoint it holds (the frame goes with the segment's last saved tensor, mid-way
      through the first saving layer's backward: ``ckf`` in its term), and a
      segment that saves nothing (no checkpoint held) has its input live through its
      whole forward (the checkpoint call holds its arguments: included here);
    * ``Ds0[r]``, ``Ds1[r]``: peak of the segment run unwrapped (the last
      segment, or a stored one): its forward keeps what it saves, no recomputation;
    * ``hold[r]``: the checkpoint it holds when checkpointed (the rule of
      ``held_checkpoint``; the unwrapped hold does not depend on r);
    * ``rec[r]``: the compute it re-runs when checkpointed, from the prefix
      sums ``Cpre`` of the per-layer compute, plus the segment's fixed cost ``cseg[l]``.

    One loop by design: it is the inner loop of the O(n^2) programs, and each of its fourteen running
    values changes with every ``r``; split into calls, all of them would be passed in and out per layer.
    """
    Dc0, Dc1, Ds0, Ds1, hold, rec = row.Dc0, row.Dc1, row.Ds0, row.Ds1, row.hold, row.rec
    Pl = K.P[l]
    first = l > 0  # the first layer's input may be held by the previous segment or not
    bwd1 = NEG  # backward terms, running max: the input held by the previous segment ...
    bwd1r = NEG  # ... the same, checkpointed (its saved tensors recomputed: qbr) ...
    bwd0 = NEG  # ... or not, unwrapped (qbf) ...
    pre_c = NEG  # ... or not, checkpointed (qbk): before the first saving layer, which run their
    post_c = NEG  # backward without the checkpoint (its frame goes with the last saved tensor), and from it
    drop = K.ck[l] if full and first else 0  # what they run without
    bwd_j0 = NEG  # checkpointed: backward terms up to the last saving layer (with the saves) ...
    bwd_j1 = NEG
    tail0 = NEG  # ... and after it (without: they run before the recomputation)
    tail1 = NEG
    fwdw = K.fc[l]  # wrapped forward, running max (a checkpoint's first pass keeps no saves)
    pm = K.f[l]  # running max of the live-forward term (recompute / unwrapped forward)
    # ... unwrapped with flag 0: its first layer's input dies at its last use unless it saves it
    pm0 = K.ff[l] if first and K.sin[l] == 0 else K.f[l]
    pm_prev = NEG
    e_pm = NEG  # pm up to the last layer the recomputation runs
    has_e = False
    seg_saves = False
    e = l - 1  # last layer the recomputation runs
    for r in range(l, n):
        v = K.P[r] - Pl + K.qb[r]
        v0 = K.qbf[l] if r == l and first else v
        vr = K.P[r] - Pl + K.qbr[r]
        vc = K.qbkr[l] if r == l and first else vr
        # as the segment's last saving layer (the trigger): from its first read of a saved tensor on
        vrt = K.P[r] - Pl + K.qbt[r]
        vct = K.qbkt[l] if r == l and first else vrt
        if full and first and r > l and K.saves[r] != 0 and not seg_saves:  # (the first saving layer lets the
            vc += K.ckf[l]  # checkpoint go mid-way through its backward)
            vct += K.ckf[l]
        bwd1r_before = bwd1r
        post_before = post_c
        if v > bwd1:
            bwd1 = v
        if vr > bwd1r:
            bwd1r = vr
        if v0 > bwd0:
            bwd0 = v0
        if K.saves[r] != 0 or seg_saves:
            if vc > post_c:
                post_c = vc
        elif vc > pre_c:
            pre_c = vc
        if K.saves[r] != 0:
            seg_saves = True
            if full:  # (the earlier layers' terms, and the trigger's own)
                d = post_before if post_before > vct else vct
                bwd_j0 = d if d > pre_c - drop else pre_c - drop
                bwd_j1 = bwd1r_before if bwd1r_before > vrt else vrt
            else:
                bwd_j0 = post_c if post_c > pre_c - drop else pre_c - drop
                bwd_j1 = bwd1r
            tail0 = NEG
            tail1 = NEG
        else:
            qt = K.qbkr[l] if r == l and first else K.qbr[r]
            if qt > tail0:
                tail0 = qt
            if K.qbr[r] > tail1:
                tail1 = K.qbr[r]
        if full:
            if r > l:
                if K.fw[r] > fwdw:
                    fwdw = K.fw[r]
                pm_prev = pm
                v = K.P[r] - Pl + K.qf[r]
                if v > pm:
                    pm = v
                if v > pm0:
                    pm0 = v
            if K.ext[r] != 0 and seg_saves:  # a recomputation happens and reaches layer r
                if K.runs[r] != 0:
                    # the recomputation ends inside layer r, at its last saved tensor
                    v = K.fs[l] if r == l else K.P[r] - Pl + K.qs[r]
                    e_pm = pm_prev if r > l else NEG
                    if v > e_pm:
                        e_pm = v
                    has_e = True
                    e = r
                elif r > l:
                    e_pm = pm_prev
                    has_e = True
                    e = r - 1
            Ds1[r] = bwd1 if bwd1 > pm else pm
            Ds0[r] = bwd0 if bwd0 > pm0 else pm0
            rest = fwdw
            if has_e and K.rb[r] + e_pm > rest:
                rest = K.rb[r] + e_pm
            if seg_saves and K.rbp[r] > rest:  # (the trigger's backward before its first read)
                rest = K.rbp[r]
            d = bwd_j0 if bwd_j0 > tail0 else tail0
            Dc0[r] = d if d > rest else rest
            if first and not seg_saves and K.ck[l] + fwdw > Dc0[r]:
                # it holds no checkpoint, but its call holds the input through its forward (the
                # live-input term of with_live_in, for every forward layer)
                Dc0[r] = K.ck[l] + fwdw
            d = bwd_j1 if bwd_j1 > tail1 else tail1
            Dc1[r] = d if d > rest else rest
        else:
            Ds1[r] = bwd1
            Ds0[r] = bwd0
            Dc0[r] = post_c if post_c > pre_c else pre_c
            Dc1[r] = bwd1r
            e = r
        if l == 0:
            hold[r] = 0
        elif not full:
            hold[r] = K.ck[l]
        else:
            hold[r] = K.ck[l] if seg_saves else 0
        rec[r] = (0 if e < l else Cpre[e + 1] - Cpre[l]) + K.cseg[l]


@njit(cache=True)
def with_live_in(l, c, flag, d, K, unwrapped):
    """A segment that holds nothing of its input still has it live while its first layer runs (where
    it dies at its last use when the segment is unwrapped and the layer does not save it, ``ff``)."""
    if l > 0 and c == 0 and flag == 0:
        v = K.ck[l] + ((K.ff[l] if K.sin[l] == 0 else K.f[l]) if unwrapped else K.fc[l])
        if v > d:
            return v
    return d


@njit(cache=True)
def plan_from_choice(choice, n):
    """The plan of a dynamic program whose segment starting at ``l`` ends at ``choice[l]``."""
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
def grow(arr, size):
    """``arr`` copied into a buffer of at least ``size`` entries (doubling)."""
    out = np.empty(max(2 * arr.shape[0], size), dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


@njit(cache=True)
def starts_of_mask(mask, n, out):
    """The segment starts of the plan ``mask`` names (bit ``j``: layer ``j + 1`` starts a segment), layer 0
    first, written to ``out``; returns how many."""
    out[0] = 0
    m = 1
    for j in range(n - 1):
        if (mask >> j) & 1:
            out[m] = j + 1
            m += 1
    return m


@njit(cache=True)
def checkpoints_of_mask(mask, n):
    """The checkpoints (segment starts after 0) of the plan ``mask`` names."""
    out = np.empty(n, dtype=np.int64)
    m = starts_of_mask(mask, n, out)
    return out[1:m].copy()


@njit(cache=True)
def better_lex(v, rc, best, best_rec):
    """Whether a plan of peak ``v`` and recomputation ``rc`` beats the best so far: a lower peak, then
    less recomputation (the first found wins ties)."""
    return v < best or (v == best and rc < best_rec)
