"""Normalisations: layer_norm / native_layer_norm / rms_norm, group_norm, batch_norm.

layer_norm and rms_norm: split any leading (non-normalised) dim; weight and bias B.
group_norm: split the batch dim only. No P (normalising is not linear).

batch_norm in training mode normalises with statistics over the batch and spatial
dims, so a batch split is NOT valid (each device would use its own local statistics,
what unsynchronised DDP does); it needs SyncBatchNorm. Valid in training mode: the
channel split, x S(1) with weight, bias, running_mean, running_var all S(0) -> S(1)
(each device owns whole channels and updates its own running stats). In eval mode
(running statistics) every dim of x but none of the stats may be split, plus the
channel split.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import B, S, Sig1D, bound_args, register


@register("layer_norm", "native_layer_norm", "rms_norm")
def layer_norm(node: OpNode) -> list[Sig1D]:
    nd = node.input_metas[0].ndim
    lead = nd - len(bound_args(node)["normalized_shape"])
    rest = (B,) * (len(node.inputs) - 1)
    return [((S(d),) + rest, (S(d),) * len(node.outputs)) for d in range(lead)]


@register("group_norm")
def group_norm(node: OpNode) -> list[Sig1D]:
    rest = (B,) * (len(node.inputs) - 1)
    return [((S(0),) + rest, (S(0),) * len(node.outputs))]


@register("batch_norm")
def batch_norm(node: OpNode) -> list[Sig1D]:
    nd = node.input_metas[0].ndim
    n_rest = len(node.inputs) - 1
    channel = 1 if nd >= 2 else 0
    sigs = [((S(channel),) + (S(0),) * n_rest, (S(channel),))]
    if not bound_args(node)["training"]:
        sigs += [((S(d),) + (B,) * n_rest, (S(d),)) for d in range(nd) if d != channel]
    return sigs
