"""Layers alike are measured once (ckptopt.tracer.layer_key): the key tells them apart where the
measurement could differ, and sharing changes no figure of any cost model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch import nn

from ckptopt import trace, zoo
from ckptopt.tracer import layer_build
from ckptopt.tracer import layers as layers_mod
from ckptopt.tracer.layer_key import layer_key


def _graph(width: int) -> fx.GraphModule:
    return fx.symbolic_trace(nn.Sequential(nn.Linear(width, width), nn.GELU()))


def test_equal_structure_equal_key_and_every_difference_counts():
    x = torch.randn(4, 8)
    a, b = _graph(8), _graph(8)
    assert layer_key(a, x, dict(keep_input=True)) == layer_key(b, torch.randn(4, 8), dict(keep_input=True))
    assert layer_key(a, x, dict(keep_input=True)) != layer_key(a, x, dict(keep_input=False))
    assert layer_key(a, x, {}) != layer_key(a, torch.randn(5, 8), {})  # shape
    assert layer_key(a, x, {}) != layer_key(a, x.requires_grad_(), {})  # needs a gradient
    assert layer_key(a, x.detach(), {}) != layer_key(a, torch.randn(8, 4).t(), {})  # strides
    assert layer_key(a, x.detach(), {}) != layer_key(a.eval(), x.detach(), {})  # training mode
    y = torch.randn(4, 8)  # a static input that is the chain input's storage, or another one
    assert layer_key(a, y, dict(static_inputs=[y])) != layer_key(a, y, dict(static_inputs=[torch.randn(4, 8)]))
    # only the order of the side inputs' ranks counts
    assert layer_key(a, y, dict(side_rank=((0, -3), (2, -1)))) == layer_key(a, y, dict(side_rank=((1, -9), (5, 0))))
    assert layer_key(a, y, dict(side_rank=((0, -3), (2, -1)))) != layer_key(a, y, dict(side_rank=((2, -1), (0, -3))))
    assert layer_key(nn.Linear(8, 8), y, {}) is None  # not a graph: measured each time

    class Closure(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    g = fx.symbolic_trace(Closure())
    g.graph.call_function(lambda t: t, (next(iter(g.graph.nodes)),))  # a lambda: not described by name
    assert layer_key(g, y, {}) is None


def _traced(model, inputs, share: bool):
    layers_mod.SHARE_MEASUREMENTS = share
    try:
        return trace(model, inputs)
    finally:
        layers_mod.SHARE_MEASUREMENTS = True


def _hf(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=4, vocab_size=128, use_cache=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif name == "gpt2":  # tied embedding and head
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128))
    elif name == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, vocab_size=128))
    else:  # encoder-decoder: masks read by two stacks
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16, vocab_size=128,
            decoder_start_token_id=0, pad_token_id=0))
    ids = torch.randint(0, 128, (2, 16))
    return model.train(), dict(input_ids=ids, labels=ids)


CASES = ["gpt", "resnet18", "llama", "gpt2", "bert", "t5"]


@pytest.mark.parametrize("name", CASES)
def test_sharing_measurements_changes_no_figure(name, monkeypatch):
    if name in ("gpt", "resnet18"):
        model, inputs = zoo.get(name, batch_size=2, input_size=32 if name == "resnet18" else 16)[:2]
        model.train()
    else:
        model, inputs = _hf(name)
    calls = []
    measure = layers_mod.measure_layer
    monkeypatch.setattr(layers_mod, "measure_layer", lambda *a, **k: calls.append(1) or measure(*a, **k))
    alone = _traced(model, inputs, share=False)
    n_alone = len(calls)
    shared = _traced(model, inputs, share=True)
    n_shared = len(calls) - n_alone
    assert json.dumps(shared.costs.to_dict(), sort_keys=True) == json.dumps(alone.costs.to_dict(), sort_keys=True)
    assert shared.flops == alone.flops
    assert n_shared <= n_alone
    if name in ("gpt", "llama", "gpt2", "bert"):  # repeated blocks: measured once
        assert n_shared < 0.8 * n_alone, (n_shared, n_alone)


@pytest.mark.parametrize("name", ["gpt", "gpt2", "t5"])
def test_a_layer_measured_like_another_makes_no_module(name, monkeypatch):
    """A layer's module (its generated code) is made only where the layer is measured or counted; the
    parameters read from its graph are the ones its module would have (submodules called whole in an FX
    graph, a tied embedding and head in GPT-2, shared relative-position weights in T5)."""
    if name == "gpt":
        model, inputs = zoo.get(name, batch_size=2, input_size=16)[:2]
        model.train()
    else:
        model, inputs = _hf(name)
    made, checked = [], []
    module = layer_build.Built.module

    def counting(self):
        if self._module is None:
            made.append(self)
        return module.fget(self)

    parameters = layer_build.Built.parameters

    def compared(self):
        got = parameters(self)
        if self._module is None:
            want = list(fx.GraphModule(self.root, self.graph).parameters())
            assert [id(p) for p in got] == [id(p) for p in want]
            checked.append(1)
        return got

    monkeypatch.setattr(layer_build.Built, "module", property(counting))
    monkeypatch.setattr(layer_build.Built, "parameters", compared)
    traced = trace(model, inputs)
    assert checked and len(checked) >= traced.n - 1
    assert len(made) < 0.8 * traced.n, (len(made), traced.n)
