"""The predicted memory timeline of one training step under a plan.

:func:`ckptopt.simulate` returns only a plan's peak. :func:`simulate_timeline`
returns the memory at every event of the step, in the order the events run:

1. the forward of every layer, segment by segment;
2. then, segment by segment from the last to the first: the recomputation of
   the segment (every checkpointed segment, for the layers it re-runs) and
   the backward of its layers, last layer first.

Each value is the memory at the high point of that event (static bytes,
checkpoints held, tensors kept by unwrapped segments, saved tensors, gradients
and the event's own transient), computed with the terms and helpers of
:mod:`ckptopt.simulator.kernels` (``held_checkpoint``, ``recompute_span``), so the
maximum of the timeline is the plan's peak as :func:`ckptopt.simulate` reports it,
stored segments included. The additive form has only a backward term per layer,
so its timeline lists the backward events only.

No torch import: like the simulator, this module runs on plain integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..costs import ChainCosts, KernelArrays
from ..plan import segment_bounds
from . import kernels, side_tensors
from .peak import checked_plan

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


def _forward(l: int, r: int, unwrapped: bool, K: KernelArrays, live_in: int,
             free: bool = False) -> list[tuple[str, int, int]]:
    """Forward events of segment [l, r], relative to its checkpoints; ``free``: nothing holds the
    input of an unwrapped segment's first layer (it dies at its last use there, ``ff``)."""
    out = [("forward", l, int(K.ff[l] if free else K.f[l] if unwrapped else K.fc[l]) + live_in)]
    for i in range(l + 1, r + 1):
        v = int(K.P[i] - K.P[l] + K.qf[i]) if unwrapped else int(K.fw[i]) + live_in  # (the call holds it)
        out.append(("forward", i, v))
    return out


def _recompute(l: int, r: int, end: int, partial: bool, K: KernelArrays) -> list[tuple[str, int, int]]:
    """Recomputation events of the checkpointed segment [l, r], layers ``l..end``."""
    base = int(K.rb[r])  # the gradients held when the backward of the last saving layer first reads
    out = []
    for i in range(l, end + 1):
        stop = partial and i == end
        if i == l:
            v = base + int(K.fs[l] if stop else K.f[l])
        else:
            v = base + int(K.P[i] - K.P[l]) + int(K.qs[i] if stop else K.qf[i])
        out.append(("recompute", i, v))
    return out


def _backward(l: int, r: int, K: KernelArrays, after: int | None = None,
              held_input: bool = False, free_input: bool = False, drop: int = 0,
              recomputed: bool = False) -> list[tuple[str, int, int]]:
    """Backward events of layers ``r`` down to ``l``; layers after ``after`` are taken without the
    segment's saved tensors (a checkpointed segment's trailing layers, run before the recomputation);
    ``held_input``: only the checkpoint's frame holds layer ``l``'s input (``qbk``);
    ``free_input``: nothing but layer ``l`` holds it (``qbf``); ``drop``: the checkpoint the
    layers before the first saving one run their backward without (its frame is gone);
    ``recomputed``: a checkpointed segment, whose saved tensors are recomputed (``qbr``, ``qbkr``)."""
    after = r if after is None else after
    freed_before = int(kernels.first_saving(l, r, K)) if drop else l
    out = []
    for i in range(r, l - 1, -1):
        if recomputed and i == after:  # the last saving layer, from its first read of a saved tensor on
            q = int(K.qbkt[i] if held_input and i == l else K.qbt[i])
        elif recomputed:
            q = int(K.qbkr[i] if held_input and i == l else K.qbr[i])
        else:
            q = int(K.qbk[i] if held_input and i == l else K.qbf[i] if free_input and i == l else K.qb[i])
        v = int(K.P[i] - K.P[l]) + q if i <= after else q
        v += int(K.ckf[l]) if drop and i == freed_before > l else 0  # (the checkpoint goes mid-way through it)
        out.append(("backward", i, v - (drop if i < freed_before else 0)))
    return out


