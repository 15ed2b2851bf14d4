"""What cuts crossed by several tensors buy: the optimal plan with single-tensor cuts against the
default (``max_crossing=8``, docs/design.md §4), both measured.

For each model: trace at ``max_crossing=1`` and at the default, solve with the default policy
(``solve(costs, "auto")``: lowest peak, then least recomputation), and measure each plan's peak
on a fake-tensor copy of the rewritten model under the exact storage tracker
(``measure_plans_fake``), with the no-checkpointing peak. Reports layers, side tensors, trace and
solve seconds, predicted and measured peaks (the 8 bytes of the scalar loss and its gradient are
the only expected difference) and the gain of the default over single-tensor cuts.

    python -m benchmarks.crossing_gain [--quick]

writes benchmarks/results/crossing_gain/latest.json (``--quick``: ``latest-quick.json``) and prints one
line per model.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import Plan, simulate, solve, trace, zoo
from ckptopt.measure import measure_plans_fake
from ckptopt.tracer.cuts import MAX_CROSSING
from tests.test_dag_exactness import CASES

SMALL = ("resnet-like", "densenet-like", "unet-like", "gpt")
ZOO = {
    "resnet50": dict(batch_size=2, input_size=64),
    "densenet121": dict(batch_size=2, input_size=64),
    "unet": dict(batch_size=2, input_size=64, base=16),
}
HF = ("T5ForConditionalGeneration", "BartForConditionalGeneration", "GPTNeoXForCausalLM",
      "CLIPForImageClassification", "LlamaForCausalLM")


def _loss(out):
    return out.float().pow(2).mean()


def one(model, inputs, loss_fn, crossing: int) -> dict:
    t0 = time.perf_counter()
    tm = trace(model, inputs, loss_fn=loss_fn, max_crossing=crossing)
    t1 = time.perf_counter()
    plan = solve(tm.costs, "auto")
    t2 = time.perf_counter()
    none = Plan((), simulate(tm.costs, ()).peak_bytes, "none", 0.0, tm.n)
    measured = measure_plans_fake(model, inputs, tm, [plan, none], loss_fn=loss_fn)
    return dict(max_crossing=crossing, layers=tm.n, side_tensors=len(tm.costs.side),
                trace_seconds=round(t1 - t0, 2), solve_seconds=round(t2 - t1, 2), solver=plan.solver,
                checkpoints=len(plan.checkpoints), predicted=int(plan.peak_bytes), measured=int(measured[0]),
                none_predicted=int(none.peak_bytes), none_measured=int(measured[1]))


def row(name: str, model, inputs, loss_fn=None, **extra) -> dict:
    single = one(model, inputs, loss_fn, 1)
    several = one(model, inputs, loss_fn, MAX_CROSSING)
    out = dict(model=name, single=single, several=several, **extra,
               gain_percent=round(100.0 * (single["measured"] - several["measured"]) / single["measured"], 2))
    print(f"{name:34s} layers {single['layers']:4d} -> {several['layers']:4d}  measured "
          f"{single['measured']:>13,} -> {several['measured']:>13,} B ({-out['gain_percent']:+.2f}%)  "
          f"predicted-measured {single['predicted'] - single['measured'] + 8:+d} / "
          f"{several['predicted'] - several['measured'] + 8:+d} B", flush=True)
    return out


def hf_model(name: str):
    from benchmarks.hf_sweep import build

    task = {"T5ForConditionalGeneration": "seq2seq", "BartForConditionalGeneration": "seq2seq",
            "CLIPForImageClassification": "image"}.get(name, "causal")
    model, batch, _ = build(name, task, 32 if task == "image" else None)
    return model, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small DAGs only")
    ap.add_argument("--out", help="default benchmarks/results/crossing_gain/latest.json (latest-quick.json with "
                    "--quick)")
    args = ap.parse_args()
    args.out = args.out or result_path("crossing_gain", "quick" if args.quick else None)
    rows = []
    for name in SMALL:
        torch.manual_seed(0)
        model, inputs = CASES[name]()
        rows.append(row(name, model, inputs, _loss))
    if not args.quick:
        for name, kw in ZOO.items():
            torch.manual_seed(0)
            model, inputs = zoo.get(name, **kw)
            rows.append(row(name, model, inputs, _loss, zoo_args=kw))
        for name in HF:
            torch.manual_seed(0)
            model, batch = hf_model(name)  # the model's own loss (the batch carries labels)
            rows.append(row(f"hf:{name}", model, batch, None, config="benchmarks.hf_sweep scale"))
    result = dict(run_metadata("crossing_gain"), max_crossing=MAX_CROSSING, rows=rows)
    write_json(args.out, result)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
