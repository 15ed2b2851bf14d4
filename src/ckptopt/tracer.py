"""The graph tracer: an ``nn.Module`` becomes a chain cost model.

Stages (each a function below)::

    model --_symbolic_trace--> fx.GraphModule   (opaque leaves where FX fails)
          --_propagate------> fake value per node (no activation memory)
          --_candidate_cuts-> positions whose live set is one tensor
          --_measure--------> LayerMeasurement per group of nodes (fake tensors)
          --> ChainCosts

**Candidate cuts.** Nodes are taken in the graph's topological order. A cut
before node ``k`` is a candidate when exactly one tensor produced by earlier
nodes is used at or after ``k`` (its *live set*), that tensor is not the
input of a view or in-place op at ``k`` (so a segment never starts by
aliasing its checkpoint), and no model input is used after it. Then
everything a later segment needs from earlier ones is that one tensor, and
the chain model of DESIGN.md section 3 is exact for plans made of these cuts:
each group of nodes between two candidate cuts is one *layer*, measured as a
whole. For a chain (VGG, an MLP) every node boundary qualifies; for a ResNet
or a transformer the cuts fall between residual blocks; a DenseNet is cut
between dense blocks, and a U-Net only where no skip connection is open.
Cuts inside those regions (several tensors crossing) are not offered here;
the experimental node-level path (:mod:`ckptopt.dag`,
:func:`ckptopt._dag_measure.trace_dag`) cuts before any node.

**Measurement.** Each layer runs forward and backward once in isolation
under ``FakeTensorMode`` with :func:`ckptopt.measure.measure_layer`: the
storage tracker counts fake storages exactly as it counts real ones, and a
``saved_tensors_hooks`` pack hook tells which storages autograd keeps. No
activation is ever allocated, so a model that needs tens of GB to train
traces in a few MB.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn

from .costs import ChainCosts
from .errors import TraceError
from .measure import LayerMeasurement, _default_loss, _is_fake, measure_layer

__all__ = ["trace", "TracedModel", "Layer"]


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """One layer of the chain: the graph nodes between two candidate cuts.

    Attributes
    ----------
    index : int
    name : str
        A readable label (the module path, or the first and last nodes).
    nodes : tuple of str
        FX node names in execution order (``"<loss>"`` for the loss layer).
    ops : tuple of str
        What each node runs (module type or function name).
    input_node, output_node : str
        The tensor entering the layer (its checkpoint when a segment starts
        here) and the one leaving it.
    costs : LayerMeasurement
        The measured chain-model quantities.
    flops : int
        Forward compute: floating-point operations from
        ``torch.utils.flop_counter``, plus one per output element of every
        other non-view op (elementwise ops, norms, pooling). The cost
        model's ``c``.
    """

    index: int
    name: str
    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    input_node: str
    output_node: str
    costs: LayerMeasurement
    flops: int = 0

    @property
    def op(self) -> str:
        return self.ops[0] if len(self.ops) == 1 else f"{self.ops[0]}..{self.ops[-1]} ({len(self.ops)} ops)"


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

    @property
    def n(self) -> int:
        return len(self.layers)

    @property
    def flops(self) -> list[int]:
        """Forward FLOPs of every layer."""
        return [l.flops for l in self.layers]


# --------------------------------------------------------------------------
# stage 1: symbolic tracing with opaque leaves
# --------------------------------------------------------------------------
class _Retry(Exception):
    def __init__(self, qualname: str, cause: BaseException):
        self.qualname = qualname
        self.cause = cause


class _LeafTracer(fx.Tracer):
    """An FX tracer that treats the named modules (and types) as leaves and
    reports the innermost submodule whose forward cannot be traced."""

    def __init__(self, leaves: set[str], leaf_types: tuple[type, ...]):
        super().__init__()
        self.leaves = leaves
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaves or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        qualname = self.path_of_module(m)
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except _Retry:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure inside this submodule
            raise _Retry(qualname, exc) from exc


def _construct(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if "control flow" in text or "bool" in text and "Proxy" in text:
        return f"data-dependent control flow ({first})"
    return first


def _symbolic_trace(model: nn.Module, leaf_modules: Iterable[str | type] | None) -> tuple[fx.GraphModule, dict]:
    names = {x for x in (leaf_modules or ()) if isinstance(x, str)}
    types = tuple(x for x in (leaf_modules or ()) if isinstance(x, type))
    known = dict(model.named_modules())
    unknown = sorted(n for n in names if n not in known)
    if unknown:
        raise TraceError(
            f"leaf_modules names {unknown} that are not submodules of the model; "
            f"valid names look like {list(known)[1:4]} (see model.named_modules())"
        )
    opaque: dict[str, str] = {}
    last: _Retry | None = None
    for _ in range(len(known) + 1):
        tracer = _LeafTracer(names | set(opaque), types)
        try:
            graph = tracer.trace(model)
        except _Retry as r:
            last = r
            if r.qualname in opaque or r.qualname == "":
                break
            opaque[r.qualname] = _construct(r.cause)
            continue
        except Exception as exc:  # the model's own forward failed
            raise TraceError(
                f"torch.fx cannot trace the forward of {type(model).__name__} itself: {_construct(exc)}. "
                "Only submodules can be made opaque automatically; move the construct into a submodule, "
                "or pass leaf_modules=[...] naming the submodules (e.g. the blocks of a transformer) "
                "to trace at that granularity.",
                node=type(model).__name__,
            ) from exc
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        return gm, opaque
    assert last is not None
    raise TraceError(
        f"torch.fx cannot trace submodule {last.qualname!r} even as an opaque layer: {_construct(last.cause)}. "
        "Pass leaf_modules=[...] naming a coarser submodule to treat as one layer.",
        node=last.qualname,
    )


# --------------------------------------------------------------------------
# stage 2: fake-tensor propagation
# --------------------------------------------------------------------------
class _FakeRecorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n):
        try:
            out = super().run_node(n)
        except Exception as exc:
            raise TraceError(
                f"running node {n.format_node()} on the example inputs failed: {type(exc).__name__}: {exc}. "
                "Check that the example inputs match what the model expects (shapes, dtypes, devices).",
                node=n.name,
            ) from exc
        self.values[n] = out
        return out


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return int(t.numel() * t.element_size())


# --------------------------------------------------------------------------
# stage 3: candidate cuts and groups
# --------------------------------------------------------------------------
def _op_label(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    return str(n.target)


def _aliases(out: Any, args: list[torch.Tensor]) -> bool:
    outs = _tensors(out)
    return any(torch._C._is_alias_of(o, a) for o in outs for a in args)


def _groups(gm: fx.GraphModule, values: dict) -> list[tuple[list[fx.Node], fx.Node]]:
    """Split the op nodes into groups at candidate cuts.

    Returns ``[(nodes, input_node), ...]``: the input of the first group is the
    model input placeholder (or None when there are several inputs).
    """
    nodes = list(gm.graph.nodes)
    ops = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")]
    pos = {n: i for i, n in enumerate(ops)}
    inputs = [n for n in nodes if n.op == "placeholder"]
    def is_tensor_value(n):
        v = values.get(n)
        return bool(_tensors(v))

    # last position (in ops order; len(ops) for the output node) where each node is used
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for u in n.users:
            p = pos.get(u, len(ops))
            last_use[n] = max(last_use.get(n, -1), p)
    input_last = max([last_use.get(n, -1) for n in inputs if is_tensor_value(n)] or [-1])

    # sweep: live tensor-valued op nodes before position k
    cuts = []
    live: set[fx.Node] = set()
    for k in range(1, len(ops)):
        prev = ops[k - 1]
        if is_tensor_value(prev) and last_use.get(prev, -1) >= k:
            live.add(prev)
        live = {n for n in live if last_use.get(n, -1) >= k}
        if len(live) != 1 or k <= input_last:
            continue
        (only,) = live
        v = values.get(only)
        if not isinstance(v, torch.Tensor) or not v.requires_grad:
            continue
        nxt = ops[k]
        args = [values[a] for a in nxt.all_input_nodes if isinstance(values.get(a), torch.Tensor)]
        if _aliases(values.get(nxt), args):
            continue  # a view or in-place op of the live tensor: keep it with its producer
        cuts.append(k)
    bounds = [0] + cuts + [len(ops)]
    groups = []
    for j in range(len(bounds) - 1):
        members = ops[bounds[j]:bounds[j + 1]]
        if j == 0:
            tensor_inputs = [n for n in inputs if is_tensor_value(n)]
            first_in = tensor_inputs[0] if len(tensor_inputs) == 1 else None
        else:
            # the single live tensor at the cut
            first_in = next(n for n in ops[: bounds[j]] if last_use.get(n, -1) >= bounds[j]
                            and isinstance(values.get(n), torch.Tensor))
        groups.append((members, first_in))
    return groups


def _subgraph_module(gm: fx.GraphModule, members: list[fx.Node], inputs: fx.Node | list[fx.Node] | None,
                     output: Any, values: dict | None = None) -> fx.GraphModule:
    """A GraphModule running ``members`` (in order) on ``inputs``, returning ``output``.

    Parameters are read through ``get_attr`` nodes of ``gm``. Any other node
    the members use must be an input, except, when ``values`` (node -> value of
    a propagation run) is given, non-tensor values (shapes, ints), which become
    constants of the subgraph: right for measuring one layer at fixed shapes,
    not for the rewriter, which passes them as inputs so other shapes work.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if isinstance(inputs, fx.Node):
        inputs = [inputs]
    for n in inputs or ():
        env[n] = g.placeholder(n.name)

    def load(a: fx.Node):
        if a in env:
            return env[a]
        if a.op == "get_attr":
            env[a] = g.get_attr(a.target)
            return env[a]
        v = values.get(a) if values is not None else None
        if values is None or _tensors(v) or a in set(members):
            raise TraceError(
                f"internal: node {a.name} is used by a layer but not passed to it (please report this model)",
                node=a.name,
            )
        return v  # a non-tensor value (a shape, an int): a constant of the layer

    for n in members:
        env[n] = g.node_copy(n, load)
    g.output(fx.node.map_arg(output, load))
    return fx.GraphModule(gm, g)


