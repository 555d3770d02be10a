"""The element-wise passes over the float32 masters and their gradients that a step runs besides
the graph's ops: working-copy casts and gradient accumulation, counted and priced.

Under a mixed-precision policy every parameter use's leaf is a fresh working copy of its float32
master, cast once per micro-step (executor/compiled.py ``LocalStep.param_use``; an FSDP gather casts
the shard before moving it, as FSDP2 does). Its gradient, in ``param_dtype``, goes back to the
master's float32 ``.grad`` through the gradient sync (executor/gradsync.py), which, per use:

- gradient synced only at the last micro-step (DDP's ``no_sync``): keeps the micro-steps'
  gradients summed in float32: the first one cast (``.float()``), each later one added (k - 1
  adds); at the last micro-step the sum is cast to ``reduce_dtype`` for the collective (by the copy
  into its bucket, for a bucketed use) and the reduced gradient back to float32 (each a cast where
  the dtypes differ);
- gradient synced every micro-step (reduce-scatters alone, FSDP): each micro-step's gradient is
  cast to ``reduce_dtype`` and back to float32 where they differ, and added to ``.grad`` after the
  first (k - 1 adds).

In float32 with one micro-step none of these runs (the casts are no-ops, nothing accumulates),
which is how ``executor.param_us`` was calibrated; so they are priced here, each pass as one op of
the ``to`` / ``add`` family in the dtype it computes in, its bytes at the memory roofline, priced as
the graph's own ops of that family are (``costmodel.compute.forward_time_s``: the family's measured
fixed cost and work scale), and added to the step's optimizer task (the passes run
on the compute stream; where in the step they run does not change the step time of a rank that
computes serially). The counts are checked against the aten ops that ran
(tests/test_master_passes.py, executor.audit.OpRecorder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from autoddl.cluster import Cluster
from autoddl.precision import MASTER_DTYPE, itemsize
from autoddl.program import ParamUse, StepProgram, syncs_every_micro_step
from autoddl.training import Training
from costmodel.compute import forward_time_s, roofline_time_s


@dataclass(frozen=True)
class Pass:
    """``count`` element-wise passes over ``numel`` elements each: a cast (``to``) from ``src`` to
    ``dst`` dtype, an ``add`` of a ``src`` gradient into a ``dst`` (float32) sum, or a ``copy`` /
    ``cat`` that keeps the dtype (costmodel/copy_passes.py)."""

    op: str          # "to", "add", "copy" or "cat"
    src: str
    dst: str
    numel: int
    count: int

    @property
    def bytes_per_pass(self) -> int:
        """Bytes one pass reads and writes: a cast or copy reads src, writes dst; an add reads both, writes dst."""
        read = itemsize(self.src) + (itemsize(self.dst) if self.op == "add" else 0)
        return self.numel * (read + itemsize(self.dst))


def use_passes(use: ParamUse, training: Training, mesh_shape: Sequence[int], every_micro_step: bool,
               casts: int | None = None) -> list[Pass]:
    """The passes one parameter use makes per optimizer step (module docstring); ``casts``: its
    working-copy casts per step when not one per micro-step (:func:`step_passes`)."""
    if use.grad is None and not training.mixed:
        return []
    k, work, red = training.micro_batches, training.param_dtype, training.grad_reduce_dtype
    n_master = math.prod(use.storage.local_shape(use.meta.shape, mesh_shape))
    out = [Pass("to", MASTER_DTYPE, work, n_master, k if casts is None else casts)] if training.mixed else []
    if use.grad is None:
        return out
    n = math.prod(use.dst.local_shape(use.meta.shape, mesh_shape))
    n_sync = math.prod(use.storage.local_shape(use.meta.shape, mesh_shape))   # the reduced gradient
    if every_micro_step:
        casts = [Pass("to", work, red, n, k), Pass("to", red, MASTER_DTYPE, n_sync, k)]
        adds = Pass("add", MASTER_DTYPE, MASTER_DTYPE, n_sync, k - 1)
    else:
        summed = MASTER_DTYPE if k > 1 else work
        casts = [Pass("to", work, MASTER_DTYPE, n, 1 if k > 1 else 0), Pass("to", summed, red, n, 1),
                 Pass("to", red, MASTER_DTYPE, n_sync, 1)]
        adds = Pass("add", work, MASTER_DTYPE, n, k - 1)
    return out + [p for p in (*casts, adds) if p.count and (p.op == "add" or p.src != p.dst)]


def step_passes(program: StepProgram, training: Training, only: frozenset[str] | None = None) -> list[Pass]:
    """The passes of every parameter use of ``program`` (``only``: of these parameters) in one step.
    Working-copy casts: one per micro-step; two for a use of an FSDP group gathered again for
    backward (each gather casts the shards); one per step for a parameter kept on the host
    (``Training.offload``: its host copy is refreshed after the optimizer step, executor/offload.py)
    and for a use of an FSDP group kept gathered for the step (pipeline stages: gathered once)."""
    k = training.micro_batches
    pipelined = program.pipeline is not None
    spilled = {f for g in program.spills for f in g.fqns}

    def casts(u: ParamUse) -> int:
        if u.fqn in spilled:
            return 1
        return program.gathers[u.gather].gathers_per_step(k, pipelined) if u.gather >= 0 else k
    return [p for u in program.param_uses if only is None or u.fqn in only
            for p in use_passes(u, training, program.mesh_shape, syncs_every_micro_step([u], pipelined), casts(u))]


def passes_time_s(passes: Iterable[Pass], cluster: Cluster, mesh_shape: Sequence[int]) -> float:
    """Seconds the passes take on one rank: each one op of its family (``to`` in its source dtype,
    ``add`` in float32, a ``cat`` (costmodel/copy_passes.py) in its dtype) with its bytes at the
    memory roofline, priced as a graph op of that family is (:func:`costmodel.compute.forward_time_s`),
    slowed by ``cluster.time_sharing``. A ``copy`` is priced at its roofline plus the unmeasured
    per-op cost: the family it would take (``contiguous``) is measured on a transposed input
    (executor/calibrate.py ``Bench._op_calls``), strided reads a flat copy does not make (a profiled
    dp step on the 2-core VM copied its gradients into their bucket at about the roofline)."""
    total = 0.0
    for p in passes:
        dtype = p.src if p.op == "to" else p.dst
        work_s = roofline_time_s(0.0, p.bytes_per_pass, cluster, dtype=dtype)
        total += p.count * forward_time_s(p.op, dtype, work_s, cluster, inputs=2 if p.op == "add" else 1,
                                          measured=p.op != "copy")
    return total * cluster.time_sharing(tuple(mesh_shape))
