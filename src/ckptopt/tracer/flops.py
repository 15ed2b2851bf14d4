"""A layer's compute cost: its forward FLOPs (``ChainCosts.c``)."""

from __future__ import annotations

from typing import Iterable

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..torch_utils import tensor_leaves

__all__ = ["forward_flops"]


def forward_flops(module: nn.Module, args: list[torch.Tensor], static_inputs: Iterable[torch.Tensor] = ()) -> int:
    """Forward compute of a layer: FLOPs of the ops ``torch.utils.flop_counter``
    has a formula for (matmuls, convolutions, attention), plus one per output
    element of every other op that is not a view (elementwise ops, norms,
    pooling), so that layers without a matmul do not look free to re-run. A
    submodule run as one op (:mod:`.capture.opaque`) counts what it counted when
    it ran on the example batch."""
    # with grad: under no_grad, FlopCounterMode's module tracker fails on a layer that returns a
    # parameter itself (it hooks outputs that require grad through a grad_fn no_grad withholds)
    with torch.enable_grad(), replayed_flops() as replayed:
        counted = count_flops(lambda: module(*[a.detach().clone() for a in args], *static_inputs))
        return counted + replayed()


def count_flops(run) -> int:
    """The FLOPs :func:`forward_flops` counts for ``run()``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    extra = _extra_formulas()

    class _Elementwise(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket not in flop_registry and func._overloadpacket not in extra and not func.is_view \
                    and not _counting_state().off:
                _Elementwise.total += sum(t.numel() for t in tensor_leaves(out))
            return out

    _Elementwise.total = 0
    with FlopCounterMode(display=False, custom_mapping=extra) as counter, _Elementwise():
        run()
    return int(counter.get_total_flops()) + int(_Elementwise.total)


def _extra_formulas() -> dict:
    """Formulas ``torch.utils.flop_counter`` lacks: CPU's fused attention
    (``_scaled_dot_product_flash_attention_for_cpu``, what SDPA runs on CPU), priced as the
    CUDA flash kernel is. Without it a CPU attention counts one FLOP per output element, and
    a plan that re-runs every attention looks free (issue 40)."""
    from torch.utils.flop_counter import sdpa_flop_count

    aten = torch.ops.aten
    out = {}
    op = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        out[op] = lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
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
