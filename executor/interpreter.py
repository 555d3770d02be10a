"""Run a traced graph on local shards exactly as a Plan says (DESIGN.md "Executor").

``PlanInterpreter`` walks ``OpGraph.exported.graph_module`` (torch.export's
ATen graph; parameters are placeholders). Every value between nodes is a
DTensor. For each op node it

1. boxes each input DTensor to the NdSbp the op's planned signature wants
   (``box``: DTensor ``redistribute``, plus a local B->P that DTensor refuses),
2. takes the local tensor with ``to_local(grad_placements=...)`` by the rule in
   ``grad_placements_for`` (without it a data-parallel weight's gradient comes
   back as one device's share labelled Replicate),
3. runs the ATen op (or the op rule's local kernel, e.g. a mean scaled to its
   share) on local tensors with shape arguments rewritten to local shapes
   (``autoddl.ops.local_args``), and
4. wraps each output with ``DTensor.from_local`` under the planned output NdSbp
   and the global shape of the trace, checking the local shape first.

Parameters are not boxed through autograd: each use gets a detached leaf
(``param_uses``) whose gradient the runtime reduces to the storage NdSbp in a
separate grad-sync phase, so that phase is explicit, labelled and auditable.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import Partial as DPartial

from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef
from autoddl.ops import localize_devices
from autoddl.ops.registry import piece_offset
from autoddl.plan import Plan
from autoddl.sbp import Broadcast, NdSbp, Partial, Signature, Split

try:  # the op rules' local shape arguments and local kernels (mean / loss scaling, vocab-parallel
    # embedding); fallback_local_args and _mean_scale below cover views and means without them
    from autoddl.ops import local_args as ops_local_args
    from autoddl.ops import local_kernel as ops_local_kernel
except ImportError:  # pragma: no cover - only while autoddl.ops is missing
    ops_local_args = ops_local_kernel = None


class PlanExecutionError(RuntimeError):
    """The plan cannot be run as written; the message names the node and what to do."""


# -- the backward rule ----------------------------------------------------------------------

def grad_placements_for(input_sbp: NdSbp, output_sbps: Sequence[NdSbp]) -> tuple:
    """Placements of an input's gradient, per mesh axis (DESIGN.md "Executor").

    S(d) -> S(d); P -> B; B -> B when every output of the op is B on that axis
    (every device computed the same thing), else P (each device holds a share).
    """
    out = []
    for axis, sbp in enumerate(input_sbp):
        if isinstance(sbp, Split):
            out.append(Shard(sbp.dim))
        elif isinstance(sbp, Partial):
            out.append(Replicate())
        elif all(isinstance(o[axis], Broadcast) for o in output_sbps):
            out.append(Replicate())
        else:
            out.append(DPartial())
    return tuple(out)


# -- boxing -----------------------------------------------------------------------------------

class _KeepOnRoot(torch.autograd.Function):
    """B -> P on some mesh axes: the axis root keeps the value, the others hold zeros.

    The logical op is the identity, so the gradient (a B tensor) passes through unchanged.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, keep: bool) -> torch.Tensor:
        return local.clone() if keep else torch.zeros_like(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _normalized(placements: Sequence) -> tuple:
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def to_partial(dt: DTensor, axes: Sequence[int]) -> DTensor:
    """Turn the Replicate placements of ``dt`` on ``axes`` into Partial (no communication)."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    keep = all(coord[a] == 0 for a in axes)
    local = _KeepOnRoot.apply(dt.to_local(grad_placements=_normalized(dt.placements)), keep)
    placements = tuple(DPartial() if i in axes else p for i, p in enumerate(dt.placements))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=dt.shape, stride=dt.stride())


class _PadToPartial(torch.autograd.Function):
    """S(d) -> P on some mesh axes without communication: the local piece, zero-padded.

    Each device puts its piece at its offset in zeros of the target's local shape; the
    addends over the axis sum to the whole. The logical op is the identity, so the
    gradient (B on those axes) is narrowed back to the piece: S(d), no communication.
    ``pads`` holds ``(dim, offset, padded size)`` per padded dim.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, pads: tuple) -> torch.Tensor:
        ctx.pads, ctx.sizes = pads, tuple(local.shape[dim] for dim, _, _ in pads)
        shape = list(local.shape)
        for dim, _offset, full in pads:
            shape[dim] = full
        out = local.new_zeros(shape)
        _narrowed(out, pads, ctx.sizes).copy_(local)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _narrowed(grad, ctx.pads, ctx.sizes), None


