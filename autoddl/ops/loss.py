"""Losses: cross_entropy_loss, nll_loss(_nd, 2d), mse/l1/smooth_l1/huber, binary cross entropy.

Batch-like dims (every dim but the class dim) may be split on input and target alike:
- reduction "none" (0): the output splits the same way;
- "sum" (2): P;
- "mean" (1): P through a kernel that divides the local mean by n, the number of devices
  splitting the batch. This is exact whenever every shard averages over the same count:
  always for mse/l1/bce (shards are equal), and for cross_entropy/nll when no target
  equals ignore_index -- otherwise it is what DDP computes (mean of per-device means).
  With a class ``weight`` the mean divides by the summed target weights, which differ per
  shard, so the mean split is not offered then.
nll_loss is linear in its log-prob input: P -> P for every reduction (weight, target B).
The class dim is never split (log-softmax normalises over it).
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, bcast_sbp, bound_args, is_float, register, split_factor, tensor_slot
from autoddl.sbp import Signature

NONE, MEAN, SUM = 0, 1, 2
CLASS_LOSSES = ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d")
ELEMENT_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "soft_margin_loss")


def _reduced_sbp(node: OpNode, out_dim: int):
    red = int(bound_args(node).get("reduction", MEAN))
    if red == NONE:
        return S(out_dim)
    if red == MEAN and tensor_slot(node, "weight") is not None and node.op_name in CLASS_LOSSES:
        return None
    return P


def class_loss(node: OpNode) -> list[Sig1D]:
    x, t = node.input_metas[0], node.input_metas[1]
    rest = (B,) * (len(node.inputs) - 2)
    if x.ndim < 2:
        sigs = []
    else:
        prob_target = t.ndim == x.ndim
        sigs = []
        for L in range(x.ndim):
            if L == 1:
                continue
            o = L if L == 0 else L - 1
            out = _reduced_sbp(node, o)
            if out is not None:
                sigs.append(((S(L), S(L if prob_target else o)) + rest, (out,)))
    if node.op_name != "cross_entropy_loss" and is_float(node.outputs[0]):
        sigs.append(((P, B) + rest, (P,)))
    return sigs


def element_loss(node: OpNode) -> list[Sig1D]:
    shape = node.input_metas[0].shape
    sigs = []
    for d in range(len(shape)):
        out = _reduced_sbp(node, d)
        ins = tuple(bcast_sbp(S(d), shape, m.shape) for m in node.input_metas)
        sigs.append((ins, (out,)))
    return sigs


def mean_loss_kernel(node: OpNode, sig: Signature, mesh_shape, coord):
    """Local mean / n for reduction='mean' with a split batch (see the module docstring)."""
    if int(bound_args(node).get("reduction", MEAN)) != MEAN:
        return None
    n = split_factor(sig.inputs[0], mesh_shape)
    if n == 1:
        return None
    from autoddl.ops import aten_op

    op = aten_op(node)

    def mean_of_shard(*args, **kwargs):
        return op(*args, **kwargs) / n

    return mean_of_shard


register(*CLASS_LOSSES, local_kernel=mean_loss_kernel)(class_loss)
register(*ELEMENT_LOSSES, local_kernel=mean_loss_kernel)(element_loss)
