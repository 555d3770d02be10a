"""Alpha-beta time of one collective on one mesh axis, per backend.

``M`` is always the bytes of the *full* tensor the collective is about (as seen
on this axis, i.e. already divided by the splits of the other mesh axes), never
a per-device piece. For ``n`` devices on the axis, bandwidth ``b`` (bytes/s per
device, one direction, derated by ``network_eff``) and latency ``a`` (s):

==============  =====================================  ===========================================
kind            M                                      time (ring / pairwise algorithms)
==============  =====================================  ===========================================
all_reduce      each device's full-size addend         2(n-1)/n * M/b + 2(n-1) * a
all_gather      the gathered tensor (piece = M/n)      (n-1)/n * M/b + (n-1) * a
reduce_scatter  each device's full-size input          (n-1)/n * M/b + (n-1) * a
all_to_all      the logical tensor (piece = M/n)       (n-1)/n * (M/n)/b + (n-1) * a
                (each device sends (n-1)/n of its M/n piece in n-1 pairwise steps)
broadcast       the broadcast tensor                   M/b + (n-1) * a
                (pipelined ring: bandwidth term ~M/b for large M, n-1 hops of latency)
==============  =====================================  ===========================================

``n == 1`` costs 0 for every kind. The backend table says how each kind is
really carried out; an emulated kind is costed as the kind that runs, on the
same ``M`` (the definitions above make that a plain substitution).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Mapping

from autoddl.cluster import Backend, LinkSpec


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"

    def __str__(self) -> str:
        return self.value


PHASES = ("forward", "backward", "grad_sync")


@dataclass(frozen=True)
class Collective:
    """One collective a training step runs: kind (as carried out), mesh axis, M bytes, phase."""

    kind: CollectiveKind
    axis: int
    bytes: int            # M: full tensor bytes on this axis (see module docstring)
    phase: str            # "forward" | "backward" | "grad_sync"
    tensor: str = ""      # the graph edge "producer->consumer" or parameter fqn it moves

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"Collective.phase must be one of {PHASES}, got {self.phase!r}")

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "axis": self.axis, "bytes": int(self.bytes),
                "phase": self.phase, "tensor": self.tensor}


@dataclass(frozen=True)
class BackendCollectives:
    """How one backend carries out each collective kind (kind -> kind that really runs)."""

    backend: Backend
    carried_as: Mapping[CollectiveKind, CollectiveKind]
    note: str = ""

    def __call__(self, kind: CollectiveKind) -> CollectiveKind:
        return self.carried_as.get(CollectiveKind(kind), CollectiveKind(kind))


_NATIVE = MappingProxyType({k: k for k in CollectiveKind})

BACKENDS: Mapping[Backend, BackendCollectives] = MappingProxyType({
    Backend.NCCL: BackendCollectives(Backend.NCCL, _NATIVE, "NCCL runs every kind natively"),
    # torch 2.13, checked in the installed package and its C++ source:
    # - reduce-scatter: ProcessGroupGloo::reduce_scatter_tensor_coalesced (pytorch PR #118911), which
    #   `_reduce_scatter_base` and funcol.reduce_scatter_single reach, clones the input, runs
    #   `allreduce` on the clone and copies out `buffer.chunk(world)[rank]`: an all-reduce of M.
    # - all-to-all: torch/distributed/tensor/_collective_utils.py::shard_dim_alltoall, for
    #   mesh.device_type == "cpu": "Gloo does not support alltoall, so falling back to allgather
    #   + chunk": DTensor's S(i)->S(j) is an all-gather of the full M, then a local chunk.
    Backend.GLOO: BackendCollectives(
        Backend.GLOO,
        MappingProxyType({**_NATIVE,
                          CollectiveKind.REDUCE_SCATTER: CollectiveKind.ALL_REDUCE,
                          CollectiveKind.ALL_TO_ALL: CollectiveKind.ALL_GATHER}),
        "gloo: reduce-scatter = all-reduce + local chunk; all-to-all (DTensor on CPU) = all-gather + chunk",
    ),
})


def carried_out_as(kind: CollectiveKind, backend: Backend | str) -> CollectiveKind:
    """The collective that really runs for ``kind`` on ``backend``."""
    try:
        table = BACKENDS[Backend(backend)]
    except ValueError:
        raise ValueError(f"costmodel.collectives: unknown backend {backend!r}; "
                         f"known: {', '.join(b.value for b in Backend)}") from None
    return table(kind)


def native_time_s(kind: CollectiveKind, nbytes: float, n_devices: int,
                  bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Alpha-beta time of ``kind`` as written in the module docstring (no backend emulation)."""
    n = int(n_devices)
    if n < 1:
        raise ValueError(f"a collective needs at least 1 device on its mesh axis, got {n_devices}")
    if n == 1:
        return 0.0
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"link bandwidth must be positive, got {bandwidth_bytes_per_s} bytes/s")
    m, b, a = float(nbytes), float(bandwidth_bytes_per_s), float(latency_s)
    kind = CollectiveKind(kind)
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (n - 1) / n * m / b + 2 * (n - 1) * a
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        return (n - 1) / n * m / b + (n - 1) * a
    if kind is CollectiveKind.ALL_TO_ALL:
        return (n - 1) / n * (m / n) / b + (n - 1) * a
    if kind is CollectiveKind.BROADCAST:
        return m / b + (n - 1) * a
    raise ValueError(f"no time formula for collective kind {kind!r}")


def collective_time_s(kind: CollectiveKind, nbytes: float, n_devices: int, link: LinkSpec,
                      backend: Backend | str, network_eff: float = 1.0) -> float:
    """Seconds for ``kind`` over ``n_devices`` on ``link``, as ``backend`` really carries it out."""
    if not 0 < network_eff <= 1:
        raise ValueError(f"network_eff must be in (0, 1], got {network_eff}")
    bandwidth = link.bandwidth_gbps * 1e9 * network_eff
    return native_time_s(carried_out_as(kind, backend), nbytes, n_devices, bandwidth, link.latency_us * 1e-6)
