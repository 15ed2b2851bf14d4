"""The peak-memory simulator: the single source of truth for a plan's peak.

A *plan* is the sorted tuple of layers that start a new segment, excluding
layer 0 (see :mod:`ckptopt.plan`). Every segment but the last is run under
``torch.utils.checkpoint(..., use_reentrant=False)`` unless it is listed in
``stored``; the last is left unwrapped (same peak, no recomputation). The
formulas are ``docs/design.md`` §3-4; :mod:`ckptopt.simulator.kernels` states
them term by term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..costs import ChainCosts
from ..errors import InvalidPlan
from ..plan import normalize_plan, normalize_stored, segment_bounds, stored_flags
from . import kernels, side_tensors

__all__ = ["simulate", "SimResult", "recomputed_layers", "plan_recompute"]

PHASES = ("forward", "recompute", "backward")


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
        summed over :func:`recomputed_layers`, in the cost model's unit
        (:attr:`ChainCosts.unit`: FLOPs for traced models, nanoseconds once
        calibrated; a count of layers when the costs carry no compute).
    forward_flops : int
        Compute of one forward pass (the sum of ``c``).
    step_flops : int
        Compute of one step without recomputation (:attr:`ChainCosts.step_compute`).
    unit : str
        The unit of the compute figures.
    segment_overhead : int
        The fixed cost of the plan's checkpointed segments (:attr:`ChainCosts.segment_cost` each), in
        ``unit``: with ``recompute_flops``, what the plan adds to a step.
    """

    peak_bytes: int
    phase: str
    layer: int
    segment: int
    recompute_flops: int = 0
    forward_flops: int = 0
    step_flops: int = 0
    unit: str = "flops"
    segment_overhead: int = 0

    @property
    def recompute_share(self) -> float:
        """What the plan adds (recomputation and its segments' fixed cost) as a share of one training
        step without it: the step's forward + backward (counted by the tracer, or measured by the
        calibration) when the costs carry backward costs, else 3 x forward (backward ~ 2 x forward)."""
        step = self.step_flops or 3 * self.forward_flops
        return (self.recompute_flops + self.segment_overhead) / step if step else 0.0

    @property
    def recompute_seconds(self) -> float | None:
        """The recomputation in seconds, when the compute was measured in ns (else None)."""
        return self.recompute_flops / 1e9 if self.unit == "ns" else None


def checked_plan(costs: ChainCosts, checkpoints, stored, fn: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"{fn}() needs a ChainCosts, got {type(costs).__name__}")
    plan = normalize_plan(costs, checkpoints)
    stored = normalize_stored(plan, stored)
    if stored and costs.is_additive:
        raise InvalidPlan("stored (unwrapped) segments need a full-form cost model; the additive form "
                          "does not say what a layer keeps of what it produces")
    return plan, stored


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
    ``recompute_flops`` equals ``costs.c`` summed over :func:`recomputed_layers`
    (``tests/test_recompute.py::test_simulator_reports_the_recomputation_of_recomputed_layers``).

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 5, 5], h=[10, 10, 10], q=[1, 1, 1])
    >>> simulate(c, ()).peak_bytes, simulate(c, (1, 2)).peak_bytes
    (21, 11)
    """
    plan, stored = checked_plan(costs, checkpoints, stored, "simulate")
    keep = stored_flags(plan, stored)
    starts = np.array((0,) + plan, dtype=np.int64)
    full = not costs.is_additive
    K = costs.kernel_arrays
    if costs.has_side:
        peak, phase, layer, seg = side_tensors.simulate_plan_side(starts, keep, costs.n, K, costs.side_arrays,
                                                             side_tensors.side_scratch(costs.n, len(costs.side)))
    else:
        peak, phase, layer, seg = kernels.simulate_plan(starts, keep, costs.n, full, K)
    cpre = costs.compute_prefix
    added = int(kernels.plan_recompute(starts, keep, costs.n, full, K, cpre))
    overhead = costs.segment_cost * sum(1 for k in keep[:-1] if not k)  # (the last segment is never wrapped)
    return SimResult(int(peak) + costs.static, PHASES[phase], int(layer), int(seg), added - overhead, int(cpre[-1]),
                     costs.step_compute, costs.unit, overhead)


def plan_recompute(costs: ChainCosts, checkpoints: tuple[int, ...], stored: tuple[int, ...] = ()) -> int:
    """Recomputation of a (validated) plan, its segments' fixed cost included, in the unit of ``costs.c``
    (the least-recomputation solvers' objective)."""
    starts = np.array((0,) + tuple(checkpoints), dtype=np.int64)
    return int(kernels.plan_recompute(starts, stored_flags(tuple(checkpoints), stored), costs.n,
                                      not costs.is_additive, costs.kernel_arrays, costs.compute_prefix))


def recomputed_layers(costs: ChainCosts, checkpoints: Iterable[int], stored: Iterable[int] = ()) -> list[int]:
    """Layers whose forward runs again during backward under this plan.

    Every checkpointed segment is recomputed from its first layer up to the end
    that :func:`ckptopt.simulator.kernels.recompute_span` gives (the last layer
    that saves a tensor it produces or packs one autograd drops; a final layer
    that saves only its input is not re-run). For the additive form, where that
    is unknown, the whole segment.

    Examples
    --------
    >>> c = ChainCosts.additive(w=[0, 5, 5], h=[10, 10, 10], q=[1, 1, 1])
    >>> recomputed_layers(c, (1, 2))
    [0, 1]
    """
    plan, stored = checked_plan(costs, checkpoints, stored, "recomputed_layers")
    kept = set(stored)
    segments = segment_bounds(costs.n, plan)[:-1]
    out: list[int] = []
    K = costs.kernel_arrays
    for l, r in segments:
        if l in kept:
            continue
        e = r if costs.is_additive else kernels.recompute_span(l, r, K)[1]
        out.extend(range(l, e + 1))
    return out
