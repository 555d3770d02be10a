"""Boxing: the moves that turn one tensor's NdSbp into another, and the backward gradient rule.

Written once here and used by both sides of the step program: the cost model
prices these moves, the executor runs them on local tensors.

Per mesh axis (DESIGN.md "Boxing"):

    S -> B  all-gather        P -> B  all-reduce       P -> S  reduce-scatter
    S(i) -> S(j)  all-to-all  B -> S  local chunk      same -> same  nothing
    S -> P  local: the own piece zero-padded           B -> P  local: the axis root keeps it, others zero

``S -> P`` is local unless a later mesh axis of the target splits the same dim
(the pieces are then nested inside that split and do not add up): that axis
goes ``S -> B -> P``, an all-gather. An N-D transition is: the collective steps
to the target with its ``-> P`` axes held back (:func:`redistribute_target`), in
the order of DTensor's greedy planner (:func:`dtensor_steps`: inner to outer
axes first when the source is sharded, then outer to inner), then the local
``-> P`` moves. A step on axis k moves the tensor as the steps before left it:
``M_k = nbytes / prod(mesh[j] for j != k if axis j is S at that moment)``. Consecutive
all-reduces (``P -> B`` on several axes: a data-parallel gradient over two axes) are one
all-reduce over the flattened group of their axes (:func:`flatten_all_reduces`), as DDP's.

The backward gradient rule: an op hands back, for an input held as ``S(d)``, a
gradient ``S(d)``; for ``P``, ``B``; for ``B``, ``B`` when every output of the op
is ``B`` on that axis (every device computed the same thing), else ``P`` (each
device holds its share). A producer needs its output's gradient as ``S(d)`` for
``S(d)`` and ``B`` for ``B`` or ``P``. Since every boxing is the identity on the
logical tensor, the gradient of a boxed edge is one boxing from the gradient the
consumers hand back to the one the producer needs (:func:`gradient_moves`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence, Union

from autoddl.collective_kinds import CollectiveKind
from autoddl.sbp import B, NdSbp, Partial, Sbp

Group = Union[int, tuple[int, ...]]   # a collective's ranks: one mesh axis, or several flattened into one group


def group_axes(group: Group) -> tuple[int, ...]:
    """The mesh axes of a collective's group (``2`` -> ``(2,)``)."""
    return tuple(group) if isinstance(group, tuple) else (group,)


def group_size(group: Group, mesh: Sequence[int]) -> int:
    """How many ranks ``group`` has on ``mesh``: its axis' size, or the product over its flattened axes."""
    return math.prod(mesh[a] for a in group_axes(group))


def group_rank(group: Group, coord: Sequence[int], mesh: Sequence[int]) -> int:
    """A rank's place in ``group`` from its mesh coordinate ``coord``: row-major over the group's axes
    (as ``DeviceMesh._flatten`` numbers a flattened group), its coordinate for one axis."""
    rank = 0
    for a in group_axes(group):
        rank = rank * mesh[a] + coord[a]
    return rank


def group_split_dim(layout: NdSbp, group: Group) -> int:
    """The tensor dim ``layout`` splits over ``group``'s ranks, the dim their pieces are joined along:
    its first axis' split (a flattened group's nested split, S(d) on each of its axes, is one split of
    dim d over all its ranks, row-major: :func:`flatten_nested_shards`)."""
    sbp = layout[group_axes(group)[0]]
    if not sbp.is_split():
        raise ValueError(f"group_split_dim: layout {layout} does not split on mesh axis {group_axes(group)[0]} "
                         f"(the first of group {group!r})")
    return sbp.dim


def group_name(group: Group) -> str:
    """``"1"`` for axis 1, ``"0+1"`` for axes 0 and 1 flattened (stream and audit names)."""
    return "+".join(str(a) for a in group_axes(group))


# -- the gradient rule ---------------------------------------------------------------------------

def grad_sbp(input_sbp: Sbp, op_output_sbps_on_axis: Sequence[Sbp]) -> Sbp:
    """SBP of the gradient an op hands back for one input, on one mesh axis (module docstring)."""
    if input_sbp.is_split():
        return input_sbp
    if input_sbp.is_partial():
        return B
    return B if all(o.is_broadcast() for o in op_output_sbps_on_axis) else Partial()


