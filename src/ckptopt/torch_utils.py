"""Small torch helpers every torch-facing stage shares, each written once.

* :class:`Inputs` and :func:`normalize_inputs`: ``example_inputs`` as the model is
  called, ``model(*args, **kwargs)``;
* :func:`default_loss`: the loss planning and measuring use when none is given;
* tensor helpers: :func:`tensor_leaves`, :func:`is_fake`, :func:`clone_layout` (storages:
  :mod:`ckptopt.storages`; a fake-tensor copy of a model and its inputs: :mod:`ckptopt.fake`);
* why a fake run or a capture failed: :func:`data_dependent_construct`, :func:`source_line`,
  :func:`own_checkpointing_hint`;
* a model's plain-Python state, to restore it after its forward ran: :func:`python_state`,
  :func:`restore_python_state`, :func:`describe_value`;
* the model and its device, leaving no state behind: :func:`check_module`,
  :func:`resolve_device`, :func:`no_lasting_state`, :func:`inspected_by_type`;
  :func:`inputs_from_list` (a graph that frees each input after its last use).
"""

from __future__ import annotations

from collections.abc import Mapping
import collections
import enum
import functools
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["Inputs", "normalize_inputs", "default_loss", "tensor_leaves",
           "clone_layout", "is_fake", "inspected_by_type", "check_module", "resolve_device", "no_lasting_state",
           "PythonState", "python_state", "data_dependent_construct", "source_line", "own_checkpointing_hint",
           "FAKE_VALUES_NOTE", "REWRITE_HINT", "restore_python_state", "describe_value", "ATOMS", "base_container"]


