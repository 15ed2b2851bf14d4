"""Command line: ``ckptopt solve --costs FILE.json``, ``ckptopt profile MODEL``.

Each subcommand prints a table by default and machine-readable output with
``--json``. Errors for bad input go to stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from importlib import resources
from typing import Sequence

from .costs import ChainCosts
from .errors import CkptoptError, InfeasibleBudget
from .solvers import SOLVERS, solve
from .solvers.exact import BRUTE_MAX_N
from .units import format_bytes, parse_bytes

DEFAULT_SOLVERS = ("none", "every", "sqrt", "chen-greedy", "linear", "dp2", "dp", "brute")


def _example_path() -> str:
    return str(resources.files("ckptopt") / "data" / "conv_chain.json")


def _fmt_plan(cps: tuple[int, ...], limit: int = 8) -> str:
    if not cps:
        return "-"
    shown = ",".join(map(str, cps[:limit]))
    return shown + (f",... ({len(cps)})" if len(cps) > limit else "")


def cmd_solve(args: argparse.Namespace) -> int:
    path = _example_path() if args.costs == "example" else args.costs
    costs = ChainCosts.from_json(path)
    budget = parse_bytes(args.budget) if args.budget else None
    names = args.solver or [s for s in DEFAULT_SOLVERS if s != "brute" or costs.n <= BRUTE_MAX_N]
    if costs.n > 2000 and not args.solver:
        names = [s for s in names if s != "dp"]
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
                   help="a zoo name (resnet50, gpt, ...: see ckptopt.zoo.names()) or package.module:factory "
                        "returning (model, example_inputs)")
    p.add_argument("--batch", type=int, metavar="B", help="batch size (default: the zoo's)")
    p.add_argument("--input-size", type=int, metavar="S", help="image side, sequence length or features")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="parameter/input dtype")
    p.add_argument("--leaf", action="append", metavar="MODULE",
                   help="submodule to trace as one opaque layer (repeatable)")


def _load_and_trace(args):
    from ._models import load_model
    from .tracer import trace

    model, inputs = load_model(args.model, args.batch, args.input_size, args.dtype)
    model.train()
    return model, inputs, trace(model, inputs, leaf_modules=args.leaf)


def cmd_profile(args: argparse.Namespace) -> int:
    from .simulate import simulate

    model, inputs, tm = _load_and_trace(args)
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
            print(f"  opaque layer {name}: FX could not trace into it ({why})")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptopt", description="Choose activation checkpoints with the lowest peak training memory."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("solve", help="solve a cost model (JSON) with every solver and print the plans")
    p.add_argument("--costs", required=True, metavar="FILE.json",
                   help="cost model written by ChainCosts.to_json; 'example' for the bundled conv chain")
    p.add_argument("--solver", action="append", metavar="S",
                   help=f"solver to run (repeatable); default: all. Valid: {', '.join(list(SOLVERS)[:-1])}, uniform:K")
    p.add_argument("--budget", metavar="SIZE", help="peak-memory budget, e.g. 8GiB, 512MiB or bytes")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("profile", help="trace a model and print per-layer memory (no activation memory needed)")
    _model_args(p)
    p.add_argument("--top", type=int, default=5, help="how many memory-heavy layers to mark (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CkptoptError, ValueError, TypeError, OSError) as exc:
        print(f"ckptopt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
