"""Executor runtime: mesh, parameters placed by storage NdSbp, one planned training step.

Inside a torchrun (or test) process::

    mesh = init_mesh(plan)
    dmodel = DistributedModel(model, graph, plan, mesh)   # graph = autoddl.trace(model, inputs, loss_fn)
    opt = build_optimizer(plan.optimizer, dmodel.parameters())
    loss = train_step(dmodel, inputs, opt)

``DistributedModel`` lowers the plan to its step program (autoddl.program) and
compiles this rank's part into a local fx program (executor/compiled.py):
forward runs it on local tensors (boxing with functional collectives), backward
is autograd over the local ops, gradient sync runs in buckets launched from
backward hooks (executor/gradsync.py) and ends with each parameter's local
gradient in its storage layout. Parameters are DTensors with the storage
placements (what users' optimizers and checkpoints see); the step works on
their local tensors. ``run_check`` compares all of it with a single-process run.
"""

from __future__ import annotations

import atexit
import copy
import datetime
import math
import os
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
# torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when first imported,
# and functional collectives import it on first use. Imported after init_process_group, it keeps the
# world group (and its gloo threads) alive past destroy_process_group until the interpreter tears its
# modules down; imported here, before any group exists, its defaults are None and destroy frees it.
import torch.distributed.nn.functional  # noqa: F401
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from autoddl.boxing import Group, boxing_moves, group_size, group_split_dim
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind, OpGraph
from autoddl.offload import check_runnable_offload
from autoddl.pipeline import pipeline_degree
from autoddl.plan import Plan
from autoddl.precision import cast_forward_inputs, torch_dtype, working_copy
from autoddl.program import StepProgram, grad_storage_of, lower, optimizer_storage_of
from autoddl.sbp import NdSbp
from executor import allocator
from executor.audit import CommRecord, CommRecorder
from executor.compiled import LocalStep, ProgramCompiler
from executor.gradsync import GradSync
from executor.moves import Boxer, place_local, shard_view, unflatten_gathered, wait
from executor.offload import HostCopies


class PlanExecutionError(RuntimeError):
    """The plan cannot be run as written; the message names the node and what to do."""


def init_mesh(plan: Plan, device: str = "cpu", timeout_s: float = 120.0) -> DeviceMesh:
    """Initialise the process group (gloo on CPU, nccl on CUDA) and the plan's DeviceMesh."""
    use_cuda = device == "cuda" and torch.cuda.is_available()
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != plan.mesh.size:
        raise PlanExecutionError(f"plan {plan.name!r} is for mesh {plan.mesh} ({plan.mesh.size} devices) but "
                                 f"{world} processes were launched; run with --nproc {plan.mesh.size}")
    return init_device_mesh("cuda" if use_cuda else "cpu", plan.mesh.shape, mesh_dim_names=plan.mesh.axis_names)


def mesh_groups(mesh: DeviceMesh, program: StepProgram) -> dict[Group, str]:
    """The process group (by name) of every mesh axis, and of every tuple of axes ``program`` runs a
    collective over (a gradient all-reduce over several data-parallel axes): the sub-mesh of those
    axes flattened with ``DeviceMesh._flatten`` (torch 2.13; every rank builds the same ones in the
    same order, as ``new_group`` needs; flattening every axis gives the world group back)."""
    groups: dict[Group, str] = {a: mesh.get_group(a).group_name for a in range(mesh.ndim)}
    names = mesh.mesh_dim_names
    for task in program.collectives():
        if isinstance(task.axis, tuple) and task.axis not in groups:
            if names is None:
                raise PlanExecutionError(f"plan {program.plan_name!r} runs a collective over mesh axes {task.axis} "
                                         "flattened, which needs a DeviceMesh with mesh_dim_names; build it with "
                                         "executor.runtime.init_mesh")
            groups[task.axis] = mesh[tuple(names[a] for a in task.axis)]._flatten().get_group().group_name
    return groups


