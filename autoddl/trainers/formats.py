"""One entry point per direction for the trainers' formats: ``write_config`` and ``read_config``."""

from __future__ import annotations

from autoddl.trainers import TrainerConfig, TrainerConfigError
from autoddl.trainers.megatron import from_megatron, to_megatron
from autoddl.trainers.torchtitan import from_torchtitan, to_torchtitan

TRAINERS = ("torchtitan", "megatron")
DEFAULT_OUT = {"torchtitan": "torchtitan.toml", "megatron": "megatron_flags.txt"}
NAMES = {"torchtitan": "torchtitan", "megatron": "Megatron-LM"}


def _known(trainer: str) -> None:
    if trainer not in TRAINERS:
        raise TrainerConfigError(f"trainer {trainer!r}: choose one of {list(TRAINERS)}")


def write_config(trainer: str, config: TrainerConfig, header: list[str] = ()) -> str:
    """``config`` in ``trainer``'s format (TOML or flags), ``header`` lines as comments first."""
    _known(trainer)
    return to_torchtitan(config, list(header)) if trainer == "torchtitan" else to_megatron(config, list(header))


def check_expressible(trainer: str, config: TrainerConfig) -> None:
    """Raises TrainerConfigError, saying what, when ``trainer`` cannot express ``config``."""
    write_config(trainer, config)


def read_config(trainer: str, text: str, *, devices: int | None = None, num_layers: int | None = None,
                source: str = "") -> tuple[TrainerConfig, list[str]]:
    """(the configuration, the flags or keys not read) of ``trainer``'s TOML / flags."""
    _known(trainer)
    if trainer == "torchtitan":
        return from_torchtitan(text, devices=devices, num_layers=num_layers, source=source or "job.toml"), []
    return from_megatron(text, devices=devices, num_layers=num_layers, source=source or "--from-megatron")
