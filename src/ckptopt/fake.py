"""Fake copies of a model and the fake-tensor mode every stage runs them in.

* :func:`fake_copy`: a model and its inputs on fake tensors (no memory);
* :func:`fake_mode`: a ``FakeTensorMode`` whose ops follow the real device's kernel
  (:data:`DEVICE_FAKE_IMPLS`) and that keeps the real value ("shadow") of what the example
  inputs alone determine, so that ops of data-dependent shape on such values run;
* :func:`quiet_fake_errors`.
"""

from __future__ import annotations

import collections
import operator
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.utils import _pytree as pytree

from .torch_utils import MODULE_INTERNALS, ATOMS, Inputs, base_container, is_fake, tensor_leaves

__all__ = ["FakeCopy", "fake_copy", "fake_mode", "DEVICE_FAKE_IMPLS", "device_meta_kernels", "idle_module_to", "quiet_fake_errors", "SHADOW_MAX_ELEMENTS"]


# --------------------------------------------------------------------------
# fake copies
# --------------------------------------------------------------------------
@dataclass
class FakeCopy:
    """A model and its inputs on fake tensors: the same shapes, dtypes and storages, no memory."""

    mode: Any  # torch._subclasses.fake_tensor.FakeTensorMode
    model: nn.Module
    inputs: Inputs


def fake_copy(model: nn.Module, inputs: Inputs, share: tuple = ()) -> FakeCopy:
    """Deep-copy ``model`` onto fake tensors (parameters, buffers) and convert ``inputs``.

    Run the copy inside ``with copy.mode:``; nothing it computes allocates memory.
    The mode is a :func:`fake_mode`: an op runs the checks of the kernel the real
    tensors' device runs, so a fake run takes the path the real run takes.
    Attributes that cannot be deep-copied (a lock, an open file, a generator) are
    shared with the copy rather than copied, and so are the objects in ``share`` from
    the start (a graph node the copy only reads: copying one recurses through its graph).

    Raises
    ------
    TraceError
        When the model cannot be copied even so, naming the attribute.
    """
    mode = fake_mode()
    try:
        fmodel = _fake_deepcopy(model, mode, {id(o): o for o in share})
    except Exception as exc:  # noqa: BLE001 - retried with the uncopyable attributes shared
        shared = _uncopyable(model)
        try:
            fmodel = _fake_deepcopy(model, mode, {id(o): o for o in [*share, *(o for _, o in shared)]})
        except Exception as exc2:  # noqa: BLE001
            from .errors import TraceError

            where = f" (first uncopyable attribute: {shared[0][0]})" if shared else ""
            raise TraceError(
                f"ckptopt cannot copy {type(model).__name__} onto fake tensors to measure it: "
                f"{type(exc2).__name__}: {exc2}{where}. Give that attribute a __deepcopy__ (or keep it "
                "off the model).", node=shared[0][0] if shared else type(model).__name__) from exc
    _shadow_constants(model, fmodel, mode)
    return FakeCopy(mode, fmodel, inputs.map_tensors(mode.from_input))


SHADOW_CONSTANT_MAX_ELEMENTS = 1 << 20
#: Float buffers and constants get shadows up to this size: the scalars a mask is built with
#: (Longformer's extended attention mask, from which it reads its global-attention count), not
#: the tables of a large model (its activations would follow them for real).
SHADOW_FLOAT_CONSTANT_MAX_ELEMENTS = 1 << 10


def _shadow_constants(model: nn.Module, fmodel: nn.Module, mode: Any) -> None:
    """Shadow the copy's buffers and graph constants (a decoder start token, position ids) with
    their real values: what the inputs determine is often computed with them too."""
    if not hasattr(mode, "shadows"):
        return
    pairs = list(zip((b for _, b in model.named_buffers()), (b for _, b in fmodel.named_buffers())))
    if isinstance(model, torch.fx.GraphModule):
        for n in model.graph.nodes:
            if n.op != "get_attr":
                continue
            try:
                get = operator.attrgetter(n.target)
                real, fake = get(model), get(fmodel)
            except AttributeError:
                continue
            if isinstance(real, torch.Tensor) and not isinstance(real, nn.Parameter):
                pairs.append((real, fake))
    for real, fake in pairs:
        if (isinstance(real, torch.Tensor) and is_fake(fake) and not is_fake(real) and not real.is_meta
                and not real.requires_grad and not real.is_complex()
                and real.numel() <= (SHADOW_CONSTANT_MAX_ELEMENTS if not real.is_floating_point() else
                                     SHADOW_FLOAT_CONSTANT_MAX_ELEMENTS)
                and fake not in mode.shadows and tuple(real.shape) == tuple(fake.shape)):
            mode._keep(fake, real.detach().clone())


