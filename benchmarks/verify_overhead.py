"""What the plan check costs: ``optimize_checkpoints`` with and without its fake training step.

Before it returns, ``optimize_checkpoints`` runs one training step through the rewritten
module on a fake-tensor copy (``ckptopt.api._verify_training_step``), so that a plan that
would fail at the first training call fails while planning. This measures the planning time
with the step and with it replaced by a no-op, alternating the two, ``--repeats`` times each
(after one warm-up call), and reports medians and their ratio, measured side by side in one
run. The models: zoo ResNet-50 (8×3×96²), a 24-block zoo GPT (width 128, 2×128 tokens), and when transformers is
installed a 4-layer Llama (width 256, batch 2×128) planned through the export front end.

Writes ``benchmarks/results/verify_overhead/latest.json``.
Run: ``python -m benchmarks.verify_overhead [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import ckptopt.api as api
from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import optimize_checkpoints, zoo


def _models():
    model, x = zoo.get("resnet50", batch_size=8, input_size=96)
    yield "resnet50 b8 96²", model.train(), x
    model, x = zoo.get("gpt", batch_size=2, input_size=128, depth=24, width=128, heads=4, seq_len=128, vocab=1000)
    yield "gpt 24 blocks w128 2x128", model.train(), x
    try:
        import transformers
    except ImportError:
        return
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    yield "llama 4 layers 2x128", transformers.LlamaForCausalLM(cfg).train(), {"input_ids": ids, "labels": ids}


def _plan_seconds(model, x, verify: bool) -> float:
    real = api._verify_training_step
    if not verify:
        api._verify_training_step = lambda *args, **kwargs: None
    try:
        t = time.perf_counter()
        optimize_checkpoints(model, x, in_place=False)
        return time.perf_counter() - t
    finally:
        api._verify_training_step = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for name, model, x in _models():
        _plan_seconds(model, x, True)  # warm-up (numba, first fake-tensor calls)
        on, off = [], []
        for _ in range(args.repeats):
            off.append(_plan_seconds(model, x, False))
            on.append(_plan_seconds(model, x, True))
        row = dict(model=name, without_s=round(statistics.median(off), 3), with_s=round(statistics.median(on), 3),
                   ratio=round(statistics.median(on) / statistics.median(off), 3))
        print(f"{name:24s} without {row['without_s']:.3f} s  with {row['with_s']:.3f} s  x{row['ratio']:.2f}", flush=True)
        rows.append(row)
    out = result_path("verify_overhead")
    write_json(out, dict(meta=run_metadata("verify_overhead"), repeats=args.repeats, rows=rows))
    print("wrote", out)


if __name__ == "__main__":
    main()