# --------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------
def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors inside nested tuples, lists, dicts and other pytree containers."""
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory once each (any order of dimensions)."""
    expected = 1
    for stride, size in sorted((int(s), int(n)) for n, s in zip(t.shape, t.stride()) if int(n) != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def clone_layout(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` in a new storage laid out as ``t``'s: same strides, offset and
    storage size. ``t.clone()`` makes a view that overlaps itself (GQA's ``expand`` of the keys,
    stride 0) or one into a larger storage (a chunk) contiguous, and an op that copies the first
    (``bmm`` clones a stride-0 operand and saves the clone) does not copy the second: a layer
    measured on such a clone saves other tensors than in the model."""
    t = t.detach()
    es = t.element_size()
    st = t.untyped_storage()
    if (_dense(t) and t.storage_offset() == 0
            and st.nbytes() == t.numel() * es) or st.nbytes() % es:
        out = t.clone()
    else:
        base = t.new_empty(0).set_(st, 0, (st.nbytes() // es,), (1,)).clone()
        out = base.as_strided(t.size(), t.stride(), t.storage_offset())
    mode = getattr(t, "fake_mode", None)
    shadows = getattr(mode, "shadows", None)
    if shadows is not None and t in shadows and out not in shadows:  # the copy has the same value
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            mode._keep(out, shadows[t].clone())
    return out


#: Base classes whose instances tools inspect by type (module, class name): a model of one gets the
#: plan attached in place (:mod:`ckptopt.inplace`).
_BY_TYPE = (("transformers.", "PreTrainedModel"), ("peft.", "PeftModel"), ("diffusers.", "ModelMixin"))


def inspected_by_type(model: Any) -> bool:
    """Whether ``model`` is a transformers, PEFT or diffusers model (which Trainer, accelerate and
    PEFT inspect by type and signature): the plan is then attached in place by default."""
    return any(c.__module__.startswith(mod) and c.__name__ == name for c in type(model).__mro__
               for mod, name in _BY_TYPE)


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


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
# why a run on fake tensors (or a capture) failed: the construct and its line
# --------------------------------------------------------------------------
def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, innermost last (at most 8)."""
    out = []
    while exc is not None and exc not in out and len(out) < 8:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def data_dependent_construct(exc: BaseException) -> str | None:
    """The data-dependent construct behind a failure, in words, or None when the failure is something
    else. Fake tensors (and ``torch.export``'s symbolic shapes) carry shapes but no values, so a
    forward that reads a value back from a tensor cannot be followed."""
    import re

    for e in exception_chain(exc):
        name, text = type(e).__name__, str(e)
        if name == "GuardOnDataDependentSymNode" or "Could not guard on data-dependent expression" in text:
            m = re.search(r"data-dependent expression (.+?) \(unhinted", text)
            expr = f" `{m.group(1)}`" if m else ""
            return ("a Python branch, assert or size computed from a value read from a tensor "
                    f"(torch.export: GuardOnDataDependentSymNode, data-dependent expression{expr})")
        if name == "DataDependentOutputException" or "aten._local_scalar_dense" in text:
            return ("a value read from a tensor (`.item()`, `.tolist()`, `int(t)`, or a Python `if`/`assert` "
                    "on a tensor; DataDependentOutputException)")
        if name == "DynamicOutputShapeException":
            return (f"an op whose output shape depends on tensor values ({text.splitlines()[0] if text else name}: "
                    "`nonzero`, boolean-mask indexing, `unique`; DynamicOutputShapeException)")
        if "symbolically traced variables cannot be used as inputs to control flow" in text or \
                "Proxy object cannot be iterated" in text:
            return "data-dependent control flow (a Python `if`, loop or `assert` on a traced tensor; torch.fx)"
    return None


def _short_path(path: str) -> str:
    path = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _internal_path(path: str) -> bool:
    """Whether a frame is inside torch, ckptopt, numpy or the standard library's wrappers rather than the
    model's code (a failure inside numpy is named at the model's line that called it)."""
    path = path.replace("\\", "/")
    return any(part in path for part in ("/torch/", "torch/_", "/ckptopt/", "/contextlib.py", "/functools.py",
                                         "/numpy/")) \
        or path.startswith(("torch/", "_export/", "fx/", "_dynamo/", "numpy/"))


def _full_path(path: str) -> str:
    """``path`` itself when it exists, else the file of a loaded module that ends with it (torch.export
    names files relative to site-packages, or cut at the front: ``ork/main/tests/x.py``)."""
    import os
    import sys

    if os.path.exists(path):
        return path
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and (f == path or f.replace("\\", "/").endswith(path.replace("\\", "/"))):
            return f
    return path


def _line_of(path: str, line: int) -> str:
    import linecache

    return linecache.getline(_full_path(path), line).strip()


def source_line(exc: BaseException | None = None, stack_trace: str | None = None) -> str | None:
    """``path:line in function: `code``` of the user's line a failure comes from: from a graph
    node's ``stack_trace``, from torch.export's message (``The following call raised this error``,
    ``Caused by: (...)``), or from the traceback's innermost frame outside torch and ckptopt."""
    import re
    import traceback

    def fmt(path: str, line: int, fn: str, code: str | None) -> str:
        code = code or _line_of(path, line)
        return f"{_short_path(path)}:{line} in {fn}" + (f": `{code}`" if code else "")

    if stack_trace:
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s+(.*)', stack_trace)
        user = [f for f in frames if not _internal_path(f[0])] or frames
        if user:
            path, line, fn, code = user[-1]
            return fmt(path, int(line), fn, code.strip())
    for e in exception_chain(exc):
        text = str(e)
        m = re.search(r'following call raised this error:\s*File "([^"]+)", line (\d+), in (\S+)\n\s+(.*)', text)
        if m:
            return fmt(m.group(1), int(m.group(2)), m.group(3), m.group(4).strip())
        m = re.search(r"Caused by: \((\S+?):(\d+) in (\S+)\)", text)
        if m and not _internal_path(m.group(1)):
            return fmt(_full_path(m.group(1)), int(m.group(2)), m.group(3), None)
    for e in exception_chain(exc):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not _internal_path(f.filename)]
        if frames:
            f = frames[-1]
            return fmt(f.filename, f.lineno, f.name, f.line)
    return None


def own_checkpointing_hint(model: Any = None) -> str:
    """How to checkpoint ``model`` without ckptopt: its own switch (transformers, diffusers), else
    ``torch.utils.checkpoint`` around its blocks."""
    by_hand = "checkpoint its blocks by hand with torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)"
    if model is None:
        return (f"{by_hand} (a transformers model: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False}))")
    if callable(getattr(model, "gradient_checkpointing_enable", None)) and \
            getattr(model, "supports_gradient_checkpointing", True):
        return ("use the model's own activation checkpointing, "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
    if callable(getattr(model, "enable_gradient_checkpointing", None)):
        return "use the model's own activation checkpointing, model.enable_gradient_checkpointing()"
    return by_hand


FAKE_VALUES_NOTE = ("ckptopt measures memory on fake tensors, which carry shapes but no values, so it cannot "
                    "follow a forward that reads a value back from a tensor")
REWRITE_HINT = ("rewrite that line without reading a tensor's value (torch.where or a mask instead of an `if`; "
                "compute the value outside the model and pass it in)")


# --------------------------------------------------------------------------
# plain-Python state of a model: what running its forward may change
# --------------------------------------------------------------------------
MODULE_INTERNALS = frozenset(vars(nn.Module()))
ATOMS = (type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis), enum.Enum,
         torch.dtype, torch.device, torch.layout, torch.memory_format)
_NO_SNAPSHOT = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                functools.partial, nn.Module, torch.Tensor)
_BASES = (collections.OrderedDict, dict, list, set)  # the C types a mutable container's contents live in
_MAX_ITEMS = 10_000  # larger containers are restored by identity only (and compared by length)


@dataclass
class PythonState:
    """The plain-Python state of a model's submodules, to restore it or compare it with a later one.

    ``attrs``: (module, attribute, object) for every attribute outside nn.Module's own bookkeeping;
    ``keys``: (module, attribute names) per module; ``contents``: id -> (object, shallow copy of its
    contents) for each mutable container (list, dict, set, their subclasses) and each plain object
    with a ``__dict__`` (a dataclass, a config) held by an attribute, copied once however many
    modules share it.
    """

    attrs: list
    keys: list
    contents: dict


def python_state(model: nn.Module) -> PythonState:
    """Snapshot every plain-Python attribute of every submodule (shallow: one level of contents).

    Never raises: an object whose contents cannot be read is kept by identity only.
    """
    attrs, keys, contents = [], [], {}
    for _, mod in model.named_modules():
        own = vars(mod)
        names = [k for k in own if k not in MODULE_INTERNALS]
        keys.append((mod, frozenset(names)))
        for attr in names:
            value = own[attr]
            attrs.append((mod, attr, value))
            if id(value) not in contents:
                copy = _contents(value)
                if copy is not None:
                    contents[id(value)] = (value, copy)
    return PythonState(attrs, keys, contents)


def base_container(value: Any) -> type | None:
    """The C type a mutable container's contents live in (OrderedDict, dict, list, set), or None."""
    return next((b for b in _BASES if isinstance(value, b)), None)


def _contents(value: Any) -> tuple | None:
    """A shallow copy of a mutable object's contents, read through the C base type (a subclass
    that overrides its accessors, or forbids them like diffusers' FrozenDict, is read as stored)."""
    if isinstance(value, ATOMS) or isinstance(value, _NO_SNAPSHOT):
        return None
    try:
        base = base_container(value)
        if base is not None:
            if base.__len__(value) > _MAX_ITEMS:
                return None
            if base in (dict, collections.OrderedDict):
                return (base, list(dict.items(value)))
            return (base, list(base.__iter__(value)))
        own = object.__getattribute__(value, "__dict__")
        if type(own) is dict and len(own) <= _MAX_ITEMS:
            return ("vars", list(own.items()))
    except Exception:  # noqa: BLE001 - kept by identity only
        pass
    return None


def _current(value: Any, kind: Any) -> list:
    if kind == "vars":
        return list(object.__getattribute__(value, "__dict__").items())
    if kind in (dict, collections.OrderedDict):
        return list(dict.items(value))
    return list(kind.__iter__(value))


def _same_items(a: list, b: list, kind: Any) -> bool:
    """The same elements, by identity (keys and values of mappings and of ``__dict__``)."""
    if len(a) != len(b):
        return False
    if kind is list or kind is set:
        return all(x is y for x, y in zip(a, b))
    return all(x[0] is y[0] and x[1] is y[1] for x, y in zip(a, b))


def restore_python_state(state: PythonState) -> None:
    """Put every snapshotted attribute and content back, by the cheapest safe means; never raises.

    An attribute rebound (or deleted) by the forward gets its object back, written to the module's
    ``__dict__``; one the forward added is removed. A container or object whose contents changed is
    refilled in place (so the user's object stays the same object): through its own methods first,
    through its C base type if those refuse (a frozen mapping). Unchanged objects are not touched.
    What cannot be restored is reported with a warning naming it.
    """
    failed = []
    for mod, names in state.keys:
        own = vars(mod)
        for attr in [k for k in own if k not in MODULE_INTERNALS and k not in names]:
            try:
                del own[attr]
            except Exception:  # noqa: BLE001
                failed.append(f"{type(mod).__name__}.{attr}")
    for mod, attr, value in state.attrs:
        own = vars(mod)
        if own.get(attr, _MISSING) is not value:
            own[attr] = value
    for value, (kind, saved) in state.contents.values():
        try:
            if not _same_items(_current(value, kind), saved, kind):
                _refill(value, kind, saved)
        except Exception:  # noqa: BLE001 - reported below, never raised
            failed.append(f"a {type(value).__name__} object")
    if failed:
        warnings.warn(f"ckptopt could not restore {', '.join(failed[:5])} after running the forward; "
                      "check these attributes of the model", RuntimeWarning, stacklevel=3)


_MISSING = object()


def _refill(value: Any, kind: Any, saved: list) -> None:
    if kind == "vars":
        own = object.__getattribute__(value, "__dict__")
        own.clear()
        own.update(saved)
        return
    try:  # the object's own methods keep whatever invariants a subclass maintains
        if kind is list:
            value[:] = saved
        elif kind is set:
            value.clear()
            value.update(saved)
        else:
            keep = dict(saved)
            for k in [k for k in dict.keys(value) if k not in keep]:
                del value[k]
            for k, v in saved:
                if not dict.__contains__(value, k) or dict.__getitem__(value, k) is not v:
                    value[k] = v
        if _same_items(_current(value, kind), saved, kind):
            return
    except Exception:  # noqa: BLE001 - the subclass refuses: fill the C base type directly
        pass
    if kind is list:
        list.__setitem__(value, slice(None), saved)
    elif kind is set:
        set.clear(value)
        set.update(value, saved)
    else:
        kind.clear(value)
        for k, v in saved:
            kind.__setitem__(value, k, v)


def describe_value(value: Any, depth: int = 2) -> Any:
    """A comparable, hashable-free summary of a value (atoms by value, tensors by shape and dtype,
    containers and plain objects by their contents down to ``depth``, anything else by type).
    Never calls a user-defined ``__eq__`` or ``__repr__``; never raises."""
    try:
        if isinstance(value, (float, complex)):
            return (type(value).__name__, repr(value))  # nan == nan
        if isinstance(value, ATOMS):
            return (type(value).__name__, value)
        if isinstance(value, torch.Tensor):
            return ("tensor", str(tuple(value.shape)), str(value.dtype))
        if isinstance(value, nn.Module):
            return ("module", type(value).__name__)
        if isinstance(value, (tuple, frozenset)) or base_container(value) is not None:
            base = base_container(value)
            items = (list(dict.items(value)) if base in (dict, collections.OrderedDict)
                     else list(value) if base is None else list(base.__iter__(value)))
            if depth <= 0 or len(items) > _MAX_ITEMS:
                return (type(value).__name__, len(items))
            if isinstance(value, (set, frozenset)):
                return (type(value).__name__, sorted(repr(describe_value(x, depth - 1)) for x in items))
            return (type(value).__name__, [describe_value(x, depth - 1) for x in items])
        if isinstance(value, _NO_SNAPSHOT) or depth <= 0:
            return ("object", type(value).__name__)
        own = object.__getattribute__(value, "__dict__")
        if type(own) is dict:
            return (type(value).__name__, [(k, describe_value(v, depth - 1)) for k, v in list(own.items())[:_MAX_ITEMS]])
    except Exception:  # noqa: BLE001
        pass
    return ("object", type(value).__name__)


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


def inputs_from_list(graph: "torch.fx.Graph") -> bool:
    """Rewrite ``graph`` (in place) to take its inputs as one list, which it empties on entry, so an
    input nothing else holds is freed after its last use inside it (a ``forward(*inputs)`` call's
    argument tuple would hold every input until it returns). False, unchanged, when it has no input."""
    import operator

    old = [n for n in graph.nodes if n.op == "placeholder"]
    if not old:
        return False
    body = next(n for n in graph.nodes if n.op != "placeholder")  # the output node at the latest
    with graph.inserting_before(body):  # inserting_before keeps the new nodes in order
        box = graph.placeholder("ckptopt_inputs")
        taken = [graph.call_function(operator.getitem, (box, i)) for i in range(len(old))]
        graph.call_method("clear", (box,))
    for ph, t in zip(old, taken):
        ph.replace_all_uses_with(t)
        graph.erase_node(ph)
    return True
