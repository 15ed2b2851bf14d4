"""Candidate cuts: where the chain of layers may be cut, and the layers between cuts.

Nodes are taken in the graph's topological order. A cut before node ``k`` is a
candidate when at most ``max_crossing`` tensors produced by earlier nodes are used
at or after ``k`` (its *live set*), none is the input of a view or in-place op at
``k`` (so a segment never starts by aliasing what crosses into it), and no model
input is used after it. Each group of nodes between two candidate cuts is one
*layer*. With one tensor crossing, everything a later segment needs from earlier
ones is that tensor (the chain model, ``docs/design.md`` §3): in a ResNet or a
transformer the cuts fall between residual blocks, a DenseNet is cut between dense
blocks, a U-Net only where no skip connection is open. With several, the others are
side tensors (§4): the encoder output between decoder layers, a skip connection's
source, the first tower's output while the second runs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import TraceError
from ..torch_utils import tensor_leaves

__all__ = ["MAX_CROSSING", "SIDE_AUTO_MAX_N", "OPS", "op_label", "candidate_groups", "subgraph_module", "subgraph",
           "WithLoss"]

#: The node kinds that run something (the others are inputs, attributes and the output).
OPS = ("call_module", "call_function", "call_method")


def op_label(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    return str(n.target)


def _aliases(out: Any, args: list[torch.Tensor]) -> bool:
    outs = tensor_leaves(out)
    return any(torch._C._is_alias_of(o, a) for o in outs for a in args)


_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                      "ilshift", "irshift", "imatmul"}


def mutated_args(gm: fx.GraphModule, n: fx.Node) -> list[fx.Node]:
    """The argument nodes op ``n`` writes in place: from the ATen schema (``Tensor(a!)``), a module
    or function called with ``inplace=True``, or a trailing-underscore method or function."""
    first = [n.args[0]] if n.args and isinstance(n.args[0], fx.Node) else []
    if n.op == "call_module":
        return first if getattr(gm.get_submodule(n.target), "inplace", False) is True else []
    if n.op == "call_method":
        name = str(n.target)
        return first if name.endswith("_") and not name.startswith("_") else []
    target = n.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        out = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                if isinstance(v, fx.Node):
                    out.append(v)
        return out
    name = getattr(target, "__name__", "")
    if n.kwargs.get("inplace") is True or name in _INPLACE_OPERATORS or (
            name.endswith("_") and not name.startswith("_")):
        return first
    return []


#: The default of :func:`ckptopt.trace`'s ``max_crossing``: a cut may be crossed by the chain
#: tensor and up to seven side tensors (an encoder output and position biases between T5's
#: decoder layers, the features a dense block concatenates, a U-Net's open skips); the exact
#: programs keep at most 2**7 states per boundary. DenseNet-121 (batch 2, 64x64): optimal peak
#: 70.9 MB at 1, 68.3 MB at 4, 66.3 MB at 8 (measured, exact to the byte).
MAX_CROSSING = 8

#: Above this many layers, ``trace``'s default halves the tensors that may cross a cut (8, 4, 2, 1)
#: before measuring; at or below it, it measures and keeps the crossing whose costs the exact
#: side-tensor program solves within ``SIDE_AUTO_MAX_WORK`` (a trial run): the program is
#: O(n^3 2^k) when nothing prunes (a model whose peak sits in its loss, as a large-vocabulary LM's:
#: 290 layers of an 8B-wide Llama take 16 s) and near O(n^2) when the saved-bytes bound does
#: (HrmText, 407 layers at 2: 0.03 s). Halving, not going straight to single-tensor cuts, keeps the
#: plans good: a T5 with LoRA on every linear layer has 416 layers at 8, 258 at 4 (the same optimal
#: peak), 6 at 1 (1.8x the peak of HF's checkpointing); HrmText 41 at 1 (2.4x).
SIDE_AUTO_MAX_N = 1_000


def candidate_groups(gm: fx.GraphModule, values: dict, static: set[fx.Node] = frozenset(),
                     max_crossing: int = MAX_CROSSING) -> list[list[fx.Node]]:
    """Split the op nodes into groups (the layers) at candidate cuts.

    A cut before op ``k`` is a candidate when between 1 and ``max_crossing`` tensors computed
    before ``k`` are used at or after it (its *live set*; ``static`` nodes never count: any
    layer may read them), at least one requires grad, no two share a storage, none is the input of a
    view or in-place op at ``k`` (a segment never starts by aliasing what crosses into it) or
    written in place at or after ``k`` (a checkpoint would find its input modified) or on a
    dead branch (no gradient reaches it: its saved tensors die in the forward),
    no model input that requires grad is still to be read, and the first layer reads the batch (a
    cut comes after the first op reading a model input or a static value). With ``max_crossing=1`` this
    is the single-tensor chain of docs/design.md §4; above, the tensors crossing a cut besides
    the chain tensor are side tensors (:class:`ckptopt.costs.SideTensor`).
    """
    nodes = list(gm.graph.nodes)
    ops = [n for n in nodes if n.op in OPS]
    pos = {n: i for i, n in enumerate(ops)}
    inputs = [n for n in nodes if n.op == "placeholder"]

    def is_tensor_value(n):
        v = values.get(n)
        return bool(tensor_leaves(v))

    # last position (in ops order; len(ops) for the output node) where each node is used
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for u in n.users:
            p = pos.get(u, len(ops))
            last_use[n] = max(last_use.get(n, -1), p)
    input_last = max([last_use.get(n, -1) for n in inputs if is_tensor_value(n) and n not in static] or [-1])
    # the first layer reads the batch: ops before the first read of a model input or static value read
    # parameters, constants and sizes alone (a weight standardization; a timestep given as a number,
    # made a tensor, expanded to the batch's size and embedded with an arange), and a layer of them
    # would have no input to run on
    param_only: set[fx.Node] = set()
    for n in ops:
        if all(a.op == "get_attr" or a in param_only or not is_tensor_value(a) for a in n.all_input_nodes):
            param_only.add(n)
    outer = set(inputs) | {n for n in static if n not in param_only and n.op != "get_attr"}
    # (an op that reads only an input's shape, ``sym_size``, makes a number: not a read of its data)
    first_read = next((pos[n] for n in ops if is_tensor_value(n)
                       and any(a in outer and is_tensor_value(a) for a in n.all_input_nodes)), 0)
    # values no gradient reaches (a dead branch: nothing after reads them toward the output): their
    # saved tensors die with the forward, which the measurement of one layer sees only within it
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    reaching = {out_node}
    for n in reversed(nodes):
        if any(u in reaching for u in n.users):
            reaching.add(n)
    # the last op that writes each tensor's storage in place: a tensor crossing a cut must not be
    # written after it (a checkpoint would recompute from, or find, a modified input)
    writes = [(pos[n], values[a]) for n in ops for a in mutated_args(gm, n) if isinstance(values.get(a), torch.Tensor)]
    last_write: dict[fx.Node, int] = {}
    if writes:
        for n in ops:
            v = values.get(n)
            if isinstance(v, torch.Tensor):
                w = [j for j, t in writes if j > pos[n] and (t is v or torch._C._is_alias_of(v, t))]
                if w:
                    last_write[n] = max(w)

    # sweep: live tensor-valued op nodes before position k
    cuts = []
    live: set[fx.Node] = set()
    for k in range(1, len(ops)):
        prev = ops[k - 1]
        if is_tensor_value(prev) and prev not in static and last_use.get(prev, -1) >= k:
            live.add(prev)
        live = {n for n in live if last_use.get(n, -1) >= k}
        if not 1 <= len(live) <= max_crossing or k <= input_last or k <= first_read:
            continue
        vals = [values.get(n) for n in live]
        if not all(isinstance(v, torch.Tensor) for v in vals) or not any(v.requires_grad for v in vals):
            continue  # (a tensor needing no gradient, a frozen layer's output, may cross beside one that does)
        if any(torch._C._is_alias_of(a, b) for i, a in enumerate(vals) for b in vals[i + 1:]):
            continue  # a view crossing with its base: one storage, two tensors
        if any(n not in reaching for n in live):
            continue  # a dead branch stays within one layer
        if any(last_write.get(n, -1) >= k for n in live):
            continue  # written in place later: its producer's segment must run up to that write
        nxt = ops[k]
        args = [values[a] for a in nxt.all_input_nodes if isinstance(values.get(a), torch.Tensor)]
        if _aliases(values.get(nxt), args):
            continue  # a view or in-place op of a live tensor: keep it with its producer
        cuts.append(k)
    bounds = [0] + cuts + [len(ops)]
    return [ops[bounds[j]:bounds[j + 1]] for j in range(len(bounds) - 1)]


def subgraph_module(gm: fx.GraphModule, members: list[fx.Node], inputs: fx.Node | list[fx.Node] | None,
                     output: Any, values: dict | None = None) -> fx.GraphModule:
    """A GraphModule running ``members`` (in order) on ``inputs``, returning ``output``.

    Parameters are read through ``get_attr`` nodes of ``gm``. Any other node
    the members use must be an input, except, when ``values`` (node -> value of
    a propagation run) is given, non-tensor values (shapes, ints), which become
    constants of the subgraph: right for measuring one layer at fixed shapes,
    not for the rewriter, which passes them as inputs so other shapes work.
    """
    return fx.GraphModule(gm, subgraph(gm, members, inputs, output, values))


def subgraph(gm: fx.GraphModule, members: list[fx.Node], inputs: fx.Node | list[fx.Node] | None,
             output: Any, values: dict | None = None) -> fx.Graph:
    """The graph of :func:`subgraph_module`, without the module: making the module generates and compiles
    its Python code, which a layer measured like another (:mod:`~ckptopt.tracer.layer_key`) never needs."""
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
        if values is None or tensor_leaves(v) or a in set(members):
            raise TraceError(
                f"internal: node {a.name} is used by a layer but not passed to it (please report this model)",
                node=a.name,
            )
        return v  # a non-tensor value (a shape, an int): a constant of the layer

    for n in members:
        env[n] = g.node_copy(n, load)
    g.output(fx.node.map_arg(output, load))
    return g


class WithLoss(nn.Module):
    """``loss_fn(rebuild(body(x, *static)))``: a layer that ends with the loss (the loss alone for
    ``body=None``); ``rebuild`` turns the graph's output into what the model returns."""

    def __init__(self, body: nn.Module | None, loss_fn: Callable, rebuild: Callable | None = None):
        super().__init__()
        self.body = body
        self.loss_fn = loss_fn
        self.rebuild = rebuild

    def forward(self, x, *static):
        out = self.body(x, *static) if self.body is not None else x
        return self.loss_fn(self.rebuild(out) if self.rebuild is not None else out)
