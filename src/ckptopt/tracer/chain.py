"""The tracer's entry point: a model becomes a chain of measured layers and its cost model.

Stages (a file each)::

    model --capture--------> fx.GraphModule   (opaque leaves where FX fails)
          --propagate------> fake value per node (no activation memory)
          --cuts-----------> candidate cuts; the layers between them
          --layer_costs----> LayerMeasurement per layer (fake tensors)
          --> ChainCosts

Each layer runs forward and backward once in isolation under ``FakeTensorMode``:
the storage tracker counts fake storages exactly as it counts real ones, and a
``saved_tensors_hooks`` pack hook tells which storages autograd keeps. No
activation is ever allocated, so a model that needs tens of GB to train traces
in a few MB.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn

from ..costs import ChainCosts
from ..errors import TraceError
from ..fake import fake_copy
from ..torch_utils import (Inputs, default_loss, distinct_storages, normalize_inputs, storage_identity, storage_nbytes,
                           tensor_leaves)
from .capture import Captured, check_capture_mode, module_path
from .capture import capture as capture_graph
from ..solvers.limits import SIDE_AUTO_MAX_WORK
from ..solvers.side_tensors import solves_within
from .cuts import MAX_CROSSING, SIDE_AUTO_MAX_N, candidate_groups
from .meta import unmaterialized
from .side_tensors import find_crossings, merge_aliased, merge_outputless
from .layer_run import reachable
from .layers import Layer, hoisted_side_tensors, measure_layers
from .propagate import FakeRecorder, autocast_cache_bytes
from .statics import param_views, place_statics, static_nodes

__all__ = ["trace", "TracedModel", "Layer"]


@dataclass
class TracedModel:
    """What :func:`trace` returns.

    Attributes
    ----------
    gm : torch.fx.GraphModule
        The traced model; it shares parameters and buffers with the original.
    graph : networkx.DiGraph
        One vertex per FX node (attributes ``op``, ``target``, ``bytes``,
        ``shape``, ``dtype``), one edge per use.
    layers : list of Layer
        The chain handed to the solvers, in order; the last is the loss when
        the model returns one tensor.
    costs : ChainCosts
        The full-form cost model of that chain (static = parameters, buffers
        and inputs).
    opaque_modules : dict
        Submodules traced as one opaque layer because FX could not trace
        into them, with the reason.
    input_bytes, param_bytes, buffer_bytes : int
    example_shapes : tuple
        Shapes of the example's tensors.
    loss_fn : callable
    capture : Captured
        What the capture stage returned: the front end, how to bind a call to
        the graph and how to rebuild the model's output.
    hoisted : tuple of str
        Static graph nodes computed once before the first layer (counted in
        the static bytes; :mod:`ckptopt.tracer.statics`).
    constants : dict
        Node name -> the non-tensor value it had (sizes, flags), to rebuild a layer.
    tensor_meta : dict
        Node name -> ``(shape, dtype, requires_grad)`` of every layer input, to run a
        layer alone on a device (:mod:`ckptopt.calibration`).
    calibration : Calibration or None
        Set when ``costs`` were calibrated on the device (:mod:`ckptopt.calibration`).
    max_crossing : int
        The most tensors a cut may be crossed by (:func:`trace`); re-tracing at other
        shapes uses the same.
    """

    gm: fx.GraphModule
    graph: nx.DiGraph
    layers: list[Layer]
    costs: ChainCosts
    opaque_modules: dict[str, str]
    input_bytes: int
    param_bytes: int
    buffer_bytes: int
    example_shapes: tuple
    loss_fn: Callable | None = None
    capture: Captured | None = None
    hoisted: tuple[str, ...] = ()
    constants: dict = dataclasses.field(default_factory=dict)
    tensor_meta: dict = dataclasses.field(default_factory=dict)
    calibration: Any = None
    max_crossing: int = MAX_CROSSING

    @property
    def n(self) -> int:
        return len(self.layers)

    @property
    def flops(self) -> list[int]:
        """Forward FLOPs of every layer."""
        return [l.flops for l in self.layers]


def check_model_and_inputs(model, example_inputs) -> Inputs:
    """The normalized inputs, once model and inputs are checked (a module, trainable, one device)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"trace() needs an nn.Module, got {type(model).__name__}; pass the model itself "
            "(not model.parameters() or a function)"
        )
    inputs = normalize_inputs(example_inputs)
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"{type(model).__name__} has no parameters that require grad, so a training step has no "
            "backward pass to plan; unfreeze some parameters (p.requires_grad_(True)) first"
        )
    # (the meta device holds nothing: a meta model is planned on its batch's device, tracer/meta.py)
    meta_model = bool(params) and all(p.is_meta for p in params)
    devices = {t.device for t in inputs.tensors() + params if not (meta_model and t.is_meta)}
    if len(devices) > 1:
        raise ValueError(
            f"the model and its example inputs are on different devices ({', '.join(sorted(map(str, devices)))}); "
            "move them to one device first, e.g. model.to(dev) and x.to(dev)"
        )
    return inputs


