"""The memory series of one layer's measured forward and backward, read the way the chain model counts
them (docs/design.md §3): helpers of :func:`ckptopt.tracer.layer_costs.measure_layer`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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


def _peak_with_input(timeline: list, k0: int, start: int, input_bytes: int, gone: int) -> int:
    """The backward's peak above ``start`` (as :func:`_backward_peaks` counts it) with the input, held
    in ``timeline``, gone from index ``gone``."""
    base = start - (input_bytes if gone <= k0 else 0)
    best = base
    for k in range(k0, len(timeline)):
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
