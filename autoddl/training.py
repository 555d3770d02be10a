"""Training settings: how a step is run, independent of how ops are sharded.

A plan carries one ``Training``; the lowering (autoddl/lowering.py) turns it into
tasks of the step program, which the cost model prices and the executor runs.

- ``bucket_mb``: gradient-sync bucket size (MB = 1e6 bytes of local gradients); 0
  syncs each parameter on its own.
- ``param_dtype`` / ``reduce_dtype``: the mixed-precision policy, named as FSDP2's
  ``MixedPrecisionPolicy``: parameters are kept (and updated, with the optimizer's
  states) in float32; forward and backward compute with working copies in
  ``param_dtype`` (activations in it too); gradients are reduced across ranks in
  ``reduce_dtype`` (None: ``param_dtype``, as FSDP2) and accumulated into float32.
- ``recompute``: activation recompute per repeated block (``layer_group``): ``none``
  keeps every activation, ``selective`` keeps matmul outputs but every second 2-D product
  of the block and recomputes the rest in backward (torchtitan's selective-op policy), ``full`` keeps only the block's
  inputs and recomputes the whole block forward before its backward. ``auto`` is a
  request: the planner chooses per block and writes its choices to ``recompute_blocks``.
- ``recompute_blocks``: block -> policy, overriding ``recompute`` for those blocks.
- ``micro_batches``: micro-steps per optimizer step (gradient accumulation): the traced
  graph is one micro-step; gradients are synced once, during the last micro-step's
  backward (sharded gradients are reduce-scattered every micro-step, as FSDP does). With
  pipeline stages, the micro-batches the schedule pipelines.
- ``schedule`` / ``virtual_stages`` / ``stage_cuts``: with a ``pp`` mesh axis, the pipeline
  schedule (gpipe, 1f1b, interleaved), the chunks per pp rank (interleaved only) and the first
  block of each virtual stage after the first (empty: equal block counts): autoddl/pipeline.py.
- ``offload``: spilling to host memory (autoddl/offload.py): ``none``; ``optimizer`` (float32
  masters, optimizer states and the optimizer step on the host, ZeRO-Offload); ``params`` (also
  each layer group's working parameters, copied in one group ahead of use); ``activations`` (also
  those groups' saved activations, out after their forward, in before their backward). ``auto`` is
  a request: the planner tries none, then each level in this order, and writes the level it chose.
- ``attention``: how an attention op (scaled_dot_product_attention) is priced: ``flash`` (one fused
  kernel, at the cluster's ``efficiency.attention`` when given) or ``unfused`` (the separate Q·Kᵀ,
  softmax, dropout and probs·V kernels of Megatron-LM's 2021 attention, and the score tensors they
  keep: autoddl/attention.py). A pricing choice: the executor runs torch's SDPA either way.
- ``spill_blocks``: under ``offload params`` / ``activations``, the repeated blocks spilled (empty: every one); the
  planner spills the fewest, in block order, with which the plan fits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

DEFAULT_BUCKET_MB = 25.0   # DistributedDataParallel's default bucket_cap_mb (torch/nn/parallel/distributed.py)

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}   # --precision name -> torch dtype name
RECOMPUTE_POLICIES = ("none", "selective", "full")
RECOMPUTE_CHOICES = RECOMPUTE_POLICIES + ("auto",)
SCHEDULES = ("gpipe", "1f1b", "interleaved")   # pipeline schedules (autoddl/pipeline.py)
OFFLOAD_LEVELS = ("none", "optimizer", "params", "activations")   # what lives in host memory (autoddl/offload.py), least first
OFFLOAD_CHOICES = OFFLOAD_LEVELS + ("auto",)
ATTENTION_KERNELS = ("flash", "unfused")   # how attention is priced (autoddl/attention.py)


def dtype_name(name: str, what: str) -> str:
    """``bf16`` / ``bfloat16`` / ``torch.bfloat16`` -> ``bfloat16``; a clear error for anything else."""
    short = str(name).removeprefix("torch.")
    if short in DTYPES:
        return DTYPES[short]
    if short in DTYPES.values():
        return short
    raise ValueError(f"training.{what} {name!r} is not a training dtype; choose one of "
                     f"{sorted(DTYPES)} (or {sorted(DTYPES.values())})")


@dataclass(frozen=True)
class Training:
    """How one step is run (module docstring)."""

    bucket_mb: float = DEFAULT_BUCKET_MB
    param_dtype: str = "float32"
    reduce_dtype: str | None = None
    recompute: str = "none"
    recompute_blocks: dict[str, str] = field(default_factory=dict)
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_cuts: tuple[str, ...] = ()
    offload: str = "none"
    spill_blocks: tuple[str, ...] = ()
    attention: str = "flash"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"training.attention {self.attention!r} is not an attention kernel; choose one of "
                             f"{list(ATTENTION_KERNELS)}")
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"training.offload {self.offload!r} is not an offload level; choose one of "
                             f"{list(OFFLOAD_CHOICES)}")
        if not self.bucket_mb >= 0:
            raise ValueError(f"training.bucket_mb must be >= 0 (MB of gradients per bucket), got {self.bucket_mb!r}")
        object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype, "param_dtype"))
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", dtype_name(self.reduce_dtype, "reduce_dtype"))
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"training.recompute {self.recompute!r} is not a policy; choose one of "
                             f"{list(RECOMPUTE_CHOICES)}")
        bad = {b: p for b, p in self.recompute_blocks.items() if p not in RECOMPUTE_POLICIES}
        if bad:
            raise ValueError(f"training.recompute_blocks {bad} name unknown policies; each block takes one of "
                             f"{list(RECOMPUTE_POLICIES)}")
        if not (isinstance(self.micro_batches, int) and self.micro_batches >= 1):
            raise ValueError(f"training.micro_batches must be an integer >= 1 (micro-steps per optimizer step), "
                             f"got {self.micro_batches!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"training.schedule {self.schedule!r} is not a pipeline schedule; choose one of "
                             f"{list(SCHEDULES)}")
        if not (isinstance(self.virtual_stages, int) and self.virtual_stages >= 1):
            raise ValueError(f"training.virtual_stages must be an integer >= 1 (chunks per pp rank), "
                             f"got {self.virtual_stages!r}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"training.virtual_stages {self.virtual_stages} needs schedule 'interleaved' "
                             f"(got {self.schedule!r}); gpipe and 1f1b run one chunk per pp rank")
        object.__setattr__(self, "stage_cuts", tuple(self.stage_cuts))
        object.__setattr__(self, "spill_blocks", tuple(self.spill_blocks))

    def __hash__(self) -> int:
        return hash((self.bucket_mb, self.param_dtype, self.reduce_dtype, self.recompute,
                     tuple(sorted(self.recompute_blocks.items())), self.micro_batches, self.schedule,
                     self.virtual_stages, self.stage_cuts, self.offload, self.spill_blocks, self.attention))

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1e6)

    @property
    def grad_reduce_dtype(self) -> str:
        """The dtype gradients cross the network in."""
        return self.reduce_dtype or self.param_dtype

    @property
    def mixed(self) -> bool:
        """Computing in a lower precision than the float32 parameters."""
        return self.param_dtype != "float32"

    @property
    def offload_level(self) -> str:
        """What lives in host memory as the step runs: ``offload``, with ``auto`` (a request) as none."""
        return "none" if self.offload == "auto" else self.offload

    def recompute_of(self, block: str) -> str:
        """The policy block ``block`` runs under (``root``, outside any block, is never recomputed)."""
        if block == "root":
            return "none"
        policy = self.recompute_blocks.get(block, self.recompute)
        return "none" if policy == "auto" else policy

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stage_cuts": list(self.stage_cuts), "spill_blocks": list(self.spill_blocks)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, source: str = "plan") -> "Training":
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: training has unknown fields {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
