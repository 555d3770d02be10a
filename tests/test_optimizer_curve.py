"""The optimizer step priced from its measured curve (``executor.optimizer_ns``): the fit
(executor/calibrate_optimizer.py), the cluster file's field (autoddl/cluster.py) and the price
(costmodel/compute.py ``optimizer_time_s``), each against values worked by hand."""

import dataclasses
import math

import pytest
import torch
import yaml

from autoddl.cluster import Cluster, ClusterConfigError, ExecutorOverheads
from costmodel.compute import optimizer_bytes, optimizer_time_s
from executor.calibrate_optimizer import fit_optimizer_ns, time_optimizer_steps
from tests.clusters import CPU_CLUSTER_PATH

CURVE = {"adamw": ((1000.0, 2.0), (100000.0, 4.0)), "sgd": ((1000.0, 0.5),)}


def test_fit_is_the_time_per_element_beyond_the_smallest_size():
    # 2 us at 10 elements, 3 us at 110: 1 us over 100 elements = 10 ns; 12 us at 1010: 10 us over 1000 = 10 ns again;
    # 1.5 us at 2010 is faster than the smallest: noise, left out
    assert fit_optimizer_ns((10, 110, 1010), (2e-6, 3e-6, 12e-6)) == ((110, 10.0), (1010, 10.0))
    assert fit_optimizer_ns((10, 2010), (2e-6, 1.5e-6)) == ()
    with pytest.raises(ValueError, match="one time per size"):
        fit_optimizer_ns((10, 110), (2e-6,))


def test_timed_steps_are_one_per_size_for_each_optimizer():
    torch.manual_seed(0)
    timed = time_optimizer_steps(torch, lambda: None, repeats=1, numels=(1024, 4096))
    assert set(timed) == {"sgd", "adamw"}
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in timed.values())


def test_curve_is_linear_in_log_numel_and_flat_past_its_ends():
    ex = ExecutorOverheads(optimizer_ns=CURVE)
    assert ex.optimizer_ns_per_element("adamw", 10000) == pytest.approx(3.0)      # halfway in log: 2 + 2 / 2
    assert ex.optimizer_ns_per_element("adamw", 10) == 2.0
    assert ex.optimizer_ns_per_element("adamw", 1e9) == 4.0
    assert ex.optimizer_ns_per_element("sgd", 1e6) == 0.5
    assert ExecutorOverheads().optimizer_ns_per_element("adamw", 1e6) is None


def test_price_is_the_curve_scaled_to_the_parameters_dtype_and_slowed_by_time_sharing():
    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    cluster = dataclasses.replace(base, executor=dataclasses.replace(base.executor, optimizer_ns=CURVE))
    n = 10000
    assert optimizer_time_s(4.0 * n, n, "adamw", cluster) == pytest.approx(n * 3.0e-9)            # 30 us
    # bfloat16 parameters: AdamW moves 6 x 2 + 56 = 68 bytes per element against float32's 80
    assert optimizer_time_s(2.0 * n, n, "adamw", cluster) == pytest.approx(n * 3.0e-9 * 68 / 80)
    sharing = cluster.time_sharing((4,))
    assert sharing == 2.0                                       # 4 ranks on the file's 2 cores
    assert optimizer_time_s(4.0 * n, n, "adam", cluster, (4,)) == pytest.approx(2 * n * 3.0e-9)
    # without the curve: the bytes at the memory bandwidth
    assert optimizer_time_s(4.0 * n, n, "adamw", base) == pytest.approx(
        80 * n / (base.device.memory_bandwidth_gbps * 1e9 * base.efficiency.memory))
    assert optimizer_bytes(4.0 * n, n, "adamw") == 80 * n


def test_cluster_file_round_trips_the_curve_and_names_a_bad_one(tmp_path):
    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    cluster = dataclasses.replace(base, executor=dataclasses.replace(base.executor, optimizer_ns=CURVE))
    path = tmp_path / "c.yaml"
    cluster.to_yaml(path)
    assert Cluster.from_yaml(path).executor.optimizer_ns == CURVE
    data = yaml.safe_load(path.read_text())
    data["executor"]["optimizer_ns"] = {"adam": [[1, 2]], "sgd": [[5, 1], [4, 1]]}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ClusterConfigError) as err:
        Cluster.from_yaml(path)
    assert "executor.optimizer_ns.adam: unknown key; did you mean 'adamw'?" in str(err.value)
    assert "executor.optimizer_ns.sgd[1][0]: numel must increase strictly" in str(err.value)
    assert not math.isnan(base.device.memory_bandwidth_gbps)
