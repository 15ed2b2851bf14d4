"""diffusers models: ckptopt against diffusers' own ``enable_gradient_checkpointing()`` (issue 19).

Three diffusers models built from config objects (no weights, no network), ``train()`` mode,
``torch.manual_seed(0)`` before each build, at sizes where activations dominate the step:

* ``UNet2DConditionModel``: SD-like, 3 resolutions with ``block_out_channels=(64, 128, 256)``,
  2 ResNets per block, cross-attention in the two upper resolutions (dimension 128, 8 heads),
  64x64 latents of 4 channels, batch 2, 16 text tokens: ``sample`` (2, 4, 64, 64), ``timestep`` (2,),
  ``encoder_hidden_states`` (2, 16, 128);
* ``AutoencoderKL``: SD-like VAE, ``block_out_channels=(64, 128, 256)``, 2 ResNets per block,
  4 latent channels, images 128x128, batch 2: ``sample`` (2, 3, 128, 128) (encode, the posterior's
  mode, decode);
* ``SD3Transformer2DModel``: a DiT (MMDiT) of 4 joint blocks, 4 heads of 32 (width 128), patch 2
  on 64x64 latents of 16 channels (1,024 image tokens), 32 text tokens of 128, pooled 64, batch 2:
  ``hidden_states``, ``encoder_hidden_states``, ``pooled_projections``, ``timestep``.

The loss is the user's: ``loss_fn = lambda out: out.sample.float().pow(2).mean()`` (the validation
loss of docs/design.md §2; a diffusion loss, MSE against the noise, holds the same tensors).

Four ways to train each (and a diagnostic fifth), every one in a fresh Python process
(``harness.run_child``):

* ``none``: the model as it is;
* ``diffusers``: ``model.enable_gradient_checkpointing()`` (diffusers' default: non-reentrant
  ``torch.utils.checkpoint`` around each ResNet and transformer block of the UNet, each
  down/mid/up block of the VAE's encoder and decoder, each block of the SD3 transformer);
* ``ckptopt``: ``optimize_checkpoints(model, batch, loss_fn=loss_fn)`` with default arguments;
* ``ckptopt-budget``: the same with ``budget=<diffusers' measured peak>``: the least recomputation
  at diffusers' own peak;
* ``ckptopt-8-forced`` (diagnostic, only where the default trace fell back to fewer than 8 tensors
  per cut): ``apply_plan(model, tm, solve(tm.costs, "auto"))`` with ``tm = trace(model, batch,
  loss_fn=loss_fn, max_crossing=8)``, what the default would give had it kept 8.

For each: the measured peak of one training step (``measure_peak_detailed``: forward, loss,
backward under the exact CPU storage tracker; where in the step the peak falls, from its
timeline), and the FLOPs of that step (``torch.utils.flop_counter``; the CPU attention kernel
``_scaled_dot_product_flash_attention_for_cpu``, which flop_counter does not know, counted with its
formula for the other SDPA kernels): the recomputation is the step's FLOPs minus the unmodified
step's, reported as a share of a step taken as 3 x forward (ckptopt's convention). For the ckptopt
ways also ``predicted_peak_bytes``, the simulated recomputation share (``simulate(...)``, priced
with the traced ``c``), the predicted peak without checkpointing (``simulate(costs, ())``), the
plan, the layer where the predicted peak falls, and whether the planned module trains like the
unmodified model: one step of each (a fresh build, same seed; ``torch.manual_seed`` right before
each forward) compared on the loss and every parameter gradient.

Writes ``benchmarks/results/diffusers_models/latest.json`` (``--out``) after every model and prints a
markdown table. Run: ``python -m benchmarks.diffusers_models`` (about 8 minutes on 2 CPU cores, most
of it the UNet; ``--only AutoencoderKL,SD3Transformer2DModel`` for some models).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

from benchmarks.harness import (child_args, child_record, result_path, run_child, run_metadata,
                                same_training as _same_training, shapes, write_json)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WAYS = ("none", "diffusers", "ckptopt", "ckptopt-budget")
#: A diagnostic way, run only for a model whose default trace fell back to fewer crossing tensors
#: (``trace`` halves ``max_crossing`` when a work-capped trial of the side-tensor program does not
#: finish, docs/design.md §5): ``trace(max_crossing=8)`` forced, ``solve(costs, "auto")``, ``apply_plan``.
FORCED = "ckptopt-8-forced"
FORCED_CROSSING = 8

BATCH = 2
CONFIGS = {
    "UNet2DConditionModel": dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(64, 128, 256),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=128, attention_head_dim=8, norm_num_groups=32),
    "AutoencoderKL": dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(64, 128, 256), layers_per_block=2,
        latent_channels=4, norm_num_groups=32, sample_size=128),
    "SD3Transformer2DModel": dict(
        sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=128, caption_projection_dim=128, pooled_projection_dim=64,
        pos_embed_max_size=64),
}
TEXT_TOKENS = {"UNet2DConditionModel": 16, "SD3Transformer2DModel": 32}


def loss_fn(out):
    """The user's loss on the predicted sample (module docstring)."""
    return out.sample.float().pow(2).mean()


