"""SBP rules checked by execution: every candidate signature of every family runs on simulated
devices (tests/shard_sim.py) on meshes (2,), (4,) and (2, 2) and must reproduce the unsharded op,
forward and backward. Plus: the signatures that matter exist, odd shapes drop splits, invalid
signatures are caught, and the example models need no fallback."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch import nn

import autoddl
import autoddl.ops as R
from autoddl.graph import NodeKind, OpGraph
from autoddl.sbp import B, S, NdSbp, Signature
from shard_sim import check_all, check_signature, make_node

MESHES = [(2,), (4,), (2, 2)]
SIZES = st.sampled_from([1, 2, 3, 4, 5, 8, 12])   # multiples of 4 and small odd sizes
HYP = settings(max_examples=4, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
aten = torch.ops.aten


def check_everywhere(node, meshes=MESHES) -> int:
    return sum(check_all(node, m) for m in meshes)


def sig(text: str) -> Signature:
    return Signature.parse(text)


def t(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype)


# -- traced small models: real OpNodes of every family -------------------------------------------
class Block(nn.Module):
    """nanoGPT-like: embeddings, layer_norm, qkv linear + split, causal SDPA, gelu MLP, loss."""

    def __init__(self, V=16, C=16, H=4, T=8):
        super().__init__()
        self.H = H
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.ln = nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.out = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.head = nn.Linear(C, V, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, idx, tgt):
        Bsz, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        q, k, v = self.qkv(self.ln(x)).split(x.shape[-1], dim=2)
        q, k, v = (z.view(Bsz, T, self.H, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(Bsz, T, -1)
        x = x + self.drop(self.proj(y))
        x = x + self.out(F.gelu(self.fc(self.ln(x))))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))


class LlamaBits(nn.Module):
    """RMSNorm as pow/mean/rsqrt/mul, rotary with slice/neg/cat, GQA by expand+reshape and
    repeat_interleave, silu gated MLP."""

    def __init__(self, C=16, H=4, KV=2):
        super().__init__()
        self.H, self.KV = H, KV
        self.w = nn.Parameter(torch.ones(C))
        self.q, self.k = nn.Linear(C, C, bias=False), nn.Linear(C, C // H * KV, bias=False)
        self.g, self.u = nn.Linear(C, 2 * C, bias=False), nn.Linear(C, 2 * C, bias=False)
        self.register_buffer("cos", torch.ones(16, C // H))

    def forward(self, x):
        Bsz, T, C = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        q = self.q(h).view(Bsz, T, self.H, -1).transpose(1, 2)
        k = self.k(h).view(Bsz, T, self.KV, -1).transpose(1, 2)
        half = q.shape[-1] // 2
        q = q * self.cos[:T] + torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        kx = k[:, :, None].expand(Bsz, self.KV, self.H // self.KV, T, k.shape[-1]).reshape(Bsz, self.H, T, -1)
        v = torch.repeat_interleave(k, self.H // self.KV, dim=1)
        y = F.scaled_dot_product_attention(q, kx, v, is_causal=True)
        return y.sum() + (F.silu(self.g(h)) * self.u(h)).mean()


class ConvNet(nn.Module):
    """VGG/ResNet pieces: conv2d with/without bias, batch_norm (training), relu_, pools, flatten."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.fc = nn.Linear(4, 6)

    def forward(self, x, y):
        x = F.relu(self.bn(self.c1(x)), inplace=True)
        x = F.max_pool2d(x, 2)
        x = F.relu(x + self.c2(x))
        x = torch.flatten(F.adaptive_avg_pool2d(F.avg_pool2d(x, 2), (1, 1)), 1)
        return F.cross_entropy(self.fc(F.dropout(x, 0.5, self.training)), y)


TRACED = {
    "block": lambda: autoddl.trace(Block(), (torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8)))),
    "llama": lambda: autoddl.trace(LlamaBits(), (torch.randn(2, 4, 16),)),
    "conv": lambda: autoddl.trace(ConvNet(), (torch.randn(4, 3, 8, 8), torch.randint(0, 6, (4,)))),
}


@pytest.fixture(scope="module")
def traced() -> dict[str, OpGraph]:
    return {k: f() for k, f in TRACED.items()}


@pytest.mark.parametrize("model", sorted(TRACED))
def test_every_candidate_of_traced_ops_executes_correctly(traced, model):
    graph = traced[model]
    assert R.unsupported_ops(graph) == []
    for node in graph.ops():
        check_everywhere(node)


