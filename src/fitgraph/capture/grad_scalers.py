"""``torch.amp.GradScaler`` in a captured step: the loss scaled as eager scales it, the update
left to the scaler.

A mixed-precision loop scales the loss (``scaler.scale(loss)`` in the loss function), then
``scaler.step(optimizer)`` unscales the gradients, skips the update where one is not finite,
and ``scaler.update()`` changes the scale in place. A captured step reads the scale as a
constant tensor, by identity: each step multiplies by its value then, as eager does. Two things
would go wrong silently, and are handled here:

* A scaler makes its scale on its first ``scale()``. Made while the step is traced, it is a
  placeholder of the trace: the step would multiply by the initial scale for ever, and the
  scaler would hold a tensor without data. ``made_scales_real`` gives such a scaler its real
  scale (and growth tracker) as torch's first ``scale()`` makes them, and the step is traced
  again, reading it.
* With the optimizer in the step, its update would apply the scaled gradients, which only
  ``scaler.step`` unscales: ``check_update_unscaled`` refuses it (pass ``optimizer=None``
  and call ``scaler.step(optimizer)``, ``scaler.update()`` after the step).

Example:
    >>> import torch, fitgraph
    >>> model = torch.nn.Linear(8, 2)
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    >>> loss_fn = lambda m, b: scaler.scale(m(b).square().mean())
    >>> step = fitgraph.optimize(model, torch.randn(16, 8), loss_fn, budget=1.0)
    >>> scaler.get_scale()    # made real by the capture, as torch's first scale() makes it
    4.0
"""

from __future__ import annotations

import gc

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .errors import CaptureError

__all__ = ["check_update_unscaled", "live_scalers", "made_scales_real"]


def live_scalers() -> list:
    """Every live ``torch.amp.GradScaler`` (a capture looks once, for both checks below).

    NOTE: the scaler is wherever the loss function finds it (a global, a closure, a
    trainer's attribute): every live one is looked at (~50 ms in a process of 350k objects);
    by type(), not isinstance: a deprecated module proxy warns when its __class__ is read."""
    return [o for o in gc.get_objects() if issubclass(type(o), torch.amp.GradScaler)]


def made_scales_real(scalers: list) -> bool:
    """Give every one of ``scalers`` whose scale a trace made (a placeholder) the real scale
    and growth tracker its first ``scale()`` makes; whether one was."""
    made = False
    for s in scalers:
        if isinstance(getattr(s, "_scale", None), FakeTensor):
            dev = s._scale.device
            s._scale = torch.full((), s._init_scale, dtype=torch.float32, device=dev)
            s._growth_tracker = torch.full((), s._init_growth_tracker, dtype=torch.int32,
                                           device=dev)
            made = True
    return made


def check_update_unscaled(constants: dict[str, torch.Tensor], optimizer, scalers: list) -> None:
    """CaptureError where the step reads the scale of one of ``scalers`` and updates the
    parameters itself."""
    if optimizer is None or not constants:
        return
    read = {id(t) for t in constants.values()}
    if any(id(getattr(s, "_scale", None)) in read for s in scalers):
        raise CaptureError(
            "the loss is scaled by a torch.amp.GradScaler and the optimizer is in the step: "
            "its update would apply the scaled gradients, which only scaler.step(optimizer) "
            "unscales (skipping a step whose gradients are not finite). Plan the step "
            "without the optimizer (optimizer=None) and call scaler.step(optimizer) and "
            "scaler.update() after it, as in eager", op="GradScaler.scale")
