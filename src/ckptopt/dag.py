"""Moved: the node-level simulator is experimental and lives in :mod:`ckptopt.experimental.dag`.

This module keeps ``import ckptopt.dag`` working (no torch import).
"""

from __future__ import annotations

from .experimental.dag import *  # noqa: F401,F403
from .experimental.dag import __all__  # noqa: F401
