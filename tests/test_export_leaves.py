"""Leaf modules on the torch.export front end (``tracer/capture/blocks.py``; docs/design.md §6, §13).

torch.export inlines every submodule; ``leaf_modules=[...]`` puts each call of a named block back
together as one layer that runs through the block's own ``__call__``. Checked against the
unmodified model (outputs, gradients, hooks) and against the exact tracker (predicted peaks).
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckptopt import TraceError, apply_plan, simulate, solve, trace  # noqa: E402
from ckptopt.measure import measure_peak  # noqa: E402
from ckptopt.plan import Plan  # noqa: E402

LOSS = 8  # the scalar loss and its gradient, not in the cost model


def _llama(layers: int = 3):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _batch():
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _layer_type():
    return transformers.models.llama.modeling_llama.LlamaDecoderLayer


def test_each_decoder_layer_call_is_one_layer_run_through_the_layer_itself():
    model, batch = _llama(), _batch()
    tm = trace(model, batch, leaf_modules=[_layer_type()], capture="export")
    names = [layer.name for layer in tm.layers]
    assert [n for n in names if n.startswith("model.layers")] == ["model.layers.0", "model.layers.1",
                                                                  "model.layers.2"], names
    plan = solve(tm.costs, "auto")
    assert plan.checkpoints
    module = apply_plan(model, tm, plan)
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: calls.append(i))
             for i, layer in enumerate(model.model.layers)]
    ref = _llama()
    out, want = module(**batch), ref(**batch)
    assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)
    out.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # every layer is called in the forward, the checkpointed ones once more in the backward
    recomputed = {i for i in range(3) if calls.count(i) == 2}
    assert sorted(set(calls)) == [0, 1, 2] and recomputed, calls
    for h in hooks:
        h.remove()
    assert "forward" not in vars(model.model.layers[0])  # the layer's own forward is back


def test_whole_layer_plans_are_predicted_to_the_byte():
    model, batch = _llama(), _batch()
    tm = trace(model, batch, leaf_modules=["model.layers.0", "model.layers.1", "model.layers.2"],
               capture="export")
    rng = random.Random(0)
    plans = [solve(tm.costs, "auto").checkpoints, ()]
    plans += [tuple(sorted(rng.sample(range(1, tm.n - 1), k))) for k in (1, 2, 3)]
    exact = 0
    for cps in plans:
        predicted = simulate(tm.costs, cps).peak_bytes
        module = apply_plan(model, tm, Plan(cps, predicted, "test", 0.0, tm.n))
        measured = measure_peak(module, batch, loss_fn=lambda out: out.loss)
        assert measured <= predicted + LOSS, (cps, predicted, measured)  # never under
        exact += measured - predicted == LOSS
    assert exact >= len(plans) - 1, exact  # (a random plan may be conservative)


def test_a_leaf_the_model_does_not_have_is_named():
    model, batch = _llama(1), _batch()
    with pytest.raises(TraceError, match=r"leaf_modules names \['model.layer.0'\] that are not submodules"):
        trace(model, batch, leaf_modules=["model.layer.0"], capture="export")


def test_a_module_called_several_times_in_a_row_makes_one_layer_per_call():
    """A shared block applied three times in a row (ALBERT shares one layer across its depth): three calls,
    told apart by the call numbers torch.export gives a module's later calls."""
    import torch.nn as nn

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(16, 32)
            self.blk = nn.Sequential(nn.Linear(32, 32), nn.GELU())

        def forward(self, x):
            x = self.inp(x)
            for _ in range(3):
                x = x + self.blk(x)
            return x

    torch.manual_seed(0)
    model, x = Shared(), torch.randn(64, 16)
    tm = trace(model, x, leaf_modules=["blk"], capture="export")
    calls = [n for n in tm.gm.graph.nodes if n.op == "call_module"]
    assert len(calls) == 3, calls
    plan = solve(tm.costs, "dp2")
    module = apply_plan(model, tm, plan)
    seen = []
    hook = model.blk.register_forward_pre_hook(lambda mod, args: seen.append(1))
    out = module(x)
    hook.remove()
    assert len(seen) == 3
    ref = Shared()
    ref.load_state_dict(model.state_dict())
    want = ref(x)
    assert torch.equal(out, want)
    out.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_block_calling_a_module_outside_it_stays_one_call():
    """A block whose forward calls a module that lives outside it (a shared table): its operations run
    inside the block's call, so the call is not split where the outside module runs."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.fc = nn.Linear(32, 32)
            self.shared = [shared]  # (not a submodule: it lives outside the block)

        def forward(self, x):
            return x + self.shared[0](torch.relu(self.fc(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.blocks = nn.ModuleList([Block(self.proj) for _ in range(2)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 32)
    tm = trace(model, x, leaf_modules=["blocks.0", "blocks.1"], capture="export")
    assert len([n for n in tm.gm.graph.nodes if n.op == "call_module"]) == 2
    module = apply_plan(model, tm, solve(tm.costs, "dp2"))
    assert torch.equal(module(x), model(x))
