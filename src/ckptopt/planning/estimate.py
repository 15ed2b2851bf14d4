"""The predicted peak of a whole training step, optimizer included, and where it is reached."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

from ..costs import ChainCosts
from ..plan import segment_bounds
from ..simulator import SimResult, simulate
from ..solvers import solve
from ..solvers.limits import TIE_BREAK_MAX_WORK
from ..solvers.pareto import FrontTooLarge, least_recompute
from ..errors import InfeasibleBudget
from ..plan import Plan
from ..storages import distinct_storages, storage_nbytes
from ..torch_utils import Inputs, normalize_inputs
from ..tracer.chain import IdleTask, while_waiting
from ..tracer.meta import planned_on
from .reserved import replay_declined
from .headroom import Headroom, check_calibrate, default_calibrate, default_headroom
from .optimizer import OptimizerMemory, optimizer_memory
from .parallel import Parallel, RankCosts
from .ranks import rank_costs
from .param_facts import param_facts, rank_trace, repeated_blocks

__all__ = ["Breakdown", "PeakEstimate", "Estimate", "estimate", "peak_estimate", "optimal_plan", "kept_output_extra",
           "least_recompute_plan", "trainable_sizes", "batch_of"]


@dataclass(frozen=True)
class Breakdown:
    """The bytes alive at the peak, by kind (they sum to the peak).

    ``transient`` is the working memory of what runs at the peak: a layer's
    forward temporaries; in backward its new gradients (parameter and input)
    and temporaries; or the optimizer step's temporaries. ``gradients`` are the
    parameter gradients already stored. ``activations`` is the rest: tensors
    saved for backward, checkpoints, the output gradient in flight. ``kept_output``: what a
    loop that keeps the model's output adds to the step (:func:`estimate`'s ``keep_output``). ``parallel``:
    what a data-parallel wrapper holds besides (DDP's gradient buckets; FSDP2's
    gathered parameters, prefetched and reduce-scatter buffers); ``parameters`` and
    ``gradients`` are then the rank's (sharded under FSDP2).
    """

    parameters: int
    buffers_and_inputs: int
    gradients: int
    optimizer_state: int
    activations: int
    transient: int
    parallel: int = 0
    kept_output: int = 0  # what a loop that keeps the model's output adds (``keep_output``)

    @property
    def total(self) -> int:
        return (self.parameters + self.buffers_and_inputs + self.gradients + self.optimizer_state
                + self.activations + self.transient + self.parallel + self.kept_output)


@dataclass(frozen=True)
class PeakEstimate:
    """The predicted peak of a training step under one plan.

    Attributes
    ----------
    label : str
        ``"no checkpointing"``, ``"optimal plan"``, ...
    checkpoints : tuple of int
        The plan (segment-start layers).
    stored : tuple of int
        Its segments left unwrapped (:attr:`ckptopt.Plan.stored`).
    peak_bytes : int
        ``max(forward_backward_bytes + state, step_bytes)``.
    forward_backward_bytes : int
        The simulator's peak of forward, loss and backward (no optimizer state).
    step_bytes : int
        The optimizer step's peak (0 for no optimizer).
    at : str
        ``"forward"``, ``"recompute"``, ``"backward"`` or ``"optimizer step"``.
    layer : int or None
        The layer running at the peak (None at the optimizer step).
    layer_name : str or None
    breakdown : Breakdown
    recompute_flops : int
        Forward FLOPs re-run in backward.
    recompute_share : float
        ``recompute_flops / (3 * forward FLOPs)``: the overhead on a step,
        a step taken as forward + backward = 3 forwards.
    """

    label: str
    checkpoints: tuple[int, ...]
    peak_bytes: int
    forward_backward_bytes: int
    step_bytes: int
    at: str
    layer: int | None
    layer_name: str | None
    breakdown: Breakdown
    recompute_flops: int
    recompute_share: float
    stored: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checkpoints"] = list(self.checkpoints)
        d["stored"] = list(self.stored)
        return d


def plan_recompute_share(costs: ChainCosts, cps: tuple[int, ...], stored: tuple[int, ...] = ()) -> tuple[int, float]:
    """(forward compute re-run in backward, its share of a step = 3 forward passes)."""
    sim = simulate(costs, cps, stored)
    return int(sim.recompute_flops), float(sim.recompute_share)


def _fb_breakdown(costs: ChainCosts, cps: tuple[int, ...], sim: SimResult) -> tuple[int, int]:
    """(gradients, transient) at the simulator's peak of forward+backward."""
    i = sim.layer
    end = segment_bounds(costs.n, cps)[sim.segment][1]
    G = costs.grad_after
    if sim.phase == "forward":
        return 0, int(costs.f[i])
    if sim.phase == "recompute":
        f = costs.fs[i] if i == end else costs.f[i]
        return int(G[end]), int(f)
    return int(G[i]), int(costs.b[i])


