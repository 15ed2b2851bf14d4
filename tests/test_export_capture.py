"""The torch.export front end on HuggingFace models it used to break on.

* Constants ``torch.export`` lifts out of a forward (``torch.tensor(...)`` in Falcon's and
  GPT-Neo's attention) live under a submodule path in ``ep.module()`` that the model does
  not have; they move to root attributes of the graph module, so the rewritten module
  finds them (it failed with ``'FalconAttention' object has no attribute 'lifted_tensor_0'``).
* A training BatchNorm on the export graph (``aten.batch_norm`` with running-statistics
  buffers, ``add_`` on ``num_batches_tracked``) updates its statistics once per step, not
  again when checkpoint recomputes its segment.
* transformers' own checkpointing is called by its current name (no FutureWarning).
* The "Moved:" shim modules are gone.

Truth is the unmodified model: loss, logits and every gradient bit-identical over two
steps with dropout on, and the same running statistics.
"""

import copy
import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()

import ckptopt  # noqa: E402
from ckptopt import TraceError, measure_peak, optimize_checkpoints  # noqa: E402
from ckptopt.tracer.capture.export import batch_norm_stats_once, count_batch_once  # noqa: E402

VOCAB = 512


def _falcon():
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=VOCAB, use_cache=False))


def _gpt_neo():
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        num_layers=2, attention_types=[[["global", "local"], 1]], hidden_size=64, num_heads=2, vocab_size=VOCAB,
        max_position_embeddings=128, window_size=16, use_cache=False))


def _gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=VOCAB, max_position_embeddings=128, sliding_window=16, attention_dropout=0.1,
        use_cache=False))


TEXT = {"falcon": _falcon, "gpt_neo": _gpt_neo, "gemma3": _gemma3}
LIFTS = {"falcon", "gpt_neo"}  # their export graphs read constants lifted under an attention module


def _text_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 32), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _resnet():
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)).train()
    gen = torch.Generator().manual_seed(0)
    return model, {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen), "labels": torch.tensor([0, 2])}


def _resolves(root, target):
    try:
        for part in target.split("."):
            root = getattr(root, part)
    except AttributeError:
        return False
    return True


def _trains_identically(ref, opt, model, batch, steps=2):
    """Two steps (dropout on, the same seed each) give the same loss, logits, gradients and buffers."""
    theirs = dict(ref.named_parameters())
    for seed in range(steps):
        torch.manual_seed(seed)
        a = ref(**batch)
        a.loss.backward()
        torch.manual_seed(seed)
        b = opt(**batch)
        b.loss.backward()
        assert type(a) is type(b)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)
        for key, p in model.named_parameters():
            assert torch.equal(p.grad, theirs[key].grad), key
        ref_buffers = dict(ref.named_buffers())
        for key, buf in model.named_buffers():
            assert torch.equal(buf, ref_buffers[key]), key
        with torch.no_grad():
            for m in (ref, model):
                for p in m.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None


@pytest.mark.parametrize("name", list(TEXT))
def test_lifted_constants_reach_the_rewritten_module(name):
    torch.manual_seed(0)
    model = TEXT[name]().train()
    ref = copy.deepcopy(model)
    batch = _text_batch()
    opt = optimize_checkpoints(model, batch)
    gm = opt.traced.gm
    assert opt.traced.capture.front_end == "export" and opt.plan.checkpoints
    targets = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    # every graph attribute is the model's, or a root attribute of the graph the model lacks
    for t in targets:
        assert _resolves(model, t) or ("." not in t and not hasattr(model, t) and hasattr(gm, t)), t
    lifted = [t for t in targets if "lifted_tensor" in t]
    assert bool(lifted) == (name in LIFTS), lifted
    _trains_identically(ref, opt, model, batch)