def simulate_timeline(costs: ChainCosts, checkpoints: Iterable[int], stored: Iterable[int] = ()) -> list[TimelineEvent]:
    """Memory at every event of one training step under a plan.

    Parameters
    ----------
    costs, checkpoints, stored
        The cost model and the plan, as for :func:`ckptopt.simulate`.

    Returns
    -------
    list of TimelineEvent
        In execution order: ``n`` forward events, then per segment from the
        last to the first its ``r - l + 1`` backward events, with its recompute
        events (for the layers :func:`ckptopt.simulator.recomputed_layers` names)
        before the backward of its last layer that saves a tensor (the
        backward of the layers after it reads nothing saved, so it runs
        first), and after one more backward event of that layer: its backward
        up to its first read of a saved tensor, which triggers them. Unwrapped segments
        have no recompute events. The additive form gives the ``n`` backward events only.

    Raises
    ------
    InvalidPlan
        As :func:`ckptopt.simulate` does, for a malformed plan.

    Notes
    -----
    ``max(e.bytes for e in timeline) == simulate(costs, checkpoints, stored).peak_bytes``
    (the same terms; ``tests/test_timeline.py`` checks it against the simulator and an
    independent reference, on random plans with stored segments in
    ``test_timeline_agrees_with_simulate_on_many_random_stored_plans``). Running time O(n)
    plus O(r - l) per segment, pure Python over compiled helpers (about 1 microsecond per
    event).

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 5, 5], h=[10, 10, 10], q=[1, 1, 1])
    >>> [e.bytes for e in simulate_timeline(c, (1,))]
    [16, 6, 1]
    """
    plan, stored = checked_plan(costs, checkpoints, stored, "simulate_timeline")
    segs = _Segments.of(costs, plan, set(stored))
    return segs.forward + [e for k in range(len(segs.bounds) - 1, -1, -1) for e in segs.backward(k)]


@dataclass
class _Segments:
    """A plan's segments as the timeline walks them: per segment its bounds, the bytes earlier segments
    hold when it runs, whether the previous (stored) one keeps its input, the checkpoint it holds
    itself, and what side tensors add to its terms; and the forward events."""

    costs: ChainCosts
    kept: set
    bounds: list = field(default_factory=list)
    held: list = field(default_factory=list)
    kept_in: list = field(default_factory=list)
    own: list = field(default_factory=list)
    adds: list = field(default_factory=list)  # per segment: (forward, recompute, backward) side addends, or None
    forward: list = field(default_factory=list)

    @classmethod
    def of(cls, costs: ChainCosts, plan: tuple, kept: set) -> "_Segments":
        segs = cls(costs, kept, segment_bounds(costs.n, plan))
        K, full, m = costs.kernel_arrays, not costs.is_additive, len(segs.bounds)
        total, prev_keeps, mask = 0, False, 0
        sc = side_tensors.side_scratch(costs.n, len(costs.side)) if costs.has_side else None
        for k, (l, r) in enumerate(segs.bounds):
            unwrapped = k == m - 1 or l in kept
            c = 0 if prev_keeps else int(kernels.held_checkpoint(l, r, unwrapped, full, K))
            total += c
            segs.held.append(total)
            segs.kept_in.append(prev_keeps)
            segs.own.append(c)
            side_held = 0
            if sc is not None:
                side_held, mask = side_tensors.side_terms(l, r, unwrapped, prev_keeps, mask, K, costs.side_arrays, sc)
                segs.adds.append((sc.fadd.copy(), sc.radd.copy(), sc.badd.copy()))
            else:
                segs.adds.append(None)
            if full:
                live_in = int(K.ck[l]) - c if k > 0 and not prev_keeps else 0
                base = costs.static + total
                segs.forward += [TimelineEvent(ph, i, k, base + v + _add(segs.adds[k], 0, i))
                                 for ph, i, v in _forward(l, r, unwrapped, K, live_in,
                                                          unwrapped and k > 0 and not prev_keeps and not K.sin[l])]
            total += int(side_held)
            prev_keeps = False
            if unwrapped and k < m - 1:  # a stored segment keeps what its layers save for every later one
                total += int(K.P[r] - K.P[l] + K.keep[r])
                prev_keeps = bool(K.sout[r])
        return segs

    def backward(self, k: int) -> list[TimelineEvent]:
        """Segment ``k``'s backward events: a checkpointed one's trailing layers that save nothing, its last
        saving layer's backward up to its first read of a saved tensor (with layer l's recomputation
        addends), the recomputation that read triggers, then the rest of its backward."""
        K, l, r = self.costs.kernel_arrays, *self.bounds[k]
        base = self.costs.static + self.held[k]
        if not self.costs.is_additive and k < len(self.bounds) - 1 and l not in self.kept:
            trigger, end, partial = (int(x) for x in kernels.recompute_span(l, r, K))
            frame = l > 0 and not self.kept_in[k]
            trail = _backward(l, r, K, after=trigger, held_input=frame, drop=self.own[k], recomputed=True)
            first = [("backward", trigger, int(K.rbp[r]), (1, l))] if trigger >= l else []
            events = trail[:r - trigger] + first + _recompute(l, r, end, bool(partial), K) + trail[r - trigger:]
        else:
            events = _backward(l, r, K, free_input=l > 0 and not self.kept_in[k])
        return [TimelineEvent(e[0], e[1], k, base + e[2] + _add(self.adds[k], *(e[3] if len(e) > 3 else
                                                                                 (1 if e[0] == "recompute" else 2, e[1]))))
                for e in events]


def _add(terms, phase: int, i: int) -> int:
    """What side tensors add to the term of layer ``i`` (phase 0 forward, 1 recompute, 2 backward)."""
    return 0 if terms is None else int(terms[phase][i])
