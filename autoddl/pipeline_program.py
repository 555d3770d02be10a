"""The step program of a pipelined plan: one micro-batch's tasks, cut by stage, run as the schedule says.

autoddl/lowering.py lowers one micro-batch of the whole graph as it does without stages (so the
boxing, recompute, ZeRO gathers and bucketed gradient syncs of a stage are what they are
elsewhere), then hands its tasks here. Each task belongs to the virtual stage of the op it is
charged to (``Task.op``; a gradient sync charged to a parameter, to the stage of the parameter's
first consumer), and to that stage's forward chunk (phase ``forward``) or backward chunk
(``backward``, ``recompute``, ``grad_sync``). Per pp rank, in the order of its schedule
(autoddl/pipeline.py), each action copies its chunk's tasks (``micro_step`` = the micro-batch,
``pp_rank`` = the rank): a task keeps its dependencies inside the chunk, and one without any
waits for the rank's previous host task and for the data the action needs, the activations from
the previous virtual stage (forward) or their gradients from the next one (backward). After a
forward the rank sends each :func:`autoddl.pipeline.boundary_tensors` tensor to the next virtual
stage, after a backward the gradients of those back: one ``send_recv`` task per tensor on the
sender's ``p2p`` stream, priced on the pp axis's link. Gradient syncs that wait for the last
micro-step without stages (``syncs_every_micro_step``) run in a chunk's last backward only, and
so do the reduce-scatters of ZeRO-3 groups, which are gathered in a chunk's first forward only and
kept for the step (autoddl/lowering.py, as torchtitan runs FSDP under pp).

Actions are issued rank by rank as their data is ready, so every dependency is issued before
the task that waits for it (what costmodel/simulate.py's one pass needs). After its actions, each
rank all-reduces over the pp axis the gradients of the parameters several pp ranks hold
(``PipelineLayout.tied``, :func:`autoddl.pipeline.tied_parameters`), then steps its optimizer.

The executor runs a virtual stage from :func:`stage_program`, the program's part for that stage
(its ops' inputs, edges, parameter uses, buckets), and :class:`StageIO`, what it receives, reads
and sends (executor/pipelined.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind, OpGraph
from autoddl.pipeline import P2P, Action, Boundary, issue_order
from autoddl.program import StepProgram, Task


@dataclass(frozen=True)
class PipelineLayout:
    """What a pipelined program runs: P ranks of V chunks, m micro-batches, each rank's actions,
    the op -> virtual stage map, the tensors crossing each boundary, each rank's parameters."""

    stages: int
    virtual_stages: int
    micro_batches: int
    schedule: str
    actions: tuple[tuple[Action, ...], ...]
    stage_of_op: dict[str, int] = field(default_factory=dict)
    boundaries: tuple[Boundary, ...] = ()
    rank_params: tuple[frozenset[str], ...] = ()
    tied: tuple[str, ...] = ()                       # parameters all-reduced over pp (pipeline.tied_parameters)

    @property
    def virtual(self) -> int:
        return self.stages * self.virtual_stages

    def rank_of(self, virtual_stage: int) -> int:
        return virtual_stage % self.stages

    def send_bytes(self, src: int, backward: bool = False) -> int:
        """Local bytes sent forward from virtual stage ``src`` (or, ``backward``, the gradients sent
        back to it from ``src + 1``) per micro-batch."""
        return sum(b.nbytes for b in self.boundaries if b.src == src and (b.grad or not backward))


