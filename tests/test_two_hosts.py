"""Two hosts in network namespaces (benchmarks/two_hosts.py): one data-parallel plan checked across them.

Needs root and iproute2 (network namespaces, tc); skipped with the testbed's own reason elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "two_hosts.py"


def _unavailable() -> str | None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--check-only"], capture_output=True, text=True, timeout=30)
    if res.returncode == 0:
        return None
    return (res.stderr or res.stdout).strip() or f"two_hosts.py --check-only exited {res.returncode}"


def _our_namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith("a2h-")}


@pytest.mark.distributed
def test_dp_plan_checks_across_two_namespaced_hosts(tmp_path):
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    before = _our_namespaces()
    plan, result = tmp_path / "dp4.json", tmp_path / "result.json"
    made = subprocess.run([sys.executable, "-m", "autoddl", "plan", "examples/gpt.py", "--preset", "tiny",
                           "--cluster", str(CPU_CLUSTER_PATH), "--devices", "4", "--scheme", "dp",
                           "--out", str(plan)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stdout + made.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1")      # 4 ranks on this machine's cores
    run = subprocess.run([sys.executable, str(SCRIPT), "--timeout-s", "90", "--", "-m", "executor.worker",
                          "--plan", str(plan), "--model", "examples/gpt.py", "--set", "preset=tiny", "--check",
                          "--steps", "1", "--pg-timeout-s", "60", "--out", str(result)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert "tbf 1000 Mbit/s each direction" in log and "inside a host: lo, unshaped" in log
    out = json.loads(result.read_text())
    assert (out["plan"], out["world_size"], out["mesh"]) == ("dp", 4, [4])
    assert out["check"]["ok"] is True and out["check"]["rtol"] == 1e-4
    assert max(out["check"]["max_rel_error"].values()) <= 1e-4
    assert out["hosts"] == ["host0", "host0", "host1", "host1"]      # node rank 0 holds ranks 0-1
    assert out["collectives_summary"]["grad_sync/all_reduce/axis0"]["count"] > 0
    assert _our_namespaces() <= before, f"namespaces left behind: {_our_namespaces() - before}"


# -- the across-hosts fit, on synthetic timings (no testbed needed) ----------------------------------
def _ring_s(kind: str, m: float, n: int, b: float, a: float) -> float:
    """Gloo's formulas of the cost model (DESIGN.md "Cost model"): reduce-scatter runs as an all-reduce."""
    ar, ag = 2 * (n - 1) / n * m / b + 2 * (n - 1) * a, (n - 1) / n * m / b + (n - 1) * a
    return {"all_reduce": ar, "reduce_scatter": ar, "all_gather": ag,
            "all_to_all": (n - 1) / n * (m / n) / b + (n - 1) * a,
            "broadcast": m / b + (n - 1) * a}[kind]