def trace(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable | None = None,
    leaf_modules: Iterable[str | type] | None = None,
    capture: str = "auto",
    max_crossing: int | None = None,
) -> TracedModel:
    """Trace ``model`` into a chain cost model without allocating activations.

    Parameters
    ----------
    model : nn.Module
        In the mode it will train in (``model.train()``).
    example_inputs : Tensor, tuple or dict
        One training batch as the model is called: a tensor, a tuple of positional
        arguments, or a dict of keyword arguments (``model(**batch)``, as
        HuggingFace collators yield). Non-tensor values (None, flags) are allowed.
        Only shapes and dtypes are used.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar``; default: the output's ``loss`` when it has
        one (HuggingFace models given ``labels``), else ``output.float().pow(2).mean()``
        summed over tensor outputs (what :func:`ckptopt.measure_peak` uses).
    leaf_modules : iterable of str or type, optional
        Submodules (by qualified name, e.g. ``"transformer.h.0"``, or by
        class) to treat as one opaque layer each (``torch.fx`` capture).
        Submodules FX cannot trace are made opaque automatically; this is the
        explicit override.
    capture : str, default "auto"
        ``"fx"`` (``torch.fx`` symbolic tracing), ``"export"`` (``torch.export``,
        non-strict) or ``"auto"``: FX, and export when FX cannot trace the model
        (:mod:`ckptopt.tracer.capture`).
    max_crossing : int, optional
        A cut is offered where at most this many tensors computed before it are read
        after it (docs/design.md §4): the chain tensor and up to ``max_crossing - 1``
        side tensors (an encoder output read by every decoder layer, a skip connection,
        a second tower's input). 1 gives the single-tensor chain. Default: 8, halved (4, 2,
        1) while the model would have more than 1,000 layers or a trial run of the exact
        side-tensor program on its costs does not finish within ``SIDE_AUTO_MAX_WORK``
        (about 2 s; it can take minutes where nothing prunes; ``capture.notes`` says so).

    Returns
    -------
    TracedModel

    Raises
    ------
    TraceError
        The model cannot be captured (the message names the construct and what
        to try), or a layer cannot be measured.
    TypeError, ValueError
        Bad model or inputs (not a Module, no trainable parameters, mixed
        devices, inputs the model rejects).

    Notes
    -----
    Model inputs that need no gradient are static memory (the caller holds the
    batch): any layer may read them. Under an active ``torch.autocast`` context
    the layers are measured as they run under it (bf16/fp16 activations where
    autocast casts), and the weight copies autocast caches for the step count as
    static memory (the figures assume backward runs inside the same autocast
    context, as :func:`ckptopt.measure_peak` does; with backward outside it the
    cache is dropped earlier and the prediction errs high by at most that amount).
    """
    check_capture_mode(capture)
    if max_crossing is not None and (isinstance(max_crossing, bool) or not isinstance(max_crossing, int)
                                     or max_crossing < 1):
        raise ValueError(f"max_crossing must be an integer >= 1 (1: single-tensor cuts only), got {max_crossing!r}")
    inputs = check_model_and_inputs(model, example_inputs)
    model, inputs = unmaterialized(model, inputs)  # meta tensors: fakes on a real device
    captured = capture_graph(model, inputs, capture, leaf_modules)
    return trace_captured(model, captured, inputs, loss_fn, max_crossing)