def peak_estimate(rank: RankCosts, plan: Plan | tuple[int, ...], opt: OptimizerMemory,
                  label: str = "", kept: tuple[int, int] = (0, 0)) -> PeakEstimate:
    """Peak and breakdown of a training step of one rank under ``plan`` (see the module note).

    Parameters
    ----------
    rank : RankCosts
        The rank's step (:func:`ckptopt.planning.ranks.rank_costs`; one process: ``single_rank``).
    plan : Plan or tuple of int
        The plan (a tuple: segment-start layers, every segment but the last checkpointed).
    opt : OptimizerMemory
    kept : (int, int)
        A loop that keeps the model's output: what that adds to the forward and backward's peak
        (measured, :func:`kept_output_extra`) and the output's bytes, alive in the optimizer step.
    """
    costs = rank.costs
    cps, stored = (plan.checkpoints, plan.stored) if isinstance(plan, Plan) else (tuple(int(c) for c in plan), ())
    at_peak = rank.fb_peak(cps, stored)
    extra, out_bytes = kept
    fb = at_peak.bytes + extra
    stp = rank.step_peak(opt) + (out_bytes if opt.name != "none" else 0)
    redo, share = plan_recompute_share(costs, cps, stored)
    other_static = rank.step_static - rank.param_bytes - rank.comm_bytes
    if fb + opt.state_bytes >= stp:
        if at_peak.sim is not None:
            grads, transient = _fb_breakdown(costs, cps, at_peak.sim)
            parallel = rank.comm_bytes
        else:  # FSDP2: the gradients and buffers held then; the chain model's own transient is in the rest
            grads, transient, parallel = at_peak.grads, 0, at_peak.buffers
        acts = fb - extra - rank.step_static - grads - transient - parallel + rank.comm_bytes
        at, layer = at_peak.phase, at_peak.layer
        output = extra
    else:
        grads, transient, parallel = rank.grad_bytes, opt.step_transient_bytes, rank.comm_bytes
        acts = int(costs.a[-1])  # the loss scalar
        at, layer = "optimizer step", None
        output = out_bytes
    bd = Breakdown(rank.param_bytes, other_static, grads, opt.state_bytes, acts, transient, parallel, output)
    peak = max(fb + opt.state_bytes, stp)
    assert bd.total == peak, (bd, peak)
    name = costs.names[layer] if (layer is not None and costs.names is not None) else None
    return PeakEstimate(label, cps, peak, fb, stp, at, layer, name, bd, redo, share, stored)


def check_keep_output(parallel: Parallel | None) -> None:
    """``keep_output=True`` plans one process."""
    if parallel is not None:
        raise ValueError("keep_output=True is not supported with parallel= yet: plan one process, or free the "
                         "output before backward (loss_fn(model(x)).backward())")


def kept_output_extra(model, inputs: Inputs, loss_fn, traced, plans) -> list[tuple[int, int]]:
    """For each plan (``()``: none), what a loop that keeps the model's output adds to the forward
    and backward's peak, and the output's bytes: measured on one fake copy, a kept-output step
    (:func:`ckptopt.measure.measure_peak`'s ``keep_output``) against the modelled one."""
    from ..measure import fake_peaks
    from ..rewriter import apply_plan

    plans = [None if not (p.checkpoints if isinstance(p, Plan) else p) else
             (p if isinstance(p, Plan) else Plan(tuple(p), 0, "given", 0.0, traced.n, ())) for p in plans]
    build = lambda fm, p: apply_plan(fm, traced, p)  # noqa: E731
    flags = [False] * len(plans) + [True] * len(plans)
    runs = fake_peaks(model, inputs, loss_fn, plans * 2, build, keep_output=flags)
    plain, kept = runs[:len(plans)], runs[len(plans):]  # (one fake copy for both)
    return [(max(0, k.peak_bytes - m.peak_bytes), int(k.output_bytes or 0)) for k, m in zip(kept, plain)]


