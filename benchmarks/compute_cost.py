"""The compute cost ``c`` of the cost model against measured CPU time.

``ChainCosts.c`` (what the least-recomputation and budget solvers minimize,
and what ``SimResult.recompute_flops`` / ``recompute_share`` report) is a
count: FLOPs from ``torch.utils.flop_counter`` for products, every other
non-view op priced by its measured time per element (``ckptopt.tracer.op_time``).
This benchmark checks it two ways on real CPU tensors:

1. **Per layer.** Every FX node of the traced model is timed while the
   forward runs (an ``fx.Interpreter``, no grad, median of ``--rounds``
   runs after a warm-up) and the nodes are summed per chain layer. Reported:
   Spearman rank correlation between ``c`` and time over the layers, and the
   share of forward time the layers of each plan re-run, predicted from ``c``
   against measured from the layer times.
2. **Per plan.** The step time (forward + loss + backward) of ``none``,
   ``sqrt``, ``dp2`` and ``every`` (rewritten with ``apply_plan``), median of
   interleaved rounds, against no checkpointing: the measured overhead beside
   the predicted ``recompute_share`` (recomputed compute / 3 x forward).

Writes ``benchmarks/results/compute_cost/latest.json`` and prints a table.
Run: ``python -m benchmarks.compute_cost [--rounds 7]``. Timing on a shared
2-core machine is noisy: medians of interleaved runs, side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.fx as fx

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import apply_plan, simulate, solve, trace, zoo
from ckptopt.simulator import recomputed_layers

MODELS = {
    "resnet18": ("resnet18", dict(batch_size=8, input_size=64)),
    "mobilenet_v2": ("mobilenet_v2", dict(batch_size=8, input_size=64)),
    "gpt": ("gpt", dict(batch_size=4, input_size=128, depth=2, width=128, heads=4, seq_len=128, vocab=1000)),
    "mlp": ("mlp", dict(batch_size=1024, width=512, depth=12)),
}
PLANS = ("none", "sqrt", "dp2", "every")


class _NodeTimer(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.times: dict[str, float] = {}

    def run_node(self, n):
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.times[n.name] = time.perf_counter() - t0
        return out


def layer_times(tm, inputs, rounds: int) -> list[float]:
    per_round = []
    with torch.no_grad():
        for k in range(rounds + 1):
            timer = _NodeTimer(tm.gm)
            timer.run(*inputs)
            if k:
                per_round.append(timer.times)
    med = {name: statistics.median(r[name] for r in per_round) for name in per_round[0]}
    return [sum(med.get(nm, 0.0) for nm in layer.nodes) for layer in tm.layers]


def spearman(x, y) -> float:
    rx = np.argsort(np.argsort(x)).astype(float)
    ry = np.argsort(np.argsort(y)).astype(float)
    return float(np.corrcoef(rx, ry)[0, 1])


def step_time(module, inputs) -> float:
    for p in module.parameters():
        p.grad = None
    t0 = time.perf_counter()
    out = module(*inputs)
    out.float().pow(2).mean().backward()
    return time.perf_counter() - t0


def run_model(name: str, rounds: int) -> dict:
    zname, kw = MODELS[name]
    torch.manual_seed(0)
    model, inputs = zoo.get(zname, **kw)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    tm = trace(model, inputs)
    c = tm.costs
    times = layer_times(tm, inputs, rounds)
    model_layers = [i for i, l in enumerate(tm.layers) if l.nodes != ("<loss>",)]
    cs = [int(c.c[i]) for i in model_layers]
    ts = [times[i] for i in model_layers]
    plans = {p: solve(c, p) for p in PLANS}
    modules = {p: (model if not plan.checkpoints else apply_plan(model, tm, plan)) for p, plan in plans.items()}
    samples = {p: [] for p in PLANS}
    for p in PLANS:  # warm-up
        step_time(modules[p], inputs)
    for _ in range(rounds):
        for p in PLANS:
            samples[p].append(step_time(modules[p], inputs))
    base = statistics.median(samples["none"])
    total_c = sum(cs)
    total_t = sum(ts)
    rows = {}
    for p, plan in plans.items():
        rec = [i for i in recomputed_layers(c, plan.checkpoints) if i in model_layers]
        sim = simulate(c, plan.checkpoints)
        rows[p] = dict(
            checkpoints=list(plan.checkpoints),
            predicted_recompute_share=sim.recompute_share,
            recomputed_forward_share_predicted=sum(int(c.c[i]) for i in rec) / total_c if total_c else 0.0,
            recomputed_forward_share_measured=sum(times[i] for i in rec) / total_t if total_t else 0.0,
            step_seconds_median=statistics.median(samples[p]),
            measured_overhead=statistics.median(samples[p]) / base - 1,
        )
    return dict(model=zname, size=kw, n=c.n, spearman_c_vs_time=spearman(cs, ts),
                forward_seconds_sum_of_layers=total_t, forward_flops=total_c,
                flops_per_second=total_c / total_t if total_t else None,
                layer_c=cs, layer_seconds=ts, plans=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    results = {}
    for name in args.models:
        results[name] = r = run_model(name, args.rounds)
        print(f"{name}: n={r['n']} spearman(c, time)={r['spearman_c_vs_time']:.2f}", flush=True)
    write_json(result_path("compute_cost"), dict(meta=run_metadata("compute_cost"), rounds=args.rounds,
                                                 results=results))
    print("| model | plan | re-run share of forward: predicted (c) | measured (layer times) "
          "| recompute share of step (predicted) | step overhead (measured) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        for p, row in r["plans"].items():
            print(f"| {name} (Spearman {r['spearman_c_vs_time']:.2f}) | {p} "
                  f"| {row['recomputed_forward_share_predicted']*100:.1f}% | {row['recomputed_forward_share_measured']*100:.1f}% "
                  f"| {row['predicted_recompute_share']*100:.1f}% | {row['measured_overhead']*100:+.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
