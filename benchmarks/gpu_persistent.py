"""What a CUDA training step leaves allocated that no tensor holds, and who allocated it.

Calibration measures the libraries' fixed workspace as what stays allocated after each layer
ran alone (``ckptopt.calibration``). On an H200 a model's whole step left about 1 MiB more
(2.6-2.9 MB on the convolutional diffusers models), not in the prediction
(``gpu_gap.py``: allocated minus tracked bytes at the step's first op). This script finds it:
for each case (a model of ``gpu_models.py`` or ``gpu_accuracy.py``; way ``none``, the model
unmodified, or ``ckptopt``, the tensor model's plan), in a fresh process, it measures the
workspace as calibration does, then records the allocator's history (with C++ and Python
stacks) over one training step, frees every tensor of it (gradients included), and writes
every block still allocated with the frames that allocated it.

    PYTHONPATH=src python benchmarks/gpu_persistent.py --out-dir /tmp/pers GPTNeoXForCausalLM:none
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cases_in_processes  # noqa: E402


def _frames(block: dict, keep: int = 14) -> list[str]:
    out = []
    for f in block.get("frames", []):
        name = f.get("name", "")
        if any(s in name for s in ("c10::cuda::CUDACachingAllocator", "std::", "_start", "__libc")):
            continue
        out.append(f"{name} ({os.path.basename(f.get('filename', ''))}:{f.get('line', '')})")
    return out[:keep]


def run_case(name: str, way: str, device: str) -> dict:
    import torch

    import gpu_gap
    from ckptopt.planning.headroom import measure_cuda_workspace

    model, batch, loss_fn = gpu_gap._load(name, device)
    module = model
    if way == "ckptopt":
        from ckptopt import optimize_checkpoints

        module = optimize_checkpoints(model, batch, loss_fn=loss_fn, calibrate=False)

    def step():
        out = module(**batch) if isinstance(batch, dict) else module(*batch)
        loss = loss_fn(out) if loss_fn else out.loss
        del out
        loss.backward()
        del loss
        module.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    workspace = measure_cuda_workspace(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="all", stacks="all")
    step()
    torch.cuda.synchronize()
    after_one = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    after_two = torch.cuda.memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    blocks = []
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b.get("frames"):
                blocks.append(dict(size=b["size"], requested=b.get("requested_size"), stream=seg.get("stream"),
                                   frames=_frames(b)))
    return dict(model=name, way=way, workspace_bytes=workspace, left_after_one_step=after_one - base,
                left_after_two_steps=after_two - base, blocks=blocks, torch=torch.__version__)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, way, device, path = sys.argv[2:6]
        try:
            rec = run_case(name, way, device)
        except BaseException as exc:  # noqa: BLE001 - recorded
            rec = dict(model=name, way=way, error=f"{type(exc).__name__}: {exc}"[:2000])
        with open(path, "w") as fh:
            json.dump(rec, fh, indent=1)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="MODEL:WAY, WAY 'none' or 'ckptopt'")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    for case, r in cases_in_processes(__file__, args.cases, args.out_dir, "persistent", args.device, args.timeout):
        print(f"{case}: workspace {r['workspace_bytes']:,} B; left after one step {r['left_after_one_step']:,} B, "
              f"after two {r['left_after_two_steps']:,} B; {len(r['blocks'])} blocks allocated while recording "
              "and alive", flush=True)
        for b in sorted(r["blocks"], key=lambda b: -b["size"])[:6]:
            print(f"   {b['size']:,} B (requested {b['requested']}) stream {b['stream']}", flush=True)
            for f in b["frames"]:
                print(f"      {f}", flush=True)


if __name__ == "__main__":
    main()
