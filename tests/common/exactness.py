"""Measured against predicted peaks: the checks a regression case (``tests/common/regressions.py``) names.

A plan is given as its segment starts, ``(1, 3)``, or as ``(segment starts, stored starts)``,
``((1, 3), (0,))``. Each check rewrites the model with every plan (``apply_plan``), measures one real
training step (``measure_peak``: the exact storage tracker) and compares the peak with the
simulator's prediction for that plan. The scalar loss and its gradient (``LOSS_BYTES``) are not in
the chain model (docs/design.md): a peak after the loss exists measures the prediction plus them.
"""

from __future__ import annotations

from ckptopt import Plan, apply_plan, simulate
from ckptopt.measure import measure_peak
from ckptopt.tracer import trace

from .fuzz import Spec, build

__all__ = ["LOSS_BYTES", "plan_parts", "gaps", "traced", "assert_exact", "assert_exact_by_phase",
           "assert_within_loss", "assert_within_loss_fake", "assert_within_loss_and_a_count"]

LOSS_BYTES = 8  # the scalar loss and its gradient, which the chain model leaves out (docs/design.md)


def plan_parts(p) -> tuple[tuple, tuple]:
    """``(checkpoints, stored)`` of a plan given as segment starts or as such a pair."""
    return (p[0], p[1]) if p and isinstance(p[0], tuple) else (p, ())


def gaps(model, x, tm, plans, fake: bool = False) -> dict:
    """Measured minus predicted peak of a training step, for each plan (of a fake-tensor step where
    ``fake``)."""
    out = {}
    for p in plans:
        cps, stored = plan_parts(p)
        opt = apply_plan(model, tm, Plan(cps, simulate(tm.costs, cps, stored).peak_bytes, "given", 0.0, tm.n,
                                         stored))
        try:
            out[p] = measure_peak(opt, (x,), fake=fake) - opt.predicted_peak_bytes
        finally:
            opt.remove_hooks()
    return out


def traced(spec: Spec, seed: int, **trace_kw):
    """A random model built from ``spec`` and ``seed``, in training mode, its example input and its trace."""
    model, x = build(spec, seed=seed)
    model.train()
    return model, x, trace(model, (x,), **trace_kw)


def _assert_gaps(found: dict, allowed) -> None:
    wrong = {p: gap for p, gap in found.items() if not allowed(p, gap)}
    assert not wrong, f"measured minus predicted peak, by plan: {wrong}"


def assert_exact(model, x, tm, plans) -> None:
    """Every plan measures its prediction plus the scalar loss and its gradient."""
    _assert_gaps(gaps(model, x, tm, plans), lambda p, gap: gap == LOSS_BYTES)


def assert_exact_by_phase(model, x, tm, plans) -> None:
    """:func:`assert_exact`, where a plan that peaks in the forward has no loss yet (gap 0)."""
    def allowed(p, gap):
        return gap == (0 if simulate(tm.costs, *plan_parts(p)).phase == "forward" else LOSS_BYTES)

    _assert_gaps(gaps(model, x, tm, plans), allowed)


def assert_within_loss(model, x, tm, plans) -> None:
    """Every plan measures its prediction plus at most the scalar loss and its gradient (a peak in the
    forward, before the loss exists, measures the prediction itself; in a bfloat16 model the loss may
    or may not add to the peak)."""
    _assert_gaps(gaps(model, x, tm, plans), lambda p, gap: 0 <= gap <= LOSS_BYTES)


def assert_within_loss_fake(model, x, tm, plans) -> None:
    """:func:`assert_within_loss`, measured on a fake-tensor step."""
    _assert_gaps(gaps(model, x, tm, plans, fake=True), lambda p, gap: 0 <= gap <= LOSS_BYTES)


def assert_within_loss_and_a_count(model, x, tm, plans) -> None:
    """Every plan measures its prediction plus the loss, give or take 8 bytes (0 to 16 B over): the
    width of a BatchNorm's int64 ``num_batches_tracked`` while it is recomputed."""
    _assert_gaps(gaps(model, x, tm, plans), lambda p, gap: abs(gap - LOSS_BYTES) <= 8)
