"""Will it fit? One rank of Llama-3-8B and -70B shapes under FSDP2 and DDP, planned without weights.

For each shape (bf16, AdamW, CUDA's foreach step, the assumed CUDA headroom: 70 MB workspace
+ 10%), the model is built on the meta device and traced once per (batch, sequence); each world
size then prices one rank from the same trace (``ckptopt.planning.Parallel``; FSDP2:
``fully_shard`` on each decoder layer and the root, rank 0, which holds the most optimizer state).
Then the largest per-rank batch at sequence 4096 on 24, 40 and 80 GB GPUs (``max_batch``'s search,
each answer b and b+1 confirmed by a trace).

    python -m benchmarks.ranks_table [--models llama3-8b,llama3-70b] [--worlds 1,2,4,8,64] [--mixed-precision bf16]

writes benchmarks/results/ranks_table/latest.json (``latest-mixed.json`` with ``--mixed-precision``) and
prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.full_size import SHAPES
from benchmarks.harness import result_path, run_metadata, write_json

GiB = 2**30


MIXED = None  # --mixed-precision bf16: fp32 weights, FSDP2's MixedPrecisionPolicy(bf16, fp32 reduce)


def build(name: str, batch: int, seq: int):
    from ckptopt._models import load_model

    cls, cfg = SHAPES[name]
    model, inputs = load_model(f"hf:{cls}", batch, seq, "fp32" if MIXED else "bf16", config=cfg, meta=True)
    return model.train(), inputs


def parallel(world: int, strategy: str):
    from ckptopt.planning import Parallel

    if MIXED:  # (one GPU too: FSDP2 on one rank, for its mixed precision)
        return Parallel(world, "fsdp", mixed_precision=MIXED)
    return None if world == 1 else Parallel(world, strategy)


def peaks(name: str, batch: int, seq: int, worlds, strategies) -> list[dict]:
    """Every (strategy, world) from one trace of the local batch."""
    from ckptopt.planning import default_headroom
    from ckptopt.planning.estimate import optimal_plan, peak_estimate
    from ckptopt.planning.optimizer import optimizer_memory
    from ckptopt.planning.ranks import rank_costs
    from ckptopt.planning.param_facts import param_facts, rank_trace, repeated_blocks
    from ckptopt.torch_utils import normalize_inputs

    model, inputs = build(name, batch, seq)
    t = time.perf_counter()
    tm = rank_trace(model, normalize_inputs(inputs), parallel(2, strategies[0]), leaf_modules=repeated_blocks(model))
    traced_s = time.perf_counter() - t
    facts = param_facts(model, tm, parallel=parallel(2, strategies[0]))
    hr = default_headroom("cuda")
    rows = []
    for strategy in strategies:
        for world in worlds:
            if world == 1 and strategy != strategies[0]:
                continue
            par = parallel(world, strategy)
            t = time.perf_counter()
            rc = rank_costs(tm.costs, facts, tm.param_bytes, par)
            opt = optimizer_memory(rc.sizes, "adamw", None, "cuda")
            none = peak_estimate(rc, (), opt, "no checkpointing")
            best = peak_estimate(rc, optimal_plan(rc, opt), opt, "optimal plan")
            rows.append(dict(model=name, batch=batch, seq=seq, strategy=strategy if par and world > 1 else "single",
                             world=world, mixed_precision=MIXED,
                             layers=tm.n, none_bytes=none.peak_bytes, none_needed=hr.needed(none.peak_bytes),
                             optimal_bytes=best.peak_bytes, optimal_needed=hr.needed(best.peak_bytes),
                             optimal_at=best.at, recompute_share=best.recompute_share,
                             trace_s=round(traced_s, 1), plan_s=round(time.perf_counter() - t, 2)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def largest(name: str, seq: int, worlds, memories) -> list[dict]:
    """The largest per-rank batch under FSDP2 (and one process) on each memory size."""
    from ckptopt.planning import Headroom, Parallel, default_headroom
    from ckptopt.planning.batch import BatchCosts, optimizer_for, search_batch

    model, inputs = build(name, 1, seq)
    base = BatchCosts(model, inputs, parallel=Parallel(2, "fsdp", mixed_precision=MIXED))
    hr = default_headroom("cuda")
    rows = []
    for world in worlds:
        bc = base.for_parallel(parallel(world, "fsdp"))
        opt = optimizer_for(bc, "adamw", None, "cuda")
        for gb in memories:
            usable = hr.usable(gb * 10**9)
            t = time.perf_counter()
            none = search_batch(bc, "none", usable, opt)
            best = search_batch(bc, "optimal", usable, opt)
            rows.append(dict(model=name, seq=seq, world=world, strategy="fsdp" if world > 1 else "single",
                             memory_gb=gb, none_batch=none.batch, optimal_batch=best.batch,
                             optimal_peak=best.peak_bytes, recompute_share=best.recompute_share,
                             traces=bc.traces, seconds=round(time.perf_counter() - t, 1)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(paths) -> str:
    """The README's tables from one or more result files."""
    rows, fits = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        fits += data["max_batch"]
    gib = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    out = ["Per-GPU peak, GiB (needed with the assumed CUDA headroom in parentheses); no checkpointing / "
           "ckptopt's plan:", "",
           "| model | batch x seq | strategy | 1 GPU | 2 | 4 | 8 | 64 |", "|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["batch"], r["seq"]) for r in rows}, key=lambda k: (k[0], k[2], k[1]))
    for model, batch, seq in keys:
        one = next((r for r in rows if (r["model"], r["batch"], r["seq"], r["world"]) == (model, batch, seq, 1)), None)
        for strategy in [s for s in ("fsdp", "ddp") if any(r["strategy"] == s for r in rows)]:
            cells = []
            for world in (1, 2, 4, 8, 64):
                r = one if world == 1 else next((r for r in rows if (r["model"], r["batch"], r["seq"], r["strategy"],
                                                                      r["world"]) == (model, batch, seq, strategy,
                                                                                       world)), None)
                cells.append("-" if r is None else
                             f"{gib(r['none_bytes'])} / **{gib(r['optimal_bytes'])}** ({gib(r['optimal_needed'])})")
            out.append(f"| {model} | {batch} x {seq} | {strategy} | " + " | ".join(cells) + " |")
    if fits:
        out += ["", "Largest per-rank batch at sequence 4096 under FSDP2 (no checkpointing / ckptopt's plan), "
                "headroom kept:", "", "| model | ranks | 24 GB | 40 GB | 80 GB |", "|---|---|---|---|---|"]
        for model, world in sorted({(f["model"], f["world"]) for f in fits}):
            cells = []
            for gb in (24, 40, 80):
                f = next((f for f in fits if (f["model"], f["world"], f["memory_gb"]) == (model, world, gb)), None)
                cells.append("-" if f is None else f"{f['none_batch']} / **{f['optimal_batch']}**")
            out.append(f"| {model} | {world} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--worlds", default="1,2,4,8,64")
    ap.add_argument("--cases", default="1x4096,4x4096,1x8192", help="per-rank batch x sequence")
    ap.add_argument("--memories", default="24,40,80", help="GPU memory sizes, GB")
    ap.add_argument("--no-max-batch", action="store_true")
    ap.add_argument("--max-batch-seq", default=4096, type=int)
    ap.add_argument("--max-batch-worlds", default="1,8,64")
    ap.add_argument("--out", help="default benchmarks/results/ranks_table/latest.json (latest-mixed.json with "
                    "--mixed-precision)")
    ap.add_argument("--markdown", nargs="+", metavar="JSON", help="print the tables of these result files and stop")
    ap.add_argument("--mixed-precision", choices=("bf16",), default=None,
                    help="fp32 weights and AdamW state, FSDP2 gathering and computing in bf16 (FSDP2 rows only; "
                         "one GPU: FSDP2 on one rank)")
    args = ap.parse_args(argv)
    global MIXED
    MIXED = args.mixed_precision
    args.out = args.out or result_path("ranks_table", "mixed" if MIXED else None)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    rows, fits = [], []
    for name in args.models.split(","):
        for case in args.cases.split(","):
            b, s = (int(v) for v in case.split("x"))
            rows += peaks(name, b, s, worlds, ["fsdp"] if MIXED else ["fsdp", "ddp"])
        if not args.no_max_batch:
            fits += largest(name, int(args.max_batch_seq), [int(w) for w in args.max_batch_worlds.split(",")], [int(m) for m in args.memories.split(",")])
    write_json(args.out, dict(meta=run_metadata("ranks_table"), rows=rows, max_batch=fits))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