def needed_grad_sbp(output_sbp: Sbp) -> Sbp:
    """SBP a producer needs its output's gradient in: S(d) for S(d), B for B or P."""
    return output_sbp if output_sbp.is_split() else B


def grad_ndsbp(input_nd: NdSbp, op_outputs: Sequence[NdSbp]) -> NdSbp:
    """:func:`grad_sbp` on every mesh axis: the gradient NdSbp a consumer hands back for an input."""
    return NdSbp(tuple(grad_sbp(s, [o[axis] for o in op_outputs]) for axis, s in enumerate(input_nd)))


def needed_grad_ndsbp(output_nd: NdSbp) -> NdSbp:
    return NdSbp(tuple(needed_grad_sbp(s) for s in output_nd))


# -- moves -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Move:
    """One step of a boxing: on ``axes`` the tensor goes from layout ``before`` to ``after``.

    A collective step has a ``kind`` and ``nbytes`` (M of the alpha-beta formula, the full tensor
    as seen on its axes) and one axis, or several for an all-reduce over their flattened group
    (:func:`flatten_all_reduces`). A local step (``kind`` None) is a chunk (B -> S), a zero-padded
    piece (S -> P, all such axes at once) or a keep-on-root (B -> P)."""

    axes: tuple[int, ...]
    before: NdSbp
    after: NdSbp
    kind: CollectiveKind | None = None
    nbytes: int = 0

    @property
    def axis(self) -> int:
        return self.axes[0]

    @property
    def group(self) -> "Group":
        """The ranks a collective step runs over: its mesh axis, or the tuple of its flattened axes."""
        return self.axes if len(self.axes) > 1 else self.axes[0]

    @property
    def is_collective(self) -> bool:
        return self.kind is not None

    def __str__(self) -> str:
        what = f"{self.kind.value} {self.nbytes} B" if self.kind else "local"
        return f"{self.before} -> {self.after} on axes {list(self.axes)} ({what})"


def transition_kind(src: Sbp, dst: Sbp) -> CollectiveKind | None:
    """The collective one mesh axis needs to go from ``src`` to ``dst``; None when local or equal."""
    if src == dst:
        return None
    if src.is_split():
        if dst.is_broadcast():
            return CollectiveKind.ALL_GATHER
        if dst.is_split():
            return CollectiveKind.ALL_TO_ALL
        return None                                   # S -> P: keep own piece zero-padded
    if src.is_partial():
        return CollectiveKind.ALL_REDUCE if dst.is_broadcast() else CollectiveKind.REDUCE_SCATTER
    return None                                       # B -> S, B -> P: local


def redistribute_target(src: NdSbp, dst: NdSbp) -> tuple[NdSbp, tuple[int, ...], tuple[int, ...]]:
    """(the layout the collective steps reach, axes then made P by a zero-padded local piece,
    axes then made P by keeping the value on the axis root) for ``src -> dst``."""
    to_p = [i for i, (s, d) in enumerate(zip(src, dst)) if d.is_partial() and not s.is_partial()]
    pad = tuple(i for i in to_p if src[i].is_split() and not any(x == src[i] for x in tuple(dst)[i + 1:]))
    keep = tuple(i for i in to_p if i not in pad)
    mid = NdSbp(tuple(s if i in pad else (B if i in keep else d) for i, (s, d) in enumerate(zip(src, dst))))
    return mid, pad, keep


def dtensor_steps(src: NdSbp, dst: NdSbp, mesh: Sequence[int]) -> list[tuple[int, Sbp]]:
    """``(mesh axis, target SBP)`` steps from ``src`` to ``dst`` (no P created), in the order of
    torch 2.13's ``DTensorRedistributePlanner.generate_greedy_transform_infos``
    (torch/distributed/tensor/_redistribute.py): on a 1-D mesh one step; otherwise, if the
    source is sharded (over more than one device), axes inner to outer, a target S(d) whose
    earlier axes split d differently becoming B first (nested sharding); then axes outer to
    inner for what is left. That order keeps every step's local piece contiguous."""
    mesh = tuple(mesh)
    cur = list(src)
    steps: list[tuple[int, Sbp]] = []
    if len(mesh) == 1:
        return [(0, dst[0])] if src[0] != dst[0] else []
    if math.prod(n for s, n in zip(src, mesh) if s.is_split()) > 1:
        for axis in reversed(range(len(cur))):
            target = dst[axis]
            if target.is_split():
                if [i for i in range(axis) if cur[i] == target] != [i for i in range(axis) if dst[i] == target]:
                    target = B
            if cur[axis] != target:
                steps.append((axis, target))
                cur[axis] = target
    for axis in range(len(cur)):
        if cur[axis] != dst[axis]:
            steps.append((axis, dst[axis]))
            cur[axis] = dst[axis]
    return steps


