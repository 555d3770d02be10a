"""Boxing: the collectives that turn one tensor's NdSbp into another, forward and backward.

Per mesh axis (DESIGN.md "Boxing"):

    S -> B  all-gather        P -> B  all-reduce       P -> S  reduce-scatter
    S(i) -> S(j)  all-to-all  B -> S, B -> P, S -> P  local (no communication)
    same -> same  nothing

``S -> P`` is local: each device keeps its own piece, zero-padded (memory only),
unless a later mesh axis of the target splits the same dim (the pieces are then
nested inside that split and do not add up): that axis goes S -> B -> P, an
all-gather. N-D transitions follow exactly what the executor runs
(executor/interpreter.py ``box``): DTensor's ``redistribute`` to the target with
the ->P axes held back (:func:`redistribute_target`), in the order of DTensor's
greedy planner (:func:`dtensor_steps`: inner to outer axes first when the source
is sharded, then outer to inner), then the local ->P moves. Each step moves the
tensor as the steps before left it: on axis k,
``M_k = nbytes / prod(mesh[j] for j != k if axis j is S at that moment)``. E.g.
[S(0), S(1)] -> [B, B] gathers axis 1 on nbytes/2, then axis 0 on nbytes.

Backward (the dual transition): the gradient arrives with the SBP the consumer
produces for that input (:func:`grad_sbp`) and must reach the SBP the producer
needs for its output's gradient (:func:`needed_grad_sbp`).
"""

from __future__ import annotations

import math
from typing import Sequence

from autoddl.cluster import Cluster
from autoddl.graph import TensorMeta
from autoddl.sbp import B, Broadcast, NdSbp, Partial, Sbp, Split
from costmodel.collectives import CollectiveKind, cluster_collective_time_s

Transition = tuple[CollectiveKind, int, int]   # (kind, mesh axis, M bytes)


def grad_sbp(input_sbp: Sbp, op_output_sbps_on_axis: Sequence[Sbp]) -> Sbp:
    """SBP of the gradient an op hands back for one input, on one mesh axis (DESIGN.md "Executor").

    input S(d) -> S(d); input P -> B; input B -> B when every output of the op is B on
    this axis (every device computed the same thing), else P (each holds its share).
    """
    if isinstance(input_sbp, Split):
        return input_sbp
    if isinstance(input_sbp, Partial):
        return B
    if not isinstance(input_sbp, Broadcast):
        raise TypeError(f"grad_sbp: expected an SBP (S(d), B or P), got {input_sbp!r}")
    return B if all(isinstance(o, Broadcast) for o in op_output_sbps_on_axis) else Partial()


def needed_grad_sbp(output_sbp: Sbp) -> Sbp:
    """SBP a producer needs its output's gradient in: S(d) for S(d), B for B or P."""
    return output_sbp if isinstance(output_sbp, Split) else B


def grad_ndsbp(input_nd: NdSbp, op_outputs: Sequence[NdSbp]) -> NdSbp:
    """:func:`grad_sbp` on every mesh axis: the gradient NdSbp a consumer produces for an input."""
    return NdSbp(tuple(grad_sbp(s, [o[axis] for o in op_outputs]) for axis, s in enumerate(input_nd)))


def needed_grad_ndsbp(output_nd: NdSbp) -> NdSbp:
    return NdSbp(tuple(needed_grad_sbp(s) for s in output_nd))


def transition_kind(src: Sbp, dst: Sbp) -> CollectiveKind | None:
    """The collective one mesh axis needs to go from ``src`` to ``dst``; None when local or equal."""
    if src == dst:
        return None
    if isinstance(src, Split):
        if isinstance(dst, Broadcast):
            return CollectiveKind.ALL_GATHER
        if isinstance(dst, Split):
            return CollectiveKind.ALL_TO_ALL
        return None                                   # S -> P: keep own piece zero-padded
    if isinstance(src, Partial):
        return CollectiveKind.ALL_REDUCE if isinstance(dst, Broadcast) else CollectiveKind.REDUCE_SCATTER
    return None                                       # B -> S, B -> P: local


