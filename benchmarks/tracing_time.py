"""Wall time and memory of ``ckptopt.tracer.trace`` on two large models.

* ResNet-152, batch 256, 224x224 images;
* a 24-block GPT (width 1024, 16 heads, context 1024, vocabulary 50257), batch 8.

Each model is built once (not timed); then ``trace`` runs ``--repeats`` times
(default 3) and the median wall time is reported. ``torch._dynamo.utils`` (which
``trace`` imports for ``deepcopy_to_fake_tensor``) is imported before anything is
timed, so its one-off import cost is excluded. Memory growth during a trace is
reported two ways:

* ``ru_maxrss`` growth: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after minus
  before. ``ru_maxrss`` is the process's high-water mark, which building the
  model has already raised, so before each trace the mark is reset to the
  current RSS (writing ``5`` to ``/proc/self/clear_refs``, Linux; it resets both
  ``VmHWM`` and ``ru_maxrss``). Without that reset (other systems) the figure
  is only a lower bound (0 when the trace peaks below the earlier mark);
* peak RSS growth: ``VmHWM`` after the trace minus ``VmRSS`` before it (same
  reset; ``None`` where ``/proc`` is unavailable). The two agree on Linux.

Also reported: the predicted peak of a training step without checkpointing
(``simulate(costs, ())``) and with the optimal plan (``solve(costs, "dp2")``), in
GiB. Target: each trace under 15 s. Writes ``benchmarks/results/tracing_time/latest.json``
and prints a Markdown table.

    python -m benchmarks.tracing_time
    python -m benchmarks.tracing_time --repeats 1 --models gpt24
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo.utils  # noqa: F401  - its first import (seconds) is not part of a trace

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import simulate, solve, zoo
from ckptopt.tracer import trace

TARGET_S = 15.0
GIB = 2**30

MODELS = {
    "resnet152": ("resnet152", dict(batch_size=256, input_size=224)),
    "gpt24": ("gpt", dict(batch_size=8, input_size=1024, depth=24, width=1024, heads=16, seq_len=1024)),
}


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # kB on Linux


def one_trace(model, inputs) -> dict:
    gc.collect()
    rss0 = _proc_status("VmRSS")
    reset = _reset_hwm()
    maxrss0 = _maxrss_bytes()
    t0 = time.perf_counter()
    tm = trace(model, inputs)
    t = time.perf_counter() - t0
    maxrss1 = _maxrss_bytes()
    hwm = _proc_status("VmHWM") if reset else None
    return dict(
        seconds=t,
        ru_maxrss_growth_bytes=maxrss1 - maxrss0,
        peak_rss_growth_bytes=(hwm - rss0) if (hwm is not None and rss0 is not None) else None,
        tm=tm,
    )


def run_model(key: str, repeats: int) -> dict:
    name, kw = MODELS[key]
    t0 = time.perf_counter()
    model, inputs = zoo.get(name, **kw)
    build = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        r = one_trace(model, inputs)
        tm = r.pop("tm")
        runs.append(r)
        print(f"  {key}: trace {r['seconds']:.2f} s, ru_maxrss growth {r['ru_maxrss_growth_bytes'] / 2**20:.1f} MiB, "
              f"peak RSS growth {(r['peak_rss_growth_bytes'] or 0) / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    none = simulate(tm.costs, ()).peak_bytes
    plan = solve(tm.costs, "dp2")
    median = statistics.median(r["seconds"] for r in runs)
    growth = [r["peak_rss_growth_bytes"] for r in runs if r["peak_rss_growth_bytes"] is not None]
    row = dict(
        model=key, zoo_name=name, config=kw,
        params=sum(p.numel() for p in model.parameters()),
        param_bytes=tm.param_bytes, input_shapes=[list(t.shape) for t in inputs],
        n=tm.n, opaque_modules=dict(tm.opaque_modules),
        build_seconds=build,
        trace_seconds=[r["seconds"] for r in runs], median_seconds=median,
        ru_maxrss_growth_bytes=[r["ru_maxrss_growth_bytes"] for r in runs],
        peak_rss_growth_bytes=[r["peak_rss_growth_bytes"] for r in runs],
        max_peak_rss_growth_bytes=max(growth) if growth else None,
        predicted_no_checkpointing_bytes=int(none),
        predicted_optimal_bytes=int(plan.peak_bytes),
        optimal_checkpoints=list(plan.checkpoints),
        solve_seconds=plan.solve_seconds,
        target_seconds=TARGET_S, within_target=median < TARGET_S,
    )
    del tm, model, inputs
    gc.collect()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | n | median trace s (runs) | ru_maxrss growth MiB | peak RSS growth MiB | "
             "no-ckpt peak GiB | optimal (dp2) GiB | target 15 s |",
             "|" + "|".join(["---"] * 8) + "|"]
    for r in rows:
        mx = max(r["ru_maxrss_growth_bytes"]) / 2**20
        pk = r["max_peak_rss_growth_bytes"]
        lines.append(
            f"| {r['model']} | {r['n']} | {r['median_seconds']:.2f} ({', '.join(f'{t:.2f}' for t in r['trace_seconds'])}) "
            f"| {mx:.1f} | {'n/a' if pk is None else f'{pk / 2**20:.1f}'} "
            f"| {r['predicted_no_checkpointing_bytes'] / GIB:.2f} | {r['predicted_optimal_bytes'] / GIB:.2f} "
            f"| {'yes' if r['within_target'] else '**NO**'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--out", type=Path, default=Path(result_path("tracing_time")))
    args = ap.parse_args()

    t_all = time.perf_counter()
    rows = []
    for key in args.models:
        print(f"{key}:", file=sys.stderr, flush=True)
        rows.append(run_model(key, args.repeats))
    total = time.perf_counter() - t_all
    result = dict(
        **run_metadata("tracing_time"),
        repeats=args.repeats,
        target_seconds=TARGET_S,
        total_seconds=total,
        models=rows,
    )
    write_json(args.out, result)
    print(table(rows))
    print()
    print(f"Total {total:.0f} s (model building included). Wrote {args.out}")


if __name__ == "__main__":
    main()
