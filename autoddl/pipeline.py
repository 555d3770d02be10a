"""Pipeline stages: the ``pp`` mesh axis, the cut of the op graph into stages, the schedules.

A plan is pipelined when its outermost mesh axis is named ``pp`` (size P > 1): every NdSbp holds B
there (the axis splits the model, not tensors), and each rank of the pp axis runs the ops of its
stages only. The op graph is cut into P x V contiguous *virtual stages* at repeated-block
boundaries (``repeated_blocks``, the blocks recompute is decided for): ``Training.stage_cuts``
names the first block of every virtual stage after the first (the search balances them by simulated
time and memory, search/stages.py; empty: equal block counts). Ops before the first block (the
embedding) run in stage 0, ops after the last (final norm, head, loss) in the last stage. Virtual
stage ``s`` runs on pp rank ``s % P`` (Megatron's interleaving: rank r holds chunks r, r + P, ...).

Schedules (``Training.schedule``), per pp rank the ordered actions (F or B, micro-batch, chunk),
with m = ``Training.micro_batches``:

- ``gpipe``: every micro-batch's forward, then every backward (GPipe, Huang et al. 2019);
- ``1f1b``: P - r - 1 warm-up forwards, then one forward one backward, then the remaining
  backwards (PipeDream-Flush; Narayanan et al. 2021): at most P - r micro-batches in flight;
- ``interleaved``: Megatron's interleaved 1F1B with V chunks per rank (Narayanan et al. 2021,
  section 2.2; m a multiple of P): the bubble shrinks by V.

Activations (and their gradients) cross each virtual-stage boundary as send/recv tasks on the
``p2p`` stream (autoddl/lowering.py builds them from :func:`boundary_tensors`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Iterable, Iterator, Sequence

from autoddl.graph import NodeKind, OpGraph, TensorRef
from autoddl.plan import Mesh, Plan
from autoddl.program import block_of, layout_of
from autoddl.sbp import Broadcast, NdSbp, Signature
from autoddl.training import SCHEDULES

PP = "pp"                                     # the mesh axis name of pipeline stages
P2P = "p2p"                                   # the stream of a rank's sends and receives


@dataclass(frozen=True)
class Action:
    """One step of a pp rank's schedule: forward ``F`` or backward ``B`` of one micro-batch on one
    of the rank's chunks (virtual stage ``chunk * P + rank``)."""

    kind: str
    micro_batch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}.{self.chunk}"


# -- plans with a pp axis ---------------------------------------------------------------------------

def pipeline_degree(plan: Plan) -> int:
    """P, the size of the plan's ``pp`` axis (1 when it has none); the axis must be the outermost."""
    names = plan.mesh.axis_names
    if PP not in names:
        return 1
    if names.index(PP) != 0:
        raise ValueError(f"plan {plan.name!r}: mesh axes {names}: the pp axis must be the outermost (first), "
                         "across nodes; e.g. axis names ('pp', 'dp', 'tp')")
    return plan.mesh.shape[0]


def with_pp_axis(plan: Plan, stages: int) -> Plan:
    """``plan`` (on the mesh inside one stage) on a mesh with an outer ``pp`` axis of ``stages``:
    every NdSbp gets B on it. Not priced (``cost`` cleared)."""
    def lift(nd: NdSbp) -> NdSbp:
        return NdSbp((Broadcast(),) + tuple(nd))

    def lift_sig(sig: Signature) -> Signature:
        return Signature(tuple(map(lift, sig.inputs)), tuple(map(lift, sig.outputs)))

    return dataclasses.replace(
        plan, mesh=Mesh((stages,) + plan.mesh.shape, (PP,) + plan.mesh.axis_names),
        signatures={k: lift_sig(v) for k, v in plan.signatures.items()},
        param_storage={k: lift(v) for k, v in plan.param_storage.items()},
        optimizer_storage={k: lift(v) for k, v in plan.optimizer_storage.items()},
        grad_storage={k: lift(v) for k, v in plan.grad_storage.items()},
        cost=None, op_costs=[], notes=list(plan.notes))


# -- cutting the graph into stages -------------------------------------------------------------------

def repeated_blocks(graph: OpGraph) -> list[str]:
    """The repeated blocks (``transformer.h.3``) in forward order; ``root`` is not one."""
    return list(dict.fromkeys(b for b in (block_of(n) for n in graph.ops()) if b != "root"))


def equal_cuts(blocks: Sequence[str], n: int) -> tuple[str, ...]:
    """The first block of virtual stages 1..n-1 when ``blocks`` are split into ``n`` runs of equal
    count (the earlier runs one longer when they do not divide)."""
    size, extra = divmod(len(blocks), n)
    starts, at = [], 0
    for s in range(n - 1):
        at += size + (s < extra)
        starts.append(blocks[at])
    return tuple(starts)


