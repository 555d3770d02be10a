"""The executor's copies around its flat collectives (costmodel/copy_passes.py) against the aten ops
that ran: a stack of Linear + ReLU blocks on 2 gloo ranks, float32, dp / ZeRO-1 / ZeRO-2 / ZeRO-3 (one
micro-step), and dp / ZeRO-3 over 2 micro-steps (dp's buckets copied in once, at the last one; ZeRO-3's
at each). Every ``copy_`` and ``cat`` that kept its dtype, as a multiset of (op, elements), is a priced
copy pass; a copy is priced at its bytes' roofline plus the per-op cost."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from clusters import CPU_CLUSTER_PATH
from dist_utils import block_stack_file, recorded_step, run_ranks, step_batch

D, ROWS = 16, 4                                  # width, rows (traced)
CASES = (("dp", 1), ("zero1", 1), ("zero2", 1), ("zero3", 1), ("dp", 2), ("zero3", 2))


def _plans(path: Path):
    """The model file, its graph and each case's plan (the baseline, with k micro-steps)."""
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from autoddl.training import Training
    from search.planner import search

    torch.manual_seed(0)
    mf = load_model_file(path, device="cpu")
    graph = mf.trace()
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(2)
    schemes = {s.name: s.plan for s in search(graph, cluster, mesh=(2,)).schemes}
    return mf, graph, {(name, k): dataclasses.replace(schemes[name], training=Training(micro_batches=k))
                       for name, k in CASES}


def _ran(path: Path) -> dict[tuple[str, int], list[tuple[str, int]]]:
    from executor.runtime import DistributedModel, build_optimizer, init_mesh

    mf, graph, plans = _plans(path)
    out = {}
    for (name, k), plan in plans.items():
        dmodel = DistributedModel(mf.model, graph, plan, init_mesh(plan))
        rec = recorded_step(dmodel, step_batch(mf.example_inputs, k), build_optimizer("sgd", dmodel.parameters()))
        out[(name, k)] = [(o.op.rstrip("_"), o.out_numels[0]) for o in rec.ops
                          if o.op in ("copy_", "cat") and len(set(o.in_dtypes + o.out_dtypes)) == 1]
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return block_stack_file(tmp_path_factory.mktemp("copies"), D, ROWS)


@pytest.mark.distributed
def test_priced_copy_passes_are_the_copies_that_ran(model_path):
    from autoddl.program import lower
    from costmodel.copy_passes import copy_passes

    ran = run_ranks(_ran, 2, model_path, timeout_s=300)
    _, graph, plans = _plans(model_path)
    for case, plan in plans.items():
        priced = Counter()
        for p in copy_passes(lower(graph, plan), plan.training):
            priced[(p.op, p.numel)] += p.count
        assert priced, case                           # each case copies something
        for rank, runs in enumerate(ran):
            got = Counter(runs[case])
            assert got == priced, (case, rank, got - priced, priced - got)