def test_traced_block_has_the_expected_signatures(traced):
    g = traced["block"]
    lin = next(n for n in g.ops() if n.target == "aten.linear.default" and len(n.inputs) == 3)
    cands = set(R.candidate_signatures(lin, (2,)))
    assert sig("[S(0)], [B], [B] -> [S(0)]") in cands          # data parallel
    assert sig("[B], [S(0)], [S(0)] -> [S(2)]") in cands       # column parallel
    assert sig("[S(2)], [S(1)], [P] -> [P]") in cands          # row parallel, bias as P
    assert sig("[S(2)], [S(1)], [B] -> [P]") not in cands
    sdpa = next(n for n in g.ops() if n.op_name == "scaled_dot_product_attention")
    for m in MESHES:
        for s in R.candidate_signatures(sdpa, m):
            assert all(x != S(2) for nd in s.inputs + s.outputs for x in nd), s
    emb = next(n for n in g.ops() if n.op_name == "embedding")
    assert sig("[S(0)], [B] -> [P]") in R.candidate_signatures(emb, (2,))
    assert sig("[S(1)], [B] -> [S(2)]") in R.candidate_signatures(emb, (2,))
    ce = next(n for n in g.ops() if n.op_name == "cross_entropy_loss")
    assert sig("[S(0)], [S(0)] -> [P]") in R.candidate_signatures(ce, (2,))


def test_batch_norm_training_never_splits_the_batch(traced):
    bn = next(n for n in traced["conv"].ops() if n.op_name == "batch_norm")
    cands = R.candidate_signatures(bn, (2,))
    assert sig("[S(1)], [S(0)], [S(0)], [S(0)], [S(0)] -> [S(1)]") in cands
    assert not any(s.inputs[0][0] == S(0) for s in cands)
    bad = Signature((NdSbp.of(S(0)),) + (NdSbp.of(B),) * 4, (NdSbp.of(S(0)),))
    with pytest.raises(AssertionError, match="differs"):
        check_signature(bn, bad, (2,))


# -- invalid signatures are caught (the harness is real) -----------------------------------------
@pytest.mark.parametrize("node, bad", [
    (make_node("aten.linear.default", t(4, 8), t(6, 8), t(6)), "[S(1)], [S(1)], [B] -> [P]"),  # bias added n times
    (make_node("aten._softmax.default", t(4, 8), 1, False), "[S(1)] -> [S(1)]"),
    (make_node("aten.amax.default", t(4, 8), [1]), "[S(1)] -> [P]"),
    (make_node("aten.mean.dim", t(4, 8), [1]), "[S(1)] -> [S(0)]"),
    (make_node("aten.gelu.default", t(4, 8)), "[P] -> [P]"),
    (make_node("aten.view.default", t(4, 8), [32]), "[S(1)] -> [S(0)]"),
    (make_node("aten.add.Tensor", t(4, 8), t(4, 8)), "[P], [B] -> [P]"),
])
def test_invalid_signatures_are_caught(node, bad):
    assert Signature.parse(bad) not in R.candidate_signatures(node, (2,))
    with pytest.raises(AssertionError):
        check_signature(node, Signature.parse(bad), (2,))


def test_mean_over_a_split_dim_needs_its_kernel():
    node = make_node("aten.mean.dim", t(4, 8), [1], True)
    s = sig("[S(1)] -> [P]")
    assert s in R.candidate_signatures(node, (2,))
    assert R.local_kernel(node, s, (2,), (0,)) is not None
    check_signature(node, s, (2,))


# -- hypothesis: every candidate of each family over drawn shapes ---------------------------------
@HYP
@given(m=SIZES, k=SIZES, n=SIZES, b=SIZES, bias=st.booleans())
@example(m=4, k=8, n=4, b=2, bias=True)
def test_matmul_family(m, k, n, b, bias):
    nodes = [
        make_node("aten.mm.default", t(m, k), t(k, n)),
        make_node("aten.addmm.default", t(n), t(m, k), t(k, n)),
        make_node("aten.addmm.default", t(m, n), t(m, k), t(k, n)),
        make_node("aten.bmm.default", t(b, m, k), t(b, k, n)),
        make_node("aten.baddbmm.default", t(b, m, n), t(b, m, k), t(b, k, n)),
        make_node("aten.matmul.default", t(b, 1, m, k), t(2, k, n)),
        make_node("aten.linear.default", t(b, m, k), t(n, k), t(n) if bias else None),
        make_node("aten.einsum.default", "bmk,nk->bmn", [t(b, m, k), t(n, k)]),
    ]
    for node in nodes:
        check_everywhere(node)


