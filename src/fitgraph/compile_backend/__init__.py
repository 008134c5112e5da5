"""The torch.compile backend: ``torch.compile(model, backend=fitgraph.backend(budget=...))``."""

from .backend import FitgraphBackend, backend
from .report import BackendReport

__all__ = ["BackendReport", "FitgraphBackend", "backend"]
