"""The chain model's figures of one layer, derived from its :class:`~ckptopt.tracer.layer_record.LayerRecord`.

Pure functions over plain data (no torch): each states one rule of docs/design.md §3-4 and can be
checked on a timeline written by hand (``tests/test_layer_figures.py``). Figures are relative: the
forward's above the bytes live before it (parameters, buffers, inputs), the backward's above the
bytes live when it starts less the injected and pending gradients.

A *timeline* is a list of entries ``(op, name, live bytes after it)``; ``k0`` is the index where the
backward starts. A *series* is a list of relative live bytes: index 0 the moment before the
backward's first operator, then one value per backward entry.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .layer_record import LayerRecord, Release

__all__ = [
    "ForwardFigures", "BackwardTimelines", "BackwardFigures", "ReleaseSplits", "SavedSet",
    "forward_figures", "backward_figures", "release_splits", "held_output_gain", "saved_set", "first_read_figures",
    "forward_peaks", "held_timelines", "backward_peaks", "peak_with_input", "relative_series", "split",
    "gone_at", "all_released_at", "without_copies", "dying_gains",
]


# -- building blocks ------------------------------------------------------------------------------

def forward_peaks(timeline: list, lo: int, hi: int, start: int, input_bytes: int, death: int) -> tuple[int, int]:
    """``(with the input held, as it went)``: the highest live bytes (at least ``start``) over the
    timeline entries ``lo..hi-1`` of a forward in which the input died at entry ``death``."""
    held = free = start
    for k in range(lo, hi):
        v = timeline[k][2]
        free = max(free, v)
        held = max(held, v + (input_bytes if k >= death else 0))
    return held, free


def gone_at(events: Iterable[tuple[int, Any]], alive_keys: dict, key: Any) -> int | None:
    """The timeline index from which the saved references over storage ``key`` (every saved reference
    when ``key`` is None) are all gone, given ``(index, key)`` per reference let go; None: never, within
    the backward."""
    count = sum(alive_keys.values()) if key is None else alive_keys.get(key, 0)
    if count == 0:
        return None
    for index, k in events:
        if key is None or k == key:
            count -= 1
            if count == 0:
                return index
    return None


def _released(releases: list[Release]) -> list[tuple[int, Any]]:
    return [(r.index, r.key) for r in releases]


def all_released_at(releases: list[Release], alive: int, k0: int, end: int) -> int:
    """The timeline index from which every saved reference kept at the backward's start is released
    (``k0`` when none is; ``end`` when some never is)."""
    count = alive
    if count == 0:
        return k0
    for r in releases:
        count -= 1
        if count == 0:
            return r.index
    return end


def _input_gone(releases: list[Release], count: int, k0: int, end: int, only_input: bool) -> int:
    """Where the chain input goes when the last of ``count`` saved references (over the input only, or
    any) is released: ``k0`` when there is none, ``end`` when one is never released."""
    if count == 0:
        return k0
    for r in releases:
        if r.holds_input or not only_input:
            count -= 1
            if count == 0:
                return r.index
    return end


def relative_series(timeline: list, k0: int, start: int, input_bytes: int, releases: list[Release],
                    alive: int, alive_input: int, keep_input: bool, extra: int, gone: int | None = None) -> list[int]:
    """The live bytes of the backward as ``b`` counts them: above ``start`` less ``extra`` (the injected
    output gradients, pending gradients), the chain input held (``keep_input``) or freed once the
    last saved tensor over it is released (at ``gone`` when given); index 0 is the moment before the
    first operator."""
    if keep_input:
        gone = len(timeline)
    elif gone is None:
        gone = k0 if alive_input == 0 else _input_gone(releases, alive_input, k0, len(timeline), True)
    out = [-(input_bytes if gone <= k0 else 0) - extra]
    for k in range(k0, len(timeline)):
        out.append(timeline[k][2] - start - (input_bytes if k >= gone else 0) - extra)
    return out


def held_timelines(timeline: list, k0: int, deaths: dict, releases: list[Release], alive_keys: dict,
                   input_key: Any, input_gone: int, input_bytes: int) -> tuple[list, list]:
    """``(as autograd keeps them, as a recomputed segment does)``: the backward's timeline (entries from
    ``k0``) measured with every saved tensor let go when unpacked and the input held by nothing else,
    with the input added back from its death (``input_gone``; held throughout in both), and, for the
    first, each saved storage added back from its death to the release of its last saved reference
    (autograd releases a node's saved tensors after it has reduced the node's gradients)."""
    late = []  # (died, released, bytes) per saved storage that died before its last release
    for key in alive_keys:
        if key is None or key == input_key or key not in deaths:
            continue
        died, nbytes = deaths[key]
        if died < k0:
            continue
        rel = max((r.index for r in releases if r.key == key), default=len(timeline))
        if rel > died:
            late.append((died, rel, nbytes))
    held, rec = list(timeline[:k0]), list(timeline[:k0])
    for k in range(k0, len(timeline)):
        op, name, v = timeline[k]
        v += input_bytes if k >= input_gone else 0
        rec.append((op, name, v))
        held.append((op, name, v + sum(b for d, r, b in late if d <= k < r)))
    return held, rec


def peak_with_input(timeline: list, k0: int, start: int, input_bytes: int, gone: int, lo: int | None = None) -> int:
    """The backward's peak above ``start`` with the input, held in ``timeline``, gone from index ``gone``;
    ``lo``: over the entries from ``lo`` on only (the moment before the first operator counts when
    ``lo <= k0``)."""
    base = start - (input_bytes if gone <= k0 else 0)
    lo = k0 if lo is None else lo
    best = base if lo <= k0 else -(1 << 62)
    for k in range(max(k0, lo), len(timeline)):
        best = max(best, timeline[k][2] - (input_bytes if k >= gone else 0))
    return best - base


def split(series: list[int], k0: int, moment: int | None) -> tuple[int, int]:
    """(max before ``moment``, max from it on) of ``series`` (index 0 before the backward, then the
    timeline from ``k0``); a moment never reached gives (max, max)."""
    if moment is None:
        top = max(series)
        return top, top
    cut = max(0, min(len(series), moment - k0 + 1))
    pre = max(series[:cut]) if cut else series[0]
    post = max(series[cut:]) if cut < len(series) else series[-1]
    return pre, post


def backward_peaks(timeline: list, k0: int, start: int, input_bytes: int, releases: list[Release],
                   alive: int, alive_input: int) -> tuple[int, int, int]:
    """Backward peaks above ``start`` of one backward run with the input held, for the input
    (a) held throughout (the previous layer saves it, or it is the model input), (b) held by
    nothing else: gone once the last saved tensor over its storage is released (before the
    backward when none is), (c) held by a checkpoint's frame: gone once the layer's last saved
    tensor is released. ``timeline[k0:]``: live bytes after each backward op; ``releases``: per
    saved reference released; ``alive``/``alive_input``: how many were kept at the start."""
    end = len(timeline)
    out = []
    for gone in (end, _input_gone(releases, alive_input, k0, end, True), _input_gone(releases, alive, k0, end, False)):
        base = start - (input_bytes if gone <= k0 else 0)
        best = base
        for k in range(k0, end):
            best = max(best, timeline[k][2] - (input_bytes if k >= gone else 0))
        out.append(best - base)
    return out[0], out[1], out[2]


def without_copies(timeline: list, copies: list) -> list:
    """``timeline`` without the copies a measurement made of saved side inputs as the backward read
    them (``(made from, counted from, died at or None, bytes)``): each entry as if the copy were the
    original, which the caller holds throughout."""
    if not copies:
        return timeline
    out = [list(e) for e in timeline]
    for i0, i1, died, nbytes in copies:
        for k in range(i0, i1):
            out[k][2] = out[i0 - 1][2] if i0 else out[k][2] - nbytes
        for k in range(i1, len(out) if died is None else died):
            out[k][2] -= nbytes
    return [tuple(e) for e in out]


def dying_gains(dying: list[int], run_gain: Callable, n: int, cap: int = 3, rank: list | None = None) -> list[int]:
    """Per side input, what its dying at its last use inside the layer adds to the forward peak (at most
    0), such that for every set of them that dies the sum is at least the measured change: the peaks'
    changes are not additive (two dying where one alone changes nothing). ``run_gain(S)``: the change
    with the side inputs ``S`` dying together. Up to ``cap`` dying: every set is measured and each
    input, most gain first, gets the least that keeps every set with it and earlier ones covered
    (``g_j = max over S' of gain(S' + j) - sum(g_i, i in S')``: exact for the whole set when it saves at
    most the sum of the parts). More: each dies alone and only the largest gain counts. ``rank``: per side
    input, how likely a plan holds it elsewhere (lower first): of equal gains, the least likely held comes
    first, as the one that dies alone the most (a tensor its producer saves after one made in the segment)."""
    out = [0] * n
    single = {k: run_gain((k,)) for k in dying}

    def key(j: int) -> tuple:
        return single[j], (rank[j] if rank else 0), j
    if len(dying) > cap or len(dying) < 2:
        if single:
            k = min(single, key=key)
            out[k] = single[k]
        return out
    order = sorted(dying, key=key)
    sets = {(k,): single[k] for k in dying}
    for size in range(2, len(order) + 1):
        for combo in itertools.combinations(order, size):
            sets[tuple(sorted(combo))] = run_gain(tuple(sorted(combo)))
    for pos, j in enumerate(order):
        best = single[j]
        for size in range(1, pos + 1):
            for prev in itertools.combinations(order[:pos], size):
                best = max(best, sets[tuple(sorted(prev + (j,)))] - sum(out[i] for i in prev))
        out[j] = min(0, best)
    return out


# -- the figures ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ForwardFigures:
    """The forward's figures (docs/design.md §3), relative to the bytes live before it."""

    f: int  #: its peak with the chain input held (by a save of the layer before, a checkpoint, the caller)
    ff: int  #: its peak with the input dying at its last use inside the layer
    fs: int  #: ``f`` up to the last pack: where a recomputation that ends in this layer stops
    ffs: int  #: ``ff`` likewise

    def as_list(self, packs: bool) -> list[int]:
        """``[f, ff]`` and, when the forward packed anything, ``[fs, ffs]`` after them."""
        return [self.f, self.ff] + ([self.fs, self.ffs] if packs else [])


