"""What a collective costs its ranks' compute stream: NCCL's share of its duration
(``executor.collective_compute_share``) and gloo's host CPU per byte sent (``links.*.cpu_ns_per_byte``):
the simulator's rule against hand formulas, the calibration's per-byte cost from synthetic timings,
its YAML write-back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autoddl
from autoddl.cli import main
from autoddl.cluster import (CONFIG_DIR, DEFAULT_CLUSTER_PATH, Cluster, ClusterConfigError, CollectiveFits,
                             ExecutorOverheads, LinkSpec, yaml_comments)
from autoddl.collective_kinds import CollectiveKind
from autoddl.plan import Mesh, Plan
from autoddl.program import COMPUTE, StepProgram, Task, comm_stream, lower
from autoddl.sbp import B, NdSbp, Signature
from costmodel import plan_cost
from costmodel.compute import op_forward_time_s
from costmodel.collectives import collective_cpu_s, cpu_ns_per_byte
from costmodel.simulate import collective_compute_s, overlapped_time_s, simulate
from executor import calibrate_overlap
from executor.calibrate_overlap import (OverlapResult, OverlapTiming, lost_compute_s, measure_overlap, median_cpu_s,
                                        median_lost_s)
from test_breakdown import batch_split_plan
from clusters import CPU_CLUSTER_PATH

NBYTES = 4_000_000


def cpu2(fraction: float, ns_per_byte: float = 0.0) -> Cluster:
    """local-cpu on 2 devices with hand-set numbers (a float32 peak of 0.1435 TFLOPS at efficiency 1, a
    0.7854 GB/s, 244.6 us link: one day's calibration, fixed here so that the matmul and the all-reduce
    below keep their order whatever local-cpu.yaml measures next), collectives on the link formula, no
    executor costs but the fraction, the intra-node link's CPU cost ``ns_per_byte``."""
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(2)
    link = LinkSpec(0.7854, 244.6, cpu_ns_per_byte=ns_per_byte)
    return dataclasses.replace(cluster, collectives=CollectiveFits(), cores_per_node=None, compute_curve=(),
                               device=dataclasses.replace(cluster.device, peak_tflops={"float32": 0.1435}),
                               efficiency=dataclasses.replace(cluster.efficiency, compute=1.0),
                               intra_node=link, inter_node=link,
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
    cost = collective_compute_s(CollectiveKind.ALL_REDUCE, NBYTES, (2,), 0, cluster, d)
    assert overlapped_time_s(c, d, cost) == pytest.approx(max(c + fraction * d, d), rel=1e-12)
    assert timeline.busy_s(stream=COMPUTE) == pytest.approx(c, rel=1e-12)
    assert [t.duration_s for t in timeline.compute_shares] == pytest.approx([fraction * d] if fraction else [])


def test_an_exposed_bucket_is_free_an_overlapped_loss_all_reduce_is_not():
    """mlp, data parallel on dgx-a100-8's 8 GPUs with a hand-set fraction, its loss read at forward's
    end (``loss_at_forward``: its own all-reduce, not carried by the bucket): the gradient bucket runs
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

    def timeline(plan, cluster):
        return simulate(lower(graph, plan, loss_at_forward=True), graph, plan, cluster)

    def busy(t):
        return t.busy_s(stream=COMPUTE, collective=False), t.busy_s(collective=True)

    plan = batch_split_plan(graph, a100.num_devices, NdSbp((B,)), "dp")
    without, with_f = (dataclasses.replace(a100, executor=dataclasses.replace(a100.executor, collective_compute_share=x))
                       for x in (0.0, f))
    before, after = timeline(plan, without), timeline(plan, with_f)
    loss_ar = _all_reduce_s(a100, 4, a100.num_devices)
    assert after.step_time_s == pytest.approx(before.step_time_s + f * loss_ar, rel=1e-9)
    assert after.exposed_comm_s == pytest.approx(before.exposed_comm_s + f * loss_ar, rel=1e-9)
    assert busy(after) == pytest.approx(busy(before), rel=1e-12)
    plan2 = batch_split_plan(graph, 2, NdSbp((B,)), "dp")
    before, after = timeline(plan2, cpu2(0.0)), timeline(plan2, cpu2(f))
    compute_s, comm_s = busy(before)
    assert comm_s > compute_s and after.step_time_s == before.step_time_s
    assert sum(t.duration_s for t in after.compute_shares) == pytest.approx(f * comm_s, rel=1e-12)


@pytest.mark.parametrize("collective_first", [True, False])
def test_a_matmul_beside_an_all_reduce_pays_the_cpu_of_its_bytes(collective_first):
    """The same two tasks with no share but the link's CPU cost k ns per byte: the all-reduce of M
    on 2 ranks sends M (ring: 2 (n-1)/n M), so the compute pays k M, whatever the all-reduce's
    duration: step = max(c + k M, d)."""
    graph, plan, node = one_matmul()
    k = 0.6
    cluster = cpu2(0.0, k)
    mm = Task(0, "forward", COMPUTE, (), op=node.name)
    ar = Task(0, "grad_sync", comm_stream(0), (), collective=CollectiveKind.ALL_REDUCE, axis=0, nbytes=NBYTES)
    tasks = [ar, mm] if collective_first else [mm, ar]
    program = StepProgram("b", (2,), [dataclasses.replace(t, id=i) for i, t in enumerate(tasks)])
    timeline = simulate(program, graph, plan, cluster)
    c, d, cpu = (op_forward_time_s(node, plan.signatures[node.name], (2,), cluster), _all_reduce_s(cluster, NBYTES),
                 k * 1e-9 * NBYTES)
    assert timeline.step_time_s == pytest.approx(max(c + cpu, d), rel=1e-9)
    assert [t.duration_s for t in timeline.compute_shares] == pytest.approx([cpu])
    assert timeline.busy_s(stream=COMPUTE) == pytest.approx(c, rel=1e-12)


def test_the_cpu_of_a_collective_is_the_bytes_a_rank_sends_on_its_link():
    """collective_cpu_s by hand on configs/two-hosts.yaml (2 hosts x 2 ranks, 1 core per host's 2 ranks:
    time-sharing 2) with intra 0.5 and inter 2 ns per byte: an all-reduce of M on a host's pair sends
    M (intra), on the 4 ranks' ring 1.5 M (inter: the group crosses the hosts); an all-gather of M on
    the pairs across hosts sends M / 2, a reduce-scatter (gloo: an all-reduce) M, a send_recv M; a
    group of one rank and a link without a cost give 0. cpu_ns_per_byte inverts it."""
    base = Cluster.from_yaml(CONFIG_DIR / "two-hosts.yaml")
    cluster = dataclasses.replace(base, intra_node=dataclasses.replace(base.intra_node, cpu_ns_per_byte=0.5),
                                  inter_node=dataclasses.replace(base.inter_node, cpu_ns_per_byte=2.0))
    m, mesh, share = 1e6, (2, 2), 2.0
    assert cluster.time_sharing(mesh) == share
    cases = [(CollectiveKind.ALL_REDUCE, 1, 0.5 * m), (CollectiveKind.ALL_REDUCE, (0, 1), 2.0 * 1.5 * m),
             (CollectiveKind.ALL_GATHER, 0, 2.0 * m / 2), (CollectiveKind.REDUCE_SCATTER, 0, 2.0 * m),
             (CollectiveKind.SEND_RECV, 0, 2.0 * m), (CollectiveKind.ALL_GATHER, 1, 0.5 * m / 2)]
    for kind, axis, ns in cases:
        assert collective_cpu_s(kind, m, mesh, axis, cluster) == pytest.approx(ns * 1e-9 * share, rel=1e-12), kind
    assert collective_cpu_s(CollectiveKind.ALL_REDUCE, m, (1, 4), 0, cluster) == 0.0
    bare = dataclasses.replace(cluster, inter_node=dataclasses.replace(base.inter_node, cpu_ns_per_byte=0.0))
    assert collective_cpu_s(CollectiveKind.ALL_REDUCE, m, mesh, 0, bare) == 0.0
    lost = collective_cpu_s(CollectiveKind.ALL_REDUCE, m, mesh, (0, 1), cluster)
    assert cpu_ns_per_byte(lost / share, CollectiveKind.ALL_REDUCE, m, 4, "gloo") == pytest.approx(2.0, rel=1e-12)
    with pytest.raises(ValueError, match="sends nothing"):
        cpu_ns_per_byte(lost, CollectiveKind.ALL_REDUCE, m, 1, "gloo")


def test_the_cpu_and_the_lost_compute_per_collective():
    """The process CPU during the collectives alone / collectives, median over repeats (the field);
    (both - compute alone) / collectives, at least 0, median over repeats (its cross-check)."""
    cpu = (OverlapTiming(0.01, 0.004, 0.013, 0.004), OverlapTiming(0.01, 0.004, 0.013, 0.002),
           OverlapTiming(0.01, 0.004, 0.013, 0.009))
    assert median_cpu_s(cpu, 8) == pytest.approx(0.004 / 8)
    assert lost_compute_s(OverlapTiming(0.010, 0.004, 0.013), 8) == pytest.approx(0.003 / 8)
    assert lost_compute_s(OverlapTiming(0.010, 0.004, 0.009), 8) == 0.0       # faster beside: noise
    timings = (OverlapTiming(0.010, 0.004, 0.011), OverlapTiming(0.010, 0.005, 0.014), OverlapTiming(0.02, 0.01, 0.03))
    assert median_lost_s(timings, 2) == pytest.approx(0.002)                   # 0.5, 2, 5 ms
    with pytest.raises(ValueError, match="collectives alone took 0"):
        lost_compute_s(OverlapTiming(0.01, 0.0, 0.01))


def test_the_measurement_runs_on_two_gloo_ranks():
    """One repeat on 2 ranks: three positive loop times, compute sized to cover the collectives, and
    the result is the compute lost per collective of those times (not timed for the record)."""
    result = measure_overlap(2, 1, repeats=1, launches=1, timeout_s=120)
    (t,) = result.timings
    assert min(t.compute_s, t.collective_s, t.both_s) > 0 and result.matmuls >= 4
    assert result.lost_s == lost_compute_s(t) and result.group_size == 2
    assert result.cpu_s == t.collective_cpu_s / 8 > 0          # gloo's threads spent CPU on the all-reduces


def test_several_launches_give_the_median_of_their_medians(monkeypatch):
    """measure_overlap over 3 launches (run_ranks replaced by synthetic rank-0 times, 8 all-reduces):
    launch medians 1, 3 and 2 ms lost per collective -> 2 ms; every repeat's timing kept, in order."""
    launches = iter([[(0.010, 0.004, 0.018, 0.008)] * 3, [(0.010, 0.004, 0.034, 0.024)] * 3,
                     [(0.010, 0.004, 0.026, 0.016), (0.010, 0.004, 0.026, 0.016), (0.010, 0.004, 0.010, 0.0)]])
    monkeypatch.setattr(calibrate_overlap, "run_ranks", lambda *a, **k: [{"times": next(launches), "matmuls": 9}])
    result = measure_overlap(2, 1, repeats=3, launches=3)
    assert result.lost_s == pytest.approx(0.002) and len(result.timings) == 9 and result.launches == 3
    assert result.cpu_s == pytest.approx(0.002)        # CPU medians 1, 3, 2 ms per collective
    assert result.timings[3] == OverlapTiming(0.010, 0.004, 0.034, 0.024)


def test_calibrate_only_collective_cpu_sets_the_links_cost_over_base_keeping_every_comment(tmp_path, monkeypatch,
                                                                                         capsys):
    """The CLI with the measurement replaced by synthetic timings (process CPU 3, 3, 2 ms per 8
    all-reduces of 1 MB on 2 ranks: median 3 / 8 ms, 1 MB sent each: 0.375 ns per byte): --out is --base with
    links.intra_node.cpu_ns_per_byte (and inter_node's, one node) set and commented, the compute
    share dropped, every other field and comment as it was; a negative cost in a file is refused by name."""
    timings = (OverlapTiming(0.010, 0.004, 0.013, 0.003),) * 2 + (OverlapTiming(0.01, 0.004, 0.012, 0.002),)
    monkeypatch.setattr(calibrate_overlap, "measure_overlap", lambda nproc, threads, repeats, launches: OverlapResult(
        median_lost_s(timings), timings, 20, 8, nproc, threads, nproc, cpu_s=median_cpu_s(timings)))
    base = CPU_CLUSTER_PATH
    out = tmp_path / "c.yaml"
    assert main(["calibrate", "--only", "collective_cpu", "--nproc", "2", "--base", str(base), "--out", str(out)]) == 0
    got, want = Cluster.from_yaml(out), Cluster.from_yaml(base)
    assert got.intra_node.cpu_ns_per_byte == got.inter_node.cpu_ns_per_byte == pytest.approx(0.375)
    assert got.executor.collective_compute_share == 0.0
    assert dataclasses.replace(got, executor=want.executor, intra_node=want.intra_node,
                               inter_node=want.inter_node) == want
    assert dataclasses.replace(got.intra_node, cpu_ns_per_byte=0.0) == dataclasses.replace(want.intra_node,
                                                                                           cpu_ns_per_byte=0.0)
    (header, comments), (base_header, base_comments) = yaml_comments(out), yaml_comments(base)
    assert header == base_header
    note = comments.pop("links.intra_node.cpu_ns_per_byte")
    assert comments.pop("links.inter_node.cpu_ns_per_byte") == "as links.intra_node (one node)"
    for key in ("executor.collective_compute_share", "links.intra_node.cpu_ns_per_byte",
                "links.inter_node.cpu_ns_per_byte"):
        base_comments.pop(key, None)
    assert comments == base_comments
    assert "--only collective_cpu" in note and "median of 3 repeats 0.375 ms" in note
    assert note.endswith("user + system, mean over ranks) per all-reduce during the all-reduces alone, the same "
                         "medians: 0.375 ms; per byte a rank sends (an all-reduce on 2 ranks): 0.375 ns")
    assert main(["calibrate", "--only", "collective_cpu,all_reduce", "--out", str(out)]) == 2
    assert "collective_cpu is timed alone" in capsys.readouterr().err
    out.write_text(out.read_text().replace("cpu_ns_per_byte: 0.375", "cpu_ns_per_byte: -1", 1))
    with pytest.raises(ClusterConfigError, match=r"links\.intra_node\.cpu_ns_per_byte: expected a non-negative"):
        Cluster.from_yaml(out)
