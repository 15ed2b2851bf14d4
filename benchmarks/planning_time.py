"""Where a planning second goes: ``optimize_checkpoints`` and ``estimate`` timed part by part.

    python -m benchmarks.planning_time                 # -> benchmarks/results/planning_time/latest.json
    python -m benchmarks.planning_time --cases llama4  # some cases only

Each case runs in a fresh process (one thread, transformers models built from their config classes, no
weights loaded): one untimed call first (imports, the solvers' compiled kernels from the on-disk cache),
then the timed call: three times as it is and three times as on one core (``os.cpu_count()`` 1: the
crossings' trials and the stored-segment pass each wait for the program before them, instead of running
beside it in a thread), alternating, medians of each, to show what that overlap saves; and once with every
layer measured (``SHARE_MEASUREMENTS = False``, not layers alike once: ``ckptopt.tracer.layer_key``), to
show what sharing saves. The costs of all calls are compared byte for byte. Each part's time is the time
spent inside the function that does it (wrapped for the run; a part called several times is summed):

* ``capture``: the model to a graph (``torch.export`` or ``torch.fx``);
* ``propagate``: the graph run once on a fake copy of the model;
* ``cuts``: where layers may be cut, at each crossing tried;
* ``measure``: each layer's run on fake tensors (``measure_layer``), with its FLOP count;
* ``crossing trials``: the time planning waits for the exact side-tensor program tried at each crossing
  (``solves_within``; each trial runs in a thread beside the next crossing's measurement: ``_Trials.settled``);
* ``solve``: the solvers; ``side effects``: the check that the forward can run twice;
  ``verify``: the fake training step through the rewritten module;
* ``allocator replay``: an estimate's fake training steps and the caching allocator's replay over them
  (``ckptopt.planning.reserved``: CUDA);
* ``other``: the rest (assembling the costs, the rewriter, Python).

``estimate`` cases plan a full-size model from its configuration on the meta device for CUDA (bf16,
AdamW): the ``estimate`` call, parts as above.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager

from benchmarks.harness import child_args, child_env, child_record, result_path, run_child, run_metadata, write_json

CASES = {
    "llama4": ("optimize", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                                    num_attention_heads=4, vocab_size=1024), (2, 128)),
    "llama12": ("optimize", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=12,
                                                     num_attention_heads=4, vocab_size=1024), (2, 128)),
    "gpt2-4": ("optimize", "GPT2LMHeadModel", dict(n_embd=256, n_layer=4, n_head=4, vocab_size=1024), (2, 128)),
    "bert4": ("optimize", "BertForMaskedLM", dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                                  intermediate_size=1024, vocab_size=1024), (2, 128)),
    "llama3-8b": ("estimate", "LlamaForCausalLM", dict(vocab_size=128256, max_position_embeddings=8192,
                                                      rope_theta=500000.0, hidden_size=4096, intermediate_size=14336,
                                                      num_hidden_layers=32, num_attention_heads=32,
                                                      num_key_value_heads=8), (1, 4096)),
    "llama3-70b": ("estimate", "LlamaForCausalLM", dict(vocab_size=128256, max_position_embeddings=8192,
                                                       rope_theta=500000.0, hidden_size=8192, intermediate_size=28672,
                                                       num_hidden_layers=80, num_attention_heads=64,
                                                       num_key_value_heads=8), (1, 4096)),
}

#: the transformers model type of each model class above
CONFIG_TYPES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2", "BertForMaskedLM": "bert"}

PARTS = [  # (part, module, attribute)
    ("capture", "ckptopt.tracer.chain", "capture_graph"),
    ("propagate", "ckptopt.tracer.chain", "_propagate"),
    ("cuts", "ckptopt.tracer.chain._Grouping", "groups"),
    ("measure", "ckptopt.tracer.layers", "measure_layer"),
    ("measure", "ckptopt.tracer.layers", "layer_compute"),
    ("crossing trials", "ckptopt.tracer.chain._Trials", "start"),  # (one core: the trial runs here)
    ("crossing trials", "ckptopt.tracer.chain._Trials", "settled"),
    ("solve", "ckptopt.api", "solve"),
    ("solve", "ckptopt.planning.estimate", "solve"),
    ("side effects", "ckptopt.api", "_check_forward_has_no_python_side_effects"),
    ("verify", "ckptopt.api", "_verify_training_step"),
    ("allocator replay", "ckptopt.planning.reserved", "replayed_needs"),
]


@contextmanager
def _timed_parts(seconds: dict, calls: dict):
    """Wrap each part's function so that the time inside it (outermost call only) adds to its part, and
    leaves the part it runs inside (an estimate's allocator replay, run while the trace waits for a
    crossing's trial, is the replay's, not the trials')."""
    import importlib

    import threading

    patched, local = [], threading.local()  # (per thread: a part run in a thread nests in none of the caller's)

    def wrap(part, fn):
        def timed(*a, **k):
            active = local.__dict__.setdefault("active", set())
            stack = local.__dict__.setdefault("stack", [])
            if part in active:  # (nested: counted by the outer call)
                return fn(*a, **k)
            active.add(part)
            stack.append(part)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                took = time.perf_counter() - t0
                seconds[part] = seconds.get(part, 0.0) + took
                calls[part] = calls.get(part, 0) + 1
                active.discard(part)
                stack.pop()
                if stack:  # (inside another part: not that part's time)
                    seconds[stack[-1]] = seconds.get(stack[-1], 0.0) - took
        return timed

    for part, where, attr in PARTS:
        mod_name, _, cls = where.partition("._")
        owner = importlib.import_module(mod_name if cls else where)
        if cls:
            owner = getattr(owner, "_" + cls)
        if not hasattr(owner, attr):
            continue
        fn = getattr(owner, attr)
        patched.append((owner, attr, fn))
        setattr(owner, attr, wrap(part, fn))
    try:
        yield
    finally:
        for owner, attr, fn in reversed(patched):
            setattr(owner, attr, fn)


def _build(kind: str, cls: str, config: dict, shape: tuple):
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(CONFIG_TYPES[cls], **config, use_cache=False)
    torch.manual_seed(0)
    if kind == "estimate":
        with torch.device("meta"):
            model = getattr(transformers, cls)(cfg).to(torch.bfloat16)
    else:
        model = getattr(transformers, cls)(cfg)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, shape)
    return model, dict(input_ids=ids, labels=ids)


