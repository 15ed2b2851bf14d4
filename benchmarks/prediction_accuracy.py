"""Predicted against measured peak memory of one training step, for every zoo model.

For each model (CPU-friendly sizes, below), with no checkpointing:

* **whole model**: the peak predicted by the chain model of the traced graph
  (``ckptopt.tracer.trace`` -> ``ckptopt.simulate(costs, ())``) against the
  peak measured by ``ckptopt.measure.measure_peak`` (exact CPU storage tracker,
  real tensors), and the relative error ``(predicted - measured) / measured``;
* **per layer**: every traced layer (measured by the tracer on FAKE tensors)
  is rebuilt from the real ``tm.gm`` and measured again in isolation on REAL
  tensors with ``ckptopt.tracer.measure_layer``, its input being the real
  value of the layer's input node (an ``fx.Interpreter`` run of ``tm.gm`` on the
  example inputs records every node's output). Reported: the largest absolute
  and relative differences of ``a, f, b, m`` (and which layer), whether
  ``p``, ``sin`` and ``sout`` agree everywhere.

Models are chains (vgg16, vgg19, mlp: target |error| <= 2%) or DAGs (resnets,
densenet121, mobilenet_v2, unet, gpt: target <= 5%). Writes
``benchmarks/results/prediction_accuracy/latest.json`` (``--quick``: ``latest-quick.json``) and
prints a Markdown table.

    python -m benchmarks.prediction_accuracy            # all zoo models
    python -m benchmarks.prediction_accuracy --quick    # resnet18, mlp, gpt
    python -m benchmarks.prediction_accuracy --models vgg16 unet
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import time
from pathlib import Path

import torch
import torch.fx as fx

from benchmarks.harness import result_path, run_metadata, write_json
from ckptopt import simulate, zoo
from ckptopt.measure import measure_peak
from ckptopt.tracer import measure_layer, trace
from ckptopt.tracer.cuts import WithLoss, subgraph_module

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - optional
    tqdm = None


CHAIN, DAG = "chain", "DAG"
TARGET = {CHAIN: 0.02, DAG: 0.05}

# name -> (kind, zoo.get keyword arguments); each real step is a few seconds on 2 cores.
CONFIGS: dict[str, tuple[str, dict]] = {
    "vgg16": (CHAIN, dict(batch_size=4, input_size=64)),
    "vgg19": (CHAIN, dict(batch_size=4, input_size=64)),
    "mlp": (CHAIN, dict(batch_size=64, width=1024, depth=8)),
    "resnet18": (DAG, dict(batch_size=8, input_size=64)),
    "resnet50": (DAG, dict(batch_size=4, input_size=64)),
    "resnet101": (DAG, dict(batch_size=4, input_size=64)),
    "resnet152": (DAG, dict(batch_size=2, input_size=64)),
    "densenet121": (DAG, dict(batch_size=4, input_size=64)),
    "mobilenet_v2": (DAG, dict(batch_size=8, input_size=64)),
    "unet": (DAG, dict(batch_size=2, input_size=64, base=32)),
    "gpt": (DAG, dict(batch_size=4, depth=4, width=128, heads=4, seq_len=128, vocab=1000)),
}
QUICK = ["resnet18", "mlp", "gpt"]
FIELDS = ("a", "f", "b", "m")


class _Recorder(fx.Interpreter):
    """Runs a GraphModule (with grad) and keeps every node's output, detached,
    and whether it requires grad (a layer whose input does not, e.g. the first
    one, computes no input gradient)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}
        self.requires_grad: dict[fx.Node, bool] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.requires_grad[n] = out.requires_grad
            self.values[n] = out.detach()
        else:
            self.values[n] = out
        return out


# measure_layer(..., input_requires_grad=) is what the tracer passes; older versions lack it
_HAS_RG = "input_requires_grad" in inspect.signature(measure_layer).parameters


def real_layer_measurements(tm, inputs) -> list:
    """Each traced layer rebuilt from ``tm.gm`` and measured on real tensors."""
    gm = tm.gm
    buffers = [b.detach().clone() for b in gm.buffers()]  # the run below updates BN running stats
    rec = _Recorder(gm)
    with torch.enable_grad():
        rec.run(*inputs)
    for b, saved in zip(gm.buffers(), buffers):
        b.copy_(saved)
    values = rec.values
    by_name = {n.name: n for n in gm.graph.nodes}
    model_output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    single_output = isinstance(model_output, fx.Node) and isinstance(values.get(model_output), torch.Tensor)

    layers = tm.layers
    model_layers = [l for l in layers if l.nodes != ("<loss>",)]
    out = []
    for j, layer in enumerate(layers):
        x = values[by_name[layer.input_node]]
        if layer.nodes == ("<loss>",):
            module = WithLoss(None, tm.loss_fn)
        else:
            last = j == len(model_layers) - 1
            output = model_output if last else by_name[layers[j + 1].input_node]
            members = [by_name[name] for name in layer.nodes]
            body = subgraph_module(gm, members, by_name[layer.input_node], output, values)
            module = WithLoss(body, tm.loss_fn) if (last and not single_output) else body
        gc.collect()
        kw = dict(input_requires_grad=rec.requires_grad.get(by_name[layer.input_node], False)) if _HAS_RG else {}
        out.append(measure_layer(module, x, **kw))
        del module, x
    del values, rec
    gc.collect()
    return out


