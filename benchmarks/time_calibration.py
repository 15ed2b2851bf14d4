"""Predicted step-time ratios against measured ones: FLOPs against calibrated (measured) time.

For each model and plan (none, sqrt, every, the default ``auto`` plan, and the
least-recompute plan under a budget halfway between the default's peak and no
checkpointing's) three figures of the step time relative to no checkpointing:

* **FLOPs**: ``1 + recompute_share`` of the traced cost model (re-run FLOPs over
  3 x forward FLOPs), what ckptopt reported before calibration;
* **calibrated**: ``1 + recompute_share`` after :func:`ckptopt.calibration.calibrate`
  (re-run forward time over the measured forward + backward time of every layer,
  each layer run alone on the device);
* **measured**: the median step time (forward + loss + backward) of the rewritten
  module over that of the model, interleaved rounds side by side.

Also the step's absolute time: the calibrated prediction ``sum(forward + backward)``
against the measured no-checkpointing step. The budget plan is solved twice, on FLOPs
and on calibrated time, and both are measured: what pricing by time buys.

Writes ``benchmarks/results/time_calibration/latest.json`` (``latest-<device>.json`` on a GPU) and
prints a Markdown table. Run: ``python -m benchmarks.time_calibration [--rounds 9] [--device cpu]``. On a shared
2-core machine timing is noisy: medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import device_label, result_path, run_metadata, write_json
from ckptopt import apply_plan, simulate, solve, trace, zoo
from ckptopt.calibration import calibrate

MODELS = {
    "resnet18": ("resnet18", dict(batch_size=8, input_size=64)),
    "mobilenet_v2": ("mobilenet_v2", dict(batch_size=8, input_size=64)),
    "unet": ("unet", dict(batch_size=2, input_size=64)),
    "gpt": ("gpt", dict(batch_size=4, depth=2, width=128, heads=4, seq_len=128, vocab=1000)),
    "mlp": ("mlp", dict(batch_size=1024, width=512, depth=12)),
}


def step_time(module, inputs, sync) -> float:
    for p in module.parameters():
        p.grad = None
    sync()
    t0 = time.perf_counter()
    out = module(*inputs)
    out.float().pow(2).mean().backward()
    sync()
    return time.perf_counter() - t0


def run_model(name: str, rounds: int, device: str) -> dict:
    zname, kw = MODELS[name]
    torch.manual_seed(0)
    model, inputs = zoo.get(zname, device=device, **kw)
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    loss = lambda out: out.float().pow(2).mean()  # noqa: E731  the loss the timed steps use
    tm = trace(model, inputs, loss_fn=loss)
    t0 = time.perf_counter()
    cal = calibrate(model, tm, inputs, repeats=rounds, cache=False)
    cal_seconds = time.perf_counter() - t0
    flops, timed = tm.costs, cal.apply(tm.costs)
    plans = {p: solve(flops, p) for p in ("sqrt", "every")}
    plans["default"] = solve(timed, "auto")
    lo, hi = plans["default"].peak_bytes, simulate(flops, ()).peak_bytes
    budget = (lo + hi) // 2
    plans["budget (FLOPs)"] = solve(flops, "auto", budget=budget)
    plans["budget (time)"] = solve(timed, "auto", budget=budget)
    modules = {"none": model}
    modules.update({p: apply_plan(model, tm, plan) for p, plan in plans.items()})
    samples = {p: [] for p in modules}
    for p in modules:  # warm-up
        step_time(modules[p], inputs, sync)
    for _ in range(rounds):
        for p in modules:
            samples[p].append(step_time(modules[p], inputs, sync))
    base = statistics.median(samples["none"])
    rows = {}
    for p, module in modules.items():
        cps, st = (plans[p].checkpoints, plans[p].stored) if p in plans else ((), ())
        by_flops, by_time = simulate(flops, cps, st), simulate(timed, cps, st)
        rows[p] = dict(checkpoints=list(cps), stored=list(st), peak_bytes=by_flops.peak_bytes,
                       predicted_ratio_flops=1 + by_flops.recompute_share,
                       predicted_ratio_calibrated=1 + by_time.recompute_share,
                       predicted_recompute_seconds=by_time.recompute_seconds,
                       measured_ratio=statistics.median(samples[p]) / base,
                       step_seconds_median=statistics.median(samples[p]))
    return dict(model=zname, size=kw, n=tm.n, device=device, budget_bytes=budget,
                calibration_seconds=cal_seconds, layers_measured=cal.measured,
                predicted_step_seconds=timed.step_compute / 1e9, measured_step_seconds=base, plans=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    results = {}
    for name in args.models:
        results[name] = r = run_model(name, args.rounds, args.device)
        print(f"{name}: n={r['n']} calibrated in {r['calibration_seconds']:.1f} s; step predicted "
              f"{1e3 * r['predicted_step_seconds']:.1f} ms, measured {1e3 * r['measured_step_seconds']:.1f} ms",
              flush=True)
    errors = {"flops": [], "calibrated": []}
    for r in results.values():
        for p, row in r["plans"].items():
            if p != "none":
                errors["flops"].append(abs(row["predicted_ratio_flops"] - row["measured_ratio"]))
                errors["calibrated"].append(abs(row["predicted_ratio_calibrated"] - row["measured_ratio"]))
    summary = {k: dict(median_abs_error=statistics.median(v), max_abs_error=max(v)) for k, v in errors.items() if v}
    label = None if args.device == "cpu" else device_label(args.device)
    write_json(result_path("time_calibration", label), dict(meta=run_metadata("time_calibration", args.device),
                                                             rounds=args.rounds, summary=summary, results=results))
    print("| model | plan | step time / no checkpointing: FLOPs | calibrated | measured | recompute (calibrated) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        for p, row in r["plans"].items():
            if p == "none":
                continue
            print(f"| {name} | {p} | {row['predicted_ratio_flops']:.2f} | {row['predicted_ratio_calibrated']:.2f} "
                  f"| {row['measured_ratio']:.2f} | {1e3 * row['predicted_recompute_seconds']:.1f} ms |")
    for k, v in summary.items():
        print(f"{k}: median |predicted - measured| {v['median_abs_error']:.3f}, max {v['max_abs_error']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
