"""ResNet-50 (bottleneck ResNet, v1.5 strides) in plain PyTorch, no torchvision.

7x7 stem conv + BatchNorm + ReLU + 3x3 max-pool, four stages of bottleneck
blocks (3, 4, 6, 3), adaptive average pool and a linear classifier. Loss:
cross-entropy on random labels.

Paper config: ResNet-50, 1000 classes (~25.6M params), batch 64 at 224x224.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .registry import (
    BuildArgs,
    ZooCase,
    construct,
    count_params,
    fmt_params,
    generator,
    image_classification_loss,
    pick,
    rand_floats,
    rand_ints,
    register,
)


@dataclass(frozen=True)
class ResNetConfig:
    layers: tuple[int, ...]
    width: int  # channels of the first stage's 3x3 convs (64 in ResNet-50)
    num_classes: int
    image_size: int
    batch_size: int


# NOTE: small keeps all 16 bottlenecks but at 1/4 of the width (16 instead of
# 64), at 128x128: the parameter count shrinks 16x while the activations per
# image shrink only ~13x (width/4 times resolution 0.33x), so they dominate.
# Measured (fp32, 1 CPU thread, forward+backward, batch 16): 2.0M params,
# ~0.37 s, peak 120 MB, weights+grads 15 MB: activations 85%.
_CONFIGS = {
    "small": ResNetConfig((3, 4, 6, 3), 16, 1000, image_size=128, batch_size=16),
    "paper": ResNetConfig((3, 4, 6, 3), 64, 1000, image_size=224, batch_size=64),
}


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, v1.5), 1x1 expand, plus the shortcut."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        # NOTE: ReLU is not in-place, so the captured graph stays functional
        # (no mutation of activations a planner would have to order around).
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """``forward(pixel_values [B, 3, H, W]) -> logits [B, num_classes]``."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        in_ch = w
        for i, n in enumerate(cfg.layers):
            width = w * 2**i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(in_ch, width, stride=2 if (j == 0 and i > 0) else 1))
                in_ch = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # NOTE: no zero-init of the last BN per block (torchvision's default too):
        # with it every conv in a residual branch would get an all-zero gradient.

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@register("resnet50", overrides=("batch_size", "image_size"))
def build(args: BuildArgs) -> ZooCase:
    cfg = _CONFIGS[args.config]
    B, S = pick(args.batch_size, cfg.batch_size), pick(args.image_size, cfg.image_size)
    if S < 32:
        raise ValueError(f"resnet50 image_size must be >= 32 (5 stride-2 stages), got {S}")
    cfg = replace(cfg, batch_size=B, image_size=S)
    model = construct(lambda: ResNet(cfg), args)
    gen = generator(args)
    batch = {
        "pixel_values": rand_floats((B, 3, S, S), gen, args),
        "labels": rand_ints((B,), cfg.num_classes, gen, args),
    }
    desc = (
        f"ResNet-50 {args.label}: bottlenecks {'-'.join(map(str, cfg.layers))}, "
        f"base width {cfg.width}, {S}x{S} images, batch {B}, "
        f"{fmt_params(count_params(model))} params"
    )
    return ZooCase(
        args.name, args.config, model, batch, image_classification_loss, (Bottleneck,), desc
    )
