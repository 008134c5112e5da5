"""The torch.compile backend: ``torch.compile(model, backend=fitgraph.backend(budget=...))``."""

from .backend_report import BackendReport
from .compiler import FitgraphBackend, backend

__all__ = ["BackendReport", "FitgraphBackend", "backend"]
