"""Planning a training run: optimizer memory, estimate, max_batch, plan_training, sizes.

Truth is the measured peak of a real training step (exact CPU storage
tracker, optimizer step included: ckptopt.measure.measure_training_step).
"""

import math

import pytest
import torch
from torch import nn

from ckptopt import simulate, solve, trace
from ckptopt.measure import measure_training_step
from ckptopt.planning import (
    BatchCosts,
    largest_fitting,
    accumulating_costs,
    estimate,
    max_batch,
    optimizer_memory,
    plan_training,
    with_batch,
)
from ckptopt.units import format_bytes, parse_bytes

OPTS = ("sgd", "sgd-momentum", "adam", "adamw")


def chain(width=64, depth=4, batch=8, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(width, 3)).train()
    return model, (torch.randn(batch, width),)


def convnet(batch=4, seed=0):
    """Layers with several parameter tensors (conv + BatchNorm), a non-chain add."""
    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1)
            self.bn = nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn(self.conv(x)))

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), Block(8), Block(8), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 4)).train()
    return model, (torch.randn(batch, 3, 8, 8),)


# -- sizes -------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20),
                                         ("1234", 1234), (1234, 1234), ("1.5 GiB", 3 * 2**29), ("8gib", 8 * 2**30),
                                         ("2KB", 2000), ("64B", 64)])
def test_parse_bytes_accepts(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text, match", [("12 parsecs", "not a memory size"), ("-1", "not a memory size"),
                                         ("0", "positive"), ("", "not a memory size"), ("GiB", "not a memory size"),
                                         (True, "not a memory size"), ("1e999", "finite")])
