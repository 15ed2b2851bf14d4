"""Node-level memory model of a training step over any DAG (``docs/design.md`` §4).

Experimental (not part of the stable API). The chain model (:mod:`ckptopt.simulator`) cuts a graph only where one tensor
crosses. Here a plan may cut before *any* node of the topological order:
several tensors cross, a segment reads several earlier tensors and hands on
several. :func:`simulate_dag` replays one training step node by node with
reference-counted storages and returns its peak. It is torch-free; the
torch side (:func:`ckptopt.experimental.nodes.trace_dag`) fills the
:class:`DagCosts` by measuring every node on fake tensors.

Note: the holding rule (``docs/design.md`` §4, measured)
-------------------------------------------------------
Every segment but the last (which holds the loss) is wrapped in a
non-reentrant ``checkpoint(fn, *inputs)``. A storage is alive while one of
these references it:

* **Python** (the forward): from its creation until its last consumer inside
  its segment, or inside the unwrapped last segment, has run; when a later
  checkpointed segment reads it, until that segment's forward has finished
  (``checkpoint(fn, *inputs)`` keeps its arguments for the whole call). The
  model output lives until the loss has run, the loss through the backward.
* **an unwrapped node** that saves it, from that node's forward until its
  backward has run;
* **a checkpointed segment that saves at least one tensor** holds all its
  inputs (the checkpoint frame), until the backward of its earliest saving
  node has run; a segment that saves nothing holds nothing;
* **a recomputation**: when the backward first reaches a saving node of a
  checkpointed segment, the segment's forward is re-run from its start up to
  the last saved tensor of its last saving node (``fs``); each recomputed
  storage a node of the segment saves lives until that node's backward,
  the other recomputed tensors die as in a forward;
* **gradients**: the gradient of a node's output exists from the backward of
  its first (highest-numbered) consumer until its own backward has run; an
  input gradient either is a new storage or shares the output gradient's
  (``add``, views, ``cat``), and a second contribution is added out of place
  (a new buffer, then the two parts die). Parameter gradients persist.

The peak is checked at every node's forward (live + ``f``, or ``fs`` where a
recomputation stops), at every backward (live, with the output gradient,
+ ``b``) and at every out-of-place gradient sum. The backward runs in
reverse topological order (the CPU autograd engine's order for these
graphs).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from ..errors import InvalidPlan, ProblemTooLarge
from ..plan import segment_bounds

__all__ = ["DagNode", "DagCosts", "DagResult", "NodePlan", "simulate_dag",
           "brute_force_dag", "local_search_dag"]


@dataclass(frozen=True)
class DagNode:
    """Measured memory behaviour of one graph node (one FX node, or the loss).

    Attributes
    ----------
    name : str
    inputs : tuple of int
        Producer node index of each tensor input that an earlier node
        computes (model inputs, parameters and buffers are static and left out).
    out_bytes : int
        Bytes of the new storage of its output (0 when the output aliases an
        input, see ``alias``, or is not a tensor).
    alias : int
        Position in ``inputs`` whose storage the output shares (a view or an
        in-place op), or -1.
    grad_bytes : int
        Bytes of the output's gradient (0 when the output needs none).
    saves_inputs : tuple of int
        Positions in ``inputs`` whose storage autograd saves.
    saves_output : bool
        The output's storage is saved.
    extra : int
        Bytes of every other storage it saves (statistics, masks).
    f, fs, b : int
        Forward transient (peak above what is live before it runs), the same
        up to its last saved tensor, and backward transient (peak above what
        is live when its backward starts, output gradient included in the
        live part: input gradients, new parameter gradients, scratch).
    input_grads : tuple of int
        Per input: 0 no gradient, 1 a new storage, 2 the output gradient's
        storage (shared).
    param_grad : int
        Bytes of the parameter gradients its backward creates (they persist).
    hook_bytes : int
        Bytes the rewriter's BatchNorm hook copies when the node is
        recomputed (``num_batches_tracked``, 8 per BatchNorm), held until the
        node's forward ends, or until the end of the step when the
        recomputation stops inside it (docs/design.md §6).
    """

    name: str
    inputs: tuple[int, ...] = ()
    out_bytes: int = 0
    alias: int = -1
    grad_bytes: int = 0
    saves_inputs: tuple[int, ...] = ()
    saves_output: bool = False
    extra: int = 0
    f: int = 0
    fs: int = 0
    b: int = 0
    input_grads: tuple[int, ...] = ()
    param_grad: int = 0
    hook_bytes: int = 0

    @property
    def saves(self) -> bool:
        return bool(self.saves_inputs) or self.saves_output or self.extra > 0


@dataclass
class DagCosts:
    """The node-level cost model of a traced model.

    Attributes
    ----------
    nodes : list of DagNode
        In topological order; the last one is the loss.
    static : int
        Parameters, buffers and model inputs.
    cuttable : tuple of int
        Positions ``k`` (1 <= k < len(nodes)) where a cut before node ``k`` is
        allowed (a view or in-place op stays with the tensor it aliases).
    """

    nodes: list[DagNode]
    static: int = 0
    cuttable: tuple[int, ...] = field(default=())

    @property
    def n(self) -> int:
        return len(self.nodes)

    def to_json(self) -> str:
        return json.dumps(dict(format="ckptopt.DagCosts", version=1, static=self.static,
                               cuttable=list(self.cuttable), nodes=[asdict(v) for v in self.nodes]))

    @classmethod
    def from_json(cls, text: str) -> "DagCosts":
        d = json.loads(text)
        nodes = [DagNode(**{k: tuple(v) if isinstance(v, list) else v for k, v in nd.items()})
                 for nd in d["nodes"]]
        return cls(nodes, int(d["static"]), tuple(d["cuttable"]))


@dataclass(frozen=True)
class NodePlan:
    """A node-level plan: the positions where a new segment starts.

    Attributes
    ----------
    cuts : tuple of int
        Sorted positions ``k`` (a segment starts at node ``k``); a cut at the
        loss (``n - 1``) checkpoints every model segment.
    n : int
        Number of nodes of the :class:`DagCosts` (the loss included).
    peak_bytes : int
        Its simulated peak.
    solver : str
    """

    cuts: tuple[int, ...]
    n: int
    peak_bytes: int = 0
    solver: str = "given"


@dataclass(frozen=True)
class DagResult:
    """What :func:`simulate_dag` returns: the peak and where it happens."""

    peak_bytes: int
    phase: str  # "forward", "recompute", "backward" or "grad-sum"
    node: int


def _check_cuts(costs: DagCosts, cuts: Iterable[int]) -> tuple[int, ...]:
    cuts = tuple(int(c) for c in cuts)
    allowed = set(costs.cuttable)
    if list(cuts) != sorted(set(cuts)):
        raise InvalidPlan(f"cuts must be strictly increasing positions, got {cuts}")
    bad = [c for c in cuts if c not in allowed]
    if bad:
        raise InvalidPlan(f"cuts {bad} are not allowed positions; allowed: {sorted(allowed)} "
                          "(a view or in-place op must stay in the segment of the tensor it aliases)")
    return cuts


class _Replay:
    """Reference-counted storages and the running peak of one simulated step."""

    def __init__(self, base: int):
        self.live = base
        self.peak = base
        self.where = ("forward", 0)
        self.refs: dict[object, int] = {}
        self.size: dict[object, int] = {}

    def check(self, extra: int, phase: str, node: int) -> None:
        if self.live + extra > self.peak:
            self.peak = self.live + extra
            self.where = (phase, node)

    def new(self, key, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self.size[key] = nbytes
        self.refs[key] = 1
        self.live += nbytes

    def ref(self, key) -> None:
        if key in self.refs:
            self.refs[key] += 1

    def unref(self, key) -> None:
        if key not in self.refs:
            return
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.size.pop(key)


def simulate_dag(costs: DagCosts, cuts: Sequence[int] = ()) -> DagResult:
    """Peak bytes of one training step with segments starting at ``cuts``.

    Parameters
    ----------
    costs : DagCosts
    cuts : sequence of int
        Positions where a segment starts (see :class:`NodePlan`); every
        segment but the last is checkpointed.

    Returns
    -------
    DagResult

    Raises
    ------
    InvalidPlan
        A cut is not increasing or not in ``costs.cuttable``.

    Notes
    -----
    Follows the holding rule of the module docstring. Running time
    O(n * (e + s)) for n nodes, e edges and s the longest segment.
    """
    cuts = _check_cuts(costs, cuts)
    nodes = costs.nodes
    n = len(nodes)
    bounds = segment_bounds(n, cuts)
    seg_of = [0] * n
    for k, (l, r) in enumerate(bounds):
        for i in range(l, r + 1):
            seg_of[i] = k
    last_seg = len(bounds) - 1
    root = _roots(nodes)
    sim = _Replay(costs.static)
    consumers = _consumers(nodes)
    py_end = _python_ends(nodes, consumers, bounds, seg_of)
    frames = _frames(nodes, bounds, last_seg)

    # ---- forward -----------------------------------------------------------
    drops: dict[int, list[int]] = {}
    for t, end in enumerate(py_end[:-1]):  # the loss itself stays referenced through the backward
        drops.setdefault(end, []).append(t)
    for i, v in enumerate(nodes):
        k = seg_of[i]
        if i == bounds[k][0] and k in frames:
            for s in frames[k][1]:
                sim.ref(("f", s))
        sim.check(v.f, "forward", i)
        if v.alias >= 0:
            sim.ref(("f", root[i]))
        else:
            sim.new(("f", i), v.out_bytes)
        if k == last_seg:  # unwrapped: the node keeps what it saves
            for s in _saved_roots(v, i, root):
                sim.ref(("f", s))
            sim.new(("x", i), v.extra)
        for t in drops.get(i, ()):
            sim.unref(("f", root[t]))

    # ---- backward ----------------------------------------------------------
    grads: dict[int, object] = {}  # node -> key of its output gradient storage
    sim.new(("seed",), nodes[-1].grad_bytes)  # loss.backward() seeds the loss's gradient,
    sim.ref(("seed",))  # which torch.autograd.backward's frame holds until the end
    grads[n - 1] = ("seed",)
    recomputed: set[int] = set()
    for i in range(n - 1, -1, -1):
        if i not in grads:
            continue  # no gradient reaches it: autograd never runs its backward
        v = nodes[i]
        k = seg_of[i]
        if k != last_seg and v.saves and k not in recomputed:
            recomputed.add(k)
            _recompute(sim, nodes, bounds[k], root, consumers)
        sim.check(v.b, "backward", i)
        out_grad = grads.pop(i)
        new_grads = []
        for p, kind in enumerate(v.input_grads):
            if kind == 1:
                key = ("g", i, p)
                sim.new(key, nodes[v.inputs[p]].grad_bytes)
                new_grads.append((v.inputs[p], key))
            elif kind == 2 and out_grad is not None:
                sim.ref(out_grad)
                new_grads.append((v.inputs[p], out_grad))
        sim.live += v.param_grad
        # release: the output gradient, the saved tensors, the frame
        if out_grad is not None:
            sim.unref(out_grad)
        if k == last_seg:
            for s in _saved_roots(v, i, root):
                sim.unref(("f", s))
            sim.unref(("x", i))
        else:
            for s in _saved_roots(v, i, root, recompute=bounds[k]):
                sim.unref(s)
            sim.unref(("rx", i))
            if k in frames and frames[k][0] == i:
                for s in frames[k][1]:
                    sim.unref(("f", s))
        for producer, key in new_grads:
            _accumulate(sim, grads, producer, key, i, nodes[producer].grad_bytes)
    phase, node = sim.where
    return DagResult(int(sim.peak), phase, int(node))


def _roots(nodes: list[DagNode]) -> list[int]:
    """The node whose storage each node's output lives in (itself, or what it aliases)."""
    root = list(range(len(nodes)))
    for i, v in enumerate(nodes):
        if v.alias >= 0:
            root[i] = root[v.inputs[v.alias]]
    return root


