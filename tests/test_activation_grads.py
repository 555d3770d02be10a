"""The activation gradients a backward holds (autoddl/activations.py ``activation_grad_bytes``, the
memory's ``activation_grads``): at a cross entropy, the logits' gradient and the log-probabilities'
(nll_loss's backward output), each N x C in the loss's dtype, besides the loss's own gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import autoddl
from autoddl.activations import activation_bytes, activation_grad_bytes
from autoddl.cluster import Cluster
from autoddl.loader import load_model_file
from autoddl.op_families import CAST_OPS
from autoddl.training import Training
from search.planner import parse_degrees, price_degrees
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
CPU = CPU_CLUSTER_PATH
N, D, H, C = 8, 16, 64, 100          # batch, input, hidden, classes: the loss's N x C is the largest gradient


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cross_entropy_holds_the_logits_and_log_probabilities_gradients(dtype):
    torch.manual_seed(0)
    inputs, targets = torch.randn(N, D), torch.randint(0, C, (N,))
    graph = autoddl.trace(_classifier(), (inputs,), lambda out, y: F.cross_entropy(out, y), targets=(targets,),
                          param_dtype=dtype)
    cluster = Cluster.from_yaml(CPU).resized(2)
    priced = price_degrees(graph, cluster, parse_degrees("dp=2"), training=Training(param_dtype=dtype))
    w = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    local = N // 2                    # dp=2 splits the batch
    # the last linear's backward (grad of its N x C output and N x H input) holds less: 2 N C w + w wins
    assert local * C * w + local * H * w < 2 * local * C * w
    expected = 2 * local * C * w + w  # logits' and log-probabilities' gradients, and the scalar loss's
    assert activation_grad_bytes(graph, priced.plan) == expected
    mem = priced.breakdown.memory
    assert mem["activation_grads"] == expected
    assert mem["total"] == sum(v for k, v in mem.items() if k not in ("total", "host"))
    # measured: what one rank's cross entropy backward allocates (torch.profiler, CPU)
    assert _cross_entropy_backward_bytes(local, getattr(torch, dtype)) == expected - w


def _cross_entropy_backward_bytes(rows: int, dtype: torch.dtype) -> int:
    """Bytes nll_loss's and log_softmax's backward allocate for an op-produced (rows, C) input."""
    torch.manual_seed(0)
    x = torch.randn(rows, C, dtype=dtype, requires_grad=True)
    loss = F.cross_entropy(x * 1.0, torch.randint(0, C, (rows,)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    return sum(e.cpu_memory_usage for e in prof.key_averages()
               if e.key in ("aten::nll_loss_backward", "aten::_log_softmax_backward_data"))


def test_logits_cast_to_float32_for_the_loss_are_held_in_float32_only():
    """examples/llama.py ``float_logits`` (TorchTitan's loss): the bf16 logits are read only by the cast,
    whose backward needs no input, so they are not saved; the float32 copy the loss reads is, and the
    loss's two gradients are float32: B T V (4 + 2 x 4) bytes for the logits on one device."""
    mf = load_model_file(ROOT / "examples" / "llama.py", preset="tiny", float_logits=True)
    graph = mf.trace("bfloat16")
    plan = price_degrees(graph, Cluster.from_yaml(CPU).resized(1), parse_degrees("dp=1"),
                         training=Training(param_dtype="bfloat16")).plan
    cfg = mf.model.config
    logits = cfg.batch_size * cfg.seq_len * cfg.vocab_size
    saved = activation_bytes(graph, plan)
    output = next(n for n in graph.ops() if n.params == ("output.weight",))
    cast = next(c for c in graph.consumers(output.name) if c.op_name in CAST_OPS)
    assert (output.outputs[0].dtype, cast.outputs[0].dtype) == ("bfloat16", "float32")
    assert (saved[output.name], saved[cast.name]) == (0, 4 * logits)
    assert activation_grad_bytes(graph, plan) == 2 * 4 * logits + 4
