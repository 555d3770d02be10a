"""Matmul family (mm, bmm, matmul, linear, addmm, baddbmm, einsum) by einsum rules.

Each operand dim gets a letter. Per letter: split it on every operand that has it (a
broadcast size-1 dim takes B); a letter kept in the output splits the output there, a
contracted letter makes the output P. Per operand: P in that operand with B in the
others gives P (the product is linear in each operand).

Bias (linear, addmm, baddbmm's ``self``) is added to the product, so it takes the
output's SBP mapped through broadcasting: S on the out-feature dim for a column split,
B for a batch split, and P when the output is P (a row-parallel linear). A parameter
stored B reaches a P use by local boxing (one device keeps it, the others hold zeros,
or every device holds bias/n); summing the addends then adds the bias exactly once.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, bcast_sbp, bound_args, register, tensor_slot

Spec = Sequence[Optional[str]]   # one letter per operand dim; None for a broadcast size-1 dim


def einsum_sigs(ins: Sequence[Spec], out: Spec) -> list[tuple[tuple, object]]:
    """(operand SBPs, output SBP) pairs of a contraction ``ins -> out``."""
    letters: list[str] = []
    for spec in ins:
        for L in spec:
            if L is not None and L not in letters:
                letters.append(L)
    sigs = []
    for L in letters:
        ops = tuple(S(spec.index(L)) if L in spec else B for spec in ins)
        sigs.append((ops, S(list(out).index(L)) if L in out else P))
    for i in range(len(ins)):
        sigs.append((tuple(P if j == i else B for j in range(len(ins))), P))
    return sigs


def _with_bias(node: OpNode, core: list[tuple[tuple, object]], core_slots: Sequence[int],
               bias_slot: int | None) -> list[Sig1D]:
    """Place the core operands' SBPs into input slots and give a bias the output's SBP, broadcast."""
    out_shape = node.outputs[0].shape
    sigs = []
    for ops, o in core:
        ins = [B] * len(node.inputs)
        for slot, sbp in zip(core_slots, ops):
            ins[slot] = sbp
        if bias_slot is not None:
            ins[bias_slot] = bcast_sbp(o, out_shape, node.input_metas[bias_slot].shape)
        sigs.append((tuple(ins), (o,)))
    return sigs


def _batch_specs(a_shape, b_shape, out_batch: int) -> tuple[list, list, list]:
    """Letters for broadcast batch dims (aligned from the right)."""
    names = [f"b{i}" for i in range(out_batch)]
    out_sizes = [max(x, y) for x, y in zip(_pad(a_shape, out_batch), _pad(b_shape, out_batch))]

    def spec(shape):
        off = out_batch - len(shape)
        return [names[i + off] if shape[i] == out_sizes[i + off] else None for i in range(len(shape))]

    return spec(a_shape), spec(b_shape), names


def _pad(shape, n):
    return [1] * (n - len(shape)) + list(shape)


@register("mm", "bmm", "matmul")
def matmul(node: OpNode) -> list[Sig1D] | None:
    a, b = (m.shape for m in node.input_metas)
    if len(a) < 1 or len(b) < 1:
        return None
    a_core = ["m", "k"] if len(a) >= 2 else ["k"]
    b_core = ["k", "n"] if len(b) >= 2 else ["k"]
    out_batch = node.outputs[0].ndim - (len(a_core) - 1) - (len(b_core) - 1)
    ab, bb, names = _batch_specs(a[: len(a) - len(a_core)], b[: len(b) - len(b_core)], out_batch)
    out = names + (["m"] if len(a) >= 2 else []) + (["n"] if len(b) >= 2 else [])
    return _with_bias(node, einsum_sigs([ab + a_core, bb + b_core], out), (0, 1), None)


@register("linear")
def linear(node: OpNode) -> list[Sig1D]:
    """linear(x (..., K), w (N, K), bias (N,)?) -> (..., N)."""
    xnd = node.input_metas[0].ndim
    batch = [f"b{i}" for i in range(xnd - 1)]
    core = einsum_sigs([batch + ["k"], ["n", "k"]], batch + ["n"])
    return _with_bias(node, core, (0, 1), tensor_slot(node, "bias"))


@register("addmm", "baddbmm")
def addmm(node: OpNode) -> list[Sig1D]:
    """addmm(bias, a (M, K), b (K, N)); baddbmm(bias, a (B, M, K), b (B, K, N)); bias broadcast."""
    a_slot, b_slot = tensor_slot(node, "mat1" if node.op_name == "addmm" else "batch1"), \
        tensor_slot(node, "mat2" if node.op_name == "addmm" else "batch2")
    batch = ["b"] if node.op_name == "baddbmm" else []
    core = einsum_sigs([batch + ["m", "k"], batch + ["k", "n"]], batch + ["m", "n"])
    return _with_bias(node, core, (a_slot, b_slot), tensor_slot(node, "self"))


@register("einsum")
def einsum(node: OpNode) -> list[Sig1D] | None:
    """einsum without ellipsis or repeated letters in one operand."""
    eq = str(bound_args(node)["equation"]).replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    lhs, rhs = eq.split("->")
    specs = lhs.split(",")
    if len(specs) != len(node.inputs) or any(len(set(s)) != len(s) for s in specs + [rhs]):
        return None
    if not all(re.fullmatch(r"[a-zA-Z]*", s) for s in specs + [rhs]):
        return None
    ins = [[L if m.shape[i] != 1 else None for i, L in enumerate(s)] for s, m in zip(specs, node.input_metas)]
    return _with_bias(node, einsum_sigs(ins, list(rhs)), tuple(range(len(specs))), None)


@register("transformers.grouped_mm_fallback.default")
def grouped_mm(node: OpNode) -> list[Sig1D] | None:
    """transformers' grouped matmul: x (S, K) rows sorted by expert, w (E, K, N), offs (E,) the end
    row of each expert's group -> (S, N); per group an mm, so einsum rules on k and n. The groups'
    bounds are global row numbers (offs), so the rows are never split here; the expert dim of
    ``w`` neither (autoddl/ops/moe.py splits the experts of a whole MoE layer)."""
    if len(node.inputs) != 3:
        return None
    core = einsum_sigs([["s", "k"], [None, "k", "n"]], ["s", "n"])
    return [(ops + (B,), (o,)) for ops, o in core if ops[0] != S(0)]
