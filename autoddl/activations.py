"""Saved activations: what autograd keeps for backward, per op, under a plan (the one rule, used by
the cost model's memory (costmodel/memory.py), the search, and the lowering's spilled-activation
copies (autoddl/offload_program.py)).

The saved activations are the user inputs plus every output of a non-view op that some op
consumes, each at its local size under the producing signature's output NdSbp (views alias their
source and add nothing), in the traced (working) dtype. An op recomputed in backward
(``recomputed_ops``) saves nothing unless an op outside its block reads it (the block's output,
which the next block keeps as its checkpoint input). Under ``Training.attention = "unfused"`` an
attention op also keeps its score tensors (autoddl/attention.py ``unfused_saved_bytes``), unless
recomputed.
"""

from __future__ import annotations

from typing import Sequence

from autoddl.attention import unfused_saved_bytes
from autoddl.graph import NodeKind, OpGraph, OpNode
from autoddl.op_families import SDPA_OPS, ZERO_COST
from autoddl.plan import Plan
from autoddl.program import block_of, recomputed_ops, signature_of, work_divisor
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
            used = {i for c, i, _ in graph.uses(node.name) if c.is_op
                    and not (node.name in recomputed and block_of(c) == block_of(node))}
            out[node.name] = sum(local_bytes(node.outputs[i].nbytes, sig.outputs[i], mesh)
                                 for i in used if node.outputs[i].dtype != "none")
            if node.name not in recomputed:
                out[node.name] += kept_scores_bytes(node, sig, mesh, plan.training)
    return out


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
