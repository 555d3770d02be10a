"""Cut one job's model into shards and price each shard's tasks on one device.

The job's plan on one device is the data-parallel baseline on a (1,) mesh (every op replicated:
the model as it is). Its one-micro-batch timeline is attributed to repeated blocks by
search/stages.py (``block_costs``: forward and backward seconds per block, the bytes each keeps);
the blocks are cut into K contiguous shards balanced by time and memory (``balanced_cuts``). A
shard's forward / backward seconds are its blocks' sums, and its backward also carries its share
of the optimizer step (the model's optimizer seconds split by parameter bytes, as the update runs
per shard after its backward). K is given, or the smallest count whose largest shard (its saved
activations and its parameters' state) fits one device's memory. All the cluster's devices work at
once, so on a CPU node with fewer cores than devices every time is multiplied by
``Cluster.time_sharing`` of that many ranks (as the cost model does for a mesh of them); a transfer
between two devices is ``costmodel.collectives.send_recv_time_s`` with all of them busy.
"""

from __future__ import annotations

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


def shard_count(costs: BlockCosts, limit_bytes: float) -> int:
    """The fewest shards whose largest one fits ``limit_bytes``; an error names the model when none does."""
    for k in range(1, len(costs.blocks) + 1):
        cuts = [0] + balanced_cuts(costs.seconds, costs.nbytes, k) + [len(costs.blocks)]
        if max(sum(costs.nbytes[a:b]) for a, b in zip(cuts, cuts[1:])) <= limit_bytes:
            return k
    raise ValueError(f"even one repeated block per shard ({len(costs.blocks)} shards) needs "
                     f"{max(costs.nbytes) / 1e9:.2f} GB, above one device's {limit_bytes / 1e9:.2f} GB; "
                     "give the job fewer steps' activations (a smaller batch) or a larger device")


def shard_job(name: str, graph: OpGraph, cluster: Cluster, steps: int, shards: int | None = None,
              optimizer: str = "sgd", training: Training | None = None) -> tuple[ShardedJob, SoloCost]:
    """The job's :class:`ShardedJob` on ``cluster``'s devices and its solo one-device cost."""
    one = cluster.resized(1)
    plan = inner_tp_plan(graph, one, 1, training or Training(), optimizer)
    costs = block_costs(graph, plan, one)
    limit = cluster.device.memory_gb * 1e9
    k = shards or shard_count(costs, limit)
    if not 1 <= k <= len(costs.blocks):
        raise ValueError(f"job {name!r}: shards {k}: {graph.model_name or 'the model'} has {len(costs.blocks)} "
                         f"repeated blocks; use 1..{len(costs.blocks)} shards")
    starts = [0] + balanced_cuts(costs.seconds, costs.nbytes, k)
    cuts = tuple(costs.blocks[i] for i in starts[1:])
    shard_of = stages_from_cuts(graph, cuts)
    ranges = list(zip(starts, starts[1:] + [len(costs.blocks)]))
    params, numel = [0] * k, [0] * k
    for node_name, s in param_homes(graph, shard_of).items():
        params[s] += graph[node_name].outputs[0].nbytes
        numel[s] += graph[node_name].outputs[0].numel
    total_params = sum(params) or 1
    share = cluster.time_sharing((cluster.num_devices,))      # every device busy at once
    job = ShardedJob(
        name, steps,
        forward_s=tuple(share * sum(costs.forward_s[a:b]) for a, b in ranges),
        backward_s=tuple(share * (sum(costs.backward_s[a:b]) + costs.optimizer_s * params[s] / total_params)
                         for s, (a, b) in enumerate(ranges)),
        param_bytes=tuple(params), flows=shard_flows(graph, shard_of), cuts=cuts,
        state_bytes=tuple(int(optimizer_state_bytes(n, optimizer)) for n in numel))
    bd = plan_cost(graph, plan, one)
    return job, SoloCost(share * bd.step_time_s, bd.memory_bytes_per_device, bd.fits_memory)


def transfer_fn(cluster: Cluster) -> Callable[[int, int, int], float]:
    """Seconds to send ``nbytes`` from device ``src`` to ``dst`` of ``cluster`` (numbered node-major),
    every device busy: ``costmodel.collectives.send_recv_time_s``; nothing to send costs 0."""
    busy = (cluster.num_devices,)
    return lambda src, dst, nbytes: send_recv_time_s(nbytes, src, dst, cluster, busy) if nbytes else 0.0
