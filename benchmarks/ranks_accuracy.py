"""One rank of DDP and FSDP2: predicted against measured, on a fake process group (issue 21).

The model is ``tests/common/ranks.py``'s residual-MLP blocks (widths that 2, 4 and 8 do not
divide, so FSDP2 pads its shards and every rank's optimizer state differs). For each strategy
(DDP; FSDP2 ``fully_shard`` on each block and the root), world size, rank and optimizer,
``ckptopt.estimate(..., parallel=Parallel(W, strategy, rank=r))`` predicts the rank's step with no
checkpointing and with the optimal plan, and ``ckptopt.measure.measure_rank_step`` measures one
steady-state step of that rank under the exact storage tracker, in this process, on PyTorch's fake
process group (collectives move no data; a rank allocates what a real one does). A gap of 8 B is
the scalar loss and its gradient (not in the cost model). Then PyTorch's own
``FSDPMemTracker`` measures the module ``optimize_checkpoints(..., parallel=...)`` shards, at 8
and 64 ranks. DDP runs as real processes over gloo (2 and 4 ranks, every rank; FSDP2 too), with
``tests/test_parallel.py``'s workers: DDP's communication hook does not run on the fake group.

    python -m benchmarks.ranks_accuracy            # writes benchmarks/results/ranks_accuracy/latest.json, prints a table
    python -m benchmarks.ranks_accuracy --llama    # a transformers Llama on the fake group: .../latest-llama.json
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.harness import result_path, run_metadata, write_json
from tests.common.ranks import fake_world

OUT = result_path("ranks_accuracy")


def tracker_rows(worlds=(8, 64)) -> list[dict]:
    """FSDPMemTracker's steady-state peak of the module optimize_checkpoints shards."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from ckptopt import estimate, optimize_checkpoints
    from ckptopt.planning import Parallel
    from tests.common.ranks import make

    rows = []
    for world in worlds:
        model, x = make()
        par = Parallel(world, "fsdp")
        with fake_world(world, 0):
            est = estimate(model, x, optimizer="adam", parallel=par)
            module = optimize_checkpoints(model, x, parallel=par)
            opt = torch.optim.Adam(module.parameters())
            peaks = []
            for _ in range(2):  # the first step allocates the optimizer's state
                fmt = FSDPMemTracker(module, opt)
                fmt.track_inputs((x,))
                with fmt:
                    loss = module(x).float().pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    del loss
                peaks.append(int(fmt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
        rows.append(dict(world=world, plan=list(module.plan.checkpoints), predicted=est.optimal.peak_bytes,
                         fsdp_mem_tracker=peaks[1], gap=peaks[1] - est.optimal.peak_bytes))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def gloo_rows(worlds=(2, 4)) -> list[dict]:
    """Real processes over gloo, every rank: DDP (Adam), DDP with gradient_as_bucket_view (SGD), FSDP2 (Adam)."""
    import tempfile

    from tests.test_parallel import _run_gloo

    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            results = _run_gloo(world, tmp)
        for rank, res in enumerate(results):
            if "error" in res:
                raise RuntimeError(f"gloo rank {rank} of {world} failed:\n{res['error']}")
            for strategy, optimizer, label, plan, predicted, measured in res["rows"]:
                rows.append(dict(backend="gloo", strategy=strategy, world=world, rank=rank, optimizer=optimizer,
                                 plan=label, checkpoints=list(plan), predicted=predicted, measured=measured,
                                 gap=measured - predicted))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def llama_rows(worlds=(2, 4, 8)) -> list[dict]:
    """A transformers Llama (torch.export captures it; each decoder layer's call runs through the layer,
    so FSDP2's hooks fire): every (world, first/last rank, SGD/Adam), no checkpointing and the plan."""
    import torch
    import transformers

    from ckptopt.planning import Parallel
    from tests.common.ranks import predicted_and_measured

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=500)  # (first dimensions 2, 4, 8 do not all divide)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 500, (4, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    for world in worlds:
        for rank in sorted({0, world - 1}):
            for optimizer in ("sgd", "adam"):
                with fake_world(world, rank) as mesh:
                    got = predicted_and_measured(Parallel(world, "fsdp", rank=rank), optimizer, mesh=mesh,
                                                 model_and_inputs=(model, batch), loss_fn=lambda out: out.loss)
                for label, plan, predicted, measured in got:
                    rows.append(dict(backend="fake", strategy="fsdp", model="LlamaForCausalLM (export)",
                                     world=world, rank=rank, optimizer=optimizer, plan=label,
                                     checkpoints=list(plan), predicted=predicted, measured=measured,
                                     gap=measured - predicted))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama", action="store_true", help="the transformers Llama rows alone, in latest-llama.json")
    args = ap.parse_args(argv)
    from ckptopt.planning import Parallel
    from tests.common.ranks import predicted_and_measured

    if args.llama:  # the transformers rows alone, in their own file
        rows = llama_rows()
        out = result_path("ranks_accuracy", "llama")
        write_json(out, dict(meta=run_metadata("ranks_accuracy"), rows=rows))
        print(f"\n{len(rows)} rank steps, {sum(r['gap'] == 8 for r in rows)} measured = predicted + 8 B; "
              f"gaps {sorted({r['gap'] for r in rows})}; wrote {out}")
        return 0

    rows = []
    for strategy in ("fsdp",):  # (DDP's communication hook needs a real backend: gloo below)
        for world in (2, 4, 8):
            for rank in sorted({0, world - 1}):
                for optimizer in ("sgd", "adam"):
                    with fake_world(world, rank) as mesh:
                        got = predicted_and_measured(Parallel(world, strategy, rank=rank), optimizer, mesh=mesh)
                    for label, plan, predicted, measured in got:
                        rows.append(dict(backend="fake", strategy=strategy, world=world, rank=rank, optimizer=optimizer, plan=label,
                                         checkpoints=list(plan), predicted=predicted, measured=measured,
                                         gap=measured - predicted))
                        print(json.dumps(rows[-1]), flush=True)
    rows += gloo_rows()
    tracked = tracker_rows()
    write_json(OUT, dict(meta=run_metadata("ranks_accuracy"), rows=rows, fsdp_mem_tracker=tracked))
    print("\n| process group | strategy | world | rank | optimizer | plan | predicted | measured | gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['strategy']} | {r['world']} | {r['rank']} | {r['optimizer']} | {r['plan']} {tuple(r['checkpoints'])} | "
              f"{r['predicted']:,} | {r['measured']:,} | {r['gap']:+,} |")
    for backend in ("fake", "gloo"):
        sel = [r for r in rows if r["backend"] == backend]
        print(f"\n{backend}: {len(sel)} rank steps, {sum(r['gap'] == 8 for r in sel)} measured = predicted + 8 B; "
              f"gaps {sorted({r['gap'] for r in sel})}")
    for t in tracked:
        print(f"FSDPMemTracker at {t['world']} ranks: {t['fsdp_mem_tracker']:,} B, predicted {t['predicted']:,} B "
              f"({t['gap']:+} B)")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
