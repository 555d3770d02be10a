"""The timeline of a step program: each task starts when its dependencies are done and its stream is free.

One pass over the tasks in issue order (every dependency is issued earlier):
``start = max(end of every dependency, end of the stream's previous task)``,
``end = start + duration``. Streams are the compute stream and one
communication stream per mesh axis (and per group of axes flattened into one: a process group
has a queue of its own), so an asynchronous gradient bucket runs
while backward goes on, and is exposed only where the optimizer (or the next
bucket) has to wait for it. With pipeline stages every pp rank has its own streams (and a
``p2p`` stream for its sends), so a rank idles where its schedule waits for another's
activations: the bubble, priced as the schedule runs. Durations:

- compute: the roofline of the op's local share (costmodel.compute), forward (again, when
  recomputed in backward) or backward; an op of a checkpointed block also pays what the
  checkpoint adds per op (``costmodel.compute.recompute_overhead_s``);
- collective: alpha-beta on the link of its mesh axis, as the backend carries it out
  (costmodel.collectives), or, for one the host waits for (``Task.host_waits``), the time measured
  at its size where the cluster file has it (``collective_points``); a pipeline send (``send_recv``,
  forward to the next pp rank, backward to the previous one) on the link between the two stages
  (``send_recv_time_s``);
- optimizer: the memory-bound step over the local parameters (a pp rank's own), plus the
  executor's fixed per-step cost (``cluster.executor.step_us``); on the ``host`` stream (offload) at
  the host's memory bandwidth (costmodel/host.py); plus the step's passes over the masters and
  their gradients (working-copy casts, micro-step gradient accumulation: costmodel/master_passes.py)
  and the executor's copies around its flat collectives (bucket copy-in, gathers' flatten and
  unflatten: costmodel/copy_passes.py), and under ZeRO-1/2 the executor's host work per parameter
  its parameter syncs rebuild (``executor.param_sync_us``), under ZeRO-3 per parameter each of its
  group gathers unpacks (``executor.param_gather_us``);
- host copy (``copy`` stream, offload): latency + bytes / bandwidth of the host link (costmodel/host.py).

Ranks that compute apart meet late: a collective starts no earlier than
``executor.arrival_skew_s`` of the time since the ranks last met (compute waited for a collective)
after its inputs are ready (k (sqrt(C) - sqrt(0.5 ms)), measured by executor/calibrate_skew.py;
0 when the cluster file has no ``executor.arrival_skew_us``).

A collective also costs its ranks' compute stream ``f * d + c``: ``f * d``, ``f`` =
``cluster.executor.collective_compute_share`` of its duration ``d`` (NCCL's kernels on the SMs the
compute kernels use), and ``c``, the host CPU its rank spends on the bytes it sends
(``costmodel.collectives.collective_cpu_s``: the link's ``cpu_ns_per_byte``; gloo's threads and the
kernel's network stack run on the cores the ranks compute on, and that CPU goes with the bytes, not
with how long the collective lasts). The rule: when a collective is issued, the compute stream of its pp rank gets a
task of ``f * d + c`` at the compute stream's place in issue order (it starts when the compute issued
before it is done). Overlapped with compute, the compute after it finishes that much later
(``max(comp + f d + c, d)`` for compute ``comp`` beside a collective ``d``: what ``overlapped_time_s``
prices); a collective that compute waits for costs nothing more once its cost to the compute is
within its duration. A collective queued behind others pays where it was issued, not where
it runs, so one that runs while the compute stream is idle (the tail of a communication-bound
backward) is charged where compute was busy. These costs
are kept apart (``Timeline.compute_shares``), not among the tasks: compute busy time stays the
ops' own, and the time they add to the step is reported as exposed communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoddl.attention import dropout_p
from autoddl.cluster import Cluster
from autoddl.graph import OpGraph, OpNode
from autoddl.op_families import SDPA_OPS
from autoddl.offload import HOST
from autoddl.plan import Plan
from autoddl.sbp import Signature
from autoddl.pipeline import schedule_makespan
from autoddl.program import COMPUTE, StepProgram, Task, block_of, recomputed_ops, signature_of
from autoddl.collective_kinds import CollectiveKind
from costmodel.collectives import cluster_collective_time_s, collective_cpu_s, send_recv_time_s, stage_device
from costmodel.compute import (is_causal, op_backward_time_s, op_forward_time_s, optimizer_time_s,
                               recompute_overhead_s)
from costmodel.copy_passes import copy_passes, param_gather_host_s, param_sync_host_s
from costmodel.host import host_copy_time_s, host_optimizer_time_s
from costmodel.master_passes import passes_time_s, step_passes
from costmodel.memory import master_parameters


@dataclass(frozen=True)
class TimedTask:
    task: Task
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    tasks: list[TimedTask]
    compute_shares: list[TimedTask] = field(default_factory=list)   # collectives' shares of the compute stream
    _sums: dict | None = field(default=None, repr=False, compare=False)

    @property
    def step_time_s(self) -> float:
        return max((t.end_s for t in self.tasks + self.compute_shares), default=0.0)

    def busy_s(self, *, stream: str | None = None, phase: str | None = None, collective: bool | None = None,
               pp_rank: int | None = None) -> float:
        """Summed durations of the tasks matching every given filter."""
        if self._sums is None:              # one pass: (stream, phase, collective, rank) -> seconds
            self._sums = {}
            for t in self.tasks:
                key = (t.task.stream, t.task.phase, t.task.is_collective, t.task.pp_rank)
                self._sums[key] = self._sums.get(key, 0.0) + t.duration_s
        return sum(v for (s, p, c, r), v in self._sums.items()
                   if (stream is None or s == stream) and (phase is None or p == phase)
                   and (collective is None or c == collective) and (pp_rank is None or r == pp_rank))

    @property
    def busiest_rank(self) -> int:
        """The pp rank whose compute stream is busiest (0 without pipeline stages)."""
        ranks = {t.task.pp_rank for t in self.tasks} or {0}
        return max(sorted(ranks), key=lambda r: self.busy_s(stream=COMPUTE, pp_rank=r))

    @property
    def exposed_comm_s(self) -> float:
        """Step time not covered by the (busiest rank's) compute stream: communication nothing
        overlapped, and with pipeline stages the bubble too (CostBreakdown separates it)."""
        return max(0.0, self.step_time_s - self.busy_s(stream=COMPUTE, pp_rank=self.busiest_rank))


@dataclass(frozen=True)
class RecomputeInfo:
    """What pricing the checkpoint's costs needs of a plan: the recomputed ops, each recomputed
    block's first op (its forward pays the block's cost) and first recomputed op (its recompute
    task does)."""

    recomputed: frozenset[str]
    forward_firsts: frozenset[str]
    recompute_firsts: frozenset[str]

    @classmethod
    def of(cls, graph: OpGraph, plan: Plan) -> "RecomputeInfo":
        blocks = recomputed_ops(graph, plan)
        firsts: dict[str, str] = {}
        for node in graph.ops():
            firsts.setdefault(block_of(node), node.name)
        return cls(frozenset(n.name for ops in blocks.values() for n in ops),
                   frozenset(firsts[b] for b in blocks), frozenset(ops[0].name for ops in blocks.values()))


def task_time_s(task: Task, graph: OpGraph, plan: Plan, cluster: Cluster, recompute: RecomputeInfo | None = None,
                params: frozenset[str] | None = None, op_times: dict | None = None,
                program: StepProgram | None = None) -> float:
    """Duration of one task (module docstring); ``recompute``: :meth:`RecomputeInfo.of` the plan
    (found when not given); ``params``: the parameters an optimizer task updates (None: all);
    ``op_times``: a memo of op kernel times for this plan and cluster (the blocks of a decoder
    repeat the same ops); ``program``: the step's program, whose parameter uses' master passes the
    optimizer task also pays (none when not given)."""
    mesh = tuple(plan.mesh.shape)
    if task.collective is CollectiveKind.SEND_RECV:
        peer = (task.pp_rank + (1 if task.phase == "forward" else -1)) % mesh[0]
        return send_recv_time_s(task.nbytes, stage_device(task.pp_rank, mesh), stage_device(peer, mesh), cluster, mesh)
    if task.is_collective:
        return cluster_collective_time_s(task.collective, task.nbytes, mesh, task.axis, cluster,
                                         host_waits=task.host_waits)
    if task.is_copy:
        return host_copy_time_s(task.nbytes, cluster)
    if task.phase == "optimizer":
        param_bytes, param_numel = master_parameters(graph, plan, params)
        if task.stream == HOST:
            step_s = host_optimizer_time_s(param_bytes, param_numel, plan.optimizer, cluster)
        else:
            step_s = optimizer_time_s(param_bytes, param_numel, plan.optimizer, cluster, mesh)
        passes = step_passes(program, plan.training, params) + copy_passes(program, plan.training, params) \
            if program else []
        passes_s = passes_time_s(passes, cluster, mesh)
        sync_host_s = (param_sync_host_s(program, cluster, params)
                       + param_gather_host_s(program, plan.training, cluster, params)) if program else 0.0
        return step_s + cluster.executor.step_us * 1e-6 + passes_s + sync_host_s
    node = graph[task.op]
    sig = signature_of(plan, node)
    forward = task.phase in ("forward", "recompute")
    t = kernel_time_s(node, sig, forward, mesh, cluster, op_times, attention=plan.training.attention)
    policy = plan.training.recompute_of(block_of(node))
    if policy != "none" and cluster.executor.recompute:
        recompute = recompute or RecomputeInfo.of(graph, plan)
        first = node.name in (recompute.forward_firsts if task.phase == "forward" else recompute.recompute_firsts)
        t += recompute_overhead_s(node, policy, task.phase, node.name in recompute.recomputed, cluster,
                                  first_in_block=first) * cluster.time_sharing(mesh)
    return t


def kernel_time_s(node: OpNode, sig: Signature, forward: bool, mesh: tuple[int, ...], cluster: Cluster,
                  memo: dict | None = None, attention: str = "flash") -> float:
    """``node``'s forward (else backward) kernel seconds under ``sig`` (costmodel/compute.py), kept in
    ``memo`` (one per plan and cluster) under all of the node those functions read, so the repeated
    blocks of a decoder price each op once."""
    key = (forward, sig, node.kind, node.target, node.flops, node.bytes_read, node.bytes_written,
           node.input_metas, node.outputs, len(node.inputs), len(node.params), is_causal(node),
           attention, dropout_p(node) if attention == "unfused" and node.op_name in SDPA_OPS else 0.0)
    t = memo.get(key) if memo is not None else None
    if t is None:
        t = (op_forward_time_s(node, sig, mesh, cluster, attention) if forward
             else op_backward_time_s(node, sig, mesh, cluster, attention))
        if memo is not None:
            memo[key] = t
    return t


def simulate(program: StepProgram, graph: OpGraph, plan: Plan, cluster: Cluster) -> Timeline:
    """The timeline of ``program`` on ``cluster`` (module docstring)."""
    end: list[float] = []
    stream_free: dict[tuple[int, str], float] = {}
    timed: list[TimedTask] = []
    recompute = RecomputeInfo.of(graph, plan)
    rank_params = program.pipeline.rank_params if program.pipeline is not None else ()
    memo: dict[tuple, float] = {}       # a pipeline copies each chunk's tasks once per micro-batch
    op_times: dict[tuple, float] = {}   # op kernel times, shared by the repeated blocks' ops
    mesh = tuple(plan.mesh.shape)
    shares: list[TimedTask] = []
    compute_costs: dict[tuple, float] = {}      # per collective task key: its cost to the compute stream
    ranks = cluster.ranks_per_node(mesh)
    skewed = bool(cluster.executor.arrival_skew_us)  # whether the cluster prices the ranks' late arrival
    met: dict[int, float] = {}                  # per pp rank: when its ranks last met (compute waited for them)
    for task in program.tasks:
        key = (task.phase, task.op, task.stream, task.collective, task.axis, task.nbytes, task.pp_rank, task.copy)
        if key not in memo:
            params = rank_params[task.pp_rank] if rank_params and task.phase == "optimizer" else None
            memo[key] = task_time_s(task, graph, plan, cluster, recompute, params, op_times, program)
        stream = (task.pp_rank, task.stream)
        start = max([end[d] for d in task.deps] + [stream_free.get(stream, 0.0)])
        if skewed and task.is_collective and task.deps:  # the ranks meet late after computing apart (docstring)
            ready = max(end[d] for d in task.deps)
            start = max(start, ready + cluster.executor.arrival_skew_s(ranks, ready - met.get(task.pp_rank, 0.0)))
        elif skewed and task.stream == COMPUTE:          # compute that waits for a collective: the ranks met there
            met[task.pp_rank] = max([met.get(task.pp_rank, 0.0)]
                                    + [end[d] for d in task.deps if program.tasks[d].is_collective])
        finish = start + memo[key]
        end.append(finish)
        stream_free[stream] = finish
        timed.append(TimedTask(task, start, finish))
        if task.is_collective:                  # its cost to the compute stream (module docstring)
            if key not in compute_costs:
                compute_costs[key] = collective_compute_s(task.collective, task.nbytes, mesh, task.axis, cluster,
                                                          memo[key])
            if compute_costs[key]:
                compute = (task.pp_rank, COMPUTE)
                at = stream_free.get(compute, 0.0)
                stream_free[compute] = at + compute_costs[key]
                shares.append(TimedTask(task, at, stream_free[compute]))
    return Timeline(timed, shares)


def collective_compute_s(kind: CollectiveKind, nbytes: float, mesh_shape: tuple[int, ...], axis, cluster: Cluster,
                         duration_s: float) -> float:
    """What a collective of ``duration_s`` costs its ranks' compute stream (module docstring):
    ``collective_compute_share * duration_s`` plus the host CPU of the bytes it sends."""
    return (cluster.executor.collective_compute_share * duration_s
            + collective_cpu_s(kind, nbytes, mesh_shape, axis, cluster))


def overlapped_time_s(compute_s: float, comm_s: float, comm_compute_s: float) -> float:
    """Time of ``compute_s`` of compute beside a collective of ``comm_s`` started with it, which costs
    the compute ``comm_compute_s`` (:func:`collective_compute_s`): the longer of the two."""
    return max(compute_s + comm_compute_s, comm_s)


def bubble_s(timeline: Timeline, program: StepProgram) -> float:
    """The pipeline bubble: the step time the schedule would take with free sends and each action
    taking its compute (as simulated), less the busiest pp rank's compute (0 without stages).
    With equal stages this is (P - 1) / m of the compute for 1F1B and GPipe, (P - 1) / (V m) for
    interleaved 1F1B (autoddl/pipeline.py)."""
    layout = program.pipeline
    if layout is None:
        return 0.0
    spent: dict[tuple[int, str, int, int], float] = {}
    for t in timeline.tasks:
        task = t.task
        if task.stream == COMPUTE and task.phase != "optimizer":
            chunk = layout.stage_of_op[task.op] // layout.stages
            key = (task.pp_rank, "F" if task.phase == "forward" else "B", task.micro_step, chunk)
            spent[key] = spent.get(key, 0.0) + t.duration_s
    makespan = schedule_makespan(layout.actions, layout.virtual_stages,
                                 lambda r, a: spent.get((r, a.kind, a.micro_batch, a.chunk), 0.0))
    busiest = max(sum(v for k, v in spent.items() if k[0] == r) for r in range(layout.stages))
    return max(0.0, makespan - busiest)


def chrome_trace(timeline: Timeline, ranks: int = 1) -> dict:
    """The timeline as Chrome-trace / Perfetto JSON: one process per rank, one thread (track) per
    stream, one complete event per task (times in µs). Without pipeline stages every rank runs the
    same program, so the ``ranks`` processes' tracks are the same (they are there to sit beside a
    measured trace of each rank); with stages, one process per pp rank, holding its own tasks. The
    collectives' shares of the compute stream are events on the compute track ("compute share of ...")."""
    streams = sorted({t.task.stream for t in timeline.tasks} | ({COMPUTE} if timeline.compute_shares else set()),
                     key=lambda s: (s != COMPUTE, s))
    tid = {s: i for i, s in enumerate(streams)}
    pp_ranks = sorted({t.task.pp_rank for t in timeline.tasks})
    staged = pp_ranks != [0]
    events: list[dict] = []
    for rank in (pp_ranks if staged else range(ranks)):
        label = f"pp rank {rank} (predicted)" if staged else f"rank {rank} (predicted)"
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}})
        events += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid[s], "args": {"name": s}}
                   for s in streams]
        for t, is_share in [(t, False) for t in timeline.tasks] + [(t, True) for t in timeline.compute_shares]:
            task = t.task
            if staged and task.pp_rank != rank:
                continue
            name = (f"{task.collective.value} {task.tensor}" if task.is_collective
                    else f"{task.phase} {task.op}") + (f" mb{task.micro_step}" if staged else "")
            name = f"compute share of {name}" if is_share else name
            events.append({"ph": "X", "name": name, "cat": task.phase, "pid": rank,
                           "tid": tid[COMPUTE if is_share else task.stream],
                           "ts": t.start_s * 1e6, "dur": t.duration_s * 1e6,
                           "args": {"bytes": task.nbytes, "axis": task.axis, "local_flops": task.local_flops}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