def boxing_moves(nbytes: int, src: NdSbp, dst: NdSbp, mesh: Sequence[int]) -> tuple[Move, ...]:
    """Every step taking a tensor of ``nbytes`` from ``src`` to ``dst`` on ``mesh`` (module docstring),
    P -> B on several axes being one all-reduce over their flattened group (:func:`flatten_all_reduces`).

    Steps on a mesh axis of size 1 change the layout without moving data: they are kept as
    local moves so that each step's ``before`` is the layout the tensor really has.
    Memoised: the moves are frozen, and the blocks of a decoder box the same tensors the same way."""
    return _boxing_moves(nbytes, src, dst, tuple(mesh))


@functools.lru_cache(maxsize=1 << 16)
def _boxing_moves(nbytes: int, src: NdSbp, dst: NdSbp, mesh: tuple[int, ...]) -> tuple[Move, ...]:
    mid, pad, keep = redistribute_target(src, dst)
    moves: list[Move] = []
    cur = src
    for axis, target in dtensor_steps(src, mid, mesh):
        nxt = NdSbp(tuple(target if i == axis else s for i, s in enumerate(cur)))
        kind = transition_kind(cur[axis], target) if mesh[axis] > 1 else None
        others = math.prod(n for j, (s, n) in enumerate(zip(cur, mesh)) if j != axis and s.is_split())
        moves.append(Move((axis,), cur, nxt, kind, nbytes // others if kind else 0))
        cur = nxt
    for axes in (pad, keep):
        if axes:
            nxt = NdSbp(tuple(dst[i] if i in axes else s for i, s in enumerate(cur)))
            moves.append(Move(axes, cur, nxt))
            cur = nxt
    return flatten_all_reduces(moves)


def gradient_moves(nbytes: int, grad: NdSbp, src: NdSbp, mesh: Sequence[int],
                   deferred: frozenset[int] = frozenset()) -> tuple[Move, ...]:
    """The gradient of an edge whose consumers hand back ``grad``, to what the producer of ``src``
    needs (for a parameter, ``src`` is its storage: this is the gradient sync). On the mesh axes in
    ``deferred`` the producer takes the gradient as P (its reduction deferred: see
    autoddl.program's ``deferred_reductions``). Memoised, as :func:`boxing_moves`."""
    return _gradient_moves(nbytes, grad, src, tuple(mesh), frozenset(deferred))


@functools.lru_cache(maxsize=1 << 16)
def _gradient_moves(nbytes: int, grad: NdSbp, src: NdSbp, mesh: tuple[int, ...],
                    deferred: frozenset[int]) -> tuple[Move, ...]:
    need = needed_grad_ndsbp(src)
    if deferred:
        need = NdSbp(tuple(Partial() if axis in deferred else s for axis, s in enumerate(need)))
    return boxing_moves(nbytes, grad, need, mesh)


def flatten_all_reduces(moves: Sequence[Move]) -> tuple[Move, ...]:
    """``moves`` with each run of consecutive all-reduces on distinct axes made one all-reduce over
    the flattened group of those axes (as DistributedDataParallel reduces a gradient over all its
    ranks at once: data parallel over several mesh axes is one all-reduce, not one per axis).
    Summing over axes 0 then 1 is summing over their flattened group, and every all-reduce of a run
    has the same M (an all-reduce changes no split), so the result is the same with one collective:
    a ring over n = n0*n1 ranks moves 2(n-1)/n*M per rank, the chain 2(n0-1)/n0*M + 2(n1-1)/n1*M."""
    out: list[Move] = []
    for m in moves:
        prev = out[-1] if out else None
        if (prev is not None and m.kind is CollectiveKind.ALL_REDUCE and prev.kind is CollectiveKind.ALL_REDUCE
                and not set(m.axes) & set(prev.axes)):
            out[-1] = Move(tuple(sorted(prev.axes + m.axes)), prev.before, m.after, m.kind, prev.nbytes)
        else:
            out.append(m)
    return tuple(out)


def flatten_nested_shards(moves: Sequence[Move], shape: Sequence[int], mesh: Sequence[int]) -> tuple[Move, ...]:
    """``moves`` of a tensor of global ``shape`` with each run of consecutive reduce-scatters to one
    dim ``d`` on ever later mesh axes (P -> S(d) on axis i, then on axis j > i) made one reduce-scatter
    over the flattened group of those axes, and each run of all-gathers from ``d`` on ever earlier
    axes (S(d) -> B on axis j, then on i < j) one all-gather over it, where ``d`` divides evenly
    over every axis that splits it. A split of ``d`` on axis i with, nested inside it, one on axis
    j puts rank (a_i, a_j)'s piece at a_i * n_j + a_j of ``d``: its rank in the flattened group
    (row-major, as ``DeviceMesh._flatten`` orders it), so one collective over the n_i * n_j ranks
    leaves every rank the same piece as the chain (with uneven pieces the nested split is not the
    flat one: those chains stay). ZeRO / FSDP over two mesh axes so reduce-scatters each gradient
    and gathers each parameter once, over all its ranks, as over a 1-D mesh of as many; what that
    buys is that one collective can be bucketed with other gradients' (autoddl/lowering.py
    ``pack_buckets``) and grouped with its layer's parameters (``plan_gathers``), where a chain runs
    per parameter. The bytes are the same: a ring over n = n_i * n_j ranks moves (n-1)/n * M per
    rank, the chain (n_i-1)/n_i * M + (n_j-1)/n_j * M/n_i (its latency steps are n - 1 against
    (n_i-1) + (n_j-1), its fixed per-collective cost once instead of twice)."""
    out: list[Move] = []
    for m in moves:
        prev = out[-1] if out else None
        if prev is not None and _nests(prev, m, shape, mesh):
            whole_m = prev.nbytes if m.kind is CollectiveKind.REDUCE_SCATTER else m.nbytes   # the whole tensor
            out[-1] = Move(tuple(sorted(prev.axes + m.axes)), prev.before, m.after, m.kind, whole_m)
        else:
            out.append(m)
    return tuple(out)


def parameter_moves(nbytes: int, src: NdSbp, dst: NdSbp, shape: Sequence[int], mesh: Sequence[int]) -> tuple[Move, ...]:
    """:func:`boxing_moves` of a parameter of global ``shape`` between its storage and a use (its gather)
    or from its gradient's layout to the storage's (its sync), chains over several axes made one
    collective over their flattened group where they nest evenly (:func:`flatten_nested_shards`): what
    the lowering runs and the search prices."""
    return flatten_nested_shards(boxing_moves(nbytes, src, dst, mesh), shape, mesh)


def _nests(prev: Move, m: Move, shape: Sequence[int], mesh: Sequence[int]) -> bool:
    """Whether ``m`` continues ``prev`` as one collective over their flattened axes (above)."""
    if m.kind is not prev.kind or len(m.axes) != 1:
        return False
    if m.kind is CollectiveKind.REDUCE_SCATTER:       # scattered outer axis first; ``whole``: every split of d
        splits, in_order, whole = (prev.after[prev.axis], m.after[m.axis]), m.axis > max(prev.axes), m.after
    elif m.kind is CollectiveKind.ALL_GATHER:         # gathered inner axis first
        splits, in_order, whole = (prev.before[prev.axis], m.before[m.axis]), m.axis < min(prev.axes), prev.before
    else:
        return False
    d, axes = splits[0].dim, prev.axes + m.axes
    if splits[1].dim != d or not in_order:
        return False
    if any(s.is_split(d) for a, s in enumerate(whole) if a not in axes):
        return False                                  # another axis splits d too: not a flat piece
    return shape[d] % group_size(axes, mesh) == 0


def collectives_of(moves: Sequence[Move]) -> list[tuple[CollectiveKind, Group, int]]:
    """``(kind, group, M bytes)`` of the collective moves (kinds before backend emulation)."""
    return [(m.kind, m.group, m.nbytes) for m in moves if m.kind is not None]
