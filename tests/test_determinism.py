"""The same model and inputs give the same plan on every run.

A plan depends only on integer byte counts (``ChainCosts`` holds int64, the
solvers do integer arithmetic), so the same costs give the same plan on any
machine; ties between equally good plans are broken by the solvers'
deterministic scan order, never by hashing or set order. Checked here:

* in one process: tracing twice gives identical costs, and solving twice
  (and from a JSON round trip) identical plans;
* across processes with different ``PYTHONHASHSEED`` values (which change
  the iteration order of sets and dicts keyed by strings): identical layer
  names, costs and plans for several zoo models and every exact solver;
* on instances made of ties (every layer identical) the plan is the same
  whichever way the costs were built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckptopt import ChainCosts, solve, zoo
from ckptopt.tracer import trace

MODELS = {
    "mlp": dict(batch_size=8, in_features=32, width=64, depth=6),
    "gpt": dict(batch_size=2, input_size=16, depth=2, width=32, heads=2, seq_len=16, vocab=64),
    "unet": dict(batch_size=2, input_size=32, base=8),
}
SOLVERS = ("dp", "dp2", "linear", "brute")

_SCRIPT = r"""
import json, sys
from ckptopt import solve, zoo
from ckptopt.tracer import trace
models, solvers = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name, kw in models.items():
    model, inputs = zoo.get(name, **kw)
    tm = trace(model, inputs)
    plans = {s: list(solve(tm.costs, s).checkpoints) for s in solvers if s != "brute" or tm.n <= 20}
    out[name] = {"names": [l.name for l in tm.layers], "costs": tm.costs.to_json(), "plans": plans}
print(json.dumps(out))
"""


def fingerprint_here() -> dict:
    out = {}
    for name, kw in MODELS.items():
        model, inputs = zoo.get(name, **kw)
        tm = trace(model, inputs)
        plans = {s: list(solve(tm.costs, s).checkpoints) for s in SOLVERS if s != "brute" or tm.n <= 20}
        out[name] = {"names": [l.name for l in tm.layers], "costs": tm.costs.to_json(), "plans": plans}
    return out


def fingerprint_in_subprocess(hash_seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(MODELS), json.dumps(SOLVERS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_same_plan_across_processes_and_hash_seeds():
    here = fingerprint_here()
    for name in MODELS:
        assert here[name]["plans"]["dp"] == here[name]["plans"]["dp2"]  # exact solvers, same tie-break
    # this process runs with whatever hash seed it got (random unless PYTHONHASHSEED is set)
    for seed in ("12345",):
        other = fingerprint_in_subprocess(seed)
        for name in MODELS:
            assert other[name]["names"] == here[name]["names"], (name, seed)
            assert other[name]["costs"] == here[name]["costs"], (name, seed)
            assert other[name]["plans"] == here[name]["plans"], (name, seed)


@pytest.mark.parametrize("name", ["mlp", "unet"])
def test_tracing_and_solving_twice_in_one_process(name):
    model, inputs = zoo.get(name, **MODELS[name])
    a, b = trace(model, inputs), trace(model, inputs)
    assert a.costs.to_json() == b.costs.to_json()
    again = ChainCosts.from_json(a.costs.to_json())
    for s in ("dp", "dp2", "linear"):
        assert solve(a.costs, s).checkpoints == solve(b.costs, s).checkpoints == solve(again, s).checkpoints


@pytest.mark.parametrize("solver", ["brute", "dp", "dp2", "linear"])
def test_ties_are_broken_the_same_way(solver):
    # 12 identical layers: many plans share the optimal peak
    n = 12
    full = ChainCosts(a=[100] * n, p=[10] * n, sin=[1] * n, sout=[0] * n, m=[0] * n, f=[100] * n, b=[110] * n,
                      static=50)
    plans = {solve(full, solver).checkpoints for _ in range(3)}
    plans.add(solve(ChainCosts.from_json(full.to_json()), solver).checkpoints)
    assert len(plans) == 1
    # built from numpy int32 arrays and numpy bools instead of Python ints: the same plan
    import numpy as np

    rebuilt = ChainCosts(a=np.full(n, 100, np.int32), p=np.full(n, 10, np.int32), sin=np.ones(n, bool),
                         sout=np.zeros(n, bool), m=np.zeros(n, np.int32), f=np.full(n, 100, np.int32),
                         b=np.full(n, 110, np.int32), static=50)
    assert solve(rebuilt, solver).checkpoints in plans
