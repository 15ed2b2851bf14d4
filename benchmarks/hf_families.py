"""HuggingFace model families beyond decoder-only LMs: ckptopt against transformers' own checkpointing.

Five transformers models built from config objects (no weights, no network), all at one
moderate size: 6 layers (encoder-decoders: 6 encoder + 6 decoder layers), width 256,
4 heads, FFN 1024, vocabulary 2048, dropout at the config default, ``use_cache=False``,
``train()`` mode, the model's own ``.loss``:

* ``T5ForConditionalGeneration`` and ``BartForConditionalGeneration``: ``input_ids`` and
  ``attention_mask`` (4, 256), the last 32 tokens of row 0 padded; ``labels`` (4, 64);
* ``WhisperForConditionalGeneration``: ``input_features`` (2, 80, 3000), the 30 s of mel
  frames the encoder requires; ``labels`` (2, 64);
* ``CLIPModel``: contrastive loss (``return_loss=True``), text and vision towers of 6
  layers each, images 64x64 in 8x8 patches; ``input_ids`` and ``attention_mask`` (8, 32),
  the last 8 tokens of row 0 padded, each row ending in the EOS token; ``pixel_values``
  (8, 3, 64, 64);
* ``GPTNeoXForCausalLM``: ``input_ids`` and ``attention_mask`` (4, 256), row 0 padded as
  above, ``labels = input_ids``.

Three ways to train each, every one in a fresh Python process (``harness.run_child``), the model
built after ``torch.manual_seed(0)``:

* ``none``: the model as it is;
* ``hf``: ``model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})``
  (``gradient_checkpointing_enable`` where the model lacks it), every layer checkpointed;
* ``ckptopt``: ``opt = optimize_checkpoints(model, batch)`` with default arguments.

For each: the measured peak of one training step, ``measure_peak`` (forward, ``.loss``,
backward under the exact CPU storage tracker), and the seconds the case took. For
``ckptopt`` also ``predicted_peak_bytes``, the prediction error (measured - predicted) /
measured, the number of checkpoints, and whether ``opt`` trains like the unmodified model:
one step of each (a fresh build, same seed; ``torch.manual_seed`` set right before each
forward, so dropout draws the same masks) compared on the loss and every parameter
gradient (max absolute difference, and whether bit-identical). A case that raises is
recorded with its exception, not fatal.

Writes ``benchmarks/results/hf_families/latest.json`` (``--out``) after every model and prints a
markdown table. Run: ``python -m benchmarks.hf_families`` (about 5 minutes on 2 CPU
cores); ``--only T5ForConditionalGeneration,CLIPModel`` for some models.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

from benchmarks.harness import (child_args, child_record, hf_checkpointing_enable, result_path, run_child,
                                run_metadata, same_training as _same_training, shapes, write_json)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WAYS = ("none", "hf", "ckptopt")

LAYERS, WIDTH, HEADS, FFN, VOCAB = 6, 256, 4, 1024, 2048
SEQ, PAD, TARGET = 256, 32, 64     # text models: sequence 256, row 0 padded over its last 32; labels 64 long
TEXT_IDS = (8, VOCAB - 32)         # drawn token ids avoid the special tokens at both ends

WHISPER_BATCH = 2                  # 1 if a case took over 3 minutes at 2 (see the note)
CLIP_BATCH, CLIP_SEQ, CLIP_PAD, IMAGE, PATCH = 8, 32, 8, 64, 8

CONFIGS = {
    "T5ForConditionalGeneration": dict(d_model=WIDTH, d_ff=FFN, d_kv=WIDTH // HEADS, num_heads=HEADS,
                                       num_layers=LAYERS, num_decoder_layers=LAYERS, vocab_size=VOCAB,
                                       decoder_start_token_id=0),
    "BartForConditionalGeneration": dict(d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                         encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                         encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB,
                                         max_position_embeddings=512),
    # Whisper's default special tokens (50256, 50257) lie beyond a 2048-token vocabulary
    "WhisperForConditionalGeneration": dict(d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                            encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB,
                                            num_mel_bins=80, max_source_positions=1500, max_target_positions=448,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                            decoder_start_token_id=1, begin_suppress_tokens=None,
                                            suppress_tokens=None),
    # CLIP's default BOS/EOS ids (49406, 49407) lie beyond the vocabulary: the last two ids instead
    "CLIPModel": dict(text_config=dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS,
                                       intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=CLIP_SEQ,
                                       pad_token_id=0, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1),
                      vision_config=dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS,
                                         intermediate_size=FFN, image_size=IMAGE, patch_size=PATCH),
                      projection_dim=WIDTH),
    "GPTNeoXForCausalLM": dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS,
                               intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=512),
}


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def build_model(name: str):
    """``transformers.<name>`` from its config class, seed 0, ``use_cache=False``, training mode."""
    import torch

    tf = _transformers()
    cls = getattr(tf, name)
    cfg = cls.config_class(**dict(CONFIGS[name], use_cache=False))
    torch.manual_seed(0)
    return cls(cfg).train()


def _padded_text(gen, batch: int, seq: int, pad: int, pad_id: int):
    import torch

    ids = torch.randint(*TEXT_IDS, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - pad:] = 0
    ids[0, seq - pad:] = pad_id
    return ids, mask


def make_batch(name: str, batch: int | None = None) -> dict:
    """The batch of the module docstring (fixed generator: the same in every process)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    if name in ("T5ForConditionalGeneration", "BartForConditionalGeneration"):
        b = batch or 4
        pad_id = 0 if name.startswith("T5") else 1
        ids, mask = _padded_text(gen, b, SEQ, PAD, pad_id)
        return dict(input_ids=ids, attention_mask=mask, labels=torch.randint(*TEXT_IDS, (b, TARGET), generator=gen))
    if name == "WhisperForConditionalGeneration":
        b = batch or WHISPER_BATCH
        return dict(input_features=torch.randn(b, 80, 3000, generator=gen),
                    labels=torch.randint(*TEXT_IDS, (b, TARGET), generator=gen))
    if name == "CLIPModel":
        b = batch or CLIP_BATCH
        ids, mask = _padded_text(gen, b, CLIP_SEQ, CLIP_PAD, 0)
        ids[:, 0] = VOCAB - 2                               # BOS
        ids[:, -1] = VOCAB - 1                              # EOS at the end of the unpadded rows
        ids[0, CLIP_SEQ - CLIP_PAD - 1] = VOCAB - 1         # and of the padded one
        return dict(input_ids=ids, attention_mask=mask,
                    pixel_values=torch.randn(b, 3, IMAGE, IMAGE, generator=gen), return_loss=True)
    if name == "GPTNeoXForCausalLM":
        b = batch or 4
        ids, mask = _padded_text(gen, b, SEQ, PAD, 0)
        return dict(input_ids=ids, attention_mask=mask, labels=ids.clone())
    raise ValueError(f"unknown model {name!r}; one of {', '.join(CONFIGS)}")


