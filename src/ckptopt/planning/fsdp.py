"""One rank of FSDP2: sharded parameters, gathered blocks, prefetches and reduce-scatters.

``fully_shard`` on each repeated block (a *unit*) and on the root (every other parameter),
PyTorch 2.13's defaults (``reshard_after_forward=True`` for the blocks; the root keeps its
parameters gathered from its forward to the end of its backward). Under mixed precision
(``Parallel.mixed_precision``) the traced costs are those of a copy in the compute dtype and the
gathered sizes are the parameters' in it (``ParamFacts.compute_nbytes``); shards, gradients and
reduce-scatters keep the model's own bytes (docs/design.md §13). What
one rank holds, measured with the exact tracker on a fake process group (every rank the same
to the byte) and on gloo (``docs/design.md`` §13):

* **sharded parameters**: each parameter is split along its first dimension, padded to a
  multiple of the world size: ``ceil(dim0 / W)`` rows per rank, one storage each;
* **a unit's all-gather**: a flat buffer and the gathered parameters, each ``W`` padded shards
  (``G_u``). In the forward (and in a recomputation) the flat buffer is kept until the next
  unit's gathered copy is made (FSDP2 defers its free to overlap the copy-out with the next
  all-gather), so a unit's forward holds ``2 G_u``, and the moment the next unit gathers holds
  both flat buffers; the gathered parameters are freed after the unit's forward;
* **backward**: a unit is gathered again when the gradient reaches its output
  (pre-backward), which also prefetches the unit before it (a flat buffer, ``G_{u-1}``, held
  until that unit's pre-backward); its parameters' gradients are computed at full size and
  held until the unit's backward ends (post-backward), which frees the gathered parameters,
  frees the previous unit's reduce-scatter input, copies the gradients into a new one
  (``W S_u``) and reduce-scatters it into the rank's sharded gradients (``S_u``, kept until
  ``zero_grad``);
* **recomputation** (activation checkpointing): a recomputed unit is gathered (in forward
  mode: its flat buffer kept until the next gather) and stays gathered until its own backward
  ends (FSDP2 does not reshard in a forward run inside the backward). A checkpointed segment
  that spans several units therefore holds every recomputed unit's parameters at once;
* **the optimizer** updates the local shards (a parameter's rows on this rank, unpadded):
  its state follows them.

The peak of a plan is computed event by event (:func:`fsdp_peak`) on the chain model's
timeline (:func:`ckptopt.simulator.simulate_timeline`), with the units' state walked
alongside. The solvers see a per-layer form of the same terms (:func:`fsdp_rank_costs`),
exact for plans whose checkpointed segments stay inside one unit and conservative for the
rest; the plan is chosen among candidates by the event-level peak.

No torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..costs import ChainCosts
from ..simulator import simulate_timeline
from .parallel import Parallel, ParamFacts, RankCosts, RankPeak

__all__ = ["FsdpShape", "FsdpRankCosts", "fsdp_shape", "fsdp_rank_costs", "fsdp_base", "fsdp_peak"]


@dataclass(frozen=True)
class FsdpShape:
    """The FSDP2 quantities of one rank, in bytes (units in forward order).

    ``spans[u] = (first, last)`` chain layers of unit ``u``; ``gathered[u]``: the unit's
    all-gather (flat buffer, and again its gathered parameters); ``grad_shard[u]``: its sharded
    gradients (the reduce-scatter output; ``world * grad_shard[u]`` is the reduce-scatter
    input); ``param_shard[u]``: its sharded parameters. ``root_*`` likewise for the root.
    ``opt_sizes``: the local bytes of every trainable parameter on the rank priced.
    ``model_end``: the last chain layer inside the model's forward (later layers: a loss
    computed outside the model).
    """

    world: int
    spans: tuple[tuple[int, int], ...]
    gathered: tuple[int, ...]
    grad_shard: tuple[int, ...]
    param_shard: tuple[int, ...]
    root_gathered: int
    root_grad_shard: int
    root_param_shard: int
    opt_sizes: tuple[int, ...]
    model_end: int


def fsdp_shape(facts: ParamFacts, parallel: Parallel, n_layers: int, model_end: int | None = None) -> FsdpShape:
    """The FSDP2 quantities of ``facts`` on ``parallel.world_size`` ranks."""
    W, r = parallel.world_size, parallel.rank
    U = len(facts.units)
    gathered, grad_shard, param_shard = [0] * (U + 1), [0] * (U + 1), [0] * (U + 1)  # [U]: the root
    opt = []
    for nbytes, cbytes, dim0, unit, trainable in zip(facts.nbytes, facts.compute_nbytes, facts.dim0, facts.unit,
                                                     facts.trainable):
        row = nbytes // max(dim0, 1)
        rows = math.ceil(dim0 / W)
        shard = rows * row
        u = unit if unit >= 0 else U
        gathered[u] += rows * (cbytes // max(dim0, 1)) * W  # (in the compute dtype under mixed precision)
        param_shard[u] += shard
        if trainable:
            grad_shard[u] += shard
            opt.append(max(0, min(rows, dim0 - r * rows)) * row)
    return FsdpShape(world=W, spans=tuple(facts.units), gathered=tuple(gathered[:U]),
                     grad_shard=tuple(grad_shard[:U]), param_shard=tuple(param_shard[:U]),
                     root_gathered=gathered[U], root_grad_shard=grad_shard[U], root_param_shard=param_shard[U],
                     opt_sizes=tuple(opt), model_end=n_layers - 1 if model_end is None else int(model_end))


def _unit_of(shape: FsdpShape, n: int) -> np.ndarray:
    owner = np.full(n, -1, dtype=np.int64)
    for u, (s, e) in enumerate(shape.spans):
        owner[s:e + 1] = u
    return owner


def fsdp_rank_costs(costs: ChainCosts, facts: ParamFacts, param_bytes: int, parallel: Parallel,
                    model_end: int | None = None) -> RankCosts:
    """The per-layer form the solvers see (see the module note); ``RankCosts.fsdp`` keeps the shape
    for :func:`fsdp_peak`."""
    shape = fsdp_shape(facts, parallel, costs.n, model_end)
    n, U = costs.n, len(shape.spans)
    owner = _unit_of(shape, n)
    p = np.asarray(costs.p, dtype=np.int64)
    G = shape.gathered
    sharded = sum(shape.param_shard) + shape.root_param_shard
    step_static = costs.static - param_bytes + sharded
    # forward: the unit's gathered parameters and its kept flat buffer; the root's layers hold the
    # flat buffer of the last gather until the model's forward ends
    fwd = np.zeros(n, dtype=np.int64)
    moment = np.zeros(n, dtype=np.int64)  # a unit's gather: the previous flat buffer is still held
    kept = shape.root_gathered
    for i in range(n):
        u = int(owner[i])
        if u >= 0:
            s, e = shape.spans[u]
            if i == s:
                moment[i] = kept
                kept = G[u]
            fwd[i] = 2 * G[u]
        else:
            fwd[i] = kept
        if i == shape.model_end:
            kept = 0
    # backward (also a recomputation inside a unit): the unit gathered, the previous unit's flat
    # buffer prefetched, the next unit's reduce-scatter input, the unit's full gradients so far
    bwd = np.zeros(n, dtype=np.int64)
    for i in range(n):
        u = int(owner[i])
        if u >= 0:
            s, e = shape.spans[u]
            later = int(p[i + 1:e + 1].sum())
            bwd[i] = G[u] + (G[u - 1] if u > 0 else 0) + (W_rs(shape, u + 1)) + later
        else:
            after_all = U > 0 and i > shape.spans[-1][1]
            before_all = U > 0 and i < shape.spans[0][0]
            bwd[i] = (G[U - 1] if after_all else 0) + (W_rs(shape, 0) if before_all else 0)
    rec = np.maximum(fwd, bwd)
    f = np.asarray(costs.f, dtype=np.int64)
    fs = np.asarray(costs.fs, dtype=np.int64)
    d = costs.to_dict()
    L = d["layers"]
    L["f"] = [int(x) for x in np.maximum(f, moment) + rec]
    L["fs"] = [int(x) for x in np.maximum(fs, moment) + rec]
    for k in ("ff", "ffs", "fc", "ffc"):  # (the same with the input dying at its last use, in a checkpoint)
        if L.get(k) is not None:
            L[k] = [int(x) for x in np.maximum(np.asarray(L[k], dtype=np.int64), moment) + rec]
    for k in ("b", "bk", "bf", "br", "bkr", "brt", "bkrt"):
        if k in L:
            L[k] = [int(x) + int(y) for x, y in zip(L[k], bwd)]
    # (the trigger's backward before its first read runs with its unit gathered too)
    L["rgp"] = [int(x) + int(y) for x, y in zip(L.get("rgp", L["rg"]), bwd)]
    for k in ("fpre", "fpost", "fkpre", "fkpost"):
        if L.get(k) is not None:
            L[k] = [int(x) + int(y) for x, y in zip(L[k], bwd)]
    newp = [int(x) if owner[i] < 0 else 0 for i, x in enumerate(p)]
    for u, (s, e) in enumerate(shape.spans):
        newp[s] = shape.grad_shard[u]
    L["p"] = newp
    d["static"] = step_static + shape.root_gathered
    rc = ChainCosts.from_dict(d)
    grads = sum(shape.grad_shard) + shape.root_grad_shard
    return FsdpRankCosts(costs=rc, sizes=shape.opt_sizes, grad_bytes=grads, param_bytes=sharded,
                         step_static=step_static, comm_bytes=0, parallel=parallel,
                         fsdp=(shape, fsdp_base(costs, step_static), tuple(int(x) for x in p)))


class FsdpRankCosts(RankCosts):
    """:class:`RankCosts` whose forward+backward peak is :func:`fsdp_peak`'s."""

    def fb_peak(self, checkpoints, stored=(), accumulate: bool = False) -> RankPeak:
        shape, base, grads = self.fsdp
        v, phase, layer, held_grads, buffers = fsdp_peak(base, list(grads), shape, checkpoints, stored, accumulate)
        return RankPeak(bytes=v, phase=phase, layer=layer, grads=held_grads, buffers=buffers)


