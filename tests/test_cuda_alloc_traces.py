"""The recorded CUDA caching-allocator traces (benchmarks/data/cuda_alloc/) hold together.

Each file was recorded on a GPU by ``python -m benchmarks.cuda_alloc_traces``; a replay of the allocator
will be checked against them. These checks need no replay: they are what must hold if a file is what it
says (the whole life of one process's allocator, its figures taken where the phases say), and each can fail.
"""

from __future__ import annotations

import copy
import functools

import pytest

from benchmarks.cuda_alloc_traces import ACTIONS, STATES, Compactor, compact_case, load, trace_files

MiB = 1 << 20
ALLOC, FREE_REQ, FREE_DONE, SEG_ALLOC, SEG_FREE, SEG_MAP, SEG_UNMAP, SNAPSHOT, OOM = range(9)
#: phases after which the peaks were reset (the window of their max_* starts at the phase before)
RESET_BEFORE = ("step1", "step2", "oom")


def _rounded(size: int) -> int:
    """The allocator's ``round_size`` without ``roundup_power2_divisions`` (none of the files sets it)."""
    return 512 if size < 512 else 512 * -(-size // 512)


def _slack(rounded: int) -> int:
    """How much larger than its rounded size a live block can be: a large-pool block is not split when
    at most 1 MiB (``kSmallSize``) would remain; a small-pool one when less than 512 would (none)."""
    return MiB if rounded > MiB else 0


def check_case(case: dict) -> list[str]:
    """What does not hold in one recorded case (empty: all holds)."""
    bad: list[str] = []
    ev = case["events"]
    n = case["n_events"]
    cols = ("action", "id", "size", "stream", "addr")
    if any(len(ev[c]) != n for c in cols):
        return [f"columns of {[len(ev[c]) for c in cols]} events, n_events {n}"]
    if not case["trace_complete"] or ev.get("unknown_actions"):
        bad.append(f"trace incomplete or unknown actions {ev.get('unknown_actions')}")
    phases = case["phases"]
    first = phases[0]  # (a snapshot records an event of its own, before its trace is taken)
    if (first["name"] != "start" or first["reserved"] or first["allocated"]
            or any(a != SNAPSHOT for a in ev["action"][:first["event"]])):
        bad.append(f"the recording does not start on an empty allocator: {first['name']} at event {first['event']}")
    if [p["event"] for p in phases] != sorted(p["event"] for p in phases) or phases[-1]["event"] > n:
        bad.append("phase boundaries out of order or past the trace")
    at = {}
    for k, p in enumerate(phases):
        at.setdefault(p["event"], []).append(k)
    win = {k: (phases[k - 1]["event"] if p["name"] in RESET_BEFORE else 0) for k, p in enumerate(phases)}
    open_windows: dict[int, list] = {}  # phase -> [max reserved, max allocated lo, max allocated hi]

    live: dict[int, tuple] = {}  # alloc id -> (size, addr, rounded, requested?)
    requested: set[int] = set()
    segs: dict[int, tuple] = {}  # segment id -> (addr, size)
    n_alloc = n_seg = 0
    reserved = lo = hi = 0
    ooms = []

    def boundary(i: int) -> None:
        for k in at.get(i, ()):
            p = phases[k]
            m = open_windows.pop(k, None)
            if m is None:
                m = [reserved, lo, hi]
            if reserved != p["reserved"]:
                bad.append(f"{p['name']}: segment events sum to {reserved} reserved, recorded {p['reserved']}")
            if m[0] != p["max_reserved"]:
                bad.append(f"{p['name']}: segment events peak at {m[0]} reserved, recorded {p['max_reserved']}")
            if not lo <= p["allocated"] <= hi:
                bad.append(f"{p['name']}: allocated {p['allocated']} outside the events' [{lo}, {hi}]")
            if not m[1] <= p["max_allocated"] <= m[2]:
                bad.append(f"{p['name']}: max allocated {p['max_allocated']} outside the events' [{m[1]}, {m[2]}]")
            if p["max_allocated"] > p["max_reserved"]:
                bad.append(f"{p['name']}: max allocated over max reserved")
            _check_segments(p, {(a, s) for a, s in segs.values()},
                            {(ad, sz) for i_, (sz, ad, _r) in live.items() if i_ not in requested}, bad)
        for k, start in win.items():  # windows opening here
            if start == i and k not in open_windows and phases[k]["event"] > i:
                open_windows[k] = [reserved, lo, hi]

    actions, ids, sizes, addrs = ev["action"], ev["id"], ev["size"], ev["addr"]
    for i in range(n):
        boundary(i)
        a, ident, size, addr = actions[i], ids[i], sizes[i], addrs[i]
        if a == ALLOC:
            if ident != n_alloc:
                bad.append(f"event {i}: alloc id {ident}, expected {n_alloc}")
            r = _rounded(size)
            live[n_alloc] = (size, addr, r)
            n_alloc += 1
            lo += r
            hi += r + _slack(r)
        elif a in (FREE_REQ, FREE_DONE):
            if ident not in live or live[ident][0] != size or live[ident][1] != addr:
                bad.append(f"event {i}: {ACTIONS[a]} of id {ident} ({size} B) matches no live allocation")
                continue
            if a == FREE_REQ:
                if ident in requested:
                    bad.append(f"event {i}: id {ident} freed twice")
                requested.add(ident)
                r = live[ident][2]
                lo -= r
                hi -= r + _slack(r)
            else:
                if ident not in requested:
                    bad.append(f"event {i}: id {ident} completed before it was requested")
                requested.discard(ident)
                del live[ident]
        elif a == SEG_ALLOC:
            if ident != n_seg:
                bad.append(f"event {i}: segment id {ident}, expected {n_seg}")
            segs[n_seg] = (addr, size)
            n_seg += 1
            reserved += size
        elif a == SEG_FREE:
            if segs.pop(ident, (None, None)) != (addr, size):
                bad.append(f"event {i}: segment_free of id {ident} matches no live segment")
            reserved -= size
        elif a == SEG_MAP:
            reserved += size
        elif a == SEG_UNMAP:
            reserved -= size
        elif a == OOM:
            ooms.append(i)
            cap = case.get("cap_bytes")
            if cap and reserved + _rounded(size) <= cap:
                bad.append(f"event {i}: out of memory asking {size} B with {reserved} of {cap} reserved")
        for m in open_windows.values():
            m[0] = max(m[0], reserved)
            m[1] = max(m[1], lo)
            m[2] = max(m[2], hi)
        if reserved < 0 or lo < 0:
            bad.append(f"event {i}: negative running sums")
            break
    boundary(n)
    if open_windows:
        bad.append(f"phases past the trace: {sorted(open_windows)}")
    if [o["event"] for o in case["oom_events"]] != ooms:
        bad.append("oom_events do not list the trace's oom events")
    if bool(case["oom"]) != bool(ooms) or bool(case["oom"]) != (phases[-1]["name"] == "oom"):
        bad.append(f"oom {case['oom']}, {len(ooms)} oom events, last phase {phases[-1]['name']}")
    if case.get("cap_bytes") and not case["oom"]:
        over = [p["name"] for p in phases if p["max_reserved"] > case["cap_bytes"]]
        if over:
            bad.append(f"reserved over the cap in {over} without running out of memory")
    if phases[-1]["segments"] != case["final_segments"] and not case["oom"]:
        bad.append("the final segments differ from the last phase's")
    return bad


def _check_segments(phase: dict, seg_events: set, live_events: set, bad: list) -> None:
    """The phase's segments against its figures and against what the events say is live."""
    segs = phase["segments"]
    if sum(s["size"] for s in segs) != phase["reserved"]:
        bad.append(f"{phase['name']}: segments sum to {sum(s['size'] for s in segs)}, reserved {phase['reserved']}")
    blocks = [b for s in segs for b in s["blocks"]]
    allocated = [b for b in blocks if b[2] == STATES.index("active_allocated")]
    if sum(b[1] for b in allocated) != phase["allocated"]:
        bad.append(f"{phase['name']}: allocated blocks sum to {sum(b[1] for b in allocated)}, "
                   f"allocated {phase['allocated']}")
    if {(b[0], b[3]) for b in allocated} != live_events or len(allocated) != len(live_events):
        bad.append(f"{phase['name']}: the allocated blocks are not the events' live allocations "
                   f"({len(allocated)} against {len(live_events)})")
    plain = {(s["addr"], s["size"]) for s in segs if not s["expandable"]}
    if plain and not plain <= seg_events:
        bad.append(f"{phase['name']}: segments the events did not allocate")
    for s in segs:
        pos = s["addr"]
        for b in sorted(s["blocks"]):
            if b[0] != pos or b[1] <= 0 or (b[2] and b[3] > b[1]):
                bad.append(f"{phase['name']}: a segment's blocks do not tile it")
                break
            pos += b[1]
        else:
            if pos != s["addr"] + s["size"]:
                bad.append(f"{phase['name']}: a segment's blocks cover {pos - s['addr']} of {s['size']}")


# --------------------------------------------------------------------------
# a toy allocator: a case that holds together by construction (the checks are tried on it with no GPU)
# --------------------------------------------------------------------------
class _Toy:
    """One segment per allocation (2 MiB for the small pool, the rounded size for the large one), freed
    with it; the trace, figures and segment lists in the form ``_snapshot()`` and ``torch.cuda`` give them."""

    def __init__(self, cap: int | None = None):
        self.cap, self.trace, self.phases, self.raw = cap, [], [], []
        self.segs: dict[int, dict] = {}
        self.next = 1 << 40
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0

    def _peaks(self) -> None:
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_reserved = max(self.max_reserved, self.reserved)

    def malloc(self, size: int) -> int:
        r = _rounded(size)
        seg = 2 * MiB if r <= MiB else r
        if self.cap and self.reserved + seg > self.cap:
            self.trace.append(dict(action="oom", size=size, device_free=0, stream=0))
            raise MemoryError(size)
        addr, self.next = self.next, self.next + seg + 2 * MiB
        blocks = [dict(address=addr, size=r, state="active_allocated", requested_size=size)]
        if seg > r:
            blocks.append(dict(address=addr + r, size=seg - r, state="inactive", requested_size=0))
        self.segs[addr] = dict(address=addr, total_size=seg, stream=0, segment_type="small" if r <= MiB else "large",
                               allocated_size=r, active_size=r, blocks=blocks)
        self.trace += [dict(action="segment_alloc", addr=addr, size=seg, stream=0),
                       dict(action="alloc", addr=addr, size=size, stream=0)]
        self.reserved += seg
        self.allocated += r
        self._peaks()
        return addr

    def free(self, addr: int) -> None:
        seg = self.segs.pop(addr)
        size = seg["blocks"][0]["requested_size"]
        self.trace += [dict(action="free_requested", addr=addr, size=size, stream=0),
                       dict(action="free_completed", addr=addr, size=size, stream=0),
                       dict(action="segment_free", addr=addr, size=seg["total_size"], stream=0)]
        self.allocated -= seg["allocated_size"]
        self.reserved -= seg["total_size"]

    def phase(self, name: str, reset_after: bool = False) -> None:
        self.trace.append(dict(action="snapshot", addr=0, size=self.allocated, stream=0))
        self.phases.append(dict(name=name, event=len(self.trace), allocated=self.allocated, reserved=self.reserved,
                                max_allocated=self.max_allocated, max_reserved=self.max_reserved, stats={}))
        self.raw.append(copy.deepcopy(list(self.segs.values())))
        if reset_after:
            self.max_allocated, self.max_reserved = self.allocated, self.reserved

    def case(self, oom) -> dict:
        return dict(name="toy", cap_bytes=self.cap, oom=oom,
                    **compact_case(self.trace, self.phases, self.raw, list(self.segs.values())))


def _toy_case(activations: int = 4, cap: int | None = None) -> dict:
    """Parameters, then two steps: activations of 3 MiB and 100 B each, freed in the backward, and the
    optimizer's state made in the first."""
    toy = _Toy(cap)
    toy.phase("start")
    params = [toy.malloc(s) for s in (5 * MiB + 3, 700, 40 * MiB)]
    toy.phase("model", reset_after=True)
    state: list[int] = []
    oom = None
    for step in ("step1", "step2"):
        try:
            acts = [toy.malloc(3 * MiB if i % 2 else 100) for i in range(activations)]
            grads = [toy.malloc(s) for s in (5 * MiB + 3, 700, 40 * MiB)]
            for a in reversed(acts):
                toy.free(a)
            if not state:
                state = [toy.malloc(s) for s in (5 * MiB + 3, 700, 40 * MiB) * 2]
            for g in grads:
                toy.free(g)
        except MemoryError:
            oom = dict(phase=step)
            toy.phase("oom")
            break
        toy.phase(step, reset_after=True)
    assert params
    return toy.case(oom)


# --------------------------------------------------------------------------
# the recorded files
# --------------------------------------------------------------------------
@functools.cache
def _files() -> dict:
    return {path.name: load(path) for path in trace_files()}


def _recorded() -> list[dict]:
    return [case for data in _files().values() for case in data["cases"]]


NO_TRACES = "no traces recorded yet in benchmarks/data/cuda_alloc (README.md there says how, on a GPU)"


def test_the_checks_pass_on_a_toy_allocator_and_fail_when_it_is_broken():
    for case in (_toy_case(), _toy_case(activations=9)):
        assert check_case(case) == []
        _assert_breaks(case)


def test_an_oom_on_the_toy_allocator_must_have_run_out():
    case = _toy_case(activations=9, cap=120 * MiB)
    assert case["oom"] and case["oom_events"] and check_case(case) == []
    case["cap_bytes"] *= 4  # it could not have run out under a cap this large
    assert any("out of memory asking" in p for p in check_case(case))


def test_the_traces_say_where_they_came_from():
    if not _files():
        pytest.skip(NO_TRACES)
    assert {"gpt.json.gz", "resnet50.json.gz", "llama.json.gz"} <= set(_files())
    for data in _files().values():
        assert data["actions"] == list(ACTIONS) and data["states"] == list(STATES)
        for case in data["cases"]:
            assert case["device_name"] and case["torch"] and case["cuda"] and case["total_memory"] > 0
            assert case["allocator"] in ("default", "expandable")
            assert (case["alloc_conf"] == "expandable_segments:True") == (case["allocator"] == "expandable")
    cases = _recorded()
    assert any(c["oom"] for c in cases) and any(c.get("cap_bytes") and not c["oom"] for c in cases)


def test_every_recorded_case_holds_together():
    if not _files():
        pytest.skip(NO_TRACES)
    for case in _recorded():
        assert check_case(case) == [], case["name"]


def test_the_checks_fail_on_a_broken_recorded_trace():
    cases = [c for c in _recorded() if not c["oom"] and len(c["phases"]) >= 4]
    if not cases:
        pytest.skip(NO_TRACES)
    _assert_breaks(cases[0])
    ooms = [c for c in _recorded() if c["oom"] and c.get("cap_bytes")]
    if ooms:
        case = copy.deepcopy(ooms[0])
        case["cap_bytes"] *= 4
        assert any("out of memory asking" in p for p in check_case(case))


def _assert_breaks(original: dict) -> None:
    """Each way of breaking the case is caught."""
    case = copy.deepcopy(original)
    ev = case["events"]
    ev["size"][ev["action"].index(FREE_REQ)] += 512  # a free of another size than its allocation
    assert any("matches no live allocation" in p for p in check_case(case))

    case = copy.deepcopy(original)
    case["events"]["size"][case["events"]["action"].index(SEG_ALLOC)] += 2 * MiB  # a segment of another size
    assert any("reserved" in p for p in check_case(case))

    case = copy.deepcopy(original)
    last = case["phases"][-1]
    last["max_allocated"] = last["max_reserved"] + 64 * MiB  # a peak the events cannot reach, over reserved
    assert any("max allocated" in p for p in check_case(case))

    case = copy.deepcopy(original)
    case["phases"][-2]["max_reserved"] -= 1
    assert any("peak at" in p for p in check_case(case))

    case = copy.deepcopy(original)
    ev = case["events"]
    i = ev["action"].index(ALLOC)
    for c in ("action", "id", "size", "stream", "addr"):  # an allocation lost from the trace
        del ev[c][i]
    case["n_events"] -= 1
    assert check_case(case)

    case = copy.deepcopy(original)
    seg = next(s for p in case["phases"] for s in p["segments"] if len(s["blocks"]) > 1)
    seg["blocks"][1][1] += 512  # a block past its neighbour
    assert any("tile" in p or "cover" in p or "segments sum" in p for p in check_case(case))


def test_compactor_numbers_allocations_segments_and_streams():
    base = 1 << 40
    trace = [
        dict(action="segment_alloc", addr=base, size=2 * MiB, stream=7),
        dict(action="alloc", addr=base, size=100, stream=7),
        dict(action="alloc", addr=base + 512, size=1000, stream=7),
        dict(action="free_requested", addr=base, size=100, stream=7),
        dict(action="free_completed", addr=base, size=100, stream=7),
        dict(action="alloc", addr=base, size=512, stream=9),
        dict(action="oom", device_free=123, size=1 << 34, stream=9),
        dict(action="segment_free", addr=base, size=2 * MiB, stream=7),
    ]
    comp = Compactor(base)
    cols, ooms = comp.events(trace)
    assert cols["action"] == [3, 0, 0, 1, 2, 0, 8, 4]
    assert cols["id"] == [0, 0, 1, 0, 0, 2, -1, 0]
    assert cols["addr"] == [0, 0, 512, 0, 0, 0, -1, 0]
    assert cols["stream"] == [0, 0, 0, 0, 0, 1, 1, 0]
    assert ooms == [dict(event=6, size=1 << 34, device_free=123)]
    segs = comp.segments([dict(address=base, total_size=2 * MiB, stream=7, segment_type="small",
                               allocated_size=1024, active_size=1024, blocks=[
                                   dict(address=base, size=512, state="inactive", requested_size=100),
                                   dict(address=base + 512, size=1024, state="active_allocated", requested_size=1000),
                                   dict(address=base + 1536, size=2 * MiB - 1536, state="inactive")])])
    assert segs[0]["addr"] == 0 and segs[0]["pool"] == "small" and segs[0]["stream"] == 0
    assert segs[0]["blocks"][1] == [512, 1024, 1, 1000]
