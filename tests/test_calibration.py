"""Device calibration (ckptopt.calibration), the headroom kept below a memory limit
(ckptopt.planning.headroom) and the "just make it fit" budget, on the CPU.

The CPU has no allocator statistics: scratch and workspace are zero there and only the
times change. The memory side is exercised with an injected probe that reports what a
real allocator would (the tensors' peak plus a known scratch), so that what calibration
folds into the cost model can be checked exactly.
"""

import gc
import itertools
import math
import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ckptopt
from ckptopt import InfeasibleBudget, optimize_checkpoints, simulate, solve, trace, zoo
from ckptopt.calibration import Calibration, DeviceProbe, LayerCalibration, calibrate, clear_cache
from ckptopt.cli import main
from ckptopt.planning import Headroom, estimate, max_batch, plan_training
from ckptopt.planning import headroom as headroom_mod
from ckptopt.tracker import StorageTracker


def convnet(batch=4, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).train()
    return model, (torch.randn(batch, 3, 8, 8),)


def chain(width=64, depth=4, batch=8, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 3)).train(), (torch.randn(batch, width),)


def all_plans(n):
    for k in range(n):
        yield from itertools.combinations(range(1, n), k)


# -- calibration on the CPU: times, no scratch ------------------------------------------
def test_cpu_calibration_measures_times_and_keeps_every_peak():
    model, x = convnet()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tm = trace(model, x)
    cal = calibrate(model, tm, x, repeats=2, cache=False)
    assert len(cal.layers) == tm.n and cal.device == "cpu"
    assert all(layer.forward_seconds > 0 and layer.backward_seconds >= 0 for layer in cal.layers)
    assert all(layer.forward_scratch == layer.backward_scratch == 0 for layer in cal.layers)
    assert cal.workspace_bytes == 0
    # the model is left as it was: BatchNorm statistics, gradients
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())

    costs = cal.apply(tm.costs)
    assert costs.unit == "ns" and costs.cb is not None
    assert list(costs.c) == [round(layer.forward_seconds * 1e9) for layer in cal.layers]
    assert list(costs.cb) == [round(layer.backward_seconds * 1e9) for layer in cal.layers]
    assert costs.step_compute == int(costs.c.sum() + costs.cb.sum())
    for plan in all_plans(tm.n):
        assert simulate(costs, plan).peak_bytes == simulate(tm.costs, plan).peak_bytes
    # the unit travels through JSON
    assert ckptopt.ChainCosts.from_dict(costs.to_dict()) == costs


def test_only_one_layer_is_in_memory_at_a_time():
    model, x = chain(width=256, depth=12, batch=512)
    tm = trace(model, x)
    tracker = StorageTracker()
    tracker.register(model, x)
    start = tracker.current_bytes
    with tracker:
        calibrate(model, tm, x, repeats=1, cache=False)
    end = tracker.current_bytes
    tracker.detach()
    one_layer = 512 * 256 * 4
    # a layer's step holds its input, output and their gradients (and weight gradients);
    # all the layers' inputs at once would be 24 activations
    assert tracker.peak_bytes - start < 8 * one_layer
    assert end == start  # nothing left behind


def test_repeated_blocks_are_measured_once():
    clear_cache()
    model, x = zoo.get("gpt", batch_size=2, depth=4, width=32, heads=2, seq_len=16, vocab=64)
    tm = trace(model, x)
    cal = calibrate(model, tm, x, repeats=1)
    assert cal.measured < tm.n  # the four decoder blocks share one signature
    names = [layer.name for layer in tm.layers]
    blocks = [i for i, name in enumerate(names) if name.startswith("transformer.h.")]
    # each block is the same few layers: only the first block's are run
    per = len(blocks) // 4
    assert per >= 2 and len(blocks) == 4 * per
    assert not cal.layers[blocks[0]].cached and all(cal.layers[i].cached for i in blocks[per:])
    again = calibrate(model, tm, x, repeats=1)
    assert again.measured == 0 and again.layers == tuple(
        LayerCalibration(c.forward_seconds, c.backward_seconds, c.forward_scratch, c.backward_scratch, True)
        for c in cal.layers)
    fresh = calibrate(model, tm, x, repeats=1, cache=False)
    assert fresh.measured == tm.n


