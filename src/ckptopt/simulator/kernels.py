"""Compiled (numba, nopython) kernels of the simulator, shared with the solvers.

Every kernel reads :class:`ckptopt.costs.KernelArrays` ``K`` by field name, plus
``full`` (False for the additive form, where only the backward term exists).

The memory model (``docs/design.md`` §3-4), relative to the static bytes and to
the checkpoints held by earlier segments, for a segment ``[l, r]`` with
``H(l, i) = K.P[i] - K.P[l]`` (what layers ``l..i-1`` leave saved, by storage):

* backward at layer i:            ``H(l, i) + qb[i]`` (``qbr``, ``qbkr`` for ``qb``, ``qbk`` in a
  checkpointed segment, whose saved tensors are recomputed); in a checkpointed segment,
  ``qb[i]`` alone for the trailing layers after its last saving layer (their
  backward reads no saved tensor, so it runs before the recomputation). When the
  previous segment does not keep the segment's input: ``qbk`` for its first layer
  (the checkpoint's frame holds the input while the layer's saved tensors live),
  and the layers before its first saving layer without the checkpoint (the frame
  goes with the segment's last saved tensor; that layer's own term, when it is not ``l``,
  takes ``ckf[l]``: the checkpoint goes mid-way through it); in an unwrapped segment ``qbf`` for
  its first layer (nothing else holds its input once its backward has read it);
* forward at i (wrapped segment): ``fc[l]`` at ``i = l``, ``fw[i]`` after (the checkpoint's first
  pass keeps none of the saved tensors);
* recompute at i:                 ``rb[r] + (f[l] | H(l, i) + qf[i])`` for ``i``
  up to the last layer the recomputation runs (:func:`recompute_span`), which
  counts its transient only up to its last saved tensor (``fs``/``qs``). The segment's
  last saving layer (the trigger) runs its backward up to its first read of a saved
  tensor before that, without the recomputed tensors: ``rbp[r]`` (with layer ``l``'s
  recomputation addends); its backward term is ``qbt``/``qbkt``, from that read on;
* forward at i of an unwrapped segment (the last, or a stored one):
  ``f[l] | H(l, i) + qf[i]`` (it keeps what it saves instead of recomputing).

A plan's peak is ``static + max_k (sum_{j<=k} c_j + D(l_k, r_k))`` with ``c_j`` the
checkpoint segment ``j`` holds (:func:`held_checkpoint`). An input nothing holds is
still live while the segment's first layer runs, so the forward term at ``i = l``
then adds it (``live_in``), and so does every forward term of a checkpointed
segment: ``checkpoint(fn, *inputs)`` holds its arguments until it returns. Phase codes:
0 forward, 1 recompute, 2 backward.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from numba import njit

from ..costs import KernelArrays

__all__ = ["NEG", "BIG", "first_saving", "held_checkpoint", "recompute_span", "segment_peak", "segment_peak_add",
           "segment_terms", "simulate_plan", "plan_recompute", "warmup"]

#: The files whose kernels numba caches on disk (``cache=True``); they call each other.
COMPILED_SOURCES = ("simulator/kernels.py", "simulator/side_tensors.py", "solvers/side_tensors.py", "solvers/rows.py", "solvers/exact.py", "solvers/pareto.py",
                    "solvers/linear.py", "solvers/baselines.py")


def drop_stale_caches(root: Path = Path(__file__).resolve().parent.parent) -> bool:
    """Delete numba's on-disk caches of the compiled kernels when any of their sources changed.

    numba keys a cached function by its own file's timestamp only, so a kernel that
    calls one in another file (the solvers call :func:`segment_peak`) keeps stale
    machine code when only the callee's file changed, and two solvers then disagree on
    one plan's peak. A stamp of all the sources in ``simulator/__pycache__`` tells
    (``tests/test_solvers.py::test_stale_numba_caches_are_dropped_when_a_compiled_source_changes``).
    Returns whether caches were deleted.
    """
    digest = hashlib.sha1()
    for rel in COMPILED_SOURCES:
        try:
            digest.update((root / rel).read_bytes())
        except OSError:
            return False
    stamp = root / "simulator" / "__pycache__" / "ckptopt_kernels.stamp"
    try:
        if stamp.exists() and stamp.read_text() == digest.hexdigest():
            return False
        for folder in {(root / rel).parent / "__pycache__" for rel in COMPILED_SOURCES}:
            for f in list(folder.glob("*.nbi")) + list(folder.glob("*.nbc")):
                f.unlink(missing_ok=True)
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(digest.hexdigest())
    except OSError:  # a read-only install: numba then does not cache there either
        return False
    return True


drop_stale_caches()

NEG = -(1 << 62)
BIG = 1 << 62


@njit(cache=True)
def first_saving(l, r, K):
    """The first layer of ``[l, r]`` that saves a tensor (``r + 1`` if none). O(r - l).

    Its backward releases the segment's last saved tensor, and with it the frame that
    holds a checkpointed segment's input.
    """
    for i in range(l, r + 1):
        if K.saves[i] != 0:
            return i
    return r + 1


@njit(cache=True)
def held_checkpoint(l, r, unwrapped, full, K):
    """Bytes segment ``[l, r]`` holds as its checkpoint (0 for the first segment). O(r - l).

    A checkpointed segment holds its input only if it saves at least one tensor (the
    checkpoint frame is referenced only by its saved tensors); an unwrapped segment
    (the last, or a stored one) only if its first layer saves its input.
    """
    if l == 0:
        return 0
    if not full:
        return K.ck[l]
    if unwrapped:
        return K.ck[l] if K.sin[l] != 0 else 0
    return K.ck[l] if first_saving(l, r, K) <= r else 0


@njit(cache=True)
def recompute_span(l, r, K):
    """Where the recomputation of the checkpointed segment ``[l, r]`` starts and stops. O(r - l).

    Returns ``(trigger, end, partial)``:

    * ``trigger``: the last layer that saves a tensor (``l - 1`` if none). Its
      backward is the first to read a saved tensor, so the recomputation runs
      then; the backward of the layers after it runs before, without the
      segment's saved tensors.
    * ``end``: the last layer the recomputation runs (``l - 1``: none). PyTorch's
      non-reentrant checkpoint stops once it has re-packed as many tensors as the
      forward packed, a dead branch's included (``ext``); a last layer that only
      saves its input is not run (its input pack precedes its compute).
    * ``partial``: ``end`` runs only up to its last saved tensor (``fs``).

    Full form only (the additive form re-runs a segment whole).
    """
    trigger = l - 1
    for i in range(r, l - 1, -1):
        if K.saves[i] != 0:
            trigger = i
            break
    e = l - 1
    if trigger >= l:
        for i in range(r, trigger - 1, -1):
            if K.ext[i] != 0:
                e = i
                break
    partial = e >= l and K.runs[e] != 0
    if e >= l and K.runs[e] == 0:
        e -= 1
    return trigger, e, partial


@njit(cache=True)
def segment_hold(l, r, unwrapped, prev_keeps, full, K):
    """``(c, live_in)``: the checkpoint segment ``[l, r]`` holds itself (:func:`held_checkpoint`), and the
    bytes of its input that no checkpoint holds but that are live while it runs forward; both 0 when the
    previous segment is stored and keeps that input."""
    if prev_keeps:
        return 0, 0
    c = held_checkpoint(l, r, unwrapped, full, K)
    return c, (K.ck[l] - c if l > 0 else 0)


@njit(cache=True)
def segment_peak(l, r, unwrapped, full, K, live_in, prev_keeps):
    """(peak, phase, layer) of segment ``[l, r]`` relative to its checkpoints. O(r - l).

    ``live_in``: bytes of the segment's input that no checkpoint holds but that
    are live while its first layer runs forward (through the whole forward of a
    checkpointed segment, whose call holds its arguments). ``prev_keeps``: the previous
    segment is stored and keeps the segment's input (its last layer saves its output).
    """
    return segment_peak_add(l, r, unwrapped, full, K, live_in, prev_keeps, K.a, K.a, K.a, False)


@njit(cache=True)
def segment_peak_add(l, r, unwrapped, full, K, live_in, prev_keeps, fadd, radd, badd, add):
    """:func:`segment_peak` with, when ``add``, ``fadd[i]``, ``radd[i]`` and ``badd[i]`` added to the
    forward, recomputation and backward terms of layer i (the side tensors live then,
    :mod:`ckptopt.simulator.side_tensors`).

    The terms are written out here and again in :func:`segment_terms` (which lists them for the mask
    programs), by design: this is the inner loop of the simulator and the programs, and written as calls
    per term (each passing the kernel arrays) the side-tensor programs ran 20% slower (diffusers UNet,
    346 layers). ``tests/test_side_tensors.py::test_segment_terms_are_the_terms_of_segment_peak_add``
    keeps the two the same."""
    Pl = K.P[l]
    best = NEG
    phase = -1
    layer = -1
    trigger = r  # backward terms after this layer are taken without the segment's saves
    if full:
        # an unwrapped segment's input that nothing holds (no save, no earlier segment) dies at its
        # last use in the first layer
        free = unwrapped and l > 0 and not prev_keeps and K.sin[l] == 0
        # (a checkpointed segment's first pass keeps none of the saves: fc)
        v = (K.ff[l] if free else K.f[l] if unwrapped else K.fc[l]) + live_in + (fadd[l] if add else 0)
        if v > best:
            best, phase, layer = v, 0, l
        if unwrapped:
            for i in range(l + 1, r + 1):
                v = K.P[i] - Pl + K.qf[i] + (fadd[i] if add else 0)
                if v > best:
                    best, phase, layer = v, 0, i
        else:  # the checkpoint call holds its arguments: an input nothing else holds is live throughout
            for i in range(l + 1, r + 1):
                v = K.fw[i] + live_in + (fadd[i] if add else 0)
                if v > best:
                    best, phase, layer = v, 0, i
            trigger, e, partial = recompute_span(l, r, K)
            base = K.rb[r]
            for i in range(l, e + 1):
                stop = partial and i == e
                if i == l:
                    v = base + (K.fs[l] if stop else K.f[l])
                else:
                    v = base + K.P[i] - Pl + (K.qs[i] if stop else K.qf[i])
                if add:
                    v += radd[i]
                if v > best:
                    best, phase, layer = v, 1, i
            if trigger >= l:  # the trigger's backward before its first read: no recomputed tensor yet
                v = K.rbp[r] + (radd[l] if add else 0)
                if v > best:
                    best, phase, layer = v, 2, trigger
    # A checkpoint's frame, which holds the segment's input, goes once the segment's last saved
    # tensor is released: the layers before its first saving layer run their backward without it.
    freed_before = l
    if full and not unwrapped and l > 0 and not prev_keeps:
        freed_before = first_saving(l, r, K)
        if freed_before > r:  # it saves nothing: it holds no checkpoint
            freed_before = l
    for i in range(r, l - 1, -1):
        q = K.qb[i] if unwrapped else K.qbr[i]  # (a checkpointed segment's saved tensors are recomputed)
        if i == l and l > 0 and not prev_keeps:  # no earlier layer holds its input:
            q = K.qbf[i] if unwrapped else K.qbkr[i]  # nothing does, or the checkpoint's frame
        if full and not unwrapped and i == trigger:  # (from its first read on: the part before is rbp)
            q = K.qbkt[i] if i == l and l > 0 and not prev_keeps else K.qbt[i]
        v = K.P[i] - Pl + q if i <= trigger else q
        if i < freed_before:
            v -= K.ck[l]
        elif i == freed_before and i > l:  # (it lets the checkpoint go mid-way through its backward)
            v += K.ckf[l]
        if add:
            v += badd[i]
        if v > best:
            best, phase, layer = v, 2, i
    return best, phase, layer


@njit(cache=True)
def segment_terms(l, r, unwrapped, K, live_in, prev_keeps, fadd, radd, badd, out):
    """Every term of :func:`segment_peak_add` (full form, with the addends), one by one: ``out[i - l]``
    the forward term of layer ``i``, ``out[w + i - l]`` its recomputation term, ``out[2 w + i - l]``
    its backward term (``w = r - l + 1``; ``NEG`` where a layer has no such term). Their maximum is
    ``segment_peak_add``'s peak (``tests/test_side_tensors.py`` checks it on random models: a rule
    changed there must be changed here). The side-tensor programs take each term apart by side
    tensor (:mod:`ckptopt.solvers.side_tensors`). O(r - l)."""
    w = r - l + 1
    for t in range(3 * w):
        out[t] = NEG
    Pl = K.P[l]
    free = unwrapped and l > 0 and not prev_keeps and K.sin[l] == 0
    out[0] = (K.ff[l] if free else K.f[l] if unwrapped else K.fc[l]) + live_in + fadd[l]
    trigger = r
    if unwrapped:
        for i in range(l + 1, r + 1):
            out[i - l] = K.P[i] - Pl + K.qf[i] + fadd[i]
    else:
        for i in range(l + 1, r + 1):
            out[i - l] = K.fw[i] + live_in + fadd[i]
        trigger, e, partial = recompute_span(l, r, K)
        base = K.rb[r]
        for i in range(l, e + 1):
            stop = partial and i == e
            if i == l:
                v = base + (K.fs[l] if stop else K.f[l])
            else:
                v = base + K.P[i] - Pl + (K.qs[i] if stop else K.qf[i])
            out[w + i - l] = v + radd[i]
        if trigger >= l and K.rbp[r] + radd[l] > out[w]:  # (the trigger's first part: with layer l's
            out[w] = K.rbp[r] + radd[l]                    # recomputation term, the same side addends)
    freed_before = l
    if not unwrapped and l > 0 and not prev_keeps:
        freed_before = first_saving(l, r, K)
        if freed_before > r:
            freed_before = l
    for i in range(r, l - 1, -1):
        q = K.qb[i] if unwrapped else K.qbr[i]
        if i == l and l > 0 and not prev_keeps:
            q = K.qbf[i] if unwrapped else K.qbkr[i]
        if not unwrapped and i == trigger:
            q = K.qbkt[i] if i == l and l > 0 and not prev_keeps else K.qbt[i]
        v = K.P[i] - Pl + q if i <= trigger else q
        if i < freed_before:
            v -= K.ck[l]
        elif i == freed_before and i > l:
            v += K.ckf[l]
        out[2 * w + i - l] = v + badd[i]


@njit(cache=True)
def simulate_plan(starts, stored, n, full, K):
    """Peak of the plan whose segments start at ``starts`` (sorted, starts[0] == 0).

    ``stored[k] != 0``: segment ``k`` (not the last) is left unwrapped: it runs
    like the last segment (keeps what its layers save, no recomputation) and
    holds those tensors, ``P[r] - P[l] + keep[r]``, while every later segment
    runs; when it keeps its output, the next segment's input is already held.
    Returns (peak without static, phase, layer, segment). O(n).
    """
    held, best, phase, layer, seg = 0, NEG, -1, -1, -1
    prev_keeps = False
    m = starts.shape[0]
    for k in range(m):  # (written out, not through segment_hold: numba's calls cost in this loop)
        l = starts[k]
        r = starts[k + 1] - 1 if k + 1 < m else n - 1
        last = k == m - 1
        st = last or stored[k] != 0
        c = 0 if prev_keeps else held_checkpoint(l, r, st, full, K)
        live_in = K.ck[l] - c if k > 0 and not prev_keeps else 0
        held += c
        v, ph, ly = segment_peak(l, r, st, full, K, live_in, prev_keeps)
        v += held
        if v > best:
            best, phase, layer, seg = v, ph, ly, k
        if st and not last:  # a stored segment keeps what its layers save, and its output if it saves it
            held += K.P[r] - K.P[l] + K.keep[r]
            prev_keeps = K.sout[r] != 0
        else:
            prev_keeps = False
    return best, phase, layer, seg


@njit(cache=True)
def plan_recompute(starts, stored, n, full, K, Cpre):
    """Compute a plan adds by re-running its checkpointed segments in backward, each segment's fixed
    cost ``cseg`` included. O(n)."""
    total = 0
    m = starts.shape[0]
    for k in range(m - 1):
        if stored[k] != 0:
            continue
        l = starts[k]
        r = starts[k + 1] - 1
        total += K.cseg[l]
        if not full:
            total += Cpre[r + 1] - Cpre[l]
            continue
        e = recompute_span(l, r, K)[1]
        if e >= l:
            total += Cpre[e + 1] - Cpre[l]
    return total


def tiny_instance(n: int = 3) -> tuple[KernelArrays, np.ndarray]:
    """A small instance with the array types of real cost models (for compiling kernels)."""
    z = np.zeros(n, dtype=np.int64)
    one = np.ones(n, dtype=np.int64)
    arrays = {name: one for name in KernelArrays._fields}  # every layer saves, runs, holds one byte ...
    arrays.update(P=np.arange(n + 1), ck=z, G=z, ckf=z)  # ... no checkpoint, no parameter gradient
    K = KernelArrays.of(n, **arrays)
    cpre = np.arange(n + 1, dtype=np.int64)
    cpre.setflags(write=False)  # as ChainCosts.compute_prefix: read-only arrays are another signature
    return K, cpre


def warmup() -> None:
    """Compile (or load from the on-disk cache) the simulator's kernels."""
    K, cpre = tiny_instance()
    n = K.a.shape[0]
    for full in (True, False):
        for unwrapped in (True, False):
            held_checkpoint(1, n - 1, unwrapped, full, K)
            first_saving(0, n - 1, K)
            segment_peak(0, n - 1, unwrapped, full, K, 0, False)
        recompute_span(0, n - 1, K)
        simulate_plan(np.array([0, 2], dtype=np.int64), np.array([1, 0], dtype=np.int64), n, full, K)
        plan_recompute(np.array([0, 2], dtype=np.int64), np.array([1, 0], dtype=np.int64), n, full, K, cpre)