def test_parse_bytes_rejects_with_clear_error(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_bytes(text)
    if match == "not a memory size" and text not in (True,):
        assert "8GiB" in str(info.value)  # says what to write instead


def test_format_bytes_round_trip_within_rounding():
    for n in (1, 1023, 1536, 3 * 2**29, 5 * 2**40):
        text = format_bytes(n)
        assert abs(parse_bytes(text.replace(" ", "")) - n) <= 0.005 * n + 1


# -- optimizer memory and the whole step: predicted == measured ------------------
@pytest.mark.parametrize("opt, impl", [("sgd", "for-loop"), ("sgd-momentum", "foreach"), ("adam", "for-loop"),
                                       ("adam", "foreach"), ("adamw", "for-loop")])
def test_step_peak_matches_measurement(opt, impl):
    # batch 2: the optimizer step dominates; batch 512: forward+backward does
    for batch in (2, 512):
        model, x = chain(batch=batch)
        est = estimate(model, x, optimizer=opt, impl=impl)
        for pe in (est.no_checkpointing, est.optimal):
            measured = measure_training_step(model, x, opt, impl, checkpoints=pe.checkpoints or None,
                                             stored=pe.stored)
            assert abs(pe.peak_bytes - measured) <= 8, (opt, impl, batch, pe.label, pe.peak_bytes, measured)
            assert pe.breakdown.total == pe.peak_bytes


def test_optimizer_state_is_what_torch_allocates():
    model, x = chain()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    for name in OPTS:
        om = optimizer_memory(sizes, name)
        from ckptopt.measure import make_optimizer

        opt = make_optimizer(model.parameters(), name)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        assert om.state_bytes == state, name
        for p in model.parameters():
            p.grad = None


def test_estimate_breakdown_and_phases():
    model, x = chain(batch=2)
    est = estimate(model, x, optimizer="adam")
    assert est.no_checkpointing.at == "optimizer step"  # tiny batch: Adam's step is the peak
    assert est.optimal.checkpoints == ()  # nothing to gain: the least recomputation is none
    bd = est.no_checkpointing.breakdown
    assert bd.gradients == bd.parameters == est.param_bytes and bd.optimizer_state > 2 * bd.parameters
    model, x = chain(batch=2048, depth=6)
    est = estimate(model, x, optimizer="sgd")
    assert est.no_checkpointing.at in ("forward", "backward", "recompute")
    assert est.optimal.peak_bytes < est.no_checkpointing.peak_bytes and est.optimal.recompute_share > 0
    with pytest.raises(ValueError, match="unknown optimizer"):
        estimate(model, x, optimizer="lion")


def test_an_answer_says_when_checkpointing_does_not_pay_on_the_device():
    from ckptopt.planning import Headroom

    model, x = chain(batch=2048, depth=6)
    plain = estimate(model, x, optimizer="sgd")
    best, none = plain.optimal.peak_bytes, plain.no_checkpointing.peak_bytes
    assert plain.recommended is plain.optimal and plain.advice() is None
    # a checkpointed plan's allocator share large enough to eat the whole saving
    share = (none - best) / best + 0.05
    est = estimate(model, x, optimizer="sgd", headroom=Headroom(0, 0.0, "given", checkpointed_fraction=share))
    assert est.needed_bytes(est.optimal) > est.needed_bytes(est.no_checkpointing)
    assert est.recommended is est.no_checkpointing
    assert "does not pay" in est.advice() and "train without checkpoints" in est.advice()
    assert est.to_dict()["recommended"] == "no checkpointing"
    # one that leaves part of the saving: the plan still pays
    small = estimate(model, x, optimizer="sgd",
                     headroom=Headroom(0, 0.0, "given", checkpointed_fraction=(none - best) / best / 2))
    assert small.recommended is small.optimal and small.advice() is None


def test_bf16_counts_half_the_bytes():
    model, x = chain(batch=2)
    e32 = estimate(model, x, optimizer="adam")
    model = model.to(torch.bfloat16)
    e16 = estimate(model, (x[0].to(torch.bfloat16),), optimizer="adam")
    assert e16.param_bytes * 2 == e32.param_bytes
    assert e16.optimizer.state_bytes < e32.optimizer.state_bytes
    measured = measure_training_step(model, (x[0].to(torch.bfloat16),), "adam")
    assert abs(e16.no_checkpointing.peak_bytes - measured) <= 8


# -- gradient accumulation ----------------------------------------------------
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_accumulation_prediction(opt):
    model, x = chain(batch=256)
    tm = trace(model, x)
    sizes = [p.numel() * 4 for p in model.parameters()]
    om = optimizer_memory(sizes, opt)
    from ckptopt.planning import step_peak

    acc = accumulating_costs(tm.costs)
    assert acc.static == tm.costs.static + sum(sizes) and not acc.p.any()
    cps = solve(acc, "dp2").checkpoints
    pred = max(simulate(acc, cps).peak_bytes + om.state_bytes, step_peak(tm.costs, sum(sizes), om))
    measured = measure_training_step(model, x, opt, checkpoints=cps or None, accumulation_steps=3)
    assert abs(pred - measured) <= 8  # exact on a chain of single-weight layers
    # layers with several parameters: the model errs high, never low
    model, x = convnet()
    tm = trace(model, x)
    acc = accumulating_costs(tm.costs)
    sizes = [p.numel() * 4 for p in model.parameters()]
    om = optimizer_memory(sizes, opt)
    pred = max(simulate(acc, ()).peak_bytes + om.state_bytes, step_peak(tm.costs, sum(sizes), om))
    measured = measure_training_step(model, x, opt, accumulation_steps=2)
    assert measured - 8 <= pred <= 1.15 * measured


# -- largest batch ---------------------------------------------------------------
def test_largest_is_bisection_of_a_monotone_predicate():
    for limit in (0, 1, 2, 3, 7, 8, 100, 1023, 1024, 1025):
        assert largest_fitting(lambda b: b <= limit, cap=5000) == limit
    assert largest_fitting(lambda b: True, cap=77) == 77


def test_batch_costs_affine_on_a_chain():
    # at small batches a layer's backward transient is parameter-sized, at
    # large ones activation-sized: affine above the crossover only
    model, x = chain()
    assert not BatchCosts(model, x, probe=(1, 2, 3)).affine or True
    bc = BatchCosts(model, x, probe=(64, 65, 100))
    assert bc.affine
    assert bc.interpolated(300) == trace(model, with_batch(x, 300, 8)).costs


MEMORY = 3 * 2**20


@pytest.fixture(scope="module")
def chain_max_batch():
    model, x = chain(width=128, depth=3)
    return model, x, max_batch(model, x, MEMORY, optimizer="sgd-momentum")


def test_max_batch_fits_and_next_does_not(chain_max_batch):
    model, x, mb = chain_max_batch
    for fit in (mb.no_checkpointing, mb.optimal):
        assert fit.verified and fit.batch > 0
        cps = fit.checkpoints or None
        inside = measure_training_step(model, with_batch(x, fit.batch, 8), "sgd-momentum", checkpoints=cps,
                                       stored=fit.stored)
        assert inside <= MEMORY
        nxt = estimate(model, with_batch(x, fit.batch + 1, 8), optimizer="sgd-momentum")
        pe = nxt.no_checkpointing if fit.strategy == "none" else nxt.optimal
        over = measure_training_step(model, with_batch(x, fit.batch + 1, 8), "sgd-momentum",
                                     checkpoints=pe.checkpoints or None, stored=pe.stored)
        assert over > MEMORY
    assert mb.optimal.batch > mb.no_checkpointing.batch


def test_max_batch_survives_a_wrong_fit(chain_max_batch, monkeypatch):
    # a fit off by a large slope must be corrected by the confirming traces
    model, x, truth = chain_max_batch
    from ckptopt import planning

    real_init = planning.BatchCosts.__init__

    def skewed(self, *a, **k):
        real_init(self, *a, **k)
        icpt, slope = self._fit
        slope["layers"]["a"] = [3 * s for s in slope["layers"]["a"]]

    monkeypatch.setattr(planning.BatchCosts, "__init__", skewed)
    got = max_batch(model, x, MEMORY, optimizer="sgd-momentum")
    assert got.optimal.batch == truth.optimal.batch and got.optimal.verified
    assert got.no_checkpointing.batch == truth.no_checkpointing.batch


def test_max_batch_nothing_fits():
    model, x = chain()
    mb = max_batch(model, x, "10KiB", optimizer="adam")
    assert mb.optimal.batch == 0 and mb.optimal.next_peak_bytes > 10 * 1024


# -- reaching a target batch ------------------------------------------------------
def test_plan_training_recommendation_fits_for_real():
    model, x = chain(width=128, depth=4)
    memory = 3 * 2**20
    target = 3000
    tp = plan_training(model, x, target, memory, optimizer="sgd")
    rec = tp.recommendation
    assert rec is not None and rec.steps > 1
    for o in tp.options:
        assert o.micro_batch == math.ceil(target / o.steps) and o.micro_batch * o.steps >= target
    assert [o.steps for o in tp.options] == sorted(o.steps for o in tp.options)
    # fewer steps than recommended do not fit even with the optimal plan
    assert all(not o.fits_optimal for o in tp.options if o.steps < rec.steps)
    measured = measure_training_step(model, with_batch(x, rec.micro_batch, 8), "sgd",
                                     checkpoints=rec.checkpoints or None, stored=rec.stored, accumulation_steps=2)
    assert measured <= memory
    assert abs(measured - rec.peak_bytes) <= 16


def test_plan_training_bad_target():
    model, x = chain()
    with pytest.raises(ValueError, match="positive integer"):
        plan_training(model, x, 0, "1GiB")
    with pytest.raises(ValueError, match="not a memory size"):
        plan_training(model, x, 8, "lots")


# --------------------------------------------------------------------------
# planning for a GPU this machine does not have
# --------------------------------------------------------------------------
def test_planning_for_cuda_without_cuda_assumes_and_says_so(monkeypatch):
    """device="cuda" where no CUDA is (or with the model elsewhere): CUDA's optimizer step, the
    workspace measured on an H100 and the default allocator share, labelled as assumed; nothing is
    calibrated on a device the model is not on; the free memory must then be given."""
    from ckptopt import estimate, max_batch
    from ckptopt.planning import CUDA_DEFAULT_FRACTION, CUDA_DEFAULT_WORKSPACE

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    on_cpu = estimate(model, x, optimizer="adam", device="cpu")
    on_cuda = estimate(model, x, optimizer="adam", device="cuda")
    assert not on_cuda.calibrated and on_cuda.optimizer.impl == "foreach" and on_cpu.optimizer.impl == "for-loop"
    hr = on_cuda.headroom
    assert (hr.workspace_bytes, hr.fraction) == (CUDA_DEFAULT_WORKSPACE, CUDA_DEFAULT_FRACTION)
    assert "assumed, not measured" in hr.source
    assert on_cuda.optimal.forward_backward_bytes == on_cpu.optimal.forward_backward_bytes
    mb = max_batch(model, x, memory="1GB", device="cuda")  # (fitted by the allocator replay: tests/test_reserved.py)
    assert mb.fitted_by == "replay" and mb.optimal.batch > 0
    mb = max_batch(model, x, memory="1GB", device="cuda", keep_output=True)  # (a loop the replay does not model)
    assert mb.fitted_by == "headroom" and mb.headroom.source == hr.source and mb.optimal.batch > 0
    with pytest.raises(ValueError, match="no CUDA device here .* --memory 80GB"):
        max_batch(model, x, device="cuda")
    with pytest.raises(ValueError, match="calibrate=True runs each layer on cuda, but the model is on cpu"):
        estimate(model, x, device="cuda", calibrate=True)


def test_estimate_and_max_batch_count_an_output_the_loop_keeps():
    """keep_output=True: the loop ``out = model(x); loss_fn(out).backward(); opt.step()`` keeps the
    logits through the backward and the optimizer step (and the previous ones through the next
    forward). The estimate of both plans is that loop's measured peak (the 8-byte loss aside), and
    max_batch's answers fit such a loop, where the estimate without it is under by the logits."""
    import sys

    from ckptopt import Plan, apply_plan
    from ckptopt.planning import estimate, max_batch, with_batch

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_measure import _ce_head_model, _kept_loop_peak

    model, x, loss_fn = _ce_head_model()
    est = estimate(model, x, optimizer="adam", loss_fn=loss_fn, keep_output=True)
    plain = estimate(model, x, optimizer="adam", loss_fn=loss_fn)
    tm = trace(model, x, loss_fn=loss_fn)
    for pe, pp in ((est.no_checkpointing, plain.no_checkpointing), (est.optimal, plain.optimal)):
        module = apply_plan(model, tm, Plan(pe.checkpoints, 0, "given", 0.0, tm.n, pe.stored)) if pe.checkpoints \
            else model
        measured = _kept_loop_peak(module, x, loss_fn, torch.optim.Adam(module.parameters()))
        assert measured - pe.peak_bytes in (0, 8)
        assert pe.peak_bytes - pp.peak_bytes == pe.breakdown.kept_output == 256 * 2048 * 4
        assert pe.breakdown.total == pe.peak_bytes
    memory = 24 * 2**20
    first = lambda out: torch.log_softmax(out, -1)[:, 0].mean()  # noqa: E731  (saves the softmax, not the logits)
    mb = max_batch(model, x, memory, optimizer="sgd", loss_fn=first, keep_output=True)
    loose = max_batch(model, x, memory, optimizer="sgd", loss_fn=first)
    for fit, free in ((mb.no_checkpointing, loose.no_checkpointing), (mb.optimal, loose.optimal)):
        assert 0 < fit.batch < free.batch and fit.peak_bytes <= memory < fit.next_peak_bytes
        for b, fits in ((fit.batch, True), (fit.batch + 1, False)):
            xb = with_batch((x,), b, 256)[0]
            tb = trace(model, xb, loss_fn=first)
            plan = fit.checkpoints if fits else solve(tb.costs, "auto").checkpoints if fit.checkpoints else ()
            module = apply_plan(model, tb, Plan(plan, 0, "given", 0.0, tb.n, fit.stored if fits else ())) \
                if plan else model
            peak = _kept_loop_peak(module, xb, first, torch.optim.SGD(module.parameters(), lr=0.1))
            assert (peak <= memory + 8) if fits else (peak > memory)


def test_keep_output_with_a_parallel_rank_is_refused_clearly():
    from ckptopt.planning import Parallel, estimate, max_batch

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    for call in (lambda: estimate(model, x, parallel=Parallel(2, "ddp"), keep_output=True),
                 lambda: max_batch(model, x, "64MiB", parallel=Parallel(2, "ddp"), keep_output=True)):
        with pytest.raises(ValueError, match="keep_output=True is not supported with parallel= yet: plan one process"):
            call()
