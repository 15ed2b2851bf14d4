"""Custom ``torch.autograd.Function``\\ s kept whole in an exported graph.

``torch.export`` records ATen ops, so a model's own ``autograd.Function`` (Bloom's GELU,
PhiMoE's sparse mixer, YOSO's LSH cumulation) is traced through: the graph keeps the ops
of its ``forward`` and autograd differentiates those instead of calling the Function's
``backward``. The gradients then differ (Bloom: ~1e-7 relative; YOSO: the loss too, its
``backward`` is not the derivative of its ``forward``) and the saved tensors are not the
ones the Function saves.

Under ``torch.fx`` (which runs Python) the call becomes one ``call_function`` node whose
target applies the Function. Under ``torch.export``, while :func:`opaque_functions` is
active, each call ``F.apply(*args)`` of a Function defined outside torch becomes one op of
the library ``ckptopt_fn`` (one op per class and non-tensor arguments): its tensor
arguments go in as a list, its tensor outputs come out as a list. The op's kernels call
``F.apply`` itself, so the rewritten module runs the Function's own ``forward`` and
``backward``, and the tracer measures what it saves; its fake kernel runs ``F.forward`` on
fake tensors. A call the op cannot carry (keyword arguments, symbolic sizes or tensors
inside containers among the arguments) is traced through: the graph keeps the ATen ops of
its ``forward``.

The ops live as long as the process: a module rewritten from such a graph runs in the
process that planned it.
"""

from __future__ import annotations

import itertools
import re
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ...storages import storage_identity

__all__ = ["opaque_functions", "is_opaque_function", "functions_note"]

NAMESPACE = "ckptopt_fn"
_ORIGINAL_APPLY = torch.autograd.function.Function.apply.__func__
_lib: torch.library.Library | None = None
_calls: dict[Any, "_Call"] = {}
_classes: dict[str, type] = {}  # op name -> the Function class it applies
_count = itertools.count()
_state = threading.local()
_lock = threading.Lock()


def is_opaque_function(target: Any) -> bool:
    """Whether an fx node target is one of these ops (its randomness cannot be seen: treat it as random)."""
    return getattr(target, "namespace", None) == NAMESPACE or getattr(target, "_ckptopt_function", None) is not None


def functions_note(gm: Any) -> str | None:
    """A line for ``explain()`` naming the custom autograd Functions the graph keeps whole, or None."""
    names = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and is_opaque_function(n.target):
            cls = getattr(n.target, "_ckptopt_function", None) or _classes.get(n.target._opname)
            if cls is not None and cls.__module__ == __name__.rpartition(".")[0] + ".opaque":
                continue  # a submodule run as one op: named in a note of its own
            name = cls.__qualname__ if cls is not None else str(n.target)
            if name not in names:
                names.append(name)
    if not names:
        return None
    return (f"custom autograd Functions kept whole (their own backward runs; what they save is priced): "
            f"{', '.join(names)}")


def first_argument(target: Any) -> Any:
    """The first non-tensor argument fixed in one of these ops (an opaque submodule's call), or None."""
    name = getattr(target, "_opname", None) if getattr(target, "namespace", None) == NAMESPACE else None
    for call in list(_calls.values()):
        if call.name == name:
            return call.template[0] if call.template else None
    return None


_fx_targets: dict[type, Any] = {}


def _fx_target(cls: type) -> Any:
    """The call_function target that applies ``cls`` (torch.fx graphs run Python: no op needed)."""
    fn = _fx_targets.get(cls)
    if fn is None:
        def fn(*args: Any) -> Any:
            return _ORIGINAL_APPLY(cls, *args)

        fn.__name__ = fn.__qualname__ = f"apply_{re.sub(r'[^0-9A-Za-z_]', '_', cls.__name__)}"
        fn._ckptopt_function = cls
        _fx_targets[cls] = fn
    return fn


