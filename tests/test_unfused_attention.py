"""Unfused attention (``Training.attention = "unfused"``, autoddl/attention.py): one SDPA op priced as
Megatron-LM's 2021 kernels against a hand count on configs/dgx-a100-8.yaml, its kept scores, and
flash (the default) unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from autoddl.activations import kept_scores_bytes
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Cluster
from autoddl.graph import NodeKind, OpNode, TensorMeta
from autoddl.plan import Mesh, Plan
from autoddl.sbp import B, S, NdSbp, Signature
from autoddl.training import Training
from costmodel.compute import op_backward_time_s, op_forward_time_s

A100 = Cluster.from_yaml(DEFAULT_CLUSTER_PATH)      # fp16 312 TFLOPS x 0.869, 2039 GB/s x 0.841, 10 us per op
PEAK, MEM, OV = 312e12 * 0.869, 2039e9 * 0.841, 10e-6
BATCH, HEADS, SEQ, DIM = 4, 24, 2048, 96             # Megatron's GPT 1.7B: 24 heads of 96, sequence 2048
N = BATCH * HEADS * SEQ * SEQ                        # score elements
QB = BATCH * HEADS * SEQ * DIM * 2                   # bytes of q (= k = v = out), fp16


def _sdpa(dropout: float) -> OpNode:
    q = TensorMeta((BATCH, HEADS, SEQ, DIM), "float16")
    flops = 4 * N * DIM + 5 * N
    return OpNode(name="sdpa", kind=NodeKind.OP, target="aten.scaled_dot_product_attention.default",
                  input_metas=(q, q, q), outputs=(q,), flops=flops, bytes_read=3 * q.nbytes, bytes_written=q.nbytes,
                  args=(None, None, None, None, dropout, True))


def _roof(flops, nbytes):
    return max(flops / PEAK, nbytes / MEM)


def _sig(split_heads: bool = False) -> Signature:
    s = NdSbp((S(1),)) if split_heads else NdSbp((B,))
    return Signature((s,) * 3, (s,))


def test_one_sdpa_op_unfused_is_its_matmuls_at_the_matmul_roofline_and_its_score_passes_at_memory():
    assert not A100.compute_curve and A100.device.peak_tflops_for("float16") == 312
    node = _sdpa(dropout=0.1)
    mm_f, mm_b = 2 * N * DIM, QB + QB + 2 * N          # q.kT: reads q, k (QB each), writes N fp16 scores
    softmax, dropout = 4 * N, 5 * N                      # read + write N fp16; + the 1-byte mask
    fwd = _roof(mm_f, mm_b) + softmax / MEM + dropout / MEM + _roof(mm_f, 2 * N + QB + QB)
    assert op_forward_time_s(node, _sig(), (8,), A100, "unfused") == pytest.approx(fwd + OV)
    # backward: 4 matmuls of the forward's size, dropout backward (5N), softmax backward (3 x 2N)
    bwd = 4 * _roof(mm_f, 2 * N + 2 * QB) + 5 * N / MEM + 6 * N / MEM
    assert op_backward_time_s(node, _sig(), (8,), A100, "unfused") == pytest.approx(bwd + OV)
    # heads split 8 ways: every pass an eighth
    assert op_forward_time_s(node, _sig(True), (8,), A100, "unfused") == pytest.approx(
        _roof(mm_f / 8, mm_b / 8) * 2 + 9 * N / 8 / MEM + OV)
    # no dropout: no dropout passes
    plain = _sdpa(dropout=0.0)
    assert op_forward_time_s(plain, _sig(), (8,), A100, "unfused") == pytest.approx(
        _roof(mm_f, mm_b) * 2 + softmax / MEM + OV)
    assert op_backward_time_s(plain, _sig(), (8,), A100, "unfused") == pytest.approx(
        4 * _roof(mm_f, 2 * N + 2 * QB) + 6 * N / MEM + OV)


def test_flash_is_the_default_and_unchanged_and_other_ops_ignore_the_setting():
    node = _sdpa(dropout=0.0)
    flash = 0.5 * node.flops / (312e12 * 0.737)          # configs/dgx-a100-8.yaml attention 0.737, causal
    assert op_forward_time_s(node, _sig(), (8,), A100) == op_forward_time_s(node, _sig(), (8,), A100, "flash") \
        == pytest.approx(flash + OV)
    assert op_backward_time_s(node, _sig(), (8,), A100, "flash") == pytest.approx(2.5 * flash + OV)
    x = TensorMeta((4096, 4096), "float16")
    mm = OpNode(name="mm", kind=NodeKind.OP, target="aten.mm.default", input_metas=(x, x), outputs=(x,),
                flops=2 * 4096**3, bytes_read=2 * x.nbytes, bytes_written=x.nbytes)
    sig = Signature((NdSbp((B,)),) * 2, (NdSbp((B,)),))
    assert op_forward_time_s(mm, sig, (8,), A100, "unfused") == op_forward_time_s(mm, sig, (8,), A100)


def test_unfused_attention_keeps_its_probabilities_and_dropout_mask():
    unfused, flash = Training(attention="unfused"), Training()
    assert kept_scores_bytes(_sdpa(0.0), _sig(), (8,), unfused) == 2 * N
    assert kept_scores_bytes(_sdpa(0.1), _sig(), (8,), unfused) == 2 * N + 2 * N + N
    assert kept_scores_bytes(_sdpa(0.1), _sig(True), (8,), unfused) == 5 * N // 8
    assert kept_scores_bytes(_sdpa(0.1), _sig(), (8,), flash) == 0


def test_attention_setting_is_validated_and_written_to_the_plan():
    with pytest.raises(ValueError, match="training.attention 'fused'.*'flash', 'unfused'"):
        Training(attention="fused")
    def plan(training):
        return Plan(name="dp", mesh=Mesh((8,), ("dp",)), signatures={}, param_storage={}, graph_hash="h",
                    training=training)
    assert Plan.from_dict(plan(Training(attention="unfused")).to_dict()).training.attention == "unfused"
    assert Plan.from_dict(plan(Training()).to_dict()).training.attention == "flash"


def test_a_plan_priced_unfused_keeps_each_layers_probabilities_and_takes_longer():
    """gpt tiny (2 layers, 4 heads, batch 4 x seq 32, no dropout) on 2 A100s, dp=2, bf16: under
    ``unfused`` each layer's SDPA keeps its probabilities, (4/2) x 4 x 32 x 32 bf16 = 16,384 bytes per
    device, and no other activation changes; with full recompute they are held only while the
    block is recomputed (one block: 16,384 bytes)."""
    from pathlib import Path

    from autoddl.loader import load_model_file
    from search.planner import parse_degrees, price_degrees

    mf = load_model_file(Path(__file__).resolve().parents[1] / "examples" / "gpt.py", device="cpu", preset="tiny")
    graph = mf.trace("bfloat16")
    cluster = A100.resized(2)

    def priced(**kw):
        return price_degrees(graph, cluster, parse_degrees("dp=2"), training=Training(param_dtype="bf16", **kw)
                             ).breakdown
    flash, unfused = priced(), priced(attention="unfused")
    per_layer = 4 // 2 * 4 * 32 * 32 * 2
    assert unfused.memory["activations"] - flash.memory["activations"] == 2 * per_layer
    assert unfused.step_time_s > flash.step_time_s
    full_flash, full_unfused = priced(recompute="full"), priced(recompute="full", attention="unfused")
    assert full_unfused.memory["activations"] == full_flash.memory["activations"]
    assert full_unfused.memory["recomputed"] - full_flash.memory["recomputed"] == per_layer
