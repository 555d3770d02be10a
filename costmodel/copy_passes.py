"""The copies the executor makes around its flat collectives, counted and priced.

A collective moves one flat buffer, so the tensors it carries are copied in before it and out after
it. DistributedDataParallel (bucket copy-in) and FSDP2 (copy-in / copy-out of its all-gathers) make
the same copies; at a few bytes per FLOP they are a real share of a step where the model is small or
memory is slow (on the 2-core VM, 10 GB/s: ~2.6 ms per 13 MB of gradients copied once). Per step:

- a **gradient bucket** (executor/gradsync.py ``_all_reduce``, ``_reduce_scatter``): each use's
  gradient (dst layout) copied into the bucket's flat buffer, once per sync (the last micro-step's,
  or every micro-step's for reduce-scatters alone). Where that copy casts (into another
  ``reduce_dtype``) it is already a master pass (costmodel/master_passes.py); only the copies that
  keep the dtype are counted here. The synced gradients are views of the buffer (no copy out). The
  bucket that carries the loss (``StepProgram.loss_bucket``) has it copied into its last element,
  once per step (the later micro-steps' shares are added to it in place: 1-element adds, left out);
- a **ZeRO-3 group gather** (executor/compiled.py ``_launch_gather``, ``_unpack``, ``_regather``):
  the group's working shards flattened by one ``cat``, the gathered buffer copied into one whole
  tensor per use (``executor.moves.unflatten_gathered``); per micro-step, once more when the group is
  gathered again for backward, which also copies each whole into the tensor autograd saved; once per
  step when a pipeline stage keeps it gathered;
- a **ZeRO-1/2 parameter sync** (executor/runtime.py ``sync_parameters``): the updated working
  shards flattened by one ``cat``, the gathered buffer copied into each parameter in place.

What a parameter sync costs the host beyond those copies and its all-gather (per parameter: the
views that address its shard and its place in the gathered buffer, the calls around them) is
``executor.param_sync_us``, measured by ``autoddl calibrate`` on the executor's own sync
(:func:`param_sync_host_s`); what a ZeRO-3 gather costs it per parameter it unpacks, each time, is
``executor.param_gather_us``, measured on the executor's own gather (:func:`param_gather_host_s`).

Left out: the ``contiguous`` of a reduce-scattered piece split on a dim other than its first, and
the casts of ZeRO-1/2's float32 shards to the working dtype before their sync (mixed precision).

Each pass is priced as the master passes are (:func:`costmodel.master_passes.passes_time_s`: one op
of its family, bytes at the memory roofline; a ``copy`` at its roofline plus the unmeasured per-op
cost, as no measured family describes it) and added to the step's
optimizer task, where the master passes are: the copies run on the compute stream, and for a rank
that computes serially where they run does not change the step time (a copy in backward that a
bucket waits for delays the bucket by as much). The counts are checked against the ``copy_`` and
``cat`` ops that ran (tests/test_copy_passes.py, executor.audit.OpRecorder).
"""

from __future__ import annotations

import math
from typing import Sequence

from autoddl.boxing import group_size
from autoddl.cluster import Cluster
from autoddl.precision import MASTER_DTYPE
from autoddl.program import ParamUse, StepProgram, syncs_every_micro_step
from autoddl.training import Training
from costmodel.master_passes import Pass


def copy_passes(program: StepProgram, training: Training, only: frozenset[str] | None = None) -> list[Pass]:
    """The executor's copies around ``program``'s collectives in one step (module docstring);
    ``only``: those of these parameters (a pipeline rank's)."""
    return (bucket_passes(program, training, only) + gather_passes(program, training, only)
            + param_sync_passes(program, training, only))