def test_training_batch_norm_updates_its_statistics_once():
    """ResNet with every layer checkpointed: its BatchNorms are recomputed, yet the running
    statistics and batch counts after two steps are the unmodified model's, and the
    measured peak is the predicted one."""
    model, batch = _resnet()
    ref = copy.deepcopy(model)
    tm = ckptopt.trace(model, batch, capture="export")
    opt = ckptopt.apply_plan(model, tm, ckptopt.solve(tm.costs, "every"))
    nodes = {n.name: n for n in tm.gm.graph.nodes}
    wrapped = [nodes[nm].target for s in opt._segments if s.wrapped for nm in s.nodes]
    assert wrapped.count(batch_norm_stats_once) >= 4 and count_batch_once in wrapped
    _trains_identically(ref, opt, model, batch)
    assert all(int(b) == 2 for k, b in model.named_buffers() if k.endswith("num_batches_tracked"))
    predicted, measured = opt.predicted_peak_bytes, measure_peak(opt, batch)
    assert abs(measured - predicted) <= 0.01 * predicted, (predicted, measured)


def test_cumulative_batch_norm_runs_as_one_op_on_the_export_path():
    """momentum=None averages with 1/num_batches_tracked: float() of a buffer, which torch.export
    cannot capture with the right factor for later steps. The BatchNorm runs as one op instead
    (tracer/capture/opaque.py), reading its counter each step; checkpointed, its recomputation leaves
    the statistics alone. Trained identically, buffers included, and predicted within the loss scalar."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=None), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3)).train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    traced = ckptopt.trace(model, x, capture="export")
    assert "reads a tensor's value" in traced.opaque_modules["1"]
    plan = ckptopt.Plan(checkpoints=tuple(range(1, traced.costs.n)), peak_bytes=0, solver="test", solve_seconds=0.0,
                        n=traced.costs.n)
    module = ckptopt.apply_plan(model, traced, plan)
    for _ in range(2):
        for m in (reference, module):
            m(x).pow(2).mean().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), model.parameters()))
        for m in (reference, model):
            m.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(reference.buffers(), model.buffers()))
    predicted = ckptopt.simulate(traced.costs, plan.checkpoints).peak_bytes
    assert 0 <= ckptopt.measure_peak(module, x) - predicted <= 8


def _benchmark_hf_models():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_models.py"
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("_bench_hf_models", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_transformers_checkpointing_is_called_by_its_current_name():
    """The helpers of tests/test_hf.py and benchmarks/hf_models.py enable transformers' own
    checkpointing non-reentrant, without the deprecation FutureWarning, and disable it."""
    from tests.test_hf import hf_checkpointing_disable, hf_checkpointing_enable

    bench = _benchmark_hf_models()
    for enable, disable in ((hf_checkpointing_enable, hf_checkpointing_disable),
                            (bench.hf_checkpointing_enable, bench.hf_checkpointing_disable)):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            enable(model)
            on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
            assert on and all(m._gradient_checkpointing_func.keywords == {"use_reentrant": False} for m in on)
            disable(model)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.parametrize("old, new", [("ckptopt.dag", "ckptopt.simulator.side_tensors"),
                                      ("ckptopt.timeline", "ckptopt.simulator.timeline"),
                                      ("ckptopt._dag_measure", "ckptopt.tracer.layers"),
                                      ("ckptopt.experimental", "ckptopt.tracer.side_tensors")])
def test_moved_modules_live_only_at_their_new_paths(old, new):
    """The node-level experimental path is gone: several tensors crossing a cut is the stable path."""
    assert importlib.util.find_spec(old) is None
    assert importlib.import_module(new).__all__


class _PicksPath(torch.nn.Module):
    """Takes another path under torch.export (as the gated-delta models do: a Python loop instead of
    solve_triangular) and skips a data-dependent check under compilation (as transformers does)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        h = self.a(x)
        h = torch.sigmoid(h) if self.pick and torch.compiler.is_exporting() else torch.tanh(h)
        if not torch.compiler.is_compiling() and self.check and bool((h.abs() > 1e6).any()):
            raise ValueError("overflow")
        return self.c(torch.relu(self.b(h))).square().mean()


@pytest.mark.parametrize("pick, check", [(True, False), (False, True)],
                         ids=["eager-path", "check-skipped-as-under-export"])
