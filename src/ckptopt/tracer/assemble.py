"""The measured layers become the chain cost model (docs/design.md §3-4).

:func:`chain_costs` takes each layer's :class:`~ckptopt.tracer.layer_costs.LayerMeasurement`, the side
tensors and the gradient storages the layers' measurements found, and builds the
:class:`~ckptopt.costs.ChainCosts` the solvers read: a field the measurement left unknown (None) takes
the figure it refines, as the cost model's defaults do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..costs import ChainCosts
from ..storages import distinct_storages, storage_identity, storage_nbytes
from ..torch_utils import tensor_leaves
from .layers import Layer

__all__ = ["ChainParts", "chain_costs", "prefix_peak", "output_gradient_at_read"]


@dataclass
class ChainParts:
    """What the cost model is built from besides the layers' own measurements."""

    side: list  #: the side tensors (those the layers found and the hoisted values they read)
    grad_store: list[int]  #: per layer: bytes of the storage its output gradient lives in (``g``)
    grad_root: list[int]  #: per layer: the layer whose output gradient that storage is (``groot``)
    param_grad_bytes: list[int]  #: per layer: the parameter gradients it makes (``p``)
    static: int  #: parameters, buffers, inputs, autocast's weight casts and the hoisted values kept
    #: what the hoisted prefix needs above what it keeps (None: no value is hoisted)
    prefix_peak: int | None = None


def chain_costs(layers: list[Layer], parts: ChainParts) -> ChainCosts:
    """The chain cost model of the measured ``layers``."""
    m = [l.costs for l in layers]
    side = parts.side
    # the prefix's own high point: no layer runs then, so layer 0's forward figures carry what exceeds
    # the values kept (ProphetNet builds large position buckets to keep a few)
    f = [x.f for x in m]
    ff = [x.f if x.ff is None else x.ff for x in m]
    fc = [x.f if x.fc is None else x.fc for x in m]  # (a checkpoint's first pass)
    ffc = [y if x.ffc is None else x.ffc for y, x in zip(ff, m)]
    if parts.prefix_peak is not None and f:
        f[0] = max(f[0], parts.prefix_peak)
        ff[0], fc[0], ffc[0] = max(ff[0], f[0]), max(fc[0], f[0]), max(ffc[0], f[0])
    rg = output_gradient_at_read(layers, side, parts.grad_root, parts.grad_store)
    br = [x.b if x.br is None else x.br for x in m]
    bkr = [(x.b if x.bk is None else x.bk) if x.bkr is None else x.bkr for x in m]
    frame = side and all(x.frame_pre is not None for x in m)  # (each layer's backward split at its frame's release)
    return ChainCosts(
        a=[x.a for x in m], p=parts.param_grad_bytes, sin=[x.sin for x in m], sout=[x.sout for x in m],
        m=[x.m for x in m], f=f, b=[x.b for x in m], fs=[x.fs for x in m], ff=ff,
        ffs=[x.fs if x.ffs is None else x.ffs for x in m], fc=fc, ffc=ffc, rg=rg,
        bk=[x.b if x.bk is None else x.bk for x in m], bf=[x.b if x.bf is None else x.bf for x in m],
        br=br, bkr=bkr,
        # a checkpointed segment's last saving layer: its backward from its first read of a saved tensor
        # on (the recomputation runs before), and the gradients held at the peak of the part before
        brt=[y if x.brt is None else x.brt for y, x in zip(br, m)],
        bkrt=[y if x.bkrt is None else x.bkrt for y, x in zip(bkr, m)],
        rgp=[y + x.rgx for y, x in zip(rg, m)],
        g=parts.grad_store, dead=[x.dead for x in m], holds=[x.holds for x in m],
        static=parts.static, names=[l.name for l in layers], c=[l.flops for l in layers],
        cb=[l.backward_flops for l in layers], side=side,
        groot=parts.grad_root if side else None, gh=[x.gh for x in m] if side else None,
        fpre=[int(x.frame_pre or 0) for x in m] if frame else None,
        fpost=[int(x.frame_post or 0) for x in m] if frame else None,
        # ... where only the frame holds the layer's input (it goes with the frame)
        fkpre=[int(x.frame_pre_k if x.frame_pre_k is not None else x.frame_pre or 0) for x in m] if frame else None,
        fkpost=[int(x.frame_post_k if x.frame_post_k is not None else x.frame_post or 0) for x in m]
        if frame else None,
    )


def output_gradient_at_read(layers: list[Layer], side: list, grad_root: list[int], grad_store: list[int]) -> list[int]:
    """Each layer's ``rg``. Measured alone, an output gradient the layer's backward uses up before it first
    reads a saved tensor is gone with its storage; in the model a side tensor's pending gradient that views
    the same storage (an addition hands both one gradient, a concatenation slices of one) holds it on, until
    that side tensor's producer runs its backward: ``rgk`` then. A layer with no chain output whose side
    output's gradient is its ``g`` (a slice of a later storage) leaves that gradient out (``rgl``): the
    kernels add ``g``."""
    held = {t.grad_view for t in side if t.grad_view is not None and t.grad_view >= 0}
    out = []
    for j, l in enumerate(layers):
        shared = grad_root[j] in held and any(t.grad_view == grad_root[j] and t.producer < j for t in side)
        if l.costs.rgl is not None and grad_store[j] > 0 and grad_root[j] != j:
            out.append(l.costs.rgl)
            continue
        out.append(l.costs.rgk if shared and l.costs.rgk is not None else l.costs.rg)
    return out


def prefix_peak(hoisted: list[fx.Node], values: dict, existing: list) -> int:
    """The most bytes the hoisted prefix holds at once beyond what exists before it (inputs,
    parameters, buffers): each value's new storages from its node until its last reader in the
    prefix (kept to the end when a layer or the output reads it)."""
    before = {storage_identity(t) for t in existing}
    order = {n: i for i, n in enumerate(hoisted)}
    inside = set(hoisted)
    last: dict[fx.Node, int] = {}
    for n in hoisted:
        last[n] = len(hoisted) if any(u not in inside for u in n.users) else max(
            (order[u] for u in n.users), default=order[n])
    live: dict[int, int] = {}  # storage -> bytes
    owners: dict[int, set] = {}
    peak = cur = 0
    for i, n in enumerate(hoisted):
        for t in tensor_leaves(values.get(n)):
            k = storage_identity(t)
            if k in before:
                continue
            owners.setdefault(k, set()).add(n)
            if k not in live:
                live[k] = storage_nbytes(t)
                cur += live[k]
        peak = max(peak, cur)
        for k in [k for k, who in owners.items() if k in live and all(last[m] <= i for m in who)]:
            cur -= live.pop(k)
    return peak


def distinct_bytes(tensors: list) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    return sum(storage_nbytes(t) for t in distinct_storages(tensors))
