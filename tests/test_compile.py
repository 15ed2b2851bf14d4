"""torch.compile of the rewritten module: it compiles and gives the eager gradients.

``torch.compile(optimize_checkpoints(model, x))``: dynamo traces through the
rewritten forward and turns each ``torch.utils.checkpoint`` segment into its
checkpoint higher-order op, which AOTAutograd recomputes in backward.

* ``aot_eager`` (dynamo + AOTAutograd, eager kernels) runs in CI, with
  ``fullgraph=True`` (the rewritten forward makes no graph break: it reads no
  ``torch.fx`` node at call time, and an exported transformers model's
  all-ones-mask check runs inside the graph as an assertion): the gradients
  equal the eager rewritten module's and the unmodified model's.
* ``inductor`` (the default backend, generated C++ on CPU) takes ~1 min to
  compile here on 2 shared cores, over this file's CI time budget: it runs
  with ``CKPTOPT_COMPILE=inductor``. Its
  kernels fuse and reorder floating-point work, so it is compared with
  ``rtol=1e-4, atol=1e-5`` against eager.

Peak memory and step time of compiled plans against ``torch.compile``'s own
``activation_memory_budget``: ``benchmarks/frontier.py`` (``ckptopt-compiled``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from ckptopt import optimize_checkpoints

INDUCTOR = os.environ.get("CKPTOPT_COMPILE", "") == "inductor"


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.GELU(), nn.Linear(64, 4))


def grads_after_step(module, model, x):
    for p in model.parameters():
        p.grad = None
    out = module(x)
    out.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads


@pytest.fixture
def optimized():
    model = tiny()
    x = torch.randn(64, 16)
    opt = optimize_checkpoints(model, x, solver="dp2")
    assert opt.plan.checkpoints, "the plan must checkpoint something for this test to mean anything"
    return model, opt, x


def _compiled_equals_eager(model, opt, x, backend, rtol, atol):
    torch._dynamo.reset()
    ref_out, ref = grads_after_step(model, model, x)
    eager_out, eager = grads_after_step(opt, model, x)
    compiled = torch.compile(opt, backend=backend, fullgraph=True)  # (no graph break in the forward)
    for _ in range(2):  # the second call runs the cached compiled code
        out, got = grads_after_step(compiled, model, x)
        torch.testing.assert_close(out, eager_out, rtol=rtol, atol=atol)
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=rtol, atol=atol)
    assert torch.equal(eager_out, ref_out) and all(torch.equal(a, b) for a, b in zip(eager, ref))
    torch._dynamo.reset()


def test_compile_aot_eager_same_gradients(optimized):
    model, opt, x = optimized
    _compiled_equals_eager(model, opt, x, "aot_eager", rtol=0, atol=0)


@pytest.mark.skipif(not INDUCTOR, reason="CPU inductor compiles for ~1 min on 2 cores (over the CI budget); "
                                         "run with CKPTOPT_COMPILE=inductor")
def test_compile_inductor_same_gradients(optimized):
    model, opt, x = optimized
    _compiled_equals_eager(model, opt, x, "inductor", rtol=1e-4, atol=1e-5)


def test_exported_transformers_model_compiles_whole_and_a_padded_batch_stops_with_a_message():
    """An exported transformers Llama planned on a batch whose attention mask is all ones (captured without
    it, as eager transformers runs it): compiled with ``fullgraph=True`` it gives the model's loss and
    gradients, and a batch that pads stops with ckptopt's message (an eager call would plan it anew; a
    compiled graph cannot branch on the mask's values)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from ckptopt.zoo.hf import get_hf

    torch._dynamo.reset()
    model, batch = get_hf("LlamaForCausalLM", 2, 32, dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=128))
    assert bool((batch["attention_mask"] == 1).all())
    opt = optimize_checkpoints(model, batch)
    assert opt.traced.capture.front_end == "export" and opt.plan.checkpoints

    def loss_and_grads(step):
        model.zero_grad(set_to_none=True)
        loss = step(batch)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    ref_loss, ref = loss_and_grads(lambda b: model(**b).loss)
    compiled = torch.compile(lambda b: opt(**b).loss, backend="aot_eager", fullgraph=True)
    loss, got = loss_and_grads(compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    padded = dict(batch, attention_mask=batch["attention_mask"].clone())
    padded["attention_mask"][0, -4:] = 0
    with pytest.raises(RuntimeError, match="planned for batches without padding"):
        compiled(padded)
    torch._dynamo.reset()
