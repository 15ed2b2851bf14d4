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

where the forward+backward peak is the simulator's (``docs/design.md`` §3, the
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

from .accumulation import AccumulationOption, TrainingPlan, plan_training
from .batch import BatchCosts, BatchFit, MaxBatch, largest_fitting, max_batch, with_batch
from .estimate import Breakdown, Estimate, PeakEstimate, estimate, peak_estimate
from .headroom import (CUDA_CHECKPOINTED_FRACTION, CUDA_DEFAULT_FRACTION, CUDA_DEFAULT_WORKSPACE,
                       CUDA_EXPANDABLE_FRACTION, Headroom, default_headroom, device_budget, device_free_memory,
                       expandable_segments, measure_allocator_overhead)
from .optimizer import OPTIMIZERS, OptimizerMemory, accumulating_costs, optimizer_memory, step_peak
from .parallel import STRATEGIES, Parallel

__all__ = [
    "Parallel",
    "STRATEGIES",
    "OPTIMIZERS",
    "OptimizerMemory",
    "optimizer_memory",
    "step_peak",
    "accumulating_costs",
    "Breakdown",
    "PeakEstimate",
    "Estimate",
    "estimate",
    "peak_estimate",
    "BatchCosts",
    "BatchFit",
    "MaxBatch",
    "max_batch",
    "with_batch",
    "AccumulationOption",
    "TrainingPlan",
    "plan_training",
    "Headroom",
    "default_headroom",
    "device_free_memory",
    "device_budget",
    "measure_allocator_overhead",
    "CUDA_DEFAULT_FRACTION",
    "CUDA_CHECKPOINTED_FRACTION",
    "CUDA_EXPANDABLE_FRACTION",
    "CUDA_DEFAULT_WORKSPACE",
    "expandable_segments",
]
