"""Write ``benchmarks/RESULTS.md`` from the newest result file of each benchmark, by question.

    python -m benchmarks.report            # (re)writes benchmarks/RESULTS.md
    python -m benchmarks.report --check    # exit 1 if RESULTS.md differs from what the result files give

Every figure in RESULTS.md comes from a file under ``benchmarks/results/<benchmark>/`` (the newest run
of each configuration, ``latest*.json``; see :mod:`benchmarks.harness`); the prose here only says how to
read the tables. Each table names its file, the command recorded in it, the ckptopt commit and date
where the file records them, and the device. A file a section needs that is missing stops the report
with :class:`MissingResult`, which names the file and the command that writes it.

NB: the report imports neither torch nor ckptopt, so it runs in a second and its test needs no models.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable

from benchmarks.harness import RESULTS, ROOT

OUT = ROOT / "benchmarks" / "RESULTS.md"
MiB, GiB = 2**20, 2**30


class MissingResult(FileNotFoundError):
    """A result file the report needs is not there."""

    def __init__(self, rel: str):
        bench = rel.split("/")[0]
        super().__init__(f"benchmarks/results/{rel} is missing: run `python -m benchmarks.{bench}` (with the options "
                         f"of its configuration) to write it, or restore it from git")
        self.rel = rel


class Results:
    """The result files under one folder, read once each."""

    def __init__(self, root: Path = RESULTS):
        self.root = Path(root)
        self._cache: dict = {}
        self.used: set[str] = set()
        """Every file asked for, JSON or not."""

    def __call__(self, rel: str) -> dict:
        self.used.add(rel)
        if rel not in self._cache:
            path = self.root / rel
            if not path.is_file():
                raise MissingResult(rel)
            self._cache[rel] = json.loads(path.read_text())
        return self._cache[rel]

    def require(self, rel: str) -> Path:
        """A file that is not JSON (a log, a figure): its path, which must exist."""
        self.used.add(rel)
        path = self.root / rel
        if not path.is_file():
            raise MissingResult(rel)
        return path


# --------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------
def b(n) -> str:
    return "–" if n is None else f"{int(n):,} B"


def sb(n) -> str:
    """Signed bytes."""
    return "–" if n is None else f"{int(n):+,} B"


def mib(n, digits: int = 1) -> str:
    return "–" if n is None else f"{n / MiB:.{digits}f} MiB"


def gib(n, digits: int = 1) -> str:
    return "–" if n is None else f"{n / GiB:.{digits}f}"


def pct(x, digits: int = 2, sign: bool = True) -> str:
    return "–" if x is None else f"{100 * x:{'+' if sign else ''}.{digits}f}%"


def times(x, digits: int = 3) -> str:
    return "–" if x is None else f"×{x:.{digits}f}"


def secs(x) -> str:
    if x is None:
        return "–"
    return f"{x:.3g} s" if x < 10 else f"{x:.1f} s"


def table(header: list[str], rows: Iterable[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def meta_of(d: dict) -> dict:
    """A result file's metadata: its ``meta``, or the top-level fields of the files that spread it there."""
    return d.get("meta") or {k: d[k] for k in ("benchmark", "date", "machine", "torch", "command", "git") if k in d}


def device_of(m: dict) -> str:
    if m.get("gpu"):
        return m["gpu"]
    if str(m.get("device", "cpu")).startswith("cuda"):
        return "CUDA (card not recorded)"
    mach = m.get("machine") if isinstance(m.get("machine"), dict) else {}
    cpus, torch = mach.get("cpus", m.get("cpus")), m.get("torch")
    return "CPU" + (f", {cpus} cores" if cpus else "") + (f", torch {torch}" if torch else "")


def short(command: str) -> str:
    """A recorded command with a long ``--only`` list shortened to its count."""
    def count(m):
        names = m.group(1).split(",")
        return m.group(0) if len(names) <= 4 else f"--only <{len(names)} models>"
    return re.sub(r"--only (\S+)", count, command)


def source(results: Results, rel: str, what: str = "") -> str:
    """The line under a table: its file, the recorded command, commit, date and device."""
    m = meta_of(results(rel))
    cmds = m.get("commands") or ([m["command"]] if m.get("command") else [])
    commit = m.get("ckptopt_commit") or ((m.get("git") or {}).get("at_start") or {}).get("commit", "")[:7] or None
    bench = rel.split("/")[0]
    cmd = "; ".join(f"`{short(c)}`" for c in cmds) if cmds else f"not recorded (re-run: `python -m benchmarks.{bench}`)"
    parts = [f"`benchmarks/results/{rel}`{(' (' + what + ')') if what else ''}", f"command: {cmd}",
             f"ckptopt `{commit}`" if commit else "commit not recorded",
             f"{m['date'][:10]}" if m.get("date") else "date not recorded", device_of(m)]
    return "*Source:* " + " · ".join(parts) + "."


UNIT = re.compile(r"(\d) (B|KB|MB|GB|MiB|GiB|s|ms|minutes)\b")


def wrap(paragraph: str, **kw) -> str:
    """A prose paragraph wrapped at 110 characters, never between a number and its unit (tables, headings,
    images and comments as they are)."""
    if paragraph.startswith(("|", "#", "!", "<!--")) or "\n|" in paragraph:
        return paragraph
    glued = UNIT.sub("\\1\0\\2", paragraph)
    return textwrap.fill(glued, width=110, break_long_words=False, break_on_hyphens=False, **kw).replace("\0", " ")


def block(*parts: str) -> str:
    return "\n\n".join(wrap(p) for p in parts if p)


def figure(results: Results, rel: str, alt: str) -> str:
    results.require(rel)
    return f"![{alt}](results/{rel})"


def dist(values: list) -> dict | None:
    v = sorted(x for x in values if x is not None)
    return dict(n=len(v), min=v[0], median=statistics.median(v), max=v[-1]) if v else None


# --------------------------------------------------------------------------
# 1. Is it exact?
# --------------------------------------------------------------------------
def exact_zoo(r: Results) -> str:
    d = r("prediction_accuracy/latest.json")
    rows = [[m["model"], m["kind"], m["n"], b(m["predicted_bytes"]), b(m["measured_bytes"]),
             sb(m["measured_bytes"] - m["predicted_bytes"])] for m in d["models"]]
    return block("### Zoo models, no checkpointing: predicted against measured peak",
                 table(["model", "kind", "layers", "predicted", "measured", "measured − predicted"], rows),
                 source(r, "prediction_accuracy/latest.json"))


def exact_plans(r: Results) -> str:
    d = r("optimize/latest.json")
    rows = []
    for m in d["models"]:
        gaps = {s: p["measured_bytes"] - p["predicted_bytes"] for s, p in m["plans"].items()
                if p.get("measured_bytes") is not None and p.get("predicted_bytes") is not None}
        planned = [g for s, g in gaps.items() if s not in ("none", "sqrt", "chen-greedy")]
        rows.append([m["config"], m["n"], len(gaps), sb(min(planned)) + " … " + sb(max(planned)),
                     "yes" if m["dp2_gradient_check"]["grads_equal"] and m["dp2_gradient_check"]["buffers_equal"]
                     else "no"])
    return block("### Zoo models, every solver's plan applied and measured",
                 "Each solver's plan is applied to the model and one training step measured; the range is over "
                 "ckptopt's own plans (dp, dp2, linear, the default).",
                 table(["model (config)", "layers", "plans measured", "measured − predicted, ckptopt's plans",
                        "dp2 module: gradients and buffers bit-identical"], rows),
                 source(r, "optimize/latest.json"))


def exact_step(r: Results) -> str:
    d = r("estimate_accuracy/latest.json")
    by = defaultdict(dict)
    for row in d["rows"]:
        by[row["model"]][(row["optimizer"], row["plan"])] = row
    opts = ["sgd", "sgd-momentum", "adam"]
    rows = []
    for model, cases in by.items():
        cells = [f"{mib(cases[(o, 'no checkpointing')]['measured_bytes'], 2)} / "
                 f"{mib(cases[(o, 'optimal plan')]['measured_bytes'], 2)}" for o in opts]
        worst = max(abs(c["measured_bytes"] - c["predicted_bytes"]) for c in cases.values())
        rows.append([model, *cells, b(worst)])
    return block("### Whole training step with the optimizer (`ckptopt.estimate`)",
                 f"{len(d['rows'])} cases; the largest relative error is {pct(d['max_abs_rel_error'], 5, False)}.",
                 table(["model", "SGD: none / optimal", "SGD momentum: none / optimal", "Adam: none / optimal",
                        "largest |measured − predicted|"], rows),
                 source(r, "estimate_accuracy/latest.json"))


def exact_fuzz(r: Results) -> str:
    d = r("exactness_fuzz/latest.json")
    s = d["summary"]
    rows = []
    for fam in ("chain", "stream"):
        if fam not in s:
            continue
        f = s[fam]
        rows.append([fam, f["models"], f["plans"], f"{f['exact']} ({pct(f['exact'] / f['plans'], 1, False)})",
                     f"{f['under_predicted']} (largest {b(f['largest_under'])})",
                     f"{f['over_predicted']} (largest {b(-f['largest_over'])})", f["errors"]])
    rp = r("exactness_fuzz/latest-replay.json")
    models = rp["models"]
    plans = sum(m["plans"] for m in models)
    inexact = [c for m in models for c in m["inexact"]]
    rec = json.loads((ROOT / "benchmarks" / "data" / "recorded_fuzz_models.json").read_text())["recorded_models"]
    run = s.get("run", {})
    return block(
        "### Random models (the fuzzer's generator, `tests/common/fuzz.py`)",
        "Per random model: the plans of dp2, the default, `every`, no checkpointing and random plans with random "
        "stored segments, each applied and measured for one real step. Exact: measured − predicted between 0 and "
        "8 B (the scalar loss and its gradient, which the cost model leaves out).",
        table(["family", "models", "plans", "exact", "under-predicted", "over-predicted", "not traced"], rows),
        source(r, "exactness_fuzz/latest.json", f"{run.get('minutes')} minutes, seed {run.get('seed')}"),
        f"Every model a fuzz run ever recorded as inexact ({len(rec)} in `benchmarks/data/recorded_fuzz_models.json`) "
        f"replayed on one commit, with its recorded plans and random ones:",
        table(["models", "plans", "models exact on every plan", "plans under-predicted", "plans over-predicted"],
              [[len(models), f"{plans:,}", sum(not m["inexact"] for m in models),
                sum(c["gap"] > 8 for c in inexact), sum(c["gap"] < 0 for c in inexact)]]),
        source(r, "exactness_fuzz/latest-replay.json"))


