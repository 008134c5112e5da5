"""The torch optimizers a step captures, each as fitgraph knows it: which param-group settings
its update reads, which state it keeps per parameter, the state torch's lazy initialisation
makes, and its update for one parameter through torch's own functional implementation.

Every optimizer here updates each parameter from that parameter's gradient, state and group
alone (no norm or statistic across parameters), so one graph node per parameter is exactly
``optimizer.step()``; the node runs torch's functional update (``torch.optim.rmsprop.rmsprop``
...) on a one-parameter list, so the arithmetic, and the bits, are torch's. Not here, with the
reason in the capture error: ``LBFGS`` (a closure re-evaluating the loss), ``SparseAdam``
(sparse gradients), and subclasses (their ``step`` may be anything: Hugging Face's
``Adafactor`` is one). ``torch.optim.Adafactor`` keeps state not shaped like its parameter (a
matrix's row and column statistics): ``shapes`` says each such key's shape. ``torch.optim.Muon``
orthogonalises each matrix's momentum (Newton–Schulz iterations, matmuls whose FLOPs grow with
the matrix's smaller side cubed): its ``flops`` is a function of the shape. Several optimizers
stepped together (Muon for the matrices, AdamW for the rest) are ``CombinedOptimizer``.

SGD and Adam/AdamW keep their own route in ``execute/optimizer_ops`` (SGD's first step makes
its momentum buffer from the gradient; both run in row chunks); their entries here give the
settings, state and FLOPs the capture records.

Example:
    >>> import torch
    >>> kind = kind_of(torch.optim.RMSprop([torch.nn.Parameter(torch.ones(2))], centered=True))
    >>> kind.name, kind.keys({"momentum": 0.0, "centered": True})
    ('rmsprop', ('step', 'square_avg', 'grad_avg'))
    >>> kind_of(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(2))])) is None
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.optim import _adafactor, adadelta, adamax, asgd, nadam, radam, rmsprop, rprop
from torch.optim import adagrad as adagrad_mod
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["KINDS", "OptimizerKind", "UNSUPPORTED", "kind_of", "supported_names"]


def _step(p: torch.Tensor, group: dict) -> torch.Tensor:
    # NOTE: torch keeps the step counter on the host (capturable=False, which capture requires)
    return torch.tensor(0.0, dtype=_get_scalar_dtype())


def _zeros(p: torch.Tensor, group: dict) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _lr_of(group: dict):
    lr = group["lr"]
    return lr.item() if isinstance(lr, torch.Tensor) else lr


@dataclass(frozen=True)
class OptimizerKind:
    """One torch optimizer as the capture and the executor see it.

    ``hyper``: the param-group settings the update reads (snapshotted into the graph, so that
    the profiler runs an update without the optimizer). ``keys(group)``: the per-parameter
    state keys torch keeps with that group's settings, in the order its lazy initialisation
    makes them. ``fresh``: key -> (parameter, group) -> the tensor that initialisation makes
    (keys not named: zeros like the parameter). ``scalars``: the 0-d keys (step counters and
    the like), the rest are shaped like the parameter. ``update(param, grad, state, group,
    foreach)``: torch's functional update of one parameter (None: ``optimizer_ops``' own
    route). ``flops``: per element of the parameter, or a function of (shape, group) giving
    the update's FLOPs (``update_flops``), for the roofline model. ``shapes``: key
    -> the parameter's shape -> that state's shape, or None where torch keeps no such key
    for a parameter of that shape (keys not named: shaped like the parameter).
    ``complex_ok``: whether torch's update takes complex parameters."""

    name: str
    classes: tuple[type, ...]
    hyper: tuple[str, ...]
    keys: Callable[[dict], tuple[str, ...]]
    flops: int | Callable[[tuple, dict], float]
    scalars: frozenset[str] = frozenset({"step"})
    fresh: dict = field(default_factory=dict)
    update: Callable | None = None
    shapes: dict = field(default_factory=dict)
    complex_ok: bool = True

    def param_keys(self, group: dict, shape: tuple) -> tuple[str, ...]:
        """The state keys torch keeps for a parameter of ``shape`` in ``group``."""
        return tuple(k for k in self.keys(group)
                     if k not in self.shapes or self.shapes[k](shape) is not None)

    def update_flops(self, shape: tuple, group: dict) -> float:
        """The FLOPs of one update of a parameter of ``shape`` in ``group``."""
        if callable(self.flops):
            return float(self.flops(tuple(shape), group))
        return float(self.flops * math.prod(shape))

    def state_numel(self, group: dict, shape: tuple) -> int:
        """The elements of the state a parameter of ``shape`` in ``group`` keeps (0-d counters
        not counted)."""
        return sum(math.prod(self.state_shape(k, shape))
                   for k in self.param_keys(group, shape) if k not in self.scalars)

    def state_shape(self, key: str, shape: tuple) -> tuple:
        """The shape of state ``key`` of a parameter of ``shape``."""
        if key in self.scalars:
            return ()
        return tuple(self.shapes[key](shape)) if key in self.shapes else tuple(shape)

    def make(self, key: str, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The state ``key`` of parameter ``p`` as torch's lazy initialisation makes it."""
        if key in self.fresh or key == "step":
            return self.fresh.get(key, _step)(p, group)
        shape = self.state_shape(key, tuple(p.shape))
        return _zeros(p, group) if shape == tuple(p.shape) else p.new_zeros(shape)


def _rmsprop(p, g, s, group, foreach):
    rmsprop.rmsprop([p], [g], [s["square_avg"]], [s["grad_avg"]] if group["centered"] else [],
                    [s["momentum_buffer"]] if group["momentum"] > 0 else [], [s["step"]],
                    foreach=foreach, maximize=group["maximize"], differentiable=False,
                    capturable=False, has_complex=torch.is_complex(p), lr=group["lr"],
                    alpha=group["alpha"], eps=group["eps"],
                    weight_decay=group["weight_decay"], momentum=group["momentum"],
                    centered=group["centered"])


def _adagrad(p, g, s, group, foreach):
    adagrad_mod.adagrad([p], [g], [s["sum"]], [s["step"]], fused=group.get("fused") or None,
                        grad_scale=None, found_inf=None, has_sparse_grad=False,
                        foreach=foreach, differentiable=False, has_complex=torch.is_complex(p),
                        lr=group["lr"], weight_decay=group["weight_decay"],
                        lr_decay=group["lr_decay"], eps=group["eps"],
                        maximize=group["maximize"])


def _adamax(p, g, s, group, foreach):
    beta1, beta2 = group["betas"]
    adamax.adamax([p], [g], [s["exp_avg"]], [s["exp_inf"]], [s["step"]], foreach=foreach,
                  maximize=group["maximize"], differentiable=False, capturable=False,
                  has_complex=torch.is_complex(p), eps=group["eps"], beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"])


def _nadam(p, g, s, group, foreach):
    beta1, beta2 = group["betas"]
    nadam.nadam([p], [g], [s["exp_avg"]], [s["exp_avg_sq"]], [s["mu_product"]], [s["step"]],
                decoupled_weight_decay=group["decoupled_weight_decay"], foreach=foreach,
                capturable=False, differentiable=False, has_complex=torch.is_complex(p),
                maximize=group["maximize"], beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], momentum_decay=group["momentum_decay"],
                eps=group["eps"])


def _radam(p, g, s, group, foreach):
    beta1, beta2 = group["betas"]
    radam.radam([p], [g], [s["exp_avg"]], [s["exp_avg_sq"]], [s["step"]],
                decoupled_weight_decay=group["decoupled_weight_decay"], foreach=foreach,
                differentiable=False, capturable=False, has_complex=torch.is_complex(p),
                maximize=group["maximize"], beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"])


def _adadelta(p, g, s, group, foreach):
    adadelta.adadelta([p], [g], [s["square_avg"]], [s["acc_delta"]], [s["step"]],
                      capturable=False, foreach=foreach, differentiable=False,
                      has_complex=torch.is_complex(p), lr=group["lr"], rho=group["rho"],
                      eps=group["eps"], weight_decay=group["weight_decay"],
                      maximize=group["maximize"])


def _asgd(p, g, s, group, foreach):
    asgd.asgd([p], [g], [s["ax"]], [s["mu"]], [s["eta"]], [s["step"]], foreach=foreach,
              maximize=group["maximize"], differentiable=False, capturable=False,
              has_complex=torch.is_complex(p), lambd=group["lambd"], lr=group["lr"], t0=group["t0"],
              alpha=group["alpha"], weight_decay=group["weight_decay"])


def _rprop(p, g, s, group, foreach):
    etaminus, etaplus = group["etas"]
    step_size_min, step_size_max = group["step_sizes"]
    rprop.rprop([p], [g], [s["prev"]], [s["step_size"]], [s["step"]], foreach=foreach,
                capturable=False, maximize=group["maximize"], differentiable=False,
                has_complex=torch.is_complex(p), step_size_min=step_size_min,
                step_size_max=step_size_max, etaminus=etaminus, etaplus=etaplus)


def _adafactor_update(p, g, s, group, foreach):
    eps1, eps2 = group["eps"]
    if eps1 is None:
        # NOTE: torch's loop sets eps1 from the first parameter it updates and keeps it for
        # the group's others: a group of one dtype (the usual) is each parameter's own
        first = next((q for q in group.get("params", ()) if q.requires_grad), p)
        eps1 = torch.finfo(first.dtype).eps
    _adafactor.adafactor([p], [g], [s.get("row_var")], [s.get("col_var")], [s.get("variance")],
                         [s["step"]], foreach=foreach, grad_scale=None, found_inf=None,
                         has_complex=False, d=group["d"], lr=group["lr"],
                         beta2_decay=group["beta2_decay"], weight_decay=group["weight_decay"],
                         eps1=eps1, eps2=eps2, maximize=group["maximize"])


def _muon(p, g, s, group, foreach):
    # NOTE: torch's muon() refuses foreach=True (CUDA's default elsewhere): eager's step
    # passes none, so neither do we
    from torch.optim._muon import muon

    muon([p], [g], [s["momentum_buffer"]], lr=group["lr"],
         weight_decay=group["weight_decay"], momentum=group["momentum"],
         nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
         eps=group["eps"], ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"],
         has_complex=False)


def _muon_flops(shape: tuple, group: dict) -> float:
    """Muon's update of an m x n matrix (m <= n after its transpose): each Newton–Schulz
    step is X Xᵀ (2m²n), a cubic of that m x m Gram matrix (2m³) and its product with X
    (2m²n); the momentum, norm, decay and update are a dozen FLOPs an element."""
    if len(shape) != 2:
        return 0.0
    m, n = sorted(shape)
    return group["ns_steps"] * (4.0 * m * m * n + 2.0 * m ** 3) + 12.0 * m * n


def _factored(drop: int):
    """A matrix's statistic over dim -1 (``drop`` 1) or -2 (``drop`` 2), kept with that dim
    1; vectors and scalars keep none (Adafactor's ``row_var`` / ``col_var``)."""
    def shape(s: tuple) -> tuple | None:
        if len(s) < 2:
            return None
        out = list(s)
        out[-drop] = 1
        return tuple(out)
    return shape


def _on_device_scalar(value: Callable[[dict], float]):
    # NOTE: ASGD keeps its counters on the parameter's device, not the host
    return lambda p, group: torch.full((), value(group), dtype=_get_scalar_dtype(),
                                       device=p.device)


def _full_like(p: torch.Tensor, value: float) -> torch.Tensor:
    # NOTE: a complex parameter's two halves start as two reals (torch's rule)
    return torch.full_like(p, complex(value, value) if p.is_complex() else value,
                           memory_format=torch.preserve_format)


def _rprop_step_size(p: torch.Tensor, group: dict) -> torch.Tensor:
    return _full_like(p, _lr_of(group))


def _adagrad_step(p: torch.Tensor, group: dict) -> torch.Tensor:
    # NOTE: Adagrad makes its state when constructed; the fused kernel's counter on the device
    if group.get("fused"):
        return torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device)
    return _step(p, group)


def _adagrad_sum(p: torch.Tensor, group: dict) -> torch.Tensor:
    return _full_like(p, group["initial_accumulator_value"])


# NOTE: FLOPs counted from torch's single-tensor loops (a multiply-add as two); only the
# roofline model reads them, the measured model times the update
KINDS: dict[str, OptimizerKind] = {k.name: k for k in (
    OptimizerKind("sgd", (torch.optim.SGD,),
                  ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                   "fused"),
                  lambda g: ("momentum_buffer",) if g["momentum"] != 0 else (), 4,
                  scalars=frozenset()),
    OptimizerKind("adam", (torch.optim.Adam, torch.optim.AdamW),
                  ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                   "decoupled_weight_decay", "fused"),
                  lambda g: ("step", "exp_avg", "exp_avg_sq")
                  + (("max_exp_avg_sq",) if g["amsgrad"] else ()), 12),
    OptimizerKind("rmsprop", (torch.optim.RMSprop,),
                  ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
                  lambda g: ("step", "square_avg") + (("momentum_buffer",) if g["momentum"] > 0
                                                      else ())
                  + (("grad_avg",) if g["centered"] else ()), 8, update=_rmsprop),
    OptimizerKind("adagrad", (torch.optim.Adagrad,),
                  ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps",
                   "maximize", "fused"),
                  lambda g: ("step", "sum"), 6, fresh={"step": _adagrad_step, "sum": _adagrad_sum}, update=_adagrad),
    OptimizerKind("adamax", (torch.optim.Adamax,),
                  ("lr", "betas", "eps", "weight_decay", "maximize"),
                  lambda g: ("step", "exp_avg", "exp_inf"), 9, update=_adamax),
    OptimizerKind("nadam", (torch.optim.NAdam,),
                  ("lr", "betas", "eps", "weight_decay", "momentum_decay",
                   "decoupled_weight_decay", "maximize"),
                  lambda g: ("step", "mu_product", "exp_avg", "exp_avg_sq"), 14,
                  scalars=frozenset({"step", "mu_product"}),
                  fresh={"mu_product": lambda p, g: torch.tensor(1.0,
                                                                 dtype=_get_scalar_dtype())},
                  update=_nadam),
    OptimizerKind("radam", (torch.optim.RAdam,),
                  ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "maximize"),
                  lambda g: ("step", "exp_avg", "exp_avg_sq"), 14, update=_radam),
    OptimizerKind("adadelta", (torch.optim.Adadelta,),
                  ("lr", "rho", "eps", "weight_decay", "maximize"),
                  lambda g: ("step", "square_avg", "acc_delta"), 10, update=_adadelta),
    OptimizerKind("asgd", (torch.optim.ASGD,),
                  ("lr", "lambd", "alpha", "t0", "weight_decay", "maximize"),
                  lambda g: ("step", "eta", "mu", "ax"), 6,
                  scalars=frozenset({"step", "eta", "mu"}),
                  fresh={"step": _on_device_scalar(lambda g: 0.0),
                         "eta": _on_device_scalar(_lr_of),
                         "mu": _on_device_scalar(lambda g: 1.0)},
                  update=_asgd),
    OptimizerKind("rprop", (torch.optim.Rprop,),
                  ("lr", "etas", "step_sizes", "maximize"),
                  lambda g: ("step", "prev", "step_size"), 8,
                  fresh={"step_size": _rprop_step_size}, update=_rprop),
    OptimizerKind("adafactor", (torch.optim.Adafactor,),
                  ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize"),
                  lambda g: ("step", "row_var", "col_var", "variance"), 14,
                  shapes={"row_var": _factored(1), "col_var": _factored(2),
                          "variance": lambda s: s if len(s) < 2 else None},
                  update=_adafactor_update, complex_ok=False),
)}
if hasattr(torch.optim, "Muon"):  # NOTE: torch >= 2.9
    KINDS["muon"] = OptimizerKind(
        "muon", (torch.optim.Muon,),
        ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
         "adjust_lr_fn"),
        lambda g: ("momentum_buffer",), _muon_flops, scalars=frozenset(), update=_muon,
        complex_ok=False)

_BY_CLASS = {cls: k for k in KINDS.values() for cls in k.classes}

# NOTE: why the others are refused (the capture error says it)
UNSUPPORTED = {
    "LBFGS": "its step re-evaluates the loss through a closure, many times a step",
    "SparseAdam": "it updates sparse gradients only",
}


def kind_of(optimizer: torch.optim.Optimizer) -> OptimizerKind | None:
    """The kind of ``optimizer`` (its exact class: a subclass's ``step`` may do anything), or
    None where fitgraph cannot capture its update."""
    return _BY_CLASS.get(type(optimizer))


def supported_names() -> str:
    """The supported optimizers' class names, for error messages."""
    return ", ".join(cls.__name__ for k in KINDS.values() for cls in k.classes)
