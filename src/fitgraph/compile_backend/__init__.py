"""The torch.compile backend: ``torch.compile(model, backend=fitgraph.backend(budget=...))``, or
by name: ``torch.compile(model, backend="fitgraph", options={"budget": ...})`` (``by_name``)."""

from .backend_report import BackendReport
from .by_name import named_backend
from .compiler import FitgraphBackend, backend

__all__ = ["BackendReport", "FitgraphBackend", "backend", "named_backend"]
