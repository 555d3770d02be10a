"""MLP: a deep, wide stack of Linear + activation layers, regressed onto a target.

n_layers Linear(width, width) layers, each followed by an activation except the
last. The simplest model on which data, tensor (Megatron column/row) and
ZeRO/FSDP parallelism all make sense, so the planner's choices are easy to check.

Presets (PRESETS below; default "tiny"):
  tiny   4 layers x 64 wide, batch 8                (16.6K params)
  large  16 layers x 8192 wide, batch 1024          (1.07B params)

Sizes are set by keyword, then environment variable, then preset:
  build_model("tiny", n_layers=2)                    keyword wins
  AUTODDL_MLP_PRESET=large or AUTODDL_PRESET=large   picks the preset
  AUTODDL_MLP_<FIELD>=value, FIELD one of N_LAYERS WIDTH ACTIVATION BIAS BATCH_SIZE

Inputs: (x, target), both (B, width) float; forward(x, target=None) returns
(B, width); loss_fn(out, x, target) is the mean squared error.
"""

# No `from __future__ import annotations`: dataclasses would then need this module in
# sys.modules, which a loader importing the file by path may not have set up.
import dataclasses
import os
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
ENV_PREFIX = "AUTODDL_MLP_"


def config(preset: str | None = None, **overrides) -> MLPConfig:
    """The preset's config with env-var and keyword overrides applied (keyword > env > preset)."""
    name = preset or os.environ.get(ENV_PREFIX + "PRESET") or os.environ.get("AUTODDL_PRESET") or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"mlp: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"mlp: unknown config field(s) {sorted(unknown)}; valid fields: {sorted(fields)}")
    values = {}
    for field in sorted(fields):
        env = os.environ.get(ENV_PREFIX + field.upper())
        if field in overrides:
            values[field] = overrides[field]
        elif env is not None:
            values[field] = _parse(env, getattr(base, field), ENV_PREFIX + field.upper())
    return dataclasses.replace(base, **values)


def _parse(text: str, like, var: str):
    """Convert an env-var string to the type of the preset's value ``like``."""
    try:
        if isinstance(like, bool):
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("1", "true", "yes")
        return type(like)(text)
    except ValueError:
        raise ValueError(f"{var}={text!r} is not a valid {type(like).__name__}") from None


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
