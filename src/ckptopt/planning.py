"""Planning a training run: the memory a step needs, the largest batch that fits,
and the micro-batch and gradient-accumulation steps that reach a target batch.

Three entry points, each built on the tracer, the simulator and the solvers:

* :func:`estimate`: the peak of one steady-state training step (forward, loss,
  backward and the optimizer step) with no checkpointing and with the optimal
  plan, broken down into parameters, gradients, optimizer state, activations
  and transients;
* :func:`max_batch`: the largest batch whose step fits in a memory size, with
  no checkpointing and with the optimal plan;
* :func:`plan_training`: for a target batch that does not fit, the micro-batch
  and the number of accumulation steps, with the recomputation each needs.

Notes: the memory model of a training step with an optimizer
--------------------------------------------------------------
The loop modelled is PyTorch's usual one, in its steady state (the second
iteration on, when the optimizer state exists)::

    loss = loss_fn(model(x)); loss.backward(); opt.step(); opt.zero_grad()

with ``zero_grad(set_to_none=True)`` (the default), only the scalar loss kept
referenced after backward, and every trainable parameter receiving a gradient.
Its peak is::

    peak = max(forward+backward peak + S,  K + G + L + S + T)

where the forward+backward peak is the simulator's (DESIGN.md section 3, the
gradients growing during backward), K the static bytes (parameters, buffers,
inputs), G the gradients of all trainable parameters, L the loss scalar, S
the optimizer state and T the optimizer step's transient memory. S and T were
measured with :class:`ckptopt.StorageTracker` (torch 2.13, default constructor
arguments) and are modelled per implementation, with s_i the bytes of the i-th
parameter tensor in the optimizer's order and P = sum s_i:

=================  ===================  ===========================  =========
optimizer          state S              T, for-loop step (CPU dflt)  T foreach
=================  ===================  ===========================  =========
``sgd``            0                    0                            0
``sgd-momentum``   P (momentum buffer)  0                            0
``adam``/``adamw`` 2P + 4 per tensor    max_i (2 s_i + s_{i-1})      P
=================  ===================  ===========================  =========

Adam's ``4 per tensor`` is its float32 ``step`` counter, kept on the CPU (not
counted on a CUDA device). The for-loop step computes
``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` per parameter: two temporaries of
that parameter's size while the previous parameter's ``denom`` is still
referenced. The foreach step (PyTorch's default on CUDA) builds
``_foreach_sqrt`` of every exponential average at once. Not modelled: coupled
weight decay (``Adam``/``SGD`` with ``weight_decay > 0`` add one parameter-sized
temporary on the for-loop path), ``nesterov``, ``amsgrad``, ``fused=True``.

With gradient accumulation over k micro-batches, micro-batches 2..k run with
every gradient already allocated: their forward+backward peak is the
simulator's on the same cost model with the per-layer parameter bytes moved
into the static bytes (all gradients held throughout; the new gradient of a
layer is part of its backward transient and is added in place). That peak is
at least the first micro-batch's for every plan, so plans for k > 1 are chosen
on it. This errs high (never low) where a layer holds several parameters: its
backward transient, measured with no gradient yet, holds the new gradients of
all of them, while in a later micro-batch each is added into ``.grad`` and
freed in turn. Measured: exact on an MLP chain; +6.2% to +9.0% on ResNet-18
(32x32, batch 4) with SGD, +0.9% with for-loop Adam, exact with foreach Adam
(the optimizer step dominates there).

Batch size: the cost model of every zoo model is affine in the batch size
(checked: traced at two batch sizes, extrapolated to a third, compared field
by field). :func:`max_batch` and :func:`plan_training` interpolate the costs
instead of tracing each candidate when that check passes, trace per candidate
when it fails, and trace the answer (and the next batch size) to confirm it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from .costs import ChainCosts
from .simulate import SimResult, recomputed_layers, simulate
from .solvers import solve
from .solvers.recompute import least_recompute

__all__ = [
    "OPTIMIZERS",
    "OptimizerMemory",
    "optimizer_memory",
    "step_peak",
    "accumulating_costs",
    "Breakdown",
    "PeakEstimate",
    "Estimate",
    "estimate",
    "BatchCosts",
    "BatchFit",
    "MaxBatch",
    "max_batch",
    "AccumulationOption",
    "TrainingPlan",
    "plan_training",
]

OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw")
IMPLS = ("for-loop", "foreach")
ADAM_COUNTER_BYTES = 4  # Adam's float32 `step` tensor per parameter
OPTIMAL_SOLVER = "dp2"
_BATCH_CAP = 1 << 24


# --------------------------------------------------------------------------
# the optimizer: state and step transient (torch-free)
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer adds to a training step, in bytes.

    Attributes
    ----------
    name : str
        One of :data:`OPTIMIZERS`.
    impl : str
        ``"for-loop"`` (PyTorch's default on CPU) or ``"foreach"`` (its default on CUDA).
    state_bytes : int
        Optimizer state held for the whole step (momentum, Adam's averages and counters).
    step_transient_bytes : int
        The temporaries of ``optimizer.step()`` above the state, gradients and parameters.
    """

    name: str
    impl: str
    state_bytes: int
    step_transient_bytes: int


