"""Moved: :mod:`ckptopt.tracer.layer_figures` (kept until the tests' imports follow)."""

from .layer_figures import dying_gains as _dying_gains  # noqa: F401
