"""Measured collective curves (autoddl/collective_points.py): interpolation and the monotone medians by
hand, the cluster file's schema (errors naming the field, the round trip), which collectives the cost
model prices with a curve (those the host waits for, on a mesh with the curve's ranks busy) and which
keep the scaled fit, the lowering's ``host_waits`` per kind of task, and the calibration's write-back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
from torch import nn

import autoddl
from autoddl.cluster import Cluster, ClusterConfigError, CollectiveFits, ExecutorOverheads, LinkSpec
from autoddl.collective_kinds import CollectiveKind as K
from autoddl.collective_points import CollectiveCurve, CollectivePoints, measured_points, monotone
from autoddl.program import lower
from costmodel.collectives import cluster_collective_time_s, collective_time_s
from costmodel.simulate import simulate
from clusters import CPU_CLUSTER_PATH

CURVE = CollectiveCurve(((4096, 1000.0), (16384, 2000.0), (65536, 2000.0)))
FIT = LinkSpec(1.0, 500.0)                      # 1 GB/s, 500 us: the fit a curve-less collective takes
FIXED_US = 50.0                                 # executor.collective_us


def test_curve_interpolates_between_points_floors_below_and_scales_above():
    assert CURVE.time_s(1) == CURVE.time_s(4096) == pytest.approx(1000e-6)           # the latency floor
    assert CURVE.time_s(10240) == pytest.approx((1000 + 1000 * 6144 / 12288) * 1e-6)   # 1500 us
    assert CURVE.time_s(40000) == pytest.approx(2000e-6)                              # flat segment
    assert CURVE.time_s(131072) == pytest.approx(4000e-6)                             # 2x the last size


def test_monotone_pools_adjacent_violators():
    assert monotone([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert monotone([5, 1, 1]) == pytest.approx([7 / 3] * 3)
    assert monotone([1, 2, 3]) == [1, 2, 3]


def test_measured_points_one_curve_per_group_and_kind_made_monotone():
    timings = [("all_reduce", 4, 4096, 5.4e-3), ("all_reduce", 4, 16384, 5.0e-3), ("all_reduce", 4, 65536, 6.0e-3),
               ("all_gather", 2, 4096, 1.0e-3), ("send_recv", 2, 4096, 1.0e-4)]
    points = measured_points(timings, 4, ("all_reduce", "all_gather"))
    assert [k for k, _ in points.curves] == [(4, 2, "all_gather"), (4, 4, "all_reduce")]    # no send_recv
    assert points.get(4, 4, K.ALL_REDUCE).points == ((4096, 5200.0), (16384, 5200.0), (65536, 6000.0))
    assert points.get(2, 4, "all_reduce") is None and points.get(4, 2, "all_reduce") is None


def _with_points(tmp_path, points):
    d = Cluster.from_yaml(CPU_CLUSTER_PATH).to_dict()
    d["collective_points"] = points
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_schema_errors_name_the_field(tmp_path):
    bad = {"rank_4": {"group_2": {"all_reduce": [[4096, 10]]}},
           "ranks_2": {"group_1": {"all_reduce": [[4096, 10]]},
                       "group_2": {"all_reduce": [[4096, 10], [16384, 9]], "allreduce": [[4096, 1]],
                                   "broadcast": [[4096, -1]]}}}
    with pytest.raises(ClusterConfigError) as err:
        Cluster.from_yaml(_with_points(tmp_path, bad))
    text = str(err.value)
    assert "collective_points.rank_4: expected a key ranks_R" in text
    assert "collective_points.ranks_2.group_1: a group of 1 rank: a collective's group has 2 ranks or more" in text
    assert "collective_points.ranks_2.group_2.all_reduce[1]: [16384, 9] after [4096, 10.0]" in text
    assert "collective_points.ranks_2.group_2.allreduce: unknown collective kind" in text
    assert "collective_points.ranks_2.group_2.broadcast[0]: expected a pair [M bytes > 0, microseconds > 0]" in text


def test_round_trip_one_line_per_curve(tmp_path):
    good = {"ranks_4": {"group_4": {"all_reduce": [[4096, 5420.5], [65536, 6000]]},
                        "group_2": {"all_gather": [[4096, 1650]]}}}
    cluster = Cluster.from_yaml(_with_points(tmp_path, good))
    assert cluster.collective_points.get(4, 4, "all_reduce").points == ((4096, 5420.5), (65536, 6000.0))
    out = tmp_path / "out.yaml"
    cluster.to_yaml(out, comments={"collective_points.ranks_4": "measured by hand"})
    assert Cluster.from_yaml(out) == cluster
    assert "      all_reduce: [[4096, 5420.5], [65536, 6000]]\n" in out.read_text()
    assert "  ranks_4:  # measured by hand\n" in out.read_text()


def cpu4(points: CollectivePoints) -> Cluster:
    """4 devices on 2 cores (time-sharing 2 on a mesh of 4), every collective on the ``FIT`` link, a fixed
    executor cost per collective, ``points``."""
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH)
    return dataclasses.replace(cluster, devices_per_node=4, cores_per_node=2, comm_measured_ranks_per_node=None,
                               collectives=CollectiveFits(), intra_node=FIT, inter_node=FIT, collective_points=points,
                               executor=ExecutorOverheads(collective_us=FIXED_US))


@pytest.mark.parametrize("kind", [K.ALL_REDUCE, K.REDUCE_SCATTER])
def test_a_collective_the_host_waits_for_takes_the_curve_of_its_ranks_busy(kind):
    """On a mesh of 4 (2 ranks per core): a waited-for all-reduce over the 4 is the ranks_4 group_4 curve plus
    the executor's cost slowed 2x; gloo's reduce-scatter (an all-reduce) takes the all-reduce's curve. An
    asynchronous one, and any on a mesh of 2 (no ranks_2 curve), is the ring formula on the fit, plus the
    executor's cost, times the time-sharing."""
    points = CollectivePoints((((4, 4, "all_reduce"), CURVE),
                               ((4, 2, "all_reduce"), CollectiveCurve(((4096, 700.0),)))))
    cluster, m = cpu4(points), 10240
    assert cluster_collective_time_s(kind, m, (4,), 0, cluster, host_waits=True) == pytest.approx(
        1500e-6 + 2 * FIXED_US * 1e-6)
    assert cluster_collective_time_s(kind, m, (2, 2), 1, cluster, host_waits=True) == pytest.approx(
        700e-6 * m / 4096 + 2 * FIXED_US * 1e-6)              # two groups of 2, 4 ranks busy; scaled past its point
    fit = collective_time_s(kind, m, 4, FIT, cluster.backend)
    assert fit == pytest.approx(2 * 3 / 4 * m / 1e9 + 6 * 500e-6)              # the ring of 4, by hand
    assert cluster_collective_time_s(kind, m, (4,), 0, cluster, host_waits=False) == pytest.approx(
        2 * (fit + FIXED_US * 1e-6))
    two = cluster.resized(2)
    assert cluster_collective_time_s(kind, m, (2,), 0, two, host_waits=True) == pytest.approx(
        collective_time_s(kind, m, 2, FIT, cluster.backend) + FIXED_US * 1e-6)
    assert cluster_collective_time_s(K.ALL_GATHER, m, (4,), 0, cluster, host_waits=True) == pytest.approx(
        2 * (collective_time_s(K.ALL_GATHER, m, 4, FIT, cluster.backend) + FIXED_US * 1e-6))   # no curve of its own