def test_calibration_rejects_a_cost_model_of_another_length():
    model, x = chain()
    tm = trace(model, x)
    cal = Calibration("cpu", tuple(LayerCalibration(1e-6, 2e-6) for _ in range(tm.n - 1)))
    with pytest.raises(ValueError, match="layers"):
        cal.apply(tm.costs)


# -- an allocator that takes scratch beyond the tensors ---------------------------------
class ScriptedProbe(DeviceProbe):
    """Reports the tensors' peak of each phase (its own storage tracker) plus a scripted
    scratch, and a scripted library workspace: what a device with a caching allocator would."""

    def __init__(self, forward_scratch, backward_scratch, workspace, recompute_workspace=0):
        super().__init__(torch.device("cpu"))
        self.scratch = {"forward": forward_scratch, "backward": backward_scratch}
        self.ws = workspace
        self.readings = [workspace, workspace + recompute_workspace]  # before and after the replay
        self.calls = 0
        self.tracker = None

    @property
    def has_statistics(self):
        return True

    def begin(self):
        # like an allocator, count every storage alive, not only what the ops return
        gc.collect()  # no garbage of earlier tests freed inside the phase (it would lower this peak only)
        gc.disable()
        self.tracker = StorageTracker()
        with warnings.catch_warnings():  # gc.get_objects touches deprecated torch.distributed aliases
            warnings.simplefilter("ignore")
            live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        self.tracker.register(live)
        self.start = self.tracker.current_bytes
        self.tracker.__enter__()

    def phase(self):
        self.tracker.__exit__(None, None, None)
        gc.enable()
        extra = self.scratch["forward" if self.calls % 2 == 0 else "backward"]
        self.calls += 1
        peak = self.tracker.peak_bytes - self.start
        self.tracker.detach()
        return peak + extra

    def workspace(self):
        return self.readings.pop(0) if self.readings else self.ws


def test_scratch_and_workspace_fold_into_the_cost_model():
    model, x = convnet()
    tm = trace(model, x)
    probe = ScriptedProbe(forward_scratch=3000, backward_scratch=5000, workspace=70_000)
    cal = calibrate(model, tm, x, repeats=1, probe=probe, cache=False)
    assert [(layer.forward_scratch, layer.backward_scratch) for layer in cal.layers] == [(3000, 5000)] * tm.n
    assert cal.workspace_bytes == 70_000
    costs = cal.apply(tm.costs)
    base = tm.costs
    assert costs.static == base.static + 70_000
    assert list(costs.f) == [int(v) + 3000 for v in base.f]
    assert list(costs.b) == [int(v) + 5000 for v in base.b]
    assert list(costs.bk) == [int(v) + 5000 for v in base.bk]
    assert list(costs.bf) == [int(v) + 5000 for v in base.bf]
    assert list(costs.fs) == [int(v) + 3000 if v > 0 else 0 for v in base.fs]
    # every plan's peak rises by the workspace and at most the larger scratch, at least by the workspace
    for plan in all_plans(tm.n):
        new, old = simulate(costs, plan).peak_bytes, simulate(base, plan).peak_bytes
        assert old + 70_000 <= new <= old + 70_000 + 5000
    # the solvers plan on the calibrated model: optimal there
    best = solve(costs, "dp")
    assert best.peak_bytes == min(simulate(costs, p).peak_bytes for p in all_plans(tm.n))