def _fake_deepcopy(obj: Any, mode: Any, memo: dict) -> Any:
    import copy

    from torch._subclasses.fake_tensor import FakeCopyMode

    with FakeCopyMode(mode), warnings.catch_warnings():
        # torch 2.13 copies a pytree TreeSpec (a transformers model holds some) through its own
        # deprecated isinstance(treespec, LeafSpec) check: its FutureWarning is not the user's business
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*deprecated", category=FutureWarning)
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
            if attr not in MODULE_INTERNALS:
                visit(f"{name + '.' if name else ''}{attr}", value, depth)
    return out


def fake_mode():
    """A ``FakeTensorMode`` whose ops follow the kernel of the tensors' device.

    PyTorch's fake tensors compute an op's output with its meta function, and a
    few meta functions carry the checks of one device's kernel (CUDA's) where
    another device runs a more permissive one: ``aten._grouped_mm`` (the MoE
    experts of transformers) demands bfloat16 in its meta function while the CPU
    kernel takes float32 and float16 too, so a fake run of a float32 model on CPU
    would fail where the real run succeeds. For the ops in
    :data:`DEVICE_FAKE_IMPLS` this mode runs the real device's checks and makes
    the output itself; every other op runs as in ``FakeTensorMode``. It also keeps
    the real value ("shadow") of what the example inputs alone determine, so that
    ops of data-dependent shape on such values run.
    """
    return DeviceFakeTensorMode()


# Shadows: the real values of what the example inputs alone determine. Fake tensors carry shapes and
# no values, so an op whose output shape depends on values (``nonzero``, boolean-mask indexing,
# ``unique_consecutive``, ``.item()``) cannot run on them. Such values are mostly computed from the
# inputs (the index of each row's EOS token in sequence classification, the positions of audio
# tokens, a sequence's length); the fake mode keeps a real copy ("shadow") of every tensor computed
# from the inputs only (never from a parameter, never a random op) and answers those ops from it.
SHADOW_MAX_ELEMENTS = 1 << 24  # a shadowed op's outputs beyond this are not computed for real
_INDEX_OPS = ("aten::index.Tensor", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
              "aten::_unsafe_index_put", "aten::_unsafe_index.Tensor")


_DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)


