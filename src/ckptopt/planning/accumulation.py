"""Reaching a target batch with gradient accumulation: micro-batch, steps, and the plan for each."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .batch import BatchCosts, memory_and_headroom, optimizer_for, peak_and_plan, search_batch
from .estimate import plan_recompute_share, least_recompute_plan
from .headroom import Headroom
from .optimizer import OptimizerMemory
from .parallel import Parallel

__all__ = ["AccumulationOption", "TrainingPlan", "plan_training"]


@dataclass(frozen=True)
class AccumulationOption:
    """One way to reach the target batch: ``steps`` micro-batches of at most ``micro_batch``.

    Peaks are of the whole loop (the later micro-batches hold every gradient;
    the optimizer step after the last). ``checkpoints``/``stored`` are the plan with
    the least recomputation whose peak fits (None when nothing fits); its
    ``recompute_share`` is the overhead on a step.
    """

    micro_batch: int
    steps: int
    peak_no_checkpointing: int
    peak_optimal: int
    optimal_checkpoints: tuple[int, ...]
    fits_no_checkpointing: bool
    fits_optimal: bool
    checkpoints: tuple[int, ...] | None
    peak_bytes: int | None
    recompute_share: float | None
    plan_solver: str | None
    optimal_stored: tuple[int, ...] = ()
    stored: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("optimal_checkpoints", "optimal_stored", "stored"):
            d[k] = list(getattr(self, k))
        d["checkpoints"] = list(self.checkpoints) if self.checkpoints is not None else None
        return d


@dataclass(frozen=True)
class TrainingPlan:
    """What :func:`plan_training` returns; ``recommended`` indexes ``options`` (None if nothing fits)."""

    target_batch: int
    memory_bytes: int
    optimizer: OptimizerMemory
    options: list[AccumulationOption] = field(default_factory=list)
    recommended: int | None = None
    affine: bool = True
    traces: int = 0
    headroom: Headroom = Headroom()
    usable_bytes: int = 0

    @property
    def recommendation(self) -> AccumulationOption | None:
        return None if self.recommended is None else self.options[self.recommended]

    def to_dict(self) -> dict:
        return dict(target_batch=self.target_batch, memory_bytes=self.memory_bytes, usable_bytes=self.usable_bytes,
                    headroom=self.headroom.to_dict(), optimizer=asdict(self.optimizer), affine=self.affine,
                    traces=self.traces, recommended=self.recommended, options=[o.to_dict() for o in self.options])


def _option(bc: BatchCosts, m: int, k: int, memory: int, opt: OptimizerMemory,
            memory_ckpt: int | None = None) -> AccumulationOption:
    """One accumulation option: ``memory`` is the usable peak without checkpoints, ``memory_ckpt``
    (default ``memory``) with them (the allocator's headroom may differ)."""
    memory_ckpt = memory if memory_ckpt is None else memory_ckpt
    rank = bc.rank(m)
    acc = k > 1
    fb_costs = rank.solver_costs(acc)
    stp = rank.step_peak(opt)
    p_none, _ = peak_and_plan(rank, "none", opt, acc)
    p_opt, best = peak_and_plan(rank, "optimal", opt, acc, final=True)
    chosen, peak, share, solver, stored = None, None, None, None, ()
    if stp <= memory:
        found = least_recompute_plan(fb_costs, memory - opt.state_bytes)
        if found is not None and found.checkpoints and memory_ckpt < memory:  # held to the checkpointed limit
            found = least_recompute_plan(fb_costs, memory_ckpt - opt.state_bytes) if stp <= memory_ckpt else None
        if found is not None and rank.fsdp is not None:  # scored by FSDP2's event-level peak
            fb = rank.fb_peak(found.checkpoints, found.stored, acc).bytes
            limit = memory_ckpt if found.checkpoints else memory
            found = found if fb + opt.state_bytes <= limit else (best if p_opt <= memory_ckpt else None)
        if found is not None:
            chosen, solver, stored = found.checkpoints, found.solver, found.stored
            fb = found.peak_bytes if rank.fsdp is None else rank.fb_peak(found.checkpoints, found.stored, acc).bytes
            peak = max(fb + opt.state_bytes, stp)
            share = plan_recompute_share(fb_costs, chosen, stored)[1]
    fits_opt = p_opt <= (memory_ckpt if best.checkpoints else memory)
    return AccumulationOption(m, k, p_none, p_opt, best.checkpoints, p_none <= memory, fits_opt,
                              chosen, peak, share, solver, best.stored, stored)


def _steps_range(target: int, m_first: int, m_last: int | None, limit: int) -> list[int]:
    """Accumulation step counts, each with a new micro-batch size, from the fewest with a micro-batch
    of at most ``m_first`` to the fewest with at most ``m_last`` (at most ``limit`` between, then
    that last one; without ``m_last`` the first ``limit``)."""
    k_first = math.ceil(target / m_first)
    k_last = max(k_first, math.ceil(target / m_last)) if m_last else target
    ks = []
    for k in range(k_first, k_last + 1):
        if not ks or math.ceil(target / k) != math.ceil(target / ks[-1]):
            ks.append(k)
        if len(ks) >= limit:
            break
    if m_last and ks[-1] != k_last:
        ks.append(k_last)
    return ks


def plan_training(model, example_inputs, target_batch: int, memory=None, optimizer: str = "adam",
                  impl: str | None = None, device: str | None = None, loss_fn=None, leaf_modules=None, capture="auto",
                  max_options: int = 8, headroom: Headroom | None = None,
                  parallel: Parallel | None = None) -> TrainingPlan:
    """Micro-batch and accumulation steps that reach ``target_batch`` within ``memory``.

    For k accumulation steps the micro-batch is ``ceil(target_batch / k)`` (the
    batch split as evenly as possible; exactly ``target_batch / k`` when k
    divides it). Options run from the fewest steps that fit with the optimal
    plan to the fewest that fit with no checkpointing; each gives the peak
    with no checkpointing, with the optimal plan, and the plan with the least
    recomputation that fits, with its overhead.

    Parameters
    ----------
    target_batch : int
        The batch the optimizer step should see.
    memory : int or str, optional
        The memory of the device (``"8GiB"``...); default: what it has free.
    headroom : Headroom, optional
        Kept free below ``memory`` (see :func:`max_batch`): every option's peak fits in
        ``headroom.usable(memory)``.
    parallel : Parallel, optional
        One rank of a DDP or FSDP2 run: the batches are the rank's (see :func:`estimate`).
    max_options : int, default 8
        At most this many options between the two ends (the ends are always listed).
    optimizer, impl, device, loss_fn, leaf_modules, capture
        As for :func:`estimate`.

    Returns
    -------
    TrainingPlan
        ``recommended``: the fewest accumulation steps, then the least
        recomputation (the first option that fits).

    Raises
    ------
    ValueError
        ``target_batch`` is not a positive integer.
    """
    if isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1:
        raise ValueError(f"target_batch must be a positive integer, got {target_batch!r}")
    bc = BatchCosts(model, example_inputs, loss_fn, leaf_modules, capture=capture, parallel=parallel)
    opt = optimizer_for(bc, optimizer, impl, device)
    total, hr, mem = memory_and_headroom(bc, memory, device, headroom)
    mem_ckpt = hr.usable(total, checkpointed=True)
    whole = _option(bc, target_batch, 1, mem, opt, mem_ckpt)
    options = [whole]
    if not whole.fits_no_checkpointing:
        m_opt = search_batch(bc, "optimal", mem_ckpt, opt, accumulate=True, cap=target_batch).batch
        m_none = search_batch(bc, "none", mem, opt, accumulate=True, cap=target_batch).batch
        if m_opt:
            ks = _steps_range(target_batch, m_opt, m_none or None, max_options)
            options += [_option(bc, math.ceil(target_batch / k), k, mem, opt, mem_ckpt) for k in ks if k > 1]
    options.sort(key=lambda o: o.steps)
    rec = next((i for i, o in enumerate(options) if o.checkpoints is not None), None)
    return TrainingPlan(target_batch, total, opt, options, rec, bc.affine, bc.traces, hr, mem)
