"""The caching-allocator replay against the allocator histories recorded on a GPU.

    python -m benchmarks.allocator_replay       # -> benchmarks/results/allocator_replay/latest.json
    python -m benchmarks.allocator_replay --no-synthesized --no-max-batch   # the recorded allocations alone

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

``synthesized``: each case against the replay of its allocations built without the device, as
``max_batch`` on CUDA builds them (:func:`ckptopt.planning.reserved.step_events`: the model built on the
CPU at the case's batch, its plan applied to a fake copy, Adam's foreach step). ``max_batch_8gib``:
``max_batch(..., device="cuda")``'s answers under 8 GiB for the models ``gpu_max_batch.py`` trains, planned
here, for a GPU session to check.
"""

from __future__ import annotations

import argparse
import time

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


def case_step_events(model_name: str, case: dict, cache: dict | None = None):
    """The allocations of a recorded case's loop built without the device
    (:func:`ckptopt.planning.reserved.step_events`): the model built on the CPU at the case's batch, its
    plan applied to a fake copy, Adam's foreach step; cached per (model, batch, plan)."""
    from benchmarks import gpu_accuracy
    from benchmarks.cuda_alloc_traces import MODELS
    from ckptopt import apply_plan, trace
    from ckptopt.planning.reserved import step_events
    from ckptopt.torch_utils import normalize_inputs

    key = (model_name, case["batch"], tuple(case["plan"]["checkpoints"]), tuple(case["plan"]["stored"]))
    if cache is not None and key in cache:
        return cache[key]
    spec, kw = MODELS[model_name]
    model, x, loss = gpu_accuracy._load(spec, dict(kw, batch_size=case["batch"]), "cpu")
    build = None
    if case["plan_kind"] != "none":
        tm = trace(model, x, loss_fn=loss)
        plan = gpu_accuracy._plan(tm.n, case["plan"]["checkpoints"], case["plan"]["stored"])
        build = lambda fm: apply_plan(fm, tm, plan)  # noqa: E731
    events = step_events(model, normalize_inputs(x), loss, build, "adam", "foreach")
    if cache is not None:
        cache[key] = events
    return events


def synthesized_case(case: dict, steps) -> dict:
    """A recorded case against the replay of its loop's allocations built without the device (``steps``,
    :class:`ckptopt.planning.reserved.StepEvents`): per step, the replay's peak reserved against the
    recorded one (the peak reset before each step, as recorded), and whether the replay runs out of
    memory where the device did (in which step)."""
    from ckptopt.simulator.allocator import CachingAllocator, ExpandableAllocator

    expandable = case["allocator"] == "expandable"
    alloc = (ExpandableAllocator if expandable else CachingAllocator)(case.get("cap_bytes"))
    recorded = {p["name"]: p for p in case["phases"]}
    bounds = [i for _, i in steps.phases[1:]] + [len(steps.events)]
    for what, key, size in steps.events[:bounds[0]]:  # the model and its batch (fit in every case)
        alloc.malloc(key, size)
    out, failed_in = [], None
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        name = f"step{k + 1}"
        alloc.reset_peak()
        for what, key, size in steps.events[lo:hi]:
            if what == "free":
                alloc.free(key)
            elif not alloc.malloc(key, size):
                failed_in = name
                break
        rec = recorded.get(name) or (recorded.get("oom") if (case.get("oom") or {}).get("phase") == name else None)
        if rec is not None:
            out.append(dict(phase=name, max_reserved=alloc.max_reserved, recorded_max_reserved=rec["max_reserved"],
                            max_allocated=alloc.max_allocated, recorded_max_allocated=rec["max_allocated"]))
        if failed_in:
            break
    device_failed_in = (case.get("oom") or {}).get("phase")
    ev = case["events"]
    largest = max(s for a, s in zip(ev["action"], ev["size"]) if a in (3, 5))  # segment_alloc, segment_map
    return dict(name=case["name"], allocator=case["allocator"], capacity=case.get("cap_bytes"), steps=out,
                replay_failed_in=failed_in, device_failed_in=device_failed_in,
                fits_answer_right=failed_in == device_failed_in, largest_segment=largest, unsupported=steps.unsupported,
                max_abs_peak_error=max([abs(p["max_reserved"] - p["recorded_max_reserved"]) for p in out] or [0]))


def synthesize_all(files=None) -> list[dict]:
    """Every recorded case against the replay of its allocations built without the device."""
    rows, cache = [], {}
    for path in files or trace_files():
        data = load(path)
        assert data["actions"][3] == "segment_alloc" and data["actions"][5] == "segment_map"
        model_name = path.name.split(".")[0]
        for case in data["cases"]:
            t0 = time.perf_counter()
            steps = case_step_events(model_name, case, cache)
            row = synthesized_case(case, steps)
            rows.append(dict(row, torch=case["torch"], device=case["device_name"],
                             seconds=round(time.perf_counter() - t0, 1)))
            print(f"  {row['name']}: " + ", ".join(f"{p['phase']} {p['max_reserved'] >> 20} MiB (recorded "
                                                  f"{p['recorded_max_reserved'] >> 20})" for p in row["steps"])
                  + f"; out of memory in {row['replay_failed_in']} (device: {row['device_failed_in']})"
                  + (f"; {row['unsupported']}" if row["unsupported"] else ""), flush=True)
    return rows


def max_batch_answers(memory: str = "8GiB") -> dict:
    """``max_batch(..., device="cuda")`` planned on this machine for the models of ``gpu_max_batch.py``
    (``gpu_accuracy.MAX_BATCH``) under ``memory``: each answer, how it was fitted (the replay, or the
    headroom share and why), and the seconds it took. A GPU session trains them
    (``benchmarks/gpu_max_batch.py``)."""
    from benchmarks import gpu_accuracy
    from ckptopt.planning import max_batch

    out = {}
    for name, (spec, kw) in gpu_accuracy.MAX_BATCH.items():
        model, x, loss = gpu_accuracy._load(spec, kw, "cpu")
        t0 = time.perf_counter()
        mb = max_batch(model, x, memory, optimizer="adam", device="cuda", loss_fn=loss)
        out[name] = dict(result=mb.to_dict(), seconds=round(time.perf_counter() - t0, 1))
        fits = [(f.strategy, f.batch, f.reserved_bytes) for f in (mb.no_checkpointing, mb.optimal)]
        print(f"  {name}: {fits}, fitted by {mb.fitted_by}" + (f" ({mb.replay_note})" if mb.replay_note else ""),
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-synthesized", action="store_true", help="leave out the replays of sequences built "
                    "without the device (a few minutes: each case's model is built and stepped on fake tensors)")
    ap.add_argument("--no-max-batch", action="store_true", help="leave out max_batch's answers on CUDA under "
                    "8 GiB, planned here (a minute or two a model)")
    args = ap.parse_args(argv)
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
    if not args.no_synthesized:
        rows = synthesize_all()
        result["synthesized"] = rows
        ok = [r for r in rows if not r["unsupported"]]
        within = sum(r["max_abs_peak_error"] <= r["largest_segment"] for r in ok)
        right = sum(r["fits_answer_right"] for r in ok)
        print(f"synthesized: {len(rows)} cases, {len(ok)} the replay takes (no convolution): peak reserved within "
              f"one segment in {within}, fits/out-of-memory answer right in {right}")
    if not args.no_max_batch:
        result["max_batch_8gib"] = max_batch_answers()
    path = result_path("allocator_replay")
    write_json(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
