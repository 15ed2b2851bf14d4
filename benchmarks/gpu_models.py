"""The HF families and diffusers models on a GPU: ckptopt, calibrated and not, against the peers' checkpointing.

The eight models of ``hf_families.py`` (T5, BART, Whisper, CLIP, GPT-NeoX) and
``diffusers_models.py`` (UNet2DConditionModel, AutoencoderKL, SD3Transformer2DModel), built
and batched exactly as those scripts build them (same configs, seeds and batches; the
transformers models' own ``.loss``, the diffusers models' ``out.sample.float().pow(2).mean()``),
moved to ``--device``. Four ways to train each, every one in a fresh process (leftover
tensors and allocator state of an earlier case would inflate ``max_memory_allocated``):

* ``none``: the model as it is;
* ``peer``: transformers' ``activation_checkpointing_enable`` (non-reentrant) or diffusers'
  ``enable_gradient_checkpointing()``;
* ``ckptopt``: ``optimize_checkpoints(model, batch)``, default arguments (on CUDA this
  calibrates: library workspaces and allocator scratch join the prediction,
  :mod:`ckptopt.calibration`);
* ``ckptopt-tensors``: the same with ``calibrate=False`` (the tensor model alone).

For the ckptopt ways on CUDA, also what planning itself took on the device above the model
and its batch (peak, and what stayed allocated after it).

Per case: one warm-up step (lazy library state, as in training), then the peak of one step
(``measure_peak_detailed``: ``torch.cuda.max_memory_allocated`` and ``..._reserved`` on
CUDA), the median seconds of three more steps, and for the ckptopt ways the prediction,
its error (``prediction_error``: predicted / measured - 1), the plan, and one step against a fresh unmodified
build (same seed right before each forward): loss and every gradient (max absolute
difference; CUDA kernels need not be bit-reproducible, so "identical" is reported, not
required).

``--batch-scale K`` multiplies every model's batch by ``K`` (the benchmarks' small batches
leave the libraries' fixed workspace a large share of a CUDA peak).

``--jobs`` cases run at once (memory figures are per process; calibration's timings, which
only price recomputation, share the GPU with the other cases). Writes ``--out`` (default
``benchmarks/results/gpu_models/latest-<device>[-x<K>].json``, ``<device>`` as
:func:`benchmarks.harness.device_label` names it, e.g. ``h200``) after every case and prints a table.

    python -m benchmarks.gpu_models --device cuda --jobs 6
    python -m benchmarks.gpu_models --device cpu --only GPTNeoXForCausalLM --jobs 2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks import diffusers_models, hf_families  # noqa: E402 (after the offline settings)
from benchmarks.harness import (child_args, child_env, child_record, device_label, hf_checkpointing_enable,  # noqa: E402
                                result_path, run_child, run_metadata, same_training, shapes, to_device, write_json)

WAYS = ("none", "peer", "ckptopt", "ckptopt-tensors")
MODELS = {**{n: hf_families for n in hf_families.CONFIGS}, **{n: diffusers_models for n in diffusers_models.CONFIGS}}


def _loss_fn(name: str):
    return diffusers_models.loss_fn if MODELS[name] is diffusers_models else None


def _one_step(module, batch: dict, loss_fn, seed: int = 1234):
    """One timed training step (gradients left in place)."""
    import torch

    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(**batch)
    loss = loss_fn(out) if loss_fn else out.loss
    loss.backward()
    return loss.detach()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _default_batch(suite, name: str) -> int:
    """The leading dimension of the model's default batch."""
    return next(v.shape[0] for v in suite.make_batch(name).values() if hasattr(v, "shape") and v.dim())


