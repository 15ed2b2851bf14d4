"""A replay of PyTorch's CUDA caching allocator: what a sequence of allocations reserves.

The cost model predicts the bytes of live tensors (``max_memory_allocated``). A step runs out of
memory when the allocator cannot *reserve* (``cudaMalloc``) a segment for a request, and what it has
reserved runs above what is allocated by rounding and by fragmentation, in whole blocks. Given the
step's allocations and frees in order (sizes requested, one stream), :class:`CachingAllocator`
replays them through the rules of the native allocator (``c10/cuda/CUDACachingAllocator.cpp``,
``DeviceCachingAllocator``) and reports the reserved bytes, their peak, and whether a request fails
under a capacity (``torch.cuda.set_per_process_memory_fraction``, or the device's free memory):

* sizes are rounded up to 512 B (``kMinBlockSize``); a request of at most 1 MiB (``kSmallSize``)
  comes from the small pool, whose segments are 2 MiB (``kSmallBuffer``); a larger one from the large
  pool, whose new segments are 20 MiB (``kLargeBuffer``) below 10 MiB (``kMinLargeAlloc``) and the
  request rounded up to 2 MiB (``kRoundLarge``) from there;
* a request takes the smallest free block of its pool and stream that holds it (best fit, ties by
  address), split when what remains is at least 512 B (small pool) or more than 1 MiB (large pool);
  with ``max_split_size`` set, blocks of that size or more are not split and serve only requests
  within 20 MiB of their size;
* a freed block merges with free neighbours in its segment;
* when no free block fits, a new segment is reserved; if that would pass the capacity, the cached
  segments that are wholly free are released (``release_cached_blocks``; with ``max_split_size``
  set, first one oversize block, ``release_available_cached_blocks``) and the reservation tried once
  more; then the request fails (``OutOfMemoryError``).

With expandable segments (``expandable_segments:True``, :class:`ExpandableAllocator`) each pool and
stream has one segment of virtual addresses whose pages (2 MiB small, 20 MiB large) are mapped as
requests need them: a request no free block holds maps what the free block at the mapped end lacks
(``find_expandable_block``, ``map_block``); any free block splits when 512 B remain; best fit passes
over a block that borders unmapped space for a larger one that does not; releasing the cache unmaps
the whole pages inside free blocks; the capacity is checked against the request's segment size as
without them. The simulator stage imports no torch: this module works on sizes alone.
"""

from __future__ import annotations

import bisect
import copy as _copy
import math
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["AllocatorRules", "CachingAllocator", "CapacityReplays", "ExpandableAllocator", "ReplayResult", "replay"]

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class AllocatorRules:
    """The constants of one PyTorch version's native CUDA caching allocator (the defaults: PyTorch
    2.x's, unchanged from 1.x to 2.11; ``max_split_size`` None is its default, no limit)."""

    min_block: int = 512
    small_size: int = 1 * MiB
    small_buffer: int = 2 * MiB
    large_buffer: int = 20 * MiB
    min_large_alloc: int = 10 * MiB
    round_large: int = 2 * MiB
    max_split_size: int | None = None

    def round_size(self, size: int) -> int:
        """The block size a request takes (``round_size``: a multiple of ``min_block``)."""
        return self.min_block if size < self.min_block else self.min_block * math.ceil(size / self.min_block)

    def is_small(self, rounded: int) -> bool:
        return rounded <= self.small_size

    def segment_size(self, rounded: int) -> int:
        """The bytes reserved for a request no cached block can serve (``get_allocation_size``)."""
        if rounded <= self.small_size:
            return self.small_buffer
        if rounded < self.min_large_alloc:
            return self.large_buffer
        return self.round_large * math.ceil(rounded / self.round_large)

    def splits(self, small: bool, rounded: int, remaining: int) -> bool:
        """Whether a block with ``remaining`` bytes beyond a request of ``rounded`` is split
        (``should_split``): in the small pool when at least a minimal block remains; in the large pool
        when more than ``small_size`` remains and the request is below ``max_split_size``."""
        if small:
            return remaining >= self.min_block
        return remaining > self.small_size and (self.max_split_size is None or rounded < self.max_split_size)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    segment: "_Segment"
    free: bool = True
    mapped: bool = True  #: (expandable segments: False for address space no page backs)
    prev: "_Block | None" = None
    next: "_Block | None" = None


@dataclass(eq=False)
class _Segment:
    addr: int
    size: int
    small: bool
    stream: int
    head: _Block | None = None


