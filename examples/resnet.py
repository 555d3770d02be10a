"""ResNet-50: a conv stem, four stages of bottleneck blocks (3-4-6-3), average pool, fc.

He et al. (2015) with the stride on the 3x3 conv of each bottleneck (the
"v1.5" layout torchvision uses; 25,557,032 params at 1000 classes). Every conv
is followed by BatchNorm (train mode: batch statistics, running-stat updates)
and ReLU; a 1x1 conv + BatchNorm projects the shortcut where shapes change.

Presets (PRESETS below; default "resnet50"):
  resnet50  blocks 3-4-6-3, base width 64, 1000 classes, batch 32 x 3 x 224 x 224
  tiny      blocks 1-1-1-1, base width 8, 16 classes, batch 4 x 3 x 32 x 32

Sizes are set by keyword, then preset (the file reads no environment):
  build_model("tiny", num_classes=8)       keyword wins
  on the command line: --preset NAME --set FIELD=VALUE (one --set per field)

Inputs: (images (B, 3, H, W) float32, labels (B,) int64); forward(images,
labels=None) returns logits (B, num_classes); loss_fn(logits, images, labels)
is the cross entropy.
"""

# No `from __future__ import annotations`: dataclasses would then need this module in
# sys.modules, which a loader importing the file by path may not have set up.
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EXPANSION = 4  # a bottleneck's output has 4x the channels of its 3x3 conv


@dataclass(frozen=True)
class ResNetConfig:
    layers: tuple[int, ...] = (3, 4, 6, 3)  # bottleneck blocks per stage
    base_width: int = 64                    # stem channels; stage i's 3x3 conv has base_width * 2**i
    num_classes: int = 1000
    image_size: int = 224                   # example_inputs height = width
    batch_size: int = 32                    # example_inputs batch

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
        if len(self.layers) != 4 or min(self.layers) < 1:
            raise ValueError(f"resnet config: layers={self.layers} must be 4 stage depths, each >= 1")
        if self.image_size % 32:
            raise ValueError(f"resnet config: image_size={self.image_size} must be a multiple of 32")


PRESETS: dict[str, ResNetConfig] = {
    "resnet50": ResNetConfig(),
    "tiny": ResNetConfig(layers=(1, 1, 1, 1), base_width=8, num_classes=16, image_size=32, batch_size=4),
}
DEFAULT_PRESET = "resnet50"


def config(preset: str | None = None, **overrides) -> ResNetConfig:
    """The preset's config with keyword overrides applied (keyword > preset)."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"resnet: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"resnet: unknown config field(s) {sorted(unknown)}; valid fields: {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


def conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Conv (no bias: BatchNorm's shift replaces it) followed by BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = width * EXPANSION
        self.conv1 = conv_bn(c_in, width, 1)               # reduce
        self.conv2 = conv_bn(width, width, 3, stride)      # spatial (and stride)
        self.conv3 = conv_bn(width, c_out, 1)              # expand
        self.downsample = conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # (B, 4w, H/s, W/s)
        out = F.relu(self.conv1(x))                                      # (B, w, H, W)
        out = F.relu(self.conv2(out))                                    # (B, w, H/s, W/s)
        out = self.conv3(out)                                            # (B, 4w, H/s, W/s)
        return F.relu(out + identity)                                    # (B, 4w, H/s, W/s)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.config = cfg
        w = cfg.base_width
        self.stem = conv_bn(3, w, 7, stride=2)                         # (B, w, H/2, W/2)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)  # (B, w, H/4, W/4)
        stages, c_in = [], w
        for i, depth in enumerate(cfg.layers):
            width, stride = w * 2 ** i, 1 if i == 0 else 2
            blocks = [Bottleneck(c_in, width, stride)]
            c_in = width * EXPANSION
            blocks += [Bottleneck(c_in, width, 1) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.maxpool(F.relu(self.stem(images)))  # (B, w, H/4, W/4)
        x = self.layer1(x)                           # (B, 4w, H/4, W/4)
        x = self.layer2(x)                           # (B, 8w, H/8, W/8)
        x = self.layer3(x)                           # (B, 16w, H/16, W/16)
        x = self.layer4(x)                           # (B, 32w, H/32, W/32)
        x = torch.flatten(self.avgpool(x), 1)        # (B, 32w)
        return self.fc(x)                            # (B, num_classes)


def build_model(preset: str | None = None, **overrides) -> ResNet:
    """A ResNet with the preset's sizes (see the module docstring for presets and overrides)."""
    return ResNet(config(preset, **overrides))


def example_inputs(preset: str | None = None, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch: images (B, 3, S, S) float32 and labels (B,) int64."""
    cfg = config(preset, **overrides)
    images = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)        # (B, 3, S, S)
    labels = torch.randint(0, cfg.num_classes, (cfg.batch_size,), dtype=torch.long)  # (B,)
    return images, labels


def loss_fn(logits: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits (B, num_classes) against labels (B,)."""
    return F.cross_entropy(logits, labels)
