"""Peak memory per device of one training step, by category.

- ``parameters``: each parameter's local piece under its storage NdSbp (P counts full size),
  kept in float32 (the masters, under any precision policy: autoddl/precision.py); under a
  mixed-precision policy the masters live in the optimizer storage (ZeRO-1/2 shard them, as
  DeepSpeed keeps fp32 master partitions) and the working copies (below) in the storage;
- ``gradients``: float32, in the gradient storage (the storage; ZeRO-2: the optimizer's); with
  pipeline stages, also the unsharded gradients of the ZeRO-3 groups kept gathered for the step,
  accumulated in the reduce dtype until the chunk's last backward reduce-scatters them (FSDP2 under
  torch.distributed.pipelining: ``FSDPParam.to_accumulated_grad_if_needed``; autoddl/lowering.py);
- ``optimizer_states``: AdamW 2 fp32 states per element of the optimizer storage, SGD none;
- ``working_params``: under a mixed-precision policy, the working copies in ``param_dtype``
  of the parameters not gathered for use (those are in ``gathered_params``), at their storage size;
- ``buffers``: module buffers, local by their signature's output NdSbp;
- ``activations``: what autograd saves for backward (with pipeline stages, for every micro-batch
  the rank's schedule holds at once: :func:`pipeline_rank_bytes`), by autoddl/activations.py's
  rule (user inputs and consumed outputs of non-view ops, at their local size, in the traced
  dtype; a recomputed op's only when read outside its block);
- ``activation_grads``: the activation gradients one op's backward holds at once, the most over the
  ops (a pipeline rank's: its stages'), by autoddl/activations.py's ``activation_grad_bytes`` (for a
  language model, the cross entropy's: the logits' gradient and its log-probabilities', each the
  logits' size, at the start of backward, while every saved activation is still held);
- ``recomputed``: the activations one recomputed block holds again during its backward: the
  largest block's recomputed outputs (one block is recomputed at a time);
- ``gathered_params``: parameters materialised larger than stored for a use (ZeRO-3 /
  FSDP gathers S -> B): by layer group, a group and the next one (prefetched) at a time
  when groups are freed after forward, all of a pp rank's groups with pipeline stages (kept for
  the step: :func:`step_gathered_bytes`); gathered per use, the largest per-op sum;
- ``boxing_buffer``: the largest tensor a collective materialises, other than the
  parameter gathers above: M for all-gather / all-reduce / reduce-scatter / broadcast,
  M/n for a native all-to-all.

Spilling to host memory (``Training.offload``, autoddl/offload.py) moves some of these off the
device, and ``host`` (not in ``total``: host memory per device, checked against the node's
``host_memory_gb`` shared by its devices) counts them there: the float32 masters, their float32
gradients and the optimizer states of every parameter, and under ``params`` the spilled groups'
working copies, under ``activations`` also those groups' saved activations of one micro-step (but
the last group's, which stay). The device keeps the other parameters' working copies (``parameters``
in float32, or ``working_params``) and their gradients in the reduce dtype until copied out
(``gradients``), the other saved activations (``activations``), and ``spilled_params`` /
``spilled_grads`` / ``spilled_acts``: two consecutive spilled groups' working copies, gradients and
saved activations at once (the one computing and the one in flight: double buffering).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from autoddl.activations import (activation_bytes, activation_grad_bytes, kept_scores_bytes,  # noqa: F401
                                 local_bytes)  # (read from here too)
from autoddl.graph import NodeKind, OpGraph
from autoddl.offload import grad_bytes, kept_parameters, spill_groups
from autoddl.pipeline import Boundary, in_flight_peak, input_stage, pipeline_degree
from autoddl.plan import Plan
from autoddl.precision import MASTER_ITEMSIZE, itemsize
from autoddl.program import (StepProgram, block_of, grad_storage_of, optimizer_storage_of, recomputed_ops,
                             signature_of, storage_of, used_parameters)
from autoddl.sbp import NdSbp
from autoddl.training import Training
from costmodel.collectives import Collective, CollectiveKind
from costmodel.compute import ZERO_COST, optimizer_state_bytes

CATEGORIES = ("parameters", "gradients", "optimizer_states", "working_params", "buffers", "activations",
              "activation_grads", "recomputed", "gathered_params", "boxing_buffer", "spilled_params", "spilled_grads",
              "spilled_acts")


def local_parameters(graph: OpGraph, plan: Plan, layout: Callable[[Plan, str], NdSbp] = storage_of,
                     only: frozenset[str] | None = None) -> tuple[int, int]:
    """(bytes, elements) of the parameters one device keeps in ``layout`` (default: their storage;
    used ones only: see used_parameters; ``only`` these when given: a pipeline rank's), at the
    masters' dtype (float32 for floating parameters)."""
    mesh = plan.mesh.shape
    nbytes = numel = 0
    for fqn, node in used_parameters(graph).items():
        if only is not None and fqn not in only:
            continue
        frac = layout(plan, fqn).shard_fraction(mesh)
        meta = node.outputs[0]
        nbytes += int(round(meta.numel * (MASTER_ITEMSIZE if meta.is_floating else meta.itemsize) * frac))
        numel += int(round(meta.numel * frac))
    return nbytes, numel


def master_parameters(graph: OpGraph, plan: Plan, only: frozenset[str] | None = None) -> tuple[int, int]:
    """(bytes, elements) of the float32 masters the optimizer updates on one device: each
    parameter's piece in its optimizer storage (ZeRO-1/2 shard it; else its storage)."""
    return local_parameters(graph, plan, optimizer_storage_of, only)


def param_state_bytes(numel_local: float, training: Training, optimizer: str) -> float:
    """Bytes one device keeps for ``numel_local`` elements of a floating parameter between and during
    steps: the float32 master and its float32 gradient (4 + 4 bytes each), the optimizer's states
    (AdamW: 8), and, under a mixed-precision policy, the working copy in ``param_dtype``.
    (``memory_bytes``'s parameters + gradients + optimizer_states + working_params, per element: what
    the search charges a parameter's storage choice.)"""
    working = itemsize(training.param_dtype) if training.mixed else 0
    return numel_local * (2 * MASTER_ITEMSIZE + working) + optimizer_state_bytes(numel_local, optimizer)


def step_gathered_bytes(numel_local: float, training: Training) -> tuple[float, float]:
    """(working copy, gradient accumulator) bytes one device holds for ``numel_local`` elements of a
    ZeRO-3 group kept gathered for a whole pipelined step: in ``param_dtype`` and in the reduce dtype
    (the ``gathered_params`` and the extra ``gradients`` of the module docstring)."""
    return numel_local * itemsize(training.param_dtype), numel_local * itemsize(training.grad_reduce_dtype)


def accumulated_grad_bytes(plan: Plan, program: StepProgram | None, only: frozenset[str] | None = None) -> int:
    """The unsharded gradient accumulators of a pipelined program's kept ZeRO-3 groups (``only``
    these parameters: a pp rank's)."""
    if program is None or program.pipeline is None:
        return 0
    mesh = plan.mesh.shape
    numel = sum(program.param_uses[i].meta.numel * program.param_uses[i].dst.shard_fraction(mesh)
                for g in rank_gathers(program, only) if not g.reshard for i in g.uses)
    return int(round(step_gathered_bytes(numel, plan.training)[1]))


def rank_gathers(program: StepProgram, only: frozenset[str] | None) -> list:
    """The gather groups of the device holding the parameters ``only`` (None: all): with pipeline
    stages, the groups of that pp rank's stages (a parameter tied across stages is in several);
    otherwise the groups whose first parameter it holds."""
    layout = program.pipeline
    if only is None:
        return list(program.gathers)
    if layout is not None and only in layout.rank_params:
        rank = layout.rank_params.index(only)
        return [g for g in program.gathers if layout.rank_of(layout.stage_of_op[g.last_consumer]) == rank]
    return [g for g in program.gathers if program.param_uses[g.uses[0]].fqn in only]


def working_param_bytes(graph: OpGraph, plan: Plan, program: StepProgram | None = None,
                        only: frozenset[str] | None = None) -> int:
    """Working copies (``param_dtype``) of the parameters not gathered for use, at storage size
    (``only`` these parameters when given)."""
    if not plan.training.mixed:
        return 0
    grouped = {program.param_uses[i].fqn for g in program.gathers for i in g.uses} if program else set()
    return sum(local_bytes(n.outputs[0].nbytes, storage_of(plan, fqn), plan.mesh.shape)
               for fqn, n in used_parameters(graph).items()
               if fqn not in grouped and n.outputs[0].is_floating and (only is None or fqn in only))


def recomputed_bytes(graph: OpGraph, plan: Plan) -> int:
    """The largest block's recomputed activations, held again during its backward."""
    mesh = plan.mesh.shape
    return max((sum(local_bytes(m.nbytes, nd, mesh) for n in block if n.op_name not in ZERO_COST
                    for m, nd in zip(n.outputs, signature_of(plan, n).outputs) if m.dtype != "none")
                + sum(kept_scores_bytes(n, signature_of(plan, n), mesh, plan.training) for n in block)
                for block in recomputed_ops(graph, plan).values()), default=0)


def gathered_param_bytes(graph: OpGraph, plan: Plan, program: StepProgram | None = None,
                         only: frozenset[str] | None = None) -> int:
    """Parameters materialised larger than stored. Gathered one at a time for its op: the largest
    per-op sum. Gathered by layer group (``program.gathers``): a group freed after forward
    (``reshard``) is alive with at most the next one, prefetched; the others until the step ends.
    ``only``: count these parameters only (a pipeline rank's)."""
    mesh = plan.mesh.shape
    grouped = {program.param_uses[i].fqn for g in program.gathers for i in g.uses} if program else set()
    params = graph.parameters()
    best = 0
    for op in graph.ops():
        sig = None
        total = 0
        for slot, ref in enumerate(op.inputs):
            p = graph[ref.node]
            if p.kind is not NodeKind.PARAMETER or p.target in grouped or (only is not None and p.target not in only):
                continue
            sig = sig or signature_of(plan, op)
            meta = params[p.target].outputs[0]
            used = local_bytes(meta.nbytes, sig.inputs[slot], mesh)
            if used > local_bytes(meta.nbytes, storage_of(plan, p.target), mesh):
                total += used
        best = max(best, total)
    gathers = rank_gathers(program, only) if program else []
    if not gathers:
        return best
    size = [sum(local_bytes(program.param_uses[i].meta.nbytes, program.param_uses[i].dst, mesh) for i in g.uses)
            for g in gathers]
    kept = sum(n for n, g in zip(size, gathers) if not g.reshard)
    pairs = max((size[i] + (size[i + 1] if i + 1 < len(size) else 0) for i, g in enumerate(gathers)
                 if g.reshard), default=0)
    return best + kept + pairs


def buffer_bytes(graph: OpGraph, plan: Plan) -> int:
    """Module buffers, local by their signature's output NdSbp."""
    return sum(local_bytes(n.outputs[0].nbytes, signature_of(plan, n).outputs[0], plan.mesh.shape)
               for n in graph.nodes_of(NodeKind.BUFFER) if n.outputs)


def boxing_buffer_bytes(collectives: Sequence[Collective], graph: OpGraph, mesh_shape: Sequence[int]) -> int:
    params = graph.parameters()
    sizes = [c.bytes // mesh_shape[c.axis] if c.kind is CollectiveKind.ALL_TO_ALL else c.bytes
             for c in collectives if not (c.phase == "forward" and c.tensor in params)]
    return max(sizes, default=0)


def memory_bytes(graph: OpGraph, plan: Plan, collectives: Sequence[Collective] = (),
                 program: StepProgram | None = None, activations: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes per device by category (see module docstring), plus ``total``; with pipeline stages,
    those of the pp rank that needs the most (:func:`pipeline_rank_bytes`).

    ``collectives`` are the step's collectives after backend emulation
    (:func:`costmodel.breakdown.predicted_collectives`); they size ``boxing_buffer``.
    ``activations``: :func:`activation_bytes` of ``graph`` and ``plan`` when the caller has it.
    """
    if program is not None and program.pipeline is not None:
        ranks = [pipeline_rank_bytes(graph, plan, collectives, program, r) for r in range(program.pipeline.stages)]
        return max(ranks, key=lambda mem: mem["total"])
    activations = activation_bytes(graph, plan) if activations is None else activations
    return _rank_bytes(graph, plan, collectives, program, None, sum(activations.values()))


def _rank_bytes(graph: OpGraph, plan: Plan, collectives: Sequence[Collective], program: StepProgram | None,
                only: frozenset[str] | None, activations: int, ops: frozenset[str] | None = None) -> dict[str, int]:
    """The categories of one device holding the parameters ``only`` (None: all) and ``activations``,
    running the ops ``ops`` (None: all)."""
    mesh = plan.mesh.shape
    state = _state_bytes(graph, plan, program, only, activations, ops)
    rest = {
        "working_params": working_param_bytes(graph, plan, program, only),
        "gathered_params": gathered_param_bytes(graph, plan, program, only),
        "boxing_buffer": boxing_buffer_bytes(collectives, graph, mesh),
        "spilled_params": 0, "spilled_grads": 0, "spilled_acts": 0,
    }
    mem = {k: state[k] if k in state else rest[k] for k in CATEGORIES}
    if plan.training.offload_level != "none":
        mem.update(offloaded_bytes(graph, plan, program, activations))
    mem["total"] = sum(mem[k] for k in CATEGORIES)
    return mem


def _state_bytes(graph: OpGraph, plan: Plan, program: StepProgram | None, only: frozenset[str] | None,
                 activations: int, ops: frozenset[str] | None = None) -> dict[str, int]:
    """The categories that need no step program without pipeline stages: parameters, gradients,
    optimizer states, buffers, activations (given), activation gradients (of ``ops``), recomputed."""
    master_bytes, master_numel = master_parameters(graph, plan, only)
    # the parameters kept whole in their storage are the masters too, unless working copies stand in
    # for them (mixed precision: float32 masters only in the optimizer storage)
    param_bytes = master_bytes if plan.training.mixed else local_parameters(graph, plan, only=only)[0]
    return {
        "parameters": param_bytes,
        "gradients": local_parameters(graph, plan, grad_storage_of, only)[0] + accumulated_grad_bytes(plan, program, only),
        "optimizer_states": int(optimizer_state_bytes(master_numel, plan.optimizer)),
        "buffers": buffer_bytes(graph, plan),
        "activations": activations,
        "activation_grads": activation_grad_bytes(graph, plan, ops),
        "recomputed": recomputed_bytes(graph, plan),
    }


def memory_floor_bytes(graph: OpGraph, plan: Plan, enough_bytes: float = math.inf) -> int | None:
    """A lower bound of ``memory_bytes(graph, plan, ...)["total"]`` without lowering the plan: the
    categories that need no step program (:func:`_state_bytes`), and the working copies of the
    parameters stored whole (B on every axis: no use of them is a gather, so none is left to
    ``gathered_params``); the rest (other working copies, gathers, the boxing buffer) is >= 0.
    Activations are counted only while the sum is not over ``enough_bytes`` yet (the floor is a
    floor either way). None for a plan with pipeline stages or spilling (their categories depend
    on the schedule / what is spilled)."""
    if pipeline_degree(plan) > 1 or plan.training.offload_level != "none":
        return None
    whole = frozenset(fqn for fqn in used_parameters(graph) if storage_of(plan, fqn).is_broadcast)
    state = _state_bytes(graph, plan, None, None, 0)
    floor = sum(state.values()) - state["recomputed"] + working_param_bytes(graph, plan, None, whole)
    if floor > enough_bytes:
        return floor
    return floor + state["recomputed"] + sum(activation_bytes(graph, plan).values())


def offloaded_bytes(graph: OpGraph, plan: Plan, program: StepProgram | None, activations: int) -> dict[str, int]:
    """The categories spilling changes (module docstring), ``host`` included; ``activations``: the
    saved activations without spilling."""
    groups = spill_groups(graph, plan)
    kept_metas = kept_parameters(graph, plan)
    kept = frozenset(kept_metas)
    master_bytes, master_numel = master_parameters(graph, plan)
    host_grads = local_parameters(graph, plan, grad_storage_of)[0]
    spilled_working = sum(g.param_bytes for g in groups) if plan.training.mixed else 0
    acts = [g.act_bytes for g in groups if g.act_bytes]      # offload activations; the last never leaves

    def pair(sizes: list[int]) -> int:        # the largest two consecutive groups
        return max((a + b for a, b in zip(sizes, sizes[1:] + [0])), default=0)
    return {
        "parameters": 0 if plan.training.mixed else local_parameters(graph, plan, only=kept)[0],
        "gradients": sum(grad_bytes(plan, f, meta) for f, meta in kept_metas.items()),
        "optimizer_states": 0,
        "working_params": working_param_bytes(graph, plan, program, kept),
        "spilled_params": pair([g.param_bytes for g in groups]),
        "spilled_grads": pair([g.grad_bytes for g in groups]),
        "activations": activations - sum(acts),
        "spilled_acts": pair(acts),
        "host": (master_bytes + host_grads + int(optimizer_state_bytes(master_numel, plan.optimizer)) + spilled_working
                 + sum(acts[:-1])),
    }


def chunk_activation_bytes(graph: OpGraph, plan: Plan, program: StepProgram) -> list[int]:
    """Per virtual stage, the activations one micro-batch leaves saved there: its ops' and inputs'
    (``activation_bytes``; an input counts where it is first read) and the tensors it receives."""
    layout = program.pipeline
    stage = {**input_stage(graph, layout.stage_of_op), **layout.stage_of_op}
    out = received_bytes(layout.boundaries, layout.virtual)
    for name, nbytes in activation_bytes(graph, plan).items():
        out[stage[name]] += nbytes
    return out


def received_bytes(boundaries: Sequence[Boundary], virtual: int) -> list[int]:
    """Per virtual stage, the bytes of one micro-batch it receives from the stage before (and keeps
    for its backward)."""
    out = [0] * virtual
    for b in boundaries:
        out[b.src + 1] += b.nbytes
    return out


def pipeline_rank_bytes(graph: OpGraph, plan: Plan, collectives: Sequence[Collective], program: StepProgram,
                        rank: int) -> dict[str, int]:
    """One pp rank's memory: its parameters (``PipelineLayout.rank_params``), and the activations of
    the micro-batches its schedule holds at once (``autoddl.pipeline.in_flight_peak`` over its
    chunks: GPipe m micro-batches, 1F1B P - rank)."""
    layout = program.pipeline
    per_stage = chunk_activation_bytes(graph, plan, program)
    chunks = [per_stage[c * layout.stages + rank] for c in range(layout.virtual_stages)]
    held = in_flight_peak(layout.actions[rank], chunks)
    ops = frozenset(name for name, stage in layout.stage_of_op.items() if layout.rank_of(stage) == rank)
    return _rank_bytes(graph, plan, collectives, program, layout.rank_params[rank], held, ops)
