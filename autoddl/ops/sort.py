"""Sorting along one dim (sort, argsort, topk, kthvalue, msort).

Which element lands where depends on every element along the sorted dim, so that dim is
never split; any other dim may be (each row sorts on its own), values and indices split
alike. Indices are positions along the sorted dim, which stays whole on every device, so
they are the global positions. No P: sorting is not linear. A router's top-k over the
experts of each token (``topk(scores (tokens, experts), k)``) splits on the token dim.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import S, Sig1D, bound_args, norm_dim, register


@register("sort", "argsort", "topk", "kthvalue", "msort")
def sort(node: OpNode) -> list[Sig1D]:
    nd = node.input_metas[0].ndim
    dim = 0 if node.op_name == "msort" else norm_dim(bound_args(node).get("dim", -1), nd)
    return [((S(d),), (S(d),) * len(node.outputs)) for d in range(nd) if d != dim]
