"""HuggingFace transformers built from their config classes: no weights, no downloads.

``hf:GPT2LMHeadModel`` is ``transformers.GPT2LMHeadModel(GPT2Config(**overrides))`` in
training mode with a batch a collator would yield: ``input_ids``, ``attention_mask``
and ``labels`` (the ids themselves for a causal LM, 15% of the positions for a
masked LM, a class per row for sequence classification). ``transformers`` is an
optional dependency, imported here only.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
import torch.nn as nn

__all__ = ["PREFIX", "get_hf", "parse_overrides"]

PREFIX = "hf:"


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "hf: models need the transformers package: pip install transformers (it keeps your torch)"
        ) from exc
    return transformers


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["n_layer=6", "use_cache=false", "hidden_act=gelu"]`` -> ``{"n_layer": 6, ...}``."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config takes key=value, got {item!r}")
        low = text.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        elif low in ("none", "null"):
            out[key] = None
        else:
            try:
                out[key] = int(text)
            except ValueError:
                try:
                    out[key] = float(text)
                except ValueError:
                    out[key] = text
    return out


def _from_config_file(tf, path: str, overrides: Mapping[str, Any]):
    """``(model class, config)`` from a Hub-style config.json on disk (no network)."""
    where = path if os.path.isdir(path) else os.path.dirname(path) or "."
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"hf:{path}: no such config file (give the path of a config.json, or of its folder)")
    try:
        with open(file) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"hf:{path}: cannot read the config: {exc}") from exc
    archs = raw.get("architectures") or []
    cls = getattr(tf, archs[0], None) if archs else None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"hf:{path}: the config names no transformers model class in 'architectures' "
                         f"({archs or 'none'}); add one, e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    try:
        cfg = cls.config_class.from_pretrained(where if os.path.isdir(path) else file, local_files_only=True,
                                               **overrides)
    except (TypeError, ValueError, OSError) as exc:
        raise ValueError(f"hf:{path}: {cls.config_class.__name__} refused the config: {exc}") from exc
    return cls, cfg


def get_hf(name: str, batch_size: int | None = None, seq_len: int | None = None,
           config: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.float32,
           seed: int = 0, device: str = "cpu") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``(model, batch)`` for ``transformers.<name>`` built from its config class.

    ``name`` may also be the path of a Hub-style ``config.json`` (or of the folder holding it),
    read from disk: its ``architectures[0]`` is the class. ``config`` overrides the config's
    defaults; ``use_cache`` is off unless given (no cache in training). Defaults: batch 2,
    sequence 128 (at most the model's positions). ``device="meta"`` builds the model without
    memory, directly in ``dtype`` (the batch, token ids, stays on the CPU): what planning needs
    for a model of any size.

    Raises
    ------
    ValueError
        For a name that is not a transformers model class, or a bad config key.
    """
    tf = _transformers()
    if name.startswith(PREFIX):
        name = name[len(PREFIX):]
    overrides = dict(config or {})
    overrides.setdefault("use_cache", False)
    if name.endswith(".json") or os.path.sep in name or os.path.isdir(name):
        cls, cfg = _from_config_file(tf, name, overrides)
        name = cls.__name__
    else:
        cls = getattr(tf, name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or getattr(cls, "config_class", None) is None:
            raise ValueError(f"transformers has no model class {name!r} (e.g. GPT2LMHeadModel, LlamaForCausalLM, "
                             "BertForMaskedLM), and it is no path to a config.json")
        try:
            cfg = cls.config_class(**overrides)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{cls.config_class.__name__} refused {overrides}: {exc}") from exc
    torch.manual_seed(seed)
    if str(device) == "meta":
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to(dtype=dtype).train()  # (free on the meta device)
    else:
        model = cls(cfg).to(device=device, dtype=dtype).train()
    b = 2 if batch_size is None else int(batch_size)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 128
    s = min(128, limit) if seq_len is None else int(seq_len)
    if s > limit:
        raise ValueError(f"{name}: sequence {s} exceeds the model's {limit} positions (set --config "
                         f"max_position_embeddings=... or n_positions=...)")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long)}
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        batch["labels"] = ids.clone()
    elif name.endswith("ForMaskedLM"):
        labels = torch.full_like(ids, -100)
        chosen = torch.rand(b, s, generator=gen) < 0.15
        labels[chosen] = ids[chosen]
        batch["labels"] = labels
    elif name.endswith("ForSequenceClassification"):
        batch["labels"] = torch.randint(0, cfg.num_labels, (b,), generator=gen)
    return model, batch
