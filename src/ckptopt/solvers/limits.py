"""Size thresholds of the solvers, in one place.

Each figure is where a solver or a pass stops being worth its time on a
2-core machine (``benchmarks/solver_scaling.py``, ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import os

__all__ = ["spare_core", "BRUTE_MAX_N", "SIDE_AUTO_MAX_WORK", "DP_ROUTINE_MAX_N", "AUTO_EXACT_MAX_N", "TIE_BREAK_MAX_WORK",
           "STORED_SIDE_MAX_WORK", "FRONT_FALLBACK_MAX_N",
           "BUDGET_SIDE_MAX_WORK", "BUDGET_SIDE_BUCKETS", "within_tie_break"]

#: ``brute`` tries all 2^(n-1) plans and refuses larger instances.
BRUTE_MAX_N = 20

#: ``trace``'s default tries the exact side-tensor program on the costs of each crossing (8, 4, 2,
#: 1 tensors per cut) and takes the first it solves within this much work (layer passes,
#: :func:`ckptopt.solvers.side_tensors.dp_side`; about 10 million a second here). With each mask
#: scored on its own, HrmText (a recurrent LM) needs 0.2 million at 2 (407 layers) and 86 million,
#: 8 s, at 4 (1,895 layers), and the diffusers UNet at 8 (346 layers) 20-40 million; with every mask
#: scored at once, as :func:`~ckptopt.solvers.side_tensors.dp_side` does, the UNet needs 3.6 million,
#: 0.3 s, and keeps 8 tensors per cut: at 4 its optimal peak is 334.6 MiB, against 200.6 MiB at 8.
SIDE_AUTO_MAX_WORK = 20_000_000
#: The CLI runs the O(n^3) ``dp`` by default only up to this size (about 0.5 s at n = 1,000).
DP_ROUTINE_MAX_N = 2_000

#: ``solver="auto"`` uses the exact O(n^2) ``dp2`` up to this size (about a second at
#: n = 15,000) and the O(n) ``linear`` beyond.
AUTO_EXACT_MAX_N = 15_000

#: Work limit (candidate points generated) of the least-recompute tie-break of dp/dp2 and of
#: the default plan's stored-segment pass (without side tensors: :data:`STORED_SIDE_MAX_WORK` with them):
#: about 0.1-0.4 s; the zoo models need a few thousand.
TIE_BREAK_MAX_WORK = 2_000_000

#: ``solver="auto"`` on a model with side tensors: work limit of the stored-segment pass, which runs where
#: the tie-break finished (a 4-layer transformers Llama of 138 layers needs 4.1 million, 0.8 s).
STORED_SIDE_MAX_WORK = 3 * TIE_BREAK_MAX_WORK

#: When the ``budget`` solver finds nothing, the smallest achievable peak it reports comes from
#: the whole Pareto front (plans with stored segments) up to this size, from ``dp2`` beyond.
FRONT_FALLBACK_MAX_N = 2_000


def within_tie_break(n: int) -> bool:
    """Whether the bounded O(n^2 F) passes run at all for ``n`` layers: beyond about 2,800
    layers their O(n^2) part alone would pass :data:`TIE_BREAK_MAX_WORK`."""
    return n * n <= 4 * TIE_BREAK_MAX_WORK


#: The ``budget`` solver on a model with side tensors: work limit of its exact Pareto program (segment
#: layers scored and points made, as ``TIE_BREAK_MAX_WORK``; 10-20 million a second here). The front
#: of a skip-heavy model can be large: a diffusers UNet of 346 layers, at a budget 22% above its lowest
#: peak, has 1,263 points at the first layer and took 251 s uncapped.
BUDGET_SIDE_MAX_WORK = 20 * TIE_BREAK_MAX_WORK

#: Past that limit, an approximate program keeps, per state, one point per 1/128 of the budget (the
#: one that recomputes least), within 8 times the work (then the lowest-peak plan). On that UNet: 7 s,
#: 1.4% more recomputation than the exact front's plan (256 buckets: 8 s, 0.003%).
BUDGET_SIDE_BUCKETS = 128


def spare_core() -> bool:
    """Whether a compiled program (they release the GIL) can run in a thread beside other work: more than
    one core. Where it cannot, the programs run one after the other, to the same answers."""
    return (os.cpu_count() or 1) > 1
