"""Element-wise ops (unary, binary with broadcasting, where, copies, dtype casts, dropout).

Also the Python bitwise operators on masks (``&``, ``|``, ``^``, ``~``: ``__and__`` ...) and
``empty_like``, whose uninitialised output takes its input's shape and so its split.

A split output dim d takes S on every operand that has d at full size (aligned from
the right, numpy broadcasting) and B on an operand that lacks it or has it as size 1.
P passes only where the op is linear in that operand: add/sub of P and P; mul of P by
B; div of P by B; scalar multiply/divide; neg; copies and float->float casts;
where(B cond, P, P). Integer and bool results never get P.

Random ops (dropout) follow the split rules; a B output of dropout needs the same
random stream on every device of that axis (the executor seeds it so).
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, bcast_sbp, bound_args, is_float, norm_dim, register

UNARY = (
    "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
    "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "elu", "elu_", "leaky_relu", "leaky_relu_",
    "hardtanh", "hardtanh_", "hardswish", "hardswish_", "hardsigmoid", "softplus", "mish", "erf",
    "reciprocal", "square", "floor", "ceil", "round", "sign", "logical_not", "bitwise_not",
    "clamp", "clamp_", "clamp_min", "clamp_max", "pow", "pow_", "threshold", "nan_to_num",
    "isnan", "isinf", "dropout", "fill", "fill_", "zeros_like", "ones_like", "full_like",
    "sigmoid_", "tanh_", "exp_", "sqrt_", "rsqrt_", "empty_like", "__invert__",
)
LINEAR_UNARY = ("neg", "neg_", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy", "to")
BINARY = (
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "maximum", "minimum", "eq", "ne",
    "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_xor", "where", "masked_fill", "masked_fill_", "lerp", "addcmul", "addcdiv", "copy_",
    "rsub", "floor_divide", "remainder", "fmod", "atan2", "type_as", "copy", "__and__", "__or__", "__xor__",
)


def split_sigs(node: OpNode, skip_dims: tuple[int, ...] = ()) -> list[Sig1D]:
    """S(d) of the output on every output dim (except ``skip_dims``), operands mapped by broadcasting."""
    out_shape = node.outputs[0].shape
    sigs = []
    for d in range(len(out_shape)):
        if d in skip_dims:
            continue
        ins = tuple(bcast_sbp(S(d), out_shape, m.shape) for m in node.input_metas)
        sigs.append((ins, (S(d),) * len(node.outputs)))
    return sigs


def _partial_sigs(node: OpNode) -> list[Sig1D]:
    name, n = node.op_name, len(node.inputs)
    if not node.outputs or not is_float(node.outputs[0]) or not all(is_float(m) for m in node.input_metas):
        return []
    if name in LINEAR_UNARY and n == 1:
        return [((P,), (P,))]
    bound = bound_args(node) if name in ("div", "div_") else {}
    if bound.get("rounding_mode") is not None:
        return []
    if name in ("add", "add_", "sub", "sub_") and n == 2:
        return [((P, P), (P,))]
    if name in ("mul", "mul_"):
        return [((P,), (P,))] if n == 1 else [((P, B), (P,)), ((B, P), (P,))]
    if name in ("div", "div_"):
        return [((P,), (P,))] if n == 1 else [((P, B), (P,))]
    return []


@register(*UNARY, *LINEAR_UNARY, *BINARY)
def elementwise(node: OpNode) -> list[Sig1D]:
    sigs = split_sigs(node)
    sigs += _partial_sigs(node)
    if node.op_name == "where" and len(node.inputs) == 3 and is_float(node.outputs[0]):
        sigs.append(((B, P, P), (P,)))
    return sigs


@register("tril", "triu", "tril_", "triu_")
def triangular(node: OpNode) -> list[Sig1D]:
    """tril/triu mask the last two dims by position: only leading (batch) dims may be split."""
    nd = node.outputs[0].ndim
    sigs = split_sigs(node, skip_dims=tuple(range(nd - 2, nd)))
    if is_float(node.outputs[0]):
        sigs.append(((P,), (P,)))
    return sigs


@register("broadcast_tensors")
def broadcast_tensors(node: OpNode) -> list[Sig1D]:
    """Every output has the broadcast shape; operands map by broadcasting; all-P -> all-P."""
    out_shape = node.outputs[0].shape
    sigs = []
    for d in range(len(out_shape)):
        ins = tuple(bcast_sbp(S(d), out_shape, m.shape) for m in node.input_metas)
        sigs.append((ins, (S(d),) * len(node.outputs)))
    if all(is_float(m) for m in node.input_metas):
        sigs.append(((P,) * len(node.inputs), (P,) * len(node.outputs)))
    return sigs


@register("_softmax", "softmax", "_log_softmax", "log_softmax")
def softmax(node: OpNode) -> list[Sig1D]:
    """Split on any dim but the softmax dim; no P (non-linear)."""
    dim = norm_dim(bound_args(node)["dim"], node.input_metas[0].ndim)
    return split_sigs(node, skip_dims=(dim,))
