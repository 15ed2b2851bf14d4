"""A layer's compute cost: its forward and backward compute (``ChainCosts.c``, ``cb``)."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ..torch_utils import tensor_leaves
from . import op_time
from .op_time import elements, weights_for

__all__ = ["forward_flops", "layer_compute"]


def forward_flops(module: nn.Module, args: list[torch.Tensor], static_inputs: Iterable[torch.Tensor] = ()) -> int:
    """Forward compute of a layer (:func:`layer_compute`'s first figure)."""
    return layer_compute(module, args, static_inputs, backward=False)[0]


def layer_compute(module: nn.Module, args: list[torch.Tensor], static_inputs: Iterable[torch.Tensor] = (),
                  backward: bool = True) -> tuple[int, int]:
    """``(forward, backward)``: the compute of a layer's forward and of its backward, as
    :func:`count_flops` prices them: FLOPs of the ops ``torch.utils.flop_counter`` has a formula for
    (matmuls, convolutions, attention), every other op that is not a view priced by its measured time
    per element (:mod:`.op_time`), so that layers without a matmul do not look free to re-run and a
    dropout mask costs what it costs. The backward is the gradient of the outputs that need one with
    respect to the inputs and parameters that take one (its seed gradients made outside the count); 0
    when none do, or with ``backward=False``. A submodule run as one op (:mod:`.capture.opaque`) counts
    what its forward counted on the example batch, and twice that for its backward (its replay runs no
    backward ops)."""
    # with grad: under no_grad, FlopCounterMode's module tracker fails on a layer that returns a
    # parameter itself (it hooks outputs that require grad through a grad_fn no_grad withholds)
    with torch.enable_grad(), replayed_flops() as replayed:
        inputs = [_leaf(a, clone=True) for a in args]
        others = [_leaf(a, clone=False) for a in static_inputs]
        result = {}

        def run():
            result["out"] = module(*inputs, *others)

        counted = count_flops(run)
        replayed_forward = replayed()
        forward = counted + replayed_forward
        if not backward:
            return forward, 0
        outs = [t for t in tensor_leaves(result.pop("out")) if t.requires_grad]
        wrt = [t for t in (*inputs, *others, *module.parameters()) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not wrt:
            return forward, 0
        seeds = [torch.ones_like(t) for t in outs]
        counted = count_flops(lambda: torch.autograd.grad(outs, wrt, seeds, allow_unused=True))
        return forward, counted + 2 * replayed_forward


def _leaf(t: Any, clone: bool) -> Any:
    """A tensor argument cut from the graph that made it (a layer's backward must not reach earlier
    layers), needing a gradient where the original does; a copy with ``clone`` (an in-place op of the
    layer must not change the propagated value)."""
    if not isinstance(t, torch.Tensor):
        return t
    out = t.detach().clone() if clone else t.detach()
    return out.requires_grad_() if t.requires_grad and (out.is_floating_point() or out.is_complex()) else out


def count_flops(run) -> int:
    """The compute :func:`forward_flops` counts for ``run()``: FLOPs where ``torch.utils.flop_counter``
    has a formula, and every other operator that is not a view priced by its elements
    (:func:`.op_time.elements`) times its measured FLOP-equivalents per element on the device type it
    runs for (:func:`.op_time.weights_for`; one per element where none is measured)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    extra = _extra_formulas()
    products = formula_ops()

    class _Elementwise(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func._overloadpacket)
            outs = tensor_leaves(out)  # (none: metadata, no work; a fake tensor's device is the one it stands for)
            if outs and name not in products and not func.is_view and not _counting_state().off:
                weights = weights_for(outs[0].device.type) if op_time.PRICED else None
                n = elements(name, (args, kwargs), outs)
                _Elementwise.total += n * weights.weight(name) if weights is not None else n
            return out

    _Elementwise.total = 0
    with FlopCounterMode(display=False, custom_mapping=extra) as counter, _Elementwise():
        run()
    return int(counter.get_total_flops()) + int(_Elementwise.total)


@functools.lru_cache(maxsize=None)
def formula_ops() -> frozenset[str]:
    """The operators priced by FLOP formulas (``torch.utils.flop_counter``'s and :func:`_extra_formulas`),
    by overload packet name."""
    from torch.utils.flop_counter import flop_registry

    return frozenset(str(op) for op in (*flop_registry, *_extra_formulas()))


def _extra_formulas() -> dict:
    """Formulas ``torch.utils.flop_counter`` lacks: CPU's fused attention
    (``_scaled_dot_product_flash_attention_for_cpu``, what SDPA runs on CPU) and its backward, priced
    as the CUDA flash kernels are. Without it a CPU attention counts one FLOP per output element, and
    a plan that re-runs every attention looks free."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    out = {}
    op = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        out[op] = lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
    op = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if op is not None:
        out[op] = lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v)
    return out


# -- submodules run as one op (capture/opaque.py): their FLOPs come from the example's run ----------
_state = threading.local()


def _counting_state() -> Any:
    if not hasattr(_state, "off"):
        _state.off, _state.total = False, None
    return _state


@contextmanager
def replayed_flops() -> Iterator[Any]:
    """While active, :func:`add_replayed_flops` adds to a total; yields a function that gives it."""
    state = _counting_state()
    saved, state.total = state.total, 0
    try:
        yield lambda: state.total
    finally:
        state.total = saved


def add_replayed_flops(n: int) -> None:
    """A replayed submodule's forward FLOPs, counted where :func:`forward_flops` is counting."""
    state = _counting_state()
    if state.total is not None:
        state.total += n


@contextmanager
def not_counted() -> Iterator[None]:
    """Ops run meanwhile count no FLOPs (a replay's allocations compute nothing)."""
    state = _counting_state()
    saved, state.off = state.off, True
    try:
        yield
    finally:
        state.off = saved
