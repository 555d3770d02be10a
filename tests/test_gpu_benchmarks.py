"""The GPU component benchmark runs (shrunken, on CPU) and its comparison reads a cluster file right.

benchmarks/gpu_components.py measures on a GPU what the GPU cluster files assume; CI has no GPU, so
its ``--smoke`` shapes are run here and each row's rate is checked against its own FLOPs, bytes and
median. benchmarks/gpu_model_check.py puts a measured rate beside the cluster's efficiency: checked
on hand-made rows against the H100 file's peaks.
"""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from autoddl.cluster import Cluster  # noqa: E402
from gpu_model_check import efficiency_rows, launch_rows, optimizer_rows  # noqa: E402


def test_smoke_run_writes_every_row_with_its_rate(tmp_path):
    """matmul / memory / launch sections on CPU: one row each, TFLOP/s = flops / median, GB/s = bytes / median."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_components.py"), "--out", str(tmp_path),
                          "--smoke", "--only", "matmul", "memory", "launch"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "gpu_components.csv")
    matmuls = rows[rows.section == "matmul"]
    # squares 64 and 128 in bf16, fp16, fp32; 8 linears x 3 products
    assert len(matmuls) == 6 + 8 * 3
    assert (matmuls.median_us > 0).all()
    assert matmuls.tflops.to_numpy() == pytest.approx(
        (matmuls.flops / (matmuls.median_us / 1e6) / 1e12).round(2).to_numpy(), abs=0.006)
    square = matmuls[matmuls.name == "square 128"].iloc[0]
    assert square.flops == 2 * 128 ** 3
    memory = rows[rows.section == "memory"].set_index("name")
    n = 1 << 20
    assert memory.loc["copy", "bytes"] == 2 * 4 * n and memory.loc["add a+b->c", "bytes"] == 3 * 4 * n
    assert memory.gbps.to_numpy() == pytest.approx(
        (memory.bytes / (memory.median_us / 1e6) / 1e9).round(1).to_numpy(), abs=0.06)
    assert set(rows[rows.section == "launch"].name) == {"tiny add_ back to back", "autograd chain forward+backward"}
    assert (tmp_path / "gpu_device.json").exists()


def test_measured_rates_are_read_as_fractions_of_the_clusters_peaks():
    """A 494.5 TFLOPS bf16 product is 0.5 of the H100's 989, beside the file's compute efficiency; an
    attention row beside ``efficiency.attention``; 1675 GB/s beside ``efficiency.memory``; the per-op
    cost beside 2 x ``op_overhead_us``."""
    h100 = Cluster.from_yaml(ROOT / "configs" / "h100-4x8.yaml")
    measured = pd.DataFrame([
        {"section": "matmul", "name": "square 8192", "dtype": "bfloat16", "shape": "8192x8192x8192",
         "flops": 2 * 8192 ** 3, "samples": 15, "tflops": 494.5, "gbps": None, "median_us": 1.0},
        {"section": "matmul", "name": "square 4096", "dtype": "float32", "shape": "4096x4096x4096",
         "flops": 2 * 4096 ** 3, "samples": 15, "tflops": 33.5, "gbps": None, "median_us": 1.0},
        {"section": "attention", "name": "sdpa flash causal forward+backward", "dtype": "bfloat16",
         "shape": "1x32x8192x128", "flops": 1.0, "samples": 11, "tflops": 197.8, "gbps": None, "median_us": 1.0},
        {"section": "memory", "name": "copy", "dtype": "float32", "shape": "1", "flops": None, "samples": 21,
         "tflops": None, "gbps": 1675.0, "median_us": 1.0},
        {"section": "launch", "name": "autograd chain forward+backward", "dtype": "float32", "shape": "256",
         "flops": None, "samples": 11, "tflops": None, "gbps": None, "median_us": 41.1},
    ])
    rows = {r["name"]: r for r in efficiency_rows(measured, h100) + launch_rows(measured, h100)}
    eff = h100.efficiency
    assert rows["square 8192"]["measured"] == pytest.approx(0.5, abs=1e-3)
    assert rows["square 8192"]["predicted"] == pytest.approx(eff.compute, abs=1e-3)
    assert rows["square 8192"]["measured_over_predicted"] == pytest.approx(0.5 / eff.compute, abs=2e-3)
    assert rows["square 4096"]["measured"] == pytest.approx(0.5, abs=1e-3)          # of the fp32 peak, 67
    assert rows["sdpa flash causal forward+backward"]["measured"] == pytest.approx(0.2, abs=1e-3)
    assert rows["sdpa flash causal forward+backward"]["predicted"] == pytest.approx(eff.attention, abs=1e-3)
    assert rows["copy"]["measured"] == pytest.approx(0.5, abs=1e-3)
    assert rows["copy"]["predicted"] == pytest.approx(eff.memory, abs=1e-3)
    launch = rows["autograd chain forward+backward"]
    assert (launch["measured"], launch["predicted"]) == pytest.approx((41.1, 2 * h100.op_overhead_us))
    assert launch["measured_over_predicted"] == pytest.approx(41.1 / (2 * h100.op_overhead_us), abs=1e-3)


def test_optimizer_row_prices_the_h100_files_measured_adamw_step():
    """The H100 file carries AdamW (foreach) as measured there, 0.0306 ns per float32 element
    (``executor.optimizer_ns``): 1e9 parameters are predicted 30.6 ms, beside a 30.634 ms measurement."""
    h100 = Cluster.from_yaml(ROOT / "configs" / "h100-4x8.yaml")
    assert h100.executor.optimizer_ns_per_element("adamw", 1e9) == pytest.approx(0.0306)
    assert h100.executor.optimizer_ns_per_element("adamw", 1e6) == pytest.approx(0.0306)   # flat: one point
    measured = pd.DataFrame([{"section": "optimizer", "name": "adamw foreach", "dtype": "float32",
                              "shape": "32x31250000", "samples": 7, "median_us": 30634.0}])
    (row,) = optimizer_rows(measured, h100)
    assert (row["measured"], row["predicted"]) == pytest.approx((30.634, 30.6))
    assert row["measured_over_predicted"] == pytest.approx(30.634 / 30.6, abs=1e-3)
