"""Unfused attention (``Training.attention = "unfused"``): the passes an attention op makes when it
runs as separate kernels rather than one fused kernel, counted once here for the cost model's time
(costmodel/compute.py ``unfused_attention_time_s``) and memory (autoddl/activations.py).

Megatron-LM as of Narayanan et al. (SC'21) ran attention this way (megatron/model/transformer.py
``ParallelAttention``: ``torch.baddbmm`` for Q·Kᵀ, ``FusedScaleMaskSoftmax`` — one CUDA kernel for
scale, mask and softmax, megatron/fused_kernels/scaled_upper_triang_masked_softmax.h — then
``attention_dropout`` (torch dropout) and ``torch.bmm`` for probs·V), materialising the
(batch, heads, L, S) scores in the working dtype. The planner's executor still runs torch's SDPA: the
setting prices a step as such a run would take, it does not change what runs.

Per op, with ``N`` = batch x heads x L x S score elements, ``w`` their itemsize (the op's compute
dtype, 2 for fp16 / bf16) and the mask of a dropout 1 byte (torch's bool mask):

forward
- Q·Kᵀ: a batched matmul, 2·N·E FLOPs, reading Q and K and writing the scores (N·w);
- scale + mask + softmax, one fused pass: reads the scores, writes the probabilities: 2·N·w bytes;
- dropout (only when the op's ``dropout_p`` > 0): reads the probabilities, writes the dropped ones
  and the mask: 2·N·w + N bytes;
- probs·V: 2·N·Ev FLOPs, reading the (dropped) probabilities and V, writing the output.

backward (autograd of the same kernels)
- the two matmuls' gradients, four batched matmuls of the forward's sizes: dV = Pᵀ·dO and
  dP = dO·Vᵀ (2·N·Ev FLOPs each), dQ = dS·K and dK = dSᵀ·Q (2·N·E each): twice the forward FLOPs,
  each reading its two operands and writing its result;
- dropout backward (when ``dropout_p`` > 0): reads dP and the mask, writes the gradient: 2·N·w + N;
- softmax backward (scale fused): reads the gradient and the saved probabilities, writes dS: 3·N·w.

kept for backward beyond the op's inputs (what autograd saves): the probabilities (N·w; the softmax
backward and, without dropout, dV read them), and with dropout the dropped probabilities (N·w, dV's
operand) and the mask (N).

Local counts divide the full op's by the work divisor ``d`` (the mesh sizes of the axes that split
the op: a batch or head split divides Q, K, V and the scores alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoddl.graph import OpNode
from autoddl.op_families import SDPA_OPS

DROPOUT_MASK_ITEMSIZE = 1          # torch.nn.functional.dropout's saved mask is a bool tensor
_SDPA_DROPOUT_ARG = 4              # scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, ...)


@dataclass(frozen=True)
class Pass:
    """One kernel of unfused attention: its FLOPs (0 for an elementwise pass) and bytes moved."""

    what: str
    flops: float
    nbytes: float


def dropout_p(node: OpNode) -> float:
    """The attention op's dropout probability (its ``dropout_p`` argument, keyword or positional)."""
    if "dropout_p" in node.kwargs:
        return float(node.kwargs["dropout_p"])
    arg = node.args[_SDPA_DROPOUT_ARG] if len(node.args) > _SDPA_DROPOUT_ARG else 0.0
    return float(arg) if isinstance(arg, (int, float)) else 0.0


def _sizes(node: OpNode, divisor: float) -> tuple[float, float, float, float, float, float, int, int]:
    """Local (scores, q, k, v, out) element counts, E, Ev and the working itemsize of ``node``."""
    if node.op_name not in SDPA_OPS or len(node.input_metas) < 3:
        raise ValueError(f"op {node.name} ({node.target}) is not scaled_dot_product_attention with q, k, v inputs")
    q, k, v = node.input_metas[:3]
    e, ev, s = q.shape[-1], v.shape[-1], k.shape[-2]
    scores = q.numel / e * s / divisor
    return scores, q.numel / divisor, k.numel / divisor, v.numel / divisor, scores * ev / s, e, ev, q.itemsize


def unfused_passes(node: OpNode, divisor: float = 1.0, backward: bool = False) -> list[Pass]:
    """The kernels of ``node`` run unfused (module docstring), forward or backward, local to a
    device whose share of the op is 1 / ``divisor``."""
    n, q, k, v, out, e, ev, w = _sizes(node, divisor)
    drop = dropout_p(node) > 0
    mask = n * DROPOUT_MASK_ITEMSIZE
    if not backward:
        passes = [Pass("q.kT", 2 * n * e, (q + k + n) * w), Pass("softmax", 0.0, 2 * n * w)]
        if drop:
            passes.append(Pass("dropout", 0.0, 2 * n * w + mask))
        return passes + [Pass("probs.v", 2 * n * ev, (n + v + out) * w)]
    passes = [Pass("dV = P^T.dO", 2 * n * ev, (n + out + v) * w), Pass("dP = dO.V^T", 2 * n * ev, (out + v + n) * w)]
    if drop:
        passes.append(Pass("dropout backward", 0.0, 2 * n * w + mask))
    return passes + [Pass("softmax backward", 0.0, 3 * n * w),
                     Pass("dQ = dS.K", 2 * n * e, (n + k + q) * w), Pass("dK = dS^T.Q", 2 * n * e, (n + q + k) * w)]


def unfused_saved_bytes(node: OpNode, divisor: float = 1.0) -> float:
    """Bytes ``node`` run unfused keeps for backward beyond its inputs (module docstring), local."""
    n, *_, w = _sizes(node, divisor)
    return n * w + ((n * w + n * DROPOUT_MASK_ITEMSIZE) if dropout_p(node) > 0 else 0.0)