class _WithLoss(nn.Module):
    def __init__(self, body: nn.Module | None, loss_fn: Callable):
        super().__init__()
        self.body = body
        self.loss_fn = loss_fn

    def forward(self, x):
        return self.loss_fn(self.body(x) if self.body is not None else x)


# --------------------------------------------------------------------------
# the entry point
# --------------------------------------------------------------------------
def _check_inputs(model, example_inputs) -> tuple:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"trace() needs an nn.Module, got {type(model).__name__}; pass the model itself "
            "(not model.parameters() or a function)"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise TypeError(
            "example_inputs must be a tensor or a non-empty tuple of the model's positional arguments, "
            f"got {type(example_inputs).__name__}"
        )
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"{type(model).__name__} has no parameters that require grad, so a training step has no "
            "backward pass to plan; unfreeze some parameters (p.requires_grad_(True)) first"
        )
    devices = {t.device for t in _tensors(list(example_inputs)) + params}
    if len(devices) > 1:
        raise ValueError(
            f"the model and its example inputs are on different devices ({', '.join(sorted(map(str, devices)))}); "
            "move them to one device first, e.g. model.to(dev) and x.to(dev)"
        )
    return tuple(example_inputs)


def trace(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable | None = None,
    leaf_modules: Iterable[str | type] | None = None,
) -> TracedModel:
    """Trace ``model`` into a chain cost model without allocating activations.

    Parameters
    ----------
    model : nn.Module
        In the mode it will train in (``model.train()``).
    example_inputs : Tensor or tuple
        Positional arguments of one training forward (the batch size and
        shapes the plan is made for). Only their shapes and dtypes are used.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar``; default ``output.float().pow(2).mean()``
        summed over tensor outputs (what :func:`ckptopt.measure_peak` uses).
    leaf_modules : iterable of str or type, optional
        Submodules (by qualified name, e.g. ``"transformer.h.0"``, or by
        class) to treat as one opaque layer each. Submodules FX cannot trace
        are made opaque automatically; this is the explicit override.

    Returns
    -------
    TracedModel

    Raises
    ------
    TraceError
        The model's own forward cannot be traced (the message names the
        construct), or a submodule fails even as an opaque layer.
    TypeError, ValueError
        Bad model or inputs (not a Module, no trainable parameters, mixed
        devices, inputs the model rejects).

    Notes
    -----
    Under an active ``torch.autocast`` context the layers are measured as
    they run under it (bf16/fp16 activations where autocast casts), and the
    weight copies autocast caches for the step count as static memory (the
    figures assume backward runs inside the same autocast context, as
    :func:`ckptopt.measure_peak` does; with backward outside it the cache is
    dropped earlier and the prediction errs high by at most that amount).
    """
    from torch._dynamo.utils import deepcopy_to_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _check_inputs(model, example_inputs)
    loss_fn = loss_fn or _default_loss
    gm, opaque = _symbolic_trace(model, leaf_modules)

    fake_mode = FakeTensorMode()
    fake_gm = deepcopy_to_fake_tensor(gm, fake_mode)
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    rec = _FakeRecorder(fake_gm)
    with fake_mode, torch.enable_grad():
        out = rec.run(*fake_args)
    values = dict(rec.values)  # keyed by the nodes of fake_gm
    cast_cache_bytes = _autocast_cache_bytes(fake_gm, fake_args, fake_mode)
    if not any(t.requires_grad for t in _tensors(out)):
        raise ValueError(
            "the model's output does not require grad on these inputs (no trainable parameter reaches it); "
            "nothing to checkpoint"
        )

    groups = _groups(fake_gm, values)
    out_node = next(n for n in fake_gm.graph.nodes if n.op == "output")
    model_output = out_node.args[0]
    single_output = isinstance(model_output, fx.Node) and isinstance(values.get(model_output), torch.Tensor)

    layers: list[Layer] = []
    param_owner: dict[int, int] = {}
    built = []
    for j, (members, first_in) in enumerate(groups):
        last = j == len(groups) - 1
        output = model_output if last else groups[j + 1][1]
        body = _subgraph_module(fake_gm, members, first_in, output, values)
        module = body if not (last and not single_output) else _WithLoss(body, loss_fn)
        x = values[first_in] if first_in is not None else None
        if x is None or not isinstance(x, torch.Tensor):
            raise TraceError(
                "the model takes several tensor inputs (or none); tracing supports one tensor input "
                "(plus non-tensor arguments) for now: wrap the model in a module that takes one "
                "tensor, e.g. the inputs stacked or concatenated",
                node=members[0].name,
            )
        for p in module.parameters():
            param_owner[id(p)] = j  # the last layer using a parameter creates its gradient
        built.append((members, first_in, output, module, x))
    with fake_mode, torch.enable_grad():
        for j, (members, first_in, output, module, x) in enumerate(built):
            # a tied or reused weight whose gradient a later layer already created
            existing = [p for p in module.parameters() if p.requires_grad and param_owner[id(p)] > j]
            try:
                # an input the previous layer saves stays alive through this layer's backward
                keep = bool(layers and layers[-1].costs.sout)
                kw = dict(input_requires_grad=bool(x.requires_grad), grads_exist=existing,
                          leaf_input=bool(x.requires_grad and x.is_leaf))
                m = measure_layer(module, x, keep_input=keep, **kw)
                if m.sin and not keep:
                    # the input is held through this layer's backward when something else holds
                    # it (a checkpoint, the model input): measured again with the input kept
                    m = dataclasses.replace(m, bk=measure_layer(module, x, keep_input=True, **kw).b)
            except Exception as exc:
                raise TraceError(
                    f"measuring layer {members[0].name}..{members[-1].name} failed: {type(exc).__name__}: {exc}",
                    node=members[0].name,
                ) from exc
            layers.append(Layer(j, _layer_name(fake_gm, members), tuple(n.name for n in members),
                                tuple(_op_label(fake_gm, n) for n in members),
                                first_in.name, (output.name if isinstance(output, fx.Node) else "<output>"), m,
                                _forward_flops(module, x)))
        if single_output:
            y = values[model_output]
            loss_layer = _WithLoss(None, loss_fn)
            m = measure_layer(loss_layer, y, keep_input=bool(layers and layers[-1].costs.sout))
            layers.append(Layer(len(layers), "loss", ("<loss>",), ("loss",), model_output.name, "<loss>", m,
                                _forward_flops(loss_layer, y)))

    # parameter bytes are charged to the last layer that uses them (tied weights once)
    fake_params = {id(p): p for p in fake_gm.parameters()}
    p_bytes = [0] * len(layers)
    for pid, j in param_owner.items():
        p_bytes[j] += _storage_nbytes(fake_params[pid]) if pid in fake_params else 0
    param_bytes = sum(_storage_nbytes(p) for p in _distinct(model.parameters()))
    buffer_bytes = sum(_storage_nbytes(b) for b in _distinct(model.buffers()))
    input_bytes = sum(_storage_nbytes(t) for t in _distinct(_tensors(list(args))))
    costs = ChainCosts(
        a=[l.costs.a for l in layers], p=p_bytes, sin=[l.costs.sin for l in layers],
        sout=[l.costs.sout for l in layers], m=[l.costs.m for l in layers], f=[l.costs.f for l in layers],
        b=[l.costs.b for l in layers], fs=[l.costs.fs for l in layers], rg=[l.costs.rg for l in layers],
        bk=[l.costs.b if l.costs.bk is None else l.costs.bk for l in layers],
        dead=[l.costs.dead for l in layers],
        static=param_bytes + buffer_bytes + input_bytes + cast_cache_bytes,
        names=[l.name for l in layers], c=[l.flops for l in layers],
    )
    graph = _nx_graph(gm, values, fake_gm)
    return TracedModel(gm, graph, layers, costs, opaque, input_bytes, param_bytes, buffer_bytes,
                       tuple(tuple(t.shape) for t in _tensors(list(args))), loss_fn)