def _check_optimizer(optimizer: str) -> str:
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    return optimizer.lower()


def default_impl(device: str) -> str:
    """PyTorch's default optimizer implementation on ``device``: foreach on CUDA, a for-loop elsewhere."""
    return "foreach" if str(device).startswith("cuda") else "for-loop"


def optimizer_memory(param_sizes: Sequence[int], optimizer: str = "adam", impl: str | None = None,
                     device: str = "cpu") -> OptimizerMemory:
    """State and step transient of ``optimizer`` for parameters of the given sizes.

    Parameters
    ----------
    param_sizes : sequence of int
        Bytes of each trainable parameter tensor, in the optimizer's order
        (``model.parameters()``).
    optimizer : str
        ``none``, ``sgd`` (momentum 0), ``sgd-momentum``, ``adam`` or ``adamw``,
        with PyTorch's default constructor arguments otherwise.
    impl : str, optional
        ``for-loop`` or ``foreach``; default: PyTorch's default on ``device``.
    device : str, default "cpu"
        Where the step runs; on CUDA Adam's step counters stay on the CPU.

    Returns
    -------
    OptimizerMemory

    Notes
    -----
    The formulas are the module's note; they are what
    :class:`ckptopt.StorageTracker` measured on torch 2.13.

    Examples
    --------
    >>> om = optimizer_memory([400, 40, 4000], "adam")
    >>> om.state_bytes, om.step_transient_bytes  # 2 * 4440 + 3 * 4; 2 * 4000 + 40
    (8892, 8040)
    >>> optimizer_memory([400, 40, 4000], "adam", impl="foreach").step_transient_bytes
    4440
    """
    name = _check_optimizer(optimizer)
    impl = impl or default_impl(device)
    if impl not in IMPLS:
        raise ValueError(f"unknown optimizer implementation {impl!r}; use 'for-loop' or 'foreach'")
    sizes = [int(s) for s in param_sizes]
    total = sum(sizes)
    if name in ("none", "sgd"):
        return OptimizerMemory(name, impl, 0, 0)
    if name == "sgd-momentum":
        return OptimizerMemory(name, impl, total, 0)
    counters = 0 if str(device).startswith("cuda") else ADAM_COUNTER_BYTES * len(sizes)
    if impl == "foreach":
        transient = total
    else:
        transient = max((2 * s + (sizes[i - 1] if i else 0) for i, s in enumerate(sizes)), default=0)
    return OptimizerMemory(name, impl, 2 * total + counters, transient)


def step_peak(costs: ChainCosts, grad_bytes: int, opt: OptimizerMemory) -> int:
    """Peak of ``optimizer.step()``: static + gradients + the loss scalar + state + transient.

    0 for ``optimizer="none"`` (no step is run).
    """
    if opt.name == "none":
        return 0
    return costs.static + int(grad_bytes) + int(costs.a[-1]) + opt.state_bytes + opt.step_transient_bytes


def accumulating_costs(costs: ChainCosts) -> ChainCosts:
    """The cost model of a micro-batch run while every gradient is already allocated.

    The per-layer parameter bytes ``p`` (whose gradients the simulator adds as
    backward reaches them) become static bytes: micro-batches 2..k of a
    gradient-accumulation loop hold all gradients from their first operator on.
    """
    d = costs.to_dict()
    layers = d["layers"]
    d["static"] = int(d["static"]) + int(sum(layers["p"]))
    layers["p"] = [0] * len(layers["p"])
    return ChainCosts.from_dict(d)


