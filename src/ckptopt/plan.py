"""The plan type: which layers start a segment, and which segments stay unwrapped.

A *plan* for a chain of ``n`` layers is the sorted tuple of layers that start a
new segment, excluding layer 0 (which always starts the first one): ``()`` is one
segment, no checkpointing. Every segment but the last runs under
``torch.utils.checkpoint(..., use_reentrant=False)`` unless its start layer is
listed in ``stored`` (it is then left unwrapped: it keeps what its layers save and
re-runs nothing); the last segment is always unwrapped.

This module is the one home of the rules that read a plan: validation
(:func:`normalize_plan`, :func:`normalize_stored`) and the segments it makes
(:func:`segment_bounds`). No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

import numpy as np

from .errors import InvalidPlan

__all__ = ["Plan", "Solution", "normalize_plan", "normalize_stored", "segment_bounds", "stored_flags"]


def segment_bounds(n: int, checkpoints: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Inclusive ``(first, last)`` layer pairs of the segments of a plan.

    >>> segment_bounds(5, (2, 4))
    ((0, 1), (2, 3), (4, 4))
    """
    starts = (0,) + tuple(int(c) for c in checkpoints)
    ends = tuple(s - 1 for s in starts[1:]) + (int(n) - 1,)
    return tuple(zip(starts, ends))


def stored_flags(checkpoints: tuple[int, ...], stored: Iterable[int]) -> np.ndarray:
    """Per segment (int64): 1 when its start layer is in ``stored`` (left unwrapped)."""
    keep = set(stored)
    return np.array([1 if s in keep else 0 for s in (0,) + tuple(checkpoints)], dtype=np.int64)


def normalize_plan(costs, checkpoints: Iterable[int]) -> tuple[int, ...]:
    """Validate ``checkpoints`` for a cost model of ``costs.n`` layers; return it as a tuple of ints.

    Raises
    ------
    InvalidPlan
        When an entry is not an integer, is out of ``1..n-1``, or the entries
        are not strictly increasing.
    """
    if isinstance(checkpoints, (str, bytes)):
        raise InvalidPlan(f"a plan is a sequence of layer indices, got the string {checkpoints!r}")
    try:
        items = list(checkpoints)
    except TypeError as exc:
        raise InvalidPlan(f"a plan is a sequence of layer indices, got {type(checkpoints).__name__}") from exc
    out: list[int] = []
    n = costs.n
    for pos, c in enumerate(items):
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise InvalidPlan(f"plan entry {pos} is {c!r}, not a layer index (int)")
        c = int(c)
        if not 1 <= c <= n - 1:
            raise InvalidPlan(
                f"plan entry {pos} is layer {c}, outside 1..{n - 1}: a checkpoint names the first "
                f"layer of a new segment, and layer 0 always starts the first one (n = {n})"
            )
        if out and c <= out[-1]:
            raise InvalidPlan(f"plan entries must be strictly increasing: {out[-1]} then {c} at entry {pos}")
        out.append(c)
    return tuple(out)


def normalize_stored(checkpoints: tuple[int, ...], stored: Iterable[int]) -> tuple[int, ...]:
    """Validate ``stored`` (start layers of segments left unwrapped) against a normalized plan."""
    if isinstance(stored, (str, bytes)):
        raise InvalidPlan(f"stored is a sequence of segment-start layers, got the string {stored!r}")
    try:
        items = sorted(set(int(x) for x in stored))
    except (TypeError, ValueError) as exc:
        raise InvalidPlan(f"stored is a sequence of segment-start layers (ints), got {stored!r}") from exc
    starts = (0,) + tuple(checkpoints)
    for x in items:
        if x not in starts:
            raise InvalidPlan(
                f"stored names layer {x}, which starts no segment: stored segments are named by their "
                f"first layer, one of {starts}"
            )
        if x == starts[-1]:
            raise InvalidPlan(
                f"stored names layer {x}, the start of the last segment, which is always left unwrapped"
            )
    return tuple(items)


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan and its simulated peak.

    Attributes
    ----------
    checkpoints : tuple of int
        Layers that start a new segment (layer 0 always starts the first).
    peak_bytes : int
        The plan's peak from :func:`~ckptopt.simulate` (static bytes included).
    solver : str
        The registry name that produced it (``"uniform:4"`` keeps its argument;
        ``"dp2+stored"`` for the default plan with unwrapped middle segments).
    solve_seconds : float
        Wall time of the solver alone (compilation excluded, simulation excluded).
    n : int
        Number of layers of the cost model it was made for.
    stored : tuple of int
        Start layers of segments (other than the last) left unwrapped: they
        keep what they save and re-run nothing. Only the ``budget`` solver and
        the default plan use them; empty otherwise.
    """

    checkpoints: tuple[int, ...]
    peak_bytes: int
    solver: str
    solve_seconds: float
    n: int
    stored: tuple[int, ...] = ()

    @property
    def wrapped(self) -> tuple[bool, ...]:
        """Per segment: run under ``torch.utils.checkpoint`` (re-run in backward)."""
        kept = set(self.stored)
        last = len(self.checkpoints)
        return tuple(k < last and s not in kept for k, s in enumerate((0,) + self.checkpoints))

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """Inclusive ``(first, last)`` layer pairs of every segment."""
        return segment_bounds(self.n, self.checkpoints)


class Solution(NamedTuple):
    """What a solver engine returns, before :func:`ckptopt.solve` scores it into a :class:`Plan`.

    ``optimum`` is the peak the engine claims (checked against the simulator) or None;
    ``label`` replaces the registry name in :attr:`Plan.solver` (``"dp2+stored"``).
    """

    checkpoints: tuple[int, ...]
    optimum: int | None = None
    stored: tuple[int, ...] = ()
    label: str | None = None