def exact_hf(r: Results) -> str:
    sw = r("hf_sweep/latest.json")
    ok = [x for x in sw["records"] if x["status"] == "ok"]
    err = dist([x["prediction_error"] for x in ok])
    exact = sum(abs(x["measured_peak_bytes"] - x["predicted_peak_bytes"]) <= 8 for x in ok)
    sample = r("hf_sweep/latest-sample.json")
    sok = [x for x in sample["records"] if x["status"] == "ok"]
    sdist = dist([x["prediction_error"] for x in sok])
    fam = r("hf_families/latest.json")["results"]
    rows = [[x["model"], b(x["ckptopt_peak_bytes"]), b(x["ckptopt_predicted_peak_bytes"]),
             sb(x["ckptopt_peak_bytes"] - x["ckptopt_predicted_peak_bytes"]), training(x["same_training"])]
            for x in fam]
    return block(
        "### transformers models",
        "The architecture sweep (every class of six auto mappings, scaled down; section \"Which models?\") counts a "
        "model ok when its plan trains bit-identically to the unmodified model (two steps, loss and every gradient) "
        "and the measured peak is within 1% of the prediction.",
        table(["run", "ok models", "within 8 B of the prediction", "prediction error: min / median / max"],
              [[f"whole sweep, `{meta_of(sw).get('ckptopt_commit')}`", len(ok), exact, f"{pct(err['min'], 3)} / {pct(err['median'], 4)} / {pct(err['max'], 3)}"],
               [f"sweep sample, `{meta_of(sample).get('ckptopt_commit')}`", len(sok), sum(abs(x["measured_peak_bytes"] - x["predicted_peak_bytes"]) <= 8
                                                          for x in sok),
                f"{pct(sdist['min'], 3)} / {pct(sdist['median'], 4)} / {pct(sdist['max'], 3)}"]]),
        source(r, "hf_sweep/latest.json"), source(r, "hf_sweep/latest-sample.json"),
        "Five families at a moderate size (6 layers, width 256), each way in a fresh process:",
        table(["model", "measured", "predicted", "measured − predicted", "same training as unmodified"], rows),
        source(r, "hf_families/latest.json"))


def training(st) -> str:
    if not st:
        return "–"
    if st.get("bit_identical"):
        return "bit-identical"
    return f"loss diff {st['loss_abs_diff']:.2g}, grad max diff {st['grad_max_abs_diff']:.2g}"


def exact_diffusers(r: Results) -> str:
    d = r("diffusers_models/latest.json")
    rows = []
    for res in d["results"]:
        for way, c in res["cases"].items():
            if not way.startswith("ckptopt") or "measured_peak_bytes" not in c:
                continue
            rows.append([res["model"], way, c.get("layers"), b(c["measured_peak_bytes"]), b(c["predicted_peak_bytes"]),
                         sb(c["measured_peak_bytes"] - c["predicted_peak_bytes"]), training(c.get("same_training"))])
    return block("### diffusers models",
                 table(["model", "way", "layers", "measured", "predicted", "measured − predicted", "same training"],
                       rows),
                 source(r, "diffusers_models/latest.json"))


def exact_ranks(r: Results) -> str:
    d = r("ranks_accuracy/latest.json")
    groups = defaultdict(list)
    for row in d["rows"]:
        groups[(row["backend"], row["strategy"], row["optimizer"])].append(row)
    rows = [[backend, strategy, opt, ", ".join(str(w) for w in sorted({x["world"] for x in g})), len(g),
             ", ".join(f"{gap:+,} B ×{n}" for gap, n in sorted(Counter(x["gap"] for x in g).items()))]
            for (backend, strategy, opt), g in sorted(groups.items())]
    llama = r("ranks_accuracy/latest-llama.json")["rows"]
    rows.append(["fake", "fsdp (transformers Llama)", ", ".join(sorted({x["optimizer"] for x in llama})),
                 ", ".join(str(w) for w in sorted({x["world"] for x in llama})), len(llama),
                 ", ".join(f"{gap:+,} B ×{n}" for gap, n in sorted(Counter(x["gap"] for x in llama).items()))])
    tracker = [[t["world"], b(t["predicted"]), b(t["fsdp_mem_tracker"]), sb(t["gap"])] for t in d["fsdp_mem_tracker"]]
    return block("### One rank of DDP and FSDP2",
                 "Each rank's steady-state step measured under the exact storage tracker (the fake process group in "
                 "process, or real gloo processes), against `estimate(..., parallel=Parallel(W, strategy, rank=r))`.",
                 table(["process group", "strategy", "optimizer", "world sizes", "rank steps",
                        "measured − predicted (how many)"], rows),
                 source(r, "ranks_accuracy/latest.json"), source(r, "ranks_accuracy/latest-llama.json"),
                 "PyTorch's own `FSDPMemTracker` on the module `optimize_checkpoints(..., parallel=...)` shards:",
                 table(["ranks", "predicted", "FSDPMemTracker", "difference"], tracker))


def exact_loops(r: Results) -> str:
    held = r("held_output/latest.json")
    rows = [[x["batch"], "none" if not x["checkpoints"] else f"{len(x['checkpoints'])} checkpoint(s)", b(x["predicted"]),
             b(x["measured_output_dies"]), b(x["measured_output_kept"]), sb(x["kept_minus_dies"]), b(x["output_bytes"])]
            for x in held["rows"]]
    cm = r("compile_memory/latest.json")
    crow = [[x["model"], x["mode"], b((x.get("tracker") or {}).get("peak_bytes")),
             (x.get("tracker") or {}).get("ops_seen", "–"), b(x.get("predicted_peak_bytes"))] for x in cm["results"]]
    return block(
        "### What the model assumes about the training loop",
        "ckptopt models `loss_fn(model(x)).backward()`: the output dies once the loss has used it. A loop that keeps "
        "`out` alive through the backward costs more (zoo GPT, three Adam steps):",
        table(["batch", "plan", "predicted", "measured, output dies", "measured, output kept", "kept − dies",
               "output size"], rows),
        source(r, "held_output/latest.json"),
        "Under `torch.compile` (CPU): the tracker sees eager and `aot_eager` steps, not inductor's own buffers, so "
        "compiled memory is not measured here:",
        table(["module", "mode", "tracker peak", "ops seen", "predicted"], crow),
        source(r, "compile_memory/latest.json"))


# --------------------------------------------------------------------------
# 2. How much lower than the peers?
# --------------------------------------------------------------------------
def peers_hf(r: Results) -> str:
    d = r("hf_models/latest.json")
    rows = []
    for res in d["results"]:
        hf = res["rows"]["hf"]["measured_peak_bytes"]
        for way, row in res["rows"].items():
            pred = row.get("predicted_peak_bytes")
            rows.append([f"{res['model']} ({res['layers']} layers)" if way == "none" else res["model"], way,
                         f"{b(row['measured_peak_bytes'])} ({mib(row['measured_peak_bytes'])})",
                         sb(row["measured_peak_bytes"] - pred) if pred else "–",
                         times(row["measured_peak_bytes"] / hf), pct(row["recompute_share"], 1, False),
                         f"{row['step_time_vs_none']:.2f}"])
    return block("### transformers models against `activation_checkpointing_enable`",
                 "`hf`: transformers' own checkpointing of every layer (non-reentrant); `ckptopt`: "
                 "`optimize_checkpoints(model, batch)`; `ckptopt-budget`: the least recomputation at HF's measured "
                 "peak. Recompute: share of a step (3 × forward) from the traced FLOPs.",
                 table(["model", "way", "measured peak", "measured − predicted", "peak / HF's", "recompute",
                        "step time / none"], rows),
                 source(r, "hf_models/latest.json"))


def peers_families(r: Results) -> str:
    fam = r("hf_families/latest.json")["results"]
    rows = [[x["model"], mib(x["none_peak_bytes"]), mib(x["hf_peak_bytes"]), mib(x["ckptopt_peak_bytes"]),
             times(x["ratio_ckptopt_vs_hf"]), x["ckptopt_checkpoints"]] for x in fam]
    d = r("diffusers_models/latest.json")
    drows = []
    for res in d["results"]:
        for way, c in res["cases"].items():
            if "measured_peak_bytes" not in c:
                drows.append([res["model"], way, f"error: {c.get('error', '')[:80]}", "", "", ""])
                continue
            drows.append([res["model"], way, f"{b(c['measured_peak_bytes'])} ({mib(c['measured_peak_bytes'])})",
                          times(c.get("ratio_vs_diffusers")), pct(c.get("recompute_share_measured"), 1, False),
                          pct(c.get("recompute_share_simulated"), 1, False)])
    return block("### Encoder-decoders, CLIP, GPT-NeoX against transformers' checkpointing",
                 table(["model", "none", "HF checkpointing", "ckptopt", "ckptopt / HF", "checkpoints"], rows),
                 source(r, "hf_families/latest.json"),
                 "### diffusers models against `enable_gradient_checkpointing()`",
                 "Recompute: measured from the step's FLOPs (`torch.utils.flop_counter`) and as the simulator prices "
                 "it from the traced FLOPs.",
                 table(["model", "way", "measured peak", "peak / diffusers'", "recompute (measured)",
                        "recompute (simulated)"], drows),
                 source(r, "diffusers_models/latest.json"))


