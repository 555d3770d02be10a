"""Cluster: the hardware a plan is scored for, loaded from a YAML file.

A cluster is ``nodes`` x ``devices_per_node`` identical devices, one link spec
inside a node and one between nodes, a collective backend and derating
efficiencies. Units are in the field names: ``*_gbps`` is GB/s (1e9 bytes per
second, per device, one direction), ``*_us`` microseconds, ``*_gb`` 1e9 bytes.

Loading validates everything at once and reports every problem, one per line,
each naming the file and the dotted field (like torchtitan's ``ParallelDims``
printing every degree), so a config is fixed in one pass. ``to_yaml`` writes a
file ``from_yaml`` reads back equal, with optional end-of-line comments that
record where a number came from (``autoddl calibrate`` uses them).

Two optional sections hold what ``autoddl calibrate`` measures beyond the
alpha-beta link and the roofline: ``collectives`` (per collective kind, the
latency and bandwidth that make the cost model's formula for that kind fit the
timings on this backend; used instead of ``links.intra_node`` for that kind on
intra-node mesh axes) and ``compute_curve`` (``[[gflop, efficiency], ...]``:
the fraction of ``peak_tflops`` a matmul of that many GFLOPs reaches,
piecewise-linear in log(FLOPs); used instead of ``efficiency.compute``); ``matmul_layouts``
(``{dtype: [[m, k, n, nn_us, nt_us, tn_us], ...]}``: a dtype the device only emulates, whose matmuls'
speed depends on the operands' layout; autoddl/matmul_layouts.py) prices a linear in that dtype.
A third, ``executor``, holds the fixed costs of autoddl's own executor (Python,
DTensor wrapping, per-parameter bookkeeping) that ``autoddl calibrate`` measures
by timing the executor itself: per op forward / backward, per op input, per
parameter use and per collective beyond its latency (all microseconds; 0 when
left out, e.g. for clusters whose plans run under a compiled runtime); per op family
and compute dtype (``op_us: {dtype: {family: [forward_us, backward_us]}}``, the whole
fixed cost of one op of that family, and ``op_work``, the multiple of the roofline
time its kernels take, by op size), measured on synthetic inputs; per recompute policy what
activation checkpointing adds per op and per block (``recompute``); and the shard runner's own fixed
costs (executor/shard_runner.py, what ``autoddl schedule --run`` runs; ``autoddl calibrate --only
shard_runner``): ``shard_forward_us`` / ``shard_backward_us`` per shard task and ``shard_param_us`` per
parameter a shard's backward updates, which price shard tasks in place of ``param_us`` and ``step_us``
(search/shards.py). The GPU cluster files leave them out: 0, not priced (unmeasured: no shard run on a
GPU yet).
The host side of a node (optional; needed to spill to host memory, ``--offload``):
``host_link: {bandwidth_gbps, latency_us}`` is one device's copy path to and from host
memory (a GPU's PCIe link, per direction; a copy of M bytes takes latency + M / bandwidth),
``host_memory_gb`` the node's host memory (its devices share it) and
``host_memory_bandwidth_gbps`` the node's host memory bandwidth (an optimizer step spilled to
the host is memory-bound on it). Files without them load; planning with offload then stops
with an error naming the missing field (``Cluster.require_host``).
``cores_per_node`` (CPU clusters) is how many ranks a node runs at full speed at
once (its cores / threads per rank): a mesh with more ranks than that on a node
time-shares the cores, and the cost model slows that mesh's compute and
collectives by ranks / cores_per_node. ``comm_measured_ranks_per_node`` says how many
ranks of a node were busy while the links and collectives were measured (the two-host
testbed measures with both ranks of each host at once): collectives are slowed only by
the sharing beyond that (``Cluster.comm_time_sharing``).
``links.inter_node`` may say that a node's devices share ONE link to the other nodes (a host's
one network interface, as on the two-host testbed, where both ranks of a host cross one veth
link) with ``shared_by_node: true`` and ``measured_flows``, the number of flows that crossed
the link at once while its ``bandwidth_gbps`` was measured (then the bandwidth one flow saw):
a collective is then priced from the flows it puts on the link at once
(``LinkSpec.per_flow``, costmodel/collectives.py ``node_link``). Without them every device
has its own inter-node link (GPU clusters: a NIC per GPU) and ``bandwidth_gbps`` is per device.
Such a link may also give ``flow_bandwidth_gbps``, what one flow reached alone on it: where the
ranks' CPU rather than the wire limits a flow (the testbed at 10 Gbit/s), fewer flows at once do not
each go faster, and no flow is priced above it.
Both links may give ``cpu_ns_per_byte``: the host CPU a rank spends per byte it sends over the link
(gloo: copies, reductions, the kernel's TCP stack; on a shaped veth link also the qdisc), taken from
the cores the ranks compute on; ``autoddl calibrate --only collective_cpu`` measures it on loopback,
``--across-hosts --only collective_cpu`` across the testbed's link. costmodel/simulate.py charges it
to the compute stream of a collective's ranks (GPU files leave it out: NCCL's cost to the compute is
``executor.collective_compute_share``).

``device.peak_tflops`` is either one number (the dense peak, used for every dtype)
or a mapping per dtype, ``{float32: 67, bfloat16: 989, float16: 989}`` (torch dtype
names; fp32 / bf16 / fp16 are read as them). The mapping must give float32;
``DeviceSpec.peak_tflops`` then reads as the float32 peak and
``DeviceSpec.peak_tflops_for(dtype)`` gives each dtype's, with an error naming the
file and the field for a dtype the mapping leaves out (a V100 has no bfloat16).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from autoddl.atomic import write_text_atomic
from autoddl.collective_points import CollectivePoints, parse_collective_points
from autoddl.matmul_layouts import MatmulLayouts, parse_layouts
from autoddl.op_families import (CAST_OPS, CONV_OPS, COPY_OPS, MATMUL_OPS, NORMS, REDUCTIONS, SDPA_OPS,
                                  VIEW_OPS)
from autoddl.training import DTYPES

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CLUSTER_PATH = CONFIG_DIR / "dgx-a100-8.yaml"
DEFAULT_CLUSTER = DEFAULT_CLUSTER_PATH          # alias used in the shared interface notes

DEVICE_KINDS = ("cuda", "cpu")
# The values of autoddl.collective_kinds.CollectiveKind (which imports this module's Backend).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# The kinds ``collectives`` may hold a fit for: the collectives, and point-to-point sends (``send_recv``:
# one rank's isend matched by another's irecv, as pipeline stages and shard transfers run them).
FITTED_KINDS = COLLECTIVE_KINDS + ("send_recv",)
# The dtypes device.peak_tflops may give a peak for (torch names), in the order written; aliases in DTYPES.
PEAK_DTYPES = tuple(DTYPES.values())            # float32, bfloat16, float16


def peak_dtype(name: Any) -> str | None:
    """``float32`` / ``fp32`` / ``torch.float32`` -> ``"float32"`` (likewise bfloat16, float16); else None."""
    short = str(name).removeprefix("torch.")
    return DTYPES.get(short) or (short if short in PEAK_DTYPES else None)


class ClusterConfigError(ValueError):
    """A cluster description is wrong; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str] | str, source: str = "") -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        self.source = source
        if len(self.errors) == 1:
            msg = self.errors[0]
        else:
            where = f" in {source}" if source else ""
            msg = f"{len(self.errors)} problems{where}:\n" + "\n".join(self.errors)
        super().__init__(msg)


