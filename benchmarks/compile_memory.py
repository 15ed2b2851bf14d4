"""Peak memory of one training step: eager against torch.compile, with and without ckptopt.

    python -m benchmarks.compile_memory            # -> benchmarks/results/compile_memory/latest.json

Four modules (the unmodified model and the ckptopt-rewritten one, each eager
and compiled) are measured two ways:

* ``tracker``: ckptopt's exact storage tracker (a ``TorchDispatchMode``).
  It sees every ATen op that goes through the dispatcher: eager code and the
  ``aot_eager`` backend. Inductor's generated CPU code allocates its buffers
  directly (``empty_strided_cpu``), outside the dispatcher, so the tracker
  cannot see them: it is not used for inductor (``ops_seen`` says how much of
  the step it saw).
* ``profiler``: ``torch.profiler`` with ``profile_memory=True`` records every
  allocation and free of the CPU allocator, inductor's included; the peak is
  the running sum's maximum over the step (scratch memory included, and
  minus whatever the step frees that was allocated before it, e.g. old
  gradients, which are cleared first).

What it showed on this machine (torch 2.13 CPU, results/compile_memory/latest.json):
eager and ``aot_eager`` give the same tracker peak to the byte and the same
number of ops (214), and the eager ckptopt peak equals its prediction to 8
bytes; with a dispatch mode active the compiled call may well run its eager
fallback, so this is no evidence about the compiled graph's memory. The
profiler recorded only 3-21 allocator events per step (hundreds of tensors
are made), so its figures are not usable either: ``prof.events()`` keeps only
some of the memory events. ``benchmarks/frontier.py`` reads them all from the
raw kineto events and measures compiled peaks that way (checked against the
tracker on eager steps); on CUDA, ``measure_peak`` reads the allocator's
statistics, which see compiled kernels.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import optimize_checkpoints
from ckptopt.measure import StorageTracker

OUT = result_path("compile_memory")


def make_model(width=256, depth=8):
    torch.manual_seed(0)
    layers = [nn.Linear(64, width)]
    for _ in range(depth):
        layers += [nn.GELU(), nn.Linear(width, width)]
    layers += [nn.Tanh(), nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def step(module, x):
    loss = module(x).float().pow(2).mean()
    loss.backward()


def clear_grads(model):
    for p in model.parameters():
        p.grad = None


def tracker_peak(module, model, x) -> dict:
    clear_grads(model)
    tracker = StorageTracker(timeline=True)
    tracker.register(model, x)
    try:
        with tracker:
            step(module, x)
        return {"peak_bytes": tracker.peak_bytes, "ops_seen": len(tracker.timeline)}
    finally:
        tracker.detach()
        clear_grads(model)


def profiler_peak(module, model, x) -> dict:
    from torch.profiler import ProfilerActivity, profile

    clear_grads(model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(module, x)
    clear_grads(model)
    events = [e for e in prof.events() if e.name == "[memory]"]
    events.sort(key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage
        peak = max(peak, live)
    return {"peak_above_start_bytes": int(peak), "allocator_events": len(events)}


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.strip().split("\n")[0]).parse_args(argv)  # (no options: --help)
    x = torch.randn(512, 64)
    results = []
    for label, ckpt in (("unmodified", False), ("ckptopt", True)):
        model = make_model()
        module = optimize_checkpoints(model, x) if ckpt else model
        plan = list(module.plan.checkpoints) if ckpt else None
        for mode in ("eager", "aot_eager", "inductor"):
            torch._dynamo.reset()
            run = module if mode == "eager" else torch.compile(module, backend=mode)
            t0 = time.perf_counter()
            step(run, x)  # compile (and warm up)
            clear_grads(model)
            warm_s = time.perf_counter() - t0
            row = {"model": label, "mode": mode, "plan": plan, "first_step_s": round(warm_s, 2),
                   "profiler": profiler_peak(run, model, x)}
            if mode != "inductor":
                row["tracker"] = tracker_peak(run, model, x)
            if ckpt:
                row["predicted_peak_bytes"] = module.predicted_peak_bytes
            results.append(row)
            print(json.dumps(row))
    static = sum(p.numel() * 4 for p in make_model().parameters()) + x.numel() * 4
    out = dict(run_metadata("compile_memory"), input_shape=list(x.shape), static_bytes=static, results=results)
    write_json(OUT, out)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
