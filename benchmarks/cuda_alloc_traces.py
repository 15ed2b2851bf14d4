"""Real CUDA caching-allocator traces of training steps, small enough to commit (issue 42).

A CPU replay of PyTorch's ``CUDACachingAllocator`` is checked against these, in CI, without a GPU.
Each case runs in a fresh process, so its allocator starts empty, and the recording covers the
allocator's whole life in that process:

1. ``torch.cuda.memory._record_memory_history(context=None)`` (no stack frames kept), before
   anything touches the allocator; the cap (``set_per_process_memory_fraction``) where the case has one;
2. the model and its batch built on the device (``model``);
3. the plan, where the case has one (``planned``): ``optimize_checkpoints(model, batch,
   calibrate=False)`` (``optimal``: planning on fake tensors, nothing run on the device), or the plan
   ``max_batch`` answered on the H200 (``max_batch``: read from
   ``benchmarks/results/gpu_accuracy/latest-h200-max-batch.json``, applied with ``trace`` and
   ``apply_plan`` as ``gpu_max_batch.py`` does);
4. ``reset_peak_memory_stats``, a first Adam step (forward, loss, backward, step) on the empty cache
   (``step1``: a cold cache, the optimizer's state made);
5. ``reset_peak_memory_stats``, a second step on the cache the first one left (``step2``: warm);
6. ``torch.cuda.memory._snapshot()``; recording stops.

At the end of each phase the process takes a snapshot and keeps: the number of trace events so far,
``memory_allocated``/``memory_reserved``, the phase's ``max_memory_allocated``/``max_memory_reserved``
(peaks reset at the start of each step), ``memory_stats()`` and every segment with its blocks. An
out-of-memory error (``torch.OutOfMemoryError``) ends the case: the trace up to it is kept, with an
``oom`` phase taken where it was caught. The file format is in ``benchmarks/data/cuda_alloc/README.md``.

    python -m benchmarks.cuda_alloc_traces                       # every case, on a CUDA machine
    python -m benchmarks.cuda_alloc_traces --list                # the cases
    python -m benchmarks.cuda_alloc_traces --only gpt            # cases whose name contains "gpt"
    python -m benchmarks.cuda_alloc_traces --dry-run             # CPU smoke run at tiny sizes (no traces)

Six cases run at once (``--jobs``), each in its own process and so with its own allocator. The
cases that plan wait for a warm-up process that compiles ckptopt's numba kernels into numba's cache
(``NUMBA_CACHE_DIR``), about 2 minutes of CPU, while the unplanned cases run. Writes
``<model>.json.gz`` per model (every case of it, rewritten as each case finishes) and ``summary.json``
to ``--out-dir`` (default ``benchmarks/data/cuda_alloc``). The command for a device run is in the
README there. :func:`load` reads a file back without torch.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness import DATA, ROOT, child_args, child_env, child_record, run_child, run_metadata, write_json

OUT_DIR = DATA / "cuda_alloc"
FORMAT = 1
#: trace actions, coded by position in the files
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "snapshot", "oom")
#: block states in the segment lists, coded by position
STATES = ("inactive", "active_allocated", "active_awaiting_free")
ALLOCATORS = {"default": None, "expandable": "expandable_segments:True"}
MAX_ENTRIES = 4_000_000
GiB = 1 << 30
CAP = 8 * GiB
ANSWERS = ROOT / "benchmarks" / "results" / "gpu_accuracy" / "latest-h200-max-batch.json"

LLAMA = dict(num_hidden_layers=4, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=32000)
#: model -> (load spec, keyword arguments; batch_size is the case's)
MODELS = {
    "resnet50": ("resnet50", dict(input_size=224)),  # gpu_accuracy.MAX_BATCH (the zoo's, torchvision's layout)
    "gpt": ("gpt", dict(depth=12, width=768, heads=12, seq_len=512, vocab=50257)),  # gpu_accuracy.MAX_BATCH
    "llama": ("hf:LlamaForCausalLM", dict(seq_len=512, config=LLAMA)),  # hf-llama of gpu_accuracy, 4 layers
    "unet": ("diffusers:UNet2DConditionModel", {}),  # diffusers_models.CONFIGS
}
#: --dry-run sizes (CPU)
SMALL = {
    "resnet50": ("resnet50", dict(input_size=32)),
    "gpt": ("gpt", dict(depth=2, width=64, heads=2, seq_len=32, vocab=128)),
    "llama": ("hf:LlamaForCausalLM", dict(seq_len=32, config=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=256))),
    "unet": ("diffusers:UNet2DConditionModel", {}),
}
BATCHES = {"resnet50": (16, 32, 64), "gpt": (4, 8, 16), "llama": (1, 2, 4), "unet": (4, 16)}
#: (model, batch, plan, allocator): under the 8 GiB cap, around where the H200 runs stopped fitting
#: (benchmarks/results/gpu_max_batch/latest-h200.json)
CAPACITY = [
    ("gpt", 45, "max_batch", "default"),      # the case: OOM on the H200 (1.08 GiB of logits)
    ("gpt", 45, "max_batch", "expandable"),   # fit on the H200
    ("gpt", 38, "max_batch", "default"),      # 40 to 45 OOM on the H200
    ("gpt", 34, "max_batch", "default"),
    ("gpt", 29, "none", "default"),           # fit on the H200
    ("gpt", 30, "none", "default"),           # OOM on the H200
    ("resnet50", 324, "max_batch", "default"),  # OOM in both H200 runs, fit in another
    ("resnet50", 91, "none", "default"),      # fit on the H200 (reserved 8.57 GB of 8.59)
    ("resnet50", 94, "none", "default"),      # OOM on the H200
]


def case_name(model: str, batch: int, plan: str, alloc: str, cap: int | None) -> str:
    return f"{model}-b{batch}-{plan}-{alloc}" + (f"-cap{cap // GiB}g" if cap else "")


def all_cases() -> list[dict]:
    """Every case, the capacity ones first, the UNet's last (the most useful first, should time run out)."""
    cases = [dict(model=m, batch=b, plan=p, alloc=a, cap=CAP) for m, b, p, a in CAPACITY]
    for model in ("gpt", "resnet50", "llama", "unet"):
        for b in BATCHES[model]:
            for plan in ("none", "optimal"):
                for alloc in ALLOCATORS:
                    cases.append(dict(model=model, batch=b, plan=plan, alloc=alloc, cap=None))
    for c in cases:
        c["name"] = case_name(c["model"], c["batch"], c["plan"], c["alloc"], c["cap"])
    return cases


