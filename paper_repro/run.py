"""The pipeline behind ``python -m paper_repro``: run, write JSON, Markdown and PNGs."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from . import experiments, figures, report
from .config import MODES, ModeConfig
from .env import run_metadata

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m paper_repro",
        description="Re-run the experiments of Hong et al. (arXiv 2502.12499) on ckptopt's zoo: "
                    "peak memory per strategy (Table 1), solver cost (Table 2), time overhead (Table 3), "
                    "figures (a) memory timeline, (b) peak against batch size, (c) solver time against n.")
    ap.add_argument("--quick", action="store_true", help="small sizes for a 2-core CPU (under 10 minutes)")
    ap.add_argument("--mode", choices=sorted(MODES), default=None,
                    help="quick, full (paper-like sizes, default) or tiny (the smoke test's)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: paper_repro/results/<device>-<mode>)")
    ap.add_argument("--models", nargs="+", default=None, help="only these zoo names (e.g. resnet50 gpt)")
    ap.add_argument("--no-readme", action="store_true",
                    help="do not refresh the tables in paper_repro/README.md (done only for the default --out)")
    args = ap.parse_args(argv)
    if args.quick and args.mode not in (None, "quick"):
        ap.error("--quick and --mode disagree")
    args.mode = "quick" if args.quick else (args.mode or "full")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available to this torch build "
                 f"({torch.__version__}); use --device cpu")
    if args.device not in ("cpu",) and not args.device.startswith("cuda"):
        ap.error(f"--device must be cpu or cuda, got {args.device!r}")
    return args


def effective_mode(args) -> ModeConfig:
    """The mode's configuration, adjusted to the device and the --models filter."""
    mode = MODES[args.mode]
    if args.mode == "full" and args.device == "cpu":
        # paper-like sizes do not run in reasonable time on a CPU: measure the peaks on fake
        # tensors (same byte counts, nothing allocated) and skip the step-time table
        mode = replace(mode, measure="fake", timing_rounds=0)
    if args.models:
        keep = tuple(m for m in mode.models if m.zoo_name in args.models)
        if not keep:
            raise SystemExit(f"--models {args.models}: none of them is in mode {mode.name!r} "
                             f"({', '.join(m.zoo_name for m in mode.models)})")
        mode = replace(mode, models=keep)
    return mode


def write_json(path: Path, meta: dict, payload) -> None:
    path.write_text(json.dumps(experiments.as_json(dict(meta=meta, results=payload)), indent=1) + "\n")


def captions(meta: dict, timeline: dict, sweep: dict, scaling: dict) -> dict:
    how = timeline["measured_with"]
    return {
        "a": (f"**(a)** Memory during one training step of {timeline['label']} ({timeline['size_text']}), for no "
              f"checkpointing, sqrt and the optimal (dp) plan. Coloured line: live bytes after every operator, "
              f"measured ({how} tensors, exact storage tracker). Black steps: the predicted memory of each "
              f"layer event (`ckptopt.simulator.timeline.simulate_timeline`: forward, recomputation, backward), at the "
              f"high point of the event. The x axis is the measured operator index divided by the number of "
              f"operators in the step; predicted events are placed on it where the measured run started the "
              f"layer (a forward pre-hook on the layer's first module, in forward and in recomputation); "
              f"layers without a module and backward layers are spread over the operators between those "
              f"anchors in proportion to their forward operator counts. Red bands: recomputation; dotted "
              f"line: end of the forward pass; dashed: static bytes."),
        "b": (f"**(b)** Peak memory of one training step against batch size for every strategy, "
              f"{sweep['model']} ({sweep['sizes']}). Lines: measured ({sweep['measured_with']} tensors); "
              f"crosses: predicted. Dashed: parameters, buffers, input and parameter gradients."),
        "c": ("**(c)** Solve time against n on random additive instances (log-log; median of "
              f"{scaling['repeats']} interleaved runs per n; fitted slopes in the legend; solvers "
              f"{'returned the same optimal peak at every n' if not scaling['solvers_disagree'] else 'DISAGREED at some n, see the JSON'})."),
    }


