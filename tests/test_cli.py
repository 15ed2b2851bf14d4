"""The command line, run in-process through ckptopt.cli.main."""

import json

import pytest

from ckptopt.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_solve_example_table(capsys):
    code, out, _ = run(capsys, "solve", "--costs", "example")
    assert code == 0
    for name in ("none", "every", "sqrt", "chen-greedy", "linear", "dp2", "dp"):
        assert f"\n{name} " in out
    assert "no checkpointing peaks at" in out


def test_solve_json_and_budget(capsys, tmp_path):
    code, out, _ = run(capsys, "solve", "--costs", "example", "--solver", "dp2", "--solver", "none", "--json")
    data = json.loads(out)
    peaks = {r["solver"]: r["peak_bytes"] for r in data["results"]}
    assert peaks["dp2"] < peaks["none"] == data["no_checkpointing_bytes"]
    code, out, _ = run(capsys, "solve", "--costs", "example", "--solver", "dp2", "--budget", "1MiB", "--json")
    assert "min_peak_bytes" in json.loads(out)["results"][0]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["solve", "--costs", "example", "--budget", "12 parsecs"], "not a memory size"),
        (["solve", "--costs", "/nonexistent.json"], "cannot read"),
        (["solve", "--costs", "example", "--solver", "magic"], "valid solvers"),
        (["profile", "nosuchmodel"], "unknown"),
        (["profile", "nosuchpkg.mod:factory"], "cannot import"),
        (["estimate", "mlp", "--strategy", "fsdp"], "--strategy needs --world-size"),
        (["estimate", "mlp", "--world-size", "0"], "world_size must be a positive integer"),
        (["estimate", "mlp", "--world-size", "2", "--rank", "2"], "rank must be in 0..1"),
        (["estimate", "mlp", "--mixed-precision", "bf16"], "--mixed-precision is fsdp2's policy"),
        (["estimate", "mlp", "--world-size", "2", "--mixed-precision", "bf16"], "use it with strategy='fsdp'"),
    ],
)
def test_errors_exit_2_with_message(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and match in err.lower()


def test_profile_table_and_json(capsys):
    code, out, _ = run(capsys, "profile", "resnet18", "--batch", "2", "--input-size", "32")
    assert code == 0
    assert "predicted peak with no checkpointing" in out and "layer1.0" in out and " <" in out
    code, out, _ = run(capsys, "profile", "mlp", "--batch", "4", "--json")
    data = json.loads(out)
    assert data["n_layers"] == len(data["layers"]) and data["predicted_peak_bytes"] > data["static_bytes"]
    assert sum(r["heavy"] for r in data["layers"]) == 5


def factory(batch_size=3):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (torch.randn(batch_size, 8),)


def test_profile_user_factory(capsys):
    code, out, _ = run(capsys, "profile", "tests.test_cli:factory", "--batch", "5", "--json")
    assert code == 0 and json.loads(out)["input_bytes"] == 5 * 8 * 4


def test_optimize_measure_json(capsys):
    code, out, _ = run(capsys, "optimize", "tests.test_cli:deep_factory", "--batch", "1024", "--measure", "--json")
    data = json.loads(out)
    # "dp2+stored" when unwrapped middle segments lower the peak or the recomputation (they do here)
    assert code == 0 and data["solver"] in ("dp2", "dp2+stored")
    assert set(data["stored"]) <= {0, *data["checkpoints"]}
    assert data["predicted_peak_bytes"] < data["no_checkpointing_predicted_bytes"]
    assert abs(data["measured_peak_bytes"] - data["predicted_peak_bytes"]) <= 8
    code, out, _ = run(capsys, "optimize", "tests.test_cli:deep_factory", "--batch", "64")
    assert "predicted peak" in out and "segment 0" in out


def test_compare_default_is_what_optimize_picks(capsys):
    code, out, _ = run(capsys, "compare", "tests.test_cli:deep_factory", "--batch", "1024", "--solvers",
                       "dp2,default", "--json")
    rows = {r["solver"]: r for r in json.loads(out)["rows"]}
    code2, out2, _ = run(capsys, "optimize", "tests.test_cli:deep_factory", "--batch", "1024", "--json")
    picked = json.loads(out2)
    assert code == code2 == 0
    assert (rows["default"]["checkpoints"], rows["default"]["stored"]) == (picked["checkpoints"], picked["stored"])
    assert rows["default"]["predicted_peak_bytes"] == picked["predicted_peak_bytes"]
    assert rows["default"]["predicted_peak_bytes"] <= rows["dp2"]["predicted_peak_bytes"]
    assert rows["dp2"]["stored"] == []


def test_optimize_infeasible_budget(capsys):
    code, _, err = run(capsys, "optimize", "tests.test_cli:deep_factory", "--budget", "1KiB")
    assert code == 2 and "smallest achievable peak" in err


def test_compare_outputs(capsys, tmp_path):
    png, csv_path, js = tmp_path / "c.png", tmp_path / "c.csv", tmp_path / "c.json"
    code, out, _ = run(capsys, "compare", "tests.test_cli:deep_factory", "--batch", "1024", "--solvers",
                       "none,sqrt,dp2", "--measure", "--png", str(png), "--csv", str(csv_path),
                       "--json-out", str(js))
    assert code == 0
    rows = json.loads(js.read_text())["rows"]
    assert [r["solver"] for r in rows] == ["none", "sqrt", "dp2"]
    for r in rows:
        assert abs(r["measured_peak_bytes"] - r["predicted_peak_bytes"]) <= 8
    assert rows[0]["recompute_share"] == 0 and rows[2]["recompute_share"] > 0
    assert csv_path.read_text().count("\n") == 4 and png.read_bytes()[:4] == b"\x89PNG"
    assert "recompute" in out


def deep_factory(batch_size=16):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 2)), (torch.randn(batch_size, 64),)


