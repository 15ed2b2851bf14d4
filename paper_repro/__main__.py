"""``python -m paper_repro [--quick] [--device cpu|cuda] [--out DIR]`` (run from the repository root)."""

import sys
from pathlib import Path

try:
    import ckptopt  # noqa: F401
except ImportError:  # a checkout that is not installed: use its src/ folder
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from .run import main

sys.exit(main())