def _one(kind: str, model, batch, share: bool, one_core: bool = False) -> dict:
    import os

    from ckptopt import optimize_checkpoints
    from ckptopt.planning import estimate
    from ckptopt.tracer import layers as layers_mod

    layers_mod.SHARE_MEASUREMENTS = share
    cpu_count = os.cpu_count
    if one_core:
        os.cpu_count = lambda: 1
    seconds: dict = {}
    calls: dict = {}
    try:
        with _timed_parts(seconds, calls):
            t0 = time.perf_counter()
            if kind == "estimate":
                est = estimate(model, batch, optimizer="adamw", device="cuda")
                n = est.n_layers
                fingerprint = json.dumps([est.no_checkpointing.peak_bytes, est.optimal.peak_bytes,
                                          list(est.optimal.checkpoints)])
            else:
                opt = optimize_checkpoints(model, batch, in_place=False)
                n = opt.traced.n
                fingerprint = json.dumps(opt.traced.costs.to_dict(), sort_keys=True) + str(opt.plan.checkpoints)
            total = time.perf_counter() - t0
    finally:
        layers_mod.SHARE_MEASUREMENTS = True
        os.cpu_count = cpu_count
    seconds["other"] = max(0.0, total - sum(seconds.values()))
    return dict(total_seconds=round(total, 3), layers=n, parts={k: round(v, 3) for k, v in seconds.items()},
                calls=calls, fingerprint=fingerprint)


def run_case(name: str) -> dict:
    import torch

    torch.set_num_threads(1)
    kind, cls, config, shape = CASES[name]
    model, batch = _build(kind, cls, config, shape)
    _one(kind, model, batch, True)  # untimed: imports, compiled kernels
    runs: dict[bool, list] = {False: [], True: []}
    for k in range(ROUNDS):  # (alternating, the order turned each round)
        for one_core in ((False, True) if k % 2 == 0 else (True, False)):
            runs[one_core].append(_one(kind, model, batch, True, one_core=one_core))
    alone = _one(kind, model, batch, False)
    prints = {r.pop("fingerprint") for r in (*runs[False], *runs[True], alone)}
    median = lambda rs: sorted(rs, key=lambda r: r["total_seconds"])[len(rs) // 2]  # noqa: E731
    return dict(case=name, kind=kind, model=cls, config=config, batch=list(shape), rounds=ROUNDS,
                shared=median(runs[False]), alone=alone, in_turn=median(runs[True]), identical=len(prints) == 1)


ROUNDS = 3  # timed calls as it is and as on one core, each


def main(argv=None) -> int:
    child = child_args(argv)
    if child is not None:
        path, args = child
        child_record(path, run_case, args[0], case=args[0])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = p.parse_args(argv)
    rows = []
    for name in args.cases:
        c = run_child("benchmarks.planning_time", [name], timeout=1800, env=child_env(threads="1"))
        rec = c.record or dict(case=name, error=f"no result (exit {c.returncode}): {c.output[-300:]}")
        rows.append(rec)
        if "error" in rec:
            print(name, "ERROR", rec["error"][:300], flush=True)
            continue
        s, a = rec["shared"], rec["alone"]
        print(f"{name}: {s['total_seconds']:.1f} s ({s['layers']} layers; every layer measured: "
              f"{a['total_seconds']:.1f} s; one core: {rec['in_turn']['total_seconds']:.1f} s; "
              f"identical {rec['identical']}) "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(s["parts"].items(), key=lambda kv: -kv[1])), flush=True)
    import subprocess

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    write_json(result_path("planning_time"), dict(meta=dict(run_metadata("planning_time"), load_after=load),
                                                  rows=rows))
    print("wrote", result_path("planning_time"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
