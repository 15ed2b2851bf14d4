"""The autograd pieces a layer is measured with (:mod:`ckptopt.tracer.layer_run`): a fresh input held
by nothing but the caller, output gradients injected (whole, shared, or laid out as the next layer
hands them out), pending side-tensor gradients, the pack hook's box, and the autocast weight casts."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FreshInput", "InjectGrad", "SharedGrad", "PendingGrad", "Packed", "autocast_weight_casts"]


class FreshInput(torch.autograd.Function):
    """Hands out a tensor that requires grad, held by nothing but the caller.

    Unlike a leaf, its autograd node does not keep it alive (a leaf's
    ``AccumulateGrad`` node holds the leaf for the whole backward), it can be
    modified in place (in-place ReLU), and the input gradient is dropped as
    soon as this node receives it, as the previous layer of a chain would.
    """

    @staticmethod
    def forward(ctx, anchor, holder, record):
        ctx.record = record
        return holder.pop()

    @staticmethod
    def backward(ctx, grad):
        # the storage the input gradient lives in: a view of the output gradient (a
        # concatenation's backward hands out slices of it) keeps all of that storage alive
        s = grad.untyped_storage()
        main = ctx.record.get("out_of", ctx.record)  # (a side input's record points to the chain input's)
        # (no chain output: the output gradient is its one side output's, when it has one)
        out = main.get("out") or main.get("only_side_out", {}).get("out")
        ctx.record["in_bytes"] = s.nbytes()
        ctx.record["in_is_out"] = out is not None and out() is s
        if grad.numel() * grad.element_size() < s.nbytes() or not grad.is_contiguous():
            # a slice (a concatenation's): the layer before receives it with this layout
            ctx.record["in_layout"] = (tuple(grad.stride()), int(grad.storage_offset()))
        # input gradients that are views of one storage (a concatenation's slices of it)
        seen = main.setdefault("grad_storages", [])
        ctx.record["shares"] = next((tag for ref, tag in seen if ref() is s), None)
        seen.append((weakref.ref(s), ctx.record.get("tag", "main")))
        return None, None, None


class InjectGrad(torch.autograd.Function):
    """Ends the graph with a 0-byte tensor; backward creates the output gradient.

    Python never holds a reference to that gradient, so the engine frees it as
    soon as the layer's backward has consumed it (holding it from Python makes
    ``b`` 8-19% too high, docs/design.md §3).
    """

    @staticmethod
    def forward(ctx, y, record):
        ctx.template = torch.empty_like(y, device="meta")  # shape, dtype and layout; no memory
        ctx.device = y.device
        ctx.record = record
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        if ctx.record.get("no_grad"):  # (no gradient reaches this output in the model)
            return None, None
        g = _layout_grad(ctx.template, ctx.device, ctx.record.get("layout"))
        if g is None:  # (contiguous, whatever the output's layout: as the next layer's backward hands
            # it out unless that one records another layout, docs/design.md §3)
            g = torch.ones(ctx.template.shape, dtype=ctx.template.dtype, device=ctx.device)
        ctx.record["grad_bytes"] = g.untyped_storage().nbytes()
        ctx.record["out"] = weakref.ref(g.untyped_storage())  # to tell it apart from the input gradients
        if "hold_out" in ctx.record:  # (it outlives the layer's backward in the model: a side gradient views it)
            ctx.record["hold_out"].append(g)
        if "on_free" in ctx.record:  # when the engine lets it go
            weakref.finalize(g.untyped_storage(), ctx.record["on_free"]).atexit = False
        return g, None


def _layout_grad(template: torch.Tensor, device: Any, layout: tuple | None) -> torch.Tensor | None:
    """An output gradient laid out as in the model, ``layout = (nbytes, stride, offset)``: a view (a
    concatenation's slice) into a storage of ``nbytes`` (None without a layout)."""
    if layout is None:
        return None
    nbytes, stride, offset = layout
    numel = max(nbytes // template.element_size(), 1)
    base = torch.ones(numel, dtype=template.dtype, device=device)
    return base.as_strided(template.shape, stride, offset)


class SharedGrad(torch.autograd.Function):
    """:class:`InjectGrad` for several outputs whose gradients are one storage in the model (an
    addition after them hands each the same gradient, a concatenation a slice of one): one buffer
    of ``nbytes``, a view of it per output."""

    @staticmethod
    def forward(ctx, record, nbytes, *ys):
        ctx.templates = [torch.empty_like(y, device="meta") for y in ys]
        ctx.device = ys[0].device
        ctx.record = record
        ctx.nbytes = nbytes
        return ys[0].new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        first = ctx.templates[0]
        layout = ctx.record.get("layout")  # (the chain output's, first when it is a member)
        numel = max([ctx.nbytes // first.element_size()] + [t.numel() for t in ctx.templates]
                    + ([layout[0] // first.element_size()] if layout else []))
        base = torch.ones(numel, dtype=first.dtype, device=ctx.device)
        outs = [base[: t.numel()].view(t.shape) if t.dtype == first.dtype else torch.ones_like(t, device=ctx.device)
                for t in ctx.templates]
        if layout:
            outs[0] = base.as_strided(first.shape, layout[1], layout[2])
        ctx.record["grad_bytes"] = base.untyped_storage().nbytes() + sum(
            o.untyped_storage().nbytes() for o in outs if o.untyped_storage() is not base.untyped_storage())
        ctx.record["out"] = weakref.ref(base.untyped_storage())
        if "hold_out" in ctx.record:
            ctx.record["hold_out"].append(base)
        if "on_free" in ctx.record:
            weakref.finalize(base.untyped_storage(), ctx.record["on_free"]).atexit = False
        return (None, None, *outs)


class PendingGrad(torch.autograd.Function):
    """A side input's gradient that a later layer already made: its backward, run before the
    layer's (created last), hands the input a zero gradient of its size, so the layer's own
    contribution is summed out of place as in the model (where the engine buffers the first)."""

    @staticmethod
    def forward(ctx, t, record):
        ctx.template = torch.empty_like(t, device="meta")
        ctx.device = t.device
        ctx.record = record
        return t.new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        g = torch.zeros_like(ctx.template, device=ctx.device)
        ctx.record["pending"] = ctx.record.get("pending", 0) + g.untyped_storage().nbytes()
        if "hold" in ctx.record:  # (its storage outlives the sum in the model: another gradient views it)
            ctx.record["hold"].append(g)
        return g, None


class _CastRecorder(TorchDispatchMode):
    """Records the low-precision copies of ``params`` that autocast makes (and caches)."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.params = params
        self.casts: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and any(args[0] is p for p in self.params):
            self.casts.append(out)
        return out


def autocast_weight_casts(module: nn.Module, args: list[torch.Tensor],
                           static_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weight copies autocast caches when ``module`` runs (none outside autocast).

    Under ``torch.autocast`` a cast of a parameter is cached until the
    autocast context exits, so it is static memory of the step (the tracer
    counts it once); a layer measured in isolation must not count it in its
    saved set ``m`` or its forward transient ``f``. A tracker would otherwise
    see the cached copy as new when an op first returns a view of it
    (``Linear`` saves ``weight.t()``). The cache is cleared and the layer run
    once without grad so that every cast is made, and seen, here.
    """
    if not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return []
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return []
    torch.clear_autocast_cache()
    recorder = _CastRecorder(params)
    with recorder:
        module(*[a.detach().clone() for a in args], *static_inputs)
    return recorder.casts


class Packed:
    """What the measuring pack hook hands autograd: a weak-referenceable box, so that the
    measurement can tell which saved tensors autograd still keeps after the forward. Unpacking
    it lets go of the tensor, as a checkpoint's recomputation does (``w`` finds it again while
    the backward still holds it)."""

    __slots__ = ("t", "w", "state", "__weakref__")

    def __init__(self, t: torch.Tensor, state: list | None = None):
        self.t = t
        self.w = None
        self.state = state  # [storage key, unpacked yet], shared with the release callback

