"""The layer figures derived from hand-written records (ckptopt.tracer.layer_figures, docs/design.md §3).

Each test writes the timeline a layer's forward and backward would leave (live bytes after each
operator, the moments saved references are released and storages die) and checks one rule.
"""

from __future__ import annotations

import itertools

from ckptopt.tracer.layer_figures import (backward_figures, backward_peaks, dying_gains, first_read_figures,
                                          forward_figures, gone_at, held_timelines, release_splits, saved_set,
                                          split, without_copies)
from ckptopt.tracer.layer_record import Entry, FirstRead, InjectedGradients, LayerKeys, LayerRecord, Release


def timeline(*live: int) -> list[Entry]:
    return [Entry(k, f"op{k}", v) for k, v in enumerate(live)]


def record(live: list[int], **kw) -> LayerRecord:
    """A record over ``live`` with the fields a test does not name left empty."""
    base = dict(timeline=timeline(*live), start=100, input_bytes=10, forward=(0, 0), input_death_in_forward=0,
                last_pack=None, packs=0, kept=(), keys=LayerKeys(chain_in="x"), output_bytes=0, backward_index=0,
                backward_start=100, input_dead=False, alive_keys={}, releases=[], rec_gone=[], deaths={},
                copies=[], first_read=None, out_grad_freed=None)
    base.update(kw)
    return LayerRecord(**base)


def test_the_forward_counts_the_input_from_its_death_where_something_holds_it():
    # the forward starts at 100 (input 10 included), makes 30, the input dies (120), makes 20 more (140)
    r = record([130, 120, 140], forward=(0, 3), input_death_in_forward=1, last_pack=1, packs=1)
    fig = forward_figures(r)
    assert (fig.f, fig.ff) == (50, 40)  # held: 140 + 10 - 100; dying inside: 140 - 100
    assert (fig.fs, fig.ffs) == (30, 30)  # up to the last pack (before entry 1)


def test_a_forward_that_packs_nothing_stops_a_recomputation_before_it_runs():
    r = record([130, 120], forward=(0, 2), input_death_in_forward=2)
    fig = forward_figures(r)
    assert (fig.fs, fig.ffs) == (0, 0)
    assert fig.as_list(packs=False) == [fig.f, fig.ff]


def test_backward_peaks_for_the_three_ways_the_input_is_held():
    # backward from 100: +50 (input gradient), the saved reference over the input released at 2, +30 at 3
    tl = timeline(150, 150, 140, 170)
    releases = [Release(2, "x", True)]
    held, free, frame = backward_peaks(tl, 0, 100, 10, releases, alive=1, alive_input=1)
    assert held == 70  # 170 - 100, the input held throughout
    assert free == 60  # the input goes with its last saved reference: 170 - 10 from entry 2
    assert frame == 60  # the layer's last saved tensor is the same reference


def test_an_input_no_saved_tensor_holds_is_gone_before_the_backward():
    tl = timeline(150, 160)
    held, free, _ = backward_peaks(tl, 0, 100, 10, [], alive=0, alive_input=0)
    assert held == 60 and free == 60  # relative to a start without the input either way


def test_a_saved_storage_dead_before_its_release_is_held_until_the_release():
    # storage "s" (8 B) died at entry 1 (its node returned) and was released at entry 3
    tl = timeline(120, 112, 112, 112, 100)
    held, rec = held_timelines(tl, 0, {"s": (1, 8)}, [Release(3, "s", False)], {"s": 1}, "x", 10, 10)
    assert [e.live if hasattr(e, "live") else e[2] for e in held] == [120, 120, 120, 112, 100]
    assert [e[2] for e in rec] == [120, 112, 112, 112, 100]  # a recomputed segment lets it go at its death


def test_a_split_is_the_peak_before_and_from_a_moment():
    assert split([0, 5, 9, 3, 4], 10, 12) == (9, 4)
    assert split([0, 5, 9, 3, 4], 10, None) == (9, 9)  # never reached: the whole backward both ways


def test_gone_at_waits_for_the_last_reference_over_a_storage():
    events = [(3, "a"), (5, "b"), (7, "a")]
    assert gone_at(events, {"a": 2, "b": 1}, "a") == 7
    assert gone_at(events, {"a": 2, "b": 1}, None) == 7  # every saved reference
    assert gone_at(events, {"a": 2, "b": 1}, "c") is None


def test_a_copy_made_for_the_backward_is_taken_out_of_the_timeline():
    tl = timeline(100, 108, 108, 100)  # a copy of 8 B made at entry 1, died at entry 3
    assert [e[2] for e in without_copies(tl, [(1, 1, 3, 8)])] == [100, 100, 100, 100]


