"""Predicted against measured peak on random models: how often is the chain model exact?

The CI fuzz test (``tests/test_fuzz.py``) checks that random models train identically
after rewriting and that the measured peak stays within 5% of the prediction. This
benchmark asks the stricter question the README's "exact to the byte" claim rests on:
for each random model (``tests/common/fuzz.py``) it traces, takes the plans of ``dp2``,
the default (``dp2`` + stored segments), ``every``, no checkpointing and a few random
plans with random stored segments, runs one real step of the rewritten module under the
exact storage tracker (``measure_peak``) and records measured minus predicted bytes.
A gap of 0 to 8 bytes is the scalar loss and its gradient (left out of the model);
above is an under-prediction, below an over-prediction.

Two families of random models (``--family``, default ``all``: drawn in turn):

* ``chain``: ``specs()``, chains and DAGs of up to 10 ops (short skips, branches that rejoin);
* ``stream``: ``stream_specs()``, models where several tensors cross layer boundaries (two
  towers joined at the end, an encoder output read by every decoder step, long skips), traced
  with ``trace``'s default cuts (several tensors per cut, docs/design.md §4).

Writes ``benchmarks/results/exactness_fuzz/latest.json`` (a summary per family and every inexact
case with its model spec, to replay with ``build(spec, seed)``; ``family`` and ``kind`` say which
generator drew it) and prints the summary. The models are drawn by hypothesis' ``example()``, which is
not seeded: each run sees other models::

    python -m benchmarks.exactness_fuzz --minutes 10 --seed 0 --family stream

Every model a run finds inexact on some plan is added, with those plans, to
``benchmarks/data/recorded_fuzz_models.json`` (``--no-record``: not). ``--replay`` replays, on the
current code, every model recorded there (or, given result files, every model those recorded as
inexact: a fuzz run's, or a replay's own output; each spec and seed once) with its recorded plans and
``--plans`` random plans (seeded, no stored segments), and prints each model's inexact plans (measured
minus predicted, the phase and layer the prediction peaks in); ``--out`` (default
``benchmarks/results/exactness_fuzz/latest-replay.json``) gets one record per model::

    python -m benchmarks.exactness_fuzz --replay --plans 24
"""

from __future__ import annotations

import argparse
import json
import random
import time
import warnings
from pathlib import Path

from benchmarks.harness import DATA, result_path, run_metadata, write_json

RECORDED = DATA / "recorded_fuzz_models.json"


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


def _summary(rows: list, cases: list, errors: list) -> dict:
    gaps = [c["gap"] for c in cases]
    return dict(models=len({r[0] for r in rows}), plans=len(rows), exact=sum(1 for r in rows if r[1]),
                under_predicted=sum(1 for g in gaps if g > 8), over_predicted=sum(1 for g in gaps if g < 0),
                largest_under=max([g for g in gaps if g > 8], default=0),
                largest_over=min([g for g in gaps if g < 0], default=0),
                largest_under_share=max([c["gap"] / c["predicted"] for c in cases if c["gap"] > 8], default=0.0),
                largest_over_share=min([c["gap"] / c["predicted"] for c in cases if c["gap"] < 0], default=0.0),
                models_inexact=len({(c["spec"], c["seed"]) for c in cases}), errors=len(errors))


def inexact_models(paths: list) -> dict:
    """``{(spec, seed): dict(source=file name, plans={(n, checkpoints, stored), ...})}``: every model the
    files record as inexact, with the plans it was inexact on. A file is the record of recorded models
    (``recorded_models``), a fuzz run's result (``cases``) or a replay's (``models``, their ``inexact``
    plans)."""
    models: dict = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "recorded_models" in data:
            for m in data["recorded_models"]:
                plans = models.setdefault((m["spec"], m["seed"]), dict(source=m["source"], plans=set()))["plans"]
                plans.update((n, tuple(cps), tuple(st)) for n, cps, st in m["plans"])
            continue
        cases = data["cases"] if "cases" in data else [
            dict(spec=m["spec"], seed=m["seed"], n=m["n"], checkpoints=c["checkpoints"], stored=c["stored"])
            for m in data["models"] for c in m["inexact"]]
        for c in cases:
            plans = models.setdefault((c["spec"], c["seed"]), dict(source=Path(path).name, plans=set()))["plans"]
            plans.add((c["n"], tuple(c["checkpoints"]), tuple(c["stored"])))
    return models


def record_inexact(found: dict, source: str, path: Path = RECORDED) -> int:
    """Add the models of ``found`` (as :func:`inexact_models` returns) to the record at ``path``, each
    spec and seed once, their plans merged; returns how many models were new."""
    data = json.loads(path.read_text()) if path.exists() else dict(recorded_models=[])
    index = {(m["spec"], m["seed"]): m for m in data["recorded_models"]}
    new = 0
    for (spec, seed), info in found.items():
        m = index.get((spec, seed))
        if m is None:
            m = index[(spec, seed)] = dict(seed=seed, source=source, plans=[], spec=spec)
            data["recorded_models"].append(m)
            new += 1
        plans = {(n, tuple(cps), tuple(st)) for n, cps, st in m["plans"]} | info["plans"]
        m["plans"] = [[n, list(cps), list(st)] for n, cps, st in sorted(plans)]
    write_json(path, data)
    return new