# --------------------------------------------------------------------------
# one case, in a fresh process
# --------------------------------------------------------------------------
def same_training(opt, name: str, batch: dict) -> dict:
    """One step of ``opt`` against one step of a fresh unmodified build (same seed, same batch)."""
    return _same_training(opt, build_model(name), batch)


def run_case(name: str, way: str, batch_size: int | None) -> dict:
    from ckptopt import measure_peak, optimize_checkpoints

    rec: dict = dict(model=name, way=way)
    t0 = time.perf_counter()
    model = build_model(name)
    batch = make_batch(name, batch_size)
    rec.update(batch=shapes(batch), params=sum(p.numel() for p in model.parameters()))
    if way == "none":
        module = model
    elif way == "hf":
        hf_checkpointing_enable(model)
        module = model
    elif way == "ckptopt":
        t = time.perf_counter()
        module = optimize_checkpoints(model, batch)
        rec.update(plan_seconds=round(time.perf_counter() - t, 2),
                   predicted_peak_bytes=int(module.predicted_peak_bytes), checkpoints=len(module.plan.checkpoints), plan=list(module.plan.checkpoints),
                   solver=module.plan.solver, layers=module.traced.n,
                   front_end=module.traced.capture.front_end if module.traced.capture is not None else "fx")
    else:
        raise ValueError(way)
    t = time.perf_counter()
    rec["measured_peak_bytes"] = int(measure_peak(module, batch))
    rec["measure_seconds"] = round(time.perf_counter() - t, 2)
    if way == "ckptopt":
        t = time.perf_counter()
        rec["same_training"] = same_training(module, name, batch)
        rec["check_seconds"] = round(time.perf_counter() - t, 2)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


