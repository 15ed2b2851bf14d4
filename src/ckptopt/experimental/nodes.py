"""Node-level tracing: every FX node measured on fake tensors -> :class:`DagCosts` (experimental).

The torch side of :mod:`ckptopt.experimental.dag`. Each op node of the traced graph runs
forward and backward once in isolation under ``FakeTensorMode`` (nothing is
allocated), with every tensor input a fresh tensor that requires grad when
it does in the model, under the exact storage tracker and a
``saved_tensors_hooks`` pack hook, as :func:`ckptopt.tracer.measure_layer`
does for a layer. The inputs are kept alive through the backward, so ``b``
is what the node's backward adds on top of whatever else is live.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import InvalidPlan, TraceError
from ..rewriter import CheckpointedModule
from ..tracer.layer_costs import InjectGrad
from ..solvers import solve
from ..torch_utils import default_loss, fake_copy, normalize_inputs, tensor_leaves
from ..tracer import TracedModel, trace
from ..tracer.cuts import OPS, WithLoss, subgraph_module
from ..tracer.propagate import FakeRecorder
from ..tracker import StorageTracker
from .dag import DagCosts, DagNode, NodePlan, brute_force_dag, local_search_dag, simulate_dag

__all__ = ["TracedDag", "trace_dag", "op_nodes", "node_plan", "solve_nodes", "apply_node_plan", "optimize_nodes",
           "chain_plan_as_node_cuts"]


@dataclass
class TracedDag:
    """What :func:`trace_dag` returns: the chain trace plus the node-level costs.

    ``names[k]`` is the FX node at position ``k`` (``"<loss>"`` last).
    """

    traced: TracedModel
    costs: DagCosts
    names: list[str]


def op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a node-level plan cuts between, in execution order."""
    return [n for n in gm.graph.nodes if n.op in OPS]


class _Fresh(torch.autograd.Function):
    """A fresh input that requires grad; its backward records the gradient's storage."""

    @staticmethod
    def forward(ctx, anchor, holder, record, index):
        ctx.record, ctx.index = record, index
        return holder.pop()

    @staticmethod
    def backward(ctx, grad):
        out = ctx.record.get("out")
        shared = grad is not None and out is not None and out() is grad.untyped_storage()
        ctx.record[ctx.index] = 0 if grad is None else 2 if shared else 1
        return None, None, None, None


def _measure_node(module: nn.Module, xs: list[torch.Tensor], grad_inputs: list[bool], name: str,
                  producers: list[int]) -> DagNode:
    """Measure one node (``module(*xs)``) in isolation; see the module docstring."""
    dev = xs[0].device if xs else torch.device("cpu")
    holders = [[x.detach().clone()] for x in xs]
    record: dict[Any, Any] = {}
    ins = []
    for p, (h, g) in enumerate(zip(holders, grad_inputs)):
        ins.append(_Fresh.apply(torch.empty(0, device=dev, requires_grad=True), h, record, p) if g else h.pop())
    in_storages = [x.untyped_storage() for x in ins]
    params = [p for p in module.parameters() if p.requires_grad]
    static = {id(t.untyped_storage()) for t in list(module.parameters()) + list(module.buffers())}
    saved: dict[int, Any] = {}
    last_pack = [None]
    tracker = StorageTracker(fake=True)

    def pack(t):
        s = t.untyped_storage()
        if tracker.is_tracked(t):
            saved[id(s)] = s
        last_pack[0] = tracker.peak_bytes
        return t

    tracker.register(module, ins)
    start = tracker.current_bytes
    try:
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = module(*ins)
            f = tracker.peak_bytes - start
            if not isinstance(y, torch.Tensor):
                if tensor_leaves(y):
                    raise TraceError(f"node {name} returns several tensors; node-level tracing supports "
                                     "nodes with one tensor output (use the chain trace)", node=name)
                return DagNode(name, tuple(producers), input_grads=tuple(0 for _ in producers))
            ys = y.untyped_storage()
            alias = next((p for p, s in enumerate(in_storages) if s is ys), -1)
            out_bytes = 0 if alias >= 0 else int(ys.nbytes())
            if not y.requires_grad:
                return DagNode(name, tuple(producers), out_bytes, alias, f=int(f), fs=0,
                               input_grads=tuple(0 for _ in producers))
            saves_inputs = tuple(p for p, s in enumerate(in_storages) if id(s) in saved)
            saves_output = alias < 0 and id(ys) in saved
            in_ids = {id(s) for s in in_storages}
            extra = sum(s.nbytes() for k, s in saved.items() if k not in in_ids and k != id(ys) and k not in static)
            end = InjectGrad.apply(y, record)
            del y, ys
            saved.clear()
            backward_start = tracker.current_bytes
            tracker.reset_peak()
            end.backward(torch.empty(0, device=dev))
            b = tracker.peak_bytes - backward_start - record.get("grad_bytes", 0)
            del end
    finally:
        tracker.detach()
        for p in params:
            p.grad = None
    kinds = [record.get(p, 0) if g else 0 for p, g in enumerate(grad_inputs)]
    grad_bytes = int(record.get("grad_bytes", 0))
    param_grad = sum(int(p.untyped_storage().nbytes()) for p in params)
    return DagNode(name, tuple(producers), out_bytes, alias, grad_bytes, saves_inputs, bool(saves_output),
                   int(extra), int(f), int(last_pack[0] - start) if last_pack[0] is not None else 0, int(b),
                   tuple(kinds), param_grad)


