"""autoddl/machine.py: a CPU cluster file says which machine it measured, and a run on another says so."""

from __future__ import annotations

import dataclasses

import pytest

from autoddl.calibration import calibrate_cluster
from autoddl.cluster import Cluster, ClusterConfigError
from autoddl.machine import calibrated_elsewhere, fingerprint, require_calibrated_here, this_machine
from autoddl.runs import load_cluster
from tests.test_calibrate import GLOO_FORMULA, base_cluster, synthetic_measurements
from clusters import CPU_CLUSTER_PATH

ZEN5 = {"model name": "AMD EPYC", "cpu family": "26", "model": "2",
        "flags": "fpu sse avx2 fma avx512f avx512_bf16 avx512vl"}
OLDER = {"model name": "AMD EPYC", "cpu family": "25", "model": "1", "flags": "fpu sse avx2 fma"}


def test_fingerprint_names_the_processor_its_vector_isa_cores_and_torch():
    assert fingerprint(ZEN5, 2, "2.13.0+cpu") == (
        "AMD EPYC (family 26, model 2; avx2 fma avx512f avx512_bf16), 2 cores, torch 2.13.0+cpu")
    # the same name without bfloat16 instructions is another machine (bfloat16 matmuls 8x slower)
    assert fingerprint(OLDER, 1, "2.13.0+cpu") == "AMD EPYC (family 25, model 1; avx2 fma), 1 core, torch 2.13.0+cpu"
    assert this_machine().endswith(f"torch {__import__('torch').__version__}")


def _cpu_file(tmp_path, calibrated_on: str | None) -> Cluster:
    c = dataclasses.replace(Cluster.from_yaml(CPU_CLUSTER_PATH), calibrated_on=calibrated_on)
    path = tmp_path / "cpu.yaml"
    c.to_yaml(path)
    return Cluster.from_yaml(path)


def test_another_machines_file_is_named_with_both_machines_and_the_command(tmp_path):
    here, there = fingerprint(ZEN5, 2, "2.13.0+cpu"), fingerprint(OLDER, 2, "2.13.0+cpu")
    c = _cpu_file(tmp_path, there)
    assert c.calibrated_on == there                   # written and read back
    why = calibrated_elsewhere(c, here)
    assert why == (f"{c.source} was calibrated on {there}; this machine is {here}: its predictions describe the "
                   f"other machine. Calibrate this one: autoddl calibrate --base {c.source} --out {c.source}, then "
                   f"autoddl calibrate --only collective_cpu --base {c.source} --out {c.source}")
    assert calibrated_elsewhere(c, there) is None
    assert calibrated_elsewhere(_cpu_file(tmp_path, None), here) is None        # a file that does not say
    gpu = dataclasses.replace(Cluster.from_yaml("configs/h100-4x8.yaml"), calibrated_on=there)
    assert calibrated_elsewhere(gpu, here) is None                               # only CPU files describe the host


def test_benchmarks_stop_on_another_machines_file_unless_told(tmp_path, capsys):
    c = _cpu_file(tmp_path, fingerprint(OLDER, 64, "0.0"))
    with pytest.raises(SystemExit, match="was calibrated on AMD EPYC .*; or pass --other-machine"):
        require_calibrated_here(c.source)
    require_calibrated_here(c.source, allow_other=True)
    assert "note: " in capsys.readouterr().out
    require_calibrated_here(_cpu_file(tmp_path, this_machine()).source)          # this machine's: no word


def test_a_run_notes_another_machines_file(tmp_path):
    from autoddl.plan import Mesh, Plan

    c = _cpu_file(tmp_path, fingerprint(OLDER, 64, "0.0"))
    plan = Plan(name="dp", mesh=Mesh((2,)), signatures={}, param_storage={}, graph_hash="", cluster_file=c.source)
    cluster, note = load_cluster(plan, None, "gloo")
    assert cluster is not None and note.startswith(f"note: {c.source} was calibrated on AMD EPYC (family 25")


def test_bad_calibrated_on_names_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(open(CPU_CLUSTER_PATH).read() + "calibrated_on: 3\n")
    with pytest.raises(ClusterConfigError, match=r"calibrated_on: 3 is not a machine description"):
        Cluster.from_yaml(path)


def test_calibration_writes_this_machine_into_a_cpu_file(tmp_path):
    agree = {k: (50e-6, 1.2e9) for k in GLOO_FORMULA}
    base = dataclasses.replace(base_cluster(), calibrated_on="somewhere else")
    cal = calibrate_cluster(synthetic_measurements(agree), base, command="x")
    assert cal.cluster.calibrated_on == this_machine()
    out = tmp_path / "cal.yaml"
    cal.write(out)
    assert Cluster.from_yaml(out).calibrated_on == this_machine()
    assert "calibrated_on: " in out.read_text() and "# the machine measured" in out.read_text()
