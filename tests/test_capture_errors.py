"""Models and batches ckptopt cannot take as they are: each gets its own clear error, and the
model's state survives the attempt.

* the model's Python state is copied and restored whatever its type (diffusers' FrozenDict, a
  dataclass, a container whose ``__eq__``/``__repr__`` raise), and Python side effects are
  found inside such objects too;
* a fake-tensor run takes the path the real run takes (``aten._grouped_mm``: the CPU kernel
  takes float32, the meta function wants bfloat16), so MoE models plan and train;
* a batch the model itself rejects gets the model's own error, not a capture failure;
* a forward that reads a tensor's value gets a TraceError naming the construct, its source line
  and what to do, without torch.export's partial graph on stderr.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.nn as nn

from ckptopt import TraceError, measure_peak, optimize_checkpoints, trace
from ckptopt.fake import fake_mode
from ckptopt.torch_utils import python_state, restore_python_state

os.environ.setdefault("HF_HUB_OFFLINE", "1")
X = torch.randn(4, 8)


# --------------------------------------------------------------------------
# Python state of any type
# --------------------------------------------------------------------------
class Frozen(dict):
    """Like diffusers' FrozenDict: a dict whose mutators refuse."""

    def _refuse(self, *a, **k):
        raise Exception(f"You cannot use this on a {type(self).__name__} instance.")

    update = pop = setdefault = __delitem__ = __setitem__ = clear = _refuse


class Loud:
    """An object whose comparison and repr raise."""

    def __eq__(self, other):
        raise RuntimeError("no comparing")

    def __repr__(self):
        raise RuntimeError("no repr")

    __hash__ = object.__hash__


@dataclasses.dataclass
class Stats:
    calls: int = 0
    seen: list = dataclasses.field(default_factory=list)


class Odd(nn.Module):
    def __init__(self, count=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.config = Frozen(width=8, act="tanh")
        self.loud = Loud()
        self.loud_list = [Loud(), 1.5, float("nan")]
        self.stats = Stats()
        self.count = count

    def forward(self, x):
        if self.count:
            self.stats.calls += 1  # a side effect inside a dataclass
        return torch.tanh(self.lin(x)) * (self.config["width"] / 8)


def test_state_of_any_type_is_copied_and_restored():
    model = nn.Sequential(Odd(), nn.Linear(8, 8), Odd(), nn.Linear(8, 4))
    config, items = model[0].config, dict(model[0].config)
    opt = optimize_checkpoints(model, X, solver="every")
    assert model[0].config is config and dict(config) == items and isinstance(config, Frozen)
    opt(X).pow(2).mean().backward()
    assert model[0].lin.weight.grad is not None


def test_side_effect_inside_a_dataclass_is_found_and_undone():
    model = nn.Sequential(Odd(count=True), nn.Linear(8, 4))
    stats = model[0].stats
    with pytest.raises(TraceError, match=r"changes Python state each time it runs \(0\.stats: .*twice"):
        optimize_checkpoints(model, X)
    assert model[0].stats is stats and stats == Stats()  # FX ran the forward on the model: restored


def test_restore_refills_in_place_whatever_the_container_allows():
    class Holder(nn.Module):
        pass

    mod = Holder()
    mod.frozen = Frozen(a=1)
    mod.items = [1, 2]
    mod.stats = Stats()
    frozen, items, stats = mod.frozen, mod.items, mod.stats
    state = python_state(mod)
    dict.__setitem__(frozen, "b", 2)  # changed behind its back: only the C type can undo it
    items.append(3)
    stats.calls = 5
    mod.items = ["rebound"]
    mod.added = "new"
    restore_python_state(state)  # never raises
    assert mod.frozen is frozen and dict(frozen) == {"a": 1}
    assert mod.items is items and items == [1, 2]
    assert mod.stats is stats and stats.calls == 0
    assert not hasattr(mod, "added")



def _diffusers_model(name):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    if name == "UNet2DConditionModel":
        model = diffusers.UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
        batch = {"sample": torch.randn(1, 4, 16, 16), "timestep": torch.tensor([10]),
                 "encoder_hidden_states": torch.randn(1, 8, 32)}
    elif name == "AutoencoderKL":
        model = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
            latent_channels=4, norm_num_groups=8, sample_size=16)
        batch = {"sample": torch.randn(1, 3, 16, 16)}
    else:
        model = diffusers.SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4)
        batch = {"hidden_states": torch.randn(1, 4, 16, 16), "encoder_hidden_states": torch.randn(1, 8, 32),
                 "pooled_projections": torch.randn(1, 16), "timestep": torch.tensor([10])}
    return model.train(), batch