def validate_plan(graph: OpGraph, plan: Plan) -> None:
    """Raise one error listing every way ``plan`` does not fit ``graph``."""
    problems: list[str] = []
    if plan.graph_hash and plan.graph_hash != graph.fingerprint():
        problems.append(f"graph_hash {plan.graph_hash} != traced graph {graph.fingerprint()} "
                        f"(the model changed since planning: re-run `autoddl plan`)")
    mesh = plan.mesh.shape
    for node in graph.ops():
        if node.target == "getitem":
            continue
        sig = plan.signatures.get(node.name)
        if sig is None:
            problems.append(f"op {node.name} ({node.target}): no signature")
            continue
        if len(sig.inputs) != len(node.inputs) or len(sig.outputs) != len(node.outputs):
            problems.append(f"op {node.name}: signature {sig} has {len(sig.inputs)} inputs / {len(sig.outputs)} "
                            f"outputs, the op has {len(node.inputs)} / {len(node.outputs)}")
            continue
        for nd, meta in zip(sig.inputs + sig.outputs, node.input_metas + node.outputs):
            if len(nd) != len(mesh) or (meta.dtype != "none" and not nd.divides(meta.shape, mesh)):
                problems.append(f"op {node.name}: {nd} does not fit {meta} on mesh {plan.mesh}")
    for node in graph.nodes_of(NodeKind.INPUT) + graph.nodes_of(NodeKind.BUFFER):
        sig = plan.signatures.get(node.name)
        if sig is None:
            problems.append(f"{node.kind.value} {node.name}: no signature (want '-> [<NdSbp>]')")
        elif len(sig.outputs) != 1 or len(sig.outputs[0]) != len(mesh) or (
                node.outputs and not sig.outputs[0].divides(node.outputs[0].shape, mesh)):
            problems.append(f"{node.kind.value} {node.name}: signature {sig} does not fit "
                            f"{node.outputs[0] if node.outputs else 'it'} on mesh {plan.mesh}")
    unknown = sorted(k for k in plan.signatures if k not in graph and k != "output")
    if unknown:
        problems.append(f"signatures for nodes not in the graph: {unknown}")
    for fqn, node in graph.parameters().items():
        nd = plan.param_storage.get(fqn)
        if nd is None:
            problems.append(f"parameter {fqn}: no storage NdSbp in param_storage")
        elif nd.has_partial:
            problems.append(f"parameter {fqn}: storage {nd} has P; store parameters as S or B")
        elif len(nd) != len(mesh) or not nd.divides(node.outputs[0].shape, mesh):
            problems.append(f"parameter {fqn}: storage {nd} does not fit {node.outputs[0]} on mesh {plan.mesh}")
    try:
        check_runnable_offload(graph, plan)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise PlanExecutionError(f"plan {plan.name!r} does not fit the traced graph of "
                                 f"{graph.model_name or 'the model'}:\n  " + "\n  ".join(problems[:12]) + more)


def _set_param(module: nn.Module, fqn: str, value: nn.Parameter) -> None:
    owner_path, _, leaf = fqn.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    setattr(owner, leaf, value)


