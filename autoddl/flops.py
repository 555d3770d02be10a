"""Forward FLOPs and bytes moved by one aten op, from its tensor metadata alone.

The traced graph (torch.export, training IR) keeps high-level ops: ``linear``,
``conv2d``, ``layer_norm``, ``scaled_dot_product_attention``,
``cross_entropy_loss``... The formulas below are the documented convention;
tests/test_flops.py computes the same numbers by hand.

Matmul-like (a multiply-add counts 2 FLOPs, a bias add 1 per output element):
- ``mm(a (M,K), b (K,N))``: 2·M·K·N; ``addmm(bias, a, b)``: 2·M·K·N + M·N;
- ``bmm (Bt,M,K)x(Bt,K,N)``: 2·Bt·M·K·N; ``baddbmm``: + Bt·M·N;
- ``linear(x (..., K), w (N, K), bias?)``: 2·numel(out)·K (+ numel(out) with bias);
- ``matmul``: 2·numel(out)·K, K = last dim of the first operand;
- ``einsum``: 2·(product of the sizes of all distinct indices) per contraction of
  two operands (a single operand: numel of the input);
- ``convNd(x, w (Cout, Cin/g, *k), bias?)``: 2·numel(out)·(Cin/g)·prod(k)
  (+ numel(out) with bias); ``conv_transposeNd(x, w (Cin, Cout/g, *k))``:
  2·numel(x)·(Cout/g)·prod(k) (+ numel(out) with bias);
- ``scaled_dot_product_attention(q (..., Hq, L, E), k (..., S, E), v (..., S, Ev))``:
  scores = numel(q)/E·S; 2·scores·E (Q·Kᵀ) + 2·scores·Ev (A·V) + 5·scores
  (softmax) + scores when an ``attn_mask`` is given. GQA (fewer K/V heads) costs
  the same as full attention over Hq heads; causal masking is not discounted.

Everything else:
- norms (layer_norm, batch_norm, group_norm, rms_norm, ...): 5 per input
  element, +2 per element when a weight is given (affine);
- softmax / log_softmax: 5 per input element;
- cross_entropy_loss: 5 per logit (log-softmax) + 1 per target (gather, mean);
  nll_loss: 1 per target; mse_loss / l1_loss: 3 per input element;
- reductions (sum, mean, amax, var, ...): 1 per input element;
- max_pool / avg_pool: prod(kernel) per output element;
  adaptive_avg_pool: 1 per input element;
- dropout: 1 per element in training, 0 (and no bytes) in eval or with p=0;
- element-wise ops and anything not listed: 1 per output element;
- embedding, views, copies, factories (zeros, arange, ...), cat/stack: 0.

Bytes: every input is read once and every output written once
(``bytes_read = Σ nbytes(inputs)``, ``bytes_written = Σ nbytes(outputs)``);
views move no bytes; embedding reads only the gathered rows and the indices.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from autoddl.graph import TensorMeta, TensorRef

# Ops that return a view or alias of their input: no FLOPs, no bytes.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "slice", "select",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "getitem", "alias",
    "detach", "flatten", "unflatten", "narrow", "as_strided", "view_as", "expand_as", "movedim",
    "tensor_split", "_assert_tensor_metadata", "_assert_scalar", "_assert_async",
})

# Ops that copy memory without arithmetic: no FLOPs, bytes moved.
COPY_OPS = frozenset({"clone", "_to_copy", "contiguous", "copy", "copy_", "lift_fresh_copy",
                      "cat", "stack", "index_select", "gather", "index", "repeat", "roll", "flip",
                      "pad", "constant_pad_nd"})

# dtype conversions: a copy when the dtype changes, an alias otherwise.
_CAST_OPS = frozenset({"to", "type_as", "type"})

_FACTORY_OPS = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "arange", "zeros",
                          "ones", "full", "empty", "scalar_tensor", "fill", "fill_", "triu", "tril",
                          "new_zeros", "new_ones", "new_full", "new_empty", "rand", "randn", "rand_like",
                          "randn_like", "randint"})

REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm",
                        "linalg_vector_norm", "prod", "logsumexp", "argmax", "argmin", "var_mean",
                        "std_mean", "any", "all"})

# norm op -> position of its weight argument (a TensorRef when affine, None otherwise)
_NORM_WEIGHT_ARG = {
    "layer_norm": 2, "native_layer_norm": 2, "group_norm": 2, "rms_norm": 2, "_fused_rms_norm": 2,
    "batch_norm": 1, "native_batch_norm": 1, "_native_batch_norm_legit": 1,
    "_native_batch_norm_legit_no_training": 1, "_native_batch_norm_legit_functional": 1,
    "native_group_norm": 1, "instance_norm": 1,
}
NORMS = frozenset(_NORM_WEIGHT_ARG)

SDPA_OPS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_cudnn_attention"})

_CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution"})
_CONV_T_OPS = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})


def op_flops(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta], args: tuple) -> int:
    """Forward FLOPs of aten op ``op`` (short name, e.g. ``"addmm"``); formulas in the module docstring.

    ``inputs`` are the metas of the op's tensor arguments in order, ``args`` its fx
    args with tensors replaced by :class:`TensorRef` (``None`` where an optional
    tensor such as a bias is absent).
    """
    out_numel = sum(o.numel for o in outputs)
    if op in VIEW_OPS or op in COPY_OPS or op in _CAST_OPS or op in _FACTORY_OPS or op == "embedding":
        return 0
    if op == "mm":
        (m, k), (_, n) = inputs[0].shape, inputs[1].shape
        return 2 * m * k * n
    if op == "addmm":  # addmm(bias, a, b)
        (m, k), (_, n) = inputs[1].shape, inputs[2].shape
        return 2 * m * k * n + m * n
    if op == "linear":  # linear(x, w, bias?)
        k = inputs[0].shape[-1]
        return 2 * out_numel * k + (out_numel if len(inputs) > 2 else 0)
    if op in ("bmm", "baddbmm"):
        a, b = (inputs[0], inputs[1]) if op == "bmm" else (inputs[1], inputs[2])
        bsz, m, k = a.shape
        n = b.shape[-1]
        return 2 * bsz * m * k * n + (bsz * m * n if op == "baddbmm" else 0)
    if op == "matmul":
        return 2 * out_numel * inputs[0].shape[-1]
    if op == "einsum":
        return _einsum_flops(args, inputs)
    if op in SDPA_OPS:
        q, k, v = inputs[0], inputs[1], inputs[2]
        e, seq_k, ev = q.shape[-1], k.shape[-2], v.shape[-1]
        scores = q.numel // e * seq_k                        # (..., Hq, L, S)
        has_mask = op == "scaled_dot_product_attention" and len(inputs) > 3
        return 2 * scores * e + 2 * scores * ev + 5 * scores + (scores if has_mask else 0)
    if op in _CONV_OPS:
        w = inputs[1]                                        # (Cout, Cin/groups, *kernel)
        if _is_transposed_convolution(op, args):
            return _conv_transpose_flops(inputs, outputs)
        return 2 * out_numel * w.shape[1] * math.prod(w.shape[2:]) + (out_numel if len(inputs) > 2 else 0)
    if op in _CONV_T_OPS:
        return _conv_transpose_flops(inputs, outputs)
    if op in NORMS:
        idx = _NORM_WEIGHT_ARG[op]
        affine = len(args) > idx and isinstance(args[idx], TensorRef)
        return (5 + (2 if affine else 0)) * inputs[0].numel
    if op in ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"):
        return 5 * inputs[0].numel
    if op == "cross_entropy_loss":  # (logits, target)
        return 5 * inputs[0].numel + inputs[1].numel
    if op in ("nll_loss", "nll_loss_nd", "nll_loss_forward", "nll_loss2d_forward"):
        return inputs[1].numel
    if op in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"):
        return 3 * inputs[0].numel
    if op in REDUCTIONS:
        return inputs[0].numel
    if op in ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
              "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d"):
        kernel = args[1] if len(args) > 1 else 1
        return outputs[0].numel * (kernel if isinstance(kernel, int) else math.prod(kernel))
    if op in ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
              "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d"):
        return inputs[0].numel
    if op == "dropout":  # dropout(x, p, train)
        return out_numel if _dropout_active(args) else 0
    return out_numel  # element-wise default: one FLOP per output element


def op_bytes(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta],
             args: tuple = ()) -> tuple[int, int]:
    """(bytes read, bytes written) by the op; views move nothing."""
    if op in VIEW_OPS:
        return 0, 0
    if op in _CAST_OPS and inputs and outputs and inputs[0].dtype == outputs[0].dtype:
        return 0, 0
    if op == "dropout" and not _dropout_active(args):
        return 0, 0
    if op == "embedding":  # reads only the gathered rows and the indices
        idx = inputs[1]
        return outputs[0].nbytes + idx.nbytes, outputs[0].nbytes
    return sum(i.nbytes for i in inputs), sum(o.nbytes for o in outputs)


def _dropout_active(args: tuple) -> bool:
    p = args[1] if len(args) > 1 else 0.5
    train = args[2] if len(args) > 2 else True
    return bool(train) and not (isinstance(p, (int, float)) and p == 0)


def _is_transposed_convolution(op: str, args: tuple) -> bool:
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return op in ("convolution", "_convolution") and len(args) > 6 and bool(args[6])


def _conv_transpose_flops(inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> int:
    x, w = inputs[0], inputs[1]                              # w: (Cin, Cout/groups, *kernel)
    out = outputs[0].numel
    return 2 * x.numel * w.shape[1] * math.prod(w.shape[2:]) + (out if len(inputs) > 2 else 0)


def _einsum_flops(args: tuple, inputs: Sequence[TensorMeta]) -> int:
    equation = str(args[0]).replace(" ", "") if args else ""
    lhs = equation.split("->")[0].split(",")
    if "..." in equation or len(lhs) != len(inputs) or not inputs:
        return 2 * math.prod(inputs[0].shape) if inputs else 0  # rare forms: a rough lower bound
    sizes: dict[str, int] = {}
    for letters, meta in zip(lhs, inputs):
        for letter, size in zip(re.sub(r"[^A-Za-z]", "", letters), meta.shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
    if len(inputs) == 1:
        return inputs[0].numel
    return 2 * (len(inputs) - 1) * math.prod(sizes.values())


def short_name(target: Any) -> str:
    """``aten.mm.default`` -> ``mm``; other targets are returned whole."""
    text = str(target)
    parts = text.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else text
