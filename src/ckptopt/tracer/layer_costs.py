"""Per-layer costs: one layer measured in isolation, on fake tensors (no memory).

:func:`measure_layer` runs one layer forward and backward once under the exact
storage tracker (:class:`ckptopt.tracker.StorageTracker`) and a
``saved_tensors_hooks`` pack hook, and returns the chain-model quantities
(``a, p, sin, sout, m, f, b`` and the refinements ``fs, rg, dead``;
``docs/design.md`` §3). :func:`forward_flops` gives its compute cost ``c``.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..torch_utils import check_module, is_fake, no_lasting_state, resolve_device, tensor_leaves
from ..tracker import StorageTracker, real_storage, storage_bytes, storage_key

__all__ = ["LayerMeasurement", "measure_layer", "forward_flops"]


@dataclass(frozen=True)
class LayerMeasurement:
    """The chain-model quantities of one layer (docs/design.md §3), in bytes.

    See :func:`measure_layer` for how each is computed.
    """

    a: int
    p: int
    sin: bool
    sout: bool
    m: int
    f: int
    b: int
    buffer_bytes: int = 0
    input_bytes: int = 0
    fs: int | None = None
    rg: int | None = None
    dead: bool = False
    bk: int | None = None  # b with the input held through the backward (set by the tracer)
    bf: int | None = None  # b with the input held by nothing but the layer (set by the tracer)
    gin: int | None = None  # bytes of the storage the input gradient lives in (None: none computed)
    gin_is_out: bool = False  # that storage is the output gradient's (the layer passes views of it)
    holds: bool = False

    @property
    def saved_bytes(self) -> int:
        """|S|: bytes of the saved set (input, output and the rest), parameters excluded."""
        return self.input_bytes * self.sin + self.a * self.sout + self.m


class _FreshInput(torch.autograd.Function):
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
        out = ctx.record.get("out")
        ctx.record["in_bytes"] = s.nbytes()
        ctx.record["in_is_out"] = out is not None and out() is s
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
        g = torch.ones_like(ctx.template, device=ctx.device)
        ctx.record["grad_bytes"] = g.untyped_storage().nbytes()
        ctx.record["out"] = weakref.ref(g.untyped_storage())  # to tell it apart from the input gradients
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


def _autocast_weight_casts(module: nn.Module, example_input: torch.Tensor,
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
        module(example_input.detach().clone(), *static_inputs)
    return recorder.casts


class _Packed:
    """What the measuring pack hook hands autograd: a weak-referenceable box, so that the
    measurement can tell which saved tensors autograd still keeps after the forward."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


def _unpack(box: _Packed) -> torch.Tensor:
    return box.t