def forward_figures(rec: LayerRecord) -> ForwardFigures:
    """The forward's peaks with the input held or dying, whole and up to the last pack (the pack of a
    dead branch's tensor too: non-reentrant checkpoint counts every tensor its forward packed and stops
    once it has re-packed as many, so a dead branch after the last kept save is re-run as well)."""
    lo, hi = rec.forward
    held, free = forward_peaks(rec.timeline, lo, hi, rec.start, rec.input_bytes, rec.input_death_in_forward)
    if rec.last_pack is None:
        return ForwardFigures(held - rec.start, free - rec.start, 0, 0)
    pheld, pfree = forward_peaks(rec.timeline, lo, rec.last_pack, rec.start, rec.input_bytes,
                                 rec.input_death_in_forward)
    return ForwardFigures(held - rec.start, free - rec.start, pheld - rec.start, pfree - rec.start)


@dataclass(frozen=True)
class BackwardTimelines:
    """A record's backward read both ways: as autograd keeps saved tensors (``held``) and as a recomputed
    segment does (``rec``), with the moments the chain input goes in each."""

    held: list
    rec: list
    input_gone: int  #: where the input died in the run
    rec_gones: tuple[int, int]  #: where it goes in a recomputed segment: (as b has it, with the frame)
    alive_input: int

    @classmethod
    def of(cls, r: LayerRecord, keep_input: bool) -> "BackwardTimelines":
        k0, end, x = r.backward_index, r.end, r.keys.chain_in
        x_gone = k0 if r.input_dead else r.deaths.get(x, (end,))[0] if x is not None else end
        held, rec = held_timelines(without_copies(r.timeline, r.copies), k0, r.deaths, r.releases, r.alive_keys,
                                   x, x_gone, r.input_bytes)
        all_gone = all_released_at(r.releases, r.alive, k0, end)
        rec_gones = (end if keep_input else x_gone, max(x_gone, all_gone))
        alive_input = r.alive_keys.get(x, 0) if x is not None else 0
        return cls(held, rec, x_gone, rec_gones, alive_input)


