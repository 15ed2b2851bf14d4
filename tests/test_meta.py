"""Models on the meta device are planned exactly like the same models with real weights.

Every entry point that runs no real step (trace and solve, estimate, max_batch, plan_training,
the CLI's estimate, max-batch and profile) gives the same answer, to the byte, for a model built
under ``torch.device("meta")`` as for the same model built with its weights; the user's meta
model is left as it was; a module to train is refused with what to do.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ckptopt import estimate, max_batch, optimize_checkpoints, solve, trace, zoo
from ckptopt.cli import main as cli_main
from ckptopt.planning import plan_training

transformers = pytest.importorskip("transformers")

LLAMA = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, use_cache=False)


def llama(meta: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg).train()
    return transformers.LlamaForCausalLM(cfg).train()


def token_batch(device="cpu"):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return {k: v.to(device) for k, v in dict(input_ids=ids, labels=ids.clone()).items()}


@pytest.fixture(scope="module")
def models():
    return llama(False), llama(True)


def test_every_planning_answer_is_the_real_models(models):
    real, meta = models
    batch, meta_batch = token_batch(), token_batch("meta")
    assert next(meta.parameters()).is_meta
    want = estimate(real, batch, optimizer="adamw")
    assert estimate(meta, meta_batch, optimizer="adamw") == want
    assert estimate(meta, batch, optimizer="adamw") == want  # (a CPU batch for a meta model)
    a, b = trace(real, batch), trace(meta, meta_batch)
    assert a.costs == b.costs and (a.param_bytes, a.buffer_bytes) == (b.param_bytes, b.buffer_bytes)
    pa, pb = solve(a.costs, "auto"), solve(b.costs, "auto")
    assert (pa.checkpoints, pa.stored, pa.peak_bytes) == (pb.checkpoints, pb.stored, pb.peak_bytes)
    assert all(p.is_meta for p in meta.parameters())  # the user's model is untouched


def test_every_parameter_is_counted_and_tied_ones_once():
    """Meta storages all have address 0: counted by storage, a meta model had one parameter."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, use_cache=False)
    real = transformers.GPT2LMHeadModel(cfg).train()
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(cfg).train()
    assert meta.lm_head.weight is meta.transformer.wte.weight  # tied
    batch = token_batch()
    want = sum(p.numel() * p.element_size() for p in real.parameters())  # (parameters() yields tied ones once)
    e = estimate(meta, batch, optimizer="adam")
    assert e.param_bytes == want == estimate(real, batch, optimizer="adam").param_bytes
    assert e == estimate(real, batch, optimizer="adam")


def test_batch_search_on_the_meta_device():
    """max_batch and plan_training re-trace at other batch sizes (rows repeated on fake tensors)."""
    real, x = zoo.get("gpt", batch_size=2, input_size=32, depth=2, width=64, heads=2, vocab=256)
    meta, mx = zoo.get("gpt", batch_size=2, input_size=32, depth=2, width=64, heads=2, vocab=256,
                       device="meta")
    assert plan_training(meta, mx, 64, memory="12MB") == plan_training(real, x, 64, memory="12MB")  # (searches batches as max_batch)


@pytest.mark.parametrize("name", ["resnet18"])
def test_zoo_models_on_the_meta_device(name):
    """The FX path: zoo.get(device="meta") builds without memory and plans as the real model."""
    model, x = zoo.get(name, batch_size=2, input_size=32)
    meta, mx = zoo.get(name, batch_size=2, input_size=32, device="meta")
    assert all(p.is_meta for p in meta.parameters()) and all(t.is_meta for t in mx)
    assert estimate(meta, mx, optimizer="sgd") == estimate(model, x, optimizer="sgd")


def test_a_module_to_train_is_refused_with_what_to_do(models):
    _, meta = models
    with pytest.raises(ValueError, match="meta device .* ckptopt.estimate, max_batch, plan_training and trace"):
        optimize_checkpoints(meta, token_batch())


def test_cli_builds_on_the_meta_device_and_answers_as_for_real_weights(capsys, monkeypatch, tmp_path):
    """estimate / max-batch / profile build hf: models on the meta device (no weights allocated), in
    the requested dtype; the answer is the API's on the real model. hf:path/config.json reads a
    Hub-style config from disk."""
    import ckptopt._models as models_mod

    built = []
    real_load = models_mod.load_model

    def spy(*a, **k):
        model, inputs = real_load(*a, **k)
        built.append(next(model.parameters()))
        return model, inputs

    monkeypatch.setattr(models_mod, "load_model", spy)
    cfg = transformers.LlamaConfig(**LLAMA)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    config_args = [a for k, v in LLAMA.items() for a in ("--config", f"{k}={v}")]
    real = llama(False).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    want = estimate(real, dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone()),
                    optimizer="adamw")
    for spec, extra in (("hf:LlamaForCausalLM", config_args), (f"hf:{tmp_path}", [])):  # (a folder: its config.json)
        assert cli_main(["estimate", spec, *extra, "--batch", "2", "--seq", "32", "--dtype", "bf16",
                         "--optimizer", "adamw", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert built[-1].is_meta and built[-1].dtype == torch.bfloat16
        assert got["optimal"]["peak_bytes"] == want.optimal.peak_bytes
        assert got["param_bytes"] == want.param_bytes
    assert cli_main(["profile", "hf:LlamaForCausalLM", *config_args, "--batch", "2", "--seq", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["param_bytes"] == sum(
        p.numel() * 4 for p in llama(False).parameters())
    assert built[-1].is_meta


def test_fake_parameters_are_planned_as_they_are():
    """A model built under a FakeTensorMode (another way to have no memory) is traced as it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with FakeTensorMode() as mode:
        fake = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        fx = mode.from_tensor(x)
    assert estimate(fake, fx, optimizer="sgd") == estimate(real, x, optimizer="sgd")


def test_calibrating_a_meta_model_is_refused_with_what_to_do():
    meta, mx = zoo.get("mlp", batch_size=2, device="meta")
    with pytest.raises(ValueError, match=r"runs each layer on cpu, but the model is on meta: materialize it"):
        max_batch(meta, mx, memory="64MiB", calibrate=True)
    with pytest.raises(ValueError, match=r"but the model is on meta"):
        estimate(meta, mx, calibrate=True)


def test_a_wide_meta_llama_traces_with_gradients_handed_out_as_slices():
    """Llama-3-8B's width at 8 decoder layers (sequence 1024), on the meta device: the attention's
    key projection gets its output gradient as a slice of a larger storage, which the layer copies
    out and lets go before its backward first reads a saved tensor. That storage left the measured
    bytes whole, and rg came out negative (InvalidCosts: "field 'rg' index 13: -4194304 is
    negative"): the 8- and 16-layer rows of benchmarks/full_size.py failed so."""
    from ckptopt import estimate
    from ckptopt._models import load_model

    cfg = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=1024, max_position_embeddings=8192)
    model, inputs = load_model("hf:LlamaForCausalLM", 1, 1024, "bf16", config=cfg, meta=True)
    est = estimate(model.train(), inputs, optimizer="adamw")  # (raised InvalidCosts)
    assert 0 < est.optimal.peak_bytes <= est.no_checkpointing.peak_bytes
    assert est.param_bytes == sum(p.numel() * 2 for p in model.parameters())
