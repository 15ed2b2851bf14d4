"""The replay of PyTorch's CUDA caching allocator (ckptopt.simulator.allocator): its rules on sequences
built by hand, its invariants on random ones, and its figures against allocator histories recorded on
a GPU (benchmarks/data/cuda_alloc)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.allocator_replay import replay_all
from benchmarks.cuda_alloc_traces import trace_files
from ckptopt.simulator.allocator import AllocatorRules, CachingAllocator, CapacityReplays, ExpandableAllocator, replay

KiB, MiB = 1024, 1 << 20


def test_small_requests_share_a_two_mib_segment_in_512_byte_blocks():
    a = CachingAllocator()
    assert a.malloc("x", 1) and a.malloc("y", 700)
    assert a.allocated == 512 + 1024 and a.reserved == 2 * MiB and len(a.segments) == 1
    assert a.malloc("z", MiB)  # at most 1 MiB: still the small pool, the same segment
    assert a.reserved == 2 * MiB
    assert a.malloc("w", MiB)  # no room left in it: a second small segment
    assert a.reserved == 4 * MiB


def test_large_requests_get_20_mib_segments_below_10_mib_and_their_size_above():
    a = CachingAllocator()
    a.malloc("a", 3 * MiB)
    assert a.reserved == 20 * MiB and a.allocated == 3 * MiB  # split: 17 MiB stays free
    a.malloc("b", 16 * MiB)  # fits the 17 MiB left; 1 MiB would remain: not split
    assert a.reserved == 20 * MiB and a.allocated == 20 * MiB
    a.malloc("c", 11 * MiB + 1)
    assert a.reserved == 20 * MiB + 12 * MiB  # rounded up to 2 MiB


def test_best_fit_and_merging_with_free_neighbours():
    a = CachingAllocator()
    for k in range(4):
        a.malloc(k, 4 * MiB)  # one 20 MiB segment: four blocks and 4 MiB free
    a.free(1)
    a.free(2)  # merges with 1: an 8 MiB hole between 0 and 3
    assert a.malloc("x", 6 * MiB) and a.reserved == 20 * MiB  # the hole, not a new segment
    a.free("x")
    a.free(0)
    a.free(3)
    a.release_cached()  # all free again: one block, the whole segment, released
    assert a.reserved == 0 and a.allocated == 0


def test_running_out_releases_the_cache_and_retries_once():
    a = CachingAllocator(capacity=40 * MiB)
    a.malloc("a", 24 * MiB)
    a.free("a")  # 24 MiB cached, nothing live
    assert a.malloc("b", 30 * MiB)  # 24 + 30 > 40: the cache goes, then it fits
    assert a.reserved == 30 * MiB
    assert not a.malloc("c", 12 * MiB)  # 30 live + 12 > 40: out of memory
    r = replay([("alloc", 1, 30 * MiB), ("alloc", 2, 12 * MiB)], capacity=40 * MiB)
    assert not r.fits and r.failed_at == 1 and r.failed_size == 12 * MiB and r.max_reserved == 30 * MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    rules = AllocatorRules(max_split_size=64 * MiB)
    a = CachingAllocator(rules=rules)
    a.malloc("big", 100 * MiB)
    a.free("big")
    a.malloc("small", 30 * MiB)  # below the limit: an oversize block does not serve it
    assert a.reserved == 130 * MiB
    a.malloc("near", 90 * MiB)  # within 20 MiB of the cached 100 MiB block: served, not split
    assert a.reserved == 130 * MiB and a.allocated == 130 * MiB


def test_bad_events_are_refused():
    with pytest.raises(ValueError, match="unknown event"):
        replay([("malloc", 1, 8)])


@st.composite
def sequences(draw):
    sizes = st.one_of(st.integers(1, 4 * KiB), st.integers(MiB - 512, MiB + 512), st.integers(1, 30 * MiB))
    events, live, n = [], [], 0
    for _ in range(draw(st.integers(1, 60))):
        if live and draw(st.booleans()):
            events.append(("free", live.pop(draw(st.integers(0, len(live) - 1))), 0))
        else:
            events.append(("alloc", n, draw(sizes)))
            live.append(n)
            n += 1
    return events, draw(st.one_of(st.none(), st.integers(2, 80).map(lambda m: m * MiB)))


def test_expandable_segments_map_pages_as_needed_and_unmap_free_ones():
    a = ExpandableAllocator()
    a.malloc("a", 30 * MiB)
    assert a.reserved == 40 * MiB  # two 20 MiB pages of the large pool's one segment
    a.malloc("b", 5 * MiB)  # the 10 MiB free at the mapped end holds it
    assert a.reserved == 40 * MiB and a.allocated == 35 * MiB  # (split: 512 B would do)
    a.malloc("c", 8 * MiB)  # 5 MiB free at the end: one more page maps what it lacks
    assert a.reserved == 60 * MiB
    a.malloc("s", 100)
    assert a.reserved == 62 * MiB  # the small pool: 2 MiB pages
    a.free("a")
    a.release_cached()  # the whole pages inside the free 30 MiB: one 20 MiB page
    assert a.reserved == 42 * MiB
    assert a.malloc("d", 12 * MiB) and a.reserved == 42 * MiB  # best fit: the 17 MiB free at the end
    assert a.malloc("e", 25 * MiB) and a.reserved == 62 * MiB  # the unmapped page and the free 10 MiB after it
    r = replay([("alloc", 1, 30 * MiB), ("free", 1, 0), ("alloc", 2, 50 * MiB)], capacity=70 * MiB, expandable=True)
    assert r.fits and r.reserved == 60 * MiB  # the 30 MiB free at the start grows into the next pages


@settings(max_examples=150, deadline=None)
@given(sequences(), st.booleans())
def test_blocks_tile_their_segments_and_the_counters_hold(case, expandable):
    events, capacity = case
    a = (ExpandableAllocator if expandable else CachingAllocator)(capacity)
    for what, key, size in events:
        if what == "alloc":
            if not a.malloc(key, size):
                assert capacity is not None and a.reserved + a.rules.segment_size(a.rules.round_size(size)) > capacity
                break
            if expandable and key % 7 == 3:
                a.release_cached()
            b = a._live[key]
            assert b.size >= a.rules.round_size(size)
        else:
            a.free(key)
        mapped = 0
        for s in a.segments:  # blocks tile the segment, no two free neighbours alike
            b, addr = s.head, s.addr
            while b is not None:
                assert b.addr == addr and b.segment is s and (b.mapped or b.free)
                assert not (b.free and b.next is not None and b.next.free and b.next.mapped == b.mapped)
                mapped += b.size if b.mapped else 0
                addr += b.size
                b = b.next
            assert addr == s.addr + s.size
        assert a.reserved == mapped <= (capacity or a.reserved)
        assert a.allocated == sum(b.size for b in a._live.values())
        if expandable:  # reserved bytes are whole pages of each pool
            assert all(s.addr % (1 << 50) == 0 for s in a.segments)
        assert a.max_reserved >= a.reserved and a.max_allocated >= a.allocated


needs_traces = pytest.mark.skipif(not trace_files(), reason="no recorded allocator traces")


@needs_traces
def test_with_the_devices_addresses_every_recorded_phase_is_exact():
    rows = replay_all(recorded_addresses=True)
    assert rows
    for r in rows:
        assert r["fits_answer_right"], r["name"]
        for p in r["phases"]:
            assert (p["reserved"], p["max_reserved"]) == (p["recorded_reserved"], p["recorded_max_reserved"]), \
                (r["name"], p)


@needs_traces
def test_without_them_every_answer_is_right_and_within_one_segment():
    rows = replay_all(recorded_addresses=False)
    assert {r["allocator"] for r in rows} == {"default", "expandable"}
    for r in rows:  # expandable segments: one per pool, no address to know; exact without the device's
        if r["allocator"] == "expandable":
            assert all(p["max_reserved"] == p["recorded_max_reserved"] for p in r["phases"]), r["name"]
    capped = [r for r in rows if r["capacity"]]
    assert any(r["device_failed_at"] is not None for r in capped) and any(r["device_failed_at"] is None for r in capped)
    for r in rows:
        assert r["fits_answer_right"], r["name"]
        assert r["max_abs_peak_error"] <= r["largest_segment"], r["name"]


def _scanning(capacity, rules):
    """A caching allocator that finds each new segment's address by scanning the live segments (as it
    does for a recorded trace's addresses), not from its list of gaps."""
    a = CachingAllocator(capacity, rules)
    a._gaps = None
    return a