def update_readme(out: Path, tag: str, text: str) -> bool:
    """Replace the block between ``<!-- results:TAG:start -->`` and ``...:end -->`` in the README."""
    if not README.exists():
        return False
    src = README.read_text()
    start, end = f"<!-- results:{tag}:start -->", f"<!-- results:{tag}:end -->"
    if start not in src or end not in src:
        return False
    rel = out.resolve().relative_to(HERE)
    text = re.sub(r"!\[(\w+)\]\((\S+?)\)", lambda m: f"![{m.group(1)}]({rel.as_posix()}/{m.group(2)})", text)
    new = src.split(start)[0] + start + "\n" + text + "\n" + end + src.split(end, 1)[1]
    README.write_text(new)
    return True


def _loadavg() -> list | None:
    """1, 5 and 15-minute load averages (other tenants of a shared machine slow the run)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = effective_mode(args)
    tag = f"{'cuda' if args.device.startswith('cuda') else 'cpu'}-{mode.name}"
    out = args.out or HERE / "results" / tag
    out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata(mode.name, args.device, mode.measure)
    t0, c0 = time.perf_counter(), time.process_time()
    meta["load_average_at_start"] = _loadavg()
    experiments.log(f"paper_repro: mode {mode.name}, device {args.device}, peaks on {mode.measure} tensors -> {out}")

    models = []
    for cfg in mode.models:
        experiments.log(f"[{cfg.label}] {cfg.describe()}")
        models.append(experiments.run_model(cfg, args.device, mode.measure, mode.timing_rounds, mode.solver_repeats))
    experiments.log("[figure a] timeline")
    tl = experiments.timeline(mode.timeline_model, args.device, mode.measure)
    experiments.log("[figure b] batch sweep")
    sweep_how = "fake" if args.device == "cpu" and mode.name != "tiny" else mode.measure
    sweep = experiments.batch_sweep(mode.sweep_model, mode.sweep_kwargs, mode.sweep_batches, args.device, sweep_how)
    experiments.log("[figure c] solver scaling")
    scaling = experiments.solver_scaling(mode.scaling_sizes, mode.scaling_repeats)
    meta["wall_seconds"] = round(time.perf_counter() - t0, 1)
    meta["process_cpu_seconds"] = round(time.process_time() - c0, 1)
    meta["load_average_at_end"] = _loadavg()

    write_json(out / "table1_peak_memory.json", meta, models)
    write_json(out / "table2_solver_cost.json", meta, [dict(label=m["label"], n=m["n"], **m["solvers"]) for m in models])
    write_json(out / "table3_time_overhead.json", meta,
               [dict(label=m["label"], timing=m["timing"]) for m in models])
    write_json(out / "fig_a_timeline.json", meta, tl)
    write_json(out / "fig_b_batch_sweep.json", meta, sweep)
    write_json(out / "fig_c_solver_scaling.json", meta, scaling)

    files = {"a": "fig_a_timeline.png", "b": "fig_b_batch_sweep.png", "c": "fig_c_solver_scaling.png"}
    figures.timeline_figure(tl, meta, out / files["a"])
    figures.batch_figure(sweep, meta, out / files["b"])
    figures.scaling_figure(scaling, meta, out / files["c"])

    caps = captions(meta, tl, sweep, scaling)
    t1, t2, t3 = report.table1(models, meta), report.table2(models, meta), report.table3(models, meta)
    (out / "table1_peak_memory.md").write_text(t1)
    (out / "table2_solver_cost.md").write_text(t2)
    (out / "table3_time_overhead.md").write_text(t3)
    body = "\n".join([t1, t2, t3, "### Solver scaling (figure c data)", "", report.scaling_table(scaling),
                      report.figures_block(meta, files, caps)])
    (out / "report.md").write_text(f"# paper_repro results: {tag}\n\n" + body)
    if args.out is None and not args.no_readme:
        if update_readme(out, tag, body):
            experiments.log(f"refreshed the {tag} tables in {README}")
    experiments.log(f"done in {meta['wall_seconds']:.0f} s; wrote {out}")
    print(json.dumps(dict(out=str(out), wall_seconds=meta["wall_seconds"]), indent=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