def trace_captured(model: nn.Module, captured: Captured, example_inputs: Any,
                   loss_fn: Callable | None = None, max_crossing: int | None = None) -> TracedModel:
    """The cost model of an already captured graph at these inputs' shapes (no new capture):
    what :func:`trace` runs after its capture stage, and what re-prices a plan at other shapes."""
    inputs = normalize_inputs(example_inputs)
    loss_fn = loss_fn or default_loss
    gm = captured.gm
    flat = captured.bind(inputs)
    if flat is None:
        takes = ", ".join(n.target for n in captured.placeholders)
        given = [f"{len(inputs.args)} positional"] + [f"{k}=" for k in inputs.kwargs]
        raise TypeError(f"example_inputs do not fit {type(model).__name__}.forward: it takes ({takes}), got "
                        f"{', '.join(given)}; pass the batch as the model is called in training")
    fake = fake_copy(gm, Inputs(tuple(flat)))
    fake_gm, fake_mode = fake.model, fake.mode
    rec = FakeRecorder(fake_gm)
    with fake_mode, torch.enable_grad():
        out = rec.run(*fake.inputs.args)
        trained = _trained_parameters(out, captured, loss_fn)
    values = dict(rec.values)  # keyed by the nodes of fake_gm
    cast_cache_bytes = autocast_cache_bytes(fake_gm, fake.inputs, fake_mode)
    if not any(t.requires_grad for t in tensor_leaves(out)):
        raise ValueError(
            "the model's output does not require grad on these inputs (no trainable parameter reaches it); "
            "nothing to checkpoint"
        )

    # static values: model inputs needing no gradient; on op-level (export) graphs also what is
    # computed from them alone, hoisted before the first layer when read by several layers
    placeholders = [n for n in fake_gm.graph.nodes if n.op == "placeholder"]
    derived = captured.front_end != "fx"
    static = static_nodes(fake_gm, values) if derived else {n for n in placeholders
                                                           if not any(t.requires_grad for t in tensor_leaves(values.get(n)))}
    static |= param_views(fake_gm, values)  # (a weight's transpose: the parameter's storage, placed like a static)
    out_node = next(n for n in fake_gm.graph.nodes if n.op == "output")

    def layer_groups(crossing: int):
        groups = candidate_groups(fake_gm, values, static, crossing)
        hoisted: list[fx.Node] = []
        if derived or any(n.op != "placeholder" for n in static):
            groups, hoisted = place_statics(groups, static, values)
        groups = [g for g in groups if g]  # (empty: made only of hoisted or moved nodes)
        # op-level graphs: assertions and same-dtype casts between blocks are no layers
        groups = merge_aliased(groups, static, values, out_node, always=derived)
        groups = merge_outputless(groups, static, values, out_node)
        return groups, hoisted

    param_bytes = sum(storage_nbytes(p) for p in distinct_storages(model.parameters()))
    buffer_bytes = sum(storage_nbytes(b) for b in distinct_storages(model.buffers()))
    input_bytes = sum(storage_nbytes(t) for t in distinct_storages(inputs.tensors()))

    def _build_costs(groups, hoisted):
        """(layers, costs) of one grouping: the layers measured, the side tensors found."""
        readable = {n for n in static if n.op == "placeholder" or n in set(hoisted)}
        crossings = find_crossings(groups, static, values, out_node)

        model_output = out_node.args[0]
        single_output = isinstance(model_output, fx.Node) and isinstance(values.get(model_output), torch.Tensor)

        layers, side, grad_store, grad_root, param_owner = measure_layers(
            fake_gm, fake_mode, groups, crossings, readable, values, placeholders, captured, loss_fn, model_output,
            single_output)
        # gradient bytes of the parameters, charged to the last layer that uses them (tied weights once);
        # a frozen parameter (a LoRA base weight) gets none
        fake_params = {id(p): p for p in fake_gm.parameters() if p.requires_grad}
        p_bytes = [0] * len(layers)
        for pid, j in param_owner.items():
            # (a parameter the loss does not reach gets no gradient: a head whose output is returned
            # beside the loss, SigLIP's attention pooling under image classification)
            p_bytes[j] += storage_nbytes(fake_params[pid]) if pid in fake_params and (
                trained is None or pid in trained) else 0
        fake_in = [t for n in placeholders for t in tensor_leaves(values.get(n))]
        kept = [n for n in hoisted if any(u not in set(hoisted) for u in n.users)]  # the rest die in the prefix
        # hoisted values the layers read live as side tensors made before the first layer (held while a
        # layer that saves them, or a checkpoint's frame, does: not for the whole step); the rest (read
        # by the model's output) stay static
        early, kept = hoisted_side_tensors(kept, layers, values, out_node,
                                           fake_in + list(fake_gm.parameters()) + list(fake_gm.buffers()))
        side = list(side) + early
        hoisted_tensors = [t for n in kept for t in tensor_leaves(values.get(n))]
        fake_in = fake_in + list(fake_gm.parameters()) + list(fake_gm.buffers())  # (a hoisted weight view is free)
        hoisted_bytes = (sum(storage_nbytes(t) for t in distinct_storages(fake_in + hoisted_tensors))
                         - sum(storage_nbytes(t) for t in distinct_storages(fake_in)))
        # the prefix's own high point (ProphetNet builds 20 MB of relative-position buckets to keep a
        # few): no layer runs then, so layer 0's forward transient carries what exceeds the values kept
        f0 = [l.costs.f for l in layers]
        ff = [l.costs.f if l.costs.ff is None else l.costs.ff for l in layers]
        fc = [l.costs.f if l.costs.fc is None else l.costs.fc for l in layers]  # (a checkpoint's first pass)
        ffc = [f if l.costs.ffc is None else l.costs.ffc for f, l in zip(ff, layers)]
        if hoisted and f0:
            f0[0] = max(f0[0], _prefix_peak(hoisted, values, fake_in) - hoisted_bytes
                        - sum(t.bytes for t in early))
            ff[0] = max(ff[0], f0[0])
            fc[0] = max(fc[0], f0[0])
            ffc[0] = max(ffc[0], f0[0])
        rg = _rg(layers, side, grad_root, grad_store)
        br = [l.costs.b if l.costs.br is None else l.costs.br for l in layers]
        bkr = [(l.costs.b if l.costs.bk is None else l.costs.bk) if l.costs.bkr is None else l.costs.bkr
               for l in layers]
        costs = ChainCosts(
            a=[l.costs.a for l in layers], p=p_bytes, sin=[l.costs.sin for l in layers],
            sout=[l.costs.sout for l in layers], m=[l.costs.m for l in layers], f=f0, ff=ff, fc=fc, ffc=ffc,
            ffs=[l.costs.fs if l.costs.ffs is None else l.costs.ffs for l in layers],
            b=[l.costs.b for l in layers], fs=[l.costs.fs for l in layers], rg=rg,
            bk=[l.costs.b if l.costs.bk is None else l.costs.bk for l in layers],
            bf=[l.costs.b if l.costs.bf is None else l.costs.bf for l in layers],
            br=br, bkr=bkr,
            # a checkpointed segment's last saving layer: its backward before and from its first read of
            # a saved tensor (the recomputation runs between)
            brt=[x if l.costs.brt is None else l.costs.brt for x, l in zip(br, layers)],
            bkrt=[x if l.costs.bkrt is None else l.costs.bkrt for x, l in zip(bkr, layers)],
            rgp=[x + l.costs.rgx for x, l in zip(rg, layers)],
            g=grad_store,
            dead=[l.costs.dead for l in layers], holds=[l.costs.holds for l in layers],
            static=param_bytes + buffer_bytes + input_bytes + cast_cache_bytes + hoisted_bytes,
            names=[l.name for l in layers], c=[l.flops for l in layers], side=side,
            groot=grad_root if side else None, gh=[l.costs.gh for l in layers] if side else None,
            # each layer's backward peak before and after its last saved tensor goes (a checkpoint's frame,
            # and the side tensors only it holds, go then)
            fpre=[int(l.costs.frame_pre or 0) for l in layers] if side and all(
                l.costs.frame_pre is not None for l in layers) else None,
            fpost=[int(l.costs.frame_post or 0) for l in layers] if side and all(
                l.costs.frame_pre is not None for l in layers) else None,
            # ... where only the frame holds the layer's input (it goes with the frame)
            fkpre=[int(l.costs.frame_pre_k if l.costs.frame_pre_k is not None else l.costs.frame_pre or 0)
                   for l in layers] if side and all(l.costs.frame_pre is not None for l in layers) else None,
            fkpost=[int(l.costs.frame_post_k if l.costs.frame_post_k is not None else l.costs.frame_post or 0)
                    for l in layers] if side and all(l.costs.frame_pre is not None for l in layers) else None,
        )
        return layers, costs

    auto = max_crossing is None
    max_crossing = MAX_CROSSING if auto else max_crossing
    groups, hoisted = layer_groups(max_crossing)
    many = len(groups)
    while auto and max_crossing > 1 and len(groups) > SIDE_AUTO_MAX_N:
        # too many layers to measure and solve at this crossing: fewer tensors per cut
        # (8 -> 4 -> 2 -> 1; a T5 with LoRA on every linear layer: 416 layers at 8, 258 at 4 with the
        # same optimal peak, 39 at 2 with a 1.8x higher one)
        max_crossing //= 2
        groups, hoisted = layer_groups(max_crossing)
    why = f"the model has {many} layers, more than the {SIDE_AUTO_MAX_N} the tracer measures at that crossing"
    while True:
        layers, costs = _build_costs(groups, hoisted)
        # the exact side-tensor program is fast when its saved-bytes bound prunes and O(n^3 2^k) when
        # nothing does (a peak in the loss): which one, only the costs tell; a trial run says
        if not (auto and max_crossing > 1 and costs.side and not solves_within(costs, SIDE_AUTO_MAX_WORK)):
            break
        why = (f"the exact side-tensor program over its {costs.n} layers at {max_crossing} would not finish "
               f"in seconds (more than {SIDE_AUTO_MAX_WORK:,} layer passes)")
        max_crossing //= 2
        groups, hoisted = layer_groups(max_crossing)
    if max_crossing < MAX_CROSSING and auto:
        note = (f"cuts crossed by at most {max_crossing} tensor{'s' if max_crossing > 1 else ''}: with up to "
                f"{MAX_CROSSING} {why} (trace(max_crossing={MAX_CROSSING}) forces them)")
        if note not in captured.notes:
            captured.notes.append(note)
    graph = _nx_graph(gm, values, fake_gm)
    constants = {n.name: v for n, v in values.items() if n.op != "output" and not tensor_leaves(v)}
    read = {name for l in layers for name in (l.input_node, *l.static_inputs, *l.side_inputs)}
    tensor_meta = {n.name: (tuple(v.shape), v.dtype, bool(v.requires_grad)) for n, v in values.items()
                   if n.name in read and isinstance(v, torch.Tensor)}
    return TracedModel(gm, graph, layers, costs, captured.opaque, input_bytes, param_bytes, buffer_bytes,
                       inputs.shapes, loss_fn, captured, tuple(n.name for n in hoisted), constants, tensor_meta,
                       max_crossing=max_crossing)