def _narrowed(t: torch.Tensor, pads: tuple, sizes: tuple) -> torch.Tensor:
    for (dim, offset, _full), size in zip(pads, sizes):
        t = t.narrow(dim, offset, size)
    return t


def shard_to_partial_is_local(src: Sequence, dst: Sequence, axis: int) -> bool:
    """S(d) -> P on ``axis`` is local unless a later mesh axis of ``dst`` splits the same dim d
    (then this axis's pieces are nested inside that split and do not add up to its pieces)."""
    dim = src[axis].dim
    return not any(p.is_shard(dim) for p in tuple(dst)[axis + 1:])


def pad_to_partial(dt: DTensor, axes: Sequence[int]) -> DTensor:
    """Turn the Shard placements of ``dt`` on ``axes`` into Partial (no communication)."""
    mesh, shape = dt.device_mesh, tuple(dt.shape)
    mesh_shape, coord = tuple(mesh.shape), tuple(mesh.get_coordinate())
    src = tuple(dt.placements)
    dst = tuple(DPartial() if i in axes else p for i, p in enumerate(src))
    src_nd, dst_nd = NdSbp.from_placements(src), NdSbp.from_placements(dst)
    dst_local = dst_nd.local_shape(shape, mesh_shape)
    pads = tuple((d, piece_offset(shape, src_nd, mesh_shape, coord, d) - piece_offset(shape, dst_nd, mesh_shape,
                                                                                      coord, d), dst_local[d])
                 for d in sorted({src[i].dim for i in axes}))
    local = _PadToPartial.apply(dt.to_local(grad_placements=_normalized(src)), pads)
    return DTensor.from_local(local, mesh, dst, run_check=False, shape=dt.shape, stride=dt.stride())


def box(dt: DTensor, dst: Sequence) -> DTensor:
    """Redistribute ``dt`` to placements ``dst`` as the cost model prices it (costmodel/boxing.py).

    DTensor's ``redistribute`` does every collective; the two moves it refuses or would do
    with a collective are local here: S(d) -> P keeps the own piece zero-padded
    (``_PadToPartial``), B -> P keeps the value on the axis root and zeros elsewhere
    (``to_partial``). An S(d) -> P on an axis whose pieces are nested inside a later
    axis's split of the same dim is not a local move (the pieces do not sum to the
    target's pieces): it goes through B (an all-gather), as costmodel.boxing prices it."""
    dst = tuple(dst)
    src = tuple(dt.placements)
    if src == dst:
        return dt
    to_p = [i for i, (s, d) in enumerate(zip(src, dst)) if d.is_partial() and not s.is_partial()]
    pad = [i for i in to_p if src[i].is_shard() and shard_to_partial_is_local(src, dst, i)]
    mid = tuple(s if i in pad else (Replicate() if i in to_p else d) for i, (s, d) in enumerate(zip(src, dst)))
    out = dt.redistribute(dt.device_mesh, mid) if mid != src else dt
    if pad:
        out = pad_to_partial(out, pad)
    keep = [i for i in to_p if i not in pad]
    return to_partial(out, keep) if keep else out


def place(full: torch.Tensor, nd: NdSbp, mesh) -> DTensor:
    """A DTensor with placements ``nd`` from a full tensor every rank holds (no communication)."""
    placements = nd.to_placements()
    no_p = tuple(Replicate() if p.is_partial() else p for p in placements)
    dt = distribute_tensor(full, mesh, no_p, src_data_rank=None)
    return box(dt, placements)


# -- local arguments ----------------------------------------------------------------------------

_SIZE_ARG_OPS = {"view", "reshape", "_unsafe_view", "expand", "view_copy", "expand_copy"}


