"""Alpha-beta time of one collective on one mesh axis (or several flattened into one group), per backend.

``M`` is always the bytes of the *full* tensor the collective is about (as seen
on this axis, i.e. already divided by the splits of the other mesh axes), never
a per-device piece. For ``n`` devices on the axis, bandwidth ``b`` (bytes/s per
device, one direction, derated by ``network_eff``) and latency ``a`` (s):

==============  =====================================  ===========================================
kind            M                                      time (ring / pairwise algorithms)
==============  =====================================  ===========================================
all_reduce      each device's full-size addend         2(n-1)/n * M/b + 2(n-1) * a
all_gather      the gathered tensor (piece = M/n)      (n-1)/n * M/b + (n-1) * a
reduce_scatter  each device's full-size input          (n-1)/n * M/b + (n-1) * a
all_to_all      the logical tensor (piece = M/n)       (n-1)/n * (M/n)/b + (n-1) * a
                (each device sends (n-1)/n of its M/n piece in n-1 pairwise steps)
broadcast       the broadcast tensor                   M/b + (n-1) * a
                (pipelined ring: bandwidth term ~M/b for large M, n-1 hops of latency)
send_recv       the tensor one rank sends another      M/b + a
                (one hop between two devices: :func:`send_recv_time_s`)
==============  =====================================  ===========================================

``n == 1`` costs 0 for every kind. The backend table says how each kind is
really carried out; an emulated kind is costed as the kind that runs, on the
same ``M`` (the definitions above make that a plain substitution).

Every formula is ``lat(n) * a + bw(n) * M / b`` (:func:`formula_coefficients`),
linear in ``(a, 1/b)``: :func:`fit_collective` recovers ``a`` and ``b`` from
timings by least squares, and :func:`cluster_collective_time_s` uses such a
per-kind fit (``Cluster.collectives``) in place of the intra-node link, and adds
the executor's fixed cost per collective (``Cluster.executor.collective_us``:
its host work around the backend call), which is not part of ``a``; on a
CPU cluster whose nodes hold more of the mesh's ranks than ``cores_per_node`` the
whole time is multiplied by ``Cluster.comm_time_sharing`` (the ranks time-share the cores,
beyond the sharing the fits were measured under). A collective the host waits for where it issues
it is priced instead from the times measured by size (``Cluster.collective_points``,
autoddl/collective_points.py) with as many ranks busy on the node as the mesh puts there, where the
file has them (:func:`measured_curve`; a group larger than a node: timed across the nodes): on a CPU
whose cores the ranks share, gloo follows no line.

A point-to-point send (a pipeline stage's activations or gradients, a shard's transfer) is
priced by :func:`send_recv_time_s` alone, from the two devices it joins, with the same rules.

What a collective costs the host CPU its ranks compute on (gloo) is :func:`collective_cpu_s`: the
bytes a rank sends (the bandwidth term's coefficient times ``M``) times the link's
``cpu_ns_per_byte``; :func:`cpu_ns_per_byte` is its inverse, for the calibration.

Across nodes the link is :func:`node_link`: ``links.inter_node`` as is, or, where the file says a
node's devices share that one link (``shared_by_node``, ``measured_flows``: the two-host testbed),
the bandwidth one of the flows the collective puts on the node's link at once gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autoddl.boxing import Group, group_axes
from autoddl.cluster import Backend, Cluster, LinkSpec
from autoddl.collective_points import CollectiveCurve
from autoddl.collective_kinds import BACKENDS, BackendCollectives, CollectiveKind, carried_out_as  # noqa: F401
from autoddl.program import PHASES


@dataclass(frozen=True)
class Collective:
    """One collective a training step runs: kind (as carried out), mesh axis (or tuple of axes
    flattened into one group), M bytes, phase."""

    kind: CollectiveKind
    axis: Group
    bytes: int            # M: full tensor bytes on this axis (see module docstring)
    phase: str            # "forward" | "backward" | "grad_sync"
    tensor: str = ""      # the graph edge "producer->consumer" or parameter fqn it moves

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"Collective.phase must be one of {PHASES}, got {self.phase!r}")

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "axis": list(self.axis) if isinstance(self.axis, tuple) else self.axis,
                "bytes": int(self.bytes),
                "phase": self.phase, "tensor": self.tensor}


def native_time_s(kind: CollectiveKind, nbytes: float, n_devices: int,
                  bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Alpha-beta time of ``kind`` as written in the module docstring (no backend emulation)."""
    n = int(n_devices)
    if n < 1:
        raise ValueError(f"a collective needs at least 1 device on its mesh axis, got {n_devices}")
    if n == 1:
        return 0.0
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"link bandwidth must be positive, got {bandwidth_bytes_per_s} bytes/s")
    m, b, a = float(nbytes), float(bandwidth_bytes_per_s), float(latency_s)
    kind = CollectiveKind(kind)
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (n - 1) / n * m / b + 2 * (n - 1) * a
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        return (n - 1) / n * m / b + (n - 1) * a
    if kind is CollectiveKind.ALL_TO_ALL:
        return (n - 1) / n * (m / n) / b + (n - 1) * a
    if kind is CollectiveKind.BROADCAST:
        return m / b + (n - 1) * a
    if kind is CollectiveKind.SEND_RECV:
        return m / b + a
    raise ValueError(f"no time formula for collective kind {kind!r}")


