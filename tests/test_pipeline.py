"""Pipeline stages in the step program (issue 12): schedules against their closed forms (bubble,
micro-batches in flight), the simulated bubble of a model of identical blocks, the send/recv tasks
against hand-computed activation sizes and the link they cross, and each rank's memory."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest

from dist_utils import block_stack_source

from autoddl.cluster import Cluster, ExecutorOverheads, LinkSpec
from autoddl.collective_kinds import CollectiveKind
from autoddl.loader import load_model_file
from autoddl.pipeline import (P2P, Action, equal_cuts, in_flight_peak, issue_order, max_in_flight, repeated_blocks,
                              schedule_actions, schedule_makespan, stage_of_ops, with_pp_axis)
from autoddl.program import COMPUTE, lower
from autoddl.training import Training
from costmodel.breakdown import plan_cost
from costmodel.memory import activation_bytes, chunk_activation_bytes, pipeline_rank_bytes
from search.planner import parse_degrees, price_degrees

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "configs" / "h100-4x8.yaml"
GPT = ROOT / "examples" / "gpt.py"

# -- schedules: closed forms ------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 4, 1),
                                            ("1f1b", 2, 16, 1), ("interleaved", 4, 8, 2),
                                            ("interleaved", 4, 16, 4), ("interleaved", 2, 6, 3)])
def test_equal_stages_with_free_sends_have_the_closed_form_bubble(schedule, p, m, v):
    # each virtual stage: forward 1/v, backward 2/v (a rank's V chunks make one stage of 1 + 2)
    acts = schedule_actions(schedule, p, m, v)
    step = schedule_makespan(acts, v, lambda r, a: (1.0 if a.kind == "F" else 2.0) / v)
    ideal = m * 3.0
    assert (step - ideal) / ideal == pytest.approx((p - 1) / m / v, rel=1e-12)   # (1/V)(p-1)/m


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("1f1b", 5, 2, 1),
                                            ("interleaved", 3, 6, 2), ("interleaved", 2, 4, 3)])
def test_makespan_is_the_issue_order_walked_with_each_action_waiting_for_its_rank_and_its_data(schedule, p, m, v):
    # unequal times per rank, kind, chunk and micro-batch, and a send time: schedule_makespan's
    # event-driven walk gives exactly the times of the issue order's recurrence
    rng = random.Random(7)
    times = {(r, k, j, c): rng.uniform(0.5, 2.0) for r in range(p) for k in "FB" for j in range(m) for c in range(v)}
    duration = lambda r, a: times[(r, a.kind, a.micro_batch, a.chunk)]    # noqa: E731
    acts = schedule_actions(schedule, p, m, v)
    end, free = {}, [0.0] * p
    for r, a, vs, src in issue_order(acts, v):
        start = max(free[r], end[src] + 0.25 if src is not None else 0.0)
        free[r] = end[(a.kind, a.micro_batch, vs)] = start + duration(r, a)
    assert schedule_makespan(acts, v, duration, 0.25) == max(free)


def test_a_schedule_that_waits_in_a_circle_is_reported():
    # rank 0 waits for rank 1's backward of micro-batch 0, which comes after rank 1's forward that waits for rank 0's
    circle = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 0), Action("B", 0, 0)]]
    for walk in (lambda: schedule_makespan(circle, 1, lambda r, a: 1.0), lambda: list(issue_order(circle, 1))):
        with pytest.raises(ValueError, match=r"deadlocks: the ranks wait at actions \['B0.0', 'F0.0'\]"):
            walk()


def test_every_rank_runs_each_micro_batch_forward_and_backward_on_each_of_its_chunks_once():
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for acts in schedule_actions(schedule, 4, 8, v):
            assert sorted((a.kind, a.micro_batch, a.chunk) for a in acts) == sorted(
                (k, j, c) for k in "FB" for j in range(8) for c in range(v))


def test_micro_batches_in_flight_gpipe_m_and_1f1b_p_minus_rank():
    p, m = 4, 8
    assert [max_in_flight(a) for a in schedule_actions("gpipe", p, m)] == [m] * p
    assert [max_in_flight(a) for a in schedule_actions("1f1b", p, m)] == [p - r for r in range(p)]
    # fewer micro-batches than stages: 1F1B holds all of them on the first rank, as GPipe
    assert max_in_flight(schedule_actions("1f1b", 8, 3)[0]) == 3
    # interleaved, rank 0: warm-up (p-1)*2 + (v-1)*p + 1 chunk-forwards in flight (Megatron)
    acts = schedule_actions("interleaved", 4, 8, 2)[0]
    assert in_flight_peak(acts, [1, 1]) == (4 - 1) * 2 + (2 - 1) * 4 + 1


def test_interleaved_needs_micro_batches_a_multiple_of_the_stages():
    with pytest.raises(ValueError, match="multiple of the pipeline degree: micro_batches 6, pp 4; use 8"):
        schedule_actions("interleaved", 4, 6, 2)


def test_training_checks_schedule_and_virtual_stages():
    with pytest.raises(ValueError, match="training.schedule 'zb' is not a pipeline schedule"):
        Training(schedule="zb")
    with pytest.raises(ValueError, match="virtual_stages 2 needs schedule 'interleaved'"):
        Training(virtual_stages=2)
    t = Training(schedule="interleaved", virtual_stages=2, stage_cuts=["h.2"])
    assert Training.from_dict(t.to_dict()) == t and t.stage_cuts == ("h.2",)


# -- the step program ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    import textwrap

    path = tmp_path_factory.mktemp("pp") / "blocks.py"
    path.write_text(textwrap.dedent(block_stack_source(1024, 8, rows=512, loss=True)))
    mf = load_model_file(path)
    return mf.trace("float32")


def _free_links(cluster: Cluster) -> Cluster:
    """``cluster`` whose links cost nothing (the closed forms' free communication) and whose ops
    cost their roofline only (no fixed per-op cost: the loss, outside the blocks, is then ~free)."""
    free = LinkSpec(bandwidth_gbps=1e12, latency_us=0.0)
    return dataclasses.replace(cluster, intra_node=free, inter_node=free, op_overhead_us=0.0,
                               executor=ExecutorOverheads())


def _pp(graph, cluster, p, training):
    """pp=p over a one-device stage (the only axis), as given by --degrees."""
    one = price_degrees(graph, cluster.resized(1), parse_degrees("dp=1"), training=training).plan
    return with_pp_axis(one, p)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_simulated_bubble_of_identical_blocks_matches_the_closed_form(blocks, schedule, v):
    p, m = 4, 8
    cluster = _free_links(Cluster.from_yaml(H100).resized(4))
    plan = _pp(blocks, cluster, p, Training(micro_batches=m, schedule=schedule, virtual_stages=v))
    bd = plan_cost(blocks, plan, cluster)
    # the last stage also runs the loss (a sum, 0.03% of a stage): equal stages up to that
    assert bd.bubble_s / bd.compute_s == pytest.approx((p - 1) / m / v, rel=2e-3)
    assert bd.step_time_s == pytest.approx(bd.compute_s + bd.bubble_s + bd.optimizer_s + bd.step_overhead_s,
                                           rel=1e-3)
    assert bd.exposed_comm_s == pytest.approx(0.0, abs=1e-3 * bd.step_time_s)


def test_stage_cut_at_block_boundaries(blocks):
    assert repeated_blocks(blocks) == [f"h.{i}" for i in range(8)]
    assert equal_cuts(repeated_blocks(blocks), 3) == ("h.3", "h.6")          # 3 + 3 + 2 blocks
    plan = _pp(blocks, Cluster.from_yaml(H100), 2, Training(stage_cuts=("h.5",)))
    stages = stage_of_ops(blocks, plan)
    from autoddl.program import block_of

    for node in blocks.ops():
        block = block_of(node)
        expected = 1 if block == "root" or int(block.split(".")[1]) >= 5 else 0    # the loss runs last
        assert stages[node.name] == expected, node.name
    bad = dataclasses.replace(plan, training=Training(stage_cuts=("h.0",)))
    with pytest.raises(ValueError, match=r"stage_cuts \['h.0'\] must name 1 distinct repeated blocks after the first"):
        stage_of_ops(blocks, bad)


@pytest.fixture(scope="module")
def gpt():
    mf = load_model_file(GPT, preset="tiny", n_layer=4)
    return mf, mf.trace("float32")


def test_send_recv_tasks_move_the_residual_stream_across_the_inter_node_link(gpt):
    mf = gpt[0].with_batch_size(16)
    graph = mf.trace("float32")
    batch, seq = mf.example_inputs[0].shape
    width = mf.model.config.n_embd
    cluster = Cluster.from_yaml(H100).resized(16)           # 2 nodes of 8: pp=2 across them, dp=8 inside
    m = 4
    inner = price_degrees(graph, cluster.resized(8), parse_degrees("dp=8"), training=Training(micro_batches=m)).plan
    plan = with_pp_axis(inner, 2)
    program = lower(graph, plan)
    # cut after block 1 of 4: only the residual stream (B/dp, T, C) float32 crosses
    [boundary] = program.pipeline.boundaries
    assert boundary.src == 0 and boundary.grad
    assert boundary.nbytes == batch // 8 * seq * width * 4
    sends = [t for t in program.tasks if t.stream == P2P]
    assert [t.collective for t in sends] == [CollectiveKind.SEND_RECV] * (2 * m)
    assert sorted((t.phase, t.pp_rank, t.micro_step) for t in sends) == sorted(
        [("forward", 0, j) for j in range(m)] + [("backward", 1, j) for j in range(m)])
    assert all(t.nbytes == boundary.nbytes and t.axis == 0 for t in sends)
    bd = plan_cost(graph, plan, cluster)
    link = cluster.inter_node                               # the pp axis spans the 2 nodes
    hand = (boundary.nbytes / (link.bandwidth_gbps * 1e9 * cluster.efficiency.network) + link.latency_us * 1e-6
            + cluster.executor.collective_us * 1e-6)
    timed = [t for t in bd.timeline.tasks if t.task.stream == P2P]
    assert [t.duration_s for t in timed] == pytest.approx([hand] * (2 * m), rel=1e-12)


def test_each_send_is_priced_on_the_link_between_its_two_stages(gpt):
    """pp=4 over 2 nodes of 2 devices: stages 0-1 and 2-3 share a node, 1-2 cross; each send (forward to
    the next rank, gradients back to the previous) costs send_recv_time_s between its two stages."""
    from costmodel.collectives import send_recv_time_s

    _, graph = gpt
    cluster = dataclasses.replace(Cluster.from_yaml(H100).resized(4), nodes=2, devices_per_node=2)
    plan = _pp(graph, cluster, 4, Training(micro_batches=2))
    bd = plan_cost(graph, plan, cluster)
    timed = [t for t in bd.timeline.tasks if t.task.stream == P2P]
    assert len(timed) == 2 * 3 * 2                           # forward and backward over 3 boundaries, 2 micro-batches
    for t in timed:
        peer = t.task.pp_rank + (1 if t.task.phase == "forward" else -1)
        assert t.duration_s == pytest.approx(send_recv_time_s(t.task.nbytes, t.task.pp_rank, peer, cluster, (4,)))
        link = cluster.intra_node if {t.task.pp_rank, peer} != {1, 2} else cluster.inter_node
        assert t.duration_s == pytest.approx(t.task.nbytes / (link.bandwidth_gbps * 1e9 * cluster.efficiency.network)
                                             + link.latency_us * 1e-6 + cluster.executor.collective_us * 1e-6)


def test_data_parallel_gradients_sync_once_per_step_on_each_rank(gpt):
    _, graph = gpt
    cluster = Cluster.from_yaml(H100).resized(8)
    inner = price_degrees(graph, cluster.resized(4), parse_degrees("dp=4"), training=Training(micro_batches=4)).plan
    # one micro-step, no stages; the loss's own all-reduce, as a pipelined program keeps it (not in a bucket)
    flat = lower(graph, dataclasses.replace(inner, training=Training()), loss_at_forward=True)
    program = lower(graph, with_pp_axis(inner, 2))
    flat_bytes = sorted(t.nbytes for t in flat.tasks if t.phase == "grad_sync")
    dp_bytes = sorted(t.nbytes for t in program.tasks if t.phase == "grad_sync" and t.axis == 1)
    tied = [(t.pp_rank, t.collective, t.nbytes) for t in program.tasks if t.phase == "grad_sync" and t.axis == 0]
    wte = graph.parameters()["transformer.wte.weight"].outputs[0].nbytes       # tied to the head on stage 1
    # every parameter's gradient all-reduced over dp once on each stage that reads it (buckets split
    # where the stages split): the tied embedding on both, then its two copies summed over pp
    assert sum(dp_bytes) == sum(flat_bytes) + wte
    assert tied == [(0, CollectiveKind.ALL_REDUCE, wte), (1, CollectiveKind.ALL_REDUCE, wte)]
    assert {t.micro_step for t in program.tasks if t.phase == "grad_sync"} == {3}
    assert [t.pp_rank for t in program.tasks if t.phase == "optimizer" and t.stream == COMPUTE] == [0, 1]


@pytest.mark.parametrize("schedule,held", [("gpipe", lambda p, m, r: m), ("1f1b", lambda p, m, r: min(p - r, m))])
def test_rank_memory_holds_the_micro_batches_in_flight(gpt, schedule, held):
    _, graph = gpt
    p, m = 2, 4
    cluster = Cluster.from_yaml(H100).resized(2)
    plan = _pp(graph, cluster, p, Training(micro_batches=m, schedule=schedule))
    program = lower(graph, plan)
    chunks = chunk_activation_bytes(graph, plan, program)
    boundary = sum(b.nbytes for b in program.pipeline.boundaries)
    assert sum(chunks) == sum(activation_bytes(graph, plan).values()) + boundary   # received copies too
    for r in range(p):
        mem = pipeline_rank_bytes(graph, plan, [], program, r)
        assert mem["activations"] == held(p, m, r) * chunks[r]
    params = {r: pipeline_rank_bytes(graph, plan, [], program, r)["parameters"] for r in range(p)}
    total = sum(n.outputs[0].numel for n in graph.parameters().values()) * 4
    # the tied embedding / head weight (wte) is held by both ranks
    wte = graph.parameters()["transformer.wte.weight"].outputs[0].numel * 4
    assert params[0] + params[1] == total + wte - _unused(graph) * 4


def _unused(graph) -> int:
    """Elements of parameters no node reads (torch.export's unused tied alias)."""
    return sum(n.outputs[0].numel for n in graph.parameters().values() if graph.nx.out_degree(n.name) == 0)


def test_chrome_trace_of_a_pipelined_step_has_one_process_per_pp_rank(blocks):
    from costmodel.simulate import chrome_trace, simulate

    cluster = Cluster.from_yaml(H100).resized(2)
    plan = _pp(blocks, cluster, 2, Training(micro_batches=4))
    program = lower(blocks, plan)
    timeline = simulate(program, blocks, plan, cluster)
    events = chrome_trace(timeline, ranks=8)["traceEvents"]
    tasks = [e for e in events if e["ph"] == "X"]
    assert sorted({e["pid"] for e in events}) == [0, 1]
    for r in (0, 1):        # each task, and each collective's share of the compute stream (H100: 0.159)
        own = [t for t in program.tasks if t.pp_rank == r]
        shares = [e for e in tasks if e["pid"] == r and e["name"].startswith("compute share of ")]
        assert len(shares) == sum(t.is_collective for t in own) > 0
        assert len([e for e in tasks if e["pid"] == r]) == len(own) + len(shares)
    assert any(e["name"].startswith("send_recv ") and e["name"].endswith("mb3") for e in tasks)
