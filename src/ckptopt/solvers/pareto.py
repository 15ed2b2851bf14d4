"""The Pareto program: every (peak, recomputation) trade-off, and the least recomputation.

A plan's *recomputation* is the forward compute its checkpointed segments run
again in backward (:attr:`ChainCosts.c` summed over
:func:`~ckptopt.simulator.recomputed_layers`). Two questions use it:

* among the plans with the lowest peak, which recomputes least (the
  lexicographic objective of ``dp``, ``dp2`` and ``brute``);
* under a memory budget ``B``, which plan recomputes least (the ``budget``
  solver, :func:`ckptopt.solvers.policy.budget`).

Both are answered by :func:`pareto_plans`, an exact dynamic program over Pareto
fronts of (peak, recomputation) pairs, with a cap on the peak; ``linear`` uses an
O(n log n) special case of the additive form (:mod:`ckptopt.solvers.linear`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..costs import ChainCosts
from ..simulator.kernels import BIG, held_checkpoint
from .fronts import add_point, add_suffix_points, front_plans, grow_points, keep_front, points
from .rows import segment_row, segment_row_buffers, with_live_in

__all__ = ["FrontPoint", "pareto_front", "least_recompute", "merge_unwrapped", "FrontTooLarge"]


class FrontPoint(NamedTuple):
    """One point of the (peak, recomputation) trade-off curve, with its plan."""

    peak_bytes: int
    recompute: int
    checkpoints: tuple[int, ...]
    stored: tuple[int, ...]


class FrontTooLarge(Exception):
    """The Pareto program passed its work limit (internal; callers fall back)."""


def pareto_front(
    costs: ChainCosts, max_peak: int | None = None, allow_stored: bool = True, max_work: int = 0, grain: int = 0,
    stop=None,
) -> list[FrontPoint]:
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
    grain : int
        Internal, with side tensors only (ignored otherwise): > 0 gives an
        approximate front of bounded size, each state of the program keeping
        one point per ``grain`` bytes of peak (the one that recomputes least;
        :func:`ckptopt.solvers.side_tensors.pareto_side`). Its plans and figures are
        real; a plan with less recomputation may be missing.
    stop : numpy array, optional
        Internal, with side tensors only: a one-element array another thread sets to 1 to
        end the program as past ``max_work``.

    Returns
    -------
    list of FrontPoint
        ``(peak_bytes, recompute, checkpoints, stored)``, sorted by peak ascending;
        recomputation strictly decreases along the list. ``stored`` lists the start layers of
        the unwrapped segments
        (see :func:`ckptopt.simulate`). The first entry is the lowest-peak
        plan that recomputes least; the last recomputes nothing.

    Notes
    -----
    Exact (see :func:`pareto_plans`); time O(n^2 F) with F
    the front size, which a cap near the optimum keeps small.
    """
    cap = BIG if max_peak is None else int(max_peak) - costs.static
    if cap < 0:
        return []
    if costs.has_side:  # over (layer, flag, held side tensors) states (ckptopt.solvers.side_tensors)
        from .side_tensors import front

        peaks, recs, flat, offsets, sflat, soffsets, complete = front(costs, cap, allow_stored, max_work, grain, stop)
    else:
        peaks, recs, flat, offsets, sflat, soffsets, complete = pareto_plans(
            costs.n, not costs.is_additive, costs.kernel_arrays, costs.compute_prefix, cap,
            bool(allow_stored) and not costs.is_additive, int(max_work),
        )
    if not complete:
        raise FrontTooLarge(f"more than {max_work} candidate points")
    out = []
    for k, (p, r) in enumerate(zip(peaks, recs)):
        plan = tuple(int(x) for x in flat[offsets[k]:offsets[k + 1]])
        stored = tuple(int(x) for x in sflat[soffsets[k]:soffsets[k + 1]])
        out.append(FrontPoint(int(p) + costs.static, int(r), *merge_unwrapped(plan, stored)))
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
    costs: ChainCosts, max_peak: int, allow_stored: bool = True, max_work: int = 0, grain: int = 0
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(checkpoints, stored)`` of the plan with the least recomputation whose peak is at most
    ``max_peak`` (the lowest such peak among ties); None if no plan fits (``grain``: see
    :func:`pareto_front`)."""
    front = pareto_front(costs, max_peak, allow_stored, max_work, grain)
    return (front[-1].checkpoints, front[-1].stored) if front else None


# --------------------------------------------------------------------------
# compiled engine
# --------------------------------------------------------------------------
@njit(cache=True)
def min_held_prefix(n, full, K, Cpre, cap, allow_stored):
    """``Hmin[2*l + flag]``: the least bytes held before layer ``l`` over the
    plans whose segments before ``l`` all stay within ``cap`` (BIG when none);
    ``flag`` = 1 when the segment before ``l`` is stored and keeps ``x_{l-1}``.

    A lower bound on what any plan within ``cap`` holds there: a smaller held
    amount admits every continuation a larger one admits, so the minimum over
    predecessors is exact for reachability. O(n^2).
    """
    Hmin = np.full(2 * n + 2, BIG, dtype=np.int64)
    Hmin[0] = 0
    row = segment_row_buffers(n)
    Dc0, Dc1, Ds0, Ds1, hold = row.Dc0, row.Dc1, row.Ds0, row.Ds1, row.hold
    for l in range(n - 1):
        if Hmin[2 * l] >= BIG and Hmin[2 * l + 1] >= BIG:
            continue
        segment_row(l, n, full, K, Cpre, row)
        hu = held_checkpoint(l, l, True, full, K)
        for flag in range(2):
            H = Hmin[2 * l + flag]
            if H >= BIG:
                continue
            for r in range(l, n - 1):
                c = 0 if flag else hold[r]
                if H + c + with_live_in(l, c, flag, Dc1[r] if flag else Dc0[r], K, False) <= cap and H + c < Hmin[2 * (r + 1)]:
                    Hmin[2 * (r + 1)] = H + c
                if allow_stored:
                    c = 0 if flag else hu
                    if H + c + with_live_in(l, c, flag, Ds1[r] if flag else Ds0[r], K, True) <= cap:
                        h2 = H + c + K.P[r] - K.P[l] + K.keep[r]
                        s2 = 2 * (r + 1) + (1 if K.sout[r] != 0 else 0)
                        if h2 < Hmin[s2]:
                            Hmin[s2] = h2
    return Hmin


@njit(cache=True)
def pareto_plans(n, full, K, Cpre, cap, allow_stored, max_work):
    """Every plan that is Pareto-optimal in (peak, recomputation) with peak <= cap.

    ``F(l, flag)``: the Pareto front of the suffix plans from layer ``l`` (a
    segment starting at ``l``; ``flag`` = 1 when the previous segment is stored
    and keeps ``l``'s input), as ``(relative peak, recompute)`` pairs sorted by
    peak ascending and recomputation strictly descending. With ``c`` the
    segment's hold (0 when ``flag``), ``D`` its peak and ``S`` what a stored
    segment keeps::

        checkpointed [l, r]: (c + max(Dc, p'),     rec(l, r) + R')  for (p', R') in F(r+1, 0)
        stored [l, r]:       (c + max(Ds, S + p'), R')              for (p', R') in F(r+1, sout[r])
        last [l, n-1]:       (c + Ds, 0)

    with ``Dc``, ``Ds`` the rows of :func:`~ckptopt.solvers.rows.segment_row` for ``flag``
    (whether the previous segment keeps the first layer's input decides its backward term).

    A suffix enters only through ``max`` and ``+``, both monotone, so a
    dominated suffix never helps: the recurrence is exact. For a fixed ``r``
    the suffix points below ``D`` give the same peak, so only the last of them
    (least recomputation) is a candidate. Points whose peak, added to the
    least bytes any plan within ``cap`` holds before ``l``
    (:func:`min_held_prefix`), exceed ``cap`` are dropped.

    Returns ``(peaks, recomputes, plans_flat, plan_offsets, stored_flat,
    stored_offsets, complete)`` for the front at layer 0 (peaks relative to
    the static bytes): plan ``k``'s segment starts after 0 and the starts of
    its stored segments. Time O(n^2 F), F the front size. With ``max_work >
    0`` the program stops once it has generated that many candidate points
    and returns ``complete = False`` with an empty front.
    """
    Hmin = min_held_prefix(n, full, K, Cpre, cap, allow_stored)
    row = segment_row_buffers(n)
    Dc0, Dc1, Ds0, Ds1, hold, rec = row.Dc0, row.Dc1, row.Ds0, row.Ds1, row.hold, row.rec
    pool = points(1024)  # every state's front (fronts.py)
    used = 0
    first = np.zeros(2 * n + 2, dtype=np.int64)
    count = np.zeros(2 * n + 2, dtype=np.int64)
    cand = points(64)  # the candidates of one state
    work = 0
    for l in range(n - 1, -1, -1):
        row_done = False
        hu = held_checkpoint(l, l, True, full, K)
        for flag in range(2):
            st = 2 * l + flag
            first[st] = used
            if Hmin[st] >= BIG:
                continue
            if not row_done:
                segment_row(l, n, full, K, Cpre, row)
                row_done = True
            work += n - l
            limit = cap - Hmin[st]
            m = 0
            for r in range(l, n):
                if r == n - 1:
                    c = 0 if flag else hu
                    d = with_live_in(l, c, flag, Ds1[r] if flag else Ds0[r], K, True)
                    if c + d <= limit:
                        cand = grow_points(cand, m + 2)
                        add_point(cand, m, c + d, 0, r, -1, 2)
                        m += 1
                    continue
                for kind in range(2):
                    if kind == 1 and not allow_stored:
                        break
                    if kind == 0:
                        c = 0 if flag else hold[r]
                        d = with_live_in(l, c, flag, Dc1[r] if flag else Dc0[r], K, False)
                        extra = 0
                        rc = rec[r]
                        nxt = 2 * (r + 1)
                    else:
                        c = 0 if flag else hu
                        d = with_live_in(l, c, flag, Ds1[r] if flag else Ds0[r], K, True)
                        extra = K.P[r] - K.P[l] + K.keep[r]
                        rc = 0
                        nxt = 2 * (r + 1) + (1 if K.sout[r] != 0 else 0)
                    if c + d > limit:
                        continue
                    work += 1
                    cand, m = add_suffix_points(cand, m, pool, first[nxt], count[nxt], c, d, extra, rc, r, kind, limit)
                    if max_work > 0 and work + m > max_work:
                        e = np.empty(0, dtype=np.int64)
                        return e, e, e, np.zeros(1, dtype=np.int64), e, np.zeros(1, dtype=np.int64), False
            if m == 0:
                continue
            work += m
            pool, used = keep_front(cand, m, pool, used)
            count[st] = used - first[st]
    peaks, recs, flat, offsets, sflat, soffsets = front_plans(pool, first[0], count[0], n)
    return peaks, recs, flat, offsets, sflat, soffsets, True


def warmup(K, cpre) -> None:
    """Compile this module's kernels on a tiny instance."""
    n = K.a.shape[0]
    for full in (True, False):
        for allow in (True, False):
            pareto_plans(n, full, K, cpre, BIG, allow, 0)
