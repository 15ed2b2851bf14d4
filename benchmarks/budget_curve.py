"""Recomputation against memory budget: the whole trade-off curve of each model.

For each model (sizes below, CPU-friendly), the model is traced once
(``ckptopt.trace``; fake tensors) and ``ckptopt.solvers.pareto_front(costs)``
returns every plan that is Pareto-optimal in (peak, recomputation), from the
lowest peak (most recomputation) to the lowest-peak plan that recomputes
nothing. The ``budget`` solver's answer for any budget B is the point with the
largest peak <= B, so this list *is* the curve of ``solve(costs, "budget",
budget=B)``: it is checked at every point (same recomputation).

Two curves per model: plans whose segments are all checkpointed but the last
(``allow_stored=False``: the plans of dp/dp2/linear, as in the paper), and
plans that may also leave middle segments unwrapped ("stored", rotor's
forward-all step; what the ``budget`` solver uses). Reported: the
recomputation each needs at the budget halfway between the lowest peak and no
checkpointing.

Recomputation is the forward compute re-run in backward (``ChainCosts.c``:
FLOPs from ``torch.utils.flop_counter``, other ops priced by their measured time
per element, ``ckptopt.tracer.op_time``), reported as a share of a step's forward
and backward compute (``SimResult.recompute_share``).

Three points per model (lowest peak, middle, no recomputation) are measured:
the plan is applied and one training step is run on fake tensors with the exact
storage tracker (``ckptopt.measure_peak(..., checkpoints=plan, fake=True)``),
which counts the same bytes as a real CPU run without allocating.

Writes ``benchmarks/results/budget_curve/latest.json`` and ``latest.png``.
Run: ``python -m benchmarks.budget_curve``.
"""

from __future__ import annotations

import time

import torch

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import Plan, measure_peak, simulate, solve, trace, zoo
from ckptopt.solvers import pareto_front

MODELS = {
    "resnet50": ("resnet50", dict(batch_size=8, input_size=96)),
    "densenet121": ("densenet121", dict(batch_size=8, input_size=64)),
    "unet": ("unet", dict(batch_size=4, input_size=96, base=16)),
    "mobilenet_v2": ("mobilenet_v2", dict(batch_size=16, input_size=64)),
    "gpt": ("gpt", dict(batch_size=8, input_size=256, depth=6, width=128, heads=4, seq_len=256, vocab=1000)),
    "mlp@2048": ("mlp", dict(batch_size=2048, width=1024, depth=24)),
}