def _reads_real(args: tuple, kwargs: dict) -> bool:
    """Whether an op's arguments hold a tensor that is not fake."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if not isinstance(a, FakeTensor):
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) and not isinstance(b, FakeTensor)
                                                   for b in a):
            return True
    return False


class DeviceFakeTensorMode(FakeTensorMode):
    """The mode of :func:`fake_mode`: ``FakeTensorMode`` with the real device's checks for the ops
    of :data:`DEVICE_FAKE_IMPLS`, and shadows of what the example inputs alone determine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shadows = _Shadows()  # fake tensor -> its real value
        self._captured_fakes: dict[int, tuple] = {}  # id of a real tensor read by an op -> (weak ref, fake)
        self._views: dict[int, list] = {}  # fake storage id -> weak references to the shadowed views of it

    def _keep(self, fake, real) -> None:
        import weakref

        self.shadows[fake] = real
        self._views.setdefault(id(fake.untyped_storage()), []).append(weakref.ref(fake))

    def _forget(self, fake) -> None:
        """Drop the shadows of every view of ``fake``'s storage (written with values we lack)."""
        for ref in self._views.pop(id(fake.untyped_storage()), ()):
            t = ref()
            if t is not None:
                self.shadows.pop(t, None)
        self.shadows.pop(fake, None)

    def from_input(self, t: torch.Tensor) -> torch.Tensor:
        """A model input as a fake tensor; the value of an integer or boolean one (ids, labels,
        masks: what sizes data-dependent ops in practice) is kept as a shadow. Float data gets
        none, so a model fed only floats pays nothing for shadows."""
        fake = self.from_tensor(t)
        if (not t.requires_grad and not t.is_meta and not is_fake(t) and t.numel() <= SHADOW_MAX_ELEMENTS
                and not t.is_floating_point() and not t.is_complex()):
            with unset_fake_temporarily():
                real = t.detach().clone()
            self._keep(fake, real)
        return fake

    def _captured(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor an op reads that no input or parameter brought in (a loss's targets, a
        plain tensor attribute): made fake once, as a model input is (its integer value kept)."""
        import weakref

        hit = self._captured_fakes.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        fake = self.from_input(t)
        self._captured_fakes[id(t)] = (weakref.ref(t), fake)
        return fake

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_real(args, kwargs):  # (a cheap scan: ATen arguments nest one list deep at most)
            args, kwargs = self._all_fake(args, kwargs)
        out = self._on_device_kernel(func, types, args, kwargs)
        if out is not None:
            return out
        if not self.shadows:
            return super().dispatch(func, types, args, kwargs)
        try:
            out = super().dispatch(func, types, args, kwargs)
        except _DATA_DEPENDENT:
            out = self._from_shadows(func, types, args, kwargs)
            if out is None:
                raise
            return out
        self._shadow(func, args, kwargs, out)
        return out

    def _all_fake(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """An op's arguments with each real tensor in them made fake (:meth:`_captured`)."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        flat = [self._captured(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
                for a in flat]
        return pytree.tree_unflatten(flat, spec)

    def _on_device_kernel(self, func, types, args: tuple, kwargs: dict):
        """The output of an op of :data:`DEVICE_FAKE_IMPLS` whose tensors are all on a device it has a
        function for, after that device's checks; None for every other op."""
        impls = DEVICE_FAKE_IMPLS.get(str(func.name()) if hasattr(func, "name") else None)
        if not impls:
            return None
        devices = {t.device.type for t in tensor_leaves((args, kwargs))}
        impl = impls.get(next(iter(devices))) if len(devices) == 1 else None
        if impl is None:
            return None
        size, dtype, device = impl(**_bind_schema(func, args, kwargs))
        return super().dispatch(torch.ops.aten.empty.memory_format, types, (size,), {"dtype": dtype, "device": device})

    # -- shadows -------------------------------------------------------------------------------
    def _real(self, func, args, kwargs):
        """``func`` run on the shadows (None when an input tensor has none, or the run fails)."""
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(t, FakeTensor) and t not in self.shadows for t in leaves):
            return None
        if any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in leaves):
            return None  # (a real tensor beside fake ones: not ours to compute with)
        real_args, real_kwargs = pytree.tree_map_only(FakeTensor, lambda t: self.shadows[t], (args, kwargs))
        try:
            with unset_fake_temporarily(), torch.no_grad():
                return (func(*real_args, **real_kwargs),)
        except Exception:  # noqa: BLE001 - a value we cannot compute: the op stays unshadowed
            return None

    def _shadow(self, func, args, kwargs, out) -> None:
        """After ``func`` ran on fake tensors: shadow its outputs with their real values when every
        tensor it read has one; else drop the shadows of what it made and of what it wrote."""
        shadows = self.shadows
        if (any(isinstance(t, FakeTensor) and t not in shadows for t in _tensors(args, kwargs))
                or torch.Tag.nondeterministic_seeded in func.tags or torch.Tag.inplace_view in func.tags):
            # no value for what it makes (an inner op of a decomposition may have shadowed it),
            # and what it writes is no longer its shadow's value
            for t in _tensors((out,), {}):
                shadows.pop(t, None)
            self._forget_written(func, args, kwargs)
            return
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, FakeTensor)]
        if not outs and not func._schema.is_mutable:
            return
        big = sum(t.numel() for t in outs) > SHADOW_MAX_ELEMENTS
        real = None if big else self._real(func, args, kwargs)
        if real is None:
            for t in outs:
                shadows.pop(t, None)
            self._forget_written(func, args, kwargs)
            return
        for f, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(real[0])):
            if isinstance(f, FakeTensor) and isinstance(r, torch.Tensor) and tuple(f.shape) == tuple(r.shape):
                self._keep(f, r)

    def _forget_written(self, func, args, kwargs) -> None:
        """Drop the shadows of the storages a mutating op writes into."""
        if func._schema.is_mutable:
            for t in _written(func, args, kwargs):
                if isinstance(t, FakeTensor):
                    self._forget(t)

    def _from_shadows(self, func, types, args, kwargs):
        """An op whose output shape depends on values, answered from the shadows: run for real
        when every input is shadowed; a boolean-mask index made integer indices from its shadow.
        None when the shadows cannot answer it."""
        real = self._real(func, args, kwargs)
        if real is not None:
            return pytree.tree_map(self._fake_of, real[0])
        name = str(func.name())
        if name == "aten::masked_select":
            return self._masked_select_from_shadow(types, args)
        if name in _INDEX_OPS:
            return self._index_from_shadows(func, types, args, kwargs)
        return None

    def _fake_of(self, r):
        """A real output as a fake tensor shadowed by it (anything else as it is)."""
        if not isinstance(r, torch.Tensor):
            return r
        with unset_fake_temporarily():
            f = self.from_tensor(r)
        self._keep(f, r)
        return f

    def _shadowed_mask(self, t) -> bool:
        return isinstance(t, FakeTensor) and t.dtype in (torch.bool, torch.uint8) and t in self.shadows

    def _masked_select_from_shadow(self, types, args):
        """``masked_select``'s output sized by its shadowed mask's count (None without a shadow)."""
        if not self._shadowed_mask(args[1]):
            return None
        mask = self.shadows[args[1]]
        shape = torch.broadcast_shapes(tuple(args[0].shape), tuple(mask.shape))
        count = int(torch.broadcast_to(mask, shape).count_nonzero())
        return super().dispatch(torch.ops.aten.empty.memory_format, types, ((count,),),
                                {"dtype": args[0].dtype, "device": args[0].device})

    def _index_from_shadows(self, func, types, args, kwargs):
        """An index op with each shadowed boolean mask among its indices replaced by the integer
        indices of its true entries (None when it has no such mask)."""
        new = []
        changed = False
        for t in list(args[1]):
            if self._shadowed_mask(t):
                with unset_fake_temporarily():
                    longs = [self.from_tensor(i) for i in self.shadows[t].nonzero().unbind(1)]
                new.extend(longs)
                changed = True
            else:
                new.append(t)
        if not changed:
            return None
        return super().dispatch(func, types, (args[0], new, *args[2:]), kwargs)