@dataclass
class ReplayResult:
    """What a replay found: the reserved and allocated bytes at the end and at their peaks, and the
    first request that failed (its index in the sequence and size), if one did."""

    reserved: int
    max_reserved: int
    allocated: int
    max_allocated: int
    failed_at: int | None = None
    failed_size: int | None = None
    segments: int = 0

    @property
    def fits(self) -> bool:
        return self.failed_at is None


@dataclass
class CachingAllocator:
    """The native CUDA caching allocator's state, driven by :meth:`malloc` and :meth:`free`.

    ``capacity``: the most it may reserve (None: no limit); ``rules``: the version's constants."""

    capacity: int | None = None
    rules: AllocatorRules = field(default_factory=AllocatorRules)
    #: the addresses of the next new segments, where known (a recorded trace's); else :meth:`_address`
    addresses: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reserved = self.max_reserved = self.allocated = self.max_allocated = 0
        #: the most any reservation so far asked to hold (what was reserved plus the new segment), whether
        #: or not the capacity let it: under a capacity at least this, every request so far ran as without one
        self.demand = 0
        self._pools: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}  # (stream, size, addr, id)
        self._blocks: dict[int, _Block] = {}  # id(block) -> block, for the pools' keys
        self._live: dict[object, _Block] = {}
        self.segments: list[_Segment] = []
        self._spans: list[tuple[int, int]] = []  # (addr, size) of the live segments, by address
        self._span_bytes = 0  # their sizes summed: equal to the last one's end when they leave no gap
        # the free ranges between live segments, (addr, size) by address; None when the segments' addresses
        # are given (a recorded trace's, which may overlap what the replay thinks live): then they are scanned
        self._gaps: list[tuple[int, int]] | None = None if self.addresses else []

    # -- the pools --------------------------------------------------------
    def _key(self, b: _Block) -> tuple[int, int, int, int]:
        return (b.segment.stream, b.size, b.addr, id(b))

    def _insert(self, b: _Block) -> None:
        self._blocks[id(b)] = b
        bisect.insort(self._pools[b.segment.small], self._key(b))

    def _remove(self, b: _Block) -> None:
        pool = self._pools[b.segment.small]
        k = bisect.bisect_left(pool, self._key(b))
        assert pool[k] == self._key(b)
        del pool[k]
        del self._blocks[id(b)]

    def _split(self, b: _Block, size: int, mapped: bool = True) -> _Block:
        """Cut ``b`` after its first ``size`` bytes; the rest becomes a free block after it (``mapped`` as
        given, out of the pool), which is returned."""
        rest = _Block(b.addr + size, b.size - size, b.segment, free=True, mapped=mapped, prev=b, next=b.next)
        if b.next is not None:
            b.next.prev = rest
        b.next = rest
        b.size = size
        return rest

    def _merge_free(self, b: _Block) -> _Block:
        """The free block ``b`` joined with its free neighbours of the same mapped state (the mapped ones
        leave the pool: ``try_merge_blocks``); returns the joined block, out of the pool."""
        for nb in (b.prev, b.next):
            if nb is not None and nb.free and nb.mapped == b.mapped:
                if nb.mapped:
                    self._remove(nb)
                left, right = (nb, b) if nb is b.prev else (b, nb)
                left.size += right.size
                left.next = right.next
                if right.next is not None:
                    right.next.prev = left
                b = left
        return b

    def _find(self, small: bool, stream: int, size: int) -> _Block | None:
        """The smallest free block of the pool and stream that holds ``size`` (``get_free_block``)."""
        pool = self._pools[small]
        k = bisect.bisect_left(pool, (stream, size, -1, -1))
        if k == len(pool) or pool[k][0] != stream:
            return None
        b = self._blocks[pool[k][3]]
        mss = self.rules.max_split_size
        if mss is not None:
            if size < mss <= b.size:
                return None  # an oversize block serves no request below the limit
            if size >= mss and b.size >= size + self.rules.large_buffer:
                return None  # nor one much smaller than itself
        return b

    # -- segments ---------------------------------------------------------
    def _address(self, size: int) -> int:
        """Where the device puts a new segment: the lowest gap among the live segments that holds it,
        else after the highest (addresses only order equal-size free blocks: the allocator takes the
        lowest)."""
        if self.addresses:
            return self.addresses.pop(0)
        if not self._spans:
            return 0
        last = self._spans[-1][0] + self._spans[-1][1]
        if last == self._span_bytes:  # (non-overlapping spans whose sizes fill [0, last): no gap to scan)
            return last
        if self._gaps is not None:
            return next((addr for addr, length in self._gaps if length >= size), last)
        end = 0
        for addr, length in self._spans:
            if addr - end >= size:
                return end
            end = max(end, addr + length)
        return end

    def _admits(self, size: int) -> bool:
        """Whether the capacity lets ``size`` more bytes be reserved (the one place a capacity decides)."""
        self.demand = max(self.demand, self.reserved + size)
        return self.capacity is None or self.reserved + size <= self.capacity

    def _reserve(self, size: int, small: bool, stream: int) -> _Block | None:
        if not self._admits(size):
            return None
        seg = _Segment(self._address(size), size, small, stream)
        seg.head = _Block(seg.addr, size, seg)
        self.segments.append(seg)
        bisect.insort(self._spans, (seg.addr, size))
        if self._gaps is not None:  # (placed at a gap's start, or after the highest segment)
            k = bisect.bisect_left(self._gaps, (seg.addr, -1))
            if k < len(self._gaps) and self._gaps[k][0] == seg.addr:
                length = self._gaps[k][1] - size
                if length > 0:
                    self._gaps[k] = (seg.addr + size, length)
                else:
                    del self._gaps[k]
        self._span_bytes += size
        self.reserved += size
        self.max_reserved = max(self.max_reserved, self.reserved)
        return seg.head

    def _grow(self, rounded: int, small: bool, stream: int) -> _Block | None:
        """A new free block that holds ``rounded`` (out of the pool), or None past the capacity."""
        return self._reserve(self.rules.segment_size(rounded), small, stream)

    def _splits(self, small: bool, rounded: int, remaining: int) -> bool:
        return self.rules.splits(small, rounded, remaining)

    def _drop(self, seg: _Segment) -> None:
        """Give a wholly free segment back to the device (``cudaFree``)."""
        self.segments.remove(seg)
        k = bisect.bisect_left(self._spans, (seg.addr, seg.size))
        del self._spans[k]
        self._span_bytes -= seg.size
        self.reserved -= seg.size
        if self._gaps is not None:
            self._open_gap(seg.addr, seg.size, highest=k == len(self._spans))

    def _open_gap(self, addr: int, size: int, highest: bool) -> None:
        """Record ``[addr, addr + size)`` free, joined with the gaps beside it; past the highest segment
        nothing is a gap (so the gap below the highest one, if it ends there, stops being one)."""
        gaps = self._gaps
        k = bisect.bisect_left(gaps, (addr, -1))
        below = k > 0 and gaps[k - 1][0] + gaps[k - 1][1] == addr
        if highest:
            if below:
                del gaps[k - 1]
            return
        lo, hi = addr, addr + size
        if below:
            k -= 1
            lo = gaps.pop(k)[0]
        if k < len(gaps) and gaps[k][0] == hi:
            hi += gaps.pop(k)[1]
        gaps.insert(k, (lo, hi - lo))

    def release_cached(self) -> None:
        """Release every segment that is wholly free (``release_cached_blocks``, both pools)."""
        for seg in list(self.segments):
            b = seg.head
            if b.free and b.next is None:
                self._remove(b)
                self._drop(seg)

    def _release_one_oversize(self, size: int) -> bool:
        """With ``max_split_size`` set: release the smallest wholly free oversize segment of at least
        ``size`` (``release_available_cached_blocks``); without it this does nothing."""
        mss = self.rules.max_split_size
        if mss is None:
            return False
        cands = [s for s in self.segments if not s.small and s.head.free and s.head.next is None
                 and s.size >= max(size, mss)]
        if not cands:
            return False
        seg = min(cands, key=lambda s: (s.size, s.addr))
        self._remove(seg.head)
        self._drop(seg)
        return True

    # -- requests ---------------------------------------------------------
    def malloc(self, key: object, size: int, stream: int = 0) -> bool:
        """Serve a request of ``size`` bytes, remembered as ``key``; False where the allocator would
        raise ``OutOfMemoryError`` (nothing changes then but the released cache)."""
        r = self.rules
        rounded = r.round_size(size)
        small = r.is_small(rounded)
        b = self._find(small, stream, rounded)
        if b is not None:
            self._remove(b)
        else:
            b = self._grow(rounded, small, stream)
            if b is None and self._release_one_oversize(rounded):
                b = self._grow(rounded, small, stream)
            if b is None:
                self.release_cached()
                b = self._grow(rounded, small, stream)
            if b is None:
                return False
        remaining = b.size - rounded
        if self._splits(small, rounded, remaining):
            self._insert(self._split(b, rounded))
        b.free = False
        self._live[key] = b
        self.allocated += b.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        return True

    def free(self, key: object) -> None:
        """Return the block of ``key`` to its pool, merged with free neighbours."""
        b = self._live.pop(key)
        self.allocated -= b.size
        b.free = True
        self._insert(self._merge_free(b))

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: the peaks start again from the current figures."""
        self.max_reserved, self.max_allocated = self.reserved, self.allocated

    def result(self, failed_at: int | None = None, failed_size: int | None = None) -> ReplayResult:
        return ReplayResult(self.reserved, self.max_reserved, self.allocated, self.max_allocated, failed_at,
                            failed_size, len(self.segments))

    def copy(self) -> "CachingAllocator":
        """An independent allocator in the same state: segments and blocks copied, requests' keys kept."""
        new = _copy.copy(self)  # (the counters, capacity and rules)
        made: dict[int, _Block] = {}  # id(old block) -> its copy
        new.segments = []
        for seg in self.segments:
            twin = _Segment(seg.addr, seg.size, seg.small, seg.stream)
            b, prev = seg.head, None
            while b is not None:
                c = _Block(b.addr, b.size, twin, b.free, b.mapped, prev)
                if prev is None:
                    twin.head = c
                else:
                    prev.next = c
                made[id(b)] = prev = c
                b = b.next
            new.segments.append(twin)
        new._blocks = {id(made[i]): made[i] for i in self._blocks}
        # (a pool's entries differ before their last field, the block's identity: their order is kept)
        new._pools = {small: [(st, size, addr, id(made[i])) for st, size, addr, i in pool]
                      for small, pool in self._pools.items()}
        new._live = {key: made[id(b)] for key, b in self._live.items()}
        new._spans = list(self._spans)
        new._gaps = None if self._gaps is None else list(self._gaps)
        new.addresses = list(self.addresses)
        return new


