"""Sharded-LRTF against hand-worked schedules, the baselines against their formulas, the flows of a
cut graph, and a cut model priced shard by shard against its one-device timeline."""

from __future__ import annotations

import pytest

from autoddl.shard_program import BACKWARD, FORWARD, Flow, JobPlacement, ShardedJob, TaskKey
from search.shard_schedule import lrtf_schedule, one_per_device, sequential
from clusters import CPU_CLUSTER_PATH


def _jobs() -> list[ShardedJob]:
    return [
        ShardedJob("A", 1, forward_s=(2.0, 2.0), backward_s=(2.0, 2.0), param_bytes=(8, 8),
                   flows=(Flow(0, 1, 4, 4, "x"),)),
        ShardedJob("B", 2, forward_s=(1.0,), backward_s=(1.0,), param_bytes=(8,)),
        ShardedJob("C", 1, forward_s=(3.0,), backward_s=(3.0,), param_bytes=(8,)),
    ]


def _one_second(src: int, dst: int, nbytes: int) -> float:
    return 1.0


def _rows(schedule) -> list[tuple]:
    names = [j.name for j in schedule.jobs]
    return [(t.label(names), t.device, t.start_s, t.end_s, t.transfer_s) for t in schedule.tasks]


def test_lrtf_without_prefetch_matches_the_hand_worked_schedule():
    # remaining work A 8 s, C 6 s, B 4 s; a free device takes the ready job with the most left, a
    # backward stays on its forward's device, ties go to the job listed first; B's second forward
    # lands on device 0 while its weights are on device 1: one 1 s message first.
    s = lrtf_schedule(_jobs(), 2, _one_second, prefetch=False)
    assert _rows(s) == [
        ("A:F0@0", 0, 0.0, 2.0, 0.0), ("C:F0@0", 1, 0.0, 3.0, 0.0), ("A:F1@0", 0, 2.0, 4.0, 0.0),
        ("B:F0@0", 1, 3.0, 4.0, 0.0), ("A:B1@0", 0, 4.0, 6.0, 0.0), ("B:B0@0", 1, 4.0, 5.0, 0.0),
        ("C:B0@0", 1, 5.0, 8.0, 0.0), ("A:B0@0", 0, 6.0, 8.0, 0.0), ("B:F0@1", 0, 9.0, 10.0, 1.0),
        ("B:B0@1", 0, 10.0, 11.0, 0.0)]
    assert s.makespan_s == 11.0
    assert s.finish_s() == [8.0, 11.0, 8.0]
    assert [m.what for m in s.tasks[8].inbox] == ["params"] and s.tasks[8].inbox[0].src == 1


def test_lrtf_with_prefetch_places_the_next_task_when_the_current_one_starts():
    # at t=0 both free devices choose first (A on 0, C on 1); then device 0 looks ahead and takes B,
    # queued after A.F0; B's second forward lands on device 1 and waits 1 s for its weights. A's
    # tasks follow one another on device 0 with no gap: 10 s against 11 s without prefetch.
    s = lrtf_schedule(_jobs(), 2, _one_second, prefetch=True)
    assert _rows(s) == [
        ("A:F0@0", 0, 0.0, 2.0, 0.0), ("C:F0@0", 1, 0.0, 3.0, 0.0), ("B:F0@0", 0, 2.0, 3.0, 0.0),
        ("A:F1@0", 0, 3.0, 5.0, 0.0), ("C:B0@0", 1, 3.0, 6.0, 0.0), ("B:B0@0", 0, 5.0, 6.0, 0.0),
        ("A:B1@0", 0, 6.0, 8.0, 0.0), ("B:F0@1", 1, 7.0, 8.0, 1.0), ("A:B0@0", 0, 8.0, 10.0, 0.0),
        ("B:B0@1", 1, 8.0, 9.0, 0.0)]
    assert s.makespan_s == 10.0


