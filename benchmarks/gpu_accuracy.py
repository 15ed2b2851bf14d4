"""Predicted against measured peak on a device, before and after calibration; max-batch under a cap.

Issue 14's targets, for a machine with a GPU (``--device cuda``; ``--small`` runs the
same code at CPU sizes, where there is no allocator and both predictions are exact):

1. **Peaks.** For each model at the sizes of ``../shared/GPU_MEASUREMENTS.md`` and each
   plan (the default, ``sqrt``, ``every``, no checkpointing): the predicted peak of the
   traced cost model (tensors only) and of the calibrated one (plus operator scratch and
   the libraries' workspace, :mod:`ckptopt.calibration`) against
   ``torch.cuda.max_memory_allocated`` of one training step after a warm-up step. The
   default plan is solved on the calibrated costs.
2. **Max batch.** ``max_batch(model, x, --memory, optimizer="adam")`` with the default
   headroom, then 3 real Adam steps at each answer under
   ``torch.cuda.set_per_process_memory_fraction(memory / total)``: fits or OOM.

Every case runs in a fresh process (leftover tensors and allocator state of an earlier
case would inflate ``max_memory_allocated``). Writes
``benchmarks/results/gpu_accuracy/latest.json`` (``--small``: ``latest-small.json``) and prints
Markdown tables.

    python -m benchmarks.gpu_accuracy --device cuda
    python -m benchmarks.gpu_accuracy --device cuda --models resnet50 gpt --no-max-batch
    python -m benchmarks.gpu_accuracy --small        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.harness import child_args, child_env, child_record, result_path, run_child, write_json

#: model -> (load spec, keyword arguments) at the sizes GPU_MEASUREMENTS.md measured
GPU_SIZES = {
    "resnet50": ("resnet50", dict(batch_size=64, input_size=224)),
    "resnet152": ("resnet152", dict(batch_size=32, input_size=224)),
    "densenet121": ("densenet121", dict(batch_size=64, input_size=224)),
    "vgg16": ("vgg16", dict(batch_size=32, input_size=224)),
    "mobilenet_v2": ("mobilenet_v2", dict(batch_size=128, input_size=224)),
    "unet": ("unet", dict(batch_size=8, input_size=256)),
    "gpt": ("gpt", dict(batch_size=8, depth=12, width=768, heads=12, seq_len=1024, vocab=50257)),
    "mlp": ("mlp", dict(batch_size=4096)),
    "hf-gpt2": ("hf:GPT2LMHeadModel", dict(batch_size=8, seq_len=1024, config=dict(n_layer=12, n_embd=768, n_head=12))),
    "hf-llama": ("hf:LlamaForCausalLM", dict(batch_size=8, seq_len=1024, config=dict(
        num_hidden_layers=12, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000))),
    "hf-bert": ("hf:BertForMaskedLM", dict(batch_size=8, seq_len=1024, config=dict(
        num_hidden_layers=12, hidden_size=768, num_attention_heads=12, max_position_embeddings=1024))),
}
SMALL_SIZES = {
    "resnet50": ("resnet50", dict(batch_size=2, input_size=32)),
    "unet": ("unet", dict(batch_size=1, input_size=32)),
    "gpt": ("gpt", dict(batch_size=2, depth=2, width=64, heads=2, seq_len=32, vocab=128)),
    "mlp": ("mlp", dict(batch_size=64, width=128, depth=4)),
}
#: max-batch checks: model -> (load spec, keyword arguments of one example batch)
MAX_BATCH = {
    "resnet50": ("resnet50", dict(batch_size=8, input_size=224)),
    "gpt": ("gpt", dict(batch_size=2, depth=12, width=768, heads=12, seq_len=512, vocab=50257)),
}
SMALL_MAX_BATCH = {"mlp": ("mlp", dict(batch_size=64, width=128, depth=4))}
PLANS = ("default", "sqrt", "every", "none")


# --------------------------------------------------------------------------
# one case, in its own process
# --------------------------------------------------------------------------
def _load(spec: str, kw: dict, device: str):
    import torch

    from ckptopt import zoo

    kw = dict(kw)
    if spec.startswith("hf:"):
        from ckptopt.zoo.hf import get_hf

        model, batch = get_hf(spec, kw.pop("batch_size"), kw.pop("seq_len"), kw.pop("config"))
        return model.to(device), {k: v.to(device) for k, v in batch.items()}, None
    model, inputs = zoo.get(spec, device=device, **kw)
    loss = lambda out: out.float().pow(2).mean()  # noqa: E731  as in GPU_MEASUREMENTS.md
    return model.train(), tuple(t.to(device) for t in inputs), loss


def peak_case(spec: str, kw: dict, plan_name: str, device: str) -> dict:
    from ckptopt import apply_plan, simulate, solve, trace
    from ckptopt.calibration import calibrate
    from ckptopt.measure import measure_peak_detailed

    model, inputs, loss = _load(spec, kw, device)
    t0 = time.perf_counter()
    tm = trace(model, inputs, loss_fn=loss)
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cal = calibrate(model, tm, inputs)
    cal_s = time.perf_counter() - t0
    costs = cal.apply(tm.costs)
    if plan_name == "none":
        cps, st = (), ()
    elif plan_name == "default":
        plan = solve(costs, "auto")
        cps, st = plan.checkpoints, plan.stored
    else:
        plan = solve(tm.costs, plan_name)
        cps, st = plan.checkpoints, plan.stored
    module = apply_plan(model, tm, _plan(tm.n, cps, st)) if cps else model
    measure_peak_detailed(module, inputs, loss)  # warm-up step: lazy library state, as in training
    m = measure_peak_detailed(module, inputs, loss)
    before = simulate(tm.costs, cps, st).peak_bytes
    after = simulate(costs, cps, st).peak_bytes
    return dict(plan=plan_name, checkpoints=list(cps), stored=list(st), predicted_tensors=before,
                predicted_calibrated=after, measured=m.peak_bytes, reserved=m.reserved_bytes,
                error_tensors=before / m.peak_bytes - 1, error_calibrated=after / m.peak_bytes - 1,
                workspace_bytes=cal.workspace_bytes, layers_measured=cal.measured, n=tm.n,
                trace_seconds=trace_s, calibration_seconds=cal_s)


def _plan(n: int, cps, st):
    from ckptopt import Plan

    return Plan(tuple(cps), 0, "given", 0.0, n, tuple(st))


def max_batch_case(spec: str, kw: dict, memory: str, device: str, keep_output: bool = False) -> dict:
    from ckptopt.planning import max_batch

    model, inputs, loss = _load(spec, kw, device)
    t0 = time.perf_counter()
    mb = max_batch(model, inputs, memory, optimizer="adam", device=device, loss_fn=loss, keep_output=keep_output)
    return dict(result=mb.to_dict(), seconds=time.perf_counter() - t0)


def _loss_of(module, x, loss):
    """The step's loss; the model's output is not kept (the step ckptopt models)."""
    out = module(*x) if isinstance(x, tuple) else module(**x)
    return loss(out) if loss else out.loss


def cap_memory(device: str, memory_bytes: int) -> None:
    """Let this process's caching allocator reserve at most ``memory_bytes`` on ``device`` (CUDA)."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # (the call refuses a bare "cuda")
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, memory_bytes / total), index)


