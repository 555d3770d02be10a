"""Which tensors a plan moves: every edge's forward boxing, backward boxing and gradient sync.

Rules (the executor must run the same thing for its audit to match):

- A producer output is read with its NdSbp: an op's ``plan.signatures[op].outputs[i]``,
  a user input's / buffer's ``plan.signatures[name].outputs[0]``, a parameter's
  ``plan.param_storage[fqn]``.
- Forward: one redistribute per producer output and per distinct target NdSbp
  (consumers wanting the same NdSbp share it), charged to the first such consumer
  (to the producer when that consumer is the OUTPUT node, so per-op times add up).
- Backward, only for tensors that need a gradient (floating, downstream of a
  parameter): each consumer hands back the gradient NdSbp ``grad_ndsbp(dst, its
  outputs)``; gradients with the same (target NdSbp, gradient NdSbp) accumulate
  locally, then one transition takes them to ``needed_grad_ndsbp(src)``. The
  OUTPUT node's gradient is the loss seed, already in ``needed_grad_ndsbp(dst)``.
- For a parameter the backward transition is the gradient sync (phase
  ``grad_sync``): P -> B all-reduce (data parallel), P -> S reduce-scatter (ZeRO),
  one per parameter and per distinct (use NdSbp, gradient NdSbp).
- The OUTPUT node reads the loss (its last input: torch.export lists buffer
  mutations first, the user output last) as all-B, because every rank reports it:
  a P loss costs a forward all-reduce (charged to the loss op). Its other inputs
  are taken as they are. An ``"output"`` entry in ``plan.signatures`` is ignored.
- Boxing is costmodel.boxing's, step by step as DTensor's redistribute runs it
  (``dtensor_steps``), S -> P and B -> P local; an activation's gradient through a
  local -> P move takes two redistributes (``edge_backward_transitions``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoddl.graph import NodeKind, OpGraph, OpNode, TensorRef
from autoddl.plan import Plan
from autoddl.sbp import NdSbp, Signature
from costmodel.boxing import (Transition, boxing_collectives, edge_backward_transitions, grad_ndsbp,
                             needed_grad_ndsbp)


@dataclass(frozen=True)
class EdgeTransition:
    """One collective (kind before backend emulation) a plan runs, and where it is charged."""

    kind: object          # CollectiveKind
    axis: int
    bytes: int
    phase: str            # "forward" | "backward" | "grad_sync"
    tensor: str           # "producer->consumer" or parameter fqn
    op: str               # the consuming op the time is charged to


def signature_of(plan: Plan, node: OpNode, mesh_ndim: int) -> Signature:
    """The plan's signature for an op / input / buffer node, checked against the node."""
    sig = plan.signatures.get(node.name)
    what = {NodeKind.OP: "op", NodeKind.INPUT: "input", NodeKind.BUFFER: "buffer",
            NodeKind.OUTPUT: "output"}.get(node.kind, node.kind.value)
    if sig is None:
        raise ValueError(f"plan {plan.name!r}: signatures has no entry for {what} {node.name!r} "
                         f"({node.target}); every op, input and buffer needs one (e.g. '-> [B]' for an input)")
    n_in = len(node.inputs) if node.kind in (NodeKind.OP, NodeKind.OUTPUT) else 0
    n_out = len(node.outputs) if node.kind is not NodeKind.OUTPUT else 0
    if len(sig.inputs) != n_in or len(sig.outputs) != n_out:
        raise ValueError(f"plan {plan.name!r}: signature {sig} of {what} {node.name!r} ({node.target}) has "
                         f"{len(sig.inputs)} inputs / {len(sig.outputs)} outputs; the node has {n_in} tensor "
                         f"inputs / {n_out} outputs")
    for nd in sig.inputs + sig.outputs:
        if len(nd) != mesh_ndim:
            raise ValueError(f"plan {plan.name!r}: signature {sig} of {what} {node.name!r} has an NdSbp "
                             f"{nd} of {len(nd)} axes; the mesh {plan.mesh} has {mesh_ndim}")
    return sig


def storage_of(plan: Plan, fqn: str, mesh_ndim: int) -> NdSbp:
    nd = plan.param_storage.get(fqn)
    if nd is None:
        raise ValueError(f"plan {plan.name!r}: param_storage has no entry for parameter {fqn!r}; "
                         "give every parameter a storage NdSbp (e.g. [B] for data parallel)")
    if len(nd) != mesh_ndim:
        raise ValueError(f"plan {plan.name!r}: storage {nd} of parameter {fqn!r} has {len(nd)} axes; "
                         f"the mesh {plan.mesh} has {mesh_ndim}")
    return nd


