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
* after the cuts are chosen, :func:`hoisted_nodes` picks those whose value is read
  outside the layer that computes it, with their static ancestors. The rewriter
  computes them once before the first segment, and the cost model counts them as
  static bytes for the whole step. A static value used only inside its own layer
  stays in that layer (and is measured with it).
"""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..torch_utils import tensor_leaves

__all__ = ["static_nodes", "hoisted_nodes", "is_random"]

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


def hoisted_nodes(groups: list[list[fx.Node]], static: set[fx.Node], values: dict[fx.Node, Any]) -> list[fx.Node]:
    """The static op nodes to compute once before the first layer: those with a tensor value read
    outside the group that computes them (the model output counts as the last group), with the
    static op nodes they are computed from. In graph order."""
    group_of = {n: j for j, members in enumerate(groups) for n in members}
    last = len(groups) - 1
    need: set[fx.Node] = set()
    for n, j in group_of.items():
        if n in static and tensor_leaves(values.get(n)):
            if any(group_of.get(u, last) != j for u in n.users):
                need.add(n)
    stack = list(need)
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in group_of and a in static and a not in need:
                need.add(a)
                stack.append(a)
    return [n for members in groups for n in members if n in need]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
