"""The simulator stage: the peak (and the timeline) of any plan on a cost model.

:func:`simulate` is the single source of truth for a plan's peak; solvers are
scored with it. :func:`simulate_timeline` gives the memory at every event of the
step, from the same compiled terms (:mod:`ckptopt.simulator.kernels`). No torch
import.
"""

from __future__ import annotations

from .peak import SimResult, plan_recompute, recomputed_layers, simulate
from .timeline import TimelineEvent, simulate_timeline

__all__ = ["simulate", "SimResult", "recomputed_layers", "plan_recompute", "simulate_timeline", "TimelineEvent"]
