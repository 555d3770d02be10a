"""3-D search: the device count as pp x (dp | fsdp) x tp, schedule, micro-batch size and recompute.

Candidates: tp a divisor of a node's devices (inside it), pp >= 2 dividing the rest (the
outermost axis, across nodes; at most one stage per repeated block), dp or fsdp the remainder;
schedules 1F1B and interleaved 1F1B with 2 virtual stages (GPipe has 1F1B's bubble and holds more
micro-batches: never better); every ``--micro-batch-size`` given (or 1 and 2) that splits the
global batch; recompute as given (``auto``: none, selective, then full, the first that fits).

Each candidate is first estimated fast, from the plan of one stage's inside: the tp baseline on a
(tp,) mesh for one data-parallel rank's micro-batch (traced once per micro-batch size, whatever
the dp degree: a rank's compute and tp collectives depend on its own batch only), whose one
micro-batch is simulated once (search/stages.py ``block_costs``: per block forward and backward
seconds, saved and parameter bytes). The stages are cut where they balance, the schedule's step
time is :func:`autoddl.pipeline.schedule_makespan` of the stages' times with every send priced as
the slowest hop between consecutive stages (``costmodel.collectives.send_recv_time_s``; fsdp: a chunk's first forward takes at least the all-gather of its parameters and its
last backward at least the reduce-scatter of their gradients: the program gathers each chunk's
groups once per step and reduce-scatters once, as torchtitan runs FSDP under pp,
autoddl/lowering.py), plus each rank's gradient all-reduce over dp and its optimizer share. Memory counts what
costmodel/memory.py counts for the pipelined program, with its functions: the rank's parameter
state (``param_state_bytes``; fsdp: / dp for the parameters with a dim the inner plan leaves
whole that dp divides, as the baseline shards them), those parameters gathered for the step with their unsharded gradients
(``step_gathered_bytes``), its micro-batches in flight (``in_flight_peak`` of the chunks' saved
activations plus what they receive, ``received_bytes``), and the one-micro-batch inner program's
recomputed block, buffers and boxing buffer (or the largest gradient bucket over dp). The best
fitting estimates (``FULL_PRICES``) are then traced at their real batch and priced by the full cost
model (``price_degrees``: the simulated step program).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from autoddl.cluster import Cluster
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import OpGraph
from autoddl.pipeline import (boundary_tensors, in_flight_peak, repeated_blocks, schedule_actions,
                              schedule_makespan, stages_from_cuts)
from autoddl.program import requires_grad
from autoddl.training import Training
from autoddl.precision import itemsize
from costmodel.collectives import cluster_collective_time_s, send_recv_time_s, stage_device
from costmodel.memory import param_state_bytes, received_bytes, step_gathered_bytes
from costmodel.simulate import collective_compute_s, overlapped_time_s
from search.meshes import role_splits
from search.stages import BlockCosts, block_costs, cuts_of

FULL_PRICES = 1          # candidates priced by the full cost model after the fast estimate
RECOMPUTE_TRIES = ("none", "selective", "full")


@dataclass
class Estimate:
    degrees: list[tuple[str, int]]
    schedule: str
    virtual_stages: int
    micro_batch_size: int
    recompute: str
    step_time_s: float
    memory_bytes: float

    @property
    def text(self) -> str:
        return (",".join(f"{r}={d}" for r, d in self.degrees) + f" {self.schedule}"
                + (f" V={self.virtual_stages}" if self.virtual_stages > 1 else "")
                + f" mbs={self.micro_batch_size} recompute={self.recompute}")


def factorisations(cluster: Cluster, blocks: int, min_pp: int = 2) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) with ``min_pp`` <= pp <= ``blocks``, pp x dp x tp = devices, tp inside a node
    (without tp, dp inside a node): search.meshes.role_splits. ``min_pp=1`` adds the plans without
    stages."""
    return [s for s in role_splits(cluster.num_devices, cluster.devices_per_node, max_pp=blocks) if s[0] >= min_pp]


