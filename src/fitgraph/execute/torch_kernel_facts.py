"""torch's answers to what the planner asks of kernels (``graph.kernel_facts``), registered
when ``fitgraph.execute`` loads.

Example:
    >>> import fitgraph
    >>> from fitgraph.graph.kernel_facts import kernel_facts
    >>> kernel_facts().packs_alike("cpu")
    True
"""

from __future__ import annotations

import functools

import torch

from ..graph.ir import Graph, Node
from ..graph.kernel_facts import use_kernel_facts
from . import bit_packing
from .ops import ArgBinder, resolve_target

__all__ = ["TorchKernelFacts"]


class TorchKernelFacts:
    """Bit packing and BatchNorm's re-made output checked on the device; strides from running
    the op on meta tensors."""

    def packs_alike(self, device: str) -> bool:
        # NOTE: read from the module at each call (tests replace it)
        return bit_packing.packs_alike(device)

    def strides_kept(self, graph: Graph, node: Node, vid: int,
                     stride: tuple[int, ...]) -> bool:
        env = {v: torch.empty_strided(graph.values[v].shape,
                                      stride if v == vid else graph.values[v].stride,
                                      dtype=getattr(torch, graph.values[v].dtype),
                                      device="meta")
               for v in node.inputs}
        try:
            args, kwargs = ArgBinder(node)(env)
            made = resolve_target(node.target)(*args, **kwargs)
        except Exception:   # NOTE: any op that cannot run on meta tensors is left as it is
            return False
        made = made if isinstance(made, (tuple, list)) else (made,)
        return all(o is None or tuple(t.stride()) == graph.values[o].stride
                   for o, t in zip(node.outputs, made))

    def batch_norm_from_stats(self, device: str, dtype: str, eps: float) -> bool:
        return _batch_norm_from_stats(device, dtype, eps)

    def optimizer_chunks_alike(self, device: str, dtype: str, kind: str, fused: bool) -> bool:
        return _optimizer_chunks_alike(device, dtype, kind, fused)


@functools.cache
def _batch_norm_from_stats(device: str, dtype: str, eps: float) -> bool:
    """Whether ``native_batch_norm(x, invstd * w, b, mean, 1 - eps, False, ...)`` makes the
    training kernel's output bit for bit (``transform.norm_from_stats``), tried on random
    tensors of a few ranks and layouts (odd sizes: vector bodies and scalar tails), with and
    without the affine parameters, on a private generator. False where it differs or cannot
    run."""
    try:
        dt = getattr(torch, dtype)
        if not dt.is_floating_point:
            return False
        gen = torch.Generator().manual_seed(0)
        for shape, channels_last in (((5, 19, 7, 9), False), ((5, 19, 7, 9), True),
                                     ((6, 37, 11), False), ((33, 21), False)):
            x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dt).to(device)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            c = shape[1]
            w = torch.randn(c, generator=gen, dtype=torch.float64).to(dt).to(device)
            b = torch.randn(c, generator=gen, dtype=torch.float64).to(dt).to(device)
            for weight, bias in ((w, b), (None, None)):
                rm, rv = torch.zeros_like(w), torch.ones_like(w)
                y, mean, invstd = torch.ops.aten.native_batch_norm(
                    x, weight, bias, rm, rv, True, 0.1, eps)
                scale = invstd if weight is None else invstd * weight
                again = torch.ops.aten.native_batch_norm(
                    x, scale, bias, mean, mean.new_full(mean.shape, 1.0 - eps), False, 0.1,
                    eps)[0]
                if not torch.equal(y, again) or y.stride() != again.stride():
                    return False
        return True
    except (RuntimeError, TypeError, AttributeError):
        return False


# NOTE: hyperparameters that take each of torch's update's branches (weight decay coupled and
# decoupled, amsgrad, maximize; momentum, dampening, Nesterov)
_PROBED_GROUPS = {
    "adam": ({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
              "amsgrad": True, "maximize": False, "decoupled_weight_decay": True},
             {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1,
              "amsgrad": False, "maximize": True, "decoupled_weight_decay": False}),
    "sgd": ({"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01,
             "nesterov": False, "maximize": False},
            {"lr": 1e-1, "momentum": 0.8, "dampening": 0.0, "weight_decay": 0.1,
             "nesterov": True, "maximize": True}),
}


@functools.cache
def _optimizer_chunks_alike(device: str, dtype: str, kind: str, fused: bool) -> bool:
    """Whether torch's update of ``kind`` run on row slices (``optimizer_ops.apply_in_chunks``)
    makes the whole update's bits on ``device`` for ``dtype``: two steps of each probed param
    group on random tensors whose slices start at odd offsets (vector bodies and scalar tails),
    compared with the same steps unchunked, in the fused kernel (``fused``) or else in both the
    single-tensor and the foreach ones (the node does not say which runs: torch picks by
    device). False where one differs, or where none runs (NOTE: the CPU's fused Adam does
    differ: its vector body and scalar tail round apart)."""
    try:
        dt = getattr(torch, dtype)
    except AttributeError:
        return False
    if not dt.is_floating_point or kind not in _PROBED_GROUPS:
        return False
    gen = torch.Generator().manual_seed(0)
    ran = False
    for shape, chunks in (((37, 19), 3), ((50, 7, 5), 4), ((1001, 3), 7)):
        for group in _PROBED_GROUPS[kind]:
            for impl in ({"fused": True},) if fused else ({"foreach": False}, {"foreach": True}):
                tensors = [(torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1).abs()
                           .to(dt).to(device) for _ in range(3)]
                whole = _probe_steps(kind, group, impl, tensors, 1)
                if whole is None:
                    continue   # NOTE: this implementation does not run here (fused on CPU bf16)
                ran = True
                parts = _probe_steps(kind, group, impl, tensors, chunks)
                if parts is None or not all(map(torch.equal, whole, parts)):
                    return False
    return ran


def _probe_steps(kind: str, group: dict, impl: dict, tensors: list, chunks: int):
    """Two updates of a parameter (``tensors``: parameter, gradient, a state's start) by
    ``optimizer_ops``' own route, in ``chunks``; the parameter and state after, or None where
    torch refuses."""
    from types import SimpleNamespace

    from .optimizer_ops import _Update, apply_in_chunks

    param, grad, start = tensors
    keys = {"adam": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
            "sgd": ("momentum_buffer",)}[kind]
    state = {k: torch.tensor(3.0) if k == "step" else start.clone() for k in keys}
    node = SimpleNamespace(kwargs={"state_keys": keys, "have": keys})
    u = _Update(node, kind, param.clone(), grad, state, {**group, **impl},
                impl.get("foreach", False), None, impl.get("fused", False))
    try:
        for _ in range(2):
            apply_in_chunks(u, chunks)
    except (RuntimeError, TypeError, ValueError):
        return None
    return [u.param, *(u.state[k] for k in keys)]


use_kernel_facts(TorchKernelFacts())
