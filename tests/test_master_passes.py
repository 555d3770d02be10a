"""The passes over the float32 masters and their gradients (costmodel/master_passes.py) against the
aten ops that ran: a stack of Linear + ReLU blocks, bf16 compute, selective recompute, 2
micro-steps, on 2 gloo ranks, dp (gradients synced once, at the last micro-step) and zero3 (no
recompute; reduce-scattered every micro-step, groups gathered again for backward). Every float32 <-> bfloat16
cast and every float32 add that ran, as a multiset of (op, source dtype, destination dtype,
elements), is a priced pass, or the forward input's cast to bf16 (one per micro-step, of the whole
micro-batch before this rank's piece is taken: not priced, a few elements). And the losses are read
(their all-reduces waited for) after the last micro-step's backward, as the program prices them.
Also pp=2 x fsdp=2 on 4 ranks (no recompute): each stage's group gathered once per step."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from dist_utils import block_stack_file, recorded_step, run_ranks, step_batch
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
D, ROWS, K = 16, 4, 2          # width, micro-batch rows (traced), micro-steps
SCHEMES = ("dp", "zero3")


def _plans(path: Path):
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from autoddl.training import Training
    from search.planner import search

    training = Training(param_dtype="bf16", recompute="selective", micro_batches=K)
    torch.manual_seed(0)
    mf = load_model_file(path, device="cpu")
    graph = mf.trace(training.param_dtype)
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(2)
    schemes = {s.name: s.plan for s in search(graph, cluster, mesh=(2,), training=training).schemes}
    # zero3 without recompute: a group's reshard hook would sit inside the last block's region
    settings = {"dp": training, "zero3": dataclasses.replace(training, recompute="none")}
    return mf, graph, {n: dataclasses.replace(schemes[n], training=settings[n]) for n in SCHEMES}


def _ran(path: Path):
    from executor.runtime import DistributedModel, build_optimizer, init_mesh

    mf, graph, plans = _plans(path)
    out = {}
    for name, plan in plans.items():
        mesh = init_mesh(plan)
        dmodel = DistributedModel(mf.model, graph, plan, mesh)
        opt = build_optimizer("sgd", dmodel.parameters())
        batch = step_batch(mf.example_inputs, K)
        rec = recorded_step(dmodel, batch, opt)
        passes = _passes(rec)
        last_backward = max(i for i, o in enumerate(rec.ops) if o.phase == "backward")
        reads = [i for i, o in enumerate(rec.ops) if o.op == "_local_scalar_dense"]
        out[name] = passes, len(reads), min(reads) > last_backward
    return out


def _passes(rec) -> list[tuple[str, str, str, int]]:
    """The pass-like ops recorded (an add's last input: the gradient added to the float32 sum; a
    casting copy's: its source), a cast by ``copy_`` (into a kept bucket: executor/gradsync.py) named
    as one by ``to``."""
    return [("_to_copy" if o.op == "copy_" else o.op, o.in_dtypes[-1], o.out_dtypes[0], o.out_numels[0])
            for o in rec.ops if _pass_like(o)]


def _pass_like(o) -> bool:
    """A cast between float32 and bfloat16 (by ``to`` or a casting ``copy_``), or an add whose result is float32."""
    if o.op in ("_to_copy", "copy_"):
        return {o.in_dtypes[-1], o.out_dtypes[0]} == {"float32", "bfloat16"}
    return o.op == "add" and o.out_dtypes == ("float32",)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return block_stack_file(tmp_path_factory.mktemp("passes"), D, ROWS)


@pytest.mark.distributed
def test_priced_master_passes_are_the_casts_and_adds_that_ran(model_path):
    from autoddl.program import lower
    from costmodel.master_passes import step_passes

    ran = run_ranks(_ran, 2, model_path, timeout_s=300)
    _, graph, plans = _plans(model_path)
    for name, plan in plans.items():
        priced = Counter()
        for p in step_passes(lower(graph, plan), plan.training):
            priced[(p.op if p.op == "add" else "_to_copy", p.src, p.dst, p.numel)] += p.count
        priced[("_to_copy", "float32", "bfloat16", ROWS * D)] += K     # the input x's cast, before it is placed
        for rank, runs in enumerate(ran):
            ops, n_reads, after_backward = runs[name]
            assert Counter(ops) == priced, (name, rank, Counter(ops) - priced, priced - Counter(ops))
            # the micro-steps' losses (their all-reduces in flight) are read once the last backward is
            # done, where the program waits for them, not between micro-steps
            assert n_reads == K and after_backward, (name, rank, n_reads)


def _pipelined_plan(path: Path):
    """pp=2 x fsdp=2 of the block stack in bf16, 2 micro-batches (search.planner.price_degrees)."""
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from autoddl.training import Training
    from search.planner import parse_degrees, price_degrees

    torch.manual_seed(0)
    mf = load_model_file(path, device="cpu")
    training = Training(param_dtype="bf16", micro_batches=K)
    graph = mf.trace(training.param_dtype)
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(4)
    return mf, graph, price_degrees(graph, cluster, parse_degrees("pp=2,fsdp=2"), training=training).plan


def _ran_pipelined(path: Path):
    from executor.runtime import build_optimizer, distributed_model, init_mesh

    mf, graph, plan = _pipelined_plan(path)
    dmodel = distributed_model(mf.model, graph, plan, init_mesh(plan))
    rec = recorded_step(dmodel, step_batch(mf.example_inputs, K), build_optimizer("sgd", dmodel.parameters()))
    return _passes(rec), dmodel.held_parameters(), dmodel.pp_rank


@pytest.mark.distributed
def test_priced_master_passes_of_fsdp_inside_pipeline_stages_are_those_that_ran(model_path):
    # under pp each stage's ZeRO-3 group is gathered (its shards cast) once per step, and its gradients
    # are kept in float32 over the micro-batches and reduce-scattered once (autoddl/lowering.py)
    from autoddl.program import lower
    from costmodel.master_passes import step_passes

    ran = run_ranks(_ran_pipelined, 4, model_path, timeout_s=300)
    _, graph, plan = _pipelined_plan(model_path)
    program = lower(graph, plan)
    assert program.gathers and not any(g.reshard for g in program.gathers)
    for rank, (ops, held, pp_rank) in enumerate(ran):
        priced = Counter()
        for p in step_passes(program, plan.training, held):
            priced[(p.op if p.op == "add" else "_to_copy", p.src, p.dst, p.numel)] += p.count
        if pp_rank == 0:                # the first stage reads x: its cast, before it is placed
            priced[("_to_copy", "float32", "bfloat16", ROWS * D)] += K
        assert Counter(ops) == priced, (rank, Counter(ops) - priced, priced - Counter(ops))


def test_pass_counts_by_hand():
    """dp (deferred) bf16, k = 4, a 100-element parameter, bf16 reduce: 4 working-copy casts; the
    first micro-step's gradient to fp32, 3 adds, the sum to bf16 for the all-reduce and back: 3 casts."""
    from autoddl.graph import TensorMeta
    from autoddl.program import ParamUse
    from autoddl.sbp import B, NdSbp
    from autoddl.training import Training
    from costmodel.master_passes import use_passes

    use = ParamUse(0, "w", TensorMeta((10, 10), "bfloat16"), NdSbp((B,)), NdSbp((B,)), NdSbp((B,)), (), ())
    got = use_passes(use, Training(param_dtype="bf16", micro_batches=4), (2,), every_micro_step=False)
    assert [(p.op, p.src, p.dst, p.numel, p.count) for p in got] == [
        ("to", "float32", "bfloat16", 100, 4), ("to", "bfloat16", "float32", 100, 1),
        ("to", "float32", "bfloat16", 100, 1), ("to", "bfloat16", "float32", 100, 1),
        ("add", "bfloat16", "float32", 100, 3)]
    assert got[-1].bytes_per_pass == 100 * (2 + 4 + 4)
    assert use_passes(use, Training(), (2,), every_micro_step=False) == []
    assert math.isclose(sum(p.count for p in got), 10)


def test_a_pass_is_priced_as_a_graph_op_of_its_family():
    """A 1M-element float32 -> bfloat16 cast, twice, on local-cpu: the ``to`` family's measured
    fixed cost plus its work scale times the bytes at the memory roofline, as a graph ``to`` op of
    that size is priced; an add of a bf16 gradient into float32 reads both, as the ``add`` family."""
    from autoddl.cluster import Cluster
    from costmodel.master_passes import Pass, passes_time_s

    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH)
    bw = cluster.device.memory_bandwidth_gbps * 1e9 * cluster.efficiency.memory
    share = cluster.time_sharing((2,))
    for p, dtype, nbytes in ((Pass("to", "float32", "bfloat16", 10**6, 2), "float32", 6e6),
                             (Pass("add", "bfloat16", "float32", 10**6, 3), "float32", 10e6)):
        fam = cluster.executor.op_cost(p.op, dtype)
        work_s = nbytes / bw
        want = p.count * (fam.work_at(work_s * 1e6)[0] * work_s + fam.forward_us * 1e-6) * share
        assert fam.work and fam.work_at(work_s * 1e6)[0] != 1.0         # the scale matters here
        assert passes_time_s([p], cluster, (2,)) == pytest.approx(want, rel=1e-9)
