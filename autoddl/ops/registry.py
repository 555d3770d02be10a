"""The rule registry and the small helpers every op family uses.

A rule is registered per aten op name (``OpNode.op_name``: ``"linear"``,
``"add_"``, ``"getitem"``) and says, for ONE mesh axis, which SBP of each tensor
input gives which SBP of each output (a ``Sig1D``). A rule may return ``None``
for an instance it does not cover (e.g. a transposed convolution's channel
split); the op then falls back to all-B and is reported as unsupported.

Rules that need more than "run the aten op on local pieces" register
``local_args`` (shape-like arguments rewritten to local shapes) and/or
``local_kernel`` (a different local computation, possibly rank dependent).

A few signatures are valid only if the local computation communicates in the
middle (Megatron's vocabulary-parallel cross-entropy all-reduces the row max,
then the sum of exponentials and the target logit). A rule lists those apart
(``inner_sigs``) with ``inner``, the collectives its kernel runs
(``InnerCollective``: kind, mesh axis, bytes, reduce op, in call order); its
``local_kernel`` then takes an ``all_reduce(tensor, axis, op) -> tensor`` and an
``all_to_all(tensor, axis, output_split_sizes, input_split_sizes) -> tensor`` keyword
through which it runs them (expert parallelism's dispatch, autoddl/ops/moe.py). They are offered only to a caller that
says it prices and runs such collectives (``inner_collectives=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import OpNode, TensorMeta, TensorRef
from autoddl.sbp import B, P, Broadcast, NdSbp, Partial, Sbp, Signature, Split, S

Sig1D = tuple[tuple[Sbp, ...], tuple[Sbp, ...]]
MeshShape = tuple[int, ...]
Coord = tuple[int, ...]

SigsFn = Callable[[OpNode], Optional[list]]
LocalArgsFn = Callable[[OpNode, Signature, MeshShape], tuple[tuple, dict]]
LocalKernelFn = Callable[[OpNode, Signature, MeshShape, Coord], Optional[Callable[..., Any]]]


@dataclass(frozen=True)
class InnerCollective:
    """A collective a signature's local kernel runs itself, between its local steps: ``kind`` on
    mesh axis ``axis`` over ``nbytes`` (M, the whole buffer), reducing with ``reduce_op``."""

    kind: CollectiveKind
    axis: int
    nbytes: int
    reduce_op: str                      # "sum" | "max" ("" for an all-to-all)
    what: str = ""                      # what it reduces, for explain and the audit's labels
    in_backward: bool = False           # autograd runs it again (reversed) in backward


InnerFn = Callable[[OpNode, Signature, MeshShape], list[InnerCollective]]


@dataclass(frozen=True)
class OpRule:
    sigs: SigsFn
    local_args: Optional[LocalArgsFn] = None
    local_kernel: Optional[LocalKernelFn] = None
    inner_sigs: Optional[SigsFn] = None         # 1-D signatures whose kernel communicates (module docstring)
    inner: Optional[InnerFn] = None             # the collectives such a signature's kernel runs


RULES: dict[str, OpRule] = {}


def register(*op_names: str, local_args: LocalArgsFn | None = None,
             local_kernel: LocalKernelFn | None = None, inner_sigs: SigsFn | None = None,
             inner: InnerFn | None = None):
    """Decorator: ``fn(node) -> list[Sig1D] | None`` is the 1-D rule of every op in ``op_names``."""
    if (inner_sigs is None) != (inner is None):
        raise ValueError(f"autoddl.ops: rule for {op_names}: inner_sigs and inner go together")

    def deco(fn: SigsFn) -> SigsFn:
        for name in op_names:
            if name in RULES:
                raise ValueError(f"autoddl.ops: a rule for {name!r} is registered twice")
            RULES[name] = OpRule(fn, local_args, local_kernel, inner_sigs, inner)
        return fn

    return deco


# -- small helpers ---------------------------------------------------------------------------
def norm_dim(d: int, ndim: int) -> int:
    """Negative dims count from the end; a 0-d tensor accepts 0 and -1."""
    nd = max(ndim, 1)
    if not -nd <= d < nd:
        raise ValueError(f"dim {d} is out of range for a {ndim}-d tensor")
    return d % nd


def all_b(node: OpNode) -> Sig1D:
    return (B,) * len(node.inputs), (B,) * len(node.outputs)


def is_float(meta: TensorMeta) -> bool:
    return meta.dtype.startswith(("float", "bfloat"))


def bcast_sbp(sbp: Sbp, out_shape: Sequence[int], in_shape: Sequence[int]) -> Sbp:
    """The SBP an operand broadcast to ``out_shape`` needs so its local piece broadcasts to the
    output piece of ``sbp``: a split dim the operand lacks or has as size 1 is B."""
    if sbp.is_split():
        a = sbp.dim - (len(out_shape) - len(in_shape))
        if a >= 0 and in_shape[a] == out_shape[sbp.dim]:
            return S(a)
        return B
    return sbp


def bound_args(node: OpNode) -> dict[str, Any]:
    """The op's arguments by schema name (positional and keyword, defaults filled in)."""
    from autoddl.ops import aten_op  # late: aten_op lives in the package API

    schema = aten_op(node)._schema
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def tensor_slot(node: OpNode, name: str) -> int | None:
    """Input slot of schema argument ``name`` (None when it was passed as None / a scalar)."""
    value = bound_args(node).get(name)
    if not isinstance(value, TensorRef):
        return None
    refs = _refs_in_order(node)
    for slot, r in enumerate(refs):
        if r is value:
            return slot
    return None


