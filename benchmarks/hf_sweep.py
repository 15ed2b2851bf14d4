"""Architecture sweep: every transformers model of six auto mappings through ckptopt, as a new user tries it.

Models: every class in transformers' auto mappings for causal LM, masked LM, seq2seq LM,
sequence classification, image classification and speech seq2seq (a class in several
mappings runs once, with the batch of its first task in ``TASKS`` order). Each is built
from its config class, scaled down generically (``scale_config``): two layers, width 64,
2 heads (head dim 32), intermediate 128, vocabulary 512, images 32x32 (then 64, 224 if
the model refuses), audio as the feature extractor yields it; no weights, no downloads,
``use_cache=False``, training mode, dropout probabilities that default to 0 set to 0.1.
The batch is what a collator yields (``make_batch``), batch 2, sequence 32, one padded
row, and the loss is the model's own ``.loss``.

Per model, in a fresh subprocess (``--timeout``), one record with ``status``:

* ``harness``: the unmodified model cannot be built or cannot train on the batch, or it
  does not train reproducibly itself (``reason``); not counted;
* ``ok``: ``optimize_checkpoints(model, batch)`` plans; two training steps
  (``torch.manual_seed(k)`` before each, an SGD update between) give the same loss and
  every parameter gradient bit for bit (``torch.equal``) as a deep copy of the unmodified
  model; the measured peak of one step (exact CPU storage tracker, ``measure_peak``) is
  within 1% of ``predicted_peak_bytes``; and where the model supports it, that peak is
  at or below HF's own checkpointing of the same model (``activation_checkpointing_enable``,
  non-reentrant) measured the same way, at no more recomputation (the matmul/conv FLOPs a
  step runs beyond the unmodified model's step, ``torch.utils.flop_counter``; only when
  HF's checkpointing recomputes anything). When the default plan buys a lower peak with more
  recomputation, the plan of ``optimize_checkpoints(model, batch, budget=<HF's peak>)`` must
  peak at or below HF's and recompute no more (``at_hf_*`` fields);
* ``fail``: ``cause`` is the stage and exception type with a normalized message
  (numbers and node names stripped so failures group), or the ok-conditions that failed
  (``failed`` lists them with figures).

Writes ``benchmarks/results/hf_sweep/latest.json`` (``--out``; ``--sample``: ``latest-ci-sample.json``)
after every model: run metadata,
``records`` and a ``summary`` grouped by status and cause. ``--only A,B``, ``--tasks
causal,masked,seq2seq,seqcls,image,speech``, ``--limit N``, ``--sample`` (6 models of
different families, for CI), ``--resume`` (keep the records already in ``--out``).
Run: ``nice -n 10 python -m benchmarks.hf_sweep`` (about 500 models, one at a time). A sample of the
sweep re-run on new code goes to ``latest-sample.json``: ``--only <models> --out
benchmarks/results/hf_sweep/latest-sample.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import statistics
import time
import traceback
import warnings
from typing import Any

from benchmarks.harness import child_args, result_path, run_child, run_metadata, write_json, write_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# task -> the auto mapping it comes from
TASKS = {
    "speech": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seqcls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
SAMPLE = ["GPT2LMHeadModel", "LlamaForCausalLM", "BertForMaskedLM", "T5ForConditionalGeneration",
          "LlamaForSequenceClassification", "ViTForImageClassification"]

BATCH, SEQ, PAD = 2, 32, 8          # batch 2, sequence 32, the second row padded over its last 8 positions
TARGET_LEN, TARGET_PAD = 16, 4      # seq2seq / speech labels
LAYERS, HIDDEN, HEADS, HEAD_DIM, INTER, VOCAB = 2, 64, 2, 32, 128, 512
IMAGE_SIZES = (32, 64, 224)
MAX_PARAMS = 30_000_000             # a scaled model above this was not scaled down
PRED_TOL = 0.01
DROPOUT = 0.1


# --------------------------------------------------------------------------
# scaling a config generically
# --------------------------------------------------------------------------
MAIN_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
               "num_encoder_layers", "num_decoder_layers", "decoder_num_layers", "encoder_num_layers",
               "speech_encoder_layers", "t2u_encoder_layers", "t2u_decoder_layers", "text_encoder_layers",
               "num_text_layers", "num_vision_layers", "depth", "num_blocks", "num_self_attends_per_block")
MINOR_LAYERS = re.compile(r"(layers|_layer_count|first_k_dense_replace)$")
WIDTH = {"hidden_size", "d_model", "d_latents", "n_embd", "dim", "emb_dim", "d_embed", "embed_dim", "hidden_dim_model",
         "word_embed_proj_dim", "projection_dim", "embedding_dim", "embedding_size", "n_embed", "model_dim",
         "attention_hidden_size", "text_hidden_size", "vision_hidden_size", "audio_hidden_size"}
WIDTH_SUFFIX = ("hidden_size", "_output_dim", "out_hidden_size", "_embed_dim", "projection_dim", "_proj_dim")
HEADS_KEYS = re.compile(r"(^|_)(num_attention_heads|n_heads?|num_heads|attention_heads|num_kv_heads|n_kv_heads|"
                        r"num_key_value_heads|linear_num_key_heads|linear_num_value_heads|index_n_heads|"
                        r"num_heads_per_layer|linear_num_heads)$")
HEAD_DIMS = re.compile(r"(^|_)(head_dim|d_kv|d_head|dim_head|attention_head_size|kv_channels|v_head_dim|"
                       r"qk_head_dim|key_head_dim|value_head_dim|attention_head_dim|head_size|rotary_dim)$")
INTER_KEYS = re.compile(r"(intermediate_size|ffn_dim|^d_ff$|^d_inner$|ffn_hidden_size|^hidden_dim$|"
                        r"intermediate_size_mlp|^n_inner$|^inner_dim$|ffn_intermediate_size|feedforward_dim)")
EXPERTS = re.compile(r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts|num_routed_experts|"
                     r"n_experts)$")
TOPK = re.compile(r"^(num_experts_per_tok|moe_topk|moe_k|num_experts_per_token|top_k|moe_top_k|num_selected_experts)$")
SHARED = re.compile(r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$")
STATE = re.compile(r"(state_size|d_state|ssm_state_size)$")
TOKEN = re.compile(r"(_token_id|_token_index|_token_ids)$")
ROLE_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 3, "mask_token_id": 4,
            "sep_token_id": 5, "cls_token_id": 6}
RESERVED_LOW, RESERVED_HIGH = 8, 32  # drawn ids avoid [0, 8) and the top 32 (other special tokens)


WIDTH_LISTS = re.compile(r"^(hidden_sizes|embed_dims?|hidden_dims|out_channels|in_channels|neck_hidden_sizes|"
                         r"widths|dims|stem_channels|stage_\w*channels|channels)$")


def _narrow(x: int, div: int) -> int:
    """A channel count divided by ``div``, at least 16; counts below 16 (image channels) stay."""
    return x if x < 16 else max(16, x // div)


def _truncate(v: list, n: int) -> list:
    """The first ``n`` entries of a per-layer list, its last ones replaced by kinds the cut dropped
    (``[sliding] * 5 + [full]`` -> ``[sliding, full]``: configs check that every kind occurs)."""
    out = list(v[:n])
    missing = [x for x in dict.fromkeys(map(repr, v)) if x not in set(map(repr, out))]
    by_repr = {repr(x): x for x in v}
    for i, r in enumerate(missing[:n]):
        out[n - 1 - i] = by_repr[r]
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _subconfig(key: str, value) -> bool:
    return isinstance(value, dict) and (key.endswith("config") or key.endswith("_configs") or "model_type" in value)


def _scale_level(d: dict, tokens: dict, notes: list, image_size: int | None, path: str = "") -> None:
    """Scale one config level (a ``to_dict()``) in place; recurses into sub-configs."""
    orig = dict(d)
    list_lengths = {len(v) for v in d.values() if isinstance(v, list)}
    orig_width = next((d[k] for k in ("hidden_size", "d_model", "n_embd") if _is_int(d.get(k))), None)
    # channel lists (stages of a conv net, a hierarchical ViT) shrink by one power of two per level, so
    # that equal widths stay equal (a stage's input is the previous stage's output)
    tops = [max(v) for k, v in d.items() if WIDTH_LISTS.search(k.lower()) and isinstance(v, list) and v
            and all(_is_int(x) for x in v)]
    width_div = 1
    while tops and max(tops) // width_div > HIDDEN:
        width_div *= 2
    # a staged model (ConvNeXt, Swin, CvT) counts its blocks per stage: one block per stage, and its
    # num_layers (the number of stages) stays
    staged = any(isinstance(d.get(k), list) for k in ("depths", "depth"))
    orig_layers = None if staged else next((d[k] for k in MAIN_LAYERS if _is_int(d.get(k)) and d[k] > 0), None)
    new_layers = min(orig_layers, LAYERS) if orig_layers else None
    for key in list(d):
        v = d[key]
        if isinstance(v, dict) and v and new_layers and all(str(k).isdigit() for k in v):
            # per-layer overrides keyed by layer index: the layers that remain, scaled alike
            kept = {k: x for k, x in v.items() if int(k) < new_layers}
            for x in kept.values():
                if isinstance(x, dict):
                    _scale_level(x, tokens, notes, image_size, f"{path}{key}.")
            d[key] = kept
            continue
        if _subconfig(key, v):
            _scale_level(v, tokens, notes, image_size, f"{path}{key}.")
            continue
        if isinstance(v, list) and v and all(_subconfig(key, x) for x in v):
            for i, x in enumerate(v):
                _scale_level(x, tokens, notes, image_size, f"{path}{key}[{i}].")
            continue
        low = key.lower()
        if TOKEN.search(low):
            continue  # token ids: below, once the vocabulary is known
        if key in MAIN_LAYERS and _is_int(v):
            if not staged:
                d[key] = min(v, LAYERS)
        elif MINOR_LAYERS.search(low) and _is_int(v) and "max_window" not in low and "conv" not in low \
                and v not in list_lengths:  # a count that sizes a list (num_feat_extract_layers) stays
            d[key] = min(v, 1)
        elif "max_window_layers" in low and _is_int(v):
            d[key] = min(v, LAYERS)
        elif key in ("depths", "depth") and isinstance(v, list) and all(_is_int(x) for x in v):
            d[key] = [min(x, 1) for x in v]
        elif HEADS_KEYS.search(low) and isinstance(v, list) and all(_is_int(x) for x in v):
            d[key] = [min(x, HEADS) for x in v]
        elif isinstance(v, list) and orig_layers and len(v) == orig_layers and orig_layers > LAYERS:
            d[key] = _truncate(v, new_layers)  # per-layer lists (layer_types, mlp_layer_types, ...)
        elif isinstance(v, list) and "layer" in low and v and all(_is_int(x) for x in v) and new_layers:
            d[key] = [x for x in v if 0 <= x < new_layers]  # layer indices (moe_layers, mlp_only_layers)
        elif HEADS_KEYS.search(low) and _is_int(v):
            heads = orig.get("num_attention_heads")
            d[key] = 1 if "key_value" in low and _is_int(heads) and v < heads else min(v, HEADS)
        elif "qk_nope_head_dim" in low or "qk_rope_head_dim" in low:
            d[key] = HEAD_DIM // 2 if _is_int(v) and v else v
        elif HEAD_DIMS.search(low) and _is_int(v) and v > 0:
            d[key] = min(v, HEAD_DIM) if "rotary" not in low else min(v, HEAD_DIM // 2)
        elif INTER_KEYS.search(low) and _is_int(v) and v > 0:
            d[key] = min(v, INTER)
        elif low.endswith("vocab_size") or low.endswith("vocab_size_base") or low == "n_vocab":
            if _is_int(v) and v > VOCAB:
                d[key] = VOCAB
        elif (key in WIDTH or low.endswith(WIDTH_SUFFIX)) and _is_int(v) and v > HIDDEN \
                and not (staged and key == "hidden_size"):  # a staged model's is its last stage's, derived
            d[key] = HIDDEN
        elif WIDTH_LISTS.search(low) and isinstance(v, list) and v and all(_is_int(x) for x in v):
            d[key] = [_narrow(x, width_div) for x in v]
        elif low.endswith("groups") and _is_int(v) and v > 1 and v == orig_width:
            d[key] = HIDDEN  # grouped convolutions over the whole width
        elif EXPERTS.search(low) and _is_int(v) and v > 4:
            d[key] = 4
        elif TOPK.search(low) and _is_int(v):
            d[key] = min(v, 2)
        elif SHARED.search(low) and _is_int(v):
            d[key] = min(v, 1)
        elif low in ("n_group", "num_expert_group", "topk_group", "n_groups", "mamba_n_groups") and _is_int(v):
            d[key] = 1
        elif STATE.search(low) and _is_int(v):
            d[key] = min(v, 16)
        elif low in ("time_step_rank", "mamba_dt_rank", "kv_lora_rank", "q_lora_rank", "laurel_rank",
                     "hc_lowrank") and _is_int(v):
            d[key] = min(v, HEAD_DIM)
        elif low in ("image_size", "input_size", "img_size") and image_size is not None:
            if _is_int(v):
                d[key] = image_size
            elif isinstance(v, list) and len(v) == 2:
                d[key] = [image_size, image_size]
        elif ("dropout" in low or "pdrop" in low) and isinstance(v, float) and v == 0.0 and "layerdrop" not in low:
            d[key] = DROPOUT
    # mamba-2 style: heads x head dim must equal expand x width
    for heads_key, dim_key in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim")):
        if _is_int(d.get(heads_key)) and _is_int(d.get(dim_key)):
            expand = d.get("mamba_expand", d.get("expand", 2))
            width = d.get("hidden_size", HIDDEN)
            if _is_int(expand) and _is_int(width):
                d[dim_key] = HEAD_DIM
                d[heads_key] = max(1, expand * width // HEAD_DIM)
    # MLA: the query head dim is nope + rope; a head_dim equal to the rope part stays so
    if _is_int(orig.get("head_dim")) and orig.get("head_dim") == orig.get("qk_rope_head_dim"):
        d["head_dim"] = d["qk_rope_head_dim"]
    # MLA: the query head dim is nope + rope
    if _is_int(d.get("qk_nope_head_dim")) and _is_int(d.get("qk_rope_head_dim")) and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    # rotary sections (multimodal rope) add up to half the head dim
    for rope_key in ("rope_parameters", "rope_scaling"):
        rope = d.get(rope_key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            sec = rope["mrope_section"]
            half = (d.get("head_dim") if _is_int(d.get("head_dim")) else HEAD_DIM) // 2
            total = sum(sec)
            new = [max(1, x * half // total) for x in sec]
            new[0] += half - sum(new)
            rope["mrope_section"] = new
    if "head_dim" in d and d["head_dim"] is None and (_is_int(d.get("hidden_size")) or _is_int(d.get("d_model"))):
        d["head_dim"] = HEAD_DIM  # a checkpoint's config states it; some classes' defaults leave it None
    if orig_layers and orig_layers > LAYERS:
        for key in ("out_features", "out_indices"):  # backbone outputs name stages that no longer exist
            if isinstance(d.get(key), list):
                d[key] = None
    if "use_cache" in d:
        d["use_cache"] = False


def _remap_tokens(d: dict, vocab: int, mapping: dict) -> None:
    """Special token ids by role into [0, 8), any other into the top of the vocabulary."""
    for key in list(d):
        v = d[key]
        if _subconfig(key, v):
            _remap_tokens(v, vocab, mapping)
            continue
        if not TOKEN.search(key.lower()):
            continue

        def one(x, key=key):
            if not _is_int(x) or x < 0:
                return x
            role = ROLE_IDS.get(key)
            if role is not None:
                mapping.setdefault(("role", key), {})
                return role
            if ("value", x) not in mapping:
                mapping[("value", x)] = vocab - 1 - sum(1 for k in mapping if k[0] == "value")
            return mapping[("value", x)]

        if key == "decoder_start_token_id":
            continue  # _remap_decoder_start
        if isinstance(v, list):
            d[key] = [one(x) for x in v]
        else:
            d[key] = one(v)


def scale_config(config_cls, task: str, image_size: int | None = None):
    """``(config, vocabulary, notes)``: ``config_cls()`` scaled down generically (see the module docstring)."""
    base = config_cls()
    d = base.to_dict()
    _scale_level(d, {}, [], image_size if task == "image" else None)
    text = _text_level(d)
    vocab = text.get("vocab_size") if _is_int(text.get("vocab_size")) else d.get("vocab_size", VOCAB)
    vocab = vocab if _is_int(vocab) else VOCAB
    # decoder_start_token_id is compared to the original roles: remap it before them
    _remap_decoder_start(d)
    _remap_tokens(d, vocab, {})
    if task == "seqcls":
        for level in (d, text):
            if level.get("pad_token_id") is None or level.get("pad_token_id") == level.get("eos_token_id"):
                level["pad_token_id"] = ROLE_IDS["pad_token_id"]
    cfg = config_cls.from_dict(d)
    cfg.use_cache = False
    notes: list[str] = []
    if getattr(cfg, "is_encoder_decoder", False) and getattr(cfg, "pad_token_id", None) is None:
        cfg.pad_token_id = ROLE_IDS["pad_token_id"]  # shifting labels into decoder inputs needs it
        notes.append("pad_token_id set to 0 (the config class has none)")
    if getattr(cfg, "is_encoder_decoder", False) and getattr(cfg, "decoder_start_token_id", None) is None:
        # a pretrained checkpoint's config.json sets it; the config class's defaults may not
        start = getattr(cfg, "pad_token_id", None)
        cfg.decoder_start_token_id = start if _is_int(start) else ROLE_IDS["bos_token_id"]
        notes.append(f"decoder_start_token_id set to {cfg.decoder_start_token_id} (the config class has none)")
    try:
        tc = cfg.get_text_config()
        if tc is not cfg and hasattr(tc, "use_cache"):
            tc.use_cache = False
    except Exception:  # noqa: BLE001 - not every config has a text config
        pass
    return cfg, vocab, notes


def _text_level(d: dict) -> dict:
    for key in ("text_config", "decoder", "decoder_config", "language_config", "llm_config", "text_decoder_config"):
        if isinstance(d.get(key), dict):
            return d[key]
    return d


def _remap_decoder_start(d: dict) -> None:
    for key, v in list(d.items()):
        if _subconfig(key, v):
            _remap_decoder_start(v)
    v = d.get("decoder_start_token_id")
    if _is_int(v):
        for role_key in ("pad_token_id", "eos_token_id", "bos_token_id"):
            if d.get(role_key) == v:
                d["decoder_start_token_id"] = -1000 - ROLE_IDS[role_key]  # placeholder, resolved below
                break
        else:
            d["decoder_start_token_id"] = -1007
    _resolve_placeholder(d)


def _resolve_placeholder(d: dict) -> None:
    v = d.get("decoder_start_token_id")
    if _is_int(v) and v <= -1000:
        d["decoder_start_token_id"] = -(v + 1000)


# --------------------------------------------------------------------------
# building the model and its batch
# --------------------------------------------------------------------------
def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def mapping_entries(tasks=None) -> list[tuple[str, str, list[str]]]:
    """``[(class name, task, every task it appears in)]``, each class once, in ``TASKS`` order."""
    from transformers.models.auto import modeling_auto

    seen: dict[str, tuple[str, list[str]]] = {}
    order = []
    for task, attr in TASKS.items():
        for _, names in getattr(modeling_auto, attr).items():
            for name in (names if isinstance(names, (tuple, list)) else (names,)):
                if name not in seen:
                    seen[name] = (task, [])
                    order.append(name)
                seen[name][1].append(task)
    out = [(n, seen[n][0], seen[n][1]) for n in order]
    if tasks:
        out = [(n, t, ts) for n, t, ts in out if t in tasks]
    return sorted(out, key=lambda e: (list(TASKS).index(e[1]) if e[1] != "causal" else -1, e[0]))


def _model_type(cls) -> str | None:
    return getattr(getattr(cls, "config_class", None), "model_type", None)


def _draw_ids(gen, shape, vocab):
    import torch

    hi = max(RESERVED_LOW + 1, vocab - RESERVED_HIGH)
    return torch.randint(RESERVED_LOW, hi, shape, generator=gen)


def _pad_id(cfg) -> int:
    text = _safe_text_config(cfg)
    for c in (cfg, text):
        v = getattr(c, "pad_token_id", None)
        if _is_int(v):
            return v
    return ROLE_IDS["pad_token_id"]


def _eos_id(cfg) -> int | None:
    text = _safe_text_config(cfg)
    for c in (cfg, text):
        v = getattr(c, "eos_token_id", None)
        if isinstance(v, list) and v:
            v = v[0]
        if _is_int(v):
            return v
    return None


def _safe_text_config(cfg):
    try:
        return cfg.get_text_config()
    except Exception:  # noqa: BLE001
        return cfg


def _text_batch(cfg, vocab: int, gen, masked: bool = False) -> dict:
    import torch

    ids = _draw_ids(gen, (BATCH, SEQ), vocab)
    eos = _eos_id(cfg)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - PAD:] = 0
    if eos is not None:  # a tokenizer ends every sequence with eos (BART-like classifiers pool there)
        ids[0, -1] = eos
        ids[1, SEQ - PAD - 1] = eos
    ids[1, SEQ - PAD:] = _pad_id(cfg)
    batch = {"input_ids": ids, "attention_mask": mask}
    if masked:
        labels = torch.full_like(ids, -100)
        chosen = (torch.rand(BATCH, SEQ, generator=gen) < 0.15) & mask.bool()
        chosen[0, 1] = True  # at least one position
        labels[chosen] = ids[chosen]
        mask_id = getattr(cfg, "mask_token_id", None)
        if _is_int(mask_id):
            ids[chosen] = mask_id
        batch["labels"] = labels
    return batch


def _target_labels(vocab: int, gen, eos):
    import torch

    labels = _draw_ids(gen, (BATCH, TARGET_LEN), vocab)
    if eos is not None:
        labels[0, -1] = eos
        labels[1, TARGET_LEN - TARGET_PAD - 1] = eos
    labels[1, TARGET_LEN - TARGET_PAD:] = -100
    return labels


def _speech_inputs(cls, model, gen) -> dict:
    """The main input as the model's feature extractor yields it for two 1 s clips."""
    import numpy as np

    tf = _transformers()
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES

    fe_name = FEATURE_EXTRACTOR_MAPPING_NAMES.get(_model_type(cls))
    if fe_name is None:
        raise HarnessError(f"no feature extractor is mapped for model type {_model_type(cls)!r}")
    fe_cls = getattr(tf, fe_name)
    fe = fe_cls()
    bins = _find_attr(model.config, ("num_mel_bins", "input_feat_per_channel", "n_mels", "feature_size"))
    if _is_int(bins) and _is_int(getattr(fe, "feature_size", None)) and fe.feature_size != bins:
        # a checkpoint ships a feature extractor that matches its config; the two classes' defaults may not
        try:
            fe = fe_cls(feature_size=bins)
        except Exception:  # noqa: BLE001
            pass
    rate = getattr(fe, "sampling_rate", 16000) or 16000
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(rate).astype(np.float32) * 0.1 for _ in range(BATCH)]
    feats = fe(clips, sampling_rate=rate, return_tensors="pt")  # the extractor's own padding
    name = model.main_input_name
    if name not in feats:
        raise HarnessError(f"the feature extractor {fe_name} yields {sorted(feats)}, not the model's main "
                           f"input {name!r}")
    out = {name: feats[name].float() if feats[name].is_floating_point() else feats[name]}
    mask_key = "attention_mask" if "attention_mask" in feats else None
    if mask_key and _accepts(model, "attention_mask"):
        out["attention_mask"] = feats[mask_key]
    return out


