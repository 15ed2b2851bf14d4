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
    TraceError,
    UnknownSolver,
)
from .plan import Plan
from .simulator import SimResult, simulate
from .solvers import SOLVERS, solve

__version__ = "0.1.0"

# torch-facing names, imported on first use so that `import ckptopt` (and the
# solvers) never import torch.
_LAZY = {
    "measure_peak": "ckptopt.measure",
    "measure_peak_detailed": "ckptopt.measure",
    "measure_layer": "ckptopt.tracer",
    "StorageTracker": "ckptopt.tracker",
    "zoo": "ckptopt.zoo",
    "trace": "ckptopt.tracer",
    "optimize_checkpoints": "ckptopt.api",
    "apply_plan": "ckptopt.rewriter",
    "CheckpointedModule": "ckptopt.rewriter",
    "detach": "ckptopt.inplace",
    "TracedModel": "ckptopt.tracer",
    "estimate": "ckptopt.planning",
    "max_batch": "ckptopt.planning",
    "plan_training": "ckptopt.planning",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        value = module if module.__name__.endswith("." + name) else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptopt' has no attribute {name!r}")

__all__ = [
    "optimize_checkpoints",
    "apply_plan",
    "CheckpointedModule",
    "detach",
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
    "TraceError",
    "trace",
    "TracedModel",
    "measure_peak",
    "StorageTracker",
    "zoo",
    "estimate",
    "max_batch",
    "plan_training",
]
