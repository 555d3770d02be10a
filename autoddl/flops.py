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
- scans (cumsum, cumprod, diff) and histc: 1 per input element; sort / topk / argsort:
  numel(input)·ceil(log2(n)) comparisons, n the size of the sorted dim;
- recurrent layers ``gru.input`` / ``lstm.input`` with G gates (3 / 4), hidden size H,
  per layer, direction, time step and batch row: 2·G·H·(I + H) (the two matmuls, I the
  layer's input size: the input's last dim, then H·directions), + 2·G·H with biases,
  + E·H element-wise (E = 11 for GRU: 2 gate sums, 2 sigmoids, r·h, + i_n, tanh,
  1 - z, two products and a sum; E = 13 for LSTM: 4 gate sums, 3 sigmoids, tanh,
  f·c + i·g, tanh(c), o·tanh(c));
- element-wise ops (torch's ``pointwise`` tag; bitwise, floor_divide, remainder): 1 per output element;
- embedding, views, copies, factories (zeros, arange, ...), cat/stack, index/scatter: 0.

Anything else -- an aten op not listed, or a custom op ``torch.ops.<ns>.<name>`` --
is counted, in order: by a formula registered with ``register_flops("ns::name", fn)``
(``fn(inputs, outputs, args, kwargs) -> int`` over TensorMetas; bundled:
``transformers::grouped_mm_fallback``, 2·S·K·N for S token rows each multiplied by
one expert's K×N matrix); by running the custom op's fake (meta) implementation under
``FlopCounterMode`` on meta tensors of the same shapes, which counts its matmuls and
convolutions when it has them; else as an *estimate* of 1 per output element, which
``flop_source`` reports as ``"estimate"`` and ``autoddl.ops.coverage_report`` lists.

Bytes: every input is read once and every output written once
(``bytes_read = Σ nbytes(inputs)``, ``bytes_written = Σ nbytes(outputs)``);
views move no bytes; embedding reads only the gathered rows and the indices.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from autoddl.graph import TensorMeta, TensorRef

# fn(input metas, output metas, args with TensorRefs, kwargs) -> forward FLOPs
FlopFormula = Callable[[Sequence[TensorMeta], Sequence[TensorMeta], tuple, dict], int]
_REGISTERED: dict[str, FlopFormula] = {}

from autoddl.op_families import (  # noqa: F401  (VIEW_OPS, COPY_OPS, NORMS, ... are read from autoddl.flops too)
    VIEW_OPS, COPY_OPS, CAST_OPS, FACTORY_OPS, REDUCTIONS, NORM_WEIGHT_ARG, NORMS, SDPA_OPS,
    CONV_OPS, CONV_T_OPS, SCAN_OPS, SORT_OPS, SORT_DIM_ARG, UNTAGGED_ELEMENTWISE, INDEX_OPS,
)
_CAST_OPS = CAST_OPS
_FACTORY_OPS = FACTORY_OPS
_NORM_WEIGHT_ARG = NORM_WEIGHT_ARG
_CONV_OPS = CONV_OPS
_CONV_T_OPS = CONV_T_OPS
_SCAN_OPS = SCAN_OPS
_SORT_OPS = SORT_OPS
_SORT_DIM_ARG = SORT_DIM_ARG
_UNTAGGED_ELEMENTWISE = UNTAGGED_ELEMENTWISE
_INDEX_OPS = INDEX_OPS

# recurrent op -> (gates, element-wise FLOPs per hidden unit and step)
_RNN = {"gru": (3, 11), "lstm": (4, 13)}


def op_flops(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta], args: tuple,
             kwargs: dict | None = None) -> int:
    """Forward FLOPs of op ``op`` (aten short name, e.g. ``"addmm"``, or a custom op's
    ``"ns.name.overload"``); formulas in the module docstring.

    ``inputs`` are the metas of the op's tensor arguments in order, ``args`` (and
    ``kwargs``) its fx arguments with tensors replaced by :class:`TensorRef` (``None``
    where an optional tensor such as a bias is absent).
    """
    registered = _REGISTERED.get(_op_key(op))
    if registered is not None:
        return int(registered(inputs, outputs, args, kwargs or {}))
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
    return _other_flops(op, inputs, outputs, args, kwargs or {})


def _other_flops(op: str, inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta], args: tuple,
                 kwargs: dict) -> int:
    """Scans, sorts, recurrent layers, bitwise and index ops, custom ops; else 1 per output element."""
    out_numel = sum(o.numel for o in outputs)
    if op in _INDEX_OPS:
        return 0
    if op in _SCAN_OPS:
        return inputs[0].numel
    if op in _SORT_OPS:
        pos = _SORT_DIM_ARG.get(op, 99)
        dim = args[pos] if len(args) > pos else kwargs.get("dim", 0 if op == "msort" else -1)
        size = inputs[0].shape[dim] if inputs[0].ndim and isinstance(dim, int) else 1
        return inputs[0].numel * max(1, math.ceil(math.log2(max(size, 1))))
    if op in _RNN:
        return _rnn_flops(op, inputs, args)
    if is_custom_op(op):
        key = (op, tuple((m.shape, m.dtype) for m in inputs), repr(args), repr(kwargs))
        if key not in _FAKE_CACHE:
            _FAKE_CACHE[key] = _fake_impl_flops(op, inputs, args, kwargs)
        counted = _FAKE_CACHE[key]
        if counted is not None:
            return counted
    return out_numel  # element-wise default: one FLOP per output element