def pipeline_tasks(tasks: list[Task], stage_of_task: list[int], layout: PipelineLayout, async_ids: set[int],
                   deferred: set[int], once: set[int] = frozenset()) -> tuple[list[Task], list[int | None]]:
    """The pipelined tasks (module docstring) and each rank's last host task. ``deferred``: tasks
    only a chunk's last backward runs; ``once``: tasks only its first forward runs (the ZeRO-3
    gathers kept for the step)."""
    chunks: dict[tuple[int, str], list[Task]] = {}
    for t in tasks:
        chunks.setdefault((stage_of_task[t.id], "F" if t.phase == "forward" else "B"), []).append(t)
    last_b, first_f = {}, {}                               # (rank, chunk) -> the micro-batch of its last B / first F
    for r, acts in enumerate(layout.actions):
        for a in acts:
            if a.kind == "B":
                last_b[(r, a.chunk)] = a.micro_batch
            else:
                first_f.setdefault((r, a.chunk), a.micro_batch)
    templates: dict[tuple[int, str, bool], Template] = {}
    out: list[Task] = []
    ready: dict[tuple[str, int, int], tuple[int, ...]] = {}   # (F|B, micro-batch, virtual stage) -> what to wait for
    last: list[int | None] = [None] * layout.stages
    for r, a, vs, src in issue_order(layout.actions, layout.virtual_stages):
        entry = tuple(sorted(set(ready.get(src, ()) + ((last[r],) if last[r] is not None else ()))))
        keep = (last_b[(r, a.chunk)] if a.kind == "B" else first_f[(r, a.chunk)]) == a.micro_batch
        key = (vs, a.kind, keep)
        if key not in templates:
            skip = set() if keep else (deferred if a.kind == "B" else once)
            templates[key] = _template(chunks.get((vs, a.kind), []), async_ids, skip)
        host = _copy_chunk(out, templates[key], entry, a.micro_batch, r)
        last[r] = host if host is not None else last[r]
        ready[(a.kind, a.micro_batch, vs)] = _sends(out, layout, a, vs, r, last[r])
    return out, last


Template = tuple[list[tuple[Task, tuple[int, ...], bool]], "int | None"]


def _template(chunk: list[Task], async_ids: set[int], skip: set[int]) -> Template:
    """How a copy of ``chunk`` is laid out: per kept task, its dependencies as offsets from the
    copy's first task and whether it waits for the copy's entry (a task with no dependency inside
    the chunk does; a skipped task hands its own on); and the offset of the last host task."""
    at: dict[int, tuple[frozenset[int], bool]] = {}
    rows: list[tuple[Task, tuple[int, ...], bool]] = []
    host = None
    for t in chunk:
        offsets: set[int] = set()
        entry = False
        for old in t.deps:
            if old in at:
                offsets |= at[old][0]
                entry |= at[old][1]
        entry = entry or not offsets
        if t.id in skip:
            at[t.id] = (frozenset(offsets), entry)
            continue
        at[t.id] = (frozenset({len(rows)}), False)
        rows.append((t, tuple(sorted(offsets)), entry))
        if t.id not in async_ids:
            host = len(rows) - 1
    return rows, host


def _copy_chunk(out: list[Task], template: Template, entry: tuple[int, ...], micro_batch: int, rank: int
                ) -> int | None:
    """Append one micro-batch's copy of a chunk laid out as ``template``; returns its last host task
    (None when it has none)."""
    rows, host = template
    base = len(out)
    for t, offsets, waits in rows:
        deps = tuple(base + o for o in offsets) + (entry if waits else ())
        out.append(_clone(t, len(out), deps, micro_batch, rank))
    return None if host is None else base + host


def _clone(t: Task, id: int, deps: tuple[int, ...], micro_step: int, pp_rank: int) -> Task:
    """``dataclasses.replace(t, ...)`` without its per-call field introspection (a pipeline copies
    hundreds of thousands of tasks)."""
    new = object.__new__(Task)
    new.__dict__.update(t.__dict__, id=id, deps=deps, micro_step=micro_step, pp_rank=pp_rank)
    return new


def _sends(out: list[Task], layout: PipelineLayout, a: Action, vs: int, rank: int, after: int | None
           ) -> tuple[int, ...]:
    """The send/recv tasks after action ``a`` (activations forward, gradients back); returns what the
    receiving action waits for: those tasks, or ``after`` when nothing is sent."""
    forward = a.kind == "F"
    if forward and vs == layout.virtual - 1 or not forward and vs == 0:
        return ()
    crossing = [b for b in layout.boundaries if b.src == (vs if forward else vs - 1) and (forward or b.grad)]
    ids = []
    for b in crossing:
        to = vs + 1 if forward else vs - 1
        out.append(Task(id=len(out), phase="forward" if forward else "backward", stream=P2P,
                        deps=(after,) if after is not None else (), op=b.ref.node,
                        collective=CollectiveKind.SEND_RECV, axis=0, nbytes=b.nbytes,
                        tensor=f"{'' if forward else 'grad '}{b.ref}->stage{to}", micro_step=a.micro_batch,
                        pp_rank=rank))
        ids.append(len(out) - 1)
    return tuple(ids) or ((after,) if after is not None else ())


