"""Model zoo: standard networks in their published layouts, with example inputs.

>>> from ckptopt import zoo
>>> model, inputs = zoo.get("resnet50", batch_size=2, input_size=64)
>>> logits = model(*inputs)

:func:`get` builds the model under ``torch.manual_seed(seed)`` (two calls with
the same seed give identical weights) and returns it with a tuple of
positional example inputs drawn from a generator seeded with the same seed:

==============  ====================================  ===================
name            example inputs                         defaults (B, size)
==============  ====================================  ===================
vgg*, resnet*,  images (B, 3, S, S), ``dtype``         2, 64
densenet121,
mobilenet_v2
unet            images (B, in_channels, S, S)          1, 64
gpt             token ids (B, S) int64, S <= seq_len   2, min(128, seq_len)
mlp             features (B, in_features)              32, in_features
==============  ====================================  ===================

For ``mlp``, ``input_size`` (if given) is the number of input features, i.e.
the same as ``in_features``. Extra keyword arguments go to the model's
constructor (``num_classes``, ``batch_norm`` for VGG, ``base`` for U-Net,
``depth/width/heads/seq_len/vocab/dropout/sdpa`` for GPT, ...).

Names of the form ``"torchvision:<name>"`` build ``torchvision.models.<name>``
(random weights) when torchvision imports; inputs are (B, 3, S, S) images,
default 2, 224.

All zoo models are traceable by :func:`torch.fx.symbolic_trace`.
"""

from __future__ import annotations

import contextlib

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from .gpt import GPT, gpt
from .mlp import MLPChain, mlp
from .unet import UNet, unet
from .vision import (
    VGG,
    DenseNet,
    MobileNetV2,
    ResNet,
    densenet121,
    mobilenet_v2,
    resnet18,
    resnet50,
    resnet101,
    resnet152,
    vgg16,
    vgg19,
)

__all__ = [
    "get",
    "names",
    "PUBLISHED_PARAM_COUNTS",
    "VGG",
    "ResNet",
    "DenseNet",
    "MobileNetV2",
    "UNet",
    "GPT",
    "MLPChain",
    "vgg16",
    "vgg19",
    "resnet18",
    "resnet50",
    "resnet101",
    "resnet152",
    "densenet121",
    "mobilenet_v2",
    "unet",
    "gpt",
    "mlp",
]

_IMAGE = "image"
_TOKENS = "tokens"
_FEATURES = "features"


class ZooEntry(NamedTuple):
    """How :func:`get` builds a zoo model and its example inputs."""

    build: Callable[..., nn.Module]
    inputs: str  # "image", "tokens" or "features"
    batch_size: int  # default batch size
    input_size: Optional[int]  # default image side (None: taken from the model)


_REGISTRY: Dict[str, ZooEntry] = {
    "vgg16": ZooEntry(vgg16, _IMAGE, 2, 64),
    "vgg19": ZooEntry(vgg19, _IMAGE, 2, 64),
    "resnet18": ZooEntry(resnet18, _IMAGE, 2, 64),
    "resnet50": ZooEntry(resnet50, _IMAGE, 2, 64),
    "resnet101": ZooEntry(resnet101, _IMAGE, 2, 64),
    "resnet152": ZooEntry(resnet152, _IMAGE, 2, 64),
    "densenet121": ZooEntry(densenet121, _IMAGE, 2, 64),
    "mobilenet_v2": ZooEntry(mobilenet_v2, _IMAGE, 2, 64),
    "unet": ZooEntry(unet, _IMAGE, 1, 64),
    "gpt": ZooEntry(gpt, _TOKENS, 2, None),
    "mlp": ZooEntry(mlp, _FEATURES, 32, None),
}

#: Parameter counts at the defaults (1000 classes for the ImageNet models;
#: torchvision's published figures), counting GPT's tied embedding once.
PUBLISHED_PARAM_COUNTS: Dict[str, int] = {
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "densenet121": 7_978_856,
    "mobilenet_v2": 3_504_872,
    "unet": 31_037_698,
    "gpt": 124_439_808,
}

_TV_PREFIX = "torchvision:"


class _MetaGenerator:
    """Stands for a ``torch.Generator`` when the inputs are made on the meta device."""


