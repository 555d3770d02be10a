"""Issue 12 on real ranks: pipelined plans run with torch.distributed.pipelining, checked and audited.

Each case prices a ``--degrees pp=...`` configuration (search.planner.price_degrees: the baseline of
the other degrees inside each stage, the stages cut at block boundaries), runs one optimizer step of
it on gloo ranks (executor/pipelined.py: each stage's compiled local program as a PipelineStage under
the plan's schedule) next to one process, and asserts that the loss, every gradient and every updated
parameter match within ``check_rtol`` (1e-4 in fp32), and that the communication that ran -- the
schedule's sends (count and bytes), the stages' own collectives, the tied embedding's pp all-reduce --
is exactly the step program's, rank by pp rank. ZeRO inside the stages: pp=2 x fsdp=2 (ZeRO-3, also
the plan `autoddl plan --pipeline` finds on 4 local-cpu ranks) and pp=2 x dp=2 with ZeRO-1 / ZeRO-2,
two optimizer steps each.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from dist_utils import check_and_audit_problems, run_ranks, step_batch
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def case(model: str, degrees: str, schedule: str = "1f1b", micro_batches: int = 2, virtual_stages: int = 1,
         layers: int = 2, param_dtype: str = "fp32", recompute: str = "none"):
    """(model file, graph, plan, batch, predicted collectives) of one pipelined configuration."""
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from autoddl.trace import trace
    from autoddl.training import Training
    from search.planner import parse_degrees, price_degrees

    degree_list = parse_degrees(degrees)
    local = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(math.prod(n for _, n in degree_list))
    torch.manual_seed(0)
    sizes = {"n_layer" if model == "gpt" else "n_layers": layers}
    mf = load_model_file(ROOT / "examples" / f"{model}.py", device="cpu", preset="tiny", **sizes)
    training = Training(micro_batches=micro_batches, param_dtype=param_dtype, recompute=recompute)
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn, name=model, param_dtype=training.param_dtype)
    plan = price_degrees(graph, local, degree_list, training=training, schedule=schedule,
                         virtual_stages=virtual_stages).plan
    return mf, graph, plan, step_batch(mf.example_inputs, micro_batches), program_collectives(graph, plan)


def program_collectives(graph, plan) -> list[tuple[str, int, int, str]]:
    """The program's collectives on local-cpu ranks, as the audit lists them: (kind, axis, bytes, phase)."""
    from autoddl.cluster import Cluster
    from costmodel.breakdown import predicted_collectives

    local = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(plan.mesh.size)
    return [(c.kind.value, c.axis, int(c.bytes), c.phase) for c in predicted_collectives(graph, plan, local)]


def _check_and_audit(runs, steps: int = 1):
    """On each rank: per case, the check against one process (``steps`` optimizer steps) and one
    audited step's records."""
    import torch.distributed as dist

    from executor.runtime import (audit_records, audit_step, build_optimizer, distributed_model, init_mesh,
                                  run_check)

    out = []
    for mf, graph, plan, batch, _ in runs:
        mesh = init_mesh(plan)
        errors = run_check(mf.model, batch, mf.loss_fn, graph, plan, mesh, optimizer="sgd", steps=steps)
        dmodel = distributed_model(mf.model, graph, plan, mesh)
        records = audit_records(dmodel, audit_step(dmodel, batch, build_optimizer("sgd", dmodel.parameters())))
        out.append((errors, [(r.kind, r.axis, r.bytes, r.phase) for r in records]))
        del dmodel
        dist.barrier()
    return out


def assert_matches(runs, results) -> None:
    """Every rank's check within its precision's bound (autoddl/precision.py ``CHECK_RTOL``) over every
    parameter; the audit equal to the program."""
    from autoddl.precision import CHECK_RTOL

    problems = []
    for i, (mf, _, plan, _, predicted) in enumerate(runs):
        name = f"{plan.name} {plan.mesh} {plan.training.schedule} V={plan.training.virtual_stages}"
        errors, records = results[0][i]
        bound = CHECK_RTOL[plan.training.param_dtype]
        problems += check_and_audit_problems(name, mf.model, errors, records, predicted, bound)
        if not any(kind == "send_recv" for kind, *_ in records):
            problems.append(f"{name}: no send/recv audited")
    assert not problems, "\n".join(problems)


