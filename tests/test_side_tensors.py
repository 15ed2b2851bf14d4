"""Side tensors (docs/design.md §4): the simulator against the naive reference, and the exact
programs against every plan, on random cost models with tensors crossing several boundaries."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptopt import ChainCosts, InvalidCosts, simulate, solve
from ckptopt.costs import SideTensor
from ckptopt.simulator import plan_recompute
from ckptopt.solvers import streams
from ckptopt.solvers.pareto import pareto_front

from .common.reference import reference_peak
from .common.strategies import side_costs

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


def plans(n, stored_too=True):
    """Every (checkpoints, stored) pair of a chain of n layers."""
    for m in range(n):
        for plan in itertools.combinations(range(1, n), m):
            mids = ((0,) + plan)[:-1]
            for k in range(len(mids) + 1 if stored_too else 1):
                for stored in itertools.combinations(mids, k):
                    yield plan, stored


@settings(max_examples=150, **SETTINGS)
@given(side_costs(max_n=7))
def test_simulator_agrees_with_the_reference(c):
    for plan, stored in plans(c.n):
        assert simulate(c, plan, stored).peak_bytes == reference_peak(c, plan, stored), (plan, stored, c.to_json(indent=None))


@settings(max_examples=300, **SETTINGS)
@given(side_costs(max_n=8))
def test_exact_programs_against_every_plan(c):
    scored = [(simulate(c, p, s).peak_bytes, plan_recompute(c, p, s), p, s) for p, s in plans(c.n)]
    checkpoint_only = [x for x in scored if not x[3]]
    low = min(x[0] for x in checkpoint_only)
    for name in ("dp", "dp2", "brute"):
        plan = solve(c, name)
        assert plan.peak_bytes == low, name
        # among the plans reaching it, the least recomputation
        assert plan_recompute(c, plan.checkpoints) == min(x[1] for x in checkpoint_only if x[0] == low), name
    value, ck, st = streams.lowest_peak(c, allow_stored=True)
    assert value + c.static == min(x[0] for x in scored) == simulate(c, ck, st).peak_bytes
    front = pareto_front(c, None, allow_stored=True)
    assert front[0].peak_bytes == value + c.static
    for point in front:
        assert simulate(c, point.checkpoints, point.stored).peak_bytes == point.peak_bytes
        assert plan_recompute(c, point.checkpoints, point.stored) == point.recompute
        assert point.recompute == min(x[1] for x in scored if x[0] <= point.peak_bytes)


@st.composite
def early_side_costs(draw, max_n: int = 8):
    """:func:`side_costs` with one to three values made before the first layer (hoisted masks:
    producer -1, no gradient), each read (and maybe saved) by some later layers."""
    c = draw(side_costs(max_n=max_n))
    early = []
    for _ in range(draw(st.integers(1, 3))):
        cons = sorted(set(draw(st.lists(st.integers(0, c.n - 1), min_size=1, max_size=3))))
        savers = tuple(u for u in cons if draw(st.booleans()))
        early.append(SideTensor(draw(st.integers(0, 100)), -1, tuple(cons), savers, 0, "mask"))
    d = c.to_dict()
    d["side"] = d.get("side", []) + [t.to_dict() for t in early]
    return ChainCosts.from_dict(d)


@settings(max_examples=300, **SETTINGS)
@given(early_side_costs())
def test_exact_programs_with_hoisted_values_against_every_plan(c):
    """The programs skip the states in which an earlier segment holds a hoisted value none of its
    readers has reached yet (unreachable: ``streams.unheld_bits``); the optimum and the Pareto front
    are still those of every plan."""
    scored = [(simulate(c, p, s).peak_bytes, plan_recompute(c, p, s), p, s) for p, s in plans(c.n)]
    low = min(x[0] for x in scored if not x[3])
    for name in ("dp", "dp2"):
        assert solve(c, name).peak_bytes == low, name
    value, ck, st_ = streams.lowest_peak(c, allow_stored=True)
    assert value + c.static == min(x[0] for x in scored) == simulate(c, ck, st_).peak_bytes
    for point in pareto_front(c, None, allow_stored=True):
        assert simulate(c, point.checkpoints, point.stored).peak_bytes == point.peak_bytes
        assert point.recompute == min(x[1] for x in scored if x[0] <= point.peak_bytes)


def test_a_tensor_read_by_every_later_layer_is_held_once():
    """An encoder output read by four checkpointed decoder layers: held once, not per checkpoint."""
    n = 6
    base = dict(a=[8] * n, p=[0] * n, sin=[1] * n, sout=[0] * n, m=[0] * n, f=[8] * n, b=[8] * n)
    enc = SideTensor(1000, 0, (2, 3, 4, 5), saved_by=(2, 3, 4, 5), grad=0)
    c = ChainCosts(**base, side=[enc])
    every = simulate(c, (1, 2, 3, 4, 5)).peak_bytes
    assert 1000 < every < 2 * 1000  # counted once
    assert simulate(c, ()).peak_bytes == every  # no checkpoint pays for it again


def test_bad_side_tensors_are_refused_with_the_field():
    base = dict(a=[1] * 4, p=[0] * 4, sin=[0] * 4, sout=[0] * 4, m=[0] * 4, f=[1] * 4, b=[1] * 4)
    for side, words in (([{"bytes": 4, "producer": 2, "consumers": [1]}], "after the producer"),
                        ([{"bytes": 4, "producer": 0, "consumers": [2], "saved_by": [1]}], "neither"),
                        ([{"bytes": -4, "producer": 0, "consumers": [2]}], "negative"),
                        ([{"bytes": 4, "consumers": [2]}], "lacks 'producer'"),
                        ([{"bytes": 4, "producer": 0, "consumers": [2], "grad_by": [3]}], "not all consumers")):
        with pytest.raises(InvalidCosts, match=words):
            ChainCosts(**base, side=side)


def test_side_tensors_survive_json():
    base = dict(a=[1] * 4, p=[0] * 4, sin=[0] * 4, sout=[0] * 4, m=[0] * 4, f=[1] * 4, b=[1] * 4)
    c = ChainCosts(**base, side=[SideTensor(7, 0, (2, 3), (3,), 9, "enc")])
    assert ChainCosts.from_json(c.to_json()) == c


@settings(max_examples=200, **SETTINGS)
@given(side_costs(max_n=7))
def test_timeline_peak_is_the_simulated_peak(c):
    from ckptopt.simulator import simulate_timeline

    for plan, stored in plans(c.n):
        events = simulate_timeline(c, plan, stored)
        assert max(e.bytes for e in events) == simulate(c, plan, stored).peak_bytes, (plan, stored)