def collective_time_s(kind: CollectiveKind, nbytes: float, n_devices: int, link: LinkSpec,
                      backend: Backend | str, network_eff: float = 1.0) -> float:
    """Seconds for ``kind`` over ``n_devices`` on ``link``, as ``backend`` really carries it out."""
    if not 0 < network_eff <= 1:
        raise ValueError(f"network_eff must be in (0, 1], got {network_eff}")
    bandwidth = link.bandwidth_gbps * 1e9 * network_eff
    return native_time_s(carried_out_as(kind, backend), nbytes, n_devices, bandwidth, link.latency_us * 1e-6)


def cluster_collective_time_s(kind: CollectiveKind, nbytes: float, mesh_shape: Sequence[int], axis: Group,
                              cluster: Cluster, host_waits: bool = False) -> float:
    """Seconds for ``kind`` on mesh axis ``axis`` of ``mesh_shape`` on ``cluster``, or over the
    flattened group of a tuple of axes (one collective over all their ranks: ``n`` is the product
    of their sizes, and the link is that of the outermost, the slowest the group crosses).

    Same as ``collective_time_s(kind, nbytes, n, cluster.link_for_axis(mesh, outermost axis),
    cluster.backend, cluster.efficiency.network)``, except that on an intra-node group a
    per-kind fit in ``cluster.collectives`` replaces the link: the fit of ``kind`` itself,
    else that of the kind the backend carries it out as (gloo's reduce-scatter is an all-reduce);
    ``n`` enters the fit's formula as it enters the link's (a fit taken on groups of 2 prices a
    group of 4 as a ring of 4 with the fitted latency and bandwidth). A group across nodes takes
    :func:`node_link` (``links.inter_node``, per flow where the node's devices share it). Plus
    ``cluster.executor.collective_us`` when the group has more than one device; all of it
    times ``cluster.comm_time_sharing(mesh_shape)``. ``host_waits`` (the host waits for it where it is
    issued) and a measured curve for the group inside a node (:func:`measured_curve`): the curve's time
    at ``nbytes`` instead of the fit's, the sharing already in it, plus the executor's cost slowed. A
    ``send_recv`` joins two devices, not an axis: it is :func:`send_recv_time_s` from the first device to
    the next one along ``axis``.
    """
    mesh = tuple(mesh_shape)
    axes, n, intra = _group(mesh, axis, cluster)
    outer = min(axes)
    if CollectiveKind(kind) is CollectiveKind.SEND_RECV:
        if len(axes) > 1:
            raise ValueError(f"a send_recv is between two ranks along one mesh axis, got the group {axis!r}")
        next_s = math.prod(mesh[outer + 1:])             # row-major: the next rank along the axis
        return send_recv_time_s(nbytes, 0, next_s, cluster, mesh) if n > 1 else 0.0
    fixed_s = cluster.executor.collective_us * 1e-6 if n > 1 else 0.0
    curve = measured_curve(kind, n, mesh, cluster, host_waits, intra)
    if curve is not None:
        return curve.time_s(nbytes) + fixed_s * cluster.comm_time_sharing(mesh)
    if intra:
        fit = cluster.collectives.get(kind) or cluster.collectives.get(carried_out_as(kind, cluster.backend))
        link = fit or cluster.intra_node
    else:
        link = node_link(cluster, mesh, tuple(axes))
    return (collective_time_s(kind, nbytes, n, link, cluster.backend, cluster.efficiency.network)
            + fixed_s) * cluster.comm_time_sharing(mesh)