def output_ndsbp(graph: OpGraph, plan: Plan, ref: TensorRef) -> NdSbp:
    """The NdSbp a producer output is held in."""
    node = graph[ref.node]
    ndim = plan.mesh.ndim
    if node.kind is NodeKind.PARAMETER:
        return storage_of(plan, node.target, ndim)
    sig = signature_of(plan, node, ndim)
    return sig.outputs[ref.index]


def used_parameters(graph: OpGraph) -> dict[str, OpNode]:
    """Parameter nodes by fqn that some node reads. torch.export lists a tied weight (GPT's
    wte / lm_head) once per name, with only one placeholder used: the unused alias holds no
    memory of its own and gets no gradient, so the cost model skips it."""
    return {fqn: n for fqn, n in graph.parameters().items() if graph.nx.out_degree(n.name) > 0}


def requires_grad(graph: OpGraph) -> set[str]:
    """Names of nodes whose outputs need a gradient: floating parameters and ops downstream of one."""
    out: set[str] = set()
    for n in graph.topo():
        if n.kind is NodeKind.PARAMETER and n.outputs and n.outputs[0].is_floating:
            out.add(n.name)
        elif n.is_op and any(r.node in out for r in n.inputs) and any(o.is_floating for o in n.outputs):
            out.add(n.name)
    return out


def plan_transitions(graph: OpGraph, plan: Plan) -> list[EdgeTransition]:
    """Every collective one training step of ``plan`` runs: forward in graph order, then backward
    and gradient sync in reverse graph order (kinds before backend emulation)."""
    mesh = plan.mesh.shape
    rg = requires_grad(graph)
    forward: list[EdgeTransition] = []
    backward: list[list[EdgeTransition]] = []
    for node in graph.topo():
        if not node.outputs or node.kind is NodeKind.OUTPUT:
            continue
        fwd, bwd = _producer_transitions(graph, plan, node, rg, mesh)
        forward += fwd
        backward.append(bwd)
    return forward + [t for group in reversed(backward) for t in group]


def _consumer_view(graph: OpGraph, plan: Plan, consumer: OpNode, slot: int, src: NdSbp,
                   ) -> tuple[NdSbp, NdSbp]:
    """(target NdSbp, gradient NdSbp handed back) of one use."""
    if consumer.kind is NodeKind.OUTPUT:
        if slot == len(consumer.inputs) - 1:        # the loss: every rank reads its value
            dst = NdSbp.broadcast(plan.mesh.ndim)
        else:                                       # other outputs are left where they are
            dst = src
        return dst, needed_grad_ndsbp(dst)
    sig = signature_of(plan, consumer, plan.mesh.ndim)
    dst = sig.inputs[slot]
    return dst, grad_ndsbp(dst, sig.outputs)


def _producer_transitions(graph: OpGraph, plan: Plan, node: OpNode, rg: set[str], mesh: tuple[int, ...],
                          ) -> tuple[list[EdgeTransition], list[EdgeTransition]]:
    is_param = node.kind is NodeKind.PARAMETER
    fwd: list[EdgeTransition] = []
    bwd: list[EdgeTransition] = []
    for out_index, meta in enumerate(node.outputs):
        uses = [(c, s) for c, i, s in graph.uses(node.name) if i == out_index]
        if not uses or meta.dtype == "none":
            continue
        src = output_ndsbp(graph, plan, TensorRef(node.name, out_index))
        name = node.name if out_index == 0 else f"{node.name}[{out_index}]"
        seen_dst: set[NdSbp] = set()
        seen_grad: set[tuple[NdSbp, NdSbp]] = set()
        for consumer, slot in uses:
            dst, grad = _consumer_view(graph, plan, consumer, slot, src)
            label = node.target if is_param else f"{name}->{consumer.name}"
            charge = node.name if consumer.kind is NodeKind.OUTPUT else consumer.name
            if dst != src and dst not in seen_dst:
                seen_dst.add(dst)
                fwd += _wrap(boxing_collectives(meta, src, dst, mesh), "forward", label, charge)
            if node.name in rg and meta.is_floating and (dst, grad) not in seen_grad:
                seen_grad.add((dst, grad))
                if is_param:      # a detached leaf per use: its gradient goes straight to storage
                    moves = boxing_collectives(meta, grad, needed_grad_ndsbp(src), mesh)
                else:
                    moves = edge_backward_transitions(meta.nbytes, src, dst, grad, mesh)
                bwd += _wrap(moves, "grad_sync" if is_param else "backward", label, charge)
    return fwd, bwd


def _wrap(transitions: list[Transition], phase: str, tensor: str, op: str) -> list[EdgeTransition]:
    return [EdgeTransition(kind, axis, nbytes, phase, tensor, op) for kind, axis, nbytes in transitions]

