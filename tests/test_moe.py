"""Mixture-of-experts layers as one op with expert parallelism (issue 11, item 3).

- Mixtral (HF, small config) traces its experts as ``autoddl::moe_experts``, with either HF
  implementation, and its FLOPs are the expert matmuls of every routed token;
- the op's signatures without communication (tokens split, experts split -> P, output features
  split) reproduce the whole op on simulated devices, forward and backward (tests/shard_sim.py);
- the expert-parallel signature's all-to-alls are priced by the alpha-beta formula of
  costmodel/collectives.py on the bytes a hand count gives, in forward and backward;
- Mixtral planned with its experts split over 2 gloo ranks and tokens dispatched by all-to-all
  matches one process (loss, every gradient), and the all-to-alls that ran are the program's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoddl.ops as R  # noqa: E402
from autoddl.collective_kinds import CollectiveKind  # noqa: E402
from autoddl.moe import TARGET, moe_forward  # noqa: E402
from autoddl.sbp import Signature  # noqa: E402
from benchmarks.hf_conformance import load_case  # noqa: E402
from shard_sim import check_signature  # noqa: E402

EP = Signature.parse("[S(0)], [S(0)], [S(0)], [S(0)], [S(0)] -> [S(0)]")


@functools.lru_cache(maxsize=None)
def mixtral(experts: str = "grouped_mm"):
    from benchmarks.hf_conformance import CASES

    return load_case("mixtral" if experts == "grouped_mm" else "mixtral_batched")


def moe_nodes(graph):
    return [n for n in graph.ops() if n.target == TARGET]


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
def test_mixtral_experts_trace_as_one_op_costed_by_routed_tokens(experts):
    mf, graph, _ = mixtral(experts)
    cfg = mf.model.config
    nodes = moe_nodes(graph)
    assert len(nodes) == cfg.num_hidden_layers
    routed = mf.forward_kwargs["input_ids"].numel() * cfg.num_experts_per_tok
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_pair = 2 * h * 2 * i + 2 * i * h + 2 * i + 2 * h       # two matmuls, gate, weighted sum
    assert [n.flops for n in nodes] == [routed * per_pair] * cfg.num_hidden_layers
    assert [n.params for n in nodes][0] == ("model.layers.0.mlp.experts.gate_up_proj",
                                             "model.layers.0.mlp.experts.down_proj")
    assert R.coverage_report(graph).no_rule == {}


def test_the_fused_op_equals_hf_experts_eagerly():
    """moe_forward (every kernel's math) against transformers' own experts module, forward and grads."""
    mf, _, _ = mixtral()
    experts = mf.model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, experts.hidden_dim, generator=g, requires_grad=True)
    index = torch.randint(0, experts.num_experts, (12, 2), generator=g)
    weights = torch.rand(12, 2, generator=g, requires_grad=True)
    ref = experts(hidden, index, weights)
    ours = moe_forward(hidden, index, weights, experts.gate_up_proj, experts.down_proj, "silu")
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(ref.square().sum(), (hidden, weights, experts.gate_up_proj))
    ours_g = torch.autograd.grad(ours.square().sum(), (hidden, weights, experts.gate_up_proj))
    for a, b in zip(ours_g, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
def test_signatures_without_communication_execute_correctly(mesh):
    _, graph, _ = mixtral()
    node = moe_nodes(graph)[0]
    sigs = R.candidate_signatures(node, mesh)
    wanted = {"[S(0)], [S(0)], [S(0)], [B], [B] -> [S(0)]", "[B], [B], [B], [S(0)], [S(0)] -> [P]",
              "[B], [B], [B], [B], [S(1)] -> [S(1)]"}
    if mesh == (2,):
        assert wanted <= {str(s) for s in sigs}
        assert EP not in sigs and EP in R.candidate_signatures(node, mesh, inner_collectives=True)
    for k, sig in enumerate(sigs):
        check_signature(node, sig, mesh, seed=k)
