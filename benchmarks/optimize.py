"""Checkpoint plans on every zoo model: predicted and measured peak, step time.

For each model, at a CPU-friendly size where activations matter (below), the
model is traced once (``ckptopt.tracer.trace``) and the plans of the solvers
``none, sqrt, chen-greedy, dp, dp2, linear`` (``dp`` only when n <= 2000) are
made with ``ckptopt.solve(tm.costs, name)``. Each plan is applied with
``ckptopt.apply_plan`` (the baselines too, so that their true peak is measured
even when it is worse than no checkpointing) and, per distinct plan:

* **measured peak**: ``ckptopt.measure.measure_peak_detailed`` (the same exact
  CPU storage tracker as ``measure_peak``, one forward + loss + backward with
  loss ``out.float().pow(2).mean()``; ``gc.collect()`` first), against the
  predicted peak ``plan.peak_bytes``: relative error ``(pred - meas) / meas``;
  also where the simulator puts the peak (``ckptopt.simulate``: phase, layer,
  segment) and the operator at which the tracker saw it;
* **step time**: median over 5 interleaved rounds (after one warm-up round) of
  forward + loss + backward (``time.perf_counter``; grads set to None between
  steps), each round running every distinct plan once; the ratio to ``none``.
  Also recorded: the ratio of the fastest steps (min over the rounds), robust
  to the ~10x slowdowns that other tenants of the 2 shared cores cause (a
  model is flagged ``timing_noisy`` when max/min of its none or dp2 steps
  exceeds 1.5), and the process CPU time of the same steps (it inflates with
  wall time there: the OpenMP threads spin).
  Plans with identical checkpoints are run once and share the figures.

For the chains (vgg16, vgg19, mlp) ``torch.utils.checkpoint.checkpoint_sequential``
(``use_reentrant=False``) is measured for EVERY segment count 1..min(#modules, 40)
on a flat ``nn.Sequential`` of the model's modules in order (VGG:
``[*features, avgpool, Flatten(1), *classifier]``; MLP: ``[*layers, head]``);
the best count's peak is reported and that count joins the timing rounds. A
count whose backward fails (VGG's in-place ReLU at a segment boundary:
"modified by an inplace operation") is measured again on the same modules with
in-place ReLU/Dropout replaced by out-of-place ones (what a user of
checkpoint_sequential has to do); the best over both is the comparison for
target 3, the best "as is" is recorded too.

For dp2 the rewritten module's parameter gradients are compared with
``torch.equal`` to the original model's for one step (same RNG seed), and its
buffers (BatchNorm running statistics) after that step too.

Targets, PASS/FAIL per model:

1. measured within 3% of predicted for dp, dp2 and linear;
2. the optimum (dp2) measured lower than sqrt and chen-greedy (ties, |delta|
   <= 0.1% of the measured peak, are reported separately from losses);
3. chains only: dp2 measured lower than the best checkpoint_sequential count.

Writes ``benchmarks/results/optimize/latest.json`` (``--quick``: ``latest-quick.json``; and a
``.png`` beside it when matplotlib imports) and prints a Markdown table.

    python -m benchmarks.optimize                 # every configuration (tens of minutes on 2 cores)
    python -m benchmarks.optimize --quick         # resnet18, mlp, gpt at small sizes (~2 min)
    python -m benchmarks.optimize --models vgg16 mlp@2048
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential

from benchmarks.harness import result_path, run_metadata
from ckptopt import apply_plan, simulate, solve, zoo
from ckptopt.measure import measure_peak, measure_peak_detailed
from ckptopt.solvers import improve_with_stored
from ckptopt.tracer import trace


SOLVERS = ("none", "sqrt", "chen-greedy", "dp", "dp2", "linear")
# "default": optimize_checkpoints' plan, dp2's improved over plans with unwrapped (stored)
# middle segments (ckptopt.solvers.improve_with_stored)
EXACT = ("dp", "dp2", "linear", "default")  # target 1
DP_MAX_N = 2000
ROUNDS = 5
CS_MAX = 40
ERR_TARGET = 0.03
TIE_TOL = 1e-3  # |delta| <= 0.1% of the measured peak counts as a tie

# config name -> (zoo model, zoo.get keyword arguments)
CONFIGS: dict[str, tuple[str, dict]] = {
    "vgg16": ("vgg16", dict(batch_size=8, input_size=64)),
    "vgg19": ("vgg19", dict(batch_size=8, input_size=64)),
    "resnet18": ("resnet18", dict(batch_size=16, input_size=96)),
    "resnet50": ("resnet50", dict(batch_size=8, input_size=96)),
    "resnet101": ("resnet101", dict(batch_size=4, input_size=64)),
    "resnet152": ("resnet152", dict(batch_size=4, input_size=64)),
    "densenet121": ("densenet121", dict(batch_size=8, input_size=64)),
    "mobilenet_v2": ("mobilenet_v2", dict(batch_size=16, input_size=64)),
    "unet": ("unet", dict(batch_size=4, input_size=96, base=16)),
    "gpt": ("gpt", dict(batch_size=8, input_size=256, depth=6, width=128, heads=4, seq_len=256, vocab=1000)),
    "mlp": ("mlp", dict(batch_size=512, width=1024, depth=24)),
    # the size above is dominated by parameters and their gradients (every plan ties);
    # at batch 2048 the activations exceed them
    "mlp@2048": ("mlp", dict(batch_size=2048, width=1024, depth=24)),
    # --quick
    "resnet18-small": ("resnet18", dict(batch_size=8, input_size=64)),
    "mlp-small": ("mlp", dict(batch_size=2048, width=512, depth=12)),
    "gpt-small": ("gpt", dict(batch_size=4, input_size=128, depth=2, width=128, heads=4, seq_len=128, vocab=1000)),
}
FULL = ["vgg16", "vgg19", "resnet18", "resnet50", "resnet101", "resnet152", "densenet121",
        "mobilenet_v2", "unet", "gpt", "mlp", "mlp@2048"]
QUICK = ["resnet18-small", "mlp-small", "gpt-small"]
CHAINS = ("vgg16", "vgg19", "mlp")

MiB = 2**20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# checkpoint_sequential on a flat Sequential
# --------------------------------------------------------------------------
def flat_modules(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, zoo.VGG):
        return [*model.features, model.avgpool, nn.Flatten(1), *model.classifier]
    if isinstance(model, zoo.MLPChain):
        return [*model.layers, model.head]
    raise TypeError(f"no flat module list for {type(model).__name__}")


def out_of_place(mods: list[nn.Module]) -> list[nn.Module]:
    """The same modules, with in-place ReLU/Dropout replaced by out-of-place ones (no parameters)."""
    out = []
    for m in mods:
        if isinstance(m, nn.ReLU) and m.inplace:
            m = nn.ReLU(inplace=False)
        elif isinstance(m, nn.Dropout) and m.inplace:
            m = nn.Dropout(m.p, inplace=False)
        out.append(m)
    return out


class CheckpointSequential(nn.Module):
    """``checkpoint_sequential(seq, segments, x, use_reentrant=False)``; shares the model's modules."""

    def __init__(self, seq: nn.Sequential, segments: int):
        super().__init__()
        self.seq = seq
        self.segments = segments

    def forward(self, x):
        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def snapshot_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in model.buffers()]


