"""Pooling over the trailing spatial dims: split the leading (batch, channel) dims only.

Average pooling is linear, so it also maps P -> P; max pooling is not.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import P, S, Sig1D, is_float, register

_SPATIAL = {"1d": 1, "2d": 2, "3d": 3}
MAX = ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
       "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d")
AVG = ("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
       "adaptive_avg_pool3d", "_adaptive_avg_pool2d")


def spatial_dims(op_name: str) -> int:
    for suffix, n in _SPATIAL.items():
        if suffix in op_name:
            return n
    raise ValueError(f"autoddl.ops.pool: cannot tell the spatial rank of {op_name!r}")


@register(*MAX, *AVG)
def pool(node: OpNode) -> list[Sig1D]:
    lead = node.input_metas[0].ndim - spatial_dims(node.op_name)
    n_out = len(node.outputs)
    sigs = [((S(d),), (S(d),) * n_out) for d in range(lead)]
    if node.op_name in AVG and is_float(node.outputs[0]):
        sigs.append(((P,), (P,)))
    return sigs
