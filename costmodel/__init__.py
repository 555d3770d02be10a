"""Analytical cost model: pure functions from (graph, plan, cluster) to seconds and bytes.

collectives  alpha-beta time per collective kind, mesh axis and backend
boxing       NdSbp -> NdSbp transitions, forward and the dual gradient transition
compute      roofline per op on its local shard, backward per op family, optimizer step
edges        which collectives a plan runs (forward, backward, gradient sync)
memory       per-device memory by category (device and, spilling, host)
host         spilling to host memory: a host copy on the host link, the optimizer step on the host
breakdown    plan_cost -> CostBreakdown, predicted_collectives
"""

from costmodel.boxing import (backward_boxing_collectives, backward_boxing_time_s, boxing_collectives,
                              boxing_time_s, grad_ndsbp, grad_sbp, needed_grad_ndsbp, needed_grad_sbp)
from costmodel.breakdown import CostBreakdown, plan_cost, predicted_collectives
from costmodel.collectives import (BACKENDS, Collective, CollectiveFit, CollectiveKind, carried_out_as,
                                   cluster_collective_time_s, collective_time_s, fit_collective,
                                   formula_coefficients, native_time_s)
from costmodel.compute import (backward_factor, compute_efficiency, op_backward_time_s, op_compute_time_s,
                               op_forward_time_s, optimizer_time_s, roofline_time_s, work_divisor)
from costmodel.memory import memory_bytes

__all__ = [
    "BACKENDS", "Collective", "CollectiveFit", "CollectiveKind", "cluster_collective_time_s", "compute_efficiency",
    "fit_collective", "formula_coefficients", "CostBreakdown", "backward_boxing_collectives",
    "backward_boxing_time_s", "backward_factor", "boxing_collectives", "boxing_time_s", "carried_out_as",
    "collective_time_s", "grad_ndsbp", "grad_sbp", "memory_bytes", "native_time_s", "needed_grad_ndsbp",
    "needed_grad_sbp", "op_backward_time_s", "op_compute_time_s", "op_forward_time_s", "optimizer_time_s",
    "plan_cost", "predicted_collectives", "roofline_time_s", "work_divisor",
]
