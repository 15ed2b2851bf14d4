"""What crosses each layer boundary: the chain tensor and the side tensors (docs/design.md §4).

Once the cuts are chosen (:func:`ckptopt.tracer.cuts.candidate_groups`), every tensor a layer
computes that a later layer reads crosses the boundaries in between. At each boundary one
of them may be the *chain tensor* ``x_{i-1}``: computed by the layer before the boundary and
read by the layer after it only (the largest, when several qualify). Every other crossing
tensor is a *side tensor* (:class:`ckptopt.costs.SideTensor`): its producer, the layers that
read it (the model's outputs count as read by the last layer, which returns them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..storages import storage_identity, storage_nbytes
from ..torch_utils import tensor_leaves

__all__ = ["LayerIO", "Crossings", "find_crossings", "merge_aliased", "merge_outputless"]


@dataclass
class LayerIO:
    """One layer's tensors from and to other layers.

    ``main_in``/``main_out``: the chain tensor entering / leaving it (None: none crosses
    that boundary); ``side_in``/``side_out``: indices into :attr:`Crossings.nodes`.
    """

    main_in: fx.Node | None = None
    main_out: fx.Node | None = None
    side_in: list[int] = field(default_factory=list)
    side_out: list[int] = field(default_factory=list)


@dataclass
class Crossings:
    """The layers' inputs and outputs, and the side tensors (node, producer, consumers)."""

    io: list[LayerIO]
    nodes: list[fx.Node]
    producer: list[int]
    consumers: list[tuple[int, ...]]


def _crossing(groups: list[list[fx.Node]], static: set[fx.Node], values: dict,
              out_node: fx.Node) -> tuple[dict[fx.Node, int], dict[fx.Node, tuple[int, ...]]]:
    """Per tensor node read by a later group: its group, and the later groups reading it."""
    group_of = {n: j for j, members in enumerate(groups) for n in members}
    last = len(groups) - 1
    readers: dict[fx.Node, set[int]] = {}
    for n, j in group_of.items():
        if n in static or not tensor_leaves(values.get(n)):
            continue
        later = set()
        for u in n.users:
            k = group_of.get(u, last if u is out_node else None)
            if k is not None and k != j:
                later.add(k)
        if later:
            readers[n] = later
    return group_of, {n: tuple(sorted(r)) for n, r in readers.items()}


def find_crossings(groups: list[list[fx.Node]], static: set[fx.Node], values: dict,
                   out_node: fx.Node) -> Crossings:
    """The chain tensor of every boundary and the side tensors, in graph order."""
    group_of, readers = _crossing(groups, static, values, out_node)
    io = [LayerIO() for _ in groups]
    chain: set[fx.Node] = set()
    producing = {group_of[n] for n in readers}
    for b in range(1, len(groups)):
        if io[b].main_in is not None:  # (carried through a pass-through layer)
            continue
        candidates = []
        for n in groups[b - 1]:
            if not isinstance(values.get(n), torch.Tensor) or not values[n].requires_grad or n not in readers:
                continue  # (the chain tensor carries a gradient; one that needs none is a side tensor)
            # read by layer b only, or by b..q where b..q-1 compute nothing later layers read and
            # so hand it on (a layer of dead ops: its output is its input, as on a plain chain)
            q = b
            while q < max(readers[n]) and q not in producing and q < len(groups) - 1:
                q += 1
            if readers[n][0] >= b and max(readers[n]) == q:
                candidates.append((n, q))
        if candidates:
            # a tensor layer b computes with comes before one only returned to the caller (the logits
            # beside a loss scalar that a last layer divides), then the largest (the first of those)
            best, q = max(candidates, key=lambda c: (any(group_of.get(u) == c[1] for u in c[0].users),
                                                     storage_nbytes(values[c[0]])))
            for k in range(b, q + 1):
                io[k - 1].main_out = io[k].main_in = best
            chain.add(best)
    nodes, producer, consumers = [], [], []
    for members in groups:
        for n in members:
            if n in readers and n not in chain:
                j = len(nodes)
                nodes.append(n)
                producer.append(group_of[n])
                consumers.append(readers[n])
                io[group_of[n]].side_out.append(j)
                for k in readers[n]:
                    io[k].side_in.append(j)
    return Crossings(io, nodes, producer, consumers)


