"""One rank of a data-parallel run: what DDP and FSDP2 add to the memory of a training step.

The chain model (``docs/design.md`` §3) prices the step of one process on its own batch.
Under data parallelism each rank runs that step on its local batch, and the parallel
wrapper changes what the rank holds besides the activations (``docs/design.md`` §13):

**DDP** (``DistributedDataParallel``, PyTorch's defaults): the reducer allocates its
gradient buckets when the module is wrapped, one flat buffer per bucket, together as large
as the trainable parameters, and keeps them for the whole run. With the default
``gradient_as_bucket_view=False`` the gradients are separate tensors, as without DDP, so the
buckets come on top of everything (measured with the exact tracker on gloo, 2 and 4 ranks:
the step's peak is the single process's plus the buckets, to the byte). With
``gradient_as_bucket_view=True`` the gradients are views into the buckets: a gradient
autograd computes is copied into its bucket and freed, so the parameter bytes do not
accumulate during the backward (a layer's backward still holds its new gradients until
they are copied, as its backward transient ``b`` already counts). ``bucket_cap_mb`` changes
how the buffer is split, not its size.

**FSDP2** (``fully_shard`` on each repeated block, then on the root; the default
``reshard_after_forward``): see :mod:`ckptopt.planning.fsdp`
(:func:`~ckptopt.planning.fsdp.fsdp_rank_costs`).

No torch import: the per-parameter facts (sizes, first dimensions, which unit owns them,
which layers use them) come from :mod:`ckptopt.planning.param_facts`; :func:`ckptopt.planning.ranks.rank_costs`
picks the strategy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence


from ..costs import ChainCosts
from ..simulator import simulate

__all__ = ["Parallel", "STRATEGIES", "ParamFacts", "RankCosts", "RankPeak", "ddp_rank_costs", "plus_static",
           "single_rank"]

STRATEGIES = ("ddp", "fsdp")
MIXED_PRECISIONS = ("bf16", "fp16")  # FSDP2's param_dtype


@dataclass(frozen=True)
class Parallel:
    """A data-parallel run, as one rank sees it.

    Attributes
    ----------
    world_size : int
        Ranks (processes, one GPU each); each runs the example batch as its local batch.
    strategy : str
        ``"ddp"`` (``DistributedDataParallel``) or ``"fsdp"`` (FSDP2's ``fully_shard`` on each
        repeated block and on the root).
    rank : int, default 0
        The rank priced. Under FSDP2 a parameter whose first dimension does not divide by the
        world size leaves the last ranks smaller optimizer state; rank 0 holds the most.
    bucket_cap_mb : float, default 25
        DDP's bucket size (it changes how the buckets are split, not their total).
    gradient_as_bucket_view : bool, default False
        DDP's option: gradients are views into the buckets.
    reshard_after_forward : bool, default True
        FSDP2's option for the blocks (the root keeps its parameters gathered until its
        backward ends, as FSDP2 does).
    mixed_precision : str, optional
        FSDP2's ``MixedPrecisionPolicy(param_dtype=<this>, reduce_dtype=torch.float32)``:
        ``"bf16"`` or ``"fp16"``. The model keeps its parameters (fp32 master weights, sharded);
        each block is gathered and computes in this dtype; gradients are reduced in fp32.
    """

    world_size: int
    strategy: str = "ddp"
    rank: int = 0
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    reshard_after_forward: bool = True
    mixed_precision: str | None = None

    def __post_init__(self):
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer (the number of ranks), got {self.world_size!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown parallel strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank!r}")
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"mixed_precision must be one of {', '.join(MIXED_PRECISIONS)} or None "
                             f"(FSDP2's param_dtype), got {self.mixed_precision!r}")
        if self.mixed_precision is not None and self.strategy != "fsdp":
            raise ValueError("mixed_precision is FSDP2's MixedPrecisionPolicy: use it with strategy='fsdp' (under DDP, "
                             "train under torch.autocast and plan inside the same context)")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb!r}")

    def describe(self) -> str:
        if self.strategy == "ddp":
            view = ", gradients as bucket views" if self.gradient_as_bucket_view else ""
            return f"DDP, {self.world_size} ranks (one rank priced{view})"
        rf = "" if self.reshard_after_forward else ", reshard_after_forward=False"
        mp = f", {self.mixed_precision} compute, fp32 reduce" if self.mixed_precision else ""
        return f"FSDP2, {self.world_size} ranks (rank {self.rank} priced{rf}{mp})"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ParamFacts:
    """The parameters, as the parallel wrappers see them (in ``model.parameters()`` order, each
    storage once).

    ``nbytes[k]``, ``dim0[k]`` (its first dimension; 1 for a scalar), ``trainable[k]``, ``unit[k]``
    (the FSDP unit that owns it, -1 for the root), and the FSDP units: ``units[u] = (first_layer,
    last_layer)``, the chain layers from the first that runs inside the unit's forward to the last.
    """

    nbytes: tuple[int, ...]
    dim0: tuple[int, ...]
    unit: tuple[int, ...] = ()
    units: tuple[tuple[int, int], ...] = ()
    unit_names: tuple[str, ...] = ()
    trainable: tuple[bool, ...] = ()
    model_end: int | None = None
    compute_nbytes: tuple[int, ...] = ()  # (FSDP2's mixed precision: each parameter as gathered; default nbytes)

    def __post_init__(self):
        if not self.compute_nbytes:
            object.__setattr__(self, "compute_nbytes", tuple(self.nbytes))
        if not self.unit:
            object.__setattr__(self, "unit", (-1,) * len(self.nbytes))
        if not self.trainable:
            object.__setattr__(self, "trainable", (True,) * len(self.nbytes))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Bytes of each trainable parameter (what the optimizer updates)."""
        return tuple(int(b) for b, t in zip(self.nbytes, self.trainable) if t)

    @property
    def total(self) -> int:
        """Bytes of the trainable parameters."""
        return int(sum(self.sizes))


