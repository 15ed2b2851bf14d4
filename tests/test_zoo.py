"""Tests for ckptopt.zoo: published parameter counts, forward shapes,
torch.fx traceability, determinism and the name registry.

Each full-size ImageNet model is built exactly once (module-scoped fixture);
forwards use batch 1 at 32x32 in eval mode. GPT forwards use a tiny config;
GPT-2 small (and the VGG-BN variants) are built on the meta device, only to
count their parameters.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.fx

from ckptopt import zoo

CNNS = ["vgg16", "vgg19", "resnet18", "resnet50", "resnet101", "resnet152",
        "densenet121", "mobilenet_v2"]
ALL = CNNS + ["unet", "gpt", "mlp"]

# torchvision's published figures (num_classes=1000).
PUBLISHED = {
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "densenet121": 7_978_856,
    "mobilenet_v2": 3_504_872,
}
GPT2_SMALL = 124_439_808

TINY_GPT = dict(depth=2, width=32, heads=4, seq_len=16, vocab=97)
TINY_MLP = dict(width=24, depth=3, num_classes=5)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights


def unet_param_count(in_ch: int = 3, num_classes: int = 2, base: int = 64) -> int:
    """milesial U-Net, bilinear=False, from the layout: convs without bias + BN (2 per channel)."""

    def double_conv(i: int, o: int) -> int:
        return (9 * i * o + 2 * o) + (9 * o * o + 2 * o)

    def up(i: int, o: int) -> int:  # ConvTranspose2d(i, i//2, 2, stride=2) with bias, then double conv
        return i * (i // 2) * 4 + i // 2 + double_conv(i, o)

    b = base
    total = double_conv(in_ch, b)
    total += sum(double_conv(b * 2 ** k, b * 2 ** (k + 1)) for k in range(4))  # down1..down4
    total += sum(up(b * 2 ** (k + 1), b * 2 ** k) for k in range(4))  # up4..up1
    total += b * num_classes + num_classes  # 1x1 OutConv
    return total


def gpt_param_count(depth, width, seq_len, vocab) -> int:
    block = 2 * (2 * width) + (width * 3 * width + 3 * width) + (width * width + width) \
        + (width * 4 * width + 4 * width) + (4 * width * width + width)
    return vocab * width + seq_len * width + depth * block + 2 * width  # tied head counted once


@pytest.fixture(scope="module", params=ALL)
def case(request):
    """(name, model, inputs): full-size CNNs/U-Net, tiny GPT/MLP; tiny inputs."""
    name = request.param
    if name == "gpt":
        model, inputs = zoo.get("gpt", batch_size=2, input_size=12, **TINY_GPT)
    elif name == "mlp":
        model, inputs = zoo.get("mlp", batch_size=3, input_size=10, **TINY_MLP)
    else:
        model, inputs = zoo.get(name, batch_size=1, input_size=32)
    model.eval()
    return name, model, inputs


# --------------------------------------------------------------- registry ---


def test_names():
    assert zoo.names() == ALL


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as ei:
        zoo.get("resnet9000")
    msg = str(ei.value)
    for n in ALL:
        assert n in msg


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed")
def test_torchvision_name_without_torchvision():
    with pytest.raises(ImportError):
        zoo.get("torchvision:resnet50")


def test_torchvision_name():
    try:
        import torchvision.models  # noqa: F401
    except Exception:
        pytest.skip("torchvision does not import")
    model, (x,) = zoo.get("torchvision:resnet18", batch_size=1, input_size=64)
    assert n_params(model) == PUBLISHED["resnet18"]
    assert x.shape == (1, 3, 64, 64)


# ---------------------------------------------------------- parameter counts ---


def test_param_count(case):
    name, model, _ = case
    if name in PUBLISHED:
        assert n_params(model) == PUBLISHED[name]
    elif name == "unet":
        assert unet_param_count() == 31_037_698
        assert n_params(model) == unet_param_count()
        assert zoo.PUBLISHED_PARAM_COUNTS["unet"] == unet_param_count()
    elif name == "gpt":
        assert n_params(model) == gpt_param_count(2, 32, 16, 97)
    elif name == "mlp":
        w, d, c = 24, 3, 5
        assert n_params(model) == (10 + 1) * w + (d - 1) * (w + 1) * w + (w + 1) * c


def test_published_table_matches():
    for name, count in PUBLISHED.items():
        assert zoo.PUBLISHED_PARAM_COUNTS[name] == count
    assert zoo.PUBLISHED_PARAM_COUNTS["gpt"] == GPT2_SMALL


def test_gpt2_small_param_count():
    assert gpt_param_count(12, 768, 1024, 50257) == GPT2_SMALL
    with torch.device("meta"):  # defaults = GPT-2 small; meta: no allocation, no init cost
        model = zoo.gpt()
    assert n_params(model) == GPT2_SMALL
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("fn,count", [(zoo.vgg16, 138_365_992), (zoo.vgg19, 143_678_248)])
def test_vgg_bn_param_count(fn, count):
    with torch.device("meta"):  # no allocation, no init cost
        model = fn(batch_norm=True)
    assert n_params(model) == count
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())


def test_unet_param_count_other_base():
    model = zoo.unet(in_channels=1, num_classes=3, base=8)
    assert n_params(model) == unet_param_count(1, 3, 8)


# ------------------------------------------------------ forwards and tracing ---


def expected_shape(name, inputs):
    x = inputs[0]
    if name in CNNS:
        return (x.shape[0], 1000)
    if name == "unet":
        return (x.shape[0], 2, x.shape[2], x.shape[3])
    if name == "gpt":
        return (x.shape[0], x.shape[1], TINY_GPT["vocab"])
    if name == "mlp":
        return (x.shape[0], TINY_MLP["num_classes"])
    raise AssertionError(name)


def test_example_inputs(case):
    name, model, inputs = case
    assert isinstance(inputs, tuple) and len(inputs) == 1
    x = inputs[0]
    if name == "gpt":
        assert x.dtype == torch.int64 and x.shape == (2, 12)
        assert 0 <= int(x.min()) and int(x.max()) < TINY_GPT["vocab"]
    elif name == "mlp":
        assert x.dtype == torch.float32 and x.shape == (3, 10)
    else:
        assert x.dtype == torch.float32 and x.shape == (1, 3, 32, 32)


def test_forward_shape(case):
    name, model, inputs = case
    with torch.no_grad():
        out = model(*inputs)
    assert out.shape == expected_shape(name, inputs)
    assert torch.isfinite(out).all()


def test_fx_trace_matches(case):
    name, model, inputs = case
    gm = torch.fx.symbolic_trace(model)
    assert isinstance(gm, torch.fx.GraphModule)
    with torch.no_grad():
        ref = model(*inputs)
        got = gm(*inputs)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_unet_odd_size_pads_and_traces():
    model, (x,) = zoo.get("unet", batch_size=2, input_size=36, base=4, in_channels=1, num_classes=3)
    model.eval()
    assert x.shape == (2, 1, 36, 36)
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(gm(x), out, rtol=0, atol=0)
    assert out.shape == (2, 3, 36, 36)


def test_unet_bilinear():
    model, (x,) = zoo.get("unet", base=4, bilinear=True, input_size=32)
    gm = torch.fx.symbolic_trace(model.eval())
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_train_step_small_models():
    for name, kw in [("resnet18", dict(num_classes=10)), ("gpt", TINY_GPT), ("mlp", TINY_MLP)]:
        model, inputs = zoo.get(name, batch_size=2, input_size=16 if name != "mlp" else None, **kw)
        model.train()
        model(*inputs).float().sum().backward()
        assert all(p.grad is not None for p in model.parameters()), name


# ------------------------------------------------------------------- GPT ---


def test_gpt_is_causal():
    model, (idx,) = zoo.get("gpt", batch_size=1, input_size=10, **TINY_GPT)
    model.eval()
    idx2 = idx.clone()
    idx2[0, 7] = (idx2[0, 7] + 1) % TINY_GPT["vocab"]
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_gpt_sdpa_matches_explicit_and_traces():
    model, (idx,) = zoo.get("gpt", batch_size=2, input_size=16, **TINY_GPT)
    fast, _ = zoo.get("gpt", batch_size=2, input_size=16, sdpa=True, **TINY_GPT)
    assert fast.state_dict().keys() == model.state_dict().keys()  # mask buffer is non-persistent
    fast.load_state_dict(model.state_dict())
    gm = torch.fx.symbolic_trace(fast)
    with torch.no_grad():
        ref = model.eval()(idx)
        torch.testing.assert_close(fast.eval()(idx), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gm(idx), fast(idx), rtol=0, atol=0)


def test_gpt_trace_has_no_runtime_mask_construction():
    model, _ = zoo.get("gpt", **TINY_GPT)
    gm = torch.fx.symbolic_trace(model)
    targets = {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes}
    assert not targets & {"ones", "tril", "triu", "full"}


def test_gpt_dropout_and_bad_seq():
    model, (idx,) = zoo.get("gpt", batch_size=1, input_size=8, dropout=0.5, **TINY_GPT)
    model.train()
    torch.manual_seed(1)
    a = model(idx)
    b = model(idx)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError):
        zoo.get("gpt", input_size=TINY_GPT["seq_len"] + 1, **TINY_GPT)
    _, (idx,) = zoo.get("gpt", **TINY_GPT)
    assert idx.shape == (2, TINY_GPT["seq_len"])  # default length capped at seq_len


# -------------------------------------------------------------- get options ---


@pytest.mark.parametrize("name,kw", [("resnet18", dict(num_classes=10)), ("gpt", TINY_GPT),
                                     ("mlp", TINY_MLP), ("unet", dict(base=4))])
def test_get_deterministic(name, kw):
    m1, in1 = zoo.get(name, seed=3, **kw)
    m2, in2 = zoo.get(name, seed=3, **kw)
    m3, in3 = zoo.get(name, seed=4, **kw)
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert any(not torch.equal(s1[k], s3[k]) for k in s1 if s1[k].is_floating_point())
    assert all(torch.equal(a, b) for a, b in zip(in1, in2))


def test_get_defaults_and_dtype():
    model, (x,) = zoo.get("resnet18", num_classes=10)
    assert x.shape == (2, 3, 64, 64)
    model, (x,) = zoo.get("mlp", **TINY_MLP)
    assert x.shape == (32, 784)
    model, (x,) = zoo.get("unet", base=4)
    assert x.shape == (1, 3, 64, 64)
    model, (x,) = zoo.get("mobilenet_v2", num_classes=10, dtype=torch.float64, input_size=32)
    assert x.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in model.parameters())
    with torch.no_grad():
        assert model.eval()(x).dtype == torch.float64
    with pytest.raises(ValueError):
        zoo.get("mlp", input_size=8, in_features=9)