def fallback_local_args(node: OpNode, sig: Signature, mesh_shape: Sequence[int]) -> tuple[tuple, dict]:
    """``node.args`` / ``kwargs`` (TensorRefs kept) with global shape arguments made local.

    Used only when ``autoddl.ops.local_args`` is unavailable: size arguments of view /
    reshape / _unsafe_view / expand, and the split sizes of split / split_with_sizes.
    """
    args, kwargs = tuple(node.args), dict(node.kwargs)
    name = node.op_name
    if name in _SIZE_ARG_OPS:
        local = sig.outputs[0].local_shape(node.outputs[0].shape, mesh_shape)
        args = (args[0], list(local)) + args[2:]
    elif name in ("split", "split_with_sizes"):
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        dim = dim % node.input_metas[0].ndim
        sizes = [nd.local_shape(m.shape, mesh_shape)[dim] for nd, m in zip(sig.outputs, node.outputs)]
        if name == "split":
            if len(set(sizes[:-1])) > 1 or sizes[-1] > sizes[0]:
                raise PlanExecutionError(f"{node.name}: split into local sizes {sizes} is not one split size")
            args = (args[0], sizes[0]) + args[2:]
        else:
            args = (args[0], sizes) + args[2:]
    return args, kwargs


def _substitute(value: Any, tensors: list[torch.Tensor], pos: list[int]) -> Any:
    """Replace TensorRefs in (nested) args by ``tensors`` in order."""
    if isinstance(value, TensorRef):
        t = tensors[pos[0]]
        pos[0] += 1
        return t
    if isinstance(value, (list, tuple)):
        return type(value)(_substitute(v, tensors, pos) for v in value)
    if isinstance(value, dict):
        return {k: _substitute(v, tensors, pos) for k, v in value.items()}
    return value