def seq_factory(batch_size=4, input_size=32):
    """A token model whose activations grow with the sequence length."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 32), *[torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32)) for _ in range(4)])
    return model, (torch.randint(0, 100, (batch_size, input_size)),)


def test_max_batch_sequence_sweep(capsys):
    """One row per sequence length, each the answer max-batch gives at that length alone; a longer
    sequence fits fewer samples."""
    argv = ("max-batch", "tests.test_cli:seq_factory", "--memory", "3MiB", "--optimizer", "sgd")
    code, out, _ = run(capsys, *argv, "--seq-sweep", "64,256", "--json")
    assert code == 0
    rows = json.loads(out)["sweep"]
    assert [r["seq"] for r in rows] == [64, 256]
    for r in rows:
        _, alone, _ = run(capsys, *argv, "--seq", str(r["seq"]), "--json")
        alone = json.loads(alone)
        for key in ("no_checkpointing", "optimal"):
            assert r[key]["batch"] == alone[key]["batch"] and r[key]["peak_bytes"] == alone[key]["peak_bytes"]
        assert r["traces"] > 0
    assert rows[0]["optimal"]["batch"] > rows[1]["optimal"]["batch"] > 0
    code, out, _ = run(capsys, *argv, "--seq-sweep", "64,256")
    assert code == 0 and "traces in all" in out and len(out.strip().splitlines()) == 6


def test_estimate_table_and_json(capsys):
    code, out, _ = run(capsys, "estimate", "tests.test_cli:deep_factory", "--batch", "4096", "--optimizer", "sgd")
    assert code == 0
    for row in ("parameters", "gradients", "optimizer state", "activations", "transients", "peak"):
        assert f"\n{row} " in out
    code, out, _ = run(capsys, "estimate", "tests.test_cli:deep_factory", "--batch", "2", "--json")
    data = json.loads(out)
    assert data["optimizer"]["name"] == "adam" and data["no_checkpointing"]["at"] == "optimizer step"
    bd = data["no_checkpointing"]["breakdown"]
    assert sum(bd.values()) == data["no_checkpointing"]["peak_bytes"]


def test_max_batch_json_with_target(capsys):
    code, out, _ = run(capsys, "max-batch", "tests.test_cli:deep_factory", "--memory", "2MiB", "--optimizer", "sgd",
                       "--target-batch", "4000", "--json")
    assert code == 0
    data = json.loads(out)
    assert 0 < data["no_checkpointing"]["batch"] <= data["optimal"]["batch"]
    assert data["no_checkpointing"]["peak_bytes"] <= 2 * 2**20 < data["no_checkpointing"]["next_peak_bytes"]
    plan = data["training_plan"]
    rec = plan["options"][plan["recommended"]]
    assert rec["peak_bytes"] <= 2 * 2**20 and rec["steps"] * rec["micro_batch"] >= 4000


@pytest.mark.parametrize("argv, match", [
    (["max-batch", "mlp", "--memory", "8 furlongs"], "not a memory size"),
    (["max-batch", "mlp", "--memory", "0"], "positive"),
    (["max-batch", "mlp", "--memory", "1GiB", "--seq-sweep", "64,x"], "sequence lengths"),
    (["estimate", "mlp", "--optimizer", "lion"], "invalid choice"),
])
def test_planning_bad_input(capsys, argv, match):
    with pytest.raises(SystemExit) if "invalid choice" in match else _nullcontext():
        code, out, err = run(capsys, *argv)
        assert code == 2 and match in err


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


HF = ["--config", "n_layer=2", "--config", "n_embd=64", "--config", "n_head=2", "--config", "vocab_size=256"]


def test_hf_models_from_their_config_class(capsys):
    """hf:<class> builds a transformers model from its config (no weights) with a collator-style batch;
    optimize (with --measure), profile and estimate name layers by module path."""
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "optimize", "hf:GPT2LMHeadModel", "--batch", "2", "--seq", "32", *HF,
                         "--measure", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["checkpoints"] and abs(data["measured_peak_bytes"] - data["predicted_peak_bytes"]) <= \
        0.01 * data["predicted_peak_bytes"]
    code, out, _ = run(capsys, "profile", "hf:GPT2LMHeadModel", "--batch", "2", "--seq", "32", *HF)
    assert code == 0 and "transformer.h.1 (ln_1..attn)" in out and "lm_head" in out
    code, out, _ = run(capsys, "estimate", "hf:GPT2LMHeadModel", "--batch", "2", "--seq", "32", *HF, "--json")
    assert code == 0 and json.loads(out)["optimal"]["peak_bytes"] > 0
    code, _, err = run(capsys, "optimize", "hf:NoSuchModel")
    assert code == 2 and "transformers has no model class 'NoSuchModel'" in err
    code, _, err = run(capsys, "optimize", "hf:GPT2LMHeadModel", "--config", "n_layer")
    assert code == 2 and "--config takes key=value" in err


def test_estimate_one_rank_of_ddp_and_fsdp(capsys):
    """--world-size prices one rank: DDP adds its gradient buckets, FSDP2 shards what the rank holds."""
    def est(*extra):
        code, out, _ = run(capsys, "estimate", "gpt", "--batch", "2", "--optimizer", "adam", "--json", *extra)
        assert code == 0
        return json.loads(out)

    one, ddp, fsdp = est(), est("--world-size", "4"), est("--world-size", "4", "--strategy", "fsdp")
    assert ddp["parallel"]["strategy"] == "ddp" and fsdp["parallel"]["world_size"] == 4 and one["parallel"] is None
    buckets = one["grad_bytes"]  # as large as the trainable parameters
    assert ddp["no_checkpointing"]["peak_bytes"] == one["no_checkpointing"]["peak_bytes"] + buckets
    assert ddp["no_checkpointing"]["breakdown"]["parallel"] == buckets
    assert fsdp["param_bytes"] < one["param_bytes"] / 3
    assert fsdp["optimal"]["peak_bytes"] < one["optimal"]["peak_bytes"]
    code, out, _ = run(capsys, "estimate", "gpt", "--batch", "2", "--world-size", "4", "--strategy", "fsdp")
    assert "one rank of FSDP2, 4 ranks (rank 0 priced)" in out and "parallel buffers" in out
    mixed = est("--world-size", "4", "--strategy", "fsdp", "--mixed-precision", "bf16")
    assert mixed["parallel"]["mixed_precision"] == "bf16"
    assert mixed["param_bytes"] == fsdp["param_bytes"]  # (the fp32 master weights' shards)
    assert mixed["optimal"]["peak_bytes"] < fsdp["optimal"]["peak_bytes"]  # (bf16 activations and gathers)


def test_library_noise_is_hidden_unless_verbose(capfd):
    pytest.importorskip("transformers")
    args = ["estimate", "hf:LlamaForCausalLM", "--batch", "1", "--seq", "32", "--config", "num_hidden_layers=1",
            "--config", "hidden_size=64", "--config", "intermediate_size=128", "--config", "num_attention_heads=2",
            "--config", "vocab_size=128"]
    assert main(args) == 0
    out, err = capfd.readouterr()
    assert "optimal plan" in out and err == ""
    # optimize exports with dynamic shapes (an estimate, at the example's): torch.export notes that it
    # specialized the batch of 1, a line shown only with --verbose
    optimize = ["optimize"] + args[1:]
    assert main(optimize) == 0
    out, err = capfd.readouterr()
    assert "segment 0" in out and err == ""
    assert main(optimize + ["--verbose"]) == 0
    out, err = capfd.readouterr()
    assert "segment 0" in out and "specialized" in err


def test_capture_keeps_torchs_export_notes_to_itself(capfd):
    transformers = pytest.importorskip("transformers")
    import logging

    import torch

    from ckptopt import optimize_checkpoints

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   vocab_size=128, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (1, 16))  # (a batch of 1: torch.export notes the dimension's specialization)
    optimize_checkpoints(model, dict(input_ids=ids, labels=ids), in_place=False)
    assert "specialized" not in capfd.readouterr().err
    assert logging.getLogger("torch._export").level == logging.NOTSET  # (left as it was)
