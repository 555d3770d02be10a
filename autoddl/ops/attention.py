"""scaled_dot_product_attention(q (..., L, E), k (..., S, E), v (..., S, Ev), mask?) -> (..., L, Ev).

- any batch dim (batch, heads), split the same way on q, k, v and the mask (a mask or
  k/v dim of size 1 broadcasts and takes B). With enable_gqa, k/v have fewer heads:
  q's contiguous head chunk j uses exactly k/v's head chunk j, so the head split is
  valid when it divides both head counts (the divisibility filter checks both);
- the query sequence (q S(L), k, v B, the mask split on its L dim) only without causal
  masking: a local is_causal mask would start at the wrong offset;
- v P, q, k, mask B -> P (attention is linear in v).
Never the key sequence (softmax over it) nor the head dim (softmax of a partial score).
Dropout (dropout_p > 0) draws random masks: the split rules still hold as distributions.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, bcast_sbp, bound_args, is_float, register, tensor_slot


@register("scaled_dot_product_attention")
def sdpa(node: OpNode) -> list[Sig1D]:
    bound = bound_args(node)
    q_shape = node.input_metas[0].shape
    out_shape = node.outputs[0].shape
    nd = len(q_shape)
    gqa = bool(bound.get("enable_gqa", False))
    mask = tensor_slot(node, "attn_mask")
    scores = tuple(q_shape[:-1]) + (node.input_metas[1].shape[-2],)   # (..., L, S) the mask broadcasts to

    def operand(slot: int, d: int):
        shape = node.input_metas[slot].shape
        if slot == mask:
            return bcast_sbp(S(d), scores, shape)
        a = d - (nd - len(shape))
        if a < 0 or shape[a] == 1:
            return B
        if shape[a] == q_shape[d] or (gqa and d == nd - 3):
            return S(a)
        return None

    sigs: list[Sig1D] = []
    for d in range(nd - 2):
        ins = tuple(S(d) if slot == 0 else operand(slot, d) for slot in range(len(node.inputs)))
        if None not in ins:
            sigs.append((ins, (S(d),)))
    if not bound.get("is_causal", False):
        L = nd - 2
        ins = tuple(S(L) if slot == 0 else (bcast_sbp(S(L), scores, node.input_metas[slot].shape)
                                            if slot == mask else B) for slot in range(len(node.inputs)))
        sigs.append((ins, (S(L),)))
    if is_float(node.outputs[0]) and out_shape[:-1] == q_shape[:-1]:
        sigs.append((tuple(P if slot == 2 else B for slot in range(len(node.inputs))), (P,)))
    return sigs