def W_rs(shape: FsdpShape, u: int) -> int:
    """The reduce-scatter input unit ``u`` leaves (0 past the last unit)."""
    return shape.world * shape.grad_shard[u] if 0 <= u < len(shape.spans) else 0


def fsdp_base(costs: ChainCosts, step_static: int) -> ChainCosts:
    """The chain model without the parameters' gradients and with the rank's static bytes: what
    :func:`fsdp_peak` walks (the gradients and FSDP2's buffers are added event by event)."""
    d = costs.to_dict()
    d["static"] = int(step_static)
    d["layers"]["p"] = [0] * costs.n
    return ChainCosts.from_dict(d)


def fsdp_peak(base: ChainCosts, grads: list[int], shape: FsdpShape, checkpoints, stored=(),
              accumulate: bool = False) -> tuple[int, str, int, int, int]:
    """The forward+backward peak of one rank under a plan, event by event: ``(bytes, phase, layer,
    gradient bytes then, FSDP2's gathered parameters and buffers then)``.

    ``base``: :func:`fsdp_base` of the local batch's cost model; ``grads[i]``: the full gradient
    bytes of layer ``i``'s parameters (the traced ``p``); ``accumulate``: a micro-batch after the
    first (the sharded gradients are there from the start; FSDP2 adds each new one into them).
    See the module note for the rules.
    """
    chain = _ChainWalk(owner=[int(x) for x in _unit_of(shape, base.n)], f=[int(x) for x in base.f],
                       b=[int(x) for x in base.b], grads=grads)
    events = simulate_timeline(base, checkpoints, stored)
    rank = _RankState.start(shape, accumulate)
    _walk_forward(rank, chain, [e for e in events if e.phase == "forward"])
    _walk_backward(rank, chain, [e for e in events if e.phase != "forward"])
    return rank.peak


