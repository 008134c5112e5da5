"""Parse memory budgets: bytes, "12GiB", "800MB", "50%", or a fraction of the eager peak.

Example:
    >>> from fitgraph.units import parse_budget
    >>> parse_budget("1.5GiB", eager_peak_bytes=0), parse_budget(0.5, eager_peak_bytes=1000)
    (1610612736, 500)
    >>> parse_budget("800MB", eager_peak_bytes=0), parse_budget("50%", eager_peak_bytes=1000)
    (800000000, 500)
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_budget"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget: int | float | str, *, eager_peak_bytes: int) -> int:
    """Bytes for a budget given as bytes (int), a fraction of the eager peak (float in (0, 1]
    or "50%"), or a size string ("12GiB", "800MB")."""
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes, a fraction or a size string, not a bool")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget {budget} bytes must be positive")
        return budget
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"a float budget is a fraction of the eager peak, in (0, 1]; got "
                             f"{budget} (give bytes as an int or a string like '12GiB')")
        return int(budget * eager_peak_bytes)
    text = str(budget).strip().lower().replace(" ", "")
    if text.endswith("%"):
        return parse_budget(float(text[:-1]) / 100, eager_peak_bytes=eager_peak_bytes)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read budget {budget!r}: use bytes, '12GiB', '800MB', '50%' "
                         "or a fraction like 0.5")
    return parse_budget(int(float(m.group(1)) * _UNITS[m.group(2)]),
                        eager_peak_bytes=eager_peak_bytes)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.1f} MiB"
