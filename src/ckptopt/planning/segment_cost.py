"""What one checkpointed segment costs besides the compute it re-runs, on a device.

A segment run under ``torch.utils.checkpoint`` (non-reentrant) pays a fixed time each step: the
checkpoint call, its saved-tensor hooks and frame, and the re-run's dispatch. The solvers price it
per checkpointed segment (:attr:`ckptopt.ChainCosts.segment_cost`, in the unit of the compute
costs), so that of plans alike in peak and recomputation they take the one with fewer wrappers, and
a wrapper must buy more memory than its time is worth under a budget.

On CPU (one thread, torch 2.13) a segment cost 70-95 us a step, on chains of 200 tiny layers
whether or not its recomputation ran; 80 us is taken. CUDA has not been measured: the same time is
assumed. FLOP-unit costs (the tracer's) convert it at an assumed rate per device type.
"""

from __future__ import annotations

__all__ = ["SEGMENT_SECONDS", "FLOPS_PER_SECOND", "segment_cost"]

#: The fixed time of one checkpointed segment, per device type (CUDA: assumed as on CPU).
SEGMENT_SECONDS = {"cpu": 80e-6, "cuda": 80e-6}
#: The rate that turns that time into FLOPs for the tracer's FLOP counts (assumed: one CPU thread's
#: float32 matrix products; a data-centre GPU's).
FLOPS_PER_SECOND = {"cpu": 1.25e11, "cuda": 1e14}


def segment_cost(device_type: str, unit: str) -> int:
    """The fixed cost of one checkpointed segment on ``device_type`` in ``unit`` (``"flops"`` or
    ``"ns"``); 0 for a device or unit with no figure."""
    seconds = SEGMENT_SECONDS.get(device_type)
    if seconds is None:
        return 0
    if unit == "ns":
        return round(seconds * 1e9)
    if unit == "flops":
        return round(seconds * FLOPS_PER_SECOND[device_type])
    return 0
