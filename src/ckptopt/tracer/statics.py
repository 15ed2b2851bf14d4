"""Static values: model inputs that need no gradient, and what the graph computes from them alone.

The caller holds the batch for the whole step, so a model input that needs no
gradient (token ids, an attention mask, labels) is static memory, like the
parameters: any segment may read it without holding it as a checkpoint, and it
does not block a cut. The same holds for what a transformer derives from those
inputs alone before its blocks run (the 4-D attention mask, position ids, rotary
cos/sin tables): values that need no gradient, computed by deterministic ops from
static values only. They cross every block boundary, so they would leave no
single-tensor cut between blocks; instead:

* :func:`static_nodes` finds them (no random op: hoisting one would change the
  order of random draws, and dropout masks with it);
* after the cuts are chosen, :func:`place_statics` moves a static value that only
  one layer reads into that layer (where the unmodified model computes it too), and
  hoists the values several layers read: the rewriter computes them once before the
  first segment, and the cost model counts them as static bytes for the whole step
  (a small over-count while no layer holds them, e.g. a mask no backward saves).
"""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..torch_utils import tensor_leaves

__all__ = ["static_nodes", "place_statics", "is_random"]

_RANDOM = re.compile(r"dropout|rand|bernoulli|normal|multinomial|rrelu|uniform|exponential|poisson|cauchy|"
                     r"geometric")


def is_random(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether running ``n`` draws random numbers (dropout, ``randn``...), looking inside
    submodules and the subgraphs of higher-order ops."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in mod.modules()):
            return True
        return isinstance(mod, fx.GraphModule) and any(is_random(mod, x) for x in mod.graph.nodes)
    if n.op not in ("call_function", "call_method"):
        return False
    name = getattr(n.target, "__name__", None) or str(n.target)
    if _RANDOM.search(str(n.target)) or _RANDOM.search(name):
        return True
    for a in n.all_input_nodes:  # a higher-order op's subgraph
        if a.op == "get_attr":
            sub = _attr(gm, a.target)
            if isinstance(sub, fx.GraphModule) and any(is_random(sub, x) for x in sub.graph.nodes):
                return True
    return False


def static_nodes(gm: fx.GraphModule, values: dict[fx.Node, Any]) -> set[fx.Node]:
    """The nodes whose values are static: no tensor in them requires grad, and they are model
    inputs, attributes (buffers, constants), or computed by deterministic ops from static values."""
    static: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "output" or any(t.requires_grad for t in tensor_leaves(values.get(n))):
            continue
        if n.op in ("placeholder", "get_attr"):
            static.add(n)
        elif all(a in static for a in n.all_input_nodes) and not is_random(gm, n):
            static.add(n)
    return static


def place_statics(groups: list[list[fx.Node]], static: set[fx.Node],
                  values: dict[fx.Node, Any]) -> tuple[list[list[fx.Node]], list[fx.Node]]:
    """Where each static op node runs: ``(groups, hoisted)``.

    A static node whose value reaches (directly or through other static nodes) one layer only
    moves into that layer, where the unmodified model computes it too (position ids read by
    one embedding, labels shifted for the loss): the layer's measurement counts it. One that
    reaches several layers (an attention mask read by every block) is hoisted: computed once
    before the first layer, counted as static bytes for the step. Static nodes that reach
    no layer (assertions on static values) go with the hoisted nodes they check, or stay.
    In graph order.
    """
    group_of = {n: j for j, members in enumerate(groups) for n in members}
    last = len(groups) - 1
    reach: dict[fx.Node, set[int]] = {}
    for members in reversed(groups):  # reverse graph order: users first
        for n in reversed(members):
            if n not in static:
                continue
            out: set[int] = set()
            for u in n.users:
                out |= reach.get(u, set()) if u in static and u in group_of else {group_of.get(u, last)}
            reach[n] = out
    hoisted = {n for n, r in reach.items() if len(r) > 1}
    sunk = {n: next(iter(r)) for n, r in reach.items() if len(r) == 1 and next(iter(r)) != group_of[n]}
    for n, r in reach.items():  # checks of hoisted values only (their inputs hoisted or inputs)
        if not r and n.all_input_nodes and all(a in hoisted or a not in group_of for a in n.all_input_nodes):
            hoisted.add(n)
    moved_in: dict[int, list[fx.Node]] = {}
    for n in (n for members in groups for n in members):
        if n in sunk and n not in hoisted:
            moved_in.setdefault(sunk[n], []).append(n)
    out_groups = []
    for j, members in enumerate(groups):
        kept = [n for n in members if n not in hoisted and (n not in sunk or n in hoisted)]
        out_groups.append(moved_in.get(j, []) + kept)
    return out_groups, [n for members in groups for n in members if n in hoisted]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
