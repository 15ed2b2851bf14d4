"""Command line: ``ckptopt optimize MODEL``, ``compare MODEL``, ``profile MODEL``, ``estimate MODEL``,
``max-batch MODEL --memory SIZE``, ``frontier MODEL``, ``solve --costs FILE.json``.

Each subcommand prints a table by default and machine-readable output with
``--json``. Errors for bad input go to stderr with exit status 2. The libraries' own warnings and
log lines are hidden unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import warnings
from importlib import resources
from typing import Sequence

from .costs import ChainCosts
from .errors import CkptoptError, InfeasibleBudget
from .solvers import SOLVERS, solve
from .units import format_bytes, parse_bytes

DEFAULT_SOLVERS = ("none", "every", "sqrt", "chen-greedy", "linear", "dp2", "dp", "brute")


def _routine(names, n: int) -> list[str]:
    """The solvers a table runs by default on ``n`` layers (each within its ``max_n``)."""
    out = []
    for name in names:
        info = SOLVERS.get(name)
        if info is None or info.max_n is None or n <= info.max_n:
            out.append(name)
    return out


def _example_path() -> str:
    return str(resources.files("ckptopt") / "data" / "conv_chain.json")


def _fmt_plan(cps: tuple[int, ...], limit: int = 8, stored: tuple[int, ...] = ()) -> str:
    if not cps:
        return "-"
    shown = ",".join(map(str, cps[:limit]))
    text = shown + (f",... ({len(cps)})" if len(cps) > limit else "")
    return text + (f" ({len(stored)} unwrapped)" if stored else "")


def cmd_solve(args: argparse.Namespace) -> int:
    path = _example_path() if args.costs == "example" else args.costs
    costs = ChainCosts.from_json(path)
    budget = parse_bytes(args.budget) if args.budget else None
    names = args.solver or _routine(DEFAULT_SOLVERS, costs.n)
    rows = []
    for name in names:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plan = solve(costs, name, budget=budget)
            note = "; ".join(str(w.message) for w in caught)
            rows.append(dict(solver=name, peak_bytes=plan.peak_bytes, checkpoints=list(plan.checkpoints),
                             solve_seconds=plan.solve_seconds, returned_by=plan.solver, note=note))
        except InfeasibleBudget as exc:
            rows.append(dict(solver=name, error=str(exc), min_peak_bytes=exc.min_peak_bytes))
    base = solve(costs, "none").peak_bytes
    if args.json:
        json.dump(dict(costs=str(path), n=costs.n, static_bytes=costs.static, no_checkpointing_bytes=base,
                       budget_bytes=budget, results=rows), sys.stdout, indent=1)
        print()
        return 0
    print(f"cost model: {path}")
    print(f"  {costs.n} layers ({costs.kind} form), static {format_bytes(costs.static)}, "
          f"no checkpointing peaks at {format_bytes(base)} ({base} B)")
    if budget:
        print(f"  budget: {format_bytes(budget)} ({budget} B)")
    print()
    head = f"{'solver':<12} {'peak':>12} {'bytes':>14} {'vs none':>8} {'segments':>8} {'solve':>10}  checkpoints"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['solver']:<12} infeasible: smallest achievable peak is {format_bytes(r['min_peak_bytes'])}")
            continue
        red = 100.0 * (r["peak_bytes"] - base) / base if base else 0.0
        name = r["solver"] if r["returned_by"] == r["solver"] else f"{r['solver']}->{r['returned_by']}"
        print(f"{name:<12} {format_bytes(r['peak_bytes']):>12} {r['peak_bytes']:>14} {red:>+7.1f}% "
              f"{len(r['checkpoints']) + 1:>8} {r['solve_seconds'] * 1e3:>8.2f}ms  {_fmt_plan(tuple(r['checkpoints']))}")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a zoo name (resnet50, gpt, ...: see ckptopt.zoo.names()), hf:<transformers model class> "
                        "(built from its config, no weights), or package.module:factory returning "
                        "(model, example_inputs)")
    p.add_argument("--batch", type=int, metavar="B", help="batch size (default: the zoo's)")
    p.add_argument("--input-size", "--seq", type=int, metavar="S", dest="input_size",
                   help="image side, sequence length or features")
    p.add_argument("--config", action="append", metavar="KEY=VALUE",
                   help="hf: models: a config setting (repeatable), e.g. --config n_layer=6")
    p.add_argument("--capture", default="auto", choices=["auto", "fx", "export"],
                   help="how the forward becomes a graph: torch.fx, torch.export, or auto (fx, then export)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="parameter/input dtype")
    p.add_argument("--leaf", action="append", metavar="MODULE",
                   help="submodule to trace as one opaque layer (repeatable)")


def _load(args, meta: bool = False):
    """The model and its example batch. ``meta``: a zoo or ``hf:`` model is built on the meta device
    (no weights in memory, in the requested dtype from the start): for commands that run no real
    step. ``--calibrate`` builds it for real (on ``--device`` when that is CUDA): layers run there."""
    from ._models import load_model
    from .torch_utils import normalize_inputs
    from .zoo.hf import parse_overrides

    calibrating = bool(getattr(args, "calibrate", None))  # layers run for real: a real model
    on_device = calibrating and str(getattr(args, "device", "cpu")).startswith("cuda")
    model, inputs = load_model(args.model, args.batch, args.input_size, args.dtype,
                               config=parse_overrides(args.config), meta=meta and not calibrating)
    model.train()
    if on_device:
        model.to(args.device)
        moved = normalize_inputs(inputs).map_tensors(lambda t: t.to(args.device))
        inputs = moved.kwargs if isinstance(inputs, dict) else moved.args
    return model, inputs


def _load_and_trace(args, meta: bool = False):
    from .tracer import trace

    model, inputs = _load(args, meta)
    return model, inputs, trace(model, inputs, leaf_modules=args.leaf, capture=args.capture)


def cmd_profile(args: argparse.Namespace) -> int:
    from .simulator import simulate

    model, inputs, tm = _load_and_trace(args, meta=True)
    costs = tm.costs
    sim = simulate(costs, ())
    peak = sim.peak_bytes
    saved = [l.costs.saved_bytes for l in tm.layers]
    heavy = set(sorted(range(len(saved)), key=lambda i: -saved[i])[: args.top])
    rows = [
        dict(index=l.index, name=l.name, op=l.op, output_bytes=l.costs.a, saved_bytes=saved[i],
             share_of_peak=saved[i] / peak if peak else 0.0, params_bytes=int(costs.p[i]),
             saves_input=l.costs.sin, saves_output=l.costs.sout, forward_transient=l.costs.f,
             backward_transient=l.costs.b, heavy=i in heavy)
        for i, l in enumerate(tm.layers)
    ]
    summary = dict(model=args.model, n_layers=tm.n, static_bytes=costs.static, param_bytes=tm.param_bytes,
                   buffer_bytes=tm.buffer_bytes, input_bytes=tm.input_bytes,
                   predicted_peak_bytes=peak, peak_phase=sim.phase, peak_layer=sim.layer,
                   opaque_modules=tm.opaque_modules)
    if args.json:
        json.dump(dict(summary, layers=rows), sys.stdout, indent=1)
        print()
        return 0
    shapes = ", ".join("x".join(map(str, s)) for s in tm.example_shapes)
    print(f"{args.model}: {tm.n} layers, inputs {shapes} ({args.dtype})")
    if tm.opaque_modules:
        for name, why in tm.opaque_modules.items():
            said = why if why.startswith("its forward reads") else f"FX could not trace into it ({why})"
            print(f"  opaque layer {name}: {said}")
    width = max(len(r["name"]) for r in rows)
    head = f"{'#':>4} {'layer':<{width}} {'op':<30} {'output':>11} {'saved':>11} {'of peak':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        mark = " <" if r["heavy"] else ""
        print(f"{r['index']:>4} {r['name']:<{width}} {r['op'][:30]:<30} {format_bytes(r['output_bytes']):>11} "
              f"{format_bytes(r['saved_bytes']):>11} {100 * r['share_of_peak']:>7.1f}%{mark}")
    print()
    print(f"static (parameters {format_bytes(tm.param_bytes)}, buffers {format_bytes(tm.buffer_bytes)}, "
          f"inputs {format_bytes(tm.input_bytes)}): {format_bytes(costs.static)}")
    print(f"predicted peak with no checkpointing: {format_bytes(peak)} ({peak} B), "
          f"reached in the {sim.phase} of layer {sim.layer} ({tm.layers[sim.layer].name})")
    print(f"'<' marks the {args.top} layers that save the most for backward")
    return 0


def _measure(module, inputs) -> int:
    import gc

    from .measure import measure_peak

    gc.collect()
    return measure_peak(module, inputs)


def cmd_optimize(args: argparse.Namespace) -> int:
    from .api import optimize_checkpoints

    model, inputs = _load(args)
    budget = "device" if args.budget == "device" else parse_bytes(args.budget) if args.budget else None
    opt = optimize_checkpoints(model, inputs, solver=args.solver, budget=budget, leaf_modules=args.leaf,
                               capture=args.capture, calibrate=args.calibrate)
    result = dict(model=args.model, solver=opt.plan.solver, checkpoints=list(opt.plan.checkpoints),
                  stored=list(opt.plan.stored), n_layers=opt.traced.n, predicted_peak_bytes=opt.predicted_peak_bytes,
                  no_checkpointing_predicted_bytes=opt.baseline_peak_bytes, solve_seconds=opt.plan.solve_seconds)
    if args.measure:
        result["no_checkpointing_measured_bytes"] = _measure(model, inputs)
        result["measured_peak_bytes"] = _measure(opt, inputs)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    print(opt.explain())
    if args.measure:
        m, m0 = result["measured_peak_bytes"], result["no_checkpointing_measured_bytes"]
        err = 100.0 * (m - opt.predicted_peak_bytes) / opt.predicted_peak_bytes
        print(f"measured (one training step, exact CPU storage tracker): {format_bytes(m)} with the plan "
              f"({err:+.2f}% from predicted), {format_bytes(m0)} without checkpointing "
              f"({100.0 * (m - m0) / m0:+.1f}%)")
    return 0


# "default": what `ckptopt optimize` / optimize_checkpoints pick (dp2, improved with unwrapped segments)
COMPARE_SOLVERS = ("none", "every", "sqrt", "chen-greedy", "linear", "dp2", "dp", "default")


def cmd_compare(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .rewriter import apply_plan
    from .simulator import recomputed_layers, simulate

    model, inputs, tm = _load_and_trace(args, meta=not args.measure)
    if args.calibrate:
        import dataclasses

        from .calibration import calibrate

        tm = dataclasses.replace(tm, costs=calibrate(model, tm, inputs).apply(tm.costs))
    names = args.solvers.split(",") if args.solvers else _routine(COMPARE_SOLVERS, tm.n)
    flops = tm.flops
    total = sum(flops) or 1
    rows = []
    for name in tqdm(names, desc="solvers", disable=not args.measure or args.json, leave=False):
        plan = solve(tm.costs, "auto" if name == "default" else name)
        recomputed = recomputed_layers(tm.costs, plan.checkpoints, plan.stored)
        row = dict(solver=name, predicted_peak_bytes=plan.peak_bytes, segments=len(plan.checkpoints) + 1,
                   checkpoints=list(plan.checkpoints), stored=list(plan.stored), solve_seconds=plan.solve_seconds,
                   recompute_share=sum(flops[i] for i in recomputed) / total)
        if tm.costs.unit == "ns":  # calibrated: the recomputation in measured seconds
            row["recompute_seconds"] = simulate(tm.costs, plan.checkpoints, plan.stored).recompute_seconds
        if args.measure:
            row["measured_peak_bytes"] = _measure(apply_plan(model, tm, plan), inputs)
        rows.append(row)
    base = next((r["predicted_peak_bytes"] for r in rows if r["solver"] == "none"), None)
    out = dict(model=args.model, n_layers=tm.n, static_bytes=tm.costs.static, rows=rows)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(out, fh, indent=1)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as fh:
            lists = ("checkpoints", "stored")
            w = csv.DictWriter(fh, fieldnames=[k for k in rows[0] if k not in lists] + list(lists))
            w.writeheader()
            for r in rows:
                w.writerow(dict(r, **{k: " ".join(map(str, r[k])) for k in lists}))
    if args.png:
        _bar_chart(args, rows)
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(f"{args.model}: {tm.n} layers, static {format_bytes(tm.costs.static)}")
    head = (f"{'solver':<12} {'predicted':>11} {'measured':>11} {'vs none':>8} {'segs':>5} {'recompute':>9} "
            f"{'solve':>9}  checkpoints")
    print(head)
    print("-" * len(head))
    for r in rows:
        meas = format_bytes(r["measured_peak_bytes"]) if "measured_peak_bytes" in r else "-"
        vs = f"{100.0 * (r['predicted_peak_bytes'] - base) / base:+.1f}%" if base else "-"
        print(f"{r['solver']:<12} {format_bytes(r['predicted_peak_bytes']):>11} {meas:>11} {vs:>8} "
              f"{r['segments']:>5} {100 * r['recompute_share']:>8.1f}% {r['solve_seconds'] * 1e3:>7.2f}ms  "
              f"{_fmt_plan(tuple(r['checkpoints']))}"
              + (f"; unwrapped: {_fmt_plan(tuple(r['stored']))}" if r["stored"] else "")
              + (f"; recompute {1e3 * r['recompute_seconds']:.2f} ms" if "recompute_seconds" in r else ""))
    print("recompute: forward FLOPs re-run in backward, as a share of one forward pass; "
          "default: what `ckptopt optimize` picks")
    return 0


def _bar_chart(args, rows) -> None:
    plt = _pyplot()
    labels = [r["solver"] for r in rows]
    pred = [r["predicted_peak_bytes"] / 2**20 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    if all("measured_peak_bytes" in r for r in rows):
        meas = [r["measured_peak_bytes"] / 2**20 for r in rows]
        ax.bar([x - 0.2 for x in xs], pred, 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], meas, 0.4, label="measured")
        ax.legend()
    else:
        ax.bar(list(xs), pred, 0.6, label="predicted")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=20)
    ax.set_ylabel("peak memory of one training step (MiB)")
    ax.set_title(f"{args.model}: peak memory by solver")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


def cmd_frontier(args: argparse.Namespace) -> int:
    from .planning.frontier import frontier

    model, inputs = _load(args, meta=not args.measure)
    points = frontier(model, inputs, points=args.points, measure=args.measure, rounds=args.rounds)
    rows = [p.to_dict() for p in points]
    if args.png:
        _frontier_chart(args, points)
    if args.json:
        json.dump(dict(model=args.model, points=rows), sys.stdout, indent=1)
        print()
        return 0
    head = f"{'method':<28} {'predicted peak':>15} {'time x':>7}"
    if args.measure:
        head += f" {'measured peak':>14} {'time x':>7} {'median':>9}"
    print(f"{args.model}: peak memory against step time (time x: against no checkpointing)")
    print(head)
    print("-" * len(head))
    for p in points:
        pred = format_bytes(p.predicted_peak_bytes) if p.predicted_peak_bytes is not None else "-"
        ratio = f"{p.predicted_time_ratio:.3f}" if p.predicted_time_ratio is not None else "-"
        line = f"{p.label:<28} {pred:>15} {ratio:>7}"
        if args.measure:
            line += (f" {format_bytes(p.measured_peak_bytes):>14} {p.time_ratio:>7.3f} "
                     f"{1e3 * p.median_seconds:>7.1f}ms")
        print(line)
    if len(points) == 1 or not any(p.label.startswith("ckptopt") for p in points):
        print("no plan peaks lower than training without checkpoints: checkpointing does not pay on this model")
    if args.measure:
        print(f"measured: one step's peak (exact storage tracker on CPU), median of {args.rounds} interleaved "
              "step times")
    if args.png:
        print(f"figure: {args.png}")
    return 0


def _frontier_chart(args, points) -> None:
    plt = _pyplot()
    measured = args.measure
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in points:
        mine = p.label.startswith("ckptopt")
        peak = p.measured_peak_bytes if measured else p.predicted_peak_bytes
        ratio = p.time_ratio if measured else p.predicted_time_ratio
        ax.scatter([peak / 2**20], [ratio], marker="o" if mine else "s", color="C0" if mine else "C1",
                   zorder=3)
        ax.annotate(p.label.replace("ckptopt, ", ""), (peak / 2**20, ratio), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    mine = sorted((p for p in points if p.label.startswith("ckptopt")),
                  key=lambda p: p.measured_peak_bytes if measured else p.predicted_peak_bytes)
    ax.plot([(p.measured_peak_bytes if measured else p.predicted_peak_bytes) / 2**20 for p in mine],
            [p.time_ratio if measured else p.predicted_time_ratio for p in mine], color="C0", lw=1,
            label="ckptopt plans")
    ax.set_xlabel(("measured" if measured else "predicted") + " peak memory of a training step (MiB)")
    ax.set_ylabel(("measured" if measured else "predicted") + " step time / no checkpointing")
    ax.set_title(f"{args.model}: memory against time (lower left is better)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--png needs matplotlib: pip install matplotlib (or the 'plot' extra)") from exc
    return plt


# --------------------------------------------------------------------------
# planning a training run: estimate, max-batch
# --------------------------------------------------------------------------
def _planning_args(p: argparse.ArgumentParser) -> None:
    from .planning import OPTIMIZERS

    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                   help="optimizer whose state and step are counted, with PyTorch's default arguments "
                        "(sgd: momentum 0; sgd-momentum: 0.9; none: forward and backward only). Default adam")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the step runs: selects PyTorch's default optimizer step there (cpu: for-loop; "
                        "cuda: foreach, which needs one parameter-sized temporary more for Adam) and whether "
                        "Adam's step counters count (they stay on the CPU). Default cpu")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--headroom", type=float, metavar="FRACTION",
                   help="share of the peak kept free for the caching allocator (default: none on cpu; on cuda "
                        "0.10, 0.15 for a plan that checkpoints, 0.05 with expandable segments)")
    p.add_argument("--keep-output", action="store_true",
                   help="your loop keeps the model's output through backward and the optimizer step (out = "
                        "model(x); loss_fn(out).backward()): count it (measured by fake steps)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each layer once on the device (workspaces, scratch, measured times): the model is "
                        "then built on --device. Default off: the model is built on the meta device (no memory)")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="price one rank of a data-parallel run of N ranks (--batch is then the per-rank batch)")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default=None,
                   help="with --world-size: ddp (DistributedDataParallel: gradient buckets) or fsdp (FSDP2 "
                        "fully_shard on each repeated block and the root). Default ddp")
    p.add_argument("--rank", type=int, default=0, help="with --world-size: the rank priced (default 0: under FSDP2 "
                   "it holds the most optimizer state)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="with --strategy ddp: DDP's gradient_as_bucket_view=True")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="with --strategy ddp: DDP's bucket_cap_mb")
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None,
                   help="with --strategy fsdp: FSDP2's MixedPrecisionPolicy(param_dtype=<this>, reduce_dtype=fp32): "
                        "the model's own parameters (e.g. fp32 master weights) sharded, blocks gathered and "
                        "computed in this dtype")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help=argparse.SUPPRESS)


def _parallel(args):
    """The :class:`~ckptopt.planning.Parallel` the arguments ask for, or None (one process)."""
    from .planning import Parallel

    if args.world_size is None:
        if args.mixed_precision is not None:
            raise ValueError("--mixed-precision is FSDP2's policy: it needs --world-size N --strategy fsdp")
        if args.strategy is not None:
            raise ValueError("--strategy needs --world-size N (the number of ranks)")
        return None
    if not args.reshard_after_forward:
        raise ValueError("--no-reshard-after-forward is not modelled yet: FSDP2's default (reshard after "
                         "forward) is what ckptopt prices")
    return Parallel(args.world_size, args.strategy or "ddp", rank=args.rank, bucket_cap_mb=args.bucket_cap_mb,
                    gradient_as_bucket_view=args.gradient_as_bucket_view, mixed_precision=args.mixed_precision)


def _headroom(args):
    from .planning import Headroom, default_headroom

    if args.headroom is None:
        return None
    base = default_headroom(args.device, calibrated=bool(args.calibrate))
    return Headroom(base.workspace_bytes, args.headroom, "given with --headroom")


def _dtype_help(p: argparse.ArgumentParser) -> None:
    for action in p._actions:
        if action.dest == "dtype":
            action.help = ("parameter and input dtype: bf16/fp16 convert the model with .to(dtype) and feed inputs "
                           "in that dtype (pure low-precision training, not autocast). Default fp32")


def _model_header(args, tm_n: int, inputs) -> str:
    from .torch_utils import normalize_inputs

    shapes = ", ".join("x".join(map(str, t.shape)) for t in normalize_inputs(inputs).tensors())
    return f"{args.model}: {tm_n} layers, inputs {shapes} ({args.dtype})"


_ROWS = (("parameters", "parameters"), ("buffers and inputs", "buffers_and_inputs"), ("gradients", "gradients"),
         ("optimizer state", "optimizer_state"), ("activations", "activations"), ("transients", "transient"),
         ("parallel buffers", "parallel"), ("kept output", "kept_output"))


def _where(pe) -> str:
    if pe.layer is None:
        return pe.at
    return f"{pe.at} of layer {pe.layer}" + (f" ({pe.layer_name})" if pe.layer_name else "")


def cmd_estimate(args: argparse.Namespace) -> int:
    from .planning import estimate

    model, inputs = _load(args, meta=True)
    est = estimate(model, inputs, optimizer=args.optimizer, device=args.device, leaf_modules=args.leaf,
                   capture=args.capture, calibrate=args.calibrate, headroom=_headroom(args), parallel=_parallel(args),
                   keep_output=args.keep_output)
    if args.json:
        json.dump(dict(model=args.model, dtype=args.dtype, device=args.device, **est.to_dict()), sys.stdout, indent=1)
        print()
        return 0
    opt = est.optimizer
    print(_model_header(args, est.n_layers, inputs) + f"; optimizer {opt.name} ({opt.impl} step, {args.device})")
    if est.parallel is not None:
        print(f"one rank of {est.parallel.describe()}; the batch above is the rank's")
    cols = (est.no_checkpointing, est.optimal)
    print(f"{'':<20} {'no checkpointing':>18} {'optimal plan':>18}")
    for label, key in _ROWS:
        vals = [getattr(c.breakdown, key) for c in cols]
        if (key == "parallel" and est.parallel is None) or (key == "kept_output" and not args.keep_output):
            continue
        print(f"{label:<20} {format_bytes(vals[0]):>18} {format_bytes(vals[1]):>18}")
    print(f"{'peak':<20} {format_bytes(cols[0].peak_bytes):>18} {format_bytes(cols[1].peak_bytes):>18}")
    red = 100.0 * (cols[1].peak_bytes - cols[0].peak_bytes) / cols[0].peak_bytes
    print(f"{'':<20} {'':>18} {red:>+17.1f}%")
    print(f"{'recompute':<20} {100 * cols[0].recompute_share:>17.1f}% {100 * cols[1].recompute_share:>17.1f}%")
    print(f"{'checkpoints':<20} {'-':>18} {_fmt_plan(cols[1].checkpoints, stored=cols[1].stored):>18}")
    if est.replayed or est.headroom.workspace_bytes or est.headroom.fraction:
        print(f"{'device needs':<20} {format_bytes(est.needed_bytes(cols[0])):>18} "
              f"{format_bytes(est.needed_bytes(cols[1])):>18}")
    for c in cols:
        print(f"{c.label}: peak reached in the {_where(c)}")
    if est.advice():
        print(est.advice())
    what = "measured forward + backward time" if est.calibrated else "forward + backward = 3 forwards"
    print("breakdown at the peak; transients: the working memory of what runs there (in backward, the new "
          f"gradients of that layer); recompute: forward compute re-run in backward, as a share of a step ({what})")
    if est.replayed:
        print("device needs: the least memory the first two training steps run in, replaying PyTorch's caching "
              "allocator over their allocations (not a headroom share)")
    else:
        print(est.headroom.describe() + (f" (not the allocator replay: {est.replay_note})" if est.replay_note else ""))
    return 0


def _fit_line(fit) -> str:
    if not fit.batch:
        return f"nothing fits: batch 1 needs {format_bytes(fit.next_peak_bytes)}"
    line = f"batch {fit.batch} (peak {format_bytes(fit.peak_bytes)} = {fit.peak_bytes} B"
    if fit.next_peak_bytes is not None:
        line += f"; batch {fit.batch + 1} needs {fit.next_peak_bytes} B"
    line += ")"
    if fit.reserved_bytes is not None:
        line += f", reserves {format_bytes(fit.reserved_bytes)}"
    if fit.strategy != "none":
        line += (f", checkpoints {_fmt_plan(fit.checkpoints, stored=fit.stored)}, "
                 f"recompute {100 * fit.recompute_share:.1f}% of a step")
    return line


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        out = []
    if not out or any(x < 1 for x in out):
        raise ValueError(f"--seq-sweep takes positive sequence lengths separated by commas (e.g. 1024,2048,4096), "
                         f"got {text!r}")
    return out


def _planning_kwargs(args: argparse.Namespace) -> dict:
    return dict(optimizer=args.optimizer, device=args.device, leaf_modules=args.leaf, capture=args.capture,
                headroom=_headroom(args), parallel=_parallel(args))


def cmd_max_batch_sweep(args: argparse.Namespace) -> int:
    """``max-batch --seq-sweep L1,L2,...``: the largest batch at each sequence length (one model built and
    traced per length, on the meta device)."""
    from .planning import max_batch

    if args.target_batch is not None:
        raise ValueError("--seq-sweep and --target-batch do not combine: sweep first, then plan one length")
    memory = parse_bytes(args.memory) if args.memory else None
    rows = []
    for length in _lengths(args.seq_sweep):
        args.input_size = length
        model, inputs = _load(args, meta=True)
        mb = max_batch(model, inputs, memory, calibrate=args.calibrate, keep_output=args.keep_output,
                       **_planning_kwargs(args))
        rows.append((length, mb))
    if args.json:
        json.dump(dict(model=args.model, dtype=args.dtype, device=args.device,
                       sweep=[dict(seq=length, **mb.to_dict()) for length, mb in rows]), sys.stdout, indent=1)
        print()
        return 0
    first = rows[0][1]
    print(f"{args.model}: memory {format_bytes(first.memory_bytes)}, optimizer {first.optimizer.name} "
          f"({first.optimizer.impl} step, {args.device}), {args.dtype}")
    if _parallel(args) is not None:
        print(f"one rank of {_parallel(args).describe()}: the batches below are per rank")
    head = f"{'seq':>7} {'no ckpt':>8} {'optimal':>8} {'optimal peak':>13} {'recompute':>9} {'traces':>6}"
    print(head)
    print("-" * len(head))
    for length, mb in rows:
        o = mb.optimal
        peak = format_bytes(o.peak_bytes) if o.batch else "-"
        share = f"{100 * o.recompute_share:.1f}%" if o.batch else "-"
        print(f"{length:>7} {mb.no_checkpointing.batch:>8} {o.batch:>8} {peak:>13} {share:>9} {mb.traces:>6}")
    print(f"({sum(mb.traces for _, mb in rows)} traces in all; batch 0: batch 1 does not fit; "
          f"{first.headroom.describe()})")
    return 0


def cmd_max_batch(args: argparse.Namespace) -> int:
    from .planning import max_batch, plan_training

    if getattr(args, "seq_sweep", None):
        return cmd_max_batch_sweep(args)
    memory = parse_bytes(args.memory) if args.memory else None
    if args.target_batch is not None and args.target_batch < 1:
        raise ValueError(f"--target-batch must be a positive integer, got {args.target_batch}")
    if args.target_batch is not None and args.keep_output:
        raise ValueError("--keep-output with --target-batch is not supported yet: plan the accumulation without it, "
                         "or free the output before backward in your loop")
    model, inputs = _load(args, meta=True)
    kw = _planning_kwargs(args)
    mb = max_batch(model, inputs, memory, calibrate=args.calibrate, keep_output=args.keep_output, **kw)
    memory = mb.memory_bytes
    plan = plan_training(model, inputs, args.target_batch, memory, **kw) if args.target_batch else None
    if args.json:
        out = dict(model=args.model, dtype=args.dtype, device=args.device, **mb.to_dict())
        if plan is not None:
            out["training_plan"] = plan.to_dict()
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    from .torch_utils import normalize_inputs

    shapes = ", ".join("x".join(map(str, t.shape[1:])) or "scalar" for t in normalize_inputs(inputs).tensors())
    opt = mb.optimizer
    print(f"{args.model}: per-sample input {shapes} ({args.dtype}), memory {format_bytes(memory)}, "
          f"optimizer {opt.name} ({opt.impl} step, {args.device})")
    if kw["parallel"] is not None:
        print(f"  one rank of {kw['parallel'].describe()}: the batches below are per rank")
    print(f"  no checkpointing: {_fit_line(mb.no_checkpointing)}")
    print(f"  optimal plan:     {_fit_line(mb.optimal)}")
    how = "affine in the batch size" if mb.affine else "not affine at the probes: re-fitted near the answer"
    print(f"  ({mb.traces} traces; cost model {how}; each answer b confirmed by tracing b and b+1)")
    if mb.optimal.calibrated:
        print("  each answer then run layer by layer on the device at its batch size (scratch and workspace "
              "measured) and lowered until they fit")
    for line in mb.fitting_lines(args.device):
        print(f"  {line}")
    if plan is not None:
        _print_training_plan(plan)
    return 0


def _print_training_plan(plan) -> None:
    print()
    print(f"reaching batch {plan.target_batch} in {format_bytes(plan.memory_bytes)} with gradient accumulation "
          f"(micro-batch = ceil({plan.target_batch} / steps)):")
    head = (f"{'steps':>5} {'micro':>6} {'no ckpt':>11} {'optimal':>11}  {'least recompute that fits':<28} "
            f"{'peak':>11} {'recompute':>9}")
    print(head)
    print("-" * len(head))
    for o in plan.options:
        if o.checkpoints is None:
            chosen, peak, share = "does not fit", "-", "-"
        else:
            chosen = ("no checkpointing" if not o.checkpoints
                      else "checkpoints " + _fmt_plan(o.checkpoints, 5, o.stored))
            peak, share = format_bytes(o.peak_bytes), f"{100 * o.recompute_share:.1f}%"
        print(f"{o.steps:>5} {o.micro_batch:>6} {format_bytes(o.peak_no_checkpointing):>11} "
              f"{format_bytes(o.peak_optimal):>11}  {chosen:<28} {peak:>11} {share:>9}")
    rec = plan.recommendation
    if rec is None:
        print("nothing fits, even at micro-batch 1 with the optimal plan: lower the memory of the step "
              "(optimizer, dtype) or use a larger device")
        return
    how = "no checkpointing" if not rec.checkpoints else f"checkpoints {_fmt_plan(rec.checkpoints, stored=rec.stored)}"
    print(f"recommended (fewest accumulation steps, then least recompute): {rec.steps} step(s) of micro-batch "
          f"{rec.micro_batch}, {how}: peak {format_bytes(rec.peak_bytes)}, recompute "
          f"{100 * rec.recompute_share:.1f}% of a step")
    free = next((o for o in plan.options if o.fits_no_checkpointing), None)
    if free is not None and free is not rec:
        print(f"without recomputation: {free.steps} steps of micro-batch {free.micro_batch} "
              f"(peak {format_bytes(free.peak_no_checkpointing)})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptopt", description="Choose activation checkpoints with the lowest peak training memory."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("solve", help="solve a cost model (JSON) with every solver and print the plans")
    p.add_argument("--costs", required=True, metavar="FILE.json",
                   help="cost model written by ChainCosts.to_json; 'example' for the bundled conv chain")
    p.add_argument("--solver", action="append", metavar="S",
                   help=f"solver to run (repeatable); default: all but auto. Valid: {', '.join(list(SOLVERS)[:-1])}, uniform:K")
    p.add_argument("--budget", metavar="SIZE", help="peak-memory budget, e.g. 8GiB, 512MiB or bytes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("profile", help="trace a model and print per-layer memory (no activation memory needed)")
    _model_args(p)
    p.add_argument("--top", type=int, default=5, help="how many memory-heavy layers to mark (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("optimize", help="choose the checkpoints with the lowest peak for a model and explain them")
    _model_args(p)
    p.add_argument("--solver", default="auto", help="auto (default), dp2, dp, linear, or a baseline")
    p.add_argument("--budget", metavar="SIZE",
                   help="peak-memory budget, e.g. 8GiB, or 'device': what the device has free, less the headroom")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each layer once on the device (workspaces, scratch, measured times): the model is "
                        "then built on --device. Default off: the model is built on the meta device (no memory)")
    p.add_argument("--measure", action="store_true",
                   help="also run one real training step with and without the plan and measure the peak")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser("compare", help="every solver side by side on one model")
    _model_args(p)
    p.add_argument("--solvers", metavar="A,B,..", help=f"comma-separated (default: {','.join(COMPARE_SOLVERS)})")
    p.add_argument("--measure", action="store_true", help="measure each plan's real peak (one training step each)")
    p.add_argument("--calibrate", action="store_true",
                   help="run each layer once on the device: recomputation in measured seconds, workspaces in the peaks")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--json-out", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--csv", metavar="FILE", help="also write the results as CSV")
    p.add_argument("--png", metavar="FILE", help="also draw a bar chart of the peaks")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("frontier", help="peak memory against step time: ckptopt's plans from the lowest peak to "
                                        "no checkpointing (and, measured, transformers' own checkpointing)")
    _model_args(p)
    p.add_argument("--points", type=int, default=6, metavar="K", help="how many plans (default 6)")
    p.add_argument("--measure", action="store_true",
                   help="run each plan: one step's peak and the median step time over --rounds interleaved rounds")
    p.add_argument("--rounds", type=int, default=5, metavar="R", help="timed rounds with --measure (default 5)")
    p.add_argument("--png", metavar="FILE", help="also draw the frontier (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_frontier)

    p = sub.add_parser("estimate", help="predicted peak of a training step (optimizer step included), with no "
                                        "checkpointing and with the optimal plan, broken down by kind")
    _model_args(p)
    _dtype_help(p)
    _planning_args(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("max-batch", help="the largest batch that fits in a memory size, with no checkpointing and "
                                         "with the optimal plan; with --target-batch, the gradient accumulation "
                                         "that reaches it")
    _model_args(p)
    _dtype_help(p)
    p.add_argument("--memory", metavar="SIZE",
                   help="memory of the device: bytes or a size such as 8GiB, 8GB, 512MiB (default: what the device "
                        "has free)")
    p.add_argument("--target-batch", type=int, metavar="N",
                   help="the batch the optimizer should see: list micro-batch / accumulation-step choices that "
                        "reach it within --memory, with their recompute overhead")
    p.add_argument("--seq-sweep", metavar="L1,L2,...",
                   help="the largest batch at each of these sequence lengths (or input sizes), one row each, "
                        "with the traces each answer took")
    _planning_args(p)
    p.set_defaults(func=cmd_max_batch)
    for p in sub.choices.values():
        p.add_argument("--verbose", action="store_true",
                       help="also print the warnings and log lines of the libraries ckptopt runs (torch.export, "
                            "transformers), which are hidden by default")
    return parser


@contextlib.contextmanager
def _library_noise_hidden(hidden: bool):
    """Warnings and log lines that are not ckptopt's (torch.export specializing a dimension, deprecations
    inside the libraries) hidden while a command runs, unless ``--verbose``; ckptopt's own warnings stay."""
    if not hidden:  # (their warnings shown, also those capture keeps to itself on loggers left at the default)
        from .tracer.capture import EXPORT_LOGGERS

        loggers = [logging.getLogger(name) for name in EXPORT_LOGGERS]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.WARNING - 1)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)
        return
    import torch._logging

    loggers = [logging.getLogger(name) for name in ("transformers", "diffusers", "accelerate")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", module=r"ckptopt(\.|$)")
        torch._logging.set_logs(all=logging.ERROR)  # (torch's loggers re-read their levels from here)
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            torch._logging.set_logs()
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _library_noise_hidden(not args.verbose):
            return args.func(args)
    except (CkptoptError, ValueError, TypeError, OSError) as exc:
        print(f"ckptopt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
