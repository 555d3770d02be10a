"""Cut one job's model into shards and price each shard's tasks on one device.

The job's plan on one device is the data-parallel baseline on a (1,) mesh (every op replicated:
the model as it is). Its one-micro-batch timeline is attributed to repeated blocks by
search/stages.py (``block_costs``: forward and backward seconds per block, the bytes each keeps);
the blocks are cut into K contiguous shards balanced by time and memory (``balanced_cuts``). The
shard runner (executor/shard_runner.py) runs the tasks, not the compiled executor, so the timeline
is priced without the compiled executor's per-parameter-use and per-step costs (``executor.param_us``,
``step_us``: :func:`runner_cluster`) and each task pays the runner's own instead
(:func:`runner_task_s`): a shard's forward is its blocks' forward seconds + ``executor.shard_forward_us``;
its backward its blocks' backward seconds + its share of the optimizer step (the model's
memory-bound update split by parameter bytes, as the update runs per shard after its backward) +
``shard_backward_us`` + ``shard_param_us`` per parameter it updates. K is given, or the smallest count that fits one device's memory
(``shard_count``: the largest shard's saved activations and parameters' state; for a spilled job,
two shards' parameter state and the step's activations). Each shard carries the activation bytes
its forward saves (the blocks' ``activation_bytes``), for the schedule's memory. All the cluster's
devices work at once, so on a CPU node with fewer cores than devices every time is multiplied by
``Cluster.time_sharing`` of that many ranks (as the cost model does for a mesh of them); a transfer
between two devices is ``costmodel.collectives.send_recv_time_s`` with all of them busy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.pipeline import stages_from_cuts
from autoddl.shard_program import ShardedJob, param_homes, shard_flows
from autoddl.training import Training
from costmodel.breakdown import plan_cost
from costmodel.collectives import send_recv_time_s
from costmodel.compute import optimizer_state_bytes
from search.planner import inner_tp_plan
from search.stages import BlockCosts, balanced_cuts, block_costs


@dataclass(frozen=True)
class SoloCost:
    """A job alone on one device: its step time and memory (the plan of the module docstring)."""

    step_s: float
    memory_bytes: int
    fits: bool


def shard_count(costs: BlockCosts, limit_bytes: float, spill: bool = False) -> int:
    """The fewest shards that fit ``limit_bytes``: the largest shard (its parameters' state and saved
    activations); spilled (``spill``), the running shard's and the prefetched next one's parameter
    state with the whole step's saved activations (a device may run all of a step's forwards before
    its backwards: autoddl/shard_memory.py). An error names the model when no count fits."""
    for k in range(1, len(costs.blocks) + 1):
        if _need_bytes(costs, k, spill) <= limit_bytes:
            return k
    one_each = _need_bytes(costs, len(costs.blocks), spill)
    what = " (spilled: two shards' parameter state and the step's saved activations)" if spill else ""
    raise ValueError(f"even one repeated block per shard ({len(costs.blocks)} shards) needs {one_each / 1e9:.2f} GB"
                     f"{what}, above one device's {limit_bytes / 1e9:.2f} GB; give the job fewer steps' activations "
                     "(a smaller batch) or a larger device")


def _need_bytes(costs: BlockCosts, k: int, spill: bool) -> float:
    """What ``k`` balanced shards need of one device (:func:`shard_count`)."""
    cuts = [0] + balanced_cuts(costs.seconds, costs.nbytes, k) + [len(costs.blocks)]
    runs = list(zip(cuts, cuts[1:]))
    if not spill:
        return max(sum(costs.nbytes[a:b]) for a, b in runs)
    state = [sum(costs.nbytes[a:b]) - sum(costs.activation_bytes[a:b]) for a, b in runs]
    return sum(costs.activation_bytes) + max(x + y for x, y in zip(state, state[1:] or [0.0]))


def runner_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` as the shard runner's tasks are priced (module docstring): the compiled executor's
    per-parameter-use and per-step costs off, every other price as it is."""
    return dataclasses.replace(cluster, executor=dataclasses.replace(cluster.executor, param_us=0.0, step_us=0.0))


def runner_task_s(forward_ops_s: float, backward_ops_s: float, params: int, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of one shard's tasks on one rank running alone: its ops' seconds (priced
    on :func:`runner_cluster`; the backward's with its optimizer share) plus the shard runner's fixed
    costs, ``params`` the parameters its backward updates (module docstring)."""
    ex = cluster.executor
    return (forward_ops_s + ex.shard_forward_us * 1e-6,
            backward_ops_s + (ex.shard_backward_us + params * ex.shard_param_us) * 1e-6)


def shard_job(name: str, graph: OpGraph, cluster: Cluster, steps: int, shards: int | None = None,
              optimizer: str = "sgd", training: Training | None = None, spill: bool = False
              ) -> tuple[ShardedJob, SoloCost]:
    """The job's :class:`ShardedJob` on ``cluster``'s devices and its solo one-device cost; ``spill``:
    the job may keep its shards in host memory (the shard count's rule, :func:`shard_count`)."""
    one = cluster.resized(1)
    plan = inner_tp_plan(graph, one, 1, training or Training(), optimizer)
    costs = block_costs(graph, plan, runner_cluster(one))
    limit = cluster.device.memory_gb * 1e9
    k = shards or shard_count(costs, limit, spill)
    if not 1 <= k <= len(costs.blocks):
        raise ValueError(f"job {name!r}: shards {k}: {graph.model_name or 'the model'} has {len(costs.blocks)} "
                         f"repeated blocks; use 1..{len(costs.blocks)} shards")
    starts = [0] + balanced_cuts(costs.seconds, costs.nbytes, k)
    cuts = tuple(costs.blocks[i] for i in starts[1:])
    shard_of = stages_from_cuts(graph, cuts)
    ranges = list(zip(starts, starts[1:] + [len(costs.blocks)]))
    params, numel, count = [0] * k, [0] * k, [0] * k
    for node_name, s in param_homes(graph, shard_of).items():
        params[s] += graph[node_name].outputs[0].nbytes
        numel[s] += graph[node_name].outputs[0].numel
        count[s] += 1
    total_params = sum(params) or 1
    share = cluster.time_sharing((cluster.num_devices,))      # every device busy at once
    tasks = [runner_task_s(sum(costs.forward_s[a:b]),
                           sum(costs.backward_s[a:b]) + costs.optimizer_s * params[s] / total_params, count[s], one)
             for s, (a, b) in enumerate(ranges)]
    job = ShardedJob(
        name, steps, forward_s=tuple(share * f for f, _ in tasks), backward_s=tuple(share * b for _, b in tasks),
        param_bytes=tuple(params), flows=shard_flows(graph, shard_of), cuts=cuts,
        state_bytes=tuple(int(optimizer_state_bytes(n, optimizer)) for n in numel),
        activation_bytes=tuple(int(sum(costs.activation_bytes[a:b])) for a, b in ranges))
    bd = plan_cost(graph, plan, one)
    return job, SoloCost(share * bd.step_time_s, bd.memory_bytes_per_device, bd.fits_memory)


def transfer_fn(cluster: Cluster) -> Callable[[int, int, int], float]:
    """Seconds to send ``nbytes`` from device ``src`` to ``dst`` of ``cluster`` (numbered node-major),
    every device busy: ``costmodel.collectives.send_recv_time_s``; nothing to send costs 0."""
    busy = (cluster.num_devices,)
    return lambda src, dst, nbytes: send_recv_time_s(nbytes, src, dst, cluster, busy) if nbytes else 0.0
