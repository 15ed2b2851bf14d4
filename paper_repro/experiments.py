"""The measurements behind every table and figure.

Each function returns plain JSON-ready dicts; nothing here formats or plots.

* :func:`run_model` — Tables 1-3 for one model: trace once, make every
  strategy's plan with :func:`ckptopt.solve`, rewrite the model with
  :func:`ckptopt.apply_plan` and measure one training step per distinct plan
  with :func:`ckptopt.measure_peak` (which is what
  ``measure_peak(model, inputs, checkpoints=plan)`` does, without tracing
  again); time the solvers; time the steps, interleaved.
* :func:`timeline` — figure (a): the live bytes after every operator of one
  measured step, and :func:`ckptopt.simulator.timeline.simulate_timeline`'s predicted
  events placed on the same axis.
* :func:`batch_sweep` — figure (b): predicted and measured peak against the
  batch size.
* :func:`solver_scaling` — figure (c): solve time against n on random
  instances.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from ckptopt import ChainCosts, apply_plan, simulate, solve, zoo
from ckptopt.measure import measure_peak
from ckptopt.tracker import StorageTracker
from ckptopt.simulator.timeline import simulate_timeline
from ckptopt.tracer import trace

from .config import STRATEGIES, TIMED_SOLVERS, TIMELINE_PLANS, ModelConfig

DP_MAX_N = 2000  # dp is O(n^3): skipped above this n (never reached by the zoo)

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def load(cfg: ModelConfig, device: str, **override):
    """The zoo model and its inputs on ``device``, and its trace (made on CPU, fake tensors)."""
    kwargs = {**cfg.kwargs, **override}
    model, inputs = zoo.get(cfg.zoo_name, **kwargs)
    model.train()
    tm = trace(model, inputs)
    if device != "cpu":
        model.to(device)  # in place: the trace's GraphModule shares these modules
        inputs = tuple(x.to(device) for x in inputs)
    return model, inputs, tm


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_plans(costs: ChainCosts, names) -> dict:
    return {s: solve(costs, s) for s in names if not (s == "dp" and costs.n > DP_MAX_N)}


def measure(module: torch.nn.Module, inputs: tuple, how: str) -> int:
    """Peak bytes of one forward + loss + backward (loss ``out.float().pow(2).mean()``)."""
    gc.collect()
    return int(measure_peak(module, inputs, fake=(how == "fake")))


def train_step(module: torch.nn.Module, inputs: tuple) -> None:
    out = module(*inputs)
    loss = out.float().pow(2).mean()
    del out
    loss.backward()


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def buffers_snapshot(model: torch.nn.Module) -> list:
    return [b.detach().clone() for b in model.buffers()]


def buffers_restore(model: torch.nn.Module, snap: list) -> None:
    with torch.no_grad():
        for b, s in zip(model.buffers(), snap):
            b.copy_(s)


# --------------------------------------------------------------------------
# Tables 1-3
# --------------------------------------------------------------------------
def solver_costs(costs: ChainCosts, repeats: int) -> dict:
    """Median solve time of dp, dp2 and linear, interleaved ``repeats`` times; plans compared."""
    runs: dict[str, list[float]] = {s: [] for s in TIMED_SOLVERS if not (s == "dp" and costs.n > DP_MAX_N)}
    plans = {}
    for _ in range(repeats):
        for s in runs:
            p = solve(costs, s)
            runs[s].append(p.solve_seconds)
            plans[s] = p
    out = {s: dict(median_seconds=statistics.median(t), seconds=t, checkpoints=list(plans[s].checkpoints),
                   predicted_bytes=int(plans[s].peak_bytes)) for s, t in runs.items()}
    ref = plans.get("dp", plans["dp2"])
    lin = plans["linear"]
    out["linear_vs_dp"] = dict(
        reference=ref.solver, same_plan=lin.checkpoints == ref.checkpoints,
        peak_difference_bytes=int(lin.peak_bytes - ref.peak_bytes),
        peak_difference_pct=100.0 * (lin.peak_bytes - ref.peak_bytes) / ref.peak_bytes,
    )
    out["dp_equals_dp2_peak"] = "dp" not in plans or plans["dp"].peak_bytes == plans["dp2"].peak_bytes
    return out


def step_times(modules: dict, model: torch.nn.Module, inputs: tuple, rounds: int, warmup: bool,
               device: str) -> dict:
    """Wall time of one training step per module: median over interleaved rounds (A, B, A, B...)."""
    snap = buffers_snapshot(model)
    times: dict = {k: [] for k in modules}
    for r in range(rounds + int(warmup)):
        for k, m in modules.items():
            zero_grads(model)
            sync(device)
            t0 = time.perf_counter()
            train_step(m, inputs)
            sync(device)
            dt = time.perf_counter() - t0
            if r >= int(warmup):
                times[k].append(dt)
    zero_grads(model)
    buffers_restore(model, snap)
    return {k: dict(median_seconds=statistics.median(v), seconds=v) for k, v in times.items()}


def run_model(cfg: ModelConfig, device: str, how: str, timing_rounds: int, solver_repeats: int) -> dict:
    """Table 1, 2 and 3 figures for one model."""
    t0 = time.perf_counter()
    model, inputs, tm = load(cfg, device)
    costs = tm.costs
    plans = make_plans(costs, STRATEGIES)
    distinct: dict[tuple, str] = {}
    for s, p in plans.items():
        distinct.setdefault(p.checkpoints, s)
    modules = {cps: apply_plan(model, tm, plans[s]) for cps, s in distinct.items()}
    measured = {cps: measure(m, inputs, how) for cps, m in modules.items()}
    static, grads = int(costs.static), int(tm.param_bytes)
    none_meas = measured[plans["none"].checkpoints]
    none_pred = int(plans["none"].peak_bytes)
    rows = {}
    for s, p in plans.items():
        meas = measured[p.checkpoints]
        sim = simulate(costs, p.checkpoints)
        rows[s] = dict(
            checkpoints=list(p.checkpoints), segments=len(p.checkpoints) + 1,
            same_plan_as=distinct[p.checkpoints] if distinct[p.checkpoints] != s else None,
            predicted_bytes=int(p.peak_bytes), measured_bytes=meas,
            prediction_error_bytes=int(p.peak_bytes) - meas,
            reduction_vs_none_measured=1 - meas / none_meas,
            reduction_vs_none_predicted=1 - p.peak_bytes / none_pred,
            activation_bytes_measured=meas - static - grads,
            activation_reduction_vs_none_measured=1 - (meas - static - grads) / (none_meas - static - grads),
            peak_phase=sim.phase, peak_layer=sim.layer, peak_layer_name=tm.layers[sim.layer].name,
        )
    log(f"  {cfg.label}: n={tm.n}, " + ", ".join(
        f"{s} {rows[s]['measured_bytes'] / 2**20:.1f}" for s in plans) + f" MiB measured ({how})")
    solvers = solver_costs(costs, solver_repeats)
    timing = None
    if timing_rounds:
        t = step_times(modules, model, inputs, timing_rounds, warmup=(how != "real"), device=device)
        base = t[plans["none"].checkpoints]["median_seconds"]
        timing = {s: dict(**t[p.checkpoints], ratio_vs_none=t[p.checkpoints]["median_seconds"] / base)
                  for s, p in plans.items()}
        log(f"  {cfg.label}: step time / none: " + ", ".join(
            f"{s} {v['ratio_vs_none']:.2f}" for s, v in timing.items()))
    res = dict(
        label=cfg.label, model=cfg.zoo_name, kind=cfg.kind, sizes=cfg.kwargs, size_text=cfg.describe(),
        n=tm.n, param_bytes=int(tm.param_bytes), buffer_bytes=int(tm.buffer_bytes),
        input_bytes=int(tm.input_bytes), static_bytes=static, param_grad_bytes=grads,
        measured_with=how, strategies=rows, solvers=solvers, timing=timing,
        seconds=time.perf_counter() - t0,
    )
    del modules, model, inputs, tm
    free(device)
    return res


# --------------------------------------------------------------------------
# figure (a): memory timeline
# --------------------------------------------------------------------------
def _anchor_modules(tm) -> dict[int, str]:
    """For each layer, the first submodule it calls (a hook there marks the layer's start)."""
    targets = {n.name: n.target for n in tm.gm.graph.nodes if n.op == "call_module"}
    out = {}
    for layer in tm.layers:
        first = next((targets[nm] for nm in layer.nodes if nm in targets), None)
        if first is not None and first not in out.values():
            out[layer.index] = first
    return out


def tracked_step(module: torch.nn.Module, inputs: tuple, anchors: dict[int, str], how: str) -> dict:
    """One training step under a StorageTracker(timeline=True), with layer-start marks.

    A forward pre-hook on each layer's first submodule records the operator
    index at which the layer starts, in the forward and (inside backward) in
    the recomputation.
    """
    fake_mode = None
    if how == "fake":
        from torch._dynamo.utils import deepcopy_to_fake_tensor
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
        module = deepcopy_to_fake_tensor(module, fake_mode)
        inputs = tuple(fake_mode.from_tensor(x) for x in inputs)
    zero_grads(module)
    snap = buffers_snapshot(module)
    tracker = StorageTracker(timeline=True, fake=(how == "fake"))
    marks: list[tuple[int, int, bool]] = []

    def hook_for(layer: int) -> Callable:
        def hook(mod, args):
            marks.append((len(tracker.timeline), layer, torch._C._current_graph_task_id() != -1))
        return hook

    handles = [module.get_submodule(name).register_forward_pre_hook(hook_for(i)) for i, name in anchors.items()]
    try:
        ctx = fake_mode if fake_mode is not None else torch.enable_grad()
        with ctx, torch.enable_grad():
            tracker.register(module, inputs)
            with tracker:
                out = module(*inputs)
                loss = out.float().pow(2).mean()
                del out
                forward_ops = len(tracker.timeline)
                loss.backward()
                del loss
        tl = [int(b) for _, _, b in tracker.timeline]
        return dict(bytes=tl, forward_ops=forward_ops, peak=int(tracker.peak_bytes), marks=marks)
    finally:
        for h in handles:
            h.remove()
        tracker.detach()
        zero_grads(module)
        if fake_mode is None:
            buffers_restore(module, snap)


def _fill(starts: dict[int, float], layers: list[int], lo: float, hi: float, widths: dict[int, float]) -> dict:
    """Start position of every layer in ``layers`` (in run order) between lo and hi.

    Anchored layers keep their measured start; the others are spread between
    the neighbouring anchors in proportion to ``widths``.
    """
    pos: dict[int, float] = {}
    known = [(j, starts[L]) for j, L in enumerate(layers) if L in starts]
    known = [(-1, lo)] + known + [(len(layers), hi)]
    for (j0, x0), (j1, x1) in zip(known, known[1:]):
        if j0 >= 0:
            pos[layers[j0]] = x0
        inner = layers[j0 + 1:j1]
        total = sum(widths[L] for L in inner) + (widths[layers[j0]] if j0 >= 0 else 0)
        x = x0 + (widths[layers[j0]] if j0 >= 0 else 0) * (x1 - x0) / max(total, 1e-12)
        for L in inner:
            pos[L] = x
            x += widths[L] * (x1 - x0) / max(total, 1e-12)
    return pos


def place_events(events, run: dict, n: int) -> list[tuple[float, float]]:
    """(x0, x1) in measured-operator units for every predicted event.

    Forward layers start where their hook fired; recomputed layers where their
    hook fired inside backward. Layers without a hook (the loss, a flatten)
    and every backward layer are spread over the operators between anchors in
    proportion to the number of operators each layer ran in the forward.
    """
    total, F = len(run["bytes"]), run["forward_ops"]
    fwd_marks: dict[int, float] = {}
    rec_marks: dict[int, float] = {}
    for x, L, in_backward in run["marks"]:
        (rec_marks if in_backward else fwd_marks).setdefault(L, float(x))
    layers = list(range(n))
    last = 0.0
    for L in layers:  # keep the anchors in run order and inside the forward
        if L in fwd_marks:
            last = fwd_marks[L] = min(max(fwd_marks[L], last), float(F))
    fwd_start = _fill(fwd_marks, layers, 0.0, float(F), {L: 1.0 for L in layers})
    ends = [fwd_start[L + 1] if L + 1 < n else float(F) for L in layers]
    width = {L: max(ends[L] - fwd_start[L], 1.0) for L in layers}
    items = [j for j, e in enumerate(events) if e.phase != "forward"]
    anchors: dict[int, float] = {}
    last = float(F)
    for j in items:
        e = events[j]
        if e.phase == "recompute" and e.layer in rec_marks:
            last = anchors[j] = min(max(rec_marks[e.layer], last), float(total))
    pos = _fill(anchors, items, float(F), float(total), {j: width[events[j].layer] for j in items})
    out = []
    for j, e in enumerate(events):
        if e.phase == "forward":
            out.append((fwd_start[e.layer], ends[e.layer]))
        else:
            k = items.index(j)
            out.append((pos[j], pos[items[k + 1]] if k + 1 < len(items) else float(total)))
    return out


def timeline(cfg: ModelConfig, device: str, how: str) -> dict:
    """Measured and predicted memory timeline of one step for no checkpointing, sqrt and the optimum."""
    model, inputs, tm = load(cfg, device)
    plans = make_plans(tm.costs, TIMELINE_PLANS)
    anchors = _anchor_modules(tm)
    out = dict(label=cfg.label, model=cfg.zoo_name, sizes=cfg.kwargs, size_text=cfg.describe(), n=tm.n,
               measured_with=how, static_bytes=int(tm.costs.static), plans={})
    for s, p in plans.items():
        module = apply_plan(model, tm, p)
        run = tracked_step(module, inputs, anchors, how)
        events = simulate_timeline(tm.costs, p.checkpoints)
        xs = place_events(events, run, tm.n)
        total = len(run["bytes"])
        out["plans"][s] = dict(
            checkpoints=list(p.checkpoints), predicted_peak=int(p.peak_bytes), measured_peak=run["peak"],
            measured_bytes=run["bytes"], forward_ops=run["forward_ops"], total_ops=total,
            predicted=[dict(phase=e.phase, layer=e.layer, segment=e.segment, bytes=int(e.bytes),
                            x0=x0 / total, x1=x1 / total) for e, (x0, x1) in zip(events, xs)],
        )
        log(f"  timeline {cfg.label} {s}: {total} ops, peak measured {run['peak'] / 2**20:.1f} MiB, "
            f"predicted {p.peak_bytes / 2**20:.1f} MiB")
        del module
    del model, inputs, tm
    free(device)
    return out


# --------------------------------------------------------------------------
# figure (b): peak against batch size
# --------------------------------------------------------------------------
def batch_sweep(model_name: str, kwargs: dict, batches, device: str, how: str) -> dict:
    """Predicted and measured peak of every strategy at each batch size."""
    cfg = ModelConfig(model_name, model_name, dict(kwargs))
    rows = []
    for b in batches:
        model, inputs, tm = load(cfg, device, batch_size=b)
        plans = make_plans(tm.costs, STRATEGIES)
        cache: dict[tuple, int] = {}
        row = dict(batch_size=b, n=tm.n, static_bytes=int(tm.costs.static), param_grad_bytes=int(tm.param_bytes),
                   strategies={})
        for s, p in plans.items():
            if p.checkpoints not in cache:
                cache[p.checkpoints] = measure(apply_plan(model, tm, p), inputs, how)
            row["strategies"][s] = dict(checkpoints=list(p.checkpoints), predicted_bytes=int(p.peak_bytes),
                                        measured_bytes=cache[p.checkpoints])
        rows.append(row)
        log(f"  sweep {model_name} batch {b}: " + ", ".join(
            f"{s} {v['measured_bytes'] / 2**20:.1f}" for s, v in row["strategies"].items()) + " MiB")
        del model, inputs, tm
        free(device)
    return dict(model=model_name, sizes=kwargs, measured_with=how, rows=rows)


# --------------------------------------------------------------------------
# figure (c): solver time against n
# --------------------------------------------------------------------------
def random_instance(n: int, seed: int) -> ChainCosts:
    """The random additive instance of benchmarks/solver_scaling.py (same generator, same seed)."""
    rng = np.random.default_rng(seed)
    return ChainCosts.additive(rng.integers(0, 1 << 20, n), rng.integers(0, 1 << 20, n),
                               rng.integers(0, 1 << 24, n))


def fit_slope(ns, ts) -> float:
    return float(np.polyfit(np.log(ns), np.log(ts), 1)[0])


def solver_scaling(sizes: dict, repeats: int) -> dict:
    """Median solve time of each solver at each n (interleaved on one instance per n)."""
    solve(random_instance(5, 0), "dp")  # compile / load the kernels first
    all_n = sorted({n for v in sizes.values() for n in v})
    times: dict[str, dict[int, float]] = {s: {} for s in sizes}
    disagree = []
    for n in all_n:
        c = random_instance(n, seed=n)
        runs = {s: [] for s in sizes if n in sizes[s]}
        peaks = {}
        for _ in range(repeats):
            for s in runs:
                p = solve(c, s)
                runs[s].append(p.solve_seconds)
                peaks[s] = int(p.peak_bytes)
        for s, ts in runs.items():
            times[s][n] = statistics.median(ts)
        if len(set(peaks.values())) > 1:
            disagree.append(dict(n=n, peaks=peaks))
        log(f"  scaling n={n}: " + "  ".join(f"{s} {times[s][n]:.3g}s" for s in runs))
    slopes = {s: fit_slope(sorted(v), [v[k] for k in sorted(v)]) if len(v) > 1 else None for s, v in times.items()}
    return dict(seconds={s: {str(n): t for n, t in v.items()} for s, v in times.items()}, slopes=slopes,
                repeats=repeats, solvers_disagree=disagree,
                instance="ChainCosts.additive(w, h, q), w, h ~ U[0, 2^20), q ~ U[0, 2^24), seed n")


def as_json(obj: Any) -> Any:
    """Make numpy scalars and tuple keys JSON-friendly."""
    if isinstance(obj, dict):
        return {str(k): as_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_json(v) for v in obj]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    return obj