def _rnn_flops(op: str, inputs: Sequence[TensorMeta], args: tuple) -> int:
    """gru/lstm.input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first): the formula in the module docstring, summed over layers and directions."""
    gates, elementwise = _RNN[op]
    x, h0 = inputs[0], inputs[1]                              # x (T, B, I) or (B, T, I); h0 (L·D, B, H)
    has_biases, layers, bidirectional, batch_first = bool(args[3]), int(args[4]), bool(args[7]), bool(args[8])
    directions = 2 if bidirectional else 1
    hidden = h0.shape[-1]
    steps_rows = x.numel // x.shape[-1]                       # T·B
    total = 0
    for layer in range(layers):
        size_in = x.shape[-1] if layer == 0 else hidden * directions
        per_row = 2 * gates * hidden * (size_in + hidden) + (2 * gates * hidden if has_biases else 0) \
            + elementwise * hidden
        total += directions * steps_rows * per_row
    return total


_KNOWN_OPS = (VIEW_OPS | COPY_OPS | _CAST_OPS | _FACTORY_OPS | _CONV_OPS | _CONV_T_OPS | _SCAN_OPS | _SORT_OPS
              | _UNTAGGED_ELEMENTWISE | _INDEX_OPS | {
                  "embedding", "mm", "addmm", "linear", "bmm", "baddbmm", "matmul", "einsum", "softmax", "_softmax",
                  "log_softmax", "_log_softmax", "_safe_softmax", "cross_entropy_loss", "nll_loss", "nll_loss_nd",
                  "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                  "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
                  "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                  "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d",
                  "dropout"})


def register_flops(op: str, fn: FlopFormula) -> None:
    """Count the forward FLOPs of ``op`` (``"ns::name"``, e.g. ``"mylib::fused_mlp"``) with ``fn``.

    ``fn(inputs, outputs, args, kwargs) -> int`` gets the op's tensor inputs and outputs
    as :class:`TensorMeta` (``.shape``, ``.dtype``, ``.numel``), its fx args with tensors
    replaced by :class:`TensorRef`, and its kwargs. A registered formula wins over the
    bundled ones, so an aten op (``"aten::gelu"``) may be re-priced too. Register before
    tracing: FLOPs are computed when the graph is built.
    """
    if not callable(fn):
        raise TypeError(f"register_flops({op!r}, fn): fn must be callable "
                        "fn(inputs, outputs, args, kwargs) -> int, got {type(fn).__name__}")
    _REGISTERED[_op_key(op)] = fn


