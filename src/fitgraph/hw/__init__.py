"""``fitgraph.hw``: which accelerator to build or buy — an accelerator template (``chip``),
its area and power (``area``), per-op latency on it (``gemm``), and the co-search of
architectures with multi-device plans. Torch-free, as the planners it feeds.
"""

from .chip import CHIPS, Chip, get_chip

__all__ = ["CHIPS", "Chip", "get_chip"]