def measured_curve(kind: CollectiveKind, n: int, mesh: tuple[int, ...], cluster: Cluster,
                   host_waits: bool, intra: bool) -> CollectiveCurve | None:
    """The curve pricing ``kind`` on a group of ``n`` ranks inside a node of ``mesh`` (``intra``), or across nodes
    where ``n`` is more than a node holds (then it was timed across them: `autoddl calibrate
    --across-hosts`; a group across nodes no larger than one, one rank per node, keeps its fit), or
    None: only a collective the host waits for where it issues it (``host_waits``: ``Task.host_waits``)
    takes one, measured (``cluster.collective_points``) with as many ranks busy on each node as ``mesh``
    puts there, for ``kind`` or the kind the backend carries it out as. `autoddl calibrate` times a
    collective back to back on every rank of the node, as a waited-for one runs: its ranks compute
    nothing beside it. An asynchronous one (a gradient bucket, a prefetched gather) runs beside compute
    on the cores that compute uses, which the curve does not see: it keeps the fit, slowed by the
    time-sharing."""
    if not host_waits or not cluster.collective_points or not (intra or n > cluster.devices_per_node):
        return None
    busy = cluster.ranks_per_node(mesh)
    points = cluster.collective_points
    return points.get(busy, n, kind) or points.get(busy, n, carried_out_as(kind, cluster.backend))


def _group(mesh: tuple[int, ...], axis: Group, cluster: Cluster) -> tuple[tuple[int, ...], int, bool]:
    """(the group's mesh axes, its ranks, whether it fits in a node: the outermost axis and every axis
    inside it within ``devices_per_node``), the mesh and axes validated."""
    for a in group_axes(axis):
        cluster.link_for_axis(mesh, a)                  # validates mesh and axes
    axes = tuple(sorted({a % len(mesh) for a in group_axes(axis)}))
    if len(axes) != len(group_axes(axis)):
        raise ValueError(f"a collective's group must be distinct mesh axes, got {axis!r} on mesh {mesh}")
    return axes, math.prod(mesh[a] for a in axes), math.prod(mesh[axes[0]:]) <= cluster.devices_per_node


def collective_cpu_s(kind: CollectiveKind, nbytes: float, mesh_shape: Sequence[int], axis: Group,
                     cluster: Cluster) -> float:
    """Host CPU seconds one rank spends on ``kind`` of ``nbytes`` (M) over mesh ``axis``, taken from its
    compute (costmodel/simulate.py): the bytes it sends (:func:`bytes_sent`), times the link's
    ``cpu_ns_per_byte`` (``links.intra_node`` for a group inside a node, else ``links.inter_node``),
    slowed by ``cluster.time_sharing`` as the ranks' compute is. 0 for a group of one rank and on links
    without a CPU cost (GPU clusters)."""
    mesh = tuple(mesh_shape)
    _, n, intra = _group(mesh, axis, cluster)
    per_byte_ns = (cluster.intra_node if intra else cluster.inter_node).cpu_ns_per_byte
    if n == 1 or not per_byte_ns:
        return 0.0
    return bytes_sent(kind, nbytes, n, cluster.backend) * per_byte_ns * 1e-9 * cluster.time_sharing(mesh)


def cpu_ns_per_byte(cpu_s: float, kind: CollectiveKind, nbytes: float, n_devices: int, backend: Backend | str) -> float:
    """A link's ``cpu_ns_per_byte`` from the CPU seconds one rank spent on one ``kind`` of ``nbytes`` on
    ``n_devices`` ranks: :func:`collective_cpu_s` inverted, without its time-sharing (that CPU is the
    rank's, however many ranks share a core) (``autoddl calibrate --only collective_cpu``)."""
    sent = bytes_sent(kind, nbytes, n_devices, backend)
    if sent <= 0:
        raise ValueError(f"cpu_ns_per_byte: {kind} of {nbytes} bytes on {n_devices} ranks sends nothing to "
                         "divide by; time a collective of at least 2 ranks")
    return cpu_s / sent * 1e9


def bytes_sent(kind: CollectiveKind, nbytes: float, n_devices: int, backend: Backend | str) -> float:
    """The bytes one rank sends in ``kind`` of ``nbytes`` (M) on ``n_devices`` ranks, as ``backend`` carries
    it out: the bandwidth term's coefficient times M (:func:`formula_coefficients`; a ``send_recv``: M)."""
    return formula_coefficients(carried_out_as(CollectiveKind(kind), backend), n_devices)[1] * nbytes


