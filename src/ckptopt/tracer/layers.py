"""Layers: each group of graph nodes built into a module and measured (docs/design.md §3-4).

:func:`measure_layers` turns the groups between cuts into :class:`Layer` records: each a
``GraphModule`` over the shared parameters taking its chain input, the side tensors it
reads and the static values it reads, returning its chain output and the side tensors it
computes, measured once on fake tensors (:func:`ckptopt.tracer.layer_costs.measure_layer`).
A second pass re-measures the layers whose output gradients turn out to share one storage
(an addition or a concatenation after them hands the same gradient to several of their
outputs), so that their figures count it once; the side tensors follow from what each
layer saves and from the storages its input gradients live in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from ..costs import SideTensor
from ..errors import TraceError
from ..storages import storage_identity, storage_nbytes
from ..torch_utils import tensor_leaves
from .capture import module_path
from .cuts import WithLoss, op_label
from .flops import layer_compute
from .layer_costs import LayerMeasurement, measure_layer
from .layer_build import Built, build_layers
from .side_tensors import Crossings

__all__ = ["Layer", "measure_layers", "hoisted_side_tensors"]

#: Hoisted values become at most this many side tensors (grouped by who reads and saves them, then
#: merged by when they are held): each is a state bit of the exact programs at every boundary.
MAX_EARLY = 2


@dataclass(frozen=True)
class Layer:
    """One layer of the chain: the graph nodes between two candidate cuts."""

    index: int
    name: str  #: a readable label (the module path, or the first and last nodes)
    nodes: tuple[str, ...]  #: FX node names in execution order (``"<loss>"`` for the loss layer)
    ops: tuple[str, ...]  #: what each node runs (module type or function name)
    #: the chain tensor entering the layer (its checkpoint when a segment starts here; "" when only side
    #: tensors cross into it), and the one leaving it
    input_node: str
    output_node: str
    costs: LayerMeasurement  #: the measured chain-model quantities
    flops: int = 0  #: forward compute, the cost model's ``c`` (:func:`.flops.layer_compute`)
    backward_flops: int = 0  #: backward compute in the same unit, the cost model's ``cb``
    #: static values the layer also reads (inputs that need no gradient, masks computed from them): held for
    #: the whole step, not checkpoints
    static_inputs: tuple[str, ...] = ()
    #: the side tensors it reads and computes (:class:`ckptopt.costs.SideTensor`)
    side_inputs: tuple[str, ...] = ()
    side_outputs: tuple[str, ...] = ()

    @property
    def op(self) -> str:
        return self.ops[0] if len(self.ops) == 1 else f"{self.ops[0]}..{self.ops[-1]} ({len(self.ops)} ops)"


def measure_layers(fake_gm: fx.GraphModule, fake_mode: Any, groups: list[list[fx.Node]], crossings: Crossings,
                   readable: set[fx.Node], values: dict, placeholders: list[fx.Node], captured: Any,
                   loss_fn: Callable, model_output: Any, single_output: bool, memo: dict | None = None):
    """``(layers, side, grad_store, grad_root, param_owner)``: the measured layers (the loss appended
    when the model returns one tensor), the side tensors (:class:`ckptopt.costs.SideTensor`), per
    layer the bytes of the storage its output gradient lives in and the layer whose output
    gradient that storage is, and which layer creates each parameter's gradient (by parameter
    id: the last that uses it).

    Layers are measured first in order, each with its input held as the layer before it has it.
    Then, last layer first, a layer whose gradients the side tensors show to be arranged otherwise
    (outputs whose gradients are one storage, a gradient handed out as a slice, pending or held
    side gradients) is measured again with them so (:meth:`_Measurer.how`); and once more where the
    side tensors that pass finds change whether its output gradient outlives its backward.
    """
    built, param_owner = build_layers(fake_gm, groups, crossings, readable, values, placeholders, captured,
                                       loss_fn, model_output, single_output)
    # what is static memory already: parameters, buffers, the model's inputs (a side tensor that is a view of
    # one, a buffer's causal mask narrowed to the sequence, adds no bytes of its own)
    static = [*fake_gm.parameters(), *fake_gm.buffers(), *(t for n in placeholders for t in tensor_leaves(values.get(n)))]
    found = _Found(saved={t: set() for t in range(len(crossings.nodes))}, grad={}, view={},
                   grad_by={t: set() for t in range(len(crossings.nodes))},
                   static_keys={storage_identity(t) for t in static})
    m = _Measurer(crossings, values, param_owner, built, found, {} if memo is None else memo)
    with fake_mode, torch.enable_grad():
        for j, b in enumerate(built):
            cost = m.measure(j)
            name = _layer_name(fake_gm, b.members) if captured.front_end == "fx" else _path_name(b.members)
            io = crossings.io[j]
            out_name = (b.output.name if isinstance(b.output, fx.Node) else
                        io.main_out.name if io.main_out is not None and j < len(built) - 1 else "<output>")
            x = [values[b.x_node]] if b.x_node is not None else []
            m.layers.append(Layer(
                index=j, name=name, nodes=tuple(n.name for n in b.members),
                ops=tuple(op_label(fake_gm, n) for n in b.members),
                input_node=b.x_node.name if b.x_node is not None else "", output_node=out_name, costs=cost,
                **m.compute(b, x, [values[n] for n in b.side_in + b.statics]),
                static_inputs=tuple(s.name for s in b.statics), side_inputs=tuple(n.name for n in b.side_in),
                side_outputs=tuple(n.name for n in b.side_out)))
        if single_output:
            m.layers.append(_loss_layer(m.layers, values[model_output], model_output, loss_fn))
        m.update_sides()
        again = False
        for j in reversed(range(len(built))):  # last first: a gradient's layout comes from the layer after
            args = m.how(j)
            read_later = [crossings.consumers[t][-1] > j for t in crossings.io[j].side_in]
            if (args["shared"] or any(args["held"]) or args["layout"] or args["pending"] != read_later
                    or not args["out_grad"] or not all(args["side_out_grad"]) or args["hold_out"]):
                m.measure_again(j, args)
                again = True
        if again:
            m.update_sides()
        # measured with it let go, a layer's release splits do not count an output gradient that outlives
        # its backward, and the gh the model adds for it comes on top of them
        for j in reversed(range(len(built))):
            if _output_grad_outlives(j, m.side, m.grad_root) != m.held_out.get(j, False):
                m.measure_again(j, m.how(j))
                m.update_sides()
    return m.layers, m.side, m.grad_store, m.grad_root, param_owner


def _loss_layer(layers: list[Layer], y: Any, model_output: fx.Node, loss_fn: Callable) -> Layer:
    """The loss as a layer of its own, after a model that returns one tensor."""
    loss = WithLoss(None, loss_fn)
    m = measure_layer(loss, y, keep_input=bool(not layers or layers[-1].costs.sout),
                      static_input=bool(layers and layers[-1].costs.out_static))
    return Layer(index=len(layers), name="loss", nodes=("<loss>",), ops=("loss",), input_node=model_output.name,
                 output_node="<loss>", costs=m, **dict(zip(_COMPUTE, layer_compute(loss, [y]))))


#: Whether layers with equal keys (:func:`~ckptopt.tracer.layer_key.layer_key`) share one measurement; off
#: only to check that sharing changes no figure (tests/test_layer_key.py).
SHARE_MEASUREMENTS = True
_COMPUTE = ("flops", "backward_flops")  # the Layer fields layer_compute's figures go to


class _Measurer:
    """The layers as measured so far, and what their measurements tell about the side tensors."""

    def __init__(self, crossings: Crossings, values: dict, param_owner: dict, built: list, found: "_Found",
                 memo: dict):
        self.crossings, self.values, self.param_owner, self.built, self.found = crossings, values, param_owner, built, found
        self.layers: list[Layer] = []
        self.memo = memo  # layer_key -> LayerMeasurement, and ("flops", layer_key) -> (forward, backward) compute
        self.held_out: dict[int, bool] = {}  # whether each layer was measured with its output gradient held
        self.side: list[SideTensor] = []
        self.grad_store: list[int] = []
        self.grad_root: list[int] = []

    def measure(self, j: int, **args: Any) -> LayerMeasurement:
        """Measure layer ``j`` (its input held as layer ``j - 1`` has it) and note what it tells."""
        previous = self.layers[j - 1].costs if j else None
        m = _measure(j, self.built[j], self.crossings, previous, self.values, self.param_owner, len(self.built),
                     found=self.found, memo=self.memo if SHARE_MEASUREMENTS else None, **args)
        self.found.note(j, self.built[j], self.crossings.io[j], m)  # (as it goes: the release splits as b)
        return m

    def compute(self, b: "Built", x: list, others: list) -> dict:
        """The layer's forward and backward compute (:class:`Layer`'s ``flops``, ``backward_flops``), counted
        once per distinct layer (:func:`layer_key`)."""
        key = b.key(x[0] if x else None, dict(others=others)) if SHARE_MEASUREMENTS else None
        if key is None:
            return dict(zip(_COMPUTE, layer_compute(b.module, x, others)))
        if ("flops", key) not in self.memo:
            self.memo["flops", key] = layer_compute(b.module, x, others)
        return dict(zip(_COMPUTE, self.memo["flops", key]))

    def measure_again(self, j: int, args: dict) -> None:
        self.layers[j] = dataclasses.replace(self.layers[j], costs=self.measure(j, **args))
        self.held_out[j] = args["hold_out"]

    def update_sides(self) -> None:
        self.grad_store, self.grad_root, self.side = _storages_and_sides(self.layers, self.crossings, self.values,
                                                                         self.found)

    def how(self, j: int) -> dict:
        """The keyword arguments of ``_measure`` that say how layer ``j``'s gradients are laid out and held,
        from the side tensors as they stand."""
        io, side = self.crossings.io[j], self.side
        shared = _shared_output_grads(j, io, side, self.grad_store, self.grad_root)
        # a side input is pending when a later consumer's backward adds to its gradient, not when one only
        # reads it (a dead branch, a size): then this layer's contribution is the first, handed out as its
        # backward makes it (a concatenation's slice), not summed out of place
        pending = [any(u > j for u in self.found.grad_by[t]) for t in io.side_in]
        # a side output no later layer hands a gradient (read only by dead ops) gets none
        side_out_grad = tuple(bool(side[t].grad_bytes) for t in io.side_out)
        return dict(shared=shared, held=_held_pending(j, io, side),
                    layout=_out_grad_layout(j, self.layers, self.grad_store), pending=pending,
                    out_grad=_chain_output_gets_a_gradient(j, self.built, self.layers, self.values),
                    side_out_grad=side_out_grad, hold_out=_output_grad_outlives(j, side, self.grad_root),
                    side_layout=_lone_side_grad_layout(j, self.crossings, self.layers, side, shared))


def _measure(j: int, b: Built, crossings: Crossings, previous: LayerMeasurement | None, values: dict,
             param_owner: dict, n_built: int, shared: tuple = (), held: tuple = (),
             layout: tuple | None = None, pending: list[bool] | None = None,
             out_grad: bool = True, side_out_grad: tuple = (), hold_out: bool = False,
             side_layout: tuple | None = None, found: "_Found | None" = None,
             memo: dict | None = None) -> LayerMeasurement:
    """Measure layer ``j`` (:func:`ckptopt.tracer.layer_costs.measure_layer`); ``found``: what the layers
    measured so far showed, which ranks each side input by how likely a plan holds it elsewhere (the
    order its dying gains are given in); ``memo``: measurements by :func:`layer_key`, which a layer like
    one measured before takes instead of being measured."""
    io = crossings.io[j]
    rank = [found._may_be_held(crossings, t, j) for t in io.side_in] if found is not None else []
    x = values[b.x_node] if b.x_node is not None else None
    # a tied or reused weight whose gradient a later layer already created
    existing = [p for p in b.parameters() if p.requires_grad and param_owner[id(p)] > j]
    try:
        # an input the previous layer saves stays alive through this layer's backward, and so does
        # the model input (the caller holds it); measure_layer also gives the figures with the
        # input held by nothing else (bf) and by a checkpoint (bk)
        keep = bool(previous is None or previous.sout)
        kw = dict(input_requires_grad=bool(x is not None and x.requires_grad), grads_exist=existing,
                  leaf_input=bool(x is not None and x.requires_grad and x.is_leaf),
                  static_inputs=[values[s] for s in b.statics])
        if x is None and not io.side_in and not b.statics:  # reads nothing: the device from what it makes
            kw["like"] = next((t for n in b.members for t in tensor_leaves(values.get(n))), None)
        if io.side_in or io.side_out or x is None:
            # a side input whose gradient a later layer already made: pending, summed out of place
            kw.update(side_inputs=[values[n] for n in b.side_in],
                      side_pending=(pending if pending is not None else
                                    [crossings.consumers[t][-1] > j for t in io.side_in]), side_pending_held=held,
                      side_last=[crossings.consumers[t][-1] == j for t in io.side_in],
                      side_outputs=len(io.side_out), main_output=io.main_out is not None or j == n_built - 1,
                      shared_out_grads=shared, side_output_grads=side_out_grad, side_rank=rank)
        kw.update(keep_input=keep, out_grad_layout=layout, main_output_grad=out_grad, hold_out_grad=hold_out,
                  side_out_grad_layout=side_layout, static_input=bool(previous is not None and previous.out_static))
        key = b.key(x, kw) if memo is not None else None
        if key is not None and key in memo:  # a layer like one measured already (a repeated block's)
            return dataclasses.replace(memo[key])
        m = measure_layer(b.module, x, **kw)
        if key is not None:
            memo[key] = m
        return m
    except Exception as exc:
        raise TraceError(
            f"measuring layer {b.members[0].name}..{b.members[-1].name} failed: {type(exc).__name__}: {exc}",
            node=b.members[0].name,
        ) from exc


@dataclass
class _Found:
    """What the layers' measurements tell about the side tensors."""

    saved: dict[int, set[int]]  # side tensor -> the layers that save it
    grad: dict[int, int]  # side tensor -> bytes of its gradient's storage
    view: dict[int, tuple[str, int]]  # side tensor -> ("in"/"out", layer) whose gradient storage it views
    grad_by: dict[int, set[int]]  # side tensor -> the consumers whose backward adds to its gradient
    static_keys: set = dataclasses.field(default_factory=set)  # the storages of the static bytes
    release: dict[tuple[int, int], tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    # (side tensor, saving layer) -> that layer's backward peak (as b) before / from its release
    release_rec: dict[tuple[int, int], tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    # ... in a recomputed segment, where its recomputed copy goes with the last node that read it
    release_free: dict[tuple[int, int], tuple[int, int] | None] = dataclasses.field(default_factory=dict)
    # ... where nothing but the layer's saves holds its chain input (the first layer of an unwrapped segment)
    together: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    # (saving layer, side tensors it lets go at one moment: the same split)
    together_rec: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    together_free: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    last_gain: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # side tensor -> what its last reader's forward peak changes by when it dies at its last use there
    # (to its last saved tensor, in its whole forward, in a checkpoint's first pass; with the reader's input
    # held, then dying too)

    def note(self, j: int, b: Built, io: Any, m: LayerMeasurement) -> None:
        split = []
        none = [None] * len(io.side_in)
        for t, gain, full, ckpt, free in zip(io.side_in, m.side_in_last_gain,
                                             m.side_in_last_gain_full or m.side_in_last_gain,
                                             m.side_in_last_gain_ckpt or [0] * len(io.side_in),
                                             m.side_in_last_gain_free or none):
            free = tuple(free) if free is not None else (gain, full, ckpt)  # (the input dying at its last use too)
            if gain or full or ckpt or any(free):
                self.last_gain[t] = (gain, full, ckpt) + free
        split_rec, split_free = [], []
        for t, saved, rel, rec, free in zip(io.side_in, m.side_in_saved, m.side_in_release or none,
                                            m.side_in_release_rec or m.side_in_release or none,
                                            m.side_in_release_free or m.side_in_release or none):
            if saved:
                self.saved[t].add(j)
                self.release[(t, j)] = rel
                self.release_rec[(t, j)] = rec
                self.release_free[(t, j)] = free
                split += [(t, tuple(rel))] if rel is not None else []
                split_rec += [(t, tuple(rec))] if rec is not None else []
                split_free += [(t, tuple(free))] if free is not None else []
        for t, saved, rel in zip(io.side_out, m.side_out_saved, m.side_out_release or [None] * len(io.side_out)):
            if saved:
                self.saved[t].add(j)
                for release in (self.release, self.release_rec, self.release_free):
                    release[(t, j)] = rel  # (a side output: counted whole, recomputed or not)
                for pairs in (split, split_rec, split_free):
                    pairs += [(t, tuple(rel))] if rel is not None else []
        for pairs, out in ((split, self.together), (split_rec, self.together_rec), (split_free, self.together_free)):
            for rel in {r for _, r in pairs}:
                together = [t for t, r in pairs if r == rel]
                if len(together) > 1:  # (several let go at one moment: side_tensors chains their splits)
                    out.append((j, together))
        for t, gbytes, is_out, shares in zip(io.side_in, m.side_in_grad, m.side_in_grad_is_out,
                                              m.side_in_grad_shares):
            if gbytes is not None:
                self.grad[t] = max(self.grad.get(t, 0), gbytes)
                self.grad_by[t].add(j)  # (a consumer reading only its size adds nothing)
            # its gradient is a view of this layer's output gradient, or of the storage its chain
            # input's gradient lives in (a concatenation's slices, an addition's one gradient); the
            # last consumer's that says so (whatever order the layers are measured, or measured again, in)
            if t in self.view and self.view[t][1] > j:
                continue
            if shares == "main" and b.x_node is not None and j > 0:
                self.view[t] = ("in", j)
            elif is_out:
                self.view[t] = ("out", j)

    def side_tensors(self, crossings: Crossings, values: dict, grad_store: list[int],
                     grad_root: list[int]) -> list[SideTensor]:
        self._chain_splits(crossings, values)
        side = []
        for t, node in enumerate(crossings.nodes):
            v = values[node]
            # a view of static memory (a buffer, a parameter, an input) holds no storage of its own: the
            # static bytes count it, as a chain output's a is 0 there
            size = 0 if storage_identity(v) in self.static_keys else storage_nbytes(v)
            own = v.numel() * v.element_size()  # its gradient's size (a view's: less than its storage)
            grad = self.grad.get(t, own) if v.requires_grad else 0
            view = -1
            if grad and t in self.view:  # one storage with a chain gradient: counted once
                kind, u = self.view[t]
                k = u - 1 if kind == "in" else u  # the layer whose output gradient that storage holds
                view = grad_root[k]
                grad = max(grad, grad_store[k])
            gby = tuple(sorted(self.grad_by[t]))
            if not gby:  # no consumer adds to its gradient
                grad, view = 0, -1
            savers = tuple(sorted(self.saved[t]))
            # each saver's backward peak before and after its saved reference goes (the last saver
            # to let go frees it mid-backward, before the gradients it makes are summed in)
            rel = [self.release.get((t, u)) for u in savers]
            pre, post = ((tuple(int(r[0]) for r in rel), tuple(int(r[1]) for r in rel))
                         if savers and all(r is not None for r in rel) else ((), ()))
            rec = [self.release_rec.get((t, u)) for u in savers]
            pre_r, post_r = ((tuple(int(r[0]) for r in rec), tuple(int(r[1]) for r in rec))
                             if pre and all(r is not None for r in rec) else ((), ()))
            if (pre_r, post_r) == (pre, post):
                pre_r, post_r = (), ()
            gains = self.last_gain.get(t, (0, None, 0))
            # (with the reader's input dying at its last use too: None where the same)
            free_gains = [None if len(gains) < 6 or g == h else g for g, h in zip(gains[3:] or (0, 0, 0), gains)]
            free = [self.release_free.get((t, u)) for u in savers]
            pre_f, post_f = ((tuple(int(r[0]) for r in free), tuple(int(r[1]) for r in free))
                             if pre and all(r is not None for r in free) else ((), ()))
            if (pre_f, post_f) == (pre, post):
                pre_f, post_f = (), ()
            side.append(SideTensor(size, crossings.producer[t], crossings.consumers[t], saved_by=savers,
                                   grad=max(grad, own) if grad else 0, name=node.name, grad_view=view,
                                   saved_pre=pre, saved_post=post,
                                   grad_by=gby if gby != tuple(crossings.consumers[t]) else (),
                                   last_gain=gains[0], last_gain_full=gains[1], saved_pre_rec=pre_r, saved_post_rec=post_r, last_gain_ckpt=gains[2],
                                   last_gain_free=free_gains[0], last_gain_full_free=free_gains[1],
                                   last_gain_ckpt_free=free_gains[2],
                                   saved_pre_free=pre_f, saved_post_free=post_f))
        return side


    def _chain_splits(self, crossings: Crossings, values: dict) -> None:
        """Side tensors a layer lets go at one moment (a product saves both operands): each split is
        measured with the others held throughout, and the simulator adds them one by one
        (``max(pre + x, post)`` each), but before that moment all of them are live: priced apart, each
        split would count its own bytes only. So the k-th adds ``f(x_1 + .. + x_k) - f(x_1 + .. + x_k-1)``,
        ``f(x) = max(pre + x, post)`` (its split's ``pre`` raised by the ones before it): all held, exactly
        theirs together; some not held by the segment, at least their own (``f`` is convex), never under.
        Chained in the order of :meth:`_may_be_held`: one an earlier segment holds (in a checkpoint's
        frame) is in the bytes already and would be counted again by every member after it; last in the
        chain, it is skipped and the others are exact. ``tests/common/regressions.py`` cases
        ``two-sides-let-go-together`` and ``held-operand-last-in-the-release-chain``."""
        for together, release in ((self.together, self.release), (self.together_rec, self.release_rec),
                                  (self.together_free, self.release_free)):
            for j, members in together:
                pre, post = release[(members[0], j)]
                before = 0
                # the ones an earlier segment may hold (a reader before j, or the producer saves it) last:
                # held, one is in the bytes already, and those after it in the chain would count it again
                for t in sorted(members, key=lambda t, j=j: self._may_be_held(crossings, t, j)):
                    release[(t, j)] = (pre + before, post)
                    before += storage_nbytes(values[crossings.nodes[t]])
        self.together, self.together_rec, self.together_free = [], [], []

    def _may_be_held(self, crossings: Crossings, t: int, j: int) -> tuple:
        """How likely side tensor ``t`` is held by a segment before layer ``j``'s (its chain order)."""
        early = sum(1 for u in crossings.consumers[t] if u < j)
        return early + (crossings.producer[t] in self.saved[t]), -crossings.producer[t]


def _merge_early(groups: dict[tuple, list], n: int) -> dict[tuple, list]:
    """``groups`` ((readers, savers) -> members) merged into :data:`MAX_EARLY`, those held over the most
    similar stretch of the step together: a merged group is held while any part is, so each merge
    over-counts a part's bytes for the stretch the other adds. A group whose readers run from layer
    ``lo`` to ``hi`` is held through the forward up to ``hi`` and, kept by a layer that saves it or by a
    checkpoint's frame, through the backward down to ``lo``: about ``hi + n - lo`` layers. Merged
    greedily, the pair whose union over-counts least first: an encoder-decoder's encoder mask, read by
    the encoder layers, stays apart from the decoder's masks, read by the decoder layers; one group of
    all three would hold the decoder's through the backward of the first encoder layer, where such a
    plan peaks (``tests/test_hf.py::test_encoder_decoder_masks_are_held_each_for_its_own_stack``)."""
    parts = [[key[0], key[1], sum(b for _, b, _ in members), members, False] for key, members in groups.items()]

    def span(readers) -> int:
        return max(readers) + n - min(readers)

    def cost(a, b) -> int:
        both = span(a[0] + b[0])
        return a[2] * (both - span(a[0])) + b[2] * (both - span(b[0]))

    while len(parts) > MAX_EARLY:
        _, i, j = min((cost(parts[i], parts[j]), i, j) for i in range(len(parts)) for j in range(i + 1, len(parts)))
        a, b = parts[i], parts.pop(j)
        parts[i] = [tuple(sorted({*a[0], *b[0]})), tuple(sorted({*a[1], *b[1]})), a[2] + b[2], a[3] + b[3], True]
    out: dict[tuple, list] = {}
    for readers, savers, _, members, merged in parts:
        # (a merged group keeps no release moments: it is held until its last saver's backward ends)
        out.setdefault((readers, savers), []).extend([(m, b, []) for m, b, _ in members] if merged else members)
    return out


def hoisted_side_tensors(hoisted: list[fx.Node], layers: list[Layer], values: dict, out_node: fx.Node,
                         free: list) -> tuple[list[SideTensor], list[fx.Node]]:
    """``(side tensors, still static)`` for the hoisted static values (masks, rotary tables): those
    the layers read become side tensors made before the first layer (producer -1, no gradient),
    read by those layers and saved by those that save them; grouped by (readers, savers), merged
    into :data:`MAX_EARLY` groups beyond that, those held over similar stretches together
    (:func:`_merge_early`; a merged group is held while any part is: over, never under). A value the
    model's output returns, or one sharing a storage with an input or a parameter (a view of it),
    stays static."""
    import torch

    free_storages = [t for t in free if isinstance(t, torch.Tensor)]
    still = []
    # one entry per storage (views of one table, read by several layers, are one tensor)
    by_storage: list[list] = []  # [value, nodes, readers, savers, releases]
    for node in hoisted:
        v = values.get(node)
        readers = [j for j, l in enumerate(layers) if node.name in l.static_inputs]
        if (not isinstance(v, torch.Tensor) or not readers or node in out_node.all_input_nodes
                or any(u is out_node for u in node.users)
                or any(torch._C._is_alias_of(v, t) for t in free_storages)):
            still.append(node)
            continue
        savers, rel = [], {}
        for j in readers:
            k = layers[j].static_inputs.index(node.name)
            m = layers[j].costs
            if k < len(m.static_in_saved) and m.static_in_saved[k]:
                savers.append(j)
                rel[j] = m.static_in_release[k] if k < len(m.static_in_release) else None
        entry = next((e for e in by_storage if e[0] is v or torch._C._is_alias_of(e[0], v)), None)
        if entry is None:
            by_storage.append([v, [node], set(readers), set(savers), rel])
        else:
            entry[1].append(node)
            entry[2] |= set(readers)
            entry[3] |= set(savers)
            entry[4] = {j: (r if j not in entry[4] else None) for j, r in {**entry[4], **rel}.items()}
    groups: dict[tuple, list] = {}
    for v, nodes, readers, savers, rel in by_storage:
        key = (tuple(sorted(readers)), tuple(sorted(savers)))
        groups.setdefault(key, []).append((nodes[0], storage_nbytes(v), [rel.get(j) for j in key[1]]))
    if len(groups) > MAX_EARLY:
        groups = _merge_early(groups, len(layers))
    out = []
    for (readers, savers), members in groups.items():
        size = sum(b for _, b, _ in members)
        pre = post = ()
        if len(members) == 1 and savers and all(r is not None for r in members[0][2]):
            pre = tuple(int(r[0]) for r in members[0][2])
            post = tuple(int(r[1]) for r in members[0][2])
        name = members[0][0].name + (f" (+{len(members) - 1})" if len(members) > 1 else "")
        out.append(SideTensor(int(size), -1, readers, saved_by=savers, grad=0, name=name, saved_pre=pre,
                              saved_post=post))
    return out, still


def _storages_and_sides(layers: list[Layer], crossings: Crossings, values: dict,
                        found: "_Found") -> tuple[list[int], list[int], list[SideTensor]]:
    """``(grad_store, grad_root, side)``: :func:`_grad_storages` and the side tensors, with views of
    views followed to the storage they share. A layer whose only output is a side tensor (no chain
    tensor leaves it) has that tensor's gradient as its output gradient: when that gradient is a
    view of a later layer's output gradient (a concatenation's slice), so are the views this
    layer's backward hands out (a concatenation of concatenations: RoCBert's embeddings), and the
    storage is the later one's, counted once and held until the last view goes. (A side tensor
    several consumers add to has a storage of its own by then: the sum.)"""
    via: dict[int, int] = {}
    own: dict[int, int] = {}
    for _ in range(len(layers) + 1):
        grad_store, grad_root = _grad_storages(layers, via, own)
        side = found.side_tensors(crossings, values, grad_store, grad_root)
        nxt, nxt_own = {}, {}
        for j, io in enumerate(crossings.io):
            if j >= len(layers):
                continue
            # one side output and no chain output, or a chain output no gradient reaches beside one side
            # output a gradient reaches
            reached = [t for t in io.side_out if side[t].grad_bytes]
            lone = (len(io.side_out) == 1 if io.main_out is None else
                    layers[j].costs.a > 0 and layers[j].costs.ga == 0 and len(reached) == 1)
            if lone:
                t = side[io.side_out[0] if io.main_out is None else reached[0]]
                if t.grad_view > j and t.grad_bytes and t.grad_split == j:  # (still a view at j: no sum)
                    nxt[j] = t.grad_view
                elif t.grad_bytes:  # (a storage of its own: the sum of its consumers' contributions)
                    nxt_own[j] = t.grad_storage(j)[1]
        if nxt == via and nxt_own == own:
            return grad_store, grad_root, side
        via, own = nxt, nxt_own
    raise AssertionError("gradient storages did not settle")  # (each round only moves roots later)


def _grad_storages(layers: list[Layer], via: dict[int, int] | None = None,
                   own: dict[int, int] | None = None) -> tuple[list[int], list[int]]:
    """Per layer, the bytes of the storage its output gradient lives in and the layer whose output
    gradient that storage is: a view of a larger tensor when the next layer's backward hands out a
    slice (a concatenation's), kept whole while the layer runs. ``via`` maps a layer whose output
    gradient is a view of a later layer's (through a side tensor) to that later layer; ``own`` a
    layer whose only output is a side tensor with a gradient storage of its own (the sum of its
    consumers' contributions) to that storage's bytes: a slice of it that the layer's backward hands
    on is the previous layer's output gradient (the side terms count the storage up to here)."""
    grad_store = [l.costs.a if l.costs.ga is None else l.costs.ga for l in layers]
    grad_root = list(range(len(layers)))
    for i in range(len(layers) - 1, -1, -1):
        if via and i in via:
            grad_store[i] = max(grad_store[i], grad_store[via[i]])
            grad_root[i] = grad_root[via[i]]
        m = layers[i].costs
        if i == 0 or not layers[i].input_node or layers[i - 1].costs.a == 0:
            continue
        if m.gin_is_out and own and i in own and not layers[i].costs.a:
            grad_store[i - 1] = max(grad_store[i - 1], own[i])
        elif m.gin_is_out:
            grad_store[i - 1] = max(grad_store[i - 1], grad_store[i])
            grad_root[i - 1] = grad_root[i]
        elif m.gin is not None:
            grad_store[i - 1] = max(grad_store[i - 1], m.gin)
    return grad_store, grad_root


def _shared_output_grads(j: int, io: Any, side: list[SideTensor], grad_store: list[int],
                         grad_root: list[int]) -> tuple:
    """Groups of layer ``j``'s outputs (0 the chain output, then its side outputs) whose gradients are
    one storage when its backward runs, with that storage's bytes: groups of two or more, a side
    output alone whose gradient is a slice of a larger storage, and a layer's only output (a side
    tensor) whose gradient views a later layer's output-gradient storage (its ``g``).

    A group may also hold ``("in", k)``: side input ``k``, whose gradient a later consumer already
    made as a view of that same storage (a concatenation after layer ``j`` hands a slice to its
    output and one to the side tensor, and layer ``j`` adds the next contribution, ``grad_split``):
    the storage then lives until layer ``j``'s contribution is summed in, not only while its own
    output gradient is used."""
    keys: list[tuple] = [("view", grad_root[j])] if io.main_out is not None else []
    keys += [side[t].grad_storage(j)[0] if side[t].grad_bytes else ("none", t) for t in io.side_out]
    groups: dict[tuple, list] = {}
    for k, key in enumerate(keys):
        groups.setdefault(key, []).append(k)
    for k, t in enumerate(io.side_in):
        st = side[t]
        if st.grad_bytes and st.grad_view >= 0 and st.grad_split == j and st.grad_last > j:
            key = st.grad_storage(j)[0]
            if key[0] == "view" and key in groups:  # (one of its outputs' gradients views it too)
                groups[key].append(("in", k))
    out = []
    for key, members in groups.items():
        if len(members) > 1 and key[0] == "view":
            sizes = [grad_store[key[1]]] + [side[t].grad_bytes for t in io.side_out]
            sizes += [side[io.side_in[m[1]]].grad_bytes for m in members if isinstance(m, tuple)]
            out.append((tuple(members), max(sizes)))
        elif key[0] == "view" and (members[0] > 0 or io.main_out is None):
            # one side output whose gradient is a slice of a larger storage (a concatenation's
            # gradient): handed out as that slice, so the whole storage is live while it is; a
            # layer's only output is handed out so at any size, its rg then taken relative to it
            t = io.side_out[members[0] - (1 if io.main_out is not None else 0)]
            nbytes = max(grad_store[key[1]], side[t].grad_bytes)
            if nbytes > side[t].bytes or len(keys) == 1:  # (a lone output: a view of the chain gradient,
                out.append((tuple(members), nbytes))      # which g counts, as the chain output's is)
    return tuple(out)


def _lone_side_grad_layout(j: int, crossings: Crossings, layers: list[Layer], side: list[SideTensor],
                           shared: tuple) -> tuple | None:
    """``(nbytes, stride, offset)`` of the gradient of layer ``j``'s one side output measured as a slice of
    a larger storage (``shared``), when the layer that hands it out (its ``grad_view``) records a
    layout: a concatenation along channels hands out a strided slice, which a normalization's backward
    (GroupNorm's) copies before reading, a copy a contiguous slice would not show. None otherwise
    (``tests/common/regressions.py`` case ``lone-side-output-gradient-strided``)."""
    io = crossings.io[j]
    k0 = 1 if io.main_out is not None else 0
    for members, nbytes in shared:
        outs = [k for k in members if not isinstance(k, tuple)]
        if len(outs) != 1 or outs[0] < k0:
            continue
        t = io.side_out[outs[0] - k0]
        # the layer whose storage it views, or the last that adds to it, which may pass that view on (an
        # addition after a concatenation hands on its strided slice; tests/common/regressions.py case
        # gradient-slice-through-an-addition)
        for u in (side[t].grad_view, side[t].grad_last):
            if u <= j or u >= len(layers) or t not in crossings.io[u].side_in:
                continue
            lay = layers[u].costs.side_in_grad_layout
            k = crossings.io[u].side_in.index(t)
            if k < len(lay) and lay[k] is not None:
                return (int(nbytes), tuple(lay[k][0]), int(lay[k][1]))
    return None


def _output_grad_outlives(j: int, side: list[SideTensor], grad_root: list[int]) -> bool:
    """Layer ``j``'s output gradient storage outlives its backward: a side tensor's gradient views it
    (an addition or a concatenation after it hands out the same storage) and is summed at an earlier
    layer (``ckptopt.sides.SideArrays.build``, which adds ``gh`` for it). Such a layer is measured with
    that gradient held to its backward's end, so ``b`` and the release splits count it where the
    backward has it: ``gh``, taken from a run that lets it go, would price it with every side input
    still held, where the model releases one the layer saves earlier (``tests/common/regressions.py``
    case ``output-gradient-outlives-the-backward``)."""
    key = ("view", int(grad_root[j]))
    return any(t.grad_bytes and t.producer <= j < t.grad_last and j > t.grad_split and t.grad_storage(j)[0] == key
               for t in side)


def _chain_output_gets_a_gradient(j: int, built: list, layers: list[Layer], values: dict) -> bool:
    """False when layer ``j``'s chain output requires grad but the next layer's backward hands it none
    (it reads it only in ops no output depends on: a dead op beside the ops that read a side tensor).
    Such a layer is measured with none injected: an injected gradient would be summed with the one its
    side outputs bring, and ``g`` would count a gradient the model never makes
    (``tests/common/regressions.py`` case ``no-gradient-reaches-the-chain-output``)."""
    if j + 1 >= len(built) or j + 1 >= len(layers) or not layers[j].costs.a:
        return True
    x_node = built[j + 1].x_node
    x = values.get(x_node) if x_node is not None else None
    return not (isinstance(x, torch.Tensor) and x.requires_grad and layers[j + 1].costs.gin is None)


def _out_grad_layout(j: int, layers: list[Layer], grad_store: list[int]) -> tuple | None:
    """``(nbytes, stride, offset)`` of layer ``j``'s output gradient when the next layer's backward hands
    it a slice of a larger storage (a concatenation's, not contiguous when the slice is along a
    later dimension: an op that needs it contiguous copies it); None otherwise."""
    if j + 1 >= len(layers) or not layers[j].costs.a:
        return None
    nxt = layers[j + 1]
    m = nxt.costs
    if not nxt.input_node or m.gin_layout is None:  # (a slice of its output gradient, or of one made inside it)
        return None
    return (int(grad_store[j]), tuple(m.gin_layout[0]), int(m.gin_layout[1]))


def _held_pending(j: int, io: Any, side: list[SideTensor]) -> tuple[bool, ...]:
    """Per side input of layer ``j``: its gradient, pending when ``j``'s backward runs, is a view of a
    storage that another side tensor's gradient still views after ``j`` sums its contribution in (an
    addition later on hands one gradient to several tensors): the storage outlives that sum."""
    out = []
    for t in io.side_in:
        st = side[t]
        held = False
        if st.grad_bytes and st.grad_view >= 0 and st.grad_split == j < st.grad_last:
            held = any(u != t and side[u].grad_bytes and side[u].grad_view == st.grad_view
                       and side[u].grad_split < j < side[u].grad_last for u in range(len(side)))
        out.append(held)
    return tuple(out)


def _layer_name(gm: fx.GraphModule, members: list[fx.Node]) -> str:
    mods = [str(n.target) for n in members if n.op == "call_module"]
    if mods:
        prefix = _common_prefix(mods)
        if prefix and len(mods) > 1:
            return prefix
        return mods[0] if len(mods) == 1 and len(members) <= 2 else f"{mods[0]}..{mods[-1]}" if len(mods) > 1 else mods[0]
    return members[0].name if len(members) == 1 else f"{members[0].name}..{members[-1].name}"


def _path_name(members: list[fx.Node]) -> str:
    """A layer's name from the module paths its nodes ran in (op-level graphs): the deepest
    module holding all of them (``model.layers.3``), with the first and last of its children
    the layer covers when that module is split over several layers (``transformer.h.0 (ln_2..mlp)``);
    a layer of root-level ops is named after them (its loss, when it computes one)."""
    paths = [p for p in (module_path(n) for n in members) if p]
    if not paths:
        last = members[-1].name
        return f"loss ({last})" if "loss" in last else (
            last if len(members) == 1 else f"{members[0].name}..{last}")
    distinct = list(dict.fromkeys(paths))
    # glue ops of an enclosing module (a residual add in the block itself) do not name the layer
    paths = [p for p in distinct if not any(q.startswith(p + ".") for q in distinct)]
    prefix = _common_prefix(paths)
    if len(paths) == 1:
        return paths[0]
    depth = len(prefix.split(".")) if prefix else 0
    children = list(dict.fromkeys(p.split(".")[depth] for p in paths))
    inner = children[0] if len(children) == 1 else f"{children[0]}..{children[-1]}"
    return f"{prefix} ({inner})" if prefix else inner


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    out = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return ".".join(out)