def flop_source(op: str) -> str:
    """How ``op``'s FLOPs are counted: ``"registered"``, ``"formula"`` (this module's, or the op's
    fake implementation's matmuls for a custom op), or ``"estimate"`` (1 per output element)."""
    if _op_key(op) in _REGISTERED:
        return "registered"
    if is_custom_op(op):
        return "formula" if _FAKE_COUNTED.get(_op_key(op)) else "estimate"
    if op in _KNOWN_OPS or op in REDUCTIONS or op in NORMS or op in SDPA_OPS or op in _RNN:
        return "formula"
    overload = _aten_overload(op)
    return "formula" if overload is not None and torch.Tag.pointwise in overload.tags else "estimate"


def is_custom_op(op: str) -> bool:
    """A ``<ns>.<name>[.<overload>]`` target of a namespace other than aten (e.g. transformers)."""
    parts = op.split(".")
    return len(parts) >= 2 and parts[0] not in ("aten", "prims") and hasattr(torch.ops, parts[0]) \
        and not parts[0].startswith("_")


def _op_key(op: str) -> str:
    """``"ns::name[.overload]"``, ``"ns.name.overload"`` or an aten short name -> ``"ns.name"``."""
    parts = op.replace("::", ".").split(".")
    return f"aten.{parts[0]}" if len(parts) == 1 else f"{parts[0]}.{parts[1]}"


@lru_cache(maxsize=None)
def _aten_overload(op: str):
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return None
    names = packet.overloads()
    return getattr(packet, names[0]) if names else None


_FAKE_COUNTED: dict[str, bool] = {}   # "ns.name" -> its fake implementation counted some FLOPs
_FAKE_CACHE: dict[tuple, int | None] = {}


def _fake_impl_flops(op: str, inputs: Sequence[TensorMeta], args: tuple, kwargs: dict) -> int | None:
    """FLOPs of custom op ``op`` counted by FlopCounterMode while its fake implementation runs on
    meta tensors of these shapes; None when it has none, fails, or does no counted work."""
    from torch._library.simple_registry import singleton
    from torch.utils.flop_counter import FlopCounterMode

    ns, name = _op_key(op).split(".")
    kernel = singleton.find(f"{ns}::{name}").fake_impl.kernel
    if kernel is None:
        return None
    tensors = iter(torch.empty(m.shape, dtype=getattr(torch, m.dtype, torch.float32), device="meta")
                   for m in inputs)
    real_args = _fill_refs(args, tensors)
    real_kwargs = {k: _fill_refs(v, tensors) for k, v in kwargs.items()}
    try:
        with FlopCounterMode(display=False) as counter:
            kernel.func(*real_args, **real_kwargs)
    except Exception:  # a fake impl may need a FakeTensorMode context or concrete values
        return None
    total = int(counter.get_total_flops())
    _FAKE_COUNTED[f"{ns}.{name}"] = total > 0
    return total if total > 0 else None


def _fill_refs(value: Any, tensors) -> Any:
    if isinstance(value, TensorRef):
        return next(tensors)
    if isinstance(value, (list, tuple)):
        return type(value)(_fill_refs(v, tensors) for v in value)
    return value


def _grouped_mm_flops(inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta], args: tuple,
                      kwargs: dict) -> int:
    """transformers::grouped_mm_fallback(input (S, K), weight (E, K, N), offs (E,)): every one of
    the S token rows is multiplied by exactly one expert's K×N matrix."""
    (s, k), n = inputs[0].shape, inputs[1].shape[-1]
    return 2 * s * k * n


register_flops("transformers::grouped_mm_fallback", _grouped_mm_flops)


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
