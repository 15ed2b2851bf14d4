"""Where a CUDA step's allocated bytes part from the tensor model: op by op, allocator against tracker.

For each case (a model of ``gpu_models.py`` or ``gpu_accuracy.py``, a plan), in a fresh
process: ``optimize_checkpoints(model, batch, calibrate=False)`` (plan ``ckptopt``: the tensor
model's plan and prediction), ``optimize_checkpoints(model, batch)`` (plan ``calibrated``: the
default; the calibration's per-layer scratch and both predicted timelines are written too) or
the model unmodified (plan ``none``), one warm-up step, then one step under
two dispatch modes: ckptopt's exact :class:`~ckptopt.tracker.StorageTracker` (live tensor
storages) and a mode that reads, around every ATen op, ``torch.cuda.memory_allocated`` before
and after and ``max_memory_allocated`` during it (peak stats reset before each op). So each
op has the allocator's bytes, the allocator's peak inside the op, and the tracker's live
tensor bytes, forward, backward and recomputation alike.

Writes one JSON per case (``--out-dir``): the prediction, the tracker's peak, the
allocated peak, the op where each peaks, the per-op series, and the ops where the
allocator's peak inside an op exceeds the tracker's live bytes most.

    python -m benchmarks.gpu_gap --out-dir /tmp/gap GPTNeoXForCausalLM:ckptopt hf-llama:none

(Its printed report is the record to keep: ``benchmarks/results/gpu_gap/latest-<label>.log``.)
"""

from __future__ import annotations

import argparse

from benchmarks.harness import cases_in_processes, child_args, child_record, to_device


def _load(name: str, device: str, scale: int = 1):
    from benchmarks import gpu_accuracy, gpu_models

    if "@" in name:  # a max-batch model of gpu_accuracy.py at a given batch: "gpt@48"
        from ckptopt.planning import with_batch

        base, batch = name.split("@")
        spec, kw = gpu_accuracy.MAX_BATCH[base]
        model, inputs, loss = gpu_accuracy._load(spec, kw, device)
        return model, with_batch(inputs, int(batch), kw["batch_size"]), loss
    if name in gpu_models.MODELS:
        suite = gpu_models.MODELS[name]
        batch = (suite.make_batch(name, gpu_models._default_batch(suite, name) * scale) if scale != 1
                 else suite.make_batch(name))
        return suite.build_model(name).to(device), to_device(batch, device), gpu_models._loss_fn(name)
    spec, kw = gpu_accuracy.GPU_SIZES[name]
    return gpu_accuracy._load(spec, kw, device)


def _predicted_timelines(module) -> dict:
    """The plan's predicted events, tensors only and (where calibrated) with scratch and workspace,
    and the calibration's per-layer scratch: where the prediction puts the device's extra bytes."""
    from ckptopt import simulate
    from ckptopt.simulator import simulate_timeline

    tm, cps, st = module.traced, module.plan.checkpoints, module.plan.stored
    cal = tm.calibration  # (a calibrated module's costs hold the calibration already)
    tensors = tm.costs if cal is None else _without_calibration(cal, tm.costs)
    out: dict = dict(timeline_tensors=[(e.phase, e.layer, e.bytes) for e in simulate_timeline(tensors, cps, st)])
    sim = simulate(tensors, cps, st)
    out["peak_tensors"] = dict(bytes=sim.peak_bytes, phase=sim.phase, layer=sim.layer)
    if cal is not None:
        out["timeline_calibrated"] = [(e.phase, e.layer, e.bytes) for e in simulate_timeline(tm.costs, cps, st)]
        sim = simulate(tm.costs, cps, st)
        out["peak_calibrated"] = dict(bytes=sim.peak_bytes, phase=sim.phase, layer=sim.layer)
        out.update(workspace_bytes=cal.workspace_bytes, recompute_workspace_bytes=cal.recompute_workspace_bytes,
                   forward_scratch=[c.forward_scratch for c in cal.layers],
                   backward_scratch=[c.backward_scratch for c in cal.layers])
    return out


def _without_calibration(cal, costs):
    """The tensors-only costs under a calibrated model's: ``Calibration.apply``'s bytes taken back."""
    from ckptopt import ChainCosts
    from ckptopt.calibration import _add_scratch

    d = costs.to_dict()
    _add_scratch(d["layers"], cal.layers, -1)
    d["static"] = int(d["static"]) - cal.workspace_bytes - cal.recompute_workspace_bytes
    return ChainCosts.from_dict(d)