def test_host_groups_and_two_hosts_cluster_recover_both_links(tmp_path, monkeypatch):
    from autoddl.calibration import fit_collectives
    from autoddl.cluster import CONFIG_DIR, Cluster
    from executor.calibrate import CollectiveTiming, Settings
    from executor.calibrate_hosts import (CHECK_BYTES, HOST_PATHS, HostTimings,
                                    fit_host_paths, host_groups, two_hosts_cluster)

    assert host_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert host_groups(6, 2) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])
    with pytest.raises(ValueError, match="not 2 or more whole hosts"):
        host_groups(4, 4)
    links = {"intra_host": (400e-6, 0.5e9), "inter_host": (300e-6, 0.0625e9), "inter_host_alone": (80e-6, 0.125e9),
             "world": (500e-6, 0.05e9)}
    settings = Settings.default(4, quick=True, threads=1)
    paths = {p: tuple(CollectiveTiming(k, 4 if p == "world" else 2, m,
                                       _ring_s(k, m, 4 if p == "world" else 2, b, a), "synthetic") for k in
                      (("all_reduce", "all_gather") if p == "inter_host_alone" else
                       ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"))
                      for m in settings.message_bytes) for p, (a, b) in links.items()}
    measured = {"inter_host_alone": 0.070, "inter_host": 0.130, "world": 0.105}     # seconds, 8 MB all-reduce
    ht = HostTimings(settings, 2, 2, paths, measured, {"rate_mbit": 1000.0, "delay_ms": 0.0}, "test", 1.0)
    fits = fit_host_paths(ht, fit_collectives)
    assert set(fits) == set(HOST_PATHS) and set(fits["inter_host_alone"]) == {"all_reduce", "all_gather"}
    from autoddl.collective_points import CollectiveCurve, CollectivePoints
    one_host = CollectivePoints((((4, 4, "all_reduce"), CollectiveCurve(((4096, 5000.0),))),))   # timed on one host
    base = dataclasses.replace(Cluster.from_yaml(CPU_CLUSTER_PATH), collective_points=one_host)
    cluster, comments, header = two_hosts_cluster(ht, fits, base)
    assert (cluster.name, cluster.nodes, cluster.devices_per_node, cluster.num_devices) == ("two-hosts", 2, 2, 4)
    assert (cluster.intra_node.latency_us, cluster.intra_node.bandwidth_gbps) == pytest.approx((400, 0.5))
    assert (cluster.inter_node.latency_us, cluster.inter_node.bandwidth_gbps) == pytest.approx((300, 0.0625))
    assert not cluster.collectives.get("all_reduce")                 # every intra kind agrees with the link
    # 8 MB all-reduce of one pair alone: 2 * 80 us + 8e6 B / 0.125 GB/s = 64.16 ms, measured 70 ms
    assert "one pair alone on the link: measured 70.0 ms, alpha-beta 64.2 ms (-8%), link rate alone 64.0 ms" in header
    # the inter-host fit ran 2 pairs at once on the hosts' one link: written as shared, 2 flows measured
    assert (cluster.inter_node.shared_by_node, cluster.inter_node.measured_flows) == (True, 2)
    assert "2 groups (one rank per host each) at once" in comments["links.inter_node.measured_flows"]
    # one pair alone reached 0.125 GB/s: no flow is priced faster (here the wire's two-flow share is the same)
    assert cluster.inter_node.flow_bandwidth_gbps == pytest.approx(0.125)
    assert "inter_host_alone's all_reduce" in comments["links.inter_node.flow_bandwidth_gbps"]
    assert cluster.intra_node.cpu_ns_per_byte == Cluster.from_yaml(CPU_CLUSTER_PATH).intra_node.cpu_ns_per_byte
    # 2 pairs at once, 2 flows as fitted: 2 * 300 us + 8e6 B / 0.0625 GB/s = 128.6 ms, measured 130 ms
    assert "2 pairs at once (links.inter_node, 2 flows of 2): measured 130.0 ms, alpha-beta 128.6 ms (-1%)" in header
    # all 4 ranks, one ring: 1 flow, twice the fitted bandwidth: 6 * 300 us + 1.5 * 8e6 B / 0.125 GB/s = 97.8 ms
    assert ("all 4 ranks (links.inter_node, n = 4, one ring: 1 flow of 2): measured 105.0 ms, alpha-beta 97.8 ms "
            "(-7%)") in header
    assert f"{CHECK_BYTES / 1e6:g} MB" in header and "tbf 1000 Mbit/s" in header and "R^2 1.0000" in header
    # what every rank busy timed: each host's own pairs (group_2) and all 4 ranks across the hosts (group_4),
    # under ranks_2 (per host), the synthetic times themselves; nothing inherited from the base's curves
    points = cluster.collective_points
    assert {k for k, _ in points.curves} == {(2, n, kind) for n in (2, 4) for kind in
                                              ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    m = settings.message_bytes[1]
    assert points.get(2, 4, "all_gather").time_s(m) == pytest.approx(_ring_s("all_gather", m, 4, 0.05e9, 500e-6),
                                                                        abs=1e-7)
    assert points.get(2, 2, "all_reduce").time_s(m) == pytest.approx(_ring_s("all_reduce", m, 2, 0.5e9, 400e-6),
                                                                        abs=1e-7)
    assert "group_4: every rank, across the hosts" in comments["collective_points.ranks_2"]
    cluster.to_yaml(tmp_path / "two.yaml", comments=comments, header=header)
    assert Cluster.from_yaml(tmp_path / "two.yaml") == cluster
    # the fields taken from the base keep the base's comments (their sources); the measured ones are the fit's
    from executor.calibrate_hosts import _base_comments
    kept = _base_comments(str(CPU_CLUSTER_PATH))
    assert kept["device.peak_tflops.float32"].startswith("measured: best float32 matmul rate")
    assert "executor.op_us" in kept and not [k for k in kept if k.startswith(("links", "collectives", "nodes"))]


# -- the link's CPU per byte across the hosts (calibrate --across-hosts --only collective_cpu) -----------
def test_collective_cpu_across_hosts_writes_the_inter_node_cost_over_base(tmp_path, monkeypatch, capsys):
    """The CLI in a torchrun rank of the testbed, the measurement replaced by synthetic timings (process
    CPU 2.5, 3, 1 ms per 8 all-reduces of 1 MB on the pairs across hosts: median 2.5 / 8 ms; each rank
    sends 1 MB: 0.3125 ns per byte; the compute lost beside matmuls, 5 / 8 ms, is the cross-check): rank 0
    writes --base with links.inter_node.cpu_ns_per_byte and a comment naming the testbed command and
    its rate, every other field, comment and the header as they were; another rank writes nothing; a
    launch outside torchrun and --only with another kind are refused by name."""
    from autoddl.cli import main
    from autoddl.cluster import CONFIG_DIR, Cluster, yaml_comments
    from executor import calibrate_overlap
    from executor.calibrate_overlap import OverlapResult, OverlapTiming, median_cpu_s, median_lost_s

    timings = (OverlapTiming(0.040, 0.010, 0.045, 0.0025), OverlapTiming(0.040, 0.008, 0.046, 0.003),
               OverlapTiming(0.04, 0.01, 0.0425, 0.001))
    path = "2 hosts x 2 ranks, the all-reduces on the 2 inter-host groups [[0, 2], [1, 3]] across the tbf 10000 Mbit/s link"
    rank, real = {"RANK": "0"}, calibrate_overlap.measure_overlap_across_hosts
    monkeypatch.setattr(calibrate_overlap, "measure_overlap_across_hosts", lambda threads, repeats: None
                        if rank["RANK"] != "0" else OverlapResult(median_lost_s(timings), timings, 46, 8, 4, threads, 2,
                                                                  path, cpu_s=median_cpu_s(timings)))
    monkeypatch.setenv("TWO_HOSTS_RATE_MBIT", "10000")
    base, out = CONFIG_DIR / "two-hosts.yaml", tmp_path / "two.yaml"
    args = ["calibrate", "--across-hosts", "--only", "collective_cpu", "--base", str(base), "--out", str(out)]
    rank["RANK"] = "1"
    assert main(args) == 0 and not out.exists()
    rank["RANK"] = "0"
    assert main(args) == 0
    got, want = Cluster.from_yaml(out), Cluster.from_yaml(base)
    assert got.inter_node.cpu_ns_per_byte == pytest.approx(0.3125, abs=1e-3)   # written to 3 digits
    assert got.intra_node == want.intra_node and got.executor.collective_compute_share == 0.0
    assert dataclasses.replace(got, executor=want.executor, inter_node=want.inter_node) == want
    (header, comments), (base_header, base_comments) = yaml_comments(out), yaml_comments(base)
    note = comments.pop("links.inter_node.cpu_ns_per_byte")
    for key in ("executor.collective_compute_share", "links.inter_node.cpu_ns_per_byte"):
        base_comments.pop(key, None)
    assert header == base_header and comments == base_comments
    assert (f"`python benchmarks/two_hosts.py --rate-mbit 10000 -- -m autoddl calibrate --across-hosts --only "
            f"collective_cpu --base {base} --out {out}`") in note
    assert f"4 gloo ranks, 1 thread each; {path}: 8 async all-reduces of 1 MB on their own group of 2" in note
    assert "median of 3 repeats 0.625 ms (medians: compute 40.0 ms, collectives 10.0 ms, both 45.0 ms)" in note
    assert note.endswith("the same medians: 0.312 ms; per byte a rank sends (an all-reduce on 2 ranks): 0.312 ns")
    assert main(["calibrate", "--across-hosts", "--only", "all_reduce", "--out", str(out)]) == 2
    assert "across hosts, --only takes collective_cpu alone" in capsys.readouterr().err
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="--only collective_cpu runs in torchrun ranks on several hosts"):
        real(1, 1)


@pytest.mark.distributed
def test_collective_cpu_measured_across_the_testbed_link(tmp_path):
    """The real measurement on the testbed (--quick: 5 repeats): rank 0 writes the per-byte cost of
    the median compute lost its repeats printed, with the inter-host groups and the link in the comment, every
    other field of --base as it was; no namespace left behind."""
    import re
    import statistics

    from autoddl.cluster import CONFIG_DIR, Cluster, yaml_comments

    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    before, base, out = _our_namespaces(), CONFIG_DIR / "two-hosts.yaml", tmp_path / "two.yaml"
    run = subprocess.run([sys.executable, str(SCRIPT), "--rate-mbit", "10000", "--timeout-s", "90", "--", "-m",
                          "autoddl", "calibrate", "--across-hosts", "--only", "collective_cpu", "--quick",
                          "--base", str(base), "--out", str(out)],
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    repeats = [tuple(float(x) for x in m) for m in
               re.findall(r"repeat \d/5: compute ([\d.]+) ms, collectives ([\d.]+) ms \(CPU ([\d.]+) ms\), both ([\d.]+) ms",
                          log)]
    assert len(repeats) == 5, log
    cpu_ms = statistics.median(cpu / 8 for c, coll, cpu, both in repeats)
    got, want = Cluster.from_yaml(out), Cluster.from_yaml(base)
    # 1 MB sent per all-reduce by each rank of a pair
    assert got.inter_node.cpu_ns_per_byte == pytest.approx(cpu_ms * 1e-3 / 1e6 * 1e9, abs=0.02)
    assert dataclasses.replace(got, executor=want.executor, inter_node=want.inter_node) == want
    note = yaml_comments(out)[1]["links.inter_node.cpu_ns_per_byte"]
    assert "inter-host groups [[0, 2], [1, 3]] at once across the tbf 10000 Mbit/s link" in note
    assert "4 gloo ranks, 1 thread each" in note and "median of 5 repeats" in note
    assert _our_namespaces() <= before, f"namespaces left behind: {_our_namespaces() - before}"


def test_study_rows_come_from_one_launchs_worker_results(tmp_path):
    """benchmarks/two_hosts_study.py times a model's plans in one launch: each plan's row is its own
    worker result (the median and p10/p90 of its step times, its predicted cost), the launch's link
    MB and the study's columns; a plan without a result keeps the launch's error."""
    import argparse

    from autoddl.plan import Plan
    from benchmark_modules import load_benchmark

    study = load_benchmark("two_hosts_study")

    path = ROOT / "results" / "plans" / "executor-gpt-tiny-dp.json"
    it = {"model": "gpt", "scheme": "dp", "path": path, "plan": Plan.load(path)}
    times = [0.010, 0.012, 0.011, 0.020, 0.013]
    args = argparse.Namespace(steps=5, warmup=3, rounds=3)
    row = dict(study.measured_row(it, {"step_time_s": times, "peak_memory_mb": [10.0, 12.5]}), link_mb="7.50")
    out = study.study_row(it, row, "two-hosts-x", 1000.0, 0.0, args)
    assert float(out["measured_median_s"]) == pytest.approx(0.012)
    assert float(out["predicted_step_s"]) == pytest.approx(it["plan"].cost.step_time_s, rel=1e-5)
    assert (out["link_mb"], out["rounds"], out["steps"], out["rate_mbit"], out["error"]) == ("7.50", 3, 5, "1000", "")
    assert float(out["peak_memory_mb"]) == 12.5 and out["axes"] == "as planned"
    failed = study.study_row(it, dict(study.measured_row(it, {"error": "exit 1: boom"}), link_mb="nan"),
                             "two-hosts-x", 1000.0, 0.0, args)
    assert failed["error"] == "exit 1: boom" and "measured_median_s" not in failed
    # the same rows join the fidelity CSV with a testbed (issue 14), once each
    from executor.measure import read_rows

    fidelity_csv = tmp_path / "fidelity.csv"
    assert study.append_fidelity_rows([out, failed], fidelity_csv) == 1       # same study, model, scheme: once
    assert study.append_fidelity_rows([out], fidelity_csv) == 0
    (joined,) = read_rows(fidelity_csv)[1]
    assert (joined["testbed"], joined["config"], joined["scheme"], joined["study"]) == (
        "two hosts at 1000 Mbit/s", "2x2", "dp", "two-hosts-x")
    assert joined["measured_median_s"] == out["measured_median_s"] and "link_mb" not in joined