def measure_layer(module: nn.Module, example_input: torch.Tensor, input_requires_grad: bool = True,
                  grads_exist: Iterable[torch.Tensor] = (), keep_input: bool = False,
                  leaf_input: bool = False, static_inputs: Iterable[torch.Tensor] = ()) -> LayerMeasurement:
    """Measure the chain-model quantities of one layer in isolation.

    The module runs forward and backward once, in its current mode, on a
    fresh copy of ``example_input`` that requires grad and that nothing else
    references, under a :class:`StorageTracker` (exact live-storage counts)
    and a ``saved_tensors_hooks`` pack hook (which storages autograd saves).
    Storages are compared by ``untyped_storage().data_ptr()``. Under a
    ``FakeTensorMode`` (fake input and parameters, call inside the mode) the
    same figures come out without allocating anything; fake storages are
    compared by identity.

    Parameters
    ----------
    module : nn.Module
        One layer of a chain: one tensor in, one tensor out.
    example_input : Tensor
        Its input (copied; the original is not counted or modified).
    input_requires_grad : bool, default True
        Whether the input requires grad, as it does inside a model. Pass
        False for a first layer fed with data: then no input gradient is
        computed (it would otherwise be counted in ``b``).
    leaf_input : bool, default False
        The input is a leaf that requires grad (a model input with
        ``requires_grad=True``): its gradient is accumulated into ``.grad``
        as in the model (out of place where the layer uses it twice), not
        dropped on arrival.
    keep_input : bool, default False
        Report as ``b`` the figure with the input alive through the backward, as
        it is inside a model whose previous layer saves its output (a ResNet
        block's input is the previous block's saved ReLU output) or for the model
        input: ``b`` then includes the input's storage at every moment the layer
        alone would already have freed it. Either way ``bf`` (the input held by
        nothing else) and ``bk`` (held only while the layer's saved tensors live,
        as by a checkpoint's frame) come out of the same run.
    static_inputs : iterable of Tensor, optional
        Further inputs that are static memory of the step (model inputs that need
        no gradient, masks computed from them): the layer runs as
        ``module(x, *static_inputs)``; they are held throughout, like the
        parameters, and never counted in the layer's figures.
    grads_exist : iterable of Parameter, optional
        Parameters that a later layer of the model also uses (a tied or
        reused weight): their gradient from that layer is pending when this
        layer's backward runs. That is
        reproduced by a zero-valued branch whose gradient reaches them first,
        so ``b`` includes the out-of-place sum of the two contributions
        (a third tensor of the weight's size, as PyTorch 2.13's engine does).

    Returns
    -------
    LayerMeasurement
        With ``P`` the bytes of the module's distinct parameter storages,
        ``Buf`` those of its buffers, ``X`` the input's bytes, and ``S`` the
        distinct storages the pack hook saw:

        ``a``
            bytes of the output's storage.
        ``p``
            ``P`` (the parameter gradients have the same size).
        ``sout``
            the output's storage is in ``S``.
        ``sin``
            the input's storage is in ``S`` and is not also the output's
            (for an in-place layer the saved storage counts as the output).
        ``m``
            bytes of the storages in ``S`` other than the input, the output,
            parameters and buffers (statistics, dropout masks, intermediates
            of a composite module). Saved storages that existed before the
            layer ran and are none of those (autocast's cached low-precision
            copies of the weights) are left out: they are static.
        ``f``
            forward peak minus ``P + Buf + X``: what the forward adds at its
            highest point (the output, the saved extras and any transient).
        ``fs``
            the forward peak up to the moment the last tensor is saved,
            minus ``P + Buf + X``: when this layer ends a checkpointed
            segment, its recomputation stops there (0 when it saves only its
            input, which is packed before it computes).
        ``rg``
            the bytes the backward holds beyond what was live when it started
            (the output gradient included) at the moment it first reads a
            saved tensor: ops at the end of the layer that save nothing (a
            mean, a concatenation, a product with a constant) run their
            backward before that, and a recomputation that this layer's
            backward triggers starts there (``a`` when it saves nothing).
        ``holds``
            autograd keeps a tensor the layer saved that none of ``sin``,
            ``sout``, ``m`` counts (a static input such as position ids, a
            parameter): the frame of a checkpoint around the layer stays alive.
        ``dead``
            the forward packed tensors that autograd no longer keeps when it
            ends (a dead branch's): a recomputation still re-packs them, so
            one that reaches this layer runs it up to ``fs``.
        ``b``
            backward peak minus the bytes live when backward starts minus
            the output gradient. Live at the start are ``P + Buf`` and the
            saved set (the output is dropped unless saved, and so is the
            input: the fresh input is not a leaf, so no ``AccumulateGrad``
            node keeps it alive); the output gradient (``a``-sized, layout
            of the output) is created inside the backward by a custom
            autograd Function, so nothing else holds it. ``b`` therefore
            includes the input gradient, the new parameter gradients and
            the backward's transients.
        ``bf``, ``bk``
            ``b`` with the input freed once the last saved tensor over its
            storage is released, and once the layer's last saved tensor is
            released. The backward runs once with the input held; the live
            bytes after every operator and the moments the saved tensors are
            released give all three figures (:func:`_backward_peaks`).
        ``buffer_bytes``, ``input_bytes``
            ``Buf`` and ``X``, for reference (buffers belong to the static
            bytes K of the chain model, not to ``m``).

    Raises
    ------
    TypeError
        ``module`` is not an ``nn.Module``, ``example_input`` is not a
        tensor, or the output is not a single tensor.
    ValueError
        The input is on another device than the parameters, or the output
        does not require grad.

    Notes
    -----
    Scratch memory inside one kernel is invisible (see the module
    docstring). The call leaves no state: parameter gradients are cleared,
    buffers (BatchNorm running statistics) restored and the RNG forked.

    Examples
    --------
    >>> import torch
    >>> m = measure_layer(torch.nn.Linear(100, 200, bias=False), torch.zeros(10, 100))
    >>> m.a, m.p, m.sin, m.sout, m.m, m.f, m.b  # b = input grad + weight grad
    (8000, 80000, True, False, 0, 8000, 84000)
    """
    check_module(module, "measure_layer")
    if not isinstance(example_input, torch.Tensor):
        raise TypeError(
            f"measure_layer takes one example input tensor, got {type(example_input).__name__}; "
            "measure_layer(layer, x) measures a layer with one tensor input and one tensor output"
        )
    fake = is_fake(example_input)
    dev = example_input.device if fake else resolve_device(module, [example_input], None, "measure_layer")
    param_bytes, param_ptrs = storage_bytes(list(module.parameters()), fake=fake)
    buffer_bytes, buffer_ptrs = storage_bytes(list(module.buffers()), exclude=param_ptrs, fake=fake)

    with no_lasting_state(module, (), dev):
        if not fake:  # stale fake storages are not in the new tracker: no need to collect them
            gc.collect()
        static_inputs = list(static_inputs)
        static_bytes, static_ptrs = storage_bytes(static_inputs, fake=fake)
        casts = _autocast_weight_casts(module, example_input, static_inputs)
        cast_bytes, cast_ptrs = storage_bytes(casts, exclude=param_ptrs | buffer_ptrs, fake=fake)
        holder = [example_input.detach().clone()]
        record: dict[str, Any] = {}  # what the backward tells about the output and input gradients
        if input_requires_grad and leaf_input:
            x = holder.pop().requires_grad_(True)
        elif input_requires_grad:
            anchor = torch.empty(0, device=dev, requires_grad=True)
            x = _FreshInput.apply(anchor, holder, record)
        else:  # e.g. the first layer of a model, fed with data: no input gradient is computed
            x = holder.pop()
        x_ptr = storage_key(x.untyped_storage())
        input_bytes = x.untyped_storage().nbytes()

        # Every pack event: (a weak reference to what autograd keeps, storage key or None,
        # bytes, forward peak so far). A saved tensor counts only if autograd still keeps it
        # when the forward ends: ops whose output is never used (a dead branch) save tensors
        # that die with that output.
        packs: list[tuple] = []
        # When each saved tensor is released: (timeline index, it holds the input's storage).
        # The backward runs once with the input held; the figures for an input held by nothing
        # else, or held only while the layer's saved tensors live (a checkpoint's frame), follow
        # from these moments (_backward_peaks).
        released: list[tuple[int, bool]] = []

        def on_release(holds_input: bool) -> None:
            released.append((len(tracker.timeline), holds_input))

        def pack(t: torch.Tensor) -> _Packed:
            s = real_storage(t, fake)
            # only storages this layer created, or registered below (parameters, buffers,
            # input); a pre-existing one (an autocast cast-cache copy of a weight) is static
            key = storage_key(s) if s is not None and tracker.is_tracked(t) else None
            box = _Packed(t.detach())  # detached: a saved output would otherwise keep its own graph alive
            weakref.finalize(box, on_release, key is not None and key == x_ptr).atexit = False
            packs.append((weakref.ref(box), key, s.nbytes() if key is not None else 0, tracker.peak_bytes))
            return box

        first_unpack: list[int] = []  # live bytes when the backward first reads a saved tensor

        def unpack(box: _Packed) -> torch.Tensor:
            if not first_unpack:
                first_unpack.append(tracker.current_bytes)
            return box.t

        grads_exist = list(grads_exist)
        pending = storage_bytes(grads_exist, fake=fake)[0] if grads_exist else 0
        tracker = StorageTracker(fake=fake, timeline=True)
        tracker.register(module, x, *casts, *static_inputs)  # cached weight casts are static, like the weights
        start = tracker.current_bytes
        try:
            with tracker:
                # forward
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    y = module(x, *static_inputs)
                forward_peak = tracker.peak_bytes
                kept = [(key, nbytes, peak) for ref, key, nbytes, peak in packs if ref() is not None]
                dead_packs = len(kept) < len(packs)
                saved = {key: nbytes for key, nbytes, _ in kept if key is not None}
                # forward peak up to the last pack, kept or not: where a recomputation of this
                # layer, the last of its segment, stops. Non-reentrant checkpoint counts every
                # tensor its forward packed, a dead branch's too, and stops once it has re-packed
                # as many, so a dead branch after the last kept save is re-run as well.
                last_pack = packs[-1][3] if packs else None
                if not isinstance(y, torch.Tensor):
                    raise TypeError(
                        f"measure_layer needs a layer with one tensor output, got {type(y).__name__}"
                    )
                if not y.requires_grad:
                    raise ValueError(
                        "the layer's output does not require grad (it is detached, or computed under "
                        "torch.no_grad()), so it has no backward pass to measure"
                    )
                ys = real_storage(y, fake)
                y_ptr = storage_key(ys) if ys is not None else None
                a = ys.nbytes() if ys is not None else 0
                end = InjectGrad.apply(y, record)
                if grads_exist:
                    # A later layer's gradient for these weights reaches their AccumulateGrad
                    # first and waits in the engine's input buffer; this layer's contribution
                    # is then added out of place. A zero branch created last (so its backward
                    # runs first) reproduces that; its buffered gradient is subtracted below,
                    # since the chain model counts it among the later layer's gradients.
                    end = end.sum() + sum((prm * 0).sum() for prm in grads_exist)
                held_input = x  # held through the backward; see _backward_peaks for the other cases
                del x, y, ys
                # backward
                backward_start = tracker.current_bytes
                k0 = len(tracker.timeline)
                released.clear()  # (a dead branch's saved tensors die in the forward)
                alive = sum(ref() is not None for ref, *_ in packs)
                alive_input = sum(ref() is not None and key is not None and key == x_ptr for ref, key, *_ in packs)
                end.backward(torch.empty(0, device=dev) if end.dim() else None)
                del end, held_input
                peaks = _backward_peaks(tracker.timeline, k0, backward_start, input_bytes, released, alive,
                                        alive_input)
        finally:
            tracker.detach()

    sout = y_ptr is not None and y_ptr in saved
    sin = x_ptr in saved and x_ptr != y_ptr
    other = set(saved) - param_ptrs - buffer_ptrs - cast_ptrs - static_ptrs - {x_ptr, y_ptr}
    return LayerMeasurement(
        a=int(a),
        p=int(param_bytes),
        sin=bool(sin),
        sout=bool(sout),
        m=int(sum(saved[k] for k in other)),
        f=int(forward_peak - start),
        fs=int(last_pack - start) if last_pack is not None else 0,
        b=int(peaks[0 if keep_input else 1] - record.get("grad_bytes", 0) - pending),
        bf=int(peaks[1] - record.get("grad_bytes", 0) - pending),
        bk=int(peaks[2] - record.get("grad_bytes", 0) - pending),
        gin=record.get("in_bytes"),
        gin_is_out=bool(record.get("in_is_out", False)),
        rg=int(max(0, first_unpack[0] - backward_start - pending)) if first_unpack else int(a),
        dead=bool(dead_packs),
        holds=bool(kept) and not (sin or sout or other),
        buffer_bytes=int(buffer_bytes),
        input_bytes=int(input_bytes),
    )