def test_a_busy_device_never_takes_a_job_an_idle_device_could_start():
    # two jobs, four devices: each job gets its own device at t=0 and keeps it (no lookahead steals it)
    jobs = [ShardedJob("A", 2, (1.0,), (1.0,), (8,)), ShardedJob("B", 2, (2.0,), (2.0,), (8,))]
    for prefetch in (True, False):
        s = lrtf_schedule(jobs, 4, _one_second, prefetch=prefetch)
        assert s.makespan_s == 8.0 and {t.device for t in s.tasks if t.job == 1} == {0}
        assert all(t.transfer_s == 0 for t in s.tasks)


def test_activation_and_gradient_messages_follow_the_devices_of_the_flow():
    # one job, two shards, one device each way: shard 1's forward on device 1 receives x from
    # device 0; shard 0's backward (on device 0) receives x's gradient from device 1
    job = ShardedJob("A", 1, forward_s=(1.0, 1.0), backward_s=(1.0, 1.0), param_bytes=(8, 8),
                     flows=(Flow(0, 1, 4, 4, "x"),))
    p = JobPlacement(job)
    assert p.task_inputs(TaskKey(0, 0, FORWARD), 0) == ()
    p.place(TaskKey(0, 0, FORWARD), 0)
    (act,) = p.task_inputs(TaskKey(0, 1, FORWARD), 1)
    assert (act.src, act.nbytes, act.what) == (0, 4, "act:0")
    p.place(TaskKey(0, 1, FORWARD), 1)
    assert not p.allowed(TaskKey(0, 1, BACKWARD), 0)
    with pytest.raises(ValueError, match="backward of shard 1 must run on device 1"):
        p.place(TaskKey(0, 1, BACKWARD), 0)
    (grad,) = p.task_inputs(TaskKey(0, 0, BACKWARD), 0)
    assert (grad.src, grad.nbytes, grad.what) == (1, 4, "grad:0")
    # the next step's forward of shard 0 on device 1 pulls the weights from device 0
    (w,) = p.task_inputs(TaskKey(1, 0, FORWARD), 1)
    assert (w.src, w.nbytes, w.what) == (0, 8, "params")


def test_one_device_runs_every_task_back_to_back():
    jobs = _jobs()
    s = lrtf_schedule(jobs, 1, _one_second)
    assert s.makespan_s == sum(j.total_s for j in jobs) == 18.0
    assert all(t.transfer_s == 0 for t in s.tasks)


def test_sequential_baseline_adds_the_solo_times_in_order():
    r = sequential([3.0, 5.0, 2.0])
    assert r.finish_s == (3.0, 8.0, 10.0) and r.makespan_s == 10.0


def test_one_per_device_assigns_longest_first_to_the_least_loaded_device():
    r = one_per_device([3.0, 5.0, 2.0, 4.0], [True] * 4, 2, ["a", "b", "c", "d"])
    # 5 -> d0 (5); 4 -> d1 (4); 3 -> d1 (7); 2 -> d0 (7)
    assert r.device_of == (1, 0, 0, 1)
    assert r.finish_s == (7.0, 5.0, 7.0, 4.0) and r.makespan_s == 7.0


def test_one_per_device_is_not_applicable_when_a_job_does_not_fit():
    r = one_per_device([3.0, 5.0], [True, False], 2, ["a", "b"])
    assert r.finish_s is None and r.makespan_s is None and "b do not fit" in r.reason


def test_a_job_rejects_flows_backwards_and_missing_shard_costs():
    with pytest.raises(ValueError, match="one entry per shard"):
        ShardedJob("A", 1, forward_s=(1.0, 1.0), backward_s=(1.0,), param_bytes=(0, 0))
    with pytest.raises(ValueError, match="must go from a shard to a later one"):
        ShardedJob("A", 1, forward_s=(1.0, 1.0), backward_s=(1.0, 1.0), param_bytes=(0, 0),
                   flows=(Flow(1, 0, 4, 4),))