def build_model(name: str):
    """``diffusers.<name>(**CONFIGS[name])``, seed 0, training mode."""
    import diffusers
    import torch

    diffusers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    return getattr(diffusers, name)(**CONFIGS[name]).train()


def make_batch(name: str, batch: int = BATCH) -> dict:
    """The batch of the module docstring (fixed generator: the same in every process)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    cfg = CONFIGS[name]
    if name == "UNet2DConditionModel":
        s = cfg["sample_size"]
        return dict(sample=torch.randn(batch, cfg["in_channels"], s, s, generator=gen),
                    timestep=torch.randint(0, 1000, (batch,), generator=gen),
                    encoder_hidden_states=torch.randn(batch, TEXT_TOKENS[name], cfg["cross_attention_dim"],
                                                      generator=gen))
    if name == "AutoencoderKL":
        s = cfg["sample_size"]
        return dict(sample=torch.randn(batch, cfg["in_channels"], s, s, generator=gen))
    if name == "SD3Transformer2DModel":
        s = cfg["sample_size"]
        return dict(hidden_states=torch.randn(batch, cfg["in_channels"], s, s, generator=gen),
                    encoder_hidden_states=torch.randn(batch, TEXT_TOKENS[name], cfg["joint_attention_dim"],
                                                      generator=gen),
                    pooled_projections=torch.randn(batch, cfg["pooled_projection_dim"], generator=gen),
                    timestep=torch.randint(0, 1000, (batch,), generator=gen))
    raise ValueError(f"unknown model {name!r}; one of {', '.join(CONFIGS)}")



# --------------------------------------------------------------------------
# FLOPs of a step (the recomputation: step FLOPs minus the unmodified step's)
# --------------------------------------------------------------------------
def _flop_mapping() -> dict:
    """flop_counter's formulas plus the CPU flash-attention kernel (forward and backward)."""
    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    mapping = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        mapping[fwd] = lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v)
    if bwd is not None:
        # (grad_out, query, key, value, out, logsumexp, ...)
        mapping[bwd] = lambda go, q, k, v, *a, out_shape=None, **kw: fc.sdpa_backward_flop_count(go, q, k, v)
    return mapping


