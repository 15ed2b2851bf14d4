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

    python -m benchmarks.gpu_persistent --out-dir /tmp/pers GPTNeoXForCausalLM:none

(Its printed report is the record to keep: ``benchmarks/results/gpu_persistent/latest-<label>.log``.)
"""

from __future__ import annotations

import argparse
import os

from benchmarks.harness import cases_in_processes, child_args, child_record


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

    from benchmarks import gpu_gap
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
    child = child_args()
    if child:
        path, (name, way, device) = child
        child_record(path, run_case, name, way, device, model=name, way=way)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="MODEL:WAY, WAY 'none' or 'ckptopt'")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    for case, r in cases_in_processes("benchmarks.gpu_persistent", args.cases, args.out_dir, "persistent", args.device, args.timeout):
        print(f"{case}: workspace {r['workspace_bytes']:,} B; left after one step {r['left_after_one_step']:,} B, "
              f"after two {r['left_after_two_steps']:,} B; {len(r['blocks'])} blocks allocated while recording "
              "and alive", flush=True)
        for b in sorted(r["blocks"], key=lambda b: -b["size"])[:6]:
            print(f"   {b['size']:,} B (requested {b['requested']}) stream {b['stream']}", flush=True)
            for f in b["frames"]:
                print(f"      {f}", flush=True)


if __name__ == "__main__":
    main()
