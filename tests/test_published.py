"""benchmarks/published.py prices TorchTitan's jobs on the hardware TorchTitan describes, at both ends of the
peak its benchmark's footnote gives ("between SXM and NVL"): the clusters it builds and what they change."""

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from autoddl.cluster import Cluster  # noqa: E402
from costmodel.compute import optimizer_time_s, roofline_time_s  # noqa: E402
from published import JOBS, NVL_PEAKS_TFLOPS, TITAN_HARDWARE, job_clusters  # noqa: E402


def test_torchtitan_jobs_are_priced_on_three_clusters_and_the_others_on_their_own():
    titan = [j for j in JOBS if j.get("titan_hardware")]
    assert {j["cluster"] for j in titan} == {"h100-4x8"} and len(titan) == 6
    job = next(j for j in titan if j["job"] == "llama3-8b seq 8192")
    labels = [label for label, _ in job_clusters(job)]
    assert labels == ["h100-4x8", "h100-96gb-500w", "h100-96gb-500w nvl-peak"]
    a100 = next(j for j in JOBS if j["cluster"] == "dgx-a100-8")
    assert [label for label, _ in job_clusters(a100)] == ["dgx-a100-8"]


def test_the_nvl_end_changes_only_the_peaks():
    """The NVL end is the same file with the H100 NVL datasheet's peaks: memory, links, efficiencies kept."""
    job = next(j for j in JOBS if j["job"] == "llama3.1-70b fsdp x tp")          # 256 devices: 32 nodes of 8
    (_, dgx), (_, sxm), (_, nvl) = job_clusters(job)
    assert sxm.num_devices == nvl.num_devices == dgx.num_devices == 256
    assert sxm.device.peaks == {"float32": 67, "bfloat16": 989, "float16": 989} == dgx.device.peaks
    assert nvl.device.peaks == NVL_PEAKS_TFLOPS == {"float32": 60, "bfloat16": 835.5, "float16": 835.5}
    assert (sxm.device.memory_gb, sxm.device.memory_bandwidth_gbps) == (96, 2400)
    assert dataclasses.replace(nvl, device=sxm.device) == sxm
    assert sxm.name == nvl.name == f"{TITAN_HARDWARE}@256"


def test_what_the_torchtitan_hardware_changes_in_a_price():
    """A compute-bound product is 989 / 835.5 slower at the NVL end; a memory-bound pass 3350 / 2400 slower on
    HBM2e than on the DGX's HBM3; AdamW, with no measured step in the file, is its bytes at HBM2e's bandwidth."""
    dgx = Cluster.from_yaml(ROOT / "configs" / "h100-4x8.yaml")
    job = next(j for j in JOBS if j["job"] == "llama3-8b seq 8192")
    (_, _), (_, sxm), (_, nvl) = job_clusters(job)
    flops = 2 * 8192 * 4096 * 4096
    assert roofline_time_s(flops, 0, sxm, dtype="bfloat16") == pytest.approx(flops / (989e12 * 0.693))
    assert roofline_time_s(flops, 0, nvl, dtype="bfloat16") / roofline_time_s(flops, 0, sxm, dtype="bfloat16") \
        == pytest.approx(989 / 835.5)
    nbytes = 1 << 30
    assert roofline_time_s(0, nbytes, sxm) == pytest.approx(nbytes / (2400e9 * 0.884))
    assert roofline_time_s(0, nbytes, sxm) / roofline_time_s(0, nbytes, dgx) == pytest.approx(3350 / 2400)
    numel = 1e9                                          # float32 masters: 6 x 4 + 56 = 80 bytes per element
    assert optimizer_time_s(4 * numel, numel, "adamw", sxm) == pytest.approx(80 * numel / (2400e9 * 0.884))
    assert optimizer_time_s(4 * numel, numel, "adamw", dgx) == pytest.approx(numel * 0.0306e-9)   # measured step
