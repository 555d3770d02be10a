"""Run a pipelined plan: each virtual stage's local program as a ``torch.distributed.pipelining`` stage.

A plan whose outermost mesh axis is ``pp`` (autoddl/pipeline.py) is lowered once, as any plan, into
its step program; each rank runs the virtual stages ``chunk * P + pp_rank`` of it. Per stage:

- the stage's part of the program (``autoddl.pipeline_program.stage_program``: its ops' inputs,
  edges, parameter uses and gradient buckets) is compiled by executor/compiled.py into a local fx
  program whose inputs are the boundary tensors the stage before sent (``StageIO.received``, in the
  producer's layout) and the graph inputs it reads itself, and whose outputs are the tensors it sends
  on (``StageIO.sent``), or the loss on the last stage. Collectives of the stage's own ops and its
  gradient sync run on the non-pp axes' process groups, as without stages (a mesh axis's group holds
  the ranks that share every other coordinate, the pp one included);
- that program is wrapped as a ``PipelineStage`` (static shapes: the boundary tensors' local shapes
  per micro-batch, so no shape inference runs) over the pp axis's process group, with the gradient
  sync of executor/gradsync.py at the end of each micro-batch's backward: syncs that wait for the last
  micro-step run in a chunk's last backward only, as the program says.

The plan's schedule runs them: ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``
(virtual stages), over ``Training.micro_batches`` micro-batches; every graph input goes to every stage
as a keyword argument (the schedule cuts it into micro-batches, each stage places its local piece),
the loss is the last stage's graph output over the micro-batch count (the schedule's loss function;
no gradient rescaling). After the schedule, the gradients of parameters held on more than one pp rank
(``PipelineLayout.tied``) are all-reduced over the pp axis. Every send of the schedule is told to the
audit (``CommRecorder.note``: kind ``send_recv`` on the pp axis, the tensor's bytes), next to the
functional collectives it records itself.

ZeRO inside the stages runs as the program says, with the non-pipelined executor's code: a stage's
ZeRO-3 groups (``StepProgram.gathers``, kept gathered under pp) are all-gathered by its LocalStep
in the chunk's first forward and kept for the step (``LocalStep.start_step`` once per step), their
gradients carried and reduce-scattered in the chunk's last backward (GradSync, the pipelined
``syncs_every_micro_step``); ZeRO-1/2: after the optimizer, each rank all-gathers its own
parameters' updated pieces (``ParamSync.pp_rank``), and a tied parameter's pp all-reduce carries
the gradient on the optimizer's piece.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import TensorRef
from autoddl.pipeline_program import StageIO, stage_io, stage_program
from autoddl.precision import torch_dtype
from autoddl.program import layout_of
from executor.compiled import LocalStep, ProgramCompiler
from executor.gradsync import GradSync
from executor.moves import wait
from executor.runtime import DistributedModel, PlanExecutionError, local_of

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}

SendHook = Callable[[str, torch.Tensor, str], None]     # (phase, tensor sent, label) -> None


class StageModule(nn.Module):
    """One stage's compiled program as the module a PipelineStage calls: the received tensors as
    positional arguments, the graph inputs (``input0``, ``input1``, ...) as keywords."""

    def __init__(self, program: torch.fx.GraphModule, local_inputs: Callable[[Sequence[torch.Tensor]], list]):
        super().__init__()
        self.program, self.local_inputs = program, local_inputs

    def forward(self, *received: torch.Tensor, **inputs: torch.Tensor):
        values = [inputs[f"input{i}"] for i in range(len(inputs))]
        return self.program(*received, *self.local_inputs(values))


class ProgramStage(PipelineStage):
    """A PipelineStage that labels the audit's phases, runs the stage's gradient sync after each
    micro-batch's backward and tells ``on_send`` of every tensor it sends."""

    def __init__(self, module: StageModule, io: StageIO, num_stages: int, device: torch.device, group,
                 example: tuple[tuple[torch.Tensor, ...], Any], grad_sync: GradSync, micro_batches: int,
                 set_phase: Callable[[str], None], on_send: SendHook):
        super().__init__(module, io.stage, num_stages, device, input_args=example[0], output_args=example[1],
                         group=group)
        self.io, self.grad_sync, self.micro_batches = io, grad_sync, micro_batches
        self.set_phase, self.on_send = set_phase, on_send

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        self.set_phase("forward")
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        self.grad_sync.last_micro_step = bwd_chunk_id == self.micro_batches - 1
        self.set_phase("backward")
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        with torch.no_grad():
            self.grad_sync.finish()

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        for op, b in zip(ops, self.io.sent):
            self.on_send("forward", op.tensor, f"{b.ref}->stage{self.io.stage + 1}")
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        for op, b in zip(ops, [b for b in self.io.received if b.grad]):
            self.on_send("backward", op.tensor, f"grad {b.ref}->stage{self.io.stage - 1}")
        return ops


