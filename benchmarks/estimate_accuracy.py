"""Predicted against measured peak of a whole training step, optimizer step included, on every zoo model.

For each zoo model (the CPU-friendly sizes of ``prediction_accuracy.py``) and
each optimizer (SGD, SGD with momentum 0.9, Adam; PyTorch's default for-loop
step on CPU), ``ckptopt.estimate`` predicts the peak of one steady-state
training step with no checkpointing and with the optimal plan, and
``ckptopt.measure.measure_training_step`` measures it for real (exact CPU
storage tracker; optimizer state allocated beforehand, as from the second
iteration on). Target: |error| <= 5%. Writes
``benchmarks/results/estimate_accuracy/latest.json`` and prints a Markdown table.

    python -m benchmarks.estimate_accuracy                  # all zoo models
    python -m benchmarks.estimate_accuracy --models mlp gpt
"""

from __future__ import annotations

import argparse
import gc
import time

from benchmarks.harness import result_path, run_metadata, write_json
from benchmarks.prediction_accuracy import CONFIGS
from ckptopt import zoo
from ckptopt.measure import measure_training_step
from ckptopt.planning import estimate

OPTIMIZERS = ("sgd", "sgd-momentum", "adam")
TARGET = 0.05


def run_model(name: str, kw: dict) -> list[dict]:
    model, inputs = zoo.get(name, **kw)
    model.train()
    rows = []
    for opt in OPTIMIZERS:
        est = estimate(model, inputs, optimizer=opt)
        for pe in (est.no_checkpointing, est.optimal):
            gc.collect()
            t0 = time.perf_counter()
            measured = measure_training_step(model, inputs, opt, "for-loop",
                                             checkpoints=pe.checkpoints if pe.checkpoints else None,
                                             stored=pe.stored)
            err = (pe.peak_bytes - measured) / measured
            rows.append(dict(model=name, config=kw, optimizer=opt, plan=pe.label, checkpoints=list(pe.checkpoints), stored=list(pe.stored),
                             predicted_bytes=pe.peak_bytes, measured_bytes=measured, rel_error=err, at=pe.at,
                             breakdown=pe.to_dict()["breakdown"], measure_seconds=time.perf_counter() - t0))
            print(f"| {name} | {opt} | {pe.label} | {pe.peak_bytes / 2**20:.2f} | {measured / 2**20:.2f} | "
                  f"{100 * err:+.4f}% | {pe.at} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(CONFIGS))
    args = ap.parse_args()
    print("| model | optimizer | plan | predicted MiB | measured MiB | error | peak in |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in args.models:
        rows += run_model(name, CONFIGS[name][1])
    worst = max(abs(r["rel_error"]) for r in rows)
    out = dict(run_metadata("estimate_accuracy"), target_abs_rel_error=TARGET, max_abs_rel_error=worst,
               within_target=worst <= TARGET, rows=rows)
    write_json(result_path("estimate_accuracy"), out)
    print(f"\nlargest |error|: {100 * worst:.4f}% (target {100 * TARGET:.0f}%)")


if __name__ == "__main__":
    main()
