"""The memory planning itself takes: ``optimize_checkpoints`` under the exact storage tracker (CPU).

For a model of ``hf_families.py`` or ``diffusers_models.py`` at ``--batch-scale`` times its batch, in
this process: the tracker registers the model and its batch, then ``optimize_checkpoints(model,
batch, calibrate=...)`` runs under it. Reported: the peak of real storages above the model and batch
(tracing runs on fake tensors; calibration runs each layer on real ones), what stays after, and the
plan's predicted training peak, for comparison. On CUDA ``gpu_models.py`` reports the same from
the allocator.

    python -m benchmarks.planning_memory GPTNeoXForCausalLM --batch-scale 8   # prints one JSON line per way
"""

from __future__ import annotations

import argparse
import json
import time
import warnings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch-scale", type=int, default=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    from benchmarks import gpu_models
    from ckptopt import optimize_checkpoints
    from ckptopt.tracker import StorageTracker

    suite = gpu_models.MODELS[args.model]
    batch = suite.make_batch(args.model, gpu_models._default_batch(suite, args.model) * args.batch_scale)
    for calibrate in (False, True):
        model = suite.build_model(args.model)
        tracker = StorageTracker()
        tracker.register(model, [v for v in batch.values() if isinstance(v, torch.Tensor)])
        base = tracker.current_bytes
        t0 = time.perf_counter()
        with tracker:
            opt = optimize_checkpoints(model, batch, loss_fn=gpu_models._loss_fn(args.model), calibrate=calibrate)
        tracker.detach()
        print(json.dumps(dict(model=args.model, batch_scale=args.batch_scale, calibrate=calibrate,
                              planning_peak_above_model_bytes=tracker.peak_bytes - base,
                              predicted_training_peak_bytes=int(opt.predicted_peak_bytes),
                              seconds=round(time.perf_counter() - t0, 1))), flush=True)


if __name__ == "__main__":
    main()
