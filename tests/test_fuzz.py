"""Random-model fuzzing: the rewritten model trains exactly like the original.

Each random model (``tests/common/fuzz.py``: chains and DAGs with residual
adds, products, concatenations, branches that rejoin, in-place ops,
BatchNorm, Dropout, LayerNorm/GroupNorm, pooling, varied widths and dtypes)
is traced and solved with every exact solver (``dp``, ``dp2``, and
``brute`` when n <= 20), plus the plan of ``optimize_checkpoints``' default
(dp2's, improved over plans with unwrapped "stored" segments) and the
``budget`` solver's plan for the budget halfway between the optimum and no
checkpointing (which often leaves middle segments unwrapped). Then, for
each distinct optimal plan and for the ``every`` plan (the most rewriting a
plan can do):

* two training steps of the rewritten module, with the same RNG seeds as
  two steps of the original, give bit-identical outputs, parameter (and
  input) gradients and buffers (BatchNorm statistics updated once);
* the measured peak (``measure_peak``: the exact storage tracker on a real
  step; the models are tiny, so this costs no more than a fake-tensor run,
  which over-counts some models: the regression case batchnorm-product-real-step)
  is at most the predicted peak x 1.05 (+ 8 bytes: the
  scalar loss and its gradient, which matter on the smallest models), and, for the
  optimal plans, at most the measured peak without checkpointing.

The exact solvers must also agree on the optimal value.

Regression cases (``tests/common/regressions.py``: a table of random models
the cost model once got wrong, each with the rule it guards) run through
``test_regression``, one test id per case.

Profiles: by default (CI) ``FAST_EXAMPLES`` derandomized models; the long
profile runs ``CKPTOPT_FUZZ_N`` (default 400) fresh random models::

    python -m pytest -m fuzz tests/test_fuzz.py -s        # or
    CKPTOPT_FUZZ=long python -m pytest tests/test_fuzz.py -s
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from ckptopt import apply_plan, simulate, solve
from ckptopt.measure import measure_peak
from ckptopt.solvers import improve_with_stored
from ckptopt.tracer import trace

from .common.exactness import LOSS_BYTES, traced
from .common.fuzz import Spec, build, specs, stream_specs
from .common.regressions import CASES, OUTPUT_GRADIENT_OUTLIVES_THE_BACKWARD, Case, Traced, plans_of

FAST_EXAMPLES = 5
FAST_STREAM_EXAMPLES = 4
LONG = os.environ.get("CKPTOPT_FUZZ", "") == "long"
LONG_EXAMPLES = int(os.environ.get("CKPTOPT_FUZZ_N", "400"))
STEPS = 2  # a second step catches a BatchNorm statistic updated twice
TOLERANCE = 1.05  # measured peak <= predicted x 1.05 (the bound), + LOSS_BYTES (the scalar loss and
# its gradient, which the chain model leaves out: docs/design.md)

_ran = {"models": 0, "plans": 0, "stored": 0}


def _loss(out):
    return out.float().pow(2).mean()


def _train(module, model, x, steps=STEPS):
    """Outputs, gradients (params and input) and buffers after ``steps`` steps from the current state."""
    outs, grads = [], []
    for s in range(steps):
        for p in model.parameters():
            p.grad = None
        x.grad = None
        torch.manual_seed(1000 + s)
        out = module(x)
        _loss(out).backward()
        outs.append(out.detach().clone())
        grads.append({k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()})
        grads[-1]["<input>"] = None if x.grad is None else x.grad.clone()
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    for p in model.parameters():
        p.grad = None
    x.grad = None
    return outs, grads, buffers


def _assert_same(ref, got, what):
    for s, (a, b) in enumerate(zip(ref[0], got[0])):
        assert torch.equal(a, b), f"{what}: output of step {s} differs"
    for s, (ga, gb) in enumerate(zip(ref[1], got[1])):
        for k in ga:
            assert (ga[k] is None) == (gb[k] is None), f"{what}: gradient of {k} present in one run only"
            if ga[k] is not None:
                assert torch.equal(ga[k], gb[k]), f"{what}: gradient of {k} differs at step {s}"
    for k in ref[2]:
        assert torch.equal(ref[2][k], got[2][k]), f"{what}: buffer {k} differs"


def _snapshot(model):
    return {k: b.detach().clone() for k, b in model.named_buffers()}


def _restore(model, snap):
    with torch.no_grad():
        for k, b in model.named_buffers():
            b.copy_(snap[k])


def _fake_objects() -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    gc.collect()
    objs = gc.get_objects()
    return sum(isinstance(o, FakeTensorMode) for o in objs), sum(isinstance(o, FakeTensor) for o in objs)


def check_random_model(spec: Spec, max_crossing: int | None = None) -> None:
    """Every check of the module docstring on one random model (traced with the default cuts, or
    ``max_crossing``: some regression cases are checked with single-tensor cuts)."""
    model, x = build(spec)
    model.train()
    fakes = _fake_objects()
    tm = trace(model, (x,)) if max_crossing is None else trace(model, (x,), max_crossing=max_crossing)
    assert _fake_objects() == fakes, "the trace left fake tensors (or their mode) alive"
    solvers = ["dp", "dp2"] + (["brute"] if tm.n <= 20 else [])
    plans = {name: solve(tm.costs, name) for name in solvers}
    optimum = {p.peak_bytes for p in plans.values()}
    assert len(optimum) == 1, f"exact solvers disagree: { {k: p.peak_bytes for k, p in plans.items()} }"
    for name, plan in plans.items():
        assert simulate(tm.costs, plan.checkpoints).peak_bytes == plan.peak_bytes, name
    to_run = {(p.checkpoints, p.stored): p for p in plans.values()}
    auto = improve_with_stored(tm.costs, plans["dp2"])  # optimize_checkpoints' default adds this pass
    assert auto.peak_bytes <= plans["dp2"].peak_bytes
    to_run.setdefault((auto.checkpoints, auto.stored), auto)
    none_peak = simulate(tm.costs, ()).peak_bytes
    if auto.peak_bytes < none_peak:  # the budget solver halfway: it often leaves segments unwrapped
        mid = solve(tm.costs, "budget", budget=(auto.peak_bytes + none_peak) // 2)
        to_run.setdefault((mid.checkpoints, mid.stored), mid)
    every = solve(tm.costs, "every")
    to_run.setdefault((every.checkpoints, ()), every)

    start = _snapshot(model)
    reference = _train(model, model, x)
    _restore(model, start)
    baseline_measured = measure_peak(model, (x,))
    for cps, plan in to_run.items():
        opt = apply_plan(model, tm, plan)
        try:
            got = _train(opt, model, x)
            _restore(model, start)
            _assert_same(reference, got, f"plan {cps} ({plan.solver})")
            measured = measure_peak(opt, (x,))
        finally:
            opt.remove_hooks()
        assert measured <= TOLERANCE * plan.peak_bytes + LOSS_BYTES, (cps, plan.solver, measured, plan.peak_bytes)
        if plan.solver != "every":
            assert measured <= baseline_measured, (cps, measured, baseline_measured)
        _ran["plans"] += 1
        _ran["stored"] += bool(plan.stored)
    _ran["models"] += 1


_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


@settings(max_examples=LONG_EXAMPLES if LONG else FAST_EXAMPLES, **_SETTINGS)
@given(spec=specs())
def test_random_models_train_identically(spec):
    check_random_model(spec)


@pytest.mark.fuzz
@settings(max_examples=LONG_EXAMPLES, derandomize=False, database=None, **_SETTINGS)
@given(spec=specs(max_nodes=14))
def test_random_models_long_profile(spec):
    check_random_model(spec)


# Models where several tensors cross layer boundaries (tests/common/fuzz.py, stream_specs: two
# towers joined at the end, an encoder output every decoder step reads, long skips), traced with
# trace's default cuts (several tensors per cut, docs/design.md §4): the side-tensor solvers agree
# with brute force, the plans train identically and peak where predicted.
@settings(max_examples=LONG_EXAMPLES if LONG else FAST_STREAM_EXAMPLES, **_SETTINGS)
@given(spec=stream_specs())
def test_random_stream_models_train_identically(spec):
    check_random_model(spec)


@pytest.mark.fuzz
@settings(max_examples=LONG_EXAMPLES, derandomize=False, database=None, **_SETTINGS)
@given(spec=stream_specs(max_len=8))
def test_random_stream_models_long_profile(spec):
    check_random_model(spec)


def teardown_module(module):
    print(f"\nfuzz: {_ran['models']} random models, {_ran['plans']} plans checked "
          f"({_ran['stored']} with unwrapped middle segments)")


def _features(spec: Spec) -> set[str]:
    out = {spec.family, spec.dtype, *(n.op for n in spec.nodes), *(n.inplace for n in spec.nodes if n.inplace)}
    if any(n.op in ("add", "mul", "cat") and min(n.inputs) < max(n.inputs) - 1 for n in spec.nodes):
        out.add("skip")  # a branch that leaves the main path and rejoins it later
    if spec.input_requires_grad:
        out.add("input-grad")
    return out


def test_generator_reaches_what_the_fuzzing_claims_to_cover():
    """A check of the generator itself: DAGs, in-place ops, every op, dtype and family appear."""
    seen: set[str] = set()
    models = []

    @settings(max_examples=100, derandomize=True, database=None, phases=[Phase.generate])
    @given(spec=specs())
    def collect(spec):
        seen.update(_features(spec))
        if len(models) < 5:
            models.append(spec)

    collect()
    wanted = {"conv", "mlp", "float32", "float64", "bfloat16", "skip", "input-grad", "add", "mul", "cat",
              "bn", "gn", "ln", "dropout", "maxpool", "avgpool", "up", "pool1d", "conv3", "conv1", "linear",
              "relu", "gelu", "relu_", "mul_", "relu_module", "dropout_"}
    assert wanted <= seen, wanted - seen
    for spec in models:  # each builds and runs at its declared shapes
        model, x = build(spec)
        assert model(x).shape == (spec.batch, spec.classes)


# --------------------------------------------------------------------------
# regression cases (tests/common/regressions.py)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_regression(case: Case):
    """The case's facts hold of its trace, its plans peak where predicted (its check), and, where it says
    so, the model passes every check of the fuzzing."""
    if case.facts or case.plans:
        model, x, tm = traced(case.spec, case.seed, **case.trace_kw())
        for fact in case.facts:
            holds = bool(fact.holds(Traced(model, x, tm)))
            assert holds, f"{case.id}: not so: {fact.says}"
        if case.plans:
            case.check(model, x, tm, plans_of(case, tm))
    if case.fuzz:
        check_random_model(case.spec, max_crossing=case.fuzz_max_crossing)


def test_a_held_output_gradient_leaves_nothing_behind_after_the_trace():
    """A trace that measures a layer with its output gradient held (the model of the regression case
    output-gradient-outlives-the-backward) leaves no fake tensor or fake mode alive: nothing that holds the
    gradient (a finalizer) may hold the layer's record, which holds the gradient, nor the fake mode with its
    real shadows of input-derived tensors."""
    before = _fake_objects()
    model, x, tm = traced(OUTPUT_GRADIENT_OUTLIVES_THE_BACKWARD, 91550067)
    assert tm.n > 1
    assert _fake_objects() == before