def _backward_peaks(timeline: list, k0: int, start: int, input_bytes: int, released: list[tuple[int, bool]],
                    alive: int, alive_input: int) -> tuple[int, int, int]:
    """Backward peaks above ``start`` of one backward run with the input held, for the input
    (a) held throughout (the previous layer saves it, or it is the model input), (b) held by
    nothing else: gone once the last saved tensor over its storage is released (before the
    backward when none is), (c) held by a checkpoint's frame: gone once the layer's last saved
    tensor is released. ``timeline[k0:]``: live bytes after each backward op; ``released``:
    (timeline index, over the input) per saved tensor released; ``alive``/``alive_input``: how
    many were kept at the start."""

    def gone_from(count: int, only_input: bool) -> int:
        if count == 0:
            return k0
        for index, over_input in released:
            if over_input or not only_input:
                count -= 1
                if count == 0:
                    return index
        return len(timeline)  # still kept at the end: held throughout

    out = []
    for gone in (len(timeline), gone_from(alive_input, True), gone_from(alive, False)):
        base = start - (input_bytes if gone <= k0 else 0)
        best = base
        for k in range(k0, len(timeline)):
            best = max(best, timeline[k][2] - (input_bytes if k >= gone else 0))
        out.append(best - base)
    return out[0], out[1], out[2]


def forward_flops(module: nn.Module, x: torch.Tensor, static_inputs: Iterable[torch.Tensor] = ()) -> int:
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
    with torch.no_grad(), FlopCounterMode(display=False) as counter, _Elementwise():
        module(x.detach().clone(), *static_inputs)
    return int(counter.get_total_flops()) + int(_Elementwise.total)
