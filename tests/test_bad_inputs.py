"""The bad-input catalogue (docs/troubleshooting.md), one test per entry.

Each test calls the public API (``optimize_checkpoints`` unless the entry
names another), checks the error's type and that its message says what is
wrong and what to do, and that the user's model is left exactly as it was:
same ``state_dict`` values, same eval-mode output, same training flag, no
gradients, no hooks and no plain-Python attribute changed.
Related tests elsewhere: tests/test_tracer.py::test_bad_inputs (trace()),
tests/test_costs.py (every malformed cost field), tests/test_solvers.py
(budgets and solver names given to solve()), tests/test_cli.py (exit codes).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

import ckptopt.tracer
from ckptopt import (ChainCosts, InfeasibleBudget, InvalidCosts, ProblemTooLarge, TraceError, UnknownSolver,
                     optimize_checkpoints)
from ckptopt import trace
from ckptopt.cli import main as cli_main


# --------------------------------------------------------------------------
# "the user's model is untouched"
# --------------------------------------------------------------------------
def _hooks(model):
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    return {(path, h): len(getattr(m, h, {})) for path, m in model.named_modules() for h in names}


def _plain_attrs(model):
    skip = set(vars(nn.Module()))
    return {(path, k): repr(v) for path, m in model.named_modules() for k, v in vars(m).items()
            if k not in skip and (v is None or isinstance(v, (bool, int, float, str, list, dict)))}


def fingerprint(model, x):
    """Everything an error must leave unchanged."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.random.fork_rng():
        out = model(x).clone()
    model.train(was_training)
    return dict(
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        out=out, training=[m.training for m in model.modules()],
        grads=[p.grad for p in model.parameters()], hooks=_hooks(model), attrs=_plain_attrs(model),
        forward_patched="forward" in vars(model),
    )


def assert_untouched(model, x, before):
    after_attrs = _plain_attrs(model)  # before the eval-mode forward below runs any counter
    assert after_attrs == before["attrs"], "a Python attribute of the model changed"
    after = fingerprint(model, x)
    assert after["state"].keys() == before["state"].keys()
    for k in before["state"]:
        assert torch.equal(after["state"][k], before["state"][k]), f"{k} changed"
    assert torch.equal(after["out"], before["out"]), "the model's output changed"
    assert after["training"] == before["training"]
    assert all(g is None for g in after["grads"]), "gradients were left on the parameters"
    assert after["hooks"] == before["hooks"], "hooks were left on the model"
    assert not after["forward_patched"]


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


X = torch.randn(4, 8)


def expect(exc_type, match, model, *args, x=X, **kwargs):
    """Call optimize_checkpoints(model, *args, **kwargs); check the error and that ``model`` is untouched."""
    before = fingerprint(model, x)
    with pytest.raises(exc_type, match=match) as info:
        optimize_checkpoints(model, *args, **kwargs)
    assert_untouched(model, x, before)
    return info.value


@pytest.fixture
def no_tracing(monkeypatch):
    """Errors that need no tracing must come before it (tracing a big model takes seconds)."""
    def refuse(*a, **k):
        raise AssertionError("traced although the arguments were already known to be bad")
    monkeypatch.setattr(ckptopt.tracer, "trace", refuse)


# --------------------------------------------------------------------------
# the catalogue
# --------------------------------------------------------------------------
@pytest.mark.parametrize("thing", [lambda: (lambda x: x), lambda: small_model().parameters(),
                                   lambda: torch.randn(2, 2), lambda: None],
                         ids=["function", "parameters", "tensor", "None"])
def test_not_a_module(thing):
    with pytest.raises(TypeError, match=r"needs an nn.Module.*pass the model itself"):
        optimize_checkpoints(thing(), X)


@pytest.mark.parametrize("inputs", [None, (), [], "x", {}, {0: X}], ids=["None", "empty-tuple", "empty-list",
                                                                        "str", "empty-dict", "int-keys"])
