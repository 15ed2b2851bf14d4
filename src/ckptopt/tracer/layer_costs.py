"""One layer's chain-model quantities, measured in isolation on fake tensors (no memory).

:func:`measure_layer` runs the layer once forward and backward under the exact storage tracker and a
``saved_tensors_hooks`` pack hook (:func:`ckptopt.tracer.layer_run.record_layer`), then a few more
forwards under other holding rules (:meth:`~ckptopt.tracer.layer_run.LayerRun.forward_pass`), and
derives the figures from what was recorded (:mod:`ckptopt.tracer.layer_figures`; docs/design.md §3-4).
:class:`LayerContext` says how the layer sits in the model: what holds its inputs, which gradients
reach its outputs and how they are laid out.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..torch_utils import check_module, is_fake, no_lasting_state, resolve_device
from ..storages import storage_bytes
from .layer_figures import (BackwardTimelines, ForwardFigures, backward_figures, dying_gains, first_read_figures,
                            forward_figures, held_output_gain, release_splits, saved_set)
from .layer_grads import autocast_weight_casts
from .layer_record import LayerRecord
from .layer_run import GradientPlan, LayerRun, list_input_copy, record_layer

__all__ = ["LayerMeasurement", "LayerContext", "measure_layer"]


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
    rgk: int | None = None  # rg where a side tensor's pending gradient holds the output gradient's storage
    rgl: int | None = None  # rg without a lone side output's gradient (no chain output; taken where g counts it)
    dead: bool = False
    bk: int | None = None  # b with the input held through the backward (set by the tracer)
    bf: int | None = None  # b with the input held by nothing but the layer (set by the tracer)
    ff: int | None = None  # f with the input dying at its last use inside the layer (held by nothing else)
    ffs: int | None = None  # fs likewise
    fc: int | None = None  # f in a checkpoint's first pass: the saved tensors not kept (they die at last use)
    ffc: int | None = None  # fc with the input dying at its last use inside the layer
    br: int | None = None  # b in a recomputed segment: saved tensors die when the node reading them returns
    bkr: int | None = None  # bk likewise
    brt: int | None = None  # br, bkr from the backward's first read of a saved tensor on (the part a
    bkrt: int | None = None  # checkpointed segment's last saving layer runs after the recomputation)
    rgx: int = 0  # what the backward's part before that read peaks at above the bytes at the read
    gin: int | None = None  # bytes of the storage the input gradient lives in (None: none computed)
    gin_is_out: bool = False  # that storage is the output gradient's (the layer passes views of it)
    gin_layout: tuple | None = None  # (stride, offset) of the input gradient when it is a slice of that storage
    holds: bool = False
    side_in_saved: tuple[bool, ...] = ()  # per side input: the layer saves it
    side_in_last_gain: tuple[int, ...] = ()  # per side input: the forward peak's change when it dies at its last use
    side_in_last_gain_full: tuple[int, ...] = ()  # ... in the whole forward (not stopped at the last pack)
    side_in_last_gain_ckpt: tuple[int, ...] = ()  # ... in a checkpoint's first pass (saved or not)
    side_in_last_gain_free: tuple = ()  # per side input: those three with the input dying at its last use too
    side_out_saved: tuple[bool, ...] = ()  # per side output: the layer saves it
    side_in_grad: tuple[int | None, ...] = ()  # per side input: bytes of its gradient's storage (None: none)
    side_in_grad_is_out: tuple[bool, ...] = ()  # ... a view of the chain output's gradient (a concatenation's)
    side_in_grad_shares: tuple = ()  # ... one storage with the chain input's gradient ("main") or another's
    side_in_grad_layout: tuple = ()  # ... (stride, offset) when it is a slice of that storage, else None
    gh: int = 0  # what the peak of the backward gains when the output gradient outlives it
    ga: int | None = None  # bytes of the output's gradient (less than a for a view of a larger storage)
    frame_pre: int | None = None  # b before / from the moment the layer's last saved tensor is released
    frame_post: int | None = None
    out_static: bool = False  # the output is static memory (the model input handed on): a is 0
    frame_pre_k: int | None = None  # the same where only the frame holds the input (it goes then too, as bkr)
    frame_post_k: int | None = None
    side_in_release: tuple = ()  # per side input: (b before, b from) its last saved reference's release, or None
    side_in_release_rec: tuple = ()  # per side input: the same in a recomputed segment (its copy dies earlier)
    side_in_release_free: tuple = ()  # ... with the input held by nothing but the layer's saves (as bf); () same
    side_out_release: tuple = ()  # per side output: the same
    static_in_saved: tuple[bool, ...] = ()  # per static input: the layer saves it
    static_in_release: tuple = ()  # per static input: (b before, b from) its last saved reference's release

    @property
    def saved_bytes(self) -> int:
        """|S|: bytes of the saved set (input, output and the rest), parameters excluded."""
        return self.input_bytes * self.sin + self.a * self.sout + self.m


@dataclass(frozen=True)
class LayerContext:
    """How a layer sits in the model, for :func:`measure_layer` (docs/design.md §3-4). Every field has the
    default of a plain layer: one tensor in, one out, the input held by nothing but the layer."""

    #: the input requires grad, as inside a model (False for a first layer fed with data: no input gradient)
    input_requires_grad: bool = True
    #: the input is a leaf that requires grad (a model input): its gradient accumulates into ``.grad``
    leaf_input: bool = False
    #: report as ``b`` the figure with the input held through the backward (the previous layer saves it, or
    #: it is the model input); ``bf`` and ``bk`` come out of the same run either way
    keep_input: bool = False
    #: the input is static memory (nothing frees it): every figure is the one with it held
    static_input: bool = False
    #: parameters a later layer also uses (a tied weight): their gradient is pending, this one summed out of place
    grads_exist: tuple = ()
    #: static values the layer also reads (inputs that need no gradient, masks): held, never counted
    static_inputs: tuple = ()
    #: side tensors it reads besides the chain input, in argument order after it (held; the simulator counts them)
    side_inputs: tuple = ()
    #: per side input: a later layer already made its gradient (this contribution is summed out of place)
    side_pending: tuple = ()
    #: per side input: that pending gradient's storage outlives the sum (another gradient views it)
    side_pending_held: tuple = ()
    #: per side input: the layer is its last reader (the forward runs again with it dying inside)
    side_last: tuple = ()
    #: per side input: how likely a plan holds it elsewhere (of equal dying gains, lowest first)
    side_rank: tuple = ()
    #: the layer returns ``(y, *side)`` (``(*side)`` without a chain output): side tensors later layers read
    side_outputs: int = 0
    #: the layer has a chain output
    main_output: bool = True
    #: ``(members, nbytes)``: outputs (0 the chain output, then side outputs; ``("in", k)`` side input ``k``'s
    #: pending gradient) whose gradients are views of one storage of ``nbytes`` in the model
    shared_out_grads: tuple = ()
    #: ``(nbytes, stride, offset)``: the chain output's gradient is a view of a larger storage (a later
    #: concatenation's slice), handed out so
    out_grad_layout: tuple | None = None
    #: a gradient reaches the chain output in the model (False: none is injected, ``ga`` is 0)
    main_output_grad: bool = True
    #: per side output: a gradient reaches it in the model (default: all do)
    side_output_grads: tuple = ()
    #: the chain output's gradient storage outlives the layer's backward (a side gradient views it): held
    hold_out_grad: bool = False
    #: ``out_grad_layout`` for the layer's one output a gradient reaches when that is a side output
    side_out_grad_layout: tuple | None = None
    #: for a layer that reads nothing and has no parameter: a tensor on the device it runs on
    like: torch.Tensor | None = None

    @classmethod
    def of(cls, **given: Any) -> "LayerContext":
        """From :func:`measure_layer`'s keywords: iterables as tuples, the per-side-input flags filled in."""
        ctx = cls(**{k: tuple(v) if k in _SEQUENCES else v for k, v in given.items()})
        n = len(ctx.side_inputs)
        fill = {k: (False,) * n for k in ("side_last", "side_pending", "side_pending_held") if not getattr(ctx, k)}
        return replace(ctx, **fill) if fill else ctx

    @property
    def plain(self) -> bool:
        """No side tensor in or out and a chain output: one tensor in, one out."""
        return not self.side_inputs and not self.side_outputs and self.main_output