def test_a_tiny_gpt_cut_in_two_prices_its_shards_from_the_one_device_timeline():
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from search.planner import inner_tp_plan
    from costmodel.collectives import send_recv_time_s
    from search.shards import runner_cluster, shard_job, transfer_fn
    from autoddl.training import Training
    from search.stages import block_costs

    cluster = _no_runner_costs(Cluster.from_yaml(CPU_CLUSTER_PATH)).resized(2)
    graph = load_model_file("examples/gpt.py", preset="tiny").trace()
    job, solo = shard_job("gpt", graph, cluster, steps=3, shards=2)
    costs = block_costs(graph, inner_tp_plan(graph, cluster.resized(1), 1, Training(), "sgd"),
                        runner_cluster(cluster.resized(1)))
    assert job.cuts == ("transformer.h.1",)
    assert job.forward_s == pytest.approx(tuple(costs.forward_s))            # one block per shard
    assert sum(job.backward_s) == pytest.approx(sum(costs.backward_s) + costs.optimizer_s)
    # the solo step runs on the compiled executor: it pays its per-parameter-use and per-step costs, the
    # shard tasks (the shard runner) do not
    uses = sum(len(n.params) for n in graph.ops())
    ex = cluster.executor
    assert ex.param_us > 0 and ex.step_us > 0 and uses >= 28
    assert solo.fits and solo.step_s == pytest.approx(job.step_s + (uses * ex.param_us + ex.step_us) * 1e-6, rel=1e-9)
    # each shard keeps its block's saved activations for the schedule's memory
    assert job.activation_bytes == tuple(int(a) for a in costs.activation_bytes) and min(job.activation_bytes) > 0
    # flows: the residual stream (B, T, C) = 4 x 32 x 64 float32, and the tied wte / lm_head weight
    # (vocab 512 x 64) kept by shard 0 and read by the head in shard 1; both send their gradient back
    assert sorted((f.src, f.dst, f.nbytes, f.grad_nbytes) for f in job.flows) == [
        (0, 1, 4 * 32 * 64 * 4, 4 * 32 * 64 * 4), (0, 1, 512 * 64 * 4, 512 * 64 * 4)]
    # every parameter is kept by one shard: shard 0 has wte, wpe and block 0
    block = 4 * (2 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 2 * 64 + 64 * 256 + 256 + 256 * 64 + 64)
    assert job.param_bytes == (4 * (512 * 64 + 64 * 64) + block, block + 4 * 2 * 64)
    # a message between two devices of one node: local-cpu's measured send_recv fit, plus the fixed cost
    from autoddl.collective_kinds import CollectiveKind
    link = cluster.collectives.get(CollectiveKind.SEND_RECV)
    assert link is not None and link != cluster.intra_node
    assert transfer_fn(cluster)(0, 1, 10**6) == pytest.approx(
        10**6 / (link.bandwidth_gbps * 1e9) + link.latency_us * 1e-6 + cluster.executor.collective_us * 1e-6)
    assert transfer_fn(cluster)(1, 1, 10**6) == 0.0
    assert transfer_fn(cluster)(0, 1, 10**6) == send_recv_time_s(10**6, 0, 1, cluster, (2,))
    # four ranks on this 2-core machine's node (cores_per_node 2) share the cores: every time doubles
    four = _no_runner_costs(Cluster.from_yaml(CPU_CLUSTER_PATH)).resized(4)
    assert four.time_sharing((4,)) == 2.0
    job4, solo4 = shard_job("gpt", graph, four, steps=3, shards=2)
    assert job4.forward_s == pytest.approx(tuple(2 * x for x in job.forward_s))
    assert job4.backward_s == pytest.approx(tuple(2 * x for x in job.backward_s))
    assert solo4.step_s == pytest.approx(2 * solo.step_s)
    # a spilled shard's optimizer states move with it before and after its backward: AdamW's two
    # float32 states per element are twice the float32 parameters, SGD has none
    assert job.state_bytes == (0, 0)
    adamw, _ = shard_job("gpt", graph, cluster, steps=3, shards=2, optimizer="adamw")
    assert adamw.state_bytes == tuple(2 * p for p in job.param_bytes)
    assert transfer_fn(four)(0, 1, 10**6) == pytest.approx(2 * transfer_fn(cluster)(0, 1, 10**6))


