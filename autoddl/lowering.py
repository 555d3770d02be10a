"""Lowering a plan into its step program (autoddl/program.py defines what a program holds).

Forward in graph order: each op's inputs are boxed (or, for a parameter, used from its
storage), then the op runs; backward in reverse, with the gradients' moves; then the
gradient sync and the optimizer.

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
bucket (ranks must launch buckets in the same order); a bucket's all-reduces on
further mesh axes follow its first at the end of backward; the optimizer waits for
every sync.

Activation recompute (``Training.recompute``): when backward reaches the last op of a recomputed
block, the block's recomputed ops (``recomputed_ops``) run forward again first, with the forward
collectives of the edges they box (``full``; ``selective`` keeps collective and matmul outputs, so
it recomputes element-wise work and every second 2-D product of the block only). A resharded
ZeRO-3 group is gathered again before.

Micro-steps (``Training.micro_batches`` = k): the one-micro-step program runs k times; the
micro-steps before the last skip the gradient syncs that are not reduce-scatters alone (DDP's
``no_sync``: gradients accumulate locally) but keep reduce-scatters (sharded gradients are reduced
every micro-step, as FSDP does): ``syncs_every_micro_step``; the optimizer runs once, after the last.

Mixed precision: gradients cross the network in ``Training.grad_reduce_dtype``; the graph (traced
under the policy) already holds activations and parameter working copies in ``param_dtype``.

Spilling to host memory (``Training.offload``, autoddl/offload.py): the host copies are emitted by
autoddl/offload_program.py at five points (before an op's forward and backward, after an op's
forward and backward, around the optimizer, which then runs on the host); a compute task waits for the copies
it needs (``wait_for``).

ZeRO-3 / FSDP gathers: the parameter uses whose move is one all-gather are grouped by layer
group (``layer_group``; groups under ``GATHER_MIN_BYTES`` merge with the next), gathered as one
collective where forward first needs the group, the next group launched right after without
waiting (prefetch); a group is freed after its last forward op and gathered again when
backward reaches that op. With pipeline stages the groups are kept gathered for the whole step, as
torchtitan runs FSDP under pp (``reshard_after_forward=False`` "to avoid per-microbatch
all-gathers", torchtitan/models/llama3/infra/parallelize.py): each chunk gathers its groups in its
first forward only, and their gradients accumulate unsharded and are
reduce-scattered in the chunk's last backward only, as torch.distributed.pipelining does for FSDP2
modules (``backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)`` until the last backward).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Sequence

from autoddl.boxing import (Group, Move, boxing_moves, gradient_moves, grad_ndsbp, group_axes, needed_grad_ndsbp,
                            parameter_moves)
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef
from autoddl.offload import check_offload
from autoddl.offload_program import SpillTasks
from autoddl.pipeline import boundary_tensors, pipeline_degree, schedule_actions, stage_of_ops, tied_parameters
from autoddl.pipeline_program import PipelineLayout, pipeline_tasks
from autoddl.plan import Plan
from autoddl.precision import itemsize
from autoddl.program import (COMPUTE, BoxKey, Bucket, EdgeBox, GatherGroup, InputSource, ParamSync, ParamUse,
                             StepProgram, Task, block_of, comm_stream, grad_storage_of, layer_group, layout_of,
                             optimizer_storage_of, recomputed_ops, requires_grad, signature_of, storage_of,
                             syncs_every_micro_step, used_parameters, work_divisor)
from autoddl.sbp import NdSbp, Partial, Signature

@functools.lru_cache(maxsize=1 << 16)
def consumer_grad(sig: Signature, slot: int, deferred: frozenset[int]) -> NdSbp:
    """The gradient layout an op hands back for input ``slot``: the gradient rule, with P on the
    axes where the op's own output gradient arrives deferred (P). Memoised (layouts are frozen)."""
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
        pure[node.name] = frozenset(
            a for a in _replicated_axes(signature_of(plan, node), ndim)
            if all(_gradient_source(graph, ref.node, rg, pure, a) for ref in node.inputs))
    deferred: dict[str, frozenset[int]] = {}
    for node in reversed(graph.ops()):
        axes = pure.get(node.name, frozenset())
        if not axes:
            continue
        handed = [consumer_grad(signature_of(plan, c), slot, deferred.get(c.name, frozenset()))
                  for c, _, slot in graph.uses(node.name) if c.is_op and c.name in rg]
        deferred[node.name] = frozenset(a for a in axes if any(g[a].is_partial() for g in handed))
    return {k: v for k, v in deferred.items() if v}


