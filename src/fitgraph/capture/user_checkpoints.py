"""The model's own ``torch.utils.checkpoint`` calls, run as plain calls while a step is traced.

Many models checkpoint their blocks themselves (Hugging Face's ``gradient_checkpointing_enable``,
``checkpoint(block, x)`` in a user's forward). Traced as eager runs it, such a step re-runs each
block in the backward, where torch restores the RNG state first so that dropout draws the
forward's masks again, and sets it back after. That restore is Python, outside any op: a traced
graph would draw the masks afresh in the backward (other gradients than eager's, and a generator
left one draw further on), and the re-run blocks' module hooks would mark the backward as loss.

fitgraph chooses what to recompute itself (the plan's recompute replaces the model's), so the
step is traced with each checkpointed function called directly, as ``checkpoint`` computes it
(the same ops and values; the recompute only repeats them; with ``use_reentrant=True`` and no
tensor input that requires grad, under ``no_grad``, as eager gives that block no gradients).
Both of torch's variants are covered, whatever name the model holds ``checkpoint`` by:
``use_reentrant=True`` goes through ``CheckpointFunction.apply``, ``use_reentrant=False``
through ``_checkpoint_without_reentrant_generator``, both looked up in
``torch.utils.checkpoint`` at each call. ``Seen.calls`` counts them; ``capture`` records it in ``graph.meta``.

Example:
    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> from fitgraph.capture.user_checkpoints import plain_checkpoints
    >>> lin = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> with plain_checkpoints() as seen:
    ...     y = checkpoint(lin, x, use_reentrant=False)
    >>> seen.calls, y.grad_fn.name()   # lin ran as itself: no checkpoint node in the graph
    (1, 'AddmmBackward0')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as _ckpt

__all__ = ["Seen", "plain_checkpoints"]


@dataclass
class Seen:
    """How many checkpointed calls ran plain."""

    calls: int = 0


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[Seen]:
    """Within the block, ``torch.utils.checkpoint.checkpoint`` (and what calls it:
    ``checkpoint_sequential``, Hugging Face's checkpointing) calls its function directly."""
    seen = Seen()

    class _Plain:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            seen.calls += 1
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                # NOTE: as eager: the reentrant variant's output needs a tensor input that
                # requires grad; without one, nothing inside gets a gradient (torch warns)
                with torch.no_grad():
                    return function(*args)
            return function(*args)

    def _no_hooks(function, preserve_rng_state, context_fn, *rest, **kwargs):
        # NOTE: checkpoint() runs ``next`` once before the function and once after, expecting
        # the second to stop: one yield, no saved-tensor hooks, no context_fn
        seen.calls += 1
        yield

    saved = (_ckpt.CheckpointFunction, _ckpt._checkpoint_without_reentrant_generator)
    _ckpt.CheckpointFunction = _Plain
    _ckpt._checkpoint_without_reentrant_generator = _no_hooks
    try:
        yield seen
    finally:
        _ckpt.CheckpointFunction, _ckpt._checkpoint_without_reentrant_generator = saved