def peers_sweep(r: Results) -> str:
    sw = r("hf_sweep/latest.json")
    ok = [x for x in sw["records"] if x["status"] == "ok"]
    with_hf = [x for x in ok if x.get("peak_ratio_vs_hf") is not None]
    ratio = dist([x["peak_ratio_vs_hf"] for x in with_hf])
    at_most = sum(x["peak_ratio_vs_hf"] <= 1.0 for x in with_hf)
    below = sum(x["peak_ratio_vs_hf"] <= 0.9 for x in with_hf)
    rec_less = sum(x["recompute_flops"] <= x["hf_recompute_flops"] for x in with_hf
                   if x.get("hf_recompute_flops") is not None and x.get("recompute_flops") is not None)
    return block("### The architecture sweep against HF's checkpointing",
                 table(["ok models with HF checkpointing", "peak at or below HF's", "at or below ×0.90",
                        "recompute no more than HF", "peak / HF's: min / median / max"],
                       [[len(with_hf), at_most, below, rec_less,
                         f"{times(ratio['min'])} / {times(ratio['median'])} / {times(ratio['max'])}"]]),
                 source(r, "hf_sweep/latest.json"))


def peers_finetune(r: Results) -> str:
    d = r("finetune_stack/latest.json")
    errors = any(x.get("error") for x in d["rows"])
    rows = [[x["arch"], x["mode"], x["variant"], b(x.get("step_peak_bytes")), f"{x['peak_vs_hf-1']:.3f}"
             if "peak_vs_hf-1" in x else "–", pct(x.get("recompute_share"), 1, False),
             pct(x.get("prediction_error"), 3) if x.get("prediction_error") is not None else "–",
             *([x.get("error", "")[:80]] if errors else [])] for x in d["rows"]]
    return block("### Fine-tuning through HF's `Trainer`: full and LoRA",
                 "`hf-1`/`hf-2`: `activation_checkpointing_enable(every_n_layers=1|2)`; `ckptopt-at-hf`: the least "
                 "recomputation at hf-1's peak. Peak: the whole second step, optimizer step included.",
                 table(["arch", "mode", "variant", "step peak", "peak / hf-1", "recompute", "prediction error",
                        *(["error"] if errors else [])], rows),
                 source(r, "finetune_stack/latest.json"))


def peers_zoo(r: Results) -> str:
    d = r("optimize/latest.json")
    cols = ["none", "sqrt", "chen-greedy", "dp2", "default", "linear"]
    rows = []
    for m in d["models"]:
        p = m["plans"]
        cs = m.get("checkpoint_sequential")
        best = f"{mib(cs['best_measured_bytes'])} ({cs['best_segments']} seg.)" if cs else "–"
        cells = [mib(p[c]["measured_bytes"]) if c in p and p[c].get("measured_bytes") else "–" for c in cols]
        rows.append([m["config"], m["n"], *cells[:3], best, *cells[3:],
                     pct(p["dp2"]["measured_bytes"] / p["none"]["measured_bytes"] - 1, 1),
                     f"{p['dp2']['step_ratio_vs_none']:.2f} / {p['default']['step_ratio_vs_none']:.2f}"])
    return block("### Zoo models: every strategy measured",
                 "Measured peaks of one training step (exact CPU storage tracker). `sqrt` and `chen-greedy` are the "
                 "classic heuristics; `checkpoint_sequential` is PyTorch's, every segment count tried (chains only); "
                 "`dp2` is the optimum of the paper's plan space; `default` is `optimize_checkpoints`' plan.",
                 table(["model", "layers", "none", "sqrt", "chen-greedy", "best checkpoint_sequential", "dp2",
                        "default", "linear", "dp2 vs none", "step time / none, dp2 / default"], rows),
                 source(r, "optimize/latest.json"), figure(r, "optimize/latest.png", "every strategy's measured peak"))


def peers_cuts(r: Results) -> str:
    d = r("crossing_gain/latest.json")
    rows = [[x["model"], f"{x['single']['layers']} → {x['several']['layers']} ({x['several']['side_tensors']})",
             b(x["single"]["measured"]), b(x["several"]["measured"]), f"{-x['gain_percent'] or 0.0:+.2f}%",
             f"{sb(x['single']['measured'] - x['single']['predicted'])} / "
             f"{sb(x['several']['measured'] - x['several']['predicted'])}"] for x in d["rows"]]
    st = r("stored_default/latest.json")["results"]
    srows = [[name, x["n"], f"{mib(x['dp2_peak_bytes'], 2)} ({pct(x['dp2_share'], 1, False)})",
              f"{mib(x['default_peak_bytes'], 2)} ({pct(x['default_share'], 1, False)})",
              pct(x["default_peak_bytes"] / x["dp2_peak_bytes"] - 1), len(x["default_stored"]),
              f"{1e3 * x['pass_seconds']:.1f} ms",
              sb(x["default_measured_bytes"] - x["default_peak_bytes"]) if x.get("default_measured_bytes") else "–"]
             for name, x in st.items()]
    nested = r("nested_checkpointing/latest.json")
    hf = nested["hf"]["measured_peak_bytes"]
    nrows = [[v, b(x["measured_peak_bytes"]), times(x["measured_peak_bytes"] / hf), training(x.get("same_training"))]
             for v, x in sorted(((v, x) for v, x in nested.items() if v != "meta"),
                                key=lambda vx: -vx[1]["measured_peak_bytes"])]
    return block(
        "### What the plan space buys",
        "Cuts crossed by several tensors (the default, up to 8) against single-tensor cuts, each plan measured on a "
        "fake-tensor copy:",
        table(["model", "layers, single → several (side tensors)", "best single-tensor plan",
               "best several-tensor plan", "change", "measured − predicted, single / several"], rows),
        source(r, "crossing_gain/latest.json"),
        "Unwrapped (\"stored\") middle segments beside dp2's optimum (peak, and recomputation as a share of a step):",
        table(["model", "layers", "dp2", "default (dp2 + stored)", "change", "stored segments", "extra pass",
               "measured − predicted"], srows),
        source(r, "stored_default/latest.json"),
        "Nested checkpoints by hand on BART (6+6 layers), against ckptopt's flat plan and HF's checkpointing:",
        table(["variant", "measured peak", "÷ HF's", "training"], nrows),
        source(r, "nested_checkpointing/latest.json"))


# --------------------------------------------------------------------------
# 3. How fast?
# --------------------------------------------------------------------------
def fast_solvers(r: Results) -> str:
    d = r("solver_scaling/latest.json")
    ns = sorted({int(n) for s in d["seconds"].values() for n in s})

    def rows(key):
        return [[s, *[secs(d[key][s].get(str(n))) if str(n) in d[key][s] else "" for n in ns],
                 f"{d['slopes'][s]:.2f}" if key == "seconds" else ""] for s in d[key]]
    side = ", ".join(f"n = {int(n):,}: {secs(t)}" for n, t in d.get("side_solve_seconds", {}).items())
    return block("### Solver time against the number of layers",
                 "Random additive instances, every solver on the same instance, interleaved, medians. The optimum "
                 "pass is the compiled kernel (the slope is fitted on it); the whole `solve()` adds the "
                 "least-recomputation tie-break. Compilation excluded.",
                 table(["optimum pass", *[f"n={n:,}" for n in ns], "log-log slope"], rows("seconds")),
                 table(["whole `solve()`", *[f"n={n:,}" for n in ns], ""], rows("solve_seconds")),
                 f"With side tensors (dp2, whole `solve()`): {side}." if side else "",
                 source(r, "solver_scaling/latest.json"), figure(r, "solver_scaling/latest.png", "solver scaling"))


def fast_tracing(r: Results) -> str:
    d = r("tracing_time/latest.json")
    rows = [[f"{m['model']} ({', '.join(f'{k} {v}' for k, v in m['config'].items())})", m["n"], secs(m["median_seconds"]),
             mib(m["max_peak_rss_growth_bytes"]), gib(m["predicted_no_checkpointing_bytes"], 2) + " GiB",
             gib(m["predicted_optimal_bytes"], 2) + " GiB"] for m in d["models"]]
    v = r("verify_overhead/latest.json")
    vrows = [[x["model"], secs(x["without_s"]), secs(x["with_s"]), times(x["ratio"], 2)] for x in v["rows"]]
    return block("### Planning time",
                 f"Tracing (median of {d['repeats']}; layers are measured on fake tensors, so tracing allocates no "
                 f"activations; target {d['target_seconds']:.0f} s):",
                 table(["model", "layers", "median trace time", "peak RSS growth", "predicted peak, no checkpointing",
                        "optimal"], rows),
                 source(r, "tracing_time/latest.json"),
                 f"The plan check (`optimize_checkpoints` runs one fake training step through the rewritten module), "
                 f"planning time with and without it, medians of {v['repeats']}:",
                 table(["model", "without", "with", "ratio"], vrows),
                 source(r, "verify_overhead/latest.json"))


def fast_planning(r: Results) -> str:
    d = r("planning_time/latest.json")
    order = ["capture", "propagate", "cuts", "measure", "crossing trials", "solve", "side effects", "verify",
             "allocator replay", "other"]
    rows = []
    for x in d["rows"]:
        if "error" in x:
            rows.append([x["case"], "", "", "", "", *[""] * len(order), x["error"][:80]])
            continue
        s, a, t = x["shared"], x["alone"], x.get("in_turn")
        rows.append([f"{x['case']} ({x['kind']})", s["layers"], secs(s["total_seconds"]), secs(a["total_seconds"]),
                     secs(t["total_seconds"]) if t else "–", *[secs(s["parts"].get(k)) for k in order],
                     "identical" if x["identical"] else "DIFFERENT"])
    return block("### Where a planning second goes",
                 "`optimize_checkpoints` (and `estimate` of full-size models from their configuration, meta device, "
                 "for CUDA, bf16, AdamW), one thread, each case in a fresh process after one untimed call; parts are "
                 "the time inside the function doing each (\"crossing trials\": the time planning waits for them). "
                 "\"Total\" and \"one core\" are medians of 3 calls each, alternating: \"one core\" is the same call "
                 "with `os.cpu_count()` 1, so the crossings' trials and the stored-segment pass run one after the "
                 "other rather than in threads beside other work. \"Every layer\": one call with each layer measured "
                 "(`SHARE_MEASUREMENTS = False`). The last column compares all the calls' results byte for byte. An estimate "
                 "exports at the example's shapes (fixed), `optimize_checkpoints` with dynamic batch and sequence "
                 "dimensions. Load after "
                 f"the run: `{d['meta'].get('load_after', '?').split('load average:')[-1].strip()}`.",
                 table(["case", "layers", "total", "every layer measured", "one core", *order, "costs"], rows),
                 source(r, "planning_time/latest.json"))