def train_case(spec: str, kw: dict, batch: int, cps, st, memory_bytes: int, device: str,
               keep_output: bool = False) -> dict:
    import torch

    from ckptopt import apply_plan, trace
    from ckptopt.planning import with_batch

    model, inputs, loss = _load(spec, kw, device)
    x = with_batch(inputs, batch, kw["batch_size"])
    if device.startswith("cuda"):
        cap_memory(device, memory_bytes)
    if cps:
        tm = trace(model, x, loss_fn=loss)
        module = apply_plan(model, tm, _plan(tm.n, cps, st))
    else:
        module = model
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    out = None
    try:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            if keep_output:  # the loop max_batch(keep_output=True) plans for
                out = module(*x) if isinstance(x, tuple) else module(**x)
                (loss(out) if loss else out.loss).backward()
            else:  # the modelled step: the output dies with the loss (RESULTS "Max batch on CUDA")
                _loss_of(module, x, loss).backward()
            opt.step()
        del out
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            return dict(fits=True, allocated=int(torch.cuda.max_memory_allocated()),
                        reserved=int(torch.cuda.max_memory_reserved()))
        return dict(fits=True)
    except torch.OutOfMemoryError as exc:
        return dict(fits=False, error=str(exc).splitlines()[0][:200])


# --------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------
def _child(payload: dict, timeout: int = 900) -> dict:
    """One case in a fresh process (``src/`` first on the path): its record, or why there is none."""
    child = run_child("benchmarks.gpu_accuracy", [json.dumps(payload)], timeout=timeout, env=child_env(src_first=True))
    if child.record is None:
        return dict(error=child.failure, output_tail=child.output[-500:])
    return child.record


