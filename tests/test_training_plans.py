"""Training settings through the planner (issue 10): precision, recompute (auto too), micro-batches,
batch sizes, throughput, --degrees and compare's variants. Values are hand-computed from the cost
model's own functions on tiny models, on one device where the expected number must not depend on
what the search chooses."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from autoddl.cli import main
from autoddl.cluster import Cluster
from autoddl.graph import NodeKind
from autoddl.loader import ModelFileError, load_for_plan, load_model_file
from autoddl.plan import Plan
from autoddl.program import recomputed_ops, signature_of
from autoddl.sbp import S
from autoddl.training import Training
from costmodel.breakdown import plan_cost
from costmodel.compute import op_compute_time_s, op_forward_time_s, optimizer_state_bytes
from search.formulate import formulate, param_state_bytes
from search.planner import (PlanningError, at_level, memory_at_levels, parse_degrees, plan_memory, price_degrees,
                            recompute_levels, search, with_training)

ROOT = Path(__file__).resolve().parents[1]
DGX = ROOT / "configs" / "dgx-a100-8.yaml"
H100 = ROOT / "configs" / "h100-4x8.yaml"
GPT = ROOT / "examples" / "gpt.py"
MLP = ROOT / "examples" / "mlp.py"
FAST = 0.05          # coordinate descent's restart budget in these tests (seconds)

LINEARS = """
    import torch
    from torch import nn

    def build_model():
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))

    def example_inputs():
        return (torch.randn(8, 64),)
