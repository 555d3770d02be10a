"""A traced graph at another batch size, from the same model's graphs at two batch sizes.

Tracing a 70B-parameter model takes tens of seconds on the meta device, and the 3-D search needs
it at several batches (each micro-batch size, then micro-batch size x the data-parallel degree).
When only the batch changes, the exported graph keeps its ops, names and edges, and every number
in it — each tensor's shape, the ints in its args (view sizes), its FLOPs and bytes — is an affine
function of the batch (a dim is the batch times a constant, or a constant; FLOPs and bytes are sums
of such products, each with the batch at most once). Two traces at batches b1 != b2 fix each line,
so the graph at batch b is read off them. The caller vouches that only the batch differs (same
model file, arguments and precision): a change of sequence length, say, is not affine (attention's
FLOPs grow with its square) and is not detected.

:func:`at_batch` checks what it relies on and returns None otherwise (the caller traces): the two
graphs have the same nodes (name, kind, target, inputs, parameters, module) in the same order,
their non-numeric leaves are equal, and every int that changes with the batch extrapolates to a whole, non-negative number.
tests/test_rebatch.py compares the result with a trace at that batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef

_SAME = ("name", "kind", "target", "inputs", "params", "module_path", "module_type")
_NUMERIC = ("input_metas", "outputs", "args", "kwargs", "flops", "bytes_read", "bytes_written")


class _NotAffine(Exception):
    pass


def at_batch(g1: OpGraph, b1: int, g2: OpGraph, b2: int, batch: int) -> OpGraph | None:
    """The graph at ``batch`` from ``g1`` (traced at ``b1``) and ``g2`` (at ``b2``), or None when the
    two do not differ by the batch alone (module docstring)."""
    if b1 == b2 or len(g1) != len(g2) or batch < 1:
        return None
    for g, b in ((g1, b1), (g2, b2)):                  # the caller's batches are the inputs' dim 0
        if any(not n.outputs or not n.outputs[0].shape or n.outputs[0].shape[0] != b
               for n in g.nodes_of(NodeKind.INPUT)):
            return None

    def line(v1: int, v2: int) -> int:
        if v1 == v2:                                   # a constant (a view's -1 included)
            return v1
        step, rest = divmod((v2 - v1) * (batch - b1), b2 - b1)
        if rest or v1 + step < 0:
            raise _NotAffine
        return v1 + step

    def affine(v1: Any, v2: Any) -> Any:
        if isinstance(v1, bool) or isinstance(v2, bool):
            if v1 != v2:
                raise _NotAffine
            return v1
        if isinstance(v1, int) and isinstance(v2, int):
            return line(v1, v2)
        if isinstance(v1, TensorMeta) and isinstance(v2, TensorMeta):
            if v1.dtype != v2.dtype or len(v1.shape) != len(v2.shape):
                raise _NotAffine
            return TensorMeta(tuple(line(x, y) for x, y in zip(v1.shape, v2.shape)), v1.dtype)
        if isinstance(v1, (list, tuple)) and type(v1) is type(v2) and len(v1) == len(v2) \
                and not isinstance(v1, TensorRef):
            return type(v1)(affine(x, y) for x, y in zip(v1, v2))
        if isinstance(v1, dict) and isinstance(v2, dict) and v1.keys() == v2.keys():
            return {k: affine(v1[k], v2[k]) for k in v1}
        if type(v1) is not type(v2) or v1 != v2:
            raise _NotAffine
        return v1

    nodes: list[OpNode] = []
    for n1, n2 in zip(g1.topo(), g2.topo()):
        if any(getattr(n1, f) != getattr(n2, f) for f in _SAME):
            return None
        try:
            nodes.append(dataclasses.replace(n1, **{f: affine(getattr(n1, f), getattr(n2, f)) for f in _NUMERIC}))
        except _NotAffine:
            return None
    return OpGraph(nodes, model_name=g1.model_name)