def test_no_example_inputs(inputs):
    err = expect(TypeError, "example_inputs must be a tensor, a non-empty tuple .* or a non-empty dict", small_model(),
                 inputs)
    assert type(inputs).__name__ in str(err)


def test_keyword_inputs_the_model_does_not_take():
    """A dict is keyword arguments: a key the forward does not take fails with the model's own error."""
    expect(TypeError, r"do not fit Sequential.forward: it takes \(input\), got 0 positional, x=", small_model(),
           {"x": X})


def test_wrong_example_inputs_shape():
    err = expect(TraceError, r"example inputs match what the model expects", small_model(), torch.randn(4, 7))
    assert err.node is not None and "7" in str(err)


def test_wrong_number_of_example_inputs():
    expect(TypeError, r"do not fit Sequential.forward: it takes \(input\), got 2 positional", small_model(), (X, X))


def test_inputs_on_several_devices():
    # one tensor on the model's device (cpu) and one on another (meta: present on every build)
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, a, b):
            return self.lin(a) + self.lin(b)

    model = TwoInputs()
    before = fingerprint_two = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"different devices \(cpu, meta\).*move them to one device"):
        trace(model, (X, torch.randn(4, 8, device="meta")))
    with pytest.raises(ValueError, match=r"optimize_checkpoints returns a module to train, but the model or its "
                                         r"inputs are on the meta device.*ckptopt.estimate"):
        optimize_checkpoints(model, (X, torch.randn(4, 8, device="meta")))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and fingerprint_two
    expect(ValueError, r"on the meta device", small_model(), torch.randn(4, 8, device="meta"))


def test_model_with_no_parameters():
    model = nn.Sequential(nn.ReLU(), nn.Tanh())
    expect(ValueError, r"no parameters that require grad.*unfreeze", model, X)


def test_model_with_nothing_requiring_grad():
    model = small_model().requires_grad_(False)
    expect(ValueError, r"no parameters that require grad.*requires_grad_\(True\)", model, X)
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("budget, match", [(0, "must be positive"), (-1, "must be positive"),
                                           (-0.5, "must be positive"), (math.nan, "NaN"),
                                           (math.inf, "infinite.*budget=None"), ("8GiB", "parse_bytes"),
                                           (True, "number of bytes")])
def test_bad_budget_fails_before_tracing(budget, match, no_tracing):
    expect(ValueError, match, small_model(), X, budget=budget)


def test_budget_below_the_minimum():
    model = small_model()
    err = expect(InfeasibleBudget, r"smallest achievable peak is \d+ bytes.*Raise the budget", model, X,
                 budget=1000)
    assert err.budget_bytes == 1000 and err.min_peak_bytes > 1000
    # the minimum it names is feasible
    opt = optimize_checkpoints(small_model(), X, budget=err.min_peak_bytes)
    assert opt.predicted_peak_bytes <= err.min_peak_bytes


def test_unknown_solver_fails_before_tracing(no_tracing):
    err = expect(UnknownSolver, r"unknown solver 'fastest'; valid solvers: .*dp2", small_model(), X,
                 solver="fastest")
    assert isinstance(err, ValueError)


def _costs_file(tmp_path):
    from ckptopt import trace

    path = tmp_path / "costs.json"
    trace(small_model(), X).costs.to_json(path)
    return path


def test_truncated_costs_json(tmp_path, capsys):
    path = _costs_file(tmp_path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(InvalidCosts, match=r"not valid JSON.*truncated.*Regenerate"):
        ChainCosts.from_json(path)
    assert cli_main(["solve", "--costs", str(path)]) == 2
    assert "truncated" in capsys.readouterr().err


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["layers"].__setitem__("a", d["layers"]["a"][:-1]),
     r"'a' has 6 entries but .* have 7; every per-layer field needs one entry per layer"),
    (lambda d: d["layers"]["b"].__setitem__(1, -5), r"'b' index 1: -5 is negative"),
    (lambda d: d["layers"]["m"].__setitem__(0, "big"), r"'m' index 0"),
    (lambda d: d.__setitem__("format", "something-else"), r"not a ckptopt cost file"),
    (lambda d: d.pop("layers"), r"no 'layers'"),
], ids=["short-field", "negative", "not-a-number", "format", "no-layers"])
def test_corrupt_costs_json(tmp_path, edit, match):
    path = _costs_file(tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidCosts, match=match):
        ChainCosts.from_json(path)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        if h.mean() > 0:  # data-dependent control flow in the model's own forward
            h = h * 2
        return self.b(h)