@pytest.mark.parametrize("name", ["UNet2DConditionModel", "AutoencoderKL", "SD3Transformer2DModel"])
def test_diffusers_models_plan_and_train_identically(name):
    """Their config is a FrozenDict (restoring it used to raise, after emptying it)."""
    model, batch = _diffusers_model(name)
    ref = copy.deepcopy(model)
    config = dict(model.config)
    loss = lambda out: out.sample.float().pow(2).mean()  # noqa: E731
    opt = optimize_checkpoints(model, batch, loss_fn=loss)
    assert dict(model.config) == config
    torch.manual_seed(0)
    a = loss(ref(**batch))
    a.backward()
    torch.manual_seed(0)
    b = loss(opt(**batch))
    b.backward()
    assert torch.equal(a, b)
    theirs = dict(ref.named_parameters())
    assert all(torch.equal(p.grad, theirs[k].grad) for k, p in model.named_parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    measured = measure_peak(opt, batch, loss_fn=loss)
    assert abs(measured - opt.predicted_peak_bytes) <= 0.01 * opt.predicted_peak_bytes


# --------------------------------------------------------------------------
# fake runs follow the real kernel (MoE experts: aten._grouped_mm)
# --------------------------------------------------------------------------
grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)


@pytest.mark.skipif(grouped_mm is None, reason="torch without grouped_mm")
def test_fake_grouped_mm_takes_the_cpu_kernels_checks():
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    for a, b in [(torch.randn(10, 8), torch.randn(3, 8, 16)),  # float32: the CPU kernel takes it
                 (torch.randn(10, 8, dtype=torch.float16), torch.randn(3, 8, 16, dtype=torch.float16))]:
        real = grouped_mm(a, b, offs=offs)
        with fake_mode() as mode:
            fake = grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(offs))
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    a, b = torch.randn(10, 6), torch.randn(3, 6, 6)  # rows of 24 bytes: both refuse alike
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        grouped_mm(a, b, offs=offs)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"), fake_mode() as mode:
        grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(offs))


def _mixtral():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=2, num_key_value_heads=2, vocab_size=512,
                                     num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    return transformers.MixtralForCausalLM(cfg).train()


def _ids(seed, batch=2, seq=64):
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _steps_identical(ref: nn.Module, model: nn.Module, batch: dict, steps: int = 2) -> None:
    """Two training steps (same seed each) give the same loss and gradients, an SGD update between."""
    for seed in range(steps):
        torch.manual_seed(seed)
        a = ref(**batch).loss
        a.backward()
        torch.manual_seed(seed)
        b = model(**batch).loss
        b.backward()
        assert torch.equal(a, b)
        theirs = dict(ref.named_parameters())
        for k, p in model.named_parameters():
            assert torch.equal(p.grad, theirs[k].grad), k
        with torch.no_grad():
            for m in (ref, model):
                for p in m.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None


def test_moe_plans_trains_identically_and_is_predicted():
    model = _mixtral()
    ref = copy.deepcopy(model)
    batch = _ids(1)
    opt = optimize_checkpoints(model, batch)
    assert opt.plan.checkpoints
    _steps_identical(ref, model, batch)
    other = _ids(7)  # expert routing depends on the data; the sizes do not (grouped experts)
    measured = measure_peak(opt, other)
    assert abs(measured - opt.predicted_peak_bytes) <= 0.01 * opt.predicted_peak_bytes


# --------------------------------------------------------------------------
# a batch the model rejects: the model's own error
# --------------------------------------------------------------------------
def _llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("batch, kind, match", [
    ({"input_idz": IDS, "labels": IDS}, ValueError,
     r"LlamaForCausalLM rejects the example batch: ValueError: You must specify exactly one of input_ids or "
     r"inputs_embeds \(the batch: input_idz: \(2, 16\) int64, labels: \(2, 16\) int64\).*fix the batch"),
    ({"input_ids": IDS, "labels": IDS[:, :8]}, ValueError,
     r"rejects the example batch: ValueError: Expected input batch_size \(32\) to match target batch_size \(16\)"),
    ({"input_ids": IDS.float(), "labels": IDS}, ValueError,
     r"rejects the example batch: RuntimeError: Expected tensor for argument #1 'indices'.*input_ids: \(2, 16\) float32"),
], ids=["unknown-key", "labels-shape", "ids-dtype"])
def test_batch_the_model_rejects(batch, kind, match):
    model = _llama()
    with pytest.raises(kind, match=match) as info:
        optimize_checkpoints(model, batch)
    assert not isinstance(info.value, TraceError) and "torch.fx" not in str(info.value)


