"""Saved activations: what autograd keeps for backward, per op, under a plan (the one rule, used by
the cost model's memory (costmodel/memory.py), the search, and the lowering's spilled-activation
copies (autoddl/offload_program.py)).

The saved activations are the user inputs plus every output of a non-view op that some op
consumes other than a dtype cast (``to``'s backward casts the gradient back and reads no input: logits
cast to float32 for the loss are held in float32 only), each at its local size under the producing
signature's output NdSbp (views alias their source and add nothing), in the traced (working) dtype. An op recomputed in backward
(``recomputed_ops``) saves nothing unless an op outside its block reads it (the block's output,
which the next block keeps as its checkpoint input). Under ``Training.attention = "unfused"`` an
attention op also keeps its score tensors (autoddl/attention.py ``unfused_saved_bytes``), unless
recomputed.

Besides what is saved, a backward holds activation gradients: while an op's backward runs, the
gradients of its outputs and of its inputs that an op produced, at their local size in their dtypes
(:func:`backward_grad_bytes`; parameters' gradients are the memory's ``gradients``, and inputs and
buffers get none). A fused cross entropy (``aten.cross_entropy_loss`` is ``log_softmax`` then
``nll_loss``) also holds the gradient of its log-probabilities, the size of its logits:
``nll_loss``'s backward writes it (aten/src/ATen/native/LossNLL.cpp ``nll_loss_backward``: zeros of
the input's shape), and ``log_softmax``'s backward reads it while writing the logits' gradient
(``_log_softmax_backward_data``), beside the saved log-probabilities (the logits' count above).
"""

from __future__ import annotations

from typing import Sequence

from autoddl.attention import unfused_saved_bytes
from autoddl.graph import NodeKind, OpGraph, OpNode
from autoddl.op_families import CAST_OPS, SDPA_OPS, ZERO_COST
from autoddl.plan import Plan
from autoddl.program import block_of, recomputed_ops, requires_grad, signature_of, work_divisor
from autoddl.sbp import NdSbp, Signature
from autoddl.training import Training


def local_bytes(nbytes: int, nd: NdSbp, mesh_shape: Sequence[int]) -> int:
    """Bytes of one device's piece of a tensor of ``nbytes`` held as ``nd``."""
    return int(round(nbytes * nd.shard_fraction(mesh_shape)))


def activation_bytes(graph: OpGraph, plan: Plan) -> dict[str, int]:
    """Saved-activation bytes per node (inputs and non-view ops), per the module docstring's rule."""
    mesh = plan.mesh.shape
    recomputed = {n.name for block in recomputed_ops(graph, plan).values() for n in block}
    out: dict[str, int] = {}
    for node in graph.topo():
        if node.kind is NodeKind.INPUT or (node.is_op and node.op_name not in ZERO_COST):
            sig = signature_of(plan, node)
            used = saved_outputs(graph, node, node.name in recomputed)
            out[node.name] = sum(local_bytes(node.outputs[i].nbytes, sig.outputs[i], mesh)
                                 for i in used if node.outputs[i].dtype != "none")
            if node.name not in recomputed:
                out[node.name] += kept_scores_bytes(node, sig, mesh, plan.training)
    return out


# fused losses that run log_softmax then nll_loss inside one traced op (module docstring)
FUSED_LOG_SOFTMAX_LOSSES = frozenset({"cross_entropy_loss"})


def saved_outputs(graph: OpGraph, node: OpNode, recomputed: bool) -> set[int]:
    """Indices of ``node``'s outputs autograd keeps (module docstring): those an op reads other than a
    dtype cast; of a recomputed op, only those an op outside its block reads."""
    block = block_of(node) if recomputed else None
    return {i for c, i, _ in graph.uses(node.name)
            if c.is_op and c.op_name not in CAST_OPS and not (recomputed and block_of(c) == block)}


def backward_grad_bytes(graph: OpGraph, node: OpNode, sig: Signature, mesh_shape: Sequence[int]) -> int:
    """The activation gradients op ``node`` run with ``sig`` holds while its backward runs (module
    docstring): when it needs one, its floating outputs' gradients and those of its inputs that an op
    produced and that need one, local bytes in their dtypes, and for a fused log-softmax loss the
    log-probabilities' (its logits' size)."""
    needs = requires_grad(graph)
    if not node.is_op or node.op_name in ZERO_COST or node.name not in needs:
        return 0
    outs = sum(local_bytes(m.nbytes, nd, mesh_shape) for m, nd in zip(node.outputs, sig.outputs) if m.is_floating)
    ins = [local_bytes(m.nbytes, nd, mesh_shape) for ref, m, nd in zip(node.inputs, node.input_metas, sig.inputs)
           if m.is_floating and graph[ref.node].is_op and ref.node in needs]
    internal = ins[0] if ins and node.op_name in FUSED_LOG_SOFTMAX_LOSSES else 0
    return outs + sum(ins) + internal


def activation_grad_bytes(graph: OpGraph, plan: Plan, names: frozenset[str] | None = None) -> int:
    """The most activation-gradient bytes one op's backward holds (:func:`backward_grad_bytes`), over
    the graph's ops (``names`` only, when given: a pipeline rank's)."""
    mesh = plan.mesh.shape
    return max((backward_grad_bytes(graph, n, signature_of(plan, n), mesh) for n in graph.ops()
                if n.op_name not in ZERO_COST and (names is None or n.name in names)), default=0)


def kept_scores_bytes(node: OpNode, sig: Signature, mesh_shape: Sequence[int], training: Training) -> int:
    """The score tensors an attention op run with ``sig`` keeps for backward (local bytes) when
    ``training`` runs attention unfused; 0 for any other op or under flash attention."""
    if training.attention != "unfused" or node.op_name not in SDPA_OPS:
        return 0
    return int(round(unfused_saved_bytes(node, work_divisor(sig, mesh_shape))))


def block_activation_bytes(graph: OpGraph, plan: Plan) -> dict[str, int]:
    """Saved-activation bytes per block (``block_of`` the producing op; inputs are ``root``'s)."""
    out: dict[str, int] = {}
    for name, nbytes in activation_bytes(graph, plan).items():
        node = graph[name]
        block = block_of(node) if node.is_op else "root"
        out[block] = out.get(block, 0) + nbytes
    return out