def estimate(costs: BlockCosts, graph: OpGraph, inner, cluster: Cluster, pp: int, dp: int, tp: int, role: str,
             schedule: str, v: int, m: int, sent_memo: dict | None = None) -> tuple[float, float]:
    """(step seconds, bytes per device) of one candidate (module docstring). ``sent_memo``: a dict
    kept for one ``inner`` plan, per stage count: the bytes each stage receives and the largest boundary
    tensor (graph walks)."""
    n = pp * v
    cuts = cuts_of(costs, n)
    index = {b: i for i, b in enumerate(costs.blocks)}
    edges = [0] + [index[c] for c in cuts] + [len(costs.blocks)]
    runs = [range(edges[s], edges[s + 1]) for s in range(n)]
    fwd = [sum(costs.forward_s[i] for i in r) for r in runs]
    bwd = [sum(costs.backward_s[i] for i in r) for r in runs]
    memo = {} if sent_memo is None else sent_memo
    if n not in memo:
        boundaries = boundary_tensors(graph, inner, stages_from_cuts(graph, cuts), requires_grad(graph))
        memo[n] = (received_bytes(boundaries, n), max((b.nbytes for b in boundaries), default=0))
    received, sent = memo[n]
    saved = [sum(costs.activation_bytes[i] for i in r) + got for r, got in zip(runs, received)]
    mesh = (pp, dp, tp)
    hops = range(pp if v > 1 else pp - 1)                      # interleaved: the last rank sends to the first too
    p2p = max((send_recv_time_s(sent, stage_device(r, mesh), stage_device((r + 1) % pp, mesh), cluster, mesh)
               for r in hops), default=0.0)                     # the slowest hop between stages
    actions = schedule_actions(schedule, pp, m, v)
    tail_s, peak = 0.0, 0.0
    gather_s, scatter_s = [(0.0, 0.0)] * n, [(0.0, 0.0)] * n   # fsdp, per chunk: (seconds, cost to the compute)
    for rank in range(pp):
        chunks = list(range(rank, n, pp))
        per_chunk = [_chunk_state(costs, runs[c], inner.training, inner.optimizer, dp if role == "fsdp" else 1, tp)
                     for c in chunks]
        state, gathered = sum(s for s, _ in per_chunk), sum(g for _, g in per_chunk)
        grad = sum(n_ for r in (runs[c] for c in chunks) for i in r for n_, _ in costs.params[i]) \
            * itemsize(inner.training.grad_reduce_dtype)
        if role == "fsdp":      # gathered in a chunk's first forward, reduce-scattered in its last backward
            for c, (_, numel) in zip(chunks, per_chunk):
                gather_s[c] = _collective(CollectiveKind.ALL_GATHER, numel * itemsize(inner.training.param_dtype),
                                          mesh, cluster)
                scatter_s[c] = _collective(CollectiveKind.REDUCE_SCATTER,
                                           numel * itemsize(inner.training.grad_reduce_dtype), mesh, cluster)
            sync = 0.0
        else:
            sync = cluster_collective_time_s(CollectiveKind.ALL_REDUCE, grad, mesh, 1, cluster)
        tail_s = max(tail_s, sync + (costs.optimizer_s / (dp if role == "fsdp" else 1)
                                     + (m - 1) * costs.passes_per_micro_step_s) * len(chunks) / n)
        held = in_flight_peak(actions[rank], [saved[c] for c in chunks])
        peak = max(peak, state + sum(step_gathered_bytes(gathered, inner.training)) + held + costs.other_bytes
                   + max(costs.boxing_bytes, _bucket_bytes(costs, [runs[c] for c in chunks], inner.training, dp)))
    def seconds(r: int, a) -> float:        # fsdp: a chunk's first forward / last backward waits for its collectives
        c = a.chunk * pp + r
        if a.kind == "F":
            return overlapped_time_s(fwd[c], *gather_s[c]) if a.micro_batch == 0 else fwd[c]
        return overlapped_time_s(bwd[c], *scatter_s[c]) if a.micro_batch == m - 1 else bwd[c]

    return schedule_makespan(actions, v, seconds, p2p) + tail_s, peak


def _collective(kind: CollectiveKind, nbytes: float, mesh: tuple[int, ...], cluster: Cluster) -> tuple[float, float]:
    """(seconds, cost to the compute stream) of the dp axis's ``kind`` of ``nbytes`` (costmodel/simulate.py)."""
    seconds = cluster_collective_time_s(kind, nbytes, mesh, 1, cluster)
    return seconds, collective_compute_s(kind, nbytes, mesh, 1, cluster, seconds)


def _bucket_bytes(costs: BlockCosts, runs: list[range], training: Training, dp: int) -> float:
    """The largest gradient bucket over dp of a device holding the blocks of ``runs`` (the
    ``boxing_buffer`` the inner plan's program lacks): autoddl/lowering.py closes a bucket once it
    reaches ``bucket_bytes`` (so at most that plus one parameter's gradient), per virtual stage."""
    if dp == 1:
        return 0.0
    grads = [[n_ * itemsize(training.grad_reduce_dtype) for i in r for n_, _ in costs.params[i]] for r in runs]
    return max((min(sum(g), training.bucket_bytes + max(g)) for g in grads if g), default=0.0)