def test_batch_a_plain_module_rejects():
    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, **batch):  # FX cannot trace len(); export fails on the missing key
            assert len(batch) >= 1
            return self.lin(batch["x"])

    with pytest.raises(ValueError, match=r"Keyed rejects the example batch: KeyError: 'x' \(the batch: y: \(4, 8\)"):
        optimize_checkpoints(Keyed(), {"y": X})
    optimize_checkpoints(Keyed(), {"x": X})  # the right key plans


# --------------------------------------------------------------------------
# a forward that reads a tensor's value
# --------------------------------------------------------------------------
class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.mean() > 0:
            h = h * 2
        return h


def test_value_read_in_an_opaque_submodule():
    """FX makes the submodule an opaque layer that fake tensors have no value to branch on in; it is
    captured again with the submodule run as one op (tracer/capture/opaque.py), planned exactly and
    trained identically. Without the weights (a meta model) the error stands, naming the line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Branch(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    opt = optimize_checkpoints(model, X)
    assert "reads a tensor's value" in opt.traced.opaque_modules["1"]
    assert 0 <= measure_peak(opt, X) - opt.predicted_peak_bytes <= 8
    for seed in (0, 1):
        torch.manual_seed(seed)
        a = ref(X).pow(2).mean()
        a.backward()
        torch.manual_seed(seed)
        b = opt(X).pow(2).mean()
        b.backward()
        assert torch.equal(a, b)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 8), Branch(), nn.Linear(8, 4))
    with pytest.raises(TraceError, match=r"cannot measure submodule '1' \(Branch, one opaque layer\): it runs a value "
                                         r"read from a tensor .*test_capture_errors.py:\d+ in forward: `if h.mean\(\) > 0:`"
                                         r".*What to do: rewrite that line.*torch.utils.checkpoint") as info:
        trace(meta, X.to("meta"))
    assert info.value.node == "_1" and "While executing" not in str(info.value)


class Count(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        idx = (h > 0).nonzero()
        return h * idx.shape[0]


def test_a_graph_node_that_reads_a_value_is_named_at_its_line_though_graphs_keep_no_lines():
    """torch.export records no source line per node (a quarter of its time); where a node of the graph
    cannot be run on fake tensors (an output shape read from values, on a meta model), the trace runs
    again with lines recorded, and the message names the model's line."""
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 8), Count(), nn.Linear(8, 4))
    with pytest.raises(TraceError, match=r"cannot measure graph node nonzero .*DynamicOutputShapeException\) at "
                                         r".*test_capture_errors.py:\d+ in forward: `idx = \(h > 0\).nonzero\(\)`"):
        trace(meta, X.to("meta"), capture="export")
    tm = trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), X, capture="export")
    assert tm.capture.front_end == "export"
    assert not any("stack_trace" in n.meta for n in tm.gm.graph.nodes)


def test_values_the_inputs_determine_are_read_from_the_example_batch():
    """Flaubert asserts `lengths.max().item() <= slen` (torch.export keeps the .item() in the graph), BART's
    classification head checks `unique_consecutive` of the EOS counts and indexes the EOS positions with a
    boolean mask: values of the input ids alone, which the fake run reads from the example batch itself
    (its shadows, torch_utils.fake_mode). Planned exactly and trained identically."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.FlaubertConfig(n_layers=2, emb_dim=64, n_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    flaubert = transformers.FlaubertWithLMHeadModel(cfg).train()
    ids = torch.randint(5, 256, (2, 16))
    bart_cfg = transformers.BartConfig(vocab_size=256, d_model=64, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                                       decoder_ffn_dim=128, max_position_embeddings=64, num_labels=3)
    bart = transformers.BartForSequenceClassification(bart_cfg).train()
    bart_ids = torch.randint(4, 256, (2, 16))
    bart_ids[:, -1] = bart_cfg.eos_token_id
    for model, batch in ((flaubert, {"input_ids": ids, "labels": ids}),
                         (bart, {"input_ids": bart_ids, "labels": torch.tensor([0, 2])})):
        ref = copy.deepcopy(model)
        opt = optimize_checkpoints(model, batch)
        assert abs(measure_peak(opt, batch) - opt.predicted_peak_bytes) <= 8, type(model).__name__
        _steps_identical(ref, model, batch)


class _ActivationMask(nn.Module):
    """Rows picked by a mask computed from an activation: its size depends on the weights' values."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h[h[:, 0] > 0])