def merge_aliased(groups: list[list[fx.Node]], static: set[fx.Node], values: dict, out_node: fx.Node,
                  always: bool) -> list[list[fx.Node]]:
    """Join the two layers around a boundary where a crossing tensor shares its storage with one
    crossing the boundary before (a layer that hands on a view of its input, an assertion, a cast
    to the same dtype: no layer). ``always``: check every boundary; otherwise only those that
    several tensors cross (a single-tensor FX chain is left as the tracer always cut it)."""
    while True:
        _, readers = _crossing(groups, static, values, out_node)
        group_of = {n: j for j, members in enumerate(groups) for n in members}
        live: list[list[tuple[fx.Node, Any]]] = [[] for _ in range(len(groups) + 1)]
        for n, later in readers.items():
            for b in range(group_of[n] + 1, max(later) + 1):
                live[b].extend((n, t) for t in tensor_leaves(values.get(n)))
        merge = None
        for b in range(2, len(groups)):
            if not always and len(live[b]) < 2 and len(live[b - 1]) < 2:
                continue
            before = {n for n, _ in live[b - 1]}
            after = {n for n, _ in live[b]}
            # the layer between only hands storages on: everything it adds to what crosses is (or
            # views) a tensor that crossed the boundary before and stops there (a same-dtype cast,
            # an assertion, a view). A layer that also computes something is a layer.
            new = [x for n, x in live[b] if n not in before]
            handed = [y for m, y in live[b - 1] if m not in after]
            if new and handed and all(any(x is y or torch._C._is_alias_of(x, y) for y in handed) for x in new):
                merge = b
                break
        if merge is None:
            return groups
        groups = groups[: merge - 1] + [groups[merge - 1] + groups[merge]] + groups[merge + 1:]


def merge_outputless(groups: list[list[fx.Node]], static: set[fx.Node], values: dict,
                     out_node: fx.Node) -> list[list[fx.Node]]:
    """Join a layer that hands nothing to a later one (a dead branch cut off on its own) to the
    next layer: a boundary nothing is computed for is no boundary."""
    group_of, readers = _crossing(groups, static, values, out_node)
    # a layer that hands on only views of storages made before it (the model input unsqueezed beside
    # dead ops) makes nothing for a later layer: kept, its output would count a storage the static bytes
    # (or the boundary before) count already (tests/common/regressions.py case
    # layer-hands-on-a-view-of-the-input)
    made_in: dict[Any, int] = {}
    for n, v in values.items():  # (inputs, parameters, static values: made before any layer)
        if n not in group_of and (n in static or n.op in ("placeholder", "get_attr")):
            for t in tensor_leaves(v):
                made_in.setdefault(storage_identity(t), -1)
    for j, members in enumerate(groups):
        for n in members:
            for t in tensor_leaves(values.get(n)):
                made_in.setdefault(storage_identity(t), j)
    producing = {j for j, members in enumerate(groups)
                 if any(n in readers and any(made_in.get(storage_identity(t), j) == j
                                             for t in tensor_leaves(values.get(n))) for n in members)}
    # a layer some later layer reads anything of, a static value included (the rotary tables a
    # pass-through layer computes from the positions)
    last = len(groups) - 1
    read_later = {j for j, members in enumerate(groups)
                  if any(group_of.get(u, last if u is out_node else None) not in (None, j)
                         for n in members for u in n.users)}
    crossing: list[set[fx.Node]] = [set() for _ in range(len(groups) + 1)]
    for n, later in readers.items():
        for b in range(group_of[n] + 1, max(later) + 1):
            crossing[b].add(n)
    out: list[list[fx.Node]] = []
    carry: list[fx.Node] = []
    for j, members in enumerate(groups):
        # kept: a layer that one tensor enters and leaves (only it crossing either boundary), the
        # single-tensor chain's pass-through layer, which find_crossings hands it through, when it
        # computes something a later layer reads (a static value) or no tensor at all (an export
        # graph's metadata assertions). One whose tensors nothing reads (dead ops) joins the next
        # layer: kept, its output would be its input, one tensor counted twice where the layer before
        # keeps it and the next saves it (tests/common/regressions.py cases dead-ops-beside-a-passed-tensor
        # and dead-only-layer)
        dead_ops = j not in read_later and any(tensor_leaves(values.get(n)) for n in members)
        through = j > 0 and len(crossing[j]) == 1 and crossing[j] == crossing[j + 1] and not carry and not dead_ops
        if through:  # ... and it is the chain tensor up to the next layer that computes something
            (n,) = crossing[j]
            q = next((k for k in range(j + 1, len(groups)) if k in producing), len(groups) - 1)
            through = max(readers[n]) <= q
        if j < len(groups) - 1 and j not in producing and not through:
            carry = carry + members
            continue
        out.append(carry + members)
        carry = []
    return out