def restore_buffers(model: nn.Module, snap: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for b, s in zip(model.buffers(), snap):
            b.copy_(s)


def zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def train_step(module: nn.Module, inputs: tuple) -> None:
    out = module(*inputs)
    loss = out.float().pow(2).mean()
    del out
    loss.backward()


def timed_step(module: nn.Module, model: nn.Module, inputs: tuple) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward + loss + backward."""
    zero_grads(model)
    c0 = time.process_time()
    t0 = time.perf_counter()
    train_step(module, inputs)
    t = time.perf_counter() - t0
    c = time.process_time() - c0
    zero_grads(model)
    return t, c


def measure(module: nn.Module, inputs: tuple) -> dict:
    gc.collect()
    pm = measure_peak_detailed(module, inputs)
    tl = pm.timeline or []
    at = max(range(len(tl)), key=lambda i: tl[i][2]) if tl else None
    return dict(bytes=int(pm.peak_bytes),
                peak_op=(tl[at][1] if at is not None else None),
                peak_op_index=(tl[at][0] if at is not None else None),
                n_ops=len(tl))


def grads_match(model: nn.Module, module: nn.Module, inputs: tuple, seed: int = 1234) -> dict:
    """One step of the original and of ``module`` from the same state and RNG seed:
    torch.equal on every parameter gradient and on the buffers after the step."""
    snap = snapshot_buffers(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]

    def run(m):
        zero_grads(model)
        restore_buffers(model, snap)
        torch.manual_seed(seed)
        train_step(m, inputs)
        g = [None if p.grad is None else p.grad.detach().clone() for p in params]
        b = snapshot_buffers(model)
        zero_grads(model)
        return g, b

    g0, b0 = run(model)
    g1, b1 = run(module)
    restore_buffers(model, snap)
    bad = [n for n, a, b in zip(names, g0, g1)
           if (a is None) != (b is None) or (a is not None and not torch.equal(a, b))]
    bad_buf = sum(not torch.equal(a, b) for a, b in zip(b0, b1))
    return dict(grads_equal=not bad, n_params=len(params), mismatched=bad[:10], n_mismatched=len(bad),
                buffers_equal=bad_buf == 0, n_buffers=len(b0), n_buffers_mismatched=int(bad_buf))


def compare(opt: int, other: int) -> tuple[str, int]:
    """Outcome of the optimum against another plan's measured peak."""
    d = other - opt
    if abs(d) <= TIE_TOL * max(opt, other):
        return "tie", d
    return ("win" if d > 0 else "loss"), d


# --------------------------------------------------------------------------
# one model
# --------------------------------------------------------------------------
def key(p) -> tuple:
    return (p.checkpoints, p.stored)


def run_model(cfg: str) -> dict:
    zname, kw = CONFIGS[cfg]
    t_model = time.perf_counter()
    model, inputs = zoo.get(zname, **kw)
    model.train()
    t0 = time.perf_counter()
    tm = trace(model, inputs)
    t_trace = time.perf_counter() - t0
    costs = tm.costs
    n = tm.n
    is_chain = zname in CHAINS

    # plans
    plans = {}
    for s in SOLVERS:
        if s == "dp" and n > DP_MAX_N:
            continue
        plans[s] = solve(costs, s)
    plans["default"] = improve_with_stored(costs, plans["dp2"])
    distinct: dict[tuple, str] = {}  # (checkpoints, stored) -> first solver with them
    for s, p in plans.items():
        distinct.setdefault(key(p), s)
    modules = {k: apply_plan(model, tm, plans[s]) for k, s in distinct.items()}

    # measured peaks
    meas = {k: measure(m, inputs) for k, m in modules.items()}
    rows = {}
    for s, p in plans.items():
        m = meas[key(p)]
        sim = simulate(costs, p.checkpoints, p.stored)
        rows[s] = dict(
            checkpoints=list(p.checkpoints), stored=list(p.stored), n_segments=len(p.checkpoints) + 1,
            same_plan_as=(distinct[key(p)] if distinct[key(p)] != s else None),
            predicted_bytes=int(p.peak_bytes), measured_bytes=m["bytes"],
            rel_error=(p.peak_bytes - m["bytes"]) / m["bytes"],
            solve_seconds=p.solve_seconds,
            sim_peak=dict(phase=sim.phase, layer=sim.layer, layer_name=tm.layers[sim.layer].name,
                          segment=sim.segment),
            measured_peak_op=m["peak_op"], measured_peak_op_index=m["peak_op_index"], n_ops=m["n_ops"],
        )
        log(f"  {cfg} {s:12s} segs {len(p.checkpoints) + 1:3d} pred {p.peak_bytes / MiB:9.2f} "
            f"meas {m['bytes'] / MiB:9.2f} MiB err {100 * rows[s]['rel_error']:+.4f}% "
            f"(sim peak: {sim.phase} @ layer {sim.layer})")

    # gradients of the optimum against the original
    gm = grads_match(model, modules[key(plans["dp2"])], inputs)
    log(f"  {cfg} dp2 grads equal: {gm['grads_equal']}, buffers equal: {gm['buffers_equal']}")

    # checkpoint_sequential sweep (chains)
    cs = None
    timed = {("plan", k): m for k, m in modules.items()}
    if is_chain:
        seq = nn.Sequential(*flat_modules(model))
        with torch.no_grad():
            snap = snapshot_buffers(model)
            torch.manual_seed(0)
            y0 = model(*inputs)
            torch.manual_seed(0)
            y1 = seq(*inputs)
            restore_buffers(model, snap)
        flat_ok = bool(torch.equal(y0, y1))
        del y0, y1
        seq_oop = nn.Sequential(*out_of_place(list(seq)))
        has_inplace = any(a is not b for a, b in zip(seq, seq_oop))
        kmax = min(len(seq), CS_MAX)
        sweep = []
        for k in range(1, kmax + 1):
            row = dict(segments=k)
            try:
                gc.collect()
                row["measured_bytes"] = int(measure_peak(CheckpointSequential(seq, k), inputs))
                row["variant"] = "as is"
            except Exception as e:  # in-place ops at a segment boundary fail in backward
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                if has_inplace:
                    try:
                        gc.collect()
                        row["measured_bytes"] = int(measure_peak(CheckpointSequential(seq_oop, k), inputs))
                        row["variant"] = "out-of-place ReLU/Dropout"
                    except Exception as e2:
                        row["error_out_of_place"] = f"{type(e2).__name__}: {e2}"[:300]
            sweep.append(row)
        ok = [r for r in sweep if "measured_bytes" in r]
        best = min(ok, key=lambda r: (r["measured_bytes"], r["segments"])) if ok else None
        ok_as_is = [r for r in ok if r["variant"] == "as is"]
        best_as_is = min(ok_as_is, key=lambda r: (r["measured_bytes"], r["segments"])) if ok_as_is else None
        sqrt_k = max(1, round(len(seq) ** 0.5))
        cs = dict(n_modules=len(seq), flat_equals_model=flat_ok, counts_tried=kmax,
                  best_segments=best and best["segments"], best_measured_bytes=best and best["measured_bytes"],
                  best_variant=best and best["variant"],
                  best_as_is_segments=best_as_is and best_as_is["segments"],
                  best_as_is_measured_bytes=best_as_is and best_as_is["measured_bytes"],
                  counts_failing_as_is=[r["segments"] for r in sweep if "error" in r],
                  counts_failing_both=[r["segments"] for r in sweep if "measured_bytes" not in r],
                  sqrt_segments=sqrt_k,
                  sqrt_measured_bytes=next((r.get("measured_bytes") for r in sweep if r["segments"] == sqrt_k), None),
                  errors=sum("error" in r for r in sweep), sweep=sweep)
        if best:
            timed[("cs", best["segments"])] = CheckpointSequential(
                seq if best["variant"] == "as is" else seq_oop, best["segments"])
        log(f"  {cfg} checkpoint_sequential: best {best and best['segments']} segments of {len(seq)} modules, "
            f"{best and best['measured_bytes'] / MiB:.2f} MiB ({best and best['variant']}; {cs['errors']} counts fail as is: "
            f"{cs['counts_failing_as_is']}; fail both: {cs['counts_failing_both']}; flat == model: {flat_ok})")

    # step times: one warm-up round, then ROUNDS interleaved rounds
    snap = snapshot_buffers(model)
    times: dict = {k: [] for k in timed}
    cpu: dict = {k: [] for k in timed}
    for r in range(ROUNDS + 1):
        for k, m in timed.items():
            t, c = timed_step(m, model, inputs)
            if r:
                times[k].append(t)
                cpu[k].append(c)
    restore_buffers(model, snap)
    med = {k: statistics.median(v) for k, v in times.items()}
    medc = {k: statistics.median(v) for k, v in cpu.items()}
    k0 = ("plan", key(plans["none"]))
    for s, p in plans.items():
        k = ("plan", key(p))
        rows[s].update(step_seconds=med[k], step_times=times[k], step_ratio_vs_none=med[k] / med[k0],
                       step_min_seconds=min(times[k]), step_min_ratio_vs_none=min(times[k]) / min(times[k0]),
                       step_spread=max(times[k]) / min(times[k]),
                       step_cpu_seconds=medc[k], step_cpu_times=cpu[k], step_cpu_ratio_vs_none=medc[k] / medc[k0])
    if cs and cs["best_segments"]:
        k = ("cs", cs["best_segments"])
        cs.update(best_step_seconds=med[k], best_step_times=times[k], best_step_ratio_vs_none=med[k] / med[k0],
                  best_step_min_ratio_vs_none=min(times[k]) / min(times[k0]),
                  best_step_cpu_seconds=medc[k], best_step_cpu_ratio_vs_none=medc[k] / medc[k0])

    # targets
    t1 = {s: abs(rows[s]["rel_error"]) <= ERR_TARGET for s in EXACT if s in rows}
    opt = rows["dp2"]["measured_bytes"]
    t2 = {b: compare(opt, rows[b]["measured_bytes"]) for b in ("sqrt", "chen-greedy")}
    targets = {
        "1_prediction_within_3pct": dict(
            status="PASS" if all(t1.values()) else "FAIL",
            per_solver={s: dict(ok=v, rel_error=rows[s]["rel_error"]) for s, v in t1.items()}),
        "2_optimal_below_sqrt_and_greedy": dict(
            status=("FAIL" if any(o == "loss" for o, _ in t2.values())
                    else "TIE" if any(o == "tie" for o, _ in t2.values()) else "PASS"),
            per_baseline={b: dict(outcome=o, baseline_minus_dp2_bytes=int(d)) for b, (o, d) in t2.items()}),
    }
    if cs:
        if cs["best_measured_bytes"] is None:
            targets["3_optimal_below_best_checkpoint_sequential"] = dict(status="FAIL", reason="no count ran")
        else:
            o, d = compare(opt, cs["best_measured_bytes"])
            od, dd = compare(rows["default"]["measured_bytes"], cs["best_measured_bytes"])
            targets["3_optimal_below_best_checkpoint_sequential"] = dict(
                status={"win": "PASS", "tie": "TIE", "loss": "FAIL"}[o], outcome=o,
                best_cs_minus_dp2_bytes=int(d), best_segments=cs["best_segments"],
                default_outcome=od, best_cs_minus_default_bytes=int(dd))

    none_pred = rows["none"]["predicted_bytes"]
    above = none_pred - costs.static - tm.param_bytes  # above parameters + buffers + inputs + parameter gradients
    res = dict(
        config=cfg, model=zname, sizes=kw, chain=is_chain, n=n,
        param_bytes=int(tm.param_bytes), buffer_bytes=int(tm.buffer_bytes), input_bytes=int(tm.input_bytes),
        static_bytes=int(costs.static),
        none_peak_above_params_and_grads_bytes=int(above),
        # parameters + their gradients dominate: the predicted optimum gains under 1% over no checkpointing
        params_dominate=bool(none_pred - rows["dp2"]["predicted_bytes"] < 0.01 * none_pred),
        n_distinct_plans=len(modules),
        plans=rows, checkpoint_sequential=cs, dp2_gradient_check=gm, targets=targets,
        dp2_reduction_vs_none=1 - opt / rows["none"]["measured_bytes"],
        # other tenants on the 2 shared cores make some steps ~10x slower (OpenMP threads spin)
        timing_noisy=bool(max(rows["none"]["step_spread"], rows["dp2"]["step_spread"]) > 1.5),
        seconds=dict(trace=t_trace, total=0.0),
    )
    del modules, timed, model, inputs, tm
    gc.collect()
    res["seconds"]["total"] = time.perf_counter() - t_model
    return res


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------
def mib(b) -> str:
    return "–" if b is None else f"{b / MiB:.1f}"


def table(results: list[dict]) -> str:
    head = ("| model | n | none | sqrt | chen-greedy | best ckpt_seq (k) | dp2 | default (dp2+stored) | linear | "
            "dp2 vs none | dp2 pred. err | dp2/none step time (median; min) | default/none step time |")
    lines = [head, "|" + "|".join(["---"] * 13) + "|"]
    for r in results:
        P = r["plans"]
        cs = r["checkpoint_sequential"]
        cs_s = (f"{mib(cs['best_measured_bytes'])} ({cs['best_segments']}"
                f"{'' if cs['best_variant'] == 'as is' else ', out-of-place'})") if cs else "n/a"
        lines.append(
            f"| {r['config']} | {r['n']} | {mib(P['none']['measured_bytes'])} | {mib(P['sqrt']['measured_bytes'])} "
            f"| {mib(P['chen-greedy']['measured_bytes'])} | {cs_s} | {mib(P['dp2']['measured_bytes'])} "
            f"| {mib(P['default']['measured_bytes'])}{' (= dp2)' if (P['default']['checkpoints'], P['default']['stored']) == (P['dp2']['checkpoints'], []) else ''} "
            f"| {mib(P['linear']['measured_bytes'])} | {-100 * r['dp2_reduction_vs_none']:+.1f}% "
            f"| {100 * P['dp2']['rel_error']:+.3f}% | {P['dp2']['step_ratio_vs_none']:.2f}; "
            f"{P['dp2']['step_min_ratio_vs_none']:.2f}{' (noisy)' if r['timing_noisy'] else ''} "
            f"| {P['default']['step_ratio_vs_none']:.2f} |")
    return "\n".join(lines)


def target_lines(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        T = r["targets"]
        parts = []
        t = T["1_prediction_within_3pct"]
        worst = max(t["per_solver"].items(), key=lambda kv: abs(kv[1]["rel_error"]))
        parts.append(f"(1) {t['status']} (worst {worst[0]} {100 * worst[1]['rel_error']:+.3f}%)")
        t = T["2_optimal_below_sqrt_and_greedy"]
        parts.append(f"(2) {t['status']} (" + ", ".join(
            f"{b}: {v['outcome']} {v['baseline_minus_dp2_bytes'] / MiB:+.2f} MiB" for b, v in t["per_baseline"].items()) + ")")
        t = T.get("3_optimal_below_best_checkpoint_sequential")
        if t:
            parts.append(f"(3) {t['status']} (best k={t.get('best_segments')}: "
                         f"{t.get('outcome')} {t.get('best_cs_minus_dp2_bytes', 0) / MiB:+.2f} MiB; default: "
                         f"{t.get('default_outcome')} {t.get('best_cs_minus_default_bytes', 0) / MiB:+.2f} MiB)")
        g = r["dp2_gradient_check"]
        parts.append(f"grads {'equal' if g['grads_equal'] else 'DIFFER'}"
                     f"{'' if g['buffers_equal'] else ', buffers DIFFER'}")
        if r["params_dominate"]:
            parts.append(f"params+grads dominate (params {r['param_bytes'] / MiB:.0f} MiB, activations etc. above "
                         f"params+grads {r['none_peak_above_params_and_grads_bytes'] / MiB:.0f} MiB at the peak)")
        out.append(f"- {r['config']}: " + "; ".join(parts))
    return out


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    keys = ["sqrt", "chen-greedy", "cs", "dp2", "linear"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(results)), 4))
    w = 0.8 / len(keys)
    for j, k in enumerate(keys):
        ys = []
        for r in results:
            none = r["plans"]["none"]["measured_bytes"]
            if k == "cs":
                cs = r["checkpoint_sequential"]
                ys.append(cs["best_measured_bytes"] / none if cs and cs["best_measured_bytes"] else float("nan"))
            else:
                ys.append(r["plans"][k]["measured_bytes"] / none)
        ax.bar([i + (j - len(keys) / 2 + 0.5) * w for i in range(len(results))], ys, w,
               label="best checkpoint_sequential" if k == "cs" else k)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r["config"] for r in results], rotation=30, ha="right")
    ax.set_ylabel("measured peak / no checkpointing")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def git_state() -> dict:
    """Read-only: the commit and whether src/ differs from it (others edit concurrently)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root,
                               capture_output=True, text=True).stdout.split("\n")
        return dict(commit=head, src_modified=[l[3:] for l in dirty if l.strip()])
    except Exception as e:  # pragma: no cover
        return dict(error=str(e))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--models", nargs="+", choices=list(CONFIGS), metavar="CONFIG",
                    help=f"configurations to run (choices: {', '.join(CONFIGS)})")
    ap.add_argument("--out", type=Path, help="default benchmarks/results/optimize/latest.json (latest-quick.json "
                    "with --quick)")
    args = ap.parse_args()
    args.out = args.out or Path(result_path("optimize", "quick" if args.quick else None))
    names = args.models or (QUICK if args.quick else FULL)
    missing = [z for z in zoo.names() if z not in {CONFIGS[c][0] for c in names}]
    if missing and not (args.models or args.quick):
        log(f"warning: zoo models without a configuration here: {missing}")
    warnings.filterwarnings("ignore", category=UserWarning)

    git = git_state()  # before the run: others commit while it goes
    torch.manual_seed(0)
    t_all = time.perf_counter()
    results: list[dict] = []

    def write(done: bool) -> None:
        """The JSON after every model (``complete`` false until the last), so a killed run leaves its part."""
        result = dict(
            **run_metadata("optimize"),
            git=dict(at_start=git, at_end=git_state() if done else None),
            complete=done,
            sizes={c: dict(model=CONFIGS[c][0], **CONFIGS[c][1]) for c in names},
            settings=dict(solvers=list(SOLVERS), dp_max_n=DP_MAX_N, rounds=ROUNDS, warmup_rounds=1,
                          checkpoint_sequential_max_segments=CS_MAX, error_target=ERR_TARGET, tie_tolerance=TIE_TOL,
                          loss="out.float().pow(2).mean()", rel_error="(predicted - measured) / measured"),
            total_seconds=time.perf_counter() - t_all,
            summary={r["config"]: {k: v["status"] for k, v in r["targets"].items()} for r in results},
            models=results,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.out)

    for cfg in names:
        log(f"{cfg}: {CONFIGS[cfg]}")
        results.append(run_model(cfg))
        r = results[-1]
        log(f"{cfg}: done in {r['seconds']['total']:.0f} s (trace {r['seconds']['trace']:.1f} s)")
        for line in target_lines([r]):
            log(line)
        write(done=False)
    total = time.perf_counter() - t_all
    write(done=True)
    png = args.out.with_suffix(".png")
    wrote_png = plot(results, png)
    print("Measured peak, MiB (exact CPU storage tracker, one training step):\n")
    print(table(results))
    print()
    print("\n".join(target_lines(results)))
    print(f"\nTotal {total:.0f} s. Wrote {args.out}" + (f" and {png}" if wrote_png else ""))


if __name__ == "__main__":
    main()