def _meta_aware(fn):
    """``torch.randn``/``randint`` that make meta tensors when given a :class:`_MetaGenerator`."""
    def call(*args, generator=None, **kw):
        if isinstance(generator, _MetaGenerator):
            return fn(*args, device="meta", **kw)
        return fn(*args, generator=generator, **kw)
    return call


_randn, _randint = _meta_aware(torch.randn), _meta_aware(torch.randint)


def names() -> List[str]:
    """The zoo's model names, in a fixed order."""
    return list(_REGISTRY)


def _torchvision():
    try:
        import torchvision  # noqa: F401
        import torchvision.models
    except Exception as e:  # ImportError, or a build mismatched with torch
        raise ImportError(f"torchvision is not usable here ({type(e).__name__}: {e})") from e
    return torchvision


def get(
    name: str,
    batch_size: Optional[int] = None,
    input_size: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    seed: int = 0,
    **model_kwargs: Any,
) -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """Build zoo model ``name`` and example inputs for it.

    Returns ``(model, example_inputs)``; ``model(*example_inputs)`` runs.
    The model is in training mode, cast to ``dtype`` (floating parameters and
    buffers) and moved to ``device``. ``device="meta"`` builds it without memory (and its
    inputs on the meta device): what planning needs, at any size. Raises :class:`ValueError` for an
    unknown name (the message lists the valid ones) or bad sizes, and
    :class:`ImportError` for a ``"torchvision:..."`` name when torchvision
    does not import.
    """
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if input_size is not None and input_size < 1:
        raise ValueError(f"input_size must be >= 1, got {input_size}")
    gen = torch.Generator().manual_seed(seed)

    if name.startswith(_TV_PREFIX):
        tv = _torchvision()
        tv_name = name[len(_TV_PREFIX):]
        torch.manual_seed(seed)
        try:
            model = tv.models.get_model(tv_name, weights=None, **model_kwargs)
        except ValueError as e:
            raise ValueError(f"unknown torchvision model {tv_name!r}: {e}") from e
        b = 2 if batch_size is None else batch_size
        s = 224 if input_size is None else input_size
        x = torch.randn(b, 3, s, s, generator=gen)
        return model.to(device=device, dtype=dtype), (x.to(device=device, dtype=dtype),)

    if name not in _REGISTRY:
        raise ValueError(
            f"unknown model {name!r}; valid names: {', '.join(names())}"
            f" (or 'torchvision:<name>' when torchvision is installed)"
        )
    entry = _REGISTRY[name]
    kind, default_s = entry.inputs, entry.input_size
    b = entry.batch_size if batch_size is None else batch_size

    if kind == _FEATURES and input_size is not None:
        if "in_features" in model_kwargs and model_kwargs["in_features"] != input_size:
            raise ValueError(
                f"mlp: input_size={input_size} conflicts with in_features={model_kwargs['in_features']}"
            )
        model_kwargs["in_features"] = input_size

    torch.manual_seed(seed)
    meta = str(device) == "meta"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = entry.build(**model_kwargs)
    model = model.to(dtype=dtype) if meta else model.to(device=device, dtype=dtype)
    if meta:  # inputs of the same shapes and dtypes, without memory (random numbers need none)
        gen = _MetaGenerator()

    if kind == _IMAGE:
        s = default_s if input_size is None else input_size
        c = model.in_channels if isinstance(model, UNet) else 3
        x = _randn(b, c, s, s, generator=gen)
        inputs: Tuple[torch.Tensor, ...] = (x.to(device=device, dtype=dtype),)
    elif kind == _TOKENS:
        assert isinstance(model, GPT)
        s = min(128, model.seq_len) if input_size is None else input_size
        if s > model.seq_len:
            raise ValueError(f"gpt: input_size={s} exceeds seq_len={model.seq_len}")
        idx = _randint(0, model.vocab, (b, s), generator=gen, dtype=torch.long)
        inputs = (idx.to(device=device),)  # (meta: already there)
    else:
        assert isinstance(model, MLPChain)
        x = _randn(b, model.in_features, generator=gen)
        inputs = (x.to(device=device, dtype=dtype),)
    return model, inputs
