"""Training under ``torch.autocast("cpu", dtype=torch.bfloat16)`` through an optimized model.

Non-reentrant checkpoint re-enters the autocast state of the forward when it
recomputes a segment, so the rewritten module must train bit-identically to
the unmodified model under autocast (backward inside or outside the autocast
context); and the tracer, called under the same autocast context, must
measure bf16 activations, and count the cached weight casts once as static
memory, so that the predicted peak of the plan is close to the measured one
(within ``AUTOCAST_TOLERANCE``; see the test for the gaps measured).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ckptopt import optimize_checkpoints
from ckptopt.measure import measure_peak

from .common.models import ResNetish


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.LayerNorm(128),
                         nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 8))


def resnetish():
    torch.manual_seed(0)
    return ResNetish(c=8, blocks=3)


AUTOCAST_TOLERANCE = 0.005

CASES = {"mlp": (mlp, (256, 32)), "resnet-like": (resnetish, (8, 3, 16, 16))}


def train_steps(module, model, x, backward_inside, steps=2):
    """Outputs, gradients and buffers after ``steps`` autocast steps (same seeds every call)."""
    outs = []
    for s in range(steps):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(100 + s)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
            loss = out.float().pow(2).mean()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        outs.append(out.detach())
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    for p in model.parameters():
        p.grad = None
    return outs, grads, buffers


@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward-in-autocast", "backward-outside"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_training_is_identical(name, backward_inside):
    make, shape = CASES[name]
    model, x = make(), torch.randn(*shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt = optimize_checkpoints(model, x, solver="dp2")
    assert opt.plan.checkpoints
    start = [b.clone() for b in model.buffers()]
    ref = train_steps(model, model, x, backward_inside)
    with torch.no_grad():
        for b, s in zip(model.buffers(), start):
            b.copy_(s)
    got = train_steps(opt, model, x, backward_inside)
    assert ref[0][0].dtype == torch.bfloat16  # autocast really ran
    for a, b in zip(ref[0], got[0]):
        assert torch.equal(a, b)
    for a, b in zip(ref[1], got[1]):
        assert torch.equal(a, b)
    for a, b in zip(ref[2], got[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_plan_prediction_matches_measured_peak(name):
    make, shape = CASES[name]
    model, x = make(), torch.randn(*shape)
    # one autocast context per step, as in a training loop (the cast cache lives as long as the
    # context); backward inside it, as the tracer assumes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt = optimize_checkpoints(model, x, solver="dp2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = measure_peak(opt, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        baseline = measure_peak(model, (x,))
    plain = optimize_checkpoints(model, x, solver="dp2")
    # bf16 activations: the autocast plan is made from different (smaller) sizes
    assert opt.traced.layers[0].costs.a * 2 == plain.traced.layers[0].costs.a
    # Measured (tests' models, several plans each): within 0.43%; before the weight-cast fixes in
    # measure_layer and the tracer's cast-cache count, the mlp was 9-11% over and this
    # resnet-like 1.7-2.7% under.
    assert abs(measured - opt.predicted_peak_bytes) <= AUTOCAST_TOLERANCE * measured, (measured, opt.predicted_peak_bytes)
    assert abs(baseline - opt.baseline_peak_bytes) <= AUTOCAST_TOLERANCE * baseline, (baseline, opt.baseline_peak_bytes)
    assert measured < baseline
