"""Does the batch ``ckptopt.max_batch`` finds really fit, and the next one not?

Runs ``max_batch`` (default: resnet50, zoo input 64x64, 2 GiB, Adam with the
for-loop step PyTorch uses on CPU), then measures real training steps with
the exact CPU storage tracker (``ckptopt.measure.measure_training_step``,
optimizer step included) at batch b and b+1, with no checkpointing and with
the optimal plan. Writes ``benchmarks/results/max_batch_check/latest.json``.

    python -m benchmarks.max_batch_check
    python -m benchmarks.max_batch_check --model resnet18 --memory 512MiB
"""

from __future__ import annotations

import argparse
import gc
import time

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import zoo
from ckptopt.measure import measure_training_step
from ckptopt.planning import estimate, max_batch, with_batch
from ckptopt.units import format_bytes, parse_bytes



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--input-size", type=int, default=None)
    ap.add_argument("--memory", default="2GiB")
    ap.add_argument("--optimizer", default="adam")
    args = ap.parse_args()
    memory = parse_bytes(args.memory)
    kw = {} if args.input_size is None else dict(input_size=args.input_size)
    model, inputs = zoo.get(args.model, **kw)
    model.train()
    t0 = time.perf_counter()
    mb = max_batch(model, inputs, memory, optimizer=args.optimizer)
    search_seconds = time.perf_counter() - t0
    print(f"max_batch: no checkpointing {mb.no_checkpointing.batch}, optimal {mb.optimal.batch} "
          f"({mb.traces} traces, {search_seconds:.1f} s)", flush=True)
    rows = []
    b0 = inputs[0].shape[0]
    for fit in (mb.no_checkpointing, mb.optimal):
        for b in (fit.batch, fit.batch + 1):
            x = with_batch(inputs, b, b0)
            est = estimate(model, x, optimizer=args.optimizer)
            pe = est.no_checkpointing if fit.strategy == "none" else est.optimal
            gc.collect()
            t1 = time.perf_counter()
            measured = measure_training_step(model, x, args.optimizer, "for-loop",
                                             checkpoints=pe.checkpoints if pe.checkpoints else None,
                                             stored=pe.stored)
            rows.append(dict(strategy=fit.strategy, batch=b, checkpoints=list(pe.checkpoints), stored=list(pe.stored),
                             predicted_bytes=pe.peak_bytes, measured_bytes=measured, fits=measured <= memory,
                             measure_seconds=time.perf_counter() - t1))
            print(f"{fit.strategy:>8} batch {b}: predicted {format_bytes(pe.peak_bytes)}, measured "
                  f"{format_bytes(measured)} ({measured} B) -> {'fits' if measured <= memory else 'does not fit'} "
                  f"in {format_bytes(memory)}", flush=True)
            del x
    ok = all(r["fits"] == (r["batch"] == f.batch) for r, f in
             zip(rows, (mb.no_checkpointing, mb.no_checkpointing, mb.optimal, mb.optimal)))
    out = dict(run_metadata("max_batch_check"), model=args.model, zoo_kwargs=kw, memory_bytes=memory,
               optimizer=args.optimizer, search_seconds=search_seconds, max_batch=mb.to_dict(), measured=rows,
               answer_fits_and_next_does_not=ok)
    write_json(result_path("max_batch_check"), out)
    print(f"b fits and b+1 does not, for both strategies: {ok}")


if __name__ == "__main__":
    main()
