"""A collective's share of the compute stream (``executor.collective_compute_share``): the simulator's
rule against hand formulas, the calibration's fraction from synthetic timings, its YAML write-back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autoddl
from autoddl.cli import main
from autoddl.cluster import (CONFIG_DIR, DEFAULT_CLUSTER_PATH, Cluster, ClusterConfigError, CollectiveFits,
                             ExecutorOverheads, yaml_comments)
from autoddl.collective_kinds import CollectiveKind
from autoddl.plan import Mesh, Plan
from autoddl.program import COMPUTE, StepProgram, Task, comm_stream
from autoddl.sbp import B, NdSbp, Signature
from costmodel import plan_cost
from costmodel.compute import op_forward_time_s
from costmodel.simulate import overlapped_time_s, simulate
from executor import calibrate_overlap
from executor.calibrate_overlap import (OverlapResult, OverlapTiming, collective_compute_share, measure_overlap,
                                        median_fraction)
from test_breakdown import batch_split_plan

NBYTES = 4_000_000


def cpu2(fraction: float) -> Cluster:
    """local-cpu on 2 devices, collectives on the link formula, no executor costs but the fraction."""
    cluster = Cluster.from_yaml(CONFIG_DIR / "local-cpu.yaml").resized(2)
    return dataclasses.replace(cluster, collectives=CollectiveFits(), cores_per_node=None,
                               executor=ExecutorOverheads(collective_compute_share=fraction))


def _all_reduce_s(cluster: Cluster, nbytes: int, n: int = 2) -> float:
    """Ring all-reduce on the intra-node link, by hand: 2 (n-1)/n M / b + 2 (n-1) a."""
    link = cluster.intra_node
    return (2 * (n - 1) / n * nbytes / (link.bandwidth_gbps * 1e9 * cluster.efficiency.network)
            + 2 * (n - 1) * link.latency_us * 1e-6)


def one_matmul():
    torch.manual_seed(0)
    graph = autoddl.trace(nn.Linear(256, 256, bias=False), (torch.randn(4096, 256),), lambda out, x: out.sum(),
                          name="mm")
    (node,) = [n for n in graph.ops() if "linear" in n.target]
    sigs = {n.name: Signature(tuple(NdSbp((B,)) for _ in n.inputs) if n.is_op else (),
                              tuple(NdSbp((B,)) for _ in n.outputs)) for n in graph.topo()}
    plan = Plan(name="b", mesh=Mesh((2,)), signatures=sigs, param_storage={f: NdSbp((B,)) for f in graph.parameters()},
                graph_hash=graph.fingerprint())
    return graph, plan, node


@pytest.mark.parametrize("collective_first", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_matmul_beside_an_all_reduce_pays_the_fraction_of_it(fraction, collective_first):
    """Two tasks, neither waiting for the other: a matmul (c) on the compute stream, a 4 MB all-reduce
    (d) on axis 0's stream. Step = max(c + f d, d) whichever is issued first; f = 0 gives today's
    max(c, d); the compute task's own duration stays c."""
    graph, plan, node = one_matmul()
    cluster = cpu2(fraction)
    mm = Task(0, "forward", COMPUTE, (), op=node.name)
    ar = Task(0, "grad_sync", comm_stream(0), (), collective=CollectiveKind.ALL_REDUCE, axis=0, nbytes=NBYTES)
    tasks = [ar, mm] if collective_first else [mm, ar]
    program = StepProgram("b", (2,), [dataclasses.replace(t, id=i) for i, t in enumerate(tasks)])
    timeline = simulate(program, graph, plan, cluster)
    c, d = op_forward_time_s(node, plan.signatures[node.name], (2,), cluster), _all_reduce_s(cluster, NBYTES)
    assert c > 0.5 * d and d > c            # both orders of max() are met across the fractions
    assert timeline.step_time_s == pytest.approx(max(c + fraction * d, d), rel=1e-9)
    assert overlapped_time_s(c, d, cluster) == pytest.approx(max(c + fraction * d, d), rel=1e-12)
    assert timeline.busy_s(stream=COMPUTE) == pytest.approx(c, rel=1e-12)
    assert [t.duration_s for t in timeline.compute_shares] == pytest.approx([fraction * d] if fraction else [])