def optimal_plan(rank: RankCosts, opt: OptimizerMemory, accumulate: bool = False) -> Plan:
    """The plan with the lowest step peak of the rank and, among those, the least recomputation.

    The lowest forward+backward peak (the ``auto`` policy, as ``optimize_checkpoints``)
    plus the optimizer state may lie below the optimizer step's peak; then any plan up
    to that level gives the same step peak, and the one with the least recomputation
    (:func:`least_recompute_plan`) is returned, often no checkpointing at all.

    Under FSDP2 the solvers see a per-layer form of its buffers that is exact for plans
    whose checkpointed segments stay inside one block; the candidates (that plan, the same
    with a cut at every block boundary, no checkpointing) are scored event by event and the
    lowest kept (``docs/design.md`` §13).

    Parameters
    ----------
    rank : RankCosts
    opt : OptimizerMemory
    accumulate : bool
        A micro-batch after the first of a gradient-accumulation loop.
    """
    costs = rank.solver_costs(accumulate)
    best = solve(costs, "auto")
    if rank.fsdp is not None:
        return _fsdp_choice(rank, costs, best, opt, accumulate)
    target = max(best.peak_bytes + opt.state_bytes, rank.step_peak(opt))
    found = least_recompute_plan(costs, target - opt.state_bytes)
    return found if found is not None else best


def _fsdp_choice(rank: RankCosts, costs: ChainCosts, best: Plan, opt: OptimizerMemory, accumulate: bool) -> Plan:
    """The FSDP2 candidate with the lowest step peak by the event-level forward+backward peak, then the
    least recomputation: the per-layer optimum, the same with a cut at every block boundary (no
    checkpointed segment spans blocks), no checkpointing, and the least-recompute plan of the per-layer
    form under the lowest step peak found."""
    spans = rank.fsdp[0].spans
    bounds = {s for s, _ in spans} | {e + 1 for _, e in spans}
    confined = tuple(sorted(set(best.checkpoints) | {b for b in bounds if 0 < b < costs.n}))
    step = rank.step_peak(opt)
    scored = {}

    def score(cps, stored):
        stored = tuple(s for s in stored if s in cps)
        if (cps, stored) not in scored:
            fb = rank.fb_peak(cps, stored, accumulate).bytes
            scored[(cps, stored)] = (max(fb + opt.state_bytes, step), plan_recompute_share(costs, cps, stored)[0], fb)
        return scored[(cps, stored)]

    for cps, stored in ((best.checkpoints, best.stored), (confined, ()), ((), ())):
        score(cps, stored)
    lowest = min(v[0] for v in scored.values())
    cheap = least_recompute_plan(costs, lowest - opt.state_bytes)
    if cheap is not None:
        score(cheap.checkpoints, cheap.stored)
    (cps, stored), (_, _, fb) = min(scored.items(), key=lambda kv: kv[1][:2])
    return Plan(cps, fb, "auto (fsdp)", 0.0, costs.n, stored)


def least_recompute_plan(costs: ChainCosts, budget: int) -> Plan | None:
    """The plan with the least recomputation whose forward+backward peak is at most ``budget``
    (no checkpointing when it fits, else the ``auto`` policy with that budget: middle segments
    may stay unwrapped), None when no plan fits."""
    none = solve(costs, "none")
    if none.peak_bytes <= budget:
        return none
    if costs.side:
        # the side-tensor Pareto program is bounded here (unbounded, it takes 104 s on the 290 layers of an
        # 8B-wide Llama, docs/design.md §5): beyond the bound, None, and the caller keeps the lowest-peak
        # plan (same step peak, maybe more recomputation)
        try:
            found = least_recompute(costs, budget, True, max_work=LEAST_RECOMPUTE_MAX_WORK)
        except FrontTooLarge:
            return None
        if found is None:
            return None
        return Plan(found[0], simulate(costs, found[0], found[1]).peak_bytes, "budget", 0.0, costs.n, found[1])
    try:
        return solve(costs, "auto", budget=budget)
    except InfeasibleBudget:
        return None


