"""Mixture-of-experts layers as one op: ``autoddl::moe_experts``, its math, and how a trace finds them.

Hugging Face routes tokens to experts with data-dependent ops (sort by expert, a histogram
of tokens per expert, a grouped matmul over row ranges; or a gather of each token's expert
weights): per-op SBP rules cannot split the experts of such a graph, since every
intermediate holds global row numbers. autoddl therefore traces a recognised experts module
as ONE op whose rules know what the layer computes (autoddl/ops/moe.py):

    moe_experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k),
                gate_up (E, 2I, H), down (E, H, I), act) -> (T, H)
    out[t] = sum_j top_k_weights[t, j] * down[e] @ (act(gate) * up),
             gate, up = (gate_up[e] @ hidden[t]).chunk(2),  e = top_k_index[t, j]

A module is recognised (``fuse_experts``) when it is transformers' experts layout: 3-D
``gate_up_proj`` (experts, [gate; up] concatenated, in) and ``down_proj`` (experts, out, in),
no bias, no post-expert norm, not transposed, the default gate (``act(gate) * up``) and an
activation of ``ACTIVATIONS``; its forward is replaced on the trace's meta copy only (the
caller's model and transformers are untouched). Others keep HF's code (and its per-op rules).

``route`` is the one implementation of the layer's math: the eager op, and every local
kernel (tokens split, experts split, experts split with all-to-all dispatch) call it.
"""

from __future__ import annotations

import types
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

OP = "autoddl::moe_experts"
TARGET = "autoddl.moe_experts.default"      # OpNode.target of the traced op

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# all_to_all(tensor, axis, output_split_sizes, input_split_sizes) -> tensor (differentiable)
AllToAll = Callable[[torch.Tensor, int, list, list], torch.Tensor]


# -- the math ---------------------------------------------------------------------------------------
def expert_rows(x: torch.Tensor, local_e: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                act: str) -> torch.Tensor:
    """(N, H_out): row r through expert ``local_e[r]`` of the local weights; rows whose expert is
    not local (outside ``0 .. gate_up.shape[0] - 1``) are 0."""
    out = x.new_zeros(x.shape[0], down.shape[1])
    for e in range(gate_up.shape[0]):
        rows = (local_e == e).nonzero().squeeze(1)
        if rows.numel():
            gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, rows, F.linear(ACTIVATIONS[act](gate) * up, down[e]))
    return out


def route(x: torch.Tensor, e: torch.Tensor, lo: int, span: int, gate_up: torch.Tensor, down: torch.Tensor,
          act: str, axes: Sequence[tuple], all_to_all: Optional[AllToAll]) -> torch.Tensor:
    """Expert outputs of the (token, expert) pairs ``x`` (N, H), ``e`` (N,): this device holds the
    experts ``lo .. lo + span - 1`` before ``axes`` split them further.

    ``axes``: per mesh axis splitting the experts, outer first, ``(axis, n, coord, dispatch)``.
    Without dispatch (tokens whole on that axis) the device keeps its ``span / n`` experts and
    gives 0 for the others' pairs (the output is then P). With dispatch (tokens split there too)
    each pair is sent to the device of its expert by an all-to-all and its result comes back by
    another (both differentiable: backward runs the reverse all-to-alls).
    """
    if not axes:
        return expert_rows(x, e - lo, gate_up, down, act)
    (axis, n, coord, dispatch), rest = axes[0], axes[1:]
    block = span // n
    if not dispatch:
        return route(x, e, lo + coord * block, block, gate_up, down, act, rest, all_to_all)
    dest = torch.div(e - lo, block, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n)
    recv = all_to_all(send, axis, [1] * n, [1] * n)
    sends, recvs = send.tolist(), recv.tolist()
    xs = all_to_all(x[order], axis, recvs, sends)
    es = all_to_all(e[order], axis, recvs, sends)
    ys = route(xs, es, lo + coord * block, block, gate_up, down, act, rest, all_to_all)
    back = all_to_all(ys, axis, sends, recvs)                     # in ``order``, on the sender
    return back.new_zeros(back.shape).index_copy(0, order, back)


def moe_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str, n_experts: Optional[int] = None,
                axes: Sequence[tuple] = (), all_to_all: Optional[AllToAll] = None) -> torch.Tensor:
    """The layer on local pieces (module docstring); ``n_experts``: all experts (default: the local
    count, i.e. none split); ``axes`` and ``all_to_all`` as in :func:`route`."""
    t, k = top_k_index.shape
    pairs = hidden.unsqueeze(1).expand(t, k, hidden.shape[-1]).reshape(t * k, hidden.shape[-1])
    y = route(pairs, top_k_index.reshape(-1), 0, n_experts or gate_up.shape[0], gate_up, down, act,
              axes, all_to_all)
    return (y.view(t, k, -1) * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(dim=1).to(hidden.dtype)


# -- the op: eager (all experts local), fake (shape), autograd (recomputed) ----------------------------
@torch.library.custom_op(OP, mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    return moe_forward(hidden, top_k_index, top_k_weights, gate_up, down, act).clone()


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, act):
    return hidden.new_empty(hidden.shape[0], down.shape[1])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.act = inputs[5]


def _backward(ctx, grad):
    hidden, index, weights, gate_up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in (hidden, weights, gate_up, down)]
    with torch.enable_grad():
        out = moe_forward(leaves[0], index, leaves[1], leaves[2], leaves[3], ctx.act)
        g_hidden, g_weights, g_gate_up, g_down = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return g_hidden, None, g_weights, g_gate_up, g_down, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)


def moe_flops(inputs, outputs, args, kwargs) -> int:
    """Per (token, expert) pair: the two expert matmuls (2 * H * 2I + 2 * I * H), the gate
    (act and product, 2I) and the weighted sum (2H)."""
    t, k = inputs[1].shape
    _, two_i, h = inputs[3].shape
    i = two_i // 2
    return t * k * (2 * h * two_i + 2 * i * h + 2 * i + 2 * h)


# -- finding experts modules ---------------------------------------------------------------------------
def fusable_activation(module: torch.nn.Module) -> Optional[str]:
    """The ``ACTIVATIONS`` name of a transformers experts module of the layout this op computes, else None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
        return None
    if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0] \
            or gate_up.shape[2] != down.shape[1] or gate_up.shape[1] != 2 * down.shape[2]:
        return None
    layout = (getattr(module, "has_gate", None), getattr(module, "has_bias", None),
              getattr(module, "has_post_expert_norm", None), getattr(module, "is_transposed", None),
              getattr(module, "is_concatenated", True))
    gate = getattr(type(module), "_apply_gate", None)
    if layout != (True, False, False, False, True) or getattr(gate, "__name__", "") != "_default_apply_gate":
        return None
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return act if act in ACTIVATIONS else None


def fuse_experts(model: torch.nn.Module) -> list[str]:
    """Make every recognised experts module of ``model`` (the trace's copy) call ``moe_experts``;
    returns their module paths."""
    fused = []
    for path, module in model.named_modules():
        act = fusable_activation(module)
        if act is not None:
            module.forward = types.MethodType(_fused_forward(act), module)
            fused.append(path)
    return fused


def _fused_forward(act: str):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch.ops.autoddl.moe_experts(hidden_states, top_k_index, top_k_weights,
                                             self.gate_up_proj, self.down_proj, act)
    return forward


def _register_flops() -> None:
    from autoddl.flops import register_flops

    register_flops(OP, moe_flops)


_register_flops()