class Backend(str, Enum):
    NCCL = "nccl"
    GLOO = "gloo"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class DeviceSpec:
    """One device. ``peak_tflops`` may be given as a mapping per dtype (module docstring): it is then
    stored in ``peaks_by_dtype`` and ``peak_tflops`` reads as the float32 peak.

    ``dataclasses.replace(device, peak_tflops={...})`` changes every peak; replacing only the number
    of a device with peaks per dtype is refused (it would disagree with its float32 peak).
    """

    name: str
    kind: str                       # "cuda" | "cpu"
    peak_tflops: float              # dense peak, 1e12 FLOP/s: float32's if peaks_by_dtype is given, else every dtype's
    memory_gb: float                # 1e9 bytes
    memory_bandwidth_gbps: float    # GB/s
    peaks_by_dtype: tuple[tuple[str, float], ...] = ()   # ((dtype, TFLOPS), ...); (): one peak for every dtype
    source: str = field(default="", compare=False, repr=False)    # the cluster file, named by errors

    def __post_init__(self) -> None:
        where = f"{self.source or 'DeviceSpec ' + repr(self.name)}"
        peaks = self.peak_tflops
        if isinstance(peaks, Mapping):
            errors: list[str] = []
            parsed = _peaks(where, "device.peak_tflops", dict(peaks), _DEVICE_FIELDS["peak_tflops"][0], errors)
            if errors:
                raise ClusterConfigError(errors, self.source)
            object.__setattr__(self, "peaks_by_dtype", tuple(parsed.items()))
            object.__setattr__(self, "peak_tflops", parsed["float32"])
            return
        pairs = self.peaks_by_dtype
        if isinstance(pairs, Mapping):
            pairs = tuple(pairs.items())
        pairs = tuple((peak_dtype(d) or str(d), v) for d, v in pairs)
        object.__setattr__(self, "peaks_by_dtype", tuple(sorted(
            pairs, key=lambda p: PEAK_DTYPES.index(p[0]) if p[0] in PEAK_DTYPES else len(PEAK_DTYPES))))
        fp32 = dict(pairs).get("float32")
        if pairs and fp32 is None:
            raise ClusterConfigError(f"{where}: device.peak_tflops.float32: missing; peaks_by_dtype "
                                     f"({self.peak_text()}) needs the float32 peak", self.source)
        if pairs and fp32 != peaks:
            raise ClusterConfigError(
                f"{where}: device.peak_tflops: {peaks!r} disagrees with the float32 peak {fp32!r} of its peaks per "
                f"dtype ({self.peak_text()}); to change the peaks give peak_tflops as a mapping, e.g. "
                f"dataclasses.replace(device, peak_tflops={{'float32': ..., 'bfloat16': ...}})", self.source)

    @property
    def peaks(self) -> dict[str, float]:
        """Dense peak per dtype given (``{}`` when one peak serves every dtype)."""
        return dict(self.peaks_by_dtype)

    def peak_tflops_for(self, dtype: Any) -> float:
        """Dense peak of compute in ``dtype`` (a torch dtype or its name: float32, bfloat16, float16;
        fp32 / bf16 / fp16 too), 1e12 FLOP/s.

        With one peak for every dtype, that peak (whatever ``dtype``). With peaks per dtype, the
        given dtype's; a dtype the cluster file gives no peak for (integers, float64 included)
        raises ``ClusterConfigError`` naming the file, ``device.peak_tflops.<dtype>`` and the
        dtypes it does give.
        """
        if not self.peaks_by_dtype:
            return self.peak_tflops
        name = peak_dtype(dtype)
        peaks = self.peaks
        if name in peaks:
            return peaks[name]
        shown = name or str(dtype).removeprefix("torch.")
        where = f"{self.source}: " if self.source else ""
        hint = (f"add `{shown}: <dense TFLOPS>` under device.peak_tflops in the cluster file, or train in "
                f"{' / '.join(peaks)}" if name else
                f"peaks are given per training dtype ({', '.join(PEAK_DTYPES)}); ask for the dtype the op "
                "computes in")
        raise ClusterConfigError(f"{where}device.peak_tflops.{shown}: missing: no {shown} peak for {self.name} "
                                 f"(device.peak_tflops gives {', '.join(peaks)}); {hint}", self.source)

    def peak_text(self) -> str:
        """``312 TFLOPS`` or ``float32 19.5, bfloat16 312, float16 312 TFLOPS``."""
        if not self.peaks_by_dtype:
            return f"{self.peak_tflops:g} TFLOPS"
        return ", ".join(f"{d} {v:g}" for d, v in self.peaks_by_dtype) + " TFLOPS"

    def to_dict(self) -> dict[str, Any]:
        """The YAML ``device`` section: ``peak_tflops`` a number, or a mapping per dtype."""
        return {"name": self.name, "kind": self.kind,
                "peak_tflops": dict(self.peaks_by_dtype) if self.peaks_by_dtype else self.peak_tflops,
                "memory_gb": self.memory_gb, "memory_bandwidth_gbps": self.memory_bandwidth_gbps}


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_gbps: float           # GB/s per device, one direction (shared_by_node: per flow, measured_flows at once)
    latency_us: float               # per message (alpha of the alpha-beta model)
    shared_by_node: bool = False    # links.inter_node only: the node's devices all cross this one link
    measured_flows: int | None = None   # with shared_by_node: flows crossing it at once when bandwidth_gbps was fitted
    flow_bandwidth_gbps: float | None = None   # with shared_by_node: the most one flow alone reaches (its ranks' own limit)
    cpu_ns_per_byte: float = 0.0    # host CPU a rank spends per byte it sends over this link (gloo's TCP); 0: not priced

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping: the sharing fields only when the link is shared, the CPU cost only when priced."""
        d: dict[str, Any] = {"bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us}
        if self.shared_by_node or self.measured_flows is not None:
            d.update(shared_by_node=self.shared_by_node, measured_flows=self.measured_flows)
        if self.flow_bandwidth_gbps is not None:
            d["flow_bandwidth_gbps"] = self.flow_bandwidth_gbps
        if self.cpu_ns_per_byte:
            d["cpu_ns_per_byte"] = self.cpu_ns_per_byte
        return d

    def per_flow(self, flows: int) -> "LinkSpec":
        """The link as each of ``flows`` flows crossing it at once sees it. A link the node's devices
        share gives each flow ``bandwidth_gbps * measured_flows / flows`` (its fit was one of
        ``measured_flows``), but never more than ``flow_bandwidth_gbps``, what one flow reached alone
        (where the ranks' CPU, not the wire, limits a flow, fewer flows do not each go faster); the
        latency and CPU cost as measured. A link of each device's own is itself."""
        if not self.shared_by_node:
            return self
        if isinstance(flows, bool) or not isinstance(flows, int) or flows < 1:
            raise ValueError(f"LinkSpec.per_flow: flows must be a positive integer, got {flows!r}")
        bandwidth = self.bandwidth_gbps * self.measured_flows / flows
        if self.flow_bandwidth_gbps is not None:
            bandwidth = min(bandwidth, self.flow_bandwidth_gbps)
        return LinkSpec(bandwidth_gbps=bandwidth, latency_us=self.latency_us, cpu_ns_per_byte=self.cpu_ns_per_byte)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak really reached (derating); ``autoddl calibrate`` measures compute, memory
    and network. ``attention`` (optional, from a published attention-kernel measurement): the
    fraction of the dtype's peak a fused attention kernel (scaled_dot_product_attention, forward +
    backward) reaches, counted as FlashAttention-2 counts its FLOPs (costmodel/compute.py
    ``attention_time_s``); None prices attention like any matmul, at ``compute``."""

    compute: float = 1.0
    memory: float = 1.0
    network: float = 1.0
    attention: float | None = None

    def to_dict(self) -> dict[str, float]:
        """The YAML ``efficiency`` section (``attention`` only when set)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class CollectiveFits:
    """Fitted (latency, bandwidth) per collective kind, each used in place of the intra-node link.

    A kind left ``None`` uses ``Cluster.intra_node``. ``get`` accepts the kind's
    name or a ``CollectiveKind`` (a ``str`` enum).
    """

    all_reduce: LinkSpec | None = None
    all_gather: LinkSpec | None = None
    reduce_scatter: LinkSpec | None = None
    all_to_all: LinkSpec | None = None
    broadcast: LinkSpec | None = None
    send_recv: LinkSpec | None = None       # point to point (costmodel.collectives.send_recv_time_s)

    def get(self, kind: Any) -> LinkSpec | None:
        name = getattr(kind, "value", kind)
        return getattr(self, name) if name in FITTED_KINDS else None

    def items(self) -> list[tuple[str, LinkSpec]]:
        return [(k, getattr(self, k)) for k in FITTED_KINDS if getattr(self, k) is not None]

    def __bool__(self) -> bool:
        return bool(self.items())


# Op families: an op without a measured cost of its own uses its family's representative (the op
# ``autoddl calibrate`` times for the family); in-place variants (``add_``) use their op's.
FAMILY_REPRESENTATIVE = {
    **{op: "view" for op in VIEW_OPS - {"getitem"}},
    **{op: "linear" for op in MATMUL_OPS | {"baddbmm"}},
    **{op: "scaled_dot_product_attention" for op in SDPA_OPS},
    **{op: "conv2d" for op in CONV_OPS},
    **{op: "layer_norm" for op in NORMS - {"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                                             "_native_batch_norm_legit_no_training",
                                             "_native_batch_norm_legit_functional"}},
    **{op: "batch_norm" for op in ("native_batch_norm", "_native_batch_norm_legit",
                                   "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional")},
    **{op: "contiguous" for op in COPY_OPS - {"cat", "stack"}},
    "stack": "cat",
    **{op: "to" for op in CAST_OPS},
    **{op: "mean" for op in REDUCTIONS},
}
RECOMPUTE_POLICIES = ("selective", "full")


