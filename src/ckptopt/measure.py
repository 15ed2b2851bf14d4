"""Measuring real training steps: the peak of one step, exactly, on any device.

* :func:`measure_peak` / :func:`measure_peak_detailed`: the peak bytes of one
  training step (forward, loss, backward) of a whole model, optionally rewritten
  with a plan, optionally on a fake-tensor copy (no memory);
* :func:`measure_plans_fake`: many plans measured on one fake copy;
* :func:`measure_training_step`: a whole steady-state step with the optimizer
  (what :mod:`ckptopt.planning` predicts), with gradient accumulation.

On CPU the figures come from :class:`ckptopt.tracker.StorageTracker` (exact live
tensor storages; kernel scratch memory is invisible), on CUDA from
``torch.cuda.max_memory_allocated`` (``docs/design.md`` §2).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .plan import Plan, normalize_plan, normalize_stored
from .planning.optimizer import IMPLS, check_optimizer
from .rewriter import CheckpointedModule, apply_plan
from .fake import fake_copy
from .simulator import simulate
from .torch_utils import (Inputs, check_module, default_loss, no_lasting_state, normalize_inputs,
                          resolve_device, tensor_leaves)
from .tracer import TracedModel, trace
from .tracer.capture.blocks import rebind
from .storages import storage_bytes
from .tracker import StorageTracker

__all__ = ["PeakMeasurement", "measure_peak", "measure_peak_detailed", "measure_plans_fake", "step_seconds",
           "measure_training_step", "measure_rank_step", "make_optimizer"]


@dataclass(frozen=True)
class PeakMeasurement:
    """Result of :func:`measure_peak_detailed`.

    Attributes
    ----------
    peak_bytes : int
        Peak bytes of the training step (see :func:`measure_peak`).
    reserved_bytes : int or None
        CUDA only: peak bytes reserved by the caching allocator
        (``torch.cuda.max_memory_reserved``), what ``nvidia-smi`` shows.
    device : torch.device
        The device measured.
    timeline : list of (op_index, op_name, current_bytes) or None
        CPU (tracker) only: live bytes after every operator of the step.
    output_bytes : int or None
        With ``keep_output``: the bytes of the model's output the loop keeps (tracker only).
    """

    peak_bytes: int
    reserved_bytes: int | None
    device: torch.device
    timeline: list[tuple[int, str, int]] | None
    output_bytes: int | None = None


def forward_loss(model: nn.Module, inputs: Inputs, loss_fn: Callable | None) -> torch.Tensor:
    """Forward and loss; returns only the loss so that nothing else stays referenced."""
    return _loss_of(_forward(model, inputs), loss_fn)


def _forward(model: nn.Module, inputs: Inputs) -> Any:
    """The model's output, checked to have something to train."""
    out = inputs.call(model)
    leaves = list(tensor_leaves(out))
    if not any(t.requires_grad for t in leaves):
        if not leaves:
            raise ValueError(
                f"the model returned {type(out).__name__} with no tensors in it; measure_peak "
                "needs a tensor output (or a tuple/list/dict of tensors) to run a backward pass"
            )
        trainable = any(p.requires_grad for p in model.parameters())
        grad_inputs = any(t.requires_grad for t in inputs.tensors())
        if not trainable and not grad_inputs:
            raise ValueError(
                "the model has no trainable parameters (no parameter has requires_grad=True) and no "
                "input requires grad, so a training step has no backward pass to measure; unfreeze "
                "the parameters (p.requires_grad_(True)) or pass an input that requires grad"
            )
        raise ValueError(
            "the model's output does not require grad although the model has trainable parameters "
            "or inputs: it was detached or computed under torch.no_grad() inside forward, so there "
            "is no backward pass to measure"
        )
    del leaves
    return out