def fast_recompute(r: Results) -> str:
    bc = r("budget_curve/latest.json")["results"]
    brows = []
    for name, x in bc.items():
        p0 = x["points"][0]
        gaps = sorted({p["measured_peak_bytes"] - p["peak_bytes"] for p in x["points"] if "measured_peak_bytes" in p})
        brows.append([name, x["n"], f"{len(x['points'])} ({len(x['checkpoint_only_points'])})",
                      f"{1e3 * x['front_seconds']:.1f} ms", f"{mib(p0['peak_bytes'], 2)} ({pct(p0['recompute_share'], 1, False)})",
                      mib(x["none_peak_bytes"], 2), mib(x["mid_budget_bytes"], 2),
                      f"{pct(x['mid_share_checkpoint_only'], 1, False)} / {pct(x['mid_share'], 1, False)}",
                      ", ".join(sb(g) for g in gaps)])
    tc = r("time_calibration/latest.json")
    trows = [[name if i == 0 else "", plan, f"{row['predicted_ratio_flops']:.2f}", f"{row['predicted_ratio_calibrated']:.2f}",
              f"{row['measured_ratio']:.2f}"]
             for name, x in tc["results"].items()
             for i, (plan, row) in enumerate((p, v) for p, v in x["plans"].items() if p != "none")]
    cc = r("compute_cost/latest.json")["results"]
    crows = [[name if i == 0 else "", f"{x['spearman_c_vs_time']:.2f}" if i == 0 else "", plan,
              f"{pct(row['recomputed_forward_share_predicted'], 1, False)} / "
              f"{pct(row['recomputed_forward_share_measured'], 1, False)}",
              pct(row["predicted_recompute_share"], 1, False), pct(row["measured_overhead"], 1)]
             for name, x in cc.items()
             for i, (plan, row) in enumerate((p, v) for p, v in x["plans"].items() if p != "none")]
    s = tc["summary"]
    return block(
        "### Recomputation against memory",
        "The least recomputation for each memory budget (exact Pareto front; \"with stored\" lets middle segments "
        "stay unwrapped, \"checkpoint-only\" is the plan space of dp/dp2/linear). Three points per model measured:",
        table(["model", "layers", "Pareto points, with stored (checkpoint-only)", "front time",
               "lowest peak (recompute share)", "no checkpointing", "mid budget",
               "share at mid budget: checkpoint-only / with stored", "measured − predicted"], brows),
        source(r, "budget_curve/latest.json"), figure(r, "budget_curve/latest.png", "budget curve"),
        "### Step time: recomputation priced by FLOPs and by measured time",
        "Step time of each plan relative to no checkpointing: predicted from the traced FLOPs, predicted from "
        f"calibrated layer times (`ckptopt.calibration`), and measured (medians of {tc['rounds']} interleaved "
        f"rounds). Median |predicted − measured|: {s['flops']['median_abs_error']:.3f} from FLOPs, "
        f"{s['calibrated']['median_abs_error']:.3f} calibrated."
        + (" This run predates the op-time table (\"What an operator costs besides its FLOPs\" below): its FLOP "
           "column counts one FLOP per element of an operator without a FLOP formula."
           if meta_of(tc).get("date", "") < OP_TIME_SINCE else ""),
        table(["model", "plan", "FLOPs", "calibrated", "measured"], trows),
        source(r, "time_calibration/latest.json"),
        "How well the FLOP count `c` ranks layer times, and each plan's re-run share against its measured overhead:",
        table(["model", "Spearman(c, layer time)", "plan", "re-run share of forward: predicted / measured",
               "recompute share of step (predicted)", "step overhead (measured)"], crows),
        source(r, "compute_cost/latest.json"))


def fast_op_time(r: Results) -> str:
    d = r("op_time/latest.json")
    t = d["table"]
    rate = t["product_flops_per_second"]
    spread = d["per_model_ns_per_element"]
    ranked = sorted(t["ns_per_element"].items(), key=lambda kv: -kv[1])
    rows = []
    for op, ns in ranked[:OP_TIME_ROWS]:
        lo, hi = min(spread[op].values()), max(spread[op].values())
        rows.append([f"`{op}`", f"{ns:.2f}", f"{ns * 1e-9 * rate:.0f}", f"{lo:.2f}–{hi:.2f}", len(spread[op])])
    return block(
        "### What an operator costs besides its FLOPs",
        "A layer's compute (`ChainCosts.c`, and its backward `cb`) counts the FLOPs of products, convolutions and "
        "attention, and prices every other operator by its time per element on the device type, converted to "
        "FLOP-equivalents at the product rate of the same run (`ckptopt/tracer/op_time.py`, docs/design.md §3 "
        "\"Compute\"). Until this table, each such element counted one FLOP. Measured on one thread over a "
        f"training step of {len(d['per_model_seconds'])} models ({', '.join(d['per_model_seconds'])}), "
        f"{d['steps']} steps each: products {rate / 1e9:.1f} GFLOP/s; a call's fixed cost "
        f"({1e6 * t['seconds_per_call']:.1f} µs with the timing mode, a view's time) taken off each call. The "
        f"{OP_TIME_ROWS} dearest per element of {len(ranked)} operators (the rest, and those seen only on small "
        f"tensors, {', '.join(f'`{x}`' for x in t['left_out'])}, are in the file; an operator the table does not "
        "list is priced at its median):",
        table(["operator", "ns per element", "FLOP-equivalents per element", "range over models (ns)", "models"],
              rows),
        source(r, "op_time/latest.json"),
        *_fresh_pages(r))


def _fresh_pages(r: Results) -> list[str]:
    f = r("op_time/latest-fresh-pages.json")
    return [f"What first touch costs, which those figures include where an operator writes a fresh output: a fill of "
            f"{f['mib']} MiB takes {1e3 * f['fill_fresh_s']:.1f} ms into a fresh tensor and "
            f"{1e3 * f['fill_held_s']:.1f} ms into one already held, an addition {1e3 * f['add_fresh_s']:.1f} against "
            f"{1e3 * f['add_held_s']:.1f} ms: {f['fresh_ns_per_byte']:.2f} ns per byte, {4 * f['fresh_ns_per_byte']:.1f} "
            "ns per float32 element, more than most operators' own time per element. A recomputation that reuses "
            "memory the backward freed does not pay it; the count does not model it yet (docs/design.md §3).",
            source(r, "op_time/latest-fresh-pages.json")]


OP_TIME_ROWS = 16
OP_TIME_SINCE = "2026-11-29"  # runs from this date on price operators by benchmarks/op_time.py's table