@dataclass(frozen=True)
class BackwardFigures:
    """The backward's peaks (docs/design.md §3), relative as ``b``."""

    b: int  #: the input held as the layer before has it (``keep_input``), saved tensors kept by autograd
    bf: int  #: the input held by nothing but the layer's own saves
    bk: int  #: the input held by a checkpoint's frame (gone with the layer's last saved tensor)
    br: int  #: ``b`` in a recomputed segment (a saved tensor dies with the node that reads it)
    bkr: int  #: ``bk`` likewise
    brt: int  #: ``br`` from the first read of a saved tensor on (the trigger's part after the recomputation)
    bkrt: int  #: ``bkr`` likewise
    rgx: int  #: what the part before that read peaks at above the bytes at the read


def backward_figures(r: LayerRecord, keep_input: bool, bw: BackwardTimelines | None = None) -> BackwardFigures:
    """The backward's peaks for each way the input may be held, as autograd keeps saved tensors and as
    a recomputed segment does; and the split at the first read of a saved tensor (the segment's last
    saving layer triggers the recomputation there and runs the part before without the recomputed
    tensors)."""
    k0, start, xb = r.backward_index, r.backward_start, r.input_bytes
    bw = bw or BackwardTimelines.of(r, keep_input)
    peaks = backward_peaks(bw.held, k0, start, xb, r.releases, r.alive, bw.alive_input)
    rec_peaks = [peak_with_input(bw.rec, k0, start, xb, gone) for gone in bw.rec_gones]
    at = r.first_read.index if r.first_read else k0
    rec_post = [peak_with_input(bw.rec, k0, start, xb, gone, lo=at - 1) for gone in bw.rec_gones]
    rgx = max([0] + [e[2] - r.first_read.live for e in bw.rec[k0:at]]) if r.first_read else 0
    given = r.grads.outputs + r.grads.pending
    return BackwardFigures(
        b=int(peaks[0 if keep_input else 1] - given), bf=int(peaks[1] - given), bk=int(peaks[2] - given),
        br=int(rec_peaks[0] - given), bkr=int(rec_peaks[1] - given),
        # (at least 0: an output gradient the part before the read used up is gone after it, as b counts it)
        brt=int(max(0, rec_post[0] - given)), bkrt=int(max(0, rec_post[1] - given)), rgx=int(rgx))