def run_isolated(name: str, way: str, batch_size: int | None, timeout: float) -> dict:
    """One case in a fresh process: its record, or why there is none."""
    child = run_child("benchmarks.hf_families", [name, way, batch_size or 0], timeout=timeout)
    rec = child.record if child.record is not None else dict(model=name, way=way, error=child.failure,
                                                             output_tail=child.output)
    rec["wall_seconds"] = round(child.seconds, 2)
    return rec


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------
def run_model(name: str, batch_size: int | None, timeout: float) -> dict:
    cases = {}
    for way in WAYS:
        cases[way] = run_isolated(name, way, batch_size, timeout)
        c = cases[way]
        print(f"  {name} {way}: " + (f"{c['measured_peak_bytes'] / 2**20:.1f} MiB" if "measured_peak_bytes" in c
                                      else f"ERROR {c.get('error', '')[:200]}") + f" [{c['wall_seconds']:.0f} s]",
              flush=True)
    res: dict = dict(model=name, config=CONFIGS[name], batch=next((c["batch"] for c in cases.values() if "batch" in c),
                                                                 None))
    peak = {w: cases[w].get("measured_peak_bytes") for w in WAYS}
    res.update({f"{w}_peak_bytes": peak[w] for w in WAYS})
    ck = cases["ckptopt"]
    pred = ck.get("predicted_peak_bytes")
    res["ckptopt_predicted_peak_bytes"] = pred
    res["prediction_error"] = (peak["ckptopt"] - pred) / peak["ckptopt"] if peak["ckptopt"] and pred else None
    res["ckptopt_checkpoints"] = ck.get("checkpoints")
    res["ratio_ckptopt_vs_hf"] = peak["ckptopt"] / peak["hf"] if peak["ckptopt"] and peak["hf"] else None
    res["ratio_hf_vs_none"] = peak["hf"] / peak["none"] if peak["hf"] and peak["none"] else None
    res["same_training"] = ck.get("same_training")
    res["seconds"] = {w: cases[w]["wall_seconds"] for w in WAYS}
    res["errors"] = {w: cases[w]["error"] for w in WAYS if "error" in cases[w]}
    res["cases"] = cases
    return res


def _table(results: list[dict]) -> str:
    mib = 2.0 ** 20

    def m(v):
        return f"{v / mib:.1f} MiB" if v else "error"

    lines = ["| model | none | hf | ckptopt | ckptopt/hf | predicted error |", "|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['ratio_ckptopt_vs_hf']:.3f}" if r["ratio_ckptopt_vs_hf"] else "–"
        err = f"{100 * r['prediction_error']:+.3f}%" if r["prediction_error"] is not None else "–"
        lines.append(f"| {r['model']} | {m(r['none_peak_bytes'])} | {m(r['hf_peak_bytes'])} | "
                     f"{m(r['ckptopt_peak_bytes'])} | {ratio} | {err} |")
    return "\n".join(lines)


def main() -> None:
    child = child_args()
    if child:
        path, (name, way, batch_size) = child
        warnings.filterwarnings("ignore")
        child_record(path, run_case, name, way, int(batch_size) or None, model=name, way=way)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated class names: " + ",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per case (default 600)")
    ap.add_argument("--whisper-batch", type=int, default=WHISPER_BATCH,
                    help=f"Whisper's batch (default {WHISPER_BATCH}; 1 where 3000 frames are too slow)")
    ap.add_argument("--out", default=result_path("hf_families"))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(CONFIGS)}")
    warnings.filterwarnings("ignore")
    tf = _transformers()
    meta = run_metadata("hf_families")
    meta.update(transformers=tf.__version__, device="cpu", timeout_seconds=args.timeout,
                models=names, ways=list(WAYS))
    t0 = time.perf_counter()
    results = []
    for name in names:
        print(f"{name}", flush=True)
        batch_size = args.whisper_batch if name == "WhisperForConditionalGeneration" else None
        res = run_model(name, batch_size, args.timeout)
        if name == "WhisperForConditionalGeneration" and args.whisper_batch != WHISPER_BATCH:
            res["note"] = (f"batch {args.whisper_batch} instead of {WHISPER_BATCH}: 3000 mel frames at batch "
                           f"{WHISPER_BATCH} took too long on this CPU")
        results.append(res)
        meta["wall_seconds"] = round(time.perf_counter() - t0, 1)
        write_json(args.out, dict(meta=meta, results=results))
    print()
    print(_table(results))
    for r in results:
        st = r["same_training"]
        if st:
            print(f"{r['model']}: ckptopt trains {'bit-identically' if st['bit_identical'] else 'differently'} "
                  f"(loss diff {st['loss_abs_diff']:.3g}, max grad diff {st['grad_max_abs_diff']:.3g})")
        for way, err in r["errors"].items():
            print(f"{r['model']} {way}: {err[:300]}")
    print(f"wall time {meta['wall_seconds']:.0f} s; wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