def _consumers(nodes: list[DagNode]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in nodes]
    for i, v in enumerate(nodes):
        for t in set(v.inputs):
            out[t].append(i)
    return out


def _python_ends(nodes, consumers, bounds, seg_of) -> list[int]:
    """After which node's forward Python drops each node's output."""
    n = len(nodes)
    ends = []
    for t in range(n):
        end = t
        for c in consumers[t]:
            if seg_of[c] == seg_of[t] or seg_of[c] == len(bounds) - 1:
                end = max(end, c)  # dropped after its last consumer (the unwrapped segment too)
            else:  # a later checkpointed segment keeps its inputs for its whole forward
                end = max(end, bounds[seg_of[c]][1])
        ends.append(end)
    return ends


def _frames(nodes, bounds, last_seg) -> dict[int, tuple[int, list[int]]]:
    """Checkpointed segments that save something: (earliest saving node, input roots)."""
    root = _roots(nodes)
    out = {}
    for k, (l, r) in enumerate(bounds):
        if k == last_seg:
            continue
        savers = [i for i in range(l, r + 1) if nodes[i].saves]
        if not savers:
            continue
        ins = sorted({root[t] for i in range(l, r + 1) for t in nodes[i].inputs if t < l})
        out[k] = (savers[0], ins)
    return out