# --------------------------------------------------------------------------
# reading the files (no torch)
# --------------------------------------------------------------------------
def load(path) -> dict:
    """One ``<model>.json.gz``: ``{"format", "meta", "actions", "states", "cases": [...]}``."""
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def trace_files(folder=OUT_DIR) -> list[Path]:
    return sorted(Path(folder).glob("*.json.gz"))


# --------------------------------------------------------------------------
# compacting a snapshot (no torch)
# --------------------------------------------------------------------------
class Compactor:
    """Maps a case's addresses to offsets from one base, streams to small integers, and allocations
    and segments to ids (the ``n``-th ``alloc`` is id ``n``; a free carries its allocation's id)."""

    def __init__(self, base: int):
        self.base = base
        self.streams: dict[int, int] = {}

    def stream(self, s) -> int:
        return self.streams.setdefault(int(s or 0), len(self.streams))

    def events(self, trace: list[dict]) -> tuple[dict, list[dict]]:
        cols: dict[str, list] = dict(action=[], id=[], size=[], stream=[], addr=[])
        ooms, live, segs = [], {}, {}
        n_alloc = n_seg = 0
        for i, e in enumerate(trace):
            action = e["action"]
            addr = e.get("addr")
            off = -1 if addr is None or action in ("oom", "snapshot") else int(addr) - self.base
            ident = -1
            if action == "alloc":
                ident = live[addr] = n_alloc
                n_alloc += 1
            elif action == "free_requested":
                ident = live.get(addr, -1)
            elif action == "free_completed":
                ident = live.pop(addr, -1)
            elif action == "segment_alloc":
                ident = segs[addr] = n_seg
                n_seg += 1
            elif action == "segment_free":
                ident = segs.pop(addr, -1)
            elif action == "oom":
                ooms.append(dict(event=i, size=int(e.get("size", 0)), device_free=e.get("device_free", e.get("addr"))))
            cols["action"].append(ACTIONS.index(action) if action in ACTIONS else -1)
            cols["id"].append(ident)
            cols["size"].append(int(e.get("size", 0)))
            cols["stream"].append(self.stream(e.get("stream")))
            cols["addr"].append(off)
        unknown = sorted({e["action"] for e in trace} - set(ACTIONS))
        if unknown:
            cols["unknown_actions"] = unknown
        return cols, ooms

    def segments(self, segments: list[dict]) -> list[dict]:
        out = []
        for s in sorted(segments, key=lambda s: s["address"]):
            out.append(dict(
                addr=int(s["address"]) - self.base, size=int(s["total_size"]), pool=s.get("segment_type"),
                stream=self.stream(s.get("stream")), expandable=bool(s.get("is_expandable", False)),
                allocated=int(s.get("allocated_size", 0)), active=int(s.get("active_size", 0)),
                blocks=[[int(b["address"]) - self.base, int(b["size"]), STATES.index(b["state"]),
                         int(b.get("requested_size", 0))] for b in s.get("blocks", ())]))
        return out


