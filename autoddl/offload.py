"""Spilling to host memory (Hydra's spilling; ZeRO-Offload's optimizer on the host): what of a plan
lives in host memory under ``Training.offload``, written once for the lowering (the copy tasks),
the cost model (their prices, memory on both sides) and the executor (the copies it runs).

- ``optimizer``: every parameter's float32 master, its optimizer states and its float32 gradient
  live in host memory, and the optimizer step runs on the host (memory-bound on the host's memory
  bandwidth). Each step copies the gradients out after their sync (device -> host, in the reduce
  dtype) and the updated working parameters back (host -> device, in ``param_dtype``), as
  ZeRO-Offload does (one copy each way at the step's end here; ZeRO-Offload overlaps the gradients'
  copy with backward per bucket).
- ``params``: as ``optimizer``, and the working parameters of the layer groups
  ``Training.spill_blocks`` names (``layer_group``: repeated blocks; all of them when it names none;
  ``root`` stays on the device) live on the host too: a
  :class:`SpillGroup` is copied in before its forward and again before its backward (the group
  forward ended with is still there and is not copied again), on the ``copy_h2d`` stream, one group ahead
  (double buffering: the copy of group i+1 overlaps the compute of group i; at most two groups are
  on the device at once), and its gradients are copied out when its backward (and their sync) is
  done (with several micro-steps, on one device only: every micro-step copies its gradients out and
  the host adds them up, which is not priced). Its updated parameters stay on the host.

- ``activations``: as ``params``, and the same groups' saved activations (autoddl/activations.py's
  rule, per micro-step) too: copied out (device -> host, on the ``copy_d2h`` stream) when the
  group's forward is done, and in again before its backward, one group ahead (double buffering as
  for parameters); the last spilled group's stay on the device (backward starts with them). Priced
  with recompute on the same groups, but not run so (a checkpointed block's saved tensors bypass
  the spill hooks): ``check_runnable_offload`` refuses it for the executor and the search.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoddl.activations import block_activation_bytes
from autoddl.graph import NodeKind, OpGraph, TensorMeta
from autoddl.pipeline import pipeline_degree
from autoddl.plan import Plan
from autoddl.precision import itemsize
from autoddl.program import grad_storage_of, layer_group, storage_of, used_parameters

HOST = "host"           # the host CPU's stream: the optimizer step under offload
H2D, D2H = "h2d", "d2h"
SPILL_LEVELS = ("params", "activations")      # the levels that spill layer groups (spill_groups)


def copy_stream(direction: str) -> str:
    """The stream of host copies one way (``h2d`` / ``d2h``): a GPU has a copy engine each way, so
    gradients going out do not wait for parameters coming in."""
    return f"copy_{direction}"


@dataclass(frozen=True)
class SpillGroup:
    """One layer group whose working parameters live on the host (module docstring), with the bytes
    one rank copies: its parameters' local pieces in ``param_dtype`` (in) and their gradients' in the
    reduce dtype (out); under ``activations``, its saved activations of one micro-step (out after
    forward, in before backward; 0 under ``params``)."""

    index: int
    group: str                       # "transformer.h.3"
    fqns: tuple[str, ...]
    param_bytes: int
    grad_bytes: int
    act_bytes: int = 0


def offload_level(plan: Plan) -> str:
    return plan.training.offload_level


def working_bytes(plan: Plan, fqn: str, meta: TensorMeta) -> int:
    """Bytes of one rank's working copy of parameter ``fqn`` of ``meta`` (its storage piece, in
    ``param_dtype``; non-floating parameters in their own dtype)."""
    size = itemsize(plan.training.param_dtype) if meta.is_floating else meta.itemsize
    return int(round(meta.numel * size * storage_of(plan, fqn).shard_fraction(plan.mesh.shape)))


def grad_bytes(plan: Plan, fqn: str, meta: TensorMeta) -> int:
    """Bytes of one rank's gradient of ``fqn`` as it leaves the device: its gradient storage piece, in
    the reduce dtype (0 for a parameter without a gradient)."""
    if not meta.is_floating:
        return 0
    frac = grad_storage_of(plan, fqn).shard_fraction(plan.mesh.shape)
    return int(round(meta.numel * itemsize(plan.training.grad_reduce_dtype) * frac))


def check_offload(graph: OpGraph, plan: Plan) -> None:
    """Refuse what offload does not support, naming what to change."""
    level = offload_level(plan)
    if level == "none":
        return
    if pipeline_degree(plan) > 1:
        raise ValueError(f"plan {plan.name!r}: offload {level} with pipeline stages is not supported; "
                         "use --offload none with a pp degree")
    if level not in SPILL_LEVELS:
        return
    if plan.training.micro_batches > 1 and plan.mesh.size > 1:
        raise ValueError(f"plan {plan.name!r}: offload {level} with {plan.training.micro_batches} micro-steps on "
                         f"{plan.mesh.size} devices is not supported (each micro-step copies its gradients out, "
                         "before a deferred gradient sync); use one micro-step, one device or --offload optimizer")
    groups = spill_groups(graph, plan)
    unknown = set(plan.training.spill_blocks) - {g.group for g in spill_groups(graph, _all_blocks(plan))}
    if unknown:
        raise ValueError(f"plan {plan.name!r}: training.spill_blocks names {sorted(unknown)}, which are no repeated "
                         "block with parameters of this model (e.g. transformer.h.0)")
    for group in groups:
        for fqn in group.fqns:
            storage = storage_of(plan, fqn)
            if any(s.is_split() and n > 1 for s, n in zip(storage, plan.mesh.shape)):
                raise ValueError(f"plan {plan.name!r}: offload {level} copies each spilled parameter whole to its "
                                 f"rank, but {fqn} is stored {storage} (sharded: ZeRO-3 / FSDP / tensor parallel); "
                                 "use --offload optimizer with this plan, or a plan that replicates it")


def check_runnable_offload(graph: OpGraph, plan: Plan) -> None:
    """Refuse what the executor does not run though the cost model prices it: offload activations of a
    block that is also recomputed (a checkpointed block's saved tensors bypass the spill hooks)."""
    if offload_level(plan) != "activations":
        return
    recomputed = [g.group for g in spill_groups(graph, plan) if plan.training.recompute_of(g.group) != "none"]
    if recomputed:
        raise ValueError(f"plan {plan.name!r}: offload activations of recomputed blocks ({', '.join(recomputed[:3])}"
                         f"{', ...' if len(recomputed) > 3 else ''}) is not run by the executor (a checkpointed "
                         "block's saved tensors bypass the spill hooks); use --recompute none for the spilled "
                         "blocks, or --offload params")


def spill_groups(graph: OpGraph, plan: Plan) -> list[SpillGroup]:
    """The layer groups spilled under ``offload params`` / ``activations``, in the order forward first
    uses them (empty under any other level): ``Training.spill_blocks``, or every one when it names
    none. Parameters outside every repeated block (``root``) stay."""
    level = offload_level(plan)
    if level not in SPILL_LEVELS:
        return []
    chosen = set(plan.training.spill_blocks)
    order: dict[str, list[str]] = {}
    used = used_parameters(graph)
    for node in graph.ops():
        for ref in node.inputs:
            p = graph[ref.node]
            if (p.kind is NodeKind.PARAMETER and p.target in used and layer_group(p.target) != "root"
                    and (not chosen or layer_group(p.target) in chosen)):
                fqns = order.setdefault(layer_group(p.target), [])
                if p.target not in fqns:
                    fqns.append(p.target)
    meta = {f: n.outputs[0] for f, n in used.items()}
    saved = block_activation_bytes(graph, plan) if level == "activations" else {}
    return [SpillGroup(i, g, tuple(fqns), sum(working_bytes(plan, f, meta[f]) for f in fqns),
                       sum(grad_bytes(plan, f, meta[f]) for f in fqns), saved.get(g, 0))
            for i, (g, fqns) in enumerate(order.items())]


def _all_blocks(plan: Plan) -> Plan:
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, spill_blocks=()))


def kept_parameters(graph: OpGraph, plan: Plan) -> dict[str, TensorMeta]:
    """Parameters whose working copies stay on the device (every one but the spilled groups'), with
    their metas."""
    spilled = {f for g in spill_groups(graph, plan) for f in g.fqns}
    return {f: n.outputs[0] for f, n in used_parameters(graph).items() if f not in spilled}
