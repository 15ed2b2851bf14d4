"""``optimize_checkpoints``: trace, solve, rewrite in one call."""

from __future__ import annotations

import dataclasses
import random
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn as nn

from .errors import TraceError
from .plan import Plan
from .rewriter import CheckpointedModule, apply_plan
from .simulator import simulate
from .solvers.registry import check_budget, lookup, solve
from .torch_utils import (ATOMS, PythonState, base_container, data_dependent_construct, default_loss,
                          describe_value, normalize_inputs, own_checkpointing_hint, python_state,
                          restore_python_state, source_line)
from .fake import fake_copy, idle_module_to, quiet_fake_errors
from .tracer.capture import check_capture_mode

__all__ = ["optimize_checkpoints"]


def optimize_checkpoints(
    model: nn.Module,
    example_inputs: Any,
    solver: str = "auto",
    budget: int | None = None,
    loss_fn: Callable | None = None,
    leaf_modules: Iterable[str | type] | None = None,
    capture: str = "auto",
    calibrate: bool | None = None,
    in_place: bool | None = None,
    parallel=None,
) -> nn.Module:
    """Return ``model`` rewritten to train with the lowest peak memory.

    Parameters
    ----------
    model : nn.Module
        The model, in training mode, on the device it trains on.
    example_inputs : Tensor, tuple or dict
        One training batch as the model is called: a tensor, a tuple of
        positional arguments, or a dict of keyword arguments (``model(**batch)``,
        what a HuggingFace collator yields), at the shapes training will use.
        The returned module is called the same way.
    solver : str
        ``"auto"`` (:mod:`ckptopt.solvers.policy`): without a budget, the lowest
        peak (exact ``dp2`` up to 15,000 layers, ``linear`` beyond), the least
        recomputation among the plans reaching it; up to about 2,800 layers
        the search also covers plans that leave middle segments unwrapped
        (:attr:`Plan.stored`), which sometimes peak lower or recompute less
        (the plan's solver then reads ``"dp2+stored"``). With a budget,
        ``budget``: the plan with the least recomputation whose peak fits.
        Or any name of :data:`ckptopt.SOLVERS` (those search checkpoint-only
        plans, the paper's plan space).
    budget : int or "device", optional
        Peak-memory budget in bytes; :class:`ckptopt.InfeasibleBudget` (with
        the smallest achievable peak) when no plan fits. ``"device"``: what the
        device has free (CUDA: ``torch.cuda.mem_get_info``; CPU: the system's
        available memory) less the headroom the caching allocator needs
        (:func:`ckptopt.planning.headroom`): the plan with the least recomputation
        that fits ("just make it fit").
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar`` used for planning. Default: the output's
        ``loss`` when it carries one (a HuggingFace model given ``labels``), else
        ``output.pow(2).mean()``, which has an output-sized gradient like most losses.
    leaf_modules : iterable of str or type, optional
        Submodules to trace as opaque layers (see :func:`ckptopt.trace`).
    capture : str, default "auto"
        How the forward becomes a graph: ``"fx"`` (``torch.fx``), ``"export"``
        (``torch.export``, non-strict) or ``"auto"``: FX, and export for models
        whose own forward FX cannot trace (HuggingFace transformers).
    calibrate : bool, optional
        Run each layer once on the device (:mod:`ckptopt.calibration`): library
        workspaces and allocator scratch join the predicted peak, and recomputation
        is priced in measured seconds. Default: on CUDA, off elsewhere.
    in_place : bool, optional
        Attach the plan to ``model`` itself and return ``model`` (:mod:`ckptopt.inplace`):
        it stays an instance of its class, with its own forward signature, ``config`` and
        ``save_pretrained``, as HuggingFace's ``Trainer``, PEFT, accelerate and TRL expect.
        Default: for transformers, PEFT and diffusers models; other models get a wrapper.
        ``ckptopt.detach(model)`` undoes it.
    parallel : ckptopt.planning.Parallel, optional
        Plan one rank of a data-parallel run (``example_inputs``: the rank's batch) for the
        memory that rank holds (``docs/design.md`` §13). ``Parallel(W, "ddp")``: DDP's gradient
        buckets count (wrap the returned module in ``DistributedDataParallel`` yourself).
        ``Parallel(W, "fsdp")``: the repeated blocks stay whole in the graph (FSDP2 gathers a
        block when it is called: an exported graph calls each block again, through
        :class:`~ckptopt.tracer.capture.blocks.BlockCall`), the plan is chosen for FSDP2's
        per-rank memory, and the returned module is sharded with ``fully_shard`` on each block
        and on itself (the process group must be initialized; the default device mesh).

    Returns
    -------
    nn.Module
        ``model`` itself with the plan attached (``in_place``), or a
        :class:`CheckpointedModule` sharing its parameters and buffers. Either has
        ``.plan``, ``.predicted_peak_bytes``, ``.explain()`` and ``.predicted_peak_for()``;
        a wrapper's missing attributes fall through to ``model`` (``.config``, ``.generate``).
        It returns what ``model`` returns (a ``ModelOutput``, a dict, a tuple).
        In eval mode, under ``torch.no_grad()`` and for calls that do not match
        the planned signature, a ``torch.export``-captured model runs its own
        forward. When no plan beats no checkpointing it runs the model unchanged
        and says so in ``explain()``. Before it is returned (unless sharded with FSDP2),
        one training step runs through it on a fake-tensor copy (no memory, the model untouched).

    Raises
    ------
    TraceError
        When the model cannot be captured or measured (naming the construct and what
        to do), or when that training step fails (the plan would have failed at the
        first training call).

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> fast = optimize_checkpoints(model, torch.randn(32, 64))
    >>> fast(torch.randn(32, 64)).shape
    torch.Size([32, 64])
    """
    _check_arguments(model, example_inputs, solver, capture, budget)
    _detach_earlier_plan(model)
    sharded = parallel is not None and parallel.strategy == "fsdp"
    if sharded:
        from .planning.estimate import sharded_leaves

        leaf_modules = sharded_leaves(model, parallel, leaf_modules)
    tm = _traced_and_checked(model, example_inputs, parallel, loss_fn, leaf_modules, capture)
    device = _device_of(model)
    tm = _calibrated(model, tm, example_inputs, calibrate, parallel, device)
    if budget == "device":
        from .planning import device_budget

        budget = device_budget(device, calibrated=tm.calibration is not None)
    plan = _rank_plan(model, tm, parallel, solver, budget) if parallel is not None else _plan(tm, solver, budget)
    module = apply_plan(model, tm, plan)
    if sharded:
        _fully_shard(model, module, leaf_modules, parallel)
        from .tracer.capture.blocks import rebind

        rebind(tm.gm, model)
    else:
        _verify_training_step(module, example_inputs, loss_fn)
        if tm.capture is not None and tm.capture.front_end != "fx":
            _replan_other_calls(model, module, _Replan(solver=solver, budget=budget, loss_fn=loss_fn,
                                                       leaf_modules=leaf_modules, capture=capture,
                                                       calibrate=calibrate, parallel=parallel))
    from .inplace import attach, inspected_by_type

    if in_place if in_place is not None else inspected_by_type(model):
        return attach(model, module)
    return module


