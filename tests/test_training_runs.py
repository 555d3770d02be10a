"""Issue 10 on real ranks: mixed precision, activation recompute and micro-steps, run and checked.

For gpt and llama ("tiny" preset) on 2 gloo ranks (mesh 2) and on 4 (mesh 2x2), each expert
baseline and the found plan run one optimizer step under a training setting; the loss, every
gradient and every parameter after the step equal one process's under the same policy and the
same micro-steps within ``autoddl.precision.check_rtol`` (1e-4 for fp32), and the collectives
that ran -- recomputed ones included -- are exactly the step program's (kind, axis, bytes, phase).
Settings: the issue's bf16 + selective recompute + 4 micro-steps; fp32 full recompute (whose
recompute re-runs the blocks' collectives); fp32 with 2 micro-steps (gradient sync deferred).
Schemes include ZeRO-1 / ZeRO-2 (the dp plan with sharded optimizer states / gradients, whose
parameters are all-gathered after the optimizer step).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback
from pathlib import Path

import pytest
import torch

from dist_utils import check_and_audit_problems, run_ranks, step_batch
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gpt", "llama")
SETTINGS = {
    "bf16-selective-mb4": dict(param_dtype="bf16", recompute="selective", micro_batches=4),
    "fp32-full": dict(recompute="full"),
    "fp32-mb2": dict(micro_batches=2),
}
SCHEMES = {(2,): ("dp", "zero1", "zero2", "zero3", "tp", "found"),
           (2, 2): ("dp", "zero1", "zero2", "zero3", "dp_tp", "found")}


def cases(mesh: tuple[int, ...]):
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from autoddl.trace import trace
    from autoddl.training import Training
    from costmodel.breakdown import predicted_collectives
    from search.planner import search

    local = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(math.prod(mesh))
    runs = []
    for model in MODELS:
        torch.manual_seed(0)
        mf = load_model_file(ROOT / "examples" / f"{model}.py", device="cpu", preset="tiny")
        for setting, fields in SETTINGS.items():
            training = Training(**fields)
            graph = trace(mf.model, mf.example_inputs, mf.loss_fn, name=model, param_dtype=training.param_dtype)
            for scheme in search(graph, local, mesh=mesh).schemes:
                if scheme.name not in SCHEMES[mesh]:
                    continue
                assert scheme.plan is not None, f"{model} {scheme.name}: {scheme.reason}"
                plan = dataclasses.replace(scheme.plan, training=training)
                predicted = [(c.kind.value, c.axis, int(c.bytes), c.phase)
                             for c in predicted_collectives(graph, plan, local)]
                runs.append((model, setting, scheme.name, mf, graph, plan, predicted))
    return runs


def _run_all(runs):
    from executor.runtime import DistributedModel, audit_step, build_optimizer, init_mesh, run_check

    mesh, table = None, {}
    for model, setting, scheme, mf, graph, plan, _ in runs:
        mesh = mesh or init_mesh(plan)
        batch = step_batch(mf.example_inputs, plan.training.micro_batches)
        try:
            errors = run_check(mf.model, batch, mf.loss_fn, graph, plan, mesh, optimizer="sgd", steps=1)
            dmodel = DistributedModel(mf.model, graph, plan, mesh)
            records = audit_step(dmodel, batch, build_optimizer("sgd", dmodel.parameters()))
            table[(model, setting, scheme)] = (errors, [(r.kind, r.axis, r.bytes, r.phase) for r in records], "")
        except Exception:
            table[(model, setting, scheme)] = (None, None, traceback.format_exc())
    return table


@functools.lru_cache(maxsize=None)
def results(mesh: tuple[int, ...]):
    return run_ranks(_run_all, math.prod(mesh), cases(mesh), timeout_s=600)


PARAMS = [pytest.param(mesh, setting, id=f"{'x'.join(map(str, mesh))}-{setting}")
          for mesh in SCHEMES for setting in SETTINGS]


@pytest.mark.distributed
@pytest.mark.parametrize("mesh,setting", PARAMS)
def test_training_settings_match_one_process_and_the_program(mesh, setting):
    from autoddl.precision import check_rtol

    problems = []
    runs = [r for r in cases(mesh) if r[1] == setting]
    assert {(r[0], r[2]) for r in runs} == {(m, s) for m in MODELS for s in SCHEMES[mesh]}
    for model, _, scheme, mf, _, plan, predicted in runs:
        rtol = check_rtol(plan.training.param_dtype)
        for rank, table in enumerate(results(mesh)):
            errors, records, failure = table[(model, setting, scheme)]
            if failure:
                problems.append(f"{model} {scheme} rank {rank} raised:\n{failure}")
                break
            problems += check_and_audit_problems(f"{model} {scheme} rank {rank}", mf.model, errors, records,
                                                 predicted, rtol)
    assert not problems, "\n".join(problems)


def test_the_settings_change_what_runs():
    """The programs differ as the settings say: recompute collectives under full recompute with
    tensor parallel, one gradient all-reduce for two micro-steps of data parallel (carrying their
    losses) but a reduce-scatter per micro-step for ZeRO-3, gathers in bf16 at half the fp32 bytes."""
    from autoddl.program import lower

    def program(model, setting, scheme):
        _, _, _, _, graph, plan, _ = next(r for r in cases((2,)) if r[:3] == (model, setting, scheme))
        return lower(graph, plan)

    def count(prog, kind, phase):
        return sum(1 for t in prog.collectives() if t.collective.value == kind and t.phase == phase)

    assert count(program("llama", "fp32-full", "tp"), "all_reduce", "recompute") > 0
    dp = program("gpt", "fp32-mb2", "dp")
    assert count(dp, "all_reduce", "grad_sync") == len(dp.buckets) >= 1
    # both micro-steps' losses ride in the first bucket of the one sync, as their sum
    assert count(dp, "all_reduce", "forward") == 0 and dp.loss_bucket == 0
    z3 = program("gpt", "fp32-mb2", "zero3")
    assert count(z3, "reduce_scatter", "grad_sync") == 2 * len(z3.buckets) >= 2
    assert count(z3, "all_reduce", "forward") == 2 and z3.loss_bucket == -1   # no all-reduce bucket: each loss's own
    gathers = lambda prog: [t.nbytes for t in prog.collectives() if t.tensor.startswith("gather")]  # noqa: E731
    fp32 = gathers(z3)[: len(z3.gathers)]
    assert gathers(program("gpt", "bf16-selective-mb4", "zero3"))[: len(z3.gathers)] == [b // 2 for b in fp32]