def _no_runner_costs(cluster, forward_us=0.0, backward_us=0.0, param_us=0.0):
    """``cluster`` with the shard runner's fixed costs set by hand (0: not priced)."""
    import dataclasses

    return dataclasses.replace(cluster, executor=dataclasses.replace(
        cluster.executor, shard_forward_us=forward_us, shard_backward_us=backward_us, shard_param_us=param_us))


def test_a_shard_task_pays_its_ops_and_the_shard_runners_costs_not_the_compiled_executors():
    """Hand-set runner costs: forward + 100 us, backward + 200 us + 10 us per parameter it updates (gpt
    tiny cut after block 0: shard 0 keeps wte, wpe and block 0's 12 weights and biases, shard 1 block 1's 12
    and ln_f's 2: 14 each); the compiled executor's param_us and step_us change no shard task."""
    import dataclasses

    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from search.shards import shard_job

    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    graph = load_model_file("examples/gpt.py", preset="tiny").trace()
    ops, _ = shard_job("gpt", graph, _no_runner_costs(base).resized(2), steps=1, shards=2)
    priced, _ = shard_job("gpt", graph, _no_runner_costs(base, 100.0, 200.0, 10.0).resized(2), steps=1, shards=2)
    assert [f - o for f, o in zip(priced.forward_s, ops.forward_s)] == pytest.approx([100e-6, 100e-6], abs=1e-12)
    assert [b - o for b, o in zip(priced.backward_s, ops.backward_s)] == pytest.approx(
        [(200 + 14 * 10) * 1e-6] * 2, abs=1e-12)
    compiled_off = dataclasses.replace(base.executor, param_us=0.0, step_us=0.0, shard_forward_us=0.0,
                                       shard_backward_us=0.0, shard_param_us=0.0)
    off, _ = shard_job("gpt", graph, dataclasses.replace(base, executor=compiled_off).resized(2), steps=1, shards=2)
    assert (off.forward_s, off.backward_s) == (ops.forward_s, ops.backward_s)
    # four ranks on the 2-core node share the cores: the runner's costs double with the ops'
    four, _ = shard_job("gpt", graph, _no_runner_costs(base, 100.0, 200.0, 10.0).resized(4), steps=1, shards=2)
    assert four.backward_s == pytest.approx(tuple(2 * b for b in priced.backward_s))


# -- spilled jobs: shards in host memory ------------------------------------------------------------

def _spilled_pair() -> list[ShardedJob]:
    return [ShardedJob("A", 1, forward_s=(2.0, 2.0), backward_s=(3.0, 3.0), param_bytes=(10, 10), spill=True),
            ShardedJob("B", 1, forward_s=(1.0, 1.0), backward_s=(1.0, 1.0), param_bytes=(10, 10), spill=True)]


def _copies(schedule) -> list[tuple]:
    names = [j.name for j in schedule.jobs]
    return [(t.label(names), t.load_start_s, t.load_end_s, t.start_s, t.end_s, t.writeback_start_s,
             t.writeback_end_s) for t in schedule.tasks]


