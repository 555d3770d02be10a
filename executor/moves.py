"""Run autoddl.boxing's moves on one rank's local tensor, with functional collectives.

Each ``Move`` of the step program is carried out here exactly as the cost model
prices it: a collective move calls ``torch.distributed._functional_collectives``
on the process group of its mesh axis (as the backend carries the kind out:
``autoddl.collective_kinds.carried_out_as``), a local move chunks, zero-pads or
keeps on the axis root. ``Boxer.run(moves, x)`` applies a list in order;
``BoxFunction`` makes a forward list and a backward list one autograd step, so
a boxed edge's gradient takes exactly the program's backward moves.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed._functional_collectives as funcol

from autoddl.boxing import Group, Move, boxing_moves
from autoddl.collective_kinds import CollectiveKind, carried_out_as
from autoddl.ops.registry import piece_offset
from autoddl.sbp import NdSbp

def wait(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a functional collective's result, once it has arrived."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


# (kind carried out, mesh axis or tuple of flattened axes, M bytes, label) -> None; the phase is the caller's
CollectiveHook = Callable[[CollectiveKind, Group, int, str], None]


@dataclass
class Boxer:
    """What a rank needs to run moves: its mesh coordinate, one process group per mesh axis and per
    tuple of axes the program flattens into one group (by name: functional collectives resolve it, and
    holding no group object lets destroy_process_group free it; executor.runtime.mesh_groups),
    the backend (which decides how a kind is carried out) and an optional hook told of every
    collective before it is issued (the audit labels records with it)."""

    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]
    groups: Mapping[Group, str]
    backend: str
    on_collective: CollectiveHook | None = None

    def run(self, moves: Sequence[Move], x: torch.Tensor, shape: Sequence[int], label: str = "") -> torch.Tensor:
        """``x`` (this rank's piece of a tensor of global ``shape``) after every move, in order."""
        for move in moves:
            x = self._collective(move, x, label) if move.kind is not None else self._local(move, x, shape)
        return x

    def launch(self, move: Move, x: torch.Tensor, label: str = "") -> torch.Tensor:
        """An all-reduce move issued without waiting: the result is waited for with :func:`wait`."""
        if move.kind is not CollectiveKind.ALL_REDUCE:
            raise ValueError(f"only an all-reduce move is launched asynchronously, got {move}")
        if self.on_collective is not None:
            self.on_collective(carried_out_as(move.kind, self.backend), move.group, move.nbytes, label)
        return funcol.all_reduce(x, "sum", self.groups[move.group])

    # -- collectives --------------------------------------------------------------------------------
    def _collective(self, move: Move, x: torch.Tensor, label: str) -> torch.Tensor:
        kind = carried_out_as(move.kind, self.backend)
        if self.on_collective is not None:
            self.on_collective(kind, move.group, move.nbytes, label)
        group, src, dst = self.groups[move.group], move.before[move.axis], move.after[move.axis]
        if move.kind is CollectiveKind.ALL_REDUCE:
            return wait(funcol.all_reduce(x, "sum", group))
        if move.kind is CollectiveKind.ALL_GATHER:
            return wait(funcol.all_gather_single(x.contiguous(), src.dim, group))
        if move.kind is CollectiveKind.REDUCE_SCATTER:
            return wait(funcol.reduce_scatter_single(x.contiguous(), "sum", dst.dim, group))
        if move.kind is CollectiveKind.ALL_TO_ALL:
            return self._all_to_all(x, src.dim, dst.dim, move.axis)
        raise NotImplementedError(f"no executor for collective move {move}")

    def _all_to_all(self, x: torch.Tensor, gather_dim: int, split_dim: int, axis: int) -> torch.Tensor:
        """S(gather_dim) -> S(split_dim) on ``axis``: this rank's ``split_dim`` chunks go one to each
        rank, the pieces received are joined along ``gather_dim``."""
        n, group = self.mesh_shape[axis], self.groups[axis]
        pieces = torch.stack(x.chunk(n, dim=split_dim))                               # (n, ...)
        out = wait(funcol.all_to_all_single(pieces.contiguous(), None, None, group))  # (n, ...)
        return torch.cat(out.unbind(0), dim=gather_dim)

    # -- local moves ------------------------------------------------------------------------------
    def _local(self, move: Move, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """B -> S chunk, S -> P zero-padded piece, B -> P keep on the axis root, or a relabel
        on an axis of size 1."""
        changed = [a for a in move.axes if self.mesh_shape[a] > 1]
        if not changed:
            return x
        before, after = move.before, move.after
        if all(after[a].is_partial() for a in changed):
            if all(before[a].is_split() for a in changed):
                return self._pad(x, shape, before, after, changed)
            keep = all(self.coord[a] == 0 for a in changed)
            return x if keep else torch.zeros_like(x)
        axis = changed[0]
        if before[axis].is_broadcast() and after[axis].is_split():
            return x.chunk(self.mesh_shape[axis], dim=after[axis].dim)[self.coord[axis]].contiguous()
        raise NotImplementedError(f"no local executor for move {move}")

    def _pad(self, x: torch.Tensor, shape: Sequence[int], before: NdSbp, after: NdSbp,
             axes: Sequence[int]) -> torch.Tensor:
        """S(d) -> P: this rank's piece at its offset in zeros of the target's local shape; the
        addends over the axes sum to the target's pieces."""
        target = after.local_shape(shape, self.mesh_shape)
        out = x.new_zeros(target)
        view = out
        for d in sorted({before[a].dim for a in axes}):
            offset = (piece_offset(shape, before, self.mesh_shape, self.coord, d)
                      - piece_offset(shape, after, self.mesh_shape, self.coord, d))
            view = view.narrow(d, offset, x.shape[d])
        view.copy_(x)
        return out


class BoxFunction(torch.autograd.Function):
    """One boxed edge: the forward moves on the value, the backward moves on its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, boxer: Boxer, forward: tuple, backward: tuple, shape: tuple,
                label: str) -> torch.Tensor:
        ctx.boxer, ctx.backward_moves, ctx.shape, ctx.label = boxer, backward, shape, label
        out = boxer.run(forward, x, shape, label)
        return out if out is not x else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.boxer.run(ctx.backward_moves, grad.contiguous(), ctx.shape, ctx.label), None, None, None, None, None


def place_local(boxer: Boxer, full: torch.Tensor, nd: NdSbp) -> torch.Tensor:
    """This rank's piece, in layout ``nd``, of a tensor every rank holds whole (no communication)."""
    moves = boxing_moves(0, NdSbp.broadcast(len(nd)), nd, boxer.mesh_shape)
    return boxer.run(moves, full, tuple(full.shape)).contiguous()


def shard_view(boxer: Boxer, full: torch.Tensor, src: NdSbp, dst: NdSbp) -> torch.Tensor:
    """This rank's piece of ``full`` (held in layout ``src``) in layout ``dst``, as a view sharing
    its storage: ``dst`` may only split (on dims that divide evenly) axes ``src`` replicates (a
    ZeRO-1/2 optimizer shard of a replicated parameter)."""
    view = full
    for axis, (before, after) in enumerate(zip(src, dst)):
        if before == after:
            continue
        if not (before.is_broadcast() and after.is_split()):
            raise ValueError(f"a shard view takes {src} to {dst}: only B -> S per mesh axis")
        view = view.chunk(boxer.mesh_shape[axis], dim=after.dim)[boxer.coord[axis]]
    return view


def unflatten_gathered(flat: torch.Tensor, n: int, pieces: Sequence[tuple[Sequence[int], int]],
                       out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Whole tensors from the all-gather of ``n`` ranks' flattened pieces laid side by side: rank r's
    pieces sit in row r; a piece of shape ``shape`` joins its ``n`` copies along ``dim``. Each whole is
    written in one pass (a strided copy of the ``n`` pieces into the whole viewed as ``(n, *shape)``):
    into ``out``'s tensors when given (ZeRO-1/2's updated parameters, in place), else into new ones."""
    rows = flat.view(n, -1)                                                        # (n, pieces)
    wholes, start = [], 0
    for i, (shape, dim) in enumerate(pieces):
        shape = tuple(shape)
        numel = math.prod(shape)
        parts = rows[:, start:start + numel].unflatten(1, shape)                  # (n, *shape), a view
        start += numel
        whole_shape = shape[:dim] + (n * shape[dim],) + shape[dim + 1:]
        target = out[i] if out is not None else None
        whole = target if target is not None and target.is_contiguous() else flat.new_empty(whole_shape)
        whole.unflatten(dim, (n, shape[dim])).movedim(dim, 0).copy_(parts)       # (n, *shape) view of it
        if target is not None and whole is not target:
            target.copy_(whole)
        wholes.append(target if target is not None else whole)
    return wholes
