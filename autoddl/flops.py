"""Forward FLOPs and bytes moved by one aten op, from its tensor metadata alone.

Conventions (the tests compute the same formulas by hand):
- a multiply-add counts 2 FLOPs; a bias add counts 1 FLOP per output element;
- scaled_dot_product_attention counts its two batched matmuls (Q·Kᵀ and A·V),
  4·B·H·L·S·E, as torch.utils.flop_counter does, plus softmax (5 per score);
  causal masking is not discounted;
- layer_norm / batch_norm / rms-style norms: 5 FLOPs per element, +2 when affine;
- softmax / log_softmax: 5 per element; element-wise ops: 1 per output element;
  reductions: 1 per input element; embedding, views and copies: 0.
- Views (view, reshape, transpose, permute, getitem, ...) move no bytes.
"""

from __future__ import annotations

import math
from typing import Sequence

from autoddl.graph import TensorMeta

VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "slice", "select",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "getitem", "alias",
    "detach", "flatten", "unflatten", "contiguous", "narrow", "as_strided", "view_as", "expand_as",
    "lift_fresh_copy", "clone", "_to_copy", "to", "type_as", "dropout",
})

_ELEMENTWISE_FREE = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "arange", "zeros",
                               "ones", "full", "scalar_tensor", "fill", "fill_", "triu", "tril"})

REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm",
                        "linalg_vector_norm", "prod", "logsumexp", "argmax", "argmin", "var_mean"})

NORMS = frozenset({"layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm",
                   "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                   "_native_batch_norm_legit_functional", "group_norm", "native_group_norm",
                   "rms_norm", "_fused_rms_norm", "instance_norm"})


def op_flops(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta], args: tuple) -> int:
    """Forward FLOPs of aten op ``op`` (short name, e.g. ``"addmm"``)."""
    out_numel = sum(o.numel for o in outputs)
    if op in VIEW_OPS or op in _ELEMENTWISE_FREE or op in ("embedding", "cat", "stack"):
        return 0
    if op == "mm":
        (m, k), (_, n) = inputs[0].shape, inputs[1].shape
        return 2 * m * k * n
    if op == "addmm":  # addmm(bias, a, b)
        (m, k), (_, n) = inputs[1].shape, inputs[2].shape
        return 2 * m * k * n + m * n
    if op == "linear":  # linear(x, w, bias?)
        k = inputs[0].shape[-1]
        rows_out = outputs[0].numel
        return 2 * rows_out * k + (rows_out if len(inputs) > 2 else 0)
    if op in ("bmm", "baddbmm"):
        a, b = (inputs[0], inputs[1]) if op == "bmm" else (inputs[1], inputs[2])
        bsz, m, k = a.shape
        n = b.shape[-1]
        return 2 * bsz * m * k * n + (bsz * m * n if op == "baddbmm" else 0)
    if op == "matmul":
        k = inputs[0].shape[-1]
        return 2 * outputs[0].numel * k
    if op in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        q, k, v = inputs[0], inputs[1], inputs[2]
        *batch, seq_q, e = q.shape
        seq_k, ev = k.shape[-2], v.shape[-1]
        heads = math.prod(batch)
        scores = heads * seq_q * seq_k
        return 2 * scores * e + 2 * scores * ev + 5 * scores
    if op in ("conv2d", "convolution", "conv1d", "conv3d"):
        x, w = inputs[0], inputs[1]
        groups = _conv_groups(op, args)
        cin_per_group = x.shape[1] // groups
        kernel = math.prod(w.shape[2:])
        out = outputs[0].numel
        return 2 * out * cin_per_group * kernel + (out if len(inputs) > 2 else 0)
    if op in NORMS:
        affine = len(inputs) > 1
        x = inputs[0]
        return (5 + (2 if affine else 0)) * x.numel
    if op in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
        return 5 * inputs[0].numel
    if op in REDUCTIONS:
        return inputs[0].numel
    if op in ("max_pool2d", "max_pool2d_with_indices", "avg_pool2d"):
        kernel = args[1] if len(args) > 1 else (1, 1)
        kernel = (kernel, kernel) if isinstance(kernel, int) else kernel
        return outputs[0].numel * math.prod(kernel)
    if op in ("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "mean_pool"):
        return inputs[0].numel
    if op in ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "mse_loss"):
        return 5 * inputs[0].numel
    return out_numel  # element-wise default: one FLOP per output element


def op_bytes(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> tuple[int, int]:
    """(bytes read, bytes written) by the op; views move nothing."""
    if op in VIEW_OPS:
        return 0, 0
    if op == "embedding":  # reads only the gathered rows and the indices
        weight, idx = inputs[0], inputs[1]
        return outputs[0].nbytes + idx.nbytes, outputs[0].nbytes
    return sum(i.nbytes for i in inputs), sum(o.nbytes for o in outputs)


def _conv_groups(op: str, args: tuple) -> int:
    # conv2d(input, weight, bias, stride, padding, dilation, groups)
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    idx = 8 if op == "convolution" else 6
    return int(args[idx]) if len(args) > idx else 1