@functools.lru_cache(maxsize=1 << 16)
def _replicated_axes(sig: Signature, ndim: int) -> tuple[int, ...]:
    """The mesh axes on which every input and output of ``sig`` is B, in order."""
    return tuple(a for a in range(ndim) if all(nd[a].is_broadcast() for nd in sig.inputs + sig.outputs))


def _gradient_source(graph: OpGraph, name: str, rg: set[str], pure: dict[str, frozenset[int]], axis: int) -> bool:
    """True when a P gradient may reach node ``name`` on ``axis``: a parameter (its sync reduces it),
    a tensor without a gradient, or an op replicated from parameters on that axis."""
    node = graph[name]
    return node.kind is NodeKind.PARAMETER or name not in rg or axis in pure.get(name, frozenset())


def lower_program(graph: OpGraph, plan: Plan, *, loss_at_forward: bool = False) -> StepProgram:
    """The step program of ``plan`` for ``graph`` (module docstring); ``autoddl.program.lower``."""
    return _Lowering(graph, plan, loss_at_forward).run()


BUCKETED_KINDS = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)   # the gradient reductions
LOSS_ELEMENT_BYTES = itemsize("float32")   # the loss carried by a bucket: one float32 element (loss_output)
FIRST_BUCKET_BYTES = 1_000_000   # DDP's first bucket: torch/nn/parallel/distributed.py _DEFAULT_FIRST_BUCKET_BYTES
GATHER_MIN_BYTES = 1_000_000     # smallest ZeRO-3 gather group (smaller layer groups merge with the next)