def _check_arguments(model: nn.Module, example_inputs: Any, solver: str, capture: str, budget) -> None:
    """Fail before tracing on a bad solver name, capture mode or budget, or a model or inputs on
    the meta device."""
    from .tracer.meta import refuse_meta

    lookup(solver)
    check_capture_mode(capture)
    if budget is not None and budget != "device":
        check_budget(budget)
    refuse_meta(model, normalize_inputs(example_inputs), "optimize_checkpoints")


def _detach_earlier_plan(model: nn.Module) -> None:
    """Detach a plan attached to ``model`` before, so that it is planned again from its own forward
    (not while that plan replans a call of another structure)."""
    from .inplace import attached, detach, planning_now

    if attached(model) is not None and not planning_now(model):
        detach(model)


def _traced_and_checked(model: nn.Module, example_inputs: Any, parallel, loss_fn: Callable | None,
                        leaf_modules, capture: str):
    """The rank's traced model, its forward checked for Python side effects (a note on the capture
    when the check could not run). The model's plain-Python state is restored afterwards: FX runs
    the forward's Python code on the model itself. Under FSDP2's mixed precision the trace is of a
    copy in the compute dtype."""
    from .planning.param_facts import rank_trace

    state = python_state(model) if isinstance(model, nn.Module) else PythonState(attrs=[], keys=[], contents={})
    try:
        tm = rank_trace(model, normalize_inputs(example_inputs), parallel, loss_fn=loss_fn,
                        leaf_modules=leaf_modules, capture=capture)
        front_end = tm.capture.front_end if tm.capture is not None else "fx"
        note = _check_forward_has_no_python_side_effects(model, example_inputs, front_end)
        if note and tm.capture is not None:
            tm.capture.notes.append(note)
    finally:
        restore_python_state(state)
    return tm


