"""Running one layer to measure it: fresh inputs, the storage tracker and autograd's hooks.

:func:`record_layer` runs a layer forward and backward once and returns a
:class:`~ckptopt.tracer.layer_record.LayerRecord`; :meth:`LayerRun.forward_pass` runs one more forward
under other holding rules (a checkpoint's first pass, side inputs dying inside the layer). The
figures are derived from the records by :mod:`ckptopt.tracer.layer_figures` (docs/design.md §3).

How the backward is run. It runs once as in a recomputed segment: unpacking a saved tensor lets the
pack hook's box go of it (a checkpoint hands out its recomputed tensors and keeps none), so the
tensor dies once the backward node that read it returns, before the engine reduces the node's
gradients to their inputs' shapes (a bias's sum). Elsewhere autograd keeps it until it releases the
node's saved tensors, after that. When each saved storage (and the input's) dies and when each saved
reference is released give the figures of both.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..torch_utils import clone_layout, inputs_from_list
from ..storages import real_storage, storage_bytes, storage_key, tensor_key
from ..tracker import StorageTracker
from .layer_grads import FreshInput, InjectGrad, Packed, PendingGrad, SharedGrad
from .layer_record import Copy, Entry, FirstRead, InjectedGradients, LayerKeys, LayerRecord, Release

__all__ = ["LayerRun", "GradientPlan", "record_layer", "list_input_copy", "reachable"]


@dataclass
class LayerRun:
    """One layer set up for measuring: its module, what it reads, and how the model holds it.

    ``freeing`` is a copy of a graph module that takes its inputs in a list it empties, so that an input
    nothing else holds dies at its last use inside the layer (None where the input is a leaf or the
    module no graph); ``casts`` the weight copies autocast caches (static memory).
    """

    module: nn.Module
    example_input: torch.Tensor | None
    input_requires_grad: bool
    leaf_input: bool
    side_inputs: list
    static_inputs: list
    casts: list
    fake: bool
    device: Any
    freeing: nn.Module | None = None

    def fresh_inputs(self, record: dict, side_records: list[dict]) -> tuple[Any, list]:
        """The chain input and side inputs, fresh copies laid out as in the model, held by nothing but
        the caller: requiring grad as in the model (through :class:`FreshInput`, which tells ``record``
        about the gradient it receives; a leaf where the model input is one)."""
        x = None
        if self.example_input is not None:
            holder = [clone_layout(self.example_input)]
            if self.input_requires_grad and self.leaf_input:
                x = holder.pop().requires_grad_(True)
            elif self.input_requires_grad:
                x = FreshInput.apply(torch.empty(0, device=self.device, requires_grad=True), holder, record)
            else:  # e.g. the first layer of a model, fed with data: no input gradient is computed
                x = holder.pop()
        sides = []
        for t, rec_t in zip(self.side_inputs, side_records):
            h = [clone_layout(t)]
            sides.append(FreshInput.apply(torch.empty(0, device=self.device, requires_grad=True), h, rec_t)
                         if t.requires_grad else h.pop())
        return x, sides

    def call(self, inputs: list) -> Any:
        """Run the layer on ``inputs``; ``freeing`` empties the list on entry, so an input the caller no
        longer holds dies at its last use inside the layer."""
        return self.freeing(inputs) if self.freeing is not None else self.module(*inputs)

    def forward_pass(self, keep_saves: bool, drop_side: tuple[int, ...] = ()) -> tuple[int, int, int, int]:
        """``(with the input held, as it went)``: the layer's forward transient, relative as ``f``, in one
        more forward on fresh inputs; then the same up to the forward's last pack (as ``fs``, ``ffs``; 0
        if none).

        ``keep_saves`` False: under a pack hook that keeps nothing, as a checkpoint's first pass runs
        (``fc``, ``ffc``): non-reentrant checkpoint keeps none of the tensors the forward saves, so each
        dies at its last use, where autograd elsewhere keeps it to the backward (a normalization's
        input, a dead branch's). ``drop_side``: side inputs held by nothing but the call, so that each
        dies at its last use inside the layer, as it does in the model where this layer reads it last
        and nothing holds it (no save, no checkpoint). The other side inputs are held throughout, as
        the call holds them (docs/design.md §3-4).
        """
        from .layer_figures import forward_peaks

        x, sides = self.fresh_inputs({}, [{} for _ in self.side_inputs])
        input_bytes = x.untyped_storage().nbytes() if x is not None else 0
        died: list[int] = []
        tracker = StorageTracker(fake=self.fake, timeline=True)
        if x is not None:
            weakref.finalize(real_storage(x, self.fake), lambda: died.append(len(tracker.timeline))).atexit = False
        tracker.register(self.module, *([x] if x is not None else []), *sides, *self.casts, *self.static_inputs)
        start = tracker.current_bytes
        packed: list[int] = []  # the timeline's length at each pack

        def keep(t: torch.Tensor) -> torch.Tensor:
            packed.append(len(tracker.timeline))
            return t.detach()  # (a saved output returned as itself: a cycle through its grad_fn, never freed)

        hooks = torch.autograd.graph.saved_tensors_hooks(keep if keep_saves else (lambda t: None), lambda t: t)
        try:
            with tracker:
                f_start = len(tracker.timeline)
                with hooks:
                    inputs = ([x] if x is not None else []) + [*sides, *self.static_inputs]
                    if self.freeing is not None:
                        x = None
                        for k in drop_side:
                            sides[k] = None
                    y = self.call(inputs)
                    del inputs
                end = len(tracker.timeline)
                gone = died[0] if died else end
                held, free = forward_peaks(tracker.timeline, f_start, end, start, input_bytes, gone)
                # (and up to the last pack: where a recomputation ending in this layer stops)
                pheld, pfree = (forward_peaks(tracker.timeline, f_start, packed[-1], start, input_bytes, gone)
                                if packed else (start, start))
                del y
        finally:
            tracker.detach()
        return int(held - start), int(free - start), int(pheld - start), int(pfree - start)


def list_input_copy(module: nn.Module) -> nn.Module | None:
    """A copy of a graph module whose forward takes its inputs as one list and empties it on entry
    (sharing its submodules and parameters), so that an input nothing else holds is freed after its
    last use inside it; None for another module."""
    if not isinstance(module, fx.GraphModule):
        return None
    g = copy.deepcopy(module.graph)
    if not inputs_from_list(g):
        return None
    return fx.GraphModule(module, g)


def reachable(outputs: list[torch.Tensor]) -> set:
    """The autograd nodes a backward from ``outputs`` reaches."""
    seen: set = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return seen


class _Recorder:
    """The pack and unpack hooks and the storage finalizers of one measurement.

    Each writes, at the tracker's current timeline length, what happened: a tensor packed (a weak
    reference to the box autograd keeps, so that a saved tensor counts only if autograd still keeps it
    when the forward ends: a dead branch's saves die with its output), a saved reference released, a
    watched storage's death, the backward's first read. A saved side input is handed to the backward as
    a copy laid out as it, which dies when the node that read it returns (a recomputed copy, handed out
    once); the side input itself stays held by the caller. Finalizer callbacks hold this recorder only:
    nothing that keeps a tensor alive.
    """

    def __init__(self, tracker: StorageTracker, fake: bool, input_key: Any, input_bytes: int, side_keys: set):
        self.tracker = tracker
        self.fake = fake
        self.input_key = input_key
        self.input_bytes = input_bytes
        self.side_keys = side_keys  # the side inputs' storage keys (their saved references are copied)
        self.packs: list[tuple] = []  # (weak reference to the box, key, bytes, timeline length)
        self.releases: list[Release] = []
        self.rec_gone: list[tuple[int, Any]] = []  # a recomputed copy's death, or an unread reference's release
        self.copies: list[list] = []  # [made, counted, died, bytes] per copy handed out
        self.deaths: dict[Any, tuple[int, int]] = {}
        # a storage that died leaves its key (an address, or a fake storage's id) to the next one: a key
        # that died is told apart from its successors by how often it died before
        self.generations: dict[Any, int] = {}
        self.watched: set = set()
        self.first_read: FirstRead | None = None
        self.out_grad_freed: int | None = None

    @property
    def now(self) -> int:
        return len(self.tracker.timeline)

    def ident(self, st: Any) -> Any:
        base = storage_key(st)
        g = self.generations.get(base, 0)
        return base if g == 0 else (base, g)

    def watch(self, st: Any, key: Any) -> None:
        if key is not None and key not in self.watched:
            self.watched.add(key)
            weakref.finalize(st, self._on_death, key, st.nbytes()).atexit = False

    def _on_death(self, key: Any, nbytes: int) -> None:
        self.deaths[key] = (self.now, nbytes)
        base = key[0] if isinstance(key, tuple) else key
        self.generations[base] = self.generations.get(base, 0) + 1

    def _on_release(self, holds_input: bool, key: Any, state: list) -> None:
        self.releases.append(Release(self.now, key, holds_input))
        if not state[1]:
            self.rec_gone.append((self.now, key))

    def _on_copy_death(self, k: int, key: Any) -> None:
        self.copies[k][2] = self.now
        self.rec_gone.append((self.now, key))

    def on_out_grad_free(self) -> None:
        if self.out_grad_freed is None:
            self.out_grad_freed = self.now

    def pack(self, t: torch.Tensor) -> Packed:
        s = real_storage(t, self.fake)
        # only storages this layer created, or registered (parameters, buffers, inputs); a pre-existing
        # one (an autocast cast-cache copy of a weight) is static
        key = self.ident(s) if s is not None and self.tracker.is_tracked(t) else None
        state = [key, False]
        box = Packed(t.detach(), state)  # detached: a saved output would otherwise keep its own graph alive
        weakref.finalize(box, self._on_release, key is not None and key == self.input_key, key,
                         state).atexit = False
        if key is not None:
            self.watch(s, key)
        self.packs.append((weakref.ref(box), key, s.nbytes() if key is not None else 0, self.now))
        return box

    def unpack(self, box: Packed) -> torch.Tensor:
        if self.first_read is None:
            # live bytes as with the input held (nothing died yet but it); the injected output gradient
            # already gone (used up by ops that save nothing) took its whole storage, which in the model
            # outlives it where that storage is larger (a concatenation's gradient still being sliced)
            live = self.tracker.current_bytes + (self.input_bytes if self.input_key in self.deaths else 0)
            self.first_read = FirstRead(live, self.out_grad_freed is not None, self.now)
        t = box.t
        if t is None:  # (read twice: a custom Function's ctx.saved_tensors)
            t = box.w()
        else:
            box.state[1] = True
            if box.state[0] is not None and box.state[0] in self.side_keys:
                made = self.now
                t = clone_layout(t)
                st = real_storage(t, self.fake)
                self.watch(st, self.ident(st))
                self.copies.append([made, self.now, None, st.nbytes()])
                weakref.finalize(st, self._on_copy_death, len(self.copies) - 1, box.state[0]).atexit = False
                del st
            box.t = None
            box.w = weakref.ref(t)
        return t

    def kept(self) -> tuple:
        """(key, bytes) of each pack autograd still keeps."""
        return tuple((key, nbytes) for ref, key, nbytes, _ in self.packs if ref() is not None)

    def alive_keys(self) -> dict:
        out: dict[Any, int] = {}
        for ref, key, *_ in self.packs:
            if ref() is not None:
                out[key] = out.get(key, 0) + 1
        return out


@dataclass
class _Outputs:
    """What the forward returned: the chain output (None without one) and the side outputs."""

    main: torch.Tensor | None
    sides: list


def _split_outputs(y: Any, side_outputs: int, main_output: bool) -> _Outputs:
    if side_outputs or not main_output:
        outs = list(y) if isinstance(y, (tuple, list)) else [y]
        if len(outs) != side_outputs + bool(main_output):
            raise TypeError(f"the layer returned {len(outs)} values for {side_outputs} side outputs")
        return _Outputs(outs[0] if main_output else None, outs[1:] if main_output else outs)
    return _Outputs(y, [])


def _check_output(y: Any, main_output: bool) -> None:
    if main_output and not isinstance(y, torch.Tensor):
        raise TypeError(f"measure_layer needs a layer with one tensor output, got {type(y).__name__}")
    if y is not None and not y.requires_grad:
        raise ValueError(
            "the layer's output does not require grad (it is detached, or computed under "
            "torch.no_grad()), so it has no backward pass to measure"
        )


@dataclass
class GradientPlan:
    """How the measurement hands the layer its gradients, as in the model (docs/design.md §3-4).

    ``record`` is the chain output's injection record (and the chain input's gradient report);
    ``side_records`` the side inputs' gradient reports; ``side_record``/``held_record`` collect the
    side outputs' and pending gradients (``held_record``'s are held through the backward).
    """

    record: dict
    side_records: list[dict]
    side_record: dict
    held_record: dict
    side_injects: list
    grads_exist: list
    pending: int


def _output_gradient_roots(ctx: Any, outs: _Outputs, sides: list, plan: GradientPlan, plain: bool) -> list:
    """The roots the backward starts from: the injected output gradients (whole, shared by several outputs
    as one storage, or none where no gradient reaches an output), a zero branch for each tied weight whose
    gradient a later layer made first, and the pending side-input gradients (created last, so run first)."""
    record, grads_exist = plan.record, plan.grads_exist
    y = outs.main
    if plain:
        end = InjectGrad.apply(y, record)
        if grads_exist:
            # A later layer's gradient for these weights reaches their AccumulateGrad first and waits in
            # the engine's input buffer; this layer's contribution is then added out of place. A zero
            # branch created last (so its backward runs first) reproduces that; its buffered gradient is
            # subtracted from the figures, since the chain model counts it among the later layer's.
            end = end.sum() + sum((prm * 0).sum() for prm in grads_exist)
        return [end]
    outs_all = ([y] if y is not None else []) + list(outs.sides)
    # the outputs no gradient reaches in the model: none injected
    no_grad_out = ({0} if y is not None and not ctx.main_output_grad else set()) | {
        k + (1 if y is not None else 0) for k, want in enumerate(ctx.side_output_grads) if not want}
    # the layer's one output a gradient reaches is a side output (no chain output, or one no gradient
    # reaches): its gradient is the layer's output gradient, g its storage (as tracer/layers.py takes it)
    lone = (len(outs_all) == 1 if y is None else
            not ctx.main_output_grad and len(outs_all) - len(no_grad_out) == 1)
    side_injects = plan.side_injects
    roots = []
    grouped: set[int] = set()
    reached = reachable([o for o in outs_all if o.requires_grad])
    # a pending side gradient that is a view of an output's gradient storage (("in", k) in a group):
    # handed out with it, so the storage lives until the sum, as in the model
    pending_in_group: set[int] = set()
    for members, nbytes in ctx.shared_out_grads:
        ins = [k[1] for k in members if isinstance(k, tuple) and ctx.side_pending[k[1]]
               and sides[k[1]].requires_grad and sides[k[1]].grad_fn in reached]
        members = [k for k in members if not isinstance(k, tuple) and outs_all[k].requires_grad
                   and k not in no_grad_out]
        if not members or (len(members) + len(ins) < 2 and not lone and int(nbytes) <= (
                outs_all[members[0]].numel() * outs_all[members[0]].element_size())):
            continue  # (one output alone: only as a slice of a larger storage)
        rec = record if y is not None and 0 in members else {}
        if rec is not record:
            if lone:
                # the layer's only output, a slice of a larger storage: that storage is its output
                # gradient (g), as a chain output's is (rg, rgk)
                rec.update(on_free=record["on_free"], storage=True)
                if ctx.side_out_grad_layout is not None:  # (laid out as the reader hands it out)
                    rec["layout"] = tuple(ctx.side_out_grad_layout)
            side_injects.append(rec)
        roots.append(SharedGrad.apply(rec, int(nbytes), *[outs_all[k] for k in members],
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
    # created last, so run first: the gradient a later layer already made (only for a side input the
    # layer's backward reaches: one it reads the size of gets none)
    roots += [PendingGrad.apply(t, plan.held_record if ctx.side_pending_held[k] else plan.side_record)
              for k, (t, p) in enumerate(zip(sides, ctx.side_pending))
              if p and t.requires_grad and t.grad_fn in reached and k not in pending_in_group]
    return roots


def _injected(ctx: Any, plan: GradientPlan, main: bool, output_bytes: int, plain: bool) -> InjectedGradients:
    """The bytes of the gradients the backward was handed (read once it ran)."""
    record = plan.record
    outputs = record.get("grad_bytes", 0)
    # the output's own gradient (a view output's is the view's size, not its storage's)
    chain = (min(output_bytes, record["grad_bytes"]) if main and record.get("grad_bytes") else
             output_bytes if ctx.main_output_grad else 0)
    chain_storage = record.get("grad_bytes", 0) if main else 0  # its injected storage
    only = record.get("only_side_out", {})
    if (not main or not ctx.main_output_grad) and only.get("storage"):
        chain_storage = only.get("grad_bytes", 0)
    # (a lone side output's injected gradient, where the layer has no chain output: rgl)
    lone = only.get("grad_bytes", 0) if not main and only else None
    if not plain:
        outputs += sum(r.get("grad_bytes", 0) for r in plan.side_injects)
    pending = plan.pending + plan.side_record.get("pending", 0) + plan.held_record.get("pending", 0)
    return InjectedGradients(outputs=outputs, pending=pending, chain=chain, chain_storage=chain_storage,
                             lone_side=lone, chain_grad_bytes=record.get("grad_bytes", 0))


def record_layer(run: LayerRun, ctx: Any, plain: bool) -> tuple[LayerRecord, GradientPlan]:
    """Run the layer forward and backward once and record it (module docstring). ``ctx``: the
    :class:`~ckptopt.tracer.layer_costs.LayerContext`; ``plain``: one tensor in, one out."""
    fake = run.fake
    record: dict[str, Any] = {}  # the chain output's injection, and what the chain input's gradient is
    if ctx.out_grad_layout is not None and ctx.main_output:
        record["layout"] = tuple(ctx.out_grad_layout)
    if not ctx.main_output_grad:
        record["no_grad"] = True  # (InjectGrad hands the chain output none)
    if ctx.hold_out_grad:
        record["hold_out"] = []  # (InjectGrad keeps the chain output's gradient here)
    # per side input, what its gradient is (FreshInput's backward fills it in)
    side_records: list[dict[str, Any]] = [{"out_of": record, "tag": k} for k in range(len(run.side_inputs))]
    # side inputs: fresh, requiring grad as in the model, held throughout (the simulator counts them)
    x, sides = run.fresh_inputs(record, side_records)
    x_key = storage_key(x.untyped_storage()) if x is not None else None
    input_bytes = x.untyped_storage().nbytes() if x is not None else 0
    side_keys = tuple(tensor_key(t, fake) for t in sides)
    tracker = StorageTracker(fake=fake, timeline=True)
    rec = _Recorder(tracker, fake, x_key, input_bytes, {k for k in side_keys if k is not None and k != x_key})
    # (the injected gradient's death is told to the recorder, not kept in ``record``, whose "hold_out"
    # keeps that gradient alive)
    record["on_free"] = rec.on_out_grad_free
    if x is not None:
        rec.watch(x.untyped_storage(), x_key)
    grads_exist = list(ctx.grads_exist)
    plan = GradientPlan(record, side_records, {}, {"hold": []}, [], grads_exist,
                        storage_bytes(grads_exist, fake=fake)[0] if grads_exist else 0)
    static_keys = tuple(tensor_key(t, fake) if isinstance(t, torch.Tensor) else None for t in run.static_inputs)
    tracker.register(run.module, *([x] if x is not None else []), *sides, *run.casts, *run.static_inputs)
    start = tracker.current_bytes
    try:
        with tracker:
            f_start = len(tracker.timeline)
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
                inputs = ([x] if x is not None else []) + [*sides, *run.static_inputs]
                if run.freeing is not None:
                    x = None
                y = run.call(inputs)
                del inputs
            f_end = len(tracker.timeline)
            x_fwd_death = rec.deaths[x_key][0] if x_key in rec.deaths else f_end
            kept = rec.kept()
            last_pack = rec.packs[-1][3] if rec.packs else None
            outs = _split_outputs(y, ctx.side_outputs, ctx.main_output)
            del y  # (a list that held the outputs would keep them alive through the backward)
            _check_output(outs.main, ctx.main_output)
            ys = real_storage(outs.main, fake) if outs.main is not None else None
            y_key = rec.ident(ys) if ys is not None else None
            output_bytes = ys.nbytes() if ys is not None else 0
            side_out_keys = tuple(None if real_storage(t, fake) is None else rec.ident(real_storage(t, fake))
                                  for t in outs.sides)
            roots = _output_gradient_roots(ctx, outs, sides, plan, plain)
            main = y_key is not None
            # the input is not held: when it dies tells the figures with it held through the backward,
            # or by nothing else, or by a checkpoint's frame
            del x, ys, outs
            x_dead = x_key is not None and x_key in rec.deaths  # (nothing saved it: gone at the start)
            backward_start = tracker.current_bytes + (input_bytes if x_dead else 0)
            k0 = len(tracker.timeline)
            rec.releases.clear()  # (a dead branch's saved tensors die in the forward)
            rec.rec_gone.clear()
            alive_keys = rec.alive_keys()
            if plain:
                end = roots.pop()
                end.backward(torch.empty(0, device=run.device) if end.dim() else None)
                del end
            elif roots:
                torch.autograd.backward(roots, [torch.empty(0, device=run.device) if r.dim() else None
                                                for r in roots])
            del roots
            grads = _injected(ctx, plan, main, output_bytes, plain)
            keys = LayerKeys(chain_in=x_key, chain_out=y_key, side_in=side_keys, side_out=side_out_keys,
                             static_in=static_keys)
            layer_record = LayerRecord(
                timeline=[Entry(*e) for e in tracker.timeline], start=start, input_bytes=input_bytes,
                forward=(f_start, f_end), input_death_in_forward=x_fwd_death, last_pack=last_pack,
                packs=len(rec.packs), kept=kept, keys=keys, output_bytes=output_bytes, backward_index=k0,
                backward_start=backward_start, input_dead=x_dead, alive_keys=alive_keys,
                releases=list(rec.releases), rec_gone=list(rec.rec_gone), deaths=dict(rec.deaths),
                copies=[Copy(*c) for c in rec.copies], first_read=rec.first_read,
                out_grad_freed=rec.out_grad_freed, grads=grads)
    finally:
        tracker.detach()
    del sides
    return layer_record, plan
