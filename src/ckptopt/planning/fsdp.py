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
from dataclasses import dataclass

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
    return FsdpShape(W, tuple(facts.units), tuple(gathered[:U]), tuple(grad_shard[:U]), tuple(param_shard[:U]),
                     gathered[U], grad_shard[U], param_shard[U], tuple(opt),
                     n_layers - 1 if model_end is None else int(model_end))


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
    return FsdpRankCosts(rc, shape.opt_sizes, grads, sharded, step_static, 0, parallel,
                         fsdp=(shape, fsdp_base(costs, step_static), tuple(int(x) for x in p)))


class FsdpRankCosts(RankCosts):
    """:class:`RankCosts` whose forward+backward peak is :func:`fsdp_peak`'s."""

    def fb_peak(self, checkpoints, stored=(), accumulate: bool = False) -> RankPeak:
        shape, base, grads = self.fsdp
        v, phase, layer, held_grads, buffers = fsdp_peak(base, list(grads), shape, checkpoints, stored, accumulate)
        return RankPeak(v, phase, layer, held_grads, buffers)


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
    n, U, W = base.n, len(shape.spans), shape.world
    owner = [int(x) for x in _unit_of(shape, n)]
    G = shape.gathered
    f, fs, b = ([int(x) for x in getattr(base, k)] for k in ("f", "fs", "b"))
    events = simulate_timeline(base, checkpoints, stored)
    best = [0, "", -1, 0, 0]  # bytes, phase, layer, gradients then, FSDP2's buffers then

    def see(v: int, phase: str, layer: int):
        if v > best[0]:
            grads = st["sharded"] + st["full"]
            best[:] = [int(v), phase, int(layer), grads, extra() - grads]

    root = shape.root_gathered  # the root's gathered parameters, held through forward and backward
    st = dict(kept=shape.root_gathered, rs=0, sharded=0, full=0)
    if accumulate:  # a later micro-batch: every sharded gradient is there from the start
        st["sharded"] = sum(shape.grad_shard) + shape.root_grad_shard  # kept: the flat buffer of the last forward-mode gather
    gathered: set[int] = set()
    pending: dict[int, int] = {}  # prefetched flat buffers

    def extra() -> int:
        return (root + st["kept"] + sum(G[v] for v in gathered) + sum(pending.values()) + st["rs"]
                + st["sharded"] + st["full"])

    def gather(u: int, level: int, phase: str, layer: int, forward_mode: bool):
        flat = pending.pop(u, None)
        see(level + extra() + G[u] + (0 if flat is not None else G[u]), phase, layer)
        gathered.add(u)
        if forward_mode:  # the flat buffer is kept until the next forward-mode gather (the previous one goes)
            st["kept"] = G[u]

    fwd = [e for e in events if e.phase == "forward"]
    if fwd:  # the root's gather, before the first layer
        see(fwd[0].bytes - f[0] + root + st["kept"], "forward", 0)
    for e in fwd:
        i, u = e.layer, owner[e.layer]
        if u >= 0 and i == shape.spans[u][0]:
            gather(u, e.bytes - f[i], "forward", i, True)
        see(e.bytes + extra(), "forward", i)
        if u >= 0 and i == shape.spans[u][1]:
            gathered.discard(u)
        if i == shape.model_end:
            st["kept"] = 0

    recomputing = -1  # the unit whose recomputation holds a flat buffer
    triggers: list[int] = []  # pre-backward hooks due (-1: the root's)
    if shape.model_end == n - 1:
        triggers.append(-1)
    triggers += [v for v in range(U) if shape.spans[v][1] == n - 1]
    events = [e for e in events if e.phase != "forward"]
    for k, e in enumerate(events):
        i, u = e.layer, owner[e.layer]
        level = e.bytes - (b[i] if e.phase == "backward" else f[i])
        nxt = events[k + 1] if k + 1 < len(events) else None
        # a checkpointed segment's last saving layer, its backward up to its first read of a saved
        # tensor (the recomputation, or the rest of its backward, follows): the level the next event has
        first = nxt is not None and e.phase == "backward" and (nxt.phase == "recompute" or nxt.layer == i)
        if first:
            level = nxt.bytes - (b[i] if nxt.phase == "backward" else f[nxt.layer])
        for v in triggers:  # the gradient reached v's output: gather v (if not yet), prefetch the one before
            w = U - 1 if v < 0 else v
            if v >= 0 and v not in gathered:
                gather(v, level, "backward", shape.spans[v][1], False)
            target = w if v < 0 else v - 1
            if 0 <= target and target not in gathered and target not in pending:
                pending[target] = G[target]
                see(level + extra(), "backward", i)
        triggers = []
        if st["kept"] and (e.phase == "backward" or u != recomputing):
            st["kept"] = 0  # a recomputed unit's forward ended: it frees its flat buffer (it is its own
            # forward's root then), but stays gathered until its backward
        if e.phase == "recompute":
            if u >= 0 and u not in gathered:
                gather(u, e.bytes - f[i], "recompute", i, True)
                recomputing = u
            see(e.bytes + extra(), "recompute", i)
            continue
        see(e.bytes + extra(), "backward", i)
        if first:
            continue
        st["full"] += grads[i]
        if u >= 0 and i == shape.spans[u][0]:  # post-backward: reshard, reduce-scatter
            gathered.discard(u)
            s_, e_ = shape.spans[u]
            st["full"] -= sum(grads[s_:e_ + 1])
            st["rs"] = W * shape.grad_shard[u]
            st["sharded"] += 0 if accumulate else shape.grad_shard[u]
        if i == shape.model_end + 1:
            triggers.append(-1)
        triggers += [v for v in range(U) if shape.spans[v][1] + 1 == i]
    return tuple(best)