def test_the_workspace_a_recomputation_adds_is_measured_inside_a_backward_and_kept():
    # A checkpointed segment's recomputation runs forward kernels inside the backward (on CUDA on
    # autograd's thread, whose library workspaces are its own: cuBLASLt's 1 MiB on an H200). The
    # calibration replays each distinct layer's forward there once and keeps what it adds.
    model, x = convnet()
    tm = trace(model, x)
    inside: list[bool] = []
    hook = model[0].register_forward_hook(
        lambda m, i, o: inside.append(torch._C._current_autograd_node() is not None and torch.is_grad_enabled()))
    try:
        probe = ScriptedProbe(forward_scratch=0, backward_scratch=0, workspace=70_000, recompute_workspace=1024)
        cal = calibrate(model, tm, x, repeats=1, probe=probe, cache=False)
    finally:
        hook.remove()
    assert cal.workspace_bytes == 70_000 and cal.recompute_workspace_bytes == 1024
    assert cal.apply(tm.costs).static == tm.costs.static + 70_000 + 1024
    assert inside[-1] and not any(inside[:-1])  # the timed and scratch runs outside, the replay inside a backward
    assert not [p for p in model.parameters() if p.grad is not None]  # the replay leaves no gradient
    # without allocator statistics nothing is replayed and nothing added
    plain = calibrate(model, tm, x, repeats=1, cache=False)
    assert plain.recompute_workspace_bytes == 0 and plain.apply(tm.costs).static == tm.costs.static


# -- measured time drives the least-recompute choice ------------------------------------
def test_budget_solver_minimizes_measured_time_not_flops():
    model, x = chain(width=64, depth=5, batch=256)
    tm = trace(model, x)
    n = tm.n
    # measured times that disagree with the FLOPs (as memory-bound layers' do on a GPU)
    rng = random.Random(0)
    times = [LayerCalibration(rng.choice([1e-5, 1e-3, 5e-3]), 1e-4) for _ in range(n)]
    costs = Calibration("cpu", tuple(times)).apply(tm.costs)
    peaks = {p: simulate(costs, p) for p in all_plans(n)}
    min_peak = min(r.peak_bytes for r in peaks.values())
    none_peak = peaks[()].peak_bytes
    checked = differs = 0
    for budget in sorted({r.peak_bytes for r in peaks.values() if min_peak <= r.peak_bytes < none_peak}):
        plan = solve(costs, "budget", budget=budget)
        sim = simulate(costs, plan.checkpoints, plan.stored)
        assert sim.peak_bytes <= budget
        cheapest = min(r.recompute_flops for r in peaks.values() if r.peak_bytes <= budget)
        assert sim.recompute_flops <= cheapest  # checkpoint-only plans are a subset of what budget searches
        by_flops = solve(tm.costs, "budget", budget=budget)
        differs += simulate(costs, by_flops.checkpoints, by_flops.stored).recompute_flops > sim.recompute_flops
        checked += 1
    assert checked >= 2 and differs >= 1  # pricing by FLOPs would have recomputed longer
    # and the figure is seconds
    sim = simulate(costs, (2,))
    assert sim.unit == "ns" and sim.recompute_seconds == pytest.approx(sim.recompute_flops / 1e9)
    assert 0 < sim.recompute_share < 1


def test_optimize_checkpoints_calibrated_explains_milliseconds():
    model, x = convnet()
    opt = optimize_checkpoints(model, x, calibrate=True)
    assert opt.traced.calibration is not None and opt.traced.costs.unit == "ns"
    text = opt.explain()
    assert "ms" in text and "calibrated on cpu" in text
    uncal = optimize_checkpoints(model, x, calibrate=False)
    assert uncal.traced.calibration is None and uncal.predicted_peak_bytes == opt.predicted_peak_bytes
    out, ref = opt(*x), model(*x)
    assert torch.allclose(out, ref)


# -- headroom ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**7), st.floats(0.0, 0.5), st.integers(1, 10**10))
def test_usable_is_the_largest_peak_that_fits(workspace, fraction, memory):
    hr = Headroom(workspace, fraction, "given")
    u = hr.usable(memory)
    assert u >= 0
    if u > 0:
        assert hr.needed(u) <= memory
    assert hr.needed(u + 1) > memory


def test_headroom_rejects_nonsense():
    with pytest.raises(ValueError, match="fraction"):
        Headroom(0, 1.5)
    with pytest.raises(ValueError, match="workspace"):
        Headroom(-1, 0.1)