# --------------------------------------------------------------------------
# one estimate: peak and breakdown of a plan
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Breakdown:
    """The bytes alive at the peak, by kind (they sum to the peak).

    ``transient`` is the working memory of what runs at the peak: a layer's
    forward temporaries; in backward its new gradients (parameter and input)
    and temporaries; or the optimizer step's temporaries. ``gradients`` are the
    parameter gradients already stored. ``activations`` is the rest: tensors
    saved for backward, checkpoints, the output gradient in flight.
    """

    parameters: int
    buffers_and_inputs: int
    gradients: int
    optimizer_state: int
    activations: int
    transient: int

    @property
    def total(self) -> int:
        return (self.parameters + self.buffers_and_inputs + self.gradients + self.optimizer_state
                + self.activations + self.transient)


@dataclass(frozen=True)
class PeakEstimate:
    """The predicted peak of a training step under one plan.

    Attributes
    ----------
    label : str
        ``"no checkpointing"``, ``"optimal plan"``, ...
    checkpoints : tuple of int
        The plan (segment-start layers).
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checkpoints"] = list(self.checkpoints)
        return d


def _layer_flops(costs: ChainCosts, flops: Sequence[int] | None) -> list[int]:
    if getattr(costs, "has_compute", False):  # per-layer forward FLOPs filled by the tracer
        return [int(x) for x in costs.c]
    return [int(x) for x in flops] if flops is not None else [0] * costs.n


def _recompute(costs: ChainCosts, cps: tuple[int, ...], flops: Sequence[int] | None) -> tuple[int, float]:
    """(FLOPs re-run in backward, their share of a step = 3 forward passes)."""
    if getattr(costs, "has_compute", False):
        sim = simulate(costs, cps)
        return int(sim.recompute_flops), float(sim.recompute_share)
    flops = _layer_flops(costs, flops)
    total = sum(flops)
    redo = sum(flops[i] for i in recomputed_layers(costs, cps))
    return redo, (redo / (3 * total) if total else 0.0)


def _fb_breakdown(costs: ChainCosts, cps: tuple[int, ...], sim: SimResult) -> tuple[int, int]:
    """(gradients, transient) at the simulator's peak of forward+backward."""
    i = sim.layer
    starts = (0,) + cps
    end = (starts[sim.segment + 1] - 1) if sim.segment + 1 < len(starts) else costs.n - 1
    G = costs.grad_after
    if sim.phase == "forward":
        return 0, int(costs.f[i])
    if sim.phase == "recompute":
        f = costs.fs[i] if i == end else costs.f[i]
        return int(G[end]), int(f)
    return int(G[i]), int(costs.b[i])


def peak_estimate(costs: ChainCosts, cps: Sequence[int], opt: OptimizerMemory, param_bytes: int,
                  grad_bytes: int, flops: Sequence[int] | None = None, label: str = "") -> PeakEstimate:
    """Peak and breakdown of a training step under plan ``cps`` (see the module note).

    Parameters
    ----------
    costs : ChainCosts
        The traced cost model (static = parameters + buffers + inputs).
    cps : sequence of int
        The plan.
    opt : OptimizerMemory
    param_bytes, grad_bytes : int
        Parameter bytes (in ``costs.static``) and gradient bytes of the trainable ones.
    flops : sequence of int, optional
        Forward FLOPs per layer, for the recompute share (``costs.c`` when present).
    """
    cps = tuple(int(c) for c in cps)
    sim = simulate(costs, cps)
    fb = sim.peak_bytes
    stp = step_peak(costs, grad_bytes, opt)
    redo, share = _recompute(costs, cps, flops)
    other_static = costs.static - param_bytes
    if fb + opt.state_bytes >= stp:
        grads, transient = _fb_breakdown(costs, cps, sim)
        acts = fb - costs.static - grads - transient
        at, layer = sim.phase, sim.layer
    else:
        grads, transient = grad_bytes, opt.step_transient_bytes
        acts = int(costs.a[-1])  # the loss scalar
        at, layer = "optimizer step", None
    bd = Breakdown(param_bytes, other_static, grads, opt.state_bytes, acts, transient)
    peak = max(fb + opt.state_bytes, stp)
    assert bd.total == peak, (bd, peak)
    name = costs.names[layer] if (layer is not None and costs.names is not None) else None
    return PeakEstimate(label, cps, peak, fb, stp, at, layer, name, bd, redo, share)