def test_the_model_is_captured_on_the_path_it_trains_on(pick, check):
    """The model sees eager mode while it is exported (torch itself still sees the export); a check
    that cannot run on fake tensors sends the capture back to torch.export's own flags."""
    torch.manual_seed(0)
    model = _PicksPath()
    model.pick, model.check = pick, check
    x = torch.randn(8, 16)
    ref = copy.deepcopy(model)
    opt = optimize_checkpoints(model, (x,), capture="export")  # (the rewritten module runs the graph)
    a, b = ref(x), opt(x)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_module_cast_to_its_own_dtype_in_the_forward():
    """SwitchTransformers' router casts its classifier to the dtype it has on every call: nothing
    changes, and torch.export (which cannot swap fake parameters) captures it."""
    class Casts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

        def forward(self, x):
            self.b = self.b.to(torch.float32)
            return self.b(torch.relu(self.a(x))).square().mean()

    model = Casts()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    opt = optimize_checkpoints(model, (x,), capture="export")
    a, b = ref(x), opt(x)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))


def test_an_all_ones_attention_mask_is_captured_as_no_mask():
    """transformers runs a batch whose mask is all ones without a mask (it reads the values eagerly); the
    capture does the same, so the estimate is the unmodified step's (it was over by the masks SDPA saves),
    and a batch that pads is planned on first sight with its mask: both train as the model does."""
    from ckptopt import estimate
    from ckptopt.measure import measure_training_step

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(0))
    ones = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    est = estimate(model, ones, optimizer="sgd")
    assert measure_training_step(copy.deepcopy(model), ones, optimizer="sgd") - est.no_checkpointing.peak_bytes == 8
    opt = optimize_checkpoints(model, ones)
    assert "attention_mask is all ones" in opt.explain()
    mask = torch.ones_like(ids)
    mask[0, :40] = 0
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    for batch in (ones, padded, ones):
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no "runs the original forward" warning: the padded call is planned)
            out = opt(**batch)
        want = ref(**batch)
        assert torch.equal(out.loss, want.loss), (batch is padded, float(out.loss), float(want.loss))
        out.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name


def test_a_cache_configured_in_a_submodule_is_off_while_capturing():
    """T5's decoder stack holds its own copy of the config (use_cache=True by default): the capture turns
    every config's cache off (it failed on the EncoderDecoderCache in the output)."""
    cfg = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32, vocab_size=VOCAB,
                                decoder_start_token_id=0, pad_token_id=0)
    assert cfg.use_cache
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids[:, :8].contiguous()}
    opt = optimize_checkpoints(model, batch)
    assert model.config.use_cache and model.decoder.config.use_cache  # (restored)
    torch.manual_seed(1)
    out = opt(**batch)
    torch.manual_seed(1)
    want = ref(**batch)
    assert torch.equal(out.loss, want.loss)


def test_an_export_at_the_example_shapes_prices_every_plan_as_the_dynamic_one():
    """``estimate`` exports at the example's shapes (``dynamic_shapes=False``: symbolic shapes cost most of
    an export's time); the two graphs must price alike: the same layer figures, and every plan's peak and
    recomputation the same, padded batch included."""
    import random

    from ckptopt import simulate
    from ckptopt.tracer import trace

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    rng = random.Random(0)
    for batch in (dict(input_ids=ids, labels=ids), dict(input_ids=ids, attention_mask=mask, labels=ids)):
        dyn, static = trace(model, batch), trace(model, batch, dynamic_shapes=False)
        assert dyn.capture.dynamic and not static.capture.dynamic
        # the final norm's `hidden_states[:, slice(-0, None), :]`: two whole-dimension slices in the dynamic
        # graph, an alias at fixed shapes (and in eager indexing): taken as aliases, the same layer figures
        assert static.costs.to_dict()["layers"] == dyn.costs.to_dict()["layers"]
        for _ in range(300):
            cps = tuple(sorted(rng.sample(range(1, dyn.n), rng.randint(1, 8))))
            stored = tuple(c for c in cps[:-1] if rng.random() < 0.3)
            a, b = simulate(dyn.costs, cps, stored), simulate(static.costs, cps, stored)
            assert (a.peak_bytes, a.recompute_flops) == (b.peak_bytes, b.recompute_flops), (cps, stored)
