"""The caching-allocator replay against the allocator histories recorded on a GPU.

    python -m benchmarks.allocator_replay       # -> benchmarks/results/allocator_replay/latest.json

Each recorded case (``benchmarks/data/cuda_alloc/*.json.gz``, README there) is the whole life of one
process's CUDA allocator: the model built, planned, two Adam steps. Its allocations and frees
(requested sizes, in order) are replayed through :class:`ckptopt.simulator.allocator.CachingAllocator`
(:class:`~ckptopt.simulator.allocator.ExpandableAllocator` for the cases run with expandable segments)
from an empty state, with the case's capacity (``set_per_process_memory_fraction``), twice: once
placing new segments at the addresses the device gave them (a check of the rules alone: the allocator
breaks ties between equal free blocks by address), once placing them as the replay does without a
device (the lowest gap that holds them). At each phase's snapshot the replay's reserved bytes and their
peak since the phase's reset are compared with ``memory_reserved``/``max_memory_reserved``; a case that
ran out of memory must fail in the replay at the same request, and one that fit must not fail.
(Addresses do not matter with expandable segments: one segment per pool.)
"""

from __future__ import annotations

import argparse

from benchmarks.cuda_alloc_traces import load, trace_files
from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt.simulator.allocator import CachingAllocator, ExpandableAllocator

#: phases whose peaks were reset before them
RESET_BEFORE = ("step1", "step2", "oom")


def replay_case(case: dict, actions: list[str], recorded_addresses: bool) -> dict:
    """One case replayed: per phase, the replay's reserved and peak reserved minus the recorded ones;
    where the replay failed (event index) against where the device did."""
    ev = case["events"]
    kinds = [actions[a] for a in ev["action"]]
    expandable = case["allocator"] == "expandable"
    alloc = (ExpandableAllocator if expandable else CachingAllocator)(case.get("cap_bytes"))
    if recorded_addresses and not expandable:  # (expandable: one segment per pool, addresses do not matter)
        alloc.addresses = [ad for k, ad in zip(kinds, ev["addr"]) if k == "segment_alloc"]
    phases, out, k, failed_at = case["phases"], [], 0, None
    for i, (kind, key, size) in enumerate(zip(kinds, ev["id"], ev["size"])):
        if kind == "alloc":
            if not alloc.malloc(key, size):
                failed_at = i
                break
        elif kind == "free_completed":
            alloc.free(key)
        elif kind == "oom":  # the request the device refused: the replay must refuse it too
            if not alloc.malloc(("oom", i), size):
                failed_at = i
            break
        elif kind == "snapshot" and k < len(phases):
            p = phases[k]
            out.append(dict(phase=p["name"], reserved=alloc.reserved, recorded_reserved=p["reserved"],
                            max_reserved=alloc.max_reserved, recorded_max_reserved=p["max_reserved"]))
            k += 1
            if k < len(phases) and phases[k]["name"] in RESET_BEFORE:
                alloc.reset_peak()
    device_failed = next((i for i, kind in enumerate(kinds) if kind == "oom"), None)
    largest = max([s for kind, s in zip(kinds, ev["size"]) if kind in ("segment_alloc", "segment_map")] or [0])
    return dict(name=case["name"], allocator=case["allocator"], capacity=case.get("cap_bytes"), phases=out,
                replay_failed_at=failed_at,
                device_failed_at=device_failed, fits_answer_right=failed_at == device_failed,
                largest_segment=largest,
                max_abs_peak_error=max([abs(p["max_reserved"] - p["recorded_max_reserved"]) for p in out] or [0]))


def replay_all(recorded_addresses: bool, files=None) -> list[dict]:
    """Every recorded case replayed (expandable-segment cases with :class:`ExpandableAllocator`)."""
    rows = []
    for path in files or trace_files():
        data = load(path)
        for case in data["cases"]:
            rows.append(dict(replay_case(case, data["actions"], recorded_addresses), torch=case["torch"],
                             device=case["device_name"]))
    return rows


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    result = dict(meta=run_metadata("allocator_replay"))
    for label, addresses in (("recorded_addresses", True), ("replay_addresses", False)):
        rows = replay_all(addresses)
        result[label] = rows
        phases = [p for r in rows for p in r["phases"]]
        exact = sum(p["max_reserved"] == p["recorded_max_reserved"] and p["reserved"] == p["recorded_reserved"]
                    for p in phases)
        within = sum(r["max_abs_peak_error"] <= r["largest_segment"] for r in rows)
        right = sum(r["fits_answer_right"] for r in rows)
        print(f"{label}: {len(rows)} cases, {len(phases)} phases: {exact} exact; peak reserved within one "
              f"segment in {within} cases; fits/out-of-memory answer right in {right}")
    path = result_path("allocator_replay")
    write_json(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
