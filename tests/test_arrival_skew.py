"""Ranks that compute apart meet late at a collective (``executor.arrival_skew_us``): the measurement's
reduction and fit (executor/calibrate_skew.py), the cluster file's field and the simulator's rule
(costmodel/simulate.py), each against values worked by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from autoddl.cluster import Cluster, ClusterConfigError, ExecutorOverheads, arrival_skew_x
from autoddl.collective_kinds import CollectiveKind
from autoddl.machine import usable_cores
from autoddl.program import COMPUTE, StepProgram, Task, comm_stream
from costmodel.compute import op_forward_time_s
from costmodel.simulate import simulate
from executor.calibrate import Settings, ranks_per_core
from executor.calibrate_skew import fit_skew_us, skew_points
from test_collective_cpu import NBYTES, _all_reduce_s, cpu2, one_matmul
from clusters import CPU_CLUSTER_PATH


def test_points_are_the_slowest_ranks_return_beyond_the_priced_compute_less_the_bare_all_reduce():
    # two ranks, two repetitions of one compute time; each rank's compute is its CPU time (no pauses)
    ranks = [{"bare": [1e-3, 3e-3], "rows": [[(0.010, 0.013), (0.010, 0.016)]]},
             {"bare": [2e-3, 1e-3], "rows": [[(0.011, 0.012), (0.012, 0.014)]]}]
    # bare: max per repetition 2 and 3 ms, median 2.5 ms; compute as priced: the median of 10, 10, 11,
    # 12 ms = 10.5; to the return: max 13 and 16 ms, median 14.5; less 10.5 and 2.5: 1.5 ms
    ((compute, extra),) = skew_points(ranks)
    assert compute == pytest.approx(0.0105) and extra == pytest.approx(1.5e-3)
    # 4 ranks on 2 cores: each rank's work takes twice its CPU time as priced (Cluster.time_sharing)
    ranks4 = [{"bare": [1e-3], "rows": [[(0.005, 0.013)]]} for _ in range(4)]
    ((compute, extra),) = skew_points(ranks4, ranks_per_core=2.0)
    assert compute == pytest.approx(0.010) and extra == pytest.approx(0.013 - 0.010 - 0.001)
    assert skew_points(ranks4, ranks_per_core=0.5) == skew_points(ranks4)     # fewer ranks than cores: x1


def test_the_calibrations_ranks_per_core():
    two = Settings.default(2, "gloo", quick=True, threads=1)
    assert ranks_per_core(two) == max(1.0, 2 / usable_cores())
    assert ranks_per_core(Settings.default(4, "gloo", quick=True, threads=1)) == max(1.0, 4 / usable_cores())
    # as the file's cores_per_node counts them: whole ranks of 2 threads on the cores (at least one)
    two_threads = Settings.default(2, "gloo", quick=True, threads=2)
    assert ranks_per_core(two_threads) == max(1.0, 2 / max(1, usable_cores() // 2))
    assert ranks_per_core(dataclasses.replace(two, backend="nccl")) == 1.0


def test_fit_is_the_slope_against_sqrt_compute_with_the_intercept_taken_out():
    k_us = 700.0
    points = [(c_ms * 1e-3, 0.3e-3 + k_us * 1e-6 * arrival_skew_x(c_ms * 1e-3)) for c_ms in (0.5, 8.0, 32.0)]
    assert fit_skew_us(points) == pytest.approx(k_us)
    assert arrival_skew_x(8e-3) == pytest.approx(math.sqrt(8) - math.sqrt(0.5))
    assert arrival_skew_x(0.2e-3) == 0.0
    assert fit_skew_us([(1e-3, 5e-3), (9e-3, 1e-3)]) == 0.0           # a falling line: no skew
    with pytest.raises(ValueError, match="at least two"):
        fit_skew_us([(1e-3, 1e-3)])


def test_skew_of_the_ranks_measured_at_or_below_the_meshs():
    ex = ExecutorOverheads(arrival_skew_us={2: 800.0, 4: 1200.0})
    c = 8e-3
    assert ex.arrival_skew_s(2, c) == pytest.approx(800e-6 * (math.sqrt(8) - math.sqrt(0.5)))
    assert ex.arrival_skew_s(3, c) == ex.arrival_skew_s(2, c)
    assert ex.arrival_skew_s(8, c) == pytest.approx(1200e-6 * (math.sqrt(8) - math.sqrt(0.5)))
    assert ex.arrival_skew_s(1, c) == 0.0 and ExecutorOverheads().arrival_skew_s(2, c) == 0.0


def test_a_collective_after_compute_starts_the_skew_later_counted_from_where_the_ranks_last_met():
    """matmul (c), its all-reduce (d), a matmul waiting for it, a second all-reduce: each all-reduce
    starts k (sqrt(c ms) - sqrt(0.5)) after its matmul, the second's compute counted from the first's
    end (where the ranks met), so step = 2 c + 2 skew(c) + 2 d."""
    graph, plan, node = one_matmul()
    base = cpu2(0.0)
    cluster = dataclasses.replace(base, executor=dataclasses.replace(base.executor, arrival_skew_us={2: 800.0}))
    tasks = [Task(0, "forward", COMPUTE, (), op=node.name),
             Task(1, "grad_sync", comm_stream(0), (0,), collective=CollectiveKind.ALL_REDUCE, axis=0, nbytes=NBYTES),
             Task(2, "forward", COMPUTE, (1,), op=node.name),
             Task(3, "grad_sync", comm_stream(0), (2,), collective=CollectiveKind.ALL_REDUCE, axis=0, nbytes=NBYTES)]
    program = StepProgram("b", (2,), tasks)
    c, d = op_forward_time_s(node, plan.signatures[node.name], (2,), cluster), _all_reduce_s(cluster, NBYTES)
    skew = 800e-6 * (math.sqrt(c * 1e3) - math.sqrt(0.5))
    assert skew > 0.1 * c                   # a real share of the step
    timeline = simulate(program, graph, plan, cluster)
    assert [t.start_s for t in timeline.tasks] == pytest.approx([0, c + skew, c + skew + d, 2 * c + 2 * skew + d])
    assert timeline.step_time_s == pytest.approx(2 * c + 2 * skew + 2 * d, rel=1e-9)
    assert simulate(program, graph, plan, base).step_time_s == pytest.approx(2 * c + 2 * d, rel=1e-9)


def test_cluster_file_round_trips_the_skew_and_names_a_bad_key(tmp_path):
    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    cluster = dataclasses.replace(base, executor=dataclasses.replace(base.executor,
                                                                     arrival_skew_us={4: 1200.0, 2: 800.0}))
    path = tmp_path / "c.yaml"
    cluster.to_yaml(path, comments={"executor.arrival_skew_us.ranks_2": "measured"})
    assert "ranks_2: 800  # measured" in path.read_text()
    assert Cluster.from_yaml(path).executor.arrival_skew_us == {2: 800.0, 4: 1200.0}
    data = yaml.safe_load(path.read_text())
    data["executor"]["arrival_skew_us"] = {"two": 1.0, "ranks_4": -1}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ClusterConfigError) as err:
        Cluster.from_yaml(path)
    assert "executor.arrival_skew_us.two: expected a key ranks_N" in str(err.value)
    assert "executor.arrival_skew_us.ranks_4: expected a non-negative number" in str(err.value)
