"""Baselines: no checkpointing, every layer, Chen's sqrt(n), Chen's greedy, uniform K."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..costs import ChainCosts
from ..errors import UnknownSolver
from ..simulator import simulate
from ..simulator.kernels import simulate_plan

__all__ = ["none", "every", "sqrt", "uniform", "chen_greedy"]


def none(costs: ChainCosts) -> tuple[int, ...]:
    """No checkpointing: one unwrapped segment."""
    return ()


def every(costs: ChainCosts) -> tuple[int, ...]:
    """Every layer its own segment (checkpoint every layer's input)."""
    return tuple(range(1, costs.n))


def uniform(costs: ChainCosts, k: int) -> tuple[int, ...]:
    """``k`` segments split by layer count exactly as ``torch.utils.checkpoint.checkpoint_sequential``
    splits a model: ``n // k`` layers each, the remainder going to the last segment
    (``k`` is capped at ``n``)."""
    n = costs.n
    k = max(1, min(int(k), n))
    size = n // k
    return tuple(j * size for j in range(1, k))


def sqrt(costs: ChainCosts) -> tuple[int, ...]:
    """Chen et al. (2016), section 3: ``ceil(sqrt(n))`` segments, split by layer count as :func:`uniform`."""
    return uniform(costs, math.ceil(math.sqrt(costs.n)))


def chen_greedy(costs: ChainCosts, ntrial: int = 6) -> tuple[int, ...]:
    """Chen et al. (2016), Algorithm 3 ("memory planning with budget") with its budget sweep.

    One pass walks the layers accumulating output sizes and makes a layer's
    output a checkpoint once the running total exceeds the budget ``B``. The
    budget is then searched as the authors' reference implementation
    (MXNet memonger, ``search_plan``) does: three guesses, starting from
    ``B = 0`` and then ``B = sqrt(x * y / 2)`` from the previous pass's saved
    total ``x`` and largest segment ``y``; then ``ntrial`` evenly spaced
    budgets from the smallest ``y`` seen to ``sqrt(2)`` times the last guess.
    Of all the plans tried, the one with the lowest true peak (the
    simulator's, standing in for memonger's executor cost) is returned;
    ties go to the plan found first.

    The sizes are the layers' output bytes ``a`` (the full form) or the
    checkpoint costs ``w`` shifted to the layer that produces them (the
    additive form: ``size[i] = w[i+1]``, ``size[n-1] = h[n-1]``).
    """
    sizes = _sizes(costs)
    full = not costs.is_additive
    K = costs.kernel_arrays
    n = costs.n
    tried: list[tuple[int, tuple[int, ...]]] = []

    def attempt(threshold: int) -> tuple[int, int]:
        starts, saved, biggest = chen_greedy_pass(sizes, int(threshold))
        plan = tuple(int(x) for x in starts)
        starts = np.array((0,) + plan, dtype=np.int64)
        if costs.has_side:
            peak = simulate(costs, plan).peak_bytes
        else:
            peak = simulate_plan(starts, np.zeros_like(starts), n, full, K)[0]
        tried.append((int(peak), plan))
        return int(saved), int(biggest)

    threshold = 0
    min_threshold = None
    for _ in range(3):
        saved, biggest = attempt(threshold)
        guess = int(math.sqrt(saved * biggest / 2))
        if min_threshold is None or biggest < min_threshold:
            min_threshold = biggest
        threshold = guess
    max_threshold = threshold * math.sqrt(2)
    step = int((max_threshold - min_threshold) / ntrial)
    if step > 0:
        threshold = min_threshold + step
        for _ in range(ntrial):
            attempt(threshold)
            threshold += step
    best_peak = min(p for p, _ in tried)
    return next(plan for p, plan in tried if p == best_peak)


def _sizes(costs: ChainCosts) -> np.ndarray:
    if costs.is_additive:
        w, h = costs.w, costs.h
        return np.concatenate([w[1:], h[-1:]]).astype(np.int64)
    return np.ascontiguousarray(costs.a, dtype=np.int64)


def parse_uniform_arg(arg: str | None) -> int:
    if arg is None:
        raise UnknownSolver("solver 'uniform' needs a segment count, e.g. 'uniform:4'")
    try:
        k = int(arg)
    except ValueError:
        raise UnknownSolver(f"solver 'uniform:{arg}': the segment count must be an integer, e.g. 'uniform:4'") from None
    if k < 1:
        raise UnknownSolver(f"solver 'uniform:{arg}': the segment count must be at least 1")
    return k


@njit(cache=True)
def chen_greedy_pass(sizes, threshold):
    """Chen et al. (2016) Algorithm 3 for one budget ``threshold``.

    Walks the layers in order accumulating output sizes; when the running
    total exceeds the threshold the layer's output becomes a checkpoint (the
    next segment starts after it). Returns (segment starts, saved x, max local y).
    """
    n = sizes.shape[0]
    out = np.empty(n, dtype=np.int64)
    m = 0
    local = 0
    saved = 0
    biggest = 0
    for i in range(n):
        local += sizes[i]
        if local > threshold and i < n - 1:
            saved += sizes[i]
            if local > biggest:
                biggest = local
            local = 0
            out[m] = i + 1
            m += 1
    if local > biggest:
        biggest = local
    return out[:m], saved, biggest


def warmup(K, cpre) -> None:
    """Compile this module's kernel on a tiny instance."""
    chen_greedy_pass(np.ones(3, dtype=np.int64), 1)