@dataclass(frozen=True)
class _ChainWalk:
    """The chain model's per-layer figures :func:`fsdp_peak` reads beside its timeline."""

    owner: list[int]  # the unit of each layer (-1: the root's)
    f: list[int]  # each layer's forward transient (the chain model's ``f``)
    b: list[int]  # each layer's backward transient (``b``)
    grads: list[int]  # the full gradient bytes of each layer's parameters

    def level(self, e) -> int:
        """The chain model's bytes under event ``e``: its high point less its layer's transient."""
        return e.bytes - (self.b[e.layer] if e.phase == "backward" else self.f[e.layer])


@dataclass
class _RankState:
    """FSDP2's bytes on one rank at the current event of :func:`fsdp_peak`'s walk (on top of the
    chain model's), and the highest total seen so far."""

    shape: FsdpShape
    accumulate: bool  # a later micro-batch: every sharded gradient is there from the start
    kept: int  # the flat buffer of the last forward-mode gather, freed at the next one
    sharded: int = 0  # the sharded gradients (reduce-scatter outputs), kept until zero_grad
    full: int = 0  # full-size gradients of the units whose backward has not ended
    rs: int = 0  # the reduce-scatter input the last post-backward made
    gathered: set[int] = field(default_factory=set)  # units whose parameters are gathered
    pending: dict[int, int] = field(default_factory=dict)  # unit -> its prefetched flat buffer
    peak: tuple[int, str, int, int, int] = (0, "", -1, 0, 0)  # bytes, phase, layer, gradients, FSDP2's buffers

    @classmethod
    def start(cls, shape: FsdpShape, accumulate: bool) -> _RankState:
        """Before the forward: the root gathered (its flat buffer kept)."""
        sharded = sum(shape.grad_shard) + shape.root_grad_shard if accumulate else 0
        return cls(shape=shape, accumulate=accumulate, kept=shape.root_gathered, sharded=sharded)

    def extra(self) -> int:
        """FSDP2's bytes now: the root's gathered parameters (held through forward and backward),
        flat buffers, gathered units, the reduce-scatter input and the gradients."""
        G = self.shape.gathered
        return (self.shape.root_gathered + self.kept + sum(G[v] for v in self.gathered)
                + sum(self.pending.values()) + self.rs + self.sharded + self.full)

    def see(self, v: int, phase: str, layer: int) -> None:
        """A moment holding ``v`` bytes in all: the new peak if it is higher than the last."""
        if v > self.peak[0]:
            grads = self.sharded + self.full
            self.peak = (int(v), phase, int(layer), grads, self.extra() - grads)

    def gather(self, u: int, level: int, phase: str, layer: int, forward_mode: bool) -> None:
        """Unit ``u``'s all-gather at chain level ``level``: its flat buffer (unless prefetched)
        and its gathered parameters; in forward mode the flat buffer is kept until the next
        forward-mode gather, which frees the previous one."""
        G = self.shape.gathered
        flat = self.pending.pop(u, None)
        self.see(level + self.extra() + G[u] + (0 if flat is not None else G[u]), phase, layer)
        self.gathered.add(u)
        if forward_mode:
            self.kept = G[u]

    def pre_backward(self, hooks: list[int], level: int, layer: int) -> None:
        """The gradient reached the output of each unit in ``hooks`` (-1: the root): gather it if
        it is not gathered yet, and prefetch the flat buffer of the unit before it."""
        U, G = len(self.shape.spans), self.shape.gathered
        for v in hooks:
            if v >= 0 and v not in self.gathered:
                self.gather(v, level, "backward", self.shape.spans[v][1], False)
            target = U - 1 if v < 0 else v - 1
            if 0 <= target and target not in self.gathered and target not in self.pending:
                self.pending[target] = G[target]
                self.see(level + self.extra(), "backward", layer)

    def post_backward(self, u: int, grads: list[int]) -> None:
        """Unit ``u``'s backward ended: reshard it, and reduce-scatter its full gradients (the
        previous reduce-scatter input freed) into its sharded ones."""
        self.gathered.discard(u)
        s, e = self.shape.spans[u]
        self.full -= sum(grads[s:e + 1])
        self.rs = self.shape.world * self.shape.grad_shard[u]
        self.sharded += 0 if self.accumulate else self.shape.grad_shard[u]


