"""Markdown tables from the experiments' JSON (every number comes from there)."""

from __future__ import annotations

from .config import STRATEGIES
from .env import metadata_line

MiB = 2**20


def _mib(b: int) -> str:
    return f"{b / MiB:.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _meta_block(meta: dict) -> str:
    return f"_Run: {metadata_line(meta)}; measured with {meta['measured_with']}._\n"


def table1(models: list[dict], meta: dict) -> str:
    """Table 1: peak memory per model and strategy; reductions; static memory apart."""
    strat = [s for s in STRATEGIES]
    lines = ["### Table 1a. Peak memory of one training step, MiB: measured (predicted)", "",
             _meta_block(meta),
             "| model | size | n | static: params + buffers + input | parameter grads | "
             + " | ".join(strat) + " | max abs(pred − meas) |",
             "|---|---|---|---|---|" + "---|" * len(strat) + "---|"]
    for m in models:
        rows = m["strategies"]
        cells = [f"{_mib(rows[s]['measured_bytes'])} ({_mib(rows[s]['predicted_bytes'])})" if s in rows else "–"
                 for s in strat]
        err = max(abs(r["prediction_error_bytes"]) for r in rows.values())
        lines.append(f"| {m['label']} | {m['size_text']} | {m['n']} | {_mib(m['static_bytes'])} | "
                     f"{_mib(m['param_grad_bytes'])} | " + " | ".join(cells) + f" | {err:,} B |")
    lines += ["", "### Table 1b. Reduction of the measured peak against no checkpointing: "
              "whole peak / activation part only", "",
              "Activation part = peak − (parameters + buffers + input) − parameter gradients.", "",
              "| model | activation part, no checkpointing (MiB) | " + " | ".join(strat[1:])
              + " | optimal plan: segments, where its peak is |",
              "|---|---|" + "---|" * (len(strat) - 1) + "---|"]
    for m in models:
        rows = m["strategies"]
        cells = [f"{_pct(-rows[s]['reduction_vs_none_measured'])} / {_pct(-rows[s]['activation_reduction_vs_none_measured'])}"
                 if s in rows else "–" for s in strat[1:]]
        opt = rows.get("dp", rows["linear"])
        lines.append(f"| {m['label']} | {_mib(rows['none']['activation_bytes_measured'])} | " + " | ".join(cells)
                     + f" | {opt['segments']}; {opt['peak_phase']} of {opt['peak_layer_name']} |")
    return "\n".join(lines) + "\n"


def table2(models: list[dict], meta: dict) -> str:
    """Table 2: solver cost on each model and linear's plan against dp's."""
    lines = ["### Table 2. Solver cost per model (median of repeated runs) and linear's plan against dp's", "",
             _meta_block(meta),
             "| model | n (candidate cuts) | dp O(n³) | dp2 O(n²) | linear O(n) | dp / linear | "
             "linear's plan = dp's | linear − dp peak (bytes) | (%) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        s = m["solvers"]
        t = {k: s[k]["median_seconds"] for k in ("dp", "dp2", "linear") if k in s}
        cmp = s["linear_vs_dp"]
        ratio = f"{t['dp'] / t['linear']:.0f}×" if "dp" in t and t["linear"] > 0 else "–"
        lines.append(
            f"| {m['label']} | {m['n']} | " + " | ".join(f"{1e6 * t[k]:.0f} µs" if k in t else "–"
                                                      for k in ("dp", "dp2", "linear"))
            + f" | {ratio} | {'yes' if cmp['same_plan'] else 'no'} | {cmp['peak_difference_bytes']:,} | "
            f"{cmp['peak_difference_pct']:+.3f}% |")
    return "\n".join(lines) + "\n"


def table3(models: list[dict], meta: dict) -> str:
    """Table 3: step time of each plan against no checkpointing."""
    timed = [m for m in models if m.get("timing")]
    lines = ["### Table 3. Time of one training step, relative to no checkpointing "
             "(median of interleaved runs)", "", _meta_block(meta)]
    if not timed:
        lines.append("Not measured in this run (full mode on a CPU: the steps are too slow to repeat here).")
        return "\n".join(lines) + "\n"
    strat = list(STRATEGIES)
    rounds = len(next(iter(timed[0]["timing"].values()))["seconds"])
    lines[0] += f", {rounds} rounds"
    lines += ["| model | no checkpointing (s) | " + " | ".join(strat[1:]) + " | optimal: peak saved |",
              "|---|---|" + "---|" * (len(strat) - 1) + "---|"]
    for m in timed:
        t = m["timing"]
        cells = [f"{t[s]['ratio_vs_none']:.2f}×" if s in t else "–" for s in strat[1:]]
        opt = m["strategies"].get("dp", m["strategies"]["linear"])
        lines.append(f"| {m['label']} | {t['none']['median_seconds']:.3f} | " + " | ".join(cells)
                     + f" | {_pct(-opt['reduction_vs_none_measured'])} |")
    return "\n".join(lines) + "\n"


def figures_block(meta: dict, files: dict, captions: dict) -> str:
    out = ["### Figures", ""]
    for key, fname in files.items():
        out += [f"![{key}]({fname})", "", captions[key], ""]
    return "\n".join(out)


def scaling_table(data: dict) -> str:
    ns = sorted({int(n) for v in data["seconds"].values() for n in v})
    lines = ["| solver | " + " | ".join(f"n={n:,}" for n in ns) + " | log-log slope |",
             "|---|" + "---|" * (len(ns) + 1)]
    for s, v in data["seconds"].items():
        cells = [f"{v[str(n)]:.3g} s" if str(n) in v else "" for n in ns]
        slope = data["slopes"].get(s)
        lines.append(f"| {s} | " + " | ".join(cells) + (f" | {slope:.2f} |" if slope is not None else " | – |"))
    return "\n".join(lines) + "\n"
