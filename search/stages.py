"""Where to cut the op graph into pipeline stages: balanced by simulated time and by memory.

The plan inside one stage (its signatures over the inner mesh axes) is lowered and simulated
once for one micro-batch, without stages; each repeated block's cost is the time its tasks took
(compute, recompute and the collectives charged to its ops) and its memory is its saved
activations plus its parameters' per-device state (``param_state_bytes``: master, gradient,
optimizer states, working copy). Beside them: each block's parameters (local elements and the dims
the plan does not split, for sharding them over dp) and what the cost model's memory accounting (costmodel/memory.py) gives
the one-micro-batch program besides parameter state and saved activations (the recomputed block,
the boxing buffer, the buffers). Ops outside the blocks count with the block they run next to
(the embedding with the first, the head and the loss with the last). The blocks are then split
into ``n`` contiguous runs minimising the largest run's ``max(time / mean time, memory / mean
memory)``, by dynamic programming over the cut points (exact, O(n x blocks^2)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.pipeline import repeated_blocks
from autoddl.plan import Plan
from autoddl.program import block_of, lower, storage_of, used_parameters
from costmodel.breakdown import predicted_collectives
from costmodel.master_passes import passes_time_s, step_passes
from costmodel.memory import (activation_bytes, boxing_buffer_bytes, buffer_bytes, local_bytes, param_state_bytes,
                              recomputed_bytes)
from costmodel.simulate import simulate


@dataclass
class BlockCosts:
    """Per repeated block (forward order) of one micro-batch of a plan without stages: forward and
    backward seconds (compute and the synchronous collectives of its ops; backward includes
    recompute), the bytes it keeps, and the one-micro-batch timeline's gradient-sync and optimizer
    seconds (asynchronous, of the whole model)."""

    blocks: list[str]
    forward_s: list[float]
    backward_s: list[float]
    nbytes: list[float]
    activation_bytes: list[float]
    grad_sync_s: float
    optimizer_s: float
    # per block, each floating parameter's local elements and the sizes of the dims its storage does not split
    params: list[list[tuple[int, tuple[int, ...]]]] = dataclasses.field(default_factory=list)
    other_bytes: float = 0.0         # the one-micro-batch program's recomputed + buffers (costmodel/memory.py)
    boxing_bytes: float = 0.0        # and its boxing_buffer (without dp: no gradient buckets)
    # the master passes (costmodel/master_passes.py) each micro-step beyond the first adds, whole model;
    # those of one micro-step are in optimizer_s (the simulator adds them to the optimizer task)
    passes_per_micro_step_s: float = 0.0

    @property
    def seconds(self) -> list[float]:
        return [f + b for f, b in zip(self.forward_s, self.backward_s)]


def block_costs(graph: OpGraph, plan: Plan, cluster: Cluster) -> BlockCosts:
    """The :class:`BlockCosts` of ``plan`` (no stages; one micro-batch): the module docstring's
    attribution."""
    blocks = repeated_blocks(graph)
    if not blocks:
        raise ValueError(f"{graph.model_name or 'the model'} has no repeated blocks (module paths with a numeric "
                         "part, e.g. transformer.h.3) to cut into pipeline stages")
    owner: dict[str, str] = {}
    current = blocks[0]
    for node in graph.ops():
        b = block_of(node)
        current = b if b != "root" else current
        owner[node.name] = current
    one = dataclasses.replace(plan, training=dataclasses.replace(plan.training, micro_batches=1))
    forward, backward = dict.fromkeys(blocks, 0.0), dict.fromkeys(blocks, 0.0)
    program = lower(graph, one)
    timeline = simulate(program, graph, one, cluster)
    for t in timeline.tasks:
        if t.task.op in owner and t.task.phase in ("forward", "backward", "recompute"):
            (forward if t.task.phase == "forward" else backward)[owner[t.task.op]] += t.duration_s
    saved = dict.fromkeys(blocks, 0.0)
    for name, size in activation_bytes(graph, one).items():
        if name in owner:
            saved[owner[name]] += size
    nbytes = dict(saved)
    params: dict[str, list[tuple[int, tuple[int, ...]]]] = {b: [] for b in blocks}
    for fqn, node in used_parameters(graph).items():
        first = graph.consumers(node.name)[0].name
        meta = node.outputs[0]
        local = local_bytes(meta.numel, storage_of(one, fqn), one.mesh.shape)
        nbytes[owner[first]] += param_state_bytes(local, one.training, one.optimizer)
        if meta.is_floating and meta.ndim:
            taken = {sbp.dim for sbp in storage_of(one, fqn) if sbp.is_split()}
            params[owner[first]].append((local, tuple(n for d, n in enumerate(meta.shape) if d not in taken)))
    boxing = boxing_buffer_bytes(predicted_collectives(graph, one, cluster, program), graph, one.mesh.shape)
    return BlockCosts(blocks, [forward[b] for b in blocks], [backward[b] for b in blocks],
                      [nbytes[b] for b in blocks], [saved[b] for b in blocks],
                      timeline.busy_s(phase="grad_sync", collective=True), timeline.busy_s(phase="optimizer"),
                      [params[b] for b in blocks], recomputed_bytes(graph, one) + buffer_bytes(graph, one), boxing,
                      _passes_s(program, one, cluster, 2) - _passes_s(program, one, cluster, 1))


def _passes_s(program, plan: Plan, cluster: Cluster, micro_batches: int) -> float:
    """Seconds of the step's master passes with ``micro_batches`` micro-steps (linear in them)."""
    training = dataclasses.replace(plan.training, micro_batches=micro_batches)
    return passes_time_s(step_passes(program, training), cluster, plan.mesh.shape)