def _calibrated(model: nn.Module, tm, example_inputs: Any, calibrate: bool | None, parallel, device: torch.device):
    """``tm`` with its costs calibrated on the device when ``calibrate`` (or its default) says so."""
    from .planning.estimate import calibration_choice

    if not calibration_choice(calibrate, str(device), str(device), parallel):
        return tm
    from .calibration import calibrate as run_calibration

    cal = run_calibration(model, tm, example_inputs)
    return dataclasses.replace(tm, costs=cal.apply(tm.costs), calibration=cal)


def _plan(tm, solver: str, budget: int | None) -> Plan:
    """The plan for one process: none (no checkpoint) when the solver's plan peaks no lower than
    training without checkpoints."""
    plan = solve(tm.costs, solver, budget=budget)
    base = simulate(tm.costs, ())
    if plan.peak_bytes >= base.peak_bytes and plan.checkpoints:
        return Plan(checkpoints=(), peak_bytes=base.peak_bytes, solver=plan.solver, solve_seconds=plan.solve_seconds,
                    n=plan.n)
    return plan


@dataclass(frozen=True)
class _Replan:
    """The arguments a call of another structure is planned with (``budget`` in bytes)."""

    solver: str
    budget: int | None
    loss_fn: Callable | None
    leaf_modules: Iterable[str | type] | None
    capture: str
    calibrate: bool | None
    parallel: Any = None  #: a rank's plan is planned again as that rank's


def _replan_other_calls(model: nn.Module, module: nn.Module, again: _Replan) -> None:
    """Plan a training call of another structure the same way on first sight: a keyword HF's Trainer
    adds (``num_items_in_batch``), or shapes other than the example's, at which the capture was made."""
    def replan(call):
        from .inplace import planning

        with planning(model):
            return optimize_checkpoints(model, call, solver=again.solver, budget=again.budget, loss_fn=again.loss_fn,
                                        leaf_modules=again.leaf_modules, capture=again.capture,
                                        calibrate=again.calibrate, parallel=again.parallel, in_place=False)

    object.__setattr__(module, "_replan", replan)


def _rank_plan(model: nn.Module, tm, parallel, solver: str, budget) -> Plan:
    """The plan for one rank of ``parallel`` (its buckets, shards and gathered blocks counted)."""
    from .errors import InfeasibleBudget
    from .planning.estimate import optimal_plan
    from .planning.optimizer import optimizer_memory
    from .planning.ranks import rank_costs
    from .planning.param_facts import param_facts

    rank = rank_costs(tm.costs, param_facts(model, tm, parallel=parallel), tm.param_bytes, parallel)
    if rank.fsdp is None or (solver != "auto" and budget is None):
        plan = solve(rank.costs, solver, budget=budget)
        return plan if rank.fsdp is None else dataclasses.replace(
            plan, peak_bytes=rank.fb_peak(plan.checkpoints, plan.stored).bytes)
    best = optimal_plan(rank, optimizer_memory(rank.sizes, "none"))  # (the forward+backward peak alone)
    if budget is None or best.peak_bytes > budget:
        if budget is not None:
            raise InfeasibleBudget(budget, best.peak_bytes)
        return best
    plan = solve(rank.costs, "budget", budget=budget)  # least recomputation in the per-layer form, if it fits
    peak = rank.fb_peak(plan.checkpoints, plan.stored).bytes
    return dataclasses.replace(plan, peak_bytes=peak) if peak <= budget else best


