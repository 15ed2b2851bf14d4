"""Fine-tuning through HF's Trainer: ckptopt against HF's own checkpointing, full and LoRA.

For each architecture (Llama, GPT-2 and T5, small configurations built from their config
classes, no weights) and each way of fine-tuning (every weight; LoRA on the attention
projections; LoRA on every linear layer, PEFT 0.21), one ``Trainer`` run per variant, with
default ``TrainingArguments`` but for the step count and batch size (AdamW, the model's own
loss, ``default_data_collator``):

* ``none``: the unmodified model;
* ``hf-1``, ``hf-2``: ``activation_checkpointing_enable(every_n_layers=1 | 2)``, non-reentrant
  (for PEFT models, on the wrapped transformers model, as PEFT's docs do);
* ``ckptopt``: ``optimize_checkpoints(model, batch)``: the model itself with the plan
  attached, handed to ``Trainer`` as it is;
* ``ckptopt-at-hf``: ``optimize_checkpoints(model, batch, budget=<hf-1's forward + backward peak>)``
  (``measure_peak`` of the same call with HF's checkpointing): the least recomputation at HF's peak.

Each run takes ``1 + 1 + 1 + --timed`` steps: a warm-up (AdamW's state is allocated; ckptopt
plans Trainer's call, which adds ``num_items_in_batch``), one step under the exact storage
tracker (parameters, buffers, gradients and AdamW state registered at its start: the peak is
the whole step's, optimizer step included; the batch, made before the step, is not counted),
one under ``FlopCounterMode`` (recomputation = the step's FLOPs less ``none``'s), and the timed
steps (median of ``on_step_begin`` .. ``on_step_end``; the machine is shared, so the ratios of
one run matter, not the seconds). For ckptopt, the forward + backward peak it predicted is
checked against ``measure_peak`` of the same call.

Run: ``python -m benchmarks.finetune_stack`` (about 5 minutes on 2 cores; ``--quick``: one
architecture, written to ``latest-quick.json``); writes ``benchmarks/results/finetune_stack/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

from benchmarks.harness import result_path, run_metadata, write_json

ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(num_hidden_layers=6, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512),
              ["q_proj", "v_proj"]),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(n_layer=6, n_embd=256, n_head=4, vocab_size=2048, n_positions=512),
             ["c_attn"]),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(num_layers=3, num_decoder_layers=3, d_model=256, d_ff=704, num_heads=4, d_kv=64,
                vocab_size=2048, decoder_start_token_id=0, pad_token_id=0),
           ["q", "v"]),
}
MODES = ("full", "lora-attention", "lora-all-linear")
VARIANTS = ("none", "hf-1", "hf-2", "ckptopt", "ckptopt-at-hf")


def build(arch: str, mode: str, seed: int = 0):
    import transformers

    cls, cfg_cls, cfg, attention = ARCHS[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**cfg, use_cache=False)).train()
    if mode != "full":
        from peft import LoraConfig, get_peft_model

        targets = attention if mode == "lora-attention" else "all-linear"
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
    return model


def dataset(arch: str, batch: int, seq: int, rows: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ARCHS[arch][2].get("vocab_size", 2048), (rows, seq), generator=g)
    data = {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.tolist()}
    return Dataset.from_dict(data)


def hf_model(model):
    """The transformers model inside a PEFT model (or the model itself)."""
    return model.base_model.model if hasattr(model, "peft_config") else model


def run(arch: str, mode: str, variant: str, batch: int, seq: int, timed: int) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator
    from torch.utils.flop_counter import FlopCounterMode

    from ckptopt import StorageTracker, measure_peak, optimize_checkpoints, simulate

    steps = 3 + timed
    ds = dataset(arch, batch, seq, batch * steps)
    model = build(arch, mode)
    example = default_data_collator([ds[i] for i in range(batch)])
    row: dict = dict(arch=arch, mode=mode, variant=variant,
                     trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad))
    if variant.startswith("hf-"):
        hf_model(model).activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                        every_n_layers=int(variant[3:]))
    elif variant.startswith("ckptopt"):
        budget = None
        if variant == "ckptopt-at-hf":
            hf = build(arch, mode)
            hf_model(hf).activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            call = dict(example, num_items_in_batch=(example["labels"][:, 1:] != -100).sum())  # Trainer's call
            budget = row["budget_bytes"] = int(measure_peak(hf, call))
            del hf
        t = time.perf_counter()
        model = optimize_checkpoints(model, example, budget=budget)
        row.update(plan_seconds=time.perf_counter() - t, predicted_fwd_bwd_bytes=int(model.predicted_peak_bytes),
                   recompute_share_predicted=simulate(model.traced.costs, model.plan.checkpoints,
                                                      model.plan.stored).recompute_share,
                   layers=model.traced.n, checkpoints=list(model.plan.checkpoints))

    class Probe(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.mode = None

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            step = state.global_step  # steps done so far
            if step == 1:
                self.mode = StorageTracker()
                self.mode.register(model)
                self.mode.register(*[t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)])
            elif step == 2:
                self.mode = FlopCounterMode(display=False)
            if self.mode is not None:
                self.mode.__enter__()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            elapsed = time.perf_counter() - self.t
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                if isinstance(self.mode, StorageTracker):
                    row["step_peak_bytes"] = int(self.mode.peak_bytes)
                else:
                    row["step_flops"] = int(self.mode.get_total_flops())
                self.mode = None
            elif state.global_step > 3:
                self.times.append(elapsed)

    probe = Probe()
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(out, per_device_train_batch_size=batch, max_steps=steps, report_to=[],
                                 save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
                                 dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator,
                          callbacks=[probe])
        trainer.train()
    row["step_seconds"] = statistics.median(probe.times)
    if variant.startswith("ckptopt"):
        model.zero_grad(set_to_none=True)
        row["measured_fwd_bwd_bytes"] = int(measure_peak(model, example))
        row["prediction_error"] = row["measured_fwd_bwd_bytes"] / row["predicted_fwd_bwd_bytes"] - 1
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="*", default=list(ARCHS))
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--timed", type=int, default=3, help="timed steps per run (median)")
    ap.add_argument("--quick", action="store_true", help="Llama only")
    ap.add_argument("--out", help="default benchmarks/results/finetune_stack/latest.json (latest-quick.json with "
                    "--quick)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of --out for the architectures not run now (each row keeps its command)")
    args = ap.parse_args(argv)
    args.out = args.out or result_path("finetune_stack", "quick" if args.quick else None)
    archs = ["llama"] if args.quick else args.archs
    rows = []
    for arch in archs:
        for mode in args.modes:
            group = {}
            for variant in VARIANTS:
                try:
                    group[variant] = run(arch, mode, variant, args.batch, args.seq, args.timed)
                except Exception as exc:  # noqa: BLE001 - recorded, the other runs go on
                    group[variant] = dict(arch=arch, mode=mode, variant=variant,
                                          error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            base = group["none"]
            for variant, row in group.items():
                if "step_peak_bytes" in row and "step_peak_bytes" in base:
                    row["peak_vs_none"] = row["step_peak_bytes"] / base["step_peak_bytes"]
                    row["recompute_flops"] = row["step_flops"] - base["step_flops"]
                    row["recompute_share"] = row["recompute_flops"] / base["step_flops"]
                    row["step_time_vs_none"] = row["step_seconds"] / base["step_seconds"]
                for hf in ("hf-1", "hf-2"):
                    if "step_peak_bytes" in row and "step_peak_bytes" in group[hf]:
                        row[f"peak_vs_{hf}"] = row["step_peak_bytes"] / group[hf]["step_peak_bytes"]
                rows.append(row)
                print(json.dumps({k: row.get(k) for k in ("arch", "mode", "variant", "step_peak_bytes",
                                                          "peak_vs_hf-1", "recompute_share", "step_time_vs_none",
                                                          "prediction_error", "error")}), flush=True)
    meta = run_metadata("finetune_stack")
    for row in rows:
        row["command"] = meta["command"]
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            kept = [r for r in json.load(f)["rows"] if (r["arch"], r["mode"]) not in {(a, m) for a in archs
                                                                                     for m in args.modes}]
        rows = kept + rows
    write_json(args.out, dict(meta=meta, batch=args.batch, seq=args.seq, rows=rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
