"""On small traced DAGs, plans over the candidate cuts are run for real (on fake tensors,
which the storage tracker counts exactly as real ones) and each measured peak must equal the
simulator's; the solvers' plan must measure no higher than any plan tried.

By default (CI) every plan with at most two cuts and a seeded sample of the others run
(``SAMPLE`` per model); ``CKPTOPT_DAG_LONG=1`` runs every plan (up to 512 per model, about a
half a minute more), so the solvers' optimum is then the brute-force optimum of measured peaks."""

import itertools
import os
import random

import pytest
import torch
import torch.nn as nn

from ckptopt import simulate, solve, zoo
from ckptopt.measure import measure_plans_fake
from ckptopt.tracer import trace
from ckptopt.solvers.limits import BRUTE_MAX_N
from ckptopt.tracer.cuts import MAX_CROSSING

from .common.models import ResNetish


class DenseNetish(nn.Module):
    """Two dense blocks (every layer's output is concatenated) and a transition."""

    def __init__(self, c=4, g=2):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.b1 = nn.ModuleList([nn.Conv2d(c + i * g, g, 3, padding=1) for i in range(2)])
        self.trans = nn.Sequential(nn.BatchNorm2d(c + 2 * g), nn.Conv2d(c + 2 * g, c, 1), nn.AvgPool2d(2))
        self.b2 = nn.ModuleList([nn.Conv2d(c + i * g, g, 3, padding=1) for i in range(1)])
        self.head = nn.Linear(c + 1 * g, 3)

    def forward(self, x):
        x = self.stem(x)
        for conv in self.b1:
            x = torch.cat([x, torch.relu(conv(x))], 1)
        x = self.trans(x)
        for conv in self.b2:
            x = torch.cat([x, torch.relu(conv(x))], 1)
        return self.head(x.mean((2, 3)))


class UNetish(nn.Module):
    """One long skip around a down/up path."""

    def __init__(self, c=4):
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.out = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 2, 1))
        self.post = nn.Sequential(nn.Tanh(), nn.Conv2d(2, 2, 1), nn.Sigmoid())

    def forward(self, x):
        a = self.inc(x)
        y = self.out(torch.cat([a, self.up(self.down(a))], 1))
        return self.post(y)


class CatOfCats(nn.Module):
    """Embeddings concatenated in two steps (RoCBert's): the first concatenation's input gradients
    are views of the second's output gradient, one storage held until the first embedding's backward."""

    def __init__(self, v=128, d=8):
        super().__init__()
        self.e = nn.ModuleList([nn.Embedding(v, d) for _ in range(3)])
        self.proj = nn.Linear(3 * d, d)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(d, 4))

    def forward(self, ids):
        a = self.e[0](ids).clone()
        c = torch.cat([a, self.e[1](ids)], -1)
        return self.head(self.proj(torch.cat([c, self.e[2](ids)], -1)).mean(1))


def tanh_chain():
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)], nn.Linear(16, 4))


def gpt_tiny():
    return zoo.get("gpt", batch_size=2, input_size=8, depth=1, width=16, heads=2, seq_len=8, vocab=32)


CASES = {
    "resnet-like": lambda: (ResNetish(c=4, blocks=2, classes=5), (torch.randn(2, 3, 8, 8),)),
    "densenet-like": lambda: (DenseNetish(), (torch.randn(2, 3, 8, 8),)),
    "unet-like": lambda: (UNetish(), (torch.randn(2, 3, 8, 8),)),
    "tanh-chain": lambda: (tanh_chain(), (torch.randn(8, 16),)),
    "cat-of-cats": lambda: (CatOfCats(), (torch.randint(0, 128, (2, 8)),)),
    "gpt": gpt_tiny,
}


LONG = os.environ.get("CKPTOPT_DAG_LONG", "") not in ("", "0")
SAMPLE = 20  # plans with three cuts or more, per model, in the default profile


@pytest.mark.parametrize("crossing", [1, MAX_CROSSING])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_plan_measured_equals_simulated(name, crossing):
    """Single-tensor cuts (every plan, or all with up to two cuts and a sample), and cuts that
    several tensors cross (docs/design.md §4: the same, over about twice the layers): every plan's
    prediction is exact, and each exact solver's plan is the lowest measured."""
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    tm = trace(model, inputs, max_crossing=crossing)
    assert 4 <= tm.n <= (10 if crossing == 1 else 22), tm.n  # small enough for brute force
    if LONG:
        plans = [c for k in range(tm.n) for c in itertools.combinations(range(1, tm.n), k)]
    else:  # every plan of up to two cuts, and a sample of the rest (drawn, not enumerated: 2^21 at 22 layers)
        plans = [c for k in range(3) for c in itertools.combinations(range(1, tm.n), k)]
        rng, cuts, rest = random.Random(name), range(1, tm.n), set()
        while len(rest) < min(SAMPLE, 2 ** (tm.n - 1) - len(plans)):
            rest.add(tuple(sorted(rng.sample(cuts, rng.randint(3, tm.n - 1)))))
        plans += sorted(rest)
    solvers = ("dp", "dp2") + (("brute",) if tm.n <= BRUTE_MAX_N else ())
    for solver in solvers:
        plans.append(solve(tm.costs, solver).checkpoints)
    plans = list(dict.fromkeys(plans))
    measured = dict(zip(plans, measure_plans_fake(model, inputs, tm, plans)))
    for cps, peak in measured.items():
        # 8 bytes: the scalar loss and its gradient, which the chain model leaves out
        # 16 bytes: the int64 copy of num_batches_tracked the BatchNorm hook keeps while a
        # segment is recomputed (8 bytes per BatchNorm being recomputed)
        gap = peak - 8 - simulate(tm.costs, cps).peak_bytes
        assert 0 <= gap <= 16, (cps, peak, simulate(tm.costs, cps))  # exact: never under, never over
    best = min(measured.values())
    for solver in solvers:
        assert measured[solve(tm.costs, solver).checkpoints] <= best + 16, solver