def test_backward_figures_leave_out_the_injected_gradients():
    # one saved reference (not over the input) released at entry 2; 40 B of injected gradient
    r = record([140, 150, 130], backward_index=0, backward_start=100, alive_keys={"s": 1},
               releases=[Release(2, "s", False)], deaths={"x": (3, 10)},
               grads=InjectedGradients(outputs=40, pending=0))
    fig = backward_figures(r, keep_input=True)
    assert fig.b == 50 - 40
    splits = release_splits(r, keep_input=True)
    assert splits.frame == (50 - 40, 30 - 40)  # the frame goes with the last saved reference


def test_rg_is_taken_with_an_output_sized_gradient_and_never_below_zero():
    grads = InjectedGradients(outputs=64, chain=32, chain_storage=64)  # a slice of a 64 B storage
    r = record([], backward_start=100, first_read=FirstRead(150, False, 1), grads=grads)
    rg, rgk, rgl = first_read_figures(r, a_own=32)
    assert rg == 50 + 32 - 64 and rgk == 50 + 32 - 64 and rgl is None
    gone = record([], backward_start=100, first_read=FirstRead(100, True, 1), grads=grads)
    rg, rgk, _ = first_read_figures(gone, a_own=32)
    assert rg == 0 and rgk == 32  # the storage went with the gradient: kept only in rgk


def test_the_saved_set_is_sorted_into_input_output_side_static_and_the_rest():
    keys = LayerKeys(chain_in="x", chain_out="y", side_in=("s",), side_out=())
    r = record([], keys=keys, kept=(("x", 10), ("y", 20), ("s", 5), ("w", 40), ("m", 7), (None, 0)), packs=6)
    saves = saved_set(r, static=set(), params={"w"}, buffers=set(), casts=set(), leaf_input=False)
    assert (saves.sin, saves.sout, saves.m, saves.holds, saves.out_static) == (True, True, 7, False, False)
    only_weight = record([], keys=keys, kept=(("w", 40),), packs=2)
    saves = saved_set(only_weight, static=set(), params={"w"}, buffers=set(), casts=set(), leaf_input=False)
    assert saves.holds and saves.m == 0 and only_weight.dead_packs


def test_dying_gains_cover_every_set_that_dies():
    # overlapping gains: together they save less than the sum of the parts
    measured = {(0,): -8, (1,): -4, (2,): 0, (0, 1): -10, (0, 2): -8, (1, 2): -4, (0, 1, 2): -10}
    gains = dying_gains([0, 1, 2], lambda s: measured[s], 3)
    for size in (1, 2, 3):
        for s in itertools.combinations(range(3), size):
            assert sum(gains[k] for k in s) >= measured[s], s  # never under: at least the change
    assert sum(gains) == measured[(0, 1, 2)]  # exact for the whole set, which saves at most the parts
    # together they save more than the parts: still never under, the whole set then over
    more = {(0,): -8, (1,): 0, (0, 1): -12}
    assert dying_gains([0, 1], lambda s: more[s], 2) == [-8, 0]


def test_equal_dying_gains_are_ordered_by_rank():
    """dying_gains on made-up measurements: of equal gains, the side tensor of the lowest rank takes them
    (without ranks, the first in order); ranks break ties only."""
    table = {(0,): -128, (1,): -128, (0, 1): -128}
    assert dying_gains([0, 1], lambda s: table[s], 2) == [-128, 0]
    assert dying_gains([0, 1], lambda s: table[s], 2, rank=[(2, 0), (1, -2)]) == [0, -128]
    assert dying_gains([0, 1], lambda s: {(0,): -100, (1,): -128, (0, 1): -128}[s], 2, rank=[0, 1]) == [0, -128]


def test_gains_of_side_inputs_dying_together_cover_every_set():
    """dying_gains on made-up measurements: every set's sum at least its change (never under), exact for
    the whole set where the parts add up, and past the cap each alone (the largest gain only)."""
    for table in ({(0,): -4, (1,): -4, (0, 1): -8},  # additive: both exact
                  {(0,): 0, (1,): -6, (0, 1): -9},  # one alone saves nothing, together more
                  {(0,): -5, (1,): -5, (0, 1): -5},  # either one suffices
                  {(0,): -2, (1,): -3, (2,): -1, (0, 1): -5, (0, 2): -2, (1, 2): -4, (0, 1, 2): -7}):
        dying = sorted({k for s in table for k in s})
        g = dying_gains(dying, lambda s: table[tuple(sorted(s))], 4)
        assert all(x <= 0 for x in g)
        for size in range(1, len(dying) + 1):
            for s in itertools.combinations(dying, size):
                assert sum(g[k] for k in s) >= table[s], (table, g, s)
    assert dying_gains([0, 1], lambda s: {(0,): -4, (1,): -4, (0, 1): -8}[s], 2) == [-4, -4]
    assert sum(dying_gains([0, 1], lambda s: {(0,): -5, (1,): -5, (0, 1): -5}[s], 2)) == -5  # (the whole set)
    assert dying_gains([0, 1], lambda s: {(0,): -4, (1,): -6}[s], 2, cap=1) == [0, -6]
