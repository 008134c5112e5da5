"""``fitgraph.capture``: one training step of any nn.Module as a torch-free Graph.

Example:
    >>> import torch, fitgraph
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    >>> batch = (torch.randn(4, 8), torch.randn(4, 1))
    >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> g = fitgraph.capture(model, batch, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> sorted({n.phase.value for n in g.nodes})
    ['backward', 'forward', 'loss', 'optimizer']
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Role
from .calling import LossFn
from .combined_optimizer import as_optimizer
from .convert import fx_to_builder
from .fold_tables import fold_constant_tables
from .grad_scalers import check_update_unscaled, live_scalers, made_scales_real
from .kernel_strides import strides_as_run
from .optimizer import add_optimizer_nodes, describe_optimizer
from .tracer import trace_step

__all__ = ["capture"]


def capture(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None = None,
            optimizer: torch.optim.Optimizer | None = None, *,
            device: str | torch.device | None = None,
            clip_grad_norm: float | None = None, steady_state: bool = False) -> Graph:
    """Capture forward, loss, backward and (with ``optimizer``: one, or a list stepped as one)
    the update of one step.

    ``clip_grad_norm``: clip the gradients' global L2 norm to this value between the backward
    and the update, as ``torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)``.
    ``steady_state``: the optimizer's state is an input of the update even where the optimizer
    has none yet (the graph of every step after the first; ``fitgraph.optimize`` plans it).

    The model's own ``torch.utils.checkpoint`` calls are traced as plain calls (the planner
    chooses what to recompute; ``graph.meta["user_checkpoints"]`` counts them, see
    ``capture.user_checkpoints``). Traced on fake tensors: no activation memory is used. A
    model built on the ``meta`` device is captured as if it lived on ``device`` (default cpu),
    so models bigger than this machine can be planned. Raises ``fitgraph.CaptureError`` naming the module and op for what cannot be
    captured.
    """
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else None
    optimizer = as_optimizer(optimizer)
    if optimizer is not None:
        describe_optimizer(optimizer)  # NOTE: fail before tracing, not after
    traced = trace_step(model, batch, loss_fn, dev, clip_grad_norm)
    scalers = live_scalers()
    if made_scales_real(scalers):
        # NOTE: a GradScaler made its scale while traced: traced again, reading the real one
        traced = trace_step(model, batch, loss_fn, dev, clip_grad_norm)
    input_names = [(f"param:{n}", Role.PARAMETER) for n in traced.param_names]
    input_names += [(f"buffer:{n}", Role.BUFFER) for n in traced.buffer_names]
    input_names += [(f"batch:{i}", Role.INPUT) for i in range(traced.n_batch)]
    cs, outputs, no_grad = fx_to_builder(traced, input_names)
    check_update_unscaled(cs.constants, optimizer, scalers)
    b = cs.b
    param_values = {n: b.inputs[i] for i, n in enumerate(traced.param_names)}
    grad_values = {k.removeprefix("grad:"): v for k, v in outputs.items() if k.startswith("grad:")}
    kind = None
    if optimizer is not None:
        kind = describe_optimizer(optimizer)
        names = {id(p): n for n, p in model.named_parameters()}  # NOTE: frozen ones too
        devs = {str(p.device) for p in model.parameters()}
        out_dev = str(dev or "cpu") if devs == {"meta"} else next(iter(devs))
        outputs.update(add_optimizer_nodes(b, optimizer, param_values=param_values,
                                           grad_values=grad_values, param_names=names,
                                           device=out_dev, steady_state=steady_state))
    graph = b.finish(outputs, meta={
        "model": type(model).__name__,
        "param_names": traced.param_names,
        "buffer_names": traced.buffer_names,
        "batch_spec": traced.batch_spec,
        "constants": cs.constants,
        "optimizer": kind,
        "clip_grad_norm": clip_grad_norm,
        "params_without_grad": no_grad,
        "capture_s": time.perf_counter() - t0,
        "user_checkpoints": traced.checkpoints,
        "flop_formula_errors": cs.flop_errors,
    }, inputs_first=True)
    for key, vid in graph.outputs.items():  # NOTE: finish renumbered the values
        if key.startswith("state:"):
            graph.values[vid].role = Role.OPTIMIZER_STATE
            graph.storages[graph.values[vid].storage].role = Role.OPTIMIZER_STATE
    verify_graph(graph)
    # NOTE: a table built in place from nothing and read again in the backward (BEiT's
    # relative position index) is a constant, as eager's cache holds it
    graph = fold_constant_tables(graph)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return graph  # NOTE: traced for a device it does not run on: nothing to run here
    # NOTE: and the strides each kernel makes, where fake tensors guessed others (a size-1
    # dim's stride, which later ops read to choose their memory format)
    return strides_as_run(graph)
