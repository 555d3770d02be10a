"""A structured training configuration, the space trainers such as torchtitan and Megatron-LM express.

A plan found by the search gives every op its own SBP signature; a trainer takes a few numbers:
degrees per role (``dp`` replicated data parallel, ``fsdp`` ZeRO-3, ``tp`` Megatron tensor parallel,
``pp`` pipeline stages), a ZeRO stage for the dp axis, sequence parallel, the precision policy,
one recompute policy and the batch sizes. ``TrainerConfig`` holds those numbers; the modules
beside it write and read them in each trainer's own terms (``torchtitan.py``: job-config TOML;
``megatron.py``: command-line flags). Pricing a configuration is the search layer's
(search/expressible.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoddl.training import DTYPES, RECOMPUTE_POLICIES, Training

ROLES = ("pp", "dp", "fsdp", "tp")        # mesh order, outermost first (torchtitan's ParallelDims order)
PRECISIONS = tuple(DTYPES)                # fp32, bf16, fp16
SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")                 # torch.distributed.pipelining's names, as torchtitan takes them
INTERLEAVED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


class TrainerConfigError(ValueError):
    """A configuration autoddl cannot read, write or price; the message names the key or flag."""


@dataclass(frozen=True)
class TrainerConfig:
    """One structured configuration (module docstring). ``reduce_dtype`` None means ``precision``
    (gradients reduced in the compute dtype, as FSDP2); it is stored resolved. ``recompute_every``
    n > 1 with ``recompute="full"`` recomputes every n-th repeated block (torchtitan's layer-wise
    selective AC). ``virtual_stages`` are pipeline stages per pp rank; ``num_layers`` (the model's
    repeated blocks) converts them to layers per stage where a trainer wants that."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    precision: str = "fp32"
    reduce_dtype: str | None = None
    recompute: str = "none"
    recompute_every: int = 1
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    seq_len: int | None = None
    schedule: str | None = None
    virtual_stages: int = 1
    num_layers: int | None = None

    def __post_init__(self) -> None:
        for role in ROLES:
            if not (isinstance(getattr(self, role), int) and getattr(self, role) >= 1):
                raise TrainerConfigError(f"{role} degree {getattr(self, role)!r}: must be an integer >= 1")
        if self.zero not in (0, 1, 2):
            raise TrainerConfigError(f"zero {self.zero!r}: 0 (none), 1 (optimizer states) or 2 (and gradients)")
        if self.zero and self.dp == 1:
            raise TrainerConfigError(f"ZeRO-{self.zero} shards over the replicated data-parallel (dp) ranks, "
                                     "and dp is 1; give dp > 1 or zero 0 (fsdp is ZeRO-3 already)")
        if self.sequence_parallel and self.tp == 1:
            raise TrainerConfigError("sequence parallel splits tensor-parallel activations: it needs tp > 1")
        for what in ("precision", "reduce_dtype"):
            if getattr(self, what) is not None and getattr(self, what) not in PRECISIONS:
                raise TrainerConfigError(f"{what} {getattr(self, what)!r}: choose one of {list(PRECISIONS)}")
        object.__setattr__(self, "reduce_dtype", self.reduce_dtype or self.precision)
        if self.recompute not in RECOMPUTE_POLICIES:
            raise TrainerConfigError(f"recompute {self.recompute!r}: choose one of {list(RECOMPUTE_POLICIES)}")
        if self.recompute_every < 1 or (self.recompute_every > 1 and self.recompute != "full"):
            raise TrainerConfigError(f"recompute_every {self.recompute_every}: every n-th block (n >= 1) is "
                                     "recomputed in full; it needs recompute 'full'")
        for what in ("micro_batch_size", "global_batch_size", "seq_len", "num_layers"):
            if getattr(self, what) is not None and getattr(self, what) < 1:
                raise TrainerConfigError(f"{what} {getattr(self, what)}: must be a positive integer")
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        if self.pp == 1:
            if self.virtual_stages != 1:
                raise TrainerConfigError(f"virtual_stages {self.virtual_stages} without pipeline stages (pp 1)")
            object.__setattr__(self, "schedule", None)
            return
        schedule = self.schedule or ("Interleaved1F1B" if self.virtual_stages > 1 else "1F1B")
        if schedule not in SCHEDULES:
            raise TrainerConfigError(f"pipeline schedule {schedule!r}: choose one of {list(SCHEDULES)}")
        if self.virtual_stages < 1 or (self.virtual_stages > 1) != (schedule in INTERLEAVED):
            raise TrainerConfigError(f"pipeline schedule {schedule} with {self.virtual_stages} virtual stages per "
                                     f"rank: interleaved schedules ({', '.join(INTERLEAVED)}) take more than one, "
                                     "the others one")
        object.__setattr__(self, "schedule", schedule)

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.fsdp * self.tp

    @property
    def data_parallel_degree(self) -> int:
        return self.dp * self.fsdp

    def degrees(self) -> list[tuple[str, int]]:
        """``--degrees`` roles, outermost first: pp, dp, fsdp, then tp (``sp`` with sequence parallel);
        degree-1 roles left out (all 1: ``[("dp", 1)]``)."""
        tp_role = "sp" if self.sequence_parallel else "tp"
        out = [(r, getattr(self, r)) for r in ("pp", "dp", "fsdp") if getattr(self, r) > 1]
        out += [(tp_role, self.tp)] if self.tp > 1 else []
        return out or [("dp", 1)]

    @classmethod
    def from_degrees(cls, degrees: list[tuple[str, int]], **settings) -> "TrainerConfig":
        """From ``search.planner.parse_degrees``'s list (roles dp, fsdp, tp, sp, pp) and the settings."""
        by = dict(degrees)
        unknown = sorted(set(by) - {"pp", "dp", "fsdp", "tp", "sp"})
        if unknown:
            raise TrainerConfigError(f"degrees {degrees}: unknown roles {unknown}")
        return cls(pp=by.get("pp", 1), dp=by.get("dp", 1), fsdp=by.get("fsdp", 1),
                   tp=by.get("tp", by.get("sp", 1)), sequence_parallel=by.get("sp", 1) > 1, **settings)

    def training(self, blocks: list[str], bucket_mb: float | None = None) -> Training:
        """The Training of this configuration (one micro-step); ``blocks``: the model's repeated blocks in
        order (search.planner.recompute_blocks), for ``recompute_every``."""
        extra = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
        if self.recompute_every > 1:
            every = {b: "full" for i, b in enumerate(blocks, 1) if i % self.recompute_every == 0}
            return Training(param_dtype=self.precision, reduce_dtype=self.reduce_dtype, recompute="none",
                            recompute_blocks=every, **extra)
        return Training(param_dtype=self.precision, reduce_dtype=self.reduce_dtype, recompute=self.recompute, **extra)

    def micro_steps(self) -> int:
        """Optimizer-step micro-steps: global / (micro-batch x data-parallel degree); 1 without both."""
        if self.micro_batch_size is None or self.global_batch_size is None:
            return 1
        return max(1, self.global_batch_size // (self.micro_batch_size * self.data_parallel_degree))

    def describe(self) -> str:
        """``fsdp=2,sp=2, bf16 (gradients reduced in fp32), recompute selective, micro-batch 2, global batch 16``."""
        text = ",".join(f"{r}={d}" for r, d in self.degrees()) + (f" ZeRO-{self.zero}" if self.zero else "")
        if self.pp > 1:
            text += f" ({self.schedule}" + (f", {self.virtual_stages} stages per rank)" if self.virtual_stages > 1
                                           else ")")
        text += f", {self.precision}" + (f" (gradients reduced in {self.reduce_dtype})"
                                         if self.reduce_dtype != self.precision else "")
        policy = self.recompute if self.recompute_every == 1 else f"full every {self.recompute_every} blocks"
        text += f", recompute {policy}"
        if self.micro_batch_size is not None:
            text += f", micro-batch {self.micro_batch_size}"
        if self.global_batch_size is not None:
            text += f", global batch {self.global_batch_size}"
        return text


def leftover(devices: int | None, known: int, what: str, source: str, others: str = "the other degrees") -> int:
    """The degree that takes the devices the others leave (torchtitan's -1, Megatron's data-parallel
    size), with errors naming ``what``, the ``others`` (the keys or flags multiplied) and ``source``."""
    if devices is None:
        raise TrainerConfigError(f"{source}: {what} is left to the device count; give --devices (or a cluster "
                                 "of that many devices) so that it can be worked out")
    if devices % known:
        raise TrainerConfigError(f"{source}: {others} = {known} does not divide the {devices} devices; {what} "
                                 "would not be an integer")
    return devices // known


def check_devices(config: TrainerConfig, devices: int | None, source: str) -> None:
    if devices is not None and config.devices != devices:
        degrees = " x ".join(f"{r}={d}" for r, d in config.degrees())
        raise TrainerConfigError(f"{source}: {degrees} = {config.devices} devices, but the plan is for {devices}; "
                                 f"give --devices {config.devices} or degrees whose product is {devices}")


def positive_int(value, name: str, source: str) -> int:
    """``value`` as a positive int, or an error naming ``name`` in ``source``."""
    try:
        out = int(value)
    except (TypeError, ValueError):
        out = 0
    if out < 1 or (isinstance(value, float) and not math.isclose(value, out)):
        raise TrainerConfigError(f"{source}: {name} = {value!r} is not a positive integer")
    return out
