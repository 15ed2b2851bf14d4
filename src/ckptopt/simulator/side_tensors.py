"""Compiled kernels for side tensors: tensors that cross layer boundaries besides the chain tensor.

A cost model with side tensors (:class:`ckptopt.costs.SideTensor`, ``docs/design.md`` §4) is
the chain model plus, for each side tensor ``j`` (bytes ``sa``, producer ``p``, consumers, last
consumer ``smax``), the holding rule:

* **forward**: the copy the forward made lives from its producer's forward to its last
  consumer's (to the end of a checkpointed consumer segment, whose call holds its
  arguments), and beyond while anything holds it; where nothing does (an unwrapped segment,
  a recomputation, the first pass of the checkpointed segment that makes it and reads it last),
  it dies at its last use inside its last consumer, whose forward term then changes by
  ``last_gain_full`` (``sdief``, at most 0; in a recomputation that stops in that layer, at its
  last saved tensor, ``last_gain``, ``sdie``; in a checkpoint's first pass, which keeps no saved
  tensor, ``last_gain_ckpt``, ``sdiec``, saved or not);
* **holders**: a checkpointed segment that reads it and saves anything (its frame, let go
  with the backward of the segment's first saving layer); a layer of an unwrapped segment
  that saves it (let go with its backward). The producer's own checkpointed segment holds
  nothing: its recomputation makes a new copy, which lives to its last recomputed consumer,
  or to the stop when a later segment reads it, or to the backward of the first layer
  that saves it (up to the segment's last saving layer, whose input packs the
  recomputation re-does even when it does not run its compute). A release counts after
  the releasing layer's backward;
* **gradient**: from the backward of its last consumer to its producer's (``bgrad``,
  ``rside`` of :class:`ckptopt.costs.SideArrays`, independent of the plan).

The peak stays a prefix objective once a segment knows which side tensors crossing its
start an earlier segment already holds (a bit mask ``S`` over the tensors open there,
``SideArrays.blist``): those are constant bytes for the rest of the step, held once however
many segments read them. :func:`side_terms` gives what the side tensors add to each term of
one segment (forward, recomputation, backward, per layer), the bytes the segment starts to
hold for later segments, and the mask at its end; :func:`simulate_plan_side` walks a plan.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from .kernels import NEG, first_saving, held_checkpoint, recompute_span, segment_peak_add

__all__ = ["side_terms", "side_terms_frame", "frame_split", "joint_order", "simulate_plan_side",
           "SideScratch", "side_scratch"]


class SideScratch(NamedTuple):
    """The work arrays the side kernels share, filled anew for each segment they score."""

    fadd: np.ndarray  #: per layer: what the side tensors add to its forward term
    radd: np.ndarray  #: ... to its recomputation term
    badd: np.ndarray  #: ... to its backward term
    mark: np.ndarray  #: per side tensor: 1 while it is held past the segment (cleared after)
    #: the releases priced with the frame's (:func:`_joint_add`): ``[0]`` their count (-1: none are
    #: priced so), ``[1]`` the checkpoint the frame lets go with them, then ``(pre, post, bytes)`` per
    #: recomputed copy from ``[2]``
    joint: np.ndarray


def side_scratch(n: int, ns: int) -> SideScratch:
    """The work arrays for ``n`` layers and ``ns`` side tensors."""
    k = max(ns, 1)
    return SideScratch(fadd=np.zeros(n, dtype=np.int64), radd=np.zeros(n, dtype=np.int64),
                       badd=np.zeros(n, dtype=np.int64), mark=np.zeros(k, dtype=np.int64),
                       joint=np.zeros(3 * k + 2, dtype=np.int64))


@njit(cache=True)
def _first_saver(SD, j, lo, hi):
    """The first consumer of side tensor ``j`` in ``[lo, hi]`` that saves it (-1 if none)."""
    for q in range(SD.cptr[j], SD.cptr[j + 1]):
        u = SD.cu[q]
        if u > hi:
            break
        if u >= lo and SD.csv[q] != 0:
            return u
    return -1


@njit(cache=True)
def _saver_index(SD, j, u):
    """Where layer ``u``'s entry of side tensor ``j``'s savers is in the release splits (-1: not a saver)."""
    for q in range(SD.svptr[j], SD.svptr[j + 1]):
        if SD.svu[q] == u:
            return q
    return -1


@njit(cache=True)
def _release_add(SD, j, u, sa, rec, free):
    """What side tensor ``j`` (``sa`` bytes) adds to layer ``u``'s backward when ``u``'s saved
    reference is the last to let it go: present until that moment of the backward (its peaks
    before and from it, ``svpre``/``svpost``; ``rec``: a recomputed copy, which goes with the node
    that read it, ``svpre_r``/``svpost_r``; ``free``: ``u``'s input held by nothing but its own saves,
    ``svpre_f``/``svpost_f``), ``sa`` throughout when they are not known."""
    q = _saver_index(SD, j, u)
    if SD.split_known[j] == 0 or q < 0:
        return sa
    pre = SD.svpre_r[q] if rec else SD.svpre_f[q] if free else SD.svpre[q]
    post = SD.svpost_r[q] if rec else SD.svpost_f[q] if free else SD.svpost[q]
    top = pre if pre > post else post
    v = pre + sa
    return (v if v > post else post) - top


@njit(cache=True)
def frame_split(SD, u, alone):
    """``(pre, post)``: layer ``u``'s backward peak before and from its last saved tensor's release, with
    its input held as its backward term has it (``alone``: by the frame only, ``fkpre``/``fkpost``)."""
    if alone:
        return SD.fkpre[u], SD.fkpost[u]
    return SD.fpre[u], SD.fpost[u]


@njit(cache=True)
def _frame_add(SD, u, x, alone):
    """What ``x`` bytes held by a checkpoint's frame add to layer ``u``'s backward, the frame going
    when ``u``'s last saved tensor is released (``x`` throughout when that moment is not known);
    ``alone``: the frame alone holds ``u``'s input, which goes with it."""
    if SD.frame_known == 0:
        return x
    pre, post = frame_split(SD, u, alone)
    top = pre if pre > post else post
    v = pre + x
    return (v if v > post else post) - top