@dataclass(frozen=True)
class ReleaseSplits:
    """``(pre, post)``: the backward's peak, relative as ``b``, before and from a moment on; None where
    the layer does not save the tensor."""

    frame: tuple[int, int]  #: when the layer's last saved tensor is released (a checkpoint's frame goes)
    frame_k: tuple[int, int]  #: the same where only the frame holds the input (it goes then too, as bkr)
    side_in: tuple  #: per side input: when its last saved reference is released
    side_in_free: tuple  #: ... with the input held by nothing but the layer's saves (as bf); () when b has that
    side_in_rec: tuple  #: ... in a recomputed segment (its recomputed copy dies with the node that read it)
    side_out: tuple  #: per side output the layer saves: counted whole, ``(top, top)``
    static_in: tuple  #: per static input


def release_splits(r: LayerRecord, keep_input: bool, bw: BackwardTimelines | None = None) -> ReleaseSplits:
    """The backward split at each release that frees something the simulator counts apart: the
    checkpoint's frame and the side and static tensors the layer saves. Each split goes with the
    backward figure it is combined with, so it is measured with the input held the same way: as ``b``
    has it, or as ``bkr`` (going with the frame) and ``bf`` (with the layer's own saves)."""
    k0, start, xb = r.backward_index, r.backward_start, r.input_bytes
    bw = bw or BackwardTimelines.of(r, keep_input)
    given = r.grads.outputs + r.grads.pending
    released = _released(r.releases)
    alive = r.alive_keys

    def series_of(timeline: list, keep: bool, gone: int | None = None) -> list[int]:
        return relative_series(timeline, k0, start, xb, r.releases, r.alive, bw.alive_input, keep, given, gone=gone)

    def at_release(series: list[int], events: list, key: Any) -> tuple[int, int] | None:
        return split(series, k0, gone_at(events, alive, key)) if alive.get(key) else None

    series = series_of(bw.held, keep_input)
    # (a checkpoint's frame goes in a recomputed segment only: split its own series there)
    rec_series = series_of(bw.rec, keep_input, gone=bw.input_gone)
    frame = split(rec_series, k0, gone_at(released, alive, None))
    frame_k = split(series_of(bw.rec, False, gone=bw.rec_gones[1]), k0, gone_at(released, alive, None))
    side_in = tuple(at_release(series, released, key) for key in r.keys.side_in)
    side_in_free = ()
    if keep_input:
        series_f = series_of(bw.held, False)
        side_in_free = tuple(at_release(series_f, released, key) for key in r.keys.side_in)
    side_in_rec = tuple(at_release(rec_series, r.rec_gone, key) for key in r.keys.side_in)
    # a side output the layer saves is in the backward's starting bytes (nothing but the saved reference
    # holds it here, as in the model, where the producer's backward comes last): counted whole on top of b
    top = max(series)
    side_out = tuple((top, top) if alive.get(key) else None for key in r.keys.side_out)
    static_in = tuple(at_release(series, released, key) if key is not None else None for key in r.keys.static_in)
    return ReleaseSplits(frame, frame_k, side_in, side_in_free, side_in_rec, side_out, static_in)