def replay(events: Iterable[tuple[str, object, int]], capacity: int | None = None,
           rules: AllocatorRules | None = None, expandable: bool = False) -> ReplayResult:
    """Replay ``("alloc", key, size)`` and ``("free", key, 0)`` events (one stream) from an empty
    allocator (with expandable segments where ``expandable``); stops at the first request that fails
    under ``capacity``."""
    a = (ExpandableAllocator if expandable else CachingAllocator)(capacity, rules or AllocatorRules())
    return _run(a, events)


def _run(a: "CachingAllocator", events: Iterable[tuple[str, object, int]], start: int = 0) -> ReplayResult:
    """Drive ``a`` through ``events`` (the sequence's from index ``start`` on)."""
    for i, (what, key, size) in enumerate(events, start):
        if not _apply(a, what, key, size):
            return a.result(i, size)
    return a.result()


def _apply(a: "CachingAllocator", what: str, key: object, size: int) -> bool:
    """One event; False where its request fails."""
    if what == "alloc":
        return a.malloc(key, size)
    if what == "free":
        a.free(key)
        return True
    raise ValueError(f"unknown event {what!r}: 'alloc' or 'free'")


class CapacityReplays:
    """:func:`replay` of one sequence under many capacities, each resumed where it first differs from the
    replay without a limit.

    A capacity decides only whether a new reservation may be made (:meth:`CachingAllocator._admits`). So
    under a capacity C the replay runs as the unlimited one up to the first request whose reservation
    would pass C: the first event after which the unlimited replay's :attr:`~CachingAllocator.demand`
    exceeds C. Each replay starts from a copy of the unlimited state just before that event, kept for the
    capacities that follow (on an 8B Llama's two steps, every capacity of a search first differs two
    thirds of the way in, at the first step's largest reservation)."""

    def __init__(self, events: Iterable[tuple[str, object, int]], rules: AllocatorRules | None = None,
                 expandable: bool = False):
        self.events = list(events)
        self._make = lambda: (ExpandableAllocator if expandable else CachingAllocator)(None, rules or AllocatorRules())
        a = self._make()
        self.demands = []  # the unlimited replay's demand after each event
        for what, key, size in self.events:
            _apply(a, what, key, size)  # (without a limit every request is served)
            self.demands.append(a.demand)
        self.unlimited = a.result()
        self._states = {0: self._make()}  # event index -> the unlimited state just before it

    def replay(self, capacity: int) -> ReplayResult:
        """:func:`replay` of the sequence under ``capacity``, the same to the figure."""
        first = bisect.bisect_right(self.demands, capacity)  # (demands never decrease)
        if first == len(self.events):
            return _copy.copy(self.unlimited)  # (each answer the caller's own, as replay()'s are)
        start = max(i for i in self._states if i <= first)
        a = self._states[start]
        if start < first:
            a = a.copy()
            _run(a, self.events[start:first], start)
            self._states[first] = a
        a = a.copy()
        a.capacity = capacity
        return _run(a, self.events[first:], first)