class PipelinedModel(DistributedModel):
    """A pipelined plan on one rank (module docstring): ``forward_backward`` runs the schedule."""

    def _compile(self) -> None:
        layout = self.program.pipeline
        if layout.schedule == "1f1b" and layout.micro_batches < layout.virtual:
            raise PlanExecutionError(f"plan {self.plan.name!r}: torch's Schedule1F1B needs at least as many "
                                     f"micro-batches as stages ({layout.micro_batches} < {layout.virtual}); "
                                     f"plan with --global-batch-size >= {layout.virtual} micro-batches or "
                                     "--schedule gpipe")
        self.layout, self.pp_rank = layout, self.boxer.coord[0]
        self.held = layout.rank_params[self.pp_rank]
        self.steps: list[LocalStep] = []
        chunks = range(layout.virtual_stages)
        self.stages = stages = [self._stage(chunk * layout.stages + self.pp_rank) for chunk in chunks]
        self.step, self.grad_sync = self.steps[0], stages[0].grad_sync     # placement of inputs; API parity
        self.last_step = next((s for st, s in zip(stages, self.steps) if st.io.last), None)
        m = layout.micro_batches
        schedule = SCHEDULES[layout.schedule]
        loss_fn = partial(_scaled_loss, micro_batches=m)
        self.schedule = (schedule(stages, m, loss_fn=loss_fn, scale_grads=False) if layout.schedule == "interleaved"
                         else schedule(stages[0], m, loss_fn=loss_fn, scale_grads=False))     # one stage per rank
        self._target = torch.zeros(m)           # the schedule cuts a target per micro-batch; the graph has its own

    def _stage(self, vs: int) -> ProgramStage:
        """Virtual stage ``vs``'s compiled program as a ProgramStage."""
        io = stage_io(self.graph, self.layout, vs)
        program = stage_program(self.program, io)
        grad_sync = self._grad_sync(program)
        step = LocalStep(program, self.boxer, self.local_params, grad_sync, param_dtype=self.plan.training.param_dtype)
        self.steps.append(step)
        compiled = ProgramCompiler(self.graph, self.plan, step, self.device, self._fx_targets, io).compile()
        module = StageModule(compiled, partial(self._local_inputs, reads=io.reads))
        return ProgramStage(module, io, self.layout.virtual, self.device, self.mesh.get_group(0), self._example(io),
                            grad_sync, self.layout.micro_batches, self._set_phase, self._on_send)

    def _example(self, io: StageIO) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Empty tensors of the stage's received and sent local shapes (one micro-batch): the static
        metadata of its PipelineStage; a tensor requires grad where its gradient is sent back."""
        received = tuple(self._empty(b.ref, b.grad) for b in io.received)
        if io.last:
            loss = self.program.loss
            return received, self._empty(TensorRef(loss.node, loss.index), False, whole=True)
        return received, tuple(self._empty(b.ref, b.grad) for b in io.sent)

    def _empty(self, ref: TensorRef, grad: bool, whole: bool = False) -> torch.Tensor:
        meta = self.graph.meta_of(ref)
        shape = meta.shape if whole else layout_of(self.graph, self.plan, ref).local_shape(meta.shape,
                                                                                            self.plan.mesh.shape)
        return torch.empty(tuple(shape), dtype=torch_dtype(meta.dtype), device=self.device).requires_grad_(grad)

    def _on_send(self, phase: str, tensor: torch.Tensor, label: str) -> None:
        if self.recorder is not None:
            self.recorder.note(CollectiveKind.SEND_RECV.value, 0, tensor.numel() * tensor.element_size(), phase,
                               label, str(tensor.dtype).removeprefix("torch."))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        raise PlanExecutionError(f"plan {self.plan.name!r} has pipeline stages: a step runs the whole schedule "
                                 "(forward_backward / executor.runtime.train_step), not one forward")

    def forward_backward(self, inputs: Sequence[torch.Tensor]) -> float:
        """The schedule over one optimizer step's ``inputs``, then the tied gradients' pp all-reduce;
        returns the loss (mean over the micro-batches) on the ranks of the last stage, NaN elsewhere."""
        self.micro_batches(inputs)                  # checks the batch: micro-batches x the traced batch
        for step in self.steps:                     # ZeRO-3 groups: gathered in a chunk's first forward, kept
            step.start_step()
        losses: list[torch.Tensor] = []
        self.schedule.step(target=self._target, losses=losses, return_outputs=False,
                           **{f"input{i}": t for i, t in enumerate(inputs)})
        self._sync_tied()
        self._set_phase("optimizer")
        if self.last_step is None:
            return math.nan
        m = self.layout.micro_batches
        if self.program.loss_async:                 # each micro-batch's loss all-reduce, launched in its forward
            return sum(self.last_step.loss_value(loss) for loss in losses) / m
        return sum(float(loss.detach()) for loss in losses)

    def _sync_tied(self) -> None:
        """``layout.tied``: each parameter's gradient as its optimizer receives it (ZeRO-1/2: on the
        optimizer's shard) all-reduced over the pp axis in the reduce dtype (a rank that does not hold
        it adds zeros), so every copy takes the same update."""
        dtype = torch_dtype(self.plan.training.grad_reduce_dtype)
        params = dict(self.module.named_parameters(remove_duplicate=False))
        self._set_phase("grad_sync")
        with torch.no_grad():
            for fqn in self.layout.tied:
                local = local_of(params[fqn])
                grad = local.grad if fqn in self.held and local.grad is not None else torch.zeros_like(local)
                self._on_collective(CollectiveKind.ALL_REDUCE, 0, grad.numel() * dtype.itemsize, f"tied {fqn}")
                summed = wait(funcol.all_reduce(grad.to(dtype), "sum", self.boxer.groups[0]))
                if fqn in self.held:
                    local.grad = summed.to(local.dtype)

    def held_parameters(self) -> frozenset[str]:
        return self.held

    def own_param_syncs(self) -> list:
        """ZeRO-1/2: the parameter syncs of this pp rank's parameters (``ParamSync.pp_rank``)."""
        return [s for s in self.program.param_syncs if s.pp_rank == self.pp_rank]

    def compile_local(self) -> None:
        """Each stage's local program through ``torch.compile``."""
        for stage in self.stages:
            stage.submod.program = torch.compile(stage.submod.program)


def _scaled_loss(output: torch.Tensor, target: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """The schedule's loss function: the stage's loss output (the graph computes the loss) over the
    micro-batch count, so that the gradients add up to the whole batch's mean."""
    return output / micro_batches

