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
    """Prefix sums of the per-layer compute (length n+1): :attr:`ChainCosts.compute_prefix`."""
    return costs.compute_prefix


def plan_recompute(costs: ChainCosts, checkpoints: tuple[int, ...], stored: tuple[int, ...] = ()) -> int:
    """Recomputation of a (validated) plan, in the unit of ``costs.c``."""
    starts = np.array((0,) + tuple(checkpoints), dtype=np.int64)
    flags = np.array([1 if s in set(stored) else 0 for s in starts], dtype=np.int64)
    return int(_kernels.plan_recompute(starts, flags, costs.n, not costs.is_additive, costs.kernel_arrays,
                                       compute_prefix(costs)))


# Work limit of the tie-break pass of dp/dp2 (candidate points generated): about 0.1-0.4 s
# on this 2-core machine; the zoo models need a few thousand.
TIE_BREAK_MAX_WORK = 2_000_000


class FrontTooLarge(Exception):
    """The Pareto program passed its work limit (internal; callers fall back)."""


def pareto_front(
    costs: ChainCosts, max_peak: int | None = None, allow_stored: bool = True, max_work: int = 0
) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """Every plan that is Pareto-optimal in (peak, recomputation).

    Parameters
    ----------
    costs : ChainCosts
    max_peak : int, optional
        Keep only plans whose peak (static bytes included) is at most this.
    max_work : int
        Internal: stop (raising ``FrontTooLarge``) after generating this many
        candidate points; 0 for no limit.
    allow_stored : bool
        Let segments other than the last be left unwrapped ("stored": they
        keep what they save and re-run nothing, as rotor's forward-all step).
        With False, every segment but the last is checkpointed, the plans
        of ``dp``, ``dp2`` and ``linear``. Ignored for the additive form,
        which does not say what a layer keeps of what it produces.

    Returns
    -------
    list of (peak_bytes, recompute, checkpoints, stored)
        Sorted by peak ascending; recomputation strictly decreases along the
        list. ``stored`` lists the start layers of the unwrapped segments
        (see :func:`ckptopt.simulate`). The first entry is the lowest-peak
        plan that recomputes least; the last recomputes nothing.

    Notes
    -----
    Exact (see :func:`ckptopt._kernels.pareto_plans`); time O(n^2 F) with F
    the front size, which a cap near the optimum keeps small.
    """
    cap = _kernels.BIG if max_peak is None else int(max_peak) - costs.static
    if cap < 0:
        return []
    peaks, recs, flat, offsets, sflat, soffsets, complete = _kernels.pareto_plans(
        costs.n, not costs.is_additive, costs.kernel_arrays, compute_prefix(costs), cap,
        bool(allow_stored) and not costs.is_additive, int(max_work),
    )
    if not complete:
        raise FrontTooLarge(f"more than {max_work} candidate points")
    out = []
    for k, (p, r) in enumerate(zip(peaks, recs)):
        plan = tuple(int(x) for x in flat[offsets[k]:offsets[k + 1]])
        stored = tuple(int(x) for x in sflat[soffsets[k]:soffsets[k + 1]])
        out.append((int(p) + costs.static, int(r)) + merge_unwrapped(plan, stored))
    return out


def merge_unwrapped(checkpoints: tuple[int, ...], stored: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop the boundaries between consecutive unwrapped segments (stored or last).

    Two adjacent unwrapped segments keep exactly what one segment spanning
    both keeps (each layer's saved tensors, the boundary tensor once), so
    the merged plan has the same peak and recomputation (the tests check it
    with the simulator) and fewer segments.
    """
    starts = (0,) + tuple(checkpoints)
    kept = set(stored)
    unwrapped = [s in kept or k == len(starts) - 1 for k, s in enumerate(starts)]
    new_starts = [starts[0]]
    new_unwrapped = [unwrapped[0]]
    for s, u in zip(starts[1:], unwrapped[1:]):
        if u and new_unwrapped[-1]:
            continue  # merge into the previous unwrapped segment
        new_starts.append(s)
        new_unwrapped.append(u)
    last = len(new_starts) - 1
    return (tuple(new_starts[1:]),
            tuple(s for k, (s, u) in enumerate(zip(new_starts, new_unwrapped)) if u and k != last))


def least_recompute(
    costs: ChainCosts, max_peak: int, allow_stored: bool = True, max_work: int = 0
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(checkpoints, stored)`` of the plan with the least recomputation whose peak is at most
    ``max_peak`` (the lowest such peak among ties); None if no plan fits."""
    front = pareto_front(costs, max_peak, allow_stored, max_work)
    return front[-1][2:] if front else None


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
