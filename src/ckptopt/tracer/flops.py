"""A layer's compute cost: its forward FLOPs (``ChainCosts.c``)."""

from __future__ import annotations

from typing import Iterable

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
    from .capture.opaque import replayed_flops

    # with grad: under no_grad, FlopCounterMode's module tracker fails on a layer that returns a
    # parameter itself (it hooks outputs that require grad through a grad_fn no_grad withholds)
    with torch.enable_grad(), replayed_flops() as replayed:
        counted = count_flops(lambda: module(*[a.detach().clone() for a in args], *static_inputs))
        return counted + replayed()


def count_flops(run) -> int:
    """The FLOPs :func:`forward_flops` counts for ``run()``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    from .capture.opaque import replaying

    extra = _extra_formulas()

    class _Elementwise(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket not in flop_registry and func._overloadpacket not in extra and not func.is_view \
                    and not replaying():
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
