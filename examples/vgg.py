"""VGG-16: 13 conv3x3 + ReLU layers in 5 max-pooled stages, then 3 fully connected layers.

The layout of Simonyan & Zisserman (2014), configuration "D", with
torchvision's adaptive average pool before the classifier (138.36M params at
1000 classes). Convolutions dominate the FLOPs, the first FC layer the
parameters: a classic case for data parallel convolutions and sharded FC layers.

Presets (PRESETS below; default "vgg16"):
  vgg16   channels 64..512, FC 4096, 1000 classes, dropout 0.5, batch 32 x 3 x 224 x 224
  tiny    channels / 8 (8..64), FC 64, 16 classes, no dropout, pool 1, batch 4 x 3 x 32 x 32

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

# VGG configuration "D": output channels of each conv3x3, "M" = 2x2 max pool
VGG16_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


@dataclass(frozen=True)
class VGGConfig:
    width_divisor: int = 1     # every conv's channels are divided by this
    fc_width: int = 4096       # hidden width of the two first FC layers
    num_classes: int = 1000
    dropout: float = 0.5       # after each of the two hidden FC layers; 0 leaves it out
    pool_size: int = 7         # adaptive average pool output (pool_size x pool_size) before the FCs
    image_size: int = 224      # example_inputs height = width
    batch_size: int = 32       # example_inputs batch

    def __post_init__(self) -> None:
        if 64 % self.width_divisor:
            raise ValueError(f"vgg config: width_divisor={self.width_divisor} must divide 64")
        if self.image_size % 32:
            raise ValueError(f"vgg config: image_size={self.image_size} must be a multiple of 32 (5 max pools)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"vgg config: dropout={self.dropout} must be in [0, 1)")


PRESETS: dict[str, VGGConfig] = {
    "vgg16": VGGConfig(),
    "tiny": VGGConfig(width_divisor=8, fc_width=64, num_classes=16, dropout=0.0, pool_size=1,
                      image_size=32, batch_size=4),
}
DEFAULT_PRESET = "vgg16"


def config(preset: str | None = None, **overrides) -> VGGConfig:
    """The preset's config with keyword overrides applied (keyword > preset)."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"vgg: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"vgg: unknown config field(s) {sorted(unknown)}; valid fields: {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


class VGG(nn.Module):
    def __init__(self, cfg: VGGConfig):
        super().__init__()
        self.config = cfg
        layers: list[nn.Module] = []
        channels = 3
        for item in VGG16_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out = item // cfg.width_divisor
                layers += [nn.Conv2d(channels, out, kernel_size=3, padding=1), nn.ReLU()]
                channels = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(cfg.pool_size)

        def drop() -> nn.Module:
            return nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

        self.classifier = nn.Sequential(
            nn.Linear(channels * cfg.pool_size * cfg.pool_size, cfg.fc_width), nn.ReLU(), drop(),
            nn.Linear(cfg.fc_width, cfg.fc_width), nn.ReLU(), drop(),
            nn.Linear(cfg.fc_width, cfg.num_classes),
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.features(images)    # (B, 3, H, W) -> (B, C, H/32, W/32)
        x = self.avgpool(x)          # (B, C, p, p)
        x = torch.flatten(x, 1)      # (B, C*p*p)
        return self.classifier(x)    # (B, num_classes)


def build_model(preset: str | None = None, **overrides) -> VGG:
    """A VGG-16 with the preset's sizes (see the module docstring for presets and overrides)."""
    return VGG(config(preset, **overrides))


def example_inputs(preset: str | None = None, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch: images (B, 3, S, S) float32 and labels (B,) int64."""
    cfg = config(preset, **overrides)
    images = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)        # (B, 3, S, S)
    labels = torch.randint(0, cfg.num_classes, (cfg.batch_size,), dtype=torch.long)  # (B,)
    return images, labels


def loss_fn(logits: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits (B, num_classes) against labels (B,)."""
    return F.cross_entropy(logits, labels)