# Worked by hand; a copy takes 1 s (10 bytes at 10 B/s). Without prefetch A (10 s of compute) goes
# first while it is ready; a shard is not loaded again when the device's previous task was that shard
# (A:B1 after A:F1); every backward writes its shard back after it ends (d2h stream, not delaying the
# next load): 14 s of compute + 6 loads in series + the last write-back. With prefetch the next task is
# placed when the current one starts, so its load overlaps that compute; LRTF interleaves A and B (each
# ready while the other runs), every task loads its shard: 1 s first load + 14 s + 1 s write-back.
SPILLED_BY_HAND = {
    False: (21.0, [("A:F0@0", 0.0, 1.0, 1.0, 3.0, 0.0, 0.0), ("A:F1@0", 3.0, 4.0, 4.0, 6.0, 0.0, 0.0),
                   ("A:B1@0", 0.0, 0.0, 6.0, 9.0, 9.0, 10.0), ("B:F0@0", 9.0, 10.0, 10.0, 11.0, 0.0, 0.0),
                   ("A:B0@0", 11.0, 12.0, 12.0, 15.0, 15.0, 16.0), ("B:F1@0", 15.0, 16.0, 16.0, 17.0, 0.0, 0.0),
                   ("B:B1@0", 0.0, 0.0, 17.0, 18.0, 18.0, 19.0), ("B:B0@0", 18.0, 19.0, 19.0, 20.0, 20.0, 21.0)]),
    True: (16.0, [("A:F0@0", 0.0, 1.0, 1.0, 3.0, 0.0, 0.0), ("B:F0@0", 1.0, 2.0, 3.0, 4.0, 0.0, 0.0),
                  ("A:F1@0", 3.0, 4.0, 4.0, 6.0, 0.0, 0.0), ("B:F1@0", 4.0, 5.0, 6.0, 7.0, 0.0, 0.0),
                  ("A:B1@0", 6.0, 7.0, 7.0, 10.0, 10.0, 11.0), ("B:B1@0", 7.0, 8.0, 10.0, 11.0, 11.0, 12.0),
                  ("A:B0@0", 10.0, 11.0, 11.0, 14.0, 14.0, 15.0), ("B:B0@0", 11.0, 12.0, 14.0, 15.0, 15.0, 16.0)]),
}


@pytest.mark.parametrize("prefetch", [False, True])
def test_two_spilled_jobs_of_two_shards_on_one_device_load_each_shard_as_worked_by_hand(prefetch):
    s = lrtf_schedule(_spilled_pair(), 1, _one_second, prefetch=prefetch, host_copy_s=lambda n: n / 10)
    makespan, rows = SPILLED_BY_HAND[prefetch]
    assert _copies(s) == rows and s.makespan_s == makespan
    assert all(t.load_bytes == (10 if t.load_end_s else 0) for t in s.tasks)
    assert [t.writeback_bytes for t in s.tasks] == [10 if t.key.kind == BACKWARD else 0 for t in s.tasks]
    # at most the running shard and the next one are on the device: a load never starts before the
    # task placed before it has started
    assert all(t.load_start_s >= s.tasks[i - 1].start_s for i, t in enumerate(s.tasks) if i and t.load_bytes)
    if not prefetch:
        assert s.finish_s() == [16.0, 21.0]


def test_a_spilled_shard_is_not_reloaded_where_it_just_ran_and_moves_through_host_memory():
    # B (not spilled, longer) takes device 0, A runs on device 1 and loads its only shard once: each
    # later task follows the same shard on that device. A spilled forward on another device gets no
    # params message, only the order of the shard's write-back (a 0-byte host message).
    jobs = [ShardedJob("A", 2, (1.0,), (1.0,), (10,), spill=True), ShardedJob("B", 1, (5.0,), (5.0,), (10,))]
    s = lrtf_schedule(jobs, 2, lambda src, dst, n: 0.0 if n == 0 else 99.0, prefetch=False,
                      host_copy_s=lambda n: n / 10)
    a = [t for t in s.tasks if t.job == 0]
    assert [(str(t.key), t.device) for t in a] == [("F0@0", 1), ("B0@0", 1), ("F0@1", 1), ("B0@1", 1)]
    assert [t.load_bytes for t in a] == [10, 0, 0, 0]          # the same device keeps it after its write-back
    b = s.tasks[[t.job for t in s.tasks].index(1)]
    assert b.load_bytes == 0 and b.writeback_bytes == 0        # B is not spilled
    p = JobPlacement(jobs[0])
    p.place(TaskKey(0, 0, FORWARD), 0)
    (host,) = p.task_inputs(TaskKey(1, 0, FORWARD), 1)
    assert (host.src, host.nbytes, host.what, host.producer) == (0, 0, "host", TaskKey(0, 0, BACKWARD))


