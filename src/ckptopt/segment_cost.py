"""What one checkpointed segment costs besides the compute it re-runs.

A segment run under ``torch.utils.checkpoint`` (non-reentrant) pays a fixed time each step: the
checkpoint call, its saved-tensor hooks and frame, the re-run's dispatch and the rewriter's call
into the segment. The cost model prices it per checkpointed segment
(:attr:`ckptopt.ChainCosts.segment_cost`, in the unit of the compute costs), so that under a budget a
wrapper must buy more memory than its time is worth, and of plans alike in peak and recomputation
the one with fewer wrappers is taken.

Every cost model a trace produces carries the figure of the device it was traced for, so every
planning path (``optimize_checkpoints``, ``estimate``, the CLI, the data-parallel and batch-size
paths) weighs plans alike. FLOP-unit costs (the tracer's) convert the time at a rate assumed per
device type; a calibrated cost model (unit ``"ns"``) carries the time measured on the device
(:func:`ckptopt.calibration.calibrate`). Measured figures: docs/design.md §9.
"""

from __future__ import annotations

__all__ = ["SEGMENT_SECONDS", "FLOPS_PER_SECOND", "segment_cost"]

#: The fixed time of one checkpointed segment per device type: one CPU thread, torch 2.13, 70-95 us
#: through the rewriter (``benchmarks/frontier.py``'s chains); an H200, torch 2.11, 184-479 us.
SEGMENT_SECONDS = {"cpu": 90e-6, "cuda": 300e-6}
#: The rate that turns that time into the tracer's FLOPs: one CPU thread's float32 matrix products
#: (86 GFLOP/s measured on the 2-core build machine), a data-centre GPU's dense products.
FLOPS_PER_SECOND = {"cpu": 1.1e11, "cuda": 1e14}


def segment_cost(device_type: str, unit: str, seconds: float | None = None) -> int:
    """The fixed cost of one checkpointed segment on ``device_type`` in ``unit`` (``"flops"`` or
    ``"ns"``): ``seconds`` where measured, else the device type's figure; 0 for a device type or
    unit with no figure (``"count"``: a layer's cost is then a number, not a time)."""
    if seconds is None:
        seconds = SEGMENT_SECONDS.get(device_type)
    if seconds is None or seconds <= 0:
        return 0
    if unit == "ns":
        return round(seconds * 1e9)
    if unit == "flops" and device_type in FLOPS_PER_SECOND:
        return round(seconds * FLOPS_PER_SECOND[device_type])
    return 0