@njit(cache=True)
def joint_order(SD, u, joint):
    """Layer ``u``'s releases priced together (the recomputed copies of ``joint``'s entries, then the
    frame, index ``count``): ``(pre, post, order)``, ``order`` the sequence they happen in. From the
    splits alone: a release after another has a peak before it at least as high, and one after it at
    most as high (ties in both are the same moment, in either order)."""
    c = joint[0]
    pre = np.empty(c + 1, dtype=np.int64)
    post = np.empty(c + 1, dtype=np.int64)
    for q in range(c):
        pre[q] = joint[2 + 3 * q]
        post[q] = joint[3 + 3 * q]
    pre[c] = SD.fpre[u]
    post[c] = SD.fpost[u]
    order = np.arange(c + 1)
    for a in range(1, c + 1):  # (insertion sort: a few entries)
        o = order[a]
        b = a - 1
        while b >= 0 and (pre[order[b]] > pre[o] or (pre[order[b]] == pre[o] and post[order[b]] < post[o])):
            order[b + 1] = order[b]
            b -= 1
        order[b + 1] = o
    return pre, post, order


@njit(cache=True)
def _joint_add(SD, u, x, joint):
    """What the frame's ``x`` bytes and the recomputed copies let go in layer ``u``'s backward with it
    (``joint``'s entries) add to its peak, as one sequence of releases: the largest of each
    release's peak before it plus everything still held then, and the peak after the last.
    Priced one by one, each release would see the others gone before its moment, though they go at
    different moments of one backward: a recomputed copy when the node that read it returns, before
    the engine sums that node's bias gradient, the frame after it (``tests/common/regressions.py``
    case ``recomputed-copy-goes-with-the-frame``)."""
    c = joint[0]
    top = SD.fpre[u] if SD.fpre[u] > SD.fpost[u] else SD.fpost[u]
    if c == 0:  # (the frame alone)
        v = SD.fpre[u] + x
        return (v if v > SD.fpost[u] else SD.fpost[u]) - top
    pre, post, order = joint_order(SD, u, joint)
    S = x
    for q in range(c):
        S += joint[4 + 3 * q]
    best = NEG
    for o in order:
        if pre[o] + S > best:
            best = pre[o] + S
        S -= x if o == c else joint[4 + 3 * o]
    last = post[order[c]]
    return (best if best > last else last) - top


