"""Executor runtime: hand-written plans for a tiny MLP run on 2 and 4 gloo ranks and match
a single-process run (loss, every gradient, every parameter after the optimizer step)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate

from dist_utils import run_ranks

RTOL = 1e-4


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x, y):  # y is the target; the loss reads it
        return self.fc2(nn.functional.gelu(self.fc1(x)))  # (B, d_out)


class ReshapeMLP(MLP):
    """The MLP with view / reshape / expand in the middle: shape arguments must be made local."""

    def forward(self, x, y):
        h = self.fc1(x)                                                        # (B, 16)
        h = nn.functional.gelu(h.reshape(h.shape[0], 4, 4)).view(h.shape[0], 16)
        h = h.expand(2, -1, -1).sum(0)                                         # (2, B, 16) -> (B, 16)
        return self.fc2(h)


def mse(out, x, y):
    return ((out - y) ** 2).mean()


def build(batch: int = 8, model_cls=MLP):
    torch.manual_seed(0)
    model = model_cls()
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    return model, (x, y)


# Hand-written plans. Node names are the fx names autoddl.trace gives the MLP + mse graph:
# x, y, linear, gelu, linear_1, sub, pow_1, mean.
PLANS = {
    # data parallel: batch split, weights replicated; mean over the split batch gives P
    # (each rank's local mean scaled by local/global count), boxed to B at the end.
    "dp": ((2,), {
        "x": "-> [S(0)]", "y": "-> [S(0)]",
        "linear": "[S(0)], [B], [B] -> [S(0)]", "gelu": "[S(0)] -> [S(0)]",
        "linear_1": "[S(0)], [B], [B] -> [S(0)]", "sub": "[S(0)], [S(0)] -> [S(0)]",
        "pow_1": "[S(0)] -> [S(0)]", "mean": "[S(0)] -> [P]",
    }, {"fc1.weight": "[B]", "fc1.bias": "[B]", "fc2.weight": "[B]", "fc2.bias": "[B]"}),
    # Megatron column -> row: fc1 split on its output features, fc2 on its input features
    # (output P); fc2's bias is used as P (only one rank adds it); y is used as P in sub(P, P).
    "tp": ((2,), {
        "x": "-> [B]", "y": "-> [B]",
        "linear": "[B], [S(0)], [S(0)] -> [S(1)]", "gelu": "[S(1)] -> [S(1)]",
        "linear_1": "[S(1)], [S(1)], [P] -> [P]", "sub": "[P], [P] -> [P]",
        "pow_1": "[B] -> [B]", "mean": "[B] -> [B]",
    }, {"fc1.weight": "[S(0)]", "fc1.bias": "[S(0)]", "fc2.weight": "[S(1)]", "fc2.bias": "[B]"}),
    # ZeRO-3: data parallel signatures, parameters stored S(0) and all-gathered to B at use.
    "zero3": ((2,), {
        "x": "-> [S(0)]", "y": "-> [S(0)]",
        "linear": "[S(0)], [B], [B] -> [S(0)]", "gelu": "[S(0)] -> [S(0)]",
        "linear_1": "[S(0)], [B], [B] -> [S(0)]", "sub": "[S(0)], [S(0)] -> [S(0)]",
        "pow_1": "[S(0)] -> [S(0)]", "mean": "[S(0)] -> [P]",
    }, {"fc1.weight": "[S(0)]", "fc1.bias": "[S(0)]", "fc2.weight": "[S(0)]", "fc2.bias": "[S(0)]"}),
    # 2x2 mesh: data parallel on axis 0, Megatron on axis 1.
    "dp_tp": ((2, 2), {
        "x": "-> [S(0), B]", "y": "-> [S(0), B]",
        "linear": "[S(0), B], [B, S(0)], [B, S(0)] -> [S(0), S(1)]",
        "gelu": "[S(0), S(1)] -> [S(0), S(1)]",
        "linear_1": "[S(0), S(1)], [B, S(1)], [B, P] -> [S(0), P]",
        "sub": "[S(0), P], [S(0), P] -> [S(0), P]",
        "pow_1": "[S(0), B] -> [S(0), B]", "mean": "[S(0), B] -> [P, B]",
    }, {"fc1.weight": "[B, S(0)]", "fc1.bias": "[B, S(0)]", "fc2.weight": "[B, S(1)]", "fc2.bias": "[B, B]"}),
    # 2x2 mesh, data parallel on both axes: the batch split over all 4 ranks, weights replicated;
    # each gradient is P on both axes, all-reduced once over the axes' flattened group (as DDP).
    "dp_2x2": ((2, 2), {
        "x": "-> [S(0), S(0)]", "y": "-> [S(0), S(0)]",
        "linear": "[S(0), S(0)], [B, B], [B, B] -> [S(0), S(0)]", "gelu": "[S(0), S(0)] -> [S(0), S(0)]",
        "linear_1": "[S(0), S(0)], [B, B], [B, B] -> [S(0), S(0)]",
        "sub": "[S(0), S(0)], [S(0), S(0)] -> [S(0), S(0)]",
        "pow_1": "[S(0), S(0)] -> [S(0), S(0)]", "mean": "[S(0), S(0)] -> [P, P]",
    }, {"fc1.weight": "[B, B]", "fc1.bias": "[B, B]", "fc2.weight": "[B, B]", "fc2.bias": "[B, B]"}),
    # data parallel, but gelu on B: an S(0)->B all-gather forward, its dual (B->S(0) slice)
    # backward, and S(0) from B (a local slice) whose backward is an all-gather.
    "dp_gather": ((2,), {
        "x": "-> [S(0)]", "y": "-> [S(0)]",
        "linear": "[S(0)], [B], [B] -> [S(0)]", "gelu": "[B] -> [B]",
        "linear_1": "[S(0)], [B], [B] -> [S(0)]", "sub": "[S(0)], [S(0)] -> [S(0)]",
        "pow_1": "[S(0)] -> [S(0)]", "mean": "[S(0)] -> [P]",
    }, {"fc1.weight": "[B]", "fc1.bias": "[B]", "fc2.weight": "[B]", "fc2.bias": "[B]"}),
    # Megatron + sequence parallel tail: fc2's P output reduce-scattered to S(0) (forward
    # reduce_scatter, backward all-gather of its gradient).
    "tp_sp": ((2,), {
        "x": "-> [B]", "y": "-> [S(0)]",
        "linear": "[B], [S(0)], [S(0)] -> [S(1)]", "gelu": "[S(1)] -> [S(1)]",
        "linear_1": "[S(1)], [S(1)], [P] -> [P]", "sub": "[S(0)], [S(0)] -> [S(0)]",
        "pow_1": "[S(0)] -> [S(0)]", "mean": "[S(0)] -> [P]",
    }, {"fc1.weight": "[S(0)]", "fc1.bias": "[S(0)]", "fc2.weight": "[S(1)]", "fc2.bias": "[B]"}),
    # batch-split fc1, then S(0)->S(1) (an all-to-all) into a row-parallel fc2.
    "mixed": ((2,), {
        "x": "-> [S(0)]", "y": "-> [B]",
        "linear": "[S(0)], [B], [B] -> [S(0)]", "gelu": "[S(1)] -> [S(1)]",
        "linear_1": "[S(1)], [S(1)], [P] -> [P]", "sub": "[P], [P] -> [P]",
        "pow_1": "[B] -> [B]", "mean": "[B] -> [B]",
    }, {"fc1.weight": "[B]", "fc1.bias": "[S(0)]", "fc2.weight": "[S(1)]", "fc2.bias": "[B]"}),
    # data parallel with F.mse_loss (broadcast_tensors + getitem + mse_loss(reduction=mean)):
    # the local loss is scaled to its share of the global mean, P
    "dp_mse": ((2,), {
        "x": "-> [S(0)]", "y": "-> [S(0)]",
        "linear": "[S(0)], [B], [B] -> [S(0)]", "gelu": "[S(0)] -> [S(0)]",
        "linear_1": "[S(0)], [B], [B] -> [S(0)]",
        "broadcast_tensors": "[S(0)], [S(0)] -> [S(0)], [S(0)]", "mse_loss": "[S(0)], [S(0)] -> [P]",
    }, {"fc1.weight": "[B]", "fc1.bias": "[B]", "fc2.weight": "[B]", "fc2.bias": "[B]"}),
    # ReshapeMLP, data parallel: the batch dim moves to dim 1 under expand
    "reshape_dp": ((2,), {
        "x": "-> [S(0)]", "y": "-> [S(0)]",
        "linear": "[S(0)], [B], [B] -> [S(0)]", "reshape": "[S(0)] -> [S(0)]", "gelu": "[S(0)] -> [S(0)]",
        "view": "[S(0)] -> [S(0)]", "expand": "[S(0)] -> [S(1)]", "sum_1": "[S(1)] -> [S(0)]",
        "linear_1": "[S(0)], [B], [B] -> [S(0)]", "sub": "[S(0)], [S(0)] -> [S(0)]",
        "pow_1": "[S(0)] -> [S(0)]", "mean": "[S(0)] -> [P]",
    }, {"fc1.weight": "[B]", "fc1.bias": "[B]", "fc2.weight": "[B]", "fc2.bias": "[B]"}),
    # ReshapeMLP, Megatron: the split hidden dim (16 -> 8) is 2 of the 4 rows after reshape
    "reshape_tp": ((2,), {
        "x": "-> [B]", "y": "-> [B]",
        "linear": "[B], [S(0)], [S(0)] -> [S(1)]", "reshape": "[S(1)] -> [S(1)]", "gelu": "[S(1)] -> [S(1)]",
        "view": "[S(1)] -> [S(1)]", "expand": "[S(1)] -> [S(2)]", "sum_1": "[S(2)] -> [S(1)]",
        "linear_1": "[S(1)], [S(1)], [P] -> [P]", "sub": "[P], [P] -> [P]",
        "pow_1": "[B] -> [B]", "mean": "[B] -> [B]",
    }, {"fc1.weight": "[S(0)]", "fc1.bias": "[S(0)]", "fc2.weight": "[S(1)]", "fc2.bias": "[B]"}),
}


def make_plan(graph, name: str):
    from autoddl.plan import Mesh, Plan
    from autoddl.sbp import NdSbp, Signature

    shape, sigs, storage = PLANS[name]
    return Plan(name=name, mesh=Mesh(shape), graph_hash=graph.fingerprint(), optimizer="adamw",
                signatures={k: Signature.parse(v) for k, v in sigs.items()},
                param_storage={k: NdSbp.parse(v) for k, v in storage.items()})


def f_mse(out, x, y):
    return nn.functional.mse_loss(out, y)


@functools.lru_cache(maxsize=None)
def traced(model_cls=MLP, loss_fn=mse):
    """Model, inputs and graph, traced once in the test process; ranks inherit them by fork."""
    import autoddl

    model, inputs = build(model_cls=model_cls)
    return model, inputs, autoddl.trace(model, inputs, loss_fn)


def traced_for(name: str):
    if name.startswith("reshape"):
        return traced(ReshapeMLP)
    return traced(MLP, f_mse) if name == "dp_mse" else traced()


OPTIMIZER = {"dp": "sgd", "tp": "adamw", "zero3": "adamw", "dp_tp": "sgd", "dp_2x2": "adamw", "dp_gather": "sgd",
             "tp_sp": "adamw", "mixed": "adamw", "dp_no_rule": "sgd", "reshape_dp": "adamw",
             "reshape_tp": "sgd", "dp_mse": "adamw"}


def _no_gradient_rule(input_nd, op_outputs):
    """A gradient 'rule' that calls every gradient what its input is: P -> B, else unchanged."""
    from autoddl.sbp import B, NdSbp

    return NdSbp(tuple(B if s.is_partial() else s for s in input_nd))


def _check_plans(names: list[str]):
    """On every rank: run_check (2 steps) and an audited step for each plan."""
    from autoddl import lowering
    from executor.runtime import DistributedModel, audit_step, build_optimizer, init_mesh, run_check

    mesh, out = None, {}
    for name in names:
        base = name.removesuffix("_no_rule")
        model, inputs, graph = traced_for(base)
        loss_fn = f_mse if base == "dp_mse" else mse
        plan = make_plan(graph, base)
        mesh = mesh or init_mesh(plan)
        rule = lowering.grad_ndsbp
        if name.endswith("_no_rule"):
            lowering.grad_ndsbp = _no_gradient_rule
        lowering.consumer_grad.cache_clear()             # memoised over the rule in force
        try:
            errors = run_check(model, inputs, loss_fn, graph, plan, mesh, optimizer=OPTIMIZER[name], steps=2)
            dmodel = DistributedModel(model, graph, plan, mesh)
            records = audit_step(dmodel, inputs, build_optimizer(OPTIMIZER[name], dmodel.parameters()))
        finally:
            lowering.grad_ndsbp = rule
            lowering.consumer_grad.cache_clear()
        out[name] = (errors, records)
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    names = ["dp", "tp", "zero3", "dp_gather", "tp_sp", "mixed", "dp_no_rule", "reshape_dp", "reshape_tp",
             "dp_mse"]
    for name in names:
        traced_for(name)
    return run_ranks(_check_plans, 2, names,
                     timeout_s=60)


@pytest.fixture(scope="module")
def four_rank_results():
    traced()
    return run_ranks(_check_plans, 4, ["dp_tp", "dp_2x2"], timeout_s=60)


def _assert_matches(results, name):
    for rank, res in enumerate(results):
        errors, _ = res[name]
        assert set(errors) == {"loss"} | {f"{k}/{p}" for k in ("grad", "param")
                                          for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
        bad = {k: v for k, v in errors.items() if not v <= RTOL}
        assert not bad, f"rank {rank}, plan {name}: relative errors above {RTOL}: {bad}"


def _comms(records) -> list[tuple]:
    return sorted((r.phase, r.kind, r.axis, r.bytes) for r in records)


F32 = 4
B_LOCAL = 4  # batch 8 split over 2


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp", "tp", "zero3", "dp_gather", "tp_sp", "mixed", "reshape_dp",
                                  "reshape_tp", "dp_mse"])
def test_two_rank_plan_matches_single_process(two_rank_results, name):
    _assert_matches(two_rank_results, name)


@pytest.mark.distributed
def test_dp_tp_2x2_matches_single_process(four_rank_results):
    _assert_matches(four_rank_results, "dp_tp")
    # tp axis: fc2's P output (local batch 4 x 8) all-reduced; dp axis: the four parameter gradients
    # (local tp shards) all-reduced in one bucket, the scalar loss riding in it as one more element
    expected = sorted([("forward", "all_reduce", 1, B_LOCAL * 8 * F32),
                       ("grad_sync", "all_reduce", 0, sum((8 * 8, 8, 8 * 8, 8)) * F32 + F32)])
    for res in four_rank_results:
        assert _comms(res["dp_tp"][1]) == expected


@pytest.mark.distributed
def test_dp_on_both_axes_of_2x2_syncs_each_bucket_with_one_all_reduce_over_all_4_ranks(four_rank_results):
    """The parameters are B on both axes: their gradients travel in one bucket, all-reduced once over
    axes (0, 1) flattened (M = every parameter's bytes), and match one process; the scalar loss, P on
    both axes, rides in that bucket as one more float32 element (no collective of its own)."""
    from autoddl.program import lower

    _assert_matches(four_rank_results, "dp_2x2")
    _, _, graph = traced()
    program = lower(graph, make_plan(graph, "dp_2x2"))
    params = sum(PARAM_NUMEL.values()) * F32
    assert [(b.axis, b.nbytes) for b in program.buckets] == [((0, 1), params + F32)]
    assert program.loss_bucket == 0 and not program.loss_async
    expected = [("grad_sync", "all_reduce", (0, 1), params + F32)]
    assert sorted((t.phase, t.collective.value, t.axis, t.nbytes) for t in program.collectives()) == expected
    for res in four_rank_results:
        assert _comms(res["dp_2x2"][1]) == expected


def test_a_loss_read_at_forward_is_all_reduced_on_its_own_asynchronously():
    """``ParallelModule.forward`` returns the reduced loss, before any bucket exists: its program
    (``loss_at_forward``) reduces the P loss with a 4-byte all-reduce of its own, issued without the
    host waiting, and the bucket holds the gradients only."""
    from autoddl.program import lower
    from executor.runtime import ParallelModule

    _, _, graph = traced()
    assert ParallelModule.loss_at_forward
    program = lower(graph, make_plan(graph, "dp_2x2"), loss_at_forward=True)
    params = sum(PARAM_NUMEL.values()) * F32
    assert [(b.axis, b.nbytes) for b in program.buckets] == [((0, 1), params)]
    assert program.loss_bucket == -1 and program.loss_async
    expected = [("forward", "all_reduce", (0, 1), F32), ("grad_sync", "all_reduce", (0, 1), params)]
    assert sorted((t.phase, t.collective.value, t.axis, t.nbytes) for t in program.collectives()) == expected


@pytest.mark.distributed
def test_without_the_gradient_rule_dp_grads_are_wrong(two_rank_results):
    """Calling a data-parallel weight's share of the gradient B (as its input is) syncs nothing."""
    errors, records = two_rank_results[0]["dp_no_rule"]
    assert errors["grad/fc1.weight"] > 1e-2 and errors["grad/fc2.weight"] > 1e-2
    assert not [r for r in records if r.phase == "grad_sync"]


PARAM_NUMEL = {"fc1.weight": 16 * 8, "fc1.bias": 16, "fc2.weight": 8 * 16, "fc2.bias": 8}


@pytest.mark.distributed
@pytest.mark.parametrize("name,expected", [
    # the four gradients (1,160 bytes) fill one bucket below DDP's 1 MB first bucket; the loss
    # rides in it as one more float32 element
    ("dp", [("grad_sync", "all_reduce", 0, sum(PARAM_NUMEL.values()) * F32 + F32)]),
    # the parameters (all outside any numbered block: one "root" group) gathered in one all-gather;
    # gloo carries the bucket's reduce-scatter out as an all-reduce of the whole buffer
    ("zero3", [("forward", "all_reduce", 0, F32), ("forward", "all_gather", 0, sum(PARAM_NUMEL.values()) * F32),
               ("backward", "all_gather", 0, sum(PARAM_NUMEL.values()) * F32),      # freed, gathered again
               ("grad_sync", "all_reduce", 0, sum(PARAM_NUMEL.values()) * F32)]),
    ("tp", [("forward", "all_reduce", 0, 8 * 8 * F32)]),
    ("dp_gather", [("forward", "all_gather", 0, 8 * 16 * F32), ("backward", "all_gather", 0, 8 * 16 * F32)]
     + [("grad_sync", "all_reduce", 0, sum(PARAM_NUMEL.values()) * F32 + F32)]),
    ("tp_sp", [("forward", "all_reduce", 0, 8 * 8 * F32), ("forward", "all_reduce", 0, F32),
               ("backward", "all_gather", 0, 8 * 8 * F32)]),
])
def test_audit_records_planned_collectives(two_rank_results, name, expected):
    for res in two_rank_results:
        assert _comms(res[name][1]) == sorted(expected)


@pytest.mark.distributed
def test_audit_records_an_all_to_all_with_the_program_s_bytes(two_rank_results):
    """The "mixed" plan's S(0) -> S(1) of fc1's (8, 16) output is one all-to-all forward and one for its
    gradient backward, each of M = the logical tensor (8 x 16 x 4 bytes), as the program prices it:
    a rank's input is only its piece, M / 2."""
    from autoddl.program import lower

    graph = traced_for("mixed")[2]
    program = lower(graph, make_plan(graph, "mixed"))
    program_a2a = sorted((c.phase, c.nbytes) for c in program.collectives() if c.collective is not None and c.collective.value == "all_to_all")
    assert program_a2a == [("backward", 8 * 16 * F32), ("forward", 8 * 16 * F32)]
    for res in two_rank_results:
        ran = sorted((r.phase, r.bytes) for r in res["mixed"][1] if r.kind == "all_to_all")
        assert ran == program_a2a


# -- single-process tests -----------------------------------------------------------------------

def test_gradient_rule():
    from autoddl.boxing import grad_ndsbp
    from autoddl.sbp import NdSbp

    nd = NdSbp.parse
    # DP weight: input B, output S(0) -> each rank holds a share: P
    assert grad_ndsbp(nd("[B]"), [nd("[S(0)]")]) == nd("[P]")
    # same computation everywhere: B
    assert grad_ndsbp(nd("[B]"), [nd("[B]")]) == nd("[B]")
    # Megatron row-parallel bias used as P: its gradient is the (B) output gradient
    assert grad_ndsbp(nd("[P]"), [nd("[P]")]) == nd("[B]")
    # split input: split gradient; per axis on a 2-D mesh
    assert grad_ndsbp(nd("[S(0), B]"), [nd("[S(0), S(1)]")]) == nd("[S(0), P]")
    assert grad_ndsbp(nd("[B, B]"), [nd("[B, B]"), nd("[B, S(0)]")]) == nd("[B, P]")


def test_local_args_rewrite_shapes():
    from autoddl.ops import local_args
    from autoddl.sbp import Signature

    _, _, graph = traced(ReshapeMLP)
    shape, sigs, _ = PLANS["reshape_tp"]
    for op, want in [("reshape", [8, 2, 4]), ("view", [8, 8]), ("expand", [2, 8, 8])]:
        args, _ = local_args(graph[op], Signature.parse(sigs[op]), shape)
        assert args[1] == want, op
    shape, sigs, _ = PLANS["reshape_dp"]
    args, _ = local_args(graph["expand"], Signature.parse(sigs["expand"]), shape)
    assert args[1] == [2, 4, 16]


def test_validate_plan_names_every_problem():
    from autoddl.sbp import NdSbp, Signature
    from executor.runtime import PlanExecutionError, validate_plan

    _, _, graph = traced()
    plan = make_plan(graph, "dp")
    validate_plan(graph, plan)  # the hand plan itself is valid
    del plan.signatures["gelu"]
    plan.signatures["pow_1"] = Signature.parse("[S(0)], [B] -> [S(0)]")
    plan.signatures["y"] = Signature.parse("-> [S(1)]")  # fine: 8 columns split in 2
    plan.signatures["nonexistent"] = Signature.parse("-> [B]")
    plan.signatures["linear"] = Signature.parse("[S(0)], [S(1)], [B] -> [S(0)]")
    plan.param_storage["fc1.bias"] = NdSbp.parse("[P]")
    del plan.param_storage["fc2.bias"]
    with pytest.raises(PlanExecutionError) as exc:
        validate_plan(graph, plan)
    msg = str(exc.value)
    for needle in ("op gelu", "op pow_1: signature", "nonexistent", "parameter fc1.bias: storage [P]",
                   "parameter fc2.bias: no storage"):
        assert needle in msg, needle
    assert "y:" not in msg and "op linear" not in msg  # valid entries are not reported


def _sleep_forever():
    import time

    time.sleep(60)


def _fail_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank one is broken")
    return int(os.environ["RANK"]) * 10


def test_run_ranks_reports_failures_and_timeouts():
    with pytest.raises(RuntimeError, match="(?s)rank 1 .*rank one is broken"):
        run_ranks(_fail_on_rank_1, 2, timeout_s=20)
    with pytest.raises(TimeoutError, match="killed all ranks"):
        run_ranks(_sleep_forever, 2, timeout_s=1)


MODEL_FILE = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x, y):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def build_model():
    return MLP()


