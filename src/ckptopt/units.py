"""Byte sizes: parsing ``8GiB``/``8GB``/``512MiB``/``1234`` and formatting."""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"8GiB"`` -> 8589934592, ``"8GB"`` -> 8000000000, ``"512MiB"``, ``"1e9"``, ``1234``.

    Raises ``ValueError`` naming the accepted forms when the text is not a size.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a memory size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = _RE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(
                f"not a memory size: {text!r}; write a number of bytes or a number with a unit, "
                "e.g. 8GiB, 8GB, 512MiB, 1.5GiB, 1000000"
            )
        value = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(value):
            raise ValueError(f"not a finite memory size: {text!r}")
        value = int(round(value))
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return value


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``'1.50 KiB'``; exact count below 1 KiB."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