def test_a_spilled_load_is_priced_by_the_host_link_formula():
    from autoddl.cluster import Cluster
    from costmodel.host import host_copy_time_s

    cluster = Cluster.from_yaml("configs/dgx-a100-8.yaml")
    link = cluster.host_link
    nbytes = 64 * 2**20
    by_hand = link.latency_us * 1e-6 + nbytes / (link.bandwidth_gbps * 1e9)
    job = ShardedJob("A", 1, (1e-3,), (1e-3,), (nbytes,), spill=True)
    (f, b) = lrtf_schedule([job], 1, _one_second, host_copy_s=lambda n: host_copy_time_s(n, cluster)).tasks
    assert f.load_end_s - f.load_start_s == pytest.approx(by_hand, rel=1e-12) and f.start_s == f.load_end_s
    assert b.load_bytes == 0 and b.writeback_end_s - b.writeback_start_s == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(ValueError, match=r"jobs \['A'\] are spilled to host memory but no host copy price"):
        lrtf_schedule([job], 1, _one_second)


def test_a_spilled_backward_also_loads_and_writes_back_its_optimizer_states():
    job = ShardedJob("A", 1, (1.0,), (1.0,), (10,), spill=True, state_bytes=(20,))
    assert job.host_copies(TaskKey(0, 0, FORWARD), resident=False) == (10, 0)
    assert job.host_copies(TaskKey(0, 0, FORWARD), resident=True) == (0, 0)
    assert job.host_copies(TaskKey(0, 0, BACKWARD), resident=True) == (20, 30)      # the states only
    assert job.host_copies(TaskKey(0, 0, BACKWARD), resident=False) == (30, 30)
    assert ShardedJob("B", 1, (1.0,), (1.0,), (10,), state_bytes=(20,)).host_copies(
        TaskKey(0, 0, BACKWARD), resident=False) == (0, 0)                           # not spilled


# -- device memory over the schedule (autoddl/shard_memory.py) -----------------------------------------

def _with_activations(jobs: list[ShardedJob], acts: list[tuple[int, ...]]) -> list[ShardedJob]:
    import dataclasses

    return [dataclasses.replace(j, activation_bytes=a) for j, a in zip(jobs, acts)]


@pytest.mark.parametrize("prefetch, peak", [(False, 3020), (True, 3330)])
def test_the_peak_device_memory_of_two_spilled_jobs_is_the_hand_count(prefetch, peak):
    # SPILLED_BY_HAND's schedules, shards of 10 bytes (a gradient as big), activations A (100, 200),
    # B (1000, 2000), each kept from its forward's start to its backward's end. Without prefetch the
    # most is at [17, 18) while B:B1 runs: B's activations 3000 + its resident shard 10 + gradient 10
    # (A is done). With prefetch every forward runs before any backward: at [7, 10) A:B1 runs with
    # all four activations (3300), its shard and gradient (20), and B:B1's shard loaded ahead (10).
    jobs = _with_activations(_spilled_pair(), [(100, 200), (1000, 2000)])
    s = lrtf_schedule(jobs, 1, _one_second, prefetch=prefetch, host_copy_s=lambda n: n / 10)
    assert _copies(s) == SPILLED_BY_HAND[prefetch][1]            # activations do not change the schedule
    assert s.peak_memory_bytes() == [peak]
    memory = s.memory()
    if prefetch:
        assert memory.peak_bytes(0, 10.0, 11.0) == 1000 + 2000 + 100 + 4 * 10   # A1's activations gone
    else:
        assert memory.peak_bytes(0, 12.0, 15.0) == 100 + 1000 + 2 * 10         # A:B0 with B0's activations


