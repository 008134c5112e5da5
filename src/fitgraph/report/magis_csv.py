"""Rows in the MAGIS results.csv format (plus fitgraph's own columns).

MAGIS's columns count memory in elements (fp32: bytes / 4) and mark measured numbers with
"is-prof-result"; fitgraph adds bytes, the solver and its time.

Example:
    >>> from fitgraph.report.magis_csv import MAGIS_COLUMNS
    >>> MAGIS_COLUMNS[:3]
    ['name', 'device memory limit', 'latency limit']
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence

__all__ = ["FITGRAPH_COLUMNS", "MAGIS_COLUMNS", "write_rows"]

MAGIS_COLUMNS = [
    "name", "device memory limit", "latency limit", "memory limit", "latency limit ratio",
    "memory limit ratio", "weight memory", "opt-is-prof-result", "opt-latency", "opt-memory",
    "opt-simul-latency", "opt-simul-memory", "ori-is-prof-result", "ori-latency", "ori-memory",
    "ori-simul-latency", "ori-simul-memory",
]
FITGRAPH_COLUMNS = ["solver", "solve-s", "recomputes", "budget-bytes", "opt-memory-bytes",
                    "ori-memory-bytes", "opt-simul-memory-bytes", "ori-simul-memory-bytes",
                    "cost-model"]


def write_rows(path: str, rows: Iterable[dict], extra_columns: Sequence[str] = ()) -> None:
    """Write ``rows`` under MAGIS's columns, then fitgraph's, then ``extra_columns``; a column
    a row lacks is left empty, a key no column names is not written."""
    cols = list(dict.fromkeys([*MAGIS_COLUMNS, *FITGRAPH_COLUMNS, *extra_columns]))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="", extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
