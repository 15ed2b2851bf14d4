"""Plans that leave some middle segments unwrapped ("stored": they keep what their layers save
and re-run nothing, as rotor's forward-all step), the plans the budget solver may return:
measured peaks equal simulated ones, and training is unchanged."""

import itertools
import random

import pytest
import torch

from ckptopt import InfeasibleBudget, Plan, apply_plan, measure_peak, optimize_checkpoints, simulate, solve, trace

from ckptopt.measure import measure_plans_fake

from .test_dag_exactness import CASES


def _loss(out):
    return out.float().pow(2).mean()


def _sample(n, count, seed=0):
    combos = []
    for k in range(1, min(n, 4)):
        for cps in itertools.combinations(range(1, n), k):
            starts = (0,) + cps
            for j in range(1, len(starts)):
                combos.extend((cps, st) for st in itertools.combinations(starts[:-1], j))
    random.Random(seed).shuffle(combos)
    return combos[:count]


@pytest.mark.parametrize("name", sorted(CASES))
def test_stored_segments_measured_equals_simulated(name):
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    tm = trace(model, inputs, loss_fn=_loss)
    plans = [Plan(cps, simulate(tm.costs, cps, stored).peak_bytes, "given", 0.0, tm.n, stored)
             for cps, stored in _sample(tm.n, 8)]
    for plan, meas in zip(plans, measure_plans_fake(model, inputs, tm, plans, loss_fn=_loss)):
        cps, stored, pred = plan.checkpoints, plan.stored, plan.peak_bytes
        # 8 bytes: the scalar loss and its gradient; 16: BatchNorm hook copies (see test_dag_exactness)
        gap = meas - 8 - pred
        assert 0 <= gap <= 16, (cps, stored, meas, pred)  # exact: never under, never over


@pytest.mark.parametrize("name", ["resnet-like", "densenet-like", "unet-like"])
def test_stored_plan_trains_like_the_original(name):
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    tm = trace(model, inputs)
    cps, stored = _sample(tm.n, 1, seed=1)[0]
    plan = Plan(cps, simulate(tm.costs, cps, stored).peak_bytes, "given", 0.0, tm.n, stored)
    module = apply_plan(model, tm, plan)
    assert any(not w for w in plan.wrapped[:-1])
    _loss(model(*inputs)).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _loss(module(*inputs)).backward()
    for r, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)


def test_optimize_with_a_budget_uses_the_least_recomputation():
    torch.manual_seed(0)
    model, inputs = CASES["resnet-like"]()
    tm = trace(model, inputs)
    lo = solve(tm.costs, "dp2").peak_bytes
    hi = simulate(tm.costs, ()).peak_bytes
    budget = (lo + hi) // 2
    module = optimize_checkpoints(model, inputs, budget=budget)
    plan = module.plan
    assert plan.solver == "budget" and plan.peak_bytes <= budget
    s = simulate(tm.costs, plan.checkpoints, plan.stored)
    assert s.recompute_flops <= simulate(tm.costs, solve(tm.costs, "dp2").checkpoints).recompute_flops
    meas = measure_peak(model, inputs, checkpoints=plan, fake=True)
    assert meas - 8 <= budget
    floor = solve(tm.costs, "auto").peak_bytes  # the lowest peak, plans with stored segments included
    with pytest.raises(InfeasibleBudget) as e:
        optimize_checkpoints(model, inputs, budget=floor - 1)
    assert e.value.min_peak_bytes <= lo


def test_auto_uses_stored_segments_where_they_lower_the_peak():
    """On this MLP the lowest peak needs unwrapped middle segments (1.8% below dp2's optimum):
    optimize_checkpoints finds it by default, the real step measures it (+8 B, the scalar loss)
    and trains exactly like the original."""
    from ckptopt import zoo

    model, x = zoo.get("mlp", batch_size=256, width=32, depth=8)
    opt = optimize_checkpoints(model, x)
    dp2 = solve(opt.traced.costs, "dp2")
    assert opt.plan.solver == "dp2+stored" and opt.plan.stored
    assert opt.predicted_peak_bytes < dp2.peak_bytes
    assert "not wrapped (stored)" in opt.explain()
    assert measure_peak(opt, x) == opt.predicted_peak_bytes + 8
    assert measure_peak(opt, x) < measure_peak(apply_plan(model, opt.traced, dp2), x)
    torch.manual_seed(3)
    _loss(model(*x)).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    _loss(opt(*x)).backward()
    for r, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)