_SEQUENCES = {"grads_exist", "static_inputs", "side_inputs", "side_pending", "side_pending_held", "side_last",
              "side_rank", "shared_out_grads", "side_output_grads"}


def measure_layer(module: nn.Module, example_input: torch.Tensor | None, **context: Any) -> LayerMeasurement:
    """Measure the chain-model quantities of one layer in isolation.

    The module runs forward and backward once, in its current mode, on a fresh copy of
    ``example_input`` that nothing else references, under a :class:`~ckptopt.tracker.StorageTracker`
    (exact live-storage counts) and a ``saved_tensors_hooks`` pack hook (which storages autograd
    saves). Under a ``FakeTensorMode`` (fake input and parameters, call inside the mode) the same
    figures come out without allocating anything.

    Parameters
    ----------
    module : nn.Module
        One layer of a chain: one tensor in, one tensor out (more with side tensors).
    example_input : Tensor or None
        Its chain input (copied; the original is not counted or modified). None: the layer reads
        only side or static inputs.
    **context
        The fields of :class:`LayerContext`: how the layer sits in the model.

    Returns
    -------
    LayerMeasurement

    Raises
    ------
    TypeError
        ``module`` is not an ``nn.Module``, ``example_input`` is not a tensor, or the output is not
        a single tensor.
    ValueError
        The input is on another device than the parameters, or the output does not require grad.

    Notes
    -----
    Scratch memory inside one kernel is invisible (:mod:`ckptopt.tracker`). The call leaves no state:
    parameter gradients are cleared, buffers (BatchNorm running statistics) restored and the RNG forked.

    Examples
    --------
    >>> import torch
    >>> m = measure_layer(torch.nn.Linear(100, 200, bias=False), torch.zeros(10, 100))
    >>> m.a, m.p, m.sin, m.sout, m.m, m.f, m.b  # b = input grad + weight grad
    (8000, 80000, True, False, 0, 8000, 84000)
    """
    check_module(module, "measure_layer")
    ctx = LayerContext.of(**context)
    if example_input is not None and not isinstance(example_input, torch.Tensor):
        raise TypeError(
            f"measure_layer takes one example input tensor, got {type(example_input).__name__}; "
            "measure_layer(layer, x) measures a layer with one tensor input and one tensor output"
        )
    fake, dev = _device(module, example_input, ctx)
    param_bytes, param_keys = storage_bytes(list(module.parameters()), fake=fake)
    buffer_bytes, buffer_keys = storage_bytes(list(module.buffers()), exclude=param_keys, fake=fake)
    plain = example_input is not None and ctx.plain
    with no_lasting_state(module, (), dev):
        if not fake:  # stale fake storages are not in the new tracker: no need to collect them
            gc.collect()
        static_inputs = list(ctx.static_inputs)
        static_keys = storage_bytes(static_inputs, fake=fake)[1]
        casts = autocast_weight_casts(module, ([example_input] if example_input is not None else [])
                                      + list(ctx.side_inputs), static_inputs)
        cast_keys = storage_bytes(casts, exclude=param_keys | buffer_keys, fake=fake)[1]
        # the forward takes its inputs in a list it empties, so that the chain input can die at its last
        # use inside the layer, as it does in the model where nothing else holds it (ff, ffs); added back
        # from its death it gives f and fs (the input held, as by a save of the layer before it, or a checkpoint)
        run = LayerRun(module, example_input, ctx.input_requires_grad, ctx.leaf_input, list(ctx.side_inputs),
                       static_inputs, casts, fake, dev, list_input_copy(module) if not ctx.leaf_input else None)
        rec, grads = record_layer(run, ctx, plain)
        forward = forward_figures(rec)
        # (a layer whose forward packs nothing runs the same in a checkpoint)
        fc, ffc = run.forward_pass(keep_saves=False)[:2] if rec.packs else (None, None)
        gains = _side_input_gains(run, rec, ctx, forward, fc, ffc)
    saves = saved_set(rec, static_keys, param_keys, buffer_keys, cast_keys, ctx.leaf_input)
    measured = _assemble(rec, grads, ctx, saves, forward, fc, ffc, gains, param_bytes, buffer_bytes)
    if ctx.static_input:  # nothing frees a static input: every figure is the one with it held
        m = measured
        measured = replace(m, bf=m.b, bk=m.b, bkr=m.br, bkrt=m.brt, ff=m.f, ffs=m.fs, ffc=m.fc,
                           frame_pre_k=m.frame_pre, frame_post_k=m.frame_post, side_in_release_free=())
    return measured