def stage_of_ops(graph: OpGraph, plan: Plan) -> dict[str, int]:
    """Op name -> virtual stage (module docstring), after checking ``training.stage_cuts``."""
    n = pipeline_degree(plan) * plan.training.virtual_stages
    blocks = repeated_blocks(graph)
    if len(blocks) < n:
        raise ValueError(f"plan {plan.name!r}: {n} pipeline stages (pp={pipeline_degree(plan)} x "
                         f"{plan.training.virtual_stages} virtual) but {graph.model_name or 'the model'} has "
                         f"{len(blocks)} repeated blocks; use fewer stages or virtual stages")
    cuts = tuple(plan.training.stage_cuts) or equal_cuts(blocks, n)
    position = {b: i for i, b in enumerate(blocks)}
    if len(cuts) != n - 1 or any(c not in position for c in cuts) or \
            [position[c] for c in cuts] != sorted({position[c] for c in cuts}) or position[cuts[0]] == 0:
        raise ValueError(f"plan {plan.name!r}: training.stage_cuts {list(cuts)} must name {n - 1} distinct "
                         f"repeated blocks after the first, in forward order (the first block of virtual stages "
                         f"1..{n - 1}), e.g. {list(equal_cuts(blocks, n))}")
    return stages_from_cuts(graph, cuts)


def stages_from_cuts(graph: OpGraph, cuts: Sequence[str]) -> dict[str, int]:
    """Op name -> virtual stage when stage s + 1 starts at block ``cuts[s]`` (unchecked)."""
    starts = {c: s + 1 for s, c in enumerate(cuts)}
    out, stage = {}, 0
    for node in graph.ops():
        stage = max(stage, starts.get(block_of(node), 0))
        out[node.name] = stage
    return out


@dataclass(frozen=True)
class Boundary:
    """A tensor sent from virtual stage ``src`` to ``src + 1`` (it is produced at or before ``src``
    and read after it); ``grad``: its gradient comes back."""

    src: int
    ref: TensorRef
    nbytes: int                       # local bytes on one rank (the producer's layout, inner axes)
    grad: bool


def boundary_tensors(graph: OpGraph, plan: Plan, stage_of: dict[str, int], rg: set[str]) -> list[Boundary]:
    """Every op output live across a virtual-stage boundary, once per boundary it crosses (a
    tensor read two stages later is forwarded through the stage between). Inputs, parameters and
    buffers are not sent: each stage reads its own."""
    out: list[Boundary] = []
    mesh = plan.mesh.shape
    for node in graph.ops():
        for index, meta in enumerate(node.outputs):
            readers = [stage_of[c.name] for c, i, _ in graph.uses(node.name) if c.is_op and i == index]
            if not readers or max(readers) <= stage_of[node.name] or meta.dtype == "none":
                continue
            ref = TensorRef(node.name, index)
            local = int(round(meta.nbytes * layout_of(graph, plan, ref).shard_fraction(mesh)))
            grad = node.name in rg and meta.is_floating
            out += [Boundary(s, ref, local, grad) for s in range(stage_of[node.name], max(readers))]
    return out


def tied_parameters(rank_params: Sequence[frozenset[str]]) -> tuple[str, ...]:
    """The parameters read on more than one pp rank (GPT's token embedding, tied to the head on the
    last stage), sorted: each rank holds a copy, and after the rank's own gradient syncs the copies'
    gradients are all-reduced over the pp axis, so every copy takes the same update (Megatron-LM's
    embedding all-reduce between the first and last stage). The all-reduce spans the whole pp axis
    (a rank that does not hold the parameter adds zeros): exact, and more than the two ranks a
    dedicated group would need once pp > 2."""
    count: dict[str, int] = {}
    for params in rank_params:
        for fqn in params:
            count[fqn] = count.get(fqn, 0) + 1
    return tuple(sorted(f for f, n in count.items() if n > 1))


def input_stage(graph: OpGraph, stage_of: dict[str, int]) -> dict[str, int]:
    """Input / buffer node -> the first stage that reads it (each stage loads what it reads)."""
    out: dict[str, int] = {}
    for node in graph.topo():
        if node.kind in (NodeKind.INPUT, NodeKind.BUFFER):
            readers = [stage_of[c.name] for c in graph.consumers(node.name) if c.is_op]
            out[node.name] = min(readers, default=0)
    return out


# -- schedules -------------------------------------------------------------------------------------

