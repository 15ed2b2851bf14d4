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
    pooling), so that layers without a matmul do not look free to re-run."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    class _Elementwise(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket not in flop_registry and not func.is_view:
                _Elementwise.total += sum(t.numel() for t in tensor_leaves(out))
            return out

    _Elementwise.total = 0
    # with grad: under no_grad, FlopCounterMode's module tracker fails on a layer that returns a
    # parameter itself (it hooks outputs that require grad through a grad_fn no_grad withholds)
    with torch.enable_grad(), FlopCounterMode(display=False) as counter, _Elementwise():
        module(*[a.detach().clone() for a in args], *static_inputs)
    return int(counter.get_total_flops()) + int(_Elementwise.total)