#: Work bound of :func:`least_recompute_plan`'s Pareto pass on a model with side tensors (segment
#: steps, as ``TIE_BREAK_MAX_WORK``): about a second or two.
LEAST_RECOMPUTE_MAX_WORK = 10 * TIE_BREAK_MAX_WORK


#: the labels of :attr:`Estimate.no_checkpointing` and :attr:`Estimate.optimal` (and their replayed needs)
NO_CHECKPOINTING, OPTIMAL_PLAN = "no checkpointing", "optimal plan"


def _replay_as_is(model, inputs: Inputs, loss_fn, optimizer: str, impl: str | None, dev: str) -> IdleTask:
    """The allocator replay of no checkpointing (:func:`~ckptopt.planning.reserved.replayed_needs`), to
    run when convenient: it needs neither the trace nor the parameters' sizes (the optimizer's name and
    step implementation do not depend on them)."""
    from .reserved import replayed_needs

    step = optimizer_memory([], optimizer, impl, dev)
    return IdleTask(lambda: replayed_needs(model, inputs, loss_fn, {NO_CHECKPOINTING: None}, step.name, step.impl))


def _plan_and_replay(model, inputs: Inputs, loss_fn, tm, rank: RankCosts, opt: OptimizerMemory,
                     as_is: IdleTask | None, why_not: str | None) -> tuple[Plan, dict | None, str | None]:
    """``(optimal plan, replayed needs by label, why not replayed)``: :func:`optimal_plan`, and where
    ``why_not`` is None the caching allocator's replay of no checkpointing (``as_is``, unless the trace
    already ran it while it waited) and of that plan (:func:`~ckptopt.planning.reserved.replayed_needs`).

    No checkpointing's replay does not depend on the plan. So with a spare core the plan is found in a
    thread beside it: its programs (the side-tensor Pareto passes, seconds on an 8B Llama) release the
    GIL, while the replay's fake step holds it. The answer is the one running them in turn gives."""
    if why_not is not None:
        return optimal_plan(rank, opt), None, why_not
    from ..rewriter import apply_plan
    from ..solvers.limits import spare_core
    from .reserved import replayed_needs

    if spare_core() and not as_is.done:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(optimal_plan, rank, opt)
            replayed, why_not = as_is.value()
            best = pending.result()
    else:
        best = optimal_plan(rank, opt)
        replayed, why_not = as_is.value()
    if replayed is None:
        return best, None, why_not
    if not (best.checkpoints or best.stored):  # (the optimal plan checkpoints nothing)
        return best, {**replayed, OPTIMAL_PLAN: replayed[NO_CHECKPOINTING]}, None
    planned, why_not = replayed_needs(model, inputs, loss_fn, {OPTIMAL_PLAN: lambda fm: apply_plan(fm, tm, best)},
                                      opt.name, opt.impl)
    if planned is None:
        return best, None, why_not
    return best, {**replayed, **planned}, None


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` returns: the step's peak with no checkpointing and with the optimal plan."""

    batch_size: int | None
    n_layers: int
    optimizer: OptimizerMemory
    param_bytes: int
    grad_bytes: int
    no_checkpointing: PeakEstimate
    optimal: PeakEstimate
    headroom: Headroom = Headroom()
    calibrated: bool = False
    parallel: Parallel | None = None
    #: on CUDA, the least memory each plan's first two steps run in, by the caching allocator's replay
    #: (:mod:`ckptopt.planning.reserved`), by label; None where the headroom share answers instead
    replayed: dict | None = None
    #: why the replay did not answer (None where it did, or off CUDA)
    replay_note: str | None = None

    def needed_bytes(self, pe: PeakEstimate) -> int:
        """The memory a device must have for the step of ``pe``: on CUDA the least memory the caching
        allocator's replay runs its first two steps in, else its peak plus the headroom (a checkpointed
        plan's where ``pe`` checkpoints)."""
        if self.replayed and pe.label in self.replayed:
            return self.replayed[pe.label]
        return self.headroom.needed(pe.peak_bytes, checkpointed=bool(pe.checkpoints))

    @property
    def recommended(self) -> PeakEstimate:
        """The plan that needs the least device memory (:meth:`needed_bytes`): the optimal plan, unless the
        headroom kept for a checkpointed plan's allocator overhead makes it need as much as no
        checkpointing or more, when checkpointing does not pay on the device."""
        if self.optimal.checkpoints and self.needed_bytes(self.optimal) < self.needed_bytes(self.no_checkpointing):
            return self.optimal
        return self.no_checkpointing

    def advice(self) -> str | None:
        """A sentence when checkpointing does not pay on the device (None when it does, or nothing is kept)."""
        if self.recommended is self.optimal or not self.optimal.checkpoints:
            return None
        from ..units import format_bytes

        none, best = self.no_checkpointing, self.optimal
        if self.replayed:
            return (f"checkpointing does not pay on this device: the optimal plan's peak is lower "
                    f"({format_bytes(best.peak_bytes)} against {format_bytes(none.peak_bytes)}), but replayed through "
                    f"the caching allocator its steps need {format_bytes(self.needed_bytes(best))} against "
                    f"{format_bytes(self.needed_bytes(none))}: train without checkpoints")
        return (f"checkpointing does not pay on this device: the optimal plan's peak is lower "
                f"({format_bytes(best.peak_bytes)} against {format_bytes(none.peak_bytes)}), but with the headroom "
                f"kept for a checkpointed plan ({100 * self.headroom.fraction_for(True):.0f}% of the peak against "
                f"{100 * self.headroom.fraction_for(False):.0f}%) it needs {format_bytes(self.needed_bytes(best))} "
                f"against {format_bytes(self.needed_bytes(none))}: train without checkpoints")

    def to_dict(self) -> dict:
        return dict(batch_size=self.batch_size, n_layers=self.n_layers, optimizer=asdict(self.optimizer),
                    param_bytes=self.param_bytes, grad_bytes=self.grad_bytes, headroom=self.headroom.to_dict(),
                    calibrated=self.calibrated, parallel=None if self.parallel is None else self.parallel.to_dict(),
                    no_checkpointing=self.no_checkpointing.to_dict(),
                    optimal=self.optimal.to_dict(),
                    needed_bytes=dict(no_checkpointing=self.needed_bytes(self.no_checkpointing),
                                      optimal=self.needed_bytes(self.optimal)),
                    recommended=self.recommended.label, advice=self.advice(), replayed=self.replayed,
                    replay_note=self.replay_note)


def is_sharded(parallel: Parallel | None) -> bool:
    """Whether ``parallel`` shards the parameters (FSDP2), so the plan follows its units."""
    return parallel is not None and parallel.strategy == "fsdp"


def calibration_choice(calibrate: bool | None, device: str, model_device: str, parallel) -> bool:
    """Whether to calibrate: ``calibrate``, by default on CUDA; never under FSDP2's mixed precision
    (planned on a copy in the compute dtype, which has no weights to run)."""
    calibrated = calibrate if calibrate is not None else default_calibrate(device, model_device)
    if calibrated and getattr(parallel, "mixed_precision", None):
        if calibrate:
            raise ValueError("calibrate=True with FSDP2's mixed precision is not supported yet (the layers would run "
                             "in the compute dtype on a copy without weights); pass calibrate=False")
        return False
    return calibrated


def sharded_leaves(model, parallel: Parallel | None, leaf_modules):
    """Under FSDP2 the blocks stay whole in a torch.fx graph (``fully_shard`` gathers a block when it is
    called, so a plan must keep the calls): the leaf modules default to the repeated blocks."""
    if leaf_modules is None and is_sharded(parallel):
        return repeated_blocks(model) or None
    return leaf_modules


def trainable_sizes(model) -> list[int]:
    """Bytes of each distinct trainable parameter, in ``model.parameters()`` order (by storage:
    :func:`~ckptopt.storages.distinct_storages`, which tells meta storages apart)."""
    return [storage_nbytes(p) for p in distinct_storages(p for p in model.parameters() if p.requires_grad)]


def batch_of(inputs: Inputs) -> int | None:
    """The batch size: the first dimension of the first input tensor that has one."""
    return next((int(t.shape[0]) for t in inputs.tensors() if t.dim() >= 1), None)


def estimate(model, example_inputs, optimizer: str = "adam", impl: str | None = None, device: str | None = None,
             loss_fn: Callable | None = None, leaf_modules=None, capture: str = "auto",
             calibrate: bool | None = None, headroom: Headroom | None = None,
             parallel: Parallel | None = None, keep_output: bool = False) -> Estimate:
    """Predicted peak of one training step, optimizer step included, without and with the optimal plan.

    Parameters
    ----------
    model : nn.Module
        In training mode, on the device and in the dtype it will train in.
    example_inputs : Tensor, tuple or dict
        One batch as the model is called (only shapes and dtypes are used: the model is
        traced on fake tensors).
    optimizer : str, default "adam"
        ``none`` (forward and backward only), ``sgd``, ``sgd-momentum`` (0.9),
        ``adam`` or ``adamw``, with PyTorch's default arguments otherwise.
    impl : str, optional
        ``for-loop`` or ``foreach`` optimizer step; default PyTorch's default on ``device``.
    device : str, optional
        Default: the model's device.
    loss_fn, leaf_modules, capture
        As for :func:`ckptopt.trace`.
    calibrate : bool, optional
        Run each layer once on the device first (:mod:`ckptopt.calibration`): library
        workspaces and operator scratch join the peak. Default: on CUDA.
    headroom : Headroom, optional
        What the caching allocator needs beyond the peak (:func:`default_headroom`:
        none on the CPU); ``Estimate.needed_bytes`` adds it.
    parallel : Parallel, optional
        One rank of a DDP or FSDP2 run (:class:`ckptopt.planning.Parallel`): ``example_inputs``
        is then the rank's local batch, and the figures are one rank's (``docs/design.md`` §13).
    keep_output : bool, default False
        The loop keeps the model's output through the step (``out = model(x);
        loss_fn(out).backward(); opt.step()``): its bytes are alive wherever the modelled
        step (``loss_fn(model(x)).backward()``) frees them, and the previous step's output
        through the forward. Measured on a fake copy with both plans (four fake steps);
        not with ``parallel``.

    Returns
    -------
    Estimate

    Notes
    -----
    The memory model and its assumptions are the module's note. The optimal
    plan is :func:`optimal_plan`'s (the ``auto`` policy's lowest peak, or the least
    recomputation up to the optimizer step's peak); the optimizer's figures do not
    depend on the plan.
    """
    inputs = normalize_inputs(example_inputs)
    leaf_modules = sharded_leaves(model, parallel, leaf_modules)
    model_dev = planned_on(model)
    dev = device or model_dev
    why_not = replay_declined(dev, headroom, parallel, keep_output)
    as_is = None if why_not is not None else _replay_as_is(model, inputs, loss_fn, optimizer, impl, dev)
    # (under FSDP2's mixed precision: what a rank computes in; at the example's shapes: an estimate plans
    # one shape, and dynamic shapes would double the export's time; the replay of the model as it is, which
    # needs no trace, runs where the trace would wait for a trial)
    with while_waiting(as_is):
        tm = rank_trace(model, inputs, parallel, loss_fn=loss_fn, leaf_modules=leaf_modules, capture=capture,
                        dynamic_shapes=False)
    calibrated = calibration_choice(calibrate, dev, model_dev, parallel)
    check_calibrate(calibrated, dev, str(next(model.parameters()).device))  # (meta: refused)
    if calibrated:
        from ..calibration import calibrate as run_calibration

        tm = dataclasses.replace(tm, costs=run_calibration(model, tm, inputs).apply(tm.costs))
    hr = headroom or default_headroom(dev, calibrated=calibrated)
    rank = rank_costs(tm.costs, param_facts(model, tm if is_sharded(parallel) else None, parallel=parallel),
                      tm.param_bytes, parallel)
    opt = optimizer_memory(rank.sizes, optimizer, impl, dev)
    best, replayed, why_not = _plan_and_replay(model, inputs, loss_fn, tm, rank, opt, as_is, why_not)
    kept = [(0, 0), (0, 0)]
    if keep_output:
        check_keep_output(parallel)
        kept = kept_output_extra(model, inputs, loss_fn, tm, [(), best])
    none = peak_estimate(rank, (), opt, NO_CHECKPOINTING, kept[0])
    optimal = peak_estimate(rank, best, opt, OPTIMAL_PLAN, kept[1])
    return Estimate(batch_of(inputs), tm.n, opt, rank.param_bytes, rank.grad_bytes, none, optimal, hr, calibrated,
                    parallel, replayed, why_not if str(dev).startswith("cuda") else None)
