"""Byte quantities: parsing ``"512MiB"``/``"8GB"`` and printing them back."""
from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"8GB"``, ``"1.5 GiB"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000; binary ones (KiB, MiB, GiB, TiB, and the
    bare K, M, G, T) powers of 1024.

    >>> parse_bytes("512MiB")
    536870912
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid byte size {value!r}: give an int or a string such as '8GB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 1:
            raise ValueError(f"invalid byte size {value!r}: must be a finite number of bytes, at least 1")
        return int(value)
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"invalid byte size {value!r}: expected a number with an optional unit "
            f"(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '512MiB' or '8GB'")
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise ValueError(f"invalid byte size {value!r}: must be a finite number of bytes, at least 1")
    return int(size)


def format_bytes(n: float | None) -> str:
    """Bytes as text in binary units, for tables and messages.

    Args:
      n: a byte count, or None (shown as ``"-"``).

    Example:
      >>> format_bytes(1536 * 2**20)
      '1.50 GiB'
    """
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
