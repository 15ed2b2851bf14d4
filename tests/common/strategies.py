"""Hypothesis strategies for random cost models."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ckptopt import ChainCosts


@st.composite
def full_costs(draw, max_n: int = 12, max_value: int = 100):
    """A random full-form model; small value ranges so ties and zeros are common."""
    n = draw(st.integers(1, max_n))
    hi = draw(st.sampled_from([3, 20, max_value]))
    ints = st.lists(st.integers(0, hi), min_size=n, max_size=n)
    flags = st.lists(st.booleans(), min_size=n, max_size=n)
    zero_or = st.lists(st.one_of(st.just(0), st.integers(0, hi)), min_size=n, max_size=n)
    f = draw(ints)
    fs = draw(st.one_of(st.none(), st.lists(st.integers(0, hi), min_size=n, max_size=n)))
    rg = draw(st.one_of(st.none(), st.lists(st.integers(0, hi), min_size=n, max_size=n)))
    dead = draw(st.one_of(st.none(), flags))
    bk = draw(st.one_of(st.none(), ints))
    bf = draw(st.one_of(st.none(), ints))
    a = draw(ints)
    g = draw(st.one_of(st.none(), st.lists(st.integers(0, hi), min_size=n, max_size=n).map(
        lambda extra: [x + e for x, e in zip(a, extra)])))  # a view of a larger gradient
    holds = draw(st.one_of(st.none(), flags))
    p, sin, sout, m = draw(zero_or), draw(flags), draw(flags), draw(zero_or)
    b, static, c = draw(ints), draw(st.integers(0, hi)), draw(compute(n))
    br = draw(st.one_of(st.none(), ints))  # (drawn last: the earlier draws stay as they were)
    bkr = draw(st.one_of(st.none(), ints))
    ff = draw(st.one_of(st.none(), ints))
    ffs = draw(st.one_of(st.none(), ints))
    # the trigger's backward from its first read of a saved tensor on, and the most before that read
    brt, bkrt, rgp = (draw(st.one_of(st.none(), ints)) for _ in range(3))
    return ChainCosts(
        a=a, p=p, sin=sin, sout=sout, m=m, f=f, b=b, static=static, fs=fs,
        c=c, rg=rg, dead=dead, bk=bk, bf=bf, g=g, holds=holds, br=br, bkr=bkr, ff=ff, ffs=ffs,
        brt=brt, bkrt=bkrt, rgp=rgp, segment_cost=draw(segment_cost()),
    )


def compute(n: int):
    """Per-layer compute: absent (every layer costs 1), or small values with zeros so ties are common."""
    return st.one_of(st.none(), st.lists(st.integers(0, 5), min_size=n, max_size=n),
                     st.lists(st.integers(0, 1000), min_size=n, max_size=n))


def segment_cost():
    """The fixed cost of a checkpointed segment: none, or small against the compute so that it trades
    with recomputation (drawn last, so the other draws of an example do not move)."""
    return st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 400))


@st.composite
def additive_costs(draw, max_n: int = 14, max_value: int = 100):
    n = draw(st.integers(1, max_n))
    hi = draw(st.sampled_from([3, 20, max_value]))
    ints = st.lists(st.integers(0, hi), min_size=n, max_size=n)
    return ChainCosts.additive(w=draw(ints), h=draw(ints), q=draw(ints), static=draw(st.integers(0, hi)),
                               c=draw(compute(n)), segment_cost=draw(segment_cost()))


def random_additive(rng: np.random.Generator, n: int, hi: int = 1000) -> ChainCosts:
    """Seeded large additive instance; mixes scales so every regime of the deque is exercised."""
    scale = rng.choice([2, 10, hi])
    w = rng.integers(0, scale, n)
    h = rng.integers(0, scale, n)
    q = rng.integers(0, scale * rng.choice([1, 5, 50]), n)
    return ChainCosts.additive(w, h, q, static=int(rng.integers(0, 10)), c=rng.integers(0, 1000, n))


def random_full(rng: np.random.Generator, n: int, hi: int = 1000) -> ChainCosts:
    scale = int(rng.choice([3, 30, hi]))
    r = lambda: rng.integers(0, scale, n)
    return ChainCosts(
        a=r(), p=r() * rng.integers(0, 2, n), sin=rng.integers(0, 2, n), sout=rng.integers(0, 2, n),
        m=r() * rng.integers(0, 2, n), f=r(), b=r(), static=int(rng.integers(0, scale)),
        c=rng.integers(0, 1000, n), rg=r() if rng.integers(0, 2) else None,
        dead=rng.integers(0, 2, n) * rng.integers(0, 2, n) if rng.integers(0, 2) else None,
        holds=rng.integers(0, 2, n) * rng.integers(0, 2, n) if rng.integers(0, 2) else None,
    )


@st.composite
def side_tensors(draw, n: int, hi: int, max_side: int = 4, max_open: int = 3):
    """Random side tensors for a chain of ``n`` layers: producer, later consumers, savers; at most
    ``max_open`` open at any boundary (the tracer's cap)."""
    from ckptopt.costs import SideTensor

    out = []
    opened = [0] * (n + 1)
    for _ in range(draw(st.integers(0, max_side)) if n >= 2 else 0):
        p = draw(st.integers(0, n - 2))
        cons = sorted(set(draw(st.lists(st.integers(p + 1, n - 1), min_size=1, max_size=3))))
        if any(opened[b] >= max_open for b in range(p + 1, cons[-1] + 1)):
            continue
        for b in range(p + 1, cons[-1] + 1):
            opened[b] += 1
        savers = [u for u in [p] + cons if draw(st.booleans())]
        size = draw(st.integers(0, hi))
        grad = draw(st.one_of(st.none(), st.just(0), st.integers(size, size + hi)))
        view = draw(st.one_of(st.just(-1), st.sampled_from(cons))) if grad != 0 else -1
        pre = post = ()
        if savers and draw(st.booleans()):  # the savers' backward peaks before / from the release
            pre = tuple(draw(st.lists(st.integers(0, hi), min_size=len(savers), max_size=len(savers))))
            post = tuple(draw(st.lists(st.integers(0, hi), min_size=len(savers), max_size=len(savers))))
        pre_r = post_r = ()
        if pre and draw(st.booleans()):  # ... where a recomputed copy goes with the node that read it
            pre_r = tuple(draw(st.lists(st.integers(0, hi), min_size=len(savers), max_size=len(savers))))
            post_r = tuple(draw(st.lists(st.integers(0, hi), min_size=len(savers), max_size=len(savers))))
        pre_f = post_f = ()
        if pre and draw(st.booleans()):  # ... where nothing but the saver's own saves holds its input
            pre_f = tuple(draw(st.lists(st.integers(0, hi), min_size=len(savers), max_size=len(savers))))
            post_f = tuple(draw(st.lists(st.integers(0, hi), min_size=len(savers), max_size=len(savers))))
        gby = tuple(u for u in cons if draw(st.booleans())) if grad != 0 and draw(st.booleans()) else ()
        out.append(SideTensor(size, p, tuple(cons), saved_by=tuple(savers), grad=grad, grad_view=view, saved_pre=pre,
                              saved_post=post, grad_by=gby,
                              saved_pre_rec=pre_r, saved_post_rec=post_r, saved_pre_free=pre_f,
                              saved_post_free=post_f))
    return out


@st.composite
def side_costs(draw, max_n: int = 9, max_value: int = 100):
    """A random full-form model with side tensors (docs/design.md §4)."""
    base = draw(full_costs(max_n=max_n, max_value=max_value))
    hi = draw(st.sampled_from([3, 20, max_value]))
    side = draw(side_tensors(base.n, hi))
    d = base.to_dict()
    d["side"] = [t.to_dict() for t in side]
    # which layers' output gradients are views of a later layer's (a concatenation's backward)
    groot = list(range(base.n))
    for i in range(base.n - 2, -1, -1):
        if draw(st.booleans()) and draw(st.booleans()):
            groot[i] = groot[i + 1]
    d["layers"]["groot"] = groot
    d["layers"]["gh"] = draw(st.lists(st.integers(0, hi), min_size=base.n, max_size=base.n))
    if base.n > 2 and draw(st.booleans()):  # a layer that saves nothing (a concatenation): a segment starting
        i = draw(st.integers(1, base.n - 2))  # there lets its frame go in a later layer's backward
        for k in ("sin", "sout", "m", "holds"):
            if k in d["layers"]:
                d["layers"][k][i] = 0
    if draw(st.booleans()):
        d["layers"]["fpre"] = draw(st.lists(st.integers(0, hi), min_size=base.n, max_size=base.n))
        d["layers"]["fpost"] = draw(st.lists(st.integers(0, hi), min_size=base.n, max_size=base.n))
        if draw(st.booleans()):  # ... where only the frame holds the layer's input
            d["layers"]["fkpre"] = draw(st.lists(st.integers(0, hi), min_size=base.n, max_size=base.n))
            d["layers"]["fkpost"] = draw(st.lists(st.integers(0, hi), min_size=base.n, max_size=base.n))
        # a saved side tensor let go at the frame's moment: its split is the frame's (one release)
        split = [(u, t.saved_pre_rec or t.saved_pre, t.saved_post_rec or t.saved_post, q)
                 for t in side if t.saved_pre for q, u in enumerate(t.saved_by)]
        if split and draw(st.booleans()):
            u, pre, post, q = draw(st.sampled_from(split))
            for k in ("fpre", "fkpre") if "fkpre" in d["layers"] else ("fpre",):
                d["layers"][k][u] = pre[q]
            for k in ("fpost", "fkpost") if "fkpost" in d["layers"] else ("fpost",):
                d["layers"][k][u] = post[q]
    return ChainCosts.from_dict(d)