@HYP
@given(a=SIZES, b=SIZES, c=SIZES)
@example(a=4, b=2, c=8)
def test_pointwise_family(a, b, c):
    x = t(a, b, c)
    nodes = [
        make_node("aten.add.Tensor", x, t(c)),
        make_node("aten.sub.Tensor", t(a, 1, c), t(b, 1), alpha=2),
        make_node("aten.mul.Tensor", x, t(a, b, 1)),
        make_node("aten.mul.Tensor", x, 0.5),
        make_node("aten.div.Tensor", x, t(c)),
        make_node("aten.add.Tensor", x, 1.0),
        make_node("aten.neg.default", x),
        make_node("aten.rsqrt.default", x),
        make_node("aten.pow.Tensor_Scalar", x, 2),
        make_node("aten.silu.default", x),
        make_node("aten.relu_.default", x),
        make_node("aten.clamp.default", x, -0.5, 0.5),
        make_node("aten.where.self", t(b, c, dtype=torch.bool), x, t(c)),
        make_node("aten.masked_fill.Scalar", x, t(1, b, c, dtype=torch.bool), -1.0),
        make_node("aten._to_copy.default", torch.empty(a, b, c, dtype=torch.float64), dtype=torch.float32),
        make_node("aten.dropout.default", x, 0.1, True),
        make_node("aten.tril.default", x),
        make_node("aten._softmax.default", x, 2, False),
        make_node("aten._log_softmax.default", x, 1, False),
        make_node("aten.zeros_like.default", x),
        make_node("aten.broadcast_tensors.default", [x, t(b, c)]),
    ]
    for node in nodes:
        check_everywhere(node)


@HYP
@given(a=SIZES, b=SIZES, c=SIZES, keep=st.booleans())
@example(a=4, b=8, c=2, keep=False)
def test_reduction_family(a, b, c, keep):
    x = t(a, b, c)
    nodes = [
        make_node("aten.sum.dim_IntList", x, [1], keep),
        make_node("aten.sum.dim_IntList", x, [0, 2], keep),
        make_node("aten.sum.default", x),
        make_node("aten.mean.dim", x, [-1], keep),
        make_node("aten.mean.dim", x, [0, 1], keep),
        make_node("aten.mean.default", x),
        make_node("aten.amax.default", x, [1], keep),
        make_node("aten.max.dim", x, 2, keep),
        make_node("aten.var.correction", x, [1], correction=1, keepdim=keep),
        make_node("aten.logsumexp.default", x, [0], keep),
    ]
    for node in nodes:
        check_everywhere(node)


