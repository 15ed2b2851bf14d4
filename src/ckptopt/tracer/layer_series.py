"""The memory series of one layer's measured forward and backward, read the way the chain model counts
them (docs/design.md §3): helpers of :func:`ckptopt.tracer.layer_costs.measure_layer`."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from ..torch_utils import clone_layout
from ..tracker import StorageTracker, real_storage, storage_key
from .layer_grads import _FreshInput


def _shares(side: dict, main: dict) -> str | int | None:
    """Which input gradient a side input's gradient shares its storage with: "main" (the chain
    input's), the index of another side input, or None; either order of arrival."""
    if side.get("shares") is not None:
        return side["shares"]
    if main.get("shares") == side.get("tag"):
        return "main"
    return None


def _gone_at(released_keys: list[tuple[int, Any]], alive_keys: dict, key: Any) -> int | None:
    """The timeline index from which the saved tensors over storage ``key`` (every saved tensor when
    ``key`` is None) are all released (None: never, within the backward)."""
    count = sum(alive_keys.values()) if key is None else alive_keys.get(key, 0)
    if count == 0:
        return None
    for index, k in released_keys:
        if key is None or k == key:
            count -= 1
            if count == 0:
                return index
    return None


def _relative_series(timeline: list, k0: int, start: int, input_bytes: int, released: list[tuple[int, bool]],
                     alive: int, alive_input: int, keep_input: bool, extra: int, gone: int | None = None) -> list[int]:
    """The live bytes of the backward as ``b`` counts them: above ``start`` less ``extra`` (the injected
    output gradients, pending gradients), the chain input held (``keep_input``) or freed once the
    last saved tensor over it is released (at ``gone`` when given); index 0 is the moment before the
    first operator."""
    if keep_input:
        gone = len(timeline)
    elif gone is None:
        count = alive_input
        gone = k0 if count == 0 else len(timeline)
        for index, over_input in released:
            if over_input and count:
                count -= 1
                if count == 0:
                    gone = index
                    break
    out = [-(input_bytes if gone <= k0 else 0) - extra]
    for k in range(k0, len(timeline)):
        out.append(timeline[k][2] - start - (input_bytes if k >= gone else 0) - extra)
    return out


def _list_input_copy(module: nn.Module) -> nn.Module | None:
    """A copy of a graph module whose forward takes its inputs as one list and empties it on entry
    (sharing its submodules and parameters), so that an input nothing else holds is freed after its
    last use inside it; None for another module."""
    import copy

    import torch.fx as fx

    from ..torch_utils import inputs_from_list

    if not isinstance(module, fx.GraphModule):
        return None
    g = copy.deepcopy(module.graph)
    if not inputs_from_list(g):
        return None
    return fx.GraphModule(module, g)


def _forward_peaks(timeline: list, lo: int, hi: int, start: int, input_bytes: int, death: int) -> tuple[int, int]:
    """``(with the input held, as it went)``: the highest live bytes (at least ``start``) over the
    timeline entries ``lo..hi-1`` of a forward in which the input died at entry ``death``."""
    held = free = start
    for k in range(lo, hi):
        v = timeline[k][2]
        free = max(free, v)
        held = max(held, v + (input_bytes if k >= death else 0))
    return held, free


def _held_timelines(timeline: list, k0: int, deaths: dict, released_keys: list[tuple[int, Any]], alive_keys: dict,
                    x_ptr: Any, x_gone: int, input_bytes: int) -> tuple[list, list]:
    """``(as autograd keeps them, as a recomputed segment does)``: the backward's timeline (entries from
    ``k0``) measured with every saved tensor let go when unpacked and the input held by nothing else,
    with the input added back from its death (``x_gone``; held throughout in both), and, for the
    first, each saved storage added back from its death to the release of its last saved reference
    (autograd releases a node's saved tensors after it has reduced the node's gradients)."""
    late = []  # (died, released, bytes) per saved storage that died before its last release
    for key in alive_keys:
        if key is None or key == x_ptr or key not in deaths:
            continue
        died, nbytes = deaths[key]
        if died < k0:
            continue
        rel = max((i for i, k in released_keys if k == key), default=len(timeline))
        if rel > died:
            late.append((died, rel, nbytes))
    held, rec = list(timeline[:k0]), list(timeline[:k0])
    for k in range(k0, len(timeline)):
        op, name, v = timeline[k]
        v += input_bytes if k >= x_gone else 0
        rec.append((op, name, v))
        held.append((op, name, v + sum(b for d, r, b in late if d <= k < r)))
    return held, rec