@settings(max_examples=150, deadline=None)
@given(sequences(), st.sampled_from([None, 4 * MiB, 24 * MiB]))
def test_gaps_place_segments_where_scanning_the_live_ones_does(case, max_split):
    events, capacity = case
    rules = AllocatorRules(max_split_size=max_split)
    a, ref = CachingAllocator(capacity, rules), _scanning(capacity, rules)
    for i, (what, key, size) in enumerate(events):
        if what == "alloc":
            served = a.malloc(key, size)
            assert ref.malloc(key, size) == served
            if not served:
                break
            if i % 5 == 4:  # (releasing the cache opens gaps below the highest segment)
                a.release_cached()
                ref.release_cached()
        else:
            a.free(key)
            ref.free(key)
        assert [(s.addr, s.size) for s in a.segments] == [(s.addr, s.size) for s in ref.segments]
        assert a._gaps == _gaps_of(a._spans)


def _gaps_of(spans):
    out, end = [], 0
    for addr, size in spans:
        if addr > end:
            out.append((end, addr - end))
        end = addr + size
    return out


@settings(max_examples=150, deadline=None)
@given(sequences(), st.booleans(), st.sampled_from([None, 4 * MiB]), st.lists(st.integers(2, 80), max_size=6))
def test_replays_resumed_where_a_capacity_first_matters_are_the_replays(case, expandable, max_split, capacities):
    events, _ = case
    rules = AllocatorRules(max_split_size=max_split)
    replays = CapacityReplays(events, rules, expandable)
    assert replays.unlimited == replay(events, None, rules, expandable)
    for c in capacities:  # (in the order given: each resumes from the states kept by those before)
        assert replays.replay(c * MiB) == replay(events, c * MiB, rules, expandable)
        for at, kept in replays._states.items():  # each kept state is still the unlimited one's there
            fresh = (ExpandableAllocator if expandable else CachingAllocator)(None, rules)
            for what, key, size in events[:at]:
                assert fresh.malloc(key, size) if what == "alloc" else fresh.free(key) is None
            assert _state(kept) == _state(fresh)


def _state(a):
    """Everything of an allocator's state a later request can depend on, by value."""
    segments = []
    for s in a.segments:
        b, blocks = s.head, []
        while b is not None:
            blocks.append((b.addr, b.size, b.free, b.mapped))
            b = b.next
        segments.append((s.addr, s.size, s.small, s.stream, blocks))
    pools = {small: [k[:3] for k in pool] for small, pool in a._pools.items()}
    live = {key: (b.addr, b.size) for key, b in a._live.items()}
    return (segments, pools, live, a._spans, a._gaps, a.reserved, a.allocated, a.max_reserved, a.max_allocated)
