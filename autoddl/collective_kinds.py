"""Collective kinds, and how each backend really carries each one out.

Both sides of the step program read this table: the cost model prices a
collective as the kind that runs, and the executor issues that kind. What a
kind moves (``M``, the bytes of the full buffer) is defined in
costmodel/collectives.py, beside the alpha-beta formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Mapping

from autoddl.cluster import Backend


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"          # point to point between pipeline stages (autoddl/pipeline_program.py)

    def __str__(self) -> str:
        return self.value


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
    #   `_reduce_scatter_base` and funcol.reduce_scatter_tensor reach, clones the input, runs
    #   `allreduce` on the clone and copies out `buffer.chunk(world)[rank]`: an all-reduce of M.
    # - all-to-all runs natively: ProcessGroupGloo::alltoall_base (gloo's alltoall / alltoallv) is what
    #   funcol.all_to_all_single reaches (tests/test_executor_runtime.py's "mixed" plan runs it on 2 gloo
    #   ranks and audits it). DTensor
    #   alone falls back to all-gather + chunk on CPU (torch/distributed/tensor/_collective_utils.py,
    #   shard_dim_alltoall); autoddl's executor and MoE kernel call all_to_all_single directly.
    Backend.GLOO: BackendCollectives(
        Backend.GLOO,
        MappingProxyType({**_NATIVE, CollectiveKind.REDUCE_SCATTER: CollectiveKind.ALL_REDUCE}),
        "gloo: reduce-scatter = all-reduce + local chunk",
    ),
})


def carried_out_as(kind: CollectiveKind, backend: Backend | str) -> CollectiveKind:
    """The collective that really runs for ``kind`` on ``backend``."""
    try:
        table = BACKENDS[Backend(backend)]
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(b.value for b in Backend)}") from None
    return table(kind)
