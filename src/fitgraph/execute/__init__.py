"""Execution on real tensors (torch): the executor and the memory meter."""

from .executor import Executor, bind_inputs, execute

__all__ = ["Executor", "bind_inputs", "execute"]