@dataclass(frozen=True)
class OpCost:
    """One op family's measured cost through the executor, in one compute dtype.

    An op of the family whose forward roofline time is ``x`` (microseconds, on its local share)
    takes ``forward_us + forward_work(x) * x`` forward and ``backward_us + backward_work(x) *
    backward roofline`` backward: the fixed part is the whole per-op cost (dispatch, autograd node,
    the executor's call) in place of ``op_overhead_us`` and the scalar per-op / per-input fields;
    the work scales, read off ``work`` (``(roofline_us, forward_work, backward_work)`` points
    measured at a few sizes, piecewise-linear in log(roofline_us), flat beyond the ends, 1 when
    empty), say how many times the roofline the family's kernels really take at that size (below 1
    for ops whose data sits in cache, well above it for a kernel on a slow path, e.g. attention's
    bfloat16 backward on a CPU)."""

    forward_us: float = 0.0
    backward_us: float = 0.0
    work: tuple[tuple[float, float, float], ...] = ()

    def work_at(self, roofline_us: float) -> tuple[float, float]:
        """(forward, backward) work scales of an op whose forward roofline time is ``roofline_us``."""
        pts = self.work
        if not pts:
            return 1.0, 1.0
        if roofline_us <= pts[0][0]:
            return pts[0][1], pts[0][2]
        if roofline_us >= pts[-1][0]:
            return pts[-1][1], pts[-1][2]
        i = next(i for i in range(1, len(pts)) if roofline_us <= pts[i][0])
        (x0, f0, b0), (x1, f1, b1) = pts[i - 1], pts[i]
        w = (math.log(roofline_us) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return f0 + w * (f1 - f0), b0 + w * (b1 - b0)


@dataclass(frozen=True)
class RecomputeCost:
    """What activation checkpointing under one policy adds (microseconds), as the executor runs a
    recomputed block (non-reentrant ``torch.utils.checkpoint``; selective: a dispatch mode calling
    the op policy per op): per op in forward (saved-tensor hooks, the policy), per op in backward
    (an op run again: beyond its forward; an op whose output is kept: its cached output's lookup),
    each for matmul-like ops (kept by selective recompute) and the others; and per block, forward
    (entering the checkpoint) and backward (setting up its recompute)."""

    op_forward_us: float = 0.0
    op_backward_us: float = 0.0
    matmul_forward_us: float = 0.0
    matmul_backward_us: float = 0.0
    block_forward_us: float = 0.0
    block_backward_us: float = 0.0


@dataclass(frozen=True)
class ExecutorOverheads:
    """Fixed costs of autoddl's executor beyond the roofline, ``op_overhead_us`` and alpha-beta.

    The executor runs every op (views included) as one call of a compiled local program,
    makes every parameter use a leaf whose gradient it syncs to the storage layout, and
    issues each collective as a functional collective it waits for. ``autoddl calibrate``
    measures these by timing the executor on chains of tiny ops (the scalar fields but
    ``collective_compute_share``, from a published measurement on GPUs) and
    each op family on synthetic inputs of a few sizes, per compute dtype (``op_us``:
    ``{dtype: {family: (forward_us, backward_us)}}``; ``op_work``: ``{dtype: {family:
    ((roofline_us, forward_work, backward_work), ...)}}``; see :class:`OpCost`); the scalar
    per-op fields price the ops of families without a measurement. ``recompute`` holds, per
    recompute policy, what checkpointing adds per op and per block (:class:`RecomputeCost`).
    The ``shard_*`` fields are the shard runner's (module docstring), not this executor's.
    """

    op_forward_us: float = 0.0      # per op the executor runs (views included), forward
    op_backward_us: float = 0.0     # per op that has a backward (views included)
    input_forward_us: float = 0.0   # per tensor input of an op, forward
    input_backward_us: float = 0.0  # per tensor input of an op, backward (its gradient's wrapping)
    param_us: float = 0.0           # per parameter use: leaf, grad sync to storage, optimizer share
    collective_us: float = 0.0      # per collective, beyond its latency (the call and its wait)
    step_us: float = 0.0            # per training step: input placement, loss read-out, zero_grad
    # per parameter a ZeRO-1/2 parameter sync rebuilds (executor/runtime.py ``sync_parameters``), beyond its
    # all-gather and its copy passes (costmodel/copy_passes.py); 0 = not priced (unmeasured: GPU cluster files)
    param_sync_us: float = 0.0
    # per parameter a ZeRO-3 / FSDP group gather packs and unpacks (executor/compiled.py ``_launch_gather``,
    # ``_unpack``), per gather, beyond its all-gather and its copy passes; 0 = not priced (as param_sync_us)
    param_gather_us: float = 0.0
    # the shard runner's (executor/shard_runner.py, ``autoddl schedule --run``) own fixed costs, in place of
    # param_us and step_us for shard tasks (search/shards.py); 0 = not priced (unmeasured: GPU cluster files)
    shard_forward_us: float = 0.0   # per shard forward task beyond its ops (its flows' leaves, the run loop)
    shard_backward_us: float = 0.0  # per shard backward task beyond its ops (autograd.backward of its outputs)
    shard_param_us: float = 0.0     # per parameter a shard's backward updates (gradient, p -= lr * grad, reset)
    # Share (0..1) of a collective's duration that its ranks' compute stream also pays
    # (costmodel/simulate.py): on GPUs NCCL's kernels take SMs from the compute kernels they overlap (a
    # cited slowdown s of overlapped compute gives s / (1 + s): the compute beside a collective of d seconds
    # does d / (1 + s) seconds of work in d). 0: not priced. CPU files price gloo's CPU per byte instead
    # (``links.*.cpu_ns_per_byte``): what a collective costs the cores goes with its bytes, not its duration.
    collective_compute_share: float = 0.0
    op_us: Mapping[str, Mapping[str, tuple[float, float]]] = field(default_factory=dict)    # dtype -> family
    op_work: Mapping[str, Mapping[str, tuple[tuple[float, float, float], ...]]] = field(default_factory=dict)
    recompute: Mapping[str, RecomputeCost] = field(default_factory=dict)   # policy -> what checkpointing adds
    # optimizer (sgd, adamw) -> ((numel, ns), ...): the optimizer's step as the executor runs it (torch's
    # foreach) on float32 parameters, nanoseconds per element beyond its smallest timed size, by the local
    # parameter count (:meth:`optimizer_ns_per_element`); empty: priced from memory_bandwidth_gbps
    optimizer_ns: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # ranks busy on a node -> microseconds per sqrt(ms): how much later than their compute says the ranks
    # meet at a collective after C ms of compute apart, beyond what collective_us holds at 0.5 ms:
    # k (sqrt(C) - sqrt(0.5)) (executor/calibrate_skew.py, costmodel/simulate.py); empty: not priced
    arrival_skew_us: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def table(m: Any, row: Any) -> dict:
            return {str(dt): {str(f): row(v) for f, v in (fams or {}).items()} for dt, fams in (m or {}).items()}
        object.__setattr__(self, "op_us", table(self.op_us, lambda v: tuple(float(x) for x in v)))
        object.__setattr__(self, "op_work", table(self.op_work, lambda v: tuple(tuple(float(x) for x in p) for p in v)))
        object.__setattr__(self, "recompute", {str(p): v if isinstance(v, RecomputeCost) else RecomputeCost(**v)
                                               for p, v in (self.recompute or {}).items()})
        object.__setattr__(self, "optimizer_ns", {str(k): tuple(tuple(float(x) for x in p) for p in v)
                                                  for k, v in (self.optimizer_ns or {}).items()})
        object.__setattr__(self, "arrival_skew_us", {int(k): float(v) for k, v in
                                                     sorted((self.arrival_skew_us or {}).items())})

    def __hash__(self) -> int:            # the tables are dicts: hash a frozen copy
        def frozen(table: Mapping) -> tuple:
            return tuple(sorted((k, frozen(v) if isinstance(v, Mapping) else v) for k, v in table.items()))
        return hash((tuple(self.scalars().items()), frozen(self.op_us), frozen(self.op_work),
                     frozen(self.recompute), frozen(self.optimizer_ns), frozen(self.arrival_skew_us)))

    def __bool__(self) -> bool:
        return any(bool(v) for v in self.scalars().values()) or bool(self.op_us or self.op_work or self.recompute
                                                                      or self.optimizer_ns or self.arrival_skew_us)

    def scalars(self) -> dict[str, float]:
        """The scalar fields (the fallback per-op costs, per input, parameter use, collective, step, and
        the collectives' share of the compute stream)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in _EXECUTOR_FIELDS}

    def family_of(self, op_name: str, dtype: str = "float32") -> str | None:
        """The family whose measured cost an op of ``op_name`` computing in ``dtype`` pays: its own,
        its in-place op's (``add_`` -> ``add``), else its family's representative; None when none of
        them was measured (in ``dtype``, else in float32)."""
        tables = [self.op_us.get(dtype, {})] + ([self.op_us.get("float32", {})] if dtype != "float32" else [])
        for name in dict.fromkeys((op_name, op_name.rstrip("_"), FAMILY_REPRESENTATIVE.get(op_name.rstrip("_"), ""))):
            if name and any(name in t for t in tables):
                return name
        return None

    def op_cost(self, op_name: str, dtype: str = "float32") -> OpCost | None:
        """The measured :class:`OpCost` of an op (its family's, in ``dtype`` or else float32), or None."""
        family = self.family_of(op_name, dtype)
        if family is None:
            return None
        dt = dtype if family in self.op_us.get(dtype, {}) else "float32"
        fixed = self.op_us[dt][family]
        return OpCost(fixed[0], fixed[1], self.op_work.get(dt, {}).get(family, ()))

    def optimizer_ns_per_element(self, optimizer: str, numel: float) -> float | None:
        """Nanoseconds per float32 element of ``optimizer``'s step over ``numel`` local elements: the
        measured curve, linear in log(numel) between its points and flat past its ends; None when not
        measured."""
        curve = self.optimizer_ns.get(optimizer)
        if not curve:
            return None
        x = math.log(max(numel, 1.0))
        xs = [math.log(n) for n, _ in curve]
        if x <= xs[0]:
            return curve[0][1]
        for (x0, (_, y0)), (x1, (_, y1)) in zip(zip(xs, curve), zip(xs[1:], curve[1:])):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return curve[-1][1]

    def arrival_skew_s(self, ranks_per_node: int, compute_s: float) -> float:
        """How much later than their compute says ranks meet at a collective after ``compute_s`` apart:
        k (sqrt(C ms) - sqrt(0.5)) (:func:`arrival_skew_x`), k the ``arrival_skew_us`` measured with
        ``ranks_per_node`` ranks busy on a node, else with the most ranks measured below that; 0 when none."""
        below = [r for r in self.arrival_skew_us if r <= ranks_per_node]
        return self.arrival_skew_us[max(below)] * 1e-6 * arrival_skew_x(compute_s) if below else 0.0

    def recompute_cost(self, policy: str) -> RecomputeCost:
        """What checkpointing under ``policy`` adds (zeros when not measured, or policy none)."""
        return self.recompute.get(policy) or RecomputeCost()

    def to_dict(self) -> dict[str, Any]:
        """The YAML section: the scalar fields (those that are 0 when not priced left out at 0), then the
        measured tables (left out when empty)."""
        out: dict[str, Any] = {k: v for k, v in self.scalars().items() if v or k not in _UNPRICED_WHEN_ZERO}
        if self.op_us:
            out["op_us"] = {dt: {f: list(v) for f, v in fams.items()} for dt, fams in self.op_us.items()}
        if self.op_work:
            out["op_work"] = {dt: {f: [list(p) for p in v] for f, v in fams.items()} for dt, fams in self.op_work.items()}
        if self.recompute:
            out["recompute"] = {p: dataclasses.asdict(v) for p, v in self.recompute.items()}
        if self.optimizer_ns:
            out["optimizer_ns"] = {k: [list(p) for p in v] for k, v in self.optimizer_ns.items()}
        if self.arrival_skew_us:
            out["arrival_skew_us"] = {f"ranks_{r}": v for r, v in self.arrival_skew_us.items()}
        return out


# -- schema -------------------------------------------------------------------
# (dotted field, expected, kind): kind is "str", "int", "pos" (> 0), "nonneg" (>= 0), "frac" (0, 1], "unit" [0, 1].
_DEVICE_FIELDS = {
    "name": ("a device name, e.g. A100-SXM4-80GB", "str"),
    "kind": ("one of " + ", ".join(DEVICE_KINDS), "kind"),
    "peak_tflops": ("a positive number in TFLOPS (dense peak, used for every dtype) or a mapping from dtype ("
                    + ", ".join(PEAK_DTYPES) + ") to its dense peak in TFLOPS, float32 included", "peaks"),
    "memory_gb": ("a positive number in GB (1e9 bytes) of device memory", "pos"),
    "memory_bandwidth_gbps": ("a positive number in GB/s of memory bandwidth", "pos"),
}
_LINK_FIELDS = {
    "bandwidth_gbps": ("a positive number in GB/s per device, one direction", "pos"),
    "latency_us": ("a non-negative number in microseconds", "nonneg"),
}
_LINK_CPU_FIELD = {         # links.intra_node and links.inter_node (module docstring)
    "cpu_ns_per_byte": ("a non-negative number of nanoseconds of host CPU a rank spends per byte it sends over "
                        "the link (gloo's copies, reductions and the kernel's network stack, taken from the cores the "
                        "ranks compute on; `autoddl calibrate --only collective_cpu` measures it); leave it out on "
                        "GPU clusters", "nonneg"),
}
_SHARED_LINK_FIELDS = {     # links.inter_node only (module docstring)
    "shared_by_node": ("true or false: true when a node's devices all cross ONE link to the other nodes "
                       "(a host's one network interface); leave it out when each device has its own", "bool"),
    "measured_flows": ("a positive integer: the flows (groups with a rank on each node) crossing the link at once "
                       "while bandwidth_gbps was measured", "int"),
    "flow_bandwidth_gbps": ("a positive number in GB/s: the bandwidth one flow reached alone on the shared link "
                            "(one group alone); no flow is priced faster. Leave it out when the wire is the only "
                            "limit", "pos"),
}
_EFFICIENCY_FIELDS = {**{k: ("a fraction in (0, 1]", "frac") for k in ("compute", "memory", "network")},
                      "attention": ("a fraction in (0, 1] of the dtype's peak a fused attention kernel reaches "
                                    "(forward + backward, FlashAttention-2's FLOP count); leave it out to price "
                                    "attention at efficiency.compute", "frac")}
_EXECUTOR_FIELDS = {k: (f"a non-negative number of microseconds {what}", "nonneg") for k, what in (
    ("op_forward_us", "per op the executor runs (views included), forward"),
    ("op_backward_us", "per op with a backward (views included)"),
    ("input_forward_us", "per tensor input of an op, forward"),
    ("input_backward_us", "per tensor input of an op, backward"),
    ("param_us", "per parameter use (leaf, grad sync, optimizer)"),
    ("collective_us", "per collective beyond its latency"),
    ("step_us", "per training step (inputs, loss, zero_grad)"),
    ("param_sync_us", "per parameter a ZeRO-1/2 parameter sync rebuilds, beyond its all-gather and copies"),
    ("param_gather_us", "per parameter a ZeRO-3 group gather unpacks, per gather, beyond its all-gather and copies"),
    ("shard_forward_us", "per shard forward task of the shard runner, beyond its ops"),
    ("shard_backward_us", "per shard backward task of the shard runner, beyond its ops"),
    ("shard_param_us", "per parameter a shard runner's backward updates"))}
_EXECUTOR_FIELDS["collective_compute_share"] = ("a number from 0 to 1: the share of a collective's duration its ranks' "
                                               "compute stream also pays (NCCL's SM use; gloo's CPU is "
                                               "links.*.cpu_ns_per_byte)", "unit")
_UNPRICED_WHEN_ZERO = ("param_sync_us", "param_gather_us", "shard_forward_us", "shard_backward_us",   # 0: left out
                       "shard_param_us", "collective_compute_share")
_TOP_KEYS = ("name", "nodes", "devices_per_node", "device", "links", "backend", "efficiency",
             "op_overhead_us", "collectives", "collective_points", "compute_curve", "matmul_layouts", "executor",
             "cores_per_node", "comm_measured_ranks_per_node", "host_link", "host_memory_gb",
             "host_memory_bandwidth_gbps", "calibrated_on")
HOST_FIELDS = {   # the host side of a node (module docstring): field -> what it is
    "host_link": "{bandwidth_gbps: GB/s per device one direction, latency_us: microseconds per copy} "
                 "(a GPU's PCIe link to host memory)",
    "host_memory_gb": "a positive number in GB (1e9 bytes) of host memory per node",
    "host_memory_bandwidth_gbps": "a positive number in GB/s of host memory bandwidth per node",
}
_LINK_KEYS = ("intra_node", "inter_node")
_NUMBER_WITH_UNIT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\d\s].*?)\s*$")