def _ratio(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _frontier_row(row: dict) -> list:
    pred = row.get("predicted_peak_bytes")
    budget = f"{row['budget_from']}'s peak" if row.get("budget_from") else ""
    plan = (f"{pct(row['predicted_recompute_share'], 1, False)}, {row['segments']} segments"
            if "predicted_recompute_share" in row else "")
    first = row.get("first_try")
    if first:
        budget += f" (first plan compiled to {mib(first['peak_profiler_bytes'])}: over; budget lowered by the excess)"
    return [row["method"], _ratio(row.get("peak_vs_none")), times(row.get("time_vs_none")),
            f"{mib(row.get('peak_bytes'))} ({row.get('peak_instrument', '–')})",
            sb(row["peak_tracker_bytes"] - pred) if pred and "peak_tracker_bytes" in row else "",
            plan, budget + (f" (same plan as {row['same_plan_as']})" if row.get("same_plan_as") else ""),
            (row.get("error") or "")[:90]]


def _against_peers(mine: list[dict]) -> str:
    """Per peer: its point, ckptopt's at its measured peak (eager for an eager peer; compiled for a compiled
    one, where measured), and ckptopt's time over the peer's."""
    by = {x["method"]: x for x in mine}
    rows = []
    for x in mine:
        if x["family"] in ("none", "ckptopt", "ckptopt-compiled", "ckptopt-1pe") or "time_vs_none" not in x:
            continue
        for fam in ("ckptopt", "ckptopt-compiled"):
            ours = by.get(f"{fam}@{x['method']}")
            if ours is None or (fam == "ckptopt" and x["family"] == "compile" and f"ckptopt-compiled@{x['method']}" in by):
                continue
            if "time_vs_none" not in ours:
                rows.append([x["method"], f"{_ratio(x['peak_vs_none'])} / {times(x['time_vs_none'])}", fam, "–", "–",
                             (ours.get("error") or "")[:60]])
                continue
            rows.append([x["method"], f"{_ratio(x['peak_vs_none'])} / {times(x['time_vs_none'])}", fam,
                         f"{_ratio(ours['peak_vs_none'])} / {times(ours['time_vs_none'])}",
                         times(ours["time_vs_none"] / x["time_vs_none"]),
                         "at or below" if ours["peak_bytes"] <= x["peak_bytes"] else "ABOVE"])
    return table(["peer", "peer: peak / time", "ckptopt", "ckptopt at the peer's peak: peak / time",
                  "time / peer's", "peak against the peer's"], rows) if rows else ""


def fast_frontier(r: Results) -> str:
    d = r("frontier/latest.json")
    m = meta_of(d)
    parts = ["### The frontier: peak memory against step time",
             "Each training-memory method as a point (peak of one step, step time), both relative to no "
             "checkpointing of the same model: transformers' checkpointing of every layer and of every second "
             "layer, PyTorch's selective activation checkpointing (torchtitan's way: keep matmul and fused-attention "
             "outputs, or matmul outputs only, recompute the rest), `torch.compile` at several "
             "`activation_memory_budget` values, ckptopt's lowest-peak plan and its plan at each peer's measured "
             "peak (`budget=`), and (`ckptopt-compiled`) ckptopt's plans compiled as the compiled peers are, at "
             "their measured peaks. A step is zero_grad, forward with the model's loss and backward (no optimizer "
             "step). "
             + (f"Medians of {d['rounds']} interleaved rounds (order rotated each round)" if d["rounds"] > 1 else
                "One round (a single step of each method, interleaved, after a warm-up step each): the times are "
                "single samples, not medians")
             + "; load before "
             f"`{m.get('load_before', '?').split('load average:')[-1].strip()}`, after "
             f"`{m.get('load_after', '?').split('load average:')[-1].strip()}` (1, 5, 15 min). Eager peaks from the "
             "exact storage tracker; compiled peaks from the profiler's CPU allocator events (inductor's buffers "
             "are invisible to the tracker), divided by the profiler's peak of no checkpointing. Measured − "
             "predicted: ckptopt's plans, tracker bytes."]
    for info in d["models"]:
        mine = [x for x in d["rows"] if x["model"] == info["model"]]
        errors = any(x.get("error") for x in mine)
        rows = [_frontier_row(x)[:None if errors else -1] for x in mine]
        gaps = [x["profiler_minus_tracker_bytes"] for x in mine
                if "profiler_minus_tracker_bytes" in x and not x.get("same_plan_as")]
        parts.append(f"**{info['model']}** ({info['sizes_text']}); the profiler against the tracker on its eager "
                     f"steps: {sb(min(gaps)) if gaps else '–'} to {sb(max(gaps)) if gaps else '–'}.")
        parts.append(table(["method", "peak / none", "step time / none", "measured peak", "measured − predicted",
                            "ckptopt: predicted recompute", "ckptopt budget"] + (["error"] if errors else []), rows))
        parts.append(_against_peers(mine))
    parts.append(_time_prediction(d["rows"]))
    parts += [source(r, "frontier/latest.json"), figure(r, "frontier/frontier.png", "peak against step time")]
    return block(*parts)


#: the eager frontier at 15 rounds, one file per model (``python -m benchmarks.frontier --models M --no-compile
#: --rounds 15 --out benchmarks/results/frontier/eager-M.json``)
EAGER_FRONTIER = ("gpt2", "llama", "bert", "t5")


def fast_frontier_eager(r: Results) -> str:
    parts = ["### The eager frontier at 15 rounds: ckptopt at each peer's peak",
             "The eager methods of the frontier above (no `torch.compile`), one model per run, 15 interleaved rounds "
             "each: the peer's point, ckptopt's plan at the peer's measured peak (`budget=`), and the ratio of the two "
             "median step times. One step of a method varies by about ±10% from round to round on this shared "
             "machine, so a ratio within about 2% of 1 does not tell the two apart. Where ckptopt is slower at a "
             "selective-checkpointing peak, `docs/design.md` §1 (\"What the plan space does not have yet\") says "
             "which products its plan re-runs and the action that would keep their outputs."]
    every_row = []
    before_table = []  # runs whose predictions counted one FLOP per element of other operators
    for name in EAGER_FRONTIER:
        rel = f"frontier/eager-{name}.json"
        d = r(rel)
        every_row += d["rows"]
        m = meta_of(d)
        if "one_per_element" not in m:
            before_table += [info["model"] for info in d["models"]]
        load = (f"load before `{m.get('load_before', '?').split('load average:')[-1].strip()}`, after "
                f"`{m.get('load_after', '?').split('load average:')[-1].strip()}`")
        for info in d["models"]:
            mine = [x for x in d["rows"] if x["model"] == info["model"]]
            parts.append(f"**{info['model']}** ({info['sizes_text']}; {d['rounds']} rounds; {load})")
            parts.append(_against_peers(mine))
            priced = _priced_against_one_per_element(mine)
            if priced:
                parts.append(priced)
            nothing = next((x for x in mine if x["method"] == "ckptopt@none" and "time_vs_none" in x), None)
            if nothing is not None:
                parts.append(f"A plan that recomputes nothing (ckptopt at the plain model's peak: "
                             f"{nothing['segments']} segment, run through ckptopt's rewriter): peak "
                             f"{_ratio(nothing['peak_vs_none'])}, step time {times(nothing['time_vs_none'])} of the "
                             "model's own.")
        parts.append(source(r, rel))
    line = _time_prediction(every_row)
    slow = sorted({x["model"] for x in every_row  # a plan that recomputes faster than the plain step
                   if x.get("family") != "none" and x.get("time_vs_none", 1.0) < 0.97})
    when = (f" The runs of {', '.join(before_table)} predate the op-time table: their predictions count one "
            "FLOP per element of an operator without a FLOP formula." if before_table else "")
    parts.append("Over the four runs: " + line[0].lower() + line[1:] + when + " Each ratio is against the same run's "
                 "plain step" + (f"; in {', '.join(slow)} a checkpointing method measured more than 3% faster than "
                                 "the plain step, a sign that the run's plain median is high, which moves its "
                                 "predictions over together" if slow else "") + ".")
    return block(*parts)


def _priced_against_one_per_element(mine: list[dict]) -> str:
    """The budget plans chosen with operators priced by their measured time against those chosen with one
    FLOP per element (``--one-per-element``), timed in the same rounds."""
    by = {x["method"]: x for x in mine}
    rows = []
    for x in mine:
        if x["family"] != "ckptopt-1pe":
            continue
        peer = x["budget_from"]
        ours = by.get(f"ckptopt@{peer}")
        if ours is None or "time_vs_none" not in ours:
            continue
        same = x.get("same_plan_as")
        old = by.get(same, x) if same else x
        if "time_vs_none" not in old:
            continue
        rows.append([peer, f"{times(ours['time_vs_none'])} ({pct(ours['predicted_recompute_share'], 1, False)}, "
                           f"{ours['segments']} segments)",
                     "same plan" if same == ours["method"] else
                     f"{times(old['time_vs_none'])} ({x['segments']} segments)",
                     times(ours["time_vs_none"] / old["time_vs_none"])])
    if not rows:
        return ""
    return ("At each peer's peak, the plan chosen with operators priced by their measured time (the table above, "
            "predicted share in brackets) against the plan the same search chose with every element of such an "
            "operator counted as one FLOP (the count before that table; `--one-per-element`), timed in the same "
            "rounds:\n\n" + table(["peak of", "priced: time", "one per element: time", "priced / one per element"],
                                   rows))


def time_prediction_errors(rows: list[dict]) -> list[tuple[str, str, float]]:
    """``(model, method, error)`` for each timed ckptopt plan: its predicted step-time ratio (1 + the
    predicted recomputation and segments' fixed cost as a share of a step) against the measured ratio,
    relative to the measured one."""
    out = []
    for x in rows:
        if (x.get("predicted_time_vs_none_flops") and x.get("time_vs_none") and not x.get("same_plan_as")
                and x.get("family", "ckptopt") == "ckptopt"):  # (an eager prediction: not for a compiled step)
            out.append((x["model"], x["method"],
                        (x["predicted_time_vs_none_flops"] - x["time_vs_none"]) / x["time_vs_none"]))
    return out


def _time_prediction(rows: list[dict]) -> str:
    errs = time_prediction_errors(rows)
    if not errs:
        return "No ckptopt plan was timed."
    abs_errs = sorted(abs(e) for _, _, e in errs)
    worst = max(errs, key=lambda t: abs(t[2]))
    return (f"Step time predicted from FLOPs (each plan's `1 +` predicted share) against measured, {len(errs)} "
            f"distinct ckptopt plans: median absolute error {pct(statistics.median(abs_errs), 1, False)}, "
            f"largest {pct(worst[2], 1)} ({worst[0]}, {worst[1]}); of them "
            f"{sum(e <= 0.10 for e in abs_errs)} within 10%.")


# --------------------------------------------------------------------------
# 4. How large?
# --------------------------------------------------------------------------
def large_full(r: Results) -> str:
    d = r("full_size/latest.json")
    rows = [[x["model"], x.get("layers"), gib(x.get("param_bytes"), 2), gib(x.get("none_peak_bytes"), 2),
             gib(x.get("optimal_peak_bytes"), 2), gib((x.get("needed_bytes") or {}).get("optimal"), 2),
             x.get("optimal_at"), secs(x.get("seconds")), mib(x.get("max_rss_bytes"), 0), x.get("error", "")]
            for x in d["rows"]]
    srows = [[x["num_hidden_layers"], x.get("layers"), secs(x.get("seconds")), mib(x.get("max_rss_bytes"), 0),
              gib(x.get("optimal_peak_bytes"), 2)] for x in d["layer_scaling"]]
    ex = d["rows"][0]
    return block("### Full-size models planned without their weights",
                 f"`ckptopt estimate` on the meta device, batch {ex['batch']}, sequence {ex['seq']}, bf16, AdamW, "
                 f"planned for `{d['device']}` (GiB; \"needed\" adds the assumed headroom), each in a fresh process: "
                 "wall time and peak resident memory of that process.",
                 table(["model", "layers", "parameters", "no checkpointing", "optimal plan", "needed (optimal)",
                        "peak at", "time", "resident", "error"], rows),
                 "The 8B shape with fewer decoder layers:",
                 table(["decoder layers", "layers traced", "time", "resident", "optimal peak (GiB)"], srows),
                 source(r, "full_size/latest.json"))


def ranks_tables(r: Results, rel: str) -> str:
    d = r(rel)
    worlds = sorted({x["world"] for x in d["rows"]})
    cells = defaultdict(dict)
    for x in d["rows"]:
        key = (x["model"], f"{x['batch']} x {x['seq']}", "fsdp" if x["strategy"] == "single" else x["strategy"])
        cells[key][x["world"]] = f"{gib(x['none_bytes'])} / **{gib(x['optimal_bytes'])}** ({gib(x['optimal_needed'])})"
    strategies = sorted({k[2] for k in cells})
    for key in list(cells):  # one GPU is the same for both strategies
        if 1 in cells[key]:
            for s in strategies:
                cells[(key[0], key[1], s)].setdefault(1, cells[key][1])
    rows = [[m, case, s, *[cells[(m, case, s)].get(w, "") for w in worlds]] for (m, case, s) in sorted(cells)]
    mb = defaultdict(dict)
    mems = sorted({x["memory_gb"] for x in d.get("max_batch", [])})
    for x in d.get("max_batch", []):
        mb[(x["model"], x["world"])][x["memory_gb"]] = f"{x['none_batch']} / **{x['optimal_batch']}**"
    mrows = [[m, w, *[mb[(m, w)].get(g, "") for g in mems]] for (m, w) in sorted(mb)]
    return block(table(["model", "batch x seq", "strategy", *[f"{w} GPU{'s' if w > 1 else ''}" for w in worlds]], rows),
                 table(["model", "ranks", *[f"{g} GB" for g in mems]], mrows) if mrows else "",
                 source(r, rel))


def large_ranks(r: Results) -> str:
    return block(
        "### Will Llama-3-8B and -70B fit? One rank of FSDP2 and DDP",
        "Per-GPU peak in GiB, no checkpointing / **ckptopt's plan** (needed with the assumed CUDA headroom in "
        "parentheses); bf16, AdamW (foreach). Then the largest per-rank batch at sequence 4096 under FSDP2, no "
        "checkpointing / **the plan**. Predictions only (the per-rank rules are the CPU-measured ones above).",
        "Llama-3-8B:", ranks_tables(r, "ranks_table/latest-8b.json"),
        "Llama-3-70B:", ranks_tables(r, "ranks_table/latest-70b.json"),
        "With FSDP2's mixed precision (fp32 master weights and AdamW state, bf16 compute; FSDP2 rows only):",
        "Llama-3-8B:", ranks_tables(r, "ranks_table/latest-8b-mixed.json"),
        "Llama-3-70B:", ranks_tables(r, "ranks_table/latest-70b-mixed.json"))


def large_batch(r: Results) -> str:
    d = r("max_batch_check/latest.json")
    rows = [[x["strategy"], x["batch"], b(x["predicted_bytes"]), b(x["measured_bytes"]), "yes" if x["fits"] else "no"]
            for x in d["measured"]]
    return block("### Largest batch under a memory cap (CPU)",
                 f"`ckptopt.max_batch` for {d['model']} at {b(d['memory_bytes'])} ({d['optimizer']}), "
                 f"{d['max_batch']['traces']} traces in {secs(d['search_seconds'])}; then a whole training step "
                 "measured at the answer and at one more sample:",
                 table(["strategy", "batch", "predicted", "measured", "fits"], rows),
                 source(r, "max_batch_check/latest.json"))


# --------------------------------------------------------------------------
# 5. Which models?
# --------------------------------------------------------------------------
FAIL_KINDS = (  # (kind, test on the cause) in order; the first that matches names the failure
    ("a value read from a tensor (`.item()`, `.tolist()`)", lambda c: "cannot measure graph node item" in c),
    ("a branch on tensor data (data-dependent control flow)", lambda c: "GuardOnDataDependentSymNode" in c),
    ("neither front end captures the forward", lambda c: "capture:" in c),
    ("prediction or peak outside the bounds", lambda c: "prediction" in c or "peak above" in c),
    ("training differs from the unmodified model", lambda c: "differ" in c),
    ("timeout", lambda c: "timeout" in c),
)


def fail_kind(cause: str) -> str:
    return next((k for k, test in FAIL_KINDS if test(cause)), "other: " + cause[:60])


def which_sweep(r: Results) -> str:
    d = r("hf_sweep/latest.json")
    recs = d["records"]
    by_task = defaultdict(Counter)
    for x in recs:
        by_task[x["task"]][x["status"]] += 1
    rows = []
    for task, c in sorted(by_task.items()):
        built = c["ok"] + c["fail"]
        rows.append([task, sum(c.values()), built, c["ok"], pct(c["ok"] / built, 1, False) if built else "–",
                     c["fail"], c["harness"]])
    tot = Counter(x["status"] for x in recs)
    built = tot["ok"] + tot["fail"]
    rows.append(["**all**", len(recs), built, f"**{tot['ok']}**", f"**{pct(tot['ok'] / built, 1, False)}**",
                 tot["fail"], tot["harness"]])
    kinds = defaultdict(list)
    for x in recs:
        if x["status"] == "fail":
            kinds[fail_kind(x.get("cause", ""))].append(x["model"])
    krows = [[k, len(v), ", ".join(sorted(v))] for k, v in sorted(kinds.items(), key=lambda kv: -len(kv[1]))]
    stages = Counter(x.get("cause", "harness: ?").split(":")[1].strip() if ":" in x.get("cause", "")
                     else x.get("cause", "?") for x in recs if x["status"] == "harness")
    hrows = [[s[:70], n] for s, n in stages.most_common()]
    return block(
        "### transformers: every class of six auto mappings",
        "Each class is built from its config, scaled down generically (2 layers, width 64), batch 2 × 32 with one "
        "padded row, the model's own loss, each in a fresh process. Built: the unmodified model builds and trains "
        "reproducibly on the batch (otherwise it is the harness's failure, not counted). Ok: planned, trains "
        "bit-identically, predicted within 1%, and at or below HF's checkpointing where the model supports it.",
        table(["task", "classes run", "built", "ok", "ok / built", "fail", "not built (harness)"], rows),
        source(r, "hf_sweep/latest.json"),
        "Failures by kind (each stops with an error that names the construct):",
        table(["kind", "models", "which"], krows),
        "Not built, by stage of the harness:",
        table(["stage", "classes"], hrows))


def _one_op(paths: list[str] | None) -> str:
    """The submodules run as one op, shortened: the layer indices of a stack folded into ``N``."""
    if not paths:
        return "–"
    kinds = list(dict.fromkeys(re.sub(r"\.\d+\.", ".N.", p) for p in paths))
    return ", ".join(f"`{k}`" for k in kinds[:3]) + (f" (+{len(kinds) - 3} more)" if len(kinds) > 3 else "")


def which_data_dependent(r: Results) -> str:
    d = r("hf_sweep/data-dependent.json")
    rows = []
    for x in d["records"]:
        if x["status"] == "ok":
            result = "ok"
        elif x.get("predicted_peak_bytes") is not None:
            result = "plans; " + x.get("cause", "")
        else:
            result = "error: " + x.get("message", x.get("cause", ""))[:120].split(" which neither")[0] + "…"
        exact = x.get("exact") or {}
        rows.append([x["model"], result, _one_op(x.get("one_op")),
                     pct(x.get("prediction_error"), 3) if x.get("prediction_error") is not None else "–",
                     times(x.get("peak_ratio_vs_hf")) if x.get("peak_ratio_vs_hf") is not None else "–",
                     "yes" if exact.get("identical") else ("–" if not exact else "no")])
    ok = sum(x["status"] == "ok" for x in d["records"])
    return block(
        "### Models whose forward reads a tensor's value",
        "The 14 models the sweep above stops on, re-run with the submodule that reads a value run as one op "
        f"(docs/design.md §11): {ok} of {len(d['records'])} are ok. \"Plans; peak above HF checkpointing\": the "
        "model plans and trains bit-identically, predicted within 0.01%, but what runs as one op is a whole "
        "encoder or decoder (LayerDrop's draw sits in the stack's loop; Longformer's encoder reads its "
        "global-attention flag and hands it down as a Python value, so the whole model goes), nothing inside "
        "it is checkpointed, and HF's per-layer checkpointing peaks lower; for LayerDrop, `explain()` says to "
        "set the layer-drop probability to 0 to plan inside it. Measured as in the sweep above.",
        table(["model", "result", "run as one op", "prediction error", "peak / HF's", "bit-identical"], rows),
        source(r, "hf_sweep/data-dependent.json"))


def which_others(r: Results) -> str:
    s = r("hf_sweep/latest-sample.json")
    st = Counter(x["status"] for x in s["records"])
    fam = r("hf_families/latest.json")
    dif = r("diffusers_models/latest.json")
    ft = r("finetune_stack/latest.json")
    pairs = sorted({(x["arch"], x["mode"]) for x in ft["rows"]})
    return block(
        "### Other model sets",
        table(["set", "models", "result"],
              [[f"the sweep sample on `{meta_of(s).get('ckptopt_commit')}` (`--only` its list)", len(s["records"]),
                ", ".join(f"{k} {v}" for k, v in st.items())],
               ["transformers families at 6 layers, width 256", len(fam["results"]),
                ", ".join(x["model"] for x in fam["results"])],
               ["diffusers", len(dif["results"]), ", ".join(x["model"] for x in dif["results"])],
               ["fine-tuning through `Trainer`", len(pairs), ", ".join(f"{a} {m}" for a, m in pairs)]]),
        source(r, "hf_sweep/latest-sample.json"))


# --------------------------------------------------------------------------
# 6. On the GPU
# --------------------------------------------------------------------------
def _cases(r: Results, rel: str) -> dict:
    return {(c["model"], c["way"]): c for c in r(rel)["cases"]}


def gpu_models_table(r: Results, peers_rel: str, ckpt_rels: list[str]) -> str:
    """One row per model: none and peer from ``peers_rel``, ckptopt from ``ckpt_rels`` (later files win)."""
    peers = _cases(r, peers_rel)
    ck: dict = {}
    for rel in ckpt_rels:
        ck.update({k: v for k, v in _cases(r, rel).items() if k[1] == "ckptopt"})
    rows = []
    for m in sorted({m for m, _ in ck} | {m for m, _ in peers}):
        none, peer, c = peers.get((m, "none"), {}), peers.get((m, "peer"), {}), ck.get((m, "ckptopt"), {})
        batch = c.get("batch") or peer.get("batch") or none.get("batch") or {}
        ratio = (c["measured_peak_bytes"] / peer["measured_peak_bytes"]
                 if c.get("measured_peak_bytes") and peer.get("measured_peak_bytes") else None)
        st = c.get("same_training") or {}
        rows.append([m, "×".join(map(str, next(iter(batch.values())))) if batch else "not recorded",
                     b(none.get("measured_peak_bytes")), b(peer.get("measured_peak_bytes")),
                     b(c.get("measured_peak_bytes")), times(ratio), b(c.get("predicted_peak_bytes")),
                     pct(c.get("prediction_error")), len(c.get("checkpoints", [])) or "–",
                     f"{st['grad_max_abs_diff']:.2g}" if st else "–"])
    return table(["model", "batch (first input)", "none", "peer's checkpointing", "ckptopt", "ckptopt / peer",
                  "predicted (calibrated)", "error (predicted / measured − 1)", "checkpoints", "grad max abs diff"],
                 rows)


def card(r: Results, rel: str) -> str:
    return device_of(meta_of(r(rel)))


def gpu_models_section(r: Results) -> str:
    fix = "gpu_models/latest-h200-after-workspace-fix.json"
    return block(
        "### The transformers families and diffusers models on a GPU",
        "The models and batches of the CPU tables above, moved to CUDA; every case in a fresh process, one warm-up "
        "step, then `torch.cuda.max_memory_allocated` of one step. ckptopt calibrates on CUDA (library workspaces "
        "and operator scratch join the prediction). Peer: transformers' `activation_checkpointing_enable` or "
        "diffusers' `enable_gradient_checkpointing()`. Bytes.",
        f"**{card(r, 'gpu_models/latest-h100.json')}**, the benchmarks' batches:",
        gpu_models_table(r, "gpu_models/latest-h100-with-peers.json", ["gpu_models/latest-h100.json"]),
        source(r, "gpu_models/latest-h100-with-peers.json", "none and peer"),
        source(r, "gpu_models/latest-h100.json", "ckptopt"),
        f"**{card(r, 'gpu_models/latest-h200.json')}**, the benchmarks' batches (ckptopt only, so no ratio: the "
        "peers at these batches were measured on the other card):",
        gpu_models_table(r, "gpu_models/latest-h200.json", ["gpu_models/latest-h200.json", fix]),
        source(r, "gpu_models/latest-h200.json"),
        source(r, fix, f"its {len(r(fix)['cases'])} models replace their rows of the file above"),
        f"**{card(r, 'gpu_models/latest-h200-x8.json')}**, 8× the batch (the libraries' fixed workspace a smaller "
        "share of the peak):",
        gpu_models_table(r, "gpu_models/latest-h200-x8-with-peers.json", ["gpu_models/latest-h200-x8.json"]),
        source(r, "gpu_models/latest-h200-x8-with-peers.json", "none and peer"),
        source(r, "gpu_models/latest-h200-x8.json", "ckptopt"),
        "The same script on the CPU at 8× the batch, the tensor model alone: " + cpu_x8_line(r),
        source(r, "gpu_models/latest-cpu-x8.json"))


def cpu_x8_line(r: Results) -> str:
    cases = r("gpu_models/latest-cpu-x8.json")["cases"]
    return "; ".join(f"{c['model']} ({c['way']}) measured {b(c.get('measured_peak_bytes'))}, predicted "
                     f"{b(c.get('predicted_peak_bytes'))}, training {training(c.get('same_training'))}"
                     for c in cases) + "."


GPU_MODELS = {"resnet50": "ResNet-50 b64 224²", "hf-llama": "Llama 12×1024, b8×1024", "gpt": "GPT 12×768, b8×1024",
              "hf-gpt2": "GPT-2 12×768, b8×1024", "hf-bert": "BERT 12×768, b8×1024", "unet": "U-Net b8 256²"}


def gpu_accuracy_section(r: Results) -> str:
    rows = []
    rels = ["gpu_accuracy/latest-h100.json", "gpu_accuracy/latest-h200-gpt.json",
            "gpu_accuracy/latest-h200-bert-unet.json"]
    for rel in rels:
        d = r(rel)
        dev = device_of(meta_of(d))
        for name, plans in d["peaks"].items():
            for p in plans:
                rows.append([GPU_MODELS.get(name, name), p["plan"], dev, b(p.get("predicted_tensors")),
                             b(p.get("predicted_calibrated")), b(p.get("measured")), pct(p.get("error_tensors")),
                             pct(p.get("error_calibrated")), b(p.get("workspace_bytes"))])
    small = r("gpu_accuracy/latest-small.json")
    srows = [[name, p["plan"], b(p.get("predicted_tensors")), b(p.get("measured")), pct(p.get("error_tensors"))]
             for name, plans in small["peaks"].items() for p in plans]
    return block(
        "### Zoo and transformers models at GPU sizes: predicted against `max_memory_allocated`",
        "Tensors only: the traced cost model; calibrated: plus operator scratch and the libraries' workspace. The "
        "optimal plan is solved on the calibrated costs.",
        table(["model", "plan", "device", "predicted (tensors)", "predicted (calibrated)", "measured",
               "error, tensors", "error, calibrated", "workspace"], rows),
        *(source(r, rel) for rel in rels),
        "The same script at CPU sizes (a smoke run; no allocator, so both predictions are the tensor model's):",
        table(["model", "plan", "predicted", "measured", "error (predicted / measured − 1)"], srows),
        source(r, "gpu_accuracy/latest-small.json"))


def gpu_allocator_replay(r: Results) -> str:
    d = r("allocator_replay/latest.json")
    rows = []
    built = {x["name"]: x for x in d.get("synthesized", [])}
    for with_dev, without in zip(d["recorded_addresses"], d["replay_addresses"]):
        worst = max(without["phases"], key=lambda p: abs(p["max_reserved"] - p["recorded_max_reserved"]))
        exact = sum(p["max_reserved"] == p["recorded_max_reserved"] and p["reserved"] == p["recorded_reserved"]
                    for p in with_dev["phases"])
        answer = ("out of memory at the device's request" if without["device_failed_at"] is not None
                  else "fits") if without["fits_answer_right"] else "wrong"
        syn = built.get(without["name"])
        if syn is None:
            syn_cells = ["–", "–"]
        else:
            steps = ", ".join(f"{mib(x['max_reserved'] - x['recorded_max_reserved'], 0)}" for x in syn["steps"])
            syn_ans = (f"out of memory in {syn['replay_failed_in']}" if syn["replay_failed_in"] else "fits") + \
                ("" if syn["fits_answer_right"] else " (wrong)")
            syn_cells = [steps + (" (convolutions)" if syn["unsupported"] else ""), syn_ans]
        rows.append([without["name"], "–" if without["allocator"] == "expandable" else f"{exact}/{len(with_dev['phases'])}",
                     f"{mib(worst['max_reserved'] - worst['recorded_max_reserved'], 0)} ({worst['phase']})",
                     mib(without["largest_segment"], 0), answer, *syn_cells])
    first = d["recorded_addresses"][0]
    return block(
        "### Reserved memory, replayed",
        "Each recorded allocator history (`benchmarks/data/cuda_alloc`: "
        f"{first['device']}, torch {first['torch']}; the whole life of one process: model, plan, two Adam steps) "
        "replayed through `ckptopt.simulator.allocator.CachingAllocator` from its requested sizes, with the case's "
        "capacity. \"Device addresses\": new segments placed where the device put them (the allocator breaks ties "
        "between equal free blocks by address), phases whose reserved bytes and peak equal the recorded ones. "
        "Without them, as a prediction runs: the largest error of the peak reserved over the case's phases, against "
        "the case's largest segment (or mapping), and the fits / out-of-memory answer at the recorded capacity. "
        "Cases run with expandable segments are replayed with `ExpandableAllocator` (one segment of address space "
        "per pool: no address to know). \"Built without the device\": the loop's allocations made on the CPU "
        "(`ckptopt.planning.reserved.step_events`: the model as `.to()` allocates it, each step from a fake step "
        "under the storage tracker, cuBLAS's workspaces, Adam's foreach state and temporaries by rule) and replayed: "
        "each step's peak reserved minus the recorded one, and where it runs out of memory (the device's answer "
        "in the answer column). `max_batch` on CUDA answers this way; it declines models with convolutions, whose "
        "cuDNN workspaces the device sizes at run time (marked).",
        table(["case", "device addresses: exact phases", "replay alone: worst peak error", "largest segment",
               "answer", "built without the device: step peaks' error", "its answer"], rows),
        _max_batch_replayed(d),
        source(r, "allocator_replay/latest.json"))


def _max_batch_replayed(d: dict) -> str:
    """A sentence on ``max_batch(..., device="cuda")``'s answers planned here (the file's ``max_batch_8gib``)."""
    answers = d.get("max_batch_8gib")
    if not answers:
        return ""
    parts = []
    for name, entry in answers.items():
        res = entry["result"]
        fits = []
        for key, label in (("no_checkpointing", "without checkpoints"), ("optimal", "with the optimal plan")):
            f = res[key]
            fits.append(f"{f['batch']} {label}" + (f" (reserving {mib(f['reserved_bytes'], 0)})"
                                                    if f.get("reserved_bytes") else ""))
        how = "the replay" if res["fitted_by"] == "replay" else f"the headroom share ({res['replay_note']})"
        parts.append(f"{name}: {', '.join(fits)}, fitted by {how}, in {entry['seconds']:.0f} s")
    return ("`max_batch(model, x, \"8GiB\", optimizer=\"adam\", device=\"cuda\")` planned on this machine for the "
            "models `gpu_max_batch.py` trains (for a GPU session to train): " + "; ".join(parts) + ".")


def gpu_max_batch_section(r: Results) -> str:
    rows = []
    for label, ans_rel, run_rel in (("", "gpu_accuracy/latest-h200-max-batch.json", "gpu_max_batch/latest-h200.json"),
                                    ("keep output", "gpu_accuracy/latest-h200-max-batch-keep-output.json",
                                     "gpu_max_batch/latest-h200-keep-output.json")):
        ans = r(ans_rel)["max_batch"]
        runs = {(c["model"], c["strategy"], c["allocator"]): c for c in r(run_rel)["cases"]}
        for model, entry in ans.items():
            res = entry["search"]["result"]
            for strategy in ("no_checkpointing", "optimal"):
                fit = res[strategy]

                def cell(alloc):
                    c = runs.get((model, strategy, alloc))
                    if not c:
                        return "–"
                    if c.get("largest_fitting") is None:
                        return f"none of {c['batch']}…{min(x['batch'] for x in c['rows'])}" if c.get("rows") else \
                            c.get("error", "–")[:60]
                    return f"{c['largest_fitting']} ({pct(c.get('overhead_at_largest'), 1, False)})"
                rows.append([model, strategy.replace("_", " ") + (f", {label}" if label else ""), fit["batch"],
                             b(fit["peak_bytes"]), cell("default"), cell("expandable")])
    return block(
        "### Max batch on the GPU",
        "`max_batch(model, x, \"8GiB\", optimizer=\"adam\")`, calibrated, default headroom; then each answer trained "
        "(two Adam steps) in a fresh process under an 8 GiB cap, batches 3% apart until the largest that fits, with "
        "the default allocator and with `expandable_segments:True`. Overhead: reserved / allocated − 1 at the "
        "largest batch that fit.",
        table(["model", "plan", "answer", "predicted peak", "default allocator: largest that fit (overhead)",
               "expandable segments: largest that fit (overhead)"], rows),
        source(r, "gpu_accuracy/latest-h200-max-batch.json", "answers"),
        source(r, "gpu_max_batch/latest-h200.json"),
        source(r, "gpu_accuracy/latest-h200-max-batch-keep-output.json", "answers, keep output"),
        source(r, "gpu_max_batch/latest-h200-keep-output.json"))


LOGS = (  # (file, device, command, what it records): the printed reports of the two diagnostic scripts
    ("gpu_gap/latest-h100.log", "NVIDIA H100 80GB HBM3",
     "python benchmarks/gpu_gap.py GPTNeoXForCausalLM:ckptopt BartForConditionalGeneration:ckptopt "
     "UNet2DConditionModel:ckptopt hf-llama:ckptopt resnet50:none SD3Transformer2DModel:none",
     "allocator against tracker op by op, on 6866fad: before the fix of the planning leak (4d2b3c0)"),
    ("gpu_gap/latest-h100-hf-llama.json", "NVIDIA H100 80GB HBM3", None,
     "the hf-llama case record of the run above (its per-op series)"),
    ("gpu_gap/latest-h200-x8.log", "NVIDIA H200",
     "python benchmarks/gpu_gap.py --batch-scale 8 CLIPModel:calibrated WhisperForConditionalGeneration:calibrated",
     "allocator against tracker at 8× the batch"),
    ("gpu_gap/latest-h200-diffusers.log", "NVIDIA H200",
     "python benchmarks/gpu_gap.py AutoencoderKL:calibrated UNet2DConditionModel:calibrated "
     "SD3Transformer2DModel:calibrated", "allocator against tracker on the diffusers models"),
    ("gpu_persistent/latest-h200.log", "NVIDIA H200",
     "python benchmarks/gpu_persistent.py GPTNeoXForCausalLM:none GPTNeoXForCausalLM:ckptopt AutoencoderKL:none "
     "CLIPModel:none", "the blocks a step leaves allocated, with the frames that allocated them"),
)


def gpu_logs(r: Results) -> str:
    for rel, *_ in LOGS:
        r.require(rel)
    return block("### Diagnostic records",
                 "The printed reports of `gpu_gap` (where a CUDA step's allocated bytes part from the tensor model, "
                 "op by op) and `gpu_persistent` (what a step leaves allocated, and who allocated it):",
                 table(["file", "device", "command", "records"],
                       [[f"`benchmarks/results/{rel}`", dev, f"`{cmd}`" if cmd else "–", what]
                        for rel, dev, cmd, what in LOGS]))


# --------------------------------------------------------------------------
# at a glance: one line per question, each figure computed from the files the sections use
# --------------------------------------------------------------------------
def glance(r: Results) -> str:
    zoo = r("prediction_accuracy/latest.json")["models"]
    zoo_exact = sum(0 <= m["measured_bytes"] - m["predicted_bytes"] <= 8 for m in zoo)
    fz = r("exactness_fuzz/latest.json")["summary"]
    fz_plans = sum(f["plans"] for k, f in fz.items() if k != "run")
    fz_exact = sum(f["exact"] for k, f in fz.items() if k != "run")
    rp = r("exactness_fuzz/latest-replay.json")["models"]
    sw = r("hf_sweep/latest.json")
    ok = [x for x in sw["records"] if x["status"] == "ok"]
    built = sum(x["status"] != "harness" for x in sw["records"])
    fam = r("hf_families/latest.json")["results"]
    fr = [x["ratio_ckptopt_vs_hf"] for x in fam if x.get("ratio_ckptopt_vs_hf")]
    dif = [res["cases"]["ckptopt"].get("ratio_vs_diffusers") for res in r("diffusers_models/latest.json")["results"]]
    swr = dist([x.get("peak_ratio_vs_hf") for x in ok])
    sol = r("solver_scaling/latest.json")
    lin = max(sol["seconds"]["linear"], key=int)
    tr = r("tracing_time/latest.json")["models"]
    full = r("full_size/latest.json")["rows"]
    plan_t = {x["case"]: x["shared"]["total_seconds"] for x in r("planning_time/latest.json")["rows"] if "error" not in x}
    cal = [p["error_calibrated"] for rel in ("gpu_accuracy/latest-h100.json", "gpu_accuracy/latest-h200-gpt.json",
                                               "gpu_accuracy/latest-h200-bert-unet.json")
           for plans in r(rel)["peaks"].values() for p in plans if p.get("error_calibrated") is not None]
    lines = [
        f"**Exact?** {zoo_exact} of {len(zoo)} zoo models predicted within the 8-byte loss without checkpointing; "
        f"{fz_exact:,} of {fz_plans:,} plans of random models exact in the newest fuzz run; {sum(not m['inexact'] for m in rp)} "
        f"of {len(rp)} recorded once-inexact random models exact on every replayed plan; {len(ok)} transformers "
        f"architectures ok (trained bit-identically, within 1%), {sum(abs(x['measured_peak_bytes'] - x['predicted_peak_bytes']) <= 8 for x in ok)} "
        "of them within 8 B.",
        f"**Lower than the peers?** Against transformers' checkpointing {times(min(fr))} to {times(max(fr))} on the "
        f"five families and {times(swr['median'])} median ({times(swr['min'])} to {times(swr['max'])}) over the sweep; "
        f"against diffusers' {times(min(dif))} to {times(max(dif))}.",
        f"**Fast?** `linear` solves {int(lin):,} layers in {secs(sol['seconds']['linear'][lin])} (optimum pass); "
        f"tracing takes {secs(max(m['median_seconds'] for m in tr))} at most on the benchmark's large models "
        f"({max(m['n'] for m in tr)} layers); `optimize_checkpoints` plans a 4-layer transformers Llama in "
        f"{secs(plan_t.get('llama4'))} and a 12-layer one in {secs(plan_t.get('llama12'))}, and `estimate` takes "
        f"{secs(plan_t.get('llama3-8b'))} for Llama-3-8B and {secs(plan_t.get('llama3-70b'))} for 70B (one thread, "
        "\"Where a planning second goes\").",
        f"**Large?** {', '.join(x['model'] for x in full)} planned without weights in "
        f"{secs(max(x['seconds'] for x in full))} at most, with at most {mib(max(x['max_rss_bytes'] for x in full), 0)} "
        "resident.",
        f"**Which models?** {len(ok)} of {built} buildable transformers architectures of six auto mappings "
        f"({pct(len(ok) / built, 1, False)}).",
        f"**GPU?** Calibrated predictions within {pct(min(cal))} to {pct(max(cal))} of `max_memory_allocated` on the "
        "zoo and transformers models at GPU sizes.",
    ]
    return "\n".join(wrap(line, initial_indent="- ", subsequent_indent="  ") for line in lines)


# --------------------------------------------------------------------------
# the document
# --------------------------------------------------------------------------
SECTIONS: list[tuple[str, str, list[Callable[[Results], str]]]] = [
    ("Is it exact?",
     "ckptopt predicts a training step's peak memory from a trace and picks the plan with the lowest predicted peak, "
     "so the prediction has to be the measurement. On the CPU the measurement is exact: a storage tracker counts "
     "every byte of every live tensor. A difference of +8 B is the scalar loss and its gradient, which the cost "
     "model leaves out; a negative difference is an over-prediction (a conservative plan), a positive one beyond "
     "8 B an under-prediction.",
     [exact_zoo, exact_plans, exact_step, exact_fuzz, exact_hf, exact_diffusers, exact_ranks, exact_loops]),
    ("How much lower than the peers?",
     "The peers are the checkpointing a user already has: transformers' `activation_checkpointing_enable`, diffusers' "
     "`enable_gradient_checkpointing()`, PyTorch's `checkpoint_sequential`, the √n and greedy heuristics. Every "
     "figure is a measured peak of one training step.",
     [peers_hf, peers_families, peers_sweep, peers_finetune, peers_zoo, peers_cuts]),
    ("How fast?",
     "Planning time (solvers, tracing, the plan check) and what a plan costs in step time. Times depend on the "
     "machine and its load; memory figures do not.",
     [fast_solvers, fast_tracing, fast_planning, fast_recompute, fast_op_time, fast_frontier, fast_frontier_eager]),
    ("How large?",
     "Full-size models are planned on the meta device, without their weights; per-rank figures price one rank of "
     "DDP or FSDP2 from one trace.",
     [large_full, large_ranks, large_batch]),
    ("Which models?",
     "Coverage: which architectures plan, train identically and are predicted, and why the others stop.",
     [which_sweep, which_data_dependent, which_others]),
    ("On the GPU",
     "GPU runs are few (a lent card, minutes at a time): each table names its card. On CUDA the measurement is "
     "`torch.cuda.max_memory_allocated`, which includes the libraries' workspaces and the allocator's rounding.",
     [gpu_models_section, gpu_accuracy_section, gpu_max_batch_section, gpu_allocator_replay, gpu_logs]),
]

HEADER = """# Benchmark results

<!-- Generated by `python -m benchmarks.report` from benchmarks/results/*/latest*.json. Do not edit by hand:
re-run a benchmark to change a figure, edit benchmarks/report.py to change the text. -->

This file is generated by `python -m benchmarks.report` from the newest result file of each benchmark
(`benchmarks/results/<benchmark>/latest*.json`). Every figure below comes from one of those files; each table
names its file, the command recorded in it, the ckptopt commit and date where the file records them, and the
device. Earlier runs are in git's history of those files."""


def slug(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


def build(root: Path = RESULTS, results: Results | None = None) -> str:
    """RESULTS.md's text from the result files under ``root`` (or those ``results`` reads);
    :class:`MissingResult` if one is missing."""
    r = results or Results(root)
    parts = [HEADER, "\n".join(f"{i}. [{t}](#{slug(t)})" for i, (t, _, _) in enumerate(SECTIONS, 1)),
             "## At a glance\n\n" + glance(r)]
    for title, intro, sections in SECTIONS:
        parts.append(f"## {title}\n\n{wrap(intro)}")
        parts += [fn(r) for fn in sections]
    return "\n\n".join(parts).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare with benchmarks/RESULTS.md (exit 1 if stale)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = build()
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} is "
              + ("up to date" if same else "stale: run `python -m benchmarks.report`"))
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