def test_an_exposed_bucket_is_free_an_overlapped_loss_all_reduce_is_not():
    """mlp, data parallel on dgx-a100-8's 8 GPUs with a hand-set fraction: the gradient bucket runs
    while the compute stream waits for it (its share costs nothing), the loss's 4-byte all-reduce runs
    beside backward (its share delays it). So step(f) = step(0) + f * loss all-reduce, and that time
    is exposed communication. On 2 CPU ranks the same step is communication-bound (the loss's
    all-reduce outlasts backward, the bucket queues behind it): every share fits in the compute
    stream's idle time, and the step does not change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    graph = autoddl.trace(model, (torch.randn(16, 32),), lambda out, x: out.sum(), name="mlp")
    f = 0.4
    a100 = Cluster.from_yaml(DEFAULT_CLUSTER_PATH)
    plan = batch_split_plan(graph, a100.num_devices, NdSbp((B,)), "dp")
    without, with_f = (dataclasses.replace(a100, executor=dataclasses.replace(a100.executor, collective_compute_share=x))
                       for x in (0.0, f))
    before, after = plan_cost(graph, plan, without), plan_cost(graph, plan, with_f)
    loss_ar = _all_reduce_s(a100, 4, a100.num_devices)
    assert after.step_time_s == pytest.approx(before.step_time_s + f * loss_ar, rel=1e-9)
    assert after.exposed_comm_s == pytest.approx(before.exposed_comm_s + f * loss_ar, rel=1e-9)
    assert (after.compute_s, after.comm_s) == pytest.approx((before.compute_s, before.comm_s), rel=1e-12)
    plan2 = batch_split_plan(graph, 2, NdSbp((B,)), "dp")
    before, after = plan_cost(graph, plan2, cpu2(0.0)), plan_cost(graph, plan2, cpu2(f))
    assert before.comm_s > before.compute_s and after.step_time_s == before.step_time_s
    assert sum(t.duration_s for t in after.timeline.compute_shares) == pytest.approx(f * after.comm_s, rel=1e-12)


def test_the_fraction_is_the_compute_slowdown_over_the_collectives_time():
    """(both - compute alone) / collectives alone, clamped to [0, 1]; the median over repeats."""
    assert collective_compute_share(OverlapTiming(0.010, 0.004, 0.013)) == pytest.approx(0.75)
    assert collective_compute_share(OverlapTiming(0.010, 0.004, 0.009)) == 0.0       # faster beside: noise
    assert collective_compute_share(OverlapTiming(0.010, 0.004, 0.016)) == 1.0       # more than all of it
    timings = (OverlapTiming(0.010, 0.004, 0.011), OverlapTiming(0.010, 0.005, 0.014), OverlapTiming(0.02, 0.01, 0.03))
    assert median_fraction(timings) == pytest.approx(0.8)                          # 0.25, 0.8, 1.0
    with pytest.raises(ValueError, match="collectives alone took 0"):
        collective_compute_share(OverlapTiming(0.01, 0.0, 0.01))


def test_the_measurement_runs_on_two_gloo_ranks():
    """One repeat on 2 ranks: three positive loop times, compute sized to cover the collectives, and
    the result is the fraction of those times (not timed for the record)."""
    result = measure_overlap(2, 1, repeats=1, timeout_s=120)
    (t,) = result.timings
    assert min(t.compute_s, t.collective_s, t.both_s) > 0 and result.matmuls >= 4
    assert result.fraction == collective_compute_share(t)


def test_calibrate_only_collective_cpu_sets_the_field_over_base_keeping_every_comment(tmp_path, monkeypatch, capsys):
    """The CLI with the measurement replaced by synthetic timings (fractions 0.75, 0.75, 0.5: median
    0.75): --out is --base with the field set and its comment added, every other field and comment
    as it was; a fraction outside [0, 1] in a file is refused by name."""
    timings = (OverlapTiming(0.010, 0.004, 0.013),) * 2 + (OverlapTiming(0.01, 0.004, 0.012),)
    monkeypatch.setattr(calibrate_overlap, "measure_overlap", lambda nproc, threads, repeats: OverlapResult(
        median_fraction(timings), timings, 20, 8, nproc, threads))
    base = CONFIG_DIR / "local-cpu.yaml"
    out = tmp_path / "c.yaml"
    assert main(["calibrate", "--only", "collective_cpu", "--nproc", "2", "--out", str(out)]) == 0
    got, want = Cluster.from_yaml(out), Cluster.from_yaml(base)
    assert got.executor.collective_compute_share == 0.75
    assert dataclasses.replace(got, executor=want.executor) == want
    (header, comments), (base_header, base_comments) = yaml_comments(out), yaml_comments(base)
    assert header == base_header
    note = comments.pop("executor.collective_compute_share")
    base_comments.pop("executor.collective_compute_share", None)
    assert comments == base_comments
    assert "--only collective_cpu" in note and "median of 3 repeats" in note
    assert main(["calibrate", "--only", "collective_cpu,all_reduce", "--out", str(out)]) == 2
    assert "collective_cpu is timed alone" in capsys.readouterr().err
    out.write_text(out.read_text().replace("collective_compute_share: 0.75", "collective_compute_share: 1.5"))
    with pytest.raises(ClusterConfigError, match=r"executor\.collective_compute_share: expected a number from 0 to 1"):
        Cluster.from_yaml(out)