def _find_attr(cfg, names, depth: int = 0):
    """The first of ``names`` set on ``cfg`` or, breadth first, on its sub-configs."""
    for n in names:
        v = getattr(cfg, n, None)
        if _is_int(v):
            return v
    if depth < 2:
        for key in ("audio_config", "encoder_config", "encoder", "speech_config"):
            sub = getattr(cfg, key, None)
            if sub is not None and not isinstance(sub, (dict, str)):
                v = _find_attr(sub, names, depth + 1)
                if v is not None:
                    return v
    return None


def _accepts(model, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def make_batch(cls, model, cfg, task: str, vocab: int, image_size: int | None) -> dict:
    """The batch a collator yields for ``task`` (module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    main = getattr(model, "main_input_name", "input_ids")
    if task == "image":
        size = image_size or 32
        channels = getattr(cfg, "num_channels", None)
        if not _is_int(channels):
            channels = getattr(getattr(cfg, "vision_config", None), "num_channels", 3)
        pixels = torch.randn(BATCH, channels if _is_int(channels) else 3, size, size, generator=gen)
        return {main if main == "pixel_values" else "pixel_values": pixels,
                "labels": torch.randint(0, max(cfg.num_labels, 1), (BATCH,), generator=gen)}
    if task == "speech" and main != "input_ids":
        batch = _speech_inputs(cls, model, gen)
        batch["labels"] = _target_labels(vocab, gen, _eos_id(cfg))
        return batch
    if task in ("seq2seq", "speech"):
        batch = _text_batch(cfg, vocab, gen)
        if getattr(cfg, "is_encoder_decoder", False):
            batch["labels"] = _target_labels(vocab, gen, _eos_id(cfg))
        else:  # a decoder-only model in a seq2seq mapping: causal labels
            labels = batch["input_ids"].clone()
            labels[batch["attention_mask"] == 0] = -100
            batch["labels"] = labels
        return batch
    if task == "masked":
        return _text_batch(cfg, vocab, gen, masked=True)
    batch = _text_batch(cfg, vocab, gen)
    if task == "seqcls":
        n = cfg.num_labels
        batch["labels"] = torch.randint(0, max(n, 1), (BATCH,), generator=gen)
    else:  # causal
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
    return batch


class HarnessError(Exception):
    """The unmodified model cannot be built or trained as the harness sets it up."""


def _n_params_meta(cls, cfg) -> int:
    import torch

    with torch.device("meta"):
        model = cls(cfg)
    return sum(p.numel() for p in model.parameters())


def build(name: str, task: str, image_size: int | None = None):
    """``(model, batch, info)`` for one class, or :class:`HarnessError`."""
    import torch

    tf = _transformers()
    cls = getattr(tf, name, None)
    if not isinstance(cls, type):
        raise HarnessError(f"transformers has no class {name}")
    config_cls = getattr(cls, "config_class", None)
    if config_cls is None:
        raise HarnessError(f"{name} has no config_class")
    try:
        cfg, vocab, notes = scale_config(config_cls, task, image_size)
    except Exception as exc:  # noqa: BLE001
        raise HarnessError(f"config: {type(exc).__name__}: {_first_line(exc)}") from exc
    try:
        n = _n_params_meta(cls, cfg)
    except Exception as exc:  # noqa: BLE001
        raise HarnessError(f"build: {type(exc).__name__}: {_first_line(exc)}") from exc
    if n > MAX_PARAMS:
        raise HarnessError(f"not scaled down generically: {n / 1e6:.1f}M parameters after scaling")
    torch.manual_seed(0)
    try:
        model = cls(cfg).float().train()
    except Exception as exc:  # noqa: BLE001
        raise HarnessError(f"build: {type(exc).__name__}: {_first_line(exc)}") from exc
    try:
        batch = make_batch(cls, model, cfg, task, vocab, image_size)
    except HarnessError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise HarnessError(f"batch: {type(exc).__name__}: {_first_line(exc)}") from exc
    return model, batch, dict(params=n, vocab=vocab, notes=notes, model_type=config_cls.model_type,
                              batch={k: list(v.shape) for k, v in batch.items()})


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The message's first line (with the next one when the first ends with a colon)."""
    text = [t.strip() for t in str(exc).strip().splitlines() if t.strip()]
    line = text[0] if text else ""
    if line.endswith(":") and len(text) > 1:
        line = f"{line} {text[1]}"
    return line[:limit]


def _loss(model, batch, seed: int):
    import torch

    torch.manual_seed(seed)
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss


def check_trains(model, batch) -> None:
    """One step of the unmodified model: it must return a scalar ``.loss`` that requires grad."""
    try:
        loss = _loss(model, batch, 0)
    except Exception as exc:  # noqa: BLE001
        raise HarnessError(f"forward: {type(exc).__name__}: {_first_line(exc)}") from exc
    if loss is None:
        raise HarnessError("the model returns no loss for this batch")
    if not (hasattr(loss, "numel") and loss.numel() == 1 and loss.requires_grad):
        raise HarnessError("the loss is not a scalar that requires grad")
    if not math.isfinite(float(loss.detach())):
        raise HarnessError("the loss is not finite")
    try:
        loss.backward()
    except Exception as exc:  # noqa: BLE001
        raise HarnessError(f"backward: {type(exc).__name__}: {_first_line(exc)}") from exc
    model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------
def two_steps(a, b, batch, a_params, b_params) -> dict:
    """Train ``a`` and ``b`` two steps each (seed k, SGD between); the first difference, if any."""
    import torch

    worst, first = 0.0, None
    losses_equal = True
    for seed in (0, 1):
        la, lb = _loss(a, batch, seed), _loss(b, batch, seed)
        la.backward()
        lb.backward()
        if not torch.equal(la.detach(), lb.detach()):
            losses_equal = False
            worst = max(worst, _rel(la.detach(), lb.detach()))
            first = first or f"loss, step {seed}"
        del la, lb
        pb = dict(b_params())
        for key, p in a_params():
            q = pb.get(key)
            ga, gb = p.grad, None if q is None else q.grad
            if ga is None and gb is None:
                continue
            if ga is None or gb is None or ga.shape != gb.shape or not torch.equal(ga, gb):
                worst = max(worst, math.inf if ga is None or gb is None or ga.shape != gb.shape else _rel(ga, gb))
                first = first or f"gradient of {key}, step {seed}"
        with torch.no_grad():
            for params in (a_params(), b_params()):
                for _, p in params:
                    if p.grad is not None:
                        p -= 0.01 * p.grad
                        p.grad = None
    return dict(identical=first is None, losses_equal=losses_equal, first_difference=first,
                max_rel_diff=None if first is None else worst)


def _rel(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.inf
    return diff / scale if scale else (math.inf if diff else 0.0)


def _step_flops(model, batch) -> int:
    """Matmul/conv FLOPs of one training step (forward, loss, backward)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss = _loss(model, batch, 0)
        loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def _enable_hf(model) -> str:
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
        return "activation_checkpointing_enable()"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return "gradient_checkpointing_enable(use_reentrant=False)"


_NORM = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"\b([us])\d+\b"), r"\1N"),            # symbolic sizes u0, s1
    (re.compile(r"(?<=[_.])\d+"), "N"),              # add_3 -> add_N, layers.0 -> layers.N
    (re.compile(r"\b\d+(\.\d+)?(e[-+]?\d+)?\b"), "N"),
    (re.compile(r"'[^']{40,}'"), "'…'"),
    (re.compile(r"\s+"), " "),
]


_NODE = re.compile(r"running node %\S+ : \[[^\]]*\] = \w+\[target=([^\]]+)\]\(.*?\) on the example inputs failed:")
_CHECK = re.compile(r"\.? ?Check that the example inputs match .*$")


def normalize(msg: str, limit: int = 160, model: str | None = None) -> str:
    """A message without numbers, addresses, node names, the model's name and ckptopt's advice:
    failures group by cause. For a capture failure, what torch.export said."""
    lines = [t.strip() for t in (msg or "").strip().splitlines() if t.strip()]
    msg = (f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]) if lines else ""
    if model:
        msg = msg.replace(model, "<model>")
    if "torch.export: " in msg and "cannot capture" in msg:
        msg = "capture: " + msg.split("torch.export: ", 1)[1]
        msg = msg.replace("torch.export cannot capture <model>: ", "")
    msg = _NODE.sub(r"running node \1 failed:", msg)
    msg = _CHECK.sub("", msg)
    for pat, rep in _NORM:
        msg = pat.sub(rep, msg)
    return msg[:limit]


def _failure(stage: str, exc: BaseException, model: str | None = None) -> dict:
    return dict(stage=stage, exception=type(exc).__name__, message=_first_line(exc, 1500),
                cause=f"{stage}: {type(exc).__name__}: {normalize(str(exc), model=model)}",
                traceback=traceback.format_exc(limit=-6)[-3000:])


def run_model(name: str, task: str, tasks: list[str] | None = None, progress=None) -> dict:
    """The record of one model (module docstring), in this process."""
    import torch

    from ckptopt import measure_peak, optimize_checkpoints, simulate

    warnings.filterwarnings("ignore")
    rec: dict[str, Any] = dict(model=name, task=task, tasks=tasks or [task])
    say = progress or (lambda stage: None)
    t0 = time.perf_counter()

    # 1. the unmodified model, built and trained once (else: harness)
    say("build")
    attempts = IMAGE_SIZES if task == "image" else (None,)
    model = batch = None
    reasons = []
    for size in attempts:
        try:
            model, batch, info = build(name, task, size)
            check_trains(model, batch)
            rec.update(info, image_size=size)
            break
        except HarnessError as exc:
            reasons.append(str(exc) if size is None else f"{size}x{size}: {exc}")
            model = batch = None
    if model is None:
        rec.update(status="harness", reason=reasons[-1] if len(reasons) == 1 else "; ".join(reasons),
                   cause="harness: " + normalize(reasons[-1].split(": ", 1)[-1] if task == "image" else reasons[-1],
                                                 model=name),
                   seconds=round(time.perf_counter() - t0, 2))
        return rec
    rec["supports_hf_checkpointing"] = bool(getattr(model, "supports_gradient_checkpointing", False))
    size = rec["image_size"]
    try:
        pristine = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - e.g. non-leaf tensors held as attributes: copies are built again
        pristine = None
        rec["copies"] = "built again (the model cannot be deep-copied)"

    def clone():
        """The unmodified model as it was before planning: a deep copy, or built again (same seed)."""
        if pristine is not None:
            return copy.deepcopy(pristine)
        again, b, _ = build(name, task, size)
        check_trains(again, b)
        return again

    reference = clone()

    # 2. plan
    say("optimize")
    try:
        t = time.perf_counter()
        opt = optimize_checkpoints(model, batch)
        rec["plan_seconds"] = round(time.perf_counter() - t, 2)
    except Exception as exc:  # noqa: BLE001
        rec.update(status="fail", **_failure("optimize", exc, name), seconds=round(time.perf_counter() - t0, 2))
        return rec
    sim = simulate(opt.traced.costs, opt.plan.checkpoints, opt.plan.stored)
    capture = getattr(opt.traced, "capture", None)
    rec.update(layers=opt.traced.n, front_end=getattr(capture, "front_end", None), solver=opt.plan.solver,
               checkpoints=list(opt.plan.checkpoints), stored=list(opt.plan.stored),
               predicted_peak_bytes=int(opt.predicted_peak_bytes), baseline_predicted_bytes=int(opt.baseline_peak_bytes),
               recompute_share=sim.recompute_share,
               one_op=sorted(k for k, v in (getattr(capture, "opaque", None) or {}).items() if "one op" in v))

    # 3. peaks: ckptopt, the unmodified model, HF's checkpointing (each one step, exact tracker)
    failed: list[str] = []
    say("measure")
    try:
        measured = measure_peak(opt, batch)
    except Exception as exc:  # noqa: BLE001
        rec.update(status="fail", **_failure("measure", exc, name), seconds=round(time.perf_counter() - t0, 2))
        return rec
    err = (measured - opt.predicted_peak_bytes) / opt.predicted_peak_bytes
    rec.update(measured_peak_bytes=int(measured), prediction_error=err)
    if abs(err) > PRED_TOL:
        failed.append(f"prediction {'under' if err > 0 else 'over'} by more than 1% ({100 * err:+.2f}%)")
    try:
        plain = clone()
        rec["none_peak_bytes"] = int(measure_peak(plain, batch))
        plain_flops = _step_flops(plain, batch)
        rec["recompute_flops"] = _step_flops(opt, batch) - plain_flops
        rec["step_flops"] = plain_flops
        del plain
    except Exception as exc:  # noqa: BLE001
        rec["none_error"] = f"{type(exc).__name__}: {_first_line(exc)}"
        plain_flops = None
    if rec["supports_hf_checkpointing"]:
        say("hf")
        try:
            hf = clone()
            rec["hf_method"] = _enable_hf(hf)
            hf_peak = int(measure_peak(hf, batch))
            rec.update(hf_peak_bytes=hf_peak, peak_ratio_vs_hf=measured / hf_peak, hf_recompute="every layer")
            if plain_flops is not None:
                rec["hf_recompute_flops"] = _step_flops(hf, batch) - plain_flops
            del hf
        except Exception as exc:  # noqa: BLE001
            rec["hf_error"] = f"{type(exc).__name__}: {_first_line(exc)}"
        if "hf_peak_bytes" in rec and measured > rec["hf_peak_bytes"]:
            failed.append(f"peak above HF checkpointing ({100 * (measured / rec['hf_peak_bytes'] - 1):+.2f}%)")
        if rec.get("hf_recompute_flops") and rec.get("recompute_flops", 0) > rec["hf_recompute_flops"]:
            # the default plan bought a lower peak with more recomputation: at HF's peak (budget=),
            # ckptopt must recompute no more than HF does
            say("budget")
            try:
                again = clone()
                at_hf = optimize_checkpoints(again, batch, budget=rec["hf_peak_bytes"])
                rec["at_hf_peak_bytes"] = int(measure_peak(at_hf, batch))
                rec["at_hf_recompute_flops"] = _step_flops(at_hf, batch) - plain_flops
                del again, at_hf
            except Exception as exc:  # noqa: BLE001
                rec["at_hf_error"] = f"{type(exc).__name__}: {_first_line(exc)}"
            if not (rec.get("at_hf_recompute_flops", 1 << 62) <= rec["hf_recompute_flops"]
                    and rec.get("at_hf_peak_bytes", 1 << 62) <= rec["hf_peak_bytes"]):
                failed.append(f"recomputes more than HF checkpointing ({rec['recompute_flops']} > "
                              f"{rec['hf_recompute_flops']} FLOPs, also at HF's peak: "
                              f"{rec.get('at_hf_recompute_flops', rec.get('at_hf_error'))})")

    # 4. two training steps against the unmodified model
    say("train")
    try:
        same = two_steps(reference, opt, batch, reference.named_parameters, opt.original.named_parameters)
    except Exception as exc:  # noqa: BLE001
        rec.update(status="fail", **_failure("train", exc, name), seconds=round(time.perf_counter() - t0, 2))
        return rec
    rec["exact"] = same
    if not same["identical"]:
        say("determinism")
        try:  # is the unmodified model itself reproducible?
            a, b = clone(), clone()
            own = two_steps(a, b, batch, a.named_parameters, b.named_parameters)
        except Exception as exc:  # noqa: BLE001
            own = dict(identical=False, first_difference=f"{type(exc).__name__}: {_first_line(exc)}")
        rec["reference_reproducible"] = own["identical"]
        if not own["identical"]:
            rec.update(status="harness", reason="the unmodified model does not train reproducibly "
                       f"({own['first_difference']})", cause="harness: the unmodified model does not train "
                       "reproducibly", seconds=round(time.perf_counter() - t0, 2))
            return rec
        what = "loss and gradients differ" if not same["losses_equal"] else "gradients differ"
        failed.insert(0, f"{what} (max relative difference {same['max_rel_diff']:.3g})")

    rec["failed"] = failed
    rec["status"] = "ok" if not failed else "fail"
    if failed:
        rec["cause"] = "; ".join(re.sub(r" \(.*\)$", "", f) for f in failed)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


# --------------------------------------------------------------------------
# driver: one subprocess per model
# --------------------------------------------------------------------------
def _child(name: str, task: str, tasks: list[str], path: str) -> None:
    import torch

    torch.set_num_threads(1)
    state = dict(model=name, task=task, tasks=tasks, stage="start")

    def progress(stage):
        state["stage"] = stage
        write_record(path, state)

    try:
        rec = run_model(name, task, tasks, progress)
    except BaseException as exc:  # noqa: BLE001 - the harness itself crashed
        rec = dict(state, status="fail", **_failure(state.get("stage", "start"), exc))
    rec.pop("stage", None)
    write_record(path, rec)


def run_isolated(name: str, task: str, tasks: list[str], timeout: float) -> dict:
    """One model in a fresh process; a record with a ``status`` also when it timed out or crashed."""
    child = run_child("benchmarks.hf_sweep", [name, task, ",".join(tasks)], timeout=timeout)
    rc, tail = child.returncode, child.output
    rec = child.record if child.record is not None else dict(model=name, task=task, tasks=tasks, stage="start")
    if "status" not in rec:  # timed out or crashed mid-way
        stage = rec.pop("stage", "start")
        what = f"timeout after {timeout:.0f} s" if rc is None else f"process exited with code {rc}"
        if stage in ("start", "build"):
            rec.update(status="harness", reason=f"{what} while building or training the unmodified model",
                       cause=f"harness: {what.split(' after')[0]} building the unmodified model")
        else:
            rec.update(status="fail", stage=stage, cause=f"{stage}: {what.split(' after')[0]}",
                       message=what, output_tail=tail if isinstance(tail, str) else tail.decode(errors="replace"))
    rec["wall_seconds"] = round(child.seconds, 2)
    return rec


def summarize(records: list[dict]) -> dict:
    by_status: dict[str, int] = {}
    causes: dict[str, dict] = {}
    for r in records:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
        if r["status"] != "ok":
            c = causes.setdefault(r.get("cause", "?"), dict(status=r["status"], count=0, examples=[]))
            c["count"] += 1
            if len(c["examples"]) < 5:
                c["examples"].append(r["model"])
    ok = [r for r in records if r["status"] == "ok"]
    built = [r for r in records if r["status"] != "harness"]

    def dist(vals):
        vals = sorted(v for v in vals if v is not None)
        if not vals:
            return None
        return dict(n=len(vals), min=vals[0], median=statistics.median(vals), max=vals[-1],
                    p10=vals[int(0.1 * (len(vals) - 1))], p90=vals[int(0.9 * (len(vals) - 1))])

    measured = [r for r in built if "prediction_error" in r]
    return dict(
        models=len(records), built=len(built), by_status=by_status,
        causes=dict(sorted(causes.items(), key=lambda kv: (kv[1]["status"], -kv[1]["count"]))),
        ok_prediction_error=dist([r["prediction_error"] for r in ok]),
        ok_exact_predictions=sum(1 for r in ok if abs(r["measured_peak_bytes"] - r["predicted_peak_bytes"]) <= 8),
        ok_peak_ratio_vs_hf=dist([r.get("peak_ratio_vs_hf") for r in ok]),
        ok_recompute_share=dist([r.get("recompute_share") for r in ok]),
        ok_without_hf_checkpointing=sum(1 for r in ok if "hf_peak_bytes" not in r),
        measured_prediction_error=dist([r["prediction_error"] for r in measured]),
        measured_peak_ratio_vs_hf=dist([r.get("peak_ratio_vs_hf") for r in measured]),
    )


def _line(r: dict) -> str:
    s = f"{r['model']:<52} {r['task']:<7} {r['status']:<8}"
    if r["status"] == "ok":
        hf = f", vs HF {100 * (r['peak_ratio_vs_hf'] - 1):+.1f}%" if "peak_ratio_vs_hf" in r else ", no HF ckpt"
        s += f"pred {100 * r['prediction_error']:+.3f}%{hf}, recompute {100 * r['recompute_share']:.1f}%"
    else:
        s += (r.get("cause") or "")[:150]
    return s + f"  [{r.get('wall_seconds', r.get('seconds', 0)):.0f}s]"


def main() -> None:
    child = child_args()
    if child:
        path, (name, task, tasks) = child
        _child(name, task, tasks.split(","), path)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated class names")
    ap.add_argument("--tasks", help="comma-separated: " + ",".join(TASKS))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--sample", action="store_true", help=f"the CI sample: {', '.join(SAMPLE)}")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per model (default 300)")
    ap.add_argument("--resume", action="store_true", help="keep the records already in --out, run the rest")
    ap.add_argument("--out", help="default benchmarks/results/hf_sweep/latest.json (latest-ci-sample.json with "
                    "--sample)")
    args = ap.parse_args()
    args.out = args.out or result_path("hf_sweep", "ci-sample" if args.sample else None)
    warnings.filterwarnings("ignore")
    tf = _transformers()
    tasks = args.tasks.split(",") if args.tasks else None
    for t in tasks or ():
        if t not in TASKS:
            ap.error(f"unknown task {t!r} (choose from {', '.join(TASKS)})")
    entries = mapping_entries(tasks)
    wanted = SAMPLE if args.sample else (args.only.split(",") if args.only else None)
    if wanted:
        index = {n: (n, t, ts) for n, t, ts in entries}
        missing = [n for n in wanted if n not in index]
        if missing:
            ap.error(f"not in the selected mappings: {', '.join(missing)}")
        entries = [index[n] for n in wanted]
    if args.limit:
        entries = entries[:args.limit]
    records: list[dict] = []
    if args.resume and os.path.exists(args.out):
        with open(args.out) as fh:
            records = json.load(fh).get("records", [])
        done = {r["model"] for r in records}
        entries = [e for e in entries if e[0] not in done]
    meta = run_metadata("hf_sweep")
    meta.update(transformers=tf.__version__, timeout_s=args.timeout, batch=BATCH, seq=SEQ, padded_positions=PAD,
                target_len=TARGET_LEN, scale=dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM,
                                                  intermediate=INTER, vocab=VOCAB, image_sizes=list(IMAGE_SIZES),
                                                  dropout_where_zero=DROPOUT, max_params=MAX_PARAMS),
                prediction_tolerance=PRED_TOL, torch_threads_per_model=1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(f"{len(entries)} models to run ({len(records)} kept)", flush=True)
    for k, (name, task, ts) in enumerate(entries, 1):
        rec = run_isolated(name, task, ts, args.timeout)
        records.append(rec)
        print(f"[{k}/{len(entries)}] {_line(rec)}", flush=True)
        write_json(args.out, dict(meta=meta, summary=summarize(records), records=records))
    summary = summarize(records)
    write_json(args.out, dict(meta=meta, summary=summary, records=records))
    print_summary(summary)


def print_summary(s: dict) -> None:
    print(f"\n{s['models']} models, {s['built']} built; " + ", ".join(f"{k} {v}" for k, v in s["by_status"].items()))
    for cause, c in s["causes"].items():
        print(f"  {c['count']:>4} {c['status']:<8} {cause[:110]}  (e.g. {', '.join(c['examples'][:3])})")
    for key in ("ok_prediction_error", "ok_peak_ratio_vs_hf", "ok_recompute_share"):
        d = s.get(key)
        if d:
            print(f"  {key}: n={d['n']} min {d['min']:.5g} p10 {d['p10']:.5g} median {d['median']:.5g} "
                  f"p90 {d['p90']:.5g} max {d['max']:.5g}")


if __name__ == "__main__":
    main()
