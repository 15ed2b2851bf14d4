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
import collections
import enum
import functools
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["Inputs", "normalize_inputs", "FakeCopy", "fake_copy", "fake_mode", "DEVICE_FAKE_IMPLS", "default_loss", "tensor_leaves",
           "storage_nbytes", "is_fake", "distinct_storages", "check_module", "resolve_device", "no_lasting_state",
           "PythonState", "python_state", "data_dependent_construct", "source_line", "own_checkpointing_hint",
           "FAKE_VALUES_NOTE", "REWRITE_HINT", "quiet_fake_errors", "restore_python_state", "describe_value", "ATOMS", "base_container"]


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


def storage_identity(t: torch.Tensor) -> int:
    """A key of the tensor's storage: its address for real memory; for meta storages (which all
    have address 0) the storage itself; for fake ones the storage object."""
    if is_fake(t):
        return id(t.untyped_storage())
    if t.is_meta:
        return -1 - t.untyped_storage()._cdata
    return t.untyped_storage().data_ptr()


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage (fake storages by identity, real ones by address)."""
    seen, out = set(), []
    for t in tensors:
        key = storage_identity(t)
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
    The mode is a :func:`fake_mode`: an op runs the checks of the kernel the real
    tensors' device runs, so a fake run takes the path the real run takes.
    Attributes that cannot be deep-copied (a lock, an open file, a generator) are
    shared with the copy rather than copied.

    Raises
    ------
    TraceError
        When the model cannot be copied even so, naming the attribute.
    """
    mode = fake_mode()
    try:
        fmodel = _fake_deepcopy(model, mode, {})
    except Exception as exc:  # noqa: BLE001 - retried with the uncopyable attributes shared
        shared = _uncopyable(model)
        try:
            fmodel = _fake_deepcopy(model, mode, {id(o): o for _, o in shared})
        except Exception as exc2:  # noqa: BLE001
            from .errors import TraceError

            where = f" (first uncopyable attribute: {shared[0][0]})" if shared else ""
            raise TraceError(
                f"ckptopt cannot copy {type(model).__name__} onto fake tensors to measure it: "
                f"{type(exc2).__name__}: {exc2}{where}. Give that attribute a __deepcopy__ (or keep it "
                "off the model).", node=shared[0][0] if shared else type(model).__name__) from exc
    return FakeCopy(mode, fmodel, inputs.map_tensors(mode.from_tensor))


def _fake_deepcopy(obj: Any, mode: Any, memo: dict) -> Any:
    import copy

    from torch._subclasses.fake_tensor import FakeCopyMode

    with FakeCopyMode(mode):
        return copy.deepcopy(obj, memo)


def _uncopyable(model: nn.Module, depth: int = 3) -> list[tuple[str, Any]]:
    """``(path, object)`` of the innermost plain-Python objects in the model's attributes that
    ``copy.deepcopy`` refuses (containers and plain objects are looked into, down to ``depth``)."""
    import copy

    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(path: str, value: Any, d: int) -> None:
        if id(value) in seen or isinstance(value, (torch.Tensor, nn.Module)) or isinstance(value, ATOMS):
            return
        seen.add(id(value))
        try:
            copy.deepcopy(value)
            return
        except Exception:  # noqa: BLE001 - this one, or something inside it
            pass
        before = len(out)
        if d > 0:
            try:
                base = base_container(value)
                if base in (dict, collections.OrderedDict):
                    items = [(f"{path}[{k!r}]", v) for k, v in dict.items(value)]
                elif base is not None or isinstance(value, tuple):
                    items = [(f"{path}[{i}]", v) for i, v in enumerate(list(value))]
                else:
                    items = [(f"{path}.{k}", v) for k, v in object.__getattribute__(value, "__dict__").items()]
            except Exception:  # noqa: BLE001
                items = []
            for p, v in items:
                visit(p, v, d - 1)
        if len(out) == before:
            out.append((path, value))

    for name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if attr not in _MODULE_INTERNALS:
                visit(f"{name + '.' if name else ''}{attr}", value, depth)
    return out


def fake_mode():
    """A ``FakeTensorMode`` whose ops follow the kernel of the tensors' device.

    PyTorch's fake tensors compute an op's output with its meta function, and a
    few meta functions carry the checks of one device's kernel (CUDA's) where
    another device runs a more permissive one: ``aten._grouped_mm`` (the MoE
    experts of transformers) demands bfloat16 in its meta function while the CPU
    kernel takes float32 and float16 too. A fake run of a float32 model on CPU
    then failed where the real run succeeds. For the ops in
    :data:`DEVICE_FAKE_IMPLS` this mode runs the real device's checks and makes
    the output itself; every other op runs as in ``FakeTensorMode``.
    """
    return _fake_mode_class()()