# -- one virtual stage, as a rank runs it ------------------------------------------------------------

@dataclass(frozen=True)
class StageIO:
    """What virtual stage ``stage`` runs and exchanges: its ops, the boundary tensors it receives
    from the stage before and sends to the next (both in :func:`autoddl.pipeline.boundary_tensors`
    order, so sender and receiver agree), the input and buffer nodes it reads itself, and whether
    it computes the loss (the last stage)."""

    stage: int
    ops: frozenset[str]
    received: tuple[Boundary, ...]
    sent: tuple[Boundary, ...]
    reads: frozenset[str]
    last: bool


def stage_io(graph: OpGraph, layout: PipelineLayout, stage: int) -> StageIO:
    """The :class:`StageIO` of virtual stage ``stage`` of ``layout``."""
    ops = frozenset(op for op, s in layout.stage_of_op.items() if s == stage)
    reads = frozenset(n.name for n in graph.topo() if n.kind in (NodeKind.INPUT, NodeKind.BUFFER)
                      and any(c.name in ops for c in graph.consumers(n.name)))
    return StageIO(stage, ops, tuple(b for b in layout.boundaries if b.src == stage - 1),
                   tuple(b for b in layout.boundaries if b.src == stage), reads, stage == layout.virtual - 1)


def stage_program(program: StepProgram, io: StageIO) -> StepProgram:
    """The part of a pipelined ``program`` that virtual stage ``io.stage`` runs, for the executor: its
    ops' inputs, edges, parameter uses, buckets and ZeRO-3 gather groups, renumbered from 0 (lowering
    gives each stage its own uses, buckets and groups), the loss on the last stage, and the layout
    (so its gradient sync follows the pipelined rule, ``syncs_every_micro_step``). No tasks: the
    schedule, its sends, the pp all-reduces and the ZeRO-1/2 parameter syncs after the optimizer
    are the pp rank's (``program.tasks`` keeps them for the audit; ``ParamSync.pp_rank``)."""
    op_inputs = {op: srcs for op, srcs in program.op_inputs.items() if op in io.ops}
    index = {old: new for new, old in enumerate(sorted({s for srcs in op_inputs.values() for s in srcs
                                                        if isinstance(s, int)}))}
    buckets = [b for b in program.buckets if any(u in index for u in b.uses)]
    gathers = [g for g in program.gathers if any(u in index for u in g.uses)]
    for group in buckets + gathers:
        if not all(u in index for u in group.uses):
            raise ValueError(f"{type(group).__name__.lower()} {group.index} of plan {program.plan_name!r} holds "
                             f"parameter uses of more than one pipeline stage; lower the plan again")
    bucket_of = {b.index: i for i, b in enumerate(buckets)}
    gather_of = {g.index: i for i, g in enumerate(gathers)}
    uses = [dataclasses.replace(use, index=index[use.index], bucket=bucket_of.get(use.bucket, -1),
                                gather=gather_of.get(use.gather, -1))
            for use in (program.param_uses[old] for old in sorted(index, key=index.get))]
    keys = {s for srcs in op_inputs.values() for s in srcs if not isinstance(s, int)}
    loss = program.loss if io.last else None
    keys |= {loss} if loss is not None else set()
    return StepProgram(
        program.plan_name, program.mesh_shape, tasks=[],
        op_inputs={op: tuple(index[s] if isinstance(s, int) else s for s in srcs) for op, srcs in op_inputs.items()},
        edges={k: e for k, e in program.edges.items() if k in keys}, param_uses=uses,
        buckets=[dataclasses.replace(b, index=i, uses=tuple(index[u] for u in b.uses)) for i, b in enumerate(buckets)],
        gathers=[dataclasses.replace(g, index=i, uses=tuple(index[u] for u in g.uses)) for i, g in enumerate(gathers)],
        loss=loss, loss_async=program.loss_async and io.last, pipeline=program.pipeline)