def balanced_cuts(seconds: list[float], nbytes: list[float], n: int) -> list[int]:
    """Indices of the first item of runs 1..n-1 splitting the items into ``n`` contiguous runs that
    minimise the largest ``max(run time / mean run time, run bytes / mean run bytes)``. Kept for
    the process (``_balanced_cuts``): the 3-D search asks for the same costs' cuts at every device
    count, link and data-parallel role, and the DP takes O(n x blocks^2)."""
    return list(_balanced_cuts(tuple(seconds), tuple(nbytes), n))


@lru_cache(maxsize=4096)
def _balanced_cuts(seconds: tuple[float, ...], nbytes: tuple[float, ...], n: int) -> tuple[int, ...]:
    k = len(seconds)
    if not 1 <= n <= k:
        raise ValueError(f"cannot cut {k} blocks into {n} pipeline stages; use at most {k} stages")
    mean_s, mean_b = sum(seconds) / n or 1.0, sum(nbytes) / n or 1.0
    prefix_s = [0.0] + [sum(seconds[: i + 1]) for i in range(k)]
    prefix_b = [0.0] + [sum(nbytes[: i + 1]) for i in range(k)]

    def load(i: int, j: int) -> float:                  # items i..j-1 as one run
        return max((prefix_s[j] - prefix_s[i]) / mean_s, (prefix_b[j] - prefix_b[i]) / mean_b)

    @lru_cache(maxsize=None)
    def best(i: int, runs: int) -> tuple[float, tuple[int, ...]]:
        """The best split of items i.. into ``runs`` runs: (its largest load, the starts after i)."""
        if runs == 1:
            return load(i, k), ()
        out = (math.inf, ())
        for j in range(i + 1, k - runs + 2):
            rest, starts = best(j, runs - 1)
            cost = max(load(i, j), rest)
            if cost < out[0]:
                out = (cost, (j,) + starts)
        return out

    return best(0, n)[1]


def stage_cuts(graph: OpGraph, plan: Plan, cluster: Cluster, n: int) -> tuple[str, ...]:
    """``Training.stage_cuts`` for ``n`` virtual stages of ``plan`` (the plan inside one stage)."""
    costs = block_costs(graph, plan, cluster)
    return cuts_of(costs, n)


def cuts_of(costs: BlockCosts, n: int) -> tuple[str, ...]:
    """``Training.stage_cuts`` for ``n`` virtual stages from ``costs``."""
    return tuple(costs.blocks[i] for i in balanced_cuts(costs.seconds, costs.nbytes, n))
