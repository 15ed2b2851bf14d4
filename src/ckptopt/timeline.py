"""Moved: the timeline is part of the simulator, :mod:`ckptopt.simulator.timeline`.

This module keeps ``from ckptopt.timeline import simulate_timeline`` working (no torch import).
"""

from __future__ import annotations

from .simulator.timeline import TimelineEvent, simulate_timeline

__all__ = ["TimelineEvent", "simulate_timeline"]
