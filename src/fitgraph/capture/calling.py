"""The calling convention of the whole library: how a (model, batch, loss_fn) gives a loss.

``batch`` is any pytree of tensors. ``loss_fn(model, batch)`` returns the scalar loss. Without a
loss_fn, the model is called by the batch's type — ``model(*batch)`` for a tuple/list,
``model(**batch)`` for a dict, ``model(batch)`` otherwise — and its output is the loss, or its
``.loss`` / ``["loss"]`` (Hugging Face ``ModelOutput`` style).

Example:
    >>> import torch
    >>> from fitgraph.capture.calling import compute_loss
    >>> m = torch.nn.Linear(3, 1)
    >>> loss = compute_loss(m, torch.zeros(2, 3), lambda m, b: m(b).sum())
    >>> torch.equal(loss, m.bias.sum() * 2)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import CaptureError

__all__ = ["LossFn", "call_model", "compute_loss", "loss_from_output"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def loss_from_output(out: Any) -> torch.Tensor:
    """The loss in a model's output: the tensor itself, or ``.loss`` / ``["loss"]``."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    kind = type(out).__name__
    raise CaptureError(
        f"the model returned a {kind} with no loss tensor; pass loss_fn=lambda model, batch: ... "
        "returning a scalar loss, or include labels in the batch so the model returns .loss",
        module="", op="model output")


def compute_loss(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    loss = loss_fn(model, batch) if loss_fn is not None else loss_from_output(call_model(model, batch))
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(f"loss_fn returned {type(loss).__name__}, not a tensor; return a scalar "
                           "loss tensor", module="", op="loss_fn")
    if loss.numel() != 1:
        raise CaptureError(f"the loss has shape {tuple(loss.shape)}; it must be a scalar: reduce "
                           "it (e.g. .mean()) in loss_fn", module="", op="loss")
    if not loss.dtype.is_floating_point:
        raise CaptureError(f"the loss has dtype {loss.dtype}; it must be floating point",
                           module="", op="loss")
    if not loss.requires_grad:
        raise CaptureError("the loss does not depend on any trainable parameter (requires_grad "
                           "is False): check that parameters require grad and that the loss is "
                           "not computed under torch.no_grad()", module="", op="loss")
    return loss.reshape(()) if loss.dim() else loss
