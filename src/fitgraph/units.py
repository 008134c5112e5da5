"""Parse memory budgets: bytes, "12GiB", "800MB", "50%", a fraction of the eager peak, or
"smallest" (the least peak fitgraph reaches: searched, it has no bytes before).

Example:
    >>> from fitgraph.units import format_bytes, parse_budget
    >>> parse_budget("1.5GiB", eager_peak_bytes=0), parse_budget(0.5, eager_peak_bytes=1000)
    (1610612736, 500)
    >>> parse_budget("800MB", eager_peak_bytes=0), parse_budget("50%", eager_peak_bytes=1000)
    (800000000, 500)
    >>> format_bytes(3 * 2**20), format_bytes(1536), format_bytes(12)
    ('3.0 MiB', '1.5 KiB', '12 B')
"""

from __future__ import annotations

import math
import re

__all__ = ["LEAST_BUDGET_BYTES", "SMALLEST", "budget_bytes", "check_budget", "check_latency_limit", "format_bytes",
           "is_smallest", "parse_budget"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# NOTE: no training step fits in 1 KiB: an int this small is a percent or a size without its
# unit ("--budget 50"), so it is refused with what was probably meant
LEAST_BUDGET_BYTES = 2**10
# NOTE: the budget that asks for the least peak the solver reaches (``solvers.solve_smallest``)
SMALLEST = "smallest"


def is_smallest(budget) -> bool:
    """Whether ``budget`` asks for the smallest peak ("smallest", any case).

    Example:
        >>> is_smallest("Smallest"), is_smallest("50%"), is_smallest(0.5)
        (True, False, False)
    """
    return isinstance(budget, str) and budget.strip().lower() == SMALLEST


def is_fraction(budget) -> bool:
    """Whether ``budget`` is relative to the eager peak (a float, "50%", "0.5").

    Example:
        >>> is_fraction(0.5), is_fraction("60%"), is_fraction("0.6"), is_fraction("8GiB")
        (True, True, True, False)
    """
    if isinstance(budget, float):
        return True
    text = str(budget).strip()
    return isinstance(budget, str) and (text.endswith("%") or re.fullmatch(r"[0-9]*\.[0-9]+",
                                                                           text) is not None)


def parse_budget(budget: int | float | str, *, eager_peak_bytes: int) -> int:
    """Bytes for a budget given as bytes (int), a fraction of the eager peak (float in (0, 1]
    or "50%"), or a size string ("12GiB", "800MB"). Errors name the budget and what it could
    have meant."""
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes, a fraction or a size string, not a bool")
    if is_smallest(budget):
        raise ValueError("budget 'smallest' is the least peak the solver reaches: it has no "
                         "bytes before that search (solvers.solve_smallest)")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget {budget} bytes must be positive")
        if budget < LEAST_BUDGET_BYTES:
            meant = (f"{budget}% ('{budget}%' or {budget / 100:g})" if budget <= 100
                     else f"{budget} MiB ('{budget}MiB')")
            if budget == 1:
                meant = "1.0 (all of eager's peak, '100%')"
            raise ValueError(f"budget {budget} is read as {budget} bytes, less than any training "
                             f"step needs: did you mean {meant}?")
        return budget
    if isinstance(budget, float):
        if not math.isfinite(budget) or not 0 < budget <= 1:
            raise ValueError(f"a float budget is a fraction of the eager peak, in (0, 1]; got "
                             f"{budget} (give bytes as an int or a string like '12GiB')")
        return max(1, int(budget * eager_peak_bytes))
    text = str(budget).strip().lower().replace(" ", "")
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise ValueError(f"cannot read budget {budget!r}: a percentage is a number before "
                             "'%', like '50%'") from None
        if not math.isfinite(percent) or not 0 < percent <= 100:
            raise ValueError(f"budget {budget!r} is a percentage of the eager peak: it must be "
                             "more than 0% and at most 100%")
        return max(1, int(percent / 100 * eager_peak_bytes))
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read budget {budget!r}: use bytes, '12GiB', '800MB', '50%', "
                         "a fraction like 0.5 or 'smallest'")
    if m.group(2) == "" and "." in m.group(1):
        return parse_budget(float(m.group(1)), eager_peak_bytes=eager_peak_bytes)
    return parse_budget(int(float(m.group(1)) * _UNITS[m.group(2)]),
                        eager_peak_bytes=eager_peak_bytes)


def budget_bytes(budget, *, eager_peak_bytes: int) -> int | None:
    """``parse_budget``'s bytes; None where there are none to give: no budget, or "smallest".

    Example:
        >>> budget_bytes("50%", eager_peak_bytes=1000), budget_bytes("smallest", eager_peak_bytes=1)
        (500, None)
    """
    if budget is None or is_smallest(budget):
        return None
    return parse_budget(budget, eager_peak_bytes=eager_peak_bytes)


def check_budget(budget: int | float | str | None) -> None:
    """Raise the error ``parse_budget`` would, before any work (capture, profiling) is spent
    ("smallest" is a budget too)."""
    if budget is not None and not is_smallest(budget):
        parse_budget(budget, eager_peak_bytes=1)


def format_bytes(n: int | None) -> str:
    """MiB with one decimal; KiB or bytes for what would print as 0.0 MiB."""
    if n is None:
        return "-"
    if abs(n) < 2**20 // 10:
        return f"{n / 2**10:,.1f} KiB" if abs(n) >= 2**10 else f"{n} B"
    return f"{n / 2**20:,.1f} MiB"


def check_latency_limit(limit: float | None) -> None:
    """A latency limit is a factor of eager's step time, at least 1 (1.10: within 10%)."""
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise TypeError(f"latency_limit must be a number like 1.10 (a factor of eager's step "
                        f"time), not {limit!r}")
    if not math.isfinite(limit) or limit < 1:
        raise ValueError(f"latency_limit {limit} is a factor of eager's step time and must be "
                         "at least 1 (1.10: at most 10% slower than eager)")
