"""MLP: a deep, wide stack of Linear + activation layers, regressed onto a target.

n_layers Linear(width, width) layers, each followed by an activation except the
last. The simplest model on which data, tensor (Megatron column/row) and
ZeRO/FSDP parallelism all make sense, so the planner's choices are easy to check.

Presets (PRESETS below; default "tiny"):
  tiny   4 layers x 64 wide, batch 8                (16.6K params)
  large  16 layers x 8192 wide, batch 1024          (1.07B params)

Sizes are set by keyword, then preset (the file reads no environment):
  build_model("tiny", n_layers=2)          keyword wins
  on the command line: --preset NAME --set FIELD=VALUE (one --set per field)

Inputs: (x, target), both (B, width) float; forward(x, target=None) returns
(B, width); loss_fn(out, x, target) is the mean squared error.
"""

# No `from __future__ import annotations`: dataclasses would then need this module in
# sys.modules, which a loader importing the file by path may not have set up.
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


@dataclass(frozen=True)
class MLPConfig:
    n_layers: int
    width: int
    activation: str = "relu"   # one of ACTIVATIONS
    bias: bool = True
    batch_size: int = 8        # example_inputs batch

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"mlp config: activation={self.activation!r}; choose one of {sorted(ACTIVATIONS)}")
        if self.n_layers < 1:
            raise ValueError(f"mlp config: n_layers={self.n_layers} must be at least 1")


PRESETS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(n_layers=4, width=64, batch_size=8),
    "large": MLPConfig(n_layers=16, width=8192, batch_size=1024),
}
DEFAULT_PRESET = "tiny"


def config(preset: str | None = None, **overrides) -> MLPConfig:
    """The preset's config with keyword overrides applied (keyword > preset)."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"mlp: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"mlp: unknown config field(s) {sorted(unknown)}; valid fields: {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        layers: list[nn.Module] = []
        for i in range(cfg.n_layers):
            layers.append(nn.Linear(cfg.width, cfg.width, bias=cfg.bias))
            if i < cfg.n_layers - 1:
                layers.append(ACTIVATIONS[cfg.activation]())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        return self.layers(x)  # (B, W) -> (B, W)


def build_model(preset: str | None = None, **overrides) -> MLP:
    """An MLP with the preset's sizes (see the module docstring for presets and overrides)."""
    return MLP(config(preset, **overrides))


def example_inputs(preset: str | None = None, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch: (x, target), both (batch_size, width) float32."""
    cfg = config(preset, **overrides)
    x = torch.randn(cfg.batch_size, cfg.width)       # (B, W)
    target = torch.randn(cfg.batch_size, cfg.width)  # (B, W)
    return x, target


def loss_fn(out: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the output (B, W) against the target (B, W)."""
    return F.mse_loss(out, target)
