"""The fixed cost of a checkpointed segment: set by the tracer for the device it traces for,
measured by the calibration, and seen alike by every planning path."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from ckptopt import ChainCosts, optimize_checkpoints, simulate, solve, trace
from ckptopt.calibration import Calibration, LayerCalibration, checkpoint_segment_seconds
from ckptopt.cli import main
from ckptopt.planning import estimate
from ckptopt.segment_cost import FLOPS_PER_SECOND, SEGMENT_SECONDS, segment_cost


def mlp(depth=8, width=64, batch=64, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)],
                        nn.Linear(width, 10))
    return net, torch.randn(batch, width)


@pytest.fixture(scope="module")
def traced():
    net, x = mlp()
    return net, x, trace(net, x)


def test_figures_per_device_and_unit():
    assert segment_cost("cpu", "flops") == round(SEGMENT_SECONDS["cpu"] * FLOPS_PER_SECOND["cpu"])
    assert segment_cost("cuda", "ns") == round(SEGMENT_SECONDS["cuda"] * 1e9)
    assert segment_cost("cpu", "ns", seconds=2.5e-4) == 250_000
    assert segment_cost("cuda", "flops", seconds=1e-4) == round(1e-4 * FLOPS_PER_SECOND["cuda"])
    assert segment_cost("cpu", "count") == 0 and segment_cost("xpu", "flops") == 0
    assert segment_cost("cpu", "ns", seconds=0.0) == 0


def test_a_trace_carries_its_devices_segment_cost(traced):
    _, _, tm = traced
    assert tm.costs.segment_cost == segment_cost("cpu", "flops") > 0
    again = ChainCosts.from_dict(json.loads(json.dumps(tm.costs.to_dict())))
    assert again == tm.costs and again.segment_cost == tm.costs.segment_cost


def _budget_where_pricing_matters(costs: ChainCosts) -> int:
    """A budget at which the plan with segments priced differs from the plan without."""
    lo, hi = solve(costs, "auto").peak_bytes, simulate(costs, ()).peak_bytes
    free = costs.with_segment_cost(0)
    for share in (0.2, 0.4, 0.6, 0.8):
        budget = int(lo + share * (hi - lo))
        if solve(costs, "auto", budget=budget).checkpoints != solve(free, "auto", budget=budget).checkpoints:
            return budget
    pytest.fail("no budget where the segment cost changes the plan: the model is too small a test")


def test_every_planning_path_prices_segments_alike(traced, tmp_path, capsys):
    net, x, tm = traced
    budget = _budget_where_pricing_matters(tm.costs)
    ref = solve(tm.costs, "auto", budget=budget)
    unpriced = solve(tm.costs.with_segment_cost(0), "auto", budget=budget)
    # the priced plan runs fewer wrappers, at a peak within the budget
    assert len(ref.checkpoints) < len(unpriced.checkpoints) and ref.peak_bytes <= budget
    opt = optimize_checkpoints(net, x, budget=budget, in_place=False)
    assert (opt.plan.checkpoints, opt.plan.stored) == (ref.checkpoints, ref.stored)
    # without a budget: the lowest peak, with the fewest wrappers among the plans that reach it
    low = optimize_checkpoints(net, x, in_place=False)
    best = solve(tm.costs, "auto")
    assert low.plan.checkpoints == best.checkpoints
    assert len(best.checkpoints) <= len(solve(tm.costs.with_segment_cost(0), "auto").checkpoints)
    est = estimate(net, x, optimizer="sgd")
    assert est.optimal.checkpoints == best.checkpoints
    # a cost model written out and read back (the CLI's input) plans the same
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(tm.costs.to_dict()))
    assert main(["solve", "--costs", str(path), "--solver", "auto", "--budget", str(budget), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert tuple(out["results"][0]["checkpoints"]) == ref.checkpoints


def test_calibration_prices_a_segment_in_measured_ns(traced):
    _, _, tm = traced
    layers = tuple(LayerCalibration(1e-5, 2e-5) for _ in range(tm.n))
    cal = Calibration("cpu", layers, segment_seconds=1.5e-4)
    costs = cal.apply(tm.costs)
    assert costs.unit == "ns" and costs.segment_cost == 150_000
    # without a measured figure: the device type's
    assert Calibration("cpu", layers).apply(tm.costs).segment_cost == segment_cost("cpu", "ns")


def test_the_measured_segment_time_is_a_time():
    # (a difference of medians on a shared machine: its size is a benchmark's question; it is never negative)
    seconds = checkpoint_segment_seconds(torch.device("cpu"), length=8, repeats=3)
    assert isinstance(seconds, float) and math.isfinite(seconds) and seconds >= 0