def test_copy_passes_by_hand(model_path):
    """ZeRO-1 of a 2-block stack's 3 Linear(16, 16) on 2 ranks (816 parameters, float32): the buckets
    copy in 816 gradient elements and the loss; the sync flattens 408 and copies 256 + 16 back into each layer; a
    copy of n float32 elements reads and writes 8n bytes at the memory roofline, plus the per-op cost
    no family measured (the ``contiguous`` family's probe copies nothing)."""
    from autoddl.cluster import Cluster
    from autoddl.program import lower
    from autoddl.training import Training
    from costmodel.copy_passes import bucket_passes, param_sync_passes
    from costmodel.master_passes import Pass, passes_time_s

    _, graph, plans = _plans(model_path)
    program = lower(graph, plans[("zero1", 1)])
    buckets = bucket_passes(program, Training())
    assert sum(p.numel * p.count for p in buckets) == 3 * (D * D + D) + 1
    syncs = param_sync_passes(program, Training())
    assert [(p.op, p.numel) for p in syncs if p.op == "cat"] == [("cat", 3 * (D * D + D) // 2)]
    assert sorted(p.numel for p in syncs if p.op == "copy") == sorted([D * D] * 3 + [D] * 3)
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH)
    ex = cluster.executor
    bw = cluster.device.memory_bandwidth_gbps * 1e9 * cluster.efficiency.memory
    per_op_s = (cluster.op_overhead_us + ex.op_forward_us + ex.input_forward_us) * 1e-6
    want = 3 * (10**6 * 8 / bw + per_op_s) * cluster.time_sharing((2,))
    assert math.isclose(passes_time_s([Pass("copy", "float32", "float32", 10**6, 3)], cluster, (2,)), want)


def test_param_gather_host_cost_by_hand(model_path):
    """ZeRO-3 of the stack gathers its one group of 6 parameter uses before forward and, freed after
    forward, again before backward: 12 unpacked parameters per micro-step, 24 over 2. The optimizer task
    pays ``executor.param_gather_us`` for each, times the mesh's time-sharing; dp and ZeRO-1/2 gather
    nothing, and a cluster without the measurement (0, as the GPU files) prices none."""
    from autoddl.cluster import Cluster
    from autoddl.program import lower
    from costmodel.copy_passes import param_gather_host_s
    from costmodel.simulate import task_time_s

    _, graph, plans = _plans(model_path)
    base = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(2)
    base = dataclasses.replace(base, executor=dataclasses.replace(base.executor, param_gather_us=0.0))
    cluster = dataclasses.replace(base, executor=dataclasses.replace(base.executor, param_gather_us=40.0))
    for (name, k), plan in plans.items():
        program = lower(graph, plan)
        unpacked = {"zero3": 12 * k}.get(name, 0)
        want = unpacked * 40e-6 * cluster.time_sharing((2,))
        assert param_gather_host_s(program, plan.training, cluster) == pytest.approx(want, abs=1e-15), name
        assert param_gather_host_s(program, plan.training, base) == 0.0
        task = next(t for t in program.tasks if t.phase == "optimizer" and not t.is_collective)
        with_gathers = task_time_s(task, graph, plan, cluster, program=program)
        without = task_time_s(task, graph, plan, base, program=program)
        assert with_gathers - without == pytest.approx(want, rel=1e-9, abs=1e-15), name


def test_param_sync_host_cost_by_hand(model_path):
    """ZeRO-1 and ZeRO-2 of the stack sync its 6 parameters (3 weights, 3 biases) once per step: the
    optimizer task pays ``executor.param_sync_us`` for each, times the mesh's time-sharing, beyond its
    copy passes; dp and ZeRO-3 have no parameter sync, and a cluster without the measurement (0, as the
    GPU files) prices none."""
    from autoddl.cluster import Cluster
    from autoddl.program import lower
    from costmodel.copy_passes import param_sync_host_s
    from costmodel.simulate import task_time_s

    _, graph, plans = _plans(model_path)
    base = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(2)
    cluster = dataclasses.replace(base, executor=dataclasses.replace(base.executor, param_sync_us=50.0))
    for (name, k), plan in plans.items():
        program = lower(graph, plan)
        synced = 6 if name in ("zero1", "zero2") else 0
        assert sum(len(s.fqns) for s in program.param_syncs) == synced, name
        want = synced * 50e-6 * cluster.time_sharing((2,))
        assert param_sync_host_s(program, cluster) == pytest.approx(want, abs=1e-15)
        assert param_sync_host_s(program, base) == 0.0
        task = next(t for t in program.tasks if t.phase == "optimizer" and not t.is_collective)
        with_sync = task_time_s(task, graph, plan, cluster, program=program)
        without = task_time_s(task, graph, plan, base, program=program)
        assert with_sync - without == pytest.approx(want, rel=1e-9, abs=1e-15), name
