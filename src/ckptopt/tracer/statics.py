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
from .capture.blocks import BlockCall
from .capture.functions import is_opaque_function

__all__ = ["static_nodes", "param_views", "place_statics", "is_random"]

_RANDOM = re.compile(r"dropout|rand|bernoulli|normal|multinomial|rrelu|uniform|exponential|poisson|cauchy|"
                     r"geometric")


def is_random(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether running ``n`` draws random numbers (dropout, ``randn``...), looking inside
    submodules and the subgraphs of higher-order ops."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if isinstance(mod, BlockCall):  # an exported block's operations, read inside the block
            return any(is_random(mod.block, x) for x in mod.graph.nodes)
        if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in mod.modules()):
            return True
        return isinstance(mod, fx.GraphModule) and any(is_random(mod, x) for x in mod.graph.nodes)
    if n.op not in ("call_function", "call_method"):
        return False
    if is_opaque_function(n.target):
        return True  # a model's own autograd.Function, kept whole: what it draws cannot be seen
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
    inputs, attributes (buffers, constants; not parameters, even frozen ones), or computed by
    deterministic ops from static values."""
    static: set[fx.Node] = set()
    # a frozen parameter is no static *input*: what the graph computes from it (the hidden states of a
    # frozen embedding and frozen projections, under LoRA) is activation memory, freed after its use
    for n in gm.graph.nodes:
        if n.op == "output" or any(t.requires_grad for t in tensor_leaves(values.get(n))):
            continue
        if n.op == "placeholder" or (n.op == "get_attr" and not isinstance(_attr(gm, n.target), nn.Parameter)):
            static.add(n)
        elif n.op != "get_attr" and all(a in static for a in n.all_input_nodes) and not is_random(gm, n):
            static.add(n)
    return _unwritten(gm, values, static)


def _unwritten(gm: fx.GraphModule, values: dict[fx.Node, Any], static: set[fx.Node]) -> set[fx.Node]:
    """``static`` less the values an op that is not static writes in place (PEGASUS-X fills a static
    ``zeros`` with the sines of positions computed from the embeddings' length): such a storage holds
    what the model computes, where it computes it, and so does everything computed from it."""
    from .cuts import mutated_args

    ops = [n for n in gm.graph.nodes if n not in static and n.op in ("call_function", "call_method", "call_module")]
    written = [values[a] for n in ops for a in mutated_args(gm, n) if a in static and tensor_leaves(values.get(a))]
    if not written:
        return static
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n not in static:
            continue
        if n.op in ("placeholder", "get_attr"):
            out.add(n)  # an input or buffer written in place: the writer is the model's own update
        elif all(a in out for a in n.all_input_nodes) and not any(
                _aliases(v, w) for v in tensor_leaves(values.get(n)) for w in written):
            out.add(n)
    return out


def param_views(gm: fx.GraphModule, values: dict[fx.Node, Any]) -> set[fx.Node]:
    """Op nodes that only view a parameter or buffer (``weight.T``, a reshape of a weight): their
    storage is the parameter's, static memory, so they never cross a cut as an activation. They
    are placed like static values (:func:`place_statics`): in the one layer that reads them, or
    computed once before the first layer when several do (a view costs no memory)."""
    import torch

    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method") or not n.all_input_nodes:
            continue
        v = values.get(n)
        if not isinstance(v, torch.Tensor):
            continue
        ins = [a for a in n.all_input_nodes]
        if all(a.op == "get_attr" or a in out for a in ins) and any(
                isinstance(values.get(a), torch.Tensor) and torch._C._is_alias_of(v, values[a]) for a in ins) \
                and not is_random(gm, n):
            out.add(n)
    return out


def place_statics(groups: list[list[fx.Node]], static: set[fx.Node],
                  values: dict[fx.Node, Any]) -> tuple[list[list[fx.Node]], list[fx.Node]]:
    """Where each static op node runs: ``(groups, hoisted)``.

    A static value that reaches (directly or through other static nodes) one layer only
    moves into that layer, where the unmodified model computes it too (position ids read by
    one embedding, labels shifted for the loss): the layer's measurement counts it. One that
    reaches several layers (an attention mask read by every block) is hoisted: computed once
    before the first layer, counted as static bytes for the step.

    Static nodes that share a storage (a value, its views and the in-place ops that fill it:
    ``new_zeros`` then ``copy_`` into a slice of it, as labels are shifted into decoder
    inputs) move together, so that every write precedes every read; a static node that
    reaches no layer (an assertion on a static value) runs where the last of its inputs
    runs, or with its static users when they went elsewhere (hoisted if they went to several
    places). Each static node thus runs after its static inputs, wherever they went.
    In graph order.
    """
    group_of = {n: j for j, members in enumerate(groups) for n in members}
    ordered = [n for members in groups for n in members]
    clusters = _StaticClusters.of(ordered, static, values)
    reach = _layers_reached(clusters, group_of, len(groups) - 1)
    dest = _destinations(clusters, reach, ordered, group_of)
    _follow_static_users(clusters, reach, dest)
    hoisted = [n for n in ordered if n in clusters and dest[clusters.find(n)] == -1]
    return _moved_into_groups(groups, ordered, clusters, dest), hoisted


class _StaticClusters:
    """The static op nodes, in clusters that move together (union-find): the nodes over one
    storage, and the nodes of one vmap region."""

    def __init__(self, nodes: list[fx.Node]):
        self.parent: dict[fx.Node, fx.Node] = {n: n for n in nodes}
        self.members: dict[fx.Node, list[fx.Node]] = {}  # a cluster's root -> its nodes, in graph order

    @classmethod
    def of(cls, ordered: list[fx.Node], static: set[fx.Node], values: dict[fx.Node, Any]) -> _StaticClusters:
        """The clusters of the static nodes among ``ordered`` (the nodes of the layers, in order)."""
        clusters = cls([n for n in ordered if n in static])
        for n in clusters.parent:
            outs = tensor_leaves(values.get(n))
            for a in n.all_input_nodes:
                if a in clusters and any(_aliases(o, t) for o in outs for t in tensor_leaves(values.get(a))):
                    clusters.join(n, a)
        # NB: a vmap region (transformers builds masks with nested vmaps) runs whole: its nesting
        # calls carry no tensor, and a cut inside it would leave a vmap level open across layers
        placed = set(ordered)
        for region in _nesting_regions(ordered):
            region = [n for n in region if n in placed]  # (not the get_attr nodes of the vmapped function)
            if region and all(n in clusters for n in region):
                for n in region[1:]:
                    clusters.join(n, region[0])
        for n in clusters.parent:
            clusters.members.setdefault(clusters.find(n), []).append(n)
        return clusters

    def __contains__(self, n: fx.Node) -> bool:
        return n in self.parent

    def find(self, n: fx.Node) -> fx.Node:
        """The root of ``n``'s cluster."""
        parent = self.parent
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def join(self, n: fx.Node, a: fx.Node) -> None:
        """One cluster of ``n``'s and ``a``'s (``a``'s root its root)."""
        self.parent[self.find(n)] = self.find(a)


def _layers_reached(clusters: _StaticClusters, group_of: dict[fx.Node, int], last: int) -> dict[fx.Node, set[int]]:
    """The layers each cluster's value reaches, through its users outside the cluster: a static user
    passes on what it reaches; a user outside the groups (the graph's output) counts as the last
    layer. A fixpoint, since a cluster spans several graph positions."""
    find = clusters.find
    reach: dict[fx.Node, set[int]] = {c: set() for c in clusters.members}
    changed = True
    while changed:
        changed = False
        for c, members in clusters.members.items():
            out = set(reach[c])
            for n in members:
                for u in n.users:
                    if u in clusters:
                        if find(u) is not c:
                            out |= reach[find(u)]
                    else:
                        out.add(group_of.get(u, last))
            if out != reach[c]:
                reach[c] = out
                changed = True
    return reach


def _destinations(clusters: _StaticClusters, reach: dict[fx.Node, set[int]], ordered: list[fx.Node],
                  group_of: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Each cluster's place: -1 hoisted (it reaches several layers), else a group index (the one
    layer it reaches). A cluster reaching no layer goes where the last of its static inputs goes
    (clusters are placed in graph order, so its inputs are placed first), or, with none, where
    its first node is."""
    find = clusters.find
    dest: dict[fx.Node, int] = {}
    for n in ordered:
        if n not in clusters or find(n) in dest:
            continue
        c = find(n)
        r = reach[c]
        if len(r) > 1:
            dest[c] = -1
        elif r:
            dest[c] = next(iter(r))
        else:
            members = clusters.members[c]
            inputs = [find(a) for m in members for a in m.all_input_nodes if a in clusters and find(a) is not c]
            placed = [dest[i] for i in inputs if i in dest]
            dest[c] = max(placed) if placed else min(group_of[m] for m in members)
    return dest


def _follow_static_users(clusters: _StaticClusters, reach: dict[fx.Node, set[int]],
                         dest: dict[fx.Node, int]) -> None:
    """Move each cluster that reaches no layer to its static users when they went elsewhere: to
    their place when it is one and later than its own (its static inputs still run before it),
    else hoisted. Such a cluster's value is passed to no layer, so a user placed in another layer
    reads it only if it runs there too, or before the first layer."""
    find = clusters.find
    changed = True
    while changed:
        changed = False
        for c, members in clusters.members.items():
            if reach[c] or dest[c] == -1:
                continue
            targets = {dest[find(u)] for n in members for u in n.users if u in clusters and find(u) is not c}
            targets.discard(dest[c])
            if targets:
                dest[c] = next(iter(targets)) if len(targets) == 1 and min(targets) > dest[c] else -1
                changed = True


def _moved_into_groups(groups: list[list[fx.Node]], ordered: list[fx.Node], clusters: _StaticClusters,
                       dest: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """The layers' groups with each static node in its cluster's place (none where hoisted), in
    graph order."""
    moved: dict[int, list[fx.Node]] = {}
    for n in ordered:
        if n in clusters and dest[clusters.find(n)] >= 0:
            moved.setdefault(dest[clusters.find(n)], []).append(n)
    out_groups = []
    for j, members in enumerate(groups):
        # the static nodes placed here, in graph order, then the layer's own nodes
        out_groups.append(moved.get(j, []) + [n for n in members if n not in clusters])
    return _in_graph_order(out_groups)


def _nesting_regions(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The nodes of each outermost vmap region (``_vmap_increment_nesting`` to the matching
    ``_vmap_decrement_nesting``), in graph order."""
    if not nodes or nodes[0].graph is None:
        return []
    regions: list[list[fx.Node]] = []
    depth, cur = 0, []
    for n in nodes[0].graph.nodes:
        name = getattr(n.target, "__name__", "")
        if name == "_vmap_increment_nesting":
            depth += 1
        if depth:
            cur.append(n)
        if name == "_vmap_decrement_nesting" and depth:
            depth -= 1
            if not depth:
                regions.append(cur)
                cur = []
    return regions


def _in_graph_order(groups: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Each group's nodes in the graph's order (moved static nodes among the layer's own)."""
    pos: dict[fx.Node, int] = {}
    for members in groups:
        for n in members:
            if n.graph is not None and n not in pos:
                pos[n] = -1
    if not pos:
        return groups
    graph = next(iter(pos)).graph
    for k, n in enumerate(graph.nodes):
        pos[n] = k
    return [sorted(members, key=pos.__getitem__) for members in groups]


def _aliases(a: Any, b: Any) -> bool:
    import torch

    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a is b or torch._C._is_alias_of(a, b))


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