def _unknown_key(src: str, where: str, key: Any, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{src}: {where}{key}: unknown key; {hint}known keys: {', '.join(known)}"


def _unit_of(dotted: str) -> str:
    """The unit a field's name promises: ``*_gbps`` GB/s, ``*_tflops`` TFLOPS, ``*_gb`` GB, ``*_us`` us
    (``device.peak_tflops.bfloat16``: its parent's)."""
    for part in reversed(dotted.split(".")):
        for suffix, unit in (("_gbps", "GB/s"), ("_tflops", "TFLOPS"), ("_gb", "GB"), ("_us", "microseconds")):
            if part.endswith(suffix):
                return unit
    return ""


def _number(src: str, dotted: str, value: Any, expected: str, kind: str, errors: list[str]) -> Any:
    """Check one numeric field; append an error and return None when it is wrong."""
    where = f"{src}: {dotted}: expected {expected}"
    if isinstance(value, str):
        try:
            value = float(value)            # "1e3": PyYAML 1.1 reads exponents without a dot as strings
        except ValueError:
            m = _NUMBER_WITH_UNIT.match(value)
            if m:
                unit = m.group(2)
                bits = re.search(r"(?<![A-Za-z])[GMTk]?(b(?!yte)|bit|bps)", unit) is not None
                hint = (f"; if that is gigabits per second, {m.group(1)} Gb/s = "
                        f"{float(m.group(1)) / 8:g} GB/s" if bits and "gbps" in dotted else "")
                errors.append(f"{where}, got {value!r}: wrong unit, drop the unit {unit!r} and give "
                              f"the bare number{' in ' + _unit_of(dotted) if _unit_of(dotted) else ''}{hint}")
            else:
                errors.append(f"{where}, got {value!r}")
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        errors.append(f"{where}, got {value!r}")
        return None
    if kind == "int":
        if isinstance(value, float) and not value.is_integer() or value < 1:
            errors.append(f"{where}, got {value!r}")
            return None
        return int(value)
    bad = (not math.isfinite(value) or (kind == "pos" and value <= 0) or (kind == "nonneg" and value < 0)
           or (kind == "frac" and not 0 < value <= 1) or (kind == "unit" and not 0 <= value <= 1))
    if bad:
        errors.append(f"{where}, got {value!r}")
        return None
    return float(value)


def _section(src: str, dotted: str, value: Any, fields: dict[str, tuple[str, str]],
             errors: list[str], defaults: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Validate a nested mapping against ``fields``; returns parsed values or None on any error."""
    if not isinstance(value, dict):
        keys = ", ".join(fields)
        errors.append(f"{src}: {dotted}: expected a mapping with keys {keys}, got {value!r}")
        return None
    n_before = len(errors)
    out: dict[str, Any] = {}
    for key in value:
        if key not in fields:
            errors.append(_unknown_key(src, f"{dotted}.", key, tuple(fields)))
    for key, (expected, kind) in fields.items():
        sub = f"{dotted}.{key}"
        if key not in value:
            if defaults is not None and key in defaults:
                out[key] = defaults[key]
            else:
                errors.append(f"{src}: {sub}: missing; expected {expected}")
            continue
        raw = value[key]
        if kind == "peaks":
            out[key] = _peaks(src, sub, raw, expected, errors)
        elif kind == "bool":
            if isinstance(raw, bool):
                out[key] = raw
            else:
                errors.append(f"{src}: {sub}: expected {expected}, got {raw!r}")
        elif kind in ("str", "kind"):
            if not isinstance(raw, str) or not raw.strip():
                errors.append(f"{src}: {sub}: expected {expected}, got {raw!r}")
            elif kind == "kind" and raw not in DEVICE_KINDS:
                errors.append(f"{src}: {sub}: unknown device kind {raw!r}; known kinds: "
                              f"{', '.join(DEVICE_KINDS)}")
            else:
                out[key] = raw
        else:
            out[key] = _number(src, sub, raw, expected, kind, errors)
    return out if len(errors) == n_before else None


def _peaks(src: str, dotted: str, value: Any, expected: str, errors: list[str]) -> Any:
    """``peak_tflops``: a positive number, or ``{dtype: positive TFLOPS}`` with float32 among the dtypes
    (aliases read as torch names, returned in PEAK_DTYPES order). None on error."""
    if not isinstance(value, dict):
        return _number(src, dotted, value, expected, "pos", errors)
    if not value:
        errors.append(f"{src}: {dotted}: expected {expected}, got {{}}")
        return None
    n_before = len(errors)
    known = PEAK_DTYPES + tuple(DTYPES)
    seen: dict[str, Any] = {}
    peaks: dict[str, Any] = {}
    for key, raw in value.items():
        dtype = peak_dtype(key) if isinstance(key, str) else None
        if dtype is None:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {peak_dtype(close[0])!r}? " if close else ""
            errors.append(f"{src}: {dotted}.{key}: unknown dtype; {hint}known dtypes: {', '.join(PEAK_DTYPES)} "
                          f"(or {', '.join(DTYPES)})")
            continue
        if dtype in seen:
            errors.append(f"{src}: {dotted}.{key}: {dtype} given twice (as {seen[dtype]!r} and {key!r}); keep one")
            continue
        seen[dtype] = key
        peaks[dtype] = _number(src, f"{dotted}.{key}", raw, f"a positive number in TFLOPS (dense {dtype} peak)",
                               "pos", errors)
    if len(errors) == n_before and "float32" not in peaks:
        errors.append(f"{src}: {dotted}.float32: missing; the mapping needs the dense float32 peak in TFLOPS "
                      f"(parameters and optimizer math are float32; device.peak_tflops reads as it), got peaks "
                      f"for {', '.join(peaks)}")
    return {d: peaks[d] for d in PEAK_DTYPES if d in peaks} if len(errors) == n_before else None


def _collectives(src: str, value: Any, errors: list[str]) -> CollectiveFits | None:
    """``collectives: {kind: {latency_us, bandwidth_gbps}, ...}`` -> CollectiveFits (None on error)."""
    expected = (f"a mapping from collective kind ({', '.join(FITTED_KINDS)}) to "
                "{latency_us: microseconds, bandwidth_gbps: GB/s}")
    if not _is_mapping(src, "collectives", value, expected, errors):
        return None
    n_before = len(errors)
    fits: dict[str, LinkSpec] = {}
    for kind, spec in value.items():
        if kind not in FITTED_KINDS:
            errors.append(_unknown_key(src, "collectives.", kind, FITTED_KINDS))
            continue
        link = _section(src, f"collectives.{kind}", spec, _LINK_FIELDS, errors)
        if link:
            fits[kind] = LinkSpec(**link)
    return CollectiveFits(**fits) if len(errors) == n_before else None


def _compute_curve(src: str, value: Any, errors: list[str]) -> tuple[tuple[float, float], ...] | None:
    """``compute_curve: [[gflop, efficiency], ...]``, GFLOPs strictly increasing (None on error)."""
    expected = ("a list of [gflop, efficiency] pairs (GFLOPs of one matmul > 0, strictly increasing; "
                "efficiency = fraction of device.peak_tflops in (0, 1])")
    if not isinstance(value, (list, tuple)):
        errors.append(f"{src}: compute_curve: expected {expected}, got {value!r}")
        return None
    n_before = len(errors)
    points: list[tuple[float, float]] = []
    for i, pair in enumerate(value):
        where = f"compute_curve[{i}]"
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            errors.append(f"{src}: {where}: expected a pair [gflop, efficiency], got {pair!r}")
            continue
        gflop = _number(src, f"{where}[0]", pair[0], "a positive number of GFLOPs per matmul", "pos", errors)
        eff = _number(src, f"{where}[1]", pair[1], "an efficiency (fraction of peak) in (0, 1]", "frac", errors)
        if gflop is not None and eff is not None:
            if points and gflop <= points[-1][0]:
                errors.append(f"{src}: {where}[0]: GFLOPs must increase strictly along the curve, got {gflop!r} "
                              f"after {points[-1][0]!r}; sort the points by GFLOPs and merge duplicates")
            points.append((gflop, eff))
    return tuple(points) if len(errors) == n_before else None


def _parse(d: Any, src: str) -> tuple[dict[str, Any], list[str]]:
    """Validate a raw cluster mapping; returns (constructor kwargs, every error found, in the order of
    the steps: unknown keys, name, size, device, links, backend, the optional fields)."""
    if not isinstance(d, dict):
        return {}, [f"{src}: expected a YAML mapping of cluster fields ({', '.join(_TOP_KEYS)}), "
                    f"got {type(d).__name__}"]
    errors: list[str] = []
    kw: dict[str, Any] = {}
    for key in d:
        if key not in _TOP_KEYS:
            errors.append(_unknown_key(src, "", key, _TOP_KEYS))
    for step in (_parse_name, _parse_size, _parse_device, _parse_links, _parse_backend, _parse_optional):
        step(d, src, kw, errors)
    return kw, errors


def _parse_name(d: dict, src: str, kw: dict[str, Any], errors: list[str]) -> None:
    name = d.get("name")
    if name is None:
        errors.append(f"{src}: name: missing; expected a cluster name, e.g. dgx-a100-8")
    elif not isinstance(name, str) or not name.strip():
        errors.append(f"{src}: name: expected a non-empty string, got {name!r}")
    kw["name"] = name


def _parse_size(d: dict, src: str, kw: dict[str, Any], errors: list[str]) -> None:
    for key, what in (("nodes", "number of nodes"), ("devices_per_node", "number of devices per node")):
        expected = f"a positive integer ({what}; nodes * devices_per_node must be at least 1)"
        if key not in d:
            errors.append(f"{src}: {key}: missing; expected {expected}")
        else:
            kw[key] = _number(src, key, d[key], expected, "int", errors)


def _parse_device(d: dict, src: str, kw: dict[str, Any], errors: list[str]) -> None:
    if "device" not in d:
        errors.append(f"{src}: device: missing; expected a mapping with keys {', '.join(_DEVICE_FIELDS)}")
    else:
        dev = _section(src, "device", d["device"], _DEVICE_FIELDS, errors)
        kw["device"] = DeviceSpec(**dev) if dev else None


def _parse_links(d: dict, src: str, kw: dict[str, Any], errors: list[str]) -> None:
    """``links``: intra_node, and inter_node when nodes > 1 (one node: the intra-node link stands in)."""
    links = d.get("links")
    if links is None:
        errors.append(f"{src}: links: missing; expected a mapping with intra_node "
                      "(and inter_node when nodes > 1), each {bandwidth_gbps, latency_us}")
        return
    if not isinstance(links, dict):
        errors.append(f"{src}: links: expected a mapping with keys intra_node, inter_node, got {links!r}")
        return
    for key in links:
        if key not in _LINK_KEYS:
            errors.append(_unknown_key(src, "links.", key, _LINK_KEYS))
    if "intra_node" not in links:
        errors.append(f"{src}: links.intra_node: missing; expected "
                      "{bandwidth_gbps: GB/s per device, latency_us: microseconds}")
    else:
        intra = _section(src, "links.intra_node", links["intra_node"], {**_LINK_FIELDS, **_LINK_CPU_FIELD}, errors,
                         defaults={"cpu_ns_per_byte": 0.0})
        kw["intra_node"] = LinkSpec(**intra) if intra else None
    if "inter_node" in links:
        kw["inter_node"] = _inter_node(src, links["inter_node"], errors)
    elif isinstance(kw.get("nodes"), int) and kw["nodes"] > 1:
        errors.append(f"{src}: links.inter_node: missing; required when nodes > 1 (nodes is "
                      f"{kw['nodes']}); expected {{bandwidth_gbps: GB/s per device, latency_us: microseconds}}")
    else:
        kw["inter_node"] = kw.get("intra_node")     # one node: never used by a mesh, kept for resized()


def _parse_backend(d: dict, src: str, kw: dict[str, Any], errors: list[str]) -> None:
    backend = d.get("backend")
    known = ", ".join(b.value for b in Backend)
    if backend is None:
        errors.append(f"{src}: backend: missing; expected one of {known}")
    elif backend not in {b.value for b in Backend}:
        errors.append(f"{src}: backend: unknown backend {backend!r}; known backends: {known}")
    else:
        kw["backend"] = Backend(backend)
        dev = kw.get("device")
        if backend == Backend.NCCL.value and dev is not None and dev.kind != "cuda":
            errors.append(f"{src}: backend: nccl needs cuda devices but device.kind is {dev.kind!r}; "
                          "use backend: gloo")


def _parse_optional(d: dict, src: str, kw: dict[str, Any], errors: list[str]) -> None:
    """The fields with defaults: efficiency, op overheads, CPU time-sharing, the host, fitted curves."""
    if "efficiency" in d:
        eff = _section(src, "efficiency", d["efficiency"], _EFFICIENCY_FIELDS, errors,
                       defaults=dataclasses.asdict(Efficiency()))
        kw["efficiency"] = Efficiency(**eff) if eff else None
    if "op_overhead_us" in d:
        kw["op_overhead_us"] = _number(src, "op_overhead_us", d["op_overhead_us"],
                                       "a non-negative number in microseconds per op launch", "nonneg",
                                       errors)
    if d.get("calibrated_on") is not None:
        if isinstance(d["calibrated_on"], str) and d["calibrated_on"].strip():
            kw["calibrated_on"] = d["calibrated_on"].strip()
        else:
            errors.append(f"{src}: calibrated_on: {d['calibrated_on']!r} is not a machine description; it is the "
                          "text `autoddl calibrate` writes (autoddl/machine.py): leave it out or calibrate again")
    if d.get("cores_per_node") is not None:
        kw["cores_per_node"] = _number(src, "cores_per_node", d["cores_per_node"],
                                       "a positive integer: ranks a node runs at full speed at once (CPU cores / "
                                       "threads per rank); leave it out when every device has its own hardware",
                                       "int", errors)
    if d.get("comm_measured_ranks_per_node") is not None:
        kw["comm_measured_ranks_per_node"] = _number(
            src, "comm_measured_ranks_per_node", d["comm_measured_ranks_per_node"],
            "a positive integer: ranks of a node that ran at once while links and collectives were measured", "int",
            errors)
    if d.get("host_link") is not None:
        host = _section(src, "host_link", d["host_link"], _LINK_FIELDS, errors)
        kw["host_link"] = LinkSpec(**host) if host else None
    for key in ("host_memory_gb", "host_memory_bandwidth_gbps"):
        if d.get(key) is not None:
            kw[key] = _number(src, key, d[key], HOST_FIELDS[key], "pos", errors)
    if d.get("collectives") is not None:
        kw["collectives"] = _collectives(src, d["collectives"], errors)
    if d.get("collective_points") is not None:
        kw["collective_points"] = parse_collective_points(src, d["collective_points"], errors, COLLECTIVE_KINDS)
    if d.get("compute_curve") is not None:
        kw["compute_curve"] = _compute_curve(src, d["compute_curve"], errors)
    if d.get("matmul_layouts") is not None:
        kw["matmul_layouts"] = parse_layouts(src, d["matmul_layouts"], errors, PEAK_DTYPES)
    if d.get("executor") is not None:
        kw["executor"] = _executor(src, d["executor"], errors)


def _inter_node(src: str, value: Any, errors: list[str]) -> LinkSpec | None:
    """``links.inter_node``: a link, optionally shared by the node's devices (module docstring); None on error."""
    n_before = len(errors)
    link = _section(src, "links.inter_node", value, {**_LINK_FIELDS, **_LINK_CPU_FIELD, **_SHARED_LINK_FIELDS},
                    errors, defaults={"shared_by_node": False, "measured_flows": None, "flow_bandwidth_gbps": None,
                                      "cpu_ns_per_byte": 0.0})
    if link is None:
        return None
    if link["shared_by_node"] and link["measured_flows"] is None:
        errors.append(f"{src}: links.inter_node.measured_flows: missing; shared_by_node: true needs "
                      f"{_SHARED_LINK_FIELDS['measured_flows'][0]} (the two-host testbed's fit: 2)")
    for key in ("measured_flows", "flow_bandwidth_gbps"):
        if not link["shared_by_node"] and link[key] is not None:
            errors.append(f"{src}: links.inter_node.{key}: given without shared_by_node: true; it applies only "
                          f"to a link the node's devices share: add shared_by_node: true, or drop {key}")
    return LinkSpec(**link) if len(errors) == n_before else None


def _number_list(src: str, dotted: str, value: Any, names: tuple[str, ...], what: tuple[str, str], kind: str,
                 errors: list[str]) -> tuple[float, ...] | None:
    """``[x, y, ...]``: one number per name in ``names``, each checked as ``kind``; ``what``: (the numbers,
    one number) in words, for the errors (None on error)."""
    if not isinstance(value, (list, tuple)) or len(value) != len(names):
        errors.append(f"{src}: {dotted}: expected [{', '.join(names)}], {what[0]}, got {value!r}")
        return None
    n_before = len(errors)
    out = tuple(_number(src, f"{dotted}[{i}]", v, f"{names[i]}, {what[1]}", kind, errors) for i, v in enumerate(value))
    return out if len(errors) == n_before else None


_OP_TABLES = {   # executor table -> (numbers per family, what they are (all, one), check)
    "op_us": (("forward_us", "backward_us"), ("non-negative numbers of microseconds per op of the family",
                                              "a non-negative number of microseconds per op"), "nonneg"),
    "op_work": (("roofline_us", "forward_work", "backward_work"), ("", ""), "pos"),
}


def _work_curve(src: str, dotted: str, value: Any, errors: list[str]) -> tuple | None:
    """``[[roofline_us, forward_work, backward_work], ...]``: positive numbers, roofline_us strictly
    increasing (None on error)."""
    return _curve(src, dotted, value, ("roofline_us", "forward_work", "backward_work"),
                  "a list of [roofline_us, forward_work, backward_work] points: the op's forward roofline time in "
                  "microseconds (strictly increasing) and the multiples of the roofline its forward and backward "
                  "take", errors)


def _curve(src: str, dotted: str, value: Any, names: tuple[str, ...], expected: str,
           errors: list[str]) -> tuple | None:
    """A non-empty list of points of positive numbers, one per name in ``names``, the first strictly
    increasing along the list (None on error)."""
    if not isinstance(value, (list, tuple)) or not value:
        errors.append(f"{src}: {dotted}: expected {expected}, got {value!r}")
        return None
    n_before = len(errors)
    points: list[tuple[float, ...]] = []
    for i, p in enumerate(value):
        parsed = _number_list(src, f"{dotted}[{i}]", p, names, ("positive numbers", "a positive number"), "pos",
                              errors)
        if parsed is not None:
            if points and parsed[0] <= points[-1][0]:
                errors.append(f"{src}: {dotted}[{i}][0]: {names[0]} must increase strictly along the curve, got "
                              f"{parsed[0]!r} after {points[-1][0]!r}")
            points.append(parsed)
    return tuple(points) if len(errors) == n_before else None


def _is_mapping(src: str, dotted: str, value: Any, expected: str, errors: list[str]) -> bool:
    """Whether ``value`` is a mapping; if not, an error saying what ``dotted`` expected."""
    if not isinstance(value, dict):
        errors.append(f"{src}: {dotted}: expected {expected}, got {value!r}")
    return isinstance(value, dict)


SKEW_BASE_MS = 0.5     # the compute before a move when executor.collective_us is timed (executor/calibrate.py)


def arrival_skew_x(compute_s: float) -> float:
    """The arrival skew's variable: sqrt(C) - sqrt(0.5), C the compute in ms (0 at or below 0.5 ms)."""
    return max(0.0, math.sqrt(max(compute_s, 0.0) * 1e3) - math.sqrt(SKEW_BASE_MS))


OPTIMIZER_KINDS = ("sgd", "adamw")     # as costmodel/compute.py's OPTIMIZERS names them


def _optimizer_curves(src: str, value: Any, errors: list[str]) -> dict | None:
    """``executor.optimizer_ns``: ``{optimizer: [[numel, ns_per_element], ...]}``, positive numbers,
    numel strictly increasing (None on error)."""
    expected = (f"a mapping from optimizer ({', '.join(OPTIMIZER_KINDS)}) to a list of [numel, ns_per_element] "
                "points: local float32 parameters (strictly increasing) and nanoseconds per element of a step")
    if not _is_mapping(src, "executor.optimizer_ns", value, expected, errors):
        return None
    n_before = len(errors)
    out: dict[str, tuple] = {}
    for kind, points in value.items():
        if kind not in OPTIMIZER_KINDS:
            errors.append(_unknown_key(src, "executor.optimizer_ns.", kind, OPTIMIZER_KINDS))
            continue
        out[kind] = _curve(src, f"executor.optimizer_ns.{kind}", points, ("numel", "ns_per_element"), expected,
                           errors)
    return out if len(errors) == n_before else None


def _arrival_skew(src: str, value: Any, errors: list[str]) -> dict | None:
    """``executor.arrival_skew_us``: ``{ranks_N: microseconds per sqrt(ms)}`` (None on error)."""
    expected = ("a mapping from ranks_N (the ranks busy on a node when it was measured) to a non-negative number "
                "of microseconds per sqrt(ms) of compute")
    if not _is_mapping(src, "executor.arrival_skew_us", value, expected, errors):
        return None
    n_before = len(errors)
    out: dict[int, float] = {}
    for key, v in value.items():
        match = re.fullmatch(r"ranks_([1-9][0-9]*)", str(key))
        if match is None:
            errors.append(f"{src}: executor.arrival_skew_us.{key}: expected a key ranks_N (N ranks busy on a node, "
                          "e.g. ranks_2)")
            continue
        number = _number(src, f"executor.arrival_skew_us.{key}", v, "a non-negative number of microseconds per "
                         "sqrt(ms)", "nonneg", errors)
        if number is not None:
            out[int(match.group(1))] = number
    return out if len(errors) == n_before else None


_RECOMPUTE_FIELDS = {k: (f"a non-negative number of microseconds {what}", "nonneg") for k, what in (
    ("op_forward_us", "per op of the block but matmul-like ones, forward"),
    ("op_backward_us", "per op of the block but matmul-like ones, backward (beyond running its forward again)"),
    ("matmul_forward_us", "per matmul-like op of the block, forward"),
    ("matmul_backward_us", "per matmul-like op of the block, backward (beyond running its forward again)"),
    ("block_forward_us", "per recomputed block, forward"),
    ("block_backward_us", "per recomputed block, backward"))}


def _op_table(src: str, name: str, value: Any, errors: list[str]) -> dict | None:
    """``executor.op_us`` (``{dtype: {family: [forward_us, backward_us]}}``) or ``op_work`` (``{dtype:
    {family: [[roofline_us, forward_work, backward_work], ...]}}``); None on error."""
    names, what, kind = _OP_TABLES[name]
    shape = f"[{', '.join(names)}]" if name == "op_us" else f"[[{', '.join(names)}], ...]"
    expected = (f"a mapping from compute dtype ({', '.join(PEAK_DTYPES)}) to {{op family (an aten op name, e.g. "
                f"linear): {shape}}}")
    if not isinstance(value, dict):
        errors.append(f"{src}: executor.{name}: expected {expected}, got {value!r}")
        return None
    n_before = len(errors)
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for key, fams in value.items():
        dtype = peak_dtype(key) if isinstance(key, str) else None
        if dtype is None:
            close = difflib.get_close_matches(str(key), PEAK_DTYPES + tuple(DTYPES), n=1)
            hint = f"did you mean {peak_dtype(close[0])!r}? " if close else ""
            errors.append(f"{src}: executor.{name}.{key}: unknown dtype; {hint}known dtypes: {', '.join(PEAK_DTYPES)}")
            continue
        if dtype in out:
            errors.append(f"{src}: executor.{name}.{key}: {dtype} given twice; keep one")
            continue
        if not isinstance(fams, dict):
            errors.append(f"{src}: executor.{name}.{key}: expected a mapping from op family to {shape}, got {fams!r}")
            continue
        out[dtype] = {}
        for fam, numbers in fams.items():
            if not isinstance(fam, str) or not fam.strip():
                errors.append(f"{src}: executor.{name}.{key}: op family names must be non-empty strings, got {fam!r}")
                continue
            parsed = (_work_curve(src, f"executor.{name}.{key}.{fam}", numbers, errors) if name == "op_work"
                      else _number_list(src, f"executor.{name}.{key}.{fam}", numbers, names, what, kind, errors))
            if parsed is not None:
                out[dtype][fam] = parsed
    return out if len(errors) == n_before else None


def _executor(src: str, value: Any, errors: list[str]) -> ExecutorOverheads | None:
    """The ``executor`` section: scalar fields (default 0), the per-family tables and ``recompute``."""
    tables = ("op_us", "op_work", "recompute", "optimizer_ns", "arrival_skew_us")
    if not isinstance(value, dict):
        errors.append(f"{src}: executor: expected a mapping with keys {', '.join(tuple(_EXECUTOR_FIELDS) + tables)}, "
                      f"got {value!r}")
        return None
    n_before = len(errors)
    scalars = {k: v for k, v in value.items() if k not in tables}
    ex = _section(src, "executor", scalars, {**_EXECUTOR_FIELDS, **{t: ("", "") for t in tables}}, errors,
                  defaults={**ExecutorOverheads().scalars(), **{t: {} for t in tables}})
    kw: dict[str, Any] = {k: v for k, v in (ex or {}).items() if k not in tables}
    for name in ("op_us", "op_work"):
        if value.get(name) is not None:
            kw[name] = _op_table(src, name, value[name], errors)
    if isinstance(kw.get("op_work"), dict):
        for dtype, fams in kw["op_work"].items():
            for fam in fams:
                if fam not in (kw.get("op_us") or {}).get(dtype, {}):
                    errors.append(f"{src}: executor.op_work.{dtype}.{fam}: no executor.op_us.{dtype}.{fam} beside it; "
                                  "a family's work scale goes with its fixed cost (give both, or neither)")
    if value.get("optimizer_ns") is not None:
        kw["optimizer_ns"] = _optimizer_curves(src, value["optimizer_ns"], errors)
    if value.get("arrival_skew_us") is not None:
        kw["arrival_skew_us"] = _arrival_skew(src, value["arrival_skew_us"], errors)
    rec = value.get("recompute")
    if rec is not None:
        if not isinstance(rec, dict):
            errors.append(f"{src}: executor.recompute: expected a mapping from recompute policy "
                          f"({', '.join(RECOMPUTE_POLICIES)}) to {{{', '.join(_RECOMPUTE_FIELDS)}}}, got {rec!r}")
        else:
            kw["recompute"] = {}
            for policy, spec in rec.items():
                if policy not in RECOMPUTE_POLICIES:
                    errors.append(_unknown_key(src, "executor.recompute.", policy, RECOMPUTE_POLICIES))
                    continue
                parsed = _section(src, f"executor.recompute.{policy}", spec, _RECOMPUTE_FIELDS, errors,
                                  defaults=dataclasses.asdict(RecomputeCost()))
                if parsed is not None:
                    kw["recompute"][policy] = RecomputeCost(**parsed)
    return ExecutorOverheads(**kw) if len(errors) == n_before else None


# -- YAML writing ---------------------------------------------------------------
def _scalar(v: Any) -> str:
    if isinstance(v, Enum):
        v = v.value
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        plain = "#" not in v and "\n" not in v and v == v.strip() and yaml.safe_load(f"k: {v}") == {"k": v}
        return v if plain else yaml.safe_dump(v, default_style='"', width=10**9).strip()
    if isinstance(v, int) or float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    text = repr(float(v))
    if "e" in text and "." not in text:             # PyYAML 1.1 needs a dot to read 1e-05 as a float
        text = text.replace("e", ".0e")
    return text


def yaml_comments(path: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """The header and the end-of-line comments of a cluster file in :meth:`Cluster.to_yaml`'s layout (two
    spaces per level, one ``- [x, y]`` line per list item), keyed as ``to_yaml`` takes them: what a
    rewrite of the file needs to keep them (``autoddl calibrate --only shard_runner``)."""
    header: list[str] = []
    comments: dict[str, str] = {}
    keys: list[str] = []
    items: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            if not keys and text:
                header.append(line[2:].rstrip() if line.startswith("# ") else text[1:].strip())
            continue
        body, _, note = line.partition("  # ")
        depth = (len(body) - len(body.lstrip())) // 2
        if text.startswith("- "):
            parent = ".".join(keys[:depth])
            dotted = f"{parent}.{items.get(parent, 0)}"
            items[parent] = items.get(parent, 0) + 1
        else:
            keys[depth:] = [body.strip().split(":")[0]]
            dotted = ".".join(keys)
        if note.strip():
            comments[dotted] = note.strip()
    return "\n".join(header), comments


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices with two link levels.

    ``inter_node`` may be left out of the YAML when ``nodes == 1``: it then
    defaults to the ``intra_node`` values (no mesh axis of a one-node cluster
    crosses nodes). Give it anyway when the cluster may be ``resized`` to
    several nodes. ``source`` is the file it came from (not compared).
    """

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    backend: Backend
    efficiency: Efficiency = Efficiency()
    op_overhead_us: float = 5.0
    collectives: CollectiveFits = CollectiveFits()
    collective_points: CollectivePoints = CollectivePoints()   # measured times by size (autoddl/collective_points.py)
    compute_curve: tuple[tuple[float, float], ...] = ()
    matmul_layouts: MatmulLayouts = MatmulLayouts()   # emulated dtypes' matmuls (autoddl/matmul_layouts.py)
    executor: ExecutorOverheads = ExecutorOverheads()
    cores_per_node: int | None = None   # CPU: ranks a node runs at once at full speed; None: no sharing
    comm_measured_ranks_per_node: int | None = None   # ranks per node busy while links / collectives were measured
    host_link: LinkSpec | None = None   # one device's copy path to host memory (None: not described)
    host_memory_gb: float | None = None             # host memory per node, 1e9 bytes
    host_memory_bandwidth_gbps: float | None = None  # host memory bandwidth per node, GB/s
    calibrated_on: str | None = field(default=None, compare=False)   # CPU: the machine measured (autoddl/machine.py)
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        src = self.source or f"cluster {self.name!r}"
        if isinstance(self.device, DeviceSpec) and self.device.source != src:    # peak_tflops_for's errors name it
            object.__setattr__(self, "device", dataclasses.replace(self.device, source=src))
        if isinstance(self.collectives, dict):          # {kind: LinkSpec | {latency_us, bandwidth_gbps}}
            fits = {k: LinkSpec(**v) if isinstance(v, dict) else v for k, v in self.collectives.items()}
            bad = [k for k in fits if k not in FITTED_KINDS]
            if bad:
                raise ClusterConfigError(f"{self.source or self.name}: collectives: unknown kinds {bad}; "
                                         f"known kinds: {', '.join(FITTED_KINDS)}")
            object.__setattr__(self, "collectives", CollectiveFits(**fits))
        if self.collective_points is None:
            object.__setattr__(self, "collective_points", CollectivePoints())
        if self.compute_curve is None:
            object.__setattr__(self, "compute_curve", ())
        object.__setattr__(self, "matmul_layouts", MatmulLayouts.of(self.matmul_layouts))   # {dtype: rows} too
        if self.executor is None:
            object.__setattr__(self, "executor", ExecutorOverheads())
        elif isinstance(self.executor, dict):
            object.__setattr__(self, "executor", ExecutorOverheads(**self.executor))
        if isinstance(self.host_link, dict):
            object.__setattr__(self, "host_link", LinkSpec(**self.host_link))
        if isinstance(self.compute_curve, (list, tuple)):
            object.__setattr__(self, "compute_curve", tuple(
                tuple(p) if isinstance(p, (list, tuple)) else p for p in self.compute_curve))
        try:
            object.__setattr__(self, "backend", Backend(self.backend))
        except ValueError:
            raise ClusterConfigError(f"{self.source or self.name}: backend: unknown backend {self.backend!r}; "
                                     f"known backends: {', '.join(b.value for b in Backend)}") from None
        _, errors = _parse(self.to_dict(), self.source or f"Cluster {self.name!r}")
        if errors:
            raise ClusterConfigError(errors, self.source)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    # -- loading / saving -------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> "Cluster":
        kw, errors = _parse(d, source)
        if errors:
            raise ClusterConfigError(errors, source)
        return cls(**kw, source=source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Cluster":
        src = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            names = available_configs()
            close = difflib.get_close_matches(Path(path).stem, names, n=1)
            hint = f" Did you mean {CONFIG_DIR / (close[0] + '.yaml')}?" if close else ""
            raise ClusterConfigError(f"{src}: no such cluster config file.{hint} Bundled configs in "
                                     f"{CONFIG_DIR}: {', '.join(names)}", src) from None
        except (IsADirectoryError, UnicodeDecodeError) as exc:
            raise ClusterConfigError(f"{src}: cannot read as a YAML text file ({exc})", src) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ClusterConfigError(f"{src}: not valid YAML{at}: {problem}; expected a mapping like "
                                     f"{DEFAULT_CLUSTER_PATH}", src) from None
        return cls.from_dict(data, source=src)

    def to_dict(self) -> dict[str, Any]:
        """The YAML schema as plain data (``from_dict(c.to_dict()) == c``)."""
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
            "links": {"intra_node": self.intra_node.to_dict(), "inter_node": self.inter_node.to_dict()},
            "backend": Backend(self.backend).value,
            "efficiency": self.efficiency.to_dict(),
            "op_overhead_us": self.op_overhead_us,
            **({"collectives": {k: v.to_dict() for k, v in self.collectives.items()}}
               if self.collectives else {}),
            **({"collective_points": self.collective_points.to_dict()} if self.collective_points else {}),
            **({"compute_curve": [list(p) for p in self.compute_curve]} if self.compute_curve else {}),
            **({"matmul_layouts": self.matmul_layouts.to_dict()} if self.matmul_layouts else {}),
            **({"executor": self.executor.to_dict()} if self.executor else {}),
            **({"cores_per_node": self.cores_per_node} if self.cores_per_node else {}),
            **({"comm_measured_ranks_per_node": self.comm_measured_ranks_per_node}
               if self.comm_measured_ranks_per_node else {}),
            **({"host_link": self.host_link.to_dict()} if self.host_link else {}),
            **{k: getattr(self, k) for k in ("host_memory_gb", "host_memory_bandwidth_gbps")
               if getattr(self, k) is not None},
            **({"calibrated_on": self.calibrated_on} if self.calibrated_on else {}),
        }

    def require_host(self, why: str) -> None:
        """Raise naming every host field (module docstring) this cluster file leaves out, for ``why``."""
        missing = [k for k in HOST_FIELDS if getattr(self, k) is None]
        if missing:
            raise ClusterConfigError(
                [f"{self.source or self.name}: {k}: missing; {why} needs it: add {k}: {HOST_FIELDS[k]} "
                 f"(with its source), or plan with --offload none" for k in missing], self.source)

    def host_bytes_per_device(self) -> float:
        """Host memory one device's rank may use: the node's, shared by its devices."""
        self.require_host("host memory accounting")
        return self.host_memory_gb * 1e9 / self.devices_per_node

    def to_yaml(self, path: str | os.PathLike, comments: dict[str, str] | None = None,
                header: str = "") -> None:
        """Write YAML atomically; ``comments`` maps dotted fields (``device.peak_tflops``,
        ``links.intra_node``, ``collectives.all_reduce``, ``compute_curve.0`` for the first
        point) to a comment placed at the end of that line; ``header`` (several lines
        allowed) is written as ``#`` comment lines at the top."""
        comments = dict(comments or {})
        lines: list[tuple[str, str]] = [("", f"# {h}".rstrip()) for h in header.splitlines()]

        def emit(mapping: dict[str, Any], prefix: str, indent: int) -> None:
            for key, value in mapping.items():
                dotted = f"{prefix}{key}"
                pad = "  " * indent
                if isinstance(value, dict):
                    lines.append((dotted, f"{pad}{key}:"))
                    emit(value, dotted + ".", indent + 1)
                elif isinstance(value, list) and all(not isinstance(x, (list, tuple, dict)) for x in value):
                    lines.append((dotted, f"{pad}{key}: [{', '.join(_scalar(x) for x in value)}]"))
                elif isinstance(value, list) and dotted.startswith("collective_points."):   # a curve: one line
                    pairs = ", ".join(f"[{', '.join(_scalar(x) for x in item)}]" for item in value)
                    lines.append((dotted, f"{pad}{key}: [{pairs}]"))
                elif isinstance(value, list):            # compute_curve: one "- [x, y]" line per point
                    lines.append((dotted, f"{pad}{key}:"))
                    for i, item in enumerate(value):
                        lines.append((f"{dotted}.{i}", f"{pad}  - [{', '.join(_scalar(x) for x in item)}]"))
                else:
                    lines.append((dotted, f"{pad}{key}: {_scalar(value)}"))

        emit(self.to_dict(), "", 0)
        known = [k for k, _ in lines if k]
        unknown = [k for k in comments if k not in known]
        if unknown:
            raise KeyError(f"to_yaml comments name unknown fields {unknown}; known fields: {', '.join(known)}")
        text = "".join(
            f"{line}  # {' '.join(comments[k].split())}\n" if comments.get(k) else f"{line}\n"
            for k, line in lines)
        write_text_atomic(path, text)

    # -- shape ----------------------------------------------------------------------
    def resized(self, num_devices: int) -> "Cluster":
        """Same hardware on ``num_devices`` devices: a part of one node (a divisor of
        ``devices_per_node``) or whole nodes (a multiple of it). Named ``base@N``."""
        n, per = num_devices, self.devices_per_node
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ClusterConfigError(f"{self.name}: cannot resize to {n!r} devices: expected a positive integer")
        if n == self.num_devices:
            return self
        if n <= per and per % n == 0:
            nodes, dpn = 1, n
        elif n % per == 0:
            nodes, dpn = n // per, per
        else:
            divisors = [k for k in range(1, per + 1) if per % k == 0]
            lower = (n // per) * per
            multiples = [m for m in (lower, lower + per) if m > 0]
            raise ClusterConfigError(
                f"{self.name}: cannot lay out {n} devices on nodes of {per} devices: use a divisor of "
                f"{per} (one partial node: {', '.join(map(str, divisors))}) or a multiple of {per} "
                f"(whole nodes, e.g. {' or '.join(map(str, multiples))})")
        base = self.name.split("@")[0]
        return dataclasses.replace(self, name=f"{base}@{n}", nodes=nodes, devices_per_node=dpn)

    def time_sharing(self, mesh_shape: tuple[int, ...]) -> float:
        """How many times slower every rank of a mesh runs because a node holds more of its ranks than
        ``cores_per_node`` (ranks fill nodes in order): ``max(1, ranks per node / cores_per_node)``."""
        if not self.cores_per_node:
            return 1.0
        return max(1.0, self.ranks_per_node(mesh_shape) / self.cores_per_node)

    def ranks_per_node(self, mesh_shape: tuple[int, ...]) -> int:
        """How many of a mesh's ranks a node runs (ranks fill nodes in order)."""
        return min(math.prod(mesh_shape), self.devices_per_node)

    def comm_time_sharing(self, mesh_shape: tuple[int, ...]) -> float:
        """``time_sharing`` of the mesh relative to the sharing the links and collectives were measured
        under (``comm_measured_ranks_per_node`` ranks per node at once): a fit taken with every rank of
        a node busy already holds their time-sharing, and is not slowed twice."""
        if not (self.cores_per_node and self.comm_measured_ranks_per_node):
            return self.time_sharing(mesh_shape)
        measured = max(1.0, self.comm_measured_ranks_per_node / self.cores_per_node)
        return self.time_sharing(mesh_shape) / measured

    def link_for_axis(self, mesh_shape: tuple[int, ...], axis: int) -> LinkSpec:
        """The link a collective on mesh axis ``axis`` crosses (outermost axis first,
        devices numbered row-major, node-major): intra-node when the axis and every
        axis inside it fit in one node, i.e. ``prod(mesh_shape[axis:]) <= devices_per_node``."""
        shape = tuple(mesh_shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"{self.name}: mesh shape must be positive integers, got {mesh_shape!r}")
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"{self.name}: axis {axis} out of range for mesh {shape} "
                             f"(axes 0..{len(shape) - 1})")
        axis %= len(shape)
        return self.intra_node if math.prod(shape[axis:]) <= self.devices_per_node else self.inter_node

    def summary(self) -> str:
        d, a, e = self.device, self.intra_node, self.inter_node
        f = self.efficiency
        shared = f" per flow of {e.measured_flows} on the node's one link" if e.shared_by_node else ""
        inter = f" | inter {e.bandwidth_gbps:g} GB/s{shared} {e.latency_us:g} us" if self.nodes > 1 else ""
        return (f"{self.name}: {self.nodes}x{self.devices_per_node} {d.name} ({d.kind}, "
                f"{d.peak_text()}, {d.memory_gb:g} GB, {d.memory_bandwidth_gbps:g} GB/s) "
                f"| intra {a.bandwidth_gbps:g} GB/s {a.latency_us:g} us{inter} | {Backend(self.backend).value} "
                f"| eff compute {f.compute:g} memory {f.memory:g} network {f.network:g}"
                + (f" attention {f.attention:g}" if f.attention is not None else "") + " "
                f"| op overhead {self.op_overhead_us:g} us"
                + (f" | fitted collectives: {', '.join(k for k, _ in self.collectives.items())}"
                   if self.collectives else "")
                + (f" | measured collective points: {len(self.collective_points.curves)} curves"
                   if self.collective_points else "")
                + (f" | compute curve: {len(self.compute_curve)} points" if self.compute_curve else "")
                + (" | matmul layouts: " + ", ".join(self.matmul_layouts.dtypes()) if self.matmul_layouts else "")
                + (" | executor overheads: " + ", ".join(f"{k} {v:g}" for k, v in self.executor.scalars().items()
                                                         if v) if self.executor else "")
                + (" | op families measured: " + ", ".join(f"{len(f)} {dt}" for dt, f in self.executor.op_us.items())
                   if self.executor.op_us else "")
                + (" | recompute costs: " + ", ".join(self.executor.recompute) if self.executor.recompute
                   else "")
                + (f" | {self.cores_per_node} ranks per node at once" if self.cores_per_node else "")
                + (f" | host link {self.host_link.bandwidth_gbps:g} GB/s {self.host_link.latency_us:g} us"
                   if self.host_link else "")
                + (f" | host {self.host_memory_gb:g} GB per node" if self.host_memory_gb else ""))

    def __str__(self) -> str:
        return self.summary()


def available_configs() -> list[str]:
    """Names of the bundled configs in ``configs/`` (without ``.yaml``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def bundled_config(name: str) -> Path:
    """Path of a bundled config: ``"dgx-a100-8"`` or ``"dgx-a100-8.yaml"``."""
    stem = name[:-5] if name.endswith(".yaml") else name
    path = CONFIG_DIR / f"{stem}.yaml"
    if "/" in stem or os.sep in stem or not path.is_file():
        names = available_configs()
        close = difflib.get_close_matches(stem, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ClusterConfigError(f"no bundled cluster config {name!r} in {CONFIG_DIR}.{hint} "
                                 f"Available: {', '.join(names) or '(none)'}")
    return path