class ExpandableAllocator(CachingAllocator):
    """The caching allocator with expandable segments (module docstring): one segment of address
    space per pool and stream, its pages mapped as requests need them."""

    #: the address space of one expandable segment (large enough never to run out in a replay)
    SPAN = 1 << 50

    def _page(self, small: bool) -> int:
        return self.rules.small_buffer if small else self.rules.large_buffer

    def _segment(self, small: bool, stream: int) -> _Segment:
        for seg in self.segments:
            if seg.small == small and seg.stream == stream:
                return seg
        seg = _Segment(len(self.segments) * self.SPAN, self.SPAN, small, stream)
        seg.head = _Block(seg.addr, self.SPAN, seg, free=True, mapped=False)
        self.segments.append(seg)
        return seg

    def _splits(self, small: bool, rounded: int, remaining: int) -> bool:
        return remaining >= self.rules.min_block

    def _find(self, small: bool, stream: int, size: int) -> _Block | None:
        """Best fit, passing over a block that borders unmapped space (it can grow) for the next larger
        one whose room, counting what could be mapped after it, is smaller (``get_free_block``)."""
        pool = self._pools[small]
        k = bisect.bisect_left(pool, (stream, size, -1, -1))
        if k == len(pool) or pool[k][0] != stream:
            return None

        def room(b: _Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        b = self._blocks[pool[k][3]]
        while k + 1 < len(pool) and pool[k + 1][0] == stream:
            nxt = self._blocks[pool[k + 1][3]]
            if not (b.next is not None and not b.next.mapped) or room(nxt) >= room(b):
                break
            k, b = k + 1, nxt
        return b

    def _map(self, b: _Block, size: int) -> _Block:
        """Back the first ``size`` bytes (whole pages) of the unmapped block ``b``; the mapped part merges
        with free mapped neighbours and goes into the pool (``map_block``). Returns the merged block."""
        page = self._page(b.segment.small)
        size = min(b.size, page * math.ceil(size / page))
        if size < b.size:
            self._split(b, size, mapped=False)
        b.mapped = True
        self.reserved += size
        self.max_reserved = max(self.max_reserved, self.reserved)
        b = self._merge_free(b)
        self._insert(b)
        return b

    def _grow(self, rounded: int, small: bool, stream: int) -> _Block | None:
        """Map what a request needs (``try_allocate_expandable_block``): the first unmapped range that,
        with the free block before it and the free or unmapped blocks after, holds the request."""
        if not self._admits(self.rules.segment_size(rounded)):
            return None
        seg = self._segment(small, stream)
        c, start = seg.head, None
        while c is not None:
            if not c.mapped:
                start = c.prev if c.prev is not None and c.prev.free and c.prev.mapped else c
                total, t = 0, start
                while t is not None and t.free and total < rounded:
                    total, t = total + t.size, t.next
                if total >= rounded:
                    break
            c = c.next
        if c is None:  # (the span never runs out in a replay)
            raise RuntimeError("expandable segment exhausted")
        b = start if start.mapped else self._map(start, min(start.size, rounded))
        while b.size < rounded:  # (b is free and mapped, an unmapped range after it)
            b = self._map(b.next, min(rounded - b.size, b.next.size))
        self._remove(b)
        return b

    def release_cached(self) -> None:
        """Unmap the whole pages inside every free mapped block (``release_blocks`` on expandable ones)."""
        for seg in self.segments:
            page = self._page(seg.small)
            b = seg.head
            while b is not None:
                nxt = b.next
                if b.free and b.mapped:
                    lo = seg.addr + page * math.ceil((b.addr - seg.addr) / page)
                    hi = seg.addr + page * ((b.addr + b.size - seg.addr) // page)
                    if hi > lo:
                        self._unmap(b, lo, hi)
                b = nxt

    def _unmap(self, b: _Block, lo: int, hi: int) -> None:
        """Unmap ``[lo, hi)`` (whole pages) of the free mapped block ``b``: what lies before and after
        stays a free mapped block; the unmapped range joins unmapped neighbours."""
        self._remove(b)
        mid = self._split(b, lo - b.addr) if lo > b.addr else b
        if hi < mid.addr + mid.size:
            self._insert(self._split(mid, hi - lo))
        if mid is not b:
            self._insert(b)
        mid.mapped = False
        self.reserved -= hi - lo
        self._merge_free(mid)