def test_stage_programs_split_the_program_between_the_stages():
    from autoddl.pipeline_program import stage_io, stage_program
    from autoddl.program import lower

    _, graph, plan, _, _ = case("gpt", "pp=2,dp=2", "1f1b", micro_batches=2)
    program = lower(graph, plan)
    ios = [stage_io(graph, program.pipeline, s) for s in range(2)]
    parts = [stage_program(program, io) for io in ios]
    assert ios[0].received == ios[1].sent == () and ios[0].sent == ios[1].received
    assert [str(b.ref) for b in ios[0].sent] == ["add_2"]            # the residual stream after block 0
    assert ios[0].reads == {"idx"} and ios[1].reads == {"targets"}
    assert [p.loss for p in parts] == [None, program.loss] and parts[1].loss_async
    # every parameter use and gradient bucket in exactly one stage, renumbered from 0 there
    assert sum(len(p.param_uses) for p in parts) == len(program.param_uses)
    assert sum(len(p.buckets) for p in parts) == len(program.buckets) == 2
    for part in parts:
        assert [u.index for u in part.param_uses] == list(range(len(part.param_uses)))
        assert sorted(i for b in part.buckets for i in b.uses) == [u.index for u in part.param_uses if u.bucket >= 0]
    # the tied token embedding is read on both stages, each with its own use, synced in its own bucket
    shared = {u.fqn for u in parts[0].param_uses} & {u.fqn for u in parts[1].param_uses}
    assert shared == {"transformer.wte.weight"} and program.pipeline.tied == ("transformer.wte.weight",)


def test_stage_programs_keep_their_own_zero3_groups():
    from autoddl.pipeline_program import stage_io, stage_program
    from autoddl.program import lower

    _, graph, plan, _, _ = case("gpt", "pp=2,fsdp=2", "1f1b", micro_batches=2)
    program = lower(graph, plan)
    parts = [stage_program(program, stage_io(graph, program.pipeline, s)) for s in range(2)]
    # one group per stage, renumbered 0 in each, holding exactly the stage's gathered uses (by its own
    # indices) with the whole program's bytes; kept for the step (no reshard under pp)
    assert [[(g.index, g.nbytes, g.reshard) for g in p.gathers] for p in parts] == [
        [(0, g.nbytes, False)] for g in program.gathers]
    for part in parts:
        assert part.gathers[0].uses == tuple(u.index for u in part.param_uses if u.gather == 0)
        assert part.pipeline is program.pipeline


@pytest.mark.distributed
def test_gpt_pp2_on_two_ranks_matches_one_process_and_its_sends():
    runs = [case("gpt", "pp=2", "1f1b", micro_batches=2)]
    mf, graph, plan, _, predicted = runs[0]
    sends = [p for p in predicted if p[0] == "send_recv"]
    # the residual stream of one micro-batch, (B, T, C) = (4, 32, 64) fp32, crosses the cut: forward
    # on pp rank 0, its gradient back on pp rank 1, once per micro-batch
    assert Counter(sends) == {("send_recv", 0, 4 * 32 * 64 * 4, "forward"): 2,
                              ("send_recv", 0, 4 * 32 * 64 * 4, "backward"): 2}
    # the tied token embedding's gradient (vocab 512 x 64 fp32) is summed over the pp axis on both ranks
    assert Counter(p for p in predicted if p[0] == "all_reduce") == {("all_reduce", 0, 512 * 64 * 4, "grad_sync"): 2}
    assert_matches(runs, run_ranks(_check_and_audit, 2, runs, timeout_s=300))


@pytest.mark.distributed
def test_interleaved_virtual_stages_and_gpipe_on_two_ranks():
    # gpt with 4 blocks, 2 chunks per pp rank: rank 0 runs virtual stages 0 and 2, rank 1 stages 1 and 3
    runs = [case("gpt", "pp=2", "interleaved", micro_batches=2, virtual_stages=2, layers=4),
            case("gpt", "pp=2", "gpipe", micro_batches=2),
            case("gpt", "pp=2", "interleaved", micro_batches=2)]          # one chunk per rank: 1F1B's order
    sends = Counter(p[3] for p in runs[0][4] if p[0] == "send_recv")
    assert sends == {"forward": 3 * 2, "backward": 3 * 2}        # 3 boundaries x 2 micro-batches, each way
    assert_matches(runs, run_ranks(_check_and_audit, 2, runs, timeout_s=300))