def test_value_of_an_activation_in_an_exported_graph():
    """A boolean mask computed from an activation (not from the inputs alone): no fake run can size it."""
    model = _ActivationMask()
    with pytest.raises(TraceError, match=r"cannot (measure|capture).*(depends on tensor values|data-dependent)"):
        optimize_checkpoints(model, torch.randn(16, 8), capture="export")


def test_transformers_model_with_a_value_check(capfd):
    """Wav2Vec2ForCTC checks its labels against the vocabulary with an `if` on a tensor."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.Wav2Vec2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                      vocab_size=32, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg).train()
    batch = {"input_values": torch.randn(2, 1600), "labels": torch.randint(1, 32, (2, 10))}
    with pytest.raises(TraceError, match=r"cannot capture Wav2Vec2ForCTC: its forward runs a Python branch.*"
                                         r"GuardOnDataDependentSymNode.*modeling_wav2vec2.py:\d+ in forward: "
                                         r"`if labels is not None and labels.max\(\) >= self.config.vocab_size:`.*"
                                         r"model.gradient_checkpointing_enable"):
        optimize_checkpoints(model, batch)
    err = capfd.readouterr().err
    assert "def forward(self" not in err  # torch.export's partial graph is not printed


def test_a_branch_on_the_labels_is_taken_as_the_example_takes_it():
    """DeBERTa's classification head branches on `label_index.size(0) > 0` (labels to score exist):
    torch.export stops on it; captured again with the example's values, the branch is kept as a
    runtime assertion. Planned exactly, trained identically, and a batch that would take the other
    branch stops loudly instead of running the wrong graph. A branch on float data is refused."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.DebertaV2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=128, max_position_embeddings=64, num_labels=3)
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(cfg).train()
    batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.tensor([0, 2])}
    ref = copy.deepcopy(model)
    opt = optimize_checkpoints(model, batch)
    assert any("Runtime assertion" in n for n in opt.traced.capture.notes)
    assert 0 <= measure_peak(opt, batch) - opt.predicted_peak_bytes <= 8
    _steps_identical(ref, model, batch)
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        model(input_ids=batch["input_ids"], labels=torch.tensor([-1, -1]))


