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
micro-step without stages (``syncs_every_micro_step``) run in a chunk's last backward only.

Actions are issued rank by rank as their data is ready, so every dependency is issued before
the task that waits for it (what costmodel/simulate.py's one pass needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoddl.collective_kinds import CollectiveKind
from autoddl.pipeline import P2P, Action, Boundary, issue_order
from autoddl.program import Task


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
                   deferred: set[int]) -> tuple[list[Task], list[int | None]]:
    """The pipelined tasks (module docstring) and each rank's last host task."""
    chunks: dict[tuple[int, str], list[Task]] = {}
    for t in tasks:
        chunks.setdefault((stage_of_task[t.id], "F" if t.phase == "forward" else "B"), []).append(t)
    last_b = {}                                            # (rank, chunk) -> the micro-batch of its last backward
    for r, acts in enumerate(layout.actions):
        for a in acts:
            if a.kind == "B":
                last_b[(r, a.chunk)] = a.micro_batch
    out: list[Task] = []
    ready: dict[tuple[str, int, int], tuple[int, ...]] = {}   # (F|B, micro-batch, virtual stage) -> what to wait for
    last: list[int | None] = [None] * layout.stages
    for r, a, vs, src in issue_order(layout.actions, layout.virtual_stages):
        entry = tuple(sorted(set(ready.get(src, ()) + ((last[r],) if last[r] is not None else ()))))
        keep_deferred = a.kind == "B" and last_b[(r, a.chunk)] == a.micro_batch
        last[r] = _copy_chunk(out, chunks.get((vs, a.kind), []), entry, a.micro_batch, r, async_ids,
                              set() if keep_deferred else deferred) or last[r]
        ready[(a.kind, a.micro_batch, vs)] = _sends(out, layout, a, vs, r, last[r])
    return out, last


def _copy_chunk(out: list[Task], chunk: list[Task], entry: tuple[int, ...], micro_batch: int, rank: int,
                async_ids: set[int], skip: set[int]) -> int | None:
    """Append one micro-batch's copy of ``chunk``; returns its last host task (None when empty)."""
    new_id: dict[int, tuple[int, ...]] = {}
    host = None
    for t in chunk:
        deps = tuple(sorted({d for old in t.deps if old in new_id for d in new_id[old]})) or entry
        if t.id in skip:
            new_id[t.id] = deps
            continue
        out.append(replace(t, id=len(out), deps=deps, micro_step=micro_batch, pp_rank=rank))
        new_id[t.id] = (len(out) - 1,)
        if t.id not in async_ids:
            host = len(out) - 1
    return host


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
