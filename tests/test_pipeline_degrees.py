"""A given 3-D configuration (issue 12): --degrees pp=P,dp|fsdp=D,tp=T --schedule S --virtual-stages V
through parse_degrees / price_degrees and the CLI, and the stage cut balanced by time and memory."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from autoddl.cli import main
from autoddl.cluster import Cluster
from autoddl.loader import load_model_file
from autoddl.pipeline import pipeline_degree
from autoddl.plan import Plan
from autoddl.sbp import Broadcast
from autoddl.training import Training
from costmodel.breakdown import plan_cost
from search.planner import PlanningError, degrees_spec, parse_degrees, price_degrees
from search.stages import balanced_cuts, stage_cuts

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "configs" / "h100-4x8.yaml"
GPT = ROOT / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def gpt8():
    """gpt tiny with 8 blocks, batch 16."""
    mf = load_model_file(GPT, preset="tiny", n_layer=8).with_batch_size(16)
    return mf, mf.trace("float32")


@pytest.fixture(scope="module")
def h100_32():
    return Cluster.from_yaml(H100)


def test_pp_is_a_degree_role_and_must_be_outermost(h100_32):
    assert parse_degrees("pp=2,dp=2,tp=8") == [("pp", 2), ("dp", 2), ("tp", 8)]
    spec, shape = degrees_spec(parse_degrees("pp=2,dp=2,tp=8"), h100_32)
    assert (spec.name, spec.roles, shape) == ("megatron_3d", ("pp", "dp", "tp"), (2, 2, 8))
    spec, shape = degrees_spec(parse_degrees("pp=4,fsdp=1,tp=8"), h100_32)
    assert (spec.roles, shape) == (("pp", "tp"), (4, 8))
    assert degrees_spec(parse_degrees("pp=2,fsdp=2,tp=8"), h100_32)[0].name == "fsdp_tp_pp"
    with pytest.raises(PlanningError, match="pp must be the outermost"):
        degrees_spec(parse_degrees("dp=2,pp=2,tp=8"), h100_32)


def test_balanced_cuts_weigh_memory_beside_time():
    # time alone would cut after item 4 (4 | 4); memory (equal per item) moves the cut to 3:
    # loads max(3/4, 3/2.5) = 1.2 and max(5/4, 2/2.5) = 1.25, against 1.6 for the cut after 4
    assert balanced_cuts([1, 1, 1, 1, 4], [1, 1, 1, 1, 1], 2) == [3]
    assert balanced_cuts([1, 1, 1, 1, 4], [0, 0, 0, 0, 0], 2) == [4]
    assert balanced_cuts([1] * 6, [1] * 6, 3) == [2, 4]
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3 pipeline stages"):
        balanced_cuts([1, 1], [1, 1], 3)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_price_degrees_builds_the_inner_baseline_on_a_pp_axis(gpt8, h100_32, schedule, v):
    _, graph = gpt8
    scheme = price_degrees(graph, h100_32, parse_degrees("pp=2,dp=2,tp=8"), training=Training(micro_batches=8),
                           schedule=schedule, virtual_stages=v)
    plan = scheme.plan
    assert scheme.name == "pp=2,dp=2,tp=8 --schedule " + schedule + (" --virtual-stages 2" if v > 1 else "")
    assert plan.name == "megatron_3d" and plan.mesh.shape == (2, 2, 8)
    assert plan.mesh.axis_names == ("pp", "dp", "tp") and pipeline_degree(plan) == 2
    assert all(nd[0] == Broadcast() for sig in plan.signatures.values() for nd in sig.inputs + sig.outputs)
    inner = price_degrees(graph, h100_32.resized(16), parse_degrees("dp=2,tp=8"), training=Training()).plan
    assert {k: str(v)[0:] for k, v in plan.signatures.items()} == {
        k: str(v).replace("[", "[B, ").replace("[B, ]", "[B]") for k, v in inner.signatures.items()}
    assert (plan.training.schedule, plan.training.virtual_stages) == (schedule, v)
    assert plan.training.stage_cuts == stage_cuts(graph, inner, h100_32, 2 * v)
    again = plan_cost(graph, Plan.from_dict(plan.to_dict()), h100_32)      # the plan round-trips and re-prices
    assert again.step_time_s == pytest.approx(plan.cost.step_time_s, rel=1e-12)
    assert plan.cost.bubble_s == pytest.approx(again.bubble_s, rel=1e-12) and again.bubble_s > 0


def test_interleaved_bubble_is_smaller_and_gpipe_holds_more_activations(gpt8, h100_32):
    _, graph = gpt8
    cost = {(s, v): price_degrees(graph, h100_32, parse_degrees("pp=2,dp=2,tp=8"), training=Training(micro_batches=8),
                                  schedule=s, virtual_stages=v).plan.cost
            for s, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2))}
    assert cost[("interleaved", 2)].bubble_s < cost[("1f1b", 1)].bubble_s
    assert cost[("gpipe", 1)].memory["activations"] > cost[("1f1b", 1)].memory["activations"]


def test_pipeline_degrees_refused_with_reasons(gpt8, h100_32):
    _, graph = gpt8
    with pytest.raises(PlanningError, match=r"interleaved 1F1B needs the micro-batch count \(6\) to be a multiple "
                                            r"of pp=4"):
        price_degrees(graph, h100_32, parse_degrees("pp=4,tp=8"), training=Training(micro_batches=6),
                      schedule="interleaved", virtual_stages=2)
    with pytest.raises(PlanningError, match="16 stages x 1 virtual stages need as many repeated blocks; gpt has 8"):
        price_degrees(graph, h100_32.resized(32), parse_degrees("pp=16,dp=2"), training=Training(micro_batches=2))
    with pytest.raises(PlanningError, match="virtual_stages 2 needs schedule 'interleaved'"):
        price_degrees(graph, h100_32, parse_degrees("pp=4,tp=8"), virtual_stages=2)


def test_cli_prices_a_pipelined_configuration_with_the_bubble_column(tmp_path, capsys):
    out = tmp_path / "pp.json"
    code = main(["plan", str(GPT), "--preset", "tiny", "--set", "n_layer=8", "--cluster", str(H100),
                 "--degrees", "pp=2,dp=2,tp=8", "--schedule", "interleaved", "--virtual-stages", "2",
                 "--micro-batch-size", "4", "--global-batch-size", "64", "--no-search", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "bubble ms" in text and "pp=2,dp=2,tp=8 --schedule interleaved --virtual-stages 2" in text
    plan = Plan.load(out)
    assert plan.mesh.axis_names == ("pp", "dp", "tp") and plan.training.micro_batches == 8
    assert plan.cost.bubble_s > 0
    code = main(["run", str(out), "--nproc", "2"])     # run takes pipelined plans, on as many ranks as the mesh
    assert code != 0 and "= 32 devices; run with --nproc 32" in capsys.readouterr().err


def test_compare_chart_shows_the_bubble_as_its_own_segment(tmp_path):
    import pandas as pd

    from autoddl.charts import breakdown_chart

    args = ["compare", str(GPT), "--preset", "tiny", "--set", "n_layer=8", "--cluster", str(H100),
            "--micro-batch-size", "4", "--global-batch-size", "64", "--degrees", "pp=2,dp=2,tp=8", "--schedule",
            "interleaved", "--virtual-stages", "2"]
    assert main(args + ["--no-search", "--csv", str(tmp_path / "pp.csv")]) == 0
    assert main(["plan", *args[1:], "--no-search", "--out", str(tmp_path / "pp.json")]) == 0
    df = pd.read_csv(tmp_path / "pp.csv")
    (given,) = df.itertuples()
    assert given.bubble_ms == pytest.approx(Plan.load(tmp_path / "pp.json").cost.bubble_s * 1e3, rel=1e-9)
    assert given.bubble_ms > 0
    drawn = breakdown_chart(df, "pp", str(tmp_path / "pp.png"))
    assert drawn["pipeline bubble"] == pytest.approx([given.bubble_ms])
    assert drawn["compute"] == pytest.approx([given.compute_ms]) and (tmp_path / "pp.png").stat().st_size > 0
    flat = df.assign(bubble_ms=0.0)                        # no stages: no bubble segment in the legend
    assert "pipeline bubble" not in breakdown_chart(flat, "flat", str(tmp_path / "flat.png"))


# -- the 3-D search ------------------------------------------------------------------------------------

def test_factorisations_keep_tp_in_a_node_and_pp_outermost(h100_32):
    from search.pipeline_search import factorisations

    assert sorted(factorisations(h100_32, 8)) == sorted([
        (4, 8, 1), (8, 4, 1),                          # no tp: dp inside a node (pp=2 x dp=16 is not)
        (2, 8, 2), (4, 4, 2), (8, 2, 2),
        (2, 4, 4), (4, 2, 4), (8, 1, 4),
        (2, 2, 8), (4, 1, 8)])                         # pp=8 x tp=8 would need 64 devices
    assert max(pp for pp, _, _ in factorisations(h100_32, 3)) == 2     # at most one stage per block (and divides)
    unstaged = [f for f in factorisations(h100_32, 8, min_pp=1) if f[0] == 1]   # plans without stages
    assert sorted(unstaged) == [(1, 1, 32), (1, 4, 8), (1, 8, 4), (1, 16, 2), (1, 32, 1)]   # a 1-D mesh may span nodes


def test_one_stage_estimate_is_every_micro_batch_in_a_row(gpt8, h100_32):
    from autoddl.collective_kinds import CollectiveKind
    from costmodel.collectives import cluster_collective_time_s
    from search.pipeline_search import estimate
    from search.planner import inner_tp_plan
    from search.stages import block_costs

    mf, _ = gpt8
    one = mf.with_batch_size(4).trace("float32")             # one dp rank's micro-batch
    inner = inner_tp_plan(one, h100_32, 8, Training())
    costs = block_costs(one, inner, h100_32.resized(8))
    step, _ = estimate(costs, one, inner, h100_32, 1, 4, 8, "dp", "1f1b", 1, 3)
    grads = sum(n.outputs[0].numel for n in one.parameters().values()) / 8 * 4    # fp32, split over tp=8
    sync = cluster_collective_time_s(CollectiveKind.ALL_REDUCE, grads, (1, 4, 8), 1, h100_32)
    # one stage: the 3 micro-batches' blocks back to back, then the gradient all-reduce and the optimizer
    # (the hand count of the gradient bytes splits every parameter over tp: the norms' are not, ~1% here)
    # float32: each micro-step beyond the first adds one float32 gradient add per parameter (its local
    # elements: 4 + 4 read, 4 written), each one op of fixed cost (costmodel/master_passes.py)
    ex, dev = h100_32.executor, h100_32.device
    fixed_s = (h100_32.op_overhead_us + ex.op_forward_us) * 1e-6
    locals_ = [n for block in costs.params for n, _ in block]
    per_step = sum(fixed_s + 12 * n / (dev.memory_bandwidth_gbps * 1e9 * h100_32.efficiency.memory) for n in locals_)
    outside = costs.passes_per_micro_step_s - per_step * h100_32.time_sharing((8,))   # the params outside blocks
    assert 0 <= outside < 0.2 * costs.passes_per_micro_step_s
    passes = 2 * costs.passes_per_micro_step_s
    assert step - 3 * sum(costs.seconds) - costs.optimizer_s - passes == pytest.approx(sync, rel=0.05)
    assert step - sync - costs.optimizer_s - passes == pytest.approx(3 * sum(costs.seconds), rel=1e-3)


def test_fast_estimate_is_near_the_full_price(gpt8, h100_32):
    from search.pipeline_search import estimate
    from search.planner import inner_tp_plan
    from search.stages import block_costs

    mf, graph16 = gpt8
    one = mf.with_batch_size(8).trace("float32")            # one dp rank's micro-batch (of 16 over dp=2)
    inner = inner_tp_plan(one, h100_32, 8, Training())
    costs = block_costs(one, inner, h100_32.resized(8))
    step, memory = estimate(costs, one, inner, h100_32, 2, 2, 8, "dp", "1f1b", 1, 8)
    full = price_degrees(graph16, h100_32, parse_degrees("pp=2,dp=2,tp=8"), training=Training(micro_batches=8)).plan
    assert step == pytest.approx(full.cost.step_time_s, rel=0.15)
    assert memory == pytest.approx(full.cost.memory_bytes_per_device, rel=0.05)


def test_cli_pipeline_search_writes_the_best_3d_plan(tmp_path, capsys):
    out = tmp_path / "p3.json"
    code = main(["plan", str(GPT), "--preset", "tiny", "--set", "n_layer=8", "--cluster", str(H100),
                 "--pipeline", "--global-batch-size", "64", "--micro-batch-size", "2", "--no-search",
                 "--out", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    assert "3-D search, micro-batch size 2:" in err and "priced" in err
    plan = Plan.load(out)
    assert plan.mesh.axis_names[0] == "pp" and plan.cost.fits_memory
    dp = math.prod(d for n, d in zip(plan.mesh.axis_names, plan.mesh.shape) if n in ("dp", "fsdp"))
    assert plan.training.micro_batches == 64 // (2 * dp)
    # without --micro-batch-size: sizes 1 and 2, each traced (the second trace a third batch is read off)
    code = main(["plan", str(GPT), "--preset", "tiny", "--set", "n_layer=4", "--cluster", str(H100), "--pipeline",
                 "--global-batch-size", "64", "--no-search", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "micro-batch size 1:" in err and "micro-batch size 2:" in err
    assert "read off its traces at batches 1 and 2" in err
    code = main(["plan", str(GPT), "--preset", "tiny", "--cluster", str(H100), "--pipeline", "--no-search",
                 "--out", str(out)])
    assert code != 0 and "--pipeline searches pipeline stages for a --global-batch-size" in capsys.readouterr().err
