"""FLOPs and bytes of traced aten ops against the formulas of autoddl/flops.py, computed by hand here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoddl
from autoddl.flops import op_bytes, op_flops
from autoddl.graph import TensorMeta

F32 = 4


class Fn(nn.Module):
    """Wrap a function as a module so trace() can export it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def only(module: nn.Module, inputs, target: str):
    """Trace ``module`` and return its single op node with aten target ``target``."""
    graph = autoddl.trace(module, inputs)
    nodes = [n for n in graph.ops() if n.target == target]
    assert len(nodes) == 1, [n.target for n in graph.ops()]
    return nodes[0]


def r(*shape):
    return torch.randn(*shape)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    node = only(nn.Linear(8, 4, bias=bias), (r(2, 3, 8),), "aten.linear.default")
    out = 2 * 3 * 4
    assert node.flops == 2 * out * 8 + (out if bias else 0)
    assert len(node.inputs) == (3 if bias else 2)


def test_mm_and_its_bytes():
    node = only(Fn(torch.mm), (r(6, 5), r(5, 7)), "aten.mm.default")
    assert node.flops == 2 * 6 * 5 * 7
    assert node.bytes_read == (6 * 5 + 5 * 7) * F32
    assert node.bytes_written == 6 * 7 * F32


def test_addmm():
    node = only(Fn(torch.addmm), (r(7), r(6, 5), r(5, 7)), "aten.addmm.default")
    assert node.flops == 2 * 6 * 5 * 7 + 6 * 7


def test_bmm():
    node = only(Fn(torch.bmm), (r(3, 6, 5), r(3, 5, 7)), "aten.bmm.default")
    assert node.flops == 2 * 3 * 6 * 5 * 7


def test_matmul_broadcast():
    node = only(Fn(torch.matmul), (r(3, 6, 5), r(5, 7)), "aten.matmul.default")
    assert node.flops == 2 * (3 * 6 * 7) * 5


def test_einsum():
    node = only(Fn(lambda a, b: torch.einsum("bij,bjk->bik", a, b)), (r(3, 6, 5), r(3, 5, 7)),
                "aten.einsum.default")
    assert node.flops == 2 * 3 * 6 * 5 * 7


def _sdpa_flops(b, hq, lq, s, e, ev, mask=False):
    scores = b * hq * lq * s
    return 2 * scores * e + 2 * scores * ev + 5 * scores + (scores if mask else 0)


def test_sdpa():
    q, k, v = r(2, 4, 6, 8), r(2, 4, 10, 8), r(2, 4, 10, 16)
    node = only(Fn(F.scaled_dot_product_attention), (q, k, v), "aten.scaled_dot_product_attention.default")
    assert node.flops == _sdpa_flops(2, 4, 6, 10, 8, 16)


def test_sdpa_causal_is_not_discounted():
    fn = Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    node = only(fn, (r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 8)), "aten.scaled_dot_product_attention.default")
    assert node.flops == _sdpa_flops(2, 4, 6, 6, 8, 8)


def test_sdpa_gqa_counts_query_heads():
    fn = Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    node = only(fn, (r(2, 8, 6, 4), r(2, 2, 10, 4), r(2, 2, 10, 4)), "aten.scaled_dot_product_attention.default")
    assert node.flops == _sdpa_flops(2, 8, 6, 10, 4, 4)