class _LayerDrop(nn.Module):
    """Skips each layer with probability 0.1 in training (M2M100, NLLB-MoE, SeamlessM4T)."""

    def __init__(self, on_device: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.on_device = on_device  # torch.rand(device=x.device): torch.fx then fails on the branch itself

    def forward(self, x):
        for layer in self.layers:
            if (torch.rand([], device=x.device) if self.on_device else torch.rand([])) < 0.1:
                continue
            x = torch.tanh(layer(x))
        return x.sum()


@pytest.mark.parametrize("capture, on_device", [("auto", False), ("export", False), ("auto", True)],
                         ids=["fx-bakes-it", "export", "both-front-ends-fail"])
def test_a_branch_on_a_random_draw_names_the_fix(capture, on_device):
    """Which layers run changes every step: one graph cannot hold that. torch.fx would bake the
    example's draw into the graph (it runs `torch.rand` for real), torch.export stops on it; both
    errors say it is a random draw and how to turn it off."""
    with pytest.raises(TraceError, match=r"(random draw|baked).*layerdrop=0"):
        optimize_checkpoints(_LayerDrop(on_device), (X,), capture=capture)


class _LoopThenFloatIndex(nn.Module):
    """FX cannot iterate a proxy; export follows the loop and then fails on a float index."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        for _ in x:
            pass
        return self.lin(x)[torch.tensor([0.5])]


class _Numpy(nn.Module):
    """Runs eagerly; neither front end (nor a fake tensor) goes through ``.numpy()``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = torch.from_numpy(x.detach().numpy() * 2)
        return self.lin(x) * scale


def test_the_construct_a_front_end_met_is_named_at_its_own_line():
    with pytest.raises(TraceError) as err:
        optimize_checkpoints(_LoopThenFloatIndex(), torch.randn(2, 4))
    msg = str(err.value)
    assert "data-dependent control flow" in msg and "test_capture_errors.py" in msg and "`for _ in x:`" in msg


def test_a_model_that_runs_but_neither_front_end_follows_is_not_blamed_on_the_batch():
    with pytest.raises(TraceError) as err:
        optimize_checkpoints(_Numpy(), torch.randn(2, 4))
    msg = str(err.value)
    assert "rejects the example batch" not in msg
    assert "torch.export" in msg and "test_capture_errors.py" in msg and ".numpy()" in msg


def _calls_numpy_badly():
    import numpy as np

    np.put_along_axis(np.zeros((2, 4)), np.zeros((2, 1)), 1, -1)  # (float indices: numpy raises inside)


def test_a_failure_inside_numpy_is_named_at_the_models_line_that_called_it():
    """SpeechT5's SpecAugment masks with numpy: export fails inside numpy, and the message names the
    model's line that called it, not numpy's own."""
    from ckptopt.torch_utils import source_line

    with pytest.raises(IndexError) as info:
        _calls_numpy_badly()
    where = source_line(info.value)
    assert "_calls_numpy_badly" in where and "np.put_along_axis" in where and "numpy/" not in where


def test_a_construct_in_transformers_own_wrapper_is_not_named_as_the_models():
    """FX fails on every transformers model in the library's output decorator (generic.py iterates
    what the forward returns); where export fails on something else, its line (the model's) is named:
    Wav2Vec2's SpecAugment masks with numpy in training."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.Wav2Vec2Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                      vocab_size=16, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
    model = transformers.Wav2Vec2ForCTC(cfg).train()
    with pytest.raises(TraceError) as info:
        optimize_checkpoints(model, {"input_values": torch.randn(2, 2000)}, loss_fn=lambda out: out.logits.mean())
    assert "modeling_wav2vec2.py" in str(info.value) and "generic.py" not in str(info.value)


class _HostDraws(nn.Module):
    """A mask (``use``) or a skipped layer (LayerDrop at ``p``) drawn with numpy / Python's random."""

    def __init__(self, how: str, p: float = 0.0):
        super().__init__()
        self.a, self.b, self.how, self.p = nn.Linear(8, 8), nn.Linear(8, 8), how, p

    def forward(self, x):
        import random

        import numpy as np

        h = torch.relu(self.a(x))
        if self.how == "mask":
            h = h * torch.from_numpy((np.random.rand(h.shape[-1]) < 0.5).astype("float32"))
        elif random.uniform(0, 1) >= self.p:  # LayerDrop: drawn every step, used only where p > 0
            h = torch.tanh(self.b(h))
        return self.b(h)


@pytest.mark.parametrize("how,p", [("mask", 0.0), ("layerdrop", 0.5)])
def test_a_forward_computing_with_numpy_or_python_random_draws_is_refused(how, p):
    """A captured graph holds what numpy or Python's random drew while capturing, and the module would apply
    that draw at every step: the forward's runs under different draws differ, so planning stops and says
    so (a draw the forward does not use, LayerDrop at 0, plans: below)."""
    with pytest.raises(TraceError, match="random numbers drawn outside torch") as err:
        optimize_checkpoints(_HostDraws(how, p).train(), X.clone().requires_grad_(), loss_fn=lambda y: y.sum())
    assert "Draw them with torch" in str(err.value)


def test_an_unused_host_draw_plans_and_the_generators_are_put_back():
    """LayerDrop at 0 drawn with random.uniform: every run alike, the plan trains as the model does (with a
    warning that the draw is taken as unused); the check's own draws leave numpy's and Python's generators
    where they were."""
    import random

    import numpy as np

    from ckptopt.api import _check_forward_has_no_python_side_effects

    torch.manual_seed(0)
    model = _HostDraws("layerdrop", 0.0).train()
    x = X.clone().requires_grad_()
    with pytest.warns(UserWarning, match="takes the draw as unused"):
        opt = optimize_checkpoints(model, x, loss_fn=lambda y: y.sum(), in_place=False)
    assert torch.equal(opt(x), model(x))
    np.random.seed(5)
    random.seed(5)
    want = (np.random.get_state()[1].copy(), random.getstate())
    with pytest.warns(UserWarning, match="takes the draw as unused"):
        assert _check_forward_has_no_python_side_effects(model, x) is None
    assert np.array_equal(np.random.get_state()[1], want[0]) and random.getstate() == want[1]
