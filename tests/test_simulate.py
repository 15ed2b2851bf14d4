"""The simulator against hand-computed peaks and an independent event-by-event reference."""

import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from ckptopt import ChainCosts, InvalidPlan, simulate

from .common.reference import reference_peak
from .common.strategies import additive_costs, full_costs


def all_plans(n):
    for k in range(n):
        yield from itertools.combinations(range(1, n), k)


def mlp3():
    # Three Linear-like layers (save input only), 100-byte activations, no parameters.
    return ChainCosts(a=[100] * 3, p=[0] * 3, sin=[1] * 3, sout=[0] * 3, m=[0] * 3, f=[100] * 3, b=[100] * 3)


@pytest.mark.parametrize(
    "plan, peak, phase, layer",
    [
        # no checkpointing: backward of layer 2 holds x0, x1 (saved), g2 and its 100-byte transient
        ((), 400, "backward", 2),
        # (2,): segment [0,1] recomputes only layer 0 (layer 1 saves just its input);
        # its backward at layer 1 holds g1, x0 and b1 = 300; segment [2] holds x1 + g2 + b2 = 300
        ((2,), 300, "backward", 1),
        ((1,), 400, "backward", 2),
        ((1, 2), 400, "backward", 2),
    ],
)
def test_hand_full_model(plan, peak, phase, layer):
    r = simulate(mlp3(), plan)
    assert (r.peak_bytes, r.phase, r.layer) == (peak, phase, layer)


def test_recompute_runs_last_layer_only_when_it_saves_what_it_produces():
    # Segment [0, 1] is wrapped; layer 1 has a 1000-byte forward transient and
    # layer 2 holds 500 bytes of parameters, whose gradient exists during the
    # recomputation of segment [0, 1]. Layer 1 is re-run only if it saves its output.
    def model(sout1):
        return ChainCosts(a=[1, 1, 1], p=[0, 0, 500], sin=[1, 1, 0], sout=[0, sout1, 0],
                          m=[0, 0, 0], f=[0, 1000, 0], b=[0, 0, 0])
    r = simulate(model(0), (2,))
    # forward of layer 1: x0 (1) + transient (1000); the recompute stops after layer 0
    assert (r.peak_bytes, r.phase, r.layer) == (1001, "forward", 1)
    r = simulate(model(1), (2,))
    # recompute of layer 1: grad of layer 2's params (500) + grad of x1 (1) + x0 (1) + 1000
    assert (r.peak_bytes, r.phase, r.layer) == (1502, "recompute", 1)


def test_additive_hand_cases():
    c = ChainCosts.additive(w=[0, 5, 5], h=[10, 10, 10], q=[1, 1, 1], static=7)
    assert simulate(c, ()).peak_bytes == 7 + 21
    assert simulate(c, (1,)).peak_bytes == 7 + 5 + 11
    assert simulate(c, (1, 2)).peak_bytes == 7 + 11


@given(full_costs(max_n=7))
def test_full_matches_reference_on_every_plan(c):
    for plan in all_plans(c.n):
        assert simulate(c, plan).peak_bytes == reference_peak(c, plan), plan


@given(additive_costs(max_n=8))
def test_additive_matches_reference_on_every_plan(c):
    for plan in all_plans(c.n):
        assert simulate(c, plan).peak_bytes == reference_peak(c, plan), plan


@given(full_costs(max_n=9), st.data())
def test_reported_layer_is_in_reported_segment(c, data):
    plan = data.draw(st.sets(st.integers(1, max(1, c.n - 1))).map(sorted)) if c.n > 1 else []
    r = simulate(c, plan)
    starts = [0] + list(plan)
    ends = [s - 1 for s in plan] + [c.n - 1]
    assert starts[r.segment] <= r.layer <= ends[r.segment]
    assert r.peak_bytes >= c.static


@pytest.mark.parametrize(
    "plan, match",
    [((0,), "outside"), ((3,), "outside"), ((2, 1), "increasing"), ((1, 1), "increasing"),
     ((1.5,), "not a layer index"), ("12", "string"), (5, "sequence")],
)
def test_invalid_plans(plan, match):
    with pytest.raises(InvalidPlan, match=match):
        simulate(mlp3(), plan)


def test_numpy_integer_plan_accepted():
    assert simulate(mlp3(), np.array([2])).peak_bytes == 300


def test_recomputed_layers_follow_the_stop_rule():
    from ckptopt.simulator import recomputed_layers

    c = mlp3()  # every layer saves only its input
    assert recomputed_layers(c, ()) == []
    # segment [0, 1]: layer 1 saves only its input, so only layer 0 is re-run
    assert recomputed_layers(c, (2,)) == [0]
    assert recomputed_layers(c, (1, 2)) == []
    relu = ChainCosts(a=[1] * 3, p=[0] * 3, sin=[1, 0, 1], sout=[0, 1, 0], m=[0] * 3, f=[1] * 3, b=[1] * 3)
    assert recomputed_layers(relu, (2,)) == [0, 1]  # layer 1 saves its output: re-run to the end
    add = ChainCosts.additive([0] * 4, [1] * 4, [1] * 4)
    assert recomputed_layers(add, (2, 3)) == [0, 1, 2]
