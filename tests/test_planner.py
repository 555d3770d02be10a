"""Baselines, the planner over meshes, and the plan / compare / explain commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autoddl
from autoddl.api import search_model
from autoddl.cli import main
from autoddl.cluster import Cluster
from autoddl.graph import NodeKind
from autoddl.plan import Plan
from autoddl.training import Training
from autoddl.sbp import B, NdSbp, S
from costmodel.breakdown import plan_cost, predicted_collectives
from search.baselines import baseline_specs, build_baseline, exchanged_specs
from search.formulate import formulate
from search.planner import PlanningError, assignment_plan, search
from search.problem import NoFeasiblePlanError
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
LOCAL = CPU_CLUSTER_PATH
DGX = ROOT / "configs" / "dgx-a100-8.yaml"


@pytest.fixture(scope="module")
def gpt():
    return autoddl.trace_model_file(ROOT / "examples" / "gpt.py", preset="tiny")[1]


@pytest.fixture(scope="module")
def mlp():
    return autoddl.trace_model_file(ROOT / "examples" / "mlp.py", preset="tiny")[1]


@pytest.fixture(scope="module")
def cluster4():
    return Cluster.from_yaml(DGX).resized(4)


def _baseline(graph, cluster, mesh, name):
    form = formulate(graph, cluster, mesh)
    spec = next(s for s in baseline_specs(len(mesh)) if s.name == name)
    base = build_baseline(form, spec)
    sigs = form.signatures(base.assignment) if base.applicable else None
    return form, base, sigs


def _storage(form, sigs, fqn):
    node = next(n for n in form.nodes if n.kind is NodeKind.PARAMETER and n.target == fqn)
    return sigs[node.name].outputs[0]


def test_dp_baseline_splits_batch_and_replicates_weights(gpt, cluster4):
    form, base, sigs = _baseline(gpt, cluster4, (4,), "dp")
    assert base.applicable
    for node in form.nodes:
        if node.kind is NodeKind.INPUT:
            assert sigs[node.name].outputs[0] == NdSbp.of(S(0))
        if node.kind is NodeKind.PARAMETER:
            assert sigs[node.name].outputs[0] == NdSbp.of(B)
        if node.kind is NodeKind.OP and node.op_name == "linear":
            assert sigs[node.name].inputs[0][0] == S(0) and sigs[node.name].inputs[1][0] == B


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_dp_baseline_replicates_constants_and_moves_no_activation(mesh, cluster4):
    """Llama's rotary table (bf16, micro-batch 8) comes from buffers alone: data parallel keeps it whole
    (B) and splits only the batch, so its only collectives are the gradient sync's (the loss rides in
    its first bucket; the greedy once split the table on the sequence and all-to-all'ed every rotary
    product)."""
    from autoddl.loader import load_model_file

    llama = load_model_file(ROOT / "examples" / "llama.py", preset="tiny").with_batch_size(8).trace("bfloat16")
    form, base, sigs = _baseline(llama, cluster4, mesh, "dp")
    inputs = {n.name for n in form.nodes if n.kind is NodeKind.INPUT}
    for node in form.nodes:          # topological: a constant is an op none of whose inputs is data
        if node.kind is NodeKind.OP and any(ref.node in inputs for ref in node.inputs):
            inputs.add(node.name)
        elif node.kind is NodeKind.OP:
            assert all(nd == NdSbp.of(*[B] * len(mesh)) for nd in sigs[node.name].outputs), node.name
    plan = assignment_plan("dp", form, base.assignment, llama.fingerprint(), "llama", cluster4, "adamw", Training())
    kinds = {(c.kind.value, c.phase) for c in predicted_collectives(llama, plan, cluster4)}
    assert kinds == {("all_reduce", "grad_sync")}, kinds


def test_tp_baseline_is_megatron_column_then_row(gpt, cluster4):
    form, base, sigs = _baseline(gpt, cluster4, (4,), "tp")
    assert base.applicable
    for layer in range(2):
        h = f"transformer.h.{layer}"
        assert _storage(form, sigs, f"{h}.attn.c_attn.weight") == NdSbp.of(S(0))   # column parallel
        assert _storage(form, sigs, f"{h}.attn.c_proj.weight") == NdSbp.of(S(1))   # row parallel
        assert _storage(form, sigs, f"{h}.mlp.c_fc.weight") == NdSbp.of(S(0))
        assert _storage(form, sigs, f"{h}.mlp.c_proj.weight") == NdSbp.of(S(1))
    attn = [n for n in form.nodes if n.op_name == "scaled_dot_product_attention"]
    assert attn and all(sigs[n.name].outputs[0] == NdSbp.of(S(1)) for n in attn)      # heads split
    for node in form.nodes:
        if node.kind is NodeKind.INPUT:
            assert sigs[node.name].outputs[0] == NdSbp.of(B)


def test_sp_and_zero3_baselines(gpt, cluster4):
    form, base, sigs = _baseline(gpt, cluster4, (4,), "sp")
    assert base.applicable
    assert all(sigs[n.name].outputs[0] == NdSbp.of(B) for n in form.nodes if n.kind is NodeKind.INPUT)
    form, base, sigs = _baseline(gpt, cluster4, (4,), "zero3")
    wte = _storage(form, sigs, "transformer.wte.weight")
    assert wte == NdSbp.of(S(0))
    lin = next(n for n in form.nodes if n.op_name == "linear")
    assert sigs[lin.name].inputs[1] == NdSbp.of(B)        # gathered for use


@pytest.fixture(scope="module")
def llama():
    return autoddl.trace_model_file(ROOT / "examples" / "llama.py", preset="tiny")[1]


def _op_sig(form, sigs, module_path, op_name="linear"):
    node = next(n for n in form.nodes if n.op_name == op_name and n.module_path == module_path)
    return sigs[node.name]


@pytest.mark.parametrize("model, mesh, axis", [("gpt", (4,), 0), ("gpt", (2,), 0), ("llama", (2,), 0)])
def test_sp_baseline_is_megatron_sequence_parallel(model, mesh, axis, request, cluster4):
    """Megatron SP (Korthikanti et al. 2022): the residual stream and the norms are split on the
    sequence (dim 1), a column-parallel linear takes its input gathered (B) and splits its weight's
    output features, a row-parallel one splits its input features and yields P, which the next op
    takes reduce-scattered onto the sequence; the embedding is vocabulary-parallel (its P output
    reduce-scattered too). Forward collectives: all-gathers and reduce-scatters only.
    (llama tiny has 2 key/value heads: over 4 devices they do not divide, as Megatron needs.)"""
    graph = request.getfixturevalue(model)
    cluster = Cluster.from_yaml(DGX).resized(mesh[0])
    form, base, sigs = _baseline(graph, cluster, mesh, "sp")
    assert base.applicable, base.reason
    if model == "gpt":
        norm, norms = "layer_norm", [f"transformer.h.{i}.ln_{j}" for i in range(2) for j in (1, 2)]
        column = ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc", "lm_head"]
        row = ["transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_proj"]
        embedding = "transformer.wte"
    else:
        norm, norms = "mul", [f"layers.{i}.{n}" for i in range(2) for n in ("attention_norm", "ffn_norm")]
        column = ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.feed_forward.w1", "output"]
        row = ["layers.0.attention.wo", "layers.0.feed_forward.w2"]
        embedding = "tok_embeddings"
    for path in norms:                                    # the stream between TP regions: S(sequence)
        nodes = [n for n in form.nodes if n.module_path == path and n.op_name == norm]
        assert nodes and all(sigs[n.name].outputs[0][axis] == S(1) for n in nodes), path
    for path in column:
        sig = _op_sig(form, sigs, path)
        assert sig.inputs[0][axis] == B and sig.inputs[1][axis] == S(0) and sig.outputs[0][axis] == S(2), path
    for path in row:
        sig = _op_sig(form, sigs, path)
        assert sig.inputs[0][axis] == S(2) and sig.inputs[1][axis] == S(1) and sig.outputs[0][axis].is_partial()
    emb = _op_sig(form, sigs, embedding, "embedding")
    assert emb.inputs[0][axis] == S(0) and emb.outputs[0][axis].is_partial()
    plan = next(s.plan for s in search(graph, cluster, mesh=mesh, cd_time_limit_s=0.1).schemes if s.name == "sp")
    kinds = {c.kind.value for c in predicted_collectives(graph, plan, cluster)
             if c.phase == "forward" and "cross_entropy_loss" not in c.tensor}       # the loss's own aside
    assert kinds == {"all_gather", "reduce_scatter"}


def test_tied_embedding_and_lm_head_share_one_vocab_split(gpt, cluster4):
    """GPT-2's lm_head weight is transformer.wte's: one parameter, two uses. On every tensor-parallel
    baseline both uses take it vocabulary-split as stored (no weight all-gather), so the lm_head's
    logits come out split on the vocabulary."""
    for name, mesh in (("tp", (4,)), ("sp", (4,)), ("dp_tp", (2, 2)), ("fsdp_tp", (2, 2))):
        form, base, sigs = _baseline(gpt, cluster4, mesh, name)
        assert base.applicable, (name, base.reason)
        tp = len(mesh) - 1
        storage = _storage(form, sigs, "transformer.wte.weight")
        assert storage[tp] == S(0), name
        emb = _op_sig(form, sigs, "transformer.wte", "embedding")
        head = _op_sig(form, sigs, "lm_head")
        assert emb.inputs[0][tp] == head.inputs[1][tp] == S(0), name
        assert head.outputs[0][tp] == S(2), name            # logits (B, T, V) split on the vocabulary


def test_tp_not_applicable_without_linear_pairs(cluster4):
    graph = autoddl.trace_model_file(ROOT / "examples" / "resnet.py", preset="tiny")[1]
    _, base, _ = _baseline(graph, cluster4, (4,), "tp")
    assert not base.applicable and "column -> row" in base.reason


def test_found_plan_never_worse_than_any_baseline(gpt, cluster4):
    outcome = search(gpt, cluster4, model_name="gpt")
    found = outcome.found_breakdown.step_time_s
    applicable = [s for s in outcome.schemes if s.name != "found" and s.plan is not None]
    assert {s.name for s in applicable} >= {"dp", "zero3", "tp"}
    for scheme in applicable:
        assert found <= scheme.step_time_s * (1 + 1e-9), scheme.name
    # the stored breakdown is the full cost model's price of the stored plan
    again = plan_cost(gpt, outcome.found, cluster4)
    assert again.step_time_s == pytest.approx(found, rel=1e-12)
    assert set(outcome.meshes) == {(4,), (2, 2)}
    meshes = {s.name: s.plan.mesh.shape for s in applicable}
    assert meshes["dp"] == meshes["zero3"] == meshes["tp"] == (4,) and meshes["dp_tp"] == (2, 2)


def test_dp_tp_replicates_on_dp_axis_and_splits_weights_on_tp_axis(gpt, cluster4):
    form, base, sigs = _baseline(gpt, cluster4, (2, 2), "dp_tp")
    assert base.applicable
    fc = _storage(form, sigs, "transformer.h.0.mlp.c_fc.weight")
    proj = _storage(form, sigs, "transformer.h.0.mlp.c_proj.weight")
    assert fc == NdSbp.of(B, S(0)) and proj == NdSbp.of(B, S(1))
    assert all(sigs[n.name].outputs[0][0] == S(0) for n in form.nodes if n.kind is NodeKind.INPUT)


def test_memory_limit_nothing_fits_names_the_minimum(mlp, cluster4):
    with pytest.raises(NoFeasiblePlanError) as info:
        search(mlp, cluster4, memory_gb=1e-6, price_all_baselines=False)    # estimated, then priced
    assert info.value.min_memory_bytes > 1e3
    with pytest.raises(NoFeasiblePlanError) as every:      # pricing every baseline up front: the same least
        search(mlp, cluster4, memory_gb=1e-6, price_all_baselines=True)
    assert every.value.min_memory_bytes == info.value.min_memory_bytes
    assert " GB" in str(info.value) and "GiB" not in str(info.value) and "--memory-gb" in str(info.value)


def test_mesh_and_devices_errors(mlp):
    cluster = Cluster.from_yaml(DGX)
    with pytest.raises(PlanningError, match="do not match the 8 devices"):
        search(mlp, cluster, mesh=(3, 3))
    with pytest.raises(ValueError, match="3"):
        search_model(mlp, cluster, devices=3)


def test_plan_json_round_trip(gpt, cluster4, tmp_path):
    plan = search(gpt, cluster4, mesh=(4,)).found
    path = tmp_path / "p.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.signatures == plan.signatures and back.param_storage == plan.param_storage
    assert back.mesh == plan.mesh and back.graph_hash == gpt.fingerprint()
    assert list(back.summary().columns)[:6] == ["op", "target", "output_shape", "signature", "compute_us", "comm_us"]
    data = json.loads(path.read_text())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema_version 99"):
        Plan.load(path)


# -- the command line --------------------------------------------------------------------------

def test_cli_plan_explain_compare(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", str(ROOT / "examples" / "gpt.py"), "--preset", "tiny", "--cluster", str(DGX),
               "--devices", "4", "--out", str(out), "--verbose"])
    text = capsys.readouterr().out
    assert rc == 0, text
    for word in ("dp", "zero3", "tp", "found plan", "the speed of the best baseline", "signature"):
        assert word in text
    plan = Plan.load(out)
    assert plan.devices == 4 and plan.model.endswith("gpt.py") and plan.model_args == {"preset": "tiny"}

    assert main(["explain", str(out), "--op", "linear"]) == 0
    text = capsys.readouterr().out
    assert "runner-up" in text and "linear" in text
    assert main(["explain", str(out), "--op", "no_such_op"]) == 2

    png = tmp_path / "cmp.png"
    assert main(["compare", str(ROOT / "examples" / "mlp.py"), "--cluster", str(DGX), "--devices", "4",
                 "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, words", [
    (["--devices", "3"], ["3", "devices"]),
    (["--mesh", "3x3"], ["3x3", "multiply to 8"]),
    (["--memory-gb", "0.000001"], ["no plan fits", "0.000 GB"]),
])
def test_cli_errors_are_one_line_exit_2(argv, words, capsys):
    rc = main(["plan", str(ROOT / "examples" / "mlp.py"), "--cluster", str(DGX), "--out", "/dev/null"] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]               # progress lines come first
    assert last.startswith("autoddl: error:")
    for word in words:
        assert word in last


def test_cli_untraceable_model_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom torch import nn\n"
                   "class M(nn.Module):\n    def forward(self, x):\n"
                   "        return x * 2 if x.sum() > 0 else x\n"
                   "def build_model():\n    return M()\n"
                   "def example_inputs():\n    return (torch.randn(4, 4),)\n")
    rc = main(["plan", str(bad), "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "bad" in err and "Traceback" not in err


def test_cli_plan_says_what_it_planned_and_what_to_run_next(tmp_path, capsys):
    """--devices beyond one node of the cluster file: the header says the cluster really planned,
    and the plan ends with the commands to explain and run it (one `autoddl run` per node)."""
    out = tmp_path / "plan.json"
    assert main(["plan", str(ROOT / "examples" / "mlp.py"), "--cluster", str(DGX), "--devices", "16",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "planned:  2x8 of dgx-a100-8 (--devices 16)" in text
    nxt = text[text.index("next:"):].splitlines()
    assert nxt[1].split()[:3] == ["autoddl", "explain", str(out)]
    assert f"autoddl run {out} --nproc 8 --nnodes 2 " in nxt[3] and "--check --reference ddp" in nxt[3]


def test_cli_unknown_scheme_is_refused_before_any_work(capsys):
    rc = main(["plan", str(ROOT / "examples" / "gpt.py"), "--scheme", "pp"])
    captured = capsys.readouterr()
    assert rc == 2 and "invalid choice: 'pp'" in captured.err
    assert "model:" not in captured.out + captured.err          # refused while parsing: nothing traced


def test_cli_explain_fits_100_columns_names_modules_and_weight_layouts(tmp_path, capsys):
    """explain: the plan in words first; every line within 100 columns unless --wide; --op takes a
    module path or a parameter name; each weight's storage -> use layout is shown."""
    out = tmp_path / "tp.json"
    assert main(["plan", str(ROOT / "examples" / "gpt.py"), "--preset", "tiny", "--cluster", str(DGX),
                 "--devices", "2", "--scheme", "tp", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("tensor parallel over 2: Plan 'tp'")
    assert max(len(line) for line in text.splitlines()) <= 100
    plan = Plan.load(out)
    assert main(["explain", str(out), "--op", "transformer.h.0.mlp", "--wide"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "(transformer.h.0.mlp." in line]
    assert [r.split()[1] for r in rows] == ["(transformer.h.0.mlp.c_fc)", "(transformer.h.0.mlp.gelu)",
                                           "(transformer.h.0.mlp.c_proj)"]
    fc = "transformer.h.0.mlp.c_fc.weight"
    assert f"{fc}: {plan.param_storage[fc]} -> " in rows[0]
    assert main(["explain", str(out), "--op", fc]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.startswith("linear")]) == 1     # the one op reading it


def _two_hosts_at_10_gbit() -> Cluster:
    """configs/two-hosts.yaml with the link between the hosts as the two-hosts study calibrated it at
    10 Gbit/s (benchmarks/two_hosts_study.py's ``cluster_for_rate``: ``python benchmarks/two_hosts.py
    --rate-mbit 10000 -- -m autoddl calibrate --across-hosts``, 2026-11-23 16:35, links.inter_node:
    median over the 5 kinds, 0.3296 GB/s per device, 868.7 us; the cluster of results/two_hosts.csv's
    10 Gbit/s rows)."""
    d = Cluster.from_yaml(ROOT / "configs" / "two-hosts.yaml").to_dict()
    d["links"]["inter_node"] = {"bandwidth_gbps": 0.3296, "latency_us": 868.7}
    d["links"]["intra_node"].pop("cpu_ns_per_byte", None)      # that calibration priced no CPU per byte
    return Cluster.from_dict(d, "two-hosts at 10 Gbit/s")


def test_search_reaches_tp_across_the_hosts_when_the_cost_model_ranks_it_first():
    """Issue 14: llama tiny at 256 wide on two hosts at 10 Gbit/s (benchmarks/two_hosts_study.py's
    MODELS). dp_tp with its mesh axes swapped (tp_dp: Megatron across the link, data parallel inside
    the hosts) is cheaper under the full cost model than every plan the descent reached from the
    baselines; the search now starts from it too and prices it, and returns it."""
    graph = autoddl.trace_model_file(ROOT / "examples" / "llama.py", preset="tiny", dim=256, ffn_dim=768,
                                     batch_size=8)[1]
    cluster = _two_hosts_at_10_gbit()
    assert cluster.link_for_axis((2, 2), 0) == cluster.inter_node != cluster.link_for_axis((2, 2), 1)
    outcome = search(graph, cluster, model_name="llama", mesh=(2, 2))
    schemes = {s.name: s for s in outcome.schemes}
    assert "tp_dp" not in schemes                  # a start and a candidate, not a baseline of the table
    form = outcome.formulations[(2, 2)]
    spec = next(s for s in exchanged_specs(2) if s.name == "tp_dp")
    assert spec.roles == ("tp", "dp")
    tp_dp = assignment_plan("tp_dp", form, build_baseline(form, spec).assignment, graph.fingerprint(), "llama",
                            cluster, "adamw", Training())
    dp_tp = schemes["dp_tp"].plan

    def swapped(nd):
        return NdSbp(tuple(reversed(nd.sbps)))
    assert tp_dp.signatures == {k: type(s)(tuple(map(swapped, s.inputs)), tuple(map(swapped, s.outputs)))
                                for k, s in dp_tp.signatures.items()}          # the study's tp_dp exactly
    tp_dp_s = plan_cost(graph, tp_dp, cluster).step_time_s
    found = outcome.found_breakdown.step_time_s
    assert found <= tp_dp_s * (1 + 1e-9) < schemes["dp_tp"].step_time_s      # was dp_tp's, 7% above tp_dp
    sigs, storage = outcome.found.signatures, outcome.found.param_storage
    assert storage["layers.0.attention.wq.weight"] == NdSbp.of(S(0), B)       # column parallel on axis 0
    assert storage["layers.0.attention.wo.weight"] == NdSbp.of(S(1), B)       # row parallel on axis 0
    assert storage["layers.0.feed_forward.w2.weight"] == NdSbp.of(S(1), B)
    tokens = next(n for n in form.nodes if n.kind is NodeKind.INPUT)
    assert sigs[tokens.name].outputs[0] == NdSbp.of(B, S(0))                  # the batch split inside the hosts
    assert any("tp_dp start" in note for note in outcome.found.notes)
