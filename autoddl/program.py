"""The step program: a plan lowered once into the tasks one rank runs in a training step.

``lower(graph, plan) -> StepProgram`` is pure. The program says, per rank:

- how every op input is obtained (``op_inputs``): an activation boxed from its
  producer's layout to the layout the op wants (an ``EdgeBox``: forward moves,
  and the backward moves of its gradient), or a parameter use (a ``ParamUse``:
  storage -> use layout forward, gradient -> storage as the gradient sync);
- the gradient-sync buckets: parameter uses whose sync is one collective of one
  kind on one mesh axis, packed in the order their gradients become ready in
  backward, up to ``plan.training.bucket_mb``, launched asynchronously as each
  fills (as DistributedDataParallel's Reducer does);
- the ordered ``tasks`` with dependencies, each on a stream (``compute``, or
  ``comm<axis>`` for the collectives of a mesh axis): forward ops and the
  collectives boxing their inputs, backward ops in reverse with their gradients'
  collectives, the buckets, the remaining syncs, the optimizer.

The cost model simulates the tasks' timeline (costmodel/simulate.py); the
executor compiles ``op_inputs``/edges/param uses/buckets into a local fx program
(executor/compiled.py) and audits the collectives that ran against
:meth:`StepProgram.collectives`. Semantics written once: the boxing
decomposition and the gradient rule (autoddl/boxing.py), the layouts (below).

Deferred gradient reductions: an op computed the same way on every rank of a mesh axis (its
inputs all B there) whose inputs come only from parameters, from tensors without a gradient
or from other such ops (GPT's position embedding: ``wpe[arange(T)]``) may take a P gradient
there: its backward is linear in the gradient and its saved inputs are the same everywhere, so
every rank's share goes through it and reaches the parameters' gradients as P, which the
bucketed, asynchronous gradient sync reduces, instead of a synchronous all-reduce of the
activation's gradient in the middle of backward (what DDP does, since it reduces gradients
only). This happens on an axis only where some consumer hands back P.

Issue order: forward and backward collectives are synchronous (the op waits for
its input), so each such task depends on the one issued before it; a bucket
depends on the backward tasks that made its gradients ready and on the previous
bucket (ranks must launch buckets in the same order); the optimizer waits for
every sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence, Union

from autoddl.boxing import Move, gradient_moves, grad_ndsbp, boxing_moves, needed_grad_ndsbp
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef
from autoddl.plan import Plan
from autoddl.sbp import NdSbp, Partial, Signature

COMPUTE = "compute"
PHASES = ("forward", "backward", "grad_sync", "optimizer")


def comm_stream(axis: int) -> str:
    return f"comm{axis}"


# -- layouts of a plan ----------------------------------------------------------------------------

def signature_of(plan: Plan, node: OpNode) -> Signature:
    """The plan's signature for an op / input / buffer node, checked against the node. A
    ``getitem`` the plan does not name reads its output of a multi-output op as that op holds it."""
    sig = plan.signatures.get(node.name)
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


def storage_of(plan: Plan, fqn: str) -> NdSbp:
    nd = plan.param_storage.get(fqn)
    if nd is None:
        raise ValueError(f"plan {plan.name!r}: param_storage has no entry for parameter {fqn!r}; "
                         "give every parameter a storage NdSbp (e.g. [B] for data parallel)")
    if len(nd) != plan.mesh.ndim:
        raise ValueError(f"plan {plan.name!r}: storage {nd} of parameter {fqn!r} has {len(nd)} axes; "
                         f"the mesh {plan.mesh} has {plan.mesh.ndim}")
    return nd


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


def requires_grad(graph: OpGraph) -> set[str]:
    """Names of nodes whose outputs need a gradient: floating parameters and ops downstream of one."""
    out: set[str] = set()
    for n in graph.topo():
        if n.kind is NodeKind.PARAMETER and n.outputs and n.outputs[0].is_floating:
            out.add(n.name)
        elif n.is_op and any(r.node in out for r in n.inputs) and any(o.is_floating for o in n.outputs):
            out.add(n.name)
    return out


def layer_group(fqn: str) -> str:
    """The repeated block a parameter belongs to: its fqn up to the first numeric part
    (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``), else ``root`` (as FSDP2's
    root module holds what no block does)."""
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return "root"


def work_divisor(sig: Signature, mesh_shape: Sequence[int]) -> int:
    """How many devices share an op's work: the product of the mesh sizes of the axes on which
    some input or output is split (a contracted split gives P outputs but still splits the work;
    an axis where everything is B or P runs the op full-size on every device)."""
    nds = sig.inputs + sig.outputs
    return math.prod(n for axis, n in enumerate(mesh_shape) if any(nd[axis].is_split() for nd in nds))


# -- the program ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BoxKey:
    """One boxing of a producer output: to layout ``dst``, its consumers handing back ``grad``
    (None when no gradient flows). Consumers with the same key share the boxed tensor."""

    node: str
    index: int
    dst: NdSbp
    grad: NdSbp | None


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
    axis: int
    uses: tuple[int, ...]            # ParamUse indices
    nbytes: int                      # M of the one all-gather: the gathered tensors' bytes added up
    last_consumer: str = ""          # the last op forward uses the group in
    reshard: bool = False            # freed after that op's forward, gathered again before its backward


@dataclass(frozen=True)
class Bucket:
    index: int
    kind: CollectiveKind
    axis: int
    uses: tuple[int, ...]            # ParamUse indices, in the order their gradients become ready
    nbytes: int                      # M of the one collective: the uses' M added up


InputSource = Union[BoxKey, int]     # an edge, or a ParamUse index


@dataclass(frozen=True)
class Task:
    id: int
    phase: str                       # one of PHASES
    stream: str                      # COMPUTE or comm_stream(axis)
    deps: tuple[int, ...]
    op: str = ""                     # graph node whose work or input this is
    collective: CollectiveKind | None = None   # before backend emulation
    axis: int = -1
    nbytes: int = 0                  # M of the collective
    tensor: str = ""                 # what a collective moves: "producer->consumer", a fqn, "bucket3"
    local_flops: float = 0.0         # compute: this rank's share of the op's forward FLOPs
    local_bytes: float = 0.0

    @property
    def is_collective(self) -> bool:
        return self.collective is not None


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

    def collectives(self) -> list[Task]:
        """The collective tasks in issue order (what the audit compares with)."""
        return [t for t in self.tasks if t.is_collective]

    def uses_of(self, fqn: str) -> list[ParamUse]:
        return [u for u in self.param_uses if u.fqn == fqn]


def consumer_grad(sig: Signature, slot: int, deferred: frozenset[int]) -> NdSbp:
    """The gradient layout an op hands back for input ``slot``: the gradient rule, with P on the
    axes where the op's own output gradient arrives deferred (P)."""
    grad = grad_ndsbp(sig.inputs[slot], sig.outputs)
    if not deferred:
        return grad
    return NdSbp(tuple(Partial() if axis in deferred else s for axis, s in enumerate(grad)))


