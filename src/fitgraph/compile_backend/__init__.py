"""The torch.compile backend: ``torch.compile(model, backend=fitgraph.backend(budget=...))``."""

from .compiler import FitgraphBackend, backend
from .report import BackendReport

__all__ = ["BackendReport", "FitgraphBackend", "backend"]
