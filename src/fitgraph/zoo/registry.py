"""Registry of zoo models and the small helpers every model file shares.

Each model file registers one or more names with :func:`register`; :func:`build`
validates the name, the config and the overrides, and then calls the model's
builder. The helpers below make construction deterministic and let the same
code build on ``cpu``, ``cuda`` or ``meta``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BuildArgs", "ZooCase", "build", "configs", "hf_names", "names", "register"]


@dataclass
class ZooCase:
    """One ready-to-train model: the module, one batch, and how to get a loss.

    ``loss_fn(model, batch)`` returns a scalar loss. When ``loss_fn`` is None
    (Hugging Face models) the loss is ``model(**batch).loss``.
    """

    name: str
    config: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
    block_types: tuple[type, ...]
    description: str

    def loss(self, model: nn.Module | None = None, batch: Any = None) -> torch.Tensor:
        """The loss of ``model`` (default ``self.model``) on ``batch`` (default ``self.batch``),
        following the ``loss_fn`` / ``model(**batch).loss`` convention."""
        m = self.model if model is None else model
        b = self.batch if batch is None else batch
        if self.loss_fn is None:
            return m(**b).loss
        return self.loss_fn(m, b)


@dataclass(frozen=True)
class BuildArgs:
    """The normalised arguments of :func:`build`, handed to a model's builder."""

    name: str
    config: str
    batch_size: int | None
    seq_len: int | None
    image_size: int | None
    device: torch.device
    dtype: torch.dtype
    seed: int

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    @property
    def label(self) -> str:
        """How descriptions name the config: "small-proportions" or "paper-size"."""
        return {"small": "small-proportions", "paper": "paper-size"}.get(self.config, self.config)


@dataclass(frozen=True)
class _Entry:
    name: str
    builder: Callable[[BuildArgs], ZooCase]
    configs: tuple[str, ...]
    # Which of batch_size / seq_len / image_size the builder understands.
    overrides: tuple[str, ...]
    hf: bool


_REGISTRY: dict[str, _Entry] = {}


def register(
    names: str | Sequence[str],
    *,
    configs: Sequence[str] = ("small", "paper"),
    overrides: Sequence[str] = ("batch_size",),
    hf: bool = False,
) -> Callable[[Callable[[BuildArgs], ZooCase]], Callable[[BuildArgs], ZooCase]]:
    """Decorator: register ``builder(args: BuildArgs) -> ZooCase`` under ``names``."""
    if isinstance(names, str):
        names = (names,)

    def deco(builder: Callable[[BuildArgs], ZooCase]) -> Callable[[BuildArgs], ZooCase]:
        for n in names:
            if n in _REGISTRY:
                raise ValueError(f"zoo name {n!r} registered twice")
            _REGISTRY[n] = _Entry(n, builder, tuple(configs), tuple(overrides), hf)
        return builder

    return deco


def names() -> list[str]:
    """Built-in (plain PyTorch) model names, sorted."""
    return sorted(n for n, e in _REGISTRY.items() if not e.hf)


def hf_names() -> list[str]:
    """Hugging Face model names (building them needs ``transformers``), sorted."""
    return sorted(n for n, e in _REGISTRY.items() if e.hf)


def configs(name: str) -> list[str]:
    """The config names ``name`` accepts."""
    return list(_entry(name).configs)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown zoo model {name!r}; valid names: {', '.join(names())}"
            f" (Hugging Face: {', '.join(hf_names())})"
        ) from None


def build(
    name: str,
    config: str = "small",
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    image_size: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ZooCase:
    """Build zoo model ``name`` in ``config`` ("small" or "paper").

    Weights are random (``torch.manual_seed(seed)`` before construction) and the
    batch is drawn from a generator seeded with ``seed``, so two calls with the
    same arguments give identical weights and batches. ``device="meta"`` builds
    everything on the meta device without allocating memory.
    """
    entry = _entry(name)
    if config not in entry.configs:
        raise ValueError(
            f"unknown config {config!r} for zoo model {name!r}; valid configs: "
            f"{', '.join(entry.configs)}"
        )
    given = {"batch_size": batch_size, "seq_len": seq_len, "image_size": image_size}
    for key, value in given.items():
        if value is None:
            continue
        if key not in entry.overrides:
            raise ValueError(
                f"zoo model {name!r} does not take {key}; it takes "
                f"{', '.join(entry.overrides)}"
            )
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    args = BuildArgs(
        name=name,
        config=config,
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        device=torch.device(device),
        dtype=dtype,
        seed=seed,
    )
    return entry.builder(args)


# ----------------------------------------------------------------------------
# Helpers shared by the model files.
# ----------------------------------------------------------------------------


def construct(factory: Callable[[], nn.Module], args: BuildArgs) -> nn.Module:
    """Seed, build ``factory()`` directly on ``args.device`` and cast to ``args.dtype``."""
    torch.manual_seed(args.seed)
    # NOTE: building under the device context (rather than .to(device) afterwards)
    # is what makes meta builds of 1.5B-parameter models free.
    with torch.device(args.device):
        model = factory()
    model.to(dtype=args.dtype)
    model.train()
    return model


def generator(args: BuildArgs) -> torch.Generator:
    """A CPU generator seeded with ``args.seed``, for drawing the batch."""
    return torch.Generator(device="cpu").manual_seed(args.seed)


def rand_ints(shape: Sequence[int], high: int, gen: torch.Generator, args: BuildArgs) -> torch.Tensor:
    """Random int64 tensor in ``[0, high)`` on ``args.device``."""
    if args.is_meta:
        return torch.empty(tuple(shape), dtype=torch.long, device="meta")
    # NOTE: draw on CPU and move, so the batch is identical whatever the device.
    return torch.randint(0, high, tuple(shape), generator=gen).to(args.device)


def rand_floats(shape: Sequence[int], gen: torch.Generator, args: BuildArgs) -> torch.Tensor:
    """Standard-normal tensor of ``args.dtype`` on ``args.device``."""
    if args.is_meta:
        return torch.empty(tuple(shape), dtype=args.dtype, device="meta")
    return torch.randn(tuple(shape), generator=gen).to(device=args.device, dtype=args.dtype)


def rand_padding_mask(batch: int, seq: int, gen: torch.Generator, args: BuildArgs) -> torch.Tensor:
    """0/1 int64 attention mask: each row keeps a random prefix of >= seq/2 tokens."""
    if args.is_meta:
        return torch.empty((batch, seq), dtype=torch.long, device="meta")
    lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=gen)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return mask.to(args.device)


def pick(value: int | None, default: int) -> int:
    return default if value is None else value


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fmt_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.0f}K"


# Module-level loss functions (not lambdas) so a ZooCase can be pickled.


def token_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(input_ids)`` logits against ``labels`` (already shifted)."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def image_classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(pixel_values)`` against integer ``labels``."""
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])
