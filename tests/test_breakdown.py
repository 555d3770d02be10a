"""plan_cost / predicted_collectives on hand-built plans: data parallel, Megatron, ZeRO-3, GPT memory."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import autoddl
from autoddl.program import lower
from autoddl.cluster import CollectiveFits, ExecutorOverheads, DEFAULT_CLUSTER_PATH, CONFIG_DIR, Cluster
from autoddl.graph import NodeKind, OpGraph
from autoddl.plan import Mesh, Plan
from autoddl.sbp import B, P, S, NdSbp, Signature
from autoddl.training import Training
from costmodel import CollectiveKind, op_compute_time_s, plan_cost, predicted_collectives
from costmodel.compute import ZERO_COST
from clusters import CPU_CLUSTER_PATH

K = CollectiveKind
ROOT = Path(__file__).resolve().parents[1]


def nd(*sbps):
    return NdSbp(tuple(sbps))


def sum_loss(out, *inputs):
    return out.sum()


def batch_split_plan(graph: OpGraph, n: int, storage: NdSbp, name: str, optimizer: str = "adamw") -> Plan:
    """1-D mesh of n: user inputs S(0); an op with a batch-split input outputs S(0) (scalars P),
    reads other inputs (parameters, positions) as B; parameters stored as ``storage``."""
    split: set[tuple[str, int]] = set()
    sigs: dict[str, Signature] = {}
    for node in graph.topo():
        if node.kind is NodeKind.INPUT:
            ok = node.outputs[0].ndim >= 1 and node.outputs[0].shape[0] % n == 0
            sigs[node.name] = Signature((), (nd(S(0) if ok else B),))
            if ok:
                split.add((node.name, 0))
        elif node.kind is NodeKind.BUFFER:
            sigs[node.name] = Signature((), (nd(B),))
        elif node.is_op:
            ins = tuple(nd(S(0)) if (r.node, r.index) in split else nd(B) for r in node.inputs)
            batched = any((r.node, r.index) in split for r in node.inputs)
            outs = []
            for i, o in enumerate(node.outputs):
                if batched and o.ndim >= 1:
                    outs.append(nd(S(0)))
                    split.add((node.name, i))
                else:
                    outs.append(nd(P) if batched else nd(B))
            sigs[node.name] = Signature(ins, tuple(outs))
    return Plan(name=name, mesh=Mesh((n,)), signatures=sigs,
                param_storage={fqn: storage for fqn in graph.parameters()}, graph_hash=graph.fingerprint(),
                optimizer=optimizer)


def mlp_graph(batch=16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    return autoddl.trace(model, (torch.randn(batch, 32),), sum_loss, name="mlp")


@pytest.fixture(scope="module")
def a100():
    """dgx-a100-8 without its collectives' share of the compute stream (tests/test_collective_cpu.py
    prices that), so step times follow the overlap of the streams alone."""
    cluster = Cluster.from_yaml(DEFAULT_CLUSTER_PATH)
    return dataclasses.replace(cluster, executor=dataclasses.replace(cluster.executor, collective_compute_share=0.0))


@pytest.fixture(scope="module")
def cpu2():
    """local-cpu on 2 devices without its calibrated per-kind fits and executor costs, so times
    follow the link formulas."""
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(2)
    return dataclasses.replace(cluster, collectives=CollectiveFits(), executor=ExecutorOverheads(), cores_per_node=None)


def _ar(nbytes, n, link, eff):
    b, a = link.bandwidth_gbps * 1e9 * eff, link.latency_us * 1e-6
    return 2 * (n - 1) / n * nbytes / b + 2 * (n - 1) * a


# -- data parallel -------------------------------------------------------------------
def _bucket_copies_s(g, cluster) -> float:
    """Each float32 gradient, and the P loss that rides in the bucket (one element), copied into its
    bucket (costmodel/copy_passes.py): its bytes read and written at the memory roofline, plus the
    cluster's per-op overhead (no measured copy family)."""
    bw = cluster.device.memory_bandwidth_gbps * 1e9 * cluster.efficiency.memory
    sizes = [p.outputs[0].nbytes for p in g.parameters().values()] + [4]
    return sum(2 * nbytes / bw + cluster.op_overhead_us * 1e-6 for nbytes in sizes)