def example_inputs():
    return torch.randn(8, 8), torch.randn(8, 8)


def loss_fn(out, x, y):
    return ((out - y) ** 2).mean()
'''


def _worker_rank(argv):
    from executor.worker import main

    return main(argv)


@pytest.mark.distributed
def test_worker_main_checks_and_audits(tmp_path):
    import json

    from autoddl.loader import load_model_file
    from autoddl.trace import trace

    model_py = tmp_path / "mlp.py"
    model_py.write_text(MODEL_FILE)
    mf = load_model_file(model_py, device="cpu")
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn)
    make_plan(graph, "zero3").save(tmp_path / "plan.json")
    out = tmp_path / "result.json"
    codes = run_ranks(_worker_rank, 2, ["--plan", str(tmp_path / "plan.json"), "--model", str(model_py),
                                        "--steps", "2", "--check", "--out", str(out)], timeout_s=60)
    assert codes == [0, 0]
    result = json.loads(out.read_text())
    assert result["check"]["ok"], result["check"]
    assert max(result["check"]["max_rel_error"].values()) <= 1e-4
    assert result["collectives_summary"]["grad_sync/all_reduce/axis0"] == {   # one bucket
        "count": 1, "bytes": sum(PARAM_NUMEL.values()) * F32}


def _dp_and_zero3_plans(tmp_path) -> list[str]:
    """The worker's ``--plans dp.json zero3.json --out-dir --model`` arguments for MODEL_FILE's mlp, written
    to ``tmp_path``."""
    from autoddl.loader import load_model_file
    from autoddl.trace import trace

    model_py = tmp_path / "mlp.py"
    model_py.write_text(MODEL_FILE)
    mf = load_model_file(model_py, device="cpu")
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn)
    for name in ("dp", "zero3"):
        make_plan(graph, name).save(tmp_path / f"{name}.json")
    return ["--plans", str(tmp_path / "dp.json"), str(tmp_path / "zero3.json"), "--out-dir", str(tmp_path),
            "--model", str(model_py)]


@pytest.mark.distributed
def test_worker_times_several_plans_in_interleaved_rounds(tmp_path):
    """``--plans A B --rounds 2``: both plans placed and warmed up first, then 5 measured steps each in
    rounds of 3 and 2 (each after one more warm-up step): every plan's JSON has its 5 step times (the
    ranks' mean per step), its audit, and every loss it trained; the warm-up is 2 steps."""
    import json

    from executor.worker import _round_schedule, _round_steps

    assert _round_steps(5, 2) == [3, 2] and _round_steps(12, 3) == [4, 4, 4] and _round_steps(2, 2) == [1, 1]
    assert _round_schedule([5, 2], 2) == [(0, 3), (1, 1), (0, 2), (1, 1)]      # round by round, each its share
    plans = _dp_and_zero3_plans(tmp_path)
    codes = run_ranks(_worker_rank, 2, plans + ["--steps", "5", "--warmup", "2", "--rounds", "2", "--quiet"],
                      timeout_s=60)
    assert codes == [0, 0]
    for name in ("dp", "zero3"):
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert "error" not in result and result["rounds"] == 2
        assert len(result["step_time_s"]) == 5 and all(t > 0 for t in result["step_time_s"])
        assert len(result["losses"]) == 2 + 5 + 2                 # warm-up, measured, one warm-up per round
        assert result["collectives_summary"]["grad_sync/all_reduce/axis0"]["count"] == 1
    with pytest.raises(SystemExit):
        _worker_rank(plans + ["--steps", "2", "--rounds", "3"])            # more rounds than steps


@pytest.mark.distributed
def test_worker_times_a_fast_plan_for_min_time_s(tmp_path):
    """``--steps 2 --min-time-s 0.3``: the mlp's steps take a few ms, so each plan runs more than 2
    measured steps, as many on every rank (the pace is the slowest rank's: a count that differed
    would leave a rank waiting in a collective until the launch times out), split over the rounds;
    its JSON says how many, and they took about 0.3 s (at least a quarter of it: the warm-up's pace
    and the measured one differ on a busy machine). Refused without a warm-up to take the pace from."""
    import json

    plans = _dp_and_zero3_plans(tmp_path)
    codes = run_ranks(_worker_rank, 2, plans + ["--steps", "2", "--warmup", "3", "--rounds", "2",
                                                "--min-time-s", "0.3", "--quiet"], timeout_s=120)
    assert codes == [0, 0]
    for name in ("dp", "zero3"):
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert "error" not in result
        assert result["steps"] == len(result["step_time_s"]) > 2
        assert sum(result["step_time_s"]) >= 0.3 / 4
        assert len(result["losses"]) == 3 + result["steps"] + 2   # warm-up, measured, one warm-up per round
    with pytest.raises(SystemExit):
        _worker_rank(plans + ["--steps", "2", "--min-time-s", "1"])         # no warm-up


@pytest.mark.distributed
def test_worker_times_a_plan_and_its_reference_in_interleaved_rounds(tmp_path):
    """``--plan dp --reference ddp --rounds 2``: the plan and DDP are both placed and warmed up, then
    their 4 measured steps run in two rounds of 2 each: both have 4 step times, and DDP trained the
    warm-up step, the 4 measured ones and one more warm-up step per round."""
    import json

    from autoddl.loader import load_model_file
    from autoddl.trace import trace

    model_py = tmp_path / "mlp.py"
    model_py.write_text(MODEL_FILE)
    mf = load_model_file(model_py, device="cpu")
    make_plan(trace(mf.model, mf.example_inputs, mf.loss_fn), "dp").save(tmp_path / "dp.json")
    out = tmp_path / "result.json"
    codes = run_ranks(_worker_rank, 2, ["--plan", str(tmp_path / "dp.json"), "--model", str(model_py),
                                        "--reference", "ddp", "--steps", "4", "--warmup", "1", "--rounds", "2",
                                        "--quiet", "--out", str(out)], timeout_s=60)
    assert codes == [0, 0]
    result = json.loads(out.read_text())
    ddp = result["references"]["ddp"]
    assert len(result["step_time_s"]) == 4 and len(ddp["step_time_s"]) == 4
    assert len(result["losses"]) == len(ddp["losses"]) == 1 + 4 + 2
    with pytest.raises(SystemExit):
        _worker_rank(["--plan", str(tmp_path / "dp.json"), "--model", str(model_py), "--steps", "4",
                      "--rounds", "2"])                               # rounds without a reference


def _grads_of_two_batches(_):
    """dp on 2 ranks: each parameter's gradient of batch a, of batch b (``.grad`` set to None in
    between), and of a then b without zero_grad in between (autograd's rule: they add up), as numpy
    arrays; and whether a gradient was handed out as a view of its bucket's kept buffer (no copy)."""
    from executor.runtime import DistributedModel, init_mesh, local_of

    model, (x, y), graph = traced()
    plan = make_plan(graph, "dp")
    dmodel = DistributedModel(model, graph, plan, init_mesh(plan))
    locals_ = {n: local_of(p) for n, p in dmodel.named_parameters()}
    batches = {"a": (x, y), "b": (x.flip(0) * 2, y.roll(1, 0))}
    grads, viewed = {}, True
    for name, batch in batches.items():
        for t in locals_.values():
            t.grad = None
        dmodel.forward_backward(batch)
        grads[name] = {n: t.grad.clone().numpy() for n, t in locals_.items()}
        kept = [b.untyped_storage().data_ptr() for b in dmodel.grad_sync.buffers.values()]
        viewed = viewed and all(t.grad.untyped_storage().data_ptr() in kept for t in locals_.values())
    dmodel.forward_backward(batches["a"])
    grads["a+b"] = {n: t.grad.clone().numpy() for n, t in locals_.items()}
    return grads, viewed


@pytest.mark.distributed
def test_gradients_kept_without_zero_grad_add_up_across_steps():
    """The all-reduce buckets are kept across steps and the synced gradients are views of them; a
    ``.grad`` still held at the next backward (no ``zero_grad``) is copied out before its bucket is
    overwritten, so that the next backward adds to it: b's gradient then a's is their sum, on every rank."""
    traced()
    for grads, viewed in run_ranks(_grads_of_two_batches, 2, None, timeout_s=60):
        assert viewed
        for name in grads["a"]:
            np.testing.assert_allclose(grads["a+b"][name], grads["a"][name] + grads["b"][name], rtol=1e-5,
                                       atol=1e-7, err_msg=name)
            assert not np.allclose(grads["a"][name], grads["b"][name])


def test_unflatten_gathered_joins_each_rank_s_piece_along_its_dim_in_place():
    """An all-gather's flat result (rank r's pieces in row r) becomes each whole tensor, the pieces joined
    along their split dim, as torch.cat of the ranks' pieces would; with ``out`` written into the given
    tensors themselves (ZeRO-1/2's parameters), a non-contiguous one too."""
    import math

    from executor.moves import unflatten_gathered

    torch.manual_seed(0)
    pieces = [((3, 5), 0), ((3, 5), 1), ((2, 3, 4), 2), ((7,), 0), ((2, 1, 3), 1)]
    for n in (2, 4):
        flat = torch.randn(n * sum(math.prod(s) for s, _ in pieces))          # (n * pieces,)
        rows, start, want = flat.view(n, -1), 0, []
        for shape, dim in pieces:
            numel = math.prod(shape)
            want.append(torch.cat([rows[r, start:start + numel].view(shape) for r in range(n)], dim=dim))
            start += numel
        assert all(torch.equal(a, b) for a, b in zip(unflatten_gathered(flat, n, pieces), want))
        dest = [torch.empty_like(w) for w in want]
        dest[1] = torch.empty(want[1].shape[1], want[1].shape[0]).t()          # not contiguous
        got = unflatten_gathered(flat, n, pieces, out=dest)
        assert all(g is d for g, d in zip(got, dest)) and all(torch.equal(d, w) for d, w in zip(dest, want))
