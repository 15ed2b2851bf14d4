"""Exceptions raised by ckptopt.

Each class means one thing and carries the data a caller needs to act on it
(the field and index of a bad cost, the smallest achievable peak of an
infeasible budget). Every class derives from a built-in exception as well, so
callers that do not know ckptopt can still catch ``ValueError``.
"""

from __future__ import annotations

from .units import format_bytes

__all__ = [
    "CkptoptError",
    "InvalidCosts",
    "InvalidPlan",
    "InfeasibleBudget",
    "UnknownSolver",
    "ProblemTooLarge",
    "TraceError",
]


class CkptoptError(Exception):
    """Base class of every error ckptopt raises on purpose."""


class InvalidCosts(CkptoptError, ValueError):
    """A cost model is malformed: a length, a negative or non-integer value.

    Attributes
    ----------
    field : str or None
        The offending field (``"a"``, ``"h"``, ``"static"``...).
    index : int or None
        The offending layer index, when the problem is one entry.
    """

    def __init__(self, message: str, field: str | None = None, index: int | None = None):
        super().__init__(message)
        self.field = field
        self.index = index


class InvalidPlan(CkptoptError, ValueError):
    """A checkpoint tuple is not a valid plan for the cost model it is used with."""


class UnknownSolver(CkptoptError, ValueError):
    """The solver name is not in the registry; the message lists the valid ones."""


class ProblemTooLarge(CkptoptError, ValueError):
    """The instance is too large for the requested solver (e.g. ``brute`` beyond n = 20)."""


class InfeasibleBudget(CkptoptError, ValueError):
    """No plan fits the memory budget.

    Attributes
    ----------
    budget_bytes : int
        The budget that was asked for.
    min_peak_bytes : int
        The smallest peak any plan reaches on this cost model: a budget at
        least this large is feasible.
    """

    def __init__(self, budget_bytes: int, min_peak_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self.min_peak_bytes = int(min_peak_bytes)
        super().__init__(
            f"no checkpoint plan fits a budget of {self.budget_bytes} bytes "
            f"({format_bytes(self.budget_bytes)}): the smallest achievable peak is "
            f"{self.min_peak_bytes} bytes ({format_bytes(self.min_peak_bytes)}). "
            "Raise the budget to at least that, or reduce the batch size "
            "(with gradient accumulation to keep the effective batch)."
        )


class TraceError(CkptoptError, RuntimeError):
    """The tracer cannot turn this model into a cost model.

    The message names the construct (and the module or graph node) that
    failed and the fallback: ``leaf_modules=[...]`` to treat named submodules
    as opaque layers.

    Attributes
    ----------
    node : str or None
        The module path or graph node where tracing failed.
    """

    def __init__(self, message: str, node: str | None = None):
        super().__init__(message)
        self.node = node
