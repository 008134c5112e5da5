"""Classic U-Net (Ronneberger et al. 2015, "same" padding) in plain PyTorch.

Encoder: a double conv (3x3 conv, GroupNorm, ReLU, twice) per level, with
``MaxPool2d(2)`` between levels. Decoder: the two deepest levels upsample with
``ConvTranspose2d(2, stride=2)``, the two shallowest with
``nn.Upsample(scale_factor=2, mode="bilinear")`` + 3x3 conv; each concatenates
the encoder skip and runs a double conv. A 1x1 conv gives per-pixel class
logits; the loss is per-pixel cross-entropy on random labels.

Paper config: base 64 channels (64..1024), 3 input channels, 2 classes,
batch 32 at 256x256 (~31M params).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .registry import (
    BuildArgs,
    ZooCase,
    construct,
    count_params,
    fmt_params,
    generator,
    pick,
    rand_floats,
    rand_ints,
    register,
)


@dataclass(frozen=True)
class UNetConfig:
    base: int  # channels at full resolution; level i has base * 2**i
    in_chans: int
    num_classes: int
    image_size: int
    batch_size: int
    depth: int = 4  # number of 2x down-samplings
    n_transpose: int = 2  # deepest decoder levels that use ConvTranspose2d


# NOTE: small keeps the 4-level topology at 1/8 of the channels, at 128x128:
# weights shrink 64x, activations per image ~32x, so activations dominate.
# Measured (fp32, 1 CPU thread, forward+backward): 0.49M params, ~0.37 s,
# peak 106 MB, weights+grads 4 MB: activations 94%.
_CONFIGS = {
    "small": UNetConfig(8, 3, 2, image_size=128, batch_size=8),
    "paper": UNetConfig(64, 3, 2, image_size=256, batch_size=32),
}


def _groups(ch: int) -> int:
    # NOTE: GroupNorm (not BatchNorm) so the U-Net has a norm without running
    # statistics: no buffer mutation in the step (ResNet-50 covers BatchNorm).
    return 8 if ch % 8 == 0 else 1


class DoubleConv(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
            nn.GroupNorm(_groups(out_ch), out_ch),
            nn.ReLU(),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
            nn.GroupNorm(_groups(out_ch), out_ch),
            nn.ReLU(),
        )


class EncoderStage(nn.Module):
    """(Max-pool, then) double conv: one U-Net stage, a checkpointing unit."""

    def __init__(self, in_ch: int, out_ch: int, pool: bool) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))


class DecoderStage(nn.Module):
    """Up-sample 2x, concatenate the skip, double conv: a checkpointing unit."""

    def __init__(self, in_ch: int, out_ch: int, transpose: bool) -> None:
        super().__init__()
        self.up: nn.Module
        if transpose:
            self.up = nn.ConvTranspose2d(in_ch, in_ch // 2, 2, stride=2)
        else:
            self.up = nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                nn.Conv2d(in_ch, in_ch // 2, 3, padding=1),
            )
        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        # NOTE: "same" padding keeps skip and up-sampled maps the same size, so
        # no cropping is needed (the 2015 paper used valid convs and cropped).
        return self.conv(torch.cat((skip, self.up(x)), dim=1))


class UNet(nn.Module):
    """``forward(pixel_values [B, C, H, W]) -> logits [B, num_classes, H, W]``."""

    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        chans = [cfg.base * 2**i for i in range(cfg.depth + 1)]
        self.encoder = nn.ModuleList(
            EncoderStage(cfg.in_chans if i == 0 else chans[i - 1], chans[i], pool=i > 0)
            for i in range(cfg.depth + 1)
        )
        self.decoder = nn.ModuleList(
            DecoderStage(chans[i], chans[i - 1], transpose=i > cfg.depth - cfg.n_transpose)
            for i in range(cfg.depth, 0, -1)
        )
        self.head = nn.Conv2d(chans[0], cfg.num_classes, 1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        skips = []
        x = pixel_values
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        skips.pop()  # the bottleneck output is x itself
        for stage in self.decoder:
            x = stage(x, skips.pop())
        return self.head(x)


def segmentation_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])


@register("unet", overrides=("batch_size", "image_size"))
def build(args: BuildArgs) -> ZooCase:
    cfg = _CONFIGS[args.config]
    B, S = pick(args.batch_size, cfg.batch_size), pick(args.image_size, cfg.image_size)
    if S % 2**cfg.depth:
        raise ValueError(f"unet image_size must be a multiple of {2**cfg.depth}, got {S}")
    cfg = replace(cfg, batch_size=B, image_size=S)
    model = construct(lambda: UNet(cfg), args)
    gen = generator(args)
    batch = {
        "pixel_values": rand_floats((B, cfg.in_chans, S, S), gen, args),
        "labels": rand_ints((B, S, S), cfg.num_classes, gen, args),
    }
    desc = (
        f"U-Net {args.label}: {cfg.depth} levels, channels {cfg.base}..{cfg.base * 2**cfg.depth}, "
        f"GroupNorm, {S}x{S}x{cfg.in_chans} images, {cfg.num_classes} classes, batch {B}, "
        f"{fmt_params(count_params(model))} params"
    )
    return ZooCase(
        args.name, args.config, model, batch, segmentation_loss, (EncoderStage, DecoderStage), desc
    )
