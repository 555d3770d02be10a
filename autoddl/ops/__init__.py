"""SBP signature rules: which input/output layouts of an op give exactly the unsharded result.

A 1-D rule (``rule_1d``) lists, for one mesh axis, every valid
(input SBPs, output SBPs) pair of an op; ``candidate_signatures`` takes their
product over the mesh axes and keeps those whose split dims divide. Validity
is defined by execution: running the op on each device's local pieces, with
``local_args`` (shape arguments rewritten to local shapes) and, where
registered, ``local_kernel`` (a different local computation), and reading
the outputs with the output SBP must give the unsharded result.
tests/shard_sim.py checks every candidate of every family that way.

Local kernels (few, all listed here):
- embedding with the weight split on the vocab dim: masked lookup of the local rows -> P;
- mean over a split dim (mean, mse/l1/cross-entropy "mean" losses): the local mean scaled
  by 1/n (shards have equal sizes, the divisibility filter guarantees it) -> P;
- squeeze.default: squeezes exactly the globally size-1 dims (a split can make a local dim 1);
- cross_entropy_loss with the logits split on the class dim (Megatron's vocabulary-parallel
  cross-entropy): local max, all-reduce (max); local sum of exponentials and target logit,
  all-reduce (sum) -> the whole loss, B. It communicates, so it is an *inner* signature
  (autoddl/ops/registry.py): offered only with ``inner_collectives=True``, run with the
  ``all_reduce`` the caller gives ``local_kernel``, its collectives listed by
  ``inner_collectives``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from autoddl.flops import flop_source
from autoddl.graph import NodeKind, OpGraph, OpNode
from autoddl.ops.registry import RULES, InnerCollective, Sig1D, all_b
from autoddl.sbp import B, P, NdSbp, Signature, S

# one module per op family; importing registers their rules
from autoddl.ops import (  # noqa: E402,F401  (imported for their registrations)
    attention, conv, creation, embedding, indexing, loss, matmul, moe, norm, pointwise, pool, reduction, scan,
    sort, view,
)

__all__ = [
    "Sig1D", "rule_1d", "candidate_signatures", "has_rule", "unsupported_ops", "placeholder_candidates",
    "aten_op", "local_args", "local_kernel", "local_callable", "localize_devices", "RULES",
    "CoverageReport", "UncoveredOpWarning", "coverage_report", "InnerCollective", "inner_collectives",
]


def aten_op(node: OpNode) -> Callable[..., Any]:
    """The torch callable of ``node.target`` (``aten.linear.default`` -> torch.ops.aten.linear.default).

    ``getitem`` nodes read output i of a multi-output op; their input already is that
    output, so the callable is the identity on its first argument."""
    if node.target == "getitem":
        return _getitem
    parts = node.target.split(".")
    if len(parts) != 3:
        raise ValueError(f"autoddl.ops: op {node.name} has target {node.target!r}, not a torch op "
                         "'<namespace>.<name>.<overload>' (e.g. aten.mm.default)")
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except AttributeError:
        raise ValueError(f"autoddl.ops: torch {torch.__version__} has no op {node.target!r} "
                         f"(node {node.name})") from None


def _getitem(x, index=None):
    return x




def _raw_rules(node: OpNode) -> list[Sig1D] | None:
    if node.kind is NodeKind.OUTPUT:
        return _output_rules(node)
    if node.kind is not NodeKind.OP:
        return None
    rule = RULES.get(node.op_name)
    if rule is None:
        return None
    return rule.sigs(node)


def _inner_rules(node: OpNode) -> list[Sig1D]:
    rule = RULES.get(node.op_name) if node.kind is NodeKind.OP else None
    if rule is None or rule.inner_sigs is None:
        return []
    return rule.inner_sigs(node) or []


def rule_1d(node: OpNode, inner_collectives: bool = False) -> list[Sig1D]:
    """Every valid 1-D signature of ``node``, all-B first, no duplicates (all-B alone without a rule).
    With ``inner_collectives``, also those whose local kernel communicates (autoddl/ops/registry.py)."""
    sigs = (_raw_rules(node) or []) + (_inner_rules(node) if inner_collectives else [])
    out: list[Sig1D] = [all_b(node)]
    for ins, outs in sigs:
        ins, outs = tuple(ins), tuple(outs)
        if len(ins) != len(node.inputs) or len(outs) != len(node.outputs):
            raise AssertionError(f"autoddl.ops rule for {node.target} gave {len(ins)} inputs / {len(outs)} "
                                 f"outputs, node {node.name} has {len(node.inputs)} / {len(node.outputs)}")
        if (ins, outs) not in out:
            out.append((ins, outs))
    return out


def has_rule(node: OpNode) -> bool:
    """True when ``node`` has a rule that covers this instance (placeholders count as covered)."""
    if node.kind in (NodeKind.INPUT, NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.OUTPUT):
        return True
    return _raw_rules(node) is not None


def unsupported_ops(graph: OpGraph) -> list[str]:
    """Names of the op nodes that have no rule and therefore only get the all-B signature."""
    return [n.name for n in graph.ops() if not has_rule(n)]


class UncoveredOpWarning(UserWarning):
    """A traced graph has ops without an SBP rule or a FLOP formula (see coverage_report)."""


@dataclass(frozen=True)
class CoverageReport:
    """The ops of a graph that autoddl only approximates, by target, with their counts.

    ``no_rule``: ops without an SBP rule; they get only the all-B signature (every
    device computes the whole op, so they are never sharded). ``no_flops``: ops whose
    FLOPs are an estimate of 1 per output element (no formula in autoddl.flops, no
    ``register_flops`` entry, no matmul in a custom op's fake implementation).
    """

    model_name: str = ""
    no_rule: dict[str, int] = field(default_factory=dict)
    no_flops: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.no_rule or self.no_flops)

    def lines(self) -> list[str]:
        """One line per kind of gap, ``target xN`` most frequent first, with what to do."""
        out = []
        if self.no_rule:
            out.append(f"{sum(self.no_rule.values())} ops without an SBP rule (planned replicated, all-B): "
                       + _counts(self.no_rule))
        if self.no_flops:
            out.append(f"{sum(self.no_flops.values())} ops without a FLOP formula (counted 1 FLOP per output "
                       f"element): {_counts(self.no_flops)}; give them one with "
                       "autoddl.register_flops('ns::op', fn)")
        return out


def _counts(by_target: dict[str, int]) -> str:
    return ", ".join(f"{t} x{n}" for t, n in sorted(by_target.items(), key=lambda kv: (-kv[1], kv[0])))


def coverage_report(graph: OpGraph) -> CoverageReport:
    """Which op targets of ``graph`` have no SBP rule and which have no FLOP formula, counted."""
    no_rule: Counter[str] = Counter()
    no_flops: Counter[str] = Counter()
    for node in graph.ops():
        if node.target == "getitem":
            continue
        if not has_rule(node):
            no_rule[node.target] += 1
        if flop_source(node.op_name) == "estimate":
            no_flops[node.target] += 1
    return CoverageReport(graph.model_name, dict(no_rule), dict(no_flops))


def candidate_signatures(node: OpNode, mesh_shape: Sequence[int], inner_collectives: bool = False) -> list[Signature]:
    """Product of ``rule_1d`` over the mesh axes, keeping signatures whose split dims divide.
    ``inner_collectives``: also signatures whose local kernel communicates (the caller prices the
    collectives ``inner_collectives()`` lists and gives ``local_kernel`` an ``all_reduce``)."""
    mesh_shape = tuple(mesh_shape)
    if node.kind in (NodeKind.INPUT, NodeKind.PARAMETER, NodeKind.BUFFER):
        return placeholder_candidates(node, mesh_shape)
    ones = rule_1d(node, inner_collectives)
    metas = tuple(node.input_metas) + tuple(node.outputs)
    n_in = len(node.inputs)
    out: list[Signature] = []
    seen: set[Signature] = set()
    for combo in itertools.product(ones, repeat=len(mesh_shape)):
        nds = [NdSbp(tuple((c[0] + c[1])[i] for c in combo)) for i in range(len(metas))]
        sig = Signature(tuple(nds[:n_in]), tuple(nds[n_in:]))
        if sig in seen:
            continue
        seen.add(sig)
        if all(nd.divides(m.shape, mesh_shape) for nd, m in zip(nds, metas)):
            out.append(sig)
    return out


def placeholder_candidates(node: OpNode, mesh_shape: Sequence[int]) -> list[Signature]:
    """Inputs, parameters and buffers: B or S(d) per mesh axis (no P), dims that divide; outputs only."""
    mesh_shape = tuple(mesh_shape)
    if not node.outputs:
        return [Signature((), ())]
    meta = node.outputs[0]
    choices = [B] + [S(d) for d in range(meta.ndim)]
    out = []
    for combo in itertools.product(choices, repeat=len(mesh_shape)):
        nd = NdSbp(combo)
        if nd.divides(meta.shape, mesh_shape):
            out.append(Signature((), (nd,)))
    return out


def _output_rules(node: OpNode) -> list[Sig1D]:
    """The graph output takes each value as B or P (P only for floating values); 2^k for k <= 4."""
    choices = [(B, P) if m.dtype.startswith(("float", "bfloat")) else (B,) for m in node.input_metas]
    if len(choices) > 4:
        return [(tuple(B for _ in choices), ()), (tuple(c[-1] for c in choices), ())]
    return [(tuple(c), ()) for c in itertools.product(*choices)]


def local_args(node: OpNode, sig: Signature, mesh_shape: Sequence[int]) -> tuple[tuple, dict]:
    """``node``'s (args, kwargs), TensorRefs kept, with shape-like arguments rewritten to the
    local shapes of ``sig`` on ``mesh_shape`` (view/reshape/expand sizes, unflatten sizes, ...)."""
    rule = RULES.get(node.op_name)
    if rule is None or rule.local_args is None:
        return tuple(node.args), dict(node.kwargs)
    return rule.local_args(node, sig, tuple(mesh_shape))


def inner_collectives(node: OpNode, sig: Signature, mesh_shape: Sequence[int]) -> list[InnerCollective]:
    """The collectives ``node``'s local kernel runs itself under ``sig``, in call order (every rank
    the same); [] for an ordinary signature. The caller prices them and, running the kernel, gives
    ``local_kernel`` an ``all_reduce`` that carries them out."""
    rule = RULES.get(node.op_name) if node.kind is NodeKind.OP else None
    if rule is None or rule.inner is None:
        return []
    return rule.inner(node, sig, tuple(mesh_shape))


def local_kernel(node: OpNode, sig: Signature, mesh_shape: Sequence[int],
                 coord: Sequence[int], all_reduce: Callable[..., Any] | None = None,
                 all_to_all: Callable[..., Any] | None = None) -> Callable[..., Any] | None:
    """A replacement for the aten op on device ``coord`` when ``sig`` needs one, else None.

    The callable takes the same arguments as the aten op (local tensors, ``local_args``). A
    signature with inner collectives needs the callables that run them, every rank of the axis
    calling them alike: ``all_reduce(tensor, axis, op) -> tensor`` (op "sum" or "max" over mesh
    axis ``axis``, a new tensor) and ``all_to_all(tensor, axis, output_split_sizes,
    input_split_sizes) -> tensor`` (differentiable)."""
    rule = RULES.get(node.op_name)
    if rule is None or rule.local_kernel is None:
        return None
    needed = {c.kind.value for c in inner_collectives(node, sig, mesh_shape)}
    given = {"all_reduce": all_reduce, "all_to_all": all_to_all}
    missing = sorted(k for k in needed if given.get(k) is None)
    if missing:
        raise ValueError(f"op {node.name} ({node.target}) under {sig} communicates inside its kernel "
                         f"(autoddl.ops.inner_collectives); pass local_kernel {' and '.join(missing)} to run them")
    if needed:
        return rule.local_kernel(node, sig, tuple(mesh_shape), tuple(coord), all_reduce=all_reduce,
                                 all_to_all=all_to_all)
    return rule.local_kernel(node, sig, tuple(mesh_shape), tuple(coord))


def local_callable(node: OpNode, sig: Signature, mesh_shape: Sequence[int], coord: Sequence[int],
                   all_reduce: Callable[..., Any] | None = None,
                   all_to_all: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """What device ``coord`` runs for ``node`` under ``sig``: the local kernel or the aten op."""
    return local_kernel(node, sig, mesh_shape, coord, all_reduce, all_to_all) or aten_op(node)


def localize_devices(args: Any, kwargs: dict[str, Any], device: str | torch.device) -> tuple[Any, dict[str, Any]]:
    """``(args, kwargs)`` with every meta ``torch.device`` replaced by ``device``.

    The trace runs on the meta device, so ops that name a device record ``meta``:
    positionally (``aten.to.device(x, meta, float32)``), by keyword
    (``_to_copy(x, device=meta)``, ``arange(..., device=meta)``) or inside a list or
    tuple. Before running such an op on real tensors, every one of them must name
    the run device; other devices and every other value are kept as they are.
    """
    device = torch.device(device)

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device):
            return device if value.type == "meta" else value
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    return swap(tuple(args)), swap(dict(kwargs))