@njit(cache=True)
def _input_held(K, i, l, held_l):
    """Whether layer ``i``'s input is held while its forward runs (``f``, ``fs`` count it; else it dies at its
    last use inside the layer, ``ff``, ``ffs``): a layer saves it, or, for the segment's first layer ``l``,
    ``held_l``. A side tensor dying in that layer changes its forward as measured that way."""
    if i == l:
        return held_l
    return K.sout[i - 1] != 0 or K.sin[i] != 0


@njit(cache=True)
def _with_frame(SD, j, u, alone):
    """Whether side tensor ``j``'s recomputed copy, saved by layer ``u`` (the segment's first saving layer,
    whose backward lets the checkpoint's frame go), goes at the frame's moment: its split is the frame's.
    Then it is one release with the frame (``max(pre + both, post)``): priced apart, each would see the
    other gone before its release, and the peak before that moment would miss one of them
    (``tests/test_side_tensors.py::test_a_recomputed_copy_let_go_with_the_frame_is_one_release``)."""
    q = _saver_index(SD, j, u)
    if SD.split_known[j] == 0 or SD.frame_known == 0 or q < 0:
        return False
    pre, post = frame_split(SD, u, alone)
    return SD.svpre_r[q] == pre and SD.svpost_r[q] == post


@njit(cache=True)
def _reads_in(SD, j, lo, hi):
    for q in range(SD.cptr[j], SD.cptr[j + 1]):
        u = SD.cu[q]
        if u > hi:
            return False
        if u >= lo:
            return True
    return False


@njit(cache=True)
def side_terms(l, r, unwrapped, prev_keeps, S, K, SD, sc):
    """What the side tensors add to segment ``[l, r]`` (``unwrapped``: stored or the last;
    ``prev_keeps``: the previous segment is stored and keeps its input).

    ``S``: bit k set when the k-th side tensor open at ``l`` is held by an earlier segment
    (its bytes are then constant, outside this segment's terms). Fills the scratch's ``fadd``, ``radd``,
    ``badd`` over ``l..r`` (:class:`SideScratch`). Returns ``(held, S2)``: the bytes this segment starts to hold
    for every later segment, and the mask at ``r + 1``. O(r - l + the side tensors' reads).
    """
    held, S2, frame, fsv = side_terms_frame(l, r, unwrapped, prev_keeps, S, K, SD, sc, True)
    return held, S2


