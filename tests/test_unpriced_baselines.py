"""Baselines that provably cannot fit are left unpriced (search ``price_all_baselines=False``,
`autoddl plan`'s default): the found plan and the best baseline are those of the all-priced search,
an unpriced row's step is the baseline's search objective, and its memory floor is a true floor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import autoddl
from autoddl.cli import main
from autoddl.cluster import Cluster
from autoddl.program import used_parameters
from autoddl.training import Training
from costmodel.breakdown import compute_floor_s, plan_cost
from costmodel.memory import memory_floor_bytes, working_param_bytes
from search.baselines import baseline_specs, build_baseline
from search.formulate import formulate
from search.planner import price_unless_unfit, search, with_training
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
LOCAL = CPU_CLUSTER_PATH
MESH = (4,)                 # one mesh keeps the searches short; every baseline on it is priced (or not)
FLOOR_PARTS = ("parameters", "gradients", "optimizer_states", "buffers", "activations", "activation_grads",
               "recomputed")


@pytest.fixture(scope="module", params=["mlp", "gpt", "llama"])
def case(request):
    """(graph, cluster, a limit in GB just under the largest baseline memory floor, the model)."""
    _, graph = autoddl.trace_model_file(ROOT / "examples" / f"{request.param}.py", preset="tiny")
    cluster = Cluster.from_yaml(LOCAL)
    free = search(graph, cluster, model_name=request.param, mesh=MESH)
    floors = [memory_floor_bytes(graph, s.plan) for s in free.schemes if s.plan is not None and s.name != "found"]
    limit = 0.999 * max(floors)
    assert min(s.breakdown.memory_bytes_per_device for s in free.schemes if s.plan is not None) < limit  # some fit
    return graph, cluster, limit / 1e9, request.param


def test_memory_floor_is_the_program_free_categories(case):
    graph, cluster, _, _ = case
    plans = [s.plan for s in search(graph, cluster, mesh=MESH).schemes if s.plan is not None]
    plans += [with_training(p, Training(param_dtype="bf16")) for p in plans]     # working copies too
    assert any(not all(p.param_storage[f].is_broadcast for f in used_parameters(graph)) for p in plans)
    for plan in plans:
        mem = plan_cost(graph, plan, cluster).memory
        floor = memory_floor_bytes(graph, plan)
        whole = frozenset(f for f in used_parameters(graph) if plan.param_storage[f].is_broadcast)
        assert floor == sum(mem[k] for k in FLOOR_PARTS) + working_param_bytes(graph, plan, None, whole)
        assert floor <= mem["total"]
        if len(whole) == len(used_parameters(graph)):                  # nothing gathered: every working copy
            assert floor == sum(mem[k] for k in FLOOR_PARTS + ("working_params",))
            assert mem["working_params"] > 0 or not plan.training.mixed
        early = memory_floor_bytes(graph, plan, enough_bytes=0)         # stops before the activations
        assert early == floor - mem["activations"] - mem["recomputed"]


def test_unpriced_baselines_change_no_choice(case):
    graph, cluster, memory_gb, _ = case
    full = search(graph, cluster, memory_gb=memory_gb, mesh=MESH)
    fast = search(graph, cluster, memory_gb=memory_gb, mesh=MESH, price_all_baselines=False)
    unpriced = [s for s in fast.schemes if s.estimated]
    assert unpriced                                                  # the limit leaves some unpriced
    assert {k: v for k, v in fast.found.to_dict().items() if k != "notes"} == \
        {k: v for k, v in full.found.to_dict().items() if k != "notes"}
    assert fast.found.notes[:-1] == full.found.notes
    assert fast.found.notes[-1].startswith(f"baselines not priced by the full cost model: "
                                          f"{', '.join(s.name for s in unpriced)} cannot fit")
    assert fast.found_breakdown.step_time_s == full.found_breakdown.step_time_s
    assert (fast.best_baseline.name, fast.best_baseline.step_time_s) == \
        (full.best_baseline.name, full.best_baseline.step_time_s)
    priced = {s.name: s for s in full.schemes}
    limit = memory_gb * 1e9
    for s in fast.schemes:
        if not s.estimated:
            assert s.step_time_s == priced[s.name].step_time_s
            continue
        bd = priced[s.name].breakdown
        assert s.floor_bytes and not bd.fits_memory and limit < s.floor_bytes <= bd.memory_bytes_per_device
        spec = next((sp for sp in baseline_specs(s.plan.mesh.ndim) if sp.name == s.name), None)
        if spec is None:                                   # zero1 / zero2: no search objective
            assert s.estimate_s is None
            continue
        form = formulate(graph, cluster, s.plan.mesh.shape, memory_limit_bytes=limit)
        assert s.estimate_s == form.problem.cost(build_baseline(form, spec).assignment)


def test_cli_marks_unpriced_rows(case, tmp_path, capsys):
    _, _, memory_gb, model = case
    if model != "mlp":
        pytest.skip("the command's table and plan once (mlp) is enough")
    outs = {}
    for extra in ([], ["--price-all-baselines"]):
        out = tmp_path / f"plan{len(extra)}.json"
        assert main(["plan", str(ROOT / "examples" / f"{model}.py"), "--preset", "tiny", "--cluster", str(LOCAL),
                     "--memory-gb", repr(memory_gb), "--mesh", "4", "--out", str(out)] + extra) == 0
        outs[bool(extra)] = (capsys.readouterr().out, json.loads(out.read_text()))
    (fast_text, fast_plan), (full_text, full_plan) = outs[False], outs[True]
    headers = [next(line for line in text.splitlines() if line.startswith("scheme")) for text in (fast_text, full_text)]
    assert headers[0].split()[-1] == "priced" and headers[1].split()[-1] == "fits" and "estimated" not in full_text
    rows = [line.split() for line in fast_text.splitlines() if line.endswith("estimated")]
    assert rows and all(r[-2] == "NO" and r[-3].startswith(">") for r in rows)
    assert fast_plan["notes"][:-1] == full_plan["notes"]
    assert {k: v for k, v in fast_plan.items() if k != "notes"} == {k: v for k, v in full_plan.items() if k != "notes"}


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_compute_floor_bounds_the_step(case, recompute):
    """compute_floor_s is the compute stream's kernels: the breakdown's compute_s without recompute
    overheads (equal with recompute none), never above the step; price_unless_unfit estimates a plan
    exactly when that floor is over the step to beat."""
    graph, cluster, _, _ = case
    plans = [with_training(s.plan, Training(recompute=recompute, micro_batches=2))
             for s in search(graph, cluster, mesh=MESH).schemes if s.plan is not None]
    for plan in plans:
        bd = plan_cost(graph, plan, cluster)
        floor = compute_floor_s(graph, plan, cluster)
        assert floor <= bd.step_time_s
        if recompute == "none":
            assert floor == pytest.approx(bd.compute_s, rel=1e-12)
        else:                                                           # local-cpu's measured overheads
            assert 0 < floor < bd.compute_s
        estimated = price_unless_unfit(graph, plan, cluster, 1e18, 1.0, beat_s=floor * (1 - 1e-9))
        assert estimated.estimated and estimated.floor_s == floor and estimated.estimate_s == 1.0
        priced = price_unless_unfit(graph, plan, cluster, 1e18, 1.0, beat_s=floor)
        assert not priced.estimated and priced.step_time_s == bd.step_time_s
