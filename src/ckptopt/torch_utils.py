"""Small torch helpers every torch-facing stage shares, each written once.

* :class:`Inputs` and :func:`normalize_inputs`: ``example_inputs`` as the model is
  called, ``model(*args, **kwargs)``;
* :func:`fake_copy`: a fake-tensor copy of a model and its inputs (no memory);
* :func:`default_loss`: the loss planning and measuring use when none is given;
* tensor helpers: :func:`tensor_leaves`, :func:`storage_nbytes`, :func:`is_fake`,
  :func:`distinct_storages`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["Inputs", "normalize_inputs", "FakeCopy", "fake_copy", "default_loss", "tensor_leaves",
           "storage_nbytes", "is_fake", "distinct_storages", "check_module", "resolve_device", "no_lasting_state"]


# --------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------
def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors inside nested tuples, lists, dicts and other pytree containers."""
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's storage (of its elements when it has no usable storage)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return int(t.numel() * t.element_size())


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage (fake storages by identity, real ones by address)."""
    seen, out = set(), []
    for t in tensors:
        key = id(t.untyped_storage()) if is_fake(t) else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


# --------------------------------------------------------------------------
# example inputs
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Inputs:
    """One batch as the model is called: ``model(*args, **kwargs)``."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def call(self, fn: Callable) -> Any:
        return fn(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        return tensor_leaves((self.args, self.kwargs))

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> "Inputs":
        """The same structure with every tensor replaced by ``fn(tensor)``."""
        args, kwargs = pytree.tree_map_only(torch.Tensor, fn, (self.args, self.kwargs))
        return Inputs(tuple(args), dict(kwargs))

    @property
    def shapes(self) -> tuple:
        return tuple(tuple(t.shape) for t in self.tensors())


def normalize_inputs(example_inputs: Any) -> Inputs:
    """``example_inputs`` as :class:`Inputs`: a tensor is the one positional argument, a tuple
    (or list) the positional arguments, a mapping (a dict, a HuggingFace ``BatchEncoding``) the
    keyword arguments, ``model(**batch)``. Non-tensor values (None, flags) may appear.

    Raises
    ------
    TypeError
        For anything else (nothing, an empty tuple or dict, a string), saying what to pass.
    """
    if isinstance(example_inputs, Inputs):
        return example_inputs
    if isinstance(example_inputs, torch.Tensor):
        return Inputs((example_inputs,))
    if isinstance(example_inputs, (tuple, list)) and len(example_inputs):
        return Inputs(tuple(example_inputs))
    if isinstance(example_inputs, Mapping) and len(example_inputs) and all(isinstance(k, str) for k in example_inputs):
        return Inputs((), dict(example_inputs))
    raise TypeError(
        "example_inputs must be a tensor, a non-empty tuple of the model's positional arguments or a "
        f"non-empty dict of its keyword arguments (model(**batch)), got {type(example_inputs).__name__}"
    )


# --------------------------------------------------------------------------
# fake copies
# --------------------------------------------------------------------------
@dataclass
class FakeCopy:
    """A model and its inputs on fake tensors: the same shapes, dtypes and storages, no memory."""

    mode: Any  # torch._subclasses.fake_tensor.FakeTensorMode
    model: nn.Module
    inputs: Inputs


def fake_copy(model: nn.Module, inputs: Inputs) -> FakeCopy:
    """Deep-copy ``model`` onto fake tensors (parameters, buffers) and convert ``inputs``.

    Run the copy inside ``with copy.mode:``; nothing it computes allocates memory.
    """
    from torch._dynamo.utils import deepcopy_to_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fmodel = deepcopy_to_fake_tensor(model, mode)
    return FakeCopy(mode, fmodel, inputs.map_tensors(mode.from_tensor))


# --------------------------------------------------------------------------
# the default loss
# --------------------------------------------------------------------------
def default_loss(out: Any) -> torch.Tensor:
    """The output's own ``loss`` when it carries one (HuggingFace's convention: a model given
    ``labels`` returns ``.loss``), else ``out.float().pow(2).mean()``, summed over the output's
    tensors that require grad.

    Not ``.sum()``: its gradient is an expanded 4-byte tensor, which hides the
    output-gradient term that every real loss has (``docs/design.md`` §2).
    """
    own = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(own, torch.Tensor) and own.numel() == 1:
        return own
    if isinstance(out, torch.Tensor):
        return out.float().pow(2).mean()
    leaves = tensor_leaves(out)
    grads = [t for t in leaves if t.requires_grad] or [t for t in leaves if t.is_floating_point()]  # no_grad: all
    terms = [t.float().pow(2).mean() for t in grads]
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    return loss


# --------------------------------------------------------------------------
# the model and its device; leaving no state behind
# --------------------------------------------------------------------------
def check_module(model: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, torch.Tensor):
            hint = " (got a tensor: pass the module, not its output)"
        elif isinstance(model, Iterator) or hasattr(model, "__next__"):
            hint = " (got an iterator: pass the module itself, not model.parameters())"
        raise TypeError(
            f"{fn} expects a torch.nn.Module as its first argument, got {type(model).__name__}{hint}. "
            "Pass the model itself, e.g. " + (f"{fn}(model, x)" if fn != "measure_layer" else f"{fn}(layer, x)")
        )


def normalize_device(d: torch.device) -> torch.device:
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def resolve_device(model: nn.Module, args: tuple, device: Any, fn: str) -> torch.device:
    owned = list(model.parameters()) + list(model.buffers())
    model_devs = {normalize_device(t.device) for t in owned}
    if len(model_devs) > 1:
        raise ValueError(
            f"{fn} measures one device, but the model's parameters and buffers are on "
            f"{sorted(str(d) for d in model_devs)}; move the model to one device first"
        )
    model_dev = next(iter(model_devs)) if model_devs else None
    input_devs = {normalize_device(t.device) for t in tensor_leaves(args)}
    for d in sorted(input_devs, key=str):
        if model_dev is not None and d != model_dev:
            raise ValueError(
                f"the example inputs are on device {d} but the model's parameters are on device "
                f"{model_dev}; move the inputs with x.to({str(model_dev)!r}) (or the model with "
                f"model.to({str(d)!r}))"
            )
    if model_dev is None and len(input_devs) > 1:
        raise ValueError(f"the example inputs are spread over devices {sorted(map(str, input_devs))}")
    dev = model_dev or (next(iter(input_devs)) if input_devs else torch.device("cpu"))
    if device is not None:
        want = normalize_device(torch.device(device))
        if want != dev:
            raise ValueError(
                f"device={str(want)!r} was requested but the model and inputs are on device {dev}; "
                "move them there first (measure_peak does not move tensors)"
            )
    if dev.type == "meta":
        raise ValueError(
            "the model and inputs are on the meta device, which holds no memory to measure; "
            "materialize them on a real device (e.g. model.to_empty(device='cpu'))"
        )
    return dev


def _snapshot_buffers(model: nn.Module) -> list:
    """Copies (on CPU, so they do not count on an accelerator) of every buffer."""
    snap = []
    with torch.no_grad():
        for mod in model.modules():
            for name, buf in mod._buffers.items():
                if buf is not None:
                    snap.append((mod, name, buf, buf.detach().to("cpu", copy=True)))
    return snap


def _restore_buffers(snap: list) -> None:
    with torch.no_grad():
        for mod, name, buf, copy in snap:
            if mod._buffers.get(name) is not buf:
                mod._buffers[name] = buf
            buf.copy_(copy)


@contextmanager
def no_lasting_state(model: nn.Module, inputs: Any, dev: torch.device):
    """Clear parameter gradients and restore buffers, input grads and RNG state afterwards."""
    params = list(model.parameters())
    input_leaves = [t for t in tensor_leaves(inputs) if t.is_leaf and t.requires_grad]
    old_input_grads = [t.grad for t in input_leaves]
    buffers = _snapshot_buffers(model)
    for p in params:
        p.grad = None
    for t in input_leaves:
        t.grad = None
    rng_devices = [dev.index] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.enable_grad():
            yield
    finally:
        for p in params:
            p.grad = None
        for t, g in zip(input_leaves, old_input_grads):
            t.grad = g
        _restore_buffers(buffers)