def test_default_headroom_is_none_on_cpu():
    hr = headroom_mod.default_headroom("cpu")
    assert hr.needed(12345) == 12345 and "no caching allocator" in hr.describe()


def test_max_batch_keeps_the_headroom_free():
    model, x = chain(width=128, depth=3)
    memory = 8 * 2**20
    hr = Headroom(2**20, 0.25, "given")
    mb = max_batch(model, x, memory, optimizer="sgd", headroom=hr)
    assert mb.memory_bytes == memory and mb.usable_bytes == hr.usable(memory)
    for fit in (mb.no_checkpointing, mb.optimal):
        assert fit.batch > 0 and hr.needed(fit.peak_bytes) <= memory < hr.needed(fit.next_peak_bytes)
    # the same as asking for the usable bytes without headroom
    plain = max_batch(model, x, mb.usable_bytes, optimizer="sgd")
    assert (plain.no_checkpointing.batch, plain.optimal.batch) == (mb.no_checkpointing.batch, mb.optimal.batch)
    assert max_batch(model, x, memory, optimizer="sgd").optimal.batch > mb.optimal.batch
    tp = plan_training(model, x, 4 * mb.optimal.batch, memory, optimizer="sgd", headroom=hr)
    assert tp.usable_bytes == mb.usable_bytes
    assert all(hr.needed(o.peak_bytes) <= memory for o in tp.options if o.checkpoints is not None)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**7), st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.integers(1, 10**10))
def test_usable_with_checkpoints_is_the_largest_peak_that_fits_their_share(workspace, fraction, ckpt, memory):
    hr = Headroom(workspace, fraction, "given", ckpt)
    for checkpointed, share in ((False, fraction), (True, ckpt)):
        u = hr.usable(memory, checkpointed)
        assert hr.needed(u + 1, checkpointed) > memory and (u == 0 or hr.needed(u, checkpointed) <= memory)
        assert hr.needed(u, checkpointed) == Headroom(workspace, share, "given").needed(u)
    assert Headroom(workspace, fraction, "given").usable(memory, True) == Headroom(workspace, fraction).usable(memory)
    with pytest.raises(ValueError, match="fractions"):
        Headroom(0, 0.1, "given", 1.0)


def test_the_default_cuda_headroom_follows_the_allocator_setting(monkeypatch):
    """Default allocator: 10%, 15% for a checkpointed plan (fragmentation measured on an H200);
    expandable segments, read from the allocator's settings or the environment: 5% for both."""
    from ckptopt.planning import CUDA_CHECKPOINTED_FRACTION, CUDA_DEFAULT_FRACTION, CUDA_EXPANDABLE_FRACTION

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert not headroom_mod.expandable_segments()
    hr = headroom_mod.default_headroom("cuda")
    assert (hr.fraction_for(False), hr.fraction_for(True)) == (CUDA_DEFAULT_FRACTION, CUDA_CHECKPOINTED_FRACTION)
    assert "15.0% with checkpoints" in hr.describe()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert headroom_mod.expandable_segments()
    hr = headroom_mod.default_headroom("cuda")
    assert hr.fraction_for(False) == hr.fraction_for(True) == CUDA_EXPANDABLE_FRACTION
    assert "expandable segments" in hr.source
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True",
                        raising=False)
    assert headroom_mod.expandable_segments()
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:False",
                        raising=False)
    assert not headroom_mod.expandable_segments()
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)  # (older torch: the env only)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert headroom_mod.expandable_segments()


