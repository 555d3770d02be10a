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
the slowest hop between consecutive stages (``costmodel.collectives.send_recv_time_s``), plus each rank's gradient reduction over dp (an all-reduce; fsdp: a reduce-scatter
per micro-batch and two all-gathers of the stage's parameters, at most overlapping its compute)
and its optimizer share. Memory: the rank's parameter state (fsdp: / dp) and its micro-batches in
flight. The best fitting estimates (``FULL_PRICES``) are then traced at their real batch and
priced by the full cost model (``price_degrees``: the simulated step program).
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
from costmodel.memory import param_state_bytes
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
    kept for one ``inner`` plan, the largest boundary tensor per stage count (graph walks)."""
    n = pp * v
    cuts = cuts_of(costs, n)
    index = {b: i for i, b in enumerate(costs.blocks)}
    edges = [0] + [index[c] for c in cuts] + [len(costs.blocks)]
    runs = [range(edges[s], edges[s + 1]) for s in range(n)]
    fwd = [sum(costs.forward_s[i] for i in r) for r in runs]
    bwd = [sum(costs.backward_s[i] for i in r) for r in runs]
    saved = [sum(costs.activation_bytes[i] for i in r) for r in runs]
    state = [sum(costs.nbytes[i] for i in r) - a for r, a in zip(runs, saved)]     # parameter state per stage
    mesh = (pp, dp, tp)
    memo = {} if sent_memo is None else sent_memo
    if n not in memo:
        memo[n] = max((b.nbytes for b in boundary_tensors(graph, inner, stages_from_cuts(graph, cuts),
                                                          requires_grad(graph))), default=0)
    sent = memo[n]
    hops = range(pp if v > 1 else pp - 1)                      # interleaved: the last rank sends to the first too
    p2p = max((send_recv_time_s(sent, stage_device(r, mesh), stage_device((r + 1) % pp, mesh), cluster, mesh)
               for r in hops), default=0.0)                     # the slowest hop between stages
    actions = schedule_actions(schedule, pp, m, v)
    per_element = param_state_bytes(1, inner.training, inner.optimizer)
    tail_s, peak = 0.0, 0.0
    for rank in range(pp):
        chunks = list(range(rank, n, pp))
        numel = sum(state[c] for c in chunks) / per_element          # the rank's parameters (local to tp)
        grad = numel * itemsize(inner.training.grad_reduce_dtype)
        if role == "fsdp":
            gathered = numel * itemsize(inner.training.param_dtype)
            comm = m * (2 * cluster_collective_time_s(CollectiveKind.ALL_GATHER, gathered, mesh, 1, cluster)
                        + cluster_collective_time_s(CollectiveKind.REDUCE_SCATTER, grad, mesh, 1, cluster))
            sync = max(0.0, comm - m * sum(fwd[c] + bwd[c] for c in chunks))
        else:
            sync = cluster_collective_time_s(CollectiveKind.ALL_REDUCE, grad, mesh, 1, cluster)
        tail_s = max(tail_s, sync + costs.optimizer_s * len(chunks) / n / (dp if role == "fsdp" else 1))
        held = in_flight_peak(actions[rank], [saved[c] for c in chunks])
        peak = max(peak, sum(state[c] for c in chunks) / (dp if role == "fsdp" else 1) + held)
    makespan = schedule_makespan(actions, v, lambda r, a: (fwd if a.kind == "F" else bwd)[a.chunk * pp + r], p2p)
    return makespan + tail_s, peak


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
