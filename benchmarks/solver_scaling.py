"""Solve time against n for dp (O(n^3)), dp2 (O(n^2)) and linear (O(n)).

Random additive instances (seeded); for each n the solvers run interleaved on the
same instance, `--repeats` times, and the median is kept. Two times per solver:
the optimum pass alone (the compiled kernel: the complexity the slopes measure) and
the whole `solve()` call, which adds the least-recomputation tie-break (dp/dp2: a
Pareto pass bounded at about 0.4 s and skipped above ~2,800 layers; linear: an
O(n log n) pass). Writes benchmarks/results/solver_scaling/latest.{json,png}
(``--quick``: ``latest-quick.{json,png}``) and prints Markdown tables with the fitted
log-log slopes (least squares over the sizes at or above `FIT_FROM`).

    python -m benchmarks.solver_scaling            # full run, about a minute on 2 cores
    python -m benchmarks.solver_scaling --quick    # smaller sizes, seconds
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, code_version, command_line
from ckptopt import ChainCosts, solve
from ckptopt.solvers import exact, linear

OUT = RESULTS / "solver_scaling"

SIZES = {
    "dp": [100, 200, 300, 500, 700, 1000, 1500, 2000],
    "dp2": [300, 1000, 2000, 5000, 10000, 20000],
    "linear": [1000, 10_000, 100_000, 300_000, 1_000_000],
}
QUICK = {"dp": [100, 200, 400], "dp2": [300, 1000, 3000], "linear": [1000, 10_000, 100_000]}
FIT_FROM = {"dp": 500, "dp2": 2000, "linear": 10_000}


def instance(n: int, seed: int) -> ChainCosts:
    rng = np.random.default_rng(seed)
    return ChainCosts.additive(
        rng.integers(0, 1 << 20, n), rng.integers(0, 1 << 20, n), rng.integers(0, 1 << 24, n)
    )


SIDE_SIZES = [100, 300, 1000, 2000]
SIDE_QUICK = [100, 300]


def side_instance(n: int, seed: int) -> ChainCosts:
    """A full-form chain with side tensors (docs/design.md §4): an encoder output made halfway and
    read (and saved) by every fourth later layer, a bias read by every fifth, and a two-layer skip
    every seventh layer."""
    from ckptopt.costs import SideTensor

    rng = np.random.default_rng(seed)
    a = rng.integers(1000, 100_000, n)
    side = [SideTensor(200_000, n // 2, tuple(range(n // 2 + 1, n, 4)), saved_by=tuple(range(n // 2 + 1, n, 8))),
            SideTensor(30_000, n // 2 + 1, tuple(range(n // 2 + 2, n, 5)), saved_by=tuple(range(n // 2 + 2, n, 5)))]
    side += [SideTensor(int(a[k]), k, (k + 2,), saved_by=(k + 2,)) for k in range(1, n - 3, 7)]
    return ChainCosts(a=a, p=rng.integers(0, 1000, n), sin=rng.integers(0, 2, n), sout=rng.integers(0, 2, n),
                      m=rng.integers(0, 50_000, n), f=a + rng.integers(0, 1000, n), b=2 * a + rng.integers(0, 1000, n),
                      side=side)


def optimum_pass(c: ChainCosts, s: str) -> tuple[float, int]:
    """Seconds of the solver's first pass alone (the compiled kernel) and the value it finds."""
    full = not c.is_additive
    arrays = c.kernel_arrays  # cached; built before the clock starts
    if s == "linear":
        P, q, w = linear._additive_arrays(c)
        t0 = time.perf_counter()
        value, _ = linear.linear_additive(c.n, P, q, w)
    else:
        kernel = exact.dp_cubic if s == "dp" else exact.dp_quadratic
        t0 = time.perf_counter()
        value, _ = kernel(c.n, full, arrays)
    return time.perf_counter() - t0, int(value) + c.static


