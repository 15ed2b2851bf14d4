"""Where the batches ``max_batch`` answers really stop fitting on a GPU, and why.

``gpu_accuracy.py`` runs ``max_batch(model, x, "8GiB", optimizer="adam")`` on CUDA and then
trains at each answer under ``torch.cuda.set_per_process_memory_fraction`` (the cap): fits or
out of memory. This script takes those answers (``--answers``: its JSON) and, for each model,
strategy (no checkpointing, the optimal plan) and allocator setting (the default, and
``expandable_segments:True``), in a fresh process, trains two Adam steps at batches around the
answer under the same cap: down from the answer until one fits when it did not, up from it
until one does not when it did (``--step`` apart, at most ``--tries`` batches). Each batch
records fits or not and, when it fits, ``max_memory_allocated`` and ``max_memory_reserved``:
the allocator's real overhead (reserved over allocated) at the largest batch that fits, which
is what the headroom's ``fraction`` must cover.

    python -m benchmarks.gpu_max_batch --answers benchmarks/results/gpu_accuracy/latest-h200-max-batch.json
    python -m benchmarks.gpu_max_batch --device cpu --answers ... --tries 2   # CPU smoke run (no cap)

Writes ``benchmarks/results/gpu_max_batch/latest-<device>.json`` (``-keep-output`` added with
``--keep-output``; ``<device>`` as :func:`benchmarks.harness.device_label` names it, e.g. ``h200``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.harness import (child_args, child_env, child_record, device_label, result_path, run_child,
                                run_metadata, write_json)

STRATEGIES = {"no_checkpointing": "none", "optimal": "optimal"}
ALLOCATORS = {"default": None, "expandable": "expandable_segments:True"}


def _step(module, x, loss, opt, keep_output: bool = False, kept: list | None = None) -> None:
    from benchmarks import gpu_accuracy

    opt.zero_grad(set_to_none=True)
    if keep_output:  # out = model(x); loss(out).backward(): kept to the next step's forward
        kept[:] = [module(*x) if isinstance(x, tuple) else module(**x)]
        (loss(kept[0]) if loss else kept[0].loss).backward()
    else:
        gpu_accuracy._loss_of(module, x, loss).backward()  # the output dies with the loss, as modelled
    opt.step()


def run_case(model_name: str, strategy: str, memory_bytes: int, batch: int, cps, st, step: int, tries: int,
             device: str, keep_output: bool = False) -> dict:
    import torch

    from benchmarks import gpu_accuracy
    from ckptopt import apply_plan, trace
    from ckptopt.planning import with_batch

    spec, kw = {**gpu_accuracy.SMALL_MAX_BATCH, **gpu_accuracy.MAX_BATCH}[model_name]
    model, inputs, loss = gpu_accuracy._load(spec, kw, device)
    cuda = device.startswith("cuda")
    module = model
    if cps:  # the rewritten module runs at any batch: traced once, at the answer
        tm = trace(model, with_batch(inputs, batch, kw["batch_size"]), loss_fn=loss)
        module = apply_plan(model, tm, gpu_accuracy._plan(tm.n, cps, st))
    if cuda:
        gpu_accuracy.cap_memory(device, memory_bytes)
    rows, b, direction = [], batch, 0
    for _ in range(tries):
        x = with_batch(inputs, b, kw["batch_size"])
        opt = torch.optim.Adam(module.parameters(), lr=1e-4)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            kept: list = []
            for _ in range(2):
                _step(module, x, loss, opt, keep_output, kept)
            del kept
            row = dict(batch=b, fits=True)
            if cuda:
                torch.cuda.synchronize()
                row.update(allocated=int(torch.cuda.max_memory_allocated()),
                           reserved=int(torch.cuda.max_memory_reserved()))
        except torch.OutOfMemoryError as exc:
            row = dict(batch=b, fits=False, error=str(exc).splitlines()[0][:160])
        del opt, x
        module.zero_grad(set_to_none=True)
        rows.append(row)
        if direction == 0:
            direction = 1 if row["fits"] else -1
        elif (direction == 1) != row["fits"]:
            break  # crossed the border
        b += direction * step
        if b < 1:
            break
    fits = [r for r in rows if r["fits"]]
    best = max(fits, key=lambda r: r["batch"]) if fits else None
    out = dict(rows=rows, largest_fitting=best["batch"] if best else None)
    if best and "allocated" in best:
        out["overhead_at_largest"] = best["reserved"] / best["allocated"] - 1
    return out


def _child(payload: dict, timeout: float) -> dict:
    """One case in a fresh process (``src/`` first on the path, the case's allocator setting)."""
    extra = {"PYTORCH_CUDA_ALLOC_CONF": payload["alloc_conf"]} if payload["alloc_conf"] else {}
    child = run_child("benchmarks.gpu_max_batch", [json.dumps(payload)], timeout=timeout,
                      env=child_env(threads="?2", src_first=True, **extra))
    if child.record is None:
        return dict(error=child.failure if child.returncode is None else
                    (child.output.strip().splitlines() or ["no output"])[-1])
    return child.record


def _run_child(p: dict) -> dict:
    return run_case(p["model"], p["strategy"], p["memory_bytes"], p["batch"], p["checkpoints"], p["stored"],
                    p["step"], p["tries"], p["device"], p.get("keep_output", False))


def main() -> None:
    child = child_args()
    if child:
        path, (payload,) = child
        child_record(path, _run_child, json.loads(payload))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", required=True, help="a gpu_accuracy.py JSON with max_batch results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--step", type=float, default=0.02, help="batches tried apart, a share of the answer (0.02)")
    ap.add_argument("--tries", type=int, default=8)
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--keep-output", action="store_true",
                    help="train a loop that keeps the model's output (for answers of gpu_accuracy.py --keep-output)")
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--out", help="default benchmarks/results/gpu_max_batch/latest-<device>[-keep-output].json")
    args = ap.parse_args()
    args.out = args.out or result_path("gpu_max_batch",
                                       device_label(args.device) + ("-keep-output" if args.keep_output else ""))

    answers = json.load(open(args.answers))["max_batch"]
    todo = []
    for model_name, entry in answers.items():
        res = entry["search"]["result"]
        for strategy, key in STRATEGIES.items():
            fit = res[strategy]
            for alloc in args.allocators.split(","):
                todo.append(dict(model=model_name, strategy=strategy, memory_bytes=res["memory_bytes"],
                                 batch=fit["batch"], predicted=fit["peak_bytes"], checkpoints=fit["checkpoints"],
                                 stored=fit["stored"], step=max(1, round(args.step * fit["batch"])),
                                 tries=args.tries, device=args.device, allocator=alloc, keep_output=args.keep_output,
                                 alloc_conf=ALLOCATORS[alloc]))
    meta = run_metadata("gpu_max_batch", args.device)
    meta["answers"] = args.answers
    results: list = []
    lock = threading.Lock()

    def one(p):
        t0 = time.perf_counter()
        rec = dict({k: p[k] for k in ("model", "strategy", "allocator", "batch", "predicted", "memory_bytes")},
                   **_child(p, args.timeout), seconds=round(time.perf_counter() - t0, 1))
        with lock:
            results.append(rec)
            print(json.dumps({k: rec.get(k) for k in ("model", "strategy", "allocator", "batch", "largest_fitting",
                                                      "overhead_at_largest", "error")}), flush=True)
            write_json(args.out, dict(meta=meta, cases=results))

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, todo))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