def _device(module: nn.Module, example_input: torch.Tensor | None, ctx: LayerContext) -> tuple[bool, Any]:
    """Whether the layer runs on fake tensors, and its device: from its chain input, else from what it
    reads or holds (a layer may read nothing from other layers: a position embedding of arange's indices)."""
    probes = ([example_input] if example_input is not None else []) + list(ctx.side_inputs) + list(
        ctx.static_inputs) + [*module.parameters(), *module.buffers()] + ([ctx.like] if ctx.like is not None else [])
    if not probes:
        raise TypeError("measure_layer needs an input or a parameter: the chain input, side inputs, static inputs")
    probe = probes[0]
    fake = is_fake(probe)
    return fake, probe.device if fake else resolve_device(module, [probe], None, "measure_layer")


@dataclass(frozen=True)
class _Gains:
    """Per side input, ``(held, free)``: the change of the forward peak when it dies at its last use inside
    the layer, with the layer's input held or dying too, in three regimes."""

    to_last_pack: list  #: a recomputation that stops at the layer's last saved tensor
    whole: list  #: the whole forward
    checkpoint: list  #: a checkpoint's first pass (a saved side input dies too)


def _side_input_gains(run: LayerRun, rec: LayerRecord, ctx: LayerContext, forward: ForwardFigures,
                      fc: int | None, ffc: int | None) -> _Gains:
    """A side input this layer reads last and does not save dies at its last use inside it where nothing
    else holds it (the plan decides): the forward runs again with each set of such inputs dying, and
    :func:`~ckptopt.tracer.layer_figures.dying_gains` gives each its share (docs/design.md §4)."""
    saved, packs = rec.saved, rec.packs > 0
    frees = run.freeing is not None
    dying = [k for k, last in enumerate(ctx.side_last) if last and rec.keys.side_in[k] not in saved] if frees else []
    ref = forward.as_list(packs)
    changes: dict[tuple, list[int]] = {}

    def change(drop: tuple) -> list[int]:
        if drop not in changes:
            held, free, pheld, pfree = run.forward_pass(keep_saves=True, drop_side=drop)
            changes[drop] = [v - w for v, w in zip([held, free] + ([pheld, pfree] if packs else []), ref)]
        return changes[drop]

    def gains(drops: list, fn) -> list:  # per side input: (held, free), the layer's input held or dying
        return list(zip(*[dying_gains(drops, lambda d, k=k: min(0, fn(d)[k]), len(ctx.side_inputs),
                                      rank=list(ctx.side_rank) or None) for k in (0, 1)]))
    to_last_pack = gains(dying, lambda d: change(d)[2:] or change(d)[:2])
    whole = gains(dying, lambda d: change(d)[:2])
    # ... and in a checkpoint's first pass, which keeps none of the saved tensors: one it saves dies too
    ref_c = [fc, ffc] if packs else ref[:2]

    def change_c(drop: tuple) -> list[int]:
        if not packs:
            return change(drop)[:2]
        return [v - w for v, w in zip(run.forward_pass(keep_saves=False, drop_side=drop)[:2], ref_c)]

    dying_c = [k for k, last in enumerate(ctx.side_last) if last] if frees else []
    return _Gains(to_last_pack, whole, gains(dying_c, change_c))