def held_output_gain(r: LayerRecord, keep_input: bool, bw: BackwardTimelines | None = None) -> int:
    """What the backward's peak gains when the injected output gradient is held to its end (a side
    tensor's gradient viewing its storage keeps it in the model): ``gh``."""
    freed, gbytes = r.out_grad_freed, r.grads.chain_grad_bytes
    if freed is None or not gbytes:
        return 0
    k0 = r.backward_index
    live = [e[2] for e in (bw or BackwardTimelines.of(r, keep_input)).held[k0:]] or [r.backward_start]
    held = [v + (gbytes if k0 + k >= freed else 0) for k, v in enumerate(live)]
    return max(0, max(held) - max(live))


def first_read_figures(r: LayerRecord, a_own: int) -> tuple[int, int, int | None]:
    """``(rg, rgk, rgl)``: the gradient bytes held when the backward first reads a saved tensor, where a
    recomputation this backward triggers starts (``a_own`` when it reads none).

    ``rg`` is taken as with an ``a``-byte output gradient (the model counts ``g`` for it): the gradient of
    a view is smaller, a storage shared with other gradients larger. An output gradient used up by then
    took its whole storage with it, as in the model, where the kernels add ``g - a`` back: ``rg`` may come
    out below 0 and is taken as 0, never under; ``rgk`` keeps the storage (a side tensor's pending gradient
    views it). ``rgl`` leaves out a lone side output's injected gradient (None where there is none).
    """
    g = r.grads
    if not r.first_read:
        return int(a_own), int(a_own), None if g.lone_side is None else 0
    gain = max(0, r.first_read.live - r.backward_start - g.pending)
    rg = int(max(0, gain + a_own - (g.chain_storage or g.chain)))
    rgk = int(gain + a_own - (0 if r.first_read.out_grad_gone else g.chain_storage or g.chain))
    rgl = None if g.lone_side is None else int(max(0, gain - g.lone_side))
    return rg, rgk, rgl


@dataclass(frozen=True)
class SavedSet:
    """What the layer saves, sorted into the chain model's terms (docs/design.md §3)."""

    sin: bool  #: its chain input (not also its output or a side output)
    sout: bool  #: its chain output
    m: int  #: bytes of everything else it saves (statistics, masks, interior tensors)
    holds: bool  #: it saves only tensors none of the above counts (a static input, a parameter)
    out_static: bool  #: its output is static memory (the model input handed on, a parameter): ``a`` is 0


def saved_set(r: LayerRecord, static: set, params: set, buffers: set, casts: set, leaf_input: bool) -> SavedSet:
    """Sort the saved storages (those autograd keeps when the forward ends) by what they are: the chain
    input and output, side tensors (the simulator counts them), static memory (parameters, buffers,
    static inputs, autocast's cached weight casts), and the rest (``m``)."""
    saved, k = r.saved, r.keys
    sout = k.chain_out is not None and k.chain_out in saved
    out_static = k.chain_out is not None and (k.chain_out in static | params | buffers
                                              or (leaf_input and k.chain_out == k.chain_in))
    # a side output that is the input itself (a same-dtype cast of a residual crossing on to later
    # layers) carries that storage from here: counted once, as the side tensor
    sin = (k.chain_in is not None and k.chain_in in saved and k.chain_in != k.chain_out
           and k.chain_in not in k.side_out)
    side = set(k.side_in) | set(k.side_out)
    other = set(saved) - params - buffers - casts - static - {k.chain_in, k.chain_out} - side
    return SavedSet(sin=bool(sin), sout=bool(sout), m=int(sum(saved[key] for key in other)),
                    holds=bool(r.kept) and not (sin or sout or other), out_static=bool(out_static))
