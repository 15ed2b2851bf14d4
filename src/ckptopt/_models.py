"""Resolve a MODEL argument of the CLI: a zoo name or ``package.module:factory``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def load_model(spec: str, batch_size: int | None = None, input_size: int | None = None,
               dtype: str = "fp32", config: dict | None = None, meta: bool = False,
               **kwargs: Any) -> tuple[torch.nn.Module, Any]:
    """Build ``(model, example_inputs)`` from a zoo name, ``hf:<transformers class>`` or a
    ``module:factory`` spec.

    A factory is called with the keyword arguments it accepts among
    ``batch_size``, ``input_size`` and ``dtype`` and must return
    ``(model, example_inputs)``. For ``hf:`` models ``input_size`` is the sequence
    length and ``config`` overrides the config class's defaults. ``meta``: zoo and ``hf:`` models
    are built on the meta device (no memory; for planning only), a factory as it builds them.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    dt = DTYPES[dtype]
    if spec.startswith("hf:"):
        from .zoo.hf import get_hf

        return get_hf(spec, batch_size, input_size, config, dt, device="meta" if meta else "cpu")
    if config:
        raise ValueError("--config applies to hf: models only")
    if ":" in spec and not spec.startswith("torchvision:"):
        mod_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(mod_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {mod_name!r} for model {spec!r}: {exc}") from exc
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ValueError(f"{spec!r}: {mod_name} has no callable {attr!r}")
        params = inspect.signature(factory).parameters
        offered = dict(batch_size=batch_size, input_size=input_size, dtype=dt, **kwargs)
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        call = {k: v for k, v in offered.items() if v is not None and (accepts_any or k in params)}
        result = factory(**call)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
            raise ValueError(
                f"factory {spec!r} must return (model, example_inputs), got {type(result).__name__}"
            )
        model, inputs = result
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        return model, inputs if isinstance(inputs, dict) else tuple(inputs)
    from . import zoo

    kw = dict(kwargs)
    if batch_size is not None:
        kw["batch_size"] = batch_size
    if input_size is not None:
        kw["input_size"] = input_size
    return zoo.get(spec, dtype=dt, device="meta" if meta else "cpu", **kw)