def bucket_passes(program: StepProgram, training: Training, only: frozenset[str] | None = None) -> list[Pass]:
    """Each bucketed use's gradient copied into its bucket, where the copy does not cast."""
    k, red, pipelined = training.micro_batches, training.grad_reduce_dtype, program.pipeline is not None
    out = []
    for bucket in program.buckets:
        for use in (program.param_uses[i] for i in bucket.uses):
            if only is not None and use.fqn not in only:
                continue
            every = syncs_every_micro_step([use], pipelined)
            held = training.param_dtype if every or k == 1 else MASTER_DTYPE   # what is copied in
            if held == red:
                out.append(Pass("copy", red, red, _numel(use.dst, use, program.mesh_shape), k if every else 1))
    if program.loss_bucket >= 0 and only is None and program.edges[program.loss].meta.dtype == red:
        out.append(Pass("copy", red, red, 1, 1))         # the loss into its bucket
    return out


def gather_passes(program: StepProgram, training: Training, only: frozenset[str] | None = None) -> list[Pass]:
    """Per ZeRO-3 gather of a group: one ``cat`` of its shards, one copy per use out of the buffer;
    a gather again for backward also copies each whole into the tensor autograd saved."""
    work, out = training.param_dtype, []
    for g in _gathers_of(program, only):
        uses = [program.param_uses[i] for i in g.uses]
        gathers = g.gathers_per_step(training.micro_batches, program.pipeline is not None)
        n, shards = group_size(g.axis, program.mesh_shape), [_numel(u.storage, u, program.mesh_shape) for u in uses]
        out.append(Pass("cat", work, work, sum(shards), gathers))
        out += [Pass("copy", work, work, shard * n, gathers + (training.micro_batches if g.reshard else 0))
                for shard in shards]
    return out


def param_sync_passes(program: StepProgram, training: Training, only: frozenset[str] | None = None) -> list[Pass]:
    """Per ZeRO-1/2 parameter sync: one ``cat`` of the updated shards, one copy per parameter into it."""
    work, out = training.param_dtype, []
    for sync in _syncs_of(program, only):
        uses = [program.uses_of(fqn)[0] for fqn in sync.fqns]
        wholes = [_numel(u.storage, u, program.mesh_shape) for u in uses]
        out.append(Pass("cat", work, work, sum(wholes) // group_size(sync.axis, program.mesh_shape), 1))
        out += [Pass("copy", work, work, whole, 1) for whole in wholes]
    return out


def param_sync_host_s(program: StepProgram, cluster: Cluster, only: frozenset[str] | None = None) -> float:
    """Seconds of the executor's own host work in the ZeRO-1/2 parameter syncs of one step, beyond their
    all-gathers and copy passes: ``executor.param_sync_us`` per parameter synced (``only``: of these)."""
    synced = sum(len(s.fqns) for s in _syncs_of(program, only))
    return synced * cluster.executor.param_sync_us * 1e-6 * cluster.time_sharing(tuple(program.mesh_shape))


def param_gather_host_s(program: StepProgram, training: Training, cluster: Cluster,
                        only: frozenset[str] | None = None) -> float:
    """Seconds of the executor's own host work in the ZeRO-3 group gathers of one step, beyond their
    all-gathers and copy passes: ``executor.param_gather_us`` per parameter use a gather unpacks, each
    time the group is gathered (``GatherGroup.gathers_per_step``: per micro-step, once more for backward
    where it is resharded after forward; ``only``: the groups holding one of these parameters)."""
    pipelined = program.pipeline is not None
    unpacked = sum(len(g.uses) * g.gathers_per_step(training.micro_batches, pipelined)
                   for g in _gathers_of(program, only))
    return unpacked * cluster.executor.param_gather_us * 1e-6 * cluster.time_sharing(tuple(program.mesh_shape))


def _gathers_of(program: StepProgram, only: frozenset[str] | None) -> list:
    """``program``'s ZeRO-3 group gathers, or (``only``) those holding one of these parameters."""
    return [g for g in program.gathers
            if only is None or any(program.param_uses[i].fqn in only for i in g.uses)]


def _syncs_of(program: StepProgram, only: frozenset[str] | None) -> list:
    """``program``'s ZeRO-1/2 parameter syncs, or (``only``) those all of whose parameters are these."""
    return [s for s in program.param_syncs if only is None or all(f in only for f in s.fqns)]


def _numel(layout, use: ParamUse, mesh_shape: Sequence[int]) -> int:
    return math.prod(layout.local_shape(use.meta.shape, mesh_shape))