def _all_released_at(released: list[tuple[int, bool]], alive: int, k0: int, end: int) -> int:
    """The timeline index from which every saved tensor kept at the backward's start is released
    (``k0`` when none is; ``end`` when some never is)."""
    count = alive
    if count == 0:
        return k0
    for index, _ in released:
        count -= 1
        if count == 0:
            return index
    return end


def _peak_with_input(timeline: list, k0: int, start: int, input_bytes: int, gone: int, lo: int | None = None) -> int:
    """The backward's peak above ``start`` (as :func:`_backward_peaks` counts it) with the input, held
    in ``timeline``, gone from index ``gone``; ``lo``: over the entries from ``lo`` on only (the moment
    before the first operator counts when ``lo <= k0``)."""
    base = start - (input_bytes if gone <= k0 else 0)
    lo = k0 if lo is None else lo
    best = base if lo <= k0 else -(1 << 62)
    for k in range(max(k0, lo), len(timeline)):
        best = max(best, timeline[k][2] - (input_bytes if k >= gone else 0))
    return best - base


def _split(series: list[int], k0: int, moment: int | None) -> tuple[int, int]:
    """(max before ``moment``, max from it on) of ``series`` (index 0 before the backward, then the
    timeline from ``k0``); a moment never reached gives (max, max)."""
    if moment is None:
        top = max(series)
        return top, top
    cut = max(0, min(len(series), moment - k0 + 1))
    pre = max(series[:cut]) if cut else series[0]
    post = max(series[cut:]) if cut < len(series) else series[-1]
    return pre, post


def _backward_peaks(timeline: list, k0: int, start: int, input_bytes: int, released: list[tuple[int, bool]],
                    alive: int, alive_input: int) -> tuple[int, int, int]:
    """Backward peaks above ``start`` of one backward run with the input held, for the input
    (a) held throughout (the previous layer saves it, or it is the model input), (b) held by
    nothing else: gone once the last saved tensor over its storage is released (before the
    backward when none is), (c) held by a checkpoint's frame: gone once the layer's last saved
    tensor is released. ``timeline[k0:]``: live bytes after each backward op; ``released``:
    (timeline index, over the input) per saved tensor released; ``alive``/``alive_input``: how
    many were kept at the start."""

    def gone_from(count: int, only_input: bool) -> int:
        if count == 0:
            return k0
        for index, over_input in released:
            if over_input or not only_input:
                count -= 1
                if count == 0:
                    return index
        return len(timeline)  # still kept at the end: held throughout

    out = []
    for gone in (len(timeline), gone_from(alive_input, True), gone_from(alive, False)):
        base = start - (input_bytes if gone <= k0 else 0)
        best = base
        for k in range(k0, len(timeline)):
            best = max(best, timeline[k][2] - (input_bytes if k >= gone else 0))
        out.append(best - base)
    return out[0], out[1], out[2]


def _key(t: torch.Tensor, fake: bool) -> Any:
    """The storage key of ``t``, or None for an empty (or storage-less) tensor."""
    s = real_storage(t, fake)
    return storage_key(s) if s is not None else None


def reachable(outputs: list[torch.Tensor]) -> set:
    """The autograd nodes a backward from ``outputs`` reaches."""
    seen: set = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return seen


