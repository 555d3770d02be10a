"""Gradient sync as the step program says: buckets launched asynchronously from backward hooks.

Every parameter use of the program is a fresh leaf each step (``ParamUses``).
When autograd has accumulated a leaf's gradient, its post-accumulate hook hands
it to ``GradSync``: a bucketed use counts down its bucket, and every bucket
whose gradients are all there is launched, in bucket order (every rank must
issue the same collectives in the same order), as one asynchronous functional
collective over a flat buffer, while backward goes on, as DistributedDataParallel's Reducer
does (data parallel over several mesh axes: one all-reduce over their flattened group, as DDP's
over all its ranks). At the end of backward (``finish``) the buckets are waited for and unpacked,
the uses synced on their own run their moves, and each parameter's gradient, in its storage
layout, is added to its local ``.grad``.

An all-reduce bucket's buffer is kept across steps and reduced in place, and the synced gradients
are views of it (DDP's ``gradient_as_bucket_view``): on the 2-core VM a fresh buffer each step, its
page faults and the out-of-place collective's copy cost gpt-4x256's dp plan ~25 ms a step (1.16x
DDP; 1.0x kept).

A reduce-scatter bucket lays its gradients out as FSDP2 does: each gradient's
scatter dim first, cut into one row per rank, the rows of all gradients side by
side, so rank r's slice of the flat result is its piece of every gradient (over
several mesh axes' flattened group, r is the rank's place in it: autoddl.boxing ``group_rank``).

Mixed precision: gradients (of the working copies, in ``param_dtype``) cross the
network in ``reduce_dtype`` and are added to the float32 masters' ``.grad``.

The loss: a program whose ``loss_bucket`` names a bucket reduces the loss in it, as one more float32
element after the gradients (autoddl/lowering.py ``loss_output``): the compiled program hands each
micro-step's share to ``hold_loss``, the bucket carries their sum, and ``reduced_loss`` reads it
after the sync.

Micro-steps: on every micro-step but the last (``last_micro_step`` False) only the
uses whose sync is reduce-scatters alone are synced (FSDP reduces sharded gradients
every micro-step); the others keep their gradient, summed in float32, for the last
micro-step's sync (DDP's ``no_sync``), as the program's ``deferred_syncs`` say.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol

from autoddl.boxing import Group, group_rank, group_size, group_split_dim
from autoddl.collective_kinds import CollectiveKind, carried_out_as
from autoddl.program import Bucket, ParamUse, StepProgram, syncs_every_micro_step
from autoddl.precision import torch_dtype
from executor.moves import Boxer, wait


class GradSync:
    """One step's gradient sync over ``program``'s uses and buckets; ``local_params`` by fqn."""

    def __init__(self, program: StepProgram, boxer: Boxer, local_params: dict[str, torch.Tensor],
                 set_phase: Callable[[str], None], reduce_dtype: str = "float32",
                 grad_targets: dict[str, tuple[torch.Tensor, tuple]] | None = None,
                 copy_out: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None):
        self.program, self.boxer, self.local_params, self.set_phase = program, boxer, local_params, set_phase
        self.copy_out = copy_out                     # offload params: synced gradients -> host (executor/offload.py)
        self.grad_targets = grad_targets or {}       # ZeRO-1/2: fqn -> (optimizer shard, local moves to it)
        self.reduce_dtype = torch_dtype(reduce_dtype)
        self.layouts = [self._layout(b) for b in program.buckets]   # per bucket, per use: fixed for the run
        self.carried: dict[int, torch.Tensor] = {}    # use -> gradient kept from earlier micro-steps (fp32)
        self.buffers: dict[int, torch.Tensor] = {}    # all-reduce bucket -> its flat buffer, kept across steps
        self.loss_shares: list[torch.Tensor] = []     # this rank's loss shares, for the loss bucket
        self._reduced_loss: torch.Tensor | None = None   # the loss bucket's last element, after its sync
        self.last_micro_step = True
        self.start_step()

    def _layout(self, bucket: Bucket) -> list[tuple[tuple[int, ...], int | None]]:
        """Each use's (gradient shape in its storage layout, scatter dim or None) in ``bucket``."""
        out = []
        for i in bucket.uses:
            use = self.program.param_uses[i]
            first, last = use.grad_sync[0].after, use.grad_sync[-1].after
            dim = group_split_dim(first, bucket.axis) if bucket.kind is CollectiveKind.REDUCE_SCATTER else None
            out.append((last.local_shape(use.meta.shape, self.boxer.mesh_shape), dim))
        return out

    def start_step(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        self.remaining = [len(b.uses) for b in self.program.buckets]
        self.in_flight: list[torch.Tensor | _RowOf | None] = []   # per bucket in order: its result, None when not synced now

    def _syncs_now(self, uses) -> bool:
        return self.last_micro_step or syncs_every_micro_step(uses, pipelined=self.program.pipeline is not None)

    def on_grad_ready(self, use_index: int, leaf: torch.Tensor) -> None:
        """Post-accumulate-grad hook of a use's leaf."""
        self.grads[use_index] = leaf.grad
        leaf.grad = None
        bucket = self.program.param_uses[use_index].bucket
        if bucket >= 0:
            self.remaining[bucket] -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while len(self.in_flight) < len(self.program.buckets) and self.remaining[len(self.in_flight)] == 0:
            bucket = self.program.buckets[len(self.in_flight)]
            uses = [self.program.param_uses[i] for i in bucket.uses]
            self.in_flight.append(self._launch(bucket) if self._syncs_now(uses) else None)

    def _launch(self, bucket: Bucket) -> torch.Tensor:
        uses = [self.program.param_uses[i] for i in bucket.uses]
        grads = [self._grad(u) for u in uses]
        self.set_phase("grad_sync")
        try:
            self._tell(bucket.kind, bucket.axis, bucket)
            if bucket.kind is CollectiveKind.ALL_REDUCE:       # on one axis or over a flattened group
                return self._all_reduce(bucket, grads)
            return self._reduce_scatter(bucket, uses, grads)
        finally:
            self.set_phase("backward")

    def _all_reduce(self, bucket: Bucket, grads: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's gradients copied (cast to the reduce dtype) into its flat buffer, all-reduced in
        place. The buffer is kept across steps, as DDP's bucket is: a fresh one every step costs its page
        faults (on the 2-core VM, copying 13 MB into new memory took ~12 ms, into a kept buffer ~1 ms), and an
        out-of-place collective one more copy. The synced gradients are views of it (``finish``). The
        loss bucket's last element is the sum of this rank's loss shares (module docstring)."""
        carries_loss = bucket.index == self.program.loss_bucket
        flat = self._kept_buffer(bucket, sum(g.numel() for g in grads) + carries_loss, grads[0].device)
        start = 0
        for g in grads:
            flat[start:start + g.numel()].view(g.shape).copy_(g)
            start += g.numel()
        if carries_loss:            # one copy in (costmodel/copy_passes.py), then 1-element adds
            last = flat[-1:]
            last.copy_(self.loss_shares[0])
            for share in self.loss_shares[1:]:
                last.add_(share)
            self.loss_shares = []
        return _all_reduce_in_place(flat, self.boxer.groups[bucket.axis])

    def hold_loss(self, share: torch.Tensor) -> None:
        """One micro-step's share of the loss, for the loss bucket (module docstring)."""
        self.loss_shares.append(share)

    def reduced_loss(self) -> float:
        """The sum over ranks and micro-steps of the loss shares the last sync carried."""
        if self._reduced_loss is None:
            raise RuntimeError("the loss is read after the step's gradient sync, which has not run: call "
                               "backward() on the loss of every micro-step first")
        value, self._reduced_loss = float(self._reduced_loss), None
        return value

    def _kept_buffer(self, bucket: Bucket, numel: int, device: torch.device) -> torch.Tensor:
        """The bucket's flat buffer; a ``.grad`` still viewing it from the last step (no
        ``zero_grad(set_to_none=True)`` in between) is given its own copy before it is overwritten."""
        flat = self.buffers.get(bucket.index)
        if flat is None:
            flat = self.buffers[bucket.index] = torch.empty(numel, dtype=self.reduce_dtype, device=device)
        for i in bucket.uses:
            local = self._target(self.program.param_uses[i].fqn)
            if local.grad is not None and local.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                local.grad = local.grad.clone()
        return flat

    def _reduce_scatter(self, bucket: Bucket, uses: list[ParamUse], grads: list[torch.Tensor]) -> torch.Tensor:
        """Rows laid out as the module docstring says, in one fresh buffer (not kept: the bucket holds whole
        gradients, which ZeRO-2/3 exist not to keep). Where the backend carries a reduce-scatter out as an
        all-reduce of the whole input (gloo: autoddl.collective_kinds), the all-reduce runs in place and the
        rank keeps a copy of its row, which saves the clone gloo makes of the input."""
        n = group_size(bucket.axis, self.boxer.mesh_shape)   # one axis, or ZeRO over several: their flattened group
        rows = torch.empty(n, sum(g.numel() for g in grads) // n, dtype=self.reduce_dtype, device=grads[0].device)
        start = 0
        for u, g in zip(uses, grads):
            dim = group_split_dim(u.grad_sync[0].after, bucket.axis)
            piece = g.movedim(dim, 0).unflatten(0, (n, -1))                 # (n, rows/n, ...)
            width = piece[0].numel()
            rows[:, start:start + width].view(piece.shape).copy_(piece)
            start += width
        group = self.boxer.groups[bucket.axis]
        if carried_out_as(CollectiveKind.REDUCE_SCATTER, self.boxer.backend) is CollectiveKind.ALL_REDUCE:
            return _RowOf(_all_reduce_in_place(rows, group),
                          group_rank(bucket.axis, self.boxer.coord, self.boxer.mesh_shape))
        return funcol.reduce_scatter_tensor(rows.reshape(-1), "sum", 0, group)

    def _tell(self, kind: CollectiveKind, axis: Group, bucket: Bucket) -> None:
        """The audit's hook, told of one of the bucket's collectives before it is issued."""
        if self.boxer.on_collective is not None:
            self.boxer.on_collective(carried_out_as(kind, self.boxer.backend), axis, bucket.nbytes,
                                     f"bucket{bucket.index}")

    def _grad(self, use: ParamUse) -> torch.Tensor:
        """The use's gradient (plus what earlier micro-steps kept); zeros when autograd never reached
        it (the parameter did not contribute to the loss), so that every rank issues the same buckets."""
        g = self.grads.get(use.index)
        if g is None:
            g = torch.zeros(use.dst.local_shape(use.meta.shape, self.boxer.mesh_shape),
                            dtype=self.local_params[use.fqn].dtype, device=self.local_params[use.fqn].device)
        carried = self.carried.pop(use.index, None)
        if carried is not None:
            g = carried + g
        self.grads[use.index] = g
        return g

    def finish(self) -> None:
        """End of backward: launch what is left, wait, unpack, add to each parameter's ``.grad``."""
        self.set_phase("grad_sync")
        for b in self.program.buckets:
            self.remaining[b.index] = 0
        self._launch_ready()
        synced: dict[str, torch.Tensor] = {}
        for bucket, result in zip(self.program.buckets, self.in_flight):
            uses = [self.program.param_uses[i] for i in bucket.uses]
            if result is None:
                self._carry(uses)
                continue
            flat = _arrived(result)
            if bucket.index == self.program.loss_bucket:
                self._reduced_loss = flat[-1].clone()
            for use, g in zip(uses, self._unpack(bucket, flat)):
                synced[use.fqn] = g if use.fqn not in synced else synced[use.fqn] + g
        for use in self.program.param_uses:
            if use.grad is None or use.bucket >= 0:
                continue
            if not self._syncs_now([use]):
                self._carry([use])
                continue
            g = self.boxer.run(use.grad_sync, self._grad(use).to(self.reduce_dtype), use.meta.shape, use.fqn)
            synced[use.fqn] = g if use.fqn not in synced else synced[use.fqn] + g
        if self.copy_out is not None:
            synced = self.copy_out(synced)
        for fqn, g in synced.items():
            local, moves = self._target(fqn), self.grad_targets.get(fqn, (None, ()))[1]
            if moves:           # ZeRO-1: this rank's piece of the whole reduced gradient
                g = self.boxer.run(moves, g, self.program.uses_of(fqn)[0].meta.shape, fqn)
            g = g.to(local.dtype).reshape(local.shape)
            local.grad = g if local.grad is None else local.grad + g
        self.start_step()

    def _target(self, fqn: str) -> torch.Tensor:
        """The local tensor whose ``.grad`` receives ``fqn``'s synced gradient (ZeRO-1/2: the optimizer's shard)."""
        return self.grad_targets[fqn][0] if fqn in self.grad_targets else self.local_params[fqn]

    def _carry(self, uses: list[ParamUse]) -> None:
        """Keep the uses' gradients, in float32, for the last micro-step's sync."""
        for use in uses:
            self.carried[use.index] = self._grad(use).float()

    def _unpack(self, bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
        """The bucket's gradients, each in its storage layout, from the collective's flat result."""
        out, start = [], 0
        for shape, dim in self.layouts[bucket.index]:
            numel = math.prod(shape)
            piece = flat[start:start + numel]
            start += numel
            if dim is not None:       # reduce-scatter: the scatter dim came first (see _launch)
                moved = (shape[dim],) + tuple(s for i, s in enumerate(shape) if i != dim)
                out.append(piece.reshape(moved).movedim(0, dim).contiguous())
            else:
                out.append(piece.reshape(shape))
        return out


def _all_reduce_in_place(flat: torch.Tensor, group: str) -> torch.Tensor:
    """An asynchronous sum all-reduce of ``flat`` into itself; :func:`_arrived` waits for it."""
    return torch.ops._c10d_functional.all_reduce_(flat, "sum", group)


class _RowOf:
    """Rank ``row``'s row of an in-place all-reduce still in flight: a reduce-scatter carried out as one."""

    def __init__(self, rows: torch.Tensor, row: int):
        self.rows, self.row = rows, row


def _arrived(result: "torch.Tensor | _RowOf") -> torch.Tensor:
    """A launched bucket's flat result, once it has arrived."""
    if isinstance(result, _RowOf):
        return torch.ops._c10d_functional.wait_tensor(result.rows)[result.row].clone()
    if isinstance(result, funcol.AsyncCollectiveTensor):
        return wait(result)
    return torch.ops._c10d_functional.wait_tensor(result)
