"""optimize_checkpoints' default plan space: checkpoint-only (dp2) against dp2 + the stored pass.

``optimize_checkpoints(model, x)`` (solver "auto", no budget) takes dp2's
optimum over plans whose segments are all checkpointed but the last (the
paper's plan space), then searches plans that may also leave middle segments
unwrapped ("stored": rotor's forward-all step) with the Pareto program capped
at that optimum (``ckptopt.solvers.improve_with_stored``), and keeps the
result when its (peak, recomputation) is lower.

For each model: dp2's predicted peak and recomputation share, the default's,
the time of the extra pass, and, where the plans differ, the default plan's
peak measured on a training step on fake tensors with the exact storage
tracker (``measure_peak(..., fake=True)``: the same bytes as a real CPU step).

Writes ``benchmarks/results/stored_default/latest.json``.
Run: ``python -m benchmarks.stored_default``.
"""

from __future__ import annotations

import time

import torch

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import measure_peak, simulate, solve, trace, zoo
from ckptopt.solvers import improve_with_stored

MODELS = {
    "vgg16 b8 96²": ("vgg16", dict(batch_size=8, input_size=96)),
    "resnet18 b32 224²": ("resnet18", dict(batch_size=32, input_size=224)),
    "resnet50 b8 96²": ("resnet50", dict(batch_size=8, input_size=96)),
    "resnet101 b32 224²": ("resnet101", dict(batch_size=32, input_size=224)),
    "densenet121 b8 96²": ("densenet121", dict(batch_size=8, input_size=96)),
    "mobilenet_v2 b32 224²": ("mobilenet_v2", dict(batch_size=32, input_size=224)),
    "unet b8 96²": ("unet", dict(batch_size=8, input_size=96)),
    "gpt b8": ("gpt", dict(batch_size=8)),
    "mlp b256 w32 d8": ("mlp", dict(batch_size=256, width=32, depth=8)),
    "mlp b2048 w1024 d24": ("mlp", dict(batch_size=2048, width=1024, depth=24)),
}


def run_model(name: str) -> dict:
    zname, kw = MODELS[name]
    torch.manual_seed(0)
    model, inputs = zoo.get(zname, **kw)
    tm = trace(model, inputs)
    c = tm.costs
    dp2 = solve(c, "dp2")
    t0 = time.perf_counter()
    auto = improve_with_stored(c, dp2)
    seconds = time.perf_counter() - t0
    s_dp2 = simulate(c, dp2.checkpoints)
    s_auto = simulate(c, auto.checkpoints, auto.stored)
    row = dict(model=zname, size=kw, n=c.n, dp2_peak_bytes=dp2.peak_bytes, dp2_share=s_dp2.recompute_share,
               default_peak_bytes=auto.peak_bytes, default_share=s_auto.recompute_share,
               default_solver=auto.solver, default_checkpoints=list(auto.checkpoints),
               default_stored=list(auto.stored), pass_seconds=seconds)
    if auto is not dp2:
        row["default_measured_bytes"] = int(measure_peak(model, inputs, checkpoints=auto, fake=True))
    return row


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = ap.parse_args(argv)
    rows = {}
    for name in args.models:
        rows[name] = run_model(name)
        print(name, "done", flush=True)
    write_json(result_path("stored_default"), dict(meta=run_metadata("stored_default"), results=rows))
    print("| model | n | dp2 peak (recompute) | default peak (recompute) | change | stored segments "
          "| extra pass | measured - predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        d, a = r["dp2_peak_bytes"], r["default_peak_bytes"]
        meas = r.get("default_measured_bytes")
        print(f"| {name} | {r['n']} | {d / 2**20:.2f} MiB ({r['dp2_share'] * 100:.1f}%) "
              f"| {a / 2**20:.2f} MiB ({r['default_share'] * 100:.1f}%) | {100.0 * (a - d) / d:+.2f}% "
              f"| {len(r['default_stored'])} | {r['pass_seconds'] * 1e3:.1f} ms "
              f"| {'' if meas is None else f'{meas - a:+d} B'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