def _without_copies(timeline: list, copies: list[list]) -> list:
    """``timeline`` without the copies a measurement made of saved side inputs as the backward read
    them (``[made from, counted from, died at or None, bytes]``): each entry as if the copy were the
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


def _fresh_inputs(example_input: torch.Tensor | None, input_requires_grad: bool, leaf_input: bool,
                  side_inputs: list, dev: Any, record: dict, side_records: list[dict]) -> tuple[Any, list]:
    """The layer's chain input and side inputs, fresh copies laid out as in the model, held by nothing
    but the caller: requiring grad as in the model (through :class:`_FreshInput`, which tells
    ``record`` about the gradient it receives; a leaf where the model input is one)."""
    x = None
    if example_input is not None:
        holder = [clone_layout(example_input)]
        if input_requires_grad and leaf_input:
            x = holder.pop().requires_grad_(True)
        elif input_requires_grad:
            x = _FreshInput.apply(torch.empty(0, device=dev, requires_grad=True), holder, record)
        else:  # e.g. the first layer of a model, fed with data: no input gradient is computed
            x = holder.pop()
    sides = []
    for t, rec_t in zip(side_inputs, side_records):
        h = [clone_layout(t)]
        sides.append(_FreshInput.apply(torch.empty(0, device=dev, requires_grad=True), h, rec_t)
                     if t.requires_grad else h.pop())
    return x, sides


def _call_layer(module: nn.Module, freeing: nn.Module | None, inputs: list) -> Any:
    """Run the layer on ``inputs``; ``freeing`` (:func:`_list_input_copy`) empties the list on entry, so
    an input the caller no longer holds dies at its last use inside the layer."""
    return freeing(inputs) if freeing is not None else module(*inputs)


def _forward_pass(module: nn.Module, freeing: nn.Module | None, example_input: torch.Tensor | None,
                  input_requires_grad: bool, leaf_input: bool, side_inputs: list, static_inputs: list,
                  casts: list, fake: bool, dev: Any, keep_saves: bool,
                  drop_side: tuple[int, ...] = ()) -> tuple[int, int, int, int]:
    """``(with the input held, as it went)``: the layer's forward transient, relative as ``f``, in one more
    forward on fresh inputs; then the same up to the forward's last pack (as ``fs``, ``ffs``; 0 if none).

    ``keep_saves`` False: under a pack hook that keeps nothing, as a checkpoint's first pass runs
    (``fc``, ``ffc``): non-reentrant checkpoint keeps none of the tensors the forward saves, so each
    dies at its last use, where autograd elsewhere keeps it to the backward (a normalization's
    input, a dead branch's). ``drop_side``: side inputs held by nothing but the call, so that each
    dies at its last use inside the layer, as it does in the model where this layer reads it last
    and nothing holds it (no save, no checkpoint). The other side inputs are held throughout, as
    the call holds them (docs/design.md §3-4). ``freeing``: the measurement's
    :func:`_list_input_copy` of the module (None where the input is a leaf or the module no graph).
    """
    x, sides = _fresh_inputs(example_input, input_requires_grad, leaf_input, side_inputs, dev, {},
                             [{} for _ in side_inputs])
    input_bytes = x.untyped_storage().nbytes() if x is not None else 0
    died: list[int] = []
    tracker = StorageTracker(fake=fake, timeline=True)
    if x is not None:
        weakref.finalize(real_storage(x, fake), lambda: died.append(len(tracker.timeline))).atexit = False
    tracker.register(module, *([x] if x is not None else []), *sides, *casts, *static_inputs)
    start = tracker.current_bytes
    packed: list[int] = []  # the timeline's length at each pack

    def keep(t: torch.Tensor) -> torch.Tensor:
        packed.append(len(tracker.timeline))
        return t.detach()  # (a saved output returned as itself: a cycle through its grad_fn, never freed)

    hooks = torch.autograd.graph.saved_tensors_hooks(keep if keep_saves else (lambda t: None), lambda t: t)
    try:
        with tracker:
            f_start = len(tracker.timeline)
            with hooks:
                inputs = ([x] if x is not None else []) + [*sides, *static_inputs]
                if freeing is not None:
                    x = None
                    for k in drop_side:
                        sides[k] = None
                y = _call_layer(module, freeing, inputs)
                del inputs
            end = len(tracker.timeline)
            gone = died[0] if died else end
            held, free = _forward_peaks(tracker.timeline, f_start, end, start, input_bytes, gone)
            # (and up to the last pack: where a recomputation ending in this layer stops)
            pheld, pfree = (_forward_peaks(tracker.timeline, f_start, packed[-1], start, input_bytes, gone)
                            if packed else (start, start))
            del y
    finally:
        tracker.detach()
    return int(held - start), int(free - start), int(pheld - start), int(pfree - start)


def _dying_gains(dying: list[int], run_gain, n: int, cap: int = 3, rank: list | None = None) -> list[int]:
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