def _forward_flops(module: nn.Module, x: torch.Tensor) -> int:
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
                _Elementwise.total += sum(t.numel() for t in _tensors(out))
            return out

    _Elementwise.total = 0
    with torch.no_grad(), FlopCounterMode(display=False) as counter, _Elementwise():
        module(x.detach().clone())
    return int(counter.get_total_flops()) + int(_Elementwise.total)


def _autocast_cache_bytes(fake_gm: fx.GraphModule, fake_args: list, fake_mode) -> int:
    """Bytes of the low-precision weight copies autocast caches for the whole step.

    Under ``torch.autocast`` every cast of a parameter is cached until the
    autocast context exits, so the copies are static memory. Measured by
    running the forward once more (fake, no grad) under a storage tracker and
    keeping what survives once its outputs are dropped. 0 without autocast.
    """
    from .measure import StorageTracker

    if not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return 0
    # the propagation run has filled the cache already: empty it so every cast is made, and
    # counted, here (a cached cast would be seen only through a view of it, or not at all)
    torch.clear_autocast_cache()
    tracker = StorageTracker(fake=True)
    with fake_mode, torch.no_grad(), tracker:
        out = fake_gm(*fake_args)
        del out
    left = tracker.current_bytes
    tracker.detach()
    return int(left)