@dataclass(frozen=True)
class RankCosts:
    """One rank's training step.

    Attributes
    ----------
    costs : ChainCosts
        The forward+backward cost model of the rank (its static bytes: what the rank holds
        throughout the forward and backward).
    sizes : tuple of int
        Bytes of each parameter tensor the rank's optimizer updates (its state follows them).
    grad_bytes : int
        Gradient bytes at the optimizer step beyond ``costs.static``.
    param_bytes : int
        Parameter bytes the rank holds at the optimizer step.
    step_static : int
        Static bytes at the optimizer step (``costs.static`` unless something of the forward
        and backward is freed before it).
    comm_bytes : int
        Of the static bytes, what the wrapper holds for communication (DDP's buckets).
    parallel : Parallel or None
    """

    costs: ChainCosts
    sizes: tuple[int, ...]
    grad_bytes: int
    param_bytes: int
    step_static: int
    comm_bytes: int = 0
    parallel: Parallel | None = None
    fsdp: tuple | None = None  # FSDP2 (FsdpRankCosts): (FsdpShape, base costs, full gradient bytes per layer)

    def solver_costs(self, accumulate: bool = False) -> ChainCosts:
        """The cost model the solvers see (a micro-batch after the first: every gradient held)."""
        from .optimizer import accumulating_costs

        return accumulating_costs(self.costs) if accumulate else self.costs

    def fb_peak(self, checkpoints, stored=(), accumulate: bool = False) -> RankPeak:
        """The forward+backward peak of the rank under a plan."""
        sim = simulate(self.solver_costs(accumulate), checkpoints, stored)
        return RankPeak(sim.peak_bytes, sim.phase, sim.layer, None, 0, sim)

    def step_peak(self, opt) -> int:
        """Peak of ``optimizer.step()``: static + gradients + the loss scalar + state + transient
        (0 for ``optimizer="none"``)."""
        if opt.name == "none":
            return 0
        return self.step_static + self.grad_bytes + int(self.costs.a[-1]) + opt.state_bytes + opt.step_transient_bytes


@dataclass(frozen=True)
class RankPeak:
    """Where a plan's forward+backward peaks on one rank: ``grads`` and ``buffers`` (FSDP2's gathered
    parameters and communication buffers) held then, when known; ``sim`` the simulator's result."""

    bytes: int
    phase: str
    layer: int
    grads: int | None = None
    buffers: int = 0
    sim: object = None


def single_rank(costs: ChainCosts, sizes: Sequence[int], param_bytes: int) -> RankCosts:
    """The step of one process, no parallel wrapper."""
    return RankCosts(costs, tuple(int(s) for s in sizes), int(sum(sizes)), int(param_bytes), costs.static)


def _with(costs: ChainCosts, static: int | None = None, **layers: Sequence[int]) -> ChainCosts:
    d = costs.to_dict()
    if static is not None:
        d["static"] = int(static)
    for k, v in layers.items():
        d["layers"][k] = [int(x) for x in v]
    return ChainCosts.from_dict(d)


def plus_static(costs: ChainCosts, extra: int) -> ChainCosts:
    """``costs`` with ``extra`` more bytes held for the whole step."""
    return _with(costs, static=costs.static + int(extra)) if extra else costs


def ddp_rank_costs(costs: ChainCosts, facts: ParamFacts, param_bytes: int, parallel: Parallel) -> RankCosts:
    """One rank of DDP (see the module note): the buckets, held for the whole run."""
    buckets = facts.total
    if parallel.gradient_as_bucket_view:
        # the gradients live in the buckets: none accumulates during the backward, none is added at the step
        rc = _with(costs, static=costs.static + buckets, p=[0] * costs.n)
        return RankCosts(rc, facts.sizes, 0, param_bytes, rc.static, buckets, parallel)
    rc = _with(costs, static=costs.static + buckets)
    return RankCosts(rc, facts.sizes, facts.total, param_bytes, rc.static, buckets, parallel)
