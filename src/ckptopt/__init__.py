"""ckptopt: the checkpoint subset with the lowest peak training memory.

Public surface: the cost model (:class:`ChainCosts`), the simulator
(:func:`simulate`), the solvers (:func:`solve`, :data:`SOLVERS`, :class:`Plan`)
and the errors. The torch-facing parts are imported lazily so that the
solvers and the simulator work (and test) without importing torch.
"""

from __future__ import annotations

from .costs import ChainCosts
from .errors import (
    CkptoptError,
    InfeasibleBudget,
    InvalidCosts,
    InvalidPlan,
    ProblemTooLarge,
    UnknownSolver,
)
from .simulate import SimResult, simulate
from .solvers import SOLVERS, Plan, solve

__version__ = "0.1.0"

__all__ = [
    "ChainCosts",
    "simulate",
    "SimResult",
    "solve",
    "SOLVERS",
    "Plan",
    "CkptoptError",
    "InvalidCosts",
    "InvalidPlan",
    "InfeasibleBudget",
    "ProblemTooLarge",
    "UnknownSolver",
]
