"""HuggingFace transformers: ckptopt against transformers' own activation checkpointing.

For GPT-2, Llama and BERT built from config objects (no weights; dropout on; batch
as a collator yields it, the model's own loss from ``labels``), four ways to train:

* ``none``: the model as it is;
* ``hf``: ``model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})``
  (``gradient_checkpointing_enable``, its deprecated name, on transformers < 5), every decoder
  layer checkpointed (what these users run today);
* ``ckptopt``: ``optimize_checkpoints(model, batch)``, the default (lowest peak);
* ``ckptopt-budget``: ``optimize_checkpoints(model, batch, budget=<hf's measured peak>)``:
  the least recomputation at transformers' own peak.

For each: the measured peak of one training step (CPU: the exact storage tracker;
CUDA: ``max_memory_allocated``), the predicted peak (ckptopt's plans), the
recomputation (share of a step, 3 x forward, from the traced FLOPs; for ``hf``
the forward of every decoder layer) and the step time: median of ``--rounds``
interleaved rounds, each running every variant once, after one warm-up step.

Writes ``benchmarks/results/hf_models/latest.json`` (``latest-<device>.json`` with ``--device cuda``,
``-quick`` added with ``--quick``). Run: ``python -m benchmarks.hf_models`` (``--device cuda`` on a GPU;
``--quick`` for 2 rounds).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.harness import (device_label, hf_checkpointing_disable, hf_checkpointing_enable,  # noqa: E402
                                result_path, run_metadata, write_json)
from ckptopt import measure_peak, optimize_checkpoints  # noqa: E402
from ckptopt.zoo.hf import get_hf  # noqa: E402

# The sizes: 6 layers, width 256, batch 4, sequence 256, vocabulary 2048.
CONFIGS = {
    "GPT2LMHeadModel": dict(n_layer=6, n_embd=256, n_head=4, vocab_size=2048, n_positions=512),
    "LlamaForCausalLM": dict(num_hidden_layers=6, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512),
    "BertForMaskedLM": dict(num_hidden_layers=6, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                            vocab_size=2048, max_position_embeddings=512),
}
BLOCKS = {"GPT2LMHeadModel": ".h.", "LlamaForCausalLM": ".layers.", "BertForMaskedLM": ".layer."}


def _hf_recompute_share(opt, name: str) -> float:
    """transformers re-runs the forward of every decoder layer: their FLOPs over 3 forward passes."""
    flops = [(layer.name, layer.flops) for layer in opt.traced.layers]
    blocks = sum(f for n, f in flops if BLOCKS[name] in n)
    return blocks / (3 * sum(f for _, f in flops))


def _step(model, batch):
    out = model(**batch)
    out.loss.backward()
    del out
    for p in model.parameters():
        p.grad = None


def run_model(name: str, batch: int, seq: int, rounds: int, device: str) -> dict:
    model, data = get_hf(name, batch, seq, CONFIGS[name])
    model.to(device)
    data = {k: v.to(device) for k, v in data.items()}
    planned = copy.deepcopy(model)  # planned in place: the unmodified model and HF's checkpointing keep ``model``
    t0 = time.perf_counter()
    opt = optimize_checkpoints(planned, data)
    plan_seconds = time.perf_counter() - t0
    rows = {"none": dict(measured_peak_bytes=measure_peak(model, data), recompute_share=0.0)}
    hf_checkpointing_enable(model)
    rows["hf"] = dict(measured_peak_bytes=measure_peak(model, data), recompute_share=_hf_recompute_share(opt, name))
    hf_checkpointing_disable(model)
    rows["ckptopt"] = dict(measured_peak_bytes=measure_peak(opt, data), predicted_peak_bytes=opt.predicted_peak_bytes,
                           recompute_share=_share(opt), plan=list(opt.plan.checkpoints), stored=list(opt.plan.stored),
                           solver=opt.plan.solver, plan_seconds=plan_seconds)
    budget = optimize_checkpoints(copy.deepcopy(model), data, budget=rows["hf"]["measured_peak_bytes"])
    rows["ckptopt-budget"] = dict(measured_peak_bytes=measure_peak(budget, data),
                                  predicted_peak_bytes=budget.predicted_peak_bytes, recompute_share=_share(budget),
                                  plan=list(budget.plan.checkpoints), stored=list(budget.plan.stored),
                                  budget_bytes=rows["hf"]["measured_peak_bytes"])
    # step time: interleaved rounds, every variant once per round, after a warm-up step each
    variants = {"none": (model, False), "hf": (model, True), "ckptopt": (opt, False), "ckptopt-budget": (budget, False)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 1):
        for key, (module, hf_ckpt) in variants.items():
            if hf_ckpt:
                hf_checkpointing_enable(model)
            torch.manual_seed(r)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            _step(module, data)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if r:  # round 0 is the warm-up
                times[key].append(time.perf_counter() - t)
            if hf_ckpt:
                hf_checkpointing_disable(model)
    base = statistics.median(times["none"])
    for key, row in rows.items():
        row["step_seconds"] = statistics.median(times[key])
        row["step_time_vs_none"] = row["step_seconds"] / base
    return dict(model=name, batch=batch, seq=seq, config=CONFIGS[name], layers=opt.traced.n,
                front_end=opt.traced.capture.front_end, rows=rows)


def _share(opt) -> float:
    from ckptopt import simulate

    return simulate(opt.traced.costs, opt.plan.checkpoints, opt.plan.stored).recompute_share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="*", default=list(CONFIGS))
    ap.add_argument("--out", help="default benchmarks/results/hf_models/latest[-<device>][-quick].json")
    args = ap.parse_args()
    label = "-".join(([] if args.device == "cpu" else [device_label(args.device)]) + (["quick"] if args.quick else []))
    args.out = args.out or result_path("hf_models", label or None)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    rounds = 2 if args.quick else args.rounds
    results = [run_model(m, args.batch, args.seq, rounds, args.device) for m in args.models]
    meta = run_metadata("hf_models", args.device)
    meta.update(transformers=transformers.__version__, rounds=rounds)
    write_json(args.out, dict(meta=meta, results=results))
    mib = 2.0 ** 20
    print(f"| model | variant | measured MiB | predicted MiB | pred. error | vs HF ckpt | recompute | step time / none |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        hf = res["rows"]["hf"]["measured_peak_bytes"]
        for key, row in res["rows"].items():
            pred = row.get("predicted_peak_bytes")
            err = f"{100 * (row['measured_peak_bytes'] - pred) / pred:+.3f}%" if pred else "–"
            print(f"| {res['model']} | {key} | {row['measured_peak_bytes'] / mib:.1f} | "
                  f"{pred / mib if pred else float('nan'):.1f} | {err} | "
                  f"{100 * (row['measured_peak_bytes'] - hf) / hf:+.1f}% | {100 * row['recompute_share']:.1f}% | "
                  f"{row['step_time_vs_none']:.2f} |")


if __name__ == "__main__":
    main()
