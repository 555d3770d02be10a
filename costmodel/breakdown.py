"""The cost of one training step of a plan: the simulated timeline of its step program, broken down.

``step_time_s`` is the finish time of the simulated timeline (costmodel/simulate.py)
of ``autoddl.program.lower(graph, plan)``: communication that overlaps compute
(gradient buckets during backward) is hidden as it runs. Beside it:
``compute_s`` (compute-stream busy time), ``comm_s`` (every collective's
duration, added up: ``boxing_forward_s + boxing_backward_s + grad_sync_s``; with stages the boxing includes the rank's
sends of activations and their gradients; the backward boxing
includes the recomputed blocks' collectives, the grad sync ZeRO-1/2's all-gather of the
updated parameters),
``exposed_comm_s`` (step time the compute stream does not cover, less the bubble: with offload,
host copies nothing overlapped are in it too), the optimizer (on the host under offload), ``offload_s``
(every host copy's duration, added up), and memory per device (device and, spilled, host). With pipeline stages the times are the busiest pp rank's, and
``bubble_s`` is the pipeline bubble (costmodel.simulate.bubble_s), its own term. :func:`predicted_collectives` lists the
program's collectives, kinds after the backend's emulation, for the executor's
audit (compare as a multiset of ``(kind, axis, bytes, phase)``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.offload import HOST
from autoddl.pipeline import pipeline_degree
from autoddl.plan import CostReport, Plan
from autoddl.program import COMPUTE, StepProgram, lower, recomputed_ops, requires_grad, signature_of
from costmodel.collectives import Collective, carried_out_as
from costmodel.memory import activation_bytes, memory_bytes
from costmodel.simulate import Timeline, bubble_s, kernel_time_s, simulate

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
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0
    offload_s: float = 0.0                     # host copies, added up (the copy stream's busy time)
    host_limit_bytes: int = 0                  # host memory per device (offload; 0: not checked)
    timeline: Timeline | None = None

    @property
    def host_memory_bytes(self) -> int:
        """Host memory per device the plan spills into (costmodel/memory.py ``host``)."""
        return int(self.memory.get("host", 0))

    @property
    def fits_memory(self) -> bool:
        """Device memory within its limit, and what is spilled within the host's share."""
        device = self.memory_limit_bytes <= 0 or self.memory_bytes_per_device <= self.memory_limit_bytes
        return device and (self.host_limit_bytes <= 0 or self.host_memory_bytes <= self.host_limit_bytes)

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

    def report(self) -> CostReport:
        """The typed summary a Plan keeps."""
        return CostReport.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary (no DataFrame): times in seconds, memory in bytes."""
        return {
            "step_time_s": float(self.step_time_s), "compute_s": float(self.compute_s),
            "comm_s": float(self.comm_s), "boxing_forward_s": float(self.boxing_forward_s),
            "boxing_backward_s": float(self.boxing_backward_s), "grad_sync_s": float(self.grad_sync_s),
            "optimizer_s": float(self.optimizer_s), "step_overhead_s": float(self.step_overhead_s),
            "exposed_comm_s": float(self.exposed_comm_s), "bubble_s": float(self.bubble_s),
            "offload_s": float(self.offload_s), "host_memory_bytes_per_device": self.host_memory_bytes,
            "memory_bytes_per_device": int(self.memory_bytes_per_device),
            "memory_limit_bytes": int(self.memory_limit_bytes), "fits_memory": bool(self.fits_memory),
            "memory": {k: int(v) for k, v in self.memory.items()},
            "collectives": self.collective_summary(),
        }


def predicted_collectives(graph: OpGraph, plan: Plan, cluster: Cluster,
                          program: StepProgram | None = None) -> list[Collective]:
    """Exactly the collectives one training step runs, as ``cluster.backend`` carries them out."""
    program = program or lower(graph, plan)
    return [Collective(carried_out_as(t.collective, cluster.backend), t.axis, t.nbytes, t.phase, t.tensor)
            for t in program.collectives()]


def plan_cost(graph: OpGraph, plan: Plan, cluster: Cluster) -> CostBreakdown:
    """Score ``plan`` for ``graph`` on ``cluster`` by simulating its step program (module docstring)."""
    if plan.mesh.size > cluster.num_devices:
        raise ValueError(f"plan {plan.name!r} uses a {plan.mesh} mesh ({plan.mesh.size} devices) but cluster "
                         f"{cluster.name} has {cluster.num_devices}; use cluster.resized({plan.mesh.size})")
    program = lower(graph, plan)
    timeline = simulate(program, graph, plan, cluster)
    collectives = predicted_collectives(graph, plan, cluster, program)
    activations = activation_bytes(graph, plan)         # the memory's and the per-op table's
    memory = memory_bytes(graph, plan, collectives, program, activations)
    rank = timeline.busiest_rank
    bubble = bubble_s(timeline, program)
    host_limit = int(cluster.host_bytes_per_device()) if plan.training.offload_level != "none" else 0
    return CostBreakdown(
        step_time_s=timeline.step_time_s, compute_s=timeline.busy_s(stream=COMPUTE, collective=False, pp_rank=rank)
        - timeline.busy_s(stream=COMPUTE, phase="optimizer", collective=False, pp_rank=rank),
        comm_s=timeline.busy_s(collective=True, pp_rank=rank),
        boxing_forward_s=timeline.busy_s(phase="forward", collective=True, pp_rank=rank),
        boxing_backward_s=timeline.busy_s(phase="backward", collective=True, pp_rank=rank)
        + timeline.busy_s(phase="recompute", collective=True, pp_rank=rank),        # a recomputed block's boxing
        grad_sync_s=timeline.busy_s(phase="grad_sync", collective=True, pp_rank=rank)
        + timeline.busy_s(phase="optimizer", collective=True, pp_rank=rank),        # ZeRO-1/2's parameter all-gather
        optimizer_s=timeline.busy_s(phase="optimizer", collective=False, pp_rank=rank)
        - cluster.executor.step_us * 1e-6,
        memory_bytes_per_device=memory["total"], memory=memory, per_op=_per_op(graph, plan, timeline, activations),
        memory_limit_bytes=int(cluster.device.memory_gb * 1e9), collectives=collectives,
        step_overhead_s=cluster.executor.step_us * 1e-6, exposed_comm_s=_exposed_comm_s(timeline, bubble, rank),
        bubble_s=bubble, offload_s=timeline.busy_s(phase="offload"), host_limit_bytes=host_limit,
        timeline=timeline,
    )


def compute_floor_s(graph: OpGraph, plan: Plan, cluster: Cluster) -> float:
    """A lower bound of ``plan_cost(graph, plan, cluster).step_time_s`` without lowering the plan:
    the kernels the one compute stream runs one after another (costmodel/simulate.py: a stream
    runs one task at a time), each micro-step: every op's forward, the backward of those a gradient
    reaches, the recomputed ops' forward again. Recompute's per-op overheads (measured >= 0; 0 when
    any is negative) and the optimizer are left out, so this is ``compute_s`` where recompute costs
    nothing extra and below it otherwise. 0.0 with pipeline stages (the busiest rank's is not this)."""
    costs = [cluster.executor.recompute_cost(p) for p in ("selective", "full")]
    if pipeline_degree(plan) > 1 or any(v < 0 for c in costs for v in vars(c).values()):
        return 0.0
    mesh, rg, memo = tuple(plan.mesh.shape), requires_grad(graph), {}

    def kernel(node, forward: bool) -> float:
        return kernel_time_s(node, signature_of(plan, node), forward, mesh, cluster, memo,
                             attention=plan.training.attention)
    total = sum(kernel(n, True) + (kernel(n, False) if n.name in rg else 0.0) for n in graph.ops())
    total += sum(kernel(n, True) for ops in recomputed_ops(graph, plan).values() for n in ops)
    return total * plan.training.micro_batches


def _exposed_comm_s(timeline: Timeline, bubble: float, rank: int) -> float:
    """Step time the compute stream does not cover, less the bubble and an optimizer step on the host
    (offload), at most the collectives' time (host copies nothing overlapped are not communication)."""
    host = timeline.busy_s(stream=HOST, pp_rank=rank)
    rest = max(0.0, timeline.exposed_comm_s - bubble - host)
    copies = timeline.busy_s(phase="offload", pp_rank=rank)
    return min(rest, timeline.busy_s(collective=True, pp_rank=rank)) if host or copies else rest


def _per_op(graph: OpGraph, plan: Plan, timeline: Timeline, activations: dict[str, int]) -> pd.DataFrame:
    """Per op: compute (forward + backward), the collectives charged to it, in µs, and its saved
    activations (:func:`activation_bytes`)."""
    compute: dict[str, float] = defaultdict(float)
    comm: dict[str, float] = defaultdict(float)
    for t in timeline.tasks:
        (comm if t.task.is_collective else compute)[t.task.op] += t.duration_s
    rows = [{"op": node.name, "target": node.target,
             "output_shape": "x".join(map(str, node.outputs[0].shape)) if node.outputs else "",
             "signature": str(signature_of(plan, node)), "compute_us": compute[node.name] * 1e6,
             "comm_us": comm[node.name] * 1e6, "memory_mb": activations.get(node.name, 0) / 1e6}
            for node in graph.ops()]
    return pd.DataFrame(rows, columns=PER_OP_COLUMNS)


def _plain(v: Any) -> Any:
    """numpy scalars -> Python scalars for JSON."""
    return v.item() if hasattr(v, "item") else v