def _run_child(payload: dict) -> dict:
    kind = payload["kind"]
    if kind == "peak":
        return peak_case(payload["spec"], payload["kw"], payload["plan"], payload["device"])
    if kind == "max_batch":
        return max_batch_case(payload["spec"], payload["kw"], payload["memory"], payload["device"],
                              payload.get("keep_output", False))
    return train_case(payload["spec"], payload["kw"], payload["batch"], payload["checkpoints"], payload["stored"],
                      payload["memory_bytes"], payload["device"], payload.get("keep_output", False))


def _write(results: dict, path: str) -> None:
    write_json(path, results)


def main(argv=None) -> int:
    child = child_args(argv)
    if child:
        path, (payload,) = child
        child_record(path, _run_child, json.loads(payload))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="CPU sizes (a smoke run of the same code)")
    ap.add_argument("--models", nargs="+", help="subset of the peak models")
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    ap.add_argument("--memory", help="the cap of the max-batch checks (default 8GiB; 64MiB with --small)")
    ap.add_argument("--no-max-batch", action="store_true")
    ap.add_argument("--keep-output", action="store_true",
                    help="max batch for, and trained with, a loop that keeps the model's output (keep_output=True)")
    ap.add_argument("--no-peaks", action="store_true")
    ap.add_argument("--out", help="the JSON written after every case (default "
                    "benchmarks/results/gpu_accuracy/latest.json; latest-small.json with --small)")
    args = ap.parse_args(argv)
    device = "cpu" if args.small else args.device
    args.memory = args.memory or ("64MiB" if args.small else "8GiB")
    sizes = SMALL_SIZES if args.small else GPU_SIZES
    models = args.models or list(sizes)
    from benchmarks.harness import run_metadata

    results = dict(meta=run_metadata("gpu_accuracy", device), device=device, peaks={}, max_batch={})
    path = args.out or result_path("gpu_accuracy", "small" if args.small else None)
    if not args.no_peaks:
        for name in models:
            spec, kw = sizes[name]
            rows = results["peaks"][name] = []
            for plan in args.plans:
                r = _child(dict(kind="peak", spec=spec, kw=kw, plan=plan, device=device))
                rows.append({"plan": plan, **r})
                print(name, plan, {k: r.get(k) for k in ("predicted_tensors", "predicted_calibrated", "measured",
                                                          "error")}, flush=True)
                _write(results, path)
    if not args.no_max_batch:
        from ckptopt.units import parse_bytes

        memory = parse_bytes(args.memory)
        for name, (spec, kw) in (SMALL_MAX_BATCH if args.small else MAX_BATCH).items():
            mb = _child(dict(kind="max_batch", spec=spec, kw=kw, memory=args.memory, device=device,
                             keep_output=args.keep_output))
            entry = results["max_batch"][name] = dict(search=mb, runs=[])
            if "result" not in mb:
                print(name, "max_batch failed:", mb, flush=True)
                continue
            for strategy in ("no_checkpointing", "optimal"):
                fit = mb["result"][strategy]
                if not fit["batch"]:
                    continue
                run = _child(dict(kind="train", spec=spec, kw=kw, batch=fit["batch"], checkpoints=fit["checkpoints"],
                                  stored=fit["stored"], memory_bytes=memory, device=device,
                                  keep_output=args.keep_output))
                entry["runs"].append(dict(strategy=strategy, batch=fit["batch"], predicted=fit["peak_bytes"], **run))
                print(name, strategy, fit["batch"], run, flush=True)
    _write(results, path)
    print("| model | plan | predicted (tensors) | predicted (calibrated) | measured | error before | error after |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results["peaks"].items():
        for r in rows:
            if "measured" not in r:
                print(f"| {name} | {r['plan']} | failed: {r.get('error')} | | | | |")
                continue
            print(f"| {name} | {r['plan']} | {r['predicted_tensors']:,} | {r['predicted_calibrated']:,} "
                  f"| {r['measured']:,} | {100 * r['error_tensors']:+.2f}% | {100 * r['error_calibrated']:+.2f}% |")
    for name, entry in results["max_batch"].items():
        for run in entry["runs"]:
            print(f"max-batch {name} {run['strategy']}: batch {run['batch']} "
                  f"{'fits' if run.get('fits') else 'OOM'} under {args.memory}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