def run_case(name: str, way: str, device: str, scale: int = 1) -> dict:
    import torch

    from ckptopt import optimize_checkpoints
    from ckptopt.measure import measure_peak_detailed

    suite, loss_fn = MODELS[name], _loss_fn(name)
    rec: dict = dict(model=name, way=way, device=device)
    t0 = time.perf_counter()
    model = suite.build_model(name).to(device)
    batch = to_device(suite.make_batch(name, _default_batch(suite, name) * scale) if scale != 1
                      else suite.make_batch(name), device)
    rec["batch"] = shapes(batch, tensors_only=True)
    module = model
    if way == "peer":
        if suite is hf_families:
            hf_checkpointing_enable(model)
        else:
            model.enable_gradient_checkpointing()
    elif way in ("ckptopt", "ckptopt-tensors"):
        t = time.perf_counter()
        if device.startswith("cuda"):  # what planning itself takes on the device, above the model and batch
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        module = optimize_checkpoints(model, batch, loss_fn=loss_fn, calibrate=None if way == "ckptopt" else False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            rec.update(planning_peak_above_model_bytes=int(torch.cuda.max_memory_allocated() - held),
                       planning_left_allocated_bytes=int(torch.cuda.memory_allocated() - held))
        cal = module.traced.calibration
        rec.update(plan_seconds=round(time.perf_counter() - t, 2), predicted_peak_bytes=int(module.predicted_peak_bytes),
                   checkpoints=list(module.plan.checkpoints), stored=list(module.plan.stored),
                   solver=module.plan.solver, layers=module.traced.n, calibrated=cal is not None,
                   workspace_bytes=cal.workspace_bytes if cal is not None else None,
                   layers_calibrated=cal.measured if cal is not None else None)
    elif way != "none":
        raise ValueError(way)
    measure_peak_detailed(module, batch, loss_fn)  # warm-up step
    m = measure_peak_detailed(module, batch, loss_fn)
    rec.update(measured_peak_bytes=int(m.peak_bytes),
               reserved_bytes=int(m.reserved_bytes) if m.reserved_bytes is not None else None)
    if "predicted_peak_bytes" in rec:
        rec["prediction_error"] = rec["predicted_peak_bytes"] / rec["measured_peak_bytes"] - 1
    times = []
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        _one_step(module, batch, loss_fn)
        _sync(device)
        times.append(time.perf_counter() - t)
    module.zero_grad(set_to_none=True)
    rec["step_seconds"] = statistics.median(times)
    if way.startswith("ckptopt"):
        rec["same_training"] = same_training(module, MODELS[name].build_model(name).to(device), batch, loss_fn)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    rec["torch"] = torch.__version__
    return rec


def run_isolated(name: str, way: str, device: str, timeout: float, scale: int = 1) -> dict:
    """One case in a fresh process (``src/`` first on the path, two threads unless set)."""
    child = run_child("benchmarks.gpu_models", [name, way, device, scale], timeout=timeout,
                      env=child_env(threads="?2", src_first=True))
    rec = child.record if child.record is not None else dict(model=name, way=way, error=child.failure,
                                                             output_tail=child.output)
    rec["wall_seconds"] = round(child.seconds, 2)
    return rec


def _table(cases: dict) -> str:
    mib = 2.0 ** 20

    def m(c):
        return f"{c['measured_peak_bytes'] / mib:.1f}" if c and "measured_peak_bytes" in c else "error"

    def err(c):
        return f"{100 * c['prediction_error']:+.2f}%" if c and c.get("prediction_error") is not None else "–"

    lines = ["| model | none MiB | peer MiB | ckptopt MiB | ckptopt/peer | error calibrated | tensors-only MiB "
             "| error tensors-only | steps s (none / peer / ckptopt) | grad max diff |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in MODELS:
        c = {w: cases.get((name, w)) for w in WAYS}
        if not any(c.values()):
            continue
        ck, peer = c["ckptopt"], c["peer"]
        ratio = (f"×{ck['measured_peak_bytes'] / peer['measured_peak_bytes']:.3f}"
                 if ck and peer and "measured_peak_bytes" in ck and "measured_peak_bytes" in peer else "–")
        st = " / ".join(f"{c[w]['step_seconds']:.3f}" if c[w] and "step_seconds" in c[w] else "–"
                        for w in ("none", "peer", "ckptopt"))
        diff = (f"{ck['same_training']['grad_max_abs_diff']:.2e}" if ck and "same_training" in ck else "–")
        lines.append(f"| {name} | {m(c['none'])} | {m(peer)} | {m(ck)} | {ratio} | {err(ck)} "
                     f"| {m(c['ckptopt-tensors'])} | {err(c['ckptopt-tensors'])} | {st} | {diff} |")
    return "\n".join(lines)


def main() -> None:
    child = child_args()
    if child:
        path, (name, way, device, scale) = child
        warnings.filterwarnings("ignore")
        child_record(path, run_case, name, way, device, int(scale), model=name, way=way)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", help="comma-separated class names: " + ",".join(MODELS))
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per case (default 600)")
    ap.add_argument("--batch-scale", type=int, default=1, help="multiply every model's batch (default 1)")
    ap.add_argument("--out", help="default benchmarks/results/gpu_models/latest-<device>[-x<K>].json")
    args = ap.parse_args()
    args.out = args.out or result_path(
        "gpu_models", device_label(args.device) + (f"-x{args.batch_scale}" if args.batch_scale != 1 else ""))

    names = args.only.split(",") if args.only else list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    ways = args.ways.split(",")
    # the ckptopt cases take longest: start them first
    todo = sorted(((n, w) for n in names for w in ways), key=lambda nw: (not nw[1].startswith("ckptopt"),))
    meta = run_metadata("gpu_models", args.device)
    meta["batch_scale"] = args.batch_scale
    try:
        import torch

        if args.device.startswith("cuda"):
            meta["gpu"] = torch.cuda.get_device_name()
        import diffusers
        import transformers

        meta.update(transformers=transformers.__version__, diffusers=diffusers.__version__)
    except Exception as exc:  # noqa: BLE001 - metadata only
        meta["versions_error"] = repr(exc)
    cases: dict = {}
    lock = threading.Lock()

    def one(nw):
        rec = run_isolated(*nw, args.device, args.timeout, args.batch_scale)
        with lock:
            cases[nw] = rec
            shown = (f"{rec['measured_peak_bytes']:,} B" if "measured_peak_bytes" in rec
                     else f"ERROR {rec.get('error', '')[:300]}")
            if rec.get("prediction_error") is not None:
                shown += f" predicted {rec['predicted_peak_bytes']:,} ({100 * rec['prediction_error']:+.2f}%)"
            print(f"{nw[0]} {nw[1]}: {shown} [{rec['wall_seconds']:.0f} s]", flush=True)
            write_json(args.out, dict(meta=meta, cases=[cases[k] for k in sorted(cases)]))

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, todo))
    print(_table(cases))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