def base_address(trace: list[dict], snapshots: list[list[dict]]) -> int:
    """The lowest address the case's allocator handed out or reserved (0 when none)."""
    addrs = [int(e["addr"]) for e in trace if e.get("addr") is not None and e["action"] not in ("oom", "snapshot")]
    addrs += [int(s["address"]) for segs in snapshots for s in segs]
    return min(addrs) if addrs else 0


# --------------------------------------------------------------------------
# one case, in its own process
# --------------------------------------------------------------------------
def _load_model(model: str, batch: int, device: str, small: bool):
    spec, kw = (SMALL if small else MODELS)[model]
    if spec.startswith("diffusers:"):
        from benchmarks import diffusers_models

        name = spec.split(":", 1)[1]
        net = diffusers_models.build_model(name).to(device)
        x = {k: v.to(device) for k, v in diffusers_models.make_batch(name, batch).items()}
        return net, x, diffusers_models.loss_fn
    from benchmarks import gpu_accuracy

    return gpu_accuracy._load(spec, dict(kw, batch_size=batch), device)


class _Recorder:
    """The phases of one case on CUDA: a snapshot at the end of each (nothing kept on the CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.phases: list[dict] = []
        self.raw_segments: list[list[dict]] = []

    def phase(self, name: str, **extra) -> None:
        import torch

        row = dict(name=name, **extra)
        if self.cuda:
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            dev = torch.cuda.current_device()
            row.update(event=len(snap["device_traces"][dev]), allocated=torch.cuda.memory_allocated(),
                       reserved=torch.cuda.memory_reserved(), max_allocated=torch.cuda.max_memory_allocated(),
                       max_reserved=torch.cuda.max_memory_reserved(), stats=dict(torch.cuda.memory_stats()))
            self.raw_segments.append([s for s in snap["segments"] if s.get("device", dev) == dev])
        else:
            self.raw_segments.append([])
        self.phases.append(row)
        print(f"  {name}: {row.get('allocated')} allocated, {row.get('reserved')} reserved", flush=True)

    def reset_peaks(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()


def _plan_module(model, x, loss, plan: str, payload: dict):
    """The module trained, and the plan applied (checkpoints, stored segments, layer count)."""
    if plan == "none":
        return model, dict(checkpoints=[], stored=[])
    if plan == "optimal":
        from ckptopt import optimize_checkpoints

        module = optimize_checkpoints(model, x, loss_fn=loss, calibrate=False)
        p = module.plan
        return module, dict(checkpoints=list(p.checkpoints), stored=list(p.stored), n=p.n, solver=p.solver,
                            predicted_peak_bytes=int(p.peak_bytes))
    from benchmarks import gpu_accuracy
    from ckptopt import apply_plan, trace

    tm = trace(model, x, loss_fn=loss)
    if payload.get("n") is not None and tm.n != payload["n"]:
        raise RuntimeError(f"the max_batch plan is for {payload['n']} layers, the trace has {tm.n}")
    module = apply_plan(model, tm, gpu_accuracy._plan(tm.n, payload["checkpoints"], payload["stored"]))
    return module, dict(checkpoints=list(payload["checkpoints"]), stored=list(payload["stored"]), n=tm.n,
                        predicted_peak_bytes=payload.get("predicted"))


def _device_facts(device: str, cap: int | None) -> dict:
    import torch

    facts = dict(torch=torch.__version__, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    if not device.startswith("cuda"):
        return facts
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info()
    facts.update(cuda=torch.version.cuda, device_name=props.name, total_memory=int(props.total_memory),
                 mem_get_info_total=int(total), free_at_start=int(free), allocator_backend=
                 torch.cuda.get_allocator_backend() if hasattr(torch.cuda, "get_allocator_backend") else None)
    if cap:
        fraction = min(1.0, cap / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        # the allocator's limit: static_cast<size_t>(fraction * total) (cudaMemGetInfo's total)
        facts.update(cap_requested=cap, cap_fraction=fraction, cap_bytes=int(fraction * total))
    return facts


def warm_up(models=("gpt", "resnet50", "llama")) -> dict:
    """Plan each model at its --dry-run size on the CPU: numba compiles ckptopt's kernels once and
    caches them (``cache=True``), so the cases that plan, started after it, do not each compile them."""
    import glob

    import ckptopt

    t0 = time.perf_counter()
    for model in models:
        net, x, loss = _load_model(model, 2, "cpu", True)
        ckptopt.optimize_checkpoints(net, x, loss_fn=loss, calibrate=False)
    where = os.environ.get("NUMBA_CACHE_DIR") or os.path.dirname(ckptopt.__file__)
    return dict(seconds=round(time.perf_counter() - t0, 1),
                cached=len(glob.glob(os.path.join(where, "**", "*.nbi"), recursive=True)))


def run_case(payload: dict) -> dict:
    import torch

    if payload.get("warm"):
        return warm_up()

    from benchmarks import gpu_accuracy

    device, small = payload["device"], payload.get("small", False)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=MAX_ENTRIES)
    facts = _device_facts(device, payload["cap"])
    rec = _Recorder(cuda)
    rec.phase("start")
    t0 = time.perf_counter()
    model, x, loss = _load_model(payload["model"], payload["batch"], device, small)
    rec.phase("model")
    oom, steps_s = None, []
    module, plan = _plan_module(model, x, loss, payload["plan"], payload)
    if payload["plan"] != "none":
        rec.phase("planned")
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    for step in ("step1", "step2"):
        rec.reset_peaks()
        t = time.perf_counter()
        try:
            opt.zero_grad(set_to_none=True)
            gpu_accuracy._loss_of(module, x, loss).backward()
            opt.step()
        except torch.OutOfMemoryError as exc:  # (its traceback, and the step's tensors, go at the block's end)
            oom = dict(phase=step, message=str(exc).splitlines()[0][:300])
        steps_s.append(round(time.perf_counter() - t, 3))
        rec.phase("oom" if oom else step)
        if oom:
            break
    snap = torch.cuda.memory._snapshot() if cuda else dict(device_traces=[[]], segments=[])
    if cuda:
        torch.cuda.memory._record_memory_history(enabled=None)
    dev = torch.cuda.current_device() if cuda else 0
    trace = snap["device_traces"][dev] if cuda else []
    final = [s for s in snap["segments"] if s.get("device", dev) == dev]
    return dict(
        name=payload["name"], model=payload["model"], batch=payload["batch"], plan_kind=payload["plan"],
        allocator=payload["alloc"], plan=plan, **facts, max_entries=MAX_ENTRIES, oom=oom,
        **compact_case(trace, rec.phases, rec.raw_segments, final),
        step_seconds=steps_s, seconds=round(time.perf_counter() - t0, 2))


def compact_case(trace: list[dict], phases: list[dict], raw_segments: list[list[dict]], final: list[dict]) -> dict:
    """The file's form of a recorded trace (``_snapshot()["device_traces"][device]``), of the segments
    (``_snapshot()["segments"]``) taken at the end of each phase (``phases`` gain ``segments``), and of
    the final segments."""
    comp = Compactor(base_address(trace, raw_segments + [final]))
    events, ooms = comp.events(trace)
    for row, segs in zip(phases, raw_segments):
        row["segments"] = comp.segments(segs)
    return dict(trace_complete=len(trace) < MAX_ENTRIES, oom_events=ooms, phases=phases,
                final_segments=comp.segments(final), streams={str(k): v for k, v in comp.streams.items()},
                events=events, n_events=len(trace))


# --------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------
def _max_batch_plans() -> dict:
    """model -> the plan max_batch answered under 8 GiB on the H200 (the optimal strategy)."""
    res = json.loads(ANSWERS.read_text())["max_batch"]
    out = {}
    for model, entry in res.items():
        fit = entry["search"]["result"]["optimal"]
        out[model] = dict(checkpoints=fit["checkpoints"], stored=fit["stored"], predicted=fit["peak_bytes"],
                          answer=fit["batch"])
    return out


def summary_row(rec: dict) -> dict:
    """What a reader wants of a case at a glance."""
    steps = [p for p in rec.get("phases", ()) if p["name"] in ("step1", "step2", "oom")]
    life = [p for p in rec.get("phases", ()) if "max_reserved" in p]
    return dict(name=rec.get("name"), oom=rec.get("oom"), n_events=rec.get("n_events"),
                max_reserved=max((p["max_reserved"] for p in life), default=None),
                max_allocated=max((p["max_allocated"] for p in life), default=None),
                steps={p["name"]: dict(max_reserved=p.get("max_reserved"), max_allocated=p.get("max_allocated"))
                       for p in steps},
                checkpoints=len(rec.get("plan", {}).get("checkpoints", ())), seconds=rec.get("seconds"),
                error=rec.get("error"))


def _write_model_file(out_dir: Path, model: str, meta: dict, records: list[dict]) -> None:
    data = dict(format=FORMAT, meta=meta, actions=list(ACTIONS), states=list(STATES),
                cases=sorted(records, key=lambda r: r["name"]))
    path = out_dir / f"{model}.json.gz"
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", compresslevel=9) as fh:
        json.dump(data, fh, separators=(",", ":"))
    os.replace(tmp, path)


def main(argv=None) -> int:
    child = child_args(argv)
    if child:
        path, (payload,) = child
        child_record(path, run_case, json.loads(payload), name=json.loads(payload).get("name", "warm-up"))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    ap.add_argument("--only", help="comma-separated substrings: the cases whose name contains one")
    ap.add_argument("--skip", help="comma-separated substrings: leave out the cases whose name contains one")
    ap.add_argument("--jobs", type=int, default=6, help="cases at once, each its own process (6)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per case (240)")
    ap.add_argument("--deadline", type=float, help="start no case after this many seconds")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, batch 2: the code paths, no traces")
    args = ap.parse_args(argv)
    cases = all_cases()
    if args.only:
        cases = [c for c in cases if any(s in c["name"] for s in args.only.split(","))]
    if args.skip:
        cases = [c for c in cases if not any(s in c["name"] for s in args.skip.split(","))]
    cases.sort(key=lambda c: (c["plan"] != "none", c["model"] == "unet"))  # (stable: capacity cases first)
    if args.list:
        for c in cases:
            print(c["name"])
        return 0
    device = "cpu" if args.dry_run else "cuda"
    plans = _max_batch_plans()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata("cuda_alloc_traces", device)
    by_model: dict[str, list[dict]] = {}
    summary: list[dict] = []
    lock = threading.Lock()
    t_start = time.perf_counter()

    warm = threading.Event()

    def warm_up_child() -> None:  # (numba's cache, in a process of its own, while the unplanned cases run)
        ch = run_child("benchmarks.cuda_alloc_traces", [json.dumps(dict(warm=True))], timeout=args.timeout * 3,
                       env=child_env(threads="2"))
        print(f"[{time.perf_counter() - t_start:6.1f}s] warm-up: {ch.record or ch.failure}", flush=True)
        warm.set()

    def one(case: dict) -> None:
        if case["plan"] != "none":
            warm.wait()
        if args.deadline and time.perf_counter() - t_start > args.deadline:
            print(case["name"], "skipped (deadline)", flush=True)
            return
        payload = dict(case, device=device, small=args.dry_run)
        if args.dry_run:
            payload.update(batch=2, cap=None)
        if case["plan"] == "max_batch":
            payload.update(plans[case["model"]])
            if args.dry_run:
                payload["plan"] = "optimal"
        env = child_env(threads="2")  # ckptopt as this process finds it (PYTHONPATH; CKPTOPT_SWEEP_COMMIT)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if ALLOCATORS[case["alloc"]]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS[case["alloc"]]
        ch = run_child("benchmarks.cuda_alloc_traces", [json.dumps(payload)], timeout=args.timeout, env=env)
        rec = ch.record or dict(name=case["name"], error=ch.failure, output_tail=ch.output[-1500:])
        rec.setdefault("name", case["name"])
        row = summary_row(rec)
        row["wall_seconds"] = round(ch.seconds, 1)
        with lock:
            summary.append(row)
            if "error" not in rec:
                by_model.setdefault(case["model"], []).append(rec)
                _write_model_file(out_dir, case["model"], meta, by_model[case["model"]])
            else:
                print(rec.get("traceback", rec.get("output_tail", ""))[-1500:], flush=True)
            write_json(out_dir / "summary.json", dict(meta=meta, cases=sorted(summary, key=lambda r: r["name"])))
            print(f"[{time.perf_counter() - t_start:6.1f}s] {case['name']}: "
                  f"{'ERROR ' + str(rec['error'])[:200] if 'error' in rec else ''}"
                  f"reserved {row['max_reserved']} allocated {row['max_allocated']} "
                  f"{'OOM in ' + rec['oom']['phase'] if rec.get('oom') else 'fits'} events {row['n_events']} "
                  f"({row['wall_seconds']} s)", flush=True)

    if any(c["plan"] != "none" for c in cases):
        threading.Thread(target=warm_up_child, daemon=True).start()
    else:
        warm.set()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, cases))
    print(f"wrote {out_dir}: {sum(len(v) for v in by_model.values())} cases of {len(cases)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
