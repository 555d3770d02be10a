"""Ops that make tensors from sizes alone (arange, zeros, ones, full, scalar_tensor, eye, new_*).

Their output is B only: every device builds the same full tensor. ``new_*`` ops read
only their input's dtype and device, so that input may have any SBP.
Random factories (rand, randn, ...) have no rule: a B output needs one random stream.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, bound_args, register

FACTORIES = ("arange", "zeros", "ones", "full", "scalar_tensor", "eye", "linspace", "tensor")
NEW = ("new_zeros", "new_ones", "new_full")


@register(*FACTORIES)
def factory(node: OpNode) -> list[Sig1D]:
    return []  # all-B only (rule_1d always adds it)


@register(*NEW)
def new_tensor(node: OpNode) -> list[Sig1D]:
    nd = node.input_metas[0].ndim
    return [((S(d),), (B,)) for d in range(nd)] + [((P,), (B,))]


@register("_assert_tensor_metadata")
def assert_metadata(node: OpNode) -> list[Sig1D]:
    """Checks dtype/device and returns nothing: its input may have any SBP unless sizes are checked."""
    bound = bound_args(node)
    if bound.get("size") is not None or bound.get("stride") is not None:
        return []
    nd = node.input_metas[0].ndim if node.input_metas else 0
    return [((S(d),), ()) for d in range(nd)] + [((P,), ())]