def test_data_parallel_mlp(a100):
    g = mlp_graph()
    n = a100.num_devices
    plan = batch_split_plan(g, n, nd(B), "dp")
    cost = plan_cost(g, plan, a100)
    params = g.parameters()
    total = sum(p.outputs[0].nbytes for p in params.values())    # 12,608 bytes: one bucket (< 1 MB)
    # the P loss (every rank reports it) rides in that bucket as one more float32 element
    expected_sync = _ar(total + 4, n, a100.intra_node, a100.efficiency.network)
    assert cost.grad_sync_s == pytest.approx(expected_sync, rel=1e-12)
    assert cost.boxing_forward_s == 0 and cost.boxing_backward_s == 0
    colls = predicted_collectives(g, plan, a100)
    assert Counter((c.kind, c.phase, c.tensor, c.bytes) for c in colls) == Counter(
        [(K.ALL_REDUCE, "grad_sync", "bucket0", total + 4)])
    # compute: every op's forward, plus backward for those downstream of a parameter
    expected_compute = sum(op_compute_time_s(op, plan.signatures[op.name], (n,), a100) for op in g.ops())
    assert cost.compute_s == pytest.approx(expected_compute)
    bw = a100.device.memory_bandwidth_gbps * 1e9 * a100.efficiency.memory
    copies = _bucket_copies_s(g, a100)
    assert cost.optimizer_s == pytest.approx(20 * g.parameter_bytes / bw + copies)  # foreach AdamW, replicated params
    # the one bucket is ready only when the first layer's backward is done: nothing overlaps it
    assert cost.step_time_s == pytest.approx(cost.compute_s + cost.grad_sync_s + cost.optimizer_s)
    assert cost.exposed_comm_s == pytest.approx(cost.grad_sync_s)
    assert cost.comm_s == pytest.approx(cost.grad_sync_s)
    # per-op table: one row per op, comm charged to the consuming ops adds up to comm_s
    assert list(cost.per_op["op"]) == [op.name for op in g.ops()]
    assert cost.per_op["comm_us"].sum() == pytest.approx(cost.comm_s * 1e6)
    assert cost.per_op["compute_us"].sum() == pytest.approx(cost.compute_s * 1e6)
    d = json.loads(json.dumps(cost.to_dict()))
    assert d["grad_sync_s"] == pytest.approx(expected_sync)
    assert d["collectives"]["grad_sync"]["all_reduce"]["count"] == 1
    json.dumps(cost.op_rows())


def test_data_parallel_over_two_axes_is_one_all_reduce_over_the_flattened_group(a100):
    """Data parallel on a 2x2 mesh: each gradient is P on both axes; they travel in one bucket,
    all-reduced once over the 4 ranks of axes 0 and 1 flattened (as DDP over all its ranks), on a
    stream of its own, launched when backward has made the last gradient: a ring over n = 4,
    2*3/4*M/b + 2*3*a (the chain on axis 0 then axis 1 it replaces was 2 * (2*1/2*M/b + 2*a))."""
    from search.baselines import baseline_specs, build_baseline
    from search.formulate import formulate
    from search.planner import assignment_plan

    g, cluster = mlp_graph(), a100.resized(4)
    form = formulate(g, cluster, (2, 2))
    spec = next(s for s in baseline_specs(2) if s.name == "dp")
    plan = assignment_plan("dp", form, build_baseline(form, spec).assignment, g.fingerprint(), "mlp", cluster,
                           "adamw", Training())
    program = lower(g, plan)
    total = sum(p.outputs[0].nbytes for p in g.parameters().values())
    synced = total + 4              # the P loss rides in the bucket as one more float32 element
    assert [(b.kind, b.axis, b.axes, b.nbytes) for b in program.buckets] == [(K.ALL_REDUCE, (0, 1), (0, 1), synced)]
    assert sorted(program.param_uses[i].fqn for i in program.buckets[0].uses) == sorted(g.parameters())
    [sync] = [t for t in program.tasks if t.tensor == "bucket0"]
    last_backward = max(t.id for t in program.tasks if t.phase == "backward" and t.collective is None)
    assert (sync.axis, sync.stream, sync.deps) == ((0, 1), "comm0+1", (last_backward,))   # as GradSync runs it
    syncs = [(c.kind, c.axis, c.bytes) for c in predicted_collectives(g, plan, cluster) if c.phase == "grad_sync"]
    assert syncs == [(K.ALL_REDUCE, (0, 1), synced)]
    b, a = cluster.intra_node.bandwidth_gbps * 1e9 * cluster.efficiency.network, cluster.intra_node.latency_us * 1e-6
    assert plan_cost(g, plan, cluster).grad_sync_s == pytest.approx(2 * 3 / 4 * synced / b + 2 * 3 * a, rel=1e-12)
    # the search's per-edge price of a parameter's gradient sync is that same one all-reduce
    from search.formulate import _pair_pricer
    bb, pp = NdSbp.parse("[B, B]"), NdSbp.parse("[P, P]")
    flat = 2 * 3 / 4 * total / b + 2 * 3 * a
    assert _pair_pricer((2, 2), cluster)(0, total, bb, bb, pp, (total // 4,)) == pytest.approx(flat, rel=1e-9)


def test_data_parallel_sgd_optimizer_and_compute_split(a100):
    g = mlp_graph()
    dp8 = plan_cost(g, batch_split_plan(g, 8, nd(B), "dp", optimizer="sgd"), a100)
    bw = a100.device.memory_bandwidth_gbps * 1e9 * a100.efficiency.memory
    assert dp8.optimizer_s == pytest.approx(3 * g.parameter_bytes / bw + _bucket_copies_s(g, a100))
    one = a100.resized(1)
    single = plan_cost(g, batch_split_plan(g, 1, nd(B), "single", optimizer="sgd"), one)
    assert single.comm_s == 0
    # with no overhead every op's roofline work is split 8 ways
    no_ov = dataclasses.replace(a100, op_overhead_us=0.0)
    c8 = plan_cost(g, batch_split_plan(g, 8, nd(B), "dp"), no_ov).compute_s
    c1 = plan_cost(g, batch_split_plan(g, 1, nd(B), "one"), no_ov.resized(1)).compute_s
    assert c8 == pytest.approx(c1 / 8)


# -- Megatron column -> row pair ---------------------------------------------------------
class ColRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64, bias=False)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.ln(x))))       # (16, 32) -> (16, 64) -> (16, 32)