def boxing_collectives(meta: TensorMeta, src: NdSbp, dst: NdSbp,
                       mesh_shape: Sequence[int]) -> list[Transition]:
    """Collectives (kind before backend emulation, axis, M bytes) taking ``meta`` from ``src`` to ``dst``."""
    mesh = tuple(mesh_shape)
    if len(src) != len(mesh) or len(dst) != len(mesh):
        raise ValueError(f"boxing {meta}: {src} -> {dst} does not match the {len(mesh)}-axis mesh {mesh}")
    for name, nd in (("source", src), ("target", dst)):
        if not nd.divides(meta.shape, mesh):
            raise ValueError(f"boxing {meta}: {name} {nd} does not divide shape {meta.shape} on mesh {mesh}; "
                             "pick a signature whose split dims divide evenly")
    return transitions_of(meta.nbytes, src, dst, mesh)


def transitions_of(nbytes: int, src: NdSbp, dst: NdSbp, mesh: tuple[int, ...]) -> list[Transition]:
    """:func:`boxing_collectives` without the checks, for the search's inner loop (layouts known valid)."""
    return _steps_collectives(nbytes, dtensor_steps(src, redistribute_target(src, dst)[0], mesh), mesh)


def redistribute_target(src: NdSbp, dst: NdSbp) -> tuple[NdSbp, tuple[int, ...], tuple[int, ...]]:
    """(what DTensor's redistribute is asked for, axes then made P by a zero-padded local piece,
    axes then made P by keeping the value on the axis root) for ``src -> dst``.

    DTensor does not turn a tensor into a partial sum; the executor does that locally
    after the redistribute: S(d) -> P pads the own piece (when no later axis of ``dst``
    splits d, see the module docstring), any other B/S -> P goes to B first and keeps
    the value on one device. Mirrors executor/interpreter.py ``box``."""
    to_p = [i for i, (s, d) in enumerate(zip(src, dst)) if isinstance(d, Partial) and not isinstance(s, Partial)]
    pad = tuple(i for i in to_p if isinstance(src[i], Split) and not any(x == src[i] for x in tuple(dst)[i + 1:]))
    keep = tuple(i for i in to_p if i not in pad)
    mid = NdSbp(tuple(s if i in pad else (B if i in keep else d) for i, (s, d) in enumerate(zip(src, dst))))
    return mid, pad, keep


Step = tuple[int, Sbp, Sbp, tuple[Sbp, ...]]   # (mesh axis, from, to, every axis's SBP before the step)


def dtensor_steps(src: NdSbp, dst: NdSbp, mesh: Sequence[int]) -> list[Step]:
    """The per-axis steps of DTensor's ``redistribute`` from ``src`` to ``dst`` (no P created).

    torch 2.13, torch/distributed/tensor/_redistribute.py,
    ``DTensorRedistributePlanner.generate_greedy_transform_infos``: on a 1-D mesh one step;
    otherwise, if the source is sharded (over more than one device), axes inner to outer,
    a target S(d) whose earlier axes split d differently becoming B first (nested
    sharding); then axes outer to inner for what is left. Consecutive same-kind steps are
    merged only over a flattened mesh, which the executor never creates."""
    mesh = tuple(mesh)
    cur = list(src)
    steps: list[Step] = []
    if len(mesh) == 1:
        return [(0, src[0], dst[0], tuple(cur))] if src[0] != dst[0] else []
    if math.prod(n for s, n in zip(src, mesh) if isinstance(s, Split)) > 1:
        for axis in reversed(range(len(cur))):
            target = dst[axis]
            if isinstance(target, Split):
                if [i for i in range(axis) if cur[i] == target] != [i for i in range(axis) if dst[i] == target]:
                    target = B
            if cur[axis] != target:
                steps.append((axis, cur[axis], target, tuple(cur)))
                cur[axis] = target
    for axis in range(len(cur)):
        if cur[axis] != dst[axis]:
            steps.append((axis, cur[axis], dst[axis], tuple(cur)))
            cur[axis] = dst[axis]
    return steps