def deferred_reductions(graph: OpGraph, plan: Plan, rg: set[str]) -> dict[str, frozenset[int]]:
    """Per op, the mesh axes on which it takes its output's gradient as P (module docstring): ops
    replicated there whose inputs are parameters, gradient-free tensors or such ops, and some
    consumer of which hands back P there. Forward pass for "replicated from parameters", then a
    reverse pass for "some consumer hands back P" (a consumer's own deferral counts)."""
    ndim = plan.mesh.ndim
    pure: dict[str, frozenset[int]] = {}
    for node in graph.ops():
        if node.name not in rg:
            continue
        sig = signature_of(plan, node)
        pure[node.name] = frozenset(
            a for a in range(ndim)
            if all(nd[a].is_broadcast() for nd in sig.inputs + sig.outputs)
            and all(_gradient_source(graph, ref.node, rg, pure, a) for ref in node.inputs))
    deferred: dict[str, frozenset[int]] = {}
    for node in reversed(graph.ops()):
        axes = pure.get(node.name, frozenset())
        if not axes:
            continue
        handed = [consumer_grad(signature_of(plan, c), slot, deferred.get(c.name, frozenset()))
                  for c, _, slot in graph.uses(node.name) if c.is_op and c.name in rg]
        deferred[node.name] = frozenset(a for a in axes if any(g[a].is_partial() for g in handed))
    return {k: v for k, v in deferred.items() if v}


