"""Regenerate src/ckptopt/data/conv_chain.json, the example cost model the README uses.

A VGG-like conv chain (batch 8, 64x64, float32) whose per-layer figures follow the
measured rules of docs/design.md §3: Conv and BatchNorm save their input,
BatchNorm also 2*C*4 bytes of statistics, ReLU saves its output, MaxPool its input
and int64 indices. Transients: forward = the output (plus indices), backward = the
input gradient plus the parameter gradient. Run: python -m benchmarks.make_example_costs
"""

from pathlib import Path

from ckptopt import ChainCosts

B, S, F = 8, 64, 4
layers = []  # (name, a, p, sin, sout, m, f, b)


def add(name, a, p, sin, sout, m, f, b):
    layers.append((name, a, p, sin, sout, m, f, b))


c_in, s = 3, S
for stage, (width, convs) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3)]):
    for j in range(convs):
        a_in = B * c_in * s * s * F
        a = B * width * s * s * F
        p = (c_in * 9 * width + width) * F
        add(f"conv{stage}_{j}", a, p, 1, 0, 0, a, a_in + p)
        add(f"bn{stage}_{j}", a, 2 * width * F, 1, 0, 2 * width * F, a, a + 2 * width * F)
        add(f"relu{stage}_{j}", a, 0, 0, 1, 0, a, a)
        c_in = width
    a_in = B * c_in * s * s * F
    s //= 2
    a = B * c_in * s * s * F
    add(f"pool{stage}", a, 0, 1, 0, 2 * a, 3 * a, a_in)
feat = c_in * s * s
a = B * 10 * F
p = (feat * 10 + 10) * F
add("fc", a, p, 1, 0, 0, a, B * feat * F + p)
add("loss", 4, 0, 1, 0, 0, 4, a)

names, *cols = zip(*layers)
static = sum(cols[1]) + B * 3 * S * S * F
costs = ChainCosts(**dict(zip(("a", "p", "sin", "sout", "m", "f", "b"), cols)), static=static, names=names)
out = Path(__file__).resolve().parents[1] / "src" / "ckptopt" / "data" / "conv_chain.json"
costs.to_json(out, indent=None)
print(f"wrote {out}: n = {costs.n}")
