"""Least recomputation: the tie-break among lowest-peak plans, and the budget solver.

A plan's *recomputation* is the forward compute its checkpointed segments run
again in backward (:attr:`ChainCosts.c` summed over
:func:`~ckptopt.simulate.recomputed_layers`). Two questions use it:

* among the plans with the lowest peak, which recomputes least (the
  lexicographic objective of ``dp``, ``dp2``, ``linear`` and ``brute``);
* under a memory budget ``B``, which plan recomputes least (``budget``).

Both are answered by :func:`ckptopt._kernels.pareto_plans`, an exact dynamic
program over Pareto fronts of (peak, recomputation) pairs, with a cap on the
peak; ``linear`` uses an O(n log n) special case of the additive form.
"""

from __future__ import annotations

import numpy as np

from .. import _kernels
from ..costs import ChainCosts

__all__ = ["compute_prefix", "plan_recompute", "pareto_front", "least_recompute", "linear_least_recompute"]


def compute_prefix(costs: ChainCosts) -> np.ndarray:
    """Prefix sums of the per-layer compute (length n+1)."""
    return np.concatenate([[0], np.cumsum(costs.c)]).astype(np.int64)


def plan_recompute(costs: ChainCosts, checkpoints: tuple[int, ...]) -> int:
    """Recomputation of a (validated) plan, in the unit of ``costs.c``."""
    starts = np.array((0,) + tuple(checkpoints), dtype=np.int64)
    return int(_kernels.plan_recompute(starts, costs.n, not costs.is_additive, costs.kernel_arrays,
                                       compute_prefix(costs)))


def pareto_front(costs: ChainCosts, max_peak: int | None = None) -> list[tuple[int, int, tuple[int, ...]]]:
    """Every plan that is Pareto-optimal in (peak, recomputation).

    Parameters
    ----------
    costs : ChainCosts
    max_peak : int, optional
        Keep only plans whose peak (static bytes included) is at most this.

    Returns
    -------
    list of (peak_bytes, recompute, checkpoints)
        Sorted by peak ascending; recomputation strictly decreases along the
        list. The first entry is the lowest-peak plan that recomputes least;
        the last (with no cap) is no checkpointing.

    Notes
    -----
    Exact (see :func:`ckptopt._kernels.pareto_plans`); time O(n^2 F) with F
    the front size, which a cap near the optimum keeps small.
    """
    cap = _kernels.BIG if max_peak is None else int(max_peak) - costs.static
    if cap < 0:
        return []
    peaks, recs, flat, offsets = _kernels.pareto_plans(
        costs.n, not costs.is_additive, costs.kernel_arrays, compute_prefix(costs), cap
    )
    return [
        (int(p) + costs.static, int(r), tuple(int(x) for x in flat[offsets[k]:offsets[k + 1]]))
        for k, (p, r) in enumerate(zip(peaks, recs))
    ]


def least_recompute(costs: ChainCosts, max_peak: int) -> tuple[int, ...] | None:
    """The plan with the least recomputation whose peak is at most ``max_peak``; None if none."""
    front = pareto_front(costs, max_peak)
    return front[-1][2] if front else None


def linear_least_recompute(costs: ChainCosts, max_peak: int) -> tuple[int, ...] | None:
    """The plan within ``max_peak`` whose last segment starts earliest, O(n log n).

    For the additive form every non-last segment is re-run whole, so that is
    the least recomputation exactly. A full model is taken through its
    additive approximation (:meth:`ChainCosts.additive_form`), as ``linear``
    does; the simulator scores the result with the full model.
    """
    w, h, q = costs.additive_form()
    P = np.concatenate([[0], np.cumsum(h)]).astype(np.int64)
    L, plan = _kernels.linear_least_recompute(
        costs.n, P, np.ascontiguousarray(q, dtype=np.int64), np.ascontiguousarray(w, dtype=np.int64),
        int(max_peak) - costs.static,
    )
    if L < 0:
        return None
    return tuple(int(x) for x in plan)