def _distinct(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        key = id(t.untyped_storage()) if _is_fake(t) else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _layer_name(gm: fx.GraphModule, members: list[fx.Node]) -> str:
    mods = [str(n.target) for n in members if n.op == "call_module"]
    if mods:
        prefix = _common_prefix(mods)
        if prefix and len(mods) > 1:
            return prefix
        return mods[0] if len(mods) == 1 and len(members) <= 2 else f"{mods[0]}..{mods[-1]}" if len(mods) > 1 else mods[0]
    return members[0].name if len(members) == 1 else f"{members[0].name}..{members[-1].name}"


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    out = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return ".".join(out)


def _nx_graph(gm: fx.GraphModule, values: dict, fake_gm: fx.GraphModule) -> nx.DiGraph:
    g = nx.DiGraph()
    by_name = {n.name: n for n in fake_gm.graph.nodes}
    for n in gm.graph.nodes:
        v = values.get(by_name.get(n.name))
        ts = _tensors(v)
        g.add_node(n.name, op=n.op, target=str(n.target),
                   bytes=sum(_storage_nbytes(t) for t in ts),
                   shape=tuple(ts[0].shape) if ts else None, dtype=str(ts[0].dtype) if ts else None)
    for n in gm.graph.nodes:
        for u in n.users:
            g.add_edge(n.name, u.name)
    return g
