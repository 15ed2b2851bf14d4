"""The predicted memory timeline of one training step under a plan.

:func:`ckptopt.simulate` returns only a plan's peak. :func:`simulate_timeline`
returns the memory at every event of the step, in the order the events run:

1. the forward of every layer, segment by segment;
2. then, segment by segment from the last to the first: the recomputation of
   the segment (every checkpointed segment, for the layers it re-runs) and
   the backward of its layers, last layer first.

Each value is the memory at the high point of that event (static bytes,
checkpoints held, saved tensors, gradients and the event's own transient),
computed with exactly the terms of :mod:`ckptopt._kernels` (``segment_peak``
and ``held_checkpoint``; DESIGN.md sections 3 and 4), so the maximum of the
timeline is the plan's peak as :func:`ckptopt.simulate` reports it. The
additive form has only a backward term per layer, so its timeline lists the
backward events only.

No torch import: like the simulator, this module runs on plain integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .costs import ChainCosts
from .simulate import normalize_plan

__all__ = ["TimelineEvent", "simulate_timeline"]


@dataclass(frozen=True)
class TimelineEvent:
    """One event of the predicted step.

    Attributes
    ----------
    phase : str
        ``"forward"``, ``"recompute"`` or ``"backward"``.
    layer : int
        The layer that runs.
    segment : int
        The segment it belongs to (0-based).
    bytes : int
        Memory at the high point of the event, static bytes included.
    """

    phase: str
    layer: int
    segment: int
    bytes: int


def _segments(n: int, plan: tuple[int, ...]) -> list[tuple[int, int]]:
    starts = (0,) + plan
    ends = tuple(s - 1 for s in plan) + (n - 1,)
    return list(zip(starts, ends))


def _held_checkpoint(l: int, r: int, last: bool, full: bool, K) -> int:
    """Bytes segment [l, r] holds as its checkpoint (``_kernels.held_checkpoint``)."""
    ck, saves, sin = K[2], K[9], K[10]
    if l == 0:
        return 0
    if not full:
        return int(ck[l])
    if last:
        return int(ck[l]) if sin[l] else 0
    return int(ck[l]) if any(saves[i] for i in range(l, r + 1)) else 0


def _forward(l: int, r: int, last: bool, K, live_in: int) -> list[tuple[str, int, int]]:
    """Forward events of segment [l, r], relative to its checkpoints."""
    P, f, fw, qf = K[0], K[5], K[4], K[3]
    out = [("forward", l, int(f[l]) + live_in)]
    for i in range(l + 1, r + 1):
        v = int(P[i] - P[l] + qf[i]) if last else int(fw[i])
        out.append(("forward", i, v))
    return out


def _recompute(l: int, r: int, K) -> list[tuple[str, int, int]]:
    """Recomputation events of the checkpointed segment [l, r] (none if it saves nothing)."""
    P, qf, f, runs, qs, fs, rb = K[0], K[3], K[5], K[8], K[11], K[12], K[15]
    j = _trigger(l, r, K)
    ext = K[16]  # the recomputation (if any: j >= l) reaches the last layer that packs, dead tensors too
    e = next((i for i in range(r, j - 1, -1) if ext[i]), l - 1) if j >= l else l - 1
    partial = e >= l and bool(runs[e])  # e runs only up to its last saved tensor
    if e >= l and not runs[e]:
        e -= 1  # e saves only its input: the layer before it runs to its end
    base = int(rb[r])  # the gradients held when the backward of the last saving layer first reads
    out = []
    for i in range(l, e + 1):
        stop = partial and i == e
        if i == l:
            v = base + int(fs[l] if stop else f[l])
        else:
            v = base + int(P[i] - P[l]) + int(qs[i] if stop else qf[i])
        out.append(("recompute", i, v))
    return out


def _trigger(l: int, r: int, K) -> int:
    """The last layer of [l, r] that saves a tensor (l - 1 if none): in a checkpointed segment its
    backward is the first to read one, so the recomputation starts there."""
    saves = K[9]
    return next((i for i in range(r, l - 1, -1) if saves[i]), l - 1)


def _backward(l: int, r: int, K, after: int | None = None, held_input: bool = False) -> list[tuple[str, int, int]]:
    """Backward events of layers ``r`` down to ``l``; layers after ``after`` are taken without the
    segment's saved tensors (a checkpointed segment's trailing layers, run before the recomputation);
    ``held_input``: something else holds layer ``l``'s input through its backward (``qbk``)."""
    P, qb, qbk = K[0], K[1], K[17]
    after = r if after is None else after
    out = []
    for i in range(r, l - 1, -1):
        q = int(qbk[i] if held_input and i == l else qb[i])
        out.append(("backward", i, int(P[i] - P[l]) + q if i <= after else q))
    return out


def simulate_timeline(costs: ChainCosts, checkpoints: Iterable[int]) -> list[TimelineEvent]:
    """Memory at every event of one training step under a plan.

    Parameters
    ----------
    costs : ChainCosts
        The cost model (full or additive form).
    checkpoints : sequence of int
        Segment-start layers, strictly increasing, each in ``1..n-1``.

    Returns
    -------
    list of TimelineEvent
        In execution order: ``n`` forward events, then per segment from the
        last to the first its ``r - l + 1`` backward events, with its recompute
        events (for the layers :func:`ckptopt.simulate.recomputed_layers` names)
        before the backward of its last layer that saves a tensor (the
        backward of the layers after it reads nothing saved, so it runs
        first). The additive form gives the ``n`` backward events only.

    Raises
    ------
    InvalidPlan
        As :func:`ckptopt.simulate` does, for a malformed plan.

    Notes
    -----
    ``max(e.bytes for e in timeline) == simulate(costs, checkpoints).peak_bytes``
    (the same terms, tested). Running time O(n) plus O(r - l) per segment for
    the checkpoint test, pure Python (about 1 microsecond per event).

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 5, 5], h=[10, 10, 10], q=[1, 1, 1])
    >>> [e.bytes for e in simulate_timeline(c, (1,))]
    [16, 6, 1]
    """
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"simulate_timeline() needs a ChainCosts, got {type(costs).__name__}")
    plan = normalize_plan(costs, checkpoints)
    K = costs.kernel_arrays
    full = not costs.is_additive
    segs = _segments(costs.n, plan)
    m = len(segs)
    held = []
    forward: list[TimelineEvent] = []
    total = 0
    for k, (l, r) in enumerate(segs):
        last = k == m - 1
        c = _held_checkpoint(l, r, last, full, K)
        total += c
        held.append(total)
        if full:
            live_in = int(K[2][l]) - c if k > 0 else 0
            base = costs.static + total
            forward += [TimelineEvent(ph, i, k, base + v) for ph, i, v in _forward(l, r, last, K, live_in)]
    backward: list[TimelineEvent] = []
    for k in range(m - 1, -1, -1):
        l, r = segs[k]
        base = costs.static + held[k]
        if full and k < m - 1:  # trailing layers that save nothing, the recomputation, the rest
            j = _trigger(l, r, K)
            trail = _backward(l, r, K, after=j, held_input=l > 0)
            events = trail[:r - j] + _recompute(l, r, K) + trail[r - j:]
        else:
            events = _backward(l, r, K)
        backward += [TimelineEvent(ph, i, k, base + v) for ph, i, v in events]
    return forward + backward