def test_a_memory_limit_delays_a_prefetch_by_the_hand_worked_second():
    # SPILLED_BY_HAND with prefetch peaks at 40 bytes in [10, 11): A:B1's shard being written back,
    # B:B1's shard and gradient, and A:B0's shard loaded ahead. With 30 bytes A:B0 (placed at 10 when
    # B:B1 starts) does not fit; the device tries again at 11, when A:B1's write-back ends: A:B0 loads
    # in [11, 12) and runs [12, 15), B:B0 loads [12, 13) and runs [15, 16): every later task 1 s late.
    free = lrtf_schedule(_spilled_pair(), 1, _one_second, host_copy_s=lambda n: n / 10)
    tight = lrtf_schedule(_spilled_pair(), 1, _one_second, host_copy_s=lambda n: n / 10, memory_bytes=30)
    assert free.peak_memory_bytes() == [40] and tight.peak_memory_bytes() == [30]
    assert _copies(tight) == SPILLED_BY_HAND[True][1][:6] + [
        ("A:B0@0", 11.0, 12.0, 12.0, 15.0, 15.0, 16.0), ("B:B0@0", 12.0, 13.0, 15.0, 16.0, 16.0, 17.0)]
    assert tight.makespan_s == free.makespan_s + 1.0 == 17.0
    # without prefetch the device holds at most one task's shard and gradient: 20 bytes, as unlimited
    plain = lrtf_schedule(_spilled_pair(), 1, _one_second, prefetch=False, host_copy_s=lambda n: n / 10,
                          memory_bytes=20)
    assert plain.peak_memory_bytes() == [20] and plain.makespan_s == SPILLED_BY_HAND[False][0]


def test_a_non_spilled_shard_is_held_where_its_forward_ran_until_it_moves_or_the_job_ends():
    from autoddl.shard_memory import shard_need_bytes

    # B (5 s a task) keeps device 0; A's single shard (params 10, states 4, activations 50) runs its
    # two steps on device 1, held from its first placement until its last backward ends (at 4 s)
    jobs = [ShardedJob("A", 2, (1.0,), (1.0,), (10,), state_bytes=(4,), activation_bytes=(50,)),
            ShardedJob("B", 1, (5.0,), (5.0,), (8,))]
    s = lrtf_schedule(jobs, 2, _one_second, prefetch=False)
    assert [(str(t.key), t.device, t.start_s) for t in s.tasks if t.job == 0] == [
        ("F0@0", 1, 0.0), ("B0@0", 1, 1.0), ("F0@1", 1, 2.0), ("B0@1", 1, 3.0)]
    memory = s.memory()
    assert memory.peak_bytes(1) == 14 + 50 + 10 == shard_need_bytes(jobs[0], 0)   # shard, activations, gradient
    assert memory.peak_bytes(1, 4.0) == 0                      # done: nothing held
    assert memory.peak_bytes(0) == 8 + 8                       # B's shard and its gradient
    # the first hand-worked schedule: B's shard (8 bytes) is on device 1 from B:F0@0's placement (3)
    # until B:F0@1 starts on device 0 (9), which holds it from its placement (8) to B's end (11)
    s = lrtf_schedule(_jobs(), 2, _one_second, prefetch=False)
    memory = s.memory()
    assert memory.peak_bytes(1, 8.0, 9.0) == 8 and memory.peak_bytes(1, 9.0) == 0
    assert memory.peak_bytes(0, 8.0, 10.0) == 8 and memory.peak_bytes(0, 10.0) == 8 + 8
    # device 1 at [4, 5): C's shard and B's with B:B0's gradient; device 0 at [4, 6): A's two shards
    # and A:B1's gradient (A's shard 1 is done at 6)
    assert s.peak_memory_bytes() == [24, 24] and memory.peak_bytes(0, 6.0, 8.0) == 16


