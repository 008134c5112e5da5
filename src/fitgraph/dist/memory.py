"""What a device holds for its parameters: weights, gradients and optimizer state, with ZeRO.

Mixed precision with Adam/AdamW (Megatron-LM's, DeepSpeed's): 16-bit weights (2 B) and
gradients (2 B), a float32 master copy (4 B) and Adam's two moments (8 B) — 16 B per
parameter. ZeRO (Rajbhandari et al., SC'20) shards over the ``dp`` data-parallel replicas:
stage 1 the optimizer state (master copy and moments), stage 2 the gradients too, stage 3 (FSDP)
the weights too, gathered block by block when used.

Example:
    >>> terms = parameter_bytes(1e9, MIXED_ADAM, zero=1, dp=8)
    >>> {k: v / 1e9 for k, v in terms.items()}
    {'weights': 2.0, 'gradients': 2.0, 'optimizer': 1.5}
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FP32_ADAM", "MIXED_ADAM", "MIXED_SGD", "PRECISIONS", "Precision", "parameter_bytes",
           "optimizer_step_bytes", "optimizer_temp_bytes"]


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter: ``weight`` and ``grad`` as computed and reduced, ``master`` (a
    float32 copy the optimizer updates; 0 when the weights are float32 already), ``state`` (the
    optimizer's: Adam's two moments are 8 B in float32, SGD with momentum 4, plain SGD 0)."""

    name: str
    weight: int
    grad: int
    master: int
    state: float
    activation_dtype: str = "bfloat16"
    # the optimizer step's temporaries: "none" (a fused kernel: Megatron's, apex's), "torch"
    # (torch.optim's Adam/AdamW: ``optimizer_temp_bytes``)
    step_temp: str = "none"

    @property
    def per_parameter(self) -> int:
        return self.weight + self.grad + self.master + self.state


MIXED_ADAM = Precision("mixed-adam", 2, 2, 4, 8)
FP32_ADAM = Precision("fp32-adam", 4, 4, 0, 8, activation_dtype="float32", step_temp="torch")
MIXED_SGD = Precision("mixed-sgd", 2, 2, 4, 0)
PRECISIONS = {p.name: p for p in (MIXED_ADAM, FP32_ADAM, MIXED_SGD)}


def parameter_bytes(params: float, precision: Precision, zero: int, dp: int) -> dict[str, float]:
    """Bytes one device holds for ``params`` parameters (its share of the model) under ZeRO
    stage ``zero`` over ``dp`` replicas."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {zero}: one of 0, 1, 2, 3")
    if dp < 1 or params < 0:
        raise ValueError(f"{params} parameters over {dp} replicas")
    opt = (precision.master + precision.state) * params
    return {"weights": precision.weight * params / (dp if zero >= 3 else 1),
            "gradients": precision.grad * params / (dp if zero >= 2 else 1),
            "optimizer": opt / (dp if zero >= 1 else 1)}


def optimizer_step_bytes(params: float, precision: Precision, zero: int, dp: int) -> float:
    """Device-memory bytes the optimizer step moves: it reads the gradient, reads and writes the
    master copy and the state, writes the 16-bit weight — for the parameters this device
    updates (``1/dp`` of them from ZeRO-1 on)."""
    mine = params / (dp if zero >= 1 else 1)
    return mine * (precision.grad + 2 * precision.master + 2 * precision.state
                   + (precision.weight if precision.master else 0))


def optimizer_temp_bytes(precision: Precision, largest: float, params: float, zero: int,
                         dp: int, cpu: bool) -> float:
    """Bytes the optimizer step allocates for a moment, beyond the state it keeps: torch's
    Adam/AdamW on the CPU updates one tensor at a time (``sqrt(v)`` and its quotient: two
    temporaries of the largest tensor, ``largest`` elements; FSDP's shards from ZeRO-2 on),
    on a GPU all at once (``_foreach_sqrt`` of every second moment: one moment's bytes of the
    parameters this device updates); a fused step none.

    Example:
        >>> optimizer_temp_bytes(FP32_ADAM, 1000, 5000, 0, 1, cpu=True)
        8000.0
    """
    if precision.step_temp == "none" or not precision.state:
        return 0.0
    moment = precision.state / 2
    if cpu:
        return 2.0 * moment * largest / (dp if zero >= 2 else 1)
    return moment * params / (dp if zero >= 1 else 1)
