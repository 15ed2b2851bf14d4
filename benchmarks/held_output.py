"""What a training loop that keeps the model's output costs beyond the step ckptopt models.

ckptopt's predictions (``estimate``, ``max_batch``, ``optimize_checkpoints``) model the step
``loss_fn(model(x)).backward(); opt.step()``: the model's output dies once the loss has read
it (or once the loss's backward has used it). A loop written as ``out = model(x); loss =
loss_fn(out); loss.backward(); opt.step()`` keeps ``out`` alive through the backward, the
optimizer step and the next forward (until ``out`` is rebound). This script measures both
loops on the CPU with the exact storage tracker: three Adam steps of the zoo GPT at batch 2 and 8 (12 blocks,
width 768, vocabulary 50,257, 128 tokens, fp32 logits), no checkpointing and the plan that
checkpoints every layer but the loss, against ``estimate``'s prediction for the same plan.

    python -m benchmarks.held_output            # writes benchmarks/results/held_output/latest.json
"""

from __future__ import annotations

import argparse
import json

from benchmarks.harness import result_path, run_metadata, write_json

OUT = result_path("held_output")


def measure(module, x, loss, keep: bool, steps: int = 3) -> int:
    """The tracked peak of ``steps`` Adam steps (foreach), the output kept or not."""
    import torch

    from ckptopt.tracker import StorageTracker

    opt = torch.optim.Adam(module.parameters(), lr=1e-4, foreach=True)
    tracker = StorageTracker()
    tracker.register(module, *x)
    out = None
    with tracker:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            if keep:
                out = module(*x)  # the previous step's output lives until this rebinding
                loss(out).backward()
            else:
                loss(module(*x)).backward()
            opt.step()
    del out
    return tracker.peak_bytes


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.strip().split("\n")[0]).parse_args(argv)  # (no options: --help)
    import torch

    from ckptopt import Plan, apply_plan, simulate, trace, zoo
    from ckptopt.planning.optimizer import optimizer_memory, step_peak

    torch.manual_seed(0)
    rows = []
    for batch in (2, 8):
        model, x = zoo.get("gpt", batch_size=batch, depth=12, width=768, heads=12, seq_len=512, vocab=50257)
        model.train()
        loss = lambda out: out.float().pow(2).mean()  # noqa: E731
        tm = trace(model, x, loss_fn=loss)
        out_bytes = int(tm.costs.a[tm.n - 2])  # the model's output (the loss layer's input)
        sizes = [p.numel() * p.element_size() for p in model.parameters()]
        opt = optimizer_memory(sizes, "adam", impl="foreach")
        stp = step_peak(tm.costs, sum(sizes), opt)
        for cps in ((), (tm.n - 1,)):
            module = apply_plan(model, tm, Plan(cps, 0, "given", 0.0, tm.n, ())) if cps else model
            predicted = max(simulate(tm.costs, cps).peak_bytes + opt.state_bytes, stp)  # (estimate's rule)
            dies, kept = measure(module, x, loss, False), measure(module, x, loss, True)
            row = dict(batch=batch, checkpoints=list(cps), output_bytes=out_bytes, predicted=predicted,
                       measured_output_dies=dies, measured_output_kept=kept, kept_minus_dies=kept - dies)
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_json(OUT, dict(meta=run_metadata("held_output"), rows=rows))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
