"""embedding(weight (V, D), indices (...)) -> (..., D).

- weight S(1) (embedding dim), indices B -> output S(last);
- indices S(d), weight B -> output S(d);
- weight P -> P (the lookup is linear in the weight);
- weight S(0) (vocab shard), indices B -> P with ``local_embedding``: each device looks
  up only the ids in its row range and gives zero rows for the others, so the addends
  sum to the full lookup (Megatron's vocab-parallel embedding). A plain local
  aten.embedding would index out of range, so this signature always runs the kernel.
"""

from __future__ import annotations

import torch

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, piece_offset, register
from autoddl.sbp import Signature


def local_embedding(weight_shard: torch.Tensor, indices: torch.Tensor, shard_offset: int) -> torch.Tensor:
    """Rows ``shard_offset .. shard_offset + len(weight_shard)`` of the full table; zeros elsewhere."""
    local = indices - shard_offset
    inside = (local >= 0) & (local < weight_shard.shape[0])
    out = torch.nn.functional.embedding(torch.where(inside, local, torch.zeros_like(local)), weight_shard)
    return out * inside.unsqueeze(-1).to(out.dtype)


@register("embedding", local_kernel=lambda node, sig, mesh, coord: _vocab_kernel(node, sig, mesh, coord))
def embedding(node: OpNode) -> list[Sig1D]:
    nd = node.input_metas[1].ndim
    sigs: list[Sig1D] = [((S(1), B), (S(nd),)), ((P, B), (P,)), ((S(0), B), (P,))]
    sigs += [((B, S(d)), (S(d),)) for d in range(nd)]
    return sigs


def _vocab_kernel(node: OpNode, sig: Signature, mesh_shape, coord):
    if not any(s.is_split(0) for s in sig.inputs[0]):
        return None
    offset = piece_offset(node.input_metas[0].shape, sig.inputs[0], mesh_shape, coord, 0)

    def vocab_parallel_embedding(weight, indices, *args, **kwargs):
        return local_embedding(weight, indices, offset)

    return vocab_parallel_embedding
