"""``ckptopt.planning.frontier`` and ``ckptopt frontier``: plans from the lowest peak to no
checkpointing, each the least-recomputation plan at its peak, measured where asked."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ckptopt import optimize_checkpoints, simulate, trace
from ckptopt.cli import main
from ckptopt.planning.frontier import frontier


def mlp(depth=6, width=64, batch=64, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)],
                        nn.Linear(width, 10))
    return net, torch.randn(batch, width)


def test_points_run_from_the_lowest_peak_and_trade_memory_for_time():
    net, x = mlp()
    points = frontier(net, x, points=6)
    tm = trace(net, x)
    none, plans = points[0], points[1:]
    assert none.label == "no checkpointing" and none.predicted_peak_bytes == simulate(tm.costs, ()).peak_bytes
    assert len(plans) >= 2 and plans[0].label == "ckptopt, lowest peak"
    assert plans[0].predicted_peak_bytes == optimize_checkpoints(net, x, in_place=False).predicted_peak_bytes
    for p in plans:
        sim = simulate(tm.costs, p.checkpoints, p.stored)
        assert p.predicted_peak_bytes == sim.peak_bytes < none.predicted_peak_bytes
        assert p.predicted_time_ratio == pytest.approx(1 + sim.recompute_share)
        # each is the plan a budget at its peak gets
        again = optimize_checkpoints(net, x, budget=p.predicted_peak_bytes, in_place=False)
        assert again.plan.checkpoints == p.checkpoints
    peaks = [p.predicted_peak_bytes for p in plans]
    times = [p.predicted_time_ratio for p in plans]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    assert all(a > b for a, b in zip(times, times[1:]))  # more memory, less time
    assert len({(p.checkpoints, p.stored) for p in plans}) == len(plans)


def test_measured_points_are_the_predicted_peaks():
    net, x = mlp(depth=4)
    points = frontier(net, x, points=3, measure=True, rounds=2)
    assert points[0].time_ratio == 1.0
    for p in points:
        # exact on the CPU, but for the loss scalar (8 B), which the tracker sees alive at the peak
        assert 0 <= p.measured_peak_bytes - p.predicted_peak_bytes <= 8
        assert p.median_seconds > 0 and p.time_ratio > 0


def test_a_transformers_model_is_measured_beside_its_own_checkpointing():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 128, (2, 16))
    batch = dict(input_ids=ids, labels=ids)
    points = frontier(model, batch, points=3, measure=True, rounds=2)
    hf = [p for p in points if p.label.startswith("transformers")]
    assert len(hf) == 1 and hf[0].measured_peak_bytes > 0 and hf[0].predicted_peak_bytes is None
    assert not getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False))  # (a copy was checkpointed)
    best = min(p.measured_peak_bytes for p in points if p.label.startswith("ckptopt"))
    assert best <= hf[0].measured_peak_bytes


def test_bad_arguments_are_refused():
    net, x = mlp(depth=2)
    with pytest.raises(ValueError, match="points"):
        frontier(net, x, points=0)
    with pytest.raises(ValueError, match="rounds"):
        frontier(net, x, rounds=0)


def test_cli_prints_writes_json_and_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "f.png"
    assert main(["frontier", "resnet18", "--batch", "8", "--input-size", "64", "--points", "3", "--png",
                 str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["points"][0]["label"] == "no checkpointing" and len(out["points"]) >= 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["frontier", "mlp", "--points", "2"]) == 0
    assert "checkpointing does not pay" in capsys.readouterr().out
    assert main(["frontier", "mlp", "--points", "0"]) == 2
