"""Compile a rank's part of the step program into a torch.fx GraphModule of local ops.

The GraphModule's inputs are this rank's pieces of the user inputs and buffers;
its output is the loss, the same on every rank. Each op of the traced graph
becomes one call of its aten op (or the op rule's local kernel) on local
tensors, with shape arguments made local (``autoddl.ops.local_args``); each
input the program boxes becomes one ``BoxFunction`` call (forward moves, and
the backward moves of its gradient), and each parameter use one call of
``LocalStep.param_use``, which makes the use's leaf (gathered if its storage is
sharded) and hooks its gradient into the gradient sync. Nothing is dispatched
through DTensor at run time; autograd runs the backward of the local ops.

Under a mixed-precision policy a use's leaf is a working copy of the float32 master in
``param_dtype``, cast before it is moved (an FSDP gather moves the cast shards). A block the
plan recomputes becomes a submodule of the program run under non-reentrant
``torch.utils.checkpoint`` (executor/recompute.py); its parameter uses are made outside it.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx

from autoddl import ops
from autoddl.boxing import group_size, group_split_dim
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorRef
from autoddl.pipeline_program import StageIO
from autoddl.plan import Plan
from autoddl.precision import working_copy
from autoddl.program import BoxKey, InputSource, StepProgram, block_of, signature_of
from autoddl.sbp import NdSbp
from executor.gradsync import GradSync
from executor.moves import Boxer, BoxFunction, place_local, unflatten_gathered, wait
from executor.offload import HostCopies
from executor.recompute import OP_META, outline_blocks


class LocalStep:
    """What the compiled graph calls at run time: parameter uses, boxes, and local placement."""

    def __init__(self, program: StepProgram, boxer: Boxer, local_params: dict[str, torch.Tensor],
                 grad_sync: GradSync, param_dtype: str = "float32", spill: HostCopies | None = None):
        self.program, self.boxer, self.local_params, self.grad_sync = program, boxer, local_params, grad_sync
        self.param_dtype = param_dtype
        self.spill = spill                   # offload params: the spilled groups' host copies
        spilled = spill.group_of if spill is not None else {}
        self.edges = list(program.edges.values())
        self.edge_index = {e.key: i for i, e in enumerate(self.edges)}
        self.standing = {u.index: self._leaf(u.index, local_params[u.fqn]) for u in program.param_uses
                         if not u.forward and self._working(local_params[u.fqn]) is local_params[u.fqn]
                         and u.fqn not in spilled}
        self.slot = {i: n for g in program.gathers for n, i in enumerate(g.uses)}   # use -> place in its group
        self.pending_losses: list[torch.Tensor] = []        # the loss all-reduces in flight (loss_async)
        self.start_step()

    def start_step(self) -> None:
        self.launched: dict[int, torch.Tensor] = {}        # gather group -> its flat all-gather, in flight
        self.gathered: dict[int, list[torch.Tensor]] = {}  # gather group -> its uses' gathered values

    def _leaf(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """``value`` as a leaf of the autograd graph whose gradient goes to the sync when accumulated."""
        leaf = value.detach()
        if self.program.param_uses[index].grad is not None:
            leaf.requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(lambda t, i=index: self.grad_sync.on_grad_ready(i, t))
        return leaf

    def _working(self, master: torch.Tensor) -> torch.Tensor:
        """The working copy of a local master under the precision policy (the master itself in fp32)."""
        return working_copy(master, self.param_dtype)

    def all_reduce(self, t: torch.Tensor, axis: int, op: str) -> torch.Tensor:
        """What an op's kernel communicates with (autoddl.ops.inner_collectives): one all-reduce on
        mesh axis ``axis``, waited for."""
        return wait(funcol.all_reduce(t, op, self.boxer.groups[axis]))

    def all_to_all(self, t: torch.Tensor, axis: int, output_split_sizes: list, input_split_sizes: list) -> torch.Tensor:
        """What an expert-parallel kernel dispatches with (autoddl/ops/moe.py): one all-to-all on mesh
        axis ``axis``, waited for; differentiable (backward runs the reverse all-to-all)."""
        return wait(funcol.all_to_all_single_autograd(t, output_split_sizes, input_split_sizes, self.boxer.groups[axis]))

    def param_use(self, index: int) -> torch.Tensor:
        """Parameter use ``index`` in its use layout, as a leaf whose gradient is hooked: a standing
        leaf sharing the parameter's storage when the use needs no move nor cast (made once), else
        a fresh leaf of the moved (or cast) value each step (e.g. a ZeRO-3 all-gather)."""
        leaf = self.standing.get(index)
        if leaf is not None:
            return leaf
        use = self.program.param_uses[index]
        with torch.no_grad():
            if use.gather >= 0:
                value = self._gathered(use.gather)[self.slot[index]]
            elif self.spill is not None and use.fqn in self.spill.group_of:     # copied in from the host
                value = self.boxer.run(use.forward, self.spill.fetch(use.fqn), use.meta.shape, use.fqn)
            else:
                value = self.boxer.run(use.forward, self._working(self.local_params[use.fqn]), use.meta.shape, use.fqn)
        return self._leaf(index, value)

    # -- ZeRO-3 / FSDP: one all-gather per layer group, the next group prefetched ----------------------
    def _gathered(self, group: int) -> list[torch.Tensor]:
        """The gathered values of ``group``'s uses; launches it unless prefetched, and prefetches the
        next group (the order of autoddl.program's ``gathered``, the same on every rank)."""
        if group not in self.launched:
            self._launch_gather(group)
        if group + 1 < len(self.program.gathers) and group + 1 not in self.launched:
            self._launch_gather(group + 1)
        if group not in self.gathered:
            self.gathered[group] = self._unpack(group, wait(self.launched[group]))
        return self.gathered[group]

    def _launch_gather(self, group: int, label: str = "gather") -> torch.Tensor:
        g = self.program.gathers[group]
        flat = torch.cat([self._working(self.local_params[self.program.param_uses[i].fqn]).reshape(-1)
                          for i in g.uses])
        if self.boxer.on_collective is not None:
            self.boxer.on_collective(CollectiveKind.ALL_GATHER, g.axis, g.nbytes, f"{label} {g.group}")
        self.launched[group] = funcol.all_gather_single(flat, 0, self.boxer.groups[g.axis])
        return self.launched[group]

    def reshard_after(self, out: Any, groups: tuple[int, ...]) -> Any:
        """After the last forward op of ``groups``: free their gathered parameters (the storage,
        which autograd's saved tensors share, shrinks to nothing) and hook ``out``'s gradient to
        gather them again when backward reaches this op (FSDP2's reshard after forward)."""
        anchor = out if isinstance(out, torch.Tensor) else next(
            (t for t in out if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if anchor is None or not anchor.requires_grad:
            return out                  # no backward will come (e.g. under no_grad): keep them
        for group in groups:
            for t in self.gathered[group]:
                t.untyped_storage().resize_(0)
        anchor.register_hook(lambda grad: self._regather(groups))
        return out

    def _regather(self, groups: tuple[int, ...]) -> None:
        """Gather ``groups`` again into the very tensors autograd saved (their version counters kept:
        the values are the ones forward used)."""
        with torch.no_grad():
            for group in groups:
                fresh = self.gather_group(group, "regather")
                for t, value in zip(self.gathered[group], fresh):
                    t.untyped_storage().resize_(value.numel() * value.element_size())
                    with torch.autograd._unsafe_preserve_version_counter(t):
                        t.copy_(value)

    def gather_group(self, group: int, label: str = "gather") -> list[torch.Tensor]:
        """``group``'s parameters gathered now and unpacked into whole tensors (no prefetch, nothing kept):
        the pack, all-gather and unpack every gather of the group runs."""
        return self._unpack(group, wait(self._launch_gather(group, label)))

    def _unpack(self, group: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each use's whole tensor: a use's pieces, one per rank, joined along the dim its storage splits."""
        g = self.program.gathers[group]
        uses = [self.program.param_uses[i] for i in g.uses]
        return unflatten_gathered(flat, group_size(g.axis, self.boxer.mesh_shape),
                                  [(u.storage.local_shape(u.meta.shape, self.boxer.mesh_shape),
                                    group_split_dim(u.forward[0].before, u.forward[0].group)) for u in uses])

    def box(self, x: torch.Tensor, edge: int) -> torch.Tensor:
        e = self.edges[edge]
        return BoxFunction.apply(x, self.boxer, e.forward, e.backward, e.meta.shape, e.label)

    def report_loss(self, share: torch.Tensor) -> torch.Tensor:
        """This rank's share of the loss, reduced off the step's critical path: held for the bucket
        that carries it (``StepProgram.loss_bucket``), or launched now as the program's asynchronous
        loss all-reduce (``StepProgram.loss_async``), waited for by :meth:`loss_value`. Backward needs
        only the local share (the all-reduce's gradient is the identity), which is returned."""
        if self.program.loss_bucket >= 0:
            self.grad_sync.hold_loss(share.detach())
            return share
        edge = self.program.edges[self.program.loss]
        self.pending_losses.append(self.boxer.launch(edge.forward[0], share.detach(), edge.label))
        return share

    def loss_value(self, loss: torch.Tensor) -> float:
        """The loss every rank reports: what the last gradient sync carried when a bucket carries it
        (read after ``backward()``), the oldest awaited all-reduce when one was launched (a pipeline
        runs several micro-batches' forwards before their losses are read), else ``loss``."""
        if self.program.loss_bucket >= 0:
            return self.grad_sync.reduced_loss()
        if self.program.loss_async:
            return float(wait(self.pending_losses.pop(0)))
        return float(loss.detach())

    def mean_loss(self, losses: Sequence[torch.Tensor]) -> float:
        """The mean of one optimizer step's micro-step ``losses``, the same on every rank, read after
        the step's gradient sync (which reduced it, when a bucket carried it)."""
        if self.program.loss_bucket >= 0:
            return self.grad_sync.reduced_loss() / len(losses)
        return sum(self.loss_value(loss) for loss in losses) / len(losses)

    def place(self, full: torch.Tensor, nd: NdSbp) -> torch.Tensor:
        """This rank's piece, in layout ``nd``, of a tensor every rank holds whole (no communication)."""
        return place_local(self.boxer, full, nd)


class ProgramCompiler:
    """Builds the GraphModule of one rank (module docstring)."""

    def __init__(self, graph: OpGraph, plan: Plan, step: LocalStep, device: torch.device,
                 fx_targets: dict[str, Any], stage: StageIO | None = None):
        self.graph, self.plan, self.step, self.device, self.fx_targets = graph, plan, step, device, fx_targets
        self.stage = stage
        self.mesh = tuple(plan.mesh.shape)
        self.fx = torch.fx.Graph()
        self.env: dict[str, torch.fx.Node] = {}
        self.sources: dict[Any, torch.fx.Node] = {}
        self.received: dict[TensorRef, torch.fx.Node] = {}
        self.block: str | None = None          # the block forward is in (offload activations: enter_block)

    def compile(self) -> torch.fx.GraphModule:
        stage = self.stage
        for b in stage.received if stage is not None else ():     # a pipeline stage: what the one before sent
            self.received[b.ref] = self.fx.placeholder(f"recv_{b.ref.node}_{b.ref.index}")
        for node in self.graph.topo():
            if node.kind in (NodeKind.INPUT, NodeKind.BUFFER):
                if stage is None or node.name in stage.reads:
                    self.env[node.name] = self.fx.placeholder(node.name)
            elif node.kind is NodeKind.OP and (stage is None or node.name in stage.ops):
                self.enter_block(node)
                self.env[node.name] = self.op(node)
                self.tag(node.name)
                done = tuple(g.index for g in self.step.program.gathers if g.reshard and g.last_consumer == node.name)
                if done:
                    self.env[node.name] = self.fx.call_function(self.step.reshard_after, (self.env[node.name], done))
                    self.env[node.name].meta[OP_META] = ""       # outside any recomputed block
                if self.step.spill is not None and node.name in self.step.spill.last_forward.values():
                    self.env[node.name] = self.fx.call_function(self.step.spill.after_forward_op,
                                                                (self.env[node.name], node.name))
                    self.env[node.name].meta[OP_META] = ""
        loss = self.step.program.loss
        if stage is not None and not stage.last:         # a pipeline stage: what the next one receives
            self.fx.output(tuple(self.output_node(b.ref) for b in stage.sent))
            return self.module()
        if self.step.program.loss_async or self.step.program.loss_bucket >= 0:   # the local share goes out
            value = self.fx.call_function(self.step.report_loss, (self.output_node(TensorRef(loss.node, loss.index)),))
        else:
            value = self.source_node(TensorRef(loss.node, loss.index), loss)
        self.fx.output(value)
        return self.module()

    def enter_block(self, node: OpNode) -> None:
        """Offload activations: tell the host copies where forward enters another block
        (executor/offload.py), before the op's inputs are made."""
        spill = self.step.spill
        if spill is None or not spill.act_group or block_of(node) == self.block:
            return
        self.block = block_of(node)
        self.fx.call_function(spill.enter_block, (self.block,)).meta[OP_META] = ""

    def module(self) -> torch.fx.GraphModule:
        """The GraphModule of the fx graph built, recomputed blocks outlined."""
        root = torch.nn.Module()
        blocks = {n.name: block_of(n) for n in self.graph.ops()}
        outline_blocks(self.fx, root, blocks, self.plan.training, self.step.param_use,
                       self.step.grad_sync.set_phase)
        module = torch.fx.GraphModule(root, self.fx, class_name="LocalProgram")
        module.graph.lint()
        return module

    def tag(self, op: str) -> None:
        """Mark the fx nodes made for graph op ``op`` (the newest untagged ones) with it."""
        for fx_node in reversed(self.fx.nodes):
            if OP_META in fx_node.meta or fx_node.op == "placeholder":
                break
            fx_node.meta[OP_META] = op

    def op(self, node: OpNode) -> torch.fx.Node:
        sig = signature_of(self.plan, node)
        sources = self.step.program.op_inputs[node.name]
        tensors = [self.source_node(ref, src) for ref, src in zip(node.inputs, sources)]
        args, kwargs = ops.local_args(node, sig, self.mesh)
        position = [0]
        args, kwargs = ops.localize_devices(_substitute(args, tensors, position),
                                            _substitute(kwargs, tensors, position), self.device)
        out = self.fx.call_function(self.kernel(node, sig), tuple(args), kwargs)
        if not node.inputs and any(not nd.is_broadcast for nd in sig.outputs):
            if len(node.outputs) != 1:
                raise NotImplementedError(f"op {node.name} ({node.target}) creates {len(node.outputs)} tensors "
                                          f"laid out {sig.outputs}; only single-output factory ops may be split")
            out = self.fx.call_function(self.step.place, (out, sig.outputs[0]))
        return out

    def kernel(self, node: OpNode, sig) -> Any:
        local = ops.local_kernel(node, sig, self.mesh, self.step.boxer.coord, all_reduce=self.step.all_reduce,
                                 all_to_all=self.step.all_to_all)
        if local is not None:
            return local
        if node.target == "getitem":
            return ops.aten_op(node)
        return self.fx_targets.get(node.name) or ops.aten_op(node)

    def source_node(self, ref: TensorRef, source: InputSource) -> torch.fx.Node:
        """The fx node of one input: a parameter use, or a (boxed) activation; one node per source."""
        if source in self.sources:
            return self.sources[source]
        if isinstance(source, BoxKey):
            value = self.output_node(ref)
            edge = self.step.program.edges[source]
            if edge.forward or edge.backward:
                value = self.fx.call_function(self.step.box, (value, self.step.edge_index[source]))
        else:
            value = self.fx.call_function(self.step.param_use, (source,))
        self.sources[source] = value
        return value

    def output_node(self, ref: TensorRef) -> torch.fx.Node:
        if ref in self.received:
            return self.received[ref]
        producer = self.graph[ref.node]
        value = self.env[ref.node]
        if producer.kind is NodeKind.OP and len(producer.outputs) > 1:
            key = ("out", ref.node, ref.index)
            if key not in self.sources:
                self.sources[key] = self.fx.call_function(operator.getitem, (value, ref.index))
            value = self.sources[key]
        return value


def _substitute(value: Any, tensors: Sequence[Any], pos: list[int]) -> Any:
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
