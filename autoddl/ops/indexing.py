"""Advanced indexing: ``x[i0, i1, ...]`` (index.Tensor) and writes through it (index_put).

``index(x, indices)``: the index tensors (None for a dim taken whole) broadcast to one
shape ``bshape``; the result is ``bshape`` in place of the indexed dims when those are
adjacent, else ``bshape`` first and the dims taken whole after (numpy's rule). Index
values are positions in the whole dim, so an indexed dim of ``x`` is never split. The
valid layouts:
- a dim taken whole split: the result splits where that dim lands; index tensors B;
- a dim of ``bshape`` split: every index tensor that has it at full size splits there (one
  of size 1 takes B), ``x`` B: each device gathers its own rows from the whole ``x``
  (``hidden[token_ids]``, a causal mask's ``positions[batch, query]``);
- ``x`` P (float), indices B -> P: a gather is linear in ``x``.

``index_put(x, indices, values, accumulate)`` writes ``values`` (broadcast to the indexed
result's shape) at those positions: a dim taken whole may be split (``x``, ``values`` and
the result alike, indices B); the indexed dims never. With ``accumulate`` every write
adds, so ``x`` P and ``values`` P give P; without it, duplicate positions keep one write
chosen by the backend, which need not be the same piece on every device: no P.
"""

from __future__ import annotations

from typing import Optional, Sequence

from autoddl.graph import OpNode, TensorRef
from autoddl.ops.registry import B, P, S, Sig1D, bcast_sbp, bound_args, is_float, register


def index_layout(x_shape: Sequence[int], indices: Sequence[Optional[TensorRef]],
                 bshape: Sequence[int]) -> tuple[dict[int, int], int, tuple[int, ...]]:
    """({dim of x taken whole: result dim}, first result dim of ``bshape``, result shape) of ``x[indices]``."""
    indexed = [d for d, i in enumerate(indices) if i is not None]
    whole = [d for d in range(len(x_shape)) if d not in indexed]
    if indexed == list(range(indexed[0], indexed[-1] + 1)):      # adjacent: bshape in their place
        start = indexed[0]
        before, after = [d for d in whole if d < start], [d for d in whole if d > start]
    else:                                                       # apart: bshape first
        start, before, after = 0, [], whole
    order = before + [None] * len(bshape) + after
    dims = {d: o for o, d in enumerate(order) if d is not None}
    shape = tuple(x_shape[d] for d in before) + tuple(bshape) + tuple(x_shape[d] for d in after)
    return dims, start, shape


def _indices(node: OpNode) -> list[Optional[TensorRef]] | None:
    indices = list(bound_args(node)["indices"])
    refs = [i for i in indices if i is not None]
    if not refs or not all(isinstance(i, TensorRef) for i in refs) or len(node.inputs) != 1 + len(refs) + (
            node.op_name != "index"):
        return None
    return indices


def _bshape(node: OpNode, n_index: int) -> tuple[int, ...]:
    shapes = [m.shape for m in node.input_metas[1:1 + n_index]]
    nd = max(len(s) for s in shapes)
    padded = [(1,) * (nd - len(s)) + tuple(s) for s in shapes]
    return tuple(max(col) for col in zip(*padded))


def _layout(node: OpNode, values: int):
    """(number of index tensors, their broadcast shape, ``index_layout``) of an op whose inputs are
    ``x``, the index tensors and ``values`` more (index_put's values); None where not recognised."""
    indices = _indices(node)
    if indices is None:
        return None
    n_index = len(node.inputs) - 1 - values
    bshape = _bshape(node, n_index)
    return n_index, bshape, index_layout(node.input_metas[0].shape, indices, bshape)


@register("index", "_unsafe_index")
def index(node: OpNode) -> list[Sig1D] | None:
    layout = _layout(node, values=0)
    if layout is None:
        return None
    n_index, bshape, (whole, start, _) = layout
    sigs: list[Sig1D] = [((S(d),) + (B,) * n_index, (S(o),)) for d, o in whole.items()]
    for j in range(len(bshape)):
        ins = tuple(bcast_sbp(S(j), bshape, m.shape) for m in node.input_metas[1:])
        if any(s != B for s in ins):
            sigs.append(((B,) + tuple(S(s.dim) if s != B else B for s in ins), (S(start + j),)))
    if is_float(node.outputs[0]):
        sigs.append(((P,) + (B,) * n_index, (P,)))
    return sigs


@register("index_put", "index_put_", "_unsafe_index_put")
def index_put(node: OpNode) -> list[Sig1D] | None:
    layout = _layout(node, values=1)
    if layout is None:
        return None
    n_index, bshape, (whole, _, result) = layout
    values = node.input_metas[-1].shape
    sigs: list[Sig1D] = []
    for d, o in whole.items():
        v = bcast_sbp(S(o), result, values)
        sigs.append(((S(d),) + (B,) * n_index + (v,), (S(d),)))
    if bound_args(node).get("accumulate") and is_float(node.outputs[0]):
        sigs.append(((P,) + (B,) * n_index + (P,), (P,)))
    return sigs