class DistributedModel(nn.Module):
    """``model``'s parameters as DTensors (storage NdSbp); ``forward`` runs the compiled local program
    and returns the tensor to call ``backward()`` on; backward syncs the gradients.

    ``forward_backward`` returns the loss (a plain float, the same on every rank), read after the
    step's gradient sync, which may carry it (``StepProgram.loss_bucket``); a subclass whose
    ``forward`` must return the reduced loss sets ``loss_at_forward``."""

    loss_at_forward = False

    def __init__(self, model: nn.Module, graph: OpGraph, plan: Plan, mesh: DeviceMesh, *,
                 recorder: CommRecorder | None = None):
        super().__init__()
        validate_plan(graph, plan)
        self.graph, self.plan, self.mesh, self.recorder = graph, plan, mesh, recorder
        self.device = torch.device(mesh.device_type)
        self.module = copy.deepcopy(model)  # the caller's model stays a plain single-device reference
        self.program = lower(graph, plan, loss_at_forward=self.loss_at_forward)
        boxer = Boxer(tuple(plan.mesh.shape), tuple(mesh.get_coordinate()), mesh_groups(mesh, self.program),
                      dist.get_backend(), self._on_collective)
        self.boxer = boxer
        self.local_params = self._place_parameters(boxer)
        self.host_copies = HostCopies(self.program, self.local_params, plan.training.param_dtype, self.device)
        if plan.training.offload_level != "none":          # the optimizer on the host (executor/offload.py)
            self._keep_masters_on_host()
        ep = graph.exported
        self._user_inputs = list(ep.graph_signature.user_inputs)
        self._constants = dict(getattr(ep.graph_signature, "inputs_to_lifted_tensor_constants", {}))
        self._placeholders = [n for n in graph.topo() if n.kind in (NodeKind.INPUT, NodeKind.BUFFER)]
        self._fx_targets = {n.name: n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"}
        self._compile()

    def _compile(self) -> None:
        """This rank's gradient sync, local step and compiled program (a pipeline compiles one per stage:
        executor/pipelined.py)."""
        training = self.plan.training
        spill = self.host_copies if self.program.spills else None
        self.grad_sync = self._grad_sync(self.program, spill)
        self.step = LocalStep(self.program, self.boxer, self.local_params, self.grad_sync,
                              param_dtype=training.param_dtype, spill=spill)
        self.local_program = ProgramCompiler(self.graph, self.plan, self.step, self.device, self._fx_targets).compile()
        self.run_program: Callable[..., torch.Tensor] = self.local_program

    def _grad_sync(self, program, spill: "HostCopies | None" = None) -> GradSync:
        host = spill is not None or self.plan.training.offload_level != "none"
        return GradSync(program, self.boxer, self.local_params, self._set_phase,
                        reduce_dtype=self.plan.training.grad_reduce_dtype, grad_targets=self._grad_targets(),
                        copy_out=self.host_copies.copy_out if host else None)

    def _keep_masters_on_host(self) -> None:
        """Offload: the kept parameters' masters to host buffers, where the optimizer steps them."""
        params = dict(self.module.named_parameters(remove_duplicate=False))
        sharded = sorted(f for f in self.local_params if hasattr(params.get(f), "_autoddl_opt_layout"))
        if sharded:
            raise PlanExecutionError(f"plan {self.plan.name!r}: offload {self.plan.training.offload_level} with the "
                                     f"optimizer sharded (ZeRO-1/2: {sharded[0]} ...) is priced but not run; run a plan "
                                     "whose optimizer storage is its parameters' storage, or --offload none")
        self.host_copies.keep_masters({f: params[f] for f in self.local_params if f in params})

    def _place_parameters(self, boxer: Boxer) -> dict[str, torch.Tensor]:
        """Every parameter as a DTensor of its storage layout (tied weights stay tied); returns the
        local tensors (sharing storage with the DTensors) by the graph's fqns."""
        placed: dict[int, nn.Parameter] = {}
        by_name: dict[str, nn.Parameter] = {}
        for fqn, p in list(self.module.named_parameters(remove_duplicate=False)):
            if id(p) not in placed:
                nd = self.plan.param_storage.get(fqn) or NdSbp.broadcast(self.mesh.ndim)
                local = place_local(boxer, p.detach().to(self.device), nd)
                dt = DTensor.from_local(local, self.mesh, nd.to_placements(), run_check=False,
                                        shape=p.shape, stride=p.stride())
                param = nn.Parameter(dt, requires_grad=p.requires_grad)
                param._autoddl_local = dt._local_tensor      # the tensor the step and the optimizer use
                optimizer_nd = optimizer_storage_of(self.plan, fqn) if fqn in self.plan.param_storage else nd
                if optimizer_nd != nd:                        # ZeRO-1/2: the optimizer steps a shard of it
                    param._autoddl_opt_local = shard_view(boxer, param._autoddl_local, nd, optimizer_nd)
                    param._autoddl_opt_layout = optimizer_nd
                placed[id(p)] = param
            _set_param(self.module, fqn, placed[id(p)])
            by_name[fqn] = placed[id(p)]
        return {fqn: by_name[fqn]._autoddl_local for fqn in self.graph.parameters() if fqn in by_name}

    def _grad_targets(self) -> dict[str, tuple[torch.Tensor, tuple]]:
        """ZeRO-1/2: per parameter, the optimizer's shard that receives its synced gradient, and the
        (local) moves from the gradient storage to it (ZeRO-1: keep this rank's piece)."""
        params = dict(self.module.named_parameters(remove_duplicate=False))
        out = {}
        for fqn in self.local_params:
            shard = getattr(params.get(fqn), "_autoddl_opt_local", None)
            if shard is not None:
                node = self.graph.parameters()[fqn]
                moves = boxing_moves(node.outputs[0].nbytes, grad_storage_of(self.plan, fqn),
                                     optimizer_storage_of(self.plan, fqn), self.plan.mesh.shape)
                out[fqn] = (shard, tuple(moves))
        return out

    def sync_parameters(self) -> None:
        """ZeRO-1/2, after the optimizer step: per ``program.param_syncs``, one all-gather of the
        updated shards (in the working dtype) rebuilds every parameter in its storage."""
        self.host_copies.copy_back()        # offload: the host's updated working copies to the device
        params = dict(self.module.named_parameters(remove_duplicate=False))
        dtype = self.plan.training.param_dtype
        with torch.no_grad():
            for sync in self.own_param_syncs():
                shards = [params[f]._autoddl_opt_local for f in sync.fqns]
                flat = torch.cat([working_copy(t, dtype).reshape(-1) for t in shards])
                self._on_collective(CollectiveKind.ALL_GATHER, sync.axis, sync.nbytes, f"param sync axis{sync.axis}")
                gathered = wait(funcol.all_gather_single(flat, 0, self.boxer.groups[sync.axis]))
                unflatten_gathered(gathered, group_size(sync.axis, self.plan.mesh.shape),   # into the parameters
                                   [(tuple(t.shape), group_split_dim(optimizer_storage_of(self.plan, f), sync.axis))
                                    for f, t in zip(sync.fqns, shards)],
                                   out=[params[f]._autoddl_local for f in sync.fqns])
        self.host_copies.refresh()          # offload params: the host's updated working copies

    def own_param_syncs(self) -> list:
        """The ``program.param_syncs`` this rank runs: all of them without pipeline stages."""
        return self.program.param_syncs

    # -- audit labels ----------------------------------------------------------------------------
    def _set_phase(self, phase: str) -> None:
        if self.recorder is not None:
            self.recorder.phase = phase

    def _on_collective(self, kind, axis: Group, nbytes: int, label: str) -> None:
        if self.recorder is not None:
            self.recorder.tensor = label

    # -- a step --------------------------------------------------------------------------------------
    def _local_inputs(self, inputs: Sequence[torch.Tensor], reads: frozenset[str] | None = None) -> list[torch.Tensor]:
        """This rank's pieces of the graph's inputs and buffers (``reads``: only these, by node name)."""
        if len(inputs) != len(self._user_inputs):
            raise PlanExecutionError(f"the traced graph takes {len(self._user_inputs)} inputs, got {len(inputs)}")
        buffers = dict(self.module.named_buffers())
        values = []
        for node in self._placeholders:
            if reads is not None and node.name not in reads:
                continue
            if node.name in self._constants:
                full = self.graph.exported.constants[self._constants[node.name]]
            elif node.kind is NodeKind.BUFFER:
                full = buffers[node.target]
            else:
                full = inputs[self._user_inputs.index(node.name)]
            nd = self.plan.signatures[node.name].outputs[0]
            if isinstance(full, torch.Tensor) and full.is_floating_point():   # as traced: the policy's dtype
                full = full.to(torch_dtype(node.outputs[0].dtype))
            values.append(self.step.place(full.to(self.device), nd) if isinstance(full, torch.Tensor) else full)
        return values

    def micro_batches(self, inputs: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor]]:
        """``inputs`` (one optimizer step's batch) cut along dim 0 into ``training.micro_batches``
        micro-steps of the traced batch each."""
        k = self.plan.training.micro_batches
        if k == 1:
            return [inputs]
        graph_inputs = {n.name: n.outputs[0] for n in self.graph.nodes_of(NodeKind.INPUT)}
        for name, t in zip(self._user_inputs, inputs):
            want = graph_inputs[name].shape[0] if graph_inputs[name].shape else None
            if want is None or t.dim() == 0 or t.shape[0] != want * k:
                raise PlanExecutionError(f"input {name}: {k} micro-steps of the traced batch "
                                         f"{want} need {k * (want or 0)} samples on dim 0, got shape "
                                         f"{tuple(t.shape)}; pass the whole optimizer step's batch")
        return split_micro_batches(inputs, k)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run the compiled program; the gradient sync finishes at the end of the loss's backward.

        Returns the tensor to call ``backward()`` on. With ``program.loss_async`` or
        ``program.loss_bucket`` it is this rank's share of the loss, reduced later (its all-reduce in
        flight, or the gradient sync's bucket to come): ``forward_backward`` reads the loss."""
        self._set_phase("forward")
        self.step.start_step()
        self.host_copies.start_step()
        if self.host_copies.act_group:             # offload activations: saved tensors to the host
            with self.host_copies.hooks():
                loss = self.run_program(*self._local_inputs(inputs))
            self.host_copies.end_forward()
        else:
            loss = self.run_program(*self._local_inputs(inputs))
        if loss.requires_grad:
            loss.register_hook(self._queue_finish)
        return loss

    def forward_backward(self, inputs: Sequence[torch.Tensor]) -> float:
        """Forward and backward of one optimizer step's ``inputs``, micro-step by micro-step (losses
        scaled by 1 / micro-steps, so that the gradient is the whole batch's mean; the gradient sync
        finishes inside the last backward); returns the loss (mean over the micro-steps). The losses
        are read after the last micro-step: with ``program.loss_async`` each read waits for that
        micro-step's loss all-reduce, which the program waits for at the step's end, not between
        micro-steps; with ``program.loss_bucket`` the gradient sync reduced their sum."""
        micro = self.micro_batches(inputs)
        losses = []
        for i, chunk in enumerate(micro):
            self.grad_sync.last_micro_step = i == len(micro) - 1
            loss = self(*chunk)
            (loss / len(micro) if len(micro) > 1 else loss).backward()
            losses.append(loss)
        return self.step.mean_loss(losses)

    def compile_local(self) -> None:
        """Run the local program through ``torch.compile`` (``autoddl run --compile``)."""
        self.run_program = torch.compile(self.local_program)

    def held_parameters(self) -> frozenset[str]:
        """The parameters (fqns) this rank holds and updates: all of them without pipeline stages."""
        return frozenset(self.local_params)

    def loss_value(self, loss: torch.Tensor) -> float:
        """The step's loss, the same on every rank."""
        return self.step.loss_value(loss)

    def _queue_finish(self, grad: torch.Tensor) -> torch.Tensor:
        self._set_phase("backward")
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        return grad

    def _finish_backward(self) -> None:
        with torch.no_grad():
            self.grad_sync.finish()
        self._set_phase("optimizer")