def megatron_plan(g: OpGraph, n: int) -> Plan:
    names = {op.op_name: op.name for op in g.ops() if op.op_name != "linear"}
    lin = [op.name for op in g.ops() if op.op_name == "linear"]
    x = g.nodes_of(NodeKind.INPUT)[0].name
    sigs = {
        x: Signature((), (nd(B),)),
        names["layer_norm"]: Signature((nd(B), nd(B), nd(B)), (nd(B),)),
        lin[0]: Signature((nd(B), nd(S(0))), (nd(S(1)),)),     # column parallel: W1 (64, 32) split rows
        names["gelu"]: Signature((nd(S(1)),), (nd(S(1)),)),
        lin[1]: Signature((nd(S(1)), nd(S(1))), (nd(P),)),     # row parallel: W2 (32, 64) split columns
        names["sum"]: Signature((nd(B),), (nd(B),)),            # P -> B boxing into the loss
    }
    storage = {"ln.weight": nd(B), "ln.bias": nd(B), "fc1.weight": nd(S(0)), "fc2.weight": nd(S(1))}
    return Plan("tp", Mesh((n,)), sigs, storage, g.fingerprint())


def test_megatron_pair_forward_all_reduce_and_deferred_backward(a100):
    """Megatron's pair: fc2's partial output is all-reduced forward. Backward, fc1 hands back a P
    gradient for the LayerNorm output; the LayerNorm runs replicated on x (no gradient) and its own
    parameters, so its gradient reduction is deferred to the LayerNorm's parameters (2 x 32
    floats, in the asynchronous bucket) instead of all-reducing the (16, 32) activation gradient."""
    g = autoddl.trace(ColRow(), (torch.randn(16, 32),), sum_loss, name="colrow")
    n = 4
    cluster = a100.resized(n)
    plan = megatron_plan(g, n)
    colls = predicted_collectives(g, plan, cluster)
    act, ln_params = 16 * 32 * 4, 2 * 32 * 4
    assert [(c.kind, c.phase, c.bytes) for c in colls] == [(K.ALL_REDUCE, "forward", act),
                                                           (K.ALL_REDUCE, "grad_sync", ln_params)]
    lin = [op.name for op in g.ops() if op.op_name == "linear"]
    assert colls[0].tensor.startswith(lin[1] + "->")          # fc2's partial output into the loss
    program = lower(g, plan)
    assert sorted(program.param_uses[i].fqn for b in program.buckets for i in b.uses) == ["ln.bias", "ln.weight"]
    cost = plan_cost(g, plan, cluster)
    assert cost.boxing_forward_s == pytest.approx(_ar(act, n, cluster.intra_node, cluster.efficiency.network))
    assert cost.boxing_backward_s == 0
    assert cost.grad_sync_s == pytest.approx(_ar(ln_params, n, cluster.intra_node, cluster.efficiency.network))
    # memory: fc1/fc2 weights sharded 4 ways, LayerNorm replicated
    assert cost.memory["parameters"] == (64 * 32 + 32 * 64) * 4 // n + 2 * 32 * 4


