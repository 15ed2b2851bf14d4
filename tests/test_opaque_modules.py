"""Submodules whose forward reads a tensor's value run as one op, measured by running them
(ckptopt.tracer.capture.opaque): the model plans, trains exactly as the unmodified one, and each
plan's predicted peak is its measured one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from ckptopt import apply_plan, optimize_checkpoints, trace
from ckptopt.errors import TraceError
from ckptopt.measure import measure_peak

D = 32


class Gate(nn.Module):
    """Branches on its activations (IBert's NaN check, an MoE router reading counts)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2 * D)
        self.back = nn.Linear(2 * D, D)
        self.spare = nn.Linear(2 * D, 2 * D)  # (the branch the example does not take: no gradient)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        if h.sum() > 0:
            h = h * 2
        else:
            h = self.spare(h)
        return self.back(torch.tanh(h)), h.mean(dim=-1)


class LayerDrop(nn.Module):
    """Skips each layer on a random draw (M2M100's encoder loop)."""

    def __init__(self, n: int = 3, p: float = 0.3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(n))
        self.p = p

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.p:
                continue
            x = x + torch.sigmoid(layer(x)) * x
        return x


class Counted(nn.Module):
    """Returns a Python value it read from a tensor: cannot be one op; its parent goes instead."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        return y, int((y > 0).sum())


class Uses(nn.Module):
    def __init__(self):
        super().__init__()
        self.counted = Counted()
        self.post = nn.Linear(D, D)

    def forward(self, x):
        y, k = self.counted(x)
        return self.post(y) * (1.0 if k > 0 else 0.5)


class Net(nn.Module):
    def __init__(self, with_counted: bool = False, p: float = 0.3):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.gate = Gate()
        self.mid = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.drop = LayerDrop(p=p)
        self.uses = Uses() if with_counted else nn.Identity()
        self.last = Gate()  # (late in the forward: its gradients exist while most of the backward runs)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h, aux = self.gate(torch.tanh(self.inp(x)))
        h = self.mid(h) + aux.unsqueeze(-1)
        h, _ = self.last(self.uses(self.drop(h)))
        return self.out(h)


def _step(model, x, seed):
    torch.manual_seed(seed)
    loss = model(x).pow(2).mean()
    loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]  # (a dropped layer: None)
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def _plans(n: int):
    yield ()
    yield tuple(range(1, n))
    yield tuple(range(1, n, 2))
    yield (n // 2,)


@pytest.mark.parametrize("with_counted", [False, True])
def test_a_submodule_that_reads_a_value_runs_as_one_op_exactly(with_counted):
    torch.manual_seed(0)
    model = Net(with_counted).train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16, D)
    traced = trace(model, x, capture="export")
    notes = " ".join(traced.capture.notes)
    assert "run as one op each" in notes and "gate" in notes and "drop" in notes
    assert {"gate", "drop", "last"} <= set(traced.opaque_modules)
    assert "draw random numbers" in notes and "drop" in notes.split("draw random numbers")[0].rsplit(";", 1)[-1]
    if with_counted:
        assert "uses" in notes and "uses.counted" not in notes  # the parent, as the child returns an int
    for plan_cps in _plans(traced.costs.n):
        from ckptopt.measure import _as_plan

        plan = _as_plan(traced, plan_cps)
        module = apply_plan(model, traced, plan)
        for seed in (1, 2):
            want_loss, want = _step(reference, x, seed)
            got_loss, got = _step(module, x, seed)
            assert torch.equal(want_loss, got_loss), plan_cps
            assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                       for a, b in zip(want, got)), plan_cps
        module.remove_hooks()


def test_the_predicted_peak_of_every_plan_is_measured():
    torch.manual_seed(0)
    model = Net(p=1e-9).train()  # (still a branch on a draw; no layer dropped in any step)
    x = torch.randn(4, 16, D)
    torch.manual_seed(5)
    traced = trace(model, x, capture="export")
    from ckptopt.measure import _as_plan
    from ckptopt.simulator import simulate

    for plan_cps in _plans(traced.costs.n):
        plan = _as_plan(traced, plan_cps)
        predicted = simulate(traced.costs, plan_cps).peak_bytes
        measured = measure_peak(apply_plan(model, traced, plan), x)
        assert 0 <= measured - predicted <= 8, (plan_cps, measured, predicted)  # (the loss scalar, as elsewhere)


def test_a_model_without_values_keeps_the_first_error():
    with torch.device("meta"):
        model = Net().train()
    with pytest.raises(TraceError, match="reads a tensor's value|value read from a tensor|data-dependent"):
        trace(model, torch.randn(4, 16, D, device="meta"), capture="export")


class Router(nn.Module):
    """Counts the rows each expert gets with ``.tolist()`` (JetMoe's router): export captures it, and
    the graph then reads values that measuring on fake tensors cannot."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.lin = nn.Linear(D, n)
        self.n = n

    def forward(self, x):
        logits = self.lin(x)
        idx = logits.argmax(-1).flatten()
        return logits.softmax(-1), idx, torch.bincount(idx, minlength=self.n).tolist()


class Experts(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.router = Router(n)
        self.w = nn.ModuleList(nn.Linear(D, D) for _ in range(n))

    def forward(self, x):
        p, idx, counts = self.router(x)
        flat = x.reshape(-1, D)
        order = idx.argsort()
        parts = flat[order].split(counts)
        out = torch.cat([w(part) for w, part in zip(self.w, parts)])
        weight = p.reshape(-1, p.shape[-1]).gather(1, idx[:, None])[order]
        return torch.empty_like(out).index_copy(0, order, out * weight).reshape_as(x)


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = Experts()
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(torch.tanh(self.moe(torch.relu(self.inp(x)))))


@pytest.mark.parametrize("capture", ["auto", "export"])  # (auto: FX keeps `moe` as a leaf it cannot measure)
def test_a_captured_graph_that_reads_a_value_runs_its_submodule_as_one_op(capture):
    torch.manual_seed(0)
    model = MoENet().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16, D)
    opt = optimize_checkpoints(model, x, capture=capture)
    assert "moe" in opt.explain() and "run as one op each" in opt.explain()
    want_loss, want = _step(reference, x, 3)
    got_loss, got = _step(opt, x, 3)
    assert torch.equal(want_loss, got_loss)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(want, got))
    assert 0 <= measure_peak(opt, x) - opt.predicted_peak_bytes <= 8


def test_a_submodule_run_as_one_op_costs_the_compute_it_ran():
    from ckptopt.tracer.flops import count_flops

    torch.manual_seed(0)
    model = Net(p=1e-9).train()
    x = torch.randn(4, 16, D)
    traced = trace(model, x, capture="export")
    compute = dict(zip(traced.costs.names, traced.costs.to_dict()["compute"]))
    with torch.enable_grad():
        h = torch.tanh(model.inp(x)).detach().requires_grad_()
        want = count_flops(lambda: model.gate(h))
    assert want > 0 and compute["gate"] == want


class NormedGate(nn.Module):
    """A BatchNorm inside a submodule that reads a value: recomputed, it must not count the batch twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x):
        h = self.norm(self.lin(x))
        return h * 2 if h.sum() > 0 else h


def test_running_statistics_inside_a_submodule_run_as_one_op_update_once_under_checkpointing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), NormedGate(), nn.Tanh(), NormedGate(), nn.Linear(D, D)).train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16, D)
    traced = trace(model, x, capture="export")
    from ckptopt.measure import _as_plan

    module = apply_plan(model, traced, _as_plan(traced, tuple(range(1, traced.costs.n))))
    for seed in (1, 2):
        want_loss, want = _step(reference, x, seed)
        got_loss, got = _step(module, x, seed)
        assert torch.equal(want_loss, got_loss) and all(torch.equal(a, b) for a, b in zip(want, got))
    for a, b in zip(reference.buffers(), model.buffers()):
        assert torch.equal(a, b)