def _steps_collectives(nbytes: int, steps: list[Step], mesh: tuple[int, ...]) -> list[Transition]:
    out: list[Transition] = []
    for axis, s, d, state in steps:
        kind = transition_kind(s, d)
        if kind is None or mesh[axis] == 1:
            continue
        others = math.prod(n for j, (sj, n) in enumerate(zip(state, mesh)) if j != axis and isinstance(sj, Split))
        out.append((kind, axis, nbytes // others))
    return out


def edge_backward_transitions(nbytes: int, src: NdSbp, dst: NdSbp, grad: NdSbp,
                              mesh: tuple[int, ...]) -> list[Transition]:
    """Collectives of the gradient of an activation edge boxed ``src -> dst`` whose consumers
    hand back ``grad``, as the executor's autograd runs them.

    Without a ->P axis: one redistribute backward, ``grad -> needed_grad_ndsbp(src)``. With
    one, two: the local ->P move's ``from_local`` first brings ``grad`` to
    ``needed_grad_ndsbp(dst)``, the move's gradient (a narrow or the identity) is then read
    as ``needed_grad_ndsbp(mid)``, which the redistribute's backward takes to
    ``needed_grad_ndsbp(src)``. (A parameter's use is a detached leaf: its gradient goes
    ``grad -> storage`` in one redistribute, :func:`transitions_of`.)"""
    mid, pad, keep = redistribute_target(src, dst)
    need = needed_grad_ndsbp(src)
    if not pad and not keep:
        return _steps_collectives(nbytes, dtensor_steps(grad, need, mesh), mesh)
    return (_steps_collectives(nbytes, dtensor_steps(grad, needed_grad_ndsbp(dst), mesh), mesh)
            + _steps_collectives(nbytes, dtensor_steps(needed_grad_ndsbp(mid), need, mesh), mesh))


def backward_boxing_collectives(meta: TensorMeta, src: NdSbp, dst: NdSbp, mesh_shape: Sequence[int],
                                consumer_outputs: Sequence[NdSbp] | None = None) -> list[Transition]:
    """Collectives of the gradient of an edge boxed ``src`` (producer) -> ``dst`` (consumer input).

    ``consumer_outputs`` (the consumer's output NdSbps) decide the gradient of a B input;
    they are required when ``dst`` has B on a mesh axis of size > 1.
    """
    if not meta.is_floating:
        return []                                     # integer tensors carry no gradient
    mesh = tuple(mesh_shape)
    if consumer_outputs is None:
        if any(isinstance(s, Broadcast) and n > 1 for s, n in zip(dst, mesh)):
            raise ValueError(
                f"backward boxing of {meta} {src} -> {dst}: the gradient of a B input depends on the "
                "consumer's outputs (B if they are B on that axis, else P); pass consumer_outputs="
                "signature.outputs of the consuming op")
        consumer_outputs = ()
    return boxing_collectives(meta, grad_ndsbp(dst, consumer_outputs), needed_grad_ndsbp(src), mesh)


def transitions_time_s(transitions: Sequence[Transition], mesh_shape: Sequence[int], cluster: Cluster) -> float:
    """Sum of the collectives' times, each on the link of its mesh axis, as the backend runs it."""
    mesh = tuple(mesh_shape)
    return sum(cluster_collective_time_s(kind, nbytes, mesh, axis, cluster) for kind, axis, nbytes in transitions)


def boxing_time_s(meta: TensorMeta, src: NdSbp, dst: NdSbp, mesh_shape: Sequence[int], cluster: Cluster) -> float:
    """Forward boxing time of ``meta`` from ``src`` to ``dst``."""
    return transitions_time_s(boxing_collectives(meta, src, dst, mesh_shape), mesh_shape, cluster)


def backward_boxing_time_s(meta: TensorMeta, src: NdSbp, dst: NdSbp, mesh_shape: Sequence[int],
                           cluster: Cluster, consumer_outputs: Sequence[NdSbp] | None = None) -> float:
    """Time of the dual gradient transition of the edge ``src`` -> ``dst`` (see module docstring)."""
    return transitions_time_s(backward_boxing_collectives(meta, src, dst, mesh_shape, consumer_outputs),
                              mesh_shape, cluster)