def _gradient_source(graph: OpGraph, name: str, rg: set[str], pure: dict[str, frozenset[int]], axis: int) -> bool:
    """True when a P gradient may reach node ``name`` on ``axis``: a parameter (its sync reduces it),
    a tensor without a gradient, or an op replicated from parameters on that axis."""
    node = graph[name]
    return node.kind is NodeKind.PARAMETER or name not in rg or axis in pure.get(name, frozenset())


def lower(graph: OpGraph, plan: Plan) -> StepProgram:
    """The step program of ``plan`` for ``graph`` (module docstring)."""
    return _Lowering(graph, plan).run()


BUCKETED_KINDS = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)   # the gradient reductions
FIRST_BUCKET_BYTES = 1_000_000   # DDP's first bucket: torch/nn/parallel/distributed.py _DEFAULT_FIRST_BUCKET_BYTES
GATHER_MIN_BYTES = 1_000_000     # smallest ZeRO-3 gather group (smaller layer groups merge with the next)


class _Lowering:
    """Builds one StepProgram: forward in graph order, then backward in reverse, then the sync."""

    def __init__(self, graph: OpGraph, plan: Plan):
        self.graph, self.plan, self.mesh = graph, plan, tuple(plan.mesh.shape)
        self.rg = requires_grad(graph)
        self.prog = StepProgram(plan.name, self.mesh)
        self.last: int | None = None                       # the task issued last on the host thread
        self.first_consumer: dict[InputSource, str] = {}   # forward order: gradient complete after it
        self._uses: dict[tuple[str, NdSbp, NdSbp | None], int] = {}
        self.async_tasks: list[int] = []                   # launched without the host waiting
        self.gather_of: dict[tuple[str, NdSbp, NdSbp | None], int] = {}   # use key -> gather group
        self.gather_specs: list[list] = []                 # [layer group, axis, M bytes] per gather group
        self.gather_task: dict[int, int] = {}              # gather group -> its task
        self.wait_for: list[int] = []                      # prefetched gathers the next op waits for
        self.deferred: dict[str, frozenset[int]] = {}      # op -> axes its output gradient arrives P on

    def run(self) -> StepProgram:
        ops = self.graph.ops()
        self.deferred = deferred_reductions(self.graph, self.plan, self.rg)
        self.plan_gathers(ops)
        for node in ops:
            self.forward_op(node)
        last = {}
        for node in ops:
            for source in self.prog.op_inputs[node.name]:
                if isinstance(source, int) and self.prog.param_uses[source].gather >= 0:
                    last[self.prog.param_uses[source].gather] = node.name
        self.prog.gathers = [GatherGroup(i, group, axis, tuple(u.index for u in self.prog.param_uses if u.gather == i),
                                         nbytes, last.get(i, ""), last.get(i, "") in self.rg)
                             for i, (group, axis, nbytes) in enumerate(self.gather_specs)]
        self.loss_output()
        self.pack_buckets(ops)
        self.backward(ops)
        self.optimizer()
        return self.prog

    # -- issuing tasks ----------------------------------------------------------------------------
    def emit(self, *, host: bool = True, deps: tuple[int, ...] | None = None, **fields) -> Task:
        if deps is None:
            deps = () if self.last is None else (self.last,)
        task = Task(id=len(self.prog.tasks), deps=deps, **fields)
        self.prog.tasks.append(task)
        if host:
            self.last = task.id
        return task

    def emit_moves(self, moves: Sequence[Move], phase: str, tensor: str, op: str, host: bool = True) -> None:
        for m in moves:
            if m.kind is not None:
                task = self.emit(host=host, phase=phase, stream=comm_stream(m.axis), op=op, collective=m.kind,
                                 axis=m.axis, nbytes=m.nbytes, tensor=tensor)
                if not host:
                    self.async_tasks.append(task.id)

    # -- forward ----------------------------------------------------------------------------------
    def forward_op(self, node: OpNode) -> None:
        sig = signature_of(self.plan, node)
        sources = tuple(self.source(node, sig, slot, ref) for slot, ref in enumerate(node.inputs))
        self.prog.op_inputs[node.name] = sources
        share = work_divisor(sig, self.mesh)
        deps = ((self.last,) if self.last is not None else ()) + tuple(self.wait_for)
        self.wait_for = []
        self.emit(deps=deps, phase="forward", stream=COMPUTE, op=node.name, local_flops=node.flops / share,
                  local_bytes=(node.bytes_read + node.bytes_written) / share)

    def input_layout(self, node: OpNode, sig: Signature, slot: int) -> tuple[NdSbp, NdSbp | None]:
        """(the layout op ``node`` reads input ``slot`` in, the gradient layout it hands back or None)."""
        ref = node.inputs[slot]
        meta = self.graph.meta_of(ref)
        flows = ref.node in self.rg and meta.is_floating and node.name in self.rg
        return sig.inputs[slot], consumer_grad(sig, slot, self.deferred.get(node.name, frozenset())) if flows else None

    def source(self, node: OpNode, sig: Signature, slot: int, ref: TensorRef) -> InputSource:
        producer = self.graph[ref.node]
        meta = producer.outputs[ref.index]
        dst, grad = self.input_layout(node, sig, slot)
        if producer.kind is NodeKind.PARAMETER:
            return self.param_use(producer, meta, dst, grad, node.name)
        return self.edge(ref, meta, dst, grad, node.name)

    # -- ZeRO-3 / FSDP gathers, per layer group --------------------------------------------------------
    def plan_gathers(self, ops: list[OpNode]) -> None:
        """Group the parameter uses whose move is one all-gather by (layer group, mesh axis), in the
        order forward first needs them: each group becomes one all-gather of its flattened shards."""
        groups: dict[tuple[str, int], int] = {}
        for node in ops:
            sig = signature_of(self.plan, node)
            for slot, ref in enumerate(node.inputs):
                producer = self.graph[ref.node]
                if producer.kind is not NodeKind.PARAMETER:
                    continue
                key = (producer.target, *self.input_layout(node, sig, slot))
                moves = boxing_moves(producer.outputs[0].nbytes, storage_of(self.plan, key[0]), key[1], self.mesh)
                if key in self.gather_of or [m.kind for m in moves] != [CollectiveKind.ALL_GATHER]:
                    continue
                group = (layer_group(key[0]), moves[0].axis)
                if group not in groups:
                    groups[group] = len(self.gather_specs)
                    self.gather_specs.append([group[0], group[1], 0])
                self.gather_of[key] = groups[group]
                self.gather_specs[groups[group]][2] += moves[0].nbytes
        self.merge_small_gathers()

    def merge_small_gathers(self) -> None:
        """Layer groups smaller than ``GATHER_MIN_BYTES`` join the next group on the same axis, as a
        user wraps FSDP2 units around blocks of some size: one small all-gather costs its latency,
        not its bytes (a VGG layer is a few KB)."""
        merged: list[list] = []
        index: list[int] = []
        for name, axis, nbytes in self.gather_specs:
            if merged and merged[-1][1] == axis and merged[-1][2] < GATHER_MIN_BYTES:
                merged[-1][0] = f"{merged[-1][0].split('..')[0]}..{name}"
                merged[-1][2] += nbytes
            else:
                merged.append([name, axis, nbytes])
            index.append(len(merged) - 1)
        self.gather_of = {key: index[g] for key, g in self.gather_of.items()}
        self.gather_specs = merged

    def gathered(self, group: int, consumer: str) -> None:
        """A use of gather ``group`` is needed by ``consumer``: launch the group unless it was
        prefetched (then the consumer waits for it), and prefetch the next group asynchronously."""
        if group in self.gather_task:
            self.wait_for.append(self.gather_task[group])
        else:
            self.launch_gather(group, consumer, host=True)
        if group + 1 < len(self.gather_specs) and group + 1 not in self.gather_task:
            self.launch_gather(group + 1, consumer, host=False)

    def launch_gather(self, group: int, consumer: str, host: bool) -> None:
        name, axis, nbytes = self.gather_specs[group]
        task = self.emit(host=host, phase="forward", stream=comm_stream(axis), op=consumer,
                         collective=CollectiveKind.ALL_GATHER, axis=axis, nbytes=nbytes, tensor=f"gather {name}")
        self.gather_task[group] = task.id

    def edge(self, ref: TensorRef, meta: TensorMeta, dst: NdSbp, grad: NdSbp | None, consumer: str,
             host: bool = True) -> BoxKey:
        key = BoxKey(ref.node, ref.index, dst, grad)
        if key not in self.prog.edges:
            src = layout_of(self.graph, self.plan, ref)
            label = f"{ref}->{consumer}"
            backward = (gradient_moves(meta.nbytes, grad, src, self.mesh, self.deferred.get(ref.node, frozenset()))
                        if grad is not None else ())
            self.prog.edges[key] = EdgeBox(key, meta, src, label, boxing_moves(meta.nbytes, src, dst, self.mesh),
                                           backward)
            charge = ref.node if consumer == "output" else consumer     # per-op times add up
            self.emit_moves(self.prog.edges[key].forward, "forward", label, charge, host)
            self.first_consumer[key] = consumer
        return key

    def param_use(self, producer: OpNode, meta: TensorMeta, dst: NdSbp, grad: NdSbp | None, consumer: str) -> int:
        fqn = producer.target
        if (fqn, dst, grad) not in self._uses:
            storage = storage_of(self.plan, fqn)
            gather = self.gather_of.get((fqn, dst, grad), -1)
            use = ParamUse(len(self.prog.param_uses), fqn, meta, storage, dst, grad,
                           boxing_moves(meta.nbytes, storage, dst, self.mesh),
                           gradient_moves(meta.nbytes, grad, storage, self.mesh) if grad is not None else (),
                           gather=gather)
            self._uses[(fqn, dst, grad)] = use.index
            self.prog.param_uses.append(use)
            if gather < 0:
                self.emit_moves(use.forward, "forward", fqn, consumer)
            self.first_consumer[use.index] = consumer
        gather = self.prog.param_uses[self._uses[(fqn, dst, grad)]].gather
        if gather >= 0:
            self.gathered(gather, consumer)
        return self._uses[(fqn, dst, grad)]

    def loss_output(self) -> None:
        """Every rank reads the loss (the output node's last input: torch.export lists buffer
        mutations first), so it is boxed to B; its gradient is the seed 1, already B. Backward does
        not need the boxed value, so a loss that is one all-reduce away from B (a P loss) is
        reduced asynchronously: only the step's end waits for it (``StepProgram.loss_async``)."""
        out = self.graph.nodes_of(NodeKind.OUTPUT)
        if not out or not out[0].inputs:
            raise ValueError(f"the graph of {self.graph.model_name or 'the model'} has no output; trace it with "
                             "its loss function (autoddl.trace(model, inputs, loss_fn))")
        ref = out[0].inputs[-1]
        meta = self.graph.meta_of(ref)
        if meta.numel != 1:
            raise ValueError(f"the graph's last output {ref} is {meta}, not a scalar loss; trace the model with "
                             "its loss function")
        broadcast = NdSbp.broadcast(len(self.mesh))
        grad = needed_grad_ndsbp(broadcast) if ref.node in self.rg else None
        moves = boxing_moves(meta.nbytes, layout_of(self.graph, self.plan, ref), broadcast, self.mesh)
        self.prog.loss_async = [m.kind for m in moves] == [CollectiveKind.ALL_REDUCE]
        self.prog.loss = self.edge(ref, meta, broadcast, grad, "output", host=not self.prog.loss_async)

    # -- gradient sync buckets ----------------------------------------------------------------------
    def pack_buckets(self, ops: list[OpNode]) -> None:
        """Bucket the uses whose sync is one reduction, in the order backward makes them ready
        (the reverse of their first consumer's forward position); one open bucket per (kind, axis),
        closed at ``bucket_mb`` (the first at 1 MB, as DDP does). Buckets are numbered by when
        their last gradient is ready: the order every rank launches them in."""
        position = {n.name: i for i, n in enumerate(ops)}
        ready = sorted((u for u in self.prog.param_uses if u.grad is not None),
                       key=lambda u: (-position[self.first_consumer[u.index]], u.index))
        cap = self.plan.training.bucket_bytes
        open_: dict[tuple[CollectiveKind, int], list[ParamUse]] = {}
        closed: list[list[ParamUse]] = []
        for use in ready:
            if cap <= 0 or len(use.grad_sync) != 1 or use.grad_sync[0].kind not in BUCKETED_KINDS:
                continue
            key = (use.grad_sync[0].kind, use.grad_sync[0].axis)
            members = open_.setdefault(key, [])
            members.append(use)
            limit = min(cap, FIRST_BUCKET_BYTES) if not closed else cap
            if sum(u.grad_sync[0].nbytes for u in members) >= limit:
                closed.append(open_.pop(key))
        closed += list(open_.values())
        rank = {u.index: i for i, u in enumerate(ready)}
        closed.sort(key=lambda members: max(rank[u.index] for u in members))
        for index, members in enumerate(closed):
            move = members[0].grad_sync[0]
            self.prog.buckets.append(Bucket(index, move.kind, move.axis, tuple(u.index for u in members),
                                            sum(u.grad_sync[0].nbytes for u in members)))
            for u in members:
                self.prog.param_uses[u.index] = _with_bucket(u, index)

    # -- backward -------------------------------------------------------------------------------------
    def backward(self, ops: list[OpNode]) -> None:
        firsts: dict[str, list[InputSource]] = {}
        for source, consumer in self.first_consumer.items():
            firsts.setdefault(consumer, []).append(source)
        loss = self.prog.edges[self.prog.loss] if self.prog.loss is not None else None
        if loss is not None and loss.key.grad is not None:
            self.emit_moves(loss.backward, "backward", loss.label, loss.key.node)
        remaining = {b.index: len(b.uses) for b in self.prog.buckets}
        self.bucket_tasks: list[int] = []
        for node in reversed(ops):
            if node.name not in self.rg:
                continue
            for g in self.prog.gathers:     # backward reached a resharded group: gather it again
                if g.reshard and g.last_consumer == node.name:
                    self.emit(phase="backward", stream=comm_stream(g.axis), op=node.name,
                              collective=CollectiveKind.ALL_GATHER, axis=g.axis, nbytes=g.nbytes,
                              tensor=f"regather {g.group}")
            sig = signature_of(self.plan, node)
            share = work_divisor(sig, self.mesh)
            self.emit(phase="backward", stream=COMPUTE, op=node.name, local_flops=node.flops / share,
                      local_bytes=(node.bytes_read + node.bytes_written) / share)
            for source in firsts.get(node.name, []):
                if isinstance(source, BoxKey):
                    edge = self.prog.edges[source]
                    self.emit_moves(edge.backward, "backward", edge.label, node.name)
                elif self.prog.param_uses[source].bucket >= 0:
                    bucket = self.prog.param_uses[source].bucket
                    remaining[bucket] -= 1
                    self.launch_ready_buckets(remaining, node.name)
        for use in self.prog.param_uses:              # the rest, at the end of backward
            if use.grad is not None and use.bucket < 0:
                self.emit_moves(use.grad_sync, "grad_sync", use.fqn, use.fqn)

    def launch_ready_buckets(self, remaining: dict[int, int], op: str) -> None:
        """Launch, in bucket order, every bucket whose gradients are all ready (async: the
        compute stream goes on; the next bucket waits for this one to be launched)."""
        while len(self.bucket_tasks) < len(self.prog.buckets) and remaining[len(self.bucket_tasks)] == 0:
            b = self.prog.buckets[len(self.bucket_tasks)]
            deps = (self.last,) + ((self.bucket_tasks[-1],) if self.bucket_tasks else ())
            task = self.emit(host=False, deps=deps, phase="grad_sync", stream=comm_stream(b.axis), op=op,
                             collective=b.kind, axis=b.axis, nbytes=b.nbytes, tensor=f"bucket{b.index}")
            self.bucket_tasks.append(task.id)

    def optimizer(self) -> None:
        syncs = tuple(t.id for t in self.prog.tasks if t.phase == "grad_sync") + tuple(self.async_tasks)
        deps = tuple(sorted(set(syncs + ((self.last,) if self.last is not None else ()))))
        self.emit(deps=deps, phase="optimizer", stream=COMPUTE, op="optimizer")


def _with_bucket(use: ParamUse, bucket: int) -> ParamUse:
    from dataclasses import replace

    return replace(use, bucket=bucket)