def replay(paths: list, n_plans: int, out: str, record: bool = True) -> int:
    """``--replay``: each inexact model of ``paths`` on the current code (see the module docstring)."""
    warnings.filterwarnings("ignore")
    from ckptopt import Plan, apply_plan, simulate
    from ckptopt.measure import measure_peak
    from ckptopt.tracer import trace
    from tests.common.fuzz import Node, Spec, build  # noqa: F401 (Node and Spec: the recorded reprs)

    models = inexact_models(paths)
    print(f"replaying {len(models)} models", flush=True)
    meta = run_metadata("exactness_fuzz")
    records = []
    for (spec_repr, seed), info in models.items():
        model, x = build(eval(spec_repr), seed=seed)
        model.train()
        tm = trace(model, (x,))
        every = [tuple(j for j in range(1, tm.n) if m >> (j - 1) & 1) for m in range(1 << (tm.n - 1))]
        random.Random(seed).shuffle(every)
        # (the recorded plans where the model still has as many layers: a merge renumbers them)
        todo = sorted({(cps, st) for n, cps, st in info["plans"] if n == tm.n} | {(cps, ()) for cps in every[:n_plans]})
        inexact = []
        for cps, stored in todo:
            sim = simulate(tm.costs, cps, stored)
            opt = apply_plan(model, tm, Plan(cps, sim.peak_bytes, "given", 0.0, tm.n, stored))
            try:
                gap = measure_peak(opt, (x,)) - sim.peak_bytes
            finally:
                opt.remove_hooks()
            if not 0 <= gap <= 8:
                inexact.append(dict(checkpoints=list(cps), stored=list(stored), gap=gap, phase=sim.phase,
                                    layer=sim.layer))
        worst = min((c["gap"] for c in inexact), key=lambda g: -abs(g), default=0)
        print(f"{seed:>10} {info['source']:<34} n {tm.n:>2}  plans {len(todo):>3}  inexact {len(inexact):>3}"
              f"  (under {sum(c['gap'] > 8 for c in inexact)}, worst {worst:+d} B)", flush=True)
        records.append(dict(seed=seed, source=info["source"], n=tm.n, plans=len(todo), inexact=inexact,
                            spec=spec_repr))
    write_json(out, dict(meta=meta, replayed=[str(p) for p in paths], plans_per_model=n_plans, models=records))
    print(f"{len(records)} models, {sum(not r['inexact'] for r in records)} exact on every plan replayed")
    if record:
        record_inexact(inexact_models([out]), Path(out).name)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=("all", "chain", "stream"), default="all",
                    help="which generator draws the models: specs() (chain), stream_specs() (stream), or both in turn")
    ap.add_argument("--out", help="default benchmarks/results/exactness_fuzz/latest.json (latest-replay.json "
                    "with --replay)")
    ap.add_argument("--replay", nargs="*", metavar="JSON",
                    help="replay every recorded inexact model (benchmarks/data/recorded_fuzz_models.json), or the "
                    "inexact models of the result files given")
    ap.add_argument("--plans", type=int, default=24, help="random plans per replayed model (default 24)")
    ap.add_argument("--no-record", dest="record", action="store_false",
                    help="do not add the inexact models found to benchmarks/data/recorded_fuzz_models.json")
    args = ap.parse_args(argv)
    if args.replay is not None:
        return replay(args.replay or [str(RECORDED)], args.plans, args.out or result_path("exactness_fuzz", "replay"),
                      args.record)
    args.out = args.out or result_path("exactness_fuzz")
    meta = run_metadata("exactness_fuzz")
    warnings.filterwarnings("ignore")
    import hypothesis

    from ckptopt import Plan, apply_plan, simulate
    from ckptopt.measure import measure_peak
    from ckptopt.tracer import trace
    from tests.common.fuzz import build, specs, stream_specs

    generators = {"chain": specs, "stream": stream_specs}
    families = list(generators) if args.family == "all" else [args.family]
    rng = random.Random(args.seed)
    deadline = time.time() + 60 * args.minutes
    rows = {f: [] for f in families}  # (model number, exact) per plan
    cases = {f: [] for f in families}
    errors = {f: [] for f in families}
    models = 0
    while time.time() < deadline:
        family = families[models % len(families)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hypothesis.errors.NonInteractiveExampleWarning)
            spec = generators[family]().example()
        seed = rng.randrange(1 << 30)
        models += 1
        try:
            model, x = build(spec, seed=seed)
            model.train()
            tm = trace(model, (x,))
            todo = sorted(plans_for(tm.costs, tm.n, rng))
        except Exception as exc:  # recorded, not fatal: a model the tracer or a solver refuses
            errors[family].append(dict(spec=repr(spec), seed=seed, error=f"{type(exc).__name__}: {exc}"[:500]))
            continue
        for cps, stored in todo:
            pred = simulate(tm.costs, cps, stored).peak_bytes
            opt = apply_plan(model, tm, Plan(cps, pred, "given", 0.0, tm.n, stored))
            try:
                gap = measure_peak(opt, (x,)) - pred
            finally:
                opt.remove_hooks()
            rows[family].append((models, 0 <= gap <= 8))
            if 0 <= gap <= 8:
                continue
            cases[family].append(dict(gap=gap, predicted=pred, checkpoints=list(cps), stored=list(stored),
                                      family=family, kind=spec.kind or family, n=tm.n,
                                      side=len(tm.costs.side), spec=repr(spec), seed=seed))
    summary = {f: _summary(rows[f], cases[f], errors[f]) for f in families}
    for f in families:
        kinds = sorted({c["kind"] for c in cases[f]})
        summary[f]["inexact_by_kind"] = {k: sum(1 for c in cases[f] if c["kind"] == k) for k in kinds}
    summary["run"] = dict(minutes=args.minutes, seed=args.seed, family=args.family)
    write_json(args.out, dict(meta=meta, summary=summary, cases=[c for f in families for c in cases[f]],
                              errors=[dict(e, family=f) for f in families for e in errors[f]]))
    print(json.dumps(summary, indent=1))
    if args.record:
        new = record_inexact(inexact_models([args.out]), Path(args.out).name)
        print(f"{new} inexact models added to {RECORDED.relative_to(RECORDED.parents[2])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