def schedule_actions(schedule: str, stages: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """Per pp rank, its actions in order (module docstring)."""
    p, m, v = stages, micro_batches, virtual
    if schedule not in SCHEDULES:
        raise ValueError(f"training.schedule {schedule!r} is not a pipeline schedule; choose one of {list(SCHEDULES)}")
    if schedule == "gpipe" or schedule == "1f1b" or v == 1:     # the actions are shared by the ranks' lists
        forward, backward = [Action("F", j, 0) for j in range(m)], [Action("B", j, 0) for j in range(m)]
        if schedule == "gpipe":
            return [forward + backward for _ in range(p)]
        return [_one_f_one_b(forward, backward, min(p - r - 1, m)) for r in range(p)]
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count to be a multiple of the pipeline degree: "
                         f"micro_batches {m}, pp {p}; use {((m + p - 1) // p) * p} micro-batches")
    forward = [Action("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]
    backward = [Action("B", a.micro_batch, v - 1 - a.chunk) for a in forward]
    return [_one_f_one_b(forward, backward, min((p - r - 1) * 2 + (v - 1) * p, m * v)) for r in range(p)]


def _one_f_one_b(forward: list[Action], backward: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then alternately one forward and one backward, then the rest backward."""
    out = forward[:warmup]
    for i in range(len(forward) - warmup):
        out += [forward[warmup + i], backward[i]]
    return out + backward[len(forward) - warmup:]


def in_flight_peak(actions: Iterable[Action], chunk_bytes: Sequence[int]) -> int:
    """The most activation bytes a rank holds at once: each forward keeps its chunk's activations
    until that micro-batch's backward of the chunk frees them."""
    return max(accumulate((chunk_bytes[a.chunk] if a.kind == "F" else -chunk_bytes[a.chunk] for a in actions),
                          initial=0))


def max_in_flight(actions: Iterable[Action]) -> int:
    """The most micro-batches (of any one chunk, counted per chunk) in flight on a rank at once."""
    return in_flight_peak(actions, [1] * 1024)


def issue_order(actions: Sequence[Sequence[Action]], virtual_stages: int
                ) -> Iterator[tuple[int, Action, int, tuple[str, int, int] | None]]:
    """Every rank's actions, interleaved so that each comes after the action it needs data from:
    (rank, action, its virtual stage, the (F|B, micro-batch, virtual stage) it waits for or None).
    A forward waits for the previous virtual stage's forward of the micro-batch, a backward for the
    next one's backward (:func:`_ids`). Raises when the schedule deadlocks."""
    p = len(actions)
    n = p * virtual_stages
    done: set[int] = set()
    pos = [0] * p
    while any(pos[r] < len(actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                vs = a.chunk * p + r
                key, src = _ids(a, vs, n)
                if src >= 0 and src not in done:
                    break
                yield r, a, vs, (("FB"[src & 1], (src >> 1) // n, (src >> 1) % n) if src >= 0 else None)
                done.add(key)
                pos[r] += 1
                progressed = True
        if not progressed:
            _deadlock(actions, pos)


def _ids(a: Action, vs: int, n: int) -> tuple[int, int]:
    """(the id of action ``a`` on virtual stage ``vs`` of ``n``, the id of the action it needs data
    from or -1): a forward needs the previous virtual stage's forward of its micro-batch, a backward
    the next one's backward; none at the ends. Id of (F|B, micro-batch j, vs): 2 (j n + vs) (+1 for B)."""
    if a.kind == "F":
        key = (a.micro_batch * n + vs) * 2
        return key, (key - 2 if vs > 0 else -1)
    key = (a.micro_batch * n + vs) * 2 + 1
    return key, (key + 2 if vs < n - 1 else -1)


def _deadlock(actions: Sequence[Sequence[Action]], pos: Sequence[int]) -> None:
    waiting = [str(actions[r][pos[r]]) for r in range(len(actions)) if pos[r] < len(actions[r])]
    raise ValueError(f"the pipeline schedule deadlocks: the ranks wait at actions {waiting}")


def schedule_makespan(actions: Sequence[Sequence[Action]], virtual_stages: int,
                      duration_s: Callable[[int, Action], float], p2p_s: float = 0.0) -> float:
    """The step time of a schedule whose action ``a`` on rank ``r`` takes ``duration_s(r, a)`` and
    whose sends take ``p2p_s``: each action starts when its rank is free and its data arrived.

    The same times as walking :func:`issue_order`, found faster (the 3-D search prices thousands of
    schedules of up to ~10^5 actions): a rank runs on until it needs data not yet produced, and
    resumes when the action it waits for ends, instead of every rank being polled in turn."""
    p = len(actions)
    n = p * virtual_stages
    end: dict[int, float] = {}
    free = [0.0] * p
    pos = [0] * p
    blocked: dict[int, int] = {}                         # the action a rank waits for -> that rank
    ready = list(range(p - 1, -1, -1))
    while ready:
        r = ready.pop()
        acts, i, t = actions[r], pos[r], free[r]
        while i < len(acts):
            a = acts[i]
            key, src = _ids(a, a.chunk * p + r, n)
            if src >= 0:
                arrived = end.get(src)
                if arrived is None:
                    blocked[src] = r
                    break
                t = max(t, arrived + p2p_s)
            t = end[key] = t + duration_s(r, a)
            if key in blocked:
                ready.append(blocked.pop(key))
            i += 1
        pos[r], free[r] = i, t
    if any(pos[r] < len(actions[r]) for r in range(p)):
        _deadlock(actions, pos)
    return max(free, default=0.0)
