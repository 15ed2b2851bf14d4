"""Least recomputation: the lexicographic tie-break of the exact solvers and the budget solver,
against an independent enumeration of every plan (peak from the simulator, recomputation from
recomputed_layers plus the fixed cost of each checkpointed segment)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ckptopt import ChainCosts, InfeasibleBudget, simulate, solve
from ckptopt.simulator import recomputed_layers
from ckptopt.solvers import pareto_front

from .common.strategies import additive_costs, full_costs, random_additive, random_full


def added(c, plan, stored=()):
    """What a plan adds to a step, summed independently of the kernels: the compute of the layers it
    re-runs, and ``segment_cost`` for each segment it checkpoints (every segment but the last and the
    stored ones)."""
    return int(sum(int(c.c[i]) for i in recomputed_layers(c, plan, stored))) + c.segment_cost * (len(plan) - len(stored))


def cost(sim):
    """What a simulated plan adds to a step (the least-recomputation solvers' objective)."""
    return sim.recompute_flops + sim.segment_overhead


def every_plan(c):
    """(peak, recompute, plan) of all 2^(n-1) plans."""
    out = []
    for k in range(c.n):
        for plan in itertools.combinations(range(1, c.n), k):
            out.append((simulate(c, plan).peak_bytes, added(c, plan), plan))
    return out


def every_plan_with_stored(c):
    """(peak, recompute, plan, stored) of every plan and every choice of unwrapped segments
    (full form; the additive form has no stored segments)."""
    out = []
    if c.is_additive:
        return [(p, r, plan, ()) for p, r, plan in every_plan(c)]
    for peak, rec, plan in every_plan(c):
        starts = (0,) + plan
        for k in range(len(starts)):
            for stored in itertools.combinations(starts[:-1], k):
                out.append((simulate(c, plan, stored).peak_bytes, added(c, plan, stored), plan, stored))
    return out


def front_of(points):
    front = []
    for peak, rec, *_ in sorted(points, key=lambda t: (t[0], t[1])):
        if not front or rec < front[-1][1]:
            front.append((peak, rec))
    return front


@given(st.one_of(full_costs(max_n=9), additive_costs(max_n=9)), st.data())
def test_simulator_reports_the_recomputation_of_recomputed_layers(c, data):
    plan = tuple(sorted(data.draw(st.sets(st.integers(1, max(1, c.n - 1)), max_size=c.n - 1)) - {c.n} if c.n > 1 else set()))
    r = simulate(c, plan)
    assert r.recompute_flops == sum(int(c.c[i]) for i in recomputed_layers(c, plan))
    assert r.segment_overhead == c.segment_cost * len(plan)
    assert r.forward_flops == int(np.sum(c.c))
    assert 0 <= r.recompute_flops / max(1, 3 * r.forward_flops) <= 1 / 3 + 1e-12


@given(full_costs(max_n=9))
def test_exact_solvers_pick_the_least_recomputation_among_optimal_plans(c):
    plans = every_plan(c)
    peak, rec, _ = min(plans)
    for s in ("brute", "dp", "dp2"):
        p = solve(c, s)
        r = simulate(c, p.checkpoints)
        assert (r.peak_bytes, cost(r)) == (peak, rec), s


@given(additive_costs(max_n=10))
def test_linear_picks_the_least_recomputation_on_additive(c):
    peak, rec, _ = min(every_plan(c))
    r = simulate(c, solve(c, "linear").checkpoints)
    assert (r.peak_bytes, cost(r)) == (peak, rec)


@given(st.one_of(full_costs(max_n=9), additive_costs(max_n=9)))
def test_pareto_front_equals_enumeration(c):
    plans = every_plan(c)
    front = []
    for peak, rec, _ in sorted(plans):
        if not front or rec < front[-1][1]:
            front.append((peak, rec))
    got = pareto_front(c, allow_stored=False)
    assert [(p, r) for p, r, _, _ in got] == front
    for p, r, plan, stored in got:  # each point's plan really has that peak and recomputation
        assert stored == ()
        s = simulate(c, plan)
        assert (s.peak_bytes, cost(s)) == (p, r)


@given(st.one_of(full_costs(max_n=7), additive_costs(max_n=7)))
def test_pareto_front_with_stored_segments_equals_enumeration(c):
    plans = every_plan_with_stored(c)
    got = pareto_front(c)
    assert [(p, r) for p, r, _, _ in got] == front_of(plans)
    for p, r, plan, stored in got:
        s = simulate(c, plan, stored)
        assert (s.peak_bytes, cost(s)) == (p, r)
    # stored segments never make the lowest peak worse, and the checkpoint-only front is dominated
    only_ckpt = pareto_front(c, allow_stored=False)
    assert got[0][0] <= only_ckpt[0][0]


@given(st.one_of(full_costs(max_n=7), additive_costs(max_n=7)))
def test_auto_stored_pass_reaches_the_lexicographic_optimum_over_every_plan(c):
    """optimize_checkpoints' "auto" pass: dp2's plan, improved over plans with stored segments,
    is the (peak, recomputation) minimum of every plan, stored segments included (full form);
    the additive form keeps dp2's plan."""
    from ckptopt.solvers import improve_with_stored

    base = solve(c, "dp2")
    got = improve_with_stored(c, base)
    s = simulate(c, got.checkpoints, got.stored)
    assert s.peak_bytes == got.peak_bytes <= base.peak_bytes
    if c.is_additive:
        assert got == base
        return
    assert (s.peak_bytes, cost(s)) == min((p, r) for p, r, *_ in every_plan_with_stored(c))
    if got.stored or got.checkpoints != base.checkpoints:
        assert got.solver == "dp2+stored"
        assert (got.peak_bytes, cost(s)) < (base.peak_bytes, cost(simulate(c, base.checkpoints)))
    else:
        assert got == base


@given(st.one_of(full_costs(max_n=7), additive_costs(max_n=7)))
def test_merging_adjacent_unwrapped_segments_keeps_peak_and_recompute(c):
    from ckptopt.solvers.pareto import merge_unwrapped

    for peak, rec, plan, stored in every_plan_with_stored(c)[:200]:
        p2, s2 = merge_unwrapped(plan, stored)
        s = simulate(c, p2, s2)
        assert (s.peak_bytes, cost(s)) == (peak, rec), (plan, stored, p2, s2)


@given(st.one_of(full_costs(max_n=7), additive_costs(max_n=7)), st.data())
def test_budget_solver_against_enumeration(c, data):
    plans = every_plan_with_stored(c)
    lo = min(p for p, *_ in plans)
    hi = max(p for p, *_ in plans)
    budget = data.draw(st.integers(max(1, lo - 3), hi + 3))
    fitting = [rec for p, rec, *_ in plans if p <= budget]
    if not fitting:
        with pytest.raises(InfeasibleBudget) as e:
            solve(c, "budget", budget=budget)
        assert e.value.min_peak_bytes == lo and e.value.budget_bytes == budget
        return
    p = solve(c, "budget", budget=budget)
    r = simulate(c, p.checkpoints, p.stored)
    assert r.peak_bytes == p.peak_bytes <= budget
    assert cost(r) == min(fitting)


@given(st.integers(0, 2**32 - 1), st.integers(12, 120), st.booleans())
@settings(max_examples=60)
def test_dp_and_dp2_agree_on_larger_models(seed, n, additive):
    rng = np.random.default_rng(seed)
    c = random_additive(rng, n) if additive else random_full(rng, n)
    a, b = solve(c, "dp"), solve(c, "dp2")
    ra, rb = simulate(c, a.checkpoints), simulate(c, b.checkpoints)
    assert (ra.peak_bytes, cost(ra)) == (rb.peak_bytes, cost(rb))
    if additive:
        rl = simulate(c, solve(c, "linear").checkpoints)
        assert (rl.peak_bytes, cost(rl)) == (ra.peak_bytes, cost(ra))


@given(st.integers(0, 2**32 - 1), st.integers(12, 60))
@settings(max_examples=25)
def test_budget_curve_is_monotone_and_consistent(seed, n):
    c = random_full(np.random.default_rng(seed), n)
    front = pareto_front(c, allow_stored=False)
    assert front[0][0] == solve(c, "dp2").peak_bytes
    # the last point recomputes nothing and is no worse than no checkpointing
    assert front[-1][1] == 0 and front[-1][0] <= simulate(c, ()).peak_bytes
    peaks = [p for p, *_ in front]
    recs = [r for _, r, *_ in front]
    assert peaks == sorted(set(peaks)) and recs == sorted(set(recs), reverse=True)
    wide = pareto_front(c)
    assert wide[0][0] <= front[0][0] and wide[-1][0] <= front[-1][0]
    # the budget solver at each point's peak recomputes exactly that point's amount
    for p, r, *_ in wide[:: max(1, len(wide) // 5)]:
        b = solve(c, "budget", budget=p)
        assert cost(simulate(c, b.checkpoints, b.stored)) == r


def test_budget_needs_a_budget():
    c = ChainCosts.additive([0, 1], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="needs a memory budget"):
        solve(c, "budget")


def test_compute_round_trips_and_is_validated():
    c = ChainCosts.additive([0, 1], [1, 1], [1, 1], c=[5, 7])
    assert ChainCosts.from_json(c.to_json()) == c and c.has_compute
    assert ChainCosts.from_json(ChainCosts.additive([0, 1], [1, 1], [1, 1]).to_json()).has_compute is False
    with pytest.raises(ValueError, match="'c'"):
        ChainCosts.additive([0, 1], [1, 1], [1, 1], c=[5])
    with pytest.raises(ValueError, match="negative"):
        ChainCosts.additive([0, 1], [1, 1], [1, 1], c=[5, -1])


def test_hand_case_prefers_the_cheaper_recomputation():
    # Two layers of equal memory: checkpointing before layer 1 or 2 gives the same peak; the
    # plan re-running the cheap layer wins.
    c = ChainCosts.additive(w=[0, 4, 4, 4], h=[4, 4, 4, 4], q=[4, 4, 4, 4], c=[100, 1, 100, 100])
    plans = every_plan(c)
    peak, rec, _ = min(plans)
    p = solve(c, "dp2")
    assert cost(simulate(c, p.checkpoints)) == rec
    assert sum(1 for pk, r, _ in plans if pk == peak) > 1  # a real tie was broken


@given(full_costs(max_n=7), st.integers(1, 400))
@settings(max_examples=30)
def test_with_segment_cost_is_the_model_built_with_it(c, cost):
    """A copy with the segment cost set plans and serialises as the model built with it, and leaves
    the original as it was."""
    cost += c.segment_cost  # (another cost than the model's)
    d = c.to_dict()
    d["segment_cost"] = cost
    built = ChainCosts.from_dict(d)
    c.kernel_arrays  # (built before the copy: the copy must not reuse it)
    copied = c.with_segment_cost(cost)
    assert copied == built and copied.to_dict() == built.to_dict()
    assert np.array_equal(copied.kernel_arrays.cseg, built.kernel_arrays.cseg)
    assert solve(copied, "dp2").checkpoints == solve(built, "dp2").checkpoints
    assert c.segment_cost != cost and not np.array_equal(c.kernel_arrays.cseg, copied.kernel_arrays.cseg)