def run_case(name: str, plan: str, device: str, scale: int = 1) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ckptopt import optimize_checkpoints
    from ckptopt.measure import measure_peak_detailed
    from ckptopt.tracker import StorageTracker

    cuda = device.startswith("cuda")
    model, batch, loss_fn = _load(name, device, scale)
    rec: dict = dict(model=name, plan=plan, device=device)
    module = model
    if plan.startswith("cps="):  # given checkpoints, on the tensor model's trace
        from ckptopt import Plan, apply_plan, trace

        cps = tuple(int(c) for c in plan[4:].split("+") if c)
        tm = trace(model, batch, loss_fn=loss_fn)
        module = apply_plan(model, tm, Plan(cps, 0, "given", 0.0, tm.n, ()))
        rec.update(checkpoints=list(cps), stored=[], layers=tm.n)
        rec.update(_predicted_timelines(module))
        rec["predicted_peak_bytes"] = rec["peak_tensors"]["bytes"]
    elif plan != "none":
        module = optimize_checkpoints(model, batch, loss_fn=loss_fn, calibrate=plan == "calibrated")
        rec.update(predicted_peak_bytes=int(module.predicted_peak_bytes), checkpoints=list(module.plan.checkpoints),
                   stored=list(module.plan.stored), layers=module.traced.n)
        rec.update(_predicted_timelines(module))
    measure_peak_detailed(module, batch, loss_fn)  # warm-up
    rows: list = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out = func(*args, **(kwargs or {}))
            during = torch.cuda.max_memory_allocated() if cuda else 0
            after = torch.cuda.memory_allocated() if cuda else 0
            rows.append((str(func), before, during, after, tracker.current_bytes))
            return out

    call = module if not isinstance(batch, dict) else None
    module.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    start_alloc = torch.cuda.memory_allocated() if cuda else 0
    tracker = StorageTracker()
    tracker.register(module, batch)  # a container: its non-tensor values (CLIP's return_loss) are skipped
    start_tracked = tracker.current_bytes
    with tracker, Probe():
        out = module(**batch) if call is None else module(*batch)
        loss = loss_fn(out) if loss_fn else out.loss
        del out
        loss.backward()
        del loss
    if cuda:
        torch.cuda.synchronize()
    module.zero_grad(set_to_none=True)
    peak_i = max(range(len(rows)), key=lambda i: rows[i][2])
    tpeak_i = max(range(len(rows)), key=lambda i: rows[i][4])
    gaps = sorted(range(len(rows)), key=lambda i: rows[i][2] - rows[i][4], reverse=True)[:30]
    rec.update(
        start_allocated=start_alloc, start_tracked=start_tracked, tracker_peak_bytes=tracker.peak_bytes,
        allocated_peak_bytes=rows[peak_i][2], allocated_peak_op=[peak_i, *rows[peak_i]],
        tracker_peak_op=[tpeak_i, *rows[tpeak_i]],
        largest_gaps=[[i, *rows[i]] for i in gaps],
        ops=len(rows), series=rows, torch=torch.__version__)
    return rec


def main() -> None:
    child = child_args()
    if child:
        path, (name, plan, device, scale) = child
        child_record(path, run_case, name, plan, device, int(scale), model=name, plan=plan)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="MODEL:PLAN, PLAN 'ckptopt' (the tensor model's plan), 'calibrated' "
                    "(the default, calibrated plan), 'cps=A+B+...' (given checkpoints) or 'none'; MODEL "
                    "'NAME@B' is a max-batch model of gpu_accuracy.py at batch B")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--batch-scale", type=int, default=1, help="a gpu_models.py model's batch times K (default 1)")
    args = ap.parse_args()
    for case, r in cases_in_processes("benchmarks.gpu_gap", args.cases, args.out_dir, "gap", args.device, args.timeout,
                                      (args.batch_scale,)):
        mib = 2 ** 20
        print(f"{case}: predicted {r.get('predicted_peak_bytes', 0) / mib:.1f} tracker {r['tracker_peak_bytes'] / mib:.1f}"
              f" allocated {r['allocated_peak_bytes'] / mib:.1f} MiB; start allocated {r['start_allocated'] / mib:.1f}"
              f" tracked {r['start_tracked'] / mib:.1f}; allocated peak at {r['allocated_peak_op']};"
              f" tracker peak at {r['tracker_peak_op']}", flush=True)
        for g in r["largest_gaps"][:8]:
            print(f"   gap {(g[3] - g[5]) / mib:8.1f} MiB at op {g[0]} {g[1]} (before {g[2] / mib:.1f}, during "
                  f"{g[3] / mib:.1f}, after {g[4] / mib:.1f}, tracked {g[5] / mib:.1f})", flush=True)


if __name__ == "__main__":
    main()