def _chunk_state(costs: BlockCosts, run: range, training: Training, optimizer: str, dp: int, tp: int
                 ) -> tuple[float, float]:
    """(parameter state bytes, elements gathered for the step) of the blocks ``run`` of one chunk on a
    device, with ZeRO-3 over ``dp`` (1: none): a parameter with a dim the inner plan does not split
    and ``dp`` divides is sharded and gathered, as the fsdp baseline stores it (search/baselines.py
    ``_storage_matching``; without tp, dim 0 only: ``_storage_wish``); the others stay whole.
    Non-floating and scalar parameters: by their block's bytes. A pp rank's are its chunks' sums."""
    numel = gathered = 0.0
    for i in run:
        for local, free in costs.params[i]:
            split = dp > 1 and any(size % dp == 0 for size in (free if tp > 1 else free[:1]))
            numel += local / dp if split else local
            gathered += local if split else 0
    other = sum(costs.nbytes[i] - costs.activation_bytes[i] for i in run) \
        - param_state_bytes(sum(n_ for i in run for n_, _ in costs.params[i]), training, optimizer)
    return param_state_bytes(numel, training, optimizer) + other, gathered


def search_3d(trace_for: Callable[[int], OpGraph], inner_plan_for: Callable[[OpGraph, int, Training], object],
              cluster: Cluster, training: Training, global_batch: int, limit_bytes: float,
              micro_batch_sizes: tuple[int, ...] = (1, 2), say: Callable[[str], None] = lambda _m: None,
              min_pp: int = 2, block_cache: dict | None = None) -> list[Estimate]:
    """Every candidate's fast :class:`Estimate`, fastest first (fitting ones before the rest).
    ``trace_for(batch)``: the graph of one micro-batch of ``batch`` samples; ``inner_plan_for(graph,
    tp, training)``: the tp baseline's plan on a (tp,) mesh. ``min_pp=1`` estimates the plans without
    stages too (one stage: the same estimate). ``costs``: a dict kept across calls for the same model
    and intra-node link, holding each (micro-batch size, recompute, tp)'s inner plan and block costs
    (they do not depend on the device count or the inter-node link)."""
    out: list[Estimate] = []
    tries = RECOMPUTE_TRIES if training.recompute == "auto" else (training.recompute,)
    for mbs in micro_batch_sizes:
        graph = trace_for(mbs)
        blocks = len(repeated_blocks(graph))
        for recompute in tries:
            tr = dataclasses.replace(training, recompute=recompute, micro_batches=1)
            by_tp: dict[int, tuple[object, BlockCosts, dict]] = {} if block_cache is None else \
                block_cache.setdefault((mbs, recompute), {})
            for pp, dp, tp in factorisations(cluster, blocks, min_pp):
                if global_batch % (mbs * dp):
                    continue
                m = global_batch // (mbs * dp)
                if tp not in by_tp:
                    inner = inner_plan_for(graph, tp, tr)
                    by_tp[tp] = (inner, block_costs(graph, inner, cluster.resized(tp)), {})
                inner, costs, sent_memo = by_tp[tp]
                for role in ("dp", "fsdp"):
                    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
                        if v > 1 and (pp == 1 or m % pp or blocks < pp * v):
                            continue
                        step, mem = estimate(costs, graph, inner, cluster, pp, dp, tp, role, schedule, v, m,
                                             sent_memo)
                        out.append(Estimate([("pp", pp), (role, dp), ("tp", tp)], schedule, v, mbs, recompute,
                                            step, mem))
            if any(e.memory_bytes <= limit_bytes for e in out):
                break                                   # recompute auto: the first level at which something fits
        say(f"3-D search, micro-batch size {mbs}: {len(out)} candidates estimated")
    return sorted(out, key=lambda e: (e.memory_bytes > limit_bytes, e.step_time_s if e.memory_bytes <= limit_bytes
                                      else e.memory_bytes))


def best_fitting(estimates: list[Estimate], limit_bytes: float, k: int = FULL_PRICES) -> list[Estimate]:
    """The ``k`` fastest estimates that fit (one per (degrees, schedule) kind of role at most)."""
    fitting = [e for e in estimates if e.memory_bytes <= limit_bytes and math.isfinite(e.step_time_s)]
    return fitting[:k]