def test_untraceable_control_flow():
    """Neither front end follows an `if` on a tensor's value: the error names the construct, its line,
    what each front end said, and what to do (not "make it an opaque submodule": fake tensors have no
    values to branch on there either, tests/test_capture_errors.py)."""
    err = expect(TraceError, r"cannot capture Branchy: its forward runs a Python branch, assert or size computed "
                             r"from a value read from a tensor .*test_bad_inputs.py:\d+ in forward: `if h.mean\(\) > 0:"
                             r".*torch.fx: data-dependent control flow.*torch.export: GuardOnDataDependentSymNode"
                             r".*What to do: rewrite that line without reading a tensor's value.*torch.utils.checkpoint",
                 Branchy(), X)
    assert err.node == "Branchy"


class Counting(nn.Module):
    """A forward with a Python side effect: recomputation would count twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.seen_batches = []

    def forward(self, x):
        self.calls += 1
        self.seen_batches.append(x.shape[0])
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("leaf", [False, True], ids=["traced-through", "opaque-leaf"])
def test_forward_that_mutates_python_state(leaf):
    model = nn.Sequential(nn.Linear(8, 8), Counting(), nn.ReLU(), Counting(), nn.Linear(8, 4))
    kwargs = {"leaf_modules": [Counting]} if leaf else {}
    err = expect(TraceError, r"changes Python state each time it runs \(1\.calls: .*would happen twice.*"
                             r"out of forward", model, X, **kwargs)
    assert err.node == "1.calls"
    # (FX ran the forward's Python code on the model itself; assert_untouched checked it was restored)


def test_forward_with_one_time_lazy_state_is_accepted():
    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.width = None

        def forward(self, x):
            self.width = x.shape[-1]  # the same on every call: harmless when run twice
            return torch.tanh(self.lin(x))

    model = nn.Sequential(Lazy(), Lazy(), nn.Linear(8, 4))
    opt = optimize_checkpoints(model, X, solver="every")
    opt(X).pow(2).mean().backward()
    assert model[0].lin.weight.grad is not None


def test_n_too_large_for_brute():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(12)])
    err = expect(ProblemTooLarge, r"refuses n > 20 \(this model has n = 2\d\).*use the exact solver 'dp2'",
                 model, X, solver="brute")
    assert isinstance(err, ValueError)


def test_a_plan_that_fails_the_training_step_check(monkeypatch):
    """The rewritten module is run for one fake training step before it is returned: a rewriter fault
    that only shows in training is an error at planning time, and the model is left as it was (the
    BatchNorm guards the rewriter put on its modules removed)."""
    import ckptopt.rewriter

    def broken(self, *args, **kwargs):
        raise RuntimeError("a segment was called with the wrong arguments")

    monkeypatch.setattr(ckptopt.rewriter.CheckpointedModule, "forward", broken)
    err = expect(TraceError, r"one training step through the rewritten module, run on fake tensors before "
                             r"returning it, failed: RuntimeError: a segment was called with the wrong arguments",
                 small_model(), X)
    assert "please report this model" in str(err)


@pytest.mark.parametrize("bad", ["False", 0, None])
def test_trace_dynamic_shapes_must_be_a_flag(bad):
    """A string "False" is truthy: taken as given it would export with dynamic shapes, silently."""
    with pytest.raises(ValueError, match="dynamic_shapes must be True"):
        trace(nn.Linear(4, 4), torch.randn(2, 4), dynamic_shapes=bad)