def test_max_batch_and_plans_keep_the_checkpointed_share_for_checkpointed_plans():
    """A plan that checkpoints keeps its own (larger) share free: max_batch's optimal answer,
    plan_training's checkpointed options and an estimate's device needs use it; the plain
    answers keep the other."""
    model, x = chain(width=128, depth=3)
    memory = 8 * 2**20
    hr = Headroom(0, 0.02, "given", 0.1)
    mb = max_batch(model, x, memory, optimizer="sgd", headroom=hr)
    assert mb.usable_bytes == hr.usable(memory) and mb.usable_checkpointed_bytes == hr.usable(memory, True)
    assert mb.optimal.checkpoints and hr.needed(mb.optimal.peak_bytes, True) <= memory
    assert hr.needed(mb.optimal.next_peak_bytes, True) > memory
    assert hr.needed(mb.no_checkpointing.peak_bytes) <= memory < hr.needed(mb.no_checkpointing.next_peak_bytes)
    flat_hr = Headroom(0, 0.02, "given")
    flat = max_batch(model, x, memory, optimizer="sgd", headroom=flat_hr)
    assert flat.no_checkpointing.batch == mb.no_checkpointing.batch and flat.optimal.batch > mb.optimal.batch
    one = plan_training(model, x, mb.optimal.batch, memory, optimizer="sgd", headroom=hr).options[0]
    assert one.steps == 1 and one.checkpoints and hr.needed(one.peak_bytes, True) <= memory
    over = plan_training(model, x, flat.optimal.batch, memory, optimizer="sgd", headroom=hr).options[0]
    assert over.steps == 1 and over.checkpoints is None and not over.fits_optimal
    flat_one = plan_training(model, x, flat.optimal.batch, memory, optimizer="sgd", headroom=flat_hr).options[0]
    assert flat_one.checkpoints and flat_one.fits_optimal
    big, xb = chain(width=128, depth=3, batch=mb.optimal.batch)
    est = estimate(big, xb, optimizer="sgd", headroom=hr)
    assert est.optimal.checkpoints and est.needed_bytes(est.optimal) == hr.needed(est.optimal.peak_bytes, True)
    assert est.needed_bytes(est.no_checkpointing) == hr.needed(est.no_checkpointing.peak_bytes)


def test_max_batch_calibrated_lowers_the_answer_until_the_scratch_fits(monkeypatch):
    from ckptopt import calibration
    from ckptopt.planning.batch import BatchCosts, peak_and_plan, with_batch
    from ckptopt.planning.optimizer import optimizer_memory

    model, x = chain(width=128, depth=3)
    memory = 8 * 2**20
    plain = max_batch(model, x, memory, optimizer="sgd", calibrate=False)
    calls = []

    def device_with_scratch(model, traced, inputs, **kw):  # its allocator takes 1 MiB in every backward
        calls.append(traced.example_shapes)
        return Calibration("cpu", tuple(LayerCalibration(1e-6, 1e-6, 0, 2**20) for _ in range(traced.n)))

    monkeypatch.setattr(calibration, "calibrate", device_with_scratch)
    mb = max_batch(model, x, memory, optimizer="sgd", calibrate=True)
    assert calls and len(calls) < 20  # a few calibrations, not a search over every batch
    bc = BatchCosts(model, x)
    sizes = [p.numel() * 4 for p in model.parameters()]
    opt = optimizer_memory(sizes, "sgd", None, "cpu")
    for fit, before in ((mb.no_checkpointing, plain.no_checkpointing), (mb.optimal, plain.optimal)):
        assert fit.calibrated and 0 < fit.batch < before.batch

        def calibrated_peak(b):
            tm = bc.traced(b)
            costs = device_with_scratch(model, tm, with_batch(x, b, 8)).apply(tm.costs)
            return peak_and_plan(bc.rank(b, costs=costs), fit.strategy, opt, final=True)[0]

        assert fit.peak_bytes == calibrated_peak(fit.batch) <= memory < calibrated_peak(fit.batch + 1)


def test_memory_left_out_means_the_device_free_memory(monkeypatch):
    model, x = chain(width=128, depth=3)
    monkeypatch.setattr(headroom_mod, "device_free_memory", lambda device: 6 * 2**20)
    from ckptopt.planning import batch as batch_mod

    monkeypatch.setattr(batch_mod, "device_free_memory", lambda device: 6 * 2**20)
    mb = max_batch(model, x, optimizer="sgd")
    assert mb.memory_bytes == 6 * 2**20
    assert mb.optimal.batch == max_batch(model, x, 6 * 2**20, optimizer="sgd").optimal.batch