def fit_slope(ns, ts):
    x, y = np.log(ns), np.log(ts)
    return float(np.polyfit(x, y, 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT, help="the folder written to (default benchmarks/results/solver_scaling)")
    args = ap.parse_args()
    sizes = QUICK if args.quick else SIZES
    solve(instance(5, 0), "dp")  # compile / load the kernels before timing anything

    all_n = sorted({n for v in sizes.values() for n in v})
    times: dict[str, dict[int, float]] = {s: {} for s in sizes}  # optimum pass alone
    solve_times: dict[str, dict[int, float]] = {s: {} for s in sizes}  # whole solve(), tie-break included
    agree: dict[int, bool] = {}
    for n in all_n:
        c = instance(n, seed=n)
        runs = {s: [] for s in sizes if n in sizes[s]}
        whole = {s: [] for s in runs}
        reps = 1 if (n >= 1500 and "dp" in runs) else args.repeats
        peaks = {}
        for _ in range(reps):  # interleaved: each repeat runs every solver once
            for s in runs:
                t, value = optimum_pass(c, s)
                runs[s].append(t)
                p = solve(c, s)
                whole[s].append(p.solve_seconds)
                peaks[s] = p.peak_bytes
                if value != p.peak_bytes:
                    raise SystemExit(f"{s} at n={n}: first pass {value} != solve() {p.peak_bytes}")
        for s in runs:
            times[s][n] = statistics.median(runs[s])
            solve_times[s][n] = statistics.median(whole[s])
        if len(set(peaks.values())) > 1:
            raise SystemExit(f"solvers disagree at n={n}: {peaks}")
        agree[n] = True
        print(f"n={n:>8}: " + "  ".join(f"{s} {times[s][n]:.4g}s (solve {solve_times[s][n]:.4g}s)" for s in runs),
              flush=True)

    side_times: dict[int, float] = {}
    for n in (SIDE_QUICK if args.quick else SIDE_SIZES):  # exact side-tensor program (solvers.side_tensors)
        c = side_instance(n, seed=n)
        ts = [solve(c, "dp2").solve_seconds for _ in range(args.repeats)]
        side_times[n] = statistics.median(ts)
        print(f"side tensors, n={n:>6}: dp2 solve {side_times[n]:.4g}s ({len(c.side)} side tensors)", flush=True)

    slopes = {}
    for s in sizes:
        ns = [n for n in sizes[s] if n >= (FIT_FROM[s] if not args.quick else 0)]
        slopes[s] = fit_slope(ns, [times[s][n] for n in ns])

    meta = dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        cpus=__import__("os").cpu_count(),
        python=platform.python_version(),
        numpy=np.__version__,
        numba=__import__("numba").__version__,
        command=command_line(),
        repeats=args.repeats,
        **code_version(),
    )
    result = dict(meta=meta, seconds={s: {str(n): t for n, t in v.items()} for s, v in times.items()},
                  solve_seconds={s: {str(n): t for n, t in v.items()} for s, v in solve_times.items()},
                  slopes=slopes, peaks_agree_at=sorted(agree),
                  side_solve_seconds={str(n): t for n, t in side_times.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "latest-quick" if args.quick else "latest"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")

    print()
    print("| solver | " + " | ".join(f"n={n:,}" for n in all_n) + " | slope |")
    print("|---|" + "---|" * (len(all_n) + 1))
    for s in sizes:
        cells = [f"{times[s][n]:.3g} s" if n in times[s] else "" for n in all_n]
        print(f"| {s} | " + " | ".join(cells) + f" | {slopes[s]:.2f} |")
    print("\nwith side tensors (dp2, whole solve()): " + ", ".join(f"n={n:,}: {t:.3g} s" for n, t in side_times.items()))
    print("\nwhole solve() (tie-break included):")
    print("| solver | " + " | ".join(f"n={n:,}" for n in all_n) + " |")
    print("|---|" + "---|" * len(all_n))
    for s in sizes:
        cells = [f"{solve_times[s][n]:.3g} s" if n in solve_times[s] else "" for n in all_n]
        print(f"| {s} | " + " | ".join(cells) + " |")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print("matplotlib not installed: skipped the PNG (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for s, marker in zip(sizes, "osd"):
        ns = sorted(times[s])
        line = ax.loglog(ns, [times[s][n] for n in ns], marker=marker, label=f"{s} (slope {slopes[s]:.2f})")[0]
        ax.loglog(ns, [solve_times[s][n] for n in ns], marker=marker, ls=":", color=line.get_color(),
                  mfc="none", alpha=0.7)
    ax.set_xlabel("n (layers)")
    ax.set_ylabel("solve time (s), median")
    ax.set_title("Solver time against n, random additive instances\n"
                 "solid: optimum pass; dotted: whole solve() with the tie-break", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, f"{meta['command']} | {meta['date']} | {meta['cpus']} CPUs", fontsize=6, alpha=0.7)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)
    print(f"wrote {args.out / (stem + '.json')} and .png")


if __name__ == "__main__":
    main()
