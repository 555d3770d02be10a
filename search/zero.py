"""ZeRO-1 / ZeRO-2 (DeepSpeed's stages 1 and 2) as storages of a plan.

A parameter a plan keeps replicated ([B]) on the mesh axes that split the batch (data
parallel) can keep its optimizer states, and the float32 master they update, split on one of
those axes instead: ZeRO-1 (``optimizer_storage`` [S(d)]; the gradient is still all-reduced
whole and each rank keeps its piece) or ZeRO-2 (``grad_storage`` [S(d)] too: the gradient is
reduce-scattered). After the optimizer, one all-gather per axis rebuilds the parameters
(autoddl/lowering.py ``param_syncs``). ``d`` is the first dim of its local piece the axis size divides;
parameters with no such dim stay as they are.
"""

from __future__ import annotations

import dataclasses

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
    """``plan`` with ZeRO-``stage`` storages on its outermost data-parallel axis (module docstring);
    a copy, named ``name`` (default: the plan's name + ``_zero<stage>``)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {stage!r}: choose 1 (optimizer states sharded) or 2 (gradients too); "
                         "stage 3 is the zero3 / fsdp plans' parameter storage")
    axes = data_parallel_axes(plan)
    if not axes:
        raise ValueError(f"plan {plan.name!r} splits no input's batch on any mesh axis: it has no data-parallel "
                         "axis for ZeRO to shard optimizer states over")
    axis, n = axes[0], plan.mesh.shape[axes[0]]
    optimizer: dict[str, NdSbp] = {}
    for fqn, node in used_parameters(graph).items():
        storage = plan.param_storage[fqn]
        local = storage.local_shape(node.outputs[0].shape, plan.mesh.shape)
        dim = next((d for d, size in enumerate(local) if size % n == 0 and size >= n
                    and not any(s.is_split(d) for s in storage)), None)     # a dim no other axis splits
        if dim is None or not storage[axis].is_broadcast() or not node.outputs[0].is_floating:
            continue
        optimizer[fqn] = NdSbp(tuple(Split(dim) if a == axis else s for a, s in enumerate(storage)))
    return dataclasses.replace(plan, name=name or f"{plan.name}_zero{stage}", optimizer_storage=optimizer,
                               grad_storage=dict(optimizer) if stage == 2 else {}, cost=None, op_costs=[],
                               notes=list(plan.notes) + [f"ZeRO-{stage} on mesh axis {axis} ({n} ranks): "
                                                         f"{len(optimizer)} parameters' optimizer states"
                                                         + (" and gradients" if stage == 2 else "") + " sharded"])
