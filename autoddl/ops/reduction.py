"""Reductions over dims (sum, mean, amax, max.dim, var, logsumexp, argmax, ...).

A split kept dim maps to the output dim it becomes. A split reduced dim gives P only
for sum and mean, the linear ones: sum directly; mean through a local kernel that
scales the local mean by 1/n (n devices split the reduced dims; shards are equal
because splits must divide), so the addends sum to the global mean. Max/min/var and
friends drop a split on a reduced dim. P input: sum(P) -> P and mean(P) -> P.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import P, S, Sig1D, bound_args, is_float, norm_dim, register, split_factor
from autoddl.sbp import Signature

LINEAR = ("sum", "mean")
OTHER = ("amax", "amin", "max", "min", "var", "std", "logsumexp", "argmax", "argmin", "prod",
         "any", "all", "linalg_vector_norm", "norm", "var_mean", "std_mean", "nansum")


def reduced_dims(node: OpNode) -> set[int] | None:
    """The reduced dims of the input; None when the op keeps no dim structure we understand."""
    nd = node.input_metas[0].ndim
    bound = bound_args(node)
    dims = bound.get("dim")
    if dims is None or dims == [] or dims == ():
        return set(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    return {norm_dim(d, nd) for d in dims}


def _out_dim_map(node: OpNode, reduced: set[int]) -> dict[int, int] | None:
    """Input dim -> output dim for kept dims, for keepdim or not (read from the output rank)."""
    nd, out_nd = node.input_metas[0].ndim, node.outputs[0].ndim
    kept = [d for d in range(nd) if d not in reduced]
    if out_nd == nd:
        return {d: d for d in kept}
    if out_nd == len(kept):
        return {d: i for i, d in enumerate(kept)}
    return None


def reduction(node: OpNode) -> list[Sig1D] | None:
    if node.op_name in ("max", "min") and len(node.inputs) == 2:   # max.other: element-wise
        from autoddl.ops.pointwise import split_sigs

        return split_sigs(node)
    if len(node.inputs) != 1 or not node.outputs:
        return None
    reduced = reduced_dims(node)
    dmap = _out_dim_map(node, reduced)
    if dmap is None:
        return None
    n_out = len(node.outputs)
    sigs: list[Sig1D] = [((S(d),), (S(o),) * n_out) for d, o in dmap.items()]
    if node.op_name in LINEAR and is_float(node.outputs[0]):
        sigs += [((S(d),), (P,)) for d in sorted(reduced)]
        sigs.append(((P,), (P,)))
    return sigs


def mean_kernel(node: OpNode, sig: Signature, mesh_shape, coord):
    """mean over a split dim: local mean / n, so the P addends sum to the global mean."""
    n = split_factor(sig.inputs[0], mesh_shape, reduced_dims(node))
    if n == 1:
        return None
    from autoddl.ops import aten_op

    op = aten_op(node)

    def scaled_mean(*args, **kwargs):
        return op(*args, **kwargs) / n

    return scaled_mean


register("sum", *OTHER)(reduction)
register("mean", local_kernel=mean_kernel)(reduction)
