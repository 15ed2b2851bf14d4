"""The trade-off a user chooses on: peak memory against step time, plan by plan.

:func:`frontier` spreads budgets evenly from the lowest peak to the peak without checkpointing and
solves each (``solve(costs, "auto", budget=...)``: the plan that recomputes least, its segments'
fixed cost included, whose peak fits), so every point is a plan ``optimize_checkpoints(model, batch,
budget=<its peak>)`` returns. Each point carries its predicted peak and predicted step time relative
to the unplanned step (``1 +`` the simulator's ``recompute_share``); with ``measure=True`` each plan
and the model as it is (and, for a transformers model, its own checkpointing of every layer) run on
the example batch: the peak of one step, and the median step time over interleaved rounds.
``ckptopt frontier MODEL --png FILE`` draws it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch.nn as nn

from ..measure import measure_peak, step_seconds
from ..plan import Plan
from ..rewriter import apply_plan
from ..simulator import simulate
from ..solvers.registry import solve
from ..tracer import trace

__all__ = ["FrontierPoint", "frontier"]


@dataclass(frozen=True)
class FrontierPoint:
    """One way to train the model: a ckptopt plan or a peer's method.

    ``predicted_*`` are set for ckptopt's plans and no checkpointing; ``measured_peak_bytes``,
    ``median_seconds`` and ``time_ratio`` (the median against no checkpointing's, measured in the
    same interleaved rounds) only when measured."""

    label: str
    checkpoints: tuple[int, ...] | None
    stored: tuple[int, ...] = ()
    predicted_peak_bytes: int | None = None
    predicted_time_ratio: float | None = None
    measured_peak_bytes: int | None = None
    median_seconds: float | None = None
    time_ratio: float | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        for k in ("checkpoints", "stored"):
            out[k] = None if out[k] is None else list(out[k])
        return out


def _budget_plans(costs, points: int) -> list[Plan]:
    """Up to ``points`` distinct plans: the least-recomputation plan at budgets evenly spaced from the
    lowest peak to the unplanned peak (the lowest peak and the cheapest plan under it included)."""
    low = solve(costs, "auto")
    high = simulate(costs, ()).peak_bytes
    plans: list[Plan] = []
    steps = max(1, points - 1)
    for k in range(steps + 1):
        budget = low.peak_bytes + (high - low.peak_bytes) * k // steps
        plan = low if k == 0 else solve(costs, "auto", budget=budget)
        if plan.peak_bytes >= high or not plan.checkpoints:  # (no lower than not checkpointing: not a plan)
            continue
        if all((plan.checkpoints, plan.stored) != (p.checkpoints, p.stored) for p in plans):
            plans.append(plan)
    return plans


def _hf_every_layer(model: nn.Module) -> nn.Module | None:
    """A copy of a transformers model with its own checkpointing of every layer (non-reentrant), or
    None for a model without it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    twin = copy.deepcopy(model)
    if hasattr(twin, "activation_checkpointing_enable"):
        twin.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(twin, "gradient_checkpointing_enable"):
        twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        return None
    twin.train()
    return twin


def frontier(model: nn.Module, example_inputs: Any, points: int = 6, loss_fn: Callable | None = None,
             measure: bool = False, rounds: int = 5, peers: bool = True) -> list[FrontierPoint]:
    """Peak memory against step time of up to ``points`` ckptopt plans and the model as it is.

    Parameters
    ----------
    model, example_inputs, loss_fn
        As for :func:`ckptopt.optimize_checkpoints`.
    points : int, default 6
        Plans, from the lowest peak to the cheapest that checkpoints (fewer where budgets share a plan).
    measure : bool, default False
        Run each plan on the batch: the exact peak of one step (the CPU's storage tracker, CUDA's
        allocator) and the median of ``rounds`` step times, the methods interleaved in each round.
    peers : bool, default True
        With ``measure``: also transformers' own checkpointing of every layer, where the model has it.

    Returns
    -------
    list of FrontierPoint
        No checkpointing first, then ckptopt's plans by peak, then the peers.
    """
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be an integer >= 1, got {points!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    tm = trace(model, example_inputs, loss_fn=loss_fn)
    none = simulate(tm.costs, ())
    out = [FrontierPoint("no checkpointing", (), (), none.peak_bytes, 1.0)]
    plans = _budget_plans(tm.costs, points)
    for k, plan in enumerate(plans):
        sim = simulate(tm.costs, plan.checkpoints, plan.stored)
        label = "ckptopt, lowest peak" if k == 0 else f"ckptopt, {len(plan.checkpoints) + 1} segments"
        out.append(FrontierPoint(label, plan.checkpoints, plan.stored, sim.peak_bytes, 1.0 + sim.recompute_share))
    if not measure:
        return out
    modules: list[nn.Module] = [model] + [apply_plan(model, tm, plan) for plan in plans]
    twin = _hf_every_layer(model) if peers else None
    if twin is not None:
        out.append(FrontierPoint("transformers, every layer", None))
        modules.append(twin)
    peaks = [measure_peak(m, example_inputs, loss_fn) for m in modules]
    seconds = step_seconds(modules, example_inputs, loss_fn, rounds=rounds)
    return [dataclasses.replace(p, measured_peak_bytes=int(b), median_seconds=s, time_ratio=s / seconds[0])
            for p, b, s in zip(out, peaks, seconds)]

