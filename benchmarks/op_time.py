"""What each operator without a FLOP formula costs per element, against the matrix products' FLOP rate.

    python -m benchmarks.op_time                 # -> benchmarks/results/op_time/latest.json
    python -m benchmarks.op_time --write-table   # also src/ckptopt/data/op_time_<device>.json
    python -m benchmarks.op_time --fresh-pages   # what first-touch memory costs -> latest-fresh-pages.json

The tracer prices a layer's compute (``ChainCosts.c``, ``cb``) as the FLOPs of its products plus, for
every other operator, its time per element converted to FLOP-equivalents at the product rate
(``ckptopt.tracer.op_time``). This benchmark measures that table: one thread, real tensors, a training
step (forward, the model's loss, backward) of each model below, every operator timed as it runs
(``perf_counter`` around the call inside a dispatch mode; one warm-up step, then ``--steps`` timed ones).
Per operator: its total time over its total elements (``op_time.elements``: the larger of its output and
its largest tensor input, the output for gathers); the product rate: the FLOPs
``torch.utils.flop_counter`` counts for the same steps over the time of the operators it has formulas
for. Views cost nothing and are left out, as the counter leaves them out.

Models: the frontier's transformers models (GPT-2, Llama, BERT, T5; 2 layers, width 512, batch 4 x 512,
training mode with the configs' dropout) and the zoo's ResNet-18 (batch 8, 64 px) and U-Net (batch 2, 64
px), so that norms, pooling and upsampling are measured too. The per-model rows let a reader see how far
one operator's time per element moves between models (cache sizes, layouts).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import ROOT, result_path, run_metadata, write_json
from ckptopt.tracer.flops import formula_ops
from ckptopt.tracer.op_time import elements

TRANSFORMERS = ("GPT2LMHeadModel", "LlamaForCausalLM", "BertForMaskedLM", "T5ForConditionalGeneration")
VIEWS = "<views>"  # the stats key of every view operator: what a call costs that does no work
MIN_ELEMENTS_PER_CALL = 4096
ZOO = {"resnet18": dict(batch_size=8, input_size=64), "unet": dict(batch_size=2, input_size=64)}


def models(small: bool):
    """``(name, step)`` per model: ``step()`` runs one forward, loss and backward."""
    from benchmarks import frontier
    from ckptopt import zoo

    sizes = dict(frontier.SMALL) if small else dict(frontier.FULL, layers=2)
    for name in TRANSFORMERS:
        model, batch = frontier.build(name, sizes)
        yield name, (lambda m=model, b=batch: m(**b).loss.backward())
    for name, kw in ZOO.items():
        if small:
            kw = dict(kw, input_size=32)
        model, inputs = zoo.get(name, **kw)
        yield name, (lambda m=model, x=inputs: m(*x).float().pow(2).mean().backward())


class _Timer(TorchDispatchMode):
    """Times every operator call: per overload packet, seconds, elements and calls."""

    def __init__(self):
        super().__init__()
        self.stats = collections.defaultdict(lambda: [0.0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - start
        name = str(func._overloadpacket)
        s = self.stats[VIEWS if func.is_view else name]
        s[0] += seconds
        s[1] += 0 if func.is_view else elements(name, (args, kwargs), out)
        s[2] += 1
        return out


def measure(step, steps: int) -> dict:
    """One model's operators: ``{op: [seconds, elements, calls]}`` over ``steps`` steps, and its FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    step()  # warm-up
    with FlopCounterMode(display=False) as counter:
        step()
    flops = int(counter.get_total_flops())
    timer = _Timer()
    with timer:
        for _ in range(steps):
            step()
    return dict(stats={k: list(v) for k, v in timer.stats.items()}, flops=flops * steps)


def summarise(per_model: dict) -> dict:
    """The table: ns per element per non-product operator over every model, and the product rate.

    A call's time is the operator's work plus a fixed cost of the call (dispatch, and this benchmark's own
    timing inside a dispatch mode), taken as a view's time per call, which does no work. The table gives
    the time above it per element, and lists only operators seen on tensors of at least
    :data:`MIN_ELEMENTS_PER_CALL` elements on average: one seen only on a few elements (a loss's seed
    gradient, a scalar) measures the fixed cost, not a rate, and the tracer prices it at the median of the
    table."""
    products = formula_ops()
    seconds = collections.defaultdict(float)
    count = collections.defaultdict(int)
    calls = collections.defaultdict(int)
    product_seconds = 0.0
    product_flops = 0
    view_seconds, view_calls = 0.0, 0
    for rec in per_model.values():
        product_flops += rec["flops"]
        for name, (s, n, k) in rec["stats"].items():
            if name == VIEWS:
                view_seconds += s
                view_calls += k
            elif name in products:
                product_seconds += s
            else:
                seconds[name] += s
                count[name] += n
                calls[name] += k
    rate = product_flops / product_seconds
    per_call = view_seconds / max(view_calls, 1)
    ns = {}
    for name in sorted(seconds):
        if count[name] >= MIN_ELEMENTS_PER_CALL * calls[name]:
            ns[name] = round(1e9 * max(0.0, seconds[name] - per_call * calls[name]) / count[name], 4)
    return dict(ns_per_element=ns, product_flops_per_second=round(rate), product_seconds=product_seconds,
                product_flops=product_flops, seconds_per_call=per_call,
                left_out=sorted(set(seconds) - set(ns)))