def step_flops(module, batch: dict) -> dict:
    """FLOPs of one forward + loss and of the whole step (forward, loss, backward, any recomputation)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_flop_mapping())
    module.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    with counter:
        loss = loss_fn(module(**batch))
        forward = counter.get_total_flops()
        loss.backward()
    total = counter.get_total_flops()
    module.zero_grad(set_to_none=True)
    return dict(forward_flops=int(forward), step_flops=int(total))


# --------------------------------------------------------------------------
# one case, in a fresh process
# --------------------------------------------------------------------------
def same_training(opt, name: str, batch: dict) -> dict:
    """One step of ``opt`` against one step of a fresh unmodified build (same seed, same batch)."""
    return _same_training(opt, build_model(name), batch, loss_fn)


def _peak_op(timeline) -> dict | None:
    """The operator after which the measured live bytes were highest (first such), and its position."""
    if not timeline:
        return None
    best = max(range(len(timeline)), key=lambda i: (timeline[i][2], -i))
    index, op, live = timeline[best]
    return dict(index=int(index), of=len(timeline), op=str(op), live_bytes=int(live))


def _plan_record(module) -> dict:
    from ckptopt import simulate

    traced, plan = module.traced, module.plan
    costs = traced.costs
    sim = simulate(costs, plan.checkpoints, plan.stored)
    none = simulate(costs, ())
    rec = dict(predicted_peak_bytes=int(module.predicted_peak_bytes), simulated_peak_bytes=int(sim.peak_bytes),
               predicted_none_peak_bytes=int(none.peak_bytes), recompute_share_simulated=float(sim.recompute_share),
               checkpoints=len(plan.checkpoints), stored_segments=len(plan.stored), plan=list(plan.checkpoints),
               stored=list(plan.stored), solver=plan.solver, layers=traced.n, static_bytes=int(costs.static),
               front_end=traced.capture.front_end if traced.capture is not None else "fx",
               max_crossing=traced.max_crossing,
               capture_notes=list(traced.capture.notes) if traced.capture is not None else [])
    rec["predicted_peak_at"] = dict(phase=sim.phase, layer=int(sim.layer), layer_name=traced.layers[sim.layer].name,
                                    segment=int(sim.segment))
    try:
        lines = module.explain().splitlines()
        rec["explain_head"] = lines[:3] + [line for line in lines if line.startswith("peak reached")]
    except Exception as exc:  # noqa: BLE001 - only a description
        rec["explain_error"] = f"{type(exc).__name__}: {exc}"
    return rec


def run_case(name: str, way: str, budget: int | None) -> dict:
    from ckptopt import optimize_checkpoints
    from ckptopt.measure import measure_peak_detailed

    rec: dict = dict(model=name, way=way)
    t0 = time.perf_counter()
    model = build_model(name)
    batch = make_batch(name)
    rec.update(batch=shapes(batch), params=sum(p.numel() for p in model.parameters()))
    if way == "none":
        module = model
    elif way == "diffusers":
        model.enable_gradient_checkpointing()
        module = model
    elif way == FORCED:
        from ckptopt import apply_plan, solve, trace

        t = time.perf_counter()
        tm = trace(model, batch, loss_fn=loss_fn, max_crossing=FORCED_CROSSING)
        module = apply_plan(model, tm, solve(tm.costs, "auto"))
        rec["plan_seconds"] = round(time.perf_counter() - t, 2)
        rec.update(_plan_record(module))
    elif way in ("ckptopt", "ckptopt-budget"):
        if way == "ckptopt-budget":
            if not budget:
                raise ValueError("ckptopt-budget needs diffusers' measured peak as its budget")
            rec["budget_bytes"] = budget
        t = time.perf_counter()
        module = optimize_checkpoints(model, batch, loss_fn=loss_fn, budget=budget if way == "ckptopt-budget" else None)
        rec["plan_seconds"] = round(time.perf_counter() - t, 2)
        rec.update(_plan_record(module))
    else:
        raise ValueError(way)
    t = time.perf_counter()
    m = measure_peak_detailed(module, batch, loss_fn=loss_fn)
    rec["measured_peak_bytes"] = int(m.peak_bytes)
    rec["measured_peak_at"] = _peak_op(m.timeline)
    rec["measure_seconds"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    rec.update(step_flops(module, batch))
    rec["flops_seconds"] = round(time.perf_counter() - t, 2)
    if way.startswith("ckptopt"):
        t = time.perf_counter()
        rec["same_training"] = same_training(module, name, batch)
        rec["check_seconds"] = round(time.perf_counter() - t, 2)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


def run_isolated(name: str, way: str, budget: int | None, timeout: float) -> dict:
    """One case in a fresh process: its record, or why there is none."""
    child = run_child("benchmarks.diffusers_models", [name, way, budget or 0], timeout=timeout)
    rec = child.record if child.record is not None else dict(model=name, way=way, error=child.failure,
                                                             output_tail=child.output)
    rec["wall_seconds"] = round(child.seconds, 2)
    return rec


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------
def run_model(name: str, timeout: float) -> dict:
    cases: dict = {}
    ways = list(WAYS)
    for way in ways:
        budget = cases["diffusers"].get("measured_peak_bytes") if way == "ckptopt-budget" else None
        cases[way] = run_isolated(name, way, budget, timeout)
        c = cases[way]
        print(f"  {name} {way}: " + (f"{c['measured_peak_bytes'] / 2**20:.1f} MiB" if "measured_peak_bytes" in c
                                      else f"ERROR {c.get('error', '')[:300]}") + f" [{c['wall_seconds']:.0f} s]",
              flush=True)
        if way == "ckptopt" and (c.get("max_crossing") or FORCED_CROSSING) < FORCED_CROSSING:
            ways.append(FORCED)  # the default fell back to fewer crossing tensors: what 8 would give
    res: dict = dict(model=name, config=CONFIGS[name],
                     batch=next((c["batch"] for c in cases.values() if "batch" in c), None))
    peak = {w: cases[w].get("measured_peak_bytes") for w in ways}
    res.update({f"{w}_peak_bytes": peak[w] for w in ways})
    base = cases["none"]
    for w in ways:
        c = cases[w]
        if "step_flops" in c and "step_flops" in base and base.get("forward_flops"):
            c["recomputed_flops"] = c["step_flops"] - base["step_flops"]
            c["recompute_share_measured"] = c["recomputed_flops"] / (3 * base["forward_flops"])
        if c.get("predicted_peak_bytes") and peak[w]:
            c["measured_minus_predicted_bytes"] = peak[w] - c["predicted_peak_bytes"]
            c["prediction_error"] = (peak[w] - c["predicted_peak_bytes"]) / peak[w]
        if peak[w] and peak["diffusers"]:
            c["ratio_vs_diffusers"] = peak[w] / peak["diffusers"]
    res["ratio_ckptopt_vs_diffusers"] = cases["ckptopt"].get("ratio_vs_diffusers")
    res["same_training"] = {w: cases[w].get("same_training") for w in ways if w.startswith("ckptopt")}
    res["seconds"] = {w: cases[w]["wall_seconds"] for w in ways}
    res["errors"] = {w: cases[w]["error"] for w in ways if "error" in cases[w]}
    res["cases"] = cases
    return res


def _table(results: list[dict]) -> str:
    mib = 2.0 ** 20
    lines = ["| model | way | measured peak | vs diffusers | predicted − measured | recompute (measured FLOPs) "
             "| recompute (simulated) | same training |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for w in r["cases"]:
            c = r["cases"][w]
            if "measured_peak_bytes" not in c:
                lines.append(f"| {r['model']} | {w} | error: {c.get('error', '')[:80]} | | | | | |")
                continue
            peak = c["measured_peak_bytes"]
            vs = f"×{c['ratio_vs_diffusers']:.3f}" if c.get("ratio_vs_diffusers") else "–"
            if c.get("predicted_peak_bytes"):
                d = c["predicted_peak_bytes"] - peak
                pred = f"{d:+,} B ({100 * d / peak:+.3f}%)"
            else:
                pred = "–"
            share = f"{100 * c['recompute_share_measured']:.1f}%" if "recompute_share_measured" in c else "–"
            sim = f"{100 * c['recompute_share_simulated']:.1f}%" if "recompute_share_simulated" in c else "–"
            st = c.get("same_training")
            same = "–" if not st else ("bit-identical" if st["bit_identical"]
                                       else f"differs (grad {st['grad_max_abs_diff']:.2g})")
            lines.append(f"| {r['model']} | {w} | {peak:,} B ({peak / mib:.1f} MiB) | {vs} | {pred} | {share} | "
                         f"{sim} | {same} |")
    return "\n".join(lines)


def main() -> None:
    child = child_args()
    if child:
        path, (name, way, budget) = child
        warnings.filterwarnings("ignore")
        child_record(path, run_case, name, way, int(budget) or None, model=name, way=way)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated class names: " + ",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case (default 900)")
    ap.add_argument("--out", default=result_path("diffusers_models"))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(CONFIGS)}")
    warnings.filterwarnings("ignore")
    import diffusers

    meta = run_metadata("diffusers_models")
    meta.update(diffusers=diffusers.__version__, device="cpu", timeout_seconds=args.timeout, models=names,
                ways=list(WAYS), diagnostic_way=FORCED, batch=BATCH, loss="out.sample.float().pow(2).mean()")
    t0 = time.perf_counter()
    results = []
    for name in names:
        print(name, flush=True)
        results.append(run_model(name, args.timeout))
        meta["wall_seconds"] = round(time.perf_counter() - t0, 1)
        write_json(args.out, dict(meta=meta, results=results))
    print()
    print(_table(results))
    for r in results:
        for way, err in r["errors"].items():
            print(f"{r['model']} {way}: {err[:300]}")
    print(f"wall time {meta['wall_seconds']:.0f} s; wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
