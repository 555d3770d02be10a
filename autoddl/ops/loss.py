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
The class dim is never split by an ordinary signature (log-softmax normalises over it).

Vocabulary-parallel cross-entropy (Megatron-LM's ``vocab_parallel_cross_entropy``): logits split
on the class dim (1), class-index targets B, no class weight, no label smoothing -> the whole
loss, B. Each device takes the max of its logit rows, all-reduced (max); subtracts it,
sums the exponentials and picks the target's logit where the target is in its class range
(else 0), both all-reduced (sum); the loss per row is log(sum) - target logit. The gradient
is local (softmax of the local columns minus the one-hot of the local target), so backward
communicates nothing. Its kernel communicates, so it is an inner signature (registry.py):
2 all-reduces per class-split axis, of rows and of 2 x rows floats (float32 for half-precision
logits). Other axes may split the batch alike (the "mean" over them as above).
"""

from __future__ import annotations

import torch

from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import OpNode
from autoddl.ops.registry import (B, P, S, InnerCollective, Sig1D, bcast_sbp, bound_args, is_float, piece_offset,
                                  register, split_factor, tensor_slot)
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


# -- vocabulary-parallel cross-entropy -------------------------------------------------------------

def vocab_parallel_sigs(node: OpNode) -> list[Sig1D]:
    """cross_entropy_loss with the class dim split (module docstring): class-index targets only,
    no class weight, no label smoothing."""
    if node.op_name != "cross_entropy_loss":
        return []
    x, t = node.input_metas[0], node.input_metas[1]
    bound = bound_args(node)
    if x.ndim < 2 or t.ndim == x.ndim or not is_float(x) or tensor_slot(node, "weight") is not None \
            or float(bound.get("label_smoothing", 0.0)) != 0.0:
        return []
    return [((S(1), B) + (B,) * (len(node.inputs) - 2), (B,))]


def _class_axes(sig: Signature) -> list[int]:
    return [axis for axis, s in enumerate(sig.inputs[0]) if s.is_split(1)]


def _stats_dtype(logits_dtype: str) -> torch.dtype:
    """float64 logits keep float64; float32 and half-precision logits reduce in float32."""
    return torch.float64 if logits_dtype == "float64" else torch.float32


def vocab_parallel_collectives(node: OpNode, sig: Signature, mesh_shape) -> list[InnerCollective]:
    """Per class-split axis, in call order: the rows' max, then their sum-exp and target logit."""
    axes = _class_axes(sig)
    if not axes:
        return []
    rows = 1
    for d in sig.inputs[1].local_shape(node.input_metas[1].shape, mesh_shape):
        rows *= d
    size = torch.empty((), dtype=_stats_dtype(node.input_metas[0].dtype)).element_size()
    return ([InnerCollective(CollectiveKind.ALL_REDUCE, a, rows * size, "max", "row max") for a in axes]
            + [InnerCollective(CollectiveKind.ALL_REDUCE, a, 2 * rows * size, "sum", "sum-exp, target logit")
               for a in axes])


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split on the class dim (1); ``all_reduce(t, axis, op)`` combines the
    devices of each axis in ``axes``. Returns the loss as F.cross_entropy would for the whole
    logits (``divisor`` > 1: a "mean" over a batch split that many ways, as mean_loss_kernel)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, axes, all_reduce, reduction, ignore_index, divisor):
        x = logits.detach().to(_stats_dtype(str(logits.dtype).removeprefix("torch.")))
        row_max = x.amax(dim=1)                                        # (N, ...)
        for a in axes:
            row_max = all_reduce(row_max, a, "max")
        shifted = x - row_max.unsqueeze(1)
        local = target - vocab_start
        inside = (local >= 0) & (local < x.shape[1])
        index = torch.where(inside, local, torch.zeros_like(local))
        picked = shifted.gather(1, index.unsqueeze(1)).squeeze(1) * inside
        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=1), picked])                  # (2, N, ...)
        for a in axes:
            stats = all_reduce(stats, a, "sum")
        sum_exp, target_logit = stats[0], stats[1]
        valid = target != ignore_index
        per_row = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp))
        if reduction == NONE:
            out, weight = per_row, valid.to(x.dtype)
        elif reduction == SUM:
            out, weight = per_row.sum(), valid.to(x.dtype)
        else:
            count = valid.sum().to(x.dtype)
            out, weight = per_row.sum() / count / divisor, valid.to(x.dtype) / count / divisor
        ctx.save_for_backward(exp / sum_exp.unsqueeze(1), index, inside, weight)
        ctx.dtype = logits.dtype
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        softmax, index, inside, weight = ctx.saved_tensors
        grad = softmax.scatter_add(1, index.unsqueeze(1), -inside.unsqueeze(1).to(softmax.dtype))
        scale = weight * grad_out.to(softmax.dtype)          # per row (reduction "none") or one number
        return (grad * scale.unsqueeze(1)).to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, axes, all_reduce,
                                 reduction: int = MEAN, ignore_index: int = -100, divisor: int = 1) -> torch.Tensor:
    """The loss of logits (N, V_local, ...) holding classes vocab_start .. vocab_start + V_local
    against class ids (N, ...), their other classes on the devices of ``axes``."""
    return VocabParallelCrossEntropy.apply(logits, target, vocab_start, tuple(axes), all_reduce, reduction,
                                           ignore_index, divisor)


def class_loss_kernel(node: OpNode, sig: Signature, mesh_shape, coord, all_reduce=None, all_to_all=None):
    """The vocabulary-parallel kernel when the class dim is split, else mean_loss_kernel's."""
    axes = _class_axes(sig)
    if not axes:
        return mean_loss_kernel(node, sig, mesh_shape, coord)
    bound = bound_args(node)
    reduction = int(bound.get("reduction", MEAN))
    ignore_index = int(bound.get("ignore_index", -100))
    vocab_start = piece_offset(node.input_metas[0].shape, sig.inputs[0], mesh_shape, coord, 1)
    divisor = split_factor(sig.inputs[0], mesh_shape, set(range(node.input_metas[0].ndim)) - {1}) \
        if reduction == MEAN else 1

    def vocab_parallel(logits, target, *args, **kwargs):
        return vocab_parallel_cross_entropy(logits, target, vocab_start, axes, all_reduce, reduction,
                                            ignore_index, divisor)

    return vocab_parallel


register(*CLASS_LOSSES, local_kernel=class_loss_kernel, inner_sigs=vocab_parallel_sigs,
         inner=vocab_parallel_collectives)(class_loss)
register(*ELEMENT_LOSSES, local_kernel=mean_loss_kernel)(element_loss)
