"""Unit tests of costmodel: collective formulas, boxing, gradient SBPs, roofline, optimizer."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autoddl.boxing import boxing_moves
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Backend, Cluster, Efficiency, LinkSpec
from autoddl.graph import NodeKind, OpNode, TensorMeta, TensorRef
from autoddl.sbp import B, P, S, NdSbp, Signature
from costmodel import (BACKENDS, CollectiveKind, backward_boxing_collectives, backward_boxing_time_s,
                       backward_factor, boxing_collectives, boxing_time_s, carried_out_as, collective_time_s,
                       grad_sbp, needed_grad_sbp, op_compute_time_s, optimizer_time_s)
from costmodel.compute import op_backward_time_s, op_forward_time_s, work_divisor
from clusters import CPU_CLUSTER_PATH

K = CollectiveKind
LINK = LinkSpec(bandwidth_gbps=100.0, latency_us=3.0)
M = 64 * 2**20
EFF = 0.8


def nd(*sbps):
    return NdSbp(tuple(sbps))


@pytest.fixture(scope="module")
def a100():
    return Cluster.from_yaml(DEFAULT_CLUSTER_PATH)


@pytest.fixture(scope="module")
def two_nodes(a100):
    """2 DGX nodes x 8: mesh axes inside a node use NVLink, the outer one InfiniBand."""
    return a100.resized(16)


def _b_a(link=LINK, eff=EFF):
    return link.bandwidth_gbps * 1e9 * eff, link.latency_us * 1e-6


# -- collectives -----------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_nccl_formulas_each_kind(n):
    b, a = _b_a()
    expected = {
        K.ALL_REDUCE: 2 * (n - 1) / n * M / b + 2 * (n - 1) * a,
        K.ALL_GATHER: (n - 1) / n * M / b + (n - 1) * a,
        K.REDUCE_SCATTER: (n - 1) / n * M / b + (n - 1) * a,
        K.ALL_TO_ALL: (n - 1) / n * (M / n) / b + (n - 1) * a,
        K.BROADCAST: M / b + (n - 1) * a,
    }
    for kind, want in expected.items():
        assert collective_time_s(kind, M, n, LINK, Backend.NCCL, EFF) == pytest.approx(want, rel=1e-12), kind


def test_gloo_emulation():
    n = 4
    b, a = _b_a()
    all_reduce = 2 * (n - 1) / n * M / b + 2 * (n - 1) * a
    all_gather = (n - 1) / n * M / b + (n - 1) * a
    assert collective_time_s(K.REDUCE_SCATTER, M, n, LINK, Backend.GLOO, EFF) == pytest.approx(all_reduce)
    all_to_all = (n - 1) / n * (M / n) / b + (n - 1) * a                 # native: alltoall_base
    assert collective_time_s(K.ALL_TO_ALL, M, n, LINK, Backend.GLOO, EFF) == pytest.approx(all_to_all)
    assert collective_time_s(K.ALL_REDUCE, M, n, LINK, "gloo", EFF) == pytest.approx(all_reduce)
    assert collective_time_s(K.ALL_GATHER, M, n, LINK, "gloo", EFF) == pytest.approx(all_gather)
    # gloo's reduce-scatter costs twice NCCL's bandwidth term
    assert collective_time_s(K.REDUCE_SCATTER, M, n, LINK, "gloo", EFF) > \
        1.9 * collective_time_s(K.REDUCE_SCATTER, M, n, LINK, "nccl", EFF)


def test_backend_table():
    assert carried_out_as(K.REDUCE_SCATTER, "gloo") is K.ALL_REDUCE
    assert carried_out_as(K.ALL_TO_ALL, Backend.GLOO) is K.ALL_TO_ALL
    assert all(carried_out_as(k, "nccl") is k for k in K)
    assert set(BACKENDS) == set(Backend)
    with pytest.raises(ValueError, match="unknown backend"):
        carried_out_as(K.ALL_REDUCE, "mpi")


def test_one_device_is_free_and_bad_inputs():
    assert all(collective_time_s(k, M, 1, LINK, "nccl") == 0.0 for k in K)
    with pytest.raises(ValueError):
        collective_time_s(K.ALL_REDUCE, M, 0, LINK, "nccl")
    with pytest.raises(ValueError, match="network_eff"):
        collective_time_s(K.ALL_REDUCE, M, 2, LINK, "nccl", network_eff=0)


def test_link_selection_on_2d_mesh(two_nodes):
    mesh = (2, 8)
    assert two_nodes.link_for_axis(mesh, 0) == two_nodes.inter_node
    assert two_nodes.link_for_axis(mesh, 1) == two_nodes.intra_node
    meta = TensorMeta((64, 1024), "float32")
    # P -> B on the outer axis only: an all-reduce over 2 devices on InfiniBand,
    # on the tensor as split by the inner axis (S(1) over 8 devices)
    src, dst = nd(P, S(1)), nd(B, S(1))
    assert boxing_collectives(meta, src, dst, mesh) == [(K.ALL_REDUCE, 0, meta.nbytes // 8)]
    b, a = _b_a(two_nodes.inter_node, two_nodes.efficiency.network)
    m = meta.nbytes / 8
    assert boxing_time_s(meta, src, dst, mesh, two_nodes) == pytest.approx(m / b + 2 * a)
    # the same on the inner axis uses NVLink over 8 devices
    src2, dst2 = nd(S(0), P), nd(S(0), B)
    b2, a2 = _b_a(two_nodes.intra_node, two_nodes.efficiency.network)
    m2 = meta.nbytes / 2
    assert boxing_time_s(meta, src2, dst2, mesh, two_nodes) == pytest.approx(2 * 7 / 8 * m2 / b2 + 14 * a2)


# -- boxing ------------------------------------------------------------------------
def test_boxing_table_1d():
    meta = TensorMeta((8, 16), "float32")
    mesh = (4,)
    cases = {
        (S(0), B): K.ALL_GATHER, (P, B): K.ALL_REDUCE, (P, S(1)): K.REDUCE_SCATTER,
        (S(0), S(1)): K.ALL_TO_ALL, (B, S(0)): None, (B, P): None, (S(0), P): None,
        (B, B): None, (P, P): None, (S(1), S(1)): None,
    }
    for (s, d), kind in cases.items():
        got = boxing_collectives(meta, nd(s), nd(d), mesh)
        assert got == ([] if kind is None else [(kind, 0, meta.nbytes)]), (s, d)


def test_boxing_nd_follows_dtensor_step_order():
    """N-D boxing is DTensor's greedy redistribute, step by step, each step on the tensor as the
    steps before left it (convention changed from 'every axis on the source's split of the
    others', which no real redistribute achieves). executor audit tests check it against runs."""
    meta = TensorMeta((16, 32), "bfloat16")
    mesh = (2, 4)
    # sharded source: inner axis first (gathers its S(1) while axis 0 still splits: nbytes / 2),
    # then the outer axis gathers the whole tensor
    got = boxing_collectives(meta, nd(S(0), S(1)), nd(B, B), mesh)
    assert got == [(K.ALL_GATHER, 1, meta.nbytes // 2), (K.ALL_GATHER, 0, meta.nbytes)]
    # ZeRO-3 over both axes: the nested S(0) pieces are gathered inner axis first as well
    assert boxing_collectives(meta, nd(S(0), S(0)), nd(B, B), mesh) == \
        [(K.ALL_GATHER, 1, meta.nbytes // 2), (K.ALL_GATHER, 0, meta.nbytes)]
    # a data-parallel x tensor-parallel gradient [P, S(0)] -> [B, B]: DTensor gathers axis 1
    # first, so the all-reduce on axis 0 moves the whole tensor
    assert boxing_collectives(meta, nd(P, S(0)), nd(B, B), mesh) == \
        [(K.ALL_GATHER, 1, meta.nbytes), (K.ALL_REDUCE, 0, meta.nbytes)]
    # unsharded source: outer axis first
    assert boxing_collectives(meta, nd(P, P), nd(B, S(1)), mesh) == \
        [(K.ALL_REDUCE, 0, meta.nbytes), (K.REDUCE_SCATTER, 1, meta.nbytes)]
    # nested sharding (S(0), S(0)) -> (B, S(0)): axis 1's S(0) must be gathered and re-split
    assert boxing_collectives(meta, nd(S(0), S(0)), nd(B, S(0)), mesh) == \
        [(K.ALL_GATHER, 1, meta.nbytes // 2), (K.ALL_GATHER, 0, meta.nbytes)]
    # a size-1 axis never communicates
    assert boxing_collectives(meta, nd(S(0), P), nd(B, B), (1, 4)) == [(K.ALL_REDUCE, 1, meta.nbytes)]


def test_all_reduces_on_several_axes_are_one_over_their_flattened_group():
    """P -> B on several axes (a data-parallel gradient over two axes) is one all-reduce over the
    group of those axes flattened, on the tensor as the other axes' splits leave it; an all-reduce
    that another collective separates from the next stays on its own axis."""
    meta = TensorMeta((16, 32), "float32")
    assert boxing_collectives(meta, nd(P, P), nd(B, B), (2, 4)) == [(K.ALL_REDUCE, (0, 1), meta.nbytes)]
    assert boxing_collectives(meta, nd(S(0), P, P), nd(S(0), B, B), (2, 2, 2)) == \
        [(K.ALL_REDUCE, (1, 2), meta.nbytes // 2)]
    assert boxing_collectives(meta, nd(P, S(1), P), nd(B, S(1), B), (2, 2, 2)) == \
        [(K.ALL_REDUCE, (0, 2), meta.nbytes // 2)]
    assert boxing_collectives(meta, nd(P, P, S(0)), nd(B, B, B), (2, 2, 2)) == \
        [(K.ALL_GATHER, 2, meta.nbytes), (K.ALL_REDUCE, (0, 1), meta.nbytes)]
    assert boxing_collectives(meta, nd(P, P), nd(B, S(1)), (2, 4)) == \
        [(K.ALL_REDUCE, 0, meta.nbytes), (K.REDUCE_SCATTER, 1, meta.nbytes)]
    [move] = boxing_moves(meta.nbytes, nd(P, P), nd(B, B), (2, 4))
    assert (move.axes, move.group, move.before, move.after) == ((0, 1), (0, 1), nd(P, P), nd(B, B))


def test_boxing_to_partial_is_local_unless_nested():
    meta = TensorMeta((16, 32), "float32")
    mesh = (2, 2)
    # S -> P keeps the own piece zero-padded, B -> P keeps the value on one device: no collective
    assert boxing_collectives(meta, nd(S(0), B), nd(P, B), mesh) == []
    assert boxing_collectives(meta, nd(S(0), S(0)), nd(P, P), mesh) == []
    assert boxing_collectives(meta, nd(B, S(1)), nd(P, S(1)), mesh) == []
    # axis 0's S(0) pieces nest inside axis 1's S(0) split: they do not add up to its pieces,
    # so axis 0 goes S -> B (an all-gather of the half axis 1 leaves) -> P
    assert boxing_collectives(meta, nd(S(0), S(0)), nd(P, S(0)), mesh) == [
        (K.ALL_GATHER, 1, meta.nbytes // 2), (K.ALL_GATHER, 0, meta.nbytes)]


def test_boxing_rejects_non_dividing_split():
    with pytest.raises(ValueError, match="does not divide"):
        boxing_collectives(TensorMeta((6, 4), "float32"), nd(S(0)), nd(B), (4,))


def test_grad_sbp_rule():
    assert grad_sbp(S(1), [B]) == S(1)
    assert grad_sbp(P, [S(0)]) == B
    assert grad_sbp(B, [B, B]) == B
    assert grad_sbp(B, [S(1)]) == P
    assert grad_sbp(B, [B, P]) == P
    assert needed_grad_sbp(S(2)) == S(2) and needed_grad_sbp(B) == B and needed_grad_sbp(P) == B


def test_backward_boxing_dual(a100):
    meta = TensorMeta((32, 64), "float32")
    mesh = (8,)
    # Megatron column-parallel input: x is B, the op's output S(1) -> gradient P -> all-reduce
    assert backward_boxing_collectives(meta, nd(B), nd(B), mesh, [nd(S(1))]) == [(K.ALL_REDUCE, 0, meta.nbytes)]
    # replicated op (output B): gradient B, nothing to do
    assert backward_boxing_collectives(meta, nd(B), nd(B), mesh, [nd(B)]) == []
    # forward all-gather S(0) -> B into a split op: backward P -> S(0) reduce-scatter
    assert backward_boxing_collectives(meta, nd(S(0)), nd(B), mesh, [nd(S(1))]) == \
        [(K.REDUCE_SCATTER, 0, meta.nbytes)]
    # forward P -> B all-reduce: the gradient of B into a replicated op is B, P needs B: free
    assert backward_boxing_collectives(meta, nd(P), nd(B), mesh, [nd(B)]) == []
    # forward B -> S(0) (local): backward S(0) -> B all-gather
    assert backward_boxing_collectives(meta, nd(B), nd(S(0)), mesh, [nd(S(0))]) == [(K.ALL_GATHER, 0, meta.nbytes)]
    # integer tensors have no gradient
    assert backward_boxing_collectives(TensorMeta((32,), "int64"), nd(B), nd(B), mesh, [nd(S(0))]) == []
    # a B target needs the consumer's outputs
    with pytest.raises(ValueError, match="consumer_outputs"):
        backward_boxing_collectives(meta, nd(S(0)), nd(B), mesh)
    b, a = _b_a(a100.intra_node, a100.efficiency.network)
    assert backward_boxing_time_s(meta, nd(B), nd(B), mesh, a100, [nd(S(1))]) == \
        pytest.approx(2 * 7 / 8 * meta.nbytes / b + 14 * a)


# -- compute -----------------------------------------------------------------------
def _op(target, inputs, outputs, flops, bytes_read, bytes_written):
    return OpNode(name=target.split(".")[1], kind=NodeKind.OP, target=target, input_metas=tuple(inputs),
                  outputs=tuple(outputs), flops=flops, bytes_read=bytes_read, bytes_written=bytes_written)


def test_roofline_compute_bound_matmul(a100):
    n = 8192
    a_, b_ = TensorMeta((n, n), "float32"), TensorMeta((n, n), "float32")
    node = _op("aten.mm.default", [a_, b_], [a_], 2 * n**3, 2 * a_.nbytes, a_.nbytes)
    dev, eff = a100.device, a100.efficiency
    flops_t = 2 * n**3 / (dev.peak_tflops * 1e12 * eff.compute)
    mem_t = 3 * a_.nbytes / (dev.memory_bandwidth_gbps * 1e9 * eff.memory)
    assert flops_t > mem_t                                       # compute-bound regime
    ov = a100.op_overhead_us * 1e-6
    sig = Signature((nd(B), nd(B)), (nd(B),))
    assert op_forward_time_s(node, sig, (8,), a100) == pytest.approx(flops_t + ov)
    assert op_backward_time_s(node, sig, (8,), a100) == pytest.approx(2 * flops_t + ov)
    assert op_compute_time_s(node, sig, (8,), a100) == pytest.approx(3 * flops_t + 2 * ov)
    # row-split over 8 devices: an eighth of the work
    sig8 = Signature((nd(S(0)), nd(B)), (nd(S(0)),))
    assert op_forward_time_s(node, sig8, (8,), a100) == pytest.approx(flops_t / 8 + ov)
    # contracted split -> P output still divides the work
    sigp = Signature((nd(S(1)), nd(S(0))), (nd(P),))
    assert work_divisor(sigp, (8,)) == 8
    assert op_compute_time_s(node, sig, (8,), a100, needs_backward=False) == pytest.approx(flops_t + ov)


def test_roofline_memory_bound_elementwise(a100):
    x = TensorMeta((4096, 4096), "float32")
    node = _op("aten.gelu.default", [x], [x], x.numel, x.nbytes, x.nbytes)
    dev, eff = a100.device, a100.efficiency
    mem_t = 2 * x.nbytes / (dev.memory_bandwidth_gbps * 1e9 * eff.memory)
    assert mem_t > x.numel / (dev.peak_tflops * 1e12 * eff.compute)   # memory-bound regime
    ov = a100.op_overhead_us * 1e-6
    sig = Signature((nd(S(0), B),), (nd(S(0), B),))
    # 2-D mesh (2, 4): split on axis 0 only divides by 2; replicated axis 1 does not
    assert op_forward_time_s(node, sig, (2, 4), a100) == pytest.approx(mem_t / 2 + ov)
    assert op_backward_time_s(node, sig, (2, 4), a100) == pytest.approx(mem_t / 2 + ov)
    # add(P, P) -> P runs full-size on every device
    add = _op("aten.add.Tensor", [x, x], [x], x.numel, 2 * x.nbytes, x.nbytes)
    assert work_divisor(Signature((nd(P), nd(P)), (nd(P),)), (8,)) == 1
    assert op_forward_time_s(add, Signature((nd(P), nd(P)), (nd(P),)), (8,), a100) == \
        pytest.approx(3 * x.nbytes / (dev.memory_bandwidth_gbps * 1e9 * eff.memory) + ov)


def test_backward_factor_per_family(a100):
    for op in ("mm", "addmm", "linear", "bmm", "matmul", "conv2d", "scaled_dot_product_attention"):
        assert backward_factor(op) == 2.0, op
    for op in ("gelu", "add", "layer_norm", "softmax", "sum", "embedding"):
        assert backward_factor(op) == 1.0, op
    for op in ("view", "transpose", "getitem", "reshape", "permute"):
        assert backward_factor(op) == 0.0, op
    x = TensorMeta((1024, 1024), "float32")
    view = _op("aten.view.default", [x], [x], 0, 0, 0)
    sig = Signature((nd(B),), (nd(B),))
    assert op_compute_time_s(view, sig, (8,), a100) == 0.0       # no launch overhead for views
    # with zero overhead, an elementwise op's backward equals its forward, a matmul's is twice
    no_ov = dataclasses.replace(a100, op_overhead_us=0.0)
    relu = _op("aten.relu.default", [x], [x], x.numel, x.nbytes, x.nbytes)
    mm = _op("aten.mm.default", [x, x], [x], 2 * 1024**3, 2 * x.nbytes, x.nbytes)
    assert op_backward_time_s(relu, sig, (8,), no_ov) == pytest.approx(op_forward_time_s(relu, sig, (8,), no_ov))
    sig2 = Signature((nd(B), nd(B)), (nd(B),))
    assert op_backward_time_s(mm, sig2, (8,), no_ov) == pytest.approx(2 * op_forward_time_s(mm, sig2, (8,), no_ov))


def test_long_softmax_rows_on_cuda_move_the_kernels_passes(a100):
    """A loss over a 128256-word vocabulary on a CUDA device (the A100 file: no measured op families):
    forward 3 reads + 1 write of the (N, C) float32 logits, backward 5 passes (aten's cunn_SoftMaxForward /
    cunn_SoftMaxBackward and nll_loss_backward's zero-filled gradient), each at the memory roofline; split
    over 8 devices, an eighth. A row of 1000 classes, a softmax over dim 0 and a CPU cluster keep the
    traced bytes (one read of the inputs, one write of the output)."""
    n, v = 8192, 128256
    logits, target = TensorMeta((n, v), "float32"), TensorMeta((n,), "int64")
    loss = TensorMeta((), "float32")
    node = _op("aten.cross_entropy_loss.default", [logits, target], [loss], 5 * n * v + n,
               logits.nbytes + target.nbytes, loss.nbytes)
    bw = a100.device.memory_bandwidth_gbps * 1e9 * a100.efficiency.memory
    ov = a100.op_overhead_us * 1e-6
    sig = Signature((nd(B), nd(B)), (nd(B),))
    assert op_forward_time_s(node, sig, (8,), a100) == pytest.approx(4 * n * v * 4 / bw + ov)
    assert op_backward_time_s(node, sig, (8,), a100) == pytest.approx(5 * n * v * 4 / bw + ov)
    split = Signature((nd(S(0)), nd(S(0))), (nd(P),))
    assert op_forward_time_s(node, split, (8,), a100) == pytest.approx(4 * n * v * 4 / 8 / bw + ov)
    small = TensorMeta((n, 1000), "float32")
    fits = _op("aten.cross_entropy_loss.default", [small, target], [loss], 0, small.nbytes + target.nbytes, 4)
    assert op_forward_time_s(fits, sig, (8,), a100) == pytest.approx((small.nbytes + target.nbytes + 4) / bw + ov)
    soft = _op("aten._softmax.default", [logits], [logits], 0, logits.nbytes, logits.nbytes)
    one = Signature((nd(B),), (nd(B),))
    last, first = dataclasses.replace(soft, args=(None, -1, False)), dataclasses.replace(soft, args=(None, 0, False))
    assert op_forward_time_s(last, one, (8,), a100) == pytest.approx(4 * logits.nbytes / bw + ov)
    assert op_backward_time_s(last, one, (8,), a100) == pytest.approx(7 * logits.nbytes / bw + ov)
    assert op_forward_time_s(first, one, (8,), a100) == pytest.approx(2 * logits.nbytes / bw + ov)
    cpu = dataclasses.replace(a100, device=dataclasses.replace(a100.device, kind="cpu"), backend="gloo")
    assert op_forward_time_s(node, sig, (8,), cpu) == pytest.approx((logits.nbytes + target.nbytes + 4) / bw + ov)


def _sdpa(batch, heads, seq, head_dim, causal):
    q = TensorMeta((batch, heads, seq, head_dim), "bfloat16")
    scores = batch * heads * seq * seq
    flops = 4 * scores * head_dim + 5 * scores                 # autoddl/flops.py: Q.K^T, A.V, softmax
    node = _op("aten.scaled_dot_product_attention.default", [q, q, q], [q], flops, 3 * q.nbytes, q.nbytes)
    return dataclasses.replace(node, args=(None, None, None, None, 0.0, causal)), flops


def test_attention_priced_at_its_own_efficiency_in_flash_attention_flop_count():
    """``efficiency.attention`` set (configs/h100-4x8.yaml: FlashAttention-2 measured on an H100, 0.275): an SDPA
    op's forward is FLOPs (halved when causal) / (bf16 peak x 0.275) + overhead, its backward 2.5 x that work;
    a matmul keeps ``efficiency.compute``; without the field SDPA is a matmul (2x backward, full FLOPs)."""
    h100 = Cluster.from_yaml(DEFAULT_CLUSTER_PATH.parent / "h100-4x8.yaml")
    assert (h100.efficiency.attention, h100.efficiency.compute, h100.op_overhead_us) == (0.275, 0.693, 13.7)
    peak, ov = 989e12, 13.7e-6
    node, flops = _sdpa(1, 32, 8192, 128, causal=True)
    sig = Signature((nd(B),) * 3, (nd(B),))
    fwd = 0.5 * flops / (peak * 0.275)
    assert op_forward_time_s(node, sig, (8,), h100) == pytest.approx(fwd + ov)
    assert op_backward_time_s(node, sig, (8,), h100) == pytest.approx(2.5 * fwd + ov)
    full, _ = _sdpa(1, 32, 8192, 128, causal=False)                # not causal: every entry computed
    assert op_forward_time_s(full, sig, (8,), h100) == pytest.approx(2 * fwd + ov)
    heads = Signature((nd(S(1)),) * 3, (nd(S(1)),))                # heads split 8 ways: an eighth
    assert op_forward_time_s(node, heads, (8,), h100) == pytest.approx(fwd / 8 + ov)
    plain = dataclasses.replace(h100, efficiency=dataclasses.replace(h100.efficiency, attention=None))
    as_matmul = flops / (peak * 0.693)
    assert op_forward_time_s(node, sig, (8,), plain) == pytest.approx(as_matmul + ov)
    assert op_backward_time_s(node, sig, (8,), plain) == pytest.approx(2 * as_matmul + ov)
    n = 8192
    a_ = TensorMeta((n, n), "bfloat16")
    mm = _op("aten.mm.default", [a_, a_], [a_], 2 * n**3, 2 * a_.nbytes, a_.nbytes)
    sig2 = Signature((nd(B), nd(B)), (nd(B),))
    assert op_forward_time_s(mm, sig2, (8,), h100) == op_forward_time_s(mm, sig2, (8,), plain) == \
        pytest.approx(2 * n**3 / (peak * 0.693) + ov)


def test_cpu_cluster_has_no_attention_efficiency_so_attention_costs_are_unchanged():
    """configs/local-cpu.yaml gives no attention field: an SDPA op costs what it cost before the field
    (a matmul-like op at ``efficiency.compute``: FLOPs / (fp32 peak x compute) + overhead + its executor
    fixed cost)."""
    cpu = Cluster.from_yaml(CPU_CLUSTER_PATH)
    assert cpu.efficiency.attention is None and "attention" not in cpu.to_dict()["efficiency"]
    node, flops = _sdpa(2, 4, 64, 16, causal=True)
    node = dataclasses.replace(node, input_metas=tuple(dataclasses.replace(m, dtype="float32")
                                                       for m in node.input_metas))
    sig = Signature((nd(B),) * 3, (nd(B),))
    no_fixed = dataclasses.replace(cpu, executor=dataclasses.replace(cpu.executor, op_us={}, op_work={}),
                                   compute_curve=None, op_overhead_us=0.0)
    expected = max(flops / (no_fixed.device.peak_tflops_for("float32") * 1e12 * no_fixed.efficiency.compute),
                   4 * node.input_metas[0].nbytes / (no_fixed.device.memory_bandwidth_gbps * 1e9
                                                     * no_fixed.efficiency.memory))
    assert op_forward_time_s(node, sig, (1,), no_fixed) == pytest.approx(
        expected + (no_fixed.executor.op_forward_us + 3 * no_fixed.executor.input_forward_us) * 1e-6)


def test_optimizer_sgd_vs_adamw(a100):
    numel = 10_000_000
    pbytes = 4 * numel
    bw = a100.device.memory_bandwidth_gbps * 1e9 * a100.efficiency.memory
    assert optimizer_time_s(pbytes, numel, "sgd", a100) == pytest.approx(3 * pbytes / bw)
    assert optimizer_time_s(pbytes, numel, "adamw", a100) == pytest.approx(20 * pbytes / bw)   # foreach passes
    # 2-byte params keep fp32 states: 6 x 2-byte param and gradient traffic + 14 x 4-byte state traffic
    assert optimizer_time_s(2 * numel, numel, "AdamW", a100) == pytest.approx((12 + 56) * numel / bw)
    shared = dataclasses.replace(a100, cores_per_node=2)          # 4 ranks on a node running 2 at once
    assert optimizer_time_s(pbytes, numel, "adamw", shared, (4,)) == pytest.approx(2 * 20 * pbytes / bw)
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_time_s(pbytes, numel, "lion", a100)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimizer_bytes_are_the_passes_the_executor_optimizer_makes(name):
    """optimizer_bytes against the memory torch's foreach optimizer (built as the executor builds it)
    touches in one step, counted op by op: every distinct tensor an op reads, and what it writes
    (its first argument when in place, else its outputs); 1-element step counters left out."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from costmodel.compute import optimizer_bytes
    from executor.runtime import torch_optimizer

    params = [torch.randn(1000, requires_grad=True), torch.randn(30, 20, requires_grad=True)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch_optimizer(name, params, 1e-3, foreach=True)
    opt.step()                                                   # the states exist from here on

    class Count(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            big = lambda xs: [t for t in tree_leaves(xs) if isinstance(t, torch.Tensor) and t.numel() > 1]
            reads = {id(t): t for t in big((args, kwargs))}
            writes = big(args[0]) if func._schema.name.endswith("_") else big(out)
            Count.nbytes += sum(t.numel() * t.element_size() for t in list(reads.values()) + writes)
            return out

    with Count():
        opt.step()
    numel = sum(p.numel() for p in params)
    assert Count.nbytes == optimizer_bytes(4 * numel, numel, name)


def test_efficiency_scales_times(a100):
    slow = dataclasses.replace(a100, efficiency=Efficiency(compute=0.3, memory=0.35, network=0.4))
    meta = TensorMeta((1 << 20,), "float32")
    t_fast = boxing_time_s(meta, nd(P), nd(B), (8,), a100)
    t_slow = boxing_time_s(meta, nd(P), nd(B), (8,), slow)
    b_fast, a_ = _b_a(a100.intra_node, a100.efficiency.network)
    b_slow, _ = _b_a(a100.intra_node, 0.4)
    assert t_fast == pytest.approx(2 * 7 / 8 * meta.nbytes / b_fast + 14 * a_)
    assert t_slow == pytest.approx(2 * 7 / 8 * meta.nbytes / b_slow + 14 * a_)
    assert not math.isclose(t_fast, t_slow)


# -- executor overheads (Cluster.executor) ------------------------------------------------------
def test_executor_overheads_per_op_input_param_and_collective(a100):
    from autoddl.cluster import ExecutorOverheads
    from costmodel.collectives import cluster_collective_time_s

    ex = ExecutorOverheads(op_forward_us=200.0, op_backward_us=50.0, input_forward_us=30.0,
                           input_backward_us=70.0, param_us=400.0, collective_us=600.0)
    slow = dataclasses.replace(a100, executor=ex)
    x = TensorMeta((1024, 1024), "float32")
    linear = OpNode(name="addmm", kind=NodeKind.OP, target="aten.addmm.default",
                    inputs=tuple(TensorRef(n) for n in ("b", "x", "w")), input_metas=(x, x, x), outputs=(x,),
                    flops=2 * 1024**3, bytes_read=3 * x.nbytes, bytes_written=x.nbytes, params=("fc.bias", "fc.weight"))
    sig = Signature((nd(B), nd(B), nd(B)), (nd(B),))
    fwd = op_forward_time_s(linear, sig, (8,), a100) + (200 + 3 * 30) * 1e-6
    bwd = op_backward_time_s(linear, sig, (8,), a100) + (50 + 3 * 70 + 2 * 400) * 1e-6
    assert op_forward_time_s(linear, sig, (8,), slow) == pytest.approx(fwd, rel=1e-12)
    assert op_backward_time_s(linear, sig, (8,), slow) == pytest.approx(bwd, rel=1e-12)
    assert op_compute_time_s(linear, sig, (8,), slow, needs_backward=False) == pytest.approx(fwd, rel=1e-12)
    # a view runs through the executor too: its fixed costs, no roofline, no launch overhead
    view = OpNode(name="view", kind=NodeKind.OP, target="aten.view.default", inputs=(TensorRef("x"),),
                  input_metas=(x,), outputs=(x,))
    s1 = Signature((nd(B),), (nd(B),))
    assert op_compute_time_s(view, s1, (8,), a100) == 0.0
    assert op_compute_time_s(view, s1, (8,), slow) == pytest.approx((200 + 30 + 50 + 70) * 1e-6, rel=1e-12)
    getitem = dataclasses.replace(view, name="getitem", target="getitem")
    assert op_compute_time_s(getitem, s1, (8,), slow) == 0.0           # runs no op
    # a collective pays collective_us on top of alpha-beta, only when the axis has devices to talk to
    for kind in K:
        base = cluster_collective_time_s(kind, M, (8,), 0, a100)
        assert cluster_collective_time_s(kind, M, (8,), 0, slow) == pytest.approx(base + 600e-6, rel=1e-12)
    assert cluster_collective_time_s(K.ALL_REDUCE, M, (1, 8), 0, slow) == 0.0


def test_op_family_costs_replace_the_scalar_fixed_costs_and_scale_the_roofline(a100):
    from autoddl.cluster import ExecutorOverheads
    from costmodel.compute import roofline_time_s

    ex = ExecutorOverheads(op_forward_us=200.0, op_backward_us=50.0, input_forward_us=30.0, input_backward_us=70.0,
                           param_us=400.0, op_us={"float32": {"linear": (12.0, 30.0), "view": (9.0, 8.0)},
                                                  "bfloat16": {"linear": (15.0, 40.0)}},
                           op_work={"float32": {"linear": ((1e-3, 0.8, 1.5),)}})      # one point: everywhere
    fam = dataclasses.replace(a100, executor=ex)
    sig = Signature((nd(B), nd(B), nd(B)), (nd(B),))
    for dtype, fixed, work in (("float32", (12.0, 30.0), (0.8, 1.5)), ("bfloat16", (15.0, 40.0), (1.0, 1.0))):
        x = TensorMeta((1024, 1024), dtype)
        linear = OpNode(name="linear", kind=NodeKind.OP, target="aten.linear.default",
                        inputs=tuple(TensorRef(n) for n in ("x", "w", "b")), input_metas=(x, x, x), outputs=(x,),
                        flops=2 * 1024**3, bytes_read=3 * x.nbytes, bytes_written=x.nbytes,
                        params=("fc.bias", "fc.weight"))
        nbytes = 4 * x.nbytes
        # forward: work scale x roofline + the family's fixed cost (no op_overhead_us, no per-op / per-input scalars)
        fwd = work[0] * roofline_time_s(2 * 1024**3, nbytes, a100, dtype=dtype) + fixed[0] * 1e-6
        # backward: 2x the work (matmul-like), the curve read at one product's FLOPs; plus 400 us per parameter read
        bwd = (work[1] * roofline_time_s(4 * 1024**3, 2 * nbytes, a100, op_flops=2 * 1024**3, dtype=dtype)
               + (fixed[1] + 2 * 400) * 1e-6)
        assert op_forward_time_s(linear, sig, (8,), fam) == pytest.approx(fwd, rel=1e-12)
        assert op_backward_time_s(linear, sig, (8,), fam) == pytest.approx(bwd, rel=1e-12)
        mm = dataclasses.replace(linear, name="mm", target="aten.mm.default", params=())   # linear's family
        assert op_forward_time_s(mm, sig, (8,), fam) == pytest.approx(fwd, rel=1e-12)
    # a view pays its family's fixed costs; an op of no measured family the scalars, as before
    x = TensorMeta((1024, 1024), "float32")
    s1 = Signature((nd(B),), (nd(B),))
    transpose = OpNode(name="t", kind=NodeKind.OP, target="aten.transpose.int", inputs=(TensorRef("x"),),
                       input_metas=(x,), outputs=(x,))
    assert op_compute_time_s(transpose, s1, (8,), fam) == pytest.approx((9 + 8) * 1e-6, rel=1e-12)
    gelu = dataclasses.replace(_op("aten.gelu.default", [x], [x], 8 * x.numel, x.nbytes, x.nbytes),
                               inputs=(TensorRef("x"),))
    work = roofline_time_s(8 * x.numel, 2 * x.nbytes, a100)
    assert op_forward_time_s(gelu, s1, (8,), fam) == pytest.approx(work + (a100.op_overhead_us + 200 + 30) * 1e-6,
                                                                   rel=1e-12)
    assert op_backward_time_s(gelu, s1, (8,), fam) == pytest.approx(work + (a100.op_overhead_us + 50 + 70) * 1e-6,
                                                                    rel=1e-12)
    # a measured curve is read at the op's forward roofline time, piecewise-linear in its log
    x_us = work * 1e6
    curve = dataclasses.replace(fam, executor=dataclasses.replace(ex, op_us={"float32": {"gelu": (10.0, 20.0)}},
                                op_work={"float32": {"gelu": ((x_us / 10, 3.0, 5.0), (x_us * 10, 1.0, 2.0))}}))
    assert op_forward_time_s(gelu, s1, (8,), curve) == pytest.approx(2.0 * work + 10e-6, rel=1e-9)
    assert op_backward_time_s(gelu, s1, (8,), curve) == pytest.approx(3.5 * work + 20e-6, rel=1e-9)


def test_recompute_overheads_per_op_and_per_block(a100):
    from autoddl.cluster import ExecutorOverheads, RecomputeCost
    from costmodel.compute import recompute_overhead_s

    cost = RecomputeCost(op_forward_us=10, op_backward_us=36, matmul_forward_us=25, matmul_backward_us=30,
                         block_forward_us=220, block_backward_us=100)
    c = dataclasses.replace(a100, executor=ExecutorOverheads(op_us={"float32": {"view": (9.0, 8.0)}},
                                                             recompute={"selective": cost}))
    x = TensorMeta((64, 64), "float32")
    mul = _op("aten.mul.Tensor", [x, x], [x], x.numel, 3 * x.nbytes, x.nbytes)
    mm = _op("aten.mm.default", [x, x], [x], 2 * 64**3, 2 * x.nbytes, x.nbytes)
    view = _op("aten.view.default", [x], [x], 0, 0, 0)
    us = 1e-6
    assert recompute_overhead_s(mul, "selective", "forward", True, c) == pytest.approx(10 * us)
    assert recompute_overhead_s(mul, "selective", "forward", True, c, first_in_block=True) == pytest.approx(230 * us)
    assert recompute_overhead_s(mm, "selective", "forward", False, c) == pytest.approx(25 * us)
    assert recompute_overhead_s(mul, "selective", "recompute", True, c) == pytest.approx(36 * us)
    assert recompute_overhead_s(mul, "selective", "recompute", True, c, first_in_block=True) == pytest.approx(136 * us)
    assert recompute_overhead_s(mul, "selective", "backward", True, c) == 0.0     # its recompute task pays
    assert recompute_overhead_s(mm, "selective", "backward", False, c) == pytest.approx(30 * us)   # kept output
    assert recompute_overhead_s(view, "selective", "backward", False, c) == pytest.approx((9 + 36) * us)  # run again
    assert recompute_overhead_s(mul, "none", "forward", True, c) == 0.0
    assert recompute_overhead_s(mul, "full", "forward", True, c) == 0.0            # full not measured: nothing


def test_simulated_step_adds_the_checkpoint_costs_of_every_task_of_a_recomputed_block(a100):
    from autoddl.cluster import ExecutorOverheads, RecomputeCost
    from autoddl.loader import load_model_file
    from autoddl.op_families import MATMUL_LIKE, ZERO_COST
    from autoddl.program import block_of, lower, recomputed_ops
    from autoddl.training import Training
    from costmodel.breakdown import plan_cost
    from executor.calibrate_models import broadcast_plan
    from search.planner import with_training

    graph = load_model_file("examples/gpt.py", preset="tiny").trace("bfloat16")
    plan = with_training(broadcast_plan(graph, (1,)), Training(param_dtype="bf16", recompute="selective"))
    cost = RecomputeCost(op_forward_us=10, op_backward_us=36, matmul_forward_us=25, matmul_backward_us=30,
                         block_forward_us=220, block_backward_us=100)
    one = a100.resized(1)
    ex = ExecutorOverheads(op_forward_us=6, op_backward_us=4, param_us=40)
    plain = dataclasses.replace(one, executor=ex)
    ckpt = dataclasses.replace(one, executor=dataclasses.replace(ex, recompute={"selective": cost}))
    recomputed = {n.name for ops in recomputed_ops(graph, plan).values() for n in ops}
    first = {}
    for node in graph.ops():
        first.setdefault(block_of(node), node.name)
    first_recomputed = {ops[0].name for ops in recomputed_ops(graph, plan).values()}
    want = 0.0
    for task in lower(graph, plan).tasks:             # hand-priced from the rules
        if task.is_collective or task.phase == "optimizer" or block_of(graph[task.op]) == "root":
            continue
        node = graph[task.op]
        if node.op_name == "getitem":
            continue
        mat = node.op_name in MATMUL_LIKE
        if task.phase == "forward":
            want += (25 if mat else 10) + (220 if node.name == first[block_of(node)] else 0)
        elif task.phase == "recompute":
            want += (30 if mat else 36) + (100 if node.name in first_recomputed else 0)   # every 2nd linear too
        elif node.name not in recomputed:
            want += 30 if mat else (6 + 36 if node.op_name in ZERO_COST else 36)
    assert want > 2 * (220 + 100)                      # two blocks, each op priced
    got = plan_cost(graph, plan, ckpt).step_time_s - plan_cost(graph, plan, plain).step_time_s
    assert got == pytest.approx(want * 1e-6, rel=1e-9)


def test_time_sharing_slows_compute_and_collectives_beyond_cores(a100):
    from costmodel.collectives import cluster_collective_time_s

    x = TensorMeta((1024, 1024), "float32")
    relu = _op("aten.relu.default", [x], [x], x.numel, x.nbytes, x.nbytes)
    sig = Signature((nd(B),), (nd(B),))
    shared = dataclasses.replace(a100, cores_per_node=2)          # 8 devices per node, 2 at once
    assert shared.time_sharing((2,)) == 1.0 and shared.time_sharing((2, 2)) == 2.0 and shared.time_sharing((8,)) == 4
    assert a100.time_sharing((8,)) == 1.0                          # no cores_per_node: no sharing
    for mesh, factor in (((2,), 1.0), ((4,), 2.0), ((2, 4), 4.0)):
        assert op_compute_time_s(relu, dataclasses.replace(sig, inputs=(nd(*[B] * len(mesh)),),
                                                           outputs=(nd(*[B] * len(mesh)),)), mesh, shared) == \
            pytest.approx(factor * op_compute_time_s(relu, dataclasses.replace(
                sig, inputs=(nd(*[B] * len(mesh)),), outputs=(nd(*[B] * len(mesh)),)), mesh, a100), rel=1e-12)
        assert cluster_collective_time_s(K.ALL_REDUCE, M, mesh, 0, shared) == pytest.approx(
            factor * cluster_collective_time_s(K.ALL_REDUCE, M, mesh, 0, a100), rel=1e-12)
    two_nodes = dataclasses.replace(a100.resized(16), cores_per_node=4)   # 8 of 16 ranks on each node
    assert two_nodes.time_sharing((2, 8)) == 2.0


def test_collectives_measured_with_every_rank_busy_are_not_slowed_twice(a100):
    """Two hosts of 2 ranks on 1 core each, collectives fitted with both ranks of each host at once: a 2x2
    mesh's collectives cost the fit (its compute still runs at half speed); one rank alone, half of it; a fit measured at full speed (no comm_measured_ranks_per_node) is slowed 2x."""
    from costmodel.collectives import cluster_collective_time_s

    hosts = dataclasses.replace(a100.resized(4), nodes=2, devices_per_node=2, cores_per_node=1)
    measured_busy = dataclasses.replace(hosts, comm_measured_ranks_per_node=2)
    bare = cluster_collective_time_s(K.ALL_REDUCE, M, (2, 2), 0, dataclasses.replace(hosts, cores_per_node=None))
    assert hosts.time_sharing((2, 2)) == measured_busy.time_sharing((2, 2)) == 2.0
    assert cluster_collective_time_s(K.ALL_REDUCE, M, (2, 2), 0, hosts) == pytest.approx(2 * bare, rel=1e-12)
    assert measured_busy.comm_time_sharing((2, 2)) == 1.0 and measured_busy.comm_time_sharing((1,)) == 0.5
    assert cluster_collective_time_s(K.ALL_REDUCE, M, (2, 2), 0, measured_busy) == pytest.approx(bare, rel=1e-12)


def test_a_collective_over_flattened_axes_is_one_ring_over_their_product_on_the_slowest_link(two_nodes):
    """An all-reduce over mesh axes (0, 1) of a 2x8 mesh on 2 nodes of 8: one ring over n = 16 ranks,
    on the inter-node link (axis 0 crosses nodes), 2*15/16*M/b + 2*15*a; over (1, 2) of a 2x4x2
    mesh (inside a node): n = 8 on NVLink. Calibrated per-kind fits replace the link inside a node,
    with n = the group's size in the fit's formula; the executor's per-collective cost is paid once."""
    from autoddl.cluster import ExecutorOverheads
    from costmodel.collectives import cluster_collective_time_s

    eff = two_nodes.efficiency.network
    b, a = _b_a(two_nodes.inter_node, eff)
    assert cluster_collective_time_s(K.ALL_REDUCE, M, (2, 8), (0, 1), two_nodes) == pytest.approx(
        2 * 15 / 16 * M / b + 2 * 15 * a, rel=1e-12)
    b, a = _b_a(two_nodes.intra_node, eff)
    assert cluster_collective_time_s(K.ALL_REDUCE, M, (2, 4, 2), (1, 2), two_nodes) == pytest.approx(
        2 * 7 / 8 * M / b + 2 * 7 * a, rel=1e-12)
    fit = LinkSpec(bandwidth_gbps=0.5, latency_us=300.0)
    from autoddl.cluster import CollectiveFits
    fitted = dataclasses.replace(two_nodes, collectives=CollectiveFits(all_reduce=fit),
                                 executor=ExecutorOverheads(collective_us=250.0))
    b, a = _b_a(fit, eff)
    assert cluster_collective_time_s(K.ALL_REDUCE, M, (2, 4, 2), (1, 2), fitted) == pytest.approx(
        2 * 7 / 8 * M / b + 2 * 7 * a + 250e-6, rel=1e-12)
    assert cluster_collective_time_s(K.ALL_REDUCE, M, (2, 4, 2), (0, 1), fitted) == pytest.approx(
        cluster_collective_time_s(K.ALL_REDUCE, M, (8, 2), 0, fitted), rel=1e-12)   # crosses nodes: the link
    with pytest.raises(ValueError, match="distinct mesh axes"):
        cluster_collective_time_s(K.ALL_REDUCE, M, (2, 8), (1, -1), two_nodes)


def test_a_send_between_two_devices_uses_their_link_and_the_send_recv_fit(a100):
    """send_recv_time_s: M/b + a on the link two devices share, the calibrated send_recv fit inside a
    node (not across), plus the executor's cost per message, times the comm time sharing."""
    from costmodel.collectives import cluster_collective_time_s, send_recv_time_s

    base = dataclasses.replace(a100.resized(16), executor=dataclasses.replace(a100.executor, collective_us=7.0))
    nbytes, eff = 3 * 2**20, base.efficiency.network
    assert base.intra_node != base.inter_node

    def hand(link):
        return nbytes / (link.bandwidth_gbps * 1e9 * eff) + link.latency_us * 1e-6 + 7e-6
    assert send_recv_time_s(nbytes, 1, 6, base, (16,)) == pytest.approx(hand(base.intra_node), rel=1e-12)
    assert send_recv_time_s(nbytes, 7, 8, base, (16,)) == pytest.approx(hand(base.inter_node), rel=1e-12)
    assert send_recv_time_s(nbytes, 3, 3, base, (16,)) == 0.0
    fit = LinkSpec(bandwidth_gbps=12.5, latency_us=40.0)
    fitted = dataclasses.replace(base, collectives={"send_recv": fit})
    assert send_recv_time_s(nbytes, 1, 6, fitted, (16,)) == pytest.approx(hand(fit), rel=1e-12)
    assert send_recv_time_s(nbytes, 7, 8, fitted, (16,)) == pytest.approx(hand(base.inter_node), rel=1e-12)
    with pytest.raises(ValueError, match="outside .* 16 devices"):
        send_recv_time_s(nbytes, 0, 16, base, (16,))
    # on a mesh axis: a send from the first device to the next one along it (axis 0 of (2, 8): 0 -> 8)
    assert cluster_collective_time_s(K.SEND_RECV, nbytes, (2, 8), 0, base) == pytest.approx(
        hand(base.inter_node), rel=1e-12)
    assert cluster_collective_time_s(K.SEND_RECV, nbytes, (2, 8), 1, fitted) == pytest.approx(hand(fit), rel=1e-12)
    assert cluster_collective_time_s(K.SEND_RECV, nbytes, (1, 16), 0, base) == 0.0


def test_sends_measured_with_every_rank_busy_are_not_slowed_twice(a100):
    """As for collectives: two hosts of 2 ranks on 1 core each; a link measured with both ranks of each
    host busy (comm_measured_ranks_per_node 2) prices a send with all 4 ranks running at the bare
    formula, and slows it 2x when measured at full speed."""
    from costmodel.collectives import send_recv_time_s

    hosts = dataclasses.replace(a100.resized(4), nodes=2, devices_per_node=2, cores_per_node=1)
    measured_busy = dataclasses.replace(hosts, comm_measured_ranks_per_node=2)
    nbytes = 2**20
    for src, dst in ((0, 1), (1, 2)):                      # inside a host, across the hosts
        bare = send_recv_time_s(nbytes, src, dst, dataclasses.replace(hosts, cores_per_node=None), (4,))
        assert send_recv_time_s(nbytes, src, dst, hosts, (4,)) == pytest.approx(2 * bare, rel=1e-12)
        assert send_recv_time_s(nbytes, src, dst, measured_busy, (4,)) == pytest.approx(bare, rel=1e-12)


def _hosts(a100, **inter):
    """A two-hosts-like cluster: 2 nodes of 2, the inter-node link configs/two-hosts.yaml fitted
    (0.06505 GB/s, 810.3 us), no derating and no executor cost, so the formulas are bare."""
    from autoddl.cluster import ExecutorOverheads
    return dataclasses.replace(a100.resized(4), nodes=2, devices_per_node=2, efficiency=Efficiency(),
                               executor=ExecutorOverheads(), inter_node=LinkSpec(0.06505, 810.3, **inter))


def test_a_link_shared_by_the_node_is_priced_by_the_flows_crossing_it_at_once(a100):
    """two-hosts: one link per host, its fit measured with 2 pairs at once (measured_flows 2). An 8 MB
    all-reduce on axis 0 of 2x2 puts 2 flows on each host's link, as fitted: the fit as it is; the
    flattened one over all 4 ranks is one ring (1 flow): half the bandwidth term, the latency the same.
    Without the sharing fields (GPU clusters) the flattened ring pays the fit's bandwidth as before."""
    from costmodel.collectives import cluster_collective_time_s, node_flows, node_link

    shared, per_device = _hosts(a100, shared_by_node=True, measured_flows=2), _hosts(a100)
    m, b, a = 8e6, 0.06505e9, 810.3e-6
    on_axis0 = 2 * 1 / 2 * m / b + 2 * a                          # 124.6 ms: the fit's condition
    for c in (shared, per_device):
        assert cluster_collective_time_s(K.ALL_REDUCE, m, (2, 2), 0, c) == pytest.approx(on_axis0, rel=1e-12)
    assert on_axis0 == pytest.approx(0.1246, abs=1e-4)
    flat = cluster_collective_time_s(K.ALL_REDUCE, m, (2, 2), (0, 1), shared)
    assert flat == pytest.approx(2 * 3 / 4 * m / b / 2 + 2 * 3 * a, rel=1e-12)          # 97.1 ms (measured 105.7)
    assert flat == pytest.approx(0.0971, abs=1e-4)
    assert cluster_collective_time_s(K.ALL_REDUCE, m, (2, 2), (0, 1), per_device) == pytest.approx(
        2 * 3 / 4 * m / b + 2 * 3 * a, rel=1e-12)                                         # 189.3 ms: as before
    assert cluster_collective_time_s(K.ALL_REDUCE, m, (4,), 0, shared) == pytest.approx(flat, rel=1e-12)
    assert cluster_collective_time_s(K.ALL_REDUCE, m, (2, 2), 1, shared) == pytest.approx(
        cluster_collective_time_s(K.ALL_REDUCE, m, (2, 2), 1, per_device), rel=1e-12)  # inside a host: untouched
    # flows at once on one node's link: the groups with a rank on the node
    assert [node_flows((2, 2), ax, 2) for ax in ((0,), (0, 1))] == [2, 1]
    assert node_flows((2, 4), (0,), 2) == 2                 # axis 1 spans 2 nodes: 2 of its ranks on each
    assert [node_flows((2, 2, 2), ax, 2) for ax in ((0,), (0, 1), (0, 1, 2))] == [2, 2, 1]
    assert node_link(shared, (2, 2, 2), (0, 1)) == LinkSpec(0.06505, 810.3)
    # a GPU cluster (a NIC per GPU, no sharing fields): the link as it is, whatever the group
    two_nodes = a100.resized(16)
    for axes in ((0,), (0, 1)):
        assert node_link(two_nodes, (2, 8), axes) is two_nodes.inter_node


def test_a_send_across_a_shared_link_counts_the_sends_at_once(a100):
    """A send from host 0 to host 1 while every rank of the busy mesh sends along the same axes: on a 2x2
    mesh (a pipeline stage's 2 ranks each send to their peer) 2 flows, the fit as it is; on a mesh (4,)
    (one transfer) 1 flow, twice the fitted bandwidth; the latency as fitted."""
    from costmodel.collectives import cluster_collective_time_s, send_recv_time_s

    shared = _hosts(a100, shared_by_node=True, measured_flows=2)
    m, b, a = 2**20, 0.06505e9, 810.3e-6
    assert send_recv_time_s(m, 0, 2, shared, (2, 2)) == pytest.approx(m / b + a, rel=1e-12)
    assert cluster_collective_time_s(K.SEND_RECV, m, (2, 2), 0, shared) == pytest.approx(m / b + a, rel=1e-12)
    assert send_recv_time_s(m, 1, 2, shared, (4,)) == pytest.approx(m / (2 * b) + a, rel=1e-12)
    assert send_recv_time_s(m, 0, 1, shared, (2, 2)) == send_recv_time_s(m, 0, 1, _hosts(a100), (2, 2))   # in a host
    with pytest.raises(ValueError, match=r"outside the busy mesh \(2,\)"):
        send_recv_time_s(m, 0, 2, shared, (2,))
