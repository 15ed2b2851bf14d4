"""What a training step reserves on CUDA, without the device (ckptopt.planning.reserved): the allocations
of a loop built from a fake step and the optimizer's rules, replayed through the caching allocator; against
allocator histories recorded on a GPU, and as the answer of max_batch on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckptopt import measure_peak
from ckptopt.planning import max_batch
from ckptopt.planning.optimizer import optimizer_memory, step_allocations
from ckptopt.planning.reserved import allocator_settings, replay_steps, step_events
from ckptopt.simulator.allocator import replay
from ckptopt.torch_utils import normalize_inputs

MiB = 1 << 20


def _live(events) -> tuple[int, int]:
    """``(live bytes at the end, their peak)`` of alloc/free events."""
    live, peak, size = 0, 0, {}
    for what, key, b in events:
        if what == "alloc":
            size[key] = b
            live += b
        else:
            live -= size.pop(key)
        peak = max(peak, live)
    return live, peak


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=12), st.sampled_from(["adam", "adamw"]),
       st.sampled_from(["foreach", "for-loop"]))
def test_the_optimizer_steps_allocations_reach_its_measured_state_and_transient(sizes, name, impl):
    """The event rules and the measured formulas of ``optimizer_memory`` (CUDA: no counters on the device)
    agree: the first step leaves the state allocated, and the temporaries peak at the step transient."""
    first = step_allocations(sizes, name, impl, first=True, tag=0)
    later = step_allocations(sizes, name, impl, first=False, tag=1)
    om = optimizer_memory(sizes, name, impl, device="cuda")
    assert _live(first)[0] == om.state_bytes
    assert _live(later)[1] == om.step_transient_bytes
    assert all(k[0] in ("sqrt", "denom") for _, k, _ in later)  # no state made after the first step


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))


def test_a_steps_allocations_are_the_trackers_bytes_plus_the_cublas_workspaces():
    """Without the optimizer, the live bytes of the model's and its step's allocations peak where the
    storage tracker's peak of the same step is, plus one cuBLAS workspace per pass (forward, backward)."""
    model, x = _mlp(), torch.randn(32, 64)
    steps = step_events(model, normalize_inputs(x), None, None, optimizer="none", steps=1, workspace_bytes=MiB)
    workspaces = [k for w, k, _ in steps.events if w == "alloc" and isinstance(k, tuple) and k[0] == "cublas workspace"]
    assert sorted(k[1] for k in workspaces) == ["backward", "forward"]
    peak = measure_peak(model, x, fake=True)
    assert _live(steps.events)[1] == peak + 2 * MiB
    assert [p for p, _ in steps.phases] == ["model", "step1"] and steps.unsupported is None


def test_a_convolution_is_named_as_what_the_replay_cannot_know():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4))
    steps = step_events(model, normalize_inputs(torch.randn(2, 3, 16, 16)), None, None, steps=1)
    assert steps.unsupported and "convolution" in steps.unsupported


def test_allocator_settings_are_read_and_unmodelled_ones_named():
    assert allocator_settings("expandable_segments:True")[0] is True
    assert allocator_settings("max_split_size_mb:128")[1].max_split_size == 128 * MiB
    assert "roundup_power2_divisions" in allocator_settings("roundup_power2_divisions:4")[2]
    assert allocator_settings("")[2] is None
    with pytest.raises(ValueError, match="garbage_collection_threshold"):
        replay_steps(step_events(_mlp(), normalize_inputs(torch.randn(4, 64)), None, None, steps=1), None,
                     "garbage_collection_threshold:0.6")


def test_max_batch_on_cuda_is_the_largest_batch_the_allocator_replay_serves(monkeypatch):
    """On CUDA (planned here, without one) max_batch answers with the replay: the answer's first two steps
    reserve at most the memory, and one more sample does not fit (by the replay or by its allocated peak)."""
    from ckptopt.planning.batch import with_batch

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1")  # (4 MiB workspaces: a small memory to fill)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024),
                          nn.GELU(), nn.Linear(1024, 8))
    x = torch.randn(4, 256)
    memory = 80 * MiB  # (the parameters, gradients and Adam state take 48 MiB of it)
    mb = max_batch(model, x, memory, device="cuda")
    assert mb.fitted_by == "replay" and mb.replay_note is None
    for fit in (mb.no_checkpointing, mb.optimal):
        assert fit.batch >= 1 and fit.reserved_bytes <= memory

        def fits(b: int) -> bool:
            from ckptopt import trace
            from ckptopt.plan import Plan
            from ckptopt.rewriter import apply_plan

            xb = with_batch(normalize_inputs(x), b, 4)
            build = None
            if fit.strategy != "none":
                tm = trace(model, xb.args[0])
                plan = Plan(tuple(fit.checkpoints), 0, "given", 0.0, tm.n, tuple(fit.stored))
                build = lambda fm: apply_plan(fm, tm, plan)  # noqa: E731
            return replay(step_events(model, xb, build=build).events, memory).fits

        assert fits(fit.batch), fit
        assert fit.next_peak_bytes > memory or not fits(fit.batch + 1), fit
    assert mb.optimal.batch > mb.no_checkpointing.batch

    # where the replay cannot answer, the headroom share does, and the answer says why
    from ckptopt.planning import Headroom
    from ckptopt.planning.reserved import replay_declined

    assert replay_declined("cuda", Headroom(0, 0.1, "given"), None, False) == "a headroom was given"
    assert replay_declined("cpu", None, None, False) == "no caching allocator off CUDA"


