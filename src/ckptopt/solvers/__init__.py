"""The solver stage: cost model in, plan out. No module here imports torch.

* :mod:`~ckptopt.solvers.registry`: :data:`SOLVERS`, :func:`solve` (the one entry point);
* :mod:`~ckptopt.solvers.policy`: the ``auto`` policy (what ckptopt picks by default);
* engines, each a compiled kernel next to its wrapper: :mod:`~ckptopt.solvers.exact`
  (brute force, O(n^3), O(n^2)), :mod:`~ckptopt.solvers.linear` (O(n)),
  :mod:`~ckptopt.solvers.pareto` (least recomputation, budgets, the trade-off curve),
  :mod:`~ckptopt.solvers.baselines`;
* :mod:`~ckptopt.solvers.limits`: the size thresholds.
"""

from __future__ import annotations

from ..plan import Plan
from .pareto import FrontPoint, pareto_front
from .policy import improve_with_stored
from .registry import SOLVERS, SolverInfo, solve, solver_names

__all__ = ["Plan", "SolverInfo", "SOLVERS", "solve", "solver_names", "pareto_front", "FrontPoint",
           "improve_with_stored"]
