"""A layer as the tracer builds it from its group of graph nodes: its inputs (the chain tensor, side
tensors, static values), its outputs, and its graph over the model's graph module, whose module (the code
that runs it) is made only when the layer is measured or counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import TraceError
from .capture.base import attr as _attr
from .cuts import WithLoss, subgraph
from .layer_key import layer_key
from .side_tensors import Crossings

__all__ = ["Built", "build_layers"]


def build_layers(fake_gm: fx.GraphModule, groups: list, crossings: Crossings, readable: set, values: dict,
                 placeholders: list, captured: Any, loss_fn: Callable, model_output: Any,
                 single_output: bool) -> tuple[list["Built"], dict[int, int]]:
    """Each group as a layer over the shared parameters, taking its chain input, the side tensors it
    reads and the static values it reads, returning its chain output and the side tensors it computes;
    and which layer creates each parameter's gradient (the last that uses it)."""
    param_owner: dict[int, int] = {}
    built = []
    for j, members in enumerate(groups):
        last = j == len(groups) - 1
        io = crossings.io[j]
        x_node, statics = _layer_inputs(members, io.main_in, readable, values, placeholders, first=j == 0)
        side_in = [crossings.nodes[t] for t in io.side_in]
        side_out = [crossings.nodes[t] for t in io.side_out]
        if last:
            output = model_output
            # what the model returns as it came in (HF returns the attention mask): read like a static
            own = set(members)
            for a in _nodes_in(model_output):
                if (a not in own and a is not x_node and a not in side_in and a not in statics
                        and a.op != "get_attr" and isinstance(values.get(a), torch.Tensor)):
                    statics.append(a)
        elif side_out:
            output = tuple(([io.main_out] if io.main_out is not None else []) + side_out)
        else:
            output = io.main_out
        ins = ([x_node] if x_node is not None else []) + side_in + statics
        graph = subgraph(fake_gm, members, ins, output, values)
        b = Built(members, x_node, side_in, side_out, statics, output, fake_gm, graph)
        if last and not single_output:  # (the loss inside: a module of its own, never keyed)
            b._module = WithLoss(fx.GraphModule(fake_gm, graph), loss_fn, captured.rebuild)
        for p in b.parameters():
            param_owner[id(p)] = j
        built.append(b)
    return built, param_owner


def _nodes_in(arg: Any) -> list[fx.Node]:
    """The graph nodes inside an output structure, in order, once each."""
    found: list[fx.Node] = []
    fx.node.map_arg(arg, lambda n: found.append(n) if n not in found else None)
    return found


@dataclass
class Built:
    """One layer: its nodes, inputs and outputs, and its graph over the model's graph module ``root``.
    The module that runs it (``module``) is made when first asked for: a layer measured like another
    never is (making it generates and compiles its code, a second per hundred layers)."""

    members: list[fx.Node]
    x_node: fx.Node | None
    side_in: list[fx.Node]
    side_out: list[fx.Node]
    statics: list[fx.Node]
    output: Any
    root: fx.GraphModule
    graph: fx.Graph
    _module: Any = None

    @property
    def module(self) -> nn.Module:
        if self._module is None:
            self._module = fx.GraphModule(self.root, self.graph)
        return self._module

    def parameters(self) -> list[nn.Parameter]:
        """The parameters ``module`` has (each once), read from the graph without making it."""
        if self._module is not None:
            return list(self._module.parameters())
        found: dict[int, nn.Parameter] = {}
        for n in self.graph.nodes:
            if n.op == "get_attr":
                obj = _attr(self.root, n.target)
            elif n.op == "call_module":
                obj = self.root.get_submodule(n.target)
            else:
                continue
            params = [obj] if isinstance(obj, nn.Parameter) else obj.parameters() if isinstance(obj, nn.Module) else []
            for p in params:
                found.setdefault(id(p), p)
        return list(found.values())

    def key(self, x: Any, context: dict) -> tuple | None:
        """:func:`layer_key` of the layer's module, from its graph (None for the layer with the loss)."""
        if self._module is not None and not isinstance(self._module, fx.GraphModule):
            return None
        return layer_key(self.root, x, context, graph=self.graph)


def _layer_inputs(members: list[fx.Node], first_in: fx.Node | None, readable: set[fx.Node], values: dict,
                  placeholders: list[fx.Node], first: bool = False) -> tuple[fx.Node | None, list[fx.Node]]:
    """The layer's chain input and the static values it reads besides (in first-read order).

    After a cut the chain input is the chain tensor crossing it (None when only side tensors
    cross: the layer then reads side tensors and static values). The first layer's is the
    model input that requires grad (at most one), else the first static tensor it reads.
    """
    own = set(members)
    reads: list[fx.Node] = []
    for n in members:
        for a in n.all_input_nodes:
            if a not in own and a not in reads and a.op != "get_attr" and isinstance(values.get(a), torch.Tensor):
                reads.append(a)
    if first_in is None and first:
        grad = [a for a in reads if a.op == "placeholder" and values[a].requires_grad]
        if len(grad) > 1:
            raise TraceError(
                f"the model takes several inputs that require grad ({', '.join(a.name for a in grad)}); the chain "
                "model gives the first layer one such input: wrap the model so that one tensor requiring grad "
                "goes in (e.g. the inputs concatenated), or detach the others",
                node=members[0].name,
            )
        candidates = grad or [a for a in reads if a in readable]
        if not candidates:
            raise TraceError(
                f"the model's first layer (from {members[0].name}) reads no tensor of the batch: the forward must "
                "read at least one tensor input, and the chain model starts at the first op that does; pass the "
                "batch as tensors (lists, numbers and strings are not read as data)", node=members[0].name)
        first_in = candidates[0]
    return first_in, [a for a in reads if a is not first_in and a in readable]