@HYP
@given(a=SIZES, b=SIZES, c=SIZES, d=SIZES)
@example(a=2, b=4, c=4, d=2)
def test_view_family(a, b, c, d):
    x = t(a, b, c * d)
    y = t(a, b, c, d)
    nodes = [
        make_node("aten.view.default", x, [a, b, c, d]),
        make_node("aten.view.default", y, [a * b, c * d]),
        make_node("aten.reshape.default", y, [a, -1]),
        make_node("aten._unsafe_view.default", x, [a * b, c * d]),
        make_node("aten.flatten.using_ints", y, 1),
        make_node("aten.unflatten.int", x, 2, [c, d]),
        make_node("aten.expand.default", t(a, 1, c), [d, a, b, c]),
        make_node("aten.transpose.int", y, 1, 3),
        make_node("aten.permute.default", y, [2, 0, 3, 1]),
        make_node("aten.t.default", t(a, b)),
        make_node("aten.unsqueeze.default", x, 1),
        make_node("aten.squeeze.default", t(a, 1, b)),
        make_node("aten.squeeze.dim", t(a, b, 1), 0),
        make_node("aten.split.Tensor", y, 1, 2),
        make_node("aten.split_with_sizes.default", t(a, b, 3 * c), [c, 2 * c], 2),
        make_node("aten.chunk.default", t(a, 2 * b, c), 2, 1),
        make_node("aten.unbind.int", y, 1),
        make_node("aten.cat.default", [x, t(a, b, 2)], -1),
        make_node("aten.cat.default", [t(a, b, c), t(d, b, c)]),
        make_node("aten.stack.default", [x, x], 1),
        make_node("aten.slice.Tensor", y, 3, 0, max(d // 2, 1)),
        make_node("aten.select.int", y, 2, 0),
        make_node("aten.contiguous.default", y),
        make_node("aten.clone.default", y),
        make_node("aten.repeat_interleave.self_int", y, 2, 1),
        make_node("aten.index_select.default", x, 1, torch.empty(d, dtype=torch.int64)),
        make_node("aten.repeat.default", t(a, b), [d, 1, 2]),
    ]
    for node in nodes:
        check_everywhere(node)


@HYP
@given(v=SIZES, dim=SIZES, b=SIZES, s=SIZES)
@example(v=7, dim=4, b=2, s=4)
def test_embedding(v, dim, b, s):
    check_everywhere(make_node("aten.embedding.default", t(v + 1, dim), torch.empty(b, s, dtype=torch.int64)))


@HYP
@given(n=SIZES, cin=SIZES, cout=SIZES, hw=st.sampled_from([4, 6]), bias=st.booleans(), train=st.booleans())
@example(n=4, cin=4, cout=4, hw=4, bias=True, train=True)
@example(n=4, cin=2, cout=4, hw=4, bias=False, train=False)
def test_conv_norm_pool(n, cin, cout, hw, bias, train):
    x = t(n, cin, hw, hw)
    nodes = [
        make_node("aten.conv2d.default", x, t(cout, cin, 3, 3), t(cout) if bias else None, [1, 1], [1, 1]),
        make_node("aten.conv2d.default", x, t(cout, cin, 1, 1), None, [2, 2]),
        make_node("aten.batch_norm.default", x, t(cin), t(cin), t(cin), t(cin), train, 0.1, 1e-5, False),
        make_node("aten.layer_norm.default", x, [hw, hw], t(hw, hw), t(hw, hw), 1e-5, False),
        make_node("aten.native_layer_norm.default", x, [hw], t(hw), None, 1e-5),
        make_node("aten.group_norm.default", x, 1, t(cin), t(cin), 1e-5, False),
        make_node("aten.max_pool2d.default", x, [2, 2]),
        make_node("aten.avg_pool2d.default", x, [2, 2]),
        make_node("aten.adaptive_avg_pool2d.default", x, [1, 1]),
    ]
    for node in nodes:
        check_everywhere(node)


@HYP
@given(b=SIZES, h=st.sampled_from([2, 4, 8]), kv=st.sampled_from([1, 2]), seq=SIZES, e=st.sampled_from([2, 4]))
@example(b=2, h=4, kv=2, seq=4, e=2)
def test_attention(b, h, kv, seq, e):
    q, k = t(b, h, seq, e), t(b, h, seq, e)
    nodes = [
        make_node("aten.scaled_dot_product_attention.default", q, k, k, None, 0.0, True),
        make_node("aten.scaled_dot_product_attention.default", q, k, k),
        make_node("aten.scaled_dot_product_attention.default", q, k, k, t(seq, seq, dtype=torch.bool)),
        make_node("aten.scaled_dot_product_attention.default", q, k, k, t(b, 1, seq, seq)),
        make_node("aten.scaled_dot_product_attention.default", q, t(b, kv, seq, e), t(b, kv, seq, e),
                  None, 0.0, True, enable_gqa=True),
    ]
    for node in nodes:
        check_everywhere(node)
    causal = nodes[0]
    assert not any(S(2) in tuple(s.outputs[0]) for m in MESHES for s in R.candidate_signatures(causal, m))
    if seq % 2 == 0:
        assert sig("[S(2)], [B], [B] -> [S(2)]") in R.candidate_signatures(nodes[1], (2,))


@HYP
@given(n=SIZES, c=SIZES, d=SIZES, red=st.sampled_from([0, 1, 2]))
@example(n=4, c=3, d=2, red=1)
@example(n=4, c=3, d=4, red=2)
def test_losses(n, c, d, red):
    ids = torch.empty(n, dtype=torch.int64)
    nodes = [
        make_node("aten.cross_entropy_loss.default", t(n, c), ids, None, red),
        make_node("aten.cross_entropy_loss.default", t(n, c, d), torch.empty(n, d, dtype=torch.int64), None, red),
        make_node("aten.cross_entropy_loss.default", t(n, c), ids, t(c), red),
        make_node("aten.cross_entropy_loss.default", t(n, c), t(n, c), None, red, -100, 0.1),
        make_node("aten.nll_loss.default", t(n, c), ids, None, red),
        make_node("aten.mse_loss.default", t(n, d), t(n, d), red),
        make_node("aten.l1_loss.default", t(n, d), t(n, d), red),
        make_node("aten.binary_cross_entropy_with_logits.default", t(n, d), t(n, d), None, t(d), red),
    ]
    for node in nodes:
        check_everywhere(node)


def test_less_common_ops():
    nodes = [
        make_node("aten.matmul.default", t(4, 8), t(8)),
        make_node("aten.matmul.default", t(8), t(2, 8, 4)),
        make_node("aten.rms_norm.default", t(4, 2, 8), [8], t(8), 1e-6),
        make_node("aten.max.other", t(4, 8), t(8)),
        make_node("aten.max_pool2d_with_indices.default", t(2, 4, 4, 4), [2, 2]),
        make_node("aten.narrow.default", t(4, 8), 1, 2, 4),
        make_node("aten.swapaxes.default", t(4, 2, 8), 0, 2),
        make_node("aten._assert_tensor_metadata.default", t(4, 8, dtype=torch.float64), dtype=torch.float64),
        make_node("aten.softmax.int", t(4, 8), -1),
        make_node("aten.copy_.default", t(4, 8), t(8)),
        make_node("aten.lerp.Scalar", t(4, 8), t(4, 8), 0.3),
        make_node("aten.stack.default", [t(4, 2), t(4, 2)], -1),
    ]
    for node in nodes:
        assert R.has_rule(node), node.target
        check_everywhere(node)


def test_factories_are_broadcast_only():
    nodes = [
        make_node("aten.arange.start", 0, 8, dtype=torch.int64, device=torch.device("cpu")),
        make_node("aten.zeros.default", [4, 4], dtype=torch.float32),
        make_node("aten.full.default", [4, 4], 2.0),
        make_node("aten.new_zeros.default", t(4, 4), [4, 2]),
    ]
    for node in nodes:
        cands = R.candidate_signatures(node, (2, 2))
        assert all(nd.is_broadcast for s in cands for nd in s.outputs)
        check_everywhere(node)


# -- divisibility, placeholders, fallback --------------------------------------------------------
def test_odd_shapes_drop_splits():
    lin = make_node("aten.linear.default", t(3, 8), t(5, 8), t(5))
    cands = R.candidate_signatures(lin, (2,))
    assert [str(s) for s in cands] == ["[B], [B], [B] -> [B]", "[S(1)], [S(1)], [P] -> [P]",
                                       "[P], [B], [P] -> [P]", "[B], [P], [P] -> [P]"]
    add = make_node("aten.add.Tensor", t(2, 8), t(2, 8))
    splits0 = [s for s in R.candidate_signatures(add, (2, 2)) if s.outputs[0] == NdSbp.of(S(0), S(0))]
    assert splits0 == []  # dim 0 of size 2 cannot be cut in 4
    assert sig("[S(0), S(1)], [S(0), S(1)] -> [S(0), S(1)]") in R.candidate_signatures(add, (2, 2))


def test_candidates_are_unique_and_all_broadcast_first():
    for node in (make_node("aten.linear.default", t(4, 8, 8), t(8, 8), t(8)),
                 make_node("aten.view.default", t(4, 8), [4, 2, 4])):
        for m in MESHES:
            cands = R.candidate_signatures(node, m)
            assert len(set(cands)) == len(cands)
            assert all(nd.is_broadcast for nd in cands[0].inputs + cands[0].outputs)


def test_placeholder_candidates():
    node = autoddl.OpNode("w", NodeKind.PARAMETER, "w", outputs=(autoddl.TensorMeta((4, 6), "float32"),))
    assert [str(s.outputs[0]) for s in R.placeholder_candidates(node, (2,))] == ["[B]", "[S(0)]", "[S(1)]"]
    assert [str(s.outputs[0]) for s in R.placeholder_candidates(node, (4,))] == ["[B]", "[S(0)]"]
    assert len(R.placeholder_candidates(node, (2, 2))) == 8   # 3 x 3 minus [S(1), S(1)] (6 % 4)
    assert not any(s.outputs[0].has_partial for s in R.placeholder_candidates(node, (2, 2)))


def test_op_without_a_rule_falls_back_to_broadcast():
    class Cum(nn.Module):
        def forward(self, x):
            return torch.trace(x).relu()

    g = autoddl.trace(Cum(), (torch.randn(4, 4),))
    assert R.unsupported_ops(g) == ["trace"]
    cands = R.candidate_signatures(g["trace"], (2, 2))
    assert cands == [Signature((NdSbp.of(B, B),), (NdSbp.of(B, B),))]
    out = g.nodes_of(NodeKind.OUTPUT)[0]
    assert {str(s) for s in R.candidate_signatures(out, (2,))} == {"[B] -> ", "[P] -> "}


# -- the example models ----------------------------------------------------------------------------
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    mod_name = f"_rules_example_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    return sys.modules[mod_name]


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp", "resnet", "vgg"])
def test_example_models_are_fully_covered(name):
    if not (EXAMPLES / f"{name}.py").exists():
        pytest.skip(f"examples/{name}.py not written yet")
    m = load_example(name)
    graph = autoddl.trace(m.build_model("tiny"), m.example_inputs("tiny"), getattr(m, "loss_fn", None))
    assert R.unsupported_ops(graph) == []
    seen = set()
    for node in graph.ops():   # one node per op target, every candidate executed
        if node.target not in seen:
            seen.add(node.target)
            check_all(node, (2, 2))


# -- the ops Hugging Face decoders add: masks from positions, routing, scans -----------------------
def test_hf_mask_routing_and_scan_ops_execute_correctly():
    """Issue 11 item 3: the ops the HF decoders had without a rule (causal masks made from
    positions, MoE routing), each checked by execution, with the layouts that matter present."""
    i64 = torch.int64
    cases = [
        (make_node("aten.cumsum.default", t(4, 8), -1), "[S(0)] -> [S(0)]"),
        (make_node("aten.cumsum.default", t(4, 8, dtype=i64), 1), "[S(0)] -> [S(0)]"),
        (make_node("aten.diff.default", t(4, 8), 1, -1, t(4, 1)), "[S(0)], [S(0)] -> [S(0)]"),
        (make_node("aten.topk.default", t(8, 4), 2), "[S(0)] -> [S(0)], [S(0)]"),
        (make_node("aten.sort.default", t(4, 8), 0), "[S(1)] -> [S(1)], [S(1)]"),
        (make_node("aten.index.Tensor", t(8, 16, dtype=i64), [t(8, 1, 1, 1, dtype=i64), t(1, 1, 16, 1, dtype=i64)]),
         "[B], [S(0)], [B] -> [S(0)]"),
        (make_node("aten.index.Tensor", t(8, 4), [t(16, dtype=i64)]), "[B], [S(0)] -> [S(0)]"),
        (make_node("aten.index.Tensor", t(4, 8, 6), [None, t(4, 2, dtype=i64)]), "[S(0)], [B] -> [S(0)]"),
        (make_node("aten.index.Tensor", t(4, 8, 6), [t(4, dtype=i64), None, t(4, dtype=i64)]), "[S(1)], [B], [B] -> [S(1)]"),
        (make_node("aten.index_put_.default", t(8, 4), [t(8, dtype=i64)], t(8, 4), True), "[S(1)], [B], [S(1)] -> [S(1)]"),
        (make_node("aten.index_put.default", t(8, 4), [t(6, dtype=i64)], t(4), False), "[S(1)], [B], [S(0)] -> [S(1)]"),
        (make_node("aten.histc.default", t(16), 4, 0, 3), "[S(0)] -> [P]"),
        (make_node("aten.__and__.Tensor", t(dtype=torch.bool), t(4, 1, 8, 8, dtype=torch.bool)), "[B], [S(2)] -> [S(2)]"),
        (make_node("aten.empty_like.default", t(4, 8, dtype=i64)), "[S(1)] -> [S(1)]"),
    ]
    for node, expected in cases:
        assert R.has_rule(node), node.target
        assert sig(expected) in R.candidate_signatures(node, (2,)), (node.target, expected)
        if node.op_name != "empty_like":           # uninitialised values: nothing to compare
            check_everywhere(node)
    scan = make_node("aten.cumsum.default", t(4, 8), 1)
    assert not any(s.inputs[0] == NdSbp.of(S(1)) for s in R.candidate_signatures(scan, (2,)))  # the scanned dim


def test_integer_histc_runs_on_cpu_through_its_kernel():
    """The meta trace of HF's grouped_mm experts records an integer histc (its non-CPU branch); CPU
    has no such kernel. The local kernel counts in float64: the same bins, the traced dtype."""
    node = make_node("aten.histc.default", t(64, dtype=torch.int32), 4, 0, 3)
    x = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="histogram"):
        torch.histc(x, 4, 0, 3)
    run = R.local_callable(node, R.candidate_signatures(node, (2,))[0], (2,), (0,))
    counts = run(x, 4, 0, 3)
    assert counts.dtype == torch.int32 and counts.tolist() == torch.bincount(x.long(), minlength=4).tolist()