def _shares(side: dict, main: dict) -> str | int | None:
    """Which input gradient a side input's gradient shares its storage with: "main" (the chain
    input's), the index of another side input, or None; either order of arrival."""
    if side.get("shares") is not None:
        return side["shares"]
    if main.get("shares") == side.get("tag"):
        return "main"
    return None


def _assemble(rec: LayerRecord, grads: GradientPlan, ctx: LayerContext, saves: Any, forward: ForwardFigures,
              fc: int | None, ffc: int | None, gains: _Gains, param_bytes: int, buffer_bytes: int) -> LayerMeasurement:
    """The :class:`LayerMeasurement` of a recorded layer."""
    bw = BackwardTimelines.of(rec, ctx.keep_input)
    back = backward_figures(rec, ctx.keep_input, bw)
    splits = release_splits(rec, ctx.keep_input, bw)
    a_own = 0 if saves.out_static else rec.output_bytes
    rg, rgk, rgl = first_read_figures(rec, a_own)
    record, sides = grads.record, grads.side_records
    saved = rec.saved
    return LayerMeasurement(
        a=int(a_own), out_static=saves.out_static, p=int(param_bytes), sin=saves.sin, sout=saves.sout, m=saves.m,
        f=int(forward.f), fs=int(forward.fs), ff=int(forward.ff), ffs=int(forward.ffs), fc=fc, ffc=ffc,
        side_in_last_gain=tuple(int(g[0]) for g in gains.to_last_pack),
        side_in_last_gain_full=tuple(int(g[0]) for g in gains.whole),
        side_in_last_gain_ckpt=tuple(int(g[0]) for g in gains.checkpoint),
        side_in_last_gain_free=tuple((int(a[1]), int(b[1]), int(c[1]))
                                     for a, b, c in zip(gains.to_last_pack, gains.whole, gains.checkpoint)),
        b=back.b, bf=back.bf, bk=back.bk, br=back.br, bkr=back.bkr, brt=back.brt, bkrt=back.bkrt, rgx=back.rgx,
        gin=record.get("in_bytes"), gin_is_out=bool(record.get("in_is_out", False)), gin_layout=record.get("in_layout"),
        rg=rg, rgk=rgk, rgl=rgl, ga=int(rec.grads.chain), dead=rec.dead_packs, holds=saves.holds,
        buffer_bytes=int(buffer_bytes), input_bytes=int(rec.input_bytes),
        side_in_saved=tuple(k in saved for k in rec.keys.side_in),
        side_out_saved=tuple(k in saved for k in rec.keys.side_out),
        side_in_grad=tuple(r.get("in_bytes") for r in sides),
        side_in_grad_is_out=tuple(bool(r.get("in_is_out", False)) for r in sides),
        side_in_grad_shares=tuple(_shares(r, record) for r in sides),
        side_in_grad_layout=tuple(r.get("in_layout") for r in sides),
        gh=int(held_output_gain(rec, ctx.keep_input, bw)),
        frame_pre=int(splits.frame[0]), frame_post=int(splits.frame[1]),
        frame_pre_k=int(splits.frame_k[0]), frame_post_k=int(splits.frame_k[1]),
        side_in_release_free=splits.side_in_free, side_in_release=splits.side_in,
        side_in_release_rec=splits.side_in_rec, side_out_release=splits.side_out,
        static_in_saved=tuple(k is not None and k in saved for k in rec.keys.static_in),
        static_in_release=splits.static_in,
    )