class _Call:
    """``cls.apply`` with fixed non-tensor arguments; the tensor arguments fill ``slots``."""

    def __init__(self, cls: type, args: tuple, name: str):
        self.cls, self.name = cls, name
        self.template = list(args)
        self.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        for i in self.slots:
            self.template[i] = None  # no tensor of the capture is kept
        self.structure: tuple | None = None  # how the outputs nest: (is_tuple, positions of None)

    def args(self, tensors: list[torch.Tensor]) -> list:
        out = list(self.template)
        for i, t in zip(self.slots, tensors):
            out[i] = t
        return out

    def flatten(self, out: Any) -> list[torch.Tensor]:
        items = list(out) if isinstance(out, tuple) else [out]
        if not all(x is None or isinstance(x, torch.Tensor) for x in items):
            kinds = ", ".join(sorted({type(x).__name__ for x in items}))
            raise TypeError(f"{self.cls.__qualname__}.forward returns {kinds}: ckptopt keeps a custom "
                            "autograd.Function whole only when it returns tensors (or None); pass capture='fx'")
        self.structure = (isinstance(out, tuple), tuple(i for i, x in enumerate(items) if x is None), len(items))
        return [x for x in items if x is not None]

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        is_tuple, nones, n = self.structure
        it = iter(tensors)
        items = [None if i in nones else next(it) for i in range(n)]
        return tuple(items) if is_tuple else items[0]

    # kernels ------------------------------------------------------------------------------
    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The Function itself (autograd records its own backward)."""
        _state.inside = getattr(_state, "inside", 0) + 1
        try:
            apply = getattr(self.cls, "ckptopt_apply", None)  # (a class of ckptopt's own applies itself)
            args = self.args(list(tensors))
            return self.flatten(apply(*args) if apply is not None else _ORIGINAL_APPLY(self.cls, *args))
        finally:
            _state.inside -= 1

    def fake(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Shapes from the Function's forward on fake tensors; outputs are fresh (an op's outputs alias nothing)."""
        with torch.no_grad():
            outs = self.run(tensors)
        given = {storage_identity(t) for t in tensors}
        return [o.clone() if storage_identity(o) in given else o for o in outs]


def _library() -> torch.library.Library:
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _lib


def _key(cls: type, args: tuple) -> Any | None:
    """The op's identity: the class and its non-tensor arguments (None: the call cannot be an op)."""
    key: list[Any] = [cls]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append(torch.Tensor)
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None  # a size known only symbolically would be baked in
        elif isinstance(a, (list, tuple, dict)) and any(
                isinstance(x, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
                for x in (a.values() if isinstance(a, dict) else a)):
            return None
        else:
            try:
                hash(a)
                key.append((type(a), a))
            except TypeError:
                key.append(("id", id(a)))  # kept alive by the op's template
    return tuple(key)


def _op_for(cls: type, args: tuple) -> tuple[_Call, Any] | None:
    key = _key(cls, args)
    if key is None:
        return None
    with _lock:
        call = _calls.get(key)
        if call is None:
            name = f"{re.sub(r'[^0-9A-Za-z_]', '_', cls.__name__)}_{next(_count)}"
            call = _Call(cls, args, name)
            lib = _library()
            lib.define(f"{name}(Tensor[] tensors) -> Tensor[]")
            lib.impl(name, call.run, "CompositeExplicitAutograd")
            lib.impl(name, call.run, "Autograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}", call.fake, lib=lib)
            _calls[key] = call
            _classes[name] = cls
    return call, getattr(getattr(torch.ops, NAMESPACE), call.name).default


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
    if proxy is not None and not kwargs and cls.__module__.split(".")[0] != "torch":
        try:
            return proxy.tracer.create_proxy("call_function", _fx_target(cls), args, {})
        except Exception:  # noqa: BLE001 - an argument FX cannot hold: traced through
            return _ORIGINAL_APPLY(cls, *args)
    if (kwargs or getattr(_state, "inside", 0) or cls.__module__.split(".")[0] == "torch"
            or not any(isinstance(a, torch.Tensor) for a in args)):
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    found = _op_for(cls, args)
    if found is None:
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    call, op = found
    return call.rebuild(op([a for a in args if isinstance(a, torch.Tensor)]))


@contextmanager
def opaque_functions() -> Iterator[None]:
    """While active, custom autograd Functions applied by the model become ``ckptopt_fn`` ops."""
    base = torch.autograd.function.Function
    saved = base.__dict__["apply"]
    base.apply = classmethod(_apply)
    try:
        yield
    finally:
        base.apply = saved
