"""Full-size language models planned without their weights: time and resident memory.

Each case runs ``ckptopt estimate hf:<class> --config ... --batch B --seq S --dtype bf16
--optimizer adamw`` (the CLI builds the model on the meta device) in a fresh process, timed
from the outside, with that process's peak resident memory (``ru_maxrss`` of the child). The
shapes are the published configurations of Llama-3-8B and -70B, Qwen2.5-32B and
Mixtral-8x7B; a second table traces the 8B shape at 4 to 32 layers (tracing time against
layer count, and the layers the tracer cut them into).

    python -m benchmarks.full_size [--quick]

writes benchmarks/results/full_size/latest.json. ``--quick``: the 8B shape only (``latest-quick.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.harness import child_env, result_path, run_metadata, write_json

LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
SHAPES = {
    "llama3-8b": ("LlamaForCausalLM", dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                           num_attention_heads=32, num_key_value_heads=8)),
    "llama3-70b": ("LlamaForCausalLM", dict(LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                            num_attention_heads=64, num_key_value_heads=8)),
    "qwen2.5-32b": ("Qwen2ForCausalLM", dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                             num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                                             max_position_embeddings=32768)),
    "mixtral-8x7b": ("MixtralForCausalLM", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                                num_local_experts=8, num_experts_per_tok=2,
                                                max_position_embeddings=32768)),
}


def run_case(cls: str, config: dict, batch: int, seq: int, device: str, timeout: float) -> dict:
    wrapper = ("import resource, sys\nfrom ckptopt.cli import main\ntry:\n    rc = main(sys.argv[1:])\nfinally:\n"
               "    print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
               "sys.exit(rc)\n")
    args = [sys.executable, "-c", wrapper, "estimate", f"hf:{cls}"]
    for k, v in config.items():
        args += ["--config", f"{k}={v}"]
    args += ["--batch", str(batch), "--seq", str(seq), "--dtype", "bf16", "--optimizer", "adamw", "--json",
             "--device", device]
    env = child_env(src_first=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {timeout:.0f} s")
    seconds = time.perf_counter() - t
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("MAXRSS ")]
    row = dict(seconds=round(seconds, 1), max_rss_bytes=rss[-1] * 1024 if rss else None)  # (ru_maxrss: KiB)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith("MAXRSS ")]
        row["error"] = (lines or ["?"])[-1][:400]
        return row
    est = json.loads(proc.stdout)
    row.update(layers=est["n_layers"], param_bytes=est["param_bytes"],
               none_peak_bytes=est["no_checkpointing"]["peak_bytes"], optimal_peak_bytes=est["optimal"]["peak_bytes"],
               optimal_at=est["optimal"]["at"], needed_bytes=est.get("needed_bytes"))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--device", default="cuda", help="the device planned for (default cuda: no GPU needed)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="default benchmarks/results/full_size/latest.json (latest-quick.json with --quick)")
    args = ap.parse_args(argv)
    args.out = args.out or result_path("full_size", "quick" if args.quick else None)
    rows, scaling = [], []
    for name, (cls, cfg) in SHAPES.items():
        if args.quick and name != "llama3-8b":
            continue
        row = dict(model=name, cls=cls, batch=args.batch, seq=args.seq,
                   **run_case(cls, cfg, args.batch, args.seq, args.device, args.timeout))
        rows.append(row)
        print(json.dumps(row), flush=True)
    cls, cfg = SHAPES["llama3-8b"]
    for layers in ((4, 32) if args.quick else (4, 8, 16, 32)):
        row = dict(model="llama3-8b", num_hidden_layers=layers,
                   **run_case(cls, dict(cfg, num_hidden_layers=layers), args.batch, args.seq, args.device,
                              args.timeout))
        scaling.append(row)
        print(json.dumps(row), flush=True)
    write_json(args.out, dict(meta=run_metadata("full_size"), device=args.device, rows=rows, layer_scaling=scaling))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
