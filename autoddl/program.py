"""The step program: a plan lowered once into the tasks one rank runs in a training step.

``lower(graph, plan) -> StepProgram`` is pure. The program says, per rank:

- how every op input is obtained (``op_inputs``): an activation boxed from its
  producer's layout to the layout the op wants (an ``EdgeBox``: forward moves,
  and the backward moves of its gradient), or a parameter use (a ``ParamUse``:
  storage -> use layout forward, gradient -> storage as the gradient sync);
- the gradient-sync buckets: parameter uses whose sync is one collective of one
  kind on one mesh axis (or over several axes' flattened group: data parallel's all-reduce,
  ZeRO's reduce-scatter: autoddl.boxing), packed
  in the order their gradients become ready in backward, up to ``plan.training.bucket_mb``, launched asynchronously as each
  fills (as DistributedDataParallel's Reducer does);
- the ordered ``tasks`` with dependencies, each on a stream (``compute``, or
  ``comm<axis>`` for the collectives of a mesh axis, ``comm0+1`` for those over axes 0 and 1
  flattened, ``p2p`` for pipeline sends, ``copy_h2d`` / ``copy_d2h`` for host copies and
  ``host`` for an optimizer step on the host: autoddl/offload.py)
  of one pipeline rank (``pp_rank``; autoddl/pipeline_program.py): forward ops and the
  collectives boxing their inputs, backward ops in reverse with their gradients'
  collectives, the buckets, the remaining syncs, the optimizer (and, spilling, the host copies).

The cost model simulates the tasks' timeline (costmodel/simulate.py); the
executor compiles ``op_inputs``/edges/param uses/buckets into a local fx program
(executor/compiled.py) and audits the collectives that ran against
:meth:`StepProgram.collectives`. Semantics written once: the boxing
decomposition and the gradient rule (autoddl/boxing.py), the layouts (below).

How the program is built (deferred gradient reductions, layer-group gathers, bucket order,
issue order) is autoddl/lowering.py's.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Union

from autoddl.boxing import Group, Move, group_axes, group_name
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef
from autoddl.op_families import MATMUL_LIKE, ZERO_COST
from autoddl.plan import Plan
from autoddl.sbp import NdSbp, Signature

if TYPE_CHECKING:
    from autoddl.offload import SpillGroup
    from autoddl.pipeline_program import PipelineLayout

COMPUTE = "compute"
PHASES = ("forward", "recompute", "backward", "grad_sync", "optimizer", "offload")   # offload: host copies


def comm_stream(group: Group) -> str:
    """The stream of a collective's group: ``comm1`` for mesh axis 1, ``comm0+1`` for axes 0 and 1
    flattened (a process group of its own, so a queue of its own: gloo and NCCL run each group's
    collectives in order on that group's own thread / communicator)."""
    return f"comm{group_name(group)}"


# -- layouts of a plan ----------------------------------------------------------------------------

def signature_of(plan: Plan, node: OpNode) -> Signature:
    """The plan's signature for an op / input / buffer node, checked against the node. A
    ``getitem`` the plan does not name reads its output of a multi-output op as that op holds it."""
    sig = plan.signatures.get(node.name)
    if sig is not None and _fits(sig, len(node.inputs) if node.kind is NodeKind.OP else 0, len(node.outputs),
                                 len(plan.mesh.shape)):
        return sig                                 # the common case, its check memoised
    if sig is None and node.target == "getitem" and node.inputs:
        ref = node.inputs[0]
        held = plan.signatures[ref.node].outputs[ref.index] if ref.node in plan.signatures else None
        if held is not None:
            return Signature((held,), (held,))
    what = {NodeKind.OP: "op", NodeKind.INPUT: "input", NodeKind.BUFFER: "buffer"}.get(node.kind, node.kind.value)
    if sig is None:
        raise ValueError(f"plan {plan.name!r}: signatures has no entry for {what} {node.name!r} "
                         f"({node.target}); every op, input and buffer needs one (e.g. '-> [B]' for an input)")
    n_in = len(node.inputs) if node.kind is NodeKind.OP else 0
    if len(sig.inputs) != n_in or len(sig.outputs) != len(node.outputs):
        raise ValueError(f"plan {plan.name!r}: signature {sig} of {what} {node.name!r} ({node.target}) has "
                         f"{len(sig.inputs)} inputs / {len(sig.outputs)} outputs; the node has {n_in} tensor "
                         f"inputs / {len(node.outputs)} outputs")
    for nd in sig.inputs + sig.outputs:
        if len(nd) != plan.mesh.ndim:
            raise ValueError(f"plan {plan.name!r}: signature {sig} of {what} {node.name!r} has an NdSbp "
                             f"{nd} of {len(nd)} axes; the mesh {plan.mesh} has {plan.mesh.ndim}")
    return sig


@functools.lru_cache(maxsize=1 << 16)
def _fits(sig: Signature, n_in: int, n_out: int, ndim: int) -> bool:
    """``sig`` has ``n_in`` inputs, ``n_out`` outputs and ``ndim`` axes in each NdSbp (signature_of's check)."""
    return len(sig.inputs) == n_in and len(sig.outputs) == n_out and all(len(nd) == ndim
                                                                        for nd in sig.inputs + sig.outputs)


def storage_of(plan: Plan, fqn: str) -> NdSbp:
    nd = plan.param_storage.get(fqn)
    if nd is None:
        raise ValueError(f"plan {plan.name!r}: param_storage has no entry for parameter {fqn!r}; "
                         "give every parameter a storage NdSbp (e.g. [B] for data parallel)")
    if len(nd) != plan.mesh.ndim:
        raise ValueError(f"plan {plan.name!r}: storage {nd} of parameter {fqn!r} has {len(nd)} axes; "
                         f"the mesh {plan.mesh} has {plan.mesh.ndim}")
    return nd


def optimizer_storage_of(plan: Plan, fqn: str) -> NdSbp:
    """Where parameter ``fqn``'s optimizer states and the master they update live (ZeRO-1/2)."""
    return plan.optimizer_storage.get(fqn) or storage_of(plan, fqn)


def grad_storage_of(plan: Plan, fqn: str) -> NdSbp:
    """The layout parameter ``fqn``'s gradient is reduced to: the optimizer storage under ZeRO-2,
    else the parameter storage (ZeRO-1 reduces the whole gradient and keeps its piece)."""
    return plan.grad_storage.get(fqn) or storage_of(plan, fqn)


def layout_of(graph: OpGraph, plan: Plan, ref: TensorRef) -> NdSbp:
    """The NdSbp a producer output is held in: a parameter's storage, else its node's signature."""
    node = graph[ref.node]
    if node.kind is NodeKind.PARAMETER:
        return storage_of(plan, node.target)
    return signature_of(plan, node).outputs[ref.index]


def used_parameters(graph: OpGraph) -> dict[str, OpNode]:
    """Parameter nodes by fqn that some node reads. torch.export lists a tied weight (GPT's
    wte / lm_head) once per name, with only one placeholder used: the unused alias holds no
    memory of its own and gets no gradient."""
    return {fqn: n for fqn, n in graph.parameters().items() if graph.nx.out_degree(n.name) > 0}


def requires_grad(graph: OpGraph) -> frozenset[str]:
    """Names of nodes whose outputs need a gradient: floating parameters and ops downstream of one
    (worked out once per graph: the 3-D search asks for a 70B model's hundreds of times)."""
    if graph not in _REQUIRES_GRAD:
        _REQUIRES_GRAD[graph] = frozenset(_requires_grad(graph))
    return _REQUIRES_GRAD[graph]


_REQUIRES_GRAD: "weakref.WeakKeyDictionary[OpGraph, frozenset[str]]" = weakref.WeakKeyDictionary()


def _requires_grad(graph: OpGraph) -> set[str]:
    out: set[str] = set()
    for n in graph.topo():
        if n.kind is NodeKind.PARAMETER and n.outputs and n.outputs[0].is_floating:
            out.add(n.name)
        elif n.is_op and any(r.node in out for r in n.inputs) and any(o.is_floating for o in n.outputs):
            out.add(n.name)
    return out


@functools.lru_cache(maxsize=1 << 16)
def layer_group(fqn: str) -> str:
    """The repeated block a parameter belongs to: its fqn up to the first numeric part
    (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``), else ``root`` (as FSDP2's
    root module holds what no block does)."""
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return "root"


def block_of(node: OpNode) -> str:
    """The repeated block an op runs in, from its module path (``transformer.h.3.attn`` ->
    ``transformer.h.3``), else ``root``: the unit activation recompute is decided for."""
    return layer_group(f"{node.module_path}.op") if node.module_path else "root"


def runs_as_one_mm(node: OpNode) -> bool:
    """Whether ``node`` runs as exactly one aten ``mm`` / ``addmm`` (``ALTERNATE_MM_ATEN``): mm, addmm,
    a linear (a 2-D weight; its input's leading dims folded), a matmul of a 2-D second operand and an
    at least 2-D first (torch folds it into one mm: aten/src/ATen/native/LinearAlgebra.cpp
    ``_matmul_impl``)."""
    if node.op_name in ("mm", "addmm", "linear"):
        return True
    metas = node.input_metas
    return node.op_name == "matmul" and len(metas) == 2 and len(metas[1].shape) == 2 and len(metas[0].shape) >= 2


def selective_recomputes(ops: Sequence[OpNode]) -> list[OpNode]:
    """The ops of one block (forward order) that torchtitan's op-level selective activation
    checkpointing recomputes: every op but views, the matmul-like ops (whose outputs it saves) and
    every odd 2-D product; the 2nd, 4th, ... product of the block (``runs_as_one_mm``) is recomputed
    too. torchtitan (torchtitan/models/llama/parallelize_llama.py, ``_apply_ac_to_transformer_block``
    at commit 9dec370): ``_save_list`` = {aten.mm, SDPA flash / efficient, reduce_scatter, ...}, and
    "Saves output of all compute ops, except every second mm", counting ``aten.mm`` per checkpointed
    block (a fresh ``meta`` per ``context_fn`` call). Its Llama's linears have no bias; a biased one
    (addmm) counts here as one mm."""
    out, products = [], 0
    for node in ops:
        if node.op_name in ZERO_COST:
            continue
        if runs_as_one_mm(node):
            products += 1
            if products % 2 == 0:
                out.append(node)
        elif node.op_name not in MATMUL_LIKE:
            out.append(node)
    return out


def recomputed_ops(graph: OpGraph, plan: Plan) -> dict[str, list[OpNode]]:
    """Per block recomputed under ``plan.training``, the ops its backward runs forward again, in
    forward order: every op of the block (``full``), or ``selective_recomputes`` of its ops
    (``selective``, torchtitan's selective-op policy)."""
    blocks: dict[str, list[OpNode]] = {}
    for node in graph.ops():
        block = block_of(node)
        if plan.training.recompute_of(block) != "none":
            blocks.setdefault(block, []).append(node)
    out = {}
    for block, ops in blocks.items():
        chosen = ops if plan.training.recompute_of(block) == "full" else selective_recomputes(ops)
        if chosen:
            out[block] = chosen
    return out


def work_divisor(sig: Signature, mesh_shape: Sequence[int]) -> int:
    """How many devices share an op's work: the product of the mesh sizes of the axes on which
    some input or output is split (a contracted split gives P outputs but still splits the work;
    an axis where everything is B or P runs the op full-size on every device)."""
    return _work_divisor(sig, tuple(mesh_shape))


@functools.lru_cache(maxsize=1 << 16)
def _work_divisor(sig: Signature, mesh_shape: tuple[int, ...]) -> int:
    nds = sig.inputs + sig.outputs
    return math.prod(n for axis, n in enumerate(mesh_shape) if any(nd[axis].is_split() for nd in nds))


def syncs_every_micro_step(uses: Sequence["ParamUse"], pipelined: bool = False) -> bool:
    """Whether these uses' gradient sync runs on every micro-step: only when it is reduce-scatters
    alone (sharded gradients, as FSDP); any other sync waits for the last micro-step (``no_sync``).
    With pipeline stages (``pipelined``) the gradients of ZeRO-3 gathered groups are reduce-scattered
    once per step too (autoddl/lowering.py: kept gathered, accumulated unsharded)."""
    return (all(m.kind is CollectiveKind.REDUCE_SCATTER for u in uses for m in u.grad_sync if m.kind is not None)
            and not (pipelined and any(u.gather >= 0 for u in uses)))


# -- the program ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BoxKey:
    """One boxing of a producer output: to layout ``dst``, its consumers handing back ``grad``
    (None when no gradient flows), in pipeline stage ``stage`` (0 without stages: a stage boxes what
    it reads on its own ranks). Consumers with the same key share the boxed tensor."""

    node: str
    index: int
    dst: NdSbp
    grad: NdSbp | None
    stage: int = 0


@dataclass(frozen=True)
class EdgeBox:
    key: BoxKey
    meta: TensorMeta
    src: NdSbp
    label: str                       # "producer->first consumer"
    forward: tuple[Move, ...]
    backward: tuple[Move, ...]       # gradient -> what the producer needs; () without a gradient


@dataclass(frozen=True)
class ParamUse:
    """A parameter read in layout ``dst``; its gradient (``grad``) goes back to ``storage``."""

    index: int
    fqn: str
    meta: TensorMeta
    storage: NdSbp
    dst: NdSbp
    grad: NdSbp | None
    forward: tuple[Move, ...]        # storage -> dst (ZeRO-3 / FSDP: an all-gather)
    grad_sync: tuple[Move, ...]      # grad -> storage (data parallel: an all-reduce)
    bucket: int = -1                 # index into StepProgram.buckets, -1 when synced on its own
    gather: int = -1                 # index into StepProgram.gathers, -1 when moved on its own


@dataclass(frozen=True)
class GatherGroup:
    """The all-gathers of one layer group's sharded parameters (ZeRO-3 / FSDP), done as one
    collective over their flattened shards, launched one group ahead of use (as FSDP2 prefetches).
    As FSDP2's ``reshard_after_forward``, the gathered parameters are freed once forward is done
    with the group and gathered again when backward reaches it (when the group's last op has an
    output with a gradient to hook; otherwise they stay until the step ends)."""

    index: int
    group: str                       # "transformer.h.3", or "root" for parameters outside any block
    axis: Group                      # a mesh axis, or ZeRO-3 over several: their flattened group
    uses: tuple[int, ...]            # ParamUse indices
    nbytes: int                      # M of the one all-gather: the gathered tensors' bytes added up
    last_consumer: str = ""          # the last op forward uses the group in
    reshard: bool = False            # freed after that op's forward, gathered again before its backward

    def gathers_per_step(self, micro_batches: int, pipelined: bool) -> int:
        """How many times one step all-gathers the group: once with pipeline stages (a stage keeps its
        groups gathered for the step), else once per micro-step, twice where it is freed after forward
        and gathered again for backward (``reshard``). The working-copy casts (costmodel/master_passes.py)
        and the copies around the gather (costmodel/copy_passes.py) run once per gather."""
        if pipelined:
            return 1
        return micro_batches * (2 if self.reshard else 1)


@dataclass(frozen=True)
class Bucket:
    """Gradients synced together: one collective of ``kind`` over their flat buffer, on mesh axis
    ``axis`` or (data parallel over several mesh axes: P on each -> B) one all-reduce over the
    flattened group of a tuple of axes (autoddl.boxing.flatten_all_reduces)."""

    index: int
    kind: CollectiveKind
    axis: Group
    uses: tuple[int, ...]            # ParamUse indices, in the order their gradients become ready
    nbytes: int                      # M of the collective: the uses' M added up

    @property
    def axes(self) -> tuple[int, ...]:
        return group_axes(self.axis)


@dataclass(frozen=True)
class ParamSync:
    """ZeRO-1/2: after the optimizer updated each rank's piece (``optimizer_storage``) of these
    parameters, one all-gather on ``axis`` (a mesh axis, or several axes' flattened group) of the
    flattened pieces rebuilds them in their storage."""

    axis: Group
    fqns: tuple[str, ...]
    nbytes: int                      # M of the all-gather: the gathered parameters' bytes
    pp_rank: int = 0                 # with pipeline stages: the pp rank whose parameters these are


InputSource = Union[BoxKey, int]     # an edge, or a ParamUse index


@dataclass(frozen=True)
class Task:
    id: int
    phase: str                       # one of PHASES
    stream: str                      # COMPUTE or comm_stream(axis or group)
    deps: tuple[int, ...]
    op: str = ""                     # graph node whose work or input this is
    collective: CollectiveKind | None = None   # before backend emulation
    axis: Group = -1                 # a mesh axis, or a tuple of axes flattened into one group
    nbytes: int = 0                  # M of the collective
    tensor: str = ""                 # what a collective moves: "producer->consumer", a fqn, "bucket3"
    local_flops: float = 0.0         # compute: this rank's share of the op's forward FLOPs
    local_bytes: float = 0.0
    micro_step: int = 0              # which micro-step of the optimizer step (Training.micro_batches)
    pp_rank: int = 0                 # which pipeline rank runs it (autoddl/pipeline.py; 0 without stages)
    copy: str = ""                   # a host copy (autoddl/offload.py): "h2d" or "d2h" of ``nbytes``
    host_waits: bool = True          # the host waits for it where it is issued; False: a collective launched
                                     # asynchronously (gradient buckets, prefetched gathers, the loss's all-reduce)

    @property
    def is_collective(self) -> bool:
        return self.collective is not None

    @property
    def is_copy(self) -> bool:
        return bool(self.copy)


@dataclass
class StepProgram:
    plan_name: str
    mesh_shape: tuple[int, ...]
    tasks: list[Task] = field(default_factory=list)
    op_inputs: dict[str, tuple[InputSource, ...]] = field(default_factory=dict)
    edges: dict[BoxKey, EdgeBox] = field(default_factory=dict)
    param_uses: list[ParamUse] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    gathers: list[GatherGroup] = field(default_factory=list)
    loss: BoxKey | None = None
    loss_async: bool = False         # the loss's all-reduce is waited for at the step's end only
    loss_bucket: int = -1            # the bucket whose all-reduce carries the loss as one more element
    param_syncs: list["ParamSync"] = field(default_factory=list)   # ZeRO-1/2: after the optimizer
    pipeline: "PipelineLayout | None" = None   # stages and schedule (autoddl/pipeline_program.py)
    spills: list["SpillGroup"] = field(default_factory=list)   # offload params: groups kept on the host

    def collectives(self) -> list[Task]:
        """The collective tasks in issue order (what the audit compares with)."""
        return [t for t in self.tasks if t.is_collective]

    def copies(self) -> list[Task]:
        """The host copy tasks in issue order (autoddl/offload.py; what the executor's copies match)."""
        return [t for t in self.tasks if t.is_copy]

    def uses_of(self, fqn: str) -> list[ParamUse]:
        return [u for u in self.param_uses if u.fqn == fqn]



def lower(graph: OpGraph, plan: Plan, *, loss_at_forward: bool = False) -> StepProgram:
    """The step program of ``plan`` for ``graph`` (autoddl/lowering.py builds it). With
    ``loss_at_forward`` every rank reads the loss as soon as forward ends (a module whose forward
    returns it); otherwise it may be read only after the step's gradient sync, which can carry it."""
    from autoddl.lowering import lower_program

    return lower_program(graph, plan, loss_at_forward=loss_at_forward)