# -- ZeRO-3 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_zero3_gather_forward_reduce_scatter_backward(a100, cpu2, backend):
    g = mlp_graph()
    cluster = a100.resized(4) if backend == "nccl" else cpu2
    n = cluster.num_devices
    plan = batch_split_plan(g, n, nd(S(0)), "zero3")
    colls = predicted_collectives(g, plan, cluster)
    params = g.parameters()
    total = sum(p.outputs[0].nbytes for p in params.values())               # one bucket (< 1 MB)
    sync_kind = K.REDUCE_SCATTER if backend == "nccl" else K.ALL_REDUCE     # gloo: all-reduce + chunk
    expected = Counter()
    # nn.Sequential's children "0" (32x64 + 64) and "2" (64x16 + 16) are layer groups of a few KB,
    # below GATHER_MIN_BYTES: merged, they are one all-gather
    groups = {"0..2": (32 * 64 + 64 + 64 * 16 + 16) * 4}
    for name, nbytes in groups.items():   # gathered forward, freed, gathered again for backward
        expected[(K.ALL_GATHER, "forward", f"gather {name}", nbytes)] += 1
        expected[(K.ALL_GATHER, "backward", f"regather {name}", nbytes)] += 1
    expected[(sync_kind, "grad_sync", "bucket0", total)] += 1
    expected[(K.ALL_REDUCE, "forward", f"{_loss(g).name}->output", 4)] += 1     # the P loss, to B
    assert Counter((c.kind, c.phase, c.tensor, c.bytes) for c in colls) == expected
    cost = plan_cost(g, plan, cluster)
    b = cluster.intra_node.bandwidth_gbps * 1e9 * cluster.efficiency.network
    a = cluster.intra_node.latency_us * 1e-6
    gather = sum((n - 1) / n * nbytes / b + (n - 1) * a for nbytes in groups.values())
    sync = ((n - 1) / n * total / b + (n - 1) * a if backend == "nccl"
            else _ar(total, n, cluster.intra_node, cluster.efficiency.network))
    assert cost.boxing_forward_s == pytest.approx(gather + _ar(4, n, cluster.intra_node, cluster.efficiency.network))
    assert cost.grad_sync_s == pytest.approx(sync)
    assert cost.boxing_backward_s == pytest.approx(gather)       # the regather


# -- memory: data parallel vs ZeRO-3 on GPT ---------------------------------------------------
@pytest.fixture(scope="module")
def gpt_graph():
    path = ROOT / "examples" / "gpt.py"
    if path.exists():
        spec = importlib.util.spec_from_file_location("autoddl_example_gpt", path)
        gpt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpt)
        preset = "gpt2-small"
        return autoddl.trace(gpt.build_model(preset), gpt.example_inputs(preset), gpt.loss_fn, name=preset)
    pytest.skip("examples/gpt.py not present")


def test_memory_dp_vs_zero3_gpt(gpt_graph, a100):
    g = gpt_graph
    n = a100.num_devices
    dp_plan = batch_split_plan(g, n, nd(B), "dp")
    dp = plan_cost(g, dp_plan, a100)
    z3 = plan_cost(g, batch_split_plan(g, n, nd(S(0)), "zero3"), a100)
    used = {fqn: p for fqn, p in g.parameters().items() if g.consumers(p.name)}   # a tied alias is unused
    n_params = sum(p.outputs[0].numel for p in used.values())
    assert dp.memory["parameters"] == 4 * n_params
    assert dp.memory["optimizer_states"] == 8 * n_params
    sharded = ("parameters", "gradients", "optimizer_states")
    diff = sum(dp.memory[k] - z3.memory[k] for k in sharded)
    assert diff == pytest.approx((4 + 4 + 8) * n_params * (1 - 1 / n), abs=16)
    assert dp.memory["activations"] == z3.memory["activations"]
    assert dp.memory["gathered_params"] == 0
    # ZeRO-3 gathers by layer group and frees a group after forward: at most a group and the next
    # one (prefetched) are whole at once; the largest pair is the root group (embeddings, final
    # norm: whatever no block holds) with block 0
    root = sum(p.outputs[0].nbytes for f, p in used.items() if ".h." not in f)
    block = sum(p.outputs[0].nbytes for f, p in used.items() if ".h.0." in f)
    largest_op_params = root + block
    assert z3.memory["gathered_params"] == largest_op_params
    # the largest buffer is a gradient bucket: at least the largest parameter (wte, 154 MB, joins a
    # bucket that already held gradients; DDP closes a bucket once it reaches the cap, so can we)
    largest_param = max(p.outputs[0].nbytes for p in used.values())
    largest_sync = max(c.bytes for c in dp.collectives if c.phase == "grad_sync")
    assert dp.memory["boxing_buffer"] == z3.memory["boxing_buffer"] == largest_sync
    assert largest_param <= largest_sync <= largest_param + 25e6
    assert dp.memory_bytes_per_device - z3.memory_bytes_per_device == pytest.approx(
        16 * n_params * (1 - 1 / n) - largest_op_params, abs=16)
    # every parameter's gradient in the buckets, the tied wte / lm_head weight once (both uses hand
    # back P, accumulated locally); wpe's embedding runs replicated (positions are B) from wpe
    # alone, so the P gradient of its output goes through it to wpe (a deferred reduction): no
    # activation gradient is all-reduced in backward
    program = lower(g, dp_plan)
    synced = [program.param_uses[i].fqn for b in program.buckets for i in b.uses]
    assert Counter(synced) == Counter(set(used))
    assert sum(c.bytes for c in dp.collectives if c.phase == "grad_sync") == 4 * n_params + 4   # and the loss
    assert [c for c in dp.collectives if c.phase == "backward"] == []
    # activations: user inputs + outputs of non-view ops that an op consumes, an n-th of batch-split ones
    expected_act = 0
    for node in g.topo():
        if node.kind is NodeKind.INPUT or (node.is_op and node.op_name not in ZERO_COST):
            for i in {i for c, i, _ in g.uses(node.name) if c.is_op}:
                meta = node.outputs[i]
                split = dp_plan.signatures[node.name].outputs[i] == nd(S(0))
                expected_act += meta.nbytes // n if split else meta.nbytes
    assert dp.memory["activations"] == expected_act
    assert dp.fits_memory