@pytest.mark.slow
@pytest.mark.parametrize("model_name, case_name", [
    ("gpt", "gpt-b29-none-default-cap8g"),   # fit under the 8 GiB cap on the H200
    ("gpt", "gpt-b30-none-default-cap8g"),   # ran out of memory in its second step there
    ("llama", "llama-b4-optimal-default"),   # a transformers model with ckptopt's plan
])
def test_allocations_built_without_the_device_replay_as_the_device_ran_them(model_name, case_name):
    """Against allocator histories recorded on an H200 (benchmarks/data/cuda_alloc): the loop's allocations
    built on the CPU from a fake step, replayed, reserve within one segment of what the device reserved
    at each step's peak, and run out of memory in the step where the device did (or not at all)."""
    from benchmarks.allocator_replay import case_step_events, synthesized_case
    from benchmarks.cuda_alloc_traces import load, trace_files

    if model_name == "llama":
        pytest.importorskip("transformers")
    path = next(p for p in trace_files() if p.name.startswith(model_name + "."))
    case = next(c for c in load(path)["cases"] if c["name"] == case_name)
    row = synthesized_case(case, case_step_events(model_name, case))
    assert row["unsupported"] is None
    assert row["fits_answer_right"], row
    assert row["steps"] and row["max_abs_peak_error"] <= row["largest_segment"], row


def test_estimate_on_cuda_needs_the_least_memory_the_replay_runs_the_steps_in(monkeypatch):
    """estimate(device="cuda") answers "what the device needs" with the replay: the least memory (to 2 MiB)
    under which both plans' first two steps run (one step of 2 MiB less runs out), and says so."""
    from ckptopt import estimate
    from ckptopt.rewriter import apply_plan

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.Tanh())], nn.Linear(512, 4))
    x = torch.randn(4096, 512)  # (activations well above the optimizer step: a plan that checkpoints)
    est = estimate(model, x, device="cuda")
    assert est.replayed is not None and est.replay_note is None and est.optimal.checkpoints
    assert set(est.replayed) == {"no checkpointing", "optimal plan"}
    from ckptopt import trace
    from ckptopt.plan import Plan

    tm = trace(model, x)
    plan = Plan(tuple(est.optimal.checkpoints), 0, "given", 0.0, tm.n, tuple(est.optimal.stored))
    for pe, build in ((est.no_checkpointing, None), (est.optimal, lambda fm: apply_plan(fm, tm, plan))):
        events = step_events(model, normalize_inputs(x), build=build).events
        need = est.needed_bytes(pe)
        assert need >= pe.peak_bytes
        assert replay(events, need).fits and not replay(events, need - 2 * MiB).fits
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # (the plan found before the replay, not beside it)
    assert estimate(model, x, device="cuda") == est
    off = estimate(model, x, device="cuda", keep_output=True)
    assert off.replayed is None and "keeps the output" in off.replay_note


def test_the_replay_of_the_model_as_it_is_runs_while_the_trace_waits(monkeypatch):
    """estimate on CUDA hands the trace the allocator replay of no checkpointing, which needs no trace:
    it runs while a crossing's trial is pending, and the estimate is the one running them in turn gives."""
    import time

    import ckptopt.planning.reserved as reserved
    import ckptopt.tracer.chain as chain
    from ckptopt import estimate, zoo

    model, x = zoo.get("gpt", batch_size=2)
    ref = estimate(model, x, device="cuda")
    order, trial, replay = [], chain.solves_within, reserved.replayed_needs

    def slow_trial(costs, max_work, stop=None):
        time.sleep(0.5)
        order.append("trial")
        return trial(costs, max_work, stop)

    def replayed(*args, **kwargs):
        order.append("replay")
        return replay(*args, **kwargs)

    monkeypatch.setattr(chain, "solves_within", slow_trial)
    monkeypatch.setattr(reserved, "replayed_needs", replayed)
    assert estimate(model, x, device="cuda") == ref
    assert ref.replayed is not None and "trial" in order and order.index("replay") < order.index("trial")


def test_a_step_that_does_not_run_on_fake_tensors_leaves_the_answer_to_the_headroom_share(monkeypatch):
    """Where the loop's fake step cannot run (a forward reading a value no fake tensor has), estimate and
    max_batch keep the headroom share and say why, rather than failing."""
    import ckptopt.planning.reserved as reserved
    from ckptopt import estimate

    def fails(*args, **kwargs):
        raise RuntimeError("aten._local_scalar_dense on a fake tensor")

    monkeypatch.setattr(reserved, "step_events", fails)
    model, x = _mlp(), torch.randn(64, 64)
    est = estimate(model, x, device="cuda")
    assert est.replayed is None and "did not run on fake tensors" in est.replay_note
    mb = max_batch(model, x, "1GiB", device="cuda")
    assert mb.fitted_by == "headroom" and "did not run on fake tensors" in mb.replay_note