def test_a_shard_that_cannot_fit_one_device_is_an_error_naming_it_and_what_to_do():
    jobs = _with_activations(_spilled_pair(), [(100, 200), (1000, 2000)])
    with pytest.raises(ValueError, match=r"job 'B': shard 1 needs 2\.02e-06 GB on one device for its backward .*"
                                         r"above the device's 2e-06 GB; cut the job into more shards"):
        lrtf_schedule(jobs, 1, _one_second, host_copy_s=lambda n: n / 10, memory_bytes=2000)
    # each shard fits alone (120 bytes) but both jobs' first forwards fill the device: a clear error too
    both = _with_activations(_spilled_pair(), [(100, 100), (100, 100)])
    with pytest.raises(ValueError, match=r"cannot place the next tasks of jobs \['A', 'B'\] on any device"):
        lrtf_schedule(both, 1, _one_second, host_copy_s=lambda n: n / 10, memory_bytes=230)
    assert lrtf_schedule(both[:1], 1, _one_second, host_copy_s=lambda n: n / 10, memory_bytes=230).peak_memory_bytes() \
        == [220]                                               # alone, A fits: 200 activations + shard + gradient


def test_the_shard_count_of_a_spilled_job_fits_two_shards_and_the_step_s_activations():
    from search.shards import shard_count
    from search.stages import BlockCosts

    # four blocks of 1 s, each 10 bytes of activations and 20 of parameter state (30 in all)
    costs = BlockCosts([f"h.{i}" for i in range(4)], [0.5] * 4, [0.5] * 4, [30.0] * 4, [10.0] * 4, 0.0, 0.0)
    assert shard_count(costs, 60) == 2                          # the largest shard: 2 blocks, 60 bytes
    # spilled: 40 bytes of activations + the running and next shard's state; 3 shards (2, 1, 1 blocks)
    # need 40 + 40 + 20 = 100, 4 shards 40 + 20 + 20 = 80
    assert shard_count(costs, 100, spill=True) == 3 and shard_count(costs, 99, spill=True) == 4
    with pytest.raises(ValueError, match=r"4 shards\) needs 0\.00 GB \(spilled: two shards' parameter state"):
        shard_count(costs, 79, spill=True)


def test_a_resident_spilled_shard_is_counted_once_while_its_write_back_outlasts_the_next_task():
    # one spilled shard (params 10, states 20, activations 5), 1 s a task, copies of 10 bytes a second:
    # F0@0 loads [0, 1) runs [1, 2); B0@0 loads the states [2, 4), runs [4, 5), writes back [5, 8);
    # F0@1 runs [5, 6) on the shard still there; B0@1 loads the states once the write-back is over
    # [8, 10) and runs [10, 11). At [6, 8) the device holds the shard and states being written back
    # and F0@1's activations: 35, not a second copy of the shard.
    job = ShardedJob("A", 2, (1.0,), (1.0,), (10,), spill=True, state_bytes=(20,), activation_bytes=(5,))
    s = lrtf_schedule([job], 1, _one_second, prefetch=False, host_copy_s=lambda n: n / 10)
    assert [(t.load_start_s, t.start_s, t.writeback_end_s) for t in s.tasks] == [
        (0.0, 1.0, 0.0), (2.0, 4.0, 8.0), (0.0, 5.0, 0.0), (8.0, 10.0, 14.0)]
    memory = s.memory()
    assert memory.peak_bytes(0, 6.0, 8.0) == 10 + 20 + 5
    assert s.peak_memory_bytes() == [10 + 20 + 10 + 5]          # a backward: shard, states, gradient, activations