@njit(cache=True)
def side_terms_frame(l, r, unwrapped, prev_keeps, S, K, SD, sc, apply_frame):
    """:func:`side_terms`, also returning ``(held, S2, frame, fsv)``: the side bytes a checkpointed
    segment's frame holds, let go in the backward of its first saving layer ``fsv``. With
    ``apply_frame`` False that release (:func:`_frame_add`, not linear in ``frame``) is left out of
    ``badd``: every other addend is a sum over the side tensors, which the mask programs of
    :mod:`ckptopt.solvers.side_tensors` take apart tensor by tensor.

    One loop by design, over the side tensors open at the segment's start and then those it makes: the
    mask programs run it ``nb + 1`` times per segment they score, and split into a call per side tensor
    (each passing the kernel and side arrays) the side-tensor programs ran about twice as slow (diffusers
    UNet, 346 layers)."""
    fadd, radd, badd, mark, jn = sc.fadd, sc.radd, sc.badd, sc.mark, sc.joint
    for i in range(l, r + 1):
        fadd[i] = 0
        radd[i] = 0
        badd[i] = SD.bgrad[i]
    fsv = first_saving(l, r, K)
    seg_saves = fsv <= r
    # no earlier layer holds layer l's input: its release splits are taken as its backward figure has it
    # (with the frame, as bkr; with its own last save, as bf where layer l - 1 saves it: b is bf elsewhere)
    alone = l > 0 and not prev_keeps
    # the frame's release and the recomputed copies let go in the same layer, priced as one sequence
    # (their splits all of the recomputed timeline: not where the frame alone holds the layer's input),
    # with the checkpoint the frame holds when that layer is not l (ckf prices it alone)
    joint = not unwrapped and seg_saves and SD.frame_known != 0 and not (alone and fsv == l)
    jn[0] = 0 if joint else -1
    jn[1] = K.ck[l] if joint and alone else 0
    free = alone and unwrapped and K.sout[l - 1] != 0
    held_l = not (unwrapped and alone and K.sin[l] == 0)  # (an unwrapped segment's first layer: ff, else f)
    trigger = r
    e = l - 1
    partial = False
    rl = e  # the last layer whose recomputation addends are filled: layer l's too for the trigger's first part
    if not unwrapped and seg_saves:
        trigger, e, partial = recompute_span(l, r, K)
        rl = e if e > l else l
        for i in range(l, rl + 1):
            radd[i] = SD.rside[trigger]
    held = 0
    frame = 0  # side bytes the checkpoint's frame holds
    b0 = SD.bptr[l]
    for k in range(SD.bptr[l + 1] - b0):
        j = SD.blist[b0 + k]
        if (S >> k) & 1:
            mark[j] = 1  # held before: still held at r + 1
            continue
        sa = SD.sa[j]
        smax = SD.smax[j]
        if unwrapped:
            rho = _first_saver(SD, j, l, r)
            hold = rho >= 0
        else:
            rho = fsv
            hold = seg_saves and _reads_in(SD, j, l, r)
        if smax <= r:
            fend = smax if unwrapped else r  # a checkpointed call holds its arguments
        else:
            fend = r
        for i in range(l, r + 1):
            if i <= fend or hold:
                fadd[i] += sa
        if unwrapped and not hold and smax <= r:  # nothing holds it: it dies inside its last reader
            fadd[smax] += SD.sdief[j] if _input_held(K, smax, l, held_l) else SD.sdief_f[j]
        if hold:
            for i in range(l, rl + 1):
                radd[i] += sa
            for i in range(rho + 1, r + 1):
                badd[i] += sa
            if unwrapped:  # let go mid-backward by the layer that saves it
                badd[rho] += _release_add(SD, j, rho, sa, False, free and rho == l)
            else:  # ... or with the frame, with the first saving layer's last saved tensor
                frame += sa
            held += sa
            mark[j] = 1
    for p in range(l, r + 1):
        for q in range(SD.optr[p], SD.optr[p + 1]):
            j = SD.olist[q]
            sa = SD.sa[j]
            smax = SD.smax[j]
            fend = smax if smax <= r else r
            if unwrapped:
                rho = p if SD.psv[j] != 0 else _first_saver(SD, j, p + 1, r)
                hold = rho >= 0
                for i in range(p + 1, r + 1):
                    if i <= fend or hold:
                        fadd[i] += sa
                if not hold and smax <= r:  # (it dies inside its last reader)
                    fadd[smax] += SD.sdief[j] if _input_held(K, smax, l, held_l) else SD.sdief_f[j]
                if hold:
                    for i in range(rho + 1, r + 1):
                        badd[i] += sa
                    badd[rho] += _release_add(SD, j, rho, sa, False, free and rho == l)
                    held += sa
                    mark[j] = 1
            else:
                for i in range(p + 1, fend + 1):
                    fadd[i] += sa
                if smax <= r:  # (the first pass keeps no saved tensor: it dies inside its last reader, a
                    fadd[smax] += SD.sdiec_f[j]  # layer after the first, whose input dies at its last use too)
                if p <= e:  # recomputed: a new copy, packed again by every layer that saves it
                    rho = p if SD.psv[j] != 0 else _first_saver(SD, j, p + 1, trigger)
                    rend = smax
                    if smax > r or rho >= 0 or smax > e:
                        rend = e
                    for i in range(p + 1, rend + 1):
                        radd[i] += sa
                    if rend == smax and rho < 0:  # (held by nothing: it dies inside its last reader;
                        # a layer that saves it holds it to its backward; one the recomputation runs
                        # whole, not only to its last saved tensor, changes as its whole forward does)
                        kin = _input_held(K, smax, l, True)
                        if smax < e or not partial:
                            radd[smax] += SD.sdief[j] if kin else SD.sdief_f[j]
                        else:
                            radd[smax] += SD.sdie[j] if kin else SD.sdie_f[j]
                    if rho >= 0:
                        for i in range(rho + 1, trigger + 1):
                            badd[i] += sa
                        q = _saver_index(SD, j, rho)
                        if rho == fsv and joint and SD.split_known[j] == 2 and q >= 0:  # (a split of that timeline)
                            o = 2 + 3 * jn[0]  # (priced with the frame's release)
                            jn[o], jn[o + 1], jn[o + 2] = SD.svpre_r[q], SD.svpost_r[q], sa
                            jn[0] += 1
                        elif rho == fsv and _with_frame(SD, j, rho, alone and fsv == l):
                            frame += sa  # (let go with the frame, at one moment)
                        else:
                            badd[rho] += _release_add(SD, j, rho, sa, True, False)
    if joint and apply_frame:  # (segment_peak_add counts the checkpoint as held, with ckf)
        ckx = jn[1]
        badd[fsv] += _joint_add(SD, fsv, frame + ckx, jn) - ckx - (K.ckf[l] if ckx else 0)
    elif frame and apply_frame:
        badd[fsv] += _frame_add(SD, fsv, frame, alone and fsv == l)
    # the mask at r + 1, and the marks cleared
    S2 = 0
    b1 = SD.bptr[r + 1]
    for k in range(SD.bptr[r + 2] - b1):
        if mark[SD.blist[b1 + k]] != 0:
            S2 |= 1 << k
    for k in range(SD.bptr[l + 1] - b0):
        mark[SD.blist[b0 + k]] = 0
    for p in range(l, r + 1):
        for q in range(SD.optr[p], SD.optr[p + 1]):
            mark[SD.olist[q]] = 0
    return held, S2, frame, fsv