class _Lowering:
    """Builds one StepProgram: forward in graph order, then backward in reverse, then the sync."""

    def __init__(self, graph: OpGraph, plan: Plan, loss_at_forward: bool = False):
        self.graph, self.plan, self.mesh = graph, plan, tuple(plan.mesh.shape)
        self.loss_at_forward = loss_at_forward
        self.rg = requires_grad(graph)
        self.prog = StepProgram(plan.name, self.mesh)
        self.last: int | None = None                       # the task issued last on the host thread
        self.first_consumer: dict[InputSource, str] = {}   # forward order: gradient complete after it
        self._uses: dict[tuple[str, NdSbp, NdSbp | None, int], int] = {}   # (fqn, dst, grad, stage) -> use
        self.async_tasks: list[int] = []                   # launched without the host waiting
        self.gather_of: dict[tuple[str, NdSbp, NdSbp | None, int], int] = {}   # use key -> gather group
        self.sync_use: dict[int, int] = {}                 # unbucketed grad-sync task -> its ParamUse
        self.gather_specs: list[list] = []                 # [layer group, axis, M bytes, stage] per gather group
        self.gather_task: dict[int, int] = {}              # gather group -> its task
        self.gathered_once: set[int] = set()               # gather tasks (pipelined: a chunk's first forward only)
        self.wait_for: list[int] = []                      # prefetched gathers the next op waits for
        self.deferred: dict[str, frozenset[int]] = {}      # op -> axes its output gradient arrives P on
        self.deferred_syncs: set[int] = set()              # sync tasks only the last micro-step runs
        self.stage_of: dict[str, int] = stage_of_ops(graph, plan) if pipeline_degree(plan) > 1 else {}
        check_offload(graph, plan)
        self.bucket_tasks: list[int] = []
        self.spill = SpillTasks(self)                      # host copies (autoddl/offload_program.py)

    def syncs_every_micro_step(self, uses: Sequence[ParamUse]) -> bool:
        """``program.syncs_every_micro_step`` of these uses in this program (with or without stages)."""
        return syncs_every_micro_step(uses, pipelined=bool(self.stage_of))

    def stage(self, op: str) -> int:
        """The virtual pipeline stage op ``op`` runs in (0 without stages)."""
        return self.stage_of.get(op, 0)

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
        keep = bool(self.stage_of)                      # pipelined: kept gathered for the step (docstring)
        self.prog.gathers = [GatherGroup(i, group, axis, tuple(u.index for u in self.prog.param_uses if u.gather == i),
                                         nbytes, last.get(i, ""), not keep and last.get(i, "") in self.rg)
                             for i, (group, axis, nbytes, _) in enumerate(self.gather_specs)]
        self.pack_buckets(ops)
        self.loss_output()
        self.backward(ops)
        if self.stage_of:
            self.pipeline()
            return self.prog
        self.prog.tasks, ids = repeat_micro_steps(self.prog.tasks, self.plan.training.micro_batches, self.last,
                                                      self.deferred_syncs)
        self.async_tasks = [new for step in ids for old in self.async_tasks for new in step[old]]
        self.last = ids[-1][self.last][-1] if self.last is not None and ids[-1][self.last] else self.last
        self.optimizer()
        return self.prog

    # -- issuing tasks ----------------------------------------------------------------------------
    def emit(self, *, host: bool = True, deps: tuple[int, ...] | None = None, **fields) -> Task:
        if deps is None:
            deps = () if self.last is None else (self.last,)
        if fields.get("stream") == COMPUTE and self.wait_for:     # prefetched copies the op waits for
            deps = tuple(dict.fromkeys(deps + tuple(self.wait_for)))
            self.wait_for = []
        task = Task(id=len(self.prog.tasks), deps=deps, host_waits=host, **fields)
        self.prog.tasks.append(task)
        if host:
            self.last = task.id
        return task

    def emit_moves(self, moves: Sequence[Move], phase: str, tensor: str, op: str, host: bool = True) -> None:
        for m in moves:
            if m.kind is not None:
                task = self.emit(host=host, phase=phase, stream=comm_stream(m.group), op=op, collective=m.kind,
                                 axis=m.group, nbytes=m.nbytes, tensor=tensor)
                if not host:
                    self.async_tasks.append(task.id)

    # -- forward ----------------------------------------------------------------------------------
    def forward_op(self, node: OpNode) -> None:
        sig = signature_of(self.plan, node)
        sources = tuple(self.source(node, sig, slot, ref) for slot, ref in enumerate(node.inputs))
        self.prog.op_inputs[node.name] = sources
        self.spill.before_forward(node)
        share = work_divisor(sig, self.mesh)
        deps = ((self.last,) if self.last is not None else ()) + tuple(self.wait_for)
        self.wait_for = []
        self.emit(deps=deps, phase="forward", stream=COMPUTE, op=node.name, local_flops=node.flops / share,
                  local_bytes=(node.bytes_read + node.bytes_written) / share)
        self.inner(node, sig, "forward")
        self.spill.after_forward(node)

    def inner(self, node: OpNode, sig: Signature, phase: str) -> None:
        """The collectives the op's local kernel runs itself (autoddl.ops.inner_collectives), synchronous;
        in backward those autograd runs again (``in_backward``)."""
        from autoddl import ops

        for c in ops.inner_collectives(node, sig, self.mesh):
            if phase == "backward" and not c.in_backward:
                continue
            self.emit(phase=phase, stream=comm_stream(c.axis), op=node.name, collective=c.kind, axis=c.axis,
                      nbytes=c.nbytes, tensor=f"{node.name} {c.what}")

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
        groups: dict[tuple[str, Group, int], int] = {}
        for node in ops:
            sig = signature_of(self.plan, node)
            for slot, ref in enumerate(node.inputs):
                producer = self.graph[ref.node]
                if producer.kind is not NodeKind.PARAMETER:
                    continue
                key = (producer.target, *self.input_layout(node, sig, slot), self.stage(node.name))
                meta = producer.outputs[0]
                moves = parameter_moves(meta.nbytes, storage_of(self.plan, key[0]), key[1], meta.shape, self.mesh)
                if key in self.gather_of or [m.kind for m in moves] != [CollectiveKind.ALL_GATHER]:
                    continue
                group = (layer_group(key[0]), moves[0].group, self.stage(node.name))
                if group not in groups:
                    groups[group] = len(self.gather_specs)
                    self.gather_specs.append([group[0], group[1], 0, group[2]])
                self.gather_of[key] = groups[group]
                self.gather_specs[groups[group]][2] += moves[0].nbytes
        self.merge_small_gathers()

    def merge_small_gathers(self) -> None:
        """Layer groups smaller than ``GATHER_MIN_BYTES`` join the next group on the same axis, as a
        user wraps FSDP2 units around blocks of some size: one small all-gather costs its latency,
        not its bytes (a VGG layer is a few KB)."""
        merged: list[list] = []
        index: list[int] = []
        for name, axis, nbytes, stage in self.gather_specs:
            if merged and merged[-1][1] == axis and merged[-1][3] == stage and merged[-1][2] < GATHER_MIN_BYTES:
                merged[-1][0] = f"{merged[-1][0].split('..')[0]}..{name}"
                merged[-1][2] += nbytes
            else:
                merged.append([name, axis, nbytes, stage])
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
        if (group + 1 < len(self.gather_specs) and group + 1 not in self.gather_task
                and self.gather_specs[group + 1][3] == self.gather_specs[group][3]):   # a stage prefetches its own
            self.launch_gather(group + 1, consumer, host=False)

    def launch_gather(self, group: int, consumer: str, host: bool) -> None:
        name, axis, nbytes, _ = self.gather_specs[group]
        task = self.emit(host=host, phase="forward", stream=comm_stream(axis), op=consumer,
                         collective=CollectiveKind.ALL_GATHER, axis=axis, nbytes=nbytes, tensor=f"gather {name}")
        self.gather_task[group] = task.id
        self.gathered_once.add(task.id)

    def edge(self, ref: TensorRef, meta: TensorMeta, dst: NdSbp, grad: NdSbp | None, consumer: str,
             host: bool = True, emit: bool = True) -> BoxKey:
        """The box of ``ref`` into layout ``dst`` for ``consumer``; its forward collectives are issued
        unless ``emit`` is False (the loss carried by a bucket: ``loss_output``)."""
        key = BoxKey(ref.node, ref.index, dst, grad, self.stage(ref.node if consumer == "output" else consumer))
        if key not in self.prog.edges:
            src = layout_of(self.graph, self.plan, ref)
            label = f"{ref}->{consumer}"
            backward = (gradient_moves(meta.nbytes, grad, src, self.mesh, self.deferred.get(ref.node, frozenset()))
                        if grad is not None else ())
            self.prog.edges[key] = EdgeBox(key, meta, src, label, boxing_moves(meta.nbytes, src, dst, self.mesh),
                                           backward)
            charge = ref.node if consumer == "output" else consumer     # per-op times add up
            if emit:
                self.emit_moves(self.prog.edges[key].forward, "forward", label, charge, host)
            self.first_consumer[key] = consumer
        return key

    def param_use(self, producer: OpNode, meta: TensorMeta, dst: NdSbp, grad: NdSbp | None, consumer: str) -> int:
        """The use of a parameter in layout ``dst`` (gradient ``grad``) by ``consumer``: one per layout pair
        and pipeline stage (a stage runs on its own ranks, so its uses and their syncs are its own)."""
        fqn = producer.target
        key = (fqn, dst, grad, self.stage(consumer))
        if key not in self._uses:
            storage = storage_of(self.plan, fqn)
            gather = self.gather_of.get(key, -1)
            grad_nbytes = meta.numel * itemsize(self.plan.training.grad_reduce_dtype)
            use = ParamUse(len(self.prog.param_uses), fqn, meta, storage, dst, grad,
                           parameter_moves(meta.nbytes, storage, dst, meta.shape, self.mesh),
                           parameter_moves(grad_nbytes, grad, needed_grad_ndsbp(grad_storage_of(self.plan, fqn)),
                                           meta.shape, self.mesh) if grad is not None else (),
                           gather=gather)
            self._uses[key] = use.index
            self.prog.param_uses.append(use)
            if gather < 0:
                self.emit_moves(use.forward, "forward", fqn, consumer)
            self.first_consumer[use.index] = consumer
        gather = self.prog.param_uses[self._uses[key]].gather
        if gather >= 0:
            self.gathered(gather, consumer)
        return self._uses[key]

    def loss_output(self) -> None:
        """Every rank reads the loss (the output node's last input: torch.export lists buffer
        mutations first), so it is boxed to B; its gradient is the seed 1, already B. Backward does
        not need the boxed value, so a loss that is one all-reduce away from B (a P loss) need not
        hold the step up:

        - unless the loss is read at forward's end (``loss_at_forward``), it rides in the first
          float32 all-reduce bucket of the same group as one more element (``StepProgram.loss_bucket``;
          with micro-steps, the sum of their shares): a collective of its own, even 4 bytes and
          asynchronous, cost gpt tiny's dp step 1.7-2.6 ms of 21 on the 2-core VM
          (results/loss_allreduce.csv), and DDP has none;
        - else it is reduced asynchronously: only the step's end waits for it (``StepProgram.loss_async``)."""
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
        one_all_reduce = [m.kind for m in moves] == [CollectiveKind.ALL_REDUCE]
        carrier = self._loss_carrier(moves[0]) if one_all_reduce else None
        self.prog.loss_async = one_all_reduce and carrier is None
        if carrier is not None:
            self.prog.loss_bucket = carrier.index
            self.prog.buckets[carrier.index] = replace(carrier, nbytes=carrier.nbytes + LOSS_ELEMENT_BYTES)
        self.prog.loss = self.edge(ref, meta, broadcast, grad, "output", host=not one_all_reduce,
                                   emit=carrier is None)

    def _loss_carrier(self, loss_move: Move) -> Bucket | None:
        """The bucket that can carry the loss (``loss_output``): the first all-reduce bucket over the
        loss's group, reduced in float32, in a program without pipeline stages read after its sync."""
        if self.loss_at_forward or self.stage_of or self.plan.training.grad_reduce_dtype != "float32":
            return None
        return next((b for b in self.prog.buckets
                     if b.kind is CollectiveKind.ALL_REDUCE and b.axis == loss_move.group), None)

    # -- gradient sync buckets ----------------------------------------------------------------------
    def pack_buckets(self, ops: list[OpNode]) -> None:
        """Bucket the uses whose sync is one reduction (an all-reduce or reduce-scatter on one axis, or
        over several axes' flattened group), in the order backward makes them ready
        (the reverse of their first consumer's forward position); one open bucket per (kind, axis),
        closed at ``bucket_mb`` (the first at 1 MB, as DDP does). Buckets are numbered by when
        their last gradient is ready: the order every rank launches them in."""
        position = {n.name: i for i, n in enumerate(ops)}
        ready = sorted((u for u in self.prog.param_uses if u.grad is not None),
                       key=lambda u: (-position[self.first_consumer[u.index]], u.index))
        cap = self.plan.training.bucket_bytes
        open_: dict[tuple[CollectiveKind, Group, int], list[ParamUse]] = {}
        closed: list[list[ParamUse]] = []
        for use in ready:
            if cap <= 0 or not _bucketable(use.grad_sync):
                continue
            key = (use.grad_sync[0].kind, use.grad_sync[0].group, self.stage(self.first_consumer[use.index]))
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
            self.prog.buckets.append(Bucket(index, move.kind, move.group, tuple(u.index for u in members),
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
        self.bucket_tasks = []
        self.spill.count_gradients(self.prog.param_uses)
        recompute_at = {block_ops[-1].name: block_ops for block_ops in recomputed_ops(self.graph, self.plan).values()}
        last_in_block = {name: name for name in recompute_at}
        regather: dict[str, list[GatherGroup]] = {}     # resharded groups by their last forward consumer
        for g in self.prog.gathers:
            if g.reshard:
                regather.setdefault(g.last_consumer, []).append(g)
        for node in reversed(ops):
            if node.name not in self.rg and node.name not in recompute_at:
                continue
            self.spill.before_backward(node, recompute_at.get(node.name, []))
            for g in regather.get(node.name, ()):     # backward reached a resharded group: gather it again
                self.emit(phase="backward", stream=comm_stream(g.axis), op=node.name,
                          collective=CollectiveKind.ALL_GATHER, axis=g.axis, nbytes=g.nbytes,
                          tensor=f"regather {g.group}")
            if node.name in last_in_block:
                self.recompute(recompute_at[node.name])
            if node.name not in self.rg:
                continue
            sig = signature_of(self.plan, node)
            share = work_divisor(sig, self.mesh)
            self.emit(phase="backward", stream=COMPUTE, op=node.name, local_flops=node.flops / share,
                      local_bytes=(node.bytes_read + node.bytes_written) / share)
            self.inner(node, sig, "backward")
            for source in firsts.get(node.name, []):
                if isinstance(source, BoxKey):
                    edge = self.prog.edges[source]
                    self.emit_moves(edge.backward, "backward", edge.label, node.name)
                else:
                    self.spill.gradient_ready(self.prog.param_uses[source])
                    if self.prog.param_uses[source].bucket >= 0:
                        bucket = self.prog.param_uses[source].bucket
                        remaining[bucket] -= 1
                        self.launch_ready_buckets(remaining, node.name)
            self.spill.after_backward(node.name)
        for use in self.prog.param_uses:              # the rest, at the end of backward
            if use.grad is not None and use.bucket < 0:
                first = len(self.prog.tasks)
                self.emit_moves(use.grad_sync, "grad_sync", use.fqn, self.first_consumer[use.index])   # per-op table
                self.sync_use.update(dict.fromkeys(range(first, len(self.prog.tasks)), use.index))
                if not self.syncs_every_micro_step([use]):
                    self.deferred_syncs.update(range(first, len(self.prog.tasks)))
        self.spill.after_backward("backward end", final=True)

    def recompute(self, block_ops: list[OpNode]) -> None:
        """The block's recomputed ops forward again (module docstring), each after the forward
        collectives of the edges it boxes when the whole block is recomputed."""
        whole = self.plan.training.recompute_of(block_of(block_ops[0])) == "full"
        for node in block_ops:
            if whole:
                for source in self.prog.op_inputs[node.name]:
                    if isinstance(source, BoxKey) and self.first_consumer.get(source) == node.name:
                        edge = self.prog.edges[source]
                        self.emit_moves(edge.forward, "recompute", edge.label, node.name)
            sig = signature_of(self.plan, node)
            share = work_divisor(sig, self.mesh)
            self.emit(phase="recompute", stream=COMPUTE, op=node.name, local_flops=node.flops / share,
                      local_bytes=(node.bytes_read + node.bytes_written) / share)
            if whole:       # selective keeps collective outputs (executor/recompute.py)
                self.inner(node, sig, "recompute")

    def launch_ready_buckets(self, remaining: dict[int, int], op: str) -> None:
        """Launch, in bucket order, every bucket whose gradients are all ready (async: the
        compute stream goes on; the next bucket waits for this one to be launched)."""
        while len(self.bucket_tasks) < len(self.prog.buckets) and remaining[len(self.bucket_tasks)] == 0:
            b = self.prog.buckets[len(self.bucket_tasks)]
            deps = (self.last,) + ((self.bucket_tasks[-1],) if self.bucket_tasks else ())
            task = self.emit(host=False, deps=deps, phase="grad_sync", stream=comm_stream(b.axis), op=op,
                             collective=b.kind, axis=b.axis, nbytes=b.nbytes, tensor=f"bucket{b.index}")
            if not self.syncs_every_micro_step([self.prog.param_uses[i] for i in b.uses]):
                self.deferred_syncs.add(task.id)
            self.bucket_tasks.append(task.id)

    # -- pipeline stages ----------------------------------------------------------------------------
    def pipeline(self) -> None:
        """The one-micro-batch tasks run as the schedule says, then each rank's optimizer
        (autoddl/pipeline_program.py)."""
        tr, p = self.plan.training, pipeline_degree(self.plan)
        first_of = {u.fqn: self.first_consumer[u.index] for u in reversed(self.prog.param_uses)}
        stage_of_task = [self.stage(self.first_consumer[self.sync_use[t.id]] if t.id in self.sync_use else
                                    t.op if t.op in self.stage_of else first_of.get(t.op, "")) for t in self.prog.tasks]
        ranks: list[set[str]] = [set() for _ in range(p)]
        for fqn, param in used_parameters(self.graph).items():
            for node in self.graph.consumers(param.name):
                ranks[self.stage(node.name) % p].add(fqn)
        rank_params = tuple(frozenset(r) for r in ranks)
        layout = PipelineLayout(p, tr.virtual_stages, tr.micro_batches, tr.schedule,
                                tuple(map(tuple, schedule_actions(tr.schedule, p, tr.micro_batches, tr.virtual_stages))),
                                self.stage_of, tuple(boundary_tensors(self.graph, self.plan, self.stage_of, self.rg)),
                                rank_params, tied_parameters(rank_params))
        async_ids = set(self.async_tasks) | {t.id for t in self.prog.tasks if t.phase == "grad_sync"}
        self.prog.tasks, last = pipeline_tasks(self.prog.tasks, stage_of_task, layout, async_ids, self.deferred_syncs,
                                               self.gathered_once)
        self.prog.pipeline = layout
        self.prog.param_syncs = []
        for r in range(p):
            waits = tuple(t.id for t in self.prog.tasks if t.pp_rank == r and t.stream != COMPUTE)
            deps = tuple(sorted(set(waits + ((last[r],) if last[r] is not None else ()))))
            for fqn in layout.tied:          # the tied copies' gradients summed over the pp axis
                deps = (self.emit(deps=deps, host=False, phase="grad_sync", stream=comm_stream(0), op=fqn, pp_rank=r,
                                  collective=CollectiveKind.ALL_REDUCE, axis=0, nbytes=self.tied_grad_bytes(fqn),
                                  tensor=f"tied {fqn}", micro_step=tr.micro_batches - 1).id,)
            self.emit(deps=deps, phase="optimizer", stream=COMPUTE, op="optimizer", pp_rank=r, tensor=f"pp rank {r}")
            for sync in param_syncs(self.graph, self.plan, layout.rank_params[r]):
                self.prog.param_syncs.append(replace(sync, pp_rank=r))
                self.emit(phase="optimizer", stream=comm_stream(sync.axis), op="optimizer", pp_rank=r,
                          collective=CollectiveKind.ALL_GATHER, axis=sync.axis, nbytes=sync.nbytes,
                          tensor=f"param sync axis{sync.axis} pp rank {r}")

    def tied_grad_bytes(self, fqn: str) -> int:
        """M of a tied parameter's pp all-reduce: its local gradient as the optimizer receives it (the
        optimizer storage: the grad storage, or under ZeRO-1 this rank's piece of it) in the reduce dtype."""
        meta = used_parameters(self.graph)[fqn].outputs[0]
        local = optimizer_storage_of(self.plan, fqn).local_shape(meta.shape, self.mesh)
        return math.prod(local) * itemsize(self.plan.training.grad_reduce_dtype)

    def optimizer(self) -> None:
        syncs = tuple(t.id for t in self.prog.tasks if t.phase == "grad_sync") + tuple(self.async_tasks)
        deps = tuple(sorted(set(syncs + ((self.last,) if self.last is not None else ()))))
        if self.plan.training.offload_level == "none":
            self.emit(deps=deps, phase="optimizer", stream=COMPUTE, op="optimizer")
        else:                                        # on the host, between the copies (autoddl/offload.py)
            self.spill.optimizer(deps)
        self.prog.param_syncs = param_syncs(self.graph, self.plan)
        for sync in self.prog.param_syncs:           # ZeRO-1/2: rebuild the updated parameters
            self.emit(phase="optimizer", stream=comm_stream(sync.axis), op="optimizer",
                      collective=CollectiveKind.ALL_GATHER, axis=sync.axis, nbytes=sync.nbytes,
                      tensor=f"param sync axis{sync.axis}")


def param_syncs(graph: OpGraph, plan: Plan, only: frozenset[str] | None = None) -> list[ParamSync]:
    """ZeRO-1/2: per mesh axis, the parameters (``only`` these, when given: a pipeline rank's) whose
    optimizer storage is one all-gather away from their storage, gathered together in their working
    dtype after the optimizer (as DeepSpeed all-gathers the updated partitions). Any other pair of
    layouts is refused."""
    by_axis: dict[Group, list[tuple[str, int]]] = {}
    for fqn, node in used_parameters(graph).items():
        if only is not None and fqn not in only:
            continue
        optimizer, storage = optimizer_storage_of(plan, fqn), storage_of(plan, fqn)
        if optimizer == storage:
            continue
        meta = node.outputs[0]
        moves = [m for m in parameter_moves(meta.nbytes, optimizer, storage, meta.shape, plan.mesh.shape) if m.kind]
        if [m.kind for m in moves] != [CollectiveKind.ALL_GATHER]:
            raise ValueError(f"plan {plan.name!r}: parameter {fqn} is stored {storage} but its optimizer storage "
                             f"is {optimizer}; ZeRO-1/2 need the optimizer storage to split one dim on mesh axes the "
                             "storage replicates, evenly where more than one (e.g. storage [B], optimizer [S(0)])")
        by_axis.setdefault(moves[0].group, []).append((fqn, moves[0].nbytes))
    return [ParamSync(axis, tuple(f for f, _ in items), sum(n for _, n in items))
            for axis, items in sorted(by_axis.items(), key=lambda item: group_axes(item[0]))]


def _bucketable(sync: Sequence[Move]) -> bool:
    """A gradient sync a bucket can carry: one reduction (all-reduce or reduce-scatter; over several
    axes it is one over their flattened group: autoddl.boxing's ``flatten_all_reduces`` and
    ``flatten_nested_shards``)."""
    return len(sync) == 1 and sync[0].kind in BUCKETED_KINDS


def _with_bucket(use: ParamUse, bucket: int) -> ParamUse:
    return replace(use, bucket=bucket)


def repeat_micro_steps(tasks: list[Task], k: int, last_host: int | None, deferred_syncs: set[int]
                       ) -> tuple[list[Task], list[dict[int, tuple[int, ...]]]]:
    """``tasks`` (one micro-step, no optimizer) run ``k`` times (module docstring): each earlier
    micro-step without the ``deferred_syncs`` (gradient syncs that are not reduce-scatters alone:
    ``syncs_every_micro_step``), each micro-step's first task after the previous
    one's last host task. A dependency on a skipped task becomes the skipped task's own. Returns
    the tasks and, per micro-step, each old task id's new ids (none or its deps when skipped)."""
    if k == 1 and all(t.id == i for i, t in enumerate(tasks)):    # one micro-step: the tasks as they are
        return [t if t.micro_step == 0 and list(t.deps) == sorted(set(t.deps)) else
                replace(t, deps=tuple(sorted(set(t.deps))), micro_step=0) for t in tasks], \
            [{t.id: (t.id,) for t in tasks}]
    out: list[Task] = []
    ids: list[dict[int, tuple[int, ...]]] = []
    previous_last: int | None = None
    for step in range(k):
        last = step == k - 1
        new_id: dict[int, tuple[int, ...]] = {}
        for t in tasks:
            deps = tuple(sorted({d for old in t.deps for d in new_id[old]}))
            if not deps and previous_last is not None:
                deps = (previous_last,)
            if not last and t.id in deferred_syncs:
                new_id[t.id] = deps
                continue
            out.append(replace(t, id=len(out), deps=deps, micro_step=step))
            new_id[t.id] = (len(out) - 1,)
        ids.append(new_id)
        previous_last = new_id[last_host][-1] if last_host is not None and new_id[last_host] else previous_last
    return out, ids