def test_a_group_across_nodes_larger_than_a_node_takes_the_curve_timed_across_them():
    """Two hosts of 2 ranks (`calibrate --across-hosts` writes ranks_2 curves of a host's pairs and of all 4
    ranks): on the 2x2 mesh a waited-for all-gather over both axes (4 ranks, across the hosts) is the
    group_4 curve plus the executor's cost; over axis 1 (a host's own pair) the group_2 curve; over axis 0
    (one rank per host: a group of 2 across the link, not the curve of a host's pair) and any asynchronous
    one the fit."""
    points = CollectivePoints((((2, 4, "all_gather"), CURVE),
                               ((2, 2, "all_gather"), CollectiveCurve(((4096, 300.0),)))))
    two = dataclasses.replace(cpu4(points), nodes=2, devices_per_node=2, cores_per_node=1,
                              comm_measured_ranks_per_node=2)
    m, mesh = 10240, (2, 2)
    assert two.comm_time_sharing(mesh) == 1                        # measured with every rank busy
    assert cluster_collective_time_s(K.ALL_GATHER, m, mesh, (0, 1), two, host_waits=True) == pytest.approx(
        1500e-6 + FIXED_US * 1e-6)
    assert cluster_collective_time_s(K.ALL_GATHER, m, mesh, 1, two, host_waits=True) == pytest.approx(
        300e-6 * m / 4096 + FIXED_US * 1e-6)
    across = cluster_collective_time_s(K.ALL_GATHER, m, mesh, 0, two, host_waits=True)
    assert across == pytest.approx(cluster_collective_time_s(K.ALL_GATHER, m, mesh, 0, two, host_waits=False))
    assert across != pytest.approx(300e-6 * m / 4096 + FIXED_US * 1e-6)
    assert cluster_collective_time_s(K.ALL_GATHER, m, mesh, (0, 1), two, host_waits=False) != pytest.approx(
        1500e-6 + FIXED_US * 1e-6)