def _rg(layers: list[Layer], side: list, grad_root: list[int], grad_store: list[int]) -> list[int]:
    """Each layer's ``rg``: measured alone, an output gradient its backward uses up before it first
    reads a saved tensor is gone with its storage; in the model a side tensor's pending gradient that
    views the same storage (an addition hands both one gradient, a concatenation slices of one) holds
    it on, until that side tensor's producer runs its backward (``rgk``). A layer with no chain output
    whose side output's gradient is its ``g`` (a slice of a later storage) leaves that gradient out
    (``rgl``; the kernels add ``g``: 112 B over in the issue-19 fuzz, tests/test_fuzz.py)."""
    held = {t.grad_view for t in side if t.grad_view is not None and t.grad_view >= 0}
    out = []
    for j, l in enumerate(layers):
        shared = grad_root[j] in held and any(t.grad_view == grad_root[j] and t.producer < j for t in side)
        if l.costs.rgl is not None and grad_store[j] > 0 and grad_root[j] != j:
            out.append(l.costs.rgl)
            continue
        out.append(l.costs.rgk if shared and l.costs.rgk is not None else l.costs.rg)
    return out


def _prefix_peak(hoisted: list[fx.Node], values: dict, existing: list) -> int:
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


def _trained_parameters(out: Any, captured: Captured, loss_fn: Callable) -> set[int] | None:
    """Ids of the parameters the loss's backward reaches (their AccumulateGrad nodes), from the
    propagation run's fake output; None when the loss cannot be formed here (all count)."""
    try:
        loss = loss_fn(captured.rebuild(out) if captured.rebuild is not None else out)
    except Exception:  # noqa: BLE001 - the last layer's measurement reports a loss that fails
        return None
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return None
    return {id(fn.variable) for fn in reachable([loss]) if isinstance(getattr(fn, "variable", None), torch.Tensor)}


def _nx_graph(gm: fx.GraphModule, values: dict, fake_gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    by_name = {n.name: n for n in fake_gm.graph.nodes}
    for n in gm.graph.nodes:
        v = values.get(by_name.get(n.name))
        ts = tensor_leaves(v)
        g.add_node(n.name, op=n.op, target=str(n.target),
                   bytes=sum(storage_nbytes(t) for t in ts),
                   shape=tuple(ts[0].shape) if ts else None, dtype=str(ts[0].dtype) if ts else None)
    for n in gm.graph.nodes:
        for u in n.users:
            g.add_edge(n.name, u.name)
    return g