def send_recv_time_s(nbytes: float, src: int, dst: int, cluster: Cluster, busy_mesh: Sequence[int]) -> float:
    """Seconds to send ``nbytes`` from device ``src`` to device ``dst`` of ``cluster`` (numbered node-major)
    while every rank of ``busy_mesh`` runs; 0 when ``src == dst``.

    The ``send_recv`` formula (``M/b + a``) on the link the two devices share: inside a node the
    calibrated ``cluster.collectives.send_recv`` fit when there is one (``autoddl calibrate``: half a
    gloo isend / irecv ping-pong), else ``cluster.intra_node``; across nodes :func:`node_link` over the
    axes of ``busy_mesh`` on which ``src`` and ``dst`` differ (every rank of ``busy_mesh`` sends to
    its peer along them at once, as a pipeline stage's ranks do; a mesh ``(N,)``: this send alone).
    Plus ``cluster.executor.collective_us``, all times ``cluster.comm_time_sharing(busy_mesh)``, as
    :func:`cluster_collective_time_s` does for a collective.
    """
    if src == dst:
        return 0.0
    dpn = cluster.devices_per_node
    if not (0 <= src < cluster.num_devices and 0 <= dst < cluster.num_devices):
        raise ValueError(f"send_recv_time_s: devices {src} -> {dst} outside {cluster.name}'s "
                         f"{cluster.num_devices} devices (0..{cluster.num_devices - 1})")
    if src // dpn == dst // dpn:
        link = cluster.collectives.get(CollectiveKind.SEND_RECV) or cluster.intra_node
    else:
        link = node_link(cluster, tuple(busy_mesh), _differing_axes(src, dst, tuple(busy_mesh)))
    return ((collective_time_s(CollectiveKind.SEND_RECV, nbytes, 2, link, cluster.backend, cluster.efficiency.network)
             + cluster.executor.collective_us * 1e-6) * cluster.comm_time_sharing(tuple(busy_mesh)))


def node_flows(mesh_shape: Sequence[int], axes: Sequence[int], devices_per_node: int) -> int:
    """Flows a collective over mesh ``axes`` puts on one node's link at once: the groups of it with a
    rank on the node (devices row-major, node-major; the groups run at once, and each group's ring,
    its ranks in device order, leaves and enters a node once). Where a node holds whole mesh axes: the
    product of the sizes of the node-internal axes not in ``axes``. A 2x2 mesh on 2 nodes of 2, axis 0
    (across) -> 2 (one pair per rank of the node); axes (0, 1) flattened -> 1 (one ring of 4)."""
    mesh, grouped = tuple(mesh_shape), set(axes)
    return len({tuple(c for a, c in enumerate(_coordinate(d, mesh)) if a not in grouped)
                for d in range(min(devices_per_node, math.prod(mesh)))})


def node_link(cluster: Cluster, mesh_shape: Sequence[int], axes: Sequence[int]) -> LinkSpec:
    """The inter-node link as one flow of a collective over mesh ``axes`` sees it (one of
    :func:`node_flows` at once): ``cluster.inter_node.per_flow(flows)``. Where the node's devices share
    one link (``links.inter_node.shared_by_node``), the bandwidth term scales by flows / measured_flows;
    the latency term is unchanged; where each device has its own (GPU clusters), the link as it is.

    configs/two-hosts.yaml (fitted with 2 pairs at once on the hosts' one link, measured_flows 2),
    8 MB all-reduce on the 2x2 mesh: axis 0 -> 2 flows, as fitted (124.6 ms alpha-beta against 134.4
    measured); the flattened group of 4 ranks -> 1 flow, twice the fitted bandwidth (97.1 ms against
    105.7 measured; 189.3 ms with the 2-flow fit as it is).
    """
    return cluster.inter_node.per_flow(node_flows(mesh_shape, axes, cluster.devices_per_node))