def _walk_forward(rank: _RankState, chain: _ChainWalk, events: list) -> None:
    """The forward's events: the root gathers before the first layer, each unit as its first
    layer runs (resharded after its last); the last flat buffer is freed as the model's forward ends."""
    shape = rank.shape
    if events:
        rank.see(events[0].bytes - chain.f[0] + shape.root_gathered + rank.kept, "forward", 0)
    for e in events:
        i, u = e.layer, chain.owner[e.layer]
        if u >= 0 and i == shape.spans[u][0]:
            rank.gather(u, chain.level(e), "forward", i, True)
        rank.see(e.bytes + rank.extra(), "forward", i)
        if u >= 0 and i == shape.spans[u][1]:
            rank.gathered.discard(u)
        if i == shape.model_end:
            rank.kept = 0


def _walk_backward(rank: _RankState, chain: _ChainWalk, events: list) -> None:
    """The backward's and recomputations' events, with FSDP2's hooks as the gradient reaches each
    unit's output (pre-backward) and leaves its input (post-backward)."""
    shape = rank.shape
    recomputing = -1  # the unit whose recomputation holds a flat buffer
    hooks = _hooks_due(shape, len(chain.owner))
    for k, e in enumerate(events):
        i, u = e.layer, chain.owner[e.layer]
        nxt = events[k + 1] if k + 1 < len(events) else None
        # NB: the backward of a checkpointed segment's last saving layer, up to its first read of a
        # saved tensor, is followed by the recomputation or the rest of that backward: its hooks
        # run at the level the next event starts at
        first = nxt is not None and e.phase == "backward" and (nxt.phase == "recompute" or nxt.layer == i)
        rank.pre_backward(hooks, chain.level(nxt if first else e), i)
        hooks = []
        if rank.kept and (e.phase == "backward" or u != recomputing):
            rank.kept = 0  # a recomputed unit's forward ended: it frees its flat buffer (it is its own
            # forward's root then), but stays gathered until its backward
        if e.phase == "recompute":
            if u >= 0 and u not in rank.gathered:
                rank.gather(u, chain.level(e), "recompute", i, True)
                recomputing = u
            rank.see(e.bytes + rank.extra(), "recompute", i)
            continue
        rank.see(e.bytes + rank.extra(), "backward", i)
        if first:
            continue
        rank.full += chain.grads[i]
        if u >= 0 and i == shape.spans[u][0]:
            rank.post_backward(u, chain.grads)
        hooks = _hooks_due(shape, i)


def _hooks_due(shape: FsdpShape, i: int) -> list[int]:
    """The pre-backward hooks that run once layer ``i``'s backward ends, the gradient reaching layer
    ``i - 1``'s output (``i = n``: the loss's gradient reaching the last layer's): the root's (-1)
    at the model's output, then each unit whose last layer is ``i - 1``."""
    return ([-1] if i == shape.model_end + 1 else []) + [v for v in range(len(shape.spans))
                                                          if shape.spans[v][1] + 1 == i]