def optimal_plan(costs: ChainCosts, opt: OptimizerMemory, step_bytes: int) -> tuple[int, ...]:
    """The plan with the lowest step peak and, among those, the least recomputation.

    The lowest forward+backward peak (``dp2``) plus the optimizer state may
    lie below the optimizer step's peak; then any plan up to that level gives
    the same step peak, and the one with the least recomputation (the
    ``budget`` solver) is returned, often no checkpointing at all.

    Parameters
    ----------
    costs : ChainCosts
        The forward+backward cost model (:func:`accumulating_costs` for micro-batches after the first).
    opt : OptimizerMemory
    step_bytes : int
        The optimizer step's peak (:func:`step_peak` of the plain cost model).
    """
    best = solve(costs, OPTIMAL_SOLVER)
    target = max(best.peak_bytes + opt.state_bytes, step_bytes)
    found = least_recompute_plan(costs, target - opt.state_bytes)
    return found[0] if found is not None else best.checkpoints


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

    def to_dict(self) -> dict:
        return dict(batch_size=self.batch_size, n_layers=self.n_layers, optimizer=asdict(self.optimizer),
                    param_bytes=self.param_bytes, grad_bytes=self.grad_bytes,
                    no_checkpointing=self.no_checkpointing.to_dict(), optimal=self.optimal.to_dict())


def _trainable_sizes(model) -> list[int]:
    """Bytes of each distinct trainable parameter, in ``model.parameters()`` order."""
    seen, out = set(), []
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if p.requires_grad and key not in seen:
            seen.add(key)
            out.append(p.untyped_storage().nbytes())
    return out


def _batch_of(inputs: tuple) -> int | None:
    import torch

    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


def _as_tuple(example_inputs: Any) -> tuple:
    import torch

    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if not isinstance(example_inputs, tuple):
        raise TypeError("example_inputs must be a tensor or a tuple of the model's positional arguments, "
                        f"got {type(example_inputs).__name__}")
    return example_inputs


def estimate(model, example_inputs, optimizer: str = "adam", impl: str | None = None, device: str | None = None,
             loss_fn: Callable | None = None, leaf_modules=None) -> Estimate:
    """Predicted peak of one training step, optimizer step included, without and with the optimal plan.

    Parameters
    ----------
    model : nn.Module
        In training mode, on the device and in the dtype it will train in.
    example_inputs : Tensor or tuple
        One batch (only shapes and dtypes are used: the model is traced on fake tensors).
    optimizer : str, default "adam"
        ``none`` (forward and backward only), ``sgd``, ``sgd-momentum`` (0.9),
        ``adam`` or ``adamw``, with PyTorch's default arguments otherwise.
    impl : str, optional
        ``for-loop`` or ``foreach`` optimizer step; default PyTorch's default on ``device``.
    device : str, optional
        Default: the model's device.
    loss_fn, leaf_modules
        As for :func:`ckptopt.trace`.

    Returns
    -------
    Estimate

    Notes
    -----
    The memory model and its assumptions are the module's note. The optimal
    plan is the one with the lowest forward+backward peak (``dp2``); the
    optimizer's figures do not depend on the plan.
    """
    from .tracer import trace

    args = _as_tuple(example_inputs)
    tm = trace(model, args, loss_fn=loss_fn, leaf_modules=leaf_modules)
    sizes = _trainable_sizes(model)
    dev = device or str(next(model.parameters()).device)
    opt = optimizer_memory(sizes, optimizer, impl, dev)
    grads = sum(sizes)
    none = peak_estimate(tm.costs, (), opt, tm.param_bytes, grads, tm.flops, "no checkpointing")
    cps = optimal_plan(tm.costs, opt, step_peak(tm.costs, grads, opt))
    optimal = peak_estimate(tm.costs, cps, opt, tm.param_bytes, grads, tm.flops, "optimal plan")
    return Estimate(_batch_of(args), tm.n, opt, tm.param_bytes, grads, none, optimal)


# --------------------------------------------------------------------------
# cost models as a function of the batch size
# --------------------------------------------------------------------------
def with_batch(inputs: tuple, batch: int, example_batch: int) -> tuple:
    """The example inputs resized to ``batch`` along dimension 0 (rows repeated cyclically).

    Tensors whose first dimension is not the example batch are passed as they are.
    """
    import torch

    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"a batch size is a positive integer, got {batch!r}")
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == example_batch:
            idx = torch.arange(batch, device=t.device) % example_batch
            t = t.detach()[idx].requires_grad_(t.requires_grad)
        out.append(t)
    return tuple(out)