def test_device_free_memory_on_cpu_is_positive():
    assert headroom_mod.device_free_memory("cpu") > 0


def test_estimate_needed_bytes_adds_the_headroom():
    model, x = chain()
    hr = Headroom(1000, 0.1, "given")
    est = estimate(model, x, optimizer="sgd", headroom=hr)
    assert est.needed_bytes(est.optimal) == est.optimal.peak_bytes + 1000 + math.ceil(0.1 * est.optimal.peak_bytes)
    d = est.to_dict()
    assert d["headroom"]["fraction"] == 0.1 and d["needed_bytes"]["optimal"] == est.needed_bytes(est.optimal)


# -- "just make it fit" --------------------------------------------------------------------
def _patch_free(monkeypatch, free):
    monkeypatch.setattr(headroom_mod, "device_free_memory", lambda device: free)


def test_budget_device_picks_the_least_recompute_plan_that_fits(monkeypatch):
    model, x = chain(width=64, depth=6, batch=256)
    tm = trace(model, x)
    lo = solve(tm.costs, "auto").peak_bytes
    hi = simulate(tm.costs, ()).peak_bytes
    free = (lo + hi) // 2
    _patch_free(monkeypatch, free)
    opt = optimize_checkpoints(model, x, budget="device")
    assert lo <= opt.predicted_peak_bytes <= free < hi
    ref = solve(tm.costs, "auto", budget=free)
    assert (opt.plan.checkpoints, opt.plan.stored) == (ref.checkpoints, ref.stored)
    _patch_free(monkeypatch, lo - 1)
    with pytest.raises(InfeasibleBudget) as err:
        optimize_checkpoints(model, x, budget="device")
    assert err.value.min_peak_bytes == lo


def test_budget_device_on_the_command_line(monkeypatch, capsys):
    _patch_free(monkeypatch, 10**12)
    code = main(["optimize", "mlp", "--budget", "device", "--json"])
    out, _ = capsys.readouterr()
    import json

    data = json.loads(out)
    assert code == 0 and data["predicted_peak_bytes"] <= 10**12


def test_cli_calibrate_and_headroom(capsys):
    code = main(["optimize", "mlp", "--calibrate"])
    out, _ = capsys.readouterr()
    assert code == 0 and "calibrated on cpu" in out and " ms" in out
    code = main(["max-batch", "mlp", "--memory", "64MiB", "--headroom", "0.2"])
    out, _ = capsys.readouterr()
    assert code == 0 and "headroom kept" in out and "20.0%" in out
    code = main(["estimate", "mlp", "--calibrate"])
    out, _ = capsys.readouterr()
    assert code == 0 and "measured forward + backward time" in out
    code = main(["compare", "mlp", "--calibrate", "--solvers", "dp2,sqrt"])
    out, _ = capsys.readouterr()
    assert code == 0 and "recompute" in out and " ms" in out


def test_calibrating_needs_no_more_memory_than_the_step_it_plans():
    """Each layer runs alone on inputs nothing else holds (a boxed call, a non-leaf input): an
    input dies at its last use, as inside the model. The calibration held two copies of each
    layer input through the run (the input and a leaf clone): on a model whose loss reads fp32
    logits it needed more than an unplanned training step (34.8 MB against 26.9 MB here)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4096))
    x = torch.randn(512, 64)
    target = torch.randint(0, 4096, (512,))
    loss_fn = lambda out: F.cross_entropy(out, target)  # noqa: E731
    tm = trace(model, (x,), loss_fn=loss_fn)
    clear_cache()
    tracker = StorageTracker()
    tracker.register(model, x, target)
    with tracker:
        cal = calibrate(model, tm, (x,), repeats=1, cache=False)
    assert cal.measured == tm.n and all(c.forward_seconds > 0 for c in cal.layers)
    assert tracker.peak_bytes <= solve(tm.costs, "none").peak_bytes
