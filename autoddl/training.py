"""Training settings: how a step is run, independent of how ops are sharded.

A plan carries one ``Training``; the lowering (autoddl/program.py) turns it into
tasks of the step program, which the cost model prices and the executor runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

DEFAULT_BUCKET_MB = 25.0   # DistributedDataParallel's default bucket_cap_mb (torch/nn/parallel/distributed.py)


@dataclass(frozen=True)
class Training:
    """``bucket_mb``: gradient-sync bucket size (MB = 1e6 bytes of local gradients); 0 syncs each
    parameter on its own."""

    bucket_mb: float = DEFAULT_BUCKET_MB

    def __post_init__(self) -> None:
        if not self.bucket_mb >= 0:
            raise ValueError(f"training.bucket_mb must be >= 0 (MB of gradients per bucket), got {self.bucket_mb!r}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1e6)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, source: str = "plan") -> "Training":
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: training has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data)
