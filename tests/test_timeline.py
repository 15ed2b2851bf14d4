"""The predicted memory timeline against the simulator and the independent reference."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from ckptopt import ChainCosts, InvalidPlan, simulate
from ckptopt.simulator import recomputed_layers
from ckptopt.simulator.timeline import simulate_timeline

from .common.reference import reference_peak
from .common.strategies import additive_costs, full_costs


@st.composite
def costs_and_plan(draw, costs_strategy):
    costs = draw(costs_strategy)
    cuts = draw(st.sets(st.integers(1, max(1, costs.n - 1)))) if costs.n > 1 else set()
    return costs, tuple(sorted(cuts))


@st.composite
def costs_plan_stored(draw):
    """A full-form model, a plan and a random subset of its middle segments left unwrapped."""
    costs, plan = draw(costs_and_plan(full_costs()))
    stored = draw(st.sets(st.sampled_from((0,) + plan[:-1]))) if plan else set()
    return costs, plan, tuple(sorted(stored))


def check_order(costs, plan, events, stored=()):
    """Events run forward 0..n-1, then per segment (last first) backward r..l, with the recompute
    events of a checkpointed segment before the backward of its last layer that saves a tensor
    (the layers after it save nothing, so their backward runs first), and after that layer's
    backward up to its first read of a saved tensor, which triggers them (one more event)."""
    n = costs.n
    starts = (0,) + plan
    ends = tuple(s - 1 for s in plan) + (n - 1,)
    expected = [] if costs.is_additive else [("forward", i) for i in range(n)]
    rec = set(recomputed_layers(costs, plan, stored))
    for k in range(len(starts) - 1, -1, -1):
        l, r = starts[k], ends[k]
        back = [("backward", i) for i in range(r, l - 1, -1)]
        if not costs.is_additive and k < len(starts) - 1 and l not in stored:
            saving = [i for i in range(l, r + 1)
                      if costs.sin[i] or costs.sout[i] or costs.m[i] > 0 or costs.holds[i]]
            trailing = r - max(saving) if saving else r - l + 1
            first = [("backward", max(saving))] if saving else []
            back = (back[:trailing] + first + [("recompute", i) for i in range(l, r + 1) if i in rec]
                    + back[trailing:])
        expected += back
    assert [(e.phase, e.layer) for e in events] == expected


def check_segments_and_static(costs, plan, events):
    starts = (0,) + plan
    for e in events:
        assert e.bytes >= costs.static
        k = int(np.searchsorted(starts, e.layer, side="right")) - 1
        assert e.segment == k


@given(costs_and_plan(full_costs()))
def test_full_timeline_peak_is_the_simulated_and_reference_peak(cp):
    costs, plan = cp
    events = simulate_timeline(costs, plan)
    peak = max(e.bytes for e in events)
    assert peak == simulate(costs, plan).peak_bytes
    assert peak == reference_peak(costs, plan)
    check_order(costs, plan, events)
    check_segments_and_static(costs, plan, events)


@given(costs_plan_stored())
def test_timeline_with_stored_segments_is_the_simulated_and_reference_peak(cps):
    """Unwrapped middle segments (the default plan's and the budget solver's): the timeline describes the
    same plan as simulate (it once took no ``stored`` and described another plan)."""
    costs, plan, stored = cps
    events = simulate_timeline(costs, plan, stored)
    peak = max(e.bytes for e in events)
    assert peak == simulate(costs, plan, stored).peak_bytes == reference_peak(costs, plan, stored)
    check_order(costs, plan, events, stored)
    check_segments_and_static(costs, plan, events)


def test_timeline_agrees_with_simulate_on_many_random_stored_plans():
    """The issue's count: 3,000 random models with a default (dp2 + stored) or random stored plan."""
    from ckptopt import solve

    from .common.strategies import random_full

    rng = np.random.default_rng(2026)
    with_stored = 0
    for _ in range(3000):
        c = random_full(rng, int(rng.integers(2, 14)))
        p = solve(c, "auto")
        plans = [(p.checkpoints, p.stored)]
        cuts = tuple(sorted(set(int(x) for x in rng.integers(1, c.n, int(rng.integers(1, c.n))))))
        plans.append((cuts, tuple(s for s in (0,) + cuts[:-1] if rng.integers(0, 2))))
        for plan, stored in plans:
            with_stored += bool(stored)
            assert max(e.bytes for e in simulate_timeline(c, plan, stored)) == simulate(c, plan, stored).peak_bytes
    assert with_stored > 1000


@given(costs_and_plan(additive_costs()))
def test_additive_timeline_peak_is_the_simulated_and_reference_peak(cp):
    costs, plan = cp
    events = simulate_timeline(costs, plan)
    assert max(e.bytes for e in events) == simulate(costs, plan).peak_bytes == reference_peak(costs, plan)
    check_order(costs, plan, events)


def test_hand_case_three_linear_layers():
    # Three Linear-like layers (save their input only), 100-byte activations, no parameters
    # (the same model as test_simulate.mlp3). No checkpointing:
    # forward of layer i holds what layers < i saved (x0, x1) + its transient f = 100;
    # backward of layer 2 holds x0, x1 (saved), g2 and b2: 400; layer 1: x0, g1, b1: 300; layer 0: 200.
    c = ChainCosts(a=[100] * 3, p=[0] * 3, sin=[1] * 3, sout=[0] * 3, m=[0] * 3, f=[100] * 3, b=[100] * 3)
    got = [(e.phase, e.layer, e.bytes) for e in simulate_timeline(c, ())]
    assert got == [
        ("forward", 0, 100), ("forward", 1, 200), ("forward", 2, 300),
        ("backward", 2, 400), ("backward", 1, 300), ("backward", 0, 200),
    ]
    # plan (2,): segment [0, 1] is checkpointed and re-runs layer 0 only (layer 1 saves only its input);
    # layer 1's backward up to its first read of a saved tensor runs before that
    got = [(e.phase, e.layer) for e in simulate_timeline(c, (2,))]
    assert got == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 2),
                   ("backward", 1), ("recompute", 0), ("backward", 1), ("backward", 0)]


def test_bad_plan_is_rejected():
    c = ChainCosts.additive(w=[0, 1], h=[1, 1], q=[1, 1])
    with pytest.raises(InvalidPlan):
        simulate_timeline(c, (5,))
    with pytest.raises(TypeError, match="ChainCosts"):
        simulate_timeline([1, 2], ())


def test_timeline_module_does_not_import_torch():
    code = "import sys, ckptopt.simulator.timeline; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