def _saved_roots(v: DagNode, i: int, root: list[int], recompute: tuple[int, int] | None = None) -> list:
    """Storage keys node ``i`` saves (forward keys, or recomputed ones inside ``recompute``)."""
    keys = set()
    targets = [v.inputs[p] for p in v.saves_inputs] + ([i] if v.saves_output else [])
    for t in targets:
        s = root[t]
        if recompute is None:
            keys.add(s)
        else:
            keys.add(("r", s) if s >= recompute[0] else ("f", s))
    return sorted(keys, key=repr)


def _recompute(sim: _Replay, nodes, bound, root, consumers) -> None:
    """Re-run segment ``bound``'s forward up to its last saved tensor."""
    l, r = bound
    e = max(i for i in range(l, r + 1) if nodes[i].saves)

    def key(t):
        return ("r", root[t]) if root[t] >= l else ("f", root[t])

    held = set()  # recomputed values Python still references
    for j in range(l, e + 1):
        v = nodes[j]
        sim.new(("h", j), v.hook_bytes)  # the BatchNorm hook's copy of num_batches_tracked
        sim.check(v.fs if j == e else v.f, "recompute", j)
        computes = j < e or v.saves_output or v.extra > 0  # else it saves only inputs, packed first
        if computes:
            if v.alias >= 0:
                sim.ref(key(j))
            else:
                sim.new(("r", j), v.out_bytes)
            held.add(j)
            sim.new(("rx", j), v.extra)
        for s in _saved_roots(v, j, root, recompute=bound):
            sim.ref(s)
        if j == e:
            break  # stops inside node e: the hook's copy is only dropped after the backward
        sim.unref(("h", j))
        for t in sorted((set(v.inputs) | {j}) & held):
            if not any(j < c <= e for c in consumers[t]):
                held.discard(t)
                sim.unref(key(t))
    for t in sorted(held):  # the recomputation stops: its other values die
        sim.unref(key(t))


