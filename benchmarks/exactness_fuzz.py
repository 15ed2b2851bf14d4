"""Predicted against measured peak on random models: how often is the chain model exact?

The CI fuzz test (``tests/test_fuzz.py``) checks that random models train identically
after rewriting and that the measured peak stays within 5% of the prediction. This
benchmark asks the stricter question the README's "exact to the byte" claim rests on:
for each random model (``tests/common/fuzz.py``) it traces, takes the plans of ``dp2``,
the default (``dp2`` + stored segments), ``every``, no checkpointing and a few random
plans with random stored segments, runs one real step of the rewritten module under the
exact storage tracker (``measure_peak``) and records measured minus predicted bytes.
A gap of 0 to 8 bytes is the scalar loss and its gradient (left out of the model);
above is an under-prediction, below an over-prediction. Writes
``benchmarks/results/exactness_fuzz.json`` (every inexact case with its model spec, to
replay with ``build(spec, seed)``) and prints a summary. The models are drawn by
hypothesis' ``example()``, which is not seeded: each run sees other models::

    python benchmarks/exactness_fuzz.py --minutes 10 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.common.fuzz: the random-model generator


def plans_for(costs, n: int, rng: random.Random) -> set:
    from ckptopt import solve
    from ckptopt.solvers import improve_with_stored

    dp2 = solve(costs, "dp2")
    auto = improve_with_stored(costs, dp2)
    out = {(dp2.checkpoints, ()), (auto.checkpoints, auto.stored), (solve(costs, "every").checkpoints, ()),
           ((), ())}
    for _ in range(4):
        cps = tuple(sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))) if n > 1 else ()
        out.add((cps, tuple(s for s in ((0,) + cps)[:-1] if rng.random() < 0.3)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "exactness_fuzz.json"))
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import hypothesis

    from ckptopt import Plan, apply_plan, simulate
    from ckptopt.measure import measure_peak
    from ckptopt.tracer import trace
    from tests.common.fuzz import build, specs

    rng = random.Random(args.seed)
    deadline = time.time() + 60 * args.minutes
    models = plans = 0
    exact = under = over = 0
    cases = []
    while time.time() < deadline:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hypothesis.errors.NonInteractiveExampleWarning)
            spec = specs().example()
        seed = rng.randrange(1 << 30)
        model, x = build(spec, seed=seed)
        model.train()
        tm = trace(model, (x,))
        for cps, stored in sorted(plans_for(tm.costs, tm.n, rng)):
            pred = simulate(tm.costs, cps, stored).peak_bytes
            opt = apply_plan(model, tm, Plan(cps, pred, "given", 0.0, tm.n, stored))
            try:
                gap = measure_peak(opt, (x,)) - pred
            finally:
                opt.remove_hooks()
            plans += 1
            if 0 <= gap <= 8:
                exact += 1
                continue
            under += gap > 8
            over += gap < 0
            cases.append(dict(gap=gap, predicted=pred, checkpoints=list(cps), stored=list(stored), spec=repr(spec),
                              seed=seed))
        models += 1
    summary = dict(models=models, plans=plans, exact=exact, under_predicted=under, over_predicted=over,
                   largest_under=max([c["gap"] for c in cases if c["gap"] > 0], default=0),
                   largest_over=min([c["gap"] for c in cases if c["gap"] < 0], default=0),
                   largest_under_share=max([c["gap"] / c["predicted"] for c in cases if c["gap"] > 0], default=0.0),
                   largest_over_share=min([c["gap"] / c["predicted"] for c in cases if c["gap"] < 0], default=0.0),
                   minutes=args.minutes, seed=args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(summary=summary, cases=cases), indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