def _differing_axes(src: int, dst: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh axes on which devices ``src`` and ``dst`` (row-major) differ."""
    if max(src, dst) >= math.prod(mesh_shape):
        raise ValueError(f"send_recv_time_s: devices {src} -> {dst} outside the busy mesh {mesh_shape} "
                         f"({math.prod(mesh_shape)} devices); pass the mesh whose ranks run during the send")
    return tuple(a for a, (i, j) in enumerate(zip(_coordinate(src, mesh_shape), _coordinate(dst, mesh_shape)))
                 if i != j)


def _coordinate(device: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Device ``device``'s coordinate on ``mesh_shape`` (devices numbered row-major)."""
    return tuple(device // math.prod(mesh_shape[a + 1:]) % n for a, n in enumerate(mesh_shape))


def stage_device(pp_rank: int, mesh_shape: Sequence[int]) -> int:
    """The first device of pipeline rank ``pp_rank`` on a mesh whose outermost axis (0) is pp: the
    peer a send from another stage's first device reaches (devices numbered row-major, node-major)."""
    return pp_rank * math.prod(tuple(mesh_shape)[1:])


# -- fitting latency and bandwidth to timings ------------------------------------------------------
def formula_coefficients(kind: CollectiveKind, n_devices: int) -> tuple[float, float]:
    """``(lat, bw)`` with ``native_time_s(kind, M, n, b, a) == lat * a + bw * M / b``."""
    return (native_time_s(kind, 0.0, n_devices, 1.0, 1.0), native_time_s(kind, 1.0, n_devices, 1.0, 0.0))


@dataclass(frozen=True)
class CollectiveFit:
    """Latency and bandwidth that make ``carried_as``'s formula reproduce timings of ``kind``."""

    kind: CollectiveKind            # the kind that was timed
    carried_as: CollectiveKind      # the formula fitted (how the backend carries ``kind`` out)
    latency_us: float
    bandwidth_gbps: float
    r2: float                       # coefficient of determination of the times
    max_rel_residual: float         # max |predicted - measured| / measured over the points
    points: int

    @property
    def link(self) -> LinkSpec:
        return LinkSpec(bandwidth_gbps=self.bandwidth_gbps, latency_us=self.latency_us)

    def predict_s(self, nbytes: float, n_devices: int) -> float:
        return native_time_s(self.carried_as, nbytes, n_devices, self.bandwidth_gbps * 1e9, self.latency_us * 1e-6)


def fit_collective(kind: CollectiveKind, backend: Backend | str,
                   samples: Sequence[tuple[int, float, float]]) -> CollectiveFit:
    """Fit ``a`` (latency) and ``b`` (bandwidth) of one kind to ``samples`` of ``(n_devices, M bytes, seconds)``.

    Minimises the sum of squared *relative* residuals of ``t = lat(n) a + bw(n) M / b``
    (the formula of the kind ``backend`` carries ``kind`` out as), so 4 KB and 32 MB
    messages count alike, with ``a >= 0``. Exact timings of the model give back exactly
    its ``a`` and ``b``.
    """
    kind = CollectiveKind(kind)
    carried = carried_out_as(kind, backend)
    rows = [(n, m, t) for n, m, t in samples if int(n) > 1]
    if len(rows) < 2 or len({(n, m) for n, m, _ in rows}) < 2:
        raise ValueError(f"fit_collective({kind}): need timings at 2 or more (devices, bytes) points with "
                         f"more than 1 device, got {len(rows)}; time more message sizes")
    if any(not t > 0 for _, _, t in rows):
        raise ValueError(f"fit_collective({kind}): every time must be positive, got {[t for *_, t in rows]}")
    coef = np.array([formula_coefficients(carried, n) for n, _, _ in rows])            # (P, 2)
    x = np.column_stack([coef[:, 0], coef[:, 1] * np.array([m for _, m, _ in rows])])  # (P, 2): a, 1/b
    t = np.array([t for *_, t in rows])                                                 # (P,)
    w = 1.0 / t                                                                         # relative residuals
    sol, *_ = np.linalg.lstsq(x * w[:, None], t * w, rcond=None)
    a, inv_b = float(sol[0]), float(sol[1])
    if a < 0:                                    # non-negative latency: refit the bandwidth alone
        a, inv_b = 0.0, float(np.sum(x[:, 1] * w * w * t) / np.sum((x[:, 1] * w) ** 2))
    if not inv_b > 0 or float(np.max(x[:, 1] * inv_b / t)) < 0.01:     # bytes explain < 1% of every time
        raise ValueError(f"fit_collective({kind}): the times do not grow with message size (fitted 1/bandwidth "
                         f"{inv_b:g} s/byte); time larger messages (e.g. up to 32 MB) on a less busy machine")
    pred = x @ np.array([a, inv_b])
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((t - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return CollectiveFit(kind=kind, carried_as=carried, latency_us=a * 1e6, bandwidth_gbps=1.0 / inv_b / 1e9,
                         r2=r2, max_rel_residual=float(np.max(np.abs(pred - t) / t)), points=len(rows))