def _accumulate(sim: _Replay, grads: dict, producer: int, key, at: int, size: int) -> None:
    """Add a gradient contribution to ``producer``'s output gradient (out of place)."""
    old = grads.get(producer)
    if old is None:
        grads[producer] = key
        return
    total = ("g+", producer, at)
    sim.new(total, size)
    sim.check(0, "grad-sum", at)
    sim.unref(old)
    sim.unref(key)
    grads[producer] = total


def brute_force_dag(costs: DagCosts, limit: int = 16,
                    positions: Iterable[int] | None = None) -> list[tuple[tuple[int, ...], int]]:
    """Every plan over ``positions`` (default ``costs.cuttable``) with its simulated peak.

    Raises
    ------
    ProblemTooLarge
        More than ``limit`` cut positions (2**limit plans).
    """
    pos = sorted(costs.cuttable if positions is None else positions)
    if len(pos) > limit:
        raise ProblemTooLarge(f"{len(pos)} cut positions give 2**{len(pos)} plans; "
                              f"brute force is limited to {limit} positions")
    out = []
    for m in range(len(pos) + 1):
        for cuts in itertools.combinations(pos, m):
            out.append((cuts, simulate_dag(costs, cuts).peak_bytes))
    return out


def local_search_dag(costs: DagCosts, start: Iterable[int] = (), max_passes: int = 100,
                     shifts: int = 2) -> tuple[tuple[int, ...], int]:
    """A node-level plan found by descent from ``start``: (cuts, simulated peak).

    Each pass tries every single move (add or remove one cut, or move one cut
    by up to ``shifts`` allowed positions) and takes the best that lowers the
    simulated peak (ties: fewer cuts); it stops when none does. A heuristic,
    not an optimum: it gives an upper bound on the node-level optimum, which
    the benchmarks compare with brute force where brute force is feasible.

    Notes
    -----
    Each pass costs O(c) simulations for c allowed positions.
    """
    pos = list(costs.cuttable)
    index = {p: k for k, p in enumerate(pos)}
    cur = tuple(sorted(start))
    best = simulate_dag(costs, cur).peak_bytes
    for _ in range(max_passes):
        cand = set()
        for p in pos:
            cand.add(tuple(sorted(set(cur) ^ {p})))
        for c in cur:
            for d in range(-shifts, shifts + 1):
                k = index[c] + d
                if d and 0 <= k < len(pos) and pos[k] not in cur:
                    cand.add(tuple(sorted((set(cur) - {c}) | {pos[k]})))
        scored = min((simulate_dag(costs, c).peak_bytes, len(c), c) for c in cand)
        if (scored[0], scored[1]) >= (best, len(cur)):
            break
        best, cur = scored[0], scored[2]
    return cur, int(best)
