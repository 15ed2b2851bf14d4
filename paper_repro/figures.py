"""The three PNG figures, drawn from the JSON the experiments wrote (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from .env import metadata_line

MiB = 2**20
COLORS = {"none": "tab:gray", "sqrt": "tab:orange", "chen-greedy": "tab:green", "dp": "tab:blue",
          "linear": "tab:purple", "dp2": "tab:cyan"}
LABELS = {"none": "no checkpointing", "sqrt": "sqrt (Chen, by count)", "chen-greedy": "Chen greedy",
          "dp": "optimal (dp)", "linear": "linear (O(n))", "dp2": "dp2"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _footer(fig, meta: dict) -> None:
    fig.text(0.005, 0.003, metadata_line(meta), fontsize=5.5, alpha=0.75)


def timeline_figure(data: dict, meta: dict, path: Path) -> None:
    """Figure (a): measured live bytes after every operator, predicted events as steps, per plan."""
    plt = _plt()
    plans = list(data["plans"])
    fig, axes = plt.subplots(len(plans), 1, figsize=(9, 2.6 * len(plans) + 0.8), sharex=True, sharey=True)
    axes = [axes] if len(plans) == 1 else list(axes)
    for ax, s in zip(axes, plans):
        d = data["plans"][s]
        total = d["total_ops"]
        xs = [(i + 1) / total for i in range(total)]
        ax.plot(xs, [b / MiB for b in d["measured_bytes"]], color=COLORS.get(s, "k"), lw=0.8,
                label=f"measured (peak {d['measured_peak'] / MiB:.1f} MiB)")
        xs, ys = [], []
        for e in d["predicted"]:
            xs += [e["x0"], e["x1"], float("nan")]
            ys += [e["bytes"] / MiB, e["bytes"] / MiB, float("nan")]
        ax.plot(xs, ys, "-", color="k", lw=1.6, alpha=0.75,
                label=f"predicted, per layer event (peak {d['predicted_peak'] / MiB:.1f} MiB)")
        spans: dict[int, list] = {}
        for e in d["predicted"]:
            if e["phase"] == "recompute":
                lo, hi = spans.get(e["segment"], (e["x0"], e["x1"]))
                spans[e["segment"]] = (min(lo, e["x0"]), max(hi, e["x1"]))
        for lo, hi in spans.values():
            ax.axvspan(lo, hi, color="tab:red", alpha=0.1, lw=0)
        ax.axvline(d["forward_ops"] / total, color="k", ls=":", lw=0.8)
        ax.axhline(data["static_bytes"] / MiB, color="tab:brown", ls="--", lw=0.8)
        ax.set_ylabel("MiB")
        segs = len(d["checkpoints"]) + 1
        ax.set_title(f"{LABELS.get(s, s)}: {segs} segment{'s' if segs > 1 else ''}", fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.25)
    axes[-1].set_xlabel("fraction of the training step (measured operator index / operators in the step)")
    fig.suptitle(
        f"(a) Memory during one training step, {data['label']} ({data['size_text']}); "
        f"dotted: end of forward, dashed: static bytes, red bands: recomputation", fontsize=9)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    _footer(fig, meta)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def batch_figure(data: dict, meta: dict, path: Path) -> None:
    """Figure (b): peak memory against batch size for each strategy, measured and predicted."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    rows = data["rows"]
    bs = [r["batch_size"] for r in rows]
    for s in rows[0]["strategies"]:
        meas = [r["strategies"][s]["measured_bytes"] / MiB for r in rows]
        pred = [r["strategies"][s]["predicted_bytes"] / MiB for r in rows]
        ax.plot(bs, meas, "-o", color=COLORS.get(s, "k"), ms=4, label=f"{LABELS.get(s, s)} measured")
        ax.plot(bs, pred, "x", color=COLORS.get(s, "k"), ms=8, mew=1.2)
    floor = [(r["static_bytes"] + r["param_grad_bytes"]) / MiB for r in rows]
    ax.plot(bs, floor, "--", color="tab:brown", lw=1, label="parameters + buffers + input + parameter gradients")
    ax.plot([], [], "x", color="k", label="predicted (x)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("peak memory of one training step (MiB)")
    sz = data["sizes"].get("input_size")
    ax.set_title(f"(b) Peak memory against batch size, {data['model']}"
                 + (f" at {sz}x{sz}" if sz else "") + f" (measured on {data['measured_with']} tensors)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    _footer(fig, meta)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def scaling_figure(data: dict, meta: dict, path: Path) -> None:
    """Figure (c): solver time against n, log-log, with fitted slopes."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.6, 4.4))
    for s, marker in zip(data["seconds"], "osd^"):
        pts = sorted((int(n), t) for n, t in data["seconds"][s].items())
        slope = data["slopes"].get(s)
        lab = f"{s} (log-log slope {slope:.2f})" if slope is not None else s
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=COLORS.get(s, "k"), label=lab)
    ax.set_xlabel("n (candidate cuts = layers)")
    ax.set_ylabel("solve time (s), median")
    ax.set_title("(c) Solver time against n, random additive instances", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    _footer(fig, meta)
    fig.savefig(path, dpi=130)
    plt.close(fig)
