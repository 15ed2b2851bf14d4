"""Smoke test of the paper_repro pipeline on its tiny configuration (one small MLP)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # paper_repro/ lives at the repository root, beside src/

pytest.importorskip("matplotlib")
from paper_repro.run import main  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("repro")
    assert main(["--mode", "tiny", "--device", "cpu", "--out", str(d), "--no-readme"]) == 0
    return d


def load(out, name):
    data = json.loads((out / name).read_text())
    meta = data["meta"]
    for key in ("date", "machine", "device", "device_name", "torch", "git_commit", "command"):
        assert meta.get(key), f"{name}: metadata lacks {key}"
    return data["results"]


def test_every_output_exists(out):
    for stem in ("table1_peak_memory", "table2_solver_cost", "table3_time_overhead"):
        assert (out / f"{stem}.json").stat().st_size > 0
        md = (out / f"{stem}.md").read_text()
        assert "torch" in md and "|---" in md  # metadata line and a table
    for stem in ("fig_a_timeline", "fig_b_batch_sweep", "fig_c_solver_scaling"):
        assert (out / f"{stem}.json").stat().st_size > 0
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![a](fig_a_timeline.png)" in (out / "report.md").read_text()


def test_table1_measured_optimum_and_predictions(out):
    for m in load(out, "table1_peak_memory.json"):
        rows = m["strategies"]
        assert set(rows) == {"none", "sqrt", "chen-greedy", "dp", "linear"}
        opt = rows["dp"]["measured_bytes"]
        # the optimum, measured on real tensors, is no worse than any other strategy measured
        for s, r in rows.items():
            assert opt <= r["measured_bytes"] + 64, s
        # and it is strictly better than no checkpointing at this size (activations dominate)
        assert opt < rows["none"]["measured_bytes"]
        for r in rows.values():  # the chain model predicts the tracker's count to the scalar loss
            assert abs(r["prediction_error_bytes"]) <= 64
        assert m["static_bytes"] == m["param_bytes"] + m["buffer_bytes"] + m["input_bytes"]


def test_table2_compares_linear_with_dp(out):
    for m in load(out, "table2_solver_cost.json"):
        cmp = m["linear_vs_dp"]
        assert cmp["peak_difference_bytes"] >= 0  # dp is exact, linear cannot beat it
        assert cmp["same_plan"] == (m["linear"]["checkpoints"] == m["dp"]["checkpoints"])
        assert m["dp_equals_dp2_peak"]


def test_timeline_figure_data_is_consistent(out):
    tl = load(out, "fig_a_timeline.json")
    for s, d in tl["plans"].items():
        assert max(d["measured_bytes"]) == d["measured_peak"]
        assert max(e["bytes"] for e in d["predicted"]) == d["predicted_peak"]
        assert abs(d["measured_peak"] - d["predicted_peak"]) <= 64, s
        xs = [(e["x0"], e["x1"]) for e in d["predicted"]]
        assert all(0 <= a <= b <= 1 for a, b in xs)
        assert all(b0 <= a1 + 1e-9 for (_, b0), (a1, _) in zip(xs, xs[1:]))  # events in run order


def test_sweep_grows_with_batch_and_scaling_agrees(out):
    rows = load(out, "fig_b_batch_sweep.json")["rows"]
    for s in rows[0]["strategies"]:
        assert rows[0]["strategies"][s]["measured_bytes"] < rows[-1]["strategies"][s]["measured_bytes"]
    sc = load(out, "fig_c_solver_scaling.json")
    assert not sc["solvers_disagree"]
    assert set(sc["seconds"]) == {"dp", "dp2", "linear"}