def run_model(name: str) -> dict:
    zname, kw = MODELS[name]
    torch.manual_seed(0)
    model, inputs = zoo.get(zname, **kw)
    tm = trace(model, inputs)
    c = tm.costs
    dp2 = solve(c, "dp2")  # also compiles the kernels, so the timing below excludes compilation
    t0 = time.perf_counter()
    front = pareto_front(c)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt_front = pareto_front(c, allow_stored=False)
    ckpt_seconds = time.perf_counter() - t0
    none = simulate(c, ())
    points = []
    for peak, rec, plan, stored in front:
        s = simulate(c, plan, stored)
        assert (s.peak_bytes, s.recompute_flops) == (peak, rec)
        b = solve(c, "budget", budget=peak)
        assert simulate(c, b.checkpoints, b.stored).recompute_flops == rec, (name, peak)
        points.append(dict(peak_bytes=peak, recompute_flops=rec, recompute_share=s.recompute_share,
                           checkpoints=list(plan), stored=list(stored)))
    ckpt_points = [dict(peak_bytes=p, recompute_flops=r, recompute_share=simulate(c, plan).recompute_share,
                        checkpoints=list(plan)) for p, r, plan, _ in ckpt_front]
    picks = sorted({0, len(front) // 2, len(front) - 1})
    for i in picks:
        plan = Plan(tuple(points[i]["checkpoints"]), points[i]["peak_bytes"], "budget", 0.0, c.n,
                    tuple(points[i]["stored"]))
        points[i]["measured_peak_bytes"] = int(measure_peak(model, inputs, checkpoints=plan, fake=True))
    mid = (front[0][0] + none.peak_bytes) // 2

    def share_at(pts, budget):
        fit = [p["recompute_share"] for p in pts if p["peak_bytes"] <= budget]
        return min(fit) if fit else None

    return dict(model=zname, size=kw, n=c.n, none_peak_bytes=none.peak_bytes, static_bytes=c.static,
                forward_flops=none.forward_flops, front_seconds=seconds, points=points,
                checkpoint_only_seconds=ckpt_seconds, checkpoint_only_points=ckpt_points,
                mid_budget_bytes=mid, mid_share=share_at(points, mid),
                mid_share_checkpoint_only=share_at(ckpt_points, mid),
                dp2_peak_bytes=dp2.peak_bytes, dp2_recompute_flops=simulate(c, dp2.checkpoints).recompute_flops)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        xs = [p["peak_bytes"] / r["none_peak_bytes"] * 100 for p in r["points"]]
        ys = [p["recompute_share"] * 100 for p in r["points"]]
        line = ax.step(xs, ys, where="post", label=f"{name} (n={r['n']})")[0]
        cx = [p["peak_bytes"] / r["none_peak_bytes"] * 100 for p in r["checkpoint_only_points"]]
        cy = [p["recompute_share"] * 100 for p in r["checkpoint_only_points"]]
        ax.step(cx, cy, where="post", ls=":", lw=1, color=line.get_color())
        mx = [p["peak_bytes"] / r["none_peak_bytes"] * 100 for p in r["points"] if "measured_peak_bytes" in p]
        my = [p["recompute_share"] * 100 for p in r["points"] if "measured_peak_bytes" in p]
        ax.plot(mx, my, "o", ms=4, color=line.get_color())
    ax.set_xlabel("peak memory, % of no checkpointing (budget)")
    ax.set_ylabel("recomputation, % of a training step")
    ax.set_title("Least recomputation for each budget (ckptopt 'budget' solver)\n"
                 "solid: middle segments may stay unwrapped; dotted: every segment but the last "
                 "checkpointed;\ndots: plans measured (fake tensors, exact tracker)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = ap.parse_args(argv)
    results = {}
    for name in args.models:
        results[name] = r = run_model(name)
        meas = [(p["peak_bytes"], p["measured_peak_bytes"]) for p in r["points"] if "measured_peak_bytes" in p]
        print(f"{name}: n={r['n']} points={len(r['points'])} front {r['front_seconds']*1e3:.1f} ms; "
              f"peak {r['points'][0]['peak_bytes']/2**20:.1f}..{r['points'][-1]['peak_bytes']/2**20:.1f} MiB "
              f"(none {r['none_peak_bytes']/2**20:.1f}); share {r['points'][0]['recompute_share']*100:.1f}%..0; "
              f"predicted-measured {[p - m for p, m in meas]} B", flush=True)
    data = dict(meta=run_metadata("budget_curve"), results=results)
    write_json(result_path("budget_curve"), data)
    plot(results, result_path("budget_curve", suffix=".png"))
    print("| model | n | Pareto points (checkpoint-only) | front time | lowest peak (recompute share) "
          "| dp2 peak (share) | no checkpointing | mid budget | share at mid budget: checkpoint-only / with stored "
          "| measured - predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        p0 = r["points"][0]
        meas = [p["measured_peak_bytes"] - p["peak_bytes"] for p in r["points"] if "measured_peak_bytes" in p]
        dp2_share = r["dp2_recompute_flops"] / (3 * r["forward_flops"]) * 100
        print(f"| {name} | {r['n']} | {len(r['points'])} ({len(r['checkpoint_only_points'])}) "
              f"| {r['front_seconds']*1e3:.1f} ms "
              f"| {p0['peak_bytes']/2**20:.2f} MiB ({p0['recompute_share']*100:.1f}%) "
              f"| {r['dp2_peak_bytes']/2**20:.2f} MiB ({dp2_share:.1f}%) "
              f"| {r['none_peak_bytes']/2**20:.2f} MiB | {r['mid_budget_bytes']/2**20:.2f} MiB "
              f"| {r['mid_share_checkpoint_only']*100:.1f}% / {r['mid_share']*100:.1f}% "
              f"| {', '.join(f'{x:+d} B' for x in meas)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