"""


def _cluster(devices: int, path: Path = DGX) -> Cluster:
    return Cluster.from_yaml(path).resized(devices)


@pytest.fixture(scope="module")
def one():
    return _cluster(1)


@pytest.fixture(scope="module")
def gpt4():
    """gpt tiny with 4 blocks, bf16: (ModelFile, graph)."""
    mf = load_model_file(GPT, preset="tiny", n_layer=4)
    return mf, mf.trace("bfloat16")


def _found(graph, cluster, training, **kw):
    return search(graph, cluster, training=training, cd_time_limit_s=FAST, **kw)


# -- precision ------------------------------------------------------------------------------------

def test_param_state_bytes_counts_float32_masters_gradients_states_and_the_working_copy():
    assert param_state_bytes(10, Training(), "adamw") == 10 * (4 + 4 + 8)
    assert param_state_bytes(10, Training(param_dtype="bf16"), "adamw") == 10 * (4 + 4 + 8 + 2)
    assert param_state_bytes(10, Training(param_dtype="fp16"), "sgd") == 10 * (4 + 4 + 2)


def test_bf16_plan_keeps_4_byte_masters_and_halves_activations_of_linear_layers(write_model, one):
    path = write_model(LINEARS)
    mf = load_model_file(path)
    numel = sum(p.numel() for p in mf.model.parameters())
    costs = {}
    for dtype in ("fp32", "bf16"):
        graph = mf.trace(Training(param_dtype=dtype).param_dtype)
        found = _found(graph, one, Training(param_dtype=dtype)).found
        assert found.training.param_dtype == Training(param_dtype=dtype).param_dtype   # the plan carries it
        costs[dtype] = plan_cost(graph, found, one).memory
        # the search's parameter memory is the same formula
        form = formulate(graph, one, (1,), training=found.training)
        p = next(i for i, n in enumerate(form.nodes) if n.kind is NodeKind.PARAMETER)
        n_p = form.nodes[p].outputs[0].numel
        assert form.problem.node_mem[p][0] == pytest.approx(
            n_p * (8 + (2 if dtype == "bf16" else 0)) + optimizer_state_bytes(n_p, "adamw"))
    fp32, bf16 = costs["fp32"], costs["bf16"]
    assert bf16["parameters"] == fp32["parameters"] == 4 * numel          # float32 masters either way
    assert bf16["gradients"] == 4 * numel and bf16["optimizer_states"] == 8 * numel
    assert bf16["working_params"] == 2 * numel and fp32["working_params"] == 0
    assert fp32["activations"] > 0 and bf16["activations"] * 2 == fp32["activations"]


# -- recompute ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recompute_lowers_activations_and_adds_the_recomputed_forward_time(gpt4, one, policy):
    _, graph = gpt4
    base = _found(graph, one, Training(param_dtype="bf16")).found
    plan = with_training(base, dataclasses.replace(base.training, recompute=policy))
    none_bd, bd = plan_cost(graph, base, one), plan_cost(graph, plan, one)
    recomputed = [n for ops in recomputed_ops(graph, plan).values() for n in ops]
    assert recomputed and len(recomputed_ops(graph, plan)) == 4           # every block
    extra = sum(op_forward_time_s(n, signature_of(plan, n), (1,), one) for n in recomputed)
    assert bd.step_time_s - none_bd.step_time_s == pytest.approx(extra, rel=1e-9)
    assert bd.memory["activations"] < none_bd.memory["activations"]
    assert bd.memory["recomputed"] > 0 == none_bd.memory["recomputed"]
    # the search's objective: a recomputed op costs its forward once more, and saves nothing
    # that only its own block reads
    form = formulate(graph, one, (1,), training=plan.training)
    names = {n.name for n in recomputed}
    for i, node in enumerate(form.nodes):
        if node.kind is NodeKind.OP and node.name in names:
            sig = form.problem.choices[i][0]
            assert form.problem.node_cost[i][0] == pytest.approx(
                op_compute_time_s(node, sig, (1,), one, needs_backward=True) + op_forward_time_s(node, sig, (1,), one))
    plain = formulate(graph, one, (1,), training=base.training)
    assert form.problem.min_memory() < plain.problem.min_memory()


def test_micro_batches_scale_compute_but_sync_gradients_once(gpt4):
    _, graph = gpt4
    two = _cluster(2)
    dp = next(s for s in _found(graph, two, Training(param_dtype="bf16"), mesh=(2,)).schemes if s.name == "dp").plan
    bds = {k: plan_cost(graph, with_training(dp, dataclasses.replace(dp.training, micro_batches=k)), two)
           for k in (1, 4)}
    assert bds[4].compute_s == pytest.approx(4 * bds[1].compute_s, rel=1e-9)
    syncs = {k: bd.collective_summary()["grad_sync"] for k, bd in bds.items()}
    assert syncs[4] == syncs[1] and set(syncs[1]) == {"all_reduce"}        # one gradient all-reduce per step
    # the search's objective: op costs x 4, a dp parameter's gradient all-reduce x 1
    forms = {k: formulate(graph, two, (2,), training=Training(param_dtype="bf16", micro_batches=k)) for k in (1, 4)}
    for i, node in enumerate(forms[1].nodes):
        if node.kind is NodeKind.OP:
            assert forms[4].problem.node_cost[i] == pytest.approx(4 * forms[1].problem.node_cost[i])
    param = next(n for n in forms[1].nodes if n.kind is NodeKind.PARAMETER and n.target.endswith("c_fc.weight"))
    p = forms[1].index[param.name]
    (v, m1), m4 = [(v, m) for u, v, m in forms[1].problem.edges if u == p][0], \
        [m for u, _, m in forms[4].problem.edges if u == p][0]
    slot = next(i for i, ref in enumerate(forms[1].nodes[v].inputs) if ref.node == param.name)
    stored_b = [j for j, s in enumerate(forms[1].problem.choices[p]) if s.outputs[0][0].is_broadcast()]
    used_b = [j for j, s in enumerate(forms[1].problem.choices[v]) if s.inputs[slot][0].is_broadcast()]
    dp_edge = m1[:, used_b][stored_b]          # replicated weight used whole: its gradient's all-reduce only
    assert (dp_edge > 0).any() and m4[:, used_b][stored_b] == pytest.approx(dp_edge)


def test_recompute_levels_go_selective_then_full_in_block_order(gpt4):
    _, graph = gpt4
    levels = recompute_levels(graph, Training(recompute="auto"))
    blocks = [f"transformer.h.{i}" for i in range(4)]
    assert len(levels) == 9 and set(levels[0].values()) == {"none"} and list(levels[0]) == blocks
    assert levels[1] == {blocks[0]: "selective", **{b: "none" for b in blocks[1:]}}
    assert set(levels[4].values()) == {"selective"}
    assert levels[5] == {blocks[0]: "full", **{b: "selective" for b in blocks[1:]}}
    assert set(levels[8].values()) == {"full"}
    pinned = recompute_levels(graph, Training(recompute="auto", recompute_blocks={blocks[0]: "none"}))
    assert len(pinned) == 7 and all(level[blocks[0]] == "none" for level in pinned)


def test_memory_by_recompute_level_is_the_full_cost_models(gpt4):
    """auto's bisection lowers a plan once and recounts only activations and recomputed bytes per
    level: the same bytes as lowering and counting everything again."""
    _, graph = gpt4
    cluster = _cluster(4)
    outcome = _found(graph, cluster, Training(param_dtype="bf16"), mesh=(4,))
    levels = recompute_levels(graph, Training(recompute="auto"))
    for scheme in ("zero3", "tp", "found"):
        plan = next(s for s in outcome.schemes if s.name == scheme).plan
        memory = memory_at_levels(graph, plan, cluster)
        for level in levels[::2]:
            training = at_level(plan.training, level)
            assert memory(training) == plan_memory(graph, with_training(plan, training), cluster)


def test_auto_recomputes_the_fewest_blocks_that_fit_the_memory_limit(gpt4, one):
    _, graph = gpt4
    tr = Training(param_dtype="bf16")
    none = _found(graph, one, tr)
    full = plan_cost(graph, with_training(none.found, dataclasses.replace(tr, recompute="full")), one)
    limit = (none.found_breakdown.memory_bytes_per_device + full.memory_bytes_per_device) / 2
    auto = _found(graph, one, dataclasses.replace(tr, recompute="auto"), memory_gb=limit / 1e9)
    chosen = auto.found.training.recompute_blocks
    levels = recompute_levels(graph, dataclasses.replace(tr, recompute="auto"))
    fits = [plan_memory(graph, with_training(auto.found, dataclasses.replace(auto.found.training,
                                                                             recompute_blocks=lv)), one) <= limit
            for lv in levels]
    first = fits.index(True)
    assert 0 < first < len(levels) - 1 and chosen == levels[first]           # neither none nor everything full
    assert auto.found_breakdown.fits_memory and auto.found_breakdown.memory_bytes_per_device <= limit
    assert any("recompute auto" in note and "over the" in note for note in auto.found.notes)
    # every baseline took its own fewest blocks too, and carries the setting
    assert all(s.plan.training.recompute == "auto" for s in auto.schemes if s.plan is not None)


# -- throughput -----------------------------------------------------------------------------------

def test_tokens_per_s_is_the_global_batch_tokens_over_the_step_time(gpt4):
    mf, graph = gpt4
    cluster = _cluster(2)
    found = _found(graph, cluster, Training(param_dtype="bf16", micro_batches=3), mesh=(2,)).found
    c = found.cost
    b, t = mf.example_inputs[0].shape
    assert c.samples_per_s is None and c.tokens_per_s == pytest.approx(b * t * 3 / c.step_time_s)
    flops = sum(n.flops for n in graph.ops())
    assert c.model_tflops_per_device == pytest.approx(3 * flops * 3 / c.step_time_s / 2 / 1e12)


def test_samples_per_s_for_float_inputs(one):
    mf = load_model_file(MLP, preset="tiny")
    graph = mf.trace()
    c = _found(graph, one, Training(micro_batches=2)).found.cost
    assert c.tokens_per_s is None and c.samples_per_s == pytest.approx(mf.batch_size * 2 / c.step_time_s)


# -- batch sizes ----------------------------------------------------------------------------------

def test_with_batch_size_repeats_or_cuts_every_input_and_target():
    mf = load_model_file(GPT, preset="tiny")
    assert mf.batch_size == 4
    big, small = mf.with_batch_size(10), mf.with_batch_size(2)
    assert [tuple(t.shape) for t in big.example_inputs] == [(10, 32), (10, 32)]
    assert [tuple(t.shape) for t in small.example_inputs] == [(2, 32), (2, 32)]
    assert big.example_inputs.n_args == mf.example_inputs.n_args and mf.with_batch_size(4) is mf
    cpu = load_model_file(GPT, preset="tiny", device="cpu")
    assert (cpu.with_batch_size(6).example_inputs[0][4:] == cpu.example_inputs[0][:2]).all()   # repeated


@pytest.mark.parametrize("inputs, words", [
    ("(torch.randn(8, 4), torch.tensor(3.0))", ["'input_1'", "0-d", "no batch dim"]),
    ("(torch.randn(8, 4), torch.randn(6, 4))", ["'input_1' (6)", "'x' (8)", "batch-first"]),
])
def test_with_batch_size_errors_name_the_input(write_model, inputs, words):
    path = write_model(f"""
        import torch
        from torch import nn

        class M(nn.Module):
            def forward(self, x, *rest):
                return x

        def build_model():
            return M()

        def example_inputs():
            return {inputs}
    """)
    with pytest.raises(ModelFileError) as err:
        load_model_file(path).with_batch_size(16)
    for word in words:
        assert word in str(err.value)


def test_cli_batch_flags_set_the_traced_batch_and_the_micro_steps(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(GPT), "--preset", "tiny", "--cluster", str(DGX), "--devices", "4", "--mesh", "4",
                 "--precision", "bf16", "--recompute", "selective", "--micro-batch-size", "2",
                 "--global-batch-size", "24", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "micro-step batch 8" in text and "3 micro-steps, global batch 24" in text and "tok/s/dev" in text
    plan = Plan.load(out)
    assert plan.batch_size == 8 and plan.training.micro_batches == 3
    assert plan.training.param_dtype == "bfloat16" and plan.training.recompute == "selective"
    saved = json.loads(out.read_text())["cost"]
    assert saved["tokens_per_s"] == pytest.approx(24 * 32 / saved["step_time_s"])
    mf = load_for_plan(plan)                                  # what explain and the executor trace
    assert mf.batch_size == 8 and mf.trace(plan.training.param_dtype).fingerprint() == plan.graph_hash
    assert main(["explain", str(out)]) == 0


@pytest.mark.parametrize("argv, words", [
    (["--micro-batch-size", "3", "--global-batch-size", "16"],
     ["--global-batch-size 16", "--micro-batch-size 3", "degree 4 = 12", "not a positive integer"]),
    (["--global-batch-size", "6"], ["--global-batch-size 6", "data-parallel degree 4"]),
    (["--micro-batch-size", "0"], ["--micro-batch-size 0", "positive"]),
])
def test_cli_batch_errors(argv, words, capsys):
    rc = main(["plan", str(GPT), "--preset", "tiny", "--cluster", str(DGX), "--devices", "4", "--out", "/dev/null"]
              + argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    for word in words:
        assert word in err


# -- --degrees ------------------------------------------------------------------------------------

def test_fsdp_tp_baseline_shards_the_outer_axis_and_splits_weights_inside(gpt4):
    _, graph = gpt4
    outcome = _found(graph, _cluster(4), Training(param_dtype="bf16"), mesh=(2, 2))
    plan = next(s for s in outcome.schemes if s.name == "fsdp_tp").plan
    assert plan.mesh.axis_names == ("fsdp", "tp")
    column, row = (plan.param_storage[f"transformer.h.0.mlp.{m}.weight"] for m in ("c_fc", "c_proj"))
    assert column[1] == S(0) and row[1] == S(1)              # Megatron inside: column then row parallel
    # FSDP: every weight sharded on the outer axis, on a dim tp does not split (S(0) inside S(0) would
    # nest the wrong way for tp's piece): each use is one all-gather over fsdp, as FSDP2 over tp
    assert column[0] == S(1) and row[0] == S(0)


def test_degrees_price_the_given_configuration_beside_the_found_plan(tmp_path, capsys):
    out = tmp_path / "given.json"
    assert main(["plan", str(GPT), "--preset", "tiny", "--cluster", str(DGX), "--devices", "4", "--mesh", "2x2",
                 "--precision", "bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
                 "--degrees", "fsdp=2,tp=2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0] for line in text.splitlines() if line.split()[:1]}
    assert {"found", "fsdp_tp", "fsdp=2,tp=2"} <= rows and "given fsdp=2,tp=2" in text
    plan = Plan.load(out)                                    # --out writes the given configuration
    assert plan.name == "fsdp_tp" and plan.mesh.shape == (2, 2) and plan.mesh.axis_names == ("fsdp", "tp")
    # the batch splits over fsdp only: 1 x 2 per micro-step, 4 micro-steps
    assert plan.batch_size == 2 and plan.training.micro_batches == 4
    assert main(["plan", str(GPT), "--preset", "tiny", "--cluster", str(DGX), "--devices", "4",
                 "--degrees", "dp=4", "--no-search", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dp=4" in text and "found plan" not in text and Plan.load(out).name == "dp"


@pytest.mark.parametrize("degrees, words", [
    ("xp=2,tp=4", ["unknown role 'xp'", "pp, dp, fsdp, tp"]),
    ("dp=2,tp=2", ["dp=2 x tp=2 = 4 devices", "has 8"]),
    ("dp=3,tp=8", ["dp=3 does not divide the 8 devices"]),
    ("tp=4,dp=2", ["tp must be the innermost"]),
    ("dp=2,dp=4", ["given twice"]),
    ("dp=two", ["not a positive integer"]),
])
def test_degrees_errors(degrees, words, capsys):
    rc = main(["plan", str(MLP), "--cluster", str(DGX), "--degrees", degrees, "--no-search", "--out", "/dev/null"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    for word in words:
        assert word in err


def test_degrees_inner_axis_must_stay_inside_a_node_and_the_baseline_must_apply(write_model):
    cluster = _cluster(32, H100)
    with pytest.raises(PlanningError, match="innermost degree tp=16 must divide the 8 devices of a node"):
        from search.planner import degrees_spec
        degrees_spec(parse_degrees("dp=2,tp=16"), cluster)
    one_linear = load_model_file(write_model("""
        import torch
        from torch import nn

        def build_model():
            return nn.Linear(64, 64)

        def example_inputs():
            return (torch.randn(8, 64),)
    """)).trace()
    with pytest.raises(PlanningError, match="does not apply to .*no column -> row parallel linear pair"):
        price_degrees(one_linear, _cluster(4), parse_degrees("tp=4"))


# -- compare --------------------------------------------------------------------------------------

def test_compare_variants_show_precision_x_recompute_with_memory_breakdown(tmp_path, capsys):
    csv = tmp_path / "variants.csv"
    assert main(["compare", str(GPT), "--preset", "tiny", "--cluster", str(DGX), "--devices", "2", "--mesh", "2",
                 "--variants", "--memory-breakdown", "--csv", str(csv)]) == 0
    text = capsys.readouterr().out
    for label in ("fp32/none", "fp32/selective", "fp32/full", "bf16/none", "bf16/selective", "bf16/full"):
        assert label in text
    for column in ("params GB", "grads GB", "optim GB", "activ GB", "other GB"):
        assert column in text
    import pandas as pd

    df = pd.read_csv(csv)
    assert len(df[df["scheme"] == "found"]) == 6
    dp = df[df["scheme"] == "dp"].set_index("variant")
    assert dp.loc["bf16/none", "activ_gb"] < dp.loc["fp32/none", "activ_gb"]
    assert dp.loc["fp32/full", "activ_gb"] < dp.loc["fp32/selective", "activ_gb"] < dp.loc["fp32/none", "activ_gb"]
    assert dp.loc["fp32/none", "step_ms"] < dp.loc["fp32/selective", "step_ms"] < dp.loc["fp32/full", "step_ms"]
    assert math.isclose(dp.loc["bf16/none", "params_gb"], dp.loc["fp32/none", "params_gb"] * 1.5,
                        rel_tol=1e-9)                   # float32 masters + bf16 working copies (4 + 2 bytes)


# -- ZeRO-1 / ZeRO-2 -------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_stages_shard_optimizer_states_and_gradients_and_gather_parameters_after_the_step(write_model,
                                                                                               precision):
    """On 2 devices, ZeRO-1 halves the optimizer states (and, with bf16, the float32 masters), ZeRO-2
    the gradients too; the step ends with one all-gather of the updated parameters, in the working
    dtype, of the whole model's bytes; ZeRO-1 still all-reduces the gradients, ZeRO-2
    reduce-scatters them."""
    from autoddl.program import lower
    from search.zero import with_zero

    mf = load_model_file(write_model(LINEARS))
    training = Training(param_dtype=precision)
    graph = mf.trace(training.param_dtype)
    two = _cluster(2)
    dp = next(s for s in _found(graph, two, training, mesh=(2,)).schemes if s.name == "dp").plan
    numel = sum(p.numel() for p in mf.model.parameters())
    working = 2 if precision == "bf16" else 4
    memory = {stage: plan_cost(graph, with_zero(graph, dp, stage) if stage else dp, two).memory for stage in (0, 1, 2)}
    assert memory[0]["optimizer_states"] == 8 * numel and memory[1]["optimizer_states"] == memory[2]["optimizer_states"] == 4 * numel
    assert memory[0]["gradients"] == memory[1]["gradients"] == 4 * numel and memory[2]["gradients"] == 2 * numel
    masters = 2 * numel if precision == "bf16" else 4 * numel       # bf16: fp32 masters only in the shards
    assert memory[1]["parameters"] == memory[2]["parameters"] == masters
    for stage, grad_kind in ((1, "all_reduce"), (2, "reduce_scatter")):
        program = lower(graph, with_zero(graph, dp, stage))
        syncs = [t for t in program.collectives() if t.phase == "grad_sync"]
        assert {t.collective.value for t in syncs} == {grad_kind}
        gathers = [t for t in program.collectives() if t.phase == "optimizer"]
        assert [(t.collective.value, t.nbytes) for t in gathers] == [("all_gather", numel * working)]


def test_zero_schemes_and_degrees(write_model, capsys):
    """``zero1`` / ``zero2`` are schemes of the plan table, ``--degrees dp=2 --zero 2`` prices that
    configuration, and ``--zero`` with fsdp is refused, saying why."""
    path = write_model(LINEARS)
    assert main(["plan", str(path), "--cluster", str(DGX), "--devices", "2", "--degrees", "dp=2", "--zero", "2",
                 "--out", str(path.with_name("z.json"))]) == 0
    out = capsys.readouterr().out
    assert "zero1 " in out and "zero2 " in out and "dp=2 --zero 2" in out
    plan = Plan.load(path.with_name("z.json"))
    assert plan.grad_storage and plan.grad_storage == plan.optimizer_storage
    assert main(["plan", str(path), "--cluster", str(DGX), "--devices", "2", "--degrees", "fsdp=2", "--zero", "1",
                 "--no-search"]) == 2
    assert "fsdp already shards" in capsys.readouterr().err
