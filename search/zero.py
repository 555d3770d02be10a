"""ZeRO-1 / ZeRO-2 (DeepSpeed's stages 1 and 2) as storages of a plan.

A parameter a plan keeps replicated ([B]) on the mesh axes that split the batch (data
parallel) can keep its optimizer states, and the float32 master they update, split over all
those axes instead, as DeepSpeed splits them over the whole data-parallel group: ZeRO-1
(``optimizer_storage`` [S(d)]; the gradient is still all-reduced whole and each rank keeps its
piece) or ZeRO-2 (``grad_storage`` [S(d)] too: the gradient is reduce-scattered). On several
axes ``d`` is split on each of them, nested in mesh order ([S(d), S(d)]), so that the
reduce-scatter and the all-gather are one collective over the axes' flattened group (autoddl.boxing
``flatten_nested_shards``). After the optimizer, one all-gather per group rebuilds the parameters
(autoddl/lowering.py ``param_syncs``). ``d`` is the first dim of its local piece the axes' sizes'
product divides (else the outermost axis alone is tried); parameters with no such dim stay as
they are.
"""

from __future__ import annotations

import dataclasses

from autoddl.boxing import group_size
from autoddl.graph import OpGraph
from autoddl.plan import Plan
from autoddl.program import used_parameters
from autoddl.sbp import NdSbp, Split

ZERO_STAGES = (1, 2)


def data_parallel_axes(plan: Plan) -> list[int]:
    """Mesh axes of more than one device that split some user input's batch (dim 0): where the plan
    is data parallel."""
    placeholders = [sig.outputs[0] for sig in plan.signatures.values() if not sig.inputs and len(sig.outputs) == 1]
    return [a for a in range(plan.mesh.ndim)
            if plan.mesh.shape[a] > 1 and any(nd[a].is_split(0) for nd in placeholders)]


def with_zero(graph: OpGraph, plan: Plan, stage: int, name: str | None = None) -> Plan:
    """``plan`` with ZeRO-``stage`` storages over its data-parallel axes (module docstring);
    a copy, named ``name`` (default: the plan's name + ``_zero<stage>``)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {stage!r}: choose 1 (optimizer states sharded) or 2 (gradients too); "
                         "stage 3 is the zero3 / fsdp plans' parameter storage")
    axes = data_parallel_axes(plan)
    if not axes:
        raise ValueError(f"plan {plan.name!r} splits no input's batch on any mesh axis: it has no data-parallel "
                         "axis for ZeRO to shard optimizer states over")
    optimizer: dict[str, NdSbp] = {}
    for fqn, node in used_parameters(graph).items():
        storage = plan.param_storage[fqn]
        if not node.outputs[0].is_floating:
            continue
        local = storage.local_shape(node.outputs[0].shape, plan.mesh.shape)
        for over in dict.fromkeys((tuple(axes), tuple(axes[:1]))):   # every data-parallel axis, else the outermost
            shard = _zero_shard(storage, local, over, plan.mesh.shape)
            if shard is not None:
                optimizer[fqn] = shard
                break
    return dataclasses.replace(plan, name=name or f"{plan.name}_zero{stage}", optimizer_storage=optimizer,
                               grad_storage=dict(optimizer) if stage == 2 else {}, cost=None, op_costs=[],
                               notes=list(plan.notes) + [f"ZeRO-{stage} over data-parallel mesh axes {axes}: "
                                                         f"{len(optimizer)} parameters' optimizer states"
                                                         + (" and gradients" if stage == 2 else "") + " sharded"])


def _zero_shard(storage: NdSbp, local: tuple[int, ...], axes: tuple[int, ...], mesh: tuple[int, ...]) -> NdSbp | None:
    """``storage`` with the first dim of the ``local`` piece that no other axis splits and that
    ``axes`` (all replicated in ``storage``) divide evenly split on each of them, nested in mesh
    order: one reduce-scatter / all-gather over their flattened group (autoddl.boxing
    ``flatten_nested_shards``); None when there is no such dim."""
    n = group_size(axes, mesh)
    if not all(storage[a].is_broadcast() for a in axes):
        return None
    dim = next((d for d, size in enumerate(local) if size % n == 0 and size >= n
                and not any(s.is_split(d) for s in storage)), None)
    if dim is None:
        return None
    return NdSbp(tuple(Split(dim) if a in axes else s for a, s in enumerate(storage)))