def compare_layers(tm, real) -> dict:
    res: dict = {}
    for f in FIELDS:
        best = (0, 0.0, None, None, None)  # abs diff, rel diff, layer, fake, real
        best_rel = (0.0, None)
        for layer, r in zip(tm.layers, real):
            fv, rv = getattr(layer.costs, f), getattr(r, f)
            d = abs(fv - rv)
            rel = d / rv if rv else (0.0 if d == 0 else float("inf"))
            if d > best[0]:
                best = (d, rel, f"{layer.index}:{layer.name}", fv, rv)
            if rel > best_rel[0]:
                best_rel = (rel, f"{layer.index}:{layer.name}")
        res[f] = dict(max_abs=best[0], at=best[2], fake=best[3], real=best[4],
                      max_rel=best_rel[0], max_rel_at=best_rel[1],
                      n_differ=sum(getattr(l.costs, f) != getattr(r, f) for l, r in zip(tm.layers, real)))
    res["p_agree"] = all(l.costs.p == r.p for l, r in zip(tm.layers, real))
    mism = [f"{l.index}:{l.name}" for l, r in zip(tm.layers, real) if (l.costs.sin, l.costs.sout) != (r.sin, r.sout)]
    res["sin_sout_agree"] = not mism
    res["sin_sout_mismatch"] = mism
    return res


def run_model(name: str, kind: str, kw: dict) -> dict:
    model, inputs = zoo.get(name, **kw)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    tm = trace(model, inputs)
    t_trace = time.perf_counter() - t0
    sim = simulate(tm.costs, ())
    predicted = sim.peak_bytes
    t0 = time.perf_counter()
    measured = measure_peak(model, inputs)
    t_step = time.perf_counter() - t0
    rel = (predicted - measured) / measured
    t0 = time.perf_counter()
    real = real_layer_measurements(tm, inputs)
    t_layers = time.perf_counter() - t0
    layers = compare_layers(tm, real)
    row = dict(
        model=name, kind=kind, config=kw, params=n_params, n=tm.n,
        opaque_modules=dict(tm.opaque_modules),
        predicted_bytes=int(predicted), measured_bytes=int(measured), rel_error=rel,
        predicted_peak_phase=sim.phase, predicted_peak_layer=sim.layer,
        target=TARGET[kind], within_target=abs(rel) <= TARGET[kind],
        layers=layers,
        seconds=dict(trace=t_trace, measure_peak=t_step, per_layer=t_layers),
    )
    # per-layer figures, for investigating a miss
    row["per_layer"] = [
        dict(index=l.index, name=l.name, nodes=len(l.nodes),
             fake=dict(a=l.costs.a, p=l.costs.p, sin=l.costs.sin, sout=l.costs.sout, m=l.costs.m,
                       f=l.costs.f, b=l.costs.b),
             real=dict(a=r.a, p=r.p, sin=r.sin, sout=r.sout, m=r.m, f=r.f, b=r.b))
        for l, r in zip(tm.layers, real)
    ]
    del tm, model, inputs, real
    gc.collect()
    return row


def mib(x: int) -> str:
    return f"{x / 2**20:.2f}"


def pct(x: float) -> str:
    return "inf" if x == float("inf") else f"{100 * x:.2g}%"


def table(rows: list[dict]) -> str:
    head = ("| model | kind | n | predicted MiB | measured MiB | rel. error | target | ok | "
            "max |Δ| a / f / b / m (bytes) | max rel Δ a / f / b / m | p, sin/sout agree |")
    lines = [head, "|" + "|".join(["---"] * 11) + "|"]
    for r in rows:
        L = r["layers"]
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['n']} | {mib(r['predicted_bytes'])} | {mib(r['measured_bytes'])} "
            f"| {100 * r['rel_error']:+.3f}% | {100 * r['target']:.0f}% | {'yes' if r['within_target'] else '**NO**'} "
            f"| {' / '.join(str(L[f]['max_abs']) for f in FIELDS)} "
            f"| {' / '.join(pct(L[f]['max_rel']) for f in FIELDS)} "
            f"| {'yes' if L['p_agree'] else 'NO'}, {'yes' if L['sin_sout_agree'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--models", nargs="+", choices=list(CONFIGS), help="run only these")
    ap.add_argument("--out", type=Path, help="default benchmarks/results/prediction_accuracy/latest.json "
                    "(latest-quick.json with --quick)")
    args = ap.parse_args()
    args.out = args.out or Path(result_path("prediction_accuracy", "quick" if args.quick else None))
    names = args.models or (QUICK if args.quick else list(CONFIGS))
    missing = [n for n in zoo.names() if n not in CONFIGS]
    if missing:
        print(f"warning: zoo models without a configuration here: {missing}", file=sys.stderr)

    torch.manual_seed(0)
    t_all = time.perf_counter()
    rows = []
    it = tqdm(names, desc="models", file=sys.stderr) if tqdm else names
    for name in it:
        kind, kw = CONFIGS[name]
        if tqdm:
            it.set_postfix_str(name)
        rows.append(run_model(name, kind, kw))
        r = rows[-1]
        msg = (f"{name}: n={r['n']} predicted {mib(r['predicted_bytes'])} MiB, measured "
               f"{mib(r['measured_bytes'])} MiB, error {100 * r['rel_error']:+.3f}% "
               f"({', '.join(f'{k} {v:.1f}s' for k, v in r['seconds'].items())})")
        (tqdm.write(msg, file=sys.stderr) if tqdm else print(msg, file=sys.stderr))
    total = time.perf_counter() - t_all

    result = dict(
        **run_metadata("prediction_accuracy"),
        targets={"chain": TARGET[CHAIN], "DAG": TARGET[DAG]},
        total_seconds=total,
        all_within_target=all(r["within_target"] for r in rows),
        models=rows,
    )
    write_json(args.out, result)
    print(table(rows))
    print()
    bad = [r["model"] for r in rows if not r["within_target"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} models within target"
          + (f"; missed: {', '.join(bad)}" if bad else "") + f". Total {total:.0f} s. Wrote {args.out}")


if __name__ == "__main__":
    main()
