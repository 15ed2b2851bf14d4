"""Moved: node-level tracing is experimental and lives in :mod:`ckptopt.experimental.nodes`.

This module keeps the paths an earlier README documented working
(``ckptopt._dag_measure.optimize_nodes``).
"""

from __future__ import annotations

from .experimental.nodes import *  # noqa: F401,F403
from .experimental.nodes import __all__  # noqa: F401