def _cuttable(ops: list[fx.Node], values: dict, pos: dict) -> tuple[int, ...]:
    """Cut positions 1..len(ops): a view or in-place op stays with the tensor it aliases."""
    banned: set[int] = set()
    for j, n in enumerate(ops):
        out = values.get(n)
        if not isinstance(out, torch.Tensor):
            continue
        for a in n.all_input_nodes:
            v = values.get(a)
            if isinstance(v, torch.Tensor) and torch._C._is_alias_of(out, v):
                banned.update(range(pos.get(a, -1) + 1, j + 1))
    return tuple(k for k in range(1, len(ops) + 1) if k not in banned)


def trace_dag(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None) -> TracedDag:
    """Trace ``model`` and measure every node: the node-level cost model.

    Parameters
    ----------
    model : nn.Module
    example_inputs : Tensor or tuple
    loss_fn : callable, optional
        As in :func:`ckptopt.trace`.

    Returns
    -------
    TracedDag

    Raises
    ------
    TraceError
        A node returns several tensors, or the model returns several; or
        anything :func:`ckptopt.trace` raises.
    """
    tm = trace(model, example_inputs, loss_fn=loss_fn)
    fake = fake_copy(tm.gm, normalize_inputs(example_inputs))
    fm, fgm = fake.mode, fake.model
    rec = FakeRecorder(fgm)
    with fm, torch.enable_grad():
        rec.run(*fake.inputs.args)
    values = rec.values
    ops = op_nodes(fgm)
    pos = {n: i for i, n in enumerate(ops)}
    out_node = next(n for n in fgm.graph.nodes if n.op == "output")
    y_node = out_node.args[0]
    if not isinstance(y_node, fx.Node) or y_node not in pos:
        raise TraceError("node-level tracing needs a model that returns one tensor computed by an op",
                         node=str(y_node))
    nodes: list[DagNode] = []
    with fm, torch.enable_grad():
        for n in ops:
            tin = [a for a in n.all_input_nodes if isinstance(values.get(a), torch.Tensor)]
            sub = subgraph_module(fgm, [n], tin, n, values)
            in_ops = [a for a in tin if a in pos]
            # model inputs and constants come first in the subgraph but are static: measure them too,
            # without gradient; only op inputs are DagNode inputs
            xs = [values[a] for a in tin]
            grads = [bool(values[a].requires_grad) for a in tin]
            node = _measure_node(sub, xs, grads, n.name, [pos[a] if a in pos else -1 for a in tin])
            node = dataclasses.replace(node, hook_bytes=_bn_hook_bytes(fgm, n))
            keep = [p for p, a in enumerate(tin) if a in pos]
            nodes.append(_only_inputs(node, keep, [pos[a] for a in in_ops]))
        loss = WithLoss(None, tm.loss_fn or default_loss)
        nodes.append(_measure_node(loss, [values[y_node]], [True], "<loss>", [pos[y_node]]))
    costs = DagCosts(nodes, tm.costs.static, _cuttable(ops, values, pos))
    return TracedDag(tm, costs, [n.name for n in ops] + ["<loss>"])


def _bn_hook_bytes(gm: fx.GraphModule, n: fx.Node) -> int:
    """Bytes the rewriter's BatchNorm hooks copy when node ``n`` is recomputed."""
    if n.op != "call_module":
        return 0
    total = 0
    for mod in gm.get_submodule(n.target).modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training and mod.num_batches_tracked is not None:
            total += int(mod.num_batches_tracked.untyped_storage().nbytes())
    return total


def _only_inputs(v: DagNode, keep: list[int], producers: list[int]) -> DagNode:
    """Drop the static inputs (model inputs) from a measured node's input lists."""
    remap = {p: q for q, p in enumerate(keep)}
    alias = remap.get(v.alias, -1) if v.alias >= 0 else -1
    out_bytes = v.out_bytes
    if v.alias >= 0 and alias < 0:
        out_bytes = 0  # a view of a model input: static memory
    return DagNode(v.name, tuple(producers), out_bytes, alias, v.grad_bytes,
                   tuple(remap[p] for p in v.saves_inputs if p in remap), v.saves_output,
                   v.extra, v.f, v.fs, v.b,
                   tuple(v.input_grads[p] for p in keep) if v.input_grads else tuple(0 for _ in keep),
                   v.param_grad, v.hook_bytes)


