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
from dataclasses import dataclass, replace
from typing import Any, Iterable

import torch
from torch import nn

from ..torch_utils import check_module, clone_layout, is_fake, no_lasting_state, resolve_device
from ..tracker import StorageTracker, real_storage, storage_bytes, storage_key
from .flops import forward_flops
from .layer_grads import InjectGrad, _autocast_weight_casts, _Packed, _Pending, _SharedGrad
from .layer_series import (_all_released_at, _backward_peaks, _call_layer, _dying_gains, _forward_pass,
                           _forward_peaks, _fresh_inputs, _gone_at, _held_timelines, _key, _list_input_copy,
                           _peak_with_input, _relative_series, _shares, _split, _without_copies, reachable)

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


def measure_layer(module: nn.Module, example_input: torch.Tensor | None, input_requires_grad: bool = True,
                  grads_exist: Iterable[torch.Tensor] = (), keep_input: bool = False,
                  leaf_input: bool = False, static_inputs: Iterable[torch.Tensor] = (),
                  side_inputs: Iterable[torch.Tensor] = (), side_pending: Iterable[bool] = (),
                  side_pending_held: Iterable[bool] = (), side_last: Iterable[bool] = (),
                  side_outputs: int = 0, main_output: bool = True,
                  shared_out_grads: Iterable[tuple[tuple[int, ...], int]] = (),
                  out_grad_layout: tuple | None = None, main_output_grad: bool = True,
                  side_output_grads: Iterable[bool] = (), hold_out_grad: bool = False,
                  side_out_grad_layout: tuple | None = None,
                  like: torch.Tensor | None = None, static_input: bool = False,
                  side_rank: Iterable = ()) -> LayerMeasurement:
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
    side_inputs, side_pending : iterable of Tensor, iterable of bool, optional
        Side tensors the layer reads besides its chain input (docs/design.md §4), in the
        order of its arguments after the chain input: fresh copies that require grad when
        the originals do, held through forward and backward (the simulator counts them;
        none of the figures does). ``side_pending``: a later layer already made its
        gradient, so this layer's contribution is summed out of place (:class:`_Pending`).
        ``side_pending_held``: that gradient's storage outlives the sum (another tensor's gradient
        views it too): held through the backward.
        ``example_input`` may then be None: the layer reads no chain tensor.
        ``side_last``: the layer is that input's last reader: the forward runs again with it (each set of
        such inputs) dying at its last use inside (``side_in_last_gain``: the change, at most 0);
        ``side_rank``: per side input, how likely a plan holds it elsewhere (of equal gains, lowest first).
    side_outputs : int, default 0
        The layer returns ``(y, *side)`` (``(*side)`` when not ``main_output``): side tensors
        later layers read. Their gradients are injected with the chain output's and left
        out of ``b`` like it; the simulator counts them.
    shared_out_grads : iterable of (members, nbytes), optional
        Outputs (0 the chain output, then the side outputs) whose gradients are views of one
        storage of ``nbytes`` in the model (a later concatenation's or addition's); a member
        ``("in", k)`` is side input ``k``, whose pending gradient is a view of that storage too
        (it then lives until this layer's contribution is summed in).
    out_grad_layout : (nbytes, stride, offset), optional
        The chain output's gradient is a view of a storage of ``nbytes`` with this layout (a later
        concatenation's slice): handed out so, as an op that needs it contiguous copies it.
    main_output_grad : bool, default True
        False when no gradient reaches the chain output in the model (the next layer reads it
        only in ops no output depends on): none is injected for it, and ``ga`` is 0.
    side_output_grads : iterable of bool, optional
        Per side output, whether a gradient reaches it in the model (default: all do); none is
        injected for one that no later layer hands a gradient (read only by dead ops).
    side_out_grad_layout : (nbytes, stride, offset), optional
        ``out_grad_layout`` for the layer's one output a gradient reaches when that is a side output
        (a GroupNorm output concatenated later: a strided channel slice, which its backward copies).
    hold_out_grad : bool, default False
        The chain output's gradient storage outlives the layer's backward in the model (a side
        tensor's gradient, summed at an earlier layer, views it): held to the end, so that every
        figure counts it where the backward has it (``gh`` is then 0).
    like : Tensor, optional
        For a layer that reads nothing and has no parameter (``torch.rand`` of a stochastic
        depth mask): a tensor on the device the layer runs on (fake or real).

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
    side_inputs = list(side_inputs)
    side_last = list(side_last) or [False] * len(side_inputs)
    side_pending = list(side_pending) or [False] * len(side_inputs)
    side_pending_held = list(side_pending_held) or [False] * len(side_inputs)
    plain = example_input is not None and not side_inputs and not side_outputs and main_output
    if example_input is not None and not isinstance(example_input, torch.Tensor):
        raise TypeError(
            f"measure_layer takes one example input tensor, got {type(example_input).__name__}; "
            "measure_layer(layer, x) measures a layer with one tensor input and one tensor output"
        )
    static_inputs = list(static_inputs)
    # a layer may read nothing from other layers (a position embedding of arange's indices): its
    # parameters tell the device and whether it runs on fake tensors
    probes = ([example_input] if example_input is not None else []) + side_inputs + static_inputs + [
        t for t in (*module.parameters(), *module.buffers())] + ([like] if like is not None else [])
    if not probes:
        raise TypeError("measure_layer needs an input or a parameter: the chain input, side inputs, static inputs")
    probe_t = probes[0]
    fake = is_fake(probe_t)
    dev = probe_t.device if fake else resolve_device(module, [probe_t], None, "measure_layer")
    param_bytes, param_ptrs = storage_bytes(list(module.parameters()), fake=fake)
    buffer_bytes, buffer_ptrs = storage_bytes(list(module.buffers()), exclude=param_ptrs, fake=fake)

    with no_lasting_state(module, (), dev):
        if not fake:  # stale fake storages are not in the new tracker: no need to collect them
            gc.collect()
        static_inputs = list(static_inputs)
        static_bytes, static_ptrs = storage_bytes(static_inputs, fake=fake)
        static_keys = []
        for t in static_inputs:
            st = real_storage(t, fake) if isinstance(t, torch.Tensor) else None
            static_keys.append(storage_key(st) if st is not None else None)
        casts = _autocast_weight_casts(module, ([example_input] if example_input is not None else []) + side_inputs,
                                       static_inputs)
        cast_bytes, cast_ptrs = storage_bytes(casts, exclude=param_ptrs | buffer_ptrs, fake=fake)
        record: dict[str, Any] = {}  # what the backward tells about the output and input gradients
        out_freed: dict[str, int] = {}  # (not in ``record``: its "hold_out" would keep the gradient alive)
        record["on_free"] = lambda: out_freed.setdefault("at", len(tracker.timeline))
        if out_grad_layout is not None and main_output:
            record["layout"] = tuple(out_grad_layout)
        if not main_output_grad:
            record["no_grad"] = True  # (InjectGrad hands the chain output none)
        if hold_out_grad:
            record["hold_out"] = []  # (InjectGrad keeps the chain output's gradient here)
        # side inputs: fresh, requiring grad as in the model, held throughout (the simulator counts them)
        side_records: list[dict[str, Any]] = [{"out_of": record, "tag": k} for k in range(len(side_inputs))]
        x, sides = _fresh_inputs(example_input, input_requires_grad, leaf_input, side_inputs, dev, record,
                                 side_records)
        x_ptr = storage_key(x.untyped_storage()) if x is not None else None
        input_bytes = x.untyped_storage().nbytes() if x is not None else 0
        x_storage = x.untyped_storage() if x is not None else None
        side_ptrs = [_key(t, fake) for t in sides]
        side_keys_in = {k for k in side_ptrs if k is not None and k != x_ptr}

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
        released_keys: list[tuple[int, Any]] = []  # (timeline index, storage key) per saved tensor released

        # A recomputed side input is a copy of its own, handed out once: unpacking a saved side input
        # hands the backward a copy laid out as it (``copies``: timeline indices from which the copy
        # is made and counted, when it died, bytes; taken out again by _without_copies), which dies
        # when the node that read it returns. The side input itself is held throughout by the caller.
        # ``rec_gone``: (timeline index, key) per reference a recomputed copy would have: a copy's
        # death, or the release of a saved reference never read.
        copies: list[list] = []
        rec_gone: list[tuple[int, Any]] = []

        def on_release(holds_input: bool, key: Any, state: list) -> None:
            released.append((len(tracker.timeline), holds_input))
            released_keys.append((len(tracker.timeline), key))
            if not state[1]:
                rec_gone.append((len(tracker.timeline), key))

        def on_copy_death(k: int, key: Any) -> None:
            copies[k][2] = len(tracker.timeline)
            rec_gone.append((len(tracker.timeline), key))

        # The backward runs once as in a recomputed segment: unpacking a saved tensor lets the
        # box go of it (a checkpoint hands out its recomputed tensors and keeps none), so the
        # tensor dies once the backward node that read it returns, before the engine reduces the
        # node's gradients to their inputs' shapes (a bias's sum). Elsewhere autograd keeps it
        # until it releases the node's saved tensors, after that. When each saved storage (and
        # the input's) dies gives the figures of both (_held_timeline).
        deaths: dict[Any, tuple[int, int]] = {}  # storage key -> (timeline index, bytes)
        # A storage that died leaves its key (an address, or a fake storage's id) to the next one:
        # a key that died is told apart from its successors by how often it died before
        generations: dict[Any, int] = {}

        def ident(st: Any) -> Any:
            base = storage_key(st)
            g = generations.get(base, 0)
            return base if g == 0 else (base, g)

        def on_death(key: Any, nbytes: int) -> None:
            deaths[key] = (len(tracker.timeline), nbytes)
            base = key[0] if isinstance(key, tuple) else key
            generations[base] = generations.get(base, 0) + 1

        watched: set = set()

        def watch(st: Any, key: Any) -> None:
            if key is not None and key not in watched:
                watched.add(key)
                weakref.finalize(st, on_death, key, st.nbytes()).atexit = False

        if x_storage is not None:
            watch(x_storage, x_ptr)
        del x_storage

        def pack(t: torch.Tensor) -> _Packed:
            s = real_storage(t, fake)
            # only storages this layer created, or registered below (parameters, buffers,
            # input); a pre-existing one (an autocast cast-cache copy of a weight) is static
            key = ident(s) if s is not None and tracker.is_tracked(t) else None
            state = [key, False]
            box = _Packed(t.detach(), state)  # detached: a saved output would otherwise keep its own graph alive
            weakref.finalize(box, on_release, key is not None and key == x_ptr, key, state).atexit = False
            if key is not None:
                watch(s, key)
            packs.append((weakref.ref(box), key, s.nbytes() if key is not None else 0, len(tracker.timeline)))
            return box

        first_unpack: list[int] = []  # live bytes when the backward first reads a saved tensor

        def unpack(box: _Packed) -> torch.Tensor:
            if not first_unpack:  # (as with the input held: nothing died yet but it)
                first_unpack.append(tracker.current_bytes + (input_bytes if x_ptr in deaths else 0))
                # the injected output gradient already gone (used up by ops that save nothing): with it
                # went its whole storage, which in the model outlives it where that storage is larger (a
                # slice of a concatenation's gradient whose other slices are still to be used)
                first_unpack.append("at" in out_freed)
                first_unpack.append(len(tracker.timeline))  # (the backward's entries before it: its first part)
            t = box.t
            if t is None:  # (read twice: a custom Function's ctx.saved_tensors)
                t = box.w()
            else:
                box.state[1] = True
                if box.state[0] is not None and box.state[0] in side_keys_in:
                    i0 = len(tracker.timeline)
                    t = clone_layout(t)
                    st = real_storage(t, fake)
                    watch(st, ident(st))
                    copies.append([i0, len(tracker.timeline), None, st.nbytes()])
                    weakref.finalize(st, on_copy_death, len(copies) - 1, box.state[0]).atexit = False
                    del st
                box.t = None
                box.w = weakref.ref(t)
            return t

        grads_exist = list(grads_exist)
        pending = storage_bytes(grads_exist, fake=fake)[0] if grads_exist else 0
        tracker = StorageTracker(fake=fake, timeline=True)
        tracker.register(module, *([x] if x is not None else []), *sides, *casts, *static_inputs)
        start = tracker.current_bytes
        side_record: dict[str, Any] = {}  # the side outputs' injected gradients, the pending ones
        held_record: dict[str, Any] = {"hold": []}  # pending gradients held through the backward
        # the forward takes its inputs in a list it empties, so that the chain input can die at its
        # last use inside the layer, as it does in the model where nothing else holds it (ff, ffs);
        # added back from its death it gives f and fs (the input held, as by a save of the layer
        # before it, or by a checkpoint)
        freeing = _list_input_copy(module) if not leaf_input else None
        try:
            with tracker:
                # forward
                f_start = len(tracker.timeline)
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    inputs = ([x] if x is not None else []) + [*sides, *static_inputs]
                    if freeing is not None:
                        x = None
                    y = _call_layer(module, freeing, inputs)
                    del inputs
                f_end = len(tracker.timeline)
                x_fwd_death = deaths[x_ptr][0] if x_ptr in deaths else f_end
                forward_peak, forward_peak0 = _forward_peaks(tracker.timeline, f_start, f_end, start, input_bytes,
                                                             x_fwd_death)
                kept = [(key, nbytes, peak) for ref, key, nbytes, peak in packs if ref() is not None]
                dead_packs = len(kept) < len(packs)
                saved = {key: nbytes for key, nbytes, _ in kept if key is not None}
                # forward peak up to the last pack, kept or not: where a recomputation of this
                # layer, the last of its segment, stops. Non-reentrant checkpoint counts every
                # tensor its forward packed, a dead branch's too, and stops once it has re-packed
                # as many, so a dead branch after the last kept save is re-run as well.
                last_pack = (_forward_peaks(tracker.timeline, f_start, packs[-1][3], start, input_bytes, x_fwd_death)
                             if packs else None)
                if side_outputs or not main_output:
                    outs = list(y) if isinstance(y, (tuple, list)) else [y]
                    if len(outs) != side_outputs + bool(main_output):
                        raise TypeError(f"the layer returned {len(outs)} values for {side_outputs} side outputs")
                    y = outs[0] if main_output else None
                    side_ys = outs[1:] if main_output else outs
                    del outs  # (a list that held the outputs would keep them alive through the backward)
                else:
                    side_ys = []
                if main_output and not isinstance(y, torch.Tensor):
                    raise TypeError(
                        f"measure_layer needs a layer with one tensor output, got {type(y).__name__}"
                    )
                if y is not None and not y.requires_grad:
                    raise ValueError(
                        "the layer's output does not require grad (it is detached, or computed under "
                        "torch.no_grad()), so it has no backward pass to measure"
                    )
                ys = real_storage(y, fake) if y is not None else None
                y_ptr = ident(ys) if ys is not None else None
                a = ys.nbytes() if ys is not None else 0
                side_y_ptrs = [None if real_storage(t, fake) is None else ident(real_storage(t, fake)) for t in side_ys]
                if plain:
                    end = InjectGrad.apply(y, record)
                    if grads_exist:
                        # A later layer's gradient for these weights reaches their AccumulateGrad
                        # first and waits in the engine's input buffer; this layer's contribution
                        # is then added out of place. A zero branch created last (so its backward
                        # runs first) reproduces that; its buffered gradient is subtracted below,
                        # since the chain model counts it among the later layer's gradients.
                        end = end.sum() + sum((prm * 0).sum() for prm in grads_exist)
                    roots = [end]
                else:
                    outs_all = ([y] if y is not None else []) + list(side_ys)
                    # the outputs no gradient reaches in the model: none injected
                    no_grad_out = ({0} if y is not None and not main_output_grad else set()) | {
                        k + (1 if y is not None else 0) for k, want in enumerate(side_output_grads) if not want}
                    # the layer's one output a gradient reaches is a side output (no chain output, or one no
                    # gradient reaches): its gradient is the layer's output gradient, g its storage (as
                    # tracer/layers.py::_storages_and_sides takes it)
                    lone = (len(outs_all) == 1 if y is None else
                            not main_output_grad and len(outs_all) - len(no_grad_out) == 1)
                    side_injects = []
                    roots = []
                    grouped: set[int] = set()
                    reached = reachable([o for o in outs_all if o.requires_grad])
                    # a pending side gradient that is a view of an output's gradient storage (("in", k)
                    # in a group): handed out with it, so the storage lives until the sum, as in the model
                    pending_in_group: set[int] = set()
                    for members, nbytes in shared_out_grads:
                        ins = [k[1] for k in members if isinstance(k, tuple) and side_pending[k[1]]
                               and sides[k[1]].requires_grad and sides[k[1]].grad_fn in reached]
                        members = [k for k in members if not isinstance(k, tuple) and outs_all[k].requires_grad
                                   and k not in no_grad_out]
                        if not members or (len(members) + len(ins) < 2 and not lone and int(nbytes) <= (
                                outs_all[members[0]].numel() * outs_all[members[0]].element_size())):
                            continue  # (one output alone: only as a slice of a larger storage)
                        rec = record if y is not None and 0 in members else {}
                        if rec is not record:
                            if lone:
                                # the layer's only output, a slice of a larger storage: that storage is
                                # its output gradient (g), as a chain output's is (rg, rgk below)
                                rec.update(on_free=record["on_free"], storage=True)
                                if side_out_grad_layout is not None:  # (laid out as the reader hands it out)
                                    rec["layout"] = tuple(side_out_grad_layout)
                            side_injects.append(rec)
                        roots.append(_SharedGrad.apply(rec, int(nbytes), *[outs_all[k] for k in members],
                                                       *[sides[k] for k in ins]))
                        grouped |= set(members)
                        pending_in_group |= set(ins)
                    for k in range(len(outs_all)):
                        if k in grouped or not outs_all[k].requires_grad or k in no_grad_out:
                            continue
                        rec = record if y is not None and k == 0 else {}
                        if rec is not record:
                            side_injects.append(rec)
                        roots.append(InjectGrad.apply(outs_all[k], rec))  # (no loop variable keeps an output)
                    if lone and len(side_injects) == 1:
                        record["only_side_out"] = side_injects[0]
                    if grads_exist:
                        roots.append(sum((prm * 0).sum() for prm in grads_exist))
                    # created last, so run first: the gradient a later layer already made (only
                    # for a side input the layer's backward reaches: one it reads the size of gets none)
                    roots += [_Pending.apply(t, held_record if side_pending_held[k] else side_record)
                              for k, (t, p) in enumerate(zip(sides, side_pending))
                              if p and t.requires_grad and t.grad_fn in reached and k not in pending_in_group]
                    del reached  # (autograd nodes: holding them keeps what they hold)
                # the input is not held: when it dies tells the figures with it held through the
                # backward, or by nothing else, or by a checkpoint's frame (_held_timeline)
                held_sides = sides
                del x, y, ys, side_ys
                if not plain:
                    del outs_all
                # backward
                x_dead = x_ptr is not None and x_ptr in deaths  # (nothing saved it: gone at the start)
                backward_start = tracker.current_bytes + (input_bytes if x_dead else 0)
                k0 = len(tracker.timeline)
                released.clear()  # (a dead branch's saved tensors die in the forward)
                released_keys.clear()
                rec_gone.clear()
                alive_keys: dict[Any, int] = {}
                for ref, key, *_ in packs:
                    if ref() is not None:
                        alive_keys[key] = alive_keys.get(key, 0) + 1
                alive = sum(ref() is not None for ref, *_ in packs)
                alive_input = sum(ref() is not None and key is not None and key == x_ptr for ref, key, *_ in packs)
                if plain:
                    end.backward(torch.empty(0, device=dev) if end.dim() else None)
                    del end
                elif roots:
                    torch.autograd.backward(roots, [torch.empty(0, device=dev) if r.dim() else None for r in roots])
                out_grads = record.get("grad_bytes", 0)
                # the output's own gradient (a view output's is the view's size, not its storage's)
                ga = (min(a, record["grad_bytes"]) if y_ptr is not None and record.get("grad_bytes") else
                      a if main_output_grad else 0)
                out_main = record.get("grad_bytes", 0) if y_ptr is not None else 0  # its injected storage
                only = record.get("only_side_out", {})
                if (y_ptr is None or not main_output_grad) and only.get("storage"):
                    out_main = only.get("grad_bytes", 0)
                # (a lone side output's injected gradient, where the layer has no chain output: rgl)
                lone = only.get("grad_bytes", 0) if y_ptr is None and only else None
                if not plain:
                    out_grads += sum(r.get("grad_bytes", 0) for r in side_injects)
                pending += side_record.get("pending", 0) + held_record.get("pending", 0)
                del roots, held_sides
                # the timeline as autograd outside a checkpoint has it (saved tensors kept until their
                # node's release, the input held throughout), and as a recomputed segment has it
                end_index = len(tracker.timeline)
                x_gone = k0 if x_dead else deaths.get(x_ptr, (end_index,))[0] if x_ptr is not None else end_index
                timeline, rec_timeline = _held_timelines(_without_copies(tracker.timeline, copies), k0, deaths,
                                                         released_keys, alive_keys,
                                                         x_ptr, x_gone, input_bytes)
                peaks = _backward_peaks(timeline, k0, backward_start, input_bytes, released, alive, alive_input)
                # in a recomputed segment: b (the input held, or by nothing else: gone once the node
                # that read it last returns) and bk (held by the checkpoint's frame)
                all_gone = _all_released_at(released, alive, k0, end_index)
                rec_gones = (end_index if keep_input else x_gone, max(x_gone, all_gone))
                rec_peaks = [_peak_with_input(rec_timeline, k0, backward_start, input_bytes, gone) for gone in rec_gones]
                # ... and from its first read of a saved tensor on: the segment's last saving layer triggers
                # the recomputation there, and runs the part before without the recomputed tensors (brt,
                # bkrt; that part's excess over the bytes at the read, rgx, goes with the recomputation)
                at = first_unpack[2] if first_unpack else k0
                rec_post = [_peak_with_input(rec_timeline, k0, backward_start, input_bytes, gone, lo=at - 1)
                            for gone in rec_gones]
                rgx = max([0] + [e[2] - first_unpack[0] for e in rec_timeline[k0:at]]) if first_unpack else 0
                # (pre, post): the backward's peak before and from a moment on (relative as b is):
                # when the layer's last saved tensor is released (a checkpoint's frame goes, and
                # the side tensors it holds with it), and when each saved side tensor's last saved
                # reference is (a layer that saves it lets it go)
                series = _relative_series(timeline, k0, backward_start, input_bytes, released, alive,
                                          alive_input, keep_input, out_grads + pending)
                # (a checkpoint's frame goes in a recomputed segment only: split its own series there)
                rec_series = _relative_series(rec_timeline, k0, backward_start, input_bytes, released, alive,
                                              alive_input, keep_input, out_grads + pending, gone=x_gone)
                frame = _split(rec_series, k0, _gone_at(released_keys, alive_keys, None))
                side_release = [(_split(series, k0, _gone_at(released_keys, alive_keys, key))
                                 if alive_keys.get(key) else None) for key in side_ptrs]
                # ... each as the backward figure it goes with where no earlier layer keeps the input:
                # held by the frame alone, it goes with the frame (bkr); by nothing but the layer's
                # saves, with the last over it (bf). Split with the input held, a side tensor that goes
                # before the input does dropped out of the first layer of such a segment (632 B under)
                frame_k = _split(_relative_series(rec_timeline, k0, backward_start, input_bytes, released, alive,
                                                  alive_input, False, out_grads + pending, gone=rec_gones[1]),
                                 k0, _gone_at(released_keys, alive_keys, None))
                side_release_free = []  # (the same as side_release where b already has the input go)
                if keep_input:
                    series_f = _relative_series(timeline, k0, backward_start, input_bytes, released, alive,
                                                alive_input, False, out_grads + pending)
                    side_release_free = [(_split(series_f, k0, _gone_at(released_keys, alive_keys, key))
                                          if alive_keys.get(key) else None) for key in side_ptrs]
                # ... and in a recomputed segment, where the recomputed copy goes with the last node
                # that read it (before the engine reduces that node's gradients: a bias's sum)
                side_release_rec = [(_split(rec_series, k0, _gone_at(rec_gone, alive_keys, key))
                                     if alive_keys.get(key) else None) for key in side_ptrs]
                # a side output the layer saves is in the backward's starting bytes (unlike a side
                # input, nothing but the saved reference holds it here, as in the model, where the
                # producer's backward comes last): counted whole on top of b, released or not
                top = max(series)
                side_out_release = [(top, top) if alive_keys.get(key) else None for key in side_y_ptrs]
                static_release = [(_split(series, k0, _gone_at(released_keys, alive_keys, key))
                                   if key is not None and alive_keys.get(key) else None) for key in static_keys]
                # the output gradient held to the end of the backward (a side tensor's gradient
                # viewing its storage keeps it): what that adds to the peak
                gh = 0
                freed, gbytes = out_freed.get("at"), record.get("grad_bytes", 0)
                if freed is not None and gbytes:
                    live = [e[2] for e in timeline[k0:]] or [backward_start]
                    held = [v + (gbytes if k0 + k >= freed else 0) for k, v in enumerate(live)]
                    gh = max(0, max(held) - max(live))
        finally:
            tracker.detach()
        # (a layer whose forward packs nothing runs the same in a checkpoint)
        run = (module, freeing, example_input, input_requires_grad, leaf_input, side_inputs, static_inputs, casts,
               fake, dev)
        fc, ffc = _forward_pass(*run, keep_saves=False)[:2] if packs else (None, None)
        # a side input this layer reads last and does not save dies at its last use inside it where nothing
        # else holds it (the plan decides): the forward peak's largest change (input held or not; in all, a
        # recomputation to the last pack apart). With several, per set of them dying (_dying_gains)
        dying = [k for k, last in enumerate(side_last) if last and side_ptrs[k] not in saved]
        ref = [forward_peak - start, forward_peak0 - start] + ([p - start for p in last_pack] if packs else [])
        changes: dict[tuple, list[int]] = {}

        def change(drop: tuple) -> list[int]:
            if drop not in changes:
                held, free, pheld, pfree = _forward_pass(*run, keep_saves=True, drop_side=drop)
                changes[drop] = [v - w for v, w in zip([held, free] + ([pheld, pfree] if packs else []), ref)]
            return changes[drop]

        dying = dying if freeing is not None else []

        def gains(drops: list, fn) -> list:  # per regime: [(held, free) per side input], the layer's input held
            return list(zip(*[_dying_gains(drops, lambda d, k=k: min(0, fn(d)[k]), len(side_inputs),
                                           rank=list(side_rank) or None) for k in (0, 1)]))
        # (in a recomputation that stops at the layer's last saved tensor; in its whole forward)
        last_gain = gains(dying, lambda d: change(d)[2:] or change(d)[:2])  # (or dying at its last use)
        last_full = gains(dying, lambda d: change(d)[:2])
        # ... and in a checkpoint's first pass, which keeps none of the saved tensors: one it saves dies too
        ref_c = [fc, ffc] if packs else ref[:2]

        def change_c(drop: tuple) -> list[int]:
            if not packs:
                return change(drop)[:2]
            return [v - w for v, w in zip(_forward_pass(*run, keep_saves=False, drop_side=drop)[:2], ref_c)]

        dying_c = [k for k, last in enumerate(side_last) if last] if freeing is not None else []
        last_ckpt = gains(dying_c, change_c)

    sout = y_ptr is not None and y_ptr in saved
    # an output that is static memory (the model input handed on, a parameter) is in the static bytes
    # already: no storage of its own (out_static; the next layer's input never dies)
    out_static = y_ptr is not None and (y_ptr in static_ptrs | param_ptrs | buffer_ptrs
                                        or (leaf_input and y_ptr == x_ptr))
    a_own = 0 if out_static else a
    unpack_gain = max(0, first_unpack[0] - backward_start - pending) if first_unpack else 0
    # a side output that is the input itself (a same-dtype cast of a residual crossing on to later
    # layers) carries that storage from here: counted once, as the side tensor
    sin = x_ptr is not None and x_ptr in saved and x_ptr != y_ptr and x_ptr not in side_y_ptrs
    side_keys = set(side_ptrs) | set(side_y_ptrs)
    other = set(saved) - param_ptrs - buffer_ptrs - cast_ptrs - static_ptrs - {x_ptr, y_ptr} - side_keys
    measured = LayerMeasurement(
        a=int(a_own),
        out_static=bool(out_static),
        p=int(param_bytes),
        sin=bool(sin),
        sout=bool(sout),
        m=int(sum(saved[k] for k in other)),
        f=int(forward_peak - start),
        fs=int(last_pack[0] - start) if last_pack is not None else 0,
        ff=int(forward_peak0 - start),
        ffs=int(last_pack[1] - start) if last_pack is not None else 0,
        fc=fc,
        ffc=ffc,
        side_in_last_gain=tuple(int(g[0]) for g in last_gain),
        side_in_last_gain_full=tuple(int(g[0]) for g in last_full),
        side_in_last_gain_ckpt=tuple(int(g[0]) for g in last_ckpt),
        side_in_last_gain_free=tuple((int(a[1]), int(b[1]), int(c[1])) for a, b, c in zip(last_gain, last_full, last_ckpt)),
        b=int(peaks[0 if keep_input else 1] - out_grads - pending),
        bf=int(peaks[1] - out_grads - pending),
        bk=int(peaks[2] - out_grads - pending),
        br=int(rec_peaks[0] - out_grads - pending),
        bkr=int(rec_peaks[1] - out_grads - pending),
        # (at least 0: an output gradient the part before the read used up is gone after it, as b counts it)
        brt=int(max(0, rec_post[0] - out_grads - pending)),
        bkrt=int(max(0, rec_post[1] - out_grads - pending)),
        rgx=int(rgx),
        gin=record.get("in_bytes"),
        gin_is_out=bool(record.get("in_is_out", False)),
        gin_layout=record.get("in_layout"),
        # rg as with an a-byte output gradient (ChainCosts.rg); the gradient of a view is smaller, and a
        # storage shared with other gradients (shared_out_grads) larger: the model counts g for it. An
        # output gradient gone by then (its whole storage with it: a slice copied out and let go) is
        # gone in the model too, where the kernels add g - a back (rb), so rg may come out below 0:
        # taken as 0 (Llama-3-8B's width: the key projection's gradient), never under. rgk keeps it,
        # storage and all (a side tensor's pending gradient views it: the tracer picks, chain._rg)
        rg=int(max(0, unpack_gain + a_own - (out_main or ga))) if first_unpack else int(a_own),
        rgk=int(unpack_gain + a_own - (0 if first_unpack[1] else out_main or ga)) if first_unpack else int(a_own),
        rgl=None if lone is None else int(max(0, unpack_gain - lone)) if first_unpack else 0,
        ga=int(ga),
        dead=bool(dead_packs),
        holds=bool(kept) and not (sin or sout or other),
        buffer_bytes=int(buffer_bytes),
        input_bytes=int(input_bytes),
        side_in_saved=tuple(k in saved for k in side_ptrs),
        side_out_saved=tuple(k in saved for k in side_y_ptrs),
        side_in_grad=tuple(r.get("in_bytes") for r in side_records),
        side_in_grad_is_out=tuple(bool(r.get("in_is_out", False)) for r in side_records),
        side_in_grad_shares=tuple(_shares(r, record) for r in side_records),
        side_in_grad_layout=tuple(r.get("in_layout") for r in side_records),
        gh=int(gh),
        frame_pre=int(frame[0]),
        frame_post=int(frame[1]),
        frame_pre_k=int(frame_k[0]),
        frame_post_k=int(frame_k[1]),
        side_in_release_free=tuple(side_release_free),
        side_in_release=tuple(side_release),
        side_in_release_rec=tuple(side_release_rec),
        side_out_release=tuple(side_out_release),
        static_in_saved=tuple(k is not None and k in saved for k in static_keys),
        static_in_release=tuple(static_release),
    )
    if static_input:  # nothing frees a static input: every figure is the one with it held
        m = measured
        measured = replace(m, bf=m.b, bk=m.b, bkr=m.br, bkrt=m.brt, ff=m.f, ffs=m.fs, ffc=m.fc,
                           frame_pre_k=m.frame_pre, frame_post_k=m.frame_post, side_in_release_free=())
    return measured