FOUR_RANKS = [("gpt", "pp=2,dp=2", 2), ("gpt", "pp=2,tp=2", 2), ("gpt", "pp=4", 4),
              ("llama", "pp=2,dp=2", 2), ("llama", "pp=2,tp=2", 2), ("llama", "pp=4", 4)]   # (model, degrees, blocks)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipelines_with_data_and_tensor_parallel_on_four_ranks():
    # torch's Schedule1F1B needs as many micro-batches as stages
    runs = [case(model, degrees, "1f1b", micro_batches=layers, layers=layers) for model, degrees, layers in FOUR_RANKS]
    assert [r[2].mesh.shape for r in runs] == [(2, 2), (2, 2), (4, 1), (2, 2), (2, 2), (4, 1)]
    assert_matches(runs, run_ranks(_check_and_audit, 4, runs, timeout_s=600))


@pytest.mark.distributed
def test_fsdp_inside_pipeline_stages_on_four_ranks():
    # pp=2 x fsdp=2: each stage's ZeRO-3 group all-gathered once per step on the fsdp axis (in its first
    # micro-batch's forward, kept for the step), its gradients reduce-scattered once, in the last backward
    # (gloo carries a reduce-scatter out as an all-reduce); two optimizer steps against one process; gpt
    # also interleaved, 2 chunks per pp rank, each chunk its own group
    runs = [case(model, "pp=2,fsdp=2", "1f1b", micro_batches=2) for model in ("gpt", "llama")]
    runs.append(case("gpt", "pp=2,fsdp=2", "interleaved", micro_batches=2, virtual_stages=2, layers=4))
    for mf, graph, plan, _, predicted in runs:
        from autoddl.program import lower

        program = lower(graph, plan)
        virtual = 2 * plan.training.virtual_stages
        assert plan.mesh.shape == (2, 2) and len(program.gathers) == virtual and not program.param_syncs
        gathers = Counter(p for p in predicted if p[0] == "all_gather")
        assert gathers == Counter(("all_gather", 1, g.nbytes, "forward") for g in program.gathers)
        syncs = Counter(p for p in predicted if p[3] == "grad_sync" and p[1] == 1)
        assert syncs == Counter(("all_reduce", 1, g.nbytes, "grad_sync") for g in program.gathers)
    assert_matches(runs, run_ranks(_check_and_audit, 4, runs, 2, timeout_s=300))


@pytest.mark.distributed
def test_bf16_fsdp_with_full_recompute_inside_pipeline_stages_on_four_ranks():
    # the shape of the 70B / 405B plans (pp x fsdp, bf16 working copies, every block recomputed) on
    # llama tiny: within the bf16 bound of one process under the same policy, the audit equal to the program
    runs = [case("llama", "pp=2,fsdp=2", "1f1b", micro_batches=2, param_dtype="bf16", recompute="full")]
    _, graph, plan, _, predicted = runs[0]
    assert plan.training.param_dtype == "bfloat16" and plan.training.recompute == "full"
    assert any(p[0] == "all_gather" for p in predicted)
    assert_matches(runs, run_ranks(_check_and_audit, 4, runs, 2, timeout_s=300))


def zero_case(model: str, stage: int):
    """``case(model, "pp=2,dp=2")`` with ZeRO-``stage`` storages on its dp axis (search/zero.py)."""
    from search.zero import with_zero

    mf, graph, plan, batch, _ = case(model, "pp=2,dp=2", "1f1b", micro_batches=2)
    plan = with_zero(graph, plan, stage)
    return mf, graph, plan, batch, program_collectives(graph, plan)


