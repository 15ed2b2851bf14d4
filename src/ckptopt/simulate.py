"""The peak-memory simulator: the single source of truth for a plan's peak.

A *plan* is the sorted tuple of layers that start a new segment, excluding
layer 0 (which always starts the first segment). ``()`` is one segment: no
checkpointing. Every segment but the last is run under
``torch.utils.checkpoint(..., use_reentrant=False)``; the last is left
unwrapped (same peak, no recomputation). The formulas are DESIGN.md section 3;
:mod:`ckptopt._kernels` states them term by term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from . import _kernels
from .costs import ChainCosts
from .errors import InvalidPlan

__all__ = ["simulate", "SimResult", "normalize_plan", "normalize_stored", "recomputed_layers"]

_PHASES = ("forward", "recompute", "backward")


@dataclass(frozen=True)
class SimResult:
    """Where a plan's peak is reached.

    Attributes
    ----------
    peak_bytes : int
        Peak memory of one training step, static bytes included.
    phase : str
        ``"forward"``, ``"recompute"`` or ``"backward"`` (the additive form has
        only the backward term).
    layer : int
        The layer running when the peak is reached.
    segment : int
        Index of the segment that layer belongs to (0-based).
    recompute_flops : int
        Forward compute the plan runs again in backward: :attr:`ChainCosts.c`
        summed over :func:`recomputed_layers` (FLOPs for traced models; a
        count of layers when the costs carry no compute).
    forward_flops : int
        Compute of one forward pass (the sum of ``c``).
    """

    peak_bytes: int
    phase: str
    layer: int
    segment: int
    recompute_flops: int = 0
    forward_flops: int = 0

    @property
    def recompute_share(self) -> float:
        """Recomputation as a share of one training step without it, a step
        taken as forward + backward = 3 x forward (backward ~ 2 x forward)."""
        return self.recompute_flops / (3 * self.forward_flops) if self.forward_flops else 0.0


def normalize_plan(costs: ChainCosts, checkpoints: Iterable[int]) -> tuple[int, ...]:
    """Validate ``checkpoints`` against ``costs`` and return it as a tuple of ints.

    Raises
    ------
    InvalidPlan
        When an entry is not an integer, is out of ``1..n-1``, or the entries
        are not strictly increasing.
    """
    if isinstance(checkpoints, (str, bytes)):
        raise InvalidPlan(f"a plan is a sequence of layer indices, got the string {checkpoints!r}")
    try:
        items = list(checkpoints)
    except TypeError as exc:
        raise InvalidPlan(f"a plan is a sequence of layer indices, got {type(checkpoints).__name__}") from exc
    out = []
    n = costs.n
    for pos, c in enumerate(items):
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise InvalidPlan(f"plan entry {pos} is {c!r}, not a layer index (int)")
        c = int(c)
        if not 1 <= c <= n - 1:
            raise InvalidPlan(
                f"plan entry {pos} is layer {c}, outside 1..{n - 1}: a checkpoint names the first "
                f"layer of a new segment, and layer 0 always starts the first one (n = {n})"
            )
        if out and c <= out[-1]:
            raise InvalidPlan(f"plan entries must be strictly increasing: {out[-1]} then {c} at entry {pos}")
        out.append(c)
    return tuple(out)


def normalize_stored(checkpoints: tuple[int, ...], stored: Iterable[int]) -> tuple[int, ...]:
    """Validate ``stored`` (start layers of segments left unwrapped) against a normalized plan."""
    if isinstance(stored, (str, bytes)):
        raise InvalidPlan(f"stored is a sequence of segment-start layers, got the string {stored!r}")
    try:
        items = sorted(set(int(x) for x in stored))
    except (TypeError, ValueError) as exc:
        raise InvalidPlan(f"stored is a sequence of segment-start layers (ints), got {stored!r}") from exc
    starts = (0,) + tuple(checkpoints)
    for x in items:
        if x not in starts:
            raise InvalidPlan(
                f"stored names layer {x}, which starts no segment: stored segments are named by their "
                f"first layer, one of {starts}"
            )
        if x == starts[-1]:
            raise InvalidPlan(
                f"stored names layer {x}, the start of the last segment, which is always left unwrapped"
            )
    return tuple(items)


def _stored_flags(starts: tuple[int, ...], stored: tuple[int, ...]) -> np.ndarray:
    keep = set(stored)
    return np.array([1 if s in keep else 0 for s in starts], dtype=np.int64)


def simulate(costs: ChainCosts, checkpoints: Iterable[int], stored: Iterable[int] = ()) -> SimResult:
    """Exact peak training memory of a plan under the chain model.

    Parameters
    ----------
    costs : ChainCosts
        The cost model (full or additive form).
    checkpoints : sequence of int
        Segment-start layers, strictly increasing, each in ``1..n-1``.
    stored : sequence of int, optional
        Start layers of segments (other than the last) left unwrapped: they
        keep what their layers save, as the last segment does, and re-run
        nothing; those tensors stay held while every later segment runs.
        Full form only.

    Returns
    -------
    SimResult

    Notes
    -----
    Running time O(n) per plan (compiled).
    ``recompute_flops`` equals ``costs.c`` summed over
    :func:`recomputed_layers` (tested).

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 5, 5], h=[10, 10, 10], q=[1, 1, 1])
    >>> simulate(c, ()).peak_bytes, simulate(c, (1, 2)).peak_bytes
    (21, 11)
    """
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"simulate() needs a ChainCosts, got {type(costs).__name__}")
    plan = normalize_plan(costs, checkpoints)
    stored = normalize_stored(plan, stored)
    if stored and costs.is_additive:
        raise InvalidPlan("stored (unwrapped) segments need a full-form cost model; the additive form "
                          "does not say what a layer keeps of what it produces")
    keep = _stored_flags((0,) + plan, stored)
    starts = np.array((0,) + plan, dtype=np.int64)
    full = not costs.is_additive
    K = costs.kernel_arrays
    peak, phase, layer, seg = _kernels.simulate_plan(starts, keep, costs.n, full, K)
    cpre = costs.compute_prefix
    recompute = _kernels.plan_recompute(starts, keep, costs.n, full, K, cpre)
    return SimResult(int(peak) + costs.static, _PHASES[phase], int(layer), int(seg), int(recompute), int(cpre[-1]))


def recomputed_layers(costs: ChainCosts, checkpoints: Iterable[int], stored: Iterable[int] = ()) -> list[int]:
    """Layers whose forward runs again during backward under this plan.

    Every segment but the last that saves a tensor is recomputed from its
    first layer up to the last layer that saves a tensor it produces (its
    output or extra tensors) or packs one autograd drops (``dead``); a final
    layer that saves only its input is not re-run (DESIGN.md section 3). For the additive form, where that is unknown, the whole segment.
    """
    plan = normalize_plan(costs, checkpoints)
    kept = set(normalize_stored(plan, stored))
    starts = (0,) + plan
    ends = tuple(s - 1 for s in plan) + (costs.n - 1,)
    wrapped = [(l, r) for l, r in list(zip(starts, ends))[:-1] if l not in kept]
    out: list[int] = []
    if costs.is_additive:
        for l, r in wrapped:
            out.extend(range(l, r + 1))
        return out
    sin, sout, m, dead = costs.sin, costs.sout, costs.m, costs.dead
    for l, r in wrapped:
        e = l - 1
        if any(sin[i] or sout[i] or m[i] > 0 for i in range(l, r + 1)):  # else nothing is recomputed
            for i in range(r, l - 1, -1):
                if sin[i] or sout[i] or m[i] > 0 or dead[i]:  # dead tensors are re-packed too
                    e = i
                    break
        if e >= l and not (sout[e] or m[e] > 0 or costs.fs[e] > 0):
            e -= 1
        out.extend(range(l, e + 1))
    return out
