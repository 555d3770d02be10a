"""Convolutions: conv1d/2d/3d and convolution (x (N, C_in, ...), w (C_out, C_in/g, k...), bias (C_out,)?).

- batch: x S(0), w B, bias B -> S(0) (any groups);
- output channels (groups == 1): x B, w S(0), bias S(0) -> S(1);
- input channels (groups == 1): x S(1), w S(1) -> P; the bias is then P too (added once
  in the sum, as for a row-parallel linear);
- x P or w P, the other B, bias P -> P (convolution is bilinear).
Spatial splits need halos and are not offered; grouped and transposed convolutions get
the batch split only.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, bound_args, register, tensor_slot


@register("conv1d", "conv2d", "conv3d", "convolution")
def conv(node: OpNode) -> list[Sig1D]:
    bound = bound_args(node)
    bias = tensor_slot(node, "bias")
    groups = int(bound.get("groups", 1))
    transposed = bool(bound.get("transposed", False))
    batched = node.input_metas[0].ndim == node.input_metas[1].ndim  # (N, C, ...) vs unbatched (C, ...)

    def sig(x, w, b, out):
        ins = [x, w] + ([b] if bias is not None else [])
        return tuple(ins), (out,)

    c = 1 if batched else 0
    sigs = [sig(S(0), B, B, S(0))] if batched else []
    if groups == 1 and not transposed:
        sigs += [sig(B, S(0), S(0), S(c)), sig(S(c), S(1), P, P), sig(P, B, P, P), sig(B, P, P, P)]
    return sigs
