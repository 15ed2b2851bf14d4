"""Models whose parameters are never allocated: the meta device, planned as the real model.

A model built under ``torch.device("meta")`` (or with accelerate's ``init_empty_weights``) has
every shape and dtype of the real one and no memory: an 8B or 70B model fits on a laptop that
way. Its tensors cannot be measured as they are, though: meta storages have no address (every
parameter would look like one storage) and meta kernels are not the device's (a run on the
meta device takes other paths than the real one). So before tracing, :func:`unmaterialized`
swaps every meta parameter, buffer and input for a fake tensor of the same shape, dtype and
strides *on a real device* (the CPU, or CUDA where it is present and asked for): the tracer then
sees exactly what it sees for the same model with real weights, fake-copied, and the plan, the
estimate and the largest batch are the same to the byte (``tests/test_meta.py``).

The user's model is not touched: a deep copy of it (free on the meta device) carries the fakes.
Models whose parameters are already fake tensors (built under a ``FakeTensorMode``) are planned
as they are.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from ..fake import fake_mode
from ..torch_utils import Inputs, is_fake

__all__ = ["has_meta", "unmaterialized", "planning_device", "planned_on", "refuse_meta"]


def has_meta(model: nn.Module, inputs: Inputs | None = None) -> bool:
    """Whether any parameter, buffer or input tensor of ``model`` lives on the meta device."""
    tensors = list(model.parameters()) + list(model.buffers()) + (inputs.tensors() if inputs is not None else [])
    return any(t.is_meta and not is_fake(t) for t in tensors)


def planning_device(device: Any = None) -> torch.device:
    """The device a meta model's fakes claim: ``device`` when it is CUDA and CUDA is present (the
    CUDA kernels' shapes), else the CPU (whose kernels' saved tensors the cost model then follows)."""
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.device(device)
    return torch.device("cpu")


def planned_on(model: nn.Module) -> str:
    """The device ``model`` is planned for by default: its parameters' (the CPU for a meta model)."""
    dev = next(model.parameters()).device
    return str(planning_device() if dev.type == "meta" else dev)


def unmaterialized(model: nn.Module, inputs: Inputs, device: Any = None) -> tuple[nn.Module, Inputs]:
    """``(model, inputs)`` with every meta tensor replaced by a fake tensor on
    :func:`planning_device` (tied parameters stay tied, ``requires_grad`` and the training mode
    are kept); the model and inputs themselves when nothing is on the meta device."""
    if not isinstance(model, nn.Module) or not has_meta(model, inputs):
        return model, inputs  # (a model of the wrong type is refused by the tracer's checks)
    dev = planning_device(device)
    mode = fake_mode()
    convert = mode.fake_tensor_converter
    made: dict[int, torch.Tensor] = {}  # by id of the original tensor (kept alive by ``keep``)
    keep: list[torch.Tensor] = []

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            keep.append(t)
            if t.is_meta and not is_fake(t):
                made[id(t)] = convert.from_meta_and_device(mode, t.detach(), dev)
            else:  # a real tensor beside meta ones (a CPU batch for a meta model): a fake of it
                made[id(t)] = mode.from_tensor(t.detach())
        return made[id(t)]

    # the copy shares every tensor with the model (memo), then gets the fakes: nothing is copied twice
    shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    twin = copy.deepcopy(model, dict(shared))
    params: dict[int, nn.Parameter] = {}
    for mod in twin.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in params:
                params[id(p)] = nn.Parameter(fake(p), requires_grad=p.requires_grad)
            mod._parameters[name] = params[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = fake(b)
        for name, v in list(vars(mod).items()):  # tensors kept as plain attributes (a rotary table's copy)
            if isinstance(v, torch.Tensor) and v.is_meta and not is_fake(v):
                mod.__dict__[name] = fake(v)
    return twin, inputs.map_tensors(fake)


def refuse_meta(model: nn.Module, inputs: Inputs, what: str) -> None:
    """A module to train needs real tensors: say so for a meta model, and what plans one."""
    if isinstance(model, nn.Module) and has_meta(model, inputs):
        raise ValueError(
            f"{what} returns a module to train, but the model or its inputs are on the meta device (no "
            "memory, nothing to run). A meta model is planned without training it: ckptopt.estimate, "
            "max_batch, plan_training and trace answer for it as for the real model; materialize it "
            "(model.to_empty(device=...) and load its weights) before optimize_checkpoints")
