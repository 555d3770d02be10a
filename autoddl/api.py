"""The Python API: plan(), compare() and parallelize(), over every layer below.

    import autoddl
    cluster = autoddl.Cluster.from_yaml("configs/dgx-a100-8.yaml")
    plan = autoddl.plan(model, example_inputs, cluster)     # -> Plan
    plan.save("plan.json"); print(plan.summary())
    model = autoddl.parallelize(model, plan)                # inside a torchrun process
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import pandas as pd
import torch
from torch import nn

from autoddl.cluster import DEFAULT_CLUSTER_PATH, Cluster
from autoddl.graph import OpGraph
from autoddl.plan import Mesh, Plan
from autoddl.trace import trace
from autoddl.training import Training


def _cluster(cluster: Cluster | str | os.PathLike | None) -> Cluster:
    if cluster is None:
        return Cluster.from_yaml(DEFAULT_CLUSTER_PATH)
    if isinstance(cluster, Cluster):
        return cluster
    return Cluster.from_yaml(cluster)


def _mesh(mesh: str | Sequence[int] | Mesh | None) -> tuple[int, ...] | None:
    if mesh is None:
        return None
    if isinstance(mesh, Mesh):
        return mesh.shape
    if isinstance(mesh, str):
        return Mesh.parse(mesh).shape
    return tuple(int(s) for s in mesh)


def search_model(graph: OpGraph, cluster: Cluster | str | None = None, *, devices: int | None = None,
                 mesh=None, memory_gb: float | None = None, optimizer: str = "adamw", progress=None,
                 training: Training | None = None):
    """Search a traced graph (traced under ``training.param_dtype``); returns
    search.planner.SearchOutcome (found plan and every baseline), every plan with ``training``."""
    from search.planner import resolve_cluster, search

    resolved = resolve_cluster(_cluster(cluster), devices)
    return search(graph, resolved, model_name=graph.model_name, mesh=_mesh(mesh), memory_gb=memory_gb,
                  optimizer=optimizer, progress=progress, training=training or Training())


def plan(model: nn.Module, example_inputs: Sequence[torch.Tensor], cluster: Cluster | str | None = None, *,
         devices: int | None = None, mesh=None, memory_gb: float | None = None,
         loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: str = "adamw",
         training: Training | None = None) -> Plan:
    """Trace ``model`` on the meta device (under ``training``'s precision; ``example_inputs`` are one
    micro-step's batch) and return the cheapest plan found for ``cluster``."""
    training = training or Training()
    graph = trace(model, example_inputs, loss_fn, name=type(model).__name__, param_dtype=training.param_dtype,
                  replicate=True)
    found = search_model(graph, cluster, devices=devices, mesh=mesh, memory_gb=memory_gb, optimizer=optimizer,
                         training=training).found
    return found.set_provenance(cluster_file=cluster if isinstance(cluster, (str, os.PathLike)) else "")


def compare(model: nn.Module, example_inputs: Sequence[torch.Tensor], cluster: Cluster | str | None = None, *,
            devices: int | None = None, mesh=None, memory_gb: float | None = None,
            loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: str = "adamw",
            training: Training | None = None) -> pd.DataFrame:
    """Every scheme (each baseline and the found plan) with its predicted breakdown, one row each."""
    training = training or Training()
    graph = trace(model, example_inputs, loss_fn, name=type(model).__name__, param_dtype=training.param_dtype,
                  replicate=True)
    outcome = search_model(graph, cluster, devices=devices, mesh=mesh, memory_gb=memory_gb, optimizer=optimizer,
                           training=training)
    return schemes_frame(outcome)


def schemes_frame(outcome) -> pd.DataFrame:
    """One row per scheme: mesh, step time and its breakdown (ms), memory per device (GB), applicability."""
    rows = []
    for s in outcome.schemes:
        row = {"scheme": s.name, "mesh": str(s.plan.mesh) if s.plan else "", "applicable": s.plan is not None,
               "reason": s.reason}
        if s.breakdown is not None:
            bd = s.breakdown
            row.update({
                "step_ms": bd.step_time_s * 1e3, "compute_ms": bd.compute_s * 1e3,
                "boxing_fwd_ms": bd.boxing_forward_s * 1e3, "boxing_bwd_ms": bd.boxing_backward_s * 1e3,
                "grad_sync_ms": bd.grad_sync_s * 1e3, "optimizer_ms": bd.optimizer_s * 1e3,
                "exposed_comm_ms": bd.exposed_comm_s * 1e3,
                "step_overhead_ms": bd.step_overhead_s * 1e3, "bubble_ms": bd.bubble_s * 1e3,
                "memory_gb": bd.memory_bytes_per_device / 1e9, "fits_memory": bd.fits_memory,
            })
        rows.append(row)
    return pd.DataFrame(rows)


def parallelize(model: nn.Module, plan: Plan, example_inputs: Sequence[torch.Tensor] | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None, *, keep_freed_memory: bool = True) -> nn.Module:
    """Inside a torchrun process: a module whose forward runs ``plan`` on this rank's shards. On CPU the
    process keeps the memory its steps free for the next (executor/allocator.py), as ``autoddl run``'s
    ranks do; ``keep_freed_memory=False`` leaves the C library's heap alone."""
    from executor.runtime import parallelize as _parallelize

    return _parallelize(model, plan, example_inputs=example_inputs, loss_fn=loss_fn,
                        keep_freed_memory=keep_freed_memory)