class _Shadows:
    """Fake tensor -> its real value, by identity, forgotten when the fake tensor dies (a dict of
    ids with weak references: cheaper per lookup than ``WeakIdKeyDictionary``, and every op of a
    fake run looks its inputs up)."""

    def __init__(self):
        self._d: dict[int, tuple] = {}

    def __contains__(self, t) -> bool:
        e = self._d.get(id(t))
        return e is not None and e[0]() is t

    def __getitem__(self, t):
        e = self._d.get(id(t))
        if e is None or e[0]() is not t:
            raise KeyError(t)
        return e[1]

    def __setitem__(self, t, real) -> None:
        import weakref

        k, d = id(t), self._d

        def gone(ref, k=k, d=d):
            if d.get(k, (None,))[0] is ref:
                del d[k]

        d[k] = (weakref.ref(t, gone), real)

    def pop(self, t, default=None):
        e = self._d.get(id(t))
        if e is None or e[0]() is not t:
            return default
        del self._d[id(t)]
        return e[1]

    def __len__(self) -> int:
        return len(self._d)


def _tensors(args: tuple, kwargs: dict) -> list:
    """The tensors among an op's arguments (flat, or in one level of lists: ``cat``, ``index``)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _written(func, args: tuple, kwargs: dict) -> list:
    """The tensors an op writes into (its schema's ``Tensor(a!)`` arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))
    return out


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
def device_meta_kernels(device_type: str):
    """While active, the meta functions of :data:`DEVICE_FAKE_IMPLS`' ops follow ``device_type``'s
    kernel: for fake modes ckptopt does not own (``torch.export``'s), whose meta tensors no longer
    know the device. The caller names the device (the model's)."""
    ops = {name: impls[device_type] for name, impls in DEVICE_FAKE_IMPLS.items() if device_type in impls}
    if not ops:
        yield
        return
    from torch._C import DispatchKey

    def kernel(impl, overload):
        def meta(*args, **kwargs):
            size, dtype, _ = impl(**_bind_schema(overload, args, kwargs))
            return torch.empty(size, dtype=dtype, device="meta")

        return meta

    # the meta function is a Python kernel of the overload (used under the Python dispatcher, as
    # torch.export runs): swapped for the duration, the overload's dispatch cache cleared both ways
    saved = {}
    for name, impl in ops.items():
        overload = getattr(torch.ops.aten, name.split("::")[1]).default
        saved[overload] = overload.py_kernels.get(DispatchKey.Meta)
        overload.py_kernels[DispatchKey.Meta] = kernel(impl, overload)
        overload._dispatch_cache.clear()
    try:
        yield
    finally:
        for overload, old in saved.items():
            if old is None:
                overload.py_kernels.pop(DispatchKey.Meta, None)
            else:
                overload.py_kernels[DispatchKey.Meta] = old
            overload._dispatch_cache.clear()


@contextmanager
def idle_module_to():
    """``module.to(dtype)`` in a forward that changes nothing (SwitchTransformers' router casts its
    classifier to the dtype it has, every call) returns the module: under torch.export and in
    ckptopt's fake copies the parameters are fake tensors, which ``nn.Module._apply`` cannot swap
    even for themselves."""
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None and all(
                (device is None or t.device == device or (device.index is None and t.device.type == device.type))
                and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
                for t in (*self.parameters(), *self.buffers())):
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


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