@pytest.mark.distributed
def test_zero1_and_zero2_inside_pipeline_stages_on_four_ranks():
    # pp=2 x dp=2, optimizer states (ZeRO-1) and gradients too (ZeRO-2) sharded on the dp axis: after the
    # optimizer, each pp rank all-gathers its own parameters' updated pieces; the tied embedding's pp
    # all-reduce carries the optimizer's piece of its gradient, (512 x 64 fp32) / 2; two steps
    runs = [zero_case("gpt", 1), zero_case("gpt", 2)]
    for mf, graph, plan, _, predicted in runs:
        from autoddl.program import lower

        syncs = lower(graph, plan).param_syncs
        assert [s.pp_rank for s in syncs] == [0, 1] and {s.axis for s in syncs} == {1}
        assert Counter(p for p in predicted if p[3] == "optimizer") == Counter(("all_gather", 1, s.nbytes, "optimizer")
                                                                               for s in syncs)
        assert Counter(p for p in predicted if p[1] == 0 and p[0] == "all_reduce") == {
            ("all_reduce", 0, 512 * 64 * 4 // 2, "grad_sync"): 2}
    assert_matches(runs, run_ranks(_check_and_audit, 4, runs, 2, timeout_s=300))


@pytest.mark.distributed
def test_the_pipelined_plan_the_3d_search_finds_on_local_cpu_runs(tmp_path):
    # `autoddl plan --pipeline` on 4 local-cpu ranks: the 3-D search's pick (pp=2 x dp=2 or pp=2 x fsdp=2,
    # as the calibrated costs of local-cpu.yaml decide; both shapes are also run on their own above), run
    # as `autoddl run --check` runs it (the model file at the plan's batch), two steps against one process
    from autoddl.cli import main
    from autoddl.loader import load_model_file
    from autoddl.plan import Plan
    from autoddl.program import lower
    from executor.worker import optimizer_step_batch, traced_for

    out, model, cluster = tmp_path / "plan.json", ROOT / "examples" / "llama.py", CPU_CLUSTER_PATH
    assert main(["plan", str(model), "--preset", "tiny", "--cluster", str(cluster), "--devices", "4", "--pipeline",
                 "--global-batch-size", "8", "--no-search", "--out", str(out)]) == 0
    plan = Plan.load(out)
    torch.manual_seed(0)
    mf, graph = traced_for(load_model_file(model, device="cpu", preset="tiny"), plan)
    program = lower(graph, plan)
    assert plan.mesh.axis_names[0] == "pp" and plan.mesh.shape == (2, 2), "the search no longer picks pp=2 here"
    assert bool(program.gathers) == (plan.mesh.axis_names[1] == "fsdp")
    runs = [(mf, graph, plan, optimizer_step_batch(mf, plan).example_inputs, program_collectives(graph, plan))]
    assert_matches(runs, run_ranks(_check_and_audit, 4, runs, 2, timeout_s=300))


def _build(mf, graph, plan):
    from executor.runtime import distributed_model, init_mesh

    distributed_model(mf.model, graph, plan, init_mesh(plan))


@pytest.mark.distributed
def test_a_1f1b_plan_with_fewer_micro_batches_than_stages_is_refused_by_name():
    mf, graph, plan, _, _ = case("gpt", "pp=2", "1f1b", micro_batches=1)
    with pytest.raises(RuntimeError, match=r"Schedule1F1B needs at least as many micro-batches as stages \(1 < 2\)"):
        run_ranks(_build, 2, mf, graph, plan, timeout_s=120)


def _check_without_tied_sync(mf, graph, plan, batch):
    from executor.pipelined import PipelinedModel
    from executor.runtime import init_mesh, run_check

    PipelinedModel._sync_tied = lambda self: None       # this rank process only (forked)
    return run_check(mf.model, batch, mf.loss_fn, graph, plan, init_mesh(plan), optimizer="sgd", steps=1)


@pytest.mark.distributed
def test_without_the_tied_all_reduce_the_embedding_gradient_is_wrong():
    mf, graph, plan, batch, _ = case("gpt", "pp=2", "1f1b", micro_batches=2)
    errors = run_ranks(_check_without_tied_sync, 2, mf, graph, plan, batch, timeout_s=120)[0]
    # each pp rank keeps only its own stage's share of the tied embedding's gradient
    assert errors["grad/transformer.wte.weight"] > 0.1
    assert max(v for k, v in errors.items() if "wte" not in k) <= 1e-4