def _loss(g: OpGraph):
    out = g.nodes_of(NodeKind.OUTPUT)[0]
    return g[out.inputs[-1].node]


def test_loss_is_boxed_to_b_for_every_rank(a100):
    """The executor hands every rank the loss. A P loss rides in the first all-reduce bucket as one
    more float32 element; with no bucket (``bucket_mb`` 0: each gradient synced on its own) it costs
    a forward all-reduce of its own, charged to the loss op. Its seed gradient needs nothing. An
    "output" signature does not change that (the executor does not apply one)."""
    g = mlp_graph()
    n = a100.num_devices
    plan = batch_split_plan(g, n, nd(B), "dp")
    loss = _loss(g)
    assert plan.signatures[loss.name].outputs == (nd(P),)
    total = sum(p.outputs[0].nbytes for p in g.parameters().values())
    assert [(c.kind, c.phase, c.bytes, c.tensor) for c in predicted_collectives(g, plan, a100)] == [
        (K.ALL_REDUCE, "grad_sync", total + 4, "bucket0")]
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, bucket_mb=0))
    expected = [(K.ALL_REDUCE, "forward", 4, f"{loss.name}->output")]
    colls = [c for c in predicted_collectives(g, plan, a100) if c.phase != "grad_sync"]
    assert [(c.kind, c.phase, c.bytes, c.tensor) for c in colls] == expected
    cost = plan_cost(g, plan, a100)
    assert cost.boxing_forward_s == pytest.approx(_ar(4, n, a100.intra_node, a100.efficiency.network))
    assert cost.per_op["comm_us"].sum() == pytest.approx(cost.comm_s * 1e6)
    assert cost.per_op.set_index("op").loc[loss.name, "comm_us"] == pytest.approx(cost.boxing_forward_s * 1e6)
    plan.signatures["output"] = Signature((nd(P),), ())
    colls = [c for c in predicted_collectives(g, plan, a100) if c.phase != "grad_sync"]
    assert [(c.kind, c.phase, c.bytes, c.tensor) for c in colls] == expected
    # a replicated loss needs nothing
    one = batch_split_plan(g, 1, nd(B), "single")
    assert predicted_collectives(g, one, a100.resized(1)) == []


def test_missing_entries_are_named(a100):
    g = mlp_graph()
    plan = batch_split_plan(g, 8, nd(B), "dp")
    first = g.ops()[0].name
    del plan.signatures[first]
    with pytest.raises(ValueError, match=f"no entry for op '{first}'"):
        plan_cost(g, plan, a100)
    plan = batch_split_plan(g, 8, nd(B), "dp")
    del plan.param_storage["0.weight"]
    with pytest.raises(ValueError, match="param_storage has no entry for parameter '0.weight'"):
        predicted_collectives(g, plan, a100)
    with pytest.raises(ValueError, match="resized"):
        plan_cost(g, batch_split_plan(g, 16, nd(B), "dp16"), a100)