@njit(cache=True)
def simulate_plan_side(starts, stored, n, K, SD, sc):
    """:func:`ckptopt.simulator.kernels.simulate_plan` with side tensors (full form).
    Returns (peak without static, phase, layer, segment). O(n + the side tensors' reads)."""
    held, best, phase, layer, seg = 0, NEG, -1, -1, -1
    prev_keeps = False
    S = 0
    m = starts.shape[0]
    for k in range(m):  # (as simulate_plan, with the side terms)
        l = starts[k]
        r = starts[k + 1] - 1 if k + 1 < m else n - 1
        last = k == m - 1
        st = last or stored[k] != 0
        c = 0 if prev_keeps else held_checkpoint(l, r, st, True, K)
        live_in = K.ck[l] - c if k > 0 and not prev_keeps else 0
        held += c
        dside, S2 = side_terms(l, r, st, prev_keeps, S, K, SD, sc)
        v, ph, ly = segment_peak_add(l, r, st, True, K, live_in, prev_keeps, sc.fadd, sc.radd, sc.badd, True)
        v += held
        if v > best:
            best, phase, layer, seg = v, ph, ly, k
        held += dside
        if st and not last:
            held += K.P[r] - K.P[l] + K.keep[r]
            prev_keeps = K.sout[r] != 0
        else:
            prev_keeps = False
        S = S2
    return best, phase, layer, seg
