"""Boxing priced: the collectives of autoddl.boxing's moves, and their times.

The decomposition of a transition into moves and the backward gradient rule live
once in the core (autoddl/boxing.py); the executor runs those same moves. This
module lists their collectives as ``(kind, mesh axis, M bytes)`` transitions
(kinds before backend emulation) and prices them on a cluster's links.
"""

from __future__ import annotations

from typing import Sequence

from autoddl.boxing import (Group, boxing_moves, collectives_of, gradient_moves, grad_ndsbp, grad_sbp,  # noqa: F401
                            needed_grad_ndsbp, needed_grad_sbp, parameter_moves, transition_kind)
from autoddl.cluster import Cluster
from autoddl.graph import TensorMeta
from autoddl.sbp import NdSbp
from costmodel.collectives import CollectiveKind, cluster_collective_time_s

Transition = tuple[CollectiveKind, Group, int]   # (kind, mesh axis or tuple of flattened axes, M bytes)


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
    return collectives_of(boxing_moves(nbytes, src, dst, mesh))


def parameter_transitions_of(nbytes: int, src: NdSbp, dst: NdSbp, shape: Sequence[int],
                             mesh: tuple[int, ...]) -> list[Transition]:
    """:func:`transitions_of` a parameter's gather (storage -> use) or gradient sync (gradient -> what
    the storage needs): a chain over several mesh axes is one collective over their flattened group
    where the parameter's ``shape`` nests evenly, as the lowering runs it (autoddl.boxing.parameter_moves)."""
    return collectives_of(parameter_moves(nbytes, src, dst, shape, mesh))


def edge_backward_transitions(nbytes: int, src: NdSbp, dst: NdSbp, grad: NdSbp,
                              mesh: tuple[int, ...]) -> list[Transition]:
    """Collectives of the gradient of an edge boxed ``src -> dst`` whose consumers hand back
    ``grad``: one boxing ``grad -> needed_grad_ndsbp(src)`` (``dst`` does not matter: every
    boxing is the identity on the logical tensor)."""
    return collectives_of(gradient_moves(nbytes, grad, src, mesh))


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
        if any(s.is_broadcast() and n > 1 for s, n in zip(dst, mesh)):
            raise ValueError(
                f"backward boxing of {meta} {src} -> {dst}: the gradient of a B input depends on the "
                "consumer's outputs (B if they are B on that axis, else P); pass consumer_outputs="
                "signature.outputs of the consuming op")
        consumer_outputs = ()
    return boxing_collectives(meta, grad_ndsbp(dst, consumer_outputs), needed_grad_ndsbp(src), mesh)


def transitions_time_s(transitions: Sequence[Transition], mesh_shape: Sequence[int], cluster: Cluster) -> float:
    """Sum of the collectives' times, each on the link of its mesh axis (or group), as the backend runs it."""
    mesh = tuple(mesh_shape)
    return sum(cluster_collective_time_s(kind, nbytes, mesh, axis, cluster, host_waits=True)
               for kind, axis, nbytes in transitions)


def boxing_time_s(meta: TensorMeta, src: NdSbp, dst: NdSbp, mesh_shape: Sequence[int], cluster: Cluster) -> float:
    """Forward boxing time of ``meta`` from ``src`` to ``dst``."""
    return transitions_time_s(boxing_collectives(meta, src, dst, mesh_shape), mesh_shape, cluster)


def backward_boxing_time_s(meta: TensorMeta, src: NdSbp, dst: NdSbp, mesh_shape: Sequence[int],
                           cluster: Cluster, consumer_outputs: Sequence[NdSbp] | None = None) -> float:
    """Time of the dual gradient transition of the edge ``src`` -> ``dst`` (see module docstring)."""
    return transitions_time_s(backward_boxing_collectives(meta, src, dst, mesh_shape, consumer_outputs),
                              mesh_shape, cluster)