def _loss_of(out: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The scalar loss of ``out`` (checked)."""
    loss = loss_fn(out) if loss_fn is not None else default_loss(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        raise ValueError(f"loss_fn must return a scalar tensor, got {what}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a loss that does not require grad; compute it from the model output")
    return loss


def _train_step(model: nn.Module, inputs: Inputs, loss_fn: Callable | None) -> None:
    loss = forward_loss(model, inputs, loss_fn)
    loss.backward()
    del loss


def step_seconds(models: Sequence[nn.Module], example_inputs: Any, loss_fn: Callable | None = None,
                 rounds: int = 5) -> list[float]:
    """The median time of one training step (forward, loss, backward) of each of ``models`` on the
    same batch: one warm-up step each, then ``rounds`` rounds, each running every model once in an
    order rotated by one per round (so that drifts in the machine's speed fall on all alike).
    Gradients are dropped before each step (``zero_grad(set_to_none=True)``), as a training loop does."""
    import statistics
    import time

    inputs = normalize_inputs(example_inputs)
    dev = resolve_device(models[0], inputs.tensors(), None, "step_seconds")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def one(model: nn.Module) -> float:
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        _train_step(model, inputs, loss_fn)
        sync()
        return time.perf_counter() - t0

    times: list[list[float]] = [[] for _ in models]
    with no_lasting_state(models[0], inputs.tensors(), dev):
        for m in models:
            one(m)
        for r in range(rounds):
            for k in range(len(models)):
                j = (k + r) % len(models)
                times[j].append(one(models[j]))
        for m in models:
            m.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def _kept_output_steps(model: nn.Module, inputs: Inputs, loss_fn: Callable | None,
                       between: Callable[[], None], output_bytes: Callable[[Any], int]) -> int:
    """Two steps of a loop that keeps the model's output, ``out = model(x); loss_fn(out).backward()``:
    the second runs its forward while the first's output is alive (``out`` is rebound only once
    the forward returns) and its backward while its own is. ``between()`` runs before the
    second step (the peak to measure starts there); returns ``output_bytes(out)``."""
    out = _forward(model, inputs)
    _loss_of(out, loss_fn).backward()
    model.zero_grad(set_to_none=True)  # (before each step, as modelled)
    between()
    new = _forward(model, inputs)
    out = new
    del new
    size = output_bytes(out)
    loss = _loss_of(out, loss_fn)
    loss.backward()
    del loss, out
    return size


def _as_plan(traced: TracedModel, checkpoints, stored=()) -> Plan:
    """A :class:`Plan` as it is, or segment-start layers (and stored segments) as a plan of ``traced``."""
    if isinstance(checkpoints, Plan):
        return checkpoints
    cps = normalize_plan(traced.costs, checkpoints)
    stored = normalize_stored(cps, stored)
    return Plan(cps, simulate(traced.costs, cps, stored).peak_bytes, "given", 0.0, traced.n, stored)


def _with_checkpoints(model: nn.Module, inputs: Inputs, loss_fn, checkpoints, stored=()) -> CheckpointedModule:
    """``model`` traced and rewritten to checkpoint at ``checkpoints`` (a Plan or segment-start layers)."""
    tm = trace(model, inputs, loss_fn=loss_fn)
    return apply_plan(model, tm, _as_plan(tm, checkpoints, stored))


def fake_peaks(model: nn.Module, inputs: Inputs, loss_fn, plans: Iterable[Any],
               build: Callable[[nn.Module, Any], nn.Module], timeline: bool = False,
               keep_output: bool | Sequence[bool] = False) -> list[PeakMeasurement]:
    """One fake-tensor copy of ``model``; for each plan, the tracked peak of one step of
    ``build(copy, plan)`` (the copy itself for ``None``), or with ``keep_output`` (one flag, or
    one per plan) of a loop's step that keeps the output (:func:`_kept_output_steps`). Nothing is
    allocated."""
    fake = fake_copy(model, inputs)
    tensors = fake.inputs.tensors()
    dev = tensors[0].device if tensors else torch.device("cpu")
    out = []
    plans = list(plans)
    keeps = [keep_output] * len(plans) if isinstance(keep_output, bool) else list(keep_output)
    for plan, keep in zip(plans, keeps):
        run = fake.model if plan is None else build(fake.model, plan)
        for prm in fake.model.parameters():
            prm.grad = None
        tracker = StorageTracker(timeline=timeline, fake=True)
        try:
            with fake.mode, torch.enable_grad():
                tracker.register(fake.model, tensors)
                with tracker:
                    size = _tracked_step(run, fake.inputs, loss_fn, tracker, keep)
            out.append(PeakMeasurement(int(tracker.peak_bytes), None, dev, tracker.timeline, size))
        finally:
            tracker.detach()
            if run is not fake.model:
                run.remove_hooks()
    return out


def _tracked_step(model: nn.Module, inputs: Inputs, loss_fn, tracker: StorageTracker,
                  keep_output: bool) -> int | None:
    """One step under ``tracker`` (its peak is the step's), or with ``keep_output`` a kept-output
    loop's step; returns the output's bytes then (storages the step made), else None."""
    if not keep_output:
        _train_step(model, inputs, loss_fn)
        return None
    before = set(tracker.storages)

    def made(out) -> int:
        return storage_bytes(tensor_leaves(out), exclude=before, fake=tracker.fake)[0]

    return _kept_output_steps(model, inputs, loss_fn, tracker.reset_peak, made)


def _measure_fake(model: nn.Module, inputs: Inputs, loss_fn, checkpoints=None,
                  keep_output: bool = False) -> PeakMeasurement:
    """The tracker's figure for one step of a fake copy of ``model``: nothing is allocated.

    With ``checkpoints``, ``model`` is traced and the plan applied to the fake
    copy (a rewritten module is not copied: it wraps the traced graph).
    """
    from .inplace import attached

    if attached(model) is not None:  # a model with a plan attached in place: its plan, on a plain copy
        if checkpoints is not None:
            raise ValueError("measure_peak: the model already has a ckptopt plan attached; pass checkpoints= "
                             "with a plain model (ckptopt.detach(model)), or leave it out")
        module = attached(model)
        return fake_peaks(model, inputs, loss_fn, [module.plan], lambda fm, p: apply_plan(fm, module.traced, p),
                           timeline=True, keep_output=keep_output)[0]
    if isinstance(model, CheckpointedModule):
        # a rewritten module is not copied (deep-copying its graphs overflows the recursion
        # limit on large models): its plan is applied again to a fake copy of the original
        if checkpoints is not None:
            raise ValueError("measure_peak: the model is already rewritten (a CheckpointedModule); "
                             "pass checkpoints= with the original model, or leave it out")
        traced, plans, base = model.traced, [model.plan], model.original
    elif checkpoints is None:
        traced, plans, base = None, [None], model
    else:
        traced = trace(model, inputs, loss_fn=loss_fn)
        plans, base = [_as_plan(traced, checkpoints)], model
    return fake_peaks(base, inputs, loss_fn, plans, lambda fm, p: apply_plan(fm, traced, p), timeline=True,
                       keep_output=keep_output)[0]


def measure_plans_fake(model: nn.Module, example_inputs: Any, traced: TracedModel, plans: Iterable[Any],
                       loss_fn: Callable | None = None,
                       apply: Callable[[nn.Module, TracedModel, Any], nn.Module] = apply_plan) -> list[int]:
    """The measured peak of one training step of ``model`` rewritten with each plan, on one
    fake-tensor copy (nothing is allocated).

    Each figure is that of ``measure_peak(model, x, checkpoints=plan, fake=True)``; the model
    is copied once and not traced again, so many plans cost one step each.

    Parameters
    ----------
    traced : TracedModel
        ``ckptopt.trace(model, x)``.
    plans : iterable of Plan or tuple of int
        A tuple is a chain plan (segment-start layers) for ``traced``.
    apply : callable, default :func:`ckptopt.apply_plan`
        ``apply(model, traced, plan)`` rewrites the fake copy with a plan.
    """
    check_module(model, "measure_plans_fake")
    inputs = normalize_inputs(example_inputs)
    plans = [_as_plan(traced, p) if isinstance(p, (tuple, list)) else p for p in plans]
    return [m.peak_bytes for m in fake_peaks(model, inputs, loss_fn, plans, lambda fm, p: apply(fm, traced, p))]


def measure_peak_detailed(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                          *, checkpoints: Any = None, device: Any = None, fake: bool = False,
                          keep_output: bool = False) -> PeakMeasurement:
    """Like :func:`measure_peak` (the same arguments), with the reserved bytes, device and timeline.

    Returns
    -------
    PeakMeasurement
        ``reserved_bytes`` is set on CUDA only, ``timeline`` on other devices
        only (it lists the live bytes after each operator of the step).
    """
    check_module(model, "measure_peak")
    inputs = normalize_inputs(example_inputs)
    if fake:
        return _measure_fake(model, inputs, loss_fn, checkpoints, keep_output)
    if checkpoints is not None:
        model = _with_checkpoints(model, inputs, loss_fn, checkpoints)
    tensors = inputs.tensors()
    dev = resolve_device(model, tensors, device, "measure_peak")

    with no_lasting_state(model, tensors, dev):
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            if keep_output:
                def between():
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)

                _kept_output_steps(model, inputs, loss_fn, between, lambda out: 0)
            else:
                _train_step(model, inputs, loss_fn)
            torch.cuda.synchronize(dev)
            return PeakMeasurement(
                peak_bytes=int(torch.cuda.max_memory_allocated(dev)),
                reserved_bytes=int(torch.cuda.max_memory_reserved(dev)),
                device=dev,
                timeline=None,
            )
        tracker = StorageTracker(timeline=True)
        tracker.register(model, tensors)
        try:
            with tracker:
                size = _tracked_step(model, inputs, loss_fn, tracker, keep_output)
            return PeakMeasurement(
                peak_bytes=tracker.peak_bytes, reserved_bytes=None, device=dev, timeline=tracker.timeline,
                output_bytes=size,
            )
        finally:
            tracker.detach()


def measure_peak(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    checkpoints: Any = None,
    device: Any = None,
    fake: bool = False,
    keep_output: bool = False,
) -> int:
    """Peak bytes of one training step: forward, loss, backward.

    Parameters
    ----------
    model : nn.Module
        Measured in its current mode (``train()``/``eval()``).
    example_inputs : Tensor, tuple or list
        A tensor, or the positional arguments for ``model(*args)``.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar tensor``. Default:
        ``output.float().pow(2).mean()`` for a tensor output, and the sum of
        that over the tensors that require grad in a tuple/list/dict output.
        Not ``.sum()``: its gradient is an expanded 4-byte tensor, which hides
        the output-gradient term (docs/design.md §2).
    checkpoints : Plan or sequence of int, optional
        Measure the model rewritten with this plan (traced first; see
        :func:`ckptopt.apply_plan`) instead of the model as it is.
    device : str or torch.device, optional
        The device to measure; it must be where the model and inputs already
        are (they are never moved). Default: inferred from them.
    fake : bool, default False
        Run the step on a fake-tensor copy of the model (``FakeTensorMode``)
        and count its storages: the same figure as the CPU tracker, for any
        batch size, without allocating activations (the copy's parameters
        are fake too). The model itself is not run.
    keep_output : bool, default False
        Measure the step of a loop that keeps the model's output, ``out = model(x);
        loss_fn(out).backward()``: two steps are run and the second measured, its forward
        with the first's output alive (``out`` is rebound once the forward returns), its
        backward with its own.

    Returns
    -------
    int
        On CUDA, ``torch.cuda.max_memory_allocated`` over the step (after
        ``reset_peak_memory_stats``): everything allocated on the device,
        kernel scratch memory included. Elsewhere (CPU), the peak of a
        :class:`StorageTracker` with the parameters, buffers and inputs (and
        nothing else that existed before) registered as live from the start.
        The model output is not held while backward runs (``loss_fn(model(x)).backward()``;
        see ``keep_output``); the scalar loss is.

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module``.
    ValueError
        Inputs on another device than the parameters (both are named), or an
        output with nothing requiring grad (no trainable parameters, or a
        detached output), or a ``loss_fn`` that does not return a scalar.

    Notes
    -----
    The call leaves no state behind: parameter ``.grad`` s are set to None
    before the step (any existing gradients are discarded) and after it,
    buffers (BatchNorm running statistics) are restored from a CPU copy, an
    input's ``.grad`` is restored, and the RNG state is forked. The step runs
    under ``torch.enable_grad()``.

    Examples
    --------
    >>> import torch
    >>> lin = torch.nn.Linear(1000, 2000, bias=False)
    >>> x = torch.randn(10, 1000)
    >>> measure_peak(lin, x)  # W + X + grad(Y) + grad(W) + 8 (loss, its seed grad)
    16120008
    """
    return measure_peak_detailed(model, example_inputs, loss_fn, checkpoints=checkpoints, device=device, fake=fake,
                                 keep_output=keep_output).peak_bytes


# --------------------------------------------------------------------------
# a whole training step with the optimizer (what ckptopt.planning predicts)
# --------------------------------------------------------------------------
def make_optimizer(params, optimizer: str = "adam", impl: str = "for-loop"):
    """The torch optimizer that :func:`ckptopt.planning.optimizer_memory` models (lr 0.01 for SGD,
    else defaults)."""
    name = check_optimizer(optimizer)
    if impl not in IMPLS:
        raise ValueError(f"unknown optimizer implementation {impl!r}; use 'for-loop' or 'foreach'")
    foreach = impl == "foreach"
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9 if name == "sgd-momentum" else 0.0, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, foreach=foreach)
    return None


def measure_training_step(model, example_inputs, optimizer: str = "adam", impl: str = "for-loop",
                          checkpoints=None, accumulation_steps: int = 1, loss_fn=None, stored=()) -> int:
    """Measured peak of one steady-state training step on CPU, optimizer step included.

    The optimizer's state is allocated first by one step on zero gradients
    (which leaves Adam's and SGD's parameters unchanged), then the step runs
    under a :class:`ckptopt.StorageTracker` that counts the parameters,
    buffers, inputs and optimizer state from the start::

        for j in range(accumulation_steps):
            loss = loss_fn(model(*inputs)); loss.backward()   # loss dropped between micro-batches
        optimizer.step(); optimizer.zero_grad()               # the last loss still referenced

    Every micro-batch uses ``example_inputs``. Buffers (BatchNorm statistics)
    and the RNG state are restored afterwards, gradients are None.

    Parameters
    ----------
    model : nn.Module
        On the CPU, in training mode.
    checkpoints : Plan or sequence of int, optional
        Measure the model rewritten with this plan.
    accumulation_steps : int, default 1
    stored : sequence of int, optional
        With ``checkpoints`` given as layers: the segments left unwrapped
        (:attr:`ckptopt.Plan.stored`, as planning's results carry them).

    Returns
    -------
    int
        Peak bytes.
    """
    inputs = normalize_inputs(example_inputs)
    module = model if checkpoints is None else _with_checkpoints(model, inputs, loss_fn, checkpoints, stored)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer, impl)
    tensors = inputs.tensors()
    with no_lasting_state(module, tensors, torch.device("cpu")):
        _optimizer_state(opt, params)
        state = [t for st in (opt.state.values() if opt is not None else ()) for t in st.values()
                 if isinstance(t, torch.Tensor)]
        tracker = StorageTracker()
        tracker.register(module, tensors, state)
        try:
            with tracker:
                for j in range(accumulation_steps):
                    loss = forward_loss(module, inputs, loss_fn)
                    loss.backward()
                    if j < accumulation_steps - 1:
                        del loss
                _optimizer_step(opt)
                del loss
            return tracker.peak_bytes
        finally:
            tracker.detach()


def _optimizer_step(opt: Any) -> None:
    """The optimizer's step, gradients set to None after (as training loops do)."""
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _optimizer_state(opt: Any, params: list) -> None:
    """Create the optimizer's state before a measured step (one step on zero gradients), as a run that
    has trained before has it."""
    if opt is not None:
        for p in params:
            p.grad = torch.zeros_like(p)
        _optimizer_step(opt)


@contextmanager
def _fsdp_storage_events(tracker: StorageTracker):
    """FSDP2 frees and re-allocates gathered parameters by resizing their storages
    (``untyped_storage().resize_``), which no operator reports: tell the tracker."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def tracked_alloc(t):
        alloc(t)
        tracker.resized(t)

    def tracked_free(t):
        free(t)
        tracker.resized(t)

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = tracked_alloc
    _fsdp_param.free_storage = tracked_free
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc
        _fsdp_param.free_storage = free


def measure_rank_step(model: nn.Module, example_inputs, parallel, optimizer: str = "sgd", checkpoints=None,
                      stored=(), loss_fn=None, blocks=None, mesh=None, impl: str = "for-loop") -> int:
    """Measured peak of one steady-state training step of this rank under DDP or FSDP2 (CPU).

    The process group must be initialized (gloo, or the fake backend of
    ``torch.testing._internal.distributed.fake_pg``, whose collectives move no data:
    the memory is the same). ``model`` is wrapped as :class:`ckptopt.planning.Parallel`
    says (DDP; or ``fully_shard`` on each block, ``blocks`` default
    :func:`ckptopt.planning.param_facts.repeated_blocks`, then on the model), rewritten first
    with ``checkpoints`` if given (the blocks kept whole: FSDP2 gathers a block when it is
    called). One step runs first (FSDP2's lazy setup, DDP's bucket rebuild), then
    ``optimizer``'s state is made and one step is measured under the exact tracker
    (forward, loss, backward, optimizer step, ``zero_grad``). The model trains: its
    parameters change and it stays wrapped.
    """
    from .planning.param_facts import fsdp_options, rank_trace, repeated_blocks

    inputs = normalize_inputs(example_inputs)
    blocks = repeated_blocks(model) if blocks is None else list(blocks)
    module = model
    if checkpoints is not None:
        fsdp = parallel.strategy == "fsdp"
        # (under mixed precision: the compute dtype's graph)
        tm = rank_trace(model, inputs, parallel, loss_fn=loss_fn, leaf_modules=blocks if fsdp else None)
        module = apply_plan(model, tm, _as_plan(tm, checkpoints, stored))
    # everything runs under the tracker (from before the wrapping: DDP's buckets, FSDP2's shards)
    tracker = StorageTracker()
    tracker.register(model, inputs.tensors())
    try:
        with tracker, _fsdp_storage_events(tracker) if parallel.strategy == "fsdp" else nullcontext():
            if parallel.strategy == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                module = DistributedDataParallel(module, bucket_cap_mb=parallel.bucket_cap_mb,
                                                 gradient_as_bucket_view=parallel.gradient_as_bucket_view)
            else:
                from torch.distributed.fsdp import fully_shard

                mp = fsdp_options(parallel)
                for path in blocks:
                    fully_shard(model.get_submodule(path), mesh=mesh,
                                reshard_after_forward=parallel.reshard_after_forward, **mp)
                fully_shard(module, mesh=mesh, **mp)
                if checkpoints is not None:
                    rebind(tm.gm, model)  # (the traced graph held the unsharded parameters)
            params = [p for p in module.parameters() if p.requires_grad]
            opt = make_optimizer(params, optimizer, impl)
            for _ in range(2):  # lazy setup, DDP's bucket rebuild (at the second forward)
                _train_step(module, inputs, loss_fn)
                for p in params:
                    p.grad = None
            _optimizer_state(opt, params)
            gc.collect()
            tracker.reset_peak()
            loss = forward_loss(module, inputs, loss_fn)
            loss.backward()
            _optimizer_step(opt)
            del loss
        return tracker.peak_bytes
    finally:
        tracker.detach()

