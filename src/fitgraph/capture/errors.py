"""Capture errors: each names the module and op at fault and what to do."""

from __future__ import annotations

__all__ = ["CaptureError"]


class CaptureError(RuntimeError):
    """The training step cannot be captured as one graph.

    Attributes ``module`` (module path, "" for top level) and ``op`` (the ATen op or Python
    construct) say where; the message says what to do.
    """

    def __init__(self, message: str, *, module: str | None = None, op: str | None = None):
        where = []
        if module is not None:
            where.append(f"module {module or '<top level>'!r}")
        if op is not None:
            where.append(f"op {op}")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message)
        self.module = module
        self.op = op
