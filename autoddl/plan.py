"""Plan: a mesh, one SBP signature per op and a storage NdSbp per parameter.

A plan is what search produces, what the cost model scores and what the
executor runs. It round-trips through JSON (``Plan.save`` / ``Plan.load``) with
a schema version, and names the traced graph it belongs to by its fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoddl.atomic import write_text_atomic
from autoddl.sbp import NdSbp, Signature
from autoddl.training import Training

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Mesh:
    """An N-D device mesh, outermost axis first (the innermost axis stays inside a node)."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.shape or any(s < 1 for s in self.shape):
            raise ValueError(f"mesh shape must be positive sizes, got {self.shape}")
        names = tuple(self.axis_names) or tuple(f"axis{i}" for i in range(len(self.shape)))
        if len(names) != len(self.shape):
            raise ValueError(f"mesh {self.shape} needs {len(self.shape)} axis names, got {names}")
        object.__setattr__(self, "axis_names", names)

    @classmethod
    def parse(cls, text: str, axis_names: tuple[str, ...] = ()) -> "Mesh":
        """``"2x4"`` -> Mesh((2, 4))."""
        try:
            shape = tuple(int(p) for p in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"cannot parse mesh {text!r}: expected sizes joined by 'x', e.g. 2x4") from None
        return cls(shape, axis_names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))


@dataclass(frozen=True)
class CostReport:
    """What the cost model predicted for one training step of a plan: the simulated step time and
    its parts (seconds; ``comm_s`` adds every collective up, ``exposed_comm_s`` is the part no
    compute overlapped), memory per device by category (bytes), and the step's collectives
    (phase -> kind -> count and bytes).

    Throughput over one optimizer step (every micro-step, the global batch): ``tokens_per_s`` when
    the first input is integer token ids (B, T), else ``samples_per_s`` (the other is None);
    ``model_tflops_per_device``: the model's FLOPs (3 x the graph's forward FLOPs per micro-step,
    recompute not counted, as MFU counts them) per second per device, in TFLOP/s."""

    step_time_s: float
    compute_s: float
    comm_s: float
    boxing_forward_s: float
    boxing_backward_s: float
    grad_sync_s: float
    optimizer_s: float
    step_overhead_s: float
    memory_bytes_per_device: int
    memory_limit_bytes: int
    fits_memory: bool
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0                       # the pipeline bubble (costmodel.simulate.bubble_s)
    offload_s: float = 0.0                      # host copies, added up (Training.offload)
    host_memory_bytes_per_device: int = 0       # what the plan spills to host memory, per device
    memory: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    model_tflops_per_device: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "plan") -> "CostReport":
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise ValueError(f"{source}: cost is missing a field ({exc}); re-run `autoddl plan`") from None


ROLE_WORDS = {"pp": "pipeline stages", "dp": "data parallel", "fsdp": "ZeRO-3 / FSDP", "tp": "tensor parallel",
              "sp": "sequence parallel", "rep": "replicated"}     # a mesh axis's role (axis_roles, --degrees) in words


def axis_roles(signatures: dict[str, Signature], param_storage: dict[str, NdSbp], ndim: int) -> tuple[str, ...]:
    """Role-named mesh axes, as torchtitan's ParallelDims names them, read off the decisions: an axis
    that splits an input's batch (dim 0) is ``dp``, or ``fsdp`` when parameters are stored split on it
    too; otherwise ``tp`` when parameters are split on it, ``sp`` when an input is split on another
    dim, else ``rep`` (everything replicated). Repeated roles get the axis index (``tp``, ``tp1``)."""
    placeholders = [sig.outputs[0] for sig in signatures.values() if not sig.inputs and len(sig.outputs) == 1]
    names: list[str] = []
    for axis in range(ndim):
        batch = any(nd[axis].is_split(0) for nd in placeholders)
        params_split = any(nd[axis].is_split() for nd in param_storage.values())
        other_split = any(nd[axis].is_split() and not nd[axis].is_split(0) for nd in placeholders)
        role = (("fsdp" if params_split else "dp") if batch else
                "tp" if params_split else "sp" if other_split else "rep")
        names.append(role if role not in names else f"{role}{axis}")
    return tuple(names)