def distributed_model(model: nn.Module, graph: OpGraph, plan: Plan, mesh: DeviceMesh, *,
                      recorder: CommRecorder | None = None) -> DistributedModel:
    """The DistributedModel that runs ``plan``: a PipelinedModel (executor/pipelined.py) when the plan
    has pipeline stages."""
    if pipeline_degree(plan) > 1:
        from executor.pipelined import PipelinedModel      # it builds on this module

        return PipelinedModel(model, graph, plan, mesh, recorder=recorder)
    return DistributedModel(model, graph, plan, mesh, recorder=recorder)


def torch_optimizer(name: str, params, lr: float, **kw) -> torch.optim.Optimizer:
    name = name.lower()
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **kw)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **kw)
    raise ValueError(f"unknown optimizer {name!r}: use 'sgd' or 'adamw'")


class LocalShardOptimizer:
    """SGD / AdamW stepping each DTensor parameter's local shard, in one foreach pass.

    Both are elementwise, so updating every device's piece on its own is the same update
    as on the full tensor (parameters are stored S or B, never P), without DTensor's
    per-tensor dispatch (about 0.5 ms per parameter on a CPU core, against ~30 us here).
    The local tensors share storage with the parameters: the step updates them in place.
    """

    def __init__(self, name: str, params, lr: float = 1e-2):
        self.params = [p for p in params if p.requires_grad]
        with torch.no_grad():
            self.locals = [local_of(p) for p in self.params]
        self.inner = torch_optimizer(name, self.locals, lr, foreach=True)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()
        for t in self.locals:
            t.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """The local gradients DistributedModel's sync wrote; a DTensor ``.grad`` set by other code
        takes their place."""
        for p, t in zip(self.params, self.locals):
            if p.grad is not None:
                t.grad = (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach()
        self.inner.step()

    def state_dict(self) -> dict:
        return self.inner.state_dict()


def local_of(p: torch.Tensor) -> torch.Tensor:
    """The local tensor the optimizer steps for ``p``: its ZeRO-1/2 shard, else the one a
    DistributedModel keeps (shared storage), else ``p``'s local piece."""
    local = getattr(p, "_autoddl_opt_local", None)
    if local is not None:
        return local
    local = getattr(p, "_autoddl_local", None)
    if local is not None:
        return local
    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def build_optimizer(name: str, params, lr: float = 1e-2):
    """The plan's optimizer by name ("sgd" or "adamw"), the same for the reference run.

    DTensor parameters get a :class:`LocalShardOptimizer` (the step on local shards);
    plain ones a torch optimizer.
    """
    params = list(params)
    if any(isinstance(p, DTensor) for p in params):
        return LocalShardOptimizer(name, params, lr)
    return torch_optimizer(name, params, lr)


def split_micro_batches(inputs: Sequence[torch.Tensor], k: int) -> list[Sequence[torch.Tensor]]:
    """``inputs`` cut into ``k`` equal micro-batches along dim 0 (a model file's ``StepInputs``
    stay ``StepInputs``, with their forward / target split)."""
    if k == 1:
        return [inputs]
    columns = [t.chunk(k, dim=0) for t in inputs]
    return [with_values(inputs, [c[i] for c in columns]) for i in range(k)]


def with_values(inputs: Sequence[Any], values: Sequence[Any]) -> Sequence[Any]:
    """``values`` in the layout of ``inputs`` (a model file's ``StepInputs`` keep their forward /
    target split; a plain sequence becomes a list)."""
    if not hasattr(inputs, "split"):
        return list(values)
    from autoddl.trace import StepInputs

    args, kwargs, targets = inputs.split(values)
    return StepInputs(args, kwargs, targets if inputs.has_targets else None)


def train_step(dmodel: DistributedModel, inputs: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> float:
    """One optimizer step over ``inputs``: forward and backward per micro-step (the gradient sync
    finishes inside the last backward; losses scaled by 1 / micro-steps, so the gradient is the
    whole batch's mean), optimizer step; returns the loss (mean over the micro-steps)."""
    optimizer.zero_grad(set_to_none=True)
    loss = dmodel.forward_backward(inputs)
    optimizer.step()
    dmodel.sync_parameters()
    return loss


def audit_step(dmodel: DistributedModel, inputs: Sequence[torch.Tensor],
               optimizer: torch.optim.Optimizer) -> list[CommRecord]:
    """Run one training step with a CommRecorder; return the collectives it ran."""
    rec = CommRecorder(dmodel.mesh, dmodel.boxer.groups)
    old, dmodel.recorder = dmodel.recorder, rec
    try:
        with rec:
            train_step(dmodel, inputs, optimizer)
    finally:
        dmodel.recorder = old
    return rec.records


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: relative to the tensor's scale, so near-zero entries do not dominate."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if actual.shape != expected.shape:
        return float("inf")
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


class _PolicyModel(nn.Module):
    """``model`` run with working copies of its parameters in ``param_dtype`` (gradients flow back
    to the float32 masters through the casts)."""

    def __init__(self, model: nn.Module, param_dtype: str):
        super().__init__()
        self.model, self.param_dtype = model, param_dtype

    def forward(self, *args, **kwargs):
        params = {k: working_copy(p, self.param_dtype) for k, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, params, args, kwargs, tie_weights=True)


def reference_loss(model: nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable,
                   param_dtype: str = "float32") -> torch.Tensor:
    """One eager step's loss on one process, under the precision policy: a model file's inputs know
    their forward / loss split (``StepInputs.step_loss``: keyword inputs, targets); a plain tuple
    is ``loss_fn(model(*x), *x)``."""
    values = tuple(inputs)
    if param_dtype != "float32":       # as autoddl.trace traces it: autoddl/precision.py
        model = _PolicyModel(model, param_dtype)
        n_forward = inputs.n_args + len(inputs.kwarg_names) if hasattr(inputs, "n_args") else len(values)
        values = cast_forward_inputs(values, n_forward, param_dtype)
    if hasattr(inputs, "step_loss"):
        return inputs.step_loss(model, loss_fn, values)
    return loss_fn(model(*values), *values)


def run_check(model: nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable, graph: OpGraph,
              plan: Plan, mesh: DeviceMesh, *, optimizer: str = "sgd", lr: float = 1e-2,
              steps: int = 1) -> dict[str, float]:
    """Train ``steps`` steps distributed and single-process; max relative errors per tensor.

    Keys: ``loss`` (worst over steps), ``grad/<fqn>`` (last step), ``param/<fqn>`` (after the
    last optimizer step). Every rank must call it (gathering to full tensors is collective).
    """
    # The reference runs on the plan's device type: on GPUs a CPU reference would measure the two
    # devices' kernels (bf16 accumulation orders), not the plan.
    device = torch.device(mesh.device_type)
    ref = copy.deepcopy(model).to(device)
    ref_inputs = with_values(inputs, [t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs])
    dmodel = distributed_model(model, graph, plan, mesh)
    d_opt = build_optimizer(optimizer, dmodel.parameters(), lr)
    r_opt = build_optimizer(optimizer, ref.parameters(), lr)
    errors: dict[str, float] = {}
    for _ in range(steps):
        d_loss = train_step(dmodel, inputs, d_opt)
        r_opt.zero_grad(set_to_none=True)
        micro = split_micro_batches(ref_inputs, plan.training.micro_batches)    # the same micro-steps
        r_loss = 0.0
        for chunk in micro:
            loss = reference_loss(ref, chunk, loss_fn, plan.training.param_dtype)
            (loss / len(micro)).backward()
            r_loss = r_loss + loss.detach().float() / len(micro)
        r_grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
        r_opt.step()
        if not math.isnan(d_loss):        # a pipeline's loss is known on its last stage only
            errors["loss"] = max(errors.get("loss", 0.0), max_rel_error(torch.tensor(d_loss), r_loss))
    d_params = dict(dmodel.module.named_parameters())
    held = dmodel.held_parameters()
    for fqn, p in ref.named_parameters():
        if fqn not in held:               # another pipeline stage's
            continue
        dp = d_params[fqn]
        if fqn in r_grads:
            grad = local_of(dp).grad
            if grad is None:
                errors[f"grad/{fqn}"] = float("inf")
            else:
                layout = getattr(dp, "_autoddl_opt_layout", None)
                placements = layout.to_placements() if layout is not None else dp.placements
                full = DTensor.from_local(grad.contiguous(), mesh, placements, run_check=False, shape=dp.shape,
                                          stride=dp.stride()).full_tensor()
                errors[f"grad/{fqn}"] = max_rel_error(full, r_grads[fqn])
        errors[f"param/{fqn}"] = max_rel_error(dp.detach().full_tensor(), p)
    return worst_over_ranks(errors)


def worst_over_ranks(errors: dict[str, float]) -> dict[str, float]:
    """Per key, the largest error any rank reported (a pipeline stage reports its own parameters)."""
    every: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, errors)
    out: dict[str, float] = {}
    for mine in every:
        for key, value in (mine or {}).items():
            out[key] = max(out.get(key, value), value)
    return {"loss": out.pop("loss", math.inf), **out}


def audit_records(dmodel: DistributedModel, records: list[CommRecord]) -> list[CommRecord]:
    """The collectives of one step, as the program lists them: the records of the rank whose mesh
    coordinate is 0 on every axis but ``pp`` (the ranks of one pp rank run the same collectives), of
    every pp rank in turn; every rank must call it."""
    every: list[tuple[tuple[int, ...], list[CommRecord]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (tuple(dmodel.boxer.coord), records))
    staged = pipeline_degree(dmodel.plan) > 1
    chosen = sorted((coord, recs) for coord, recs in every if not any(coord[1 if staged else 0:]))
    return [r for _, recs in chosen for r in recs]


# -- parallelize: a plan inside the user's own training loop ----------------------------------------

class _Reported(torch.autograd.Function):
    """The reduced loss as the value, this rank's share as what the gradient flows into."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
        return reduced.reshape(share.shape).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ParallelModule(DistributedModel):
    """A DistributedModel for a plain training loop: ``loss = m(*inputs); loss.backward(); opt.step()``.

    ``forward(*inputs)`` runs the plan's graph, which includes the loss function it was traced
    with, and returns the loss (a plain scalar tensor, the same on every rank). At the end of
    every ``backward()`` the gradients, synced to their storage layout, are added to each DTensor
    parameter's ``.grad``, so any torch optimizer over ``parameters()`` works and gradients
    accumulate over several backward passes as usual until its ``zero_grad``.
    """

    loss_at_forward = True       # forward returns the reduced loss: no bucket can carry it

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The loss, the same on every rank, as a tensor to call ``backward()`` on."""
        share = super().forward(*inputs)
        if not self.program.loss_async:
            return share
        return _Reported.apply(share, torch.tensor(self.loss_value(share), dtype=share.dtype))

    def _finish_backward(self) -> None:
        super()._finish_backward()
        for p in self.module.parameters():
            local = getattr(p, "_autoddl_local", None)
            if local is None or local.grad is None:
                continue
            g = DTensor.from_local(local.grad, self.mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
            p.grad = g if p.grad is None else p.grad + g
            local.grad = None


def parallelize(model: nn.Module, plan: Plan, example_inputs: Sequence[torch.Tensor] | None = None,
                loss_fn: Callable | None = None, *, device: str = "cpu",
                timeout_s: float = 120.0, keep_freed_memory: bool = True) -> ParallelModule:
    """Inside a torchrun process: ``model`` laid out as ``plan`` says, as a ParallelModule.

    Initialises the process group (gloo, or nccl with ``device="cuda"``) if it is not, and the
    plan's DeviceMesh. The plan's graph includes the loss, so ``forward(*inputs)`` returns the
    loss; the model is traced with ``example_inputs`` and ``loss_fn``, by default those of the
    model file the plan was made for (``plan.model`` with ``plan.model_args``), and the trace must
    match the plan's graph hash. Parameters are DTensors by their storage NdSbp; pass
    ``module.parameters()`` to any torch optimizer. Every rank must pass the same full model
    (same seed) and, at each step, the same full batch.

    On CPU the process then keeps the memory its steps free for the next ones
    (executor/allocator.py ``keep_freed_memory``: glibc's thresholds), as the ranks of ``autoddl
    run`` and the calibration do, so the steps run as the cost model was calibrated;
    ``keep_freed_memory=False`` leaves the C library's heap as it was.
    """
    if pipeline_degree(plan) > 1:
        raise ValueError(f"parallelize: plan {plan.name!r} has pipeline stages (pp={pipeline_degree(plan)}), which run "
                         "as a whole schedule per step, not as one module's forward; run it with `autoddl run`")
    if example_inputs is None or loss_fn is None:
        if not plan.model or not os.path.isfile(plan.model):
            raise ValueError(f"parallelize: plan {plan.name!r} names no model file to take "
                             f"{'example_inputs' if example_inputs is None else 'loss_fn'} from "
                             f"(plan.model={plan.model!r}); pass example_inputs= and loss_fn=")
        from autoddl.loader import load_model_file

        mf = load_model_file(plan.model, device="meta", **plan.model_args)
        example_inputs = mf.example_inputs if example_inputs is None else example_inputs
        loss_fn = mf.loss_fn if loss_fn is None else loss_fn
    from autoddl.trace import trace

    graph = trace(model, example_inputs, loss_fn, name=type(model).__name__, param_dtype=plan.training.param_dtype)
    if keep_freed_memory and device == "cpu":
        allocator.keep_freed_memory()
    owns_group = not dist.is_initialized()
    mesh = init_mesh(plan, device, timeout_s=timeout_s)
    if owns_group:                      # ours to start, so ours to shut down when the script ends
        atexit.register(_shut_down, weakref.ref(mesh))
    return ParallelModule(model, graph, plan, mesh)


def close_process_group() -> None:
    """Wait for every rank (a barrier: no rank closes its connections while a peer still uses them,
    the mesh's flattened groups included), then destroy the process group and every group made from it."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _shut_down(mesh_ref: "weakref.ref[DeviceMesh]") -> None:
    """At exit, while the interpreter is whole: wait for every rank (a barrier: no rank closes its
    connections while a peer still uses them), destroy the process group, and drop the groups the
    mesh keeps (the user's DTensors keep the mesh), so that the groups and their gloo threads end
    here. Left to the interpreter's teardown, they made gloo abort the process now and then under
    load ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    try:
        close_process_group()
    finally:
        mesh = mesh_ref()
        if mesh is not None:
            getattr(mesh, "_pg_registry", {}).clear()   # DeviceMesh's name -> group cache (torch 2.13)
