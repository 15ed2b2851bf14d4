"""Command line: ``ckptopt solve --costs FILE.json``.

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CkptoptError, ValueError, OSError) as exc:
        print(f"ckptopt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
