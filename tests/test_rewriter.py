"""The rewritten module against the unmodified model: outputs, gradients, buffers, memory."""

import warnings

import pytest
import torch
import torch.nn as nn

from ckptopt import InfeasibleBudget, UnknownSolver, apply_plan, optimize_checkpoints, solve, zoo
from ckptopt.measure import measure_peak
from ckptopt.tracer import trace

# CPU kernels are deterministic: recomputation reproduces activations bit for bit,
# so outputs and gradients must be exactly equal (no tolerance).

ZOO_SMALL = {
    "vgg16": dict(batch_size=2, input_size=32),
    "resnet18": dict(batch_size=2, input_size=32),
    "resnet50": dict(batch_size=2, input_size=32),
    "densenet121": dict(batch_size=2, input_size=32),
    "mobilenet_v2": dict(batch_size=2, input_size=32),
    "unet": dict(batch_size=2, input_size=32, base=8),
    "gpt": dict(batch_size=2, input_size=16, depth=2, width=32, heads=2, seq_len=16, vocab=64, dropout=0.1),
    "mlp": dict(batch_size=8, in_features=32, width=64, depth=4),
}


def loss_of(out):
    return out.float().pow(2).mean()


def buffers(model):
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def restore(model, snap):
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(snap[k])


def run_steps(module, model, inputs, steps, seed=0):
    """Forward/backward `steps` times; returns outputs, grads (of the last step), buffers."""
    outs = []
    for s in range(steps):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(seed + s)
        out = module(*inputs)
        loss_of(out).backward()
        outs.append(out.detach())
    grads = {k: (None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return outs, grads, buffers(model)


def assert_same_training(model, inputs, opt, steps=3):
    start = buffers(model)
    ref = run_steps(model, model, inputs, steps)
    restore(model, start)
    got = run_steps(opt, model, inputs, steps)
    restore(model, start)
    for a, b in zip(ref[0], got[0]):
        assert torch.equal(a, b), "outputs differ"
    for k in ref[1]:
        assert (ref[1][k] is None) == (got[1][k] is None), k
        if ref[1][k] is not None:
            assert torch.equal(ref[1][k], got[1][k]), f"gradient of {k} differs"
    for k in ref[2]:
        assert torch.equal(ref[2][k], got[2][k]), f"buffer {k} differs"


@pytest.mark.parametrize("name", sorted(ZOO_SMALL))
def test_zoo_numerics_identical_with_every_cut_checkpointed(name):
    model, inputs = zoo.get(name, **ZOO_SMALL[name])
    tm = trace(model, inputs)
    # "every": every candidate cut is a checkpoint, the most rewriting a plan can do
    opt = apply_plan(model, tm, solve(tm.costs, "every"))
    # every model layer is its own checkpointed segment (the loss is outside the module)
    assert sum(s.wrapped for s in opt._segments) == tm.n - 1
    # two steps catch a second BatchNorm update; the big ResNets take one to stay quick
    assert_same_training(model, inputs, opt, steps=1 if name in ("resnet101", "resnet152") else 2)
    assert opt.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("name", ["resnet18", "gpt", "mobilenet_v2", "unet"])
def test_optimal_plan_numerics_and_measured_peak(name):
    model, inputs = zoo.get(name, **ZOO_SMALL[name])
    opt = optimize_checkpoints(model, inputs, solver="dp2")
    assert_same_training(model, inputs, opt)
    measured = measure_peak(opt, inputs)
    assert abs(measured - opt.predicted_peak_bytes) <= 0.03 * opt.predicted_peak_bytes
    assert opt.predicted_peak_bytes <= opt.baseline_peak_bytes


def test_batchnorm_statistics_updated_once():
    model, inputs = zoo.get("resnet18", **ZOO_SMALL["resnet18"])
    tm = trace(model, inputs)
    opt = apply_plan(model, tm, solve(tm.costs, "every"))
    bn = model.bn1
    before = bn.num_batches_tracked.item()
    for _ in range(3):
        loss_of(opt(*inputs)).backward()
    assert bn.num_batches_tracked.item() == before + 3
    assert bn.momentum == 0.1


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.relu(self.lin(x))


def counting_model():
    return nn.Sequential(Counter(), Counter(), Counter(), nn.Linear(16, 4))


def test_recomputation_only_when_training_with_grad():
    model = counting_model()
    x = torch.randn(4, 16)
    tm = trace(model, (x,), leaf_modules=[Counter])
    opt = apply_plan(model, tm, solve(tm.costs, "every"))
    c = model[0]
    c.calls = 0
    loss_of(opt(x)).backward()
    assert c.calls == 2  # forward, then recomputation in backward
    c.calls = 0
    opt.eval()
    assert not model.training and not model[0].training  # eval() passes through
    loss_of(opt(x)).backward()
    assert c.calls == 1
    opt.train()
    c.calls = 0
    with torch.no_grad():
        opt(x)
    assert c.calls == 1


def test_state_dict_round_trip_and_to():
    model, inputs = zoo.get("resnet18", **ZOO_SMALL["resnet18"])
    opt = optimize_checkpoints(model, inputs, solver="every")
    sd = opt.state_dict()
    assert list(sd) == list(model.state_dict())
    other, _ = zoo.get("resnet18", seed=5, **ZOO_SMALL["resnet18"])
    opt.load_state_dict(other.state_dict())
    assert torch.equal(model.conv1.weight, other.conv1.weight)
    other.load_state_dict(opt.state_dict())
    opt.to(torch.float64)
    assert model.conv1.weight.dtype == torch.float64
    x64 = inputs[0].double()
    ref = other.double()
    ref.eval(), opt.eval()
    assert torch.equal(opt(x64), ref(x64))


def test_other_batch_size_works_other_shape_warns():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = optimize_checkpoints(model, torch.randn(8, 16), solver="every")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training(model, (torch.randn(3, 16),), opt, steps=1)
    seq = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    opt = optimize_checkpoints(seq, torch.randn(2, 5, 16), solver="every")
    with pytest.warns(UserWarning, match="planned for other shapes"):
        opt(torch.randn(2, 7, 16))


class Fancy(nn.Module):
    """kwargs, a frozen layer, a tuple + dict output and a non-tensor crossing cuts."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 12)
        self.frozen = nn.Linear(12, 12).requires_grad_(False)
        self.b = nn.Linear(12, 12)
        self.c = nn.Linear(12, 6)

    def forward(self, x, scale: float = 1.0):
        n = x.size(-1)  # a non-tensor value used three segments later
        h = torch.relu(self.a(x)) * scale
        h = torch.relu(self.frozen(h))
        h = torch.tanh(self.b(h))
        out = self.c(h[..., :n])
        return out, {"aux": h.mean(), "n": n}


def test_kwargs_frozen_params_nested_outputs():
    torch.manual_seed(0)
    model = Fancy()
    x = torch.randn(5, 12)
    loss = lambda o: o[0].pow(2).mean() + o[1]["aux"]
    tm = trace(model, (x,), loss_fn=loss)
    opt = apply_plan(model, tm, solve(tm.costs, "every"))
    assert sum(s.wrapped for s in opt._segments) >= 3
    for p in model.parameters():
        p.grad = None
    ref = model(x, scale=0.5)
    loss(ref).backward()
    ref_grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    got = opt(x, scale=0.5)
    loss(got).backward()
    assert torch.equal(ref[0], got[0]) and got[1]["n"] == 12 and torch.equal(ref[1]["aux"], got[1]["aux"])
    for r, p in zip(ref_grads, model.parameters()):
        assert (r is None and p.grad is None) or torch.equal(r, p.grad)
    assert model.frozen.weight.grad is None


def test_input_that_requires_grad_gets_the_same_gradient():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(4, 8, requires_grad=True)
    opt = optimize_checkpoints(model, (x,), solver="every")
    loss_of(model(x)).backward()
    g = x.grad.clone()
    x.grad = None
    loss_of(opt(x)).backward()
    assert torch.equal(g, x.grad)


def test_never_worse_than_no_checkpointing():
    # one big layer: nothing to gain, the plan is empty and explain() says so
    model = nn.Sequential(nn.Linear(256, 256))
    opt = optimize_checkpoints(model, torch.randn(4, 256))
    assert opt.plan.checkpoints == () and opt.predicted_peak_bytes == opt.baseline_peak_bytes
    assert "cannot lower the peak" in opt.explain()
    for solver in ("every", "sqrt", "chen-greedy"):
        # an explicitly requested plan worse than none is not returned either
        o = optimize_checkpoints(model, torch.randn(4, 256), solver=solver)
        assert o.predicted_peak_bytes <= o.baseline_peak_bytes


def test_explain_lists_segments():
    model, inputs = zoo.get("gpt", **ZOO_SMALL["gpt"])
    opt = optimize_checkpoints(model, inputs)
    text = opt.explain()
    assert "predicted peak" in text and "without checkpointing" in text
    assert text.count("segment ") == len(opt.plan.segments)


def test_bad_input():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with pytest.raises(UnknownSolver, match="valid solvers"):
        optimize_checkpoints(model, x, solver="fastest")
    with pytest.raises(InfeasibleBudget) as ei:
        optimize_checkpoints(model, x, budget=100)
    assert str(ei.value.min_peak_bytes) in str(ei.value)
    tm = trace(model, (x,))
    other = trace(nn.Sequential(nn.Linear(8, 8)), (x,))
    with pytest.raises(ValueError, match="layers"):
        apply_plan(model, tm, solve(other.costs, "none"))
    with pytest.raises(TypeError, match="Plan"):
        apply_plan(model, tm, (1, 2))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_an_unwrapped_segment_that_reads_only_parameters_runs(capture):
    """Mamba's ``-exp(A_log.float())`` reads a parameter and nothing else: a stored segment starting
    there has no inputs, and its code (which takes its inputs as a list only when it has some) was
    called with an empty list; the first training call of the planned Mamba raised a TypeError."""
    import copy

    from ckptopt import Plan, simulate

    class Decay(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            self.log_rate = nn.Parameter(torch.randn(16))

        def forward(self, x):
            return self.b(torch.relu(self.a(x)) * -torch.exp(self.log_rate.float()))

    torch.manual_seed(0)
    model, x = Decay().train(), torch.randn(8, 16)
    t = trace(model, x, capture=capture)
    (k,) = [l.index for l in t.layers if not l.input_node and not l.side_inputs]
    cps, stored = (k, k + 1), (k,)
    p = simulate(t.costs, cps, stored)
    planned = apply_plan(copy.deepcopy(model), t, Plan(cps, p.peak_bytes, "given", 0.0, t.n, stored))
    out, ref = planned(x), model(x)
    out.pow(2).mean().backward()
    ref.pow(2).mean().backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(planned.parameters(), model.parameters()))
    assert 0 <= measure_peak(planned, x) - p.peak_bytes <= 8


def _bn_chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                           for _ in range(6)]).train()


def test_a_plan_that_fails_its_first_training_step_is_caught_before_it_is_returned(monkeypatch):
    """optimize_checkpoints runs one fake training step through the rewritten module: a rewriter
    fault that only shows in training (here: every checkpointed segment raises) is a TraceError
    at planning time, naming the cause, not a module that fails in the user's loop."""
    import ckptopt.rewriter as rewriter

    def broken(fn, *args, **kwargs):
        raise RuntimeError("segment called with the wrong arguments")

    model, x = _bn_chain(), torch.randn(4, 8, 16, 16)
    assert optimize_checkpoints(model, x).plan.checkpoints  # the unbroken plan checkpoints something
    monkeypatch.setattr(rewriter, "checkpoint", broken)
    with pytest.raises(Exception) as info:
        optimize_checkpoints(model, x)
    assert type(info.value).__name__ == "TraceError"
    assert "training step" in str(info.value) and "segment called with the wrong arguments" in str(info.value)


def test_the_fake_training_step_leaves_the_model_untouched():
    """The verifying step runs on a fake copy: no gradient, no BatchNorm statistics, no version bump."""
    model, x = _bn_chain(), torch.randn(4, 8, 16, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = optimize_checkpoints(model, x)
    assert fast.plan.checkpoints
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_step_fake_tensors_cannot_run_is_said_in_explain_not_raised(monkeypatch):
    """A step that reads a tensor's value cannot run on fake tensors: the plan is returned and
    explain() says it was not verified (the real step may well pass)."""
    import ckptopt.rewriter as rewriter

    real = rewriter.checkpoint

    def reads_a_value(fn, *args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor

        if any(isinstance(a, FakeTensor) for a in args):
            bool(args[0].sum() > 0)  # DataDependentOutputException on a fake tensor
        return real(fn, *args, **kwargs)

    model, x = _bn_chain(), torch.randn(4, 8, 16, 16)
    monkeypatch.setattr(rewriter, "checkpoint", reads_a_value)
    fast = optimize_checkpoints(model, x)
    assert "not verified by a fake training step" in fast.explain()
    fast(x).sum().backward()  # and the real step runs