def relative_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies below it (what a committed plan
    names), else absolute; "" stays ""."""
    if not path:
        return ""
    absolute = Path(path).resolve()
    try:
        return str(absolute.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(absolute)


@dataclass
class Plan:
    name: str                                   # "found", "dp", "tp", "dp_tp", "zero3", "sp", ...
    mesh: Mesh
    signatures: dict[str, Signature]            # op / input / buffer node name -> signature
    param_storage: dict[str, NdSbp]             # parameter fqn -> how it is kept between steps
    graph_hash: str
    # ZeRO-1 / ZeRO-2 (DeepSpeed's stages): where a parameter's optimizer states (and the float32
    # master it updates) live, and where its gradient is reduced to; a parameter not named uses its
    # param_storage. ZeRO-1: grad [B], optimizer [S(0)]; ZeRO-2: both [S(0)].
    optimizer_storage: dict[str, NdSbp] = field(default_factory=dict)
    grad_storage: dict[str, NdSbp] = field(default_factory=dict)
    model: str = ""                             # model file or name the plan was made for
    model_args: dict[str, Any] = field(default_factory=dict)  # keyword args of build_model (preset, sizes)
    cluster: str = ""
    cluster_file: str = ""                      # the cluster YAML the plan was priced with
    optimizer: str = "adamw"
    training: Training = field(default_factory=Training)
    batch_size: int | None = None               # the traced micro-step's batch (dim 0 of the inputs, all
                                                # data-parallel ranks); None: the model file's own
    cost: CostReport | None = None                          # what the cost model predicted
    op_costs: list[dict[str, Any]] = field(default_factory=list)  # per-op rows (summary table)
    notes: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    @property
    def devices(self) -> int:
        return self.mesh.size

    def set_provenance(self, *, model_file: str | os.PathLike = "", model_args: dict[str, Any] | None = None,
                       cluster_file: str | os.PathLike = "") -> "Plan":
        """Record where the plan came from, the same way from the CLI and the API: files relative
        to the working directory (no absolute paths in a committed plan), the model's arguments."""
        self.model = relative_path(model_file) or self.model
        self.model_args = dict(model_args or {})
        self.cluster_file = relative_path(cluster_file)
        return self

    # -- JSON -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "model": self.model,
            "model_args": self.model_args,
            "cluster": self.cluster,
            "cluster_file": self.cluster_file,
            "graph_hash": self.graph_hash,
            "optimizer": self.optimizer,
            "training": self.training.to_dict(),
            "batch_size": self.batch_size,
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "signatures": {k: str(v) for k, v in self.signatures.items()},
            "param_storage": {k: str(v) for k, v in self.param_storage.items()},
            "optimizer_storage": {k: str(v) for k, v in self.optimizer_storage.items()},
            "grad_storage": {k: str(v) for k, v in self.grad_storage.items()},
            "cost": self.cost.to_dict() if self.cost is not None else {},
            "op_costs": self.op_costs,
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "plan") -> "Plan":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"{source}: schema_version {version!r} is not supported "
                             f"(this autoddl reads {SCHEMA_VERSION}); re-run `autoddl plan`")
        try:
            mesh = Mesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"]))
            return cls(
                name=data["name"], mesh=mesh,
                signatures={k: Signature.parse(v) for k, v in data["signatures"].items()},
                param_storage={k: NdSbp.parse(v) for k, v in data["param_storage"].items()},
                optimizer_storage={k: NdSbp.parse(v) for k, v in data.get("optimizer_storage", {}).items()},
                grad_storage={k: NdSbp.parse(v) for k, v in data.get("grad_storage", {}).items()},
                graph_hash=data["graph_hash"], model=data.get("model", ""),
                model_args=data.get("model_args", {}), cluster=data.get("cluster", ""),
                cluster_file=data.get("cluster_file", ""), optimizer=data.get("optimizer", "adamw"),
                training=Training.from_dict(data.get("training"), source=source),
                batch_size=data.get("batch_size"),
                cost=CostReport.from_dict(data["cost"], source=source) if data.get("cost") else None, op_costs=data.get("op_costs", []), notes=data.get("notes", []),
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing field {exc.args[0]!r}; re-run `autoddl plan`") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temporary file, then rename)."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such plan file; make one with `autoddl plan MODEL_PY`") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON plan ({exc})") from None
        return cls.from_dict(data, source=str(path))

    def summary(self):
        """Per-op DataFrame: op, output shape, signature, compute µs, comm µs, memory."""
        import pandas as pd

        cols = ["op", "output_shape", "signature", "compute_us", "comm_us", "memory_mb"]
        if self.op_costs:
            return pd.DataFrame(self.op_costs)
        return pd.DataFrame([{"op": k, "signature": str(v)} for k, v in self.signatures.items()],
                            columns=cols)

    def __str__(self) -> str:
        t = f", predicted step {self.cost.step_time_s * 1e3:.3f} ms" if self.cost is not None else ""
        return f"Plan {self.name!r} on mesh {self.mesh} for {self.model or 'model'}{t}"