def _mean_scale(fx_node: torch.fx.Node, node: OpNode, locals_: list[torch.Tensor]) -> float:
    """Local count / global count for a mean over split elements, else 1.

    A mean over a dim split across devices is, per device, the local mean; times this
    ratio it is that device's share of the global mean, so the output reads as P. Covers
    ``mean`` and loss ops with ``reduction=1`` (mean), whose count is the target's numel.
    (With ``ignore_index`` hits the per-device count differs and the result is not exact.)
    """
    if not locals_:
        return 1.0
    if node.op_name == "mean":
        return _reduced_numel(node, tuple(locals_[0].shape)) / _reduced_numel(node, node.input_metas[0].shape)
    schema = getattr(fx_node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "reduction" not in names or len(locals_) < 2:
        return 1.0
    pos = names.index("reduction")
    reduction = fx_node.args[pos] if len(fx_node.args) > pos else fx_node.kwargs.get("reduction", 1)
    if reduction != 1:
        return 1.0
    return locals_[1].numel() / max(1, node.input_metas[1].numel)


def _reduced_numel(node: OpNode, shape: Sequence[int]) -> int:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not dims:  # mean.default, or dim=None / []
        dims = range(len(shape))
    n = 1
    for d in dims:
        n *= shape[d % len(shape)] if shape else 1
    return n


# -- the interpreter ------------------------------------------------------------------------------

class PlanInterpreter(torch.fx.Interpreter):
    """Runs ``graph.exported.graph_module`` with DTensor values, op by op, as ``plan`` says."""

    def __init__(self, graph: OpGraph, plan: Plan, mesh, recorder=None, *, device: str = "cpu",
                 use_ops_rules: bool = True):
        if graph.exported is None:
            raise PlanExecutionError("the OpGraph has no `exported` program: trace the model in this "
                                     "process with autoddl.trace(model, inputs, loss_fn)")
        super().__init__(graph.exported.graph_module, garbage_collect_values=True)
        self.opgraph = graph
        self.plan = plan
        self.mesh = mesh
        self.mesh_shape = tuple(plan.mesh.shape)
        self.recorder = recorder
        self.device = device
        self._by_name = {n.name: n for n in self.module.graph.nodes}
        self.coord = tuple(mesh.get_coordinate())
        self.use_ops_rules = use_ops_rules and ops_local_args is not None
        self._cache: dict[tuple, DTensor] = {}
        self.param_uses: dict[str, list[DTensor]] = defaultdict(list)

    def run_step(self, placeholder_values: Sequence[Any]) -> Any:
        """Run the graph once; ``placeholder_values`` in placeholder order (params, buffers, inputs)."""
        self._cache.clear()
        self.param_uses = defaultdict(list)
        try:
            return self.run(*placeholder_values)
        finally:
            self._cache.clear()

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "call_function" and n.target is not operator.getitem:
            if n.name not in self.opgraph:  # an unused assertion the trace dropped (shapes are global)
                return None
            return self._run_op(n)
        return super().run_node(n)

    # -- one op ---------------------------------------------------------------------------------
    def _run_op(self, n: torch.fx.Node) -> Any:
        op = self.opgraph[n.name]
        sig = self.plan.signatures.get(n.name)
        if sig is None:
            raise PlanExecutionError(f"plan {self.plan.name!r} has no signature for op {n.name} "
                                     f"({op.target}); re-run `autoddl plan` for this graph")
        live_outs = [nd for nd, m in zip(sig.outputs, op.outputs) if m.dtype != "none"]
        locals_: list[torch.Tensor] = []
        for slot, ref in enumerate(op.inputs):
            want = sig.inputs[slot]
            boxed = self._boxed_input(ref, want, op)
            locals_.append(boxed.to_local(grad_placements=grad_placements_for(want, live_outs)))
        if self.use_ops_rules:
            args, kwargs = ops_local_args(op, sig, self.mesh_shape)
            kernel = ops_local_kernel(op, sig, self.mesh_shape, self.coord) or n.target
        else:
            args, kwargs = fallback_local_args(op, sig, self.mesh_shape)
            kernel = n.target
        position = [0]
        args = _substitute(args, locals_, position)
        kwargs = _substitute(kwargs, locals_, position)
        args, kwargs = localize_devices(args, kwargs, self.device)  # traced on meta
        out = kernel(*args, **kwargs)
        if not self.use_ops_rules:
            scale = _mean_scale(n, op, locals_)
            if scale != 1.0:
                out = out * scale
        return self._wrap(op, sig, out, has_inputs=bool(op.inputs))

    def _boxed_input(self, ref: TensorRef, want: NdSbp, op: OpNode) -> DTensor:
        key = (ref.node, ref.index, want)
        if key in self._cache:
            return self._cache[key]
        value = self.env[self._by_name[ref.node]]
        if isinstance(value, (tuple, list)):
            value = value[ref.index]
        if not isinstance(value, DTensor):
            raise PlanExecutionError(f"op {op.name}: input {ref} is a {type(value).__name__}, not a DTensor")
        producer = self.opgraph[ref.node]
        placements = want.to_placements()
        if self.recorder is not None:
            self.recorder.tensor = str(ref)
        if producer.kind is NodeKind.PARAMETER:
            # a detached leaf per (parameter, use NdSbp); the runtime syncs its grad to storage
            boxed = box(value.detach(), placements).detach().requires_grad_(value.requires_grad)
            self.param_uses[producer.target].append(boxed)
        else:
            boxed = box(value, placements)
        if self.recorder is not None:
            self.recorder.tensor = ""
        self._cache[key] = boxed
        return boxed

    def _wrap(self, op: OpNode, sig: Signature, out: Any, *, has_inputs: bool) -> Any:
        if isinstance(out, (tuple, list)):
            return type(out)(
                self._from_local(op, i, t, sig.outputs[i], has_inputs) if isinstance(t, torch.Tensor) else t
                for i, t in enumerate(out))
        return self._from_local(op, 0, out, sig.outputs[0], has_inputs)

    def _from_local(self, op: OpNode, i: int, local: torch.Tensor, nd: NdSbp, has_inputs: bool) -> DTensor:
        meta: TensorMeta = op.outputs[i]
        if not has_inputs:  # a factory op (zeros, arange, ...) computed the full tensor: cut it locally
            return place(local, nd, self.mesh)
        expected = nd.local_shape(meta.shape, self.mesh_shape)
        if tuple(local.shape) != expected:
            raise PlanExecutionError(
                f"op {op.name} ({op.target}) output {i}: local shape {tuple(local.shape)} but the plan's "
                f"{nd} of global {list(meta.shape)} needs {expected}; the signature "
                f"{self.plan.signatures[op.name]} is not valid for this op, or the op's shape "
                f"arguments need rewriting in autoddl.ops.local_args")
        return DTensor.from_local(local, self.mesh, nd.to_placements(), run_check=False,
                                  shape=torch.Size(meta.shape), stride=_contiguous_stride(meta.shape))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))

