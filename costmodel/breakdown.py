"""The cost of one training step of a plan, broken down: compute, communication, optimizer, memory.

``step_time_s = compute_s + comm_s + optimizer_s + step_overhead_s`` with
``comm_s = boxing_forward_s + boxing_backward_s + grad_sync_s``: no overlap of
communication with compute is assumed (an upper bound; eager DTensor code with
blocking redistributes runs that way). ``step_overhead_s`` is the executor's calibrated
fixed cost per step (``cluster.executor.step_us``: input placement, loss read-out,
zero_grad), 0 for a cluster that was not calibrated. Which collectives run is decided in
:mod:`costmodel.edges`; :func:`predicted_collectives` lists them, kinds after
the backend's emulation, for the executor's audit (compare as a multiset of
``(kind, axis, bytes, phase)``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.plan import Plan
from costmodel.collectives import Collective, carried_out_as, cluster_collective_time_s
from costmodel.compute import op_backward_time_s, op_forward_time_s, optimizer_time_s
from costmodel.edges import plan_transitions, requires_grad, signature_of
from costmodel.memory import activation_bytes, local_parameters, memory_bytes

PER_OP_COLUMNS = ["op", "target", "output_shape", "signature", "compute_us", "comm_us", "memory_mb"]


@dataclass
class CostBreakdown:
    step_time_s: float
    compute_s: float
    comm_s: float
    boxing_forward_s: float
    boxing_backward_s: float
    grad_sync_s: float
    optimizer_s: float
    memory_bytes_per_device: int
    memory: dict[str, int]
    per_op: pd.DataFrame
    memory_limit_bytes: int = 0
    collectives: list[Collective] = field(default_factory=list)
    step_overhead_s: float = 0.0

    @property
    def fits_memory(self) -> bool:
        return self.memory_limit_bytes <= 0 or self.memory_bytes_per_device <= self.memory_limit_bytes

    def op_rows(self) -> list[dict[str, Any]]:
        """The per-op table as JSON-able rows (what Plan.op_costs stores)."""
        return [{k: _plain(v) for k, v in row.items()} for row in self.per_op.to_dict("records")]

    def collective_summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """phase -> kind -> {count, bytes} over the step's collectives."""
        out: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: {"count": 0, "bytes": 0}))
        for c in self.collectives:
            entry = out[c.phase][c.kind.value]
            entry["count"] += 1
            entry["bytes"] += int(c.bytes)
        return {p: dict(k) for p, k in out.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary (no DataFrame): times in seconds, memory in bytes."""
        return {
            "step_time_s": float(self.step_time_s), "compute_s": float(self.compute_s),
            "comm_s": float(self.comm_s), "boxing_forward_s": float(self.boxing_forward_s),
            "boxing_backward_s": float(self.boxing_backward_s), "grad_sync_s": float(self.grad_sync_s),
            "optimizer_s": float(self.optimizer_s), "step_overhead_s": float(self.step_overhead_s),
            "memory_bytes_per_device": int(self.memory_bytes_per_device),
            "memory_limit_bytes": int(self.memory_limit_bytes), "fits_memory": bool(self.fits_memory),
            "memory": {k: int(v) for k, v in self.memory.items()},
            "collectives": self.collective_summary(),
        }


def predicted_collectives(graph: OpGraph, plan: Plan, cluster: Cluster) -> list[Collective]:
    """Exactly the collectives one training step runs, as ``cluster.backend`` carries them out."""
    return [Collective(carried_out_as(t.kind, cluster.backend), t.axis, t.bytes, t.phase, t.tensor)
            for t in plan_transitions(graph, plan)]


def plan_cost(graph: OpGraph, plan: Plan, cluster: Cluster) -> CostBreakdown:
    """Score ``plan`` for ``graph`` on ``cluster``: see the module docstring for the model."""
    mesh = plan.mesh.shape
    if plan.mesh.size > cluster.num_devices:
        raise ValueError(f"plan {plan.name!r} uses a {plan.mesh} mesh ({plan.mesh.size} devices) but cluster "
                         f"{cluster.name} has {cluster.num_devices}; use cluster.resized({plan.mesh.size})")
    rg = requires_grad(graph)
    transitions = plan_transitions(graph, plan)
    collectives: list[Collective] = []
    phase_s = {"forward": 0.0, "backward": 0.0, "grad_sync": 0.0}
    comm_by_op: dict[str, float] = defaultdict(float)
    for t in transitions:
        c = Collective(carried_out_as(t.kind, cluster.backend), t.axis, t.bytes, t.phase, t.tensor)
        collectives.append(c)
        seconds = cluster_collective_time_s(c.kind, c.bytes, mesh, c.axis, cluster)
        phase_s[c.phase] += seconds
        comm_by_op[t.op] += seconds

    activations = activation_bytes(graph, plan)
    rows = []
    compute_s = 0.0
    for node in graph.ops():
        sig = signature_of(plan, node, plan.mesh.ndim)
        seconds = op_forward_time_s(node, sig, mesh, cluster)
        if node.name in rg:
            seconds += op_backward_time_s(node, sig, mesh, cluster)
        compute_s += seconds
        rows.append({
            "op": node.name, "target": node.target,
            "output_shape": "x".join(map(str, node.outputs[0].shape)) if node.outputs else "",
            "signature": str(sig), "compute_us": seconds * 1e6, "comm_us": comm_by_op.get(node.name, 0.0) * 1e6,
            "memory_mb": activations.get(node.name, 0) / 1e6,
        })
    per_op = pd.DataFrame(rows, columns=PER_OP_COLUMNS)

    param_bytes, param_numel = local_parameters(graph, plan)
    optimizer_s = optimizer_time_s(param_bytes, param_numel, plan.optimizer, cluster)
    step_overhead_s = cluster.executor.step_us * 1e-6
    memory = memory_bytes(graph, plan, collectives)
    comm_s = sum(phase_s.values())
    return CostBreakdown(
        step_time_s=compute_s + comm_s + optimizer_s + step_overhead_s, compute_s=compute_s, comm_s=comm_s,
        boxing_forward_s=phase_s["forward"], boxing_backward_s=phase_s["backward"],
        grad_sync_s=phase_s["grad_sync"], optimizer_s=optimizer_s,
        memory_bytes_per_device=memory["total"], memory=memory, per_op=per_op,
        memory_limit_bytes=int(cluster.device.memory_gb * 1e9), collectives=collectives,
        step_overhead_s=step_overhead_s,
    )


def _plain(v: Any) -> Any:
    """numpy scalars -> Python scalars for JSON."""
    return v.item() if hasattr(v, "item") else v