def _affine(c1: dict, c2: dict, b1: int, b2: int) -> tuple[dict, dict] | None:
    """(intercept, slope) of every integer field of two cost dicts, or None when not exactly affine."""
    l1, l2 = c1["layers"], c2["layers"]
    if l1.keys() != l2.keys() or c1.get("names") != c2.get("names"):
        return None
    icpt, slope = {"layers": {}}, {"layers": {}}
    for k in l1:
        if len(l1[k]) != len(l2[k]):
            return None
        if k in ("sin", "sout", "dead"):  # flags: equal at both sizes, taken as they are
            if l1[k] != l2[k]:
                return None
            continue
        icpt["layers"][k], slope["layers"][k] = [], []
        for v1, v2 in zip(l1[k], l2[k]):
            d = int(v2) - int(v1)
            if d % (b2 - b1):
                return None
            s = d // (b2 - b1)
            icpt["layers"][k].append(int(v1) - s * b1)
            slope["layers"][k].append(s)
    d = int(c2["static"]) - int(c1["static"])
    if d % (b2 - b1):
        return None
    slope["static"] = d // (b2 - b1)
    icpt["static"] = int(c1["static"]) - slope["static"] * b1
    if "compute" in c1 and "compute" in c2:  # FLOPs per layer: affine when they can be, else as at b1
        diffs = [int(v2) - int(v1) for v1, v2 in zip(c1["compute"], c2["compute"])]
        if all(x % (b2 - b1) == 0 for x in diffs):
            slope["compute"] = [x // (b2 - b1) for x in diffs]
            icpt["compute"] = [int(v1) - s * b1 for v1, s in zip(c1["compute"], slope["compute"])]
        else:
            slope["compute"], icpt["compute"] = [0] * len(diffs), [int(v) for v in c1["compute"]]
    return icpt, slope


class BatchCosts:
    """The cost model of a model at any batch size, from a few traces.

    Every integer field is fitted as an affine function of the batch size
    through two traced batch sizes (adjacent sizes, so the slopes are exact
    integers) and checked against a third trace. Fields need not be affine
    everywhere: a layer's backward transient can be a maximum of a
    parameter-sized and an activation-sized term, so small batch sizes follow
    another line than large ones (measured on ResNet-18 at 32x32). Callers
    therefore confirm an answer by tracing it and re-fit (:meth:`refit`) near it.

    Parameters
    ----------
    model : nn.Module
    example_inputs : tuple
        One batch; other batch sizes repeat its rows (:func:`with_batch`).
    loss_fn, leaf_modules
        As for :func:`ckptopt.trace`.
    probe : tuple of three ints, default (4, 5, 16)
        The batch sizes traced to fit the affine model (first two) and to check it.

    Attributes
    ----------
    affine : bool
        Whether the check at the third probe passed.
    traces : int
        How many traces were run.
    refits : int
        How many times the fit was moved near an answer.
    """

    def __init__(self, model, example_inputs, loss_fn=None, leaf_modules=None, probe=(4, 5, 16)):
        self.model = model
        self.inputs = _as_tuple(example_inputs)
        self.example_batch = _batch_of(self.inputs)
        if self.example_batch is None:
            raise ValueError("the example inputs have no batch dimension (no tensor with a first dimension)")
        self.loss_fn, self.leaf_modules = loss_fn, leaf_modules
        self.traces = 0
        self.refits = 0
        self._traced: dict[int, Any] = {}
        self.sizes = _trainable_sizes(model)
        b1, b2, b3 = probe
        t1 = self.traced(b1)
        self.flops = t1.flops
        self.names = t1.costs.names
        self.param_bytes = t1.param_bytes
        self._fit = None
        self._fit_at(b1, b2)
        self.affine = self._fit is not None and self.interpolated(b3) == self.traced(b3).costs

    def _fit_at(self, b1: int, b2: int) -> bool:
        fit = _affine(self.traced(b1).costs.to_dict(), self.traced(b2).costs.to_dict(), b1, b2)
        if fit is not None:
            self._fit, self._fit_batch = fit, b1
        return fit is not None

    def refit(self, batch: int) -> bool:
        """Fit the affine model through ``batch`` and ``batch + 1`` (traced); False if the layers differ."""
        self.refits += 1
        return self._fit_at(batch, batch + 1)

    def traced(self, batch: int):
        """The :class:`~ckptopt.TracedModel` at ``batch`` (cached)."""
        from .tracer import trace

        if batch not in self._traced:
            inputs = with_batch(self.inputs, batch, self.example_batch)
            try:
                self._traced[batch] = trace(self.model, inputs, loss_fn=self.loss_fn,
                                            leaf_modules=self.leaf_modules)
            except Exception as exc:
                raise type(exc)(f"tracing the model at batch size {batch} failed: {exc}") from exc
            self.traces += 1
        return self._traced[batch]

    def interpolated(self, batch: int) -> ChainCosts:
        """The affine model's costs at ``batch``."""
        icpt, slope = self._fit
        d = dict(format="ckptopt.ChainCosts", kind="full", static=icpt["static"] + slope["static"] * batch,
                 layers={})
        if self.names is not None:
            d["names"] = list(self.names)
        traced = self._traced[self._fit_batch].costs.to_dict()
        if "compute" in icpt:
            d["compute"] = [max(0, i + s * batch) for i, s in zip(icpt["compute"], slope["compute"])]
        base = traced["layers"]
        for k, v in base.items():
            if k in ("sin", "sout", "dead"):  # flags: equal at both sizes, taken as they are
                d["layers"][k] = v
            else:
                d["layers"][k] = [max(0, i + s * batch) for i, s in zip(icpt["layers"][k], slope["layers"][k])]
        return ChainCosts.from_dict(d)

    def costs(self, batch: int, trace: bool = False) -> ChainCosts:
        """The cost model at ``batch``: traced when cached or ``trace`` (or no fit exists), else interpolated."""
        if batch in self._traced or trace or self._fit is None:
            return self.traced(batch).costs
        return self.interpolated(batch)


# --------------------------------------------------------------------------
# largest batch
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchFit:
    """The largest batch that fits under one strategy.

    ``batch`` is 0 when not even batch 1 fits; ``peak_bytes`` is its predicted
    peak, ``next_peak_bytes`` that of ``batch + 1`` (over the memory), both
    confirmed by a trace when ``verified``.
    """

    strategy: str
    batch: int
    peak_bytes: int | None
    next_peak_bytes: int | None
    checkpoints: tuple[int, ...]
    recompute_share: float
    verified: bool

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checkpoints"] = list(self.checkpoints)
        return d


@dataclass(frozen=True)
class MaxBatch:
    """What :func:`max_batch` returns."""

    memory_bytes: int
    optimizer: OptimizerMemory
    no_checkpointing: BatchFit
    optimal: BatchFit
    affine: bool
    traces: int

    def to_dict(self) -> dict:
        return dict(memory_bytes=self.memory_bytes, optimizer=asdict(self.optimizer), affine=self.affine,
                    traces=self.traces, no_checkpointing=self.no_checkpointing.to_dict(),
                    optimal=self.optimal.to_dict())


def _peak(costs: ChainCosts, strategy: str, opt: OptimizerMemory, grads: int, accumulate: bool = False,
          final: bool = False) -> tuple[int, tuple[int, ...]]:
    """Predicted step peak and plan at this cost model; ``accumulate``: a micro-batch after the first.

    During a search only the optimal peak matters (``dp2``); ``final`` picks
    the least-recompute plan among those reaching it (:func:`optimal_plan`).
    """
    fb_costs = accumulating_costs(costs) if accumulate else costs
    if strategy == "none":
        cps = ()
    elif final:
        cps = optimal_plan(fb_costs, opt, step_peak(costs, grads, opt))
    else:
        cps = solve(fb_costs, OPTIMAL_SOLVER).checkpoints
    fb = simulate(fb_costs, cps).peak_bytes
    return max(fb + opt.state_bytes, step_peak(costs, grads, opt)), cps


def _largest(fits: Callable[[int], bool], cap: int = _BATCH_CAP) -> int:
    """The largest b in 1..cap with fits(b), for a monotone predicate (0 if none). O(log b) calls."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        return lo if not fits(cap) else cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _check_memory(memory) -> int:
    from .units import parse_bytes

    return parse_bytes(memory)


def _search(bc: BatchCosts, strategy: str, memory: int, opt: OptimizerMemory, accumulate: bool = False,
            cap: int = _BATCH_CAP, rounds: int = 4) -> BatchFit:
    """Largest batch (<= cap) whose predicted peak fits, confirmed by tracing it and the next size.

    Searched on interpolated costs; when the traces at the answer disagree,
    the fit is moved through the answer and the search repeated (``rounds``
    times at most), then every candidate is traced.
    """
    grads = sum(bc.sizes)

    def peak(b: int, trace: bool = False) -> int:
        return _peak(bc.costs(b, trace), strategy, opt, grads, accumulate)[0]

    def confirmed(b: int) -> bool:
        ok = b == 0 or peak(b, trace=True) <= memory
        return ok and (b >= cap or peak(b + 1, trace=True) > memory)

    best, verified = 0, False
    for _ in range(rounds):
        best = _largest(lambda b: peak(b) <= memory, cap)
        if confirmed(best):
            verified = True
            break
        if not bc.refit(max(best, 1)):
            break
    if not verified:  # trace every candidate
        best = _largest(lambda b: peak(b, trace=True) <= memory, cap)
        verified = True
    if not best:
        return BatchFit(strategy, 0, None, peak(1, trace=True), (), 0.0, verified)
    costs = bc.costs(best, trace=True)
    p, cps = _peak(costs, strategy, opt, grads, accumulate, final=True)
    fb_costs = accumulating_costs(costs) if accumulate else costs
    share = _recompute(fb_costs, cps, bc.flops)[1]
    nxt = peak(best + 1, trace=True) if best < cap else None
    return BatchFit(strategy, best, p, nxt, cps, share, verified)


def _optimizer_for(bc: BatchCosts, optimizer: str, impl: str | None, device: str | None) -> OptimizerMemory:
    dev = device or str(next(bc.model.parameters()).device)
    return optimizer_memory(bc.sizes, optimizer, impl, dev)


def max_batch(model, example_inputs, memory, optimizer: str = "adam", impl: str | None = None,
              device: str | None = None, loss_fn=None, leaf_modules=None) -> MaxBatch:
    """The largest batch whose training step fits in ``memory``, without and with the optimal plan.

    Parameters
    ----------
    model : nn.Module
    example_inputs : Tensor or tuple
        One batch of any size; other sizes repeat its rows along dimension 0.
    memory : int or str
        Bytes, or a size such as ``"8GiB"``, ``"8GB"``, ``"512MiB"``.
    optimizer, impl, device, loss_fn, leaf_modules
        As for :func:`estimate`.

    Returns
    -------
    MaxBatch

    Notes
    -----
    The cost model is traced at batch 2 and 3 and checked at 8; when every
    field is affine in the batch size, candidates are scored on interpolated
    costs (no tracing), otherwise each candidate is traced. The peak grows
    with the batch, so the largest fitting batch is found by doubling and
    bisection: O(log b) simulations (and ``dp2`` solves for the optimal plan).
    The answer ``b`` and ``b + 1`` are traced to confirm the interpolation.
    """
    mem = _check_memory(memory)
    bc = BatchCosts(model, example_inputs, loss_fn, leaf_modules)
    opt = _optimizer_for(bc, optimizer, impl, device)
    none = _search(bc, "none", mem, opt)
    best = _search(bc, "optimal", mem, opt)
    return MaxBatch(mem, opt, none, best, bc.affine, bc.traces)


# --------------------------------------------------------------------------
# reaching a target batch with gradient accumulation
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class AccumulationOption:
    """One way to reach the target batch: ``steps`` micro-batches of at most ``micro_batch``.

    Peaks are of the whole loop (the later micro-batches hold every gradient;
    the optimizer step after the last). ``least_recompute`` is the plan with
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["optimal_checkpoints"] = list(self.optimal_checkpoints)
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

    @property
    def recommendation(self) -> AccumulationOption | None:
        return None if self.recommended is None else self.options[self.recommended]

    def to_dict(self) -> dict:
        return dict(target_batch=self.target_batch, memory_bytes=self.memory_bytes,
                    optimizer=asdict(self.optimizer), affine=self.affine, traces=self.traces,
                    recommended=self.recommended, options=[o.to_dict() for o in self.options])


def least_recompute_plan(costs: ChainCosts, budget: int) -> tuple[tuple[int, ...], str] | None:
    """The plan with the least recomputation whose forward+backward peak is at most ``budget``
    (every segment but the last checkpointed), None when no plan fits."""
    if solve(costs, "none").peak_bytes <= budget:
        return (), "none"
    # checkpoint-only plans: the plans here are carried as checkpoint tuples, so the budget
    # solver's unwrapped middle segments (Plan.stored) are not used yet
    found = least_recompute(costs, budget, allow_stored=False)
    return (found[0], "budget") if found is not None else None


def _option(bc: BatchCosts, m: int, k: int, memory: int, opt: OptimizerMemory) -> AccumulationOption:
    grads = sum(bc.sizes)
    costs = bc.costs(m)
    acc = k > 1
    fb_costs = accumulating_costs(costs) if acc else costs
    stp = step_peak(costs, grads, opt)
    p_none, _ = _peak(costs, "none", opt, grads, acc)
    p_opt, cps_opt = _peak(costs, "optimal", opt, grads, acc, final=True)
    chosen, peak, share, solver = None, None, None, None
    if stp <= memory:
        found = least_recompute_plan(fb_costs, memory - opt.state_bytes)
        if found is not None:
            chosen, solver = found
            peak = max(simulate(fb_costs, chosen).peak_bytes + opt.state_bytes, stp)
            share = _recompute(fb_costs, chosen, bc.flops)[1]
    return AccumulationOption(m, k, p_none, p_opt, cps_opt, p_none <= memory, p_opt <= memory,
                              chosen, peak, share, solver)


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


def plan_training(model, example_inputs, target_batch: int, memory, optimizer: str = "adam",
                  impl: str | None = None, device: str | None = None, loss_fn=None, leaf_modules=None,
                  max_options: int = 8) -> TrainingPlan:
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
    memory : int or str
        The memory of the device (``"8GiB"``...).
    max_options : int, default 8
        At most this many options between the two ends (the ends are always listed).
    optimizer, impl, device, loss_fn, leaf_modules
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
    mem = _check_memory(memory)
    bc = BatchCosts(model, example_inputs, loss_fn, leaf_modules)
    opt = _optimizer_for(bc, optimizer, impl, device)
    whole = _option(bc, target_batch, 1, mem, opt)
    options = [whole]
    if not whole.fits_no_checkpointing:
        m_opt = _search(bc, "optimal", mem, opt, accumulate=True, cap=target_batch).batch
        m_none = _search(bc, "none", mem, opt, accumulate=True, cap=target_batch).batch
        if m_opt:
            ks = _steps_range(target_batch, m_opt, m_none or None, max_options)
            options += [_option(bc, math.ceil(target_batch / k), k, mem, opt) for k in ks if k > 1]
    options.sort(key=lambda o: o.steps)
    rec = next((i for i, o in enumerate(options) if o.checkpoints is not None), None)
    return TrainingPlan(target_batch, mem, opt, options, rec, bc.affine, bc.traces)


# --------------------------------------------------------------------------
# measuring a real training step (CPU, exact storage tracker)
# --------------------------------------------------------------------------
def make_optimizer(params, optimizer: str = "adam", impl: str = "for-loop"):
    """The torch optimizer that :func:`optimizer_memory` models (lr 0.01 for SGD, else defaults)."""
    import torch

    name = _check_optimizer(optimizer)
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
                          checkpoints=None, accumulation_steps: int = 1, loss_fn=None) -> int:
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

    Returns
    -------
    int
        Peak bytes.
    """
    import torch

    from .measure import StorageTracker, _forward_loss, _no_lasting_state, _with_checkpoints

    args = _as_tuple(example_inputs)
    module = model if checkpoints is None else _with_checkpoints(model, args, loss_fn, checkpoints)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer, impl)
    with _no_lasting_state(module, args, torch.device("cpu")):
        if opt is not None:
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = [t for st in (opt.state.values() if opt is not None else ()) for t in st.values()
                 if isinstance(t, torch.Tensor)]
        tracker = StorageTracker()
        tracker.register(module, args, state)
        try:
            with tracker:
                for j in range(accumulation_steps):
                    loss = _forward_loss(module, args, loss_fn)
                    loss.backward()
                    if j < accumulation_steps - 1:
                        del loss
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                del loss
            return tracker.peak_bytes
        finally:
            tracker.detach()
