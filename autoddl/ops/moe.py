"""Mixture-of-experts layers (``autoddl::moe_experts``, autoddl/moe.py): expert parallelism.

Inputs: hidden (T, H), top_k_index (T, k), top_k_weights (T, k), gate_up (E, 2I, H),
down (E, H, I); output (T, H). Per mesh axis:
- tokens split: hidden, index and weights S(0), experts B -> S(0) (each device runs its tokens);
- experts split, tokens whole: hidden, index, weights B, gate_up and down S(0) -> P: a device
  runs only the (token, expert) pairs of its E/n experts and gives 0 for the others, so the
  addends sum to the layer's output (the kernel narrows the expert range);
- output features split: down S(1) (its H rows), the rest B -> S(1);
- expert parallelism (an *inner* signature: its kernel communicates, autoddl/ops/registry.py):
  tokens and experts both S(0) -> S(0). Each device sends each of its (token, expert) pairs to
  the device holding that expert (all-to-all of the pairs' hidden rows and expert ids, after
  one of the per-device pair counts), runs its experts on what it received, and sends the
  results back (all-to-all); the routing weights are applied at home. Backward runs the two
  all-to-alls of the rows reversed (the gradient of an all-to-all is the reverse all-to-all).

No split of the gate/up rows: gate_up is [gate; up] stacked on dim 1, so a row split hands a
device gates without their ups (as Phi-3's fused projections, results/README.md).

What the all-to-alls move: each device sends all of its pairs, ``pairs = local tokens * k``
rows (some to itself): piece = pairs * H * itemsize, so M = n * piece (costmodel/collectives.py:
the all-to-all's M is the logical tensor, piece M/n). Where the pairs go depends on the routing;
the price, (n-1)/n of the piece on the wire, is that of a balanced router. A second axis
dispatching further receives, in balance, as many pairs as it sent.
"""

from __future__ import annotations

from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import OpNode
from autoddl.moe import TARGET, moe_forward
from autoddl.ops.registry import B, P, S, InnerCollective, Sig1D, register
from autoddl.sbp import Signature

HIDDEN, INDEX, WEIGHTS, GATE_UP, DOWN = range(5)
INDEX_BYTES = 8                      # int64 expert ids and pair counts


def moe_sigs(node: OpNode) -> list[Sig1D]:
    return [((S(0), S(0), S(0), B, B), (S(0),)),        # tokens split
            ((B, B, B, S(0), S(0)), (P,)),               # experts split, tokens whole
            ((B, B, B, B, S(1)), (S(1),))]               # down's output features split


def expert_parallel_sigs(node: OpNode) -> list[Sig1D]:
    return [((S(0),) * 5, (S(0),))]


def dispatch_axes(sig: Signature, mesh_shape, coord) -> list[tuple]:
    """(axis, n, coord, dispatch) of each axis splitting the experts, outer first (autoddl.moe.route)."""
    return [(a, n, c, sig.inputs[HIDDEN][a].is_split(0)) for a, (n, c) in enumerate(zip(mesh_shape, coord))
            if sig.inputs[GATE_UP][a].is_split(0)]


def expert_parallel_collectives(node: OpNode, sig: Signature, mesh_shape) -> list[InnerCollective]:
    """Per dispatching axis, in call order: pair counts, hidden rows, expert ids, results back
    (module docstring); the rows' two run again reversed in backward."""
    hidden = node.input_metas[HIDDEN]
    tokens, width = sig.inputs[HIDDEN].local_shape(hidden.shape, mesh_shape)
    out_width = sig.outputs[0].local_shape(node.outputs[0].shape, mesh_shape)[1]
    itemsize = hidden.itemsize
    pairs = tokens * node.input_metas[INDEX].shape[1]
    out = []
    for axis, n, _, dispatch in dispatch_axes(sig, mesh_shape, (0,) * len(mesh_shape)):
        if not dispatch:
            continue
        a2a = CollectiveKind.ALL_TO_ALL
        out += [InnerCollective(a2a, axis, n * n * INDEX_BYTES, "", "pair counts"),
                InnerCollective(a2a, axis, n * pairs * width * itemsize, "", "dispatch rows", in_backward=True),
                InnerCollective(a2a, axis, n * pairs * INDEX_BYTES, "", "dispatch expert ids"),
                InnerCollective(a2a, axis, n * pairs * out_width * itemsize, "", "combine rows", in_backward=True)]
    return out


def moe_kernel(node: OpNode, sig: Signature, mesh_shape, coord, all_reduce=None, all_to_all=None):
    """Every signature runs autoddl.moe.moe_forward on the local pieces, narrowed to this device's
    experts and dispatching over the axes that split tokens and experts both."""
    axes = dispatch_axes(sig, mesh_shape, coord)
    if any(d for *_, d in axes) and all_to_all is None:
        raise ValueError(f"op {node.name} ({node.target}) under {sig} dispatches tokens to experts with "
                         "all-to-alls; pass local_kernel an all_to_all(tensor, axis, out_splits, in_splits)")
    n_experts = node.input_metas[GATE_UP].shape[0]

    def moe_local(hidden, top_k_index, top_k_weights, gate_up, down, act):
        return moe_forward(hidden, top_k_index, top_k_weights, gate_up, down, act, n_experts, axes, all_to_all)

    return moe_local


register(TARGET, local_kernel=moe_kernel, inner_sigs=expert_parallel_sigs,
         inner=expert_parallel_collectives)(moe_sigs)
