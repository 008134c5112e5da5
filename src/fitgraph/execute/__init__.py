"""Execution on real tensors (torch): the executor and the memory meter."""

from . import torch_kernel_facts  # noqa: F401  (registers torch's answers: graph.kernel_facts)
from .executor import Executor, bind_inputs, execute

__all__ = ["Executor", "bind_inputs", "execute"]