@functools.lru_cache(maxsize=None)
def _fake_mode_class():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class DeviceFakeTensorMode(FakeTensorMode):
        def dispatch(self, func, types, args=(), kwargs=None):
            impls = DEVICE_FAKE_IMPLS.get(str(func.name()) if hasattr(func, "name") else None)
            if impls:
                devices = {t.device.type for t in tensor_leaves((args, kwargs))}
                impl = impls.get(next(iter(devices))) if len(devices) == 1 else None
                if impl is not None:
                    schema_args = _bind_schema(func, args, kwargs or {})
                    size, dtype, device = impl(**schema_args)
                    return super().dispatch(torch.ops.aten.empty.memory_format, types, (size,),
                                            {"dtype": dtype, "device": device})
            return super().dispatch(func, types, args, kwargs)

    return DeviceFakeTensorMode


def _bind_schema(func, args: tuple, kwargs: dict) -> dict:
    names = [a.name for a in func._schema.arguments]
    out = {a.name: a.default_value if a.has_default_value() else None for a in func._schema.arguments}
    out.update(zip(names, args))
    out.update(kwargs)
    return out


def _grouped_mm_cpu(self, mat2, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm`` on the device-generic kernel (CPU): its checks and its output
    (torch 2.13, ``aten/src/ATen/native/GroupedMMUtils.h``)."""
    a, b = self, mat2
    ok = (torch.bfloat16, torch.float16, torch.float32)
    torch._check(a.dtype in ok and b.dtype == a.dtype,
                 lambda: f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {a.dtype} and {b.dtype}")
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3),
                 lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={a.dim()} and mat_b.dim()={b.dim()}")
    torch._check(a.size(-1) == b.size(-2) if a.dim() == 3 or b.dim() == 3 else True,
                 lambda: "contraction dimension of mat_a and mat_b must match")
    for mat in (a, b):
        end = mat.dim() - 1
        stride_m, stride_n = mat.stride(end - 1), mat.stride(end)
        align = 16 // mat.element_size()
        if stride_n == 1 and stride_m >= max(1, mat.size(end)):
            torch._check(stride_m % align == 0, lambda: "strides should be multiple of 16 bytes")
        elif stride_m == 1 and stride_n >= max(1, mat.size(end - 1)):
            torch._check(stride_n % align == 0, lambda: "strides should be multiple of 16 bytes")
        else:
            torch._check(False, lambda: f"Invalid strides/sizes, got {tuple(mat.stride())} for strides and "
                                        f"{tuple(mat.size())} for sizes")
    if a.dim() == 2 or b.dim() == 2:
        torch._check(offs is not None and offs.dim() == 1 and offs.dtype == torch.int32,
                     lambda: "Offsets tensor must be a 1D int32 tensor for 2D multiplicand layouts")
    else:
        torch._check(offs is None, lambda: "Offsets tensor provided, but is not needed for 3D/3D multiplicand layouts.")
    torch._check(bias is None, lambda: "Bias tensor provided, but it is not supported yet.")
    torch._check(out_dtype is None or out_dtype == a.dtype,
                 lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    if a.dim() == 2:
        size = [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    else:
        size = [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]
    return size, a.dtype, a.device


DEVICE_FAKE_IMPLS: dict[str, dict[str, Callable]] = {
    # op name -> device type -> fn(schema arguments) -> (output size, dtype, device): ops whose meta
    # function holds another device's checks (CUDA's); a fake run on these devices uses fn instead
    "aten::_grouped_mm": {"cpu": _grouped_mm_cpu},
}


@contextmanager
def quiet_fake_errors():
    """Keep ``FakeTensorMode``'s own log of a failed meta function (a full traceback at ERROR level)
    off the user's console while ckptopt runs a forward whose failure it reports itself."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    old = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(old)


# --------------------------------------------------------------------------
# why a run on fake tensors (or a capture) failed: the construct and its line
# --------------------------------------------------------------------------
def _chain(exc: BaseException | None) -> list[BaseException]:
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

    for e in _chain(exc):
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
    path = path.replace("\\", "/")
    return any(part in path for part in ("/torch/", "torch/_", "/ckptopt/", "/contextlib.py", "/functools.py")) \
        or path.startswith(("torch/", "_export/", "fx/", "_dynamo/"))


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
    for e in _chain(exc):
        text = str(e)
        m = re.search(r'following call raised this error:\s*File "([^"]+)", line (\d+), in (\S+)\n\s+(.*)', text)
        if m:
            return fmt(m.group(1), int(m.group(2)), m.group(3), m.group(4).strip())
        m = re.search(r"Caused by: \((\S+?):(\d+) in (\S+)\)", text)
        if m and not _internal_path(m.group(1)):
            return fmt(_full_path(m.group(1)), int(m.group(2)), m.group(3), None)
    for e in _chain(exc):
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
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
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
        names = [k for k in own if k not in _MODULE_INTERNALS]
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
        for attr in [k for k in own if k not in _MODULE_INTERNALS and k not in names]:
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