def fresh_pages(mib: int = 64, rounds: int = 15) -> dict:
    """What touching memory for the first time costs: a fill and an addition into a fresh tensor of ``mib``
    MiB against the same into one already held (medians of ``rounds``). On Linux a large CPU allocation is
    mapped fresh each time, so the first write to each page faults."""
    n = mib * 2**20 // 4
    held = torch.empty(n)

    def median(fn) -> float:
        fn()
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    fill_fresh, fill_held = median(lambda: torch.empty(n).fill_(1.0)), median(lambda: held.fill_(1.0))
    add_fresh, add_held = median(lambda: held + held), median(lambda: torch.add(held, held, out=held))
    return dict(mib=mib, rounds=rounds, fill_fresh_s=fill_fresh, fill_held_s=fill_held, add_fresh_s=add_fresh,
                add_held_s=add_held, fresh_ns_per_byte=1e9 * (fill_fresh - fill_held) / (4 * n))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model (default 3)")
    ap.add_argument("--small", action="store_true", help="tiny sizes, a smoke run (latest-small.json)")
    ap.add_argument("--write-table", action="store_true",
                    help="also write the table the tracer reads, src/ckptopt/data/op_time_cpu.json")
    ap.add_argument("--fresh-pages", action="store_true",
                    help="only measure what first-touch memory costs (latest-fresh-pages.json); the table is untouched")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.fresh_pages:
        rec = fresh_pages()
        write_json(result_path("op_time", "fresh-pages"), dict(run_metadata("op_time", "cpu"), **rec))
        print(f"{rec['mib']} MiB: fill fresh {1e3 * rec['fill_fresh_s']:.2f} ms, held {1e3 * rec['fill_held_s']:.2f} ms; "
              f"add into fresh {1e3 * rec['add_fresh_s']:.2f} ms, held {1e3 * rec['add_held_s']:.2f} ms; "
              f"first touch {rec['fresh_ns_per_byte']:.3f} ns per byte")
        return
    per_model = {}
    for name, step in models(args.small):
        t0 = time.perf_counter()
        per_model[name] = measure(step, args.steps)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    table = summarise(per_model)
    rows = {}
    for name, rec in per_model.items():
        for op, (s, n, calls) in rec["stats"].items():
            if n > 0 and op in table["ns_per_element"]:
                above = max(0.0, s - table["seconds_per_call"] * calls)
                rows.setdefault(op, {})[name] = round(1e9 * above / n, 4)
    out = dict(run_metadata("op_time", "cpu"), steps=args.steps, small=args.small, table=table,
               per_model_ns_per_element=rows,
               per_model_seconds={m: {op: round(v[0] / args.steps, 6) for op, v in rec["stats"].items()}
                                  for m, rec in per_model.items()})
    write_json(result_path("op_time", "small" if args.small else None), out)
    rate = table["product_flops_per_second"]
    print(f"products: {rate / 1e9:.1f} GFLOP/s; a call: {1e6 * table['seconds_per_call']:.1f} us; "
          f"left out (seen on small tensors only): {', '.join(table['left_out'])}")
    for op, ns in sorted(table["ns_per_element"].items(), key=lambda kv: -kv[1]):
        spread = rows.get(op, {})
        lo, hi = (min(spread.values()), max(spread.values())) if spread else (ns, ns)
        print(f"  {op:48s} {ns:8.3f} ns/element = {ns * 1e-9 * rate:8.1f} FLOP-eq  (models {lo:.3f}-{hi:.3f})")
    if args.write_table:
        if args.small:
            raise SystemExit("--write-table needs the full sizes (drop --small)")
        meta = out
        data = dict(device_type="cpu", threads=1, torch=meta["torch"], date=meta["date"],
                    machine=meta["machine"], command=meta["command"], ckptopt_commit=meta.get("ckptopt_commit"),
                    product_flops_per_second=rate, ns_per_element=table["ns_per_element"])
        path = Path(ROOT) / "src" / "ckptopt" / "data" / "op_time_cpu.json"
        write_json(path, data)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