def node_plan(td: TracedDag, cuts) -> NodePlan:
    """A :class:`NodePlan` of ``cuts`` with its simulated peak."""
    cuts = tuple(sorted(cuts))
    return NodePlan(cuts, td.costs.n, simulate_dag(td.costs, cuts).peak_bytes)


def chain_plan_as_node_cuts(td: TracedDag, checkpoints) -> tuple[int, ...]:
    """The node positions where the chain plan ``checkpoints`` (layer indices) cuts."""
    index = {nm: k for k, nm in enumerate(td.names)}
    return tuple(index[td.traced.layers[j].nodes[0]] for j in checkpoints)


def solve_nodes(td: TracedDag, brute_limit: int = 14) -> NodePlan:
    """The best node-level plan found: brute force when few positions, else local search.

    With at most ``brute_limit`` allowed cut positions every plan is
    simulated (exact optimum under the node-level simulator). Otherwise a
    local search (:func:`ckptopt.experimental.dag.local_search_dag`) starts from the chain
    optimum over single-tensor cuts (``solve(costs, "dp2")``) and from no
    cut; the result is never worse than the chain optimum under the
    node-level simulator, but it is not proven optimal.
    """
    costs = td.costs
    if len(costs.cuttable) <= brute_limit:
        cuts, peak = min(brute_force_dag(costs, limit=brute_limit), key=lambda kv: (kv[1], len(kv[0])))
        return NodePlan(tuple(cuts), costs.n, int(peak), "dag-brute")
    chain = chain_plan_as_node_cuts(td, solve(td.traced.costs, "dp2").checkpoints)
    found = [local_search_dag(costs, start) for start in (chain, ())]
    found.append((chain, simulate_dag(costs, chain).peak_bytes))
    cuts, peak = min(found, key=lambda cp: (cp[1], len(cp[0])))
    return NodePlan(tuple(cuts), costs.n, int(peak), "dag-local-search")


def optimize_nodes(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None):
    """Experimental: like :func:`ckptopt.optimize_checkpoints`, with cuts anywhere in the graph.

    Traces every node (:func:`trace_dag`), picks a node-level plan with
    :func:`solve_nodes` and rewrites the model with it. Returns the
    :class:`~ckptopt.rewriter.CheckpointedModule` (its ``plan`` is a
    :class:`~ckptopt.experimental.dag.NodePlan`).
    """
    td = trace_dag(model, example_inputs, loss_fn=loss_fn)
    return apply_node_plan(model, td.traced, solve_nodes(td))


def _node_groups(gm: fx.GraphModule, plan: NodePlan) -> tuple[list[list[fx.Node]], list[bool]]:
    """The op-node groups of a node-level plan and which are checkpointed.

    Position ``k`` is the k-th op node of ``gm`` (``len(ops)``: the loss); a
    cut at the loss checkpoints every model segment.
    """
    ops = op_nodes(gm)
    if plan.n != len(ops) + 1:
        raise InvalidPlan(f"the node plan was made for {plan.n} nodes but the traced graph has "
                          f"{len(ops)} op nodes and the loss ({len(ops) + 1}); trace the model again")
    cuts = list(plan.cuts)
    if cuts != sorted(set(cuts)) or any(not 1 <= c <= len(ops) for c in cuts):
        raise InvalidPlan(f"node plan cuts must be increasing positions in 1..{len(ops)}, got {plan.cuts}")
    starts = [0] + [c for c in cuts if c < len(ops)]
    ends = starts[1:] + [len(ops)]
    groups = [ops[a:b] for a, b in zip(starts, ends)]
    wrapped = [True] * (len(groups) - 1) + [len(ops) in cuts]
    return groups, wrapped


def apply_node_plan(model: nn.Module, traced: TracedModel, plan: NodePlan) -> CheckpointedModule:
    """Rewrite ``model`` with a node-level plan (cuts before graph nodes, several tensors crossing).

    The counterpart of :func:`ckptopt.apply_plan` for :class:`NodePlan`; pass it as
    ``measure_plans_fake(..., apply=apply_node_plan)``.
    """
    if not isinstance(plan, NodePlan):
        raise TypeError(f"apply_node_plan needs a NodePlan, got {type(plan).__name__}; "
                        "for a chain Plan use ckptopt.apply_plan")
    return CheckpointedModule(model, traced, plan, node_groups=_node_groups(traced.gm, plan))