def _fully_shard(model: nn.Module, module: nn.Module, blocks, parallel) -> None:
    """FSDP2 on each block the graph calls, then on the module the user trains."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("parallel=Parallel(..., 'fsdp') shards the returned module with fully_shard, which "
                           "needs torch.distributed initialized (dist.init_process_group) on every rank first")
    from torch.distributed.fsdp import fully_shard

    from .planning.param_facts import fsdp_options

    mp = fsdp_options(parallel)
    for block in _modules_named(model, blocks or ()):
        fully_shard(block, **mp)
    fully_shard(module, **mp)


def _modules_named(model: nn.Module, blocks) -> list[nn.Module]:
    """The submodules ``blocks`` names (paths, or classes: every module of that class, outermost)."""
    names = [b for b in blocks if isinstance(b, str)]
    types = tuple(b for b in blocks if isinstance(b, type))
    out = [model.get_submodule(n) for n in names]
    taken: list[str] = []
    for path, mod in model.named_modules():
        if types and isinstance(mod, types) and not any(path.startswith(t + ".") for t in taken):
            out.append(mod)
            taken.append(path)
    return out


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# --------------------------------------------------------------------------
# forwards with Python side effects (a counter, a list that grows)
# --------------------------------------------------------------------------
def _summaries(state: PythonState) -> dict:
    """(module id, attribute) -> (module, summary, shown): what each attribute holds now."""
    return {(id(mod), attr): (mod, describe_value(value), _show(value)) for mod, attr, value in state.attrs}


def _show(value: Any) -> str:
    if isinstance(value, ATOMS):
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - a repr that raises
            text = f"<{type(value).__name__}>"
        return text if len(text) <= 60 else text[:57] + "..."
    try:
        base = base_container(value)
        if base is not None:
            return f"a {type(value).__name__} of {base.__len__(value)}"
    except Exception:  # noqa: BLE001
        pass
    return f"a {type(value).__name__}"


def _changes(before: dict, after: dict, paths: dict) -> list[str]:
    """What differs between two :func:`_summaries`, as ``path.attr: old -> new``."""
    out = []
    for key in list(before) + [k for k in after if k not in before]:
        mod, a, shown_a = before.get(key, (None, "<absent>", "<absent>"))
        mod2, b, shown_b = after.get(key, (None, "<deleted>", "<deleted>"))
        if a != b:
            path = paths.get(id(mod if mod is not None else mod2), "")
            out.append(f"{path or 'the model'}.{key[1]}: {shown_a} -> {shown_b}"[:160])
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _verify_training_step(module: CheckpointedModule, example_inputs: Any, loss_fn: Callable | None) -> None:
    """Run one training step (forward, loss, backward) through the rewritten ``module`` on a
    fake-tensor copy before it is returned: a plan that would fail at the first training call
    (a constant the capture lifted and the rewriter left behind, a segment called with the wrong
    arguments, an in-place change to a tensor a recomputation needs) fails here, with an error that
    says so, instead of in the user's training loop. The copy costs no memory and leaves the model
    untouched (its parameters get no gradient).

    A step that cannot run on fake tensors because the forward reads a tensor's value is not an
    error (the real run may well pass): ``explain()`` says the step was not verified.
    """
    name = type(module.original).__name__
    try:
        with warnings.catch_warnings():  # (the user's warnings filters are for their own step: a copy's
            warnings.simplefilter("ignore")  # deprecation notes must not fail it, nor reach them)
            fake = fake_copy(module, normalize_inputs(example_inputs))
    except TraceError as exc:  # (the model itself was copied for the side-effect check: not the plan's fault)
        object.__setattr__(module, "_unverified", "the plan was not verified by a fake training step before it "
                           f"was returned: the rewritten module could not be copied onto fake tensors ({exc})")
        return
    try:
        with quiet_fake_errors(), idle_module_to(), fake.mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fake.inputs.call(fake.model)
            loss = (loss_fn or default_loss)(out)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
    except Exception as exc:
        line = source_line(exc)
        where = f" at {line}" if line else ""
        if data_dependent_construct(exc) is not None:
            note = (f"the plan was not verified by a fake training step before it was returned: the step reads a "
                    f"tensor's value{where}, which fake tensors do not have")
            object.__setattr__(module, "_unverified", note)
            return
        what = f"{len(module.plan.checkpoints)} checkpoints" if module.plan.checkpoints else "no checkpoint"
        module.remove_hooks()  # (the BatchNorm guards it put on the model's modules: the model as it was)
        raise TraceError(
            f"ckptopt planned {name} ({what}), but one training step through the rewritten module, run on "
            f"fake tensors before returning it, failed: {_first_line(exc)}{where}. The model was traced and "
            "planned without error, so this is a ckptopt bug: please report this model. To train now, try "
            "capture='fx' or capture='export' (the other front end), or leaf_modules=[...] naming the "
            "submodule in that line; or use the model's own gradient checkpointing.",
            node=name) from exc


class _HostRandom:
    """Whether the forward draws from numpy's global generator or Python's ``random`` (:meth:`moved`), and
    two runs of it under different draws (:meth:`run`: seeded with the run's number first), each with every
    op it dispatches and the values it reads besides fake tensors' data (:func:`_read_values`): where the
    runs differ, the forward computes with what those generators draw (a mask, a skipped layer), which a
    captured graph would hold fixed. A forward that draws and does not use the draw (LayerDrop at 0 drawn
    with ``random.uniform``) runs alike. Both generators are put back as they were."""

    def __enter__(self):
        self._before = _host_rng_state()
        self.runs: list[list] = []
        return self

    def moved(self) -> bool:
        """Whether either generator has drawn since entering."""
        return not _same_rng_state(self._before, _host_rng_state())

    def run(self):
        """A dispatch mode recording one run (enter it inside the fake mode)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        np.random.seed(len(self.runs))
        random.seed(len(self.runs))
        ops: list = []
        self.runs.append(ops)

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append((func, _read_values((args, kwargs or {}))))
                return func(*args, **(kwargs or {}))

        return Record()

    def differs(self) -> str | None:
        """Where the two runs first differ (None: they ran alike, or did not run)."""
        if not self.runs:
            return None
        a, b = self.runs
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"op {k} ({x[0]})"
        if len(a) != len(b):
            return f"op {min(len(a), len(b))} (one run has {abs(len(a) - len(b))} ops more)"
        return None

    def __exit__(self, *exc):
        np.random.set_state(self._before[0])
        random.setstate(self._before[1])
        return False


def _host_rng_state() -> tuple:
    return np.random.get_state(), random.getstate()


def _same_rng_state(a: tuple, b: tuple) -> bool:
    (np_a, py_a), (np_b, py_b) = a, b
    return np_a[2:] == np_b[2:] and np.array_equal(np_a[1], np_b[1]) and py_a == py_b


def _read_values(tree: Any) -> tuple:
    """What an op reads besides fake tensors' data: fake tensors' shapes and dtypes, the bytes of real tensors
    (of up to a million elements; the shape beyond), anything else as :func:`describe_value` gives it."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import _disable_current_modes

    out = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, FakeTensor):
            out.append((leaf.shape, leaf.dtype))
        elif isinstance(leaf, torch.Tensor):
            value = None
            if leaf.numel() <= 1_000_000 and leaf.device.type == "cpu" and leaf.dtype != torch.bfloat16:
                with _disable_current_modes():  # (its bytes, not an op of the modes recording)
                    value = hash(leaf.detach().contiguous().numpy().tobytes())
            out.append(("real", leaf.shape, leaf.dtype, value))
        else:
            out.append(describe_value(leaf, 0))
    return tuple(out)


def _check_forward_has_no_python_side_effects(model: nn.Module, example_inputs: Any,
                                              front_end: str = "fx") -> str | None:
    """Raise when running the forward again changes a plain-Python attribute of a submodule.

    A checkpointed segment runs its forward a second time during backward,
    so a forward that counts calls or appends to a list would do it twice
    per step (and a graph captured by ``torch.export`` would not do it at
    all). The forward runs twice on a fake-tensor copy of the model (no
    memory, the model itself is not touched); a change between the first
    and the second run (not a one-time lazy initialization) is an error.
    Attributes of any type are compared by :func:`describe_value` (no user
    ``__eq__`` or ``__repr__`` is called). Where the runs draw from numpy's or Python's
    global generator, two more runs under different draws follow (:class:`_HostRandom`):
    runs that differ compute with those draws, which a captured graph would hold fixed,
    and that is an error too; runs alike plan with a warning.

    Returns a note for ``explain()`` when the check could not run: the model's own
    Python forward reads a tensor's value, which fake tensors do not have, in code the
    ``torch.export`` graph does not contain (a check transformers skips while compiling).
    """
    name = type(model).__name__
    fake = fake_copy(model, normalize_inputs(example_inputs))
    copy = fake.model
    try:
        with _HostRandom() as rng, quiet_fake_errors(), idle_module_to(), fake.mode, torch.no_grad():
            fake.inputs.call(copy)
            first = _summaries(python_state(copy))
            fake.inputs.call(copy)
            second = _summaries(python_state(copy))
            if rng.moved():  # (after two runs: caches and lazy state are what every later run sees)
                for _ in range(2):
                    with rng.run():
                        fake.inputs.call(copy)
    except Exception as exc:
        construct = data_dependent_construct(exc)
        line = source_line(exc)
        if construct is not None and front_end != "fx":
            return (f"the check for Python side effects in forward was skipped: the forward, run outside "
                    f"torch.export, reads a tensor's value{' at ' + line if line else ''}")
        if construct is not None:  # a value torch.fx computed once, for real, and baked into the graph
            raise TraceError(
                f"{name}'s forward reads a tensor's value{' at ' + line if line else ''} ({construct}) from tensors "
                "torch.fx does not trace (made in the forward: `torch.rand(...)`, `torch.tensor(...)`): FX ran it once "
                "while tracing and baked that outcome into the graph, which other steps would not take. Make the "
                "value constant (LayerDrop: config.layerdrop=0), or move the code into a submodule and pass it in "
                "leaf_modules=[...] so it runs as Python every step.", node=name) from exc
        raise TraceError(
            f"{name} was captured, but running its forward again on a fake-tensor copy (ckptopt's check for "
            f"Python side effects in forward) failed: {_first_line(exc)}{' at ' + line if line else ''}. "
            "If the forward runs on these inputs outside ckptopt, skip the "
            "check: ckptopt.apply_plan(model, ckptopt.trace(model, x), ckptopt.solve(...)).",
            node=name,
        ) from exc
    differs = rng.differs()
    if rng.runs and not differs:
        warnings.warn(
            f"the forward of {name} draws random numbers outside torch (numpy's np.random or Python's random), and "
            "two runs under different draws computed alike, so the plan takes the draw as unused (LayerDrop at 0). "
            "If it can change what the forward computes (LayerDrop above 0, a mask), the module ckptopt returns "
            "applies the draw made while capturing at every step: draw with torch (torch.rand) instead.",
            stacklevel=3)
    if differs:
        raise TraceError(
            f"the forward of {name} computes with random numbers drawn outside torch (numpy's np.random or Python's "
            f"random: two runs under different draws differ at {differs}): the graph ckptopt captures holds what "
            "was drawn while capturing, so the module it returns would apply the same draw at every step. Draw "
            "them with torch (torch.rand, torch.bernoulli: the graph draws anew each step), or turn the draw off "
            "while training with ckptopt (transformers' speech models draw SpecAugment masks so: "
            f"config.mask_time_prob=0 and mask_feature_prob=0), or {own_checkpointing_hint(model)}.", node=name)
    changed = _changes(first, second, {id(m): p for p, m in copy.named_modules()})
    if changed:
        why = ("Checkpointing runs a segment's forward again during backward, so that change would happen "
               "twice per training step." if front_end == "fx" else
               "The module ckptopt returns runs the graph torch.export captured, which holds tensor operations "
               "only, so that change would not happen in training at all.")
        raise TraceError(
            f"the forward of {type(model).__name__} changes Python state each time it runs "
            f"({'; '.join(changed[:3])}). {why} Keep such state out of forward "
            "(count steps in the training loop), or, if running it twice is harmless, rewrite "
            "explicitly with ckptopt.apply_plan(model, ckptopt.trace(model, x), ckptopt.solve(...)).",
            node=changed[0].split(":")[0],
        )