def test_sdpa_with_mask():
    fn = Fn(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    node = only(fn, (r(2, 4, 6, 8), r(2, 4, 10, 8), r(2, 4, 10, 8), r(6, 10)),
                "aten.scaled_dot_product_attention.default")
    assert node.flops == _sdpa_flops(2, 4, 6, 10, 8, 8, mask=True)


def test_conv2d_groups_and_stride():
    conv = nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
    node = only(conv, (r(2, 4, 9, 9),), "aten.conv2d.default")
    h_out = (9 + 2 * 1 - 3) // 2 + 1
    out = 2 * 8 * h_out * h_out
    assert node.outputs[0].shape == (2, 8, h_out, h_out)
    assert node.flops == 2 * out * (4 // 2) * 3 * 3 + out


def test_conv2d_without_bias():
    node = only(nn.Conv2d(3, 5, (3, 2), bias=False), (r(1, 3, 7, 6),), "aten.conv2d.default")
    out = 1 * 5 * 5 * 5
    assert node.flops == 2 * out * 3 * 3 * 2


def test_conv_transpose2d():
    node = only(nn.ConvTranspose2d(4, 6, 3, stride=2), (r(2, 4, 5, 5),), "aten.conv_transpose2d.input")
    out = math.prod(node.outputs[0].shape)
    assert node.flops == 2 * (2 * 4 * 5 * 5) * 6 * 3 * 3 + out


def test_embedding_is_free_and_reads_only_rows():
    node = only(nn.Embedding(1000, 16), (torch.randint(0, 1000, (2, 3)),), "aten.embedding.default")
    assert node.flops == 0
    assert node.bytes_read == 2 * 3 * 16 * F32 + 2 * 3 * 8      # gathered rows + int64 indices
    assert node.bytes_written == 2 * 3 * 16 * F32


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine):
    node = only(nn.LayerNorm(8, elementwise_affine=affine), (r(2, 3, 8),), "aten.layer_norm.default")
    assert node.flops == (5 + (2 if affine else 0)) * 2 * 3 * 8


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm(affine):
    node = only(nn.BatchNorm2d(4, affine=affine), (r(2, 4, 5, 5),), "aten.batch_norm.default")
    assert node.flops == (5 + (2 if affine else 0)) * 2 * 4 * 5 * 5


def test_elementwise_ops_one_flop_per_output_element():
    graph = autoddl.trace(Fn(lambda a, b: torch.relu(a * b + a).exp()), (r(3, 4), r(3, 4)))
    targets = [n.target for n in graph.ops()]
    assert targets == ["aten.mul.Tensor", "aten.add.Tensor", "aten.relu.default", "aten.exp.default"]
    assert [n.flops for n in graph.ops()] == [12] * 4
    add = graph.ops()[1]
    assert (add.bytes_read, add.bytes_written) == (2 * 12 * F32, 12 * F32)


def test_broadcasting_elementwise_counts_output():
    node = only(Fn(lambda a, b: a + b), (r(3, 4), r(4)), "aten.add.Tensor")
    assert node.flops == 12


def test_softmax_and_reduction():
    graph = autoddl.trace(Fn(lambda a: a.softmax(-1).sum(-1)), (r(3, 4),))
    softmax, total = graph.ops()
    assert (softmax.target, total.target) == ("aten.softmax.int", "aten.sum.dim_IntList")
    assert softmax.flops == 5 * 12
    assert total.flops == 12


def test_max_pool2d():
    node = only(nn.MaxPool2d(3, stride=1), (r(2, 4, 6, 6),), "aten.max_pool2d.default")
    assert node.flops == (2 * 4 * 4 * 4) * 3 * 3


def test_adaptive_avg_pool2d():
    node = only(nn.AdaptiveAvgPool2d((2, 3)), (r(2, 4, 6, 6),), "aten.adaptive_avg_pool2d.default")
    assert node.flops == 2 * 4 * 6 * 6


def test_cross_entropy():
    node = only(Fn(F.cross_entropy), (r(6, 10), torch.randint(0, 10, (6,))), "aten.cross_entropy_loss.default")
    assert node.flops == 5 * 6 * 10 + 6


@pytest.mark.parametrize("train", [True, False])
def test_dropout(train):
    drop = nn.Dropout(0.1).train(train)
    node = only(drop, (r(3, 4),), "aten.dropout.default")
    assert node.flops == (12 if train else 0)
    assert node.bytes_written == (12 * F32 if train else 0)


def test_views_move_nothing_and_copies_move_bytes():
    graph = autoddl.trace(Fn(lambda a: a.view(4, 3).transpose(0, 1).contiguous()), (r(3, 4),))
    view, transpose, contiguous = graph.ops()
    assert view.target == "aten.view.default" and transpose.target == "aten.transpose.int"
    for n in (view, transpose):
        assert (n.flops, n.bytes_read, n.bytes_written) == (0, 0, 0)
    assert contiguous.flops == 0
    assert (contiguous.bytes_read, contiguous.bytes_written) == (12 * F32, 12 * F32)


def test_dtype_cast_copies_only_when_dtype_changes():
    assert op_bytes("to", [TensorMeta((3, 4), "float32")], [TensorMeta((3, 4), "float16")]) == (48, 24)
    assert op_bytes("to", [TensorMeta((3, 4), "float32")], [TensorMeta((3, 4), "float32")]) == (0, 0)


def test_unknown_op_falls_back_to_elementwise():
    metas = [TensorMeta((5, 2), "float32")]
    assert op_flops("some_new_op", metas, metas, ()) == 10


# -- recurrent layers, sorts, custom ops, registered formulas, the coverage report -----------------------

@pytest.mark.parametrize("cell, gates, elementwise", [(nn.GRU, 3, 11), (nn.LSTM, 4, 13)])
@pytest.mark.parametrize("layers, bidirectional", [(1, False), (2, True)])
def test_recurrent_layer_against_hand_count(cell, gates, elementwise, layers, bidirectional):
    seq, batch, size_in, hidden = 7, 3, 10, 6
    rnn = cell(size_in, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
    target = "aten.gru.input" if cell is nn.GRU else "aten.lstm.input"
    node = only(rnn, (r(batch, seq, size_in),), target)
    dirs = 2 if bidirectional else 1
    expected = 0
    for layer in range(layers):
        i = size_in if layer == 0 else hidden * dirs
        matmuls = 2 * (gates * hidden * i) + 2 * (gates * hidden * hidden)   # W_ih x and W_hh h per step
        biases = 2 * gates * hidden                                           # b_ih and b_hh
        expected += dirs * seq * batch * (matmuls + biases + elementwise * hidden)
    assert node.flops == expected


def test_big_gru_is_not_free():
    """The issue's case: a GRU was priced at 0.008 GFLOPs instead of ~100."""
    with torch.device("meta"):
        gru = nn.GRU(1024, 1024, num_layers=2, batch_first=True)
    node = only(gru, (torch.empty(32, 512, 1024, device="meta"),), "aten.gru.input")
    per_layer = 32 * 512 * (2 * 3 * 1024 * (1024 + 1024) + 2 * 3 * 1024 + 11 * 1024)
    assert node.flops == 2 * per_layer and node.flops > 400e9


def test_topk_and_sort_count_comparisons():
    node = only(Fn(lambda x: torch.topk(x, 2, dim=-1).values), (r(4, 16),), "aten.topk.default")
    assert node.flops == 4 * 16 * 4                                  # log2(16) = 4 per element
    node = only(Fn(lambda x: torch.sort(x, dim=0).values), (r(8, 3),), "aten.sort.default")
    assert node.flops == 8 * 3 * 3


@torch.library.custom_op("autoddl_test::proj", mutates_args=())
def _proj(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@_proj.register_fake
def _proj_fake(x, w):
    return x @ w                       # the fake implementation has the matmul structure


@torch.library.custom_op("autoddl_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu()


@_opaque.register_fake
def _opaque_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[1])      # shapes only: nothing to count


def test_custom_op_flops_from_its_fake_implementation():
    from autoddl.flops import flop_source

    node = only(Fn(torch.ops.autoddl_test.proj), (r(6, 5), r(5, 7)), "autoddl_test.proj.default")
    assert node.flops == 2 * 6 * 5 * 7
    assert flop_source(node.op_name) == "formula"


def test_custom_op_without_structure_is_reported_then_registered():
    from autoddl.flops import _REGISTERED, flop_source
    from autoddl.ops import UncoveredOpWarning, coverage_report

    module, inputs = Fn(lambda x, w: torch.ops.autoddl_test.opaque(x, w) * 2), (r(6, 5), r(5, 7))
    with pytest.warns(UncoveredOpWarning, match=r"without a FLOP formula.*autoddl_test\.opaque\.default x1"):
        graph = autoddl.trace(module, inputs)
    (node,) = [n for n in graph.ops() if n.target == "autoddl_test.opaque.default"]
    assert node.flops == 6 * 7 and flop_source(node.op_name) == "estimate"   # 1 per output element
    report = coverage_report(graph)
    assert report.no_flops == {"autoddl_test.opaque.default": 1}
    assert report.no_rule == {"autoddl_test.opaque.default": 1}              # and replicated: no SBP rule
    try:
        autoddl.register_flops("autoddl_test::opaque", lambda ins, outs, args, kw:
                               2 * ins[0].shape[0] * ins[0].shape[1] * ins[1].shape[1] + outs[0].numel)
        (node,) = [n for n in autoddl.trace(module, inputs).ops() if n.target == "autoddl_test.opaque.default"]
        assert node.flops == 2 * 6 * 5 * 7 + 6 * 7
        assert coverage_report(autoddl.trace(module, inputs)).no_flops == {}
    finally:
        _REGISTERED.pop("autoddl_test.opaque", None)


def test_register_flops_rejects_a_non_callable():
    with pytest.raises(TypeError, match=r"register_flops\('x::y', fn\): fn must be callable"):
        autoddl.register_flops("x::y", 3)


def test_grouped_mm_fallback_counts_one_expert_matmul_per_token():
    transformers_moe = pytest.importorskip("transformers.integrations.moe")
    assert transformers_moe is not None
    tokens, k, n, experts = 12, 8, 5, 4
    offs = torch.tensor([3, 6, 9, 12])
    node = only(Fn(torch.ops.transformers.grouped_mm_fallback), (r(tokens, k), r(experts, k, n), offs),
                "transformers.grouped_mm_fallback.default")
    assert node.flops == 2 * tokens * k * n


def test_coverage_report_of_a_covered_model_is_empty():
    from autoddl.ops import coverage_report

    graph = autoddl.trace(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8)), (r(2, 4),))
    report = coverage_report(graph)
    assert not report and report.lines() == []
