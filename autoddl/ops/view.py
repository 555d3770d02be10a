"""Views and data movement: reshape family, expand, transpose/permute, split/chunk/unbind,
getitem, cat/stack, slice/select/narrow, index_select, repeat, repeat_interleave.

A split dim follows the op. Reshapes (view, reshape, flatten, unflatten, squeeze,
unsqueeze) are cut into groups of input dims whose product equals a group of output
dims; the leading (non-1) input dim of a group maps to the leading output dim of the
group: cutting either into n contiguous chunks cuts the group's flat range into the
same n chunks (the divisibility filter checks both sizes). Cat/slice/select/split
along a split dim are not allowed. P passes through every view (they are linear).
"""

from __future__ import annotations

import math
from typing import Sequence

from autoddl.graph import OpNode
from autoddl.ops.registry import (B, P, S, Sig1D, bound_args, is_float, local_out_shape, norm_dim,
                                  register, replace_arg)


def reshape_map(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """(input dim, output dim) pairs: the leading dims of each group of merged/split dims."""
    if math.prod(a) != math.prod(b) or 0 in a:
        return []
    pairs, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] == 1:
            i += 1
            continue
        if b[j] == 1:
            j += 1
            continue
        gi, gj, pa, pb = i, j, a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                i += 1
            else:
                pb *= b[j]
                j += 1
        pairs.append((gi, gj))
    return pairs


def _partial(node: OpNode) -> list[Sig1D]:
    if node.outputs and is_float(node.outputs[0]) and all(is_float(m) for m in node.input_metas[:1]):
        return [((P,) + (B,) * (len(node.inputs) - 1), (P,) * len(node.outputs))]
    return []


def _reshape_args(node: OpNode, sig, mesh_shape):
    return replace_arg(node, "size" if node.op_name != "reshape" else "shape", local_out_shape(node, sig, mesh_shape))


def _unflatten_args(node: OpNode, sig, mesh_shape):
    bound = bound_args(node)
    dim = norm_dim(bound["dim"], node.input_metas[0].ndim)
    k = len(bound["sizes"])
    return replace_arg(node, "sizes", local_out_shape(node, sig, mesh_shape)[dim: dim + k])


def _squeeze_kernel(node: OpNode, sig, mesh_shape, coord):
    """squeeze would also drop a local dim that a split made size 1: squeeze the global size-1 ones."""
    import torch

    shape = node.input_metas[0].shape
    asked = bound_args(node).get("dim")
    asked = range(len(shape)) if asked is None else [asked] if isinstance(asked, int) else asked
    dims = sorted({norm_dim(d, len(shape)) for d in asked if shape[norm_dim(d, len(shape))] == 1})
    return lambda x, *args, **kwargs: torch.ops.aten.squeeze.dims(x, dims)


def reshape_like(node: OpNode) -> list[Sig1D]:
    pairs = reshape_map(node.input_metas[0].shape, node.outputs[0].shape)
    return [((S(i),), (S(o),)) for i, o in pairs] + _partial(node)


register("view", "_unsafe_view", "reshape", local_args=_reshape_args)(reshape_like)
register("unflatten", local_args=_unflatten_args)(reshape_like)
register("squeeze", local_kernel=_squeeze_kernel)(reshape_like)
register("flatten", "unsqueeze")(reshape_like)


def _expand_args(node: OpNode, sig, mesh_shape):
    return replace_arg(node, "size", local_out_shape(node, sig, mesh_shape))


@register("expand", local_args=_expand_args)
def expand(node: OpNode) -> list[Sig1D]:
    """A kept dim follows; an expanded (new or size-1) output dim may be split from a B input."""
    a, b = node.input_metas[0].shape, node.outputs[0].shape
    off = len(b) - len(a)
    sigs = []
    for d in range(len(b)):
        ai = d - off
        sigs.append(((S(ai) if ai >= 0 and a[ai] == b[d] else B,), (S(d),)))
    return sigs + _partial(node)


def _perm(node: OpNode) -> list[int]:
    nd = node.input_metas[0].ndim
    if node.op_name == "permute":
        return [norm_dim(d, nd) for d in bound_args(node)["dims"]]
    perm = list(range(nd))
    if node.op_name in ("t", "numpy_T") or nd < 2:
        perm.reverse()
        return perm
    bound = bound_args(node)
    a0, a1 = ("axis0", "axis1") if "axis0" in bound else ("dim0", "dim1")
    d0, d1 = norm_dim(bound[a0], nd), norm_dim(bound[a1], nd)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