def _refs_in_order(node: OpNode) -> list[TensorRef]:
    refs: list[TensorRef] = []

    def walk(v: Any) -> None:
        if isinstance(v, TensorRef):
            refs.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(node.args)
    walk(node.kwargs)
    return refs


def split_factor(sig_part: NdSbp, mesh_shape: MeshShape, dims: set[int] | None = None) -> int:
    """Product of the mesh sizes of the axes on which ``sig_part`` splits a dim in ``dims`` (any if None)."""
    n = 1
    for sbp, size in zip(sig_part, mesh_shape):
        if sbp.is_split() and (dims is None or sbp.dim in dims):
            n *= size
    return n


def piece_offset(shape: Sequence[int], nd: NdSbp, mesh_shape: MeshShape, coord: Coord, dim: int) -> int:
    """Start index along ``dim`` of the piece device ``coord`` holds (nested splits, outer axis first)."""
    offset, size = 0, shape[dim]
    for sbp, n, c in zip(nd, mesh_shape, coord):
        if sbp.is_split(dim):
            size //= n
            offset += c * size
    return offset


def local_out_shape(node: OpNode, sig: Signature, mesh_shape: MeshShape, i: int = 0) -> list[int]:
    return list(sig.outputs[i].local_shape(node.outputs[i].shape, mesh_shape))


def replace_arg(node: OpNode, name: str, value: Any) -> tuple[tuple, dict]:
    """(args, kwargs) of ``node`` with schema argument ``name`` set to ``value``."""
    from autoddl.ops import aten_op

    schema = aten_op(node)._schema
    args, kwargs = list(node.args), dict(node.kwargs)
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            if i < len(args) and not arg.kwarg_only:
                args[i] = value
            else:
                kwargs[name] = value
            return tuple(args), kwargs
    raise KeyError(f"{node.target} has no argument {name!r}")


__all__ = [
    "Sig1D", "OpRule", "InnerCollective", "RULES", "register", "norm_dim", "all_b", "is_float", "bcast_sbp",
    "bound_args", "tensor_slot", "split_factor", "piece_offset", "local_out_shape", "replace_arg",
    "B", "P", "S", "Split", "Broadcast", "Partial",
]