def _programs():
    """An MLP of three 1 MB layers (a ZeRO-3 gather group each) and its dp, tp, ZeRO-1 and ZeRO-3 programs
    on 4 ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    graph = autoddl.trace(model, (torch.randn(8, 512),), lambda out, x: out.pow(2).mean(), name="mlp")
    from search.planner import search
    plans = {s.name: s.plan for s in search(graph, cpu4(CollectivePoints()), mesh=(4,)).schemes}
    return graph, plans, {name: lower(graph, plans[name]) for name in ("dp", "tp", "zero1", "zero3")}


def test_host_waits_is_what_the_executor_waits_for_where_it_issues_it():
    """Gradient buckets, prefetched gathers and the loss's all-reduce are asynchronous; boxing moves, ZeRO-1's
    parameter sync after the optimizer and the first (not prefetched) gather are waited for."""
    _, _, programs = _programs()
    waits = {name: {(t.phase, t.tensor.split(" ")[0].rstrip("0123456789"), t.host_waits)
                    for t in p.tasks if t.is_collective} for name, p in programs.items()}
    assert ("grad_sync", "bucket", False) in waits["dp"] and ("grad_sync", "bucket", True) not in waits["dp"]
    assert ("forward", "mean->output", False) in waits["tp"]                    # the loss's: read at the step's end
    assert {w for ph, what, w in waits["tp"] if what != "mean->output"} == {True}   # the boxing moves
    assert ("optimizer", "param", True) in waits["zero1"]
    gathers = [t.host_waits for t in programs["zero3"].tasks if t.tensor.startswith("gather ")]
    assert gathers[0] and not any(gathers[1:]) and len(gathers) > 1


def test_the_timeline_prices_each_collective_by_whether_the_host_waits():
    """Every collective of the simulated tp and dp programs lasts what cluster_collective_time_s gives for its
    ``host_waits``; with a curve far below the fit the waited-for ones get shorter, the asynchronous ones not."""
    graph, plans, programs = _programs()
    flat = CollectivePoints(tuple(((4, n, k), CollectiveCurve(((4096, 10.0),)))
                                  for n in (2, 4) for k in ("all_reduce", "all_gather")))
    for name in ("tp", "dp"):
        plan_mesh = programs[name].mesh_shape
        durations = []
        for cluster in (cpu4(CollectivePoints()), cpu4(flat)):
            timeline = simulate(programs[name], graph, plans[name], cluster)
            for t in timeline.tasks:
                if t.task.is_collective:
                    want = cluster_collective_time_s(t.task.collective, t.task.nbytes, plan_mesh, t.task.axis,
                                                     cluster, host_waits=t.task.host_waits)
                    assert t.duration_s == pytest.approx(want)
            durations.append([(t.task.host_waits, t.duration_s) for t in timeline.tasks if t.task.is_collective])
        for (waits, fitted_s), (_, curve_s) in zip(*durations):
            assert curve_s < fitted_s if waits else curve_s == pytest.approx(fitted_s)
        waited = [t for t in programs[name].tasks if t.is_collective and t.host_waits]
        assert bool(waited) == (name == "tp")



def _all_reduce_timings(nproc: int, groups: tuple[int, ...], a_s: float, b: float):
    """Ring all-reduce times of latency ``a_s`` and bandwidth ``b`` on each group size, at the quick sizes."""
    from executor.calibrate import CollectiveTiming, Settings
    return tuple(CollectiveTiming("all_reduce", n, m, 2 * (n - 1) / n * m / b + 2 * (n - 1) * a_s, "synthetic")
                 for n in groups for m in Settings.default(nproc, quick=True).message_bytes)


@pytest.mark.parametrize("nproc", [2, 4])
def test_calibrate_only_writes_the_curves_of_its_ranks_and_keeps_the_fits_when_they_share_cores(tmp_path, nproc):
    """--only all_reduce on 2 ranks (the base's cores): the fit is replaced and the ranks_2 curves written; on
    4 ranks (2 per core): only the ranks_4 curves, the fits kept (they price the asynchronous collectives,
    scaled by the time-sharing); either way the base's curves of other rank counts stay."""
    from autoddl.calibration import calibrate_cluster
    from executor.calibrate import Measurements, Settings

    old = CollectivePoints((((8, 2, "broadcast"), CollectiveCurve(((4096, 9.0),))),))
    base = dataclasses.replace(Cluster.from_yaml(CPU_CLUSTER_PATH), cores_per_node=2, collective_points=old)
    groups = (2, 4) if nproc == 4 else (2,)
    meas = Measurements(settings=Settings.default(nproc, quick=True, kinds=("all_reduce",), comm_only=True),
                        matmuls=(), memory_gbps={}, dispatch_us=0.0, tiny_op_us=0.0,
                        collectives=_all_reduce_timings(nproc, groups, 300e-6, 2e9), seconds={"total": 1.0},
                        machine="test")
    cal = calibrate_cluster(meas, base, command=f"autoddl calibrate --nproc {nproc} --only all_reduce")
    curves = cal.cluster.collective_points
    assert curves.get(8, 2, "broadcast") == old.get(8, 2, "broadcast")
    for n in groups:
        first = curves.get(nproc, n, "all_reduce").points[0]
        assert first == (4096, round((2 * (n - 1) / n * 4096 / 2e9 + 2 * (n - 1) * 300e-6) * 1e6, 1))
    if nproc == 4:
        assert cal.cluster.collectives == base.collectives
    else:
        assert cal.cluster.collectives.all_reduce == LinkSpec(2.0, 300.0)
    out = tmp_path / "c.yaml"
    cal.write(out)
    assert Cluster.from_yaml(out) == cal.cluster
    assert f"  ranks_{nproc}:  # measured " in out.read_text()