@register("transpose", "permute", "t", "swapaxes")
def transpose(node: OpNode) -> list[Sig1D]:
    perm = _perm(node)
    return [((S(src),), (S(o),)) for o, src in enumerate(perm)] + _partial(node)


@register("split", "split_with_sizes", "chunk", "unbind", "tensor_split")
def split(node: OpNode) -> list[Sig1D]:
    """Every output splits like the input, on any dim but the one being cut."""
    nd = node.input_metas[0].ndim
    dim = norm_dim(bound_args(node).get("dim", 0), nd)
    drop = node.op_name == "unbind"
    sigs = [((S(d),), (S(d - (drop and d > dim)),) * len(node.outputs)) for d in range(nd) if d != dim]
    return sigs + _partial(node)


@register("getitem")
def getitem(node: OpNode) -> list[Sig1D]:
    """Output i of a multi-output op: its input already is that output (identity)."""
    return [((S(d),), (S(d),)) for d in range(node.outputs[0].ndim)] + _partial(node)


@register("cat", "concat", "concatenate")
def cat(node: OpNode) -> list[Sig1D] | None:
    nd = node.outputs[0].ndim
    if any(m.ndim != nd for m in node.input_metas):
        return None  # legacy cat with 1-d empty tensors
    dim = norm_dim(bound_args(node).get("dim", 0), nd)
    n = len(node.inputs)
    sigs = [((S(d),) * n, (S(d),)) for d in range(nd) if d != dim]
    if all(is_float(m) for m in node.input_metas):
        sigs.append(((P,) * n, (P,)))
    return sigs


@register("stack")
def stack(node: OpNode) -> list[Sig1D]:
    nd = node.outputs[0].ndim
    dim = norm_dim(bound_args(node).get("dim", 0), nd)
    n = len(node.inputs)
    sigs = [((S(d),) * n, (S(d if d < dim else d + 1),)) for d in range(nd - 1)]
    if all(is_float(m) for m in node.input_metas):
        sigs.append(((P,) * n, (P,)))
    return sigs


@register("slice", "narrow", "select", "index_select")
def slice_(node: OpNode) -> list[Sig1D]:
    """Index along one dim: other dims follow (select drops its dim); the indexed dim stays whole.
    index_select may instead split its index: the output splits on the indexed dim."""
    nd = node.input_metas[0].ndim
    dim = norm_dim(bound_args(node).get("dim", 0), nd)
    extra = (B,) * (len(node.inputs) - 1)
    drop = node.op_name == "select"
    sigs = [((S(d),) + extra, (S(d - (drop and d > dim)),)) for d in range(nd) if d != dim]
    if node.op_name == "index_select":
        sigs.append(((B, S(0)), (S(dim),)))
    return sigs + _partial(node)


@register("repeat")
def repeat(node: OpNode) -> list[Sig1D]:
    """Dims repeated once keep their split (repeats may add leading dims)."""
    a = node.input_metas[0].shape
    reps = list(bound_args(node)["repeats"])
    off = len(reps) - len(a)
    sigs = [((S(i),), (S(i + off),)) for i in range(len(a)) if reps[i + off] == 1]
    return sigs + _partial(node)


def _repeat_interleave_args(node: OpNode, sig, mesh_shape):
    if bound_args(node).get("output_size") is None:
        return tuple(node.args), dict(node.kwargs)
    dim = norm_dim(bound_args(node)["dim"], node.input_metas[0].ndim)
    return replace_arg(node, "output_size", local_out_shape(node, sig, mesh_shape)[dim])


@register("repeat_interleave", local_args=_repeat_interleave_args)
def repeat_interleave(node: OpNode) -> list[Sig1D] | None:
    """repeat_interleave(x, int repeats, dim): each element repeats in place, so every dim,
    the repeated one included, may be split (chunk j of the output repeats chunk j of x)."""
    bound = bound_args(node)
    if bound.get("dim") is None or len(node.inputs) != 1:
        return None
    return [((S(d),), (S(d),)) for d in range(node.outputs[0].ndim)] + _partial(node)
