"""The small models and the plan ``autoddl calibrate``'s benchmarks (executor/calibrate.py) run.

- ``chain_model(kind, n)``: ``n`` tiny ops in a row (the executor's per-op, per-input and
  per-parameter costs);
- ``block_model(kind, n)``: a block of element-wise ops or matmuls, run under each recompute
  policy (what activation checkpointing adds per op and per block);
- ``probe_ops(settings)``: the Probe model traced at each of ``PROBE_SIZES``, one node per op
  family (each family's fixed cost and work);
- ``broadcast_plan(graph, mesh)``: every op all-B (no collectives).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.calibrate import Settings

# Sizes each op family is timed at (a generic grid, tiny to a few MB per tensor): batch, sequence, width,
# heads, vocabulary (classes), image channels and side. "tiny" gives the fixed costs, the rest the work.
PROBE_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(batch=1, seq=8, width=16, heads=2, vocab=64, channels=4, side=8),
    "small": dict(batch=4, seq=32, width=64, heads=4, vocab=256, channels=8, side=16),
    "medium": dict(batch=8, seq=64, width=128, heads=4, vocab=1024, channels=16, side=16),
    "large": dict(batch=8, seq=128, width=256, heads=4, vocab=2048, channels=32, side=32),
}

CHAIN_WIDTH = 16
CHAIN_KINDS = ("unary", "binary", "param")


def chain_loss(out: Any, x: Any) -> Any:
    return out.sum()


def _make_chain_class():
    from torch import nn

    class Chain(nn.Module):
        """``n`` tiny ops in a row: ``unary`` tanh / relu (1 input each); ``binary`` residual pairs
        ``y = y + tanh(y)`` (inputs 1 and 2; ``y`` has two consumers, as a residual stream does, so
        its gradient is accumulated); ``param`` mul by its own parameter (2 inputs, one a parameter use)."""

        def __init__(self, kind: str, n: int) -> None:
            super().__init__()
            import torch

            if kind not in CHAIN_KINDS:
                raise ValueError(f"chain kind {kind!r}: choose one of {CHAIN_KINDS}")
            self.kind, self.n = kind, n
            self.w = nn.Parameter(torch.full((CHAIN_WIDTH, CHAIN_WIDTH), 0.5))
            count = n if kind == "param" else 0
            self.ws = nn.ParameterList(nn.Parameter(torch.full((CHAIN_WIDTH, CHAIN_WIDTH), 1.0))
                                       for _ in range(count))

        def forward(self, x: Any) -> Any:
            import torch

            s = x * self.w                                      # (W, W)
            y = s
            for i in range(self.n):
                if self.kind == "unary":
                    y = torch.tanh(y) if i % 2 == 0 else torch.relu(y)
                elif self.kind == "binary":
                    if i % 2 == 0:
                        r, y = y, torch.tanh(y)             # r: the residual, consumed twice
                    else:
                        y = torch.add(y, r)
                else:
                    y = y * self.ws[i]
            return y

    return Chain


def chain_model(kind: str, n: int) -> Any:
    return _make_chain_class()(kind, n)


def _make_block_class():
    from torch import nn

    class Block(nn.Module):
        """``n`` ops in a row on ``(B, T, C)`` inputs (:func:`block_input`): ``elementwise`` tanh / relu
        (selective recompute runs them again); ``matmul`` a linear with a bias by its own weight, as a
        transformer block's (selective recompute keeps every odd one's output and runs every second one
        again). A linear on a 3-D input dispatches four aten ops (``t``, a view to 2-D, ``addmm``, a view
        back), each through selective recompute's dispatch mode: 2-D ``mm`` blocks measured its overhead
        per op at 57 us forward where these measure 134 (one thread, ``/tmp`` timing of 2026-11-29)."""

        def __init__(self, kind: str, n: int) -> None:
            super().__init__()
            import torch

            self.kind, self.n = kind, n
            count = n if kind == "matmul" else 0
            self.ws = nn.ParameterList(nn.Parameter(torch.eye(CHAIN_WIDTH)) for _ in range(count))
            self.bs = nn.ParameterList(nn.Parameter(torch.zeros(CHAIN_WIDTH)) for _ in range(count))

        def forward(self, x: Any) -> Any:
            import torch
            import torch.nn.functional as F

            y = x                                                     # (B, T, C)
            for i in range(self.n):
                if self.kind == "matmul":
                    y = F.linear(y, self.ws[i], self.bs[i])          # (B, T, C)
                else:
                    y = torch.tanh(y) if i % 2 == 0 else torch.relu(y)
            return y

    return Block


def block_model(kind: str, n: int) -> Any:
    return _make_block_class()(kind, n)


def block_input(torch: Any, device: Any) -> Any:
    """The recompute blocks' input: ``(2, CHAIN_WIDTH // 2, CHAIN_WIDTH)``, needing a gradient."""
    return torch.randn(2, CHAIN_WIDTH // 2, CHAIN_WIDTH, device=device, requires_grad=True)


def _make_probe_class():
    from torch import nn

    class Probe(nn.Module):
        """Every op family the calibration times, each applied to the inputs (not chained): transformer
        pieces on ``x`` (batch, seq, width), an embedding of ``idx``, a cross entropy of ``logits``,
        convolution-net pieces on ``img``. Its traced ops are what :func:`probe_ops` times."""

        def __init__(self, width: int, vocab: int, channels: int, heads: int) -> None:
            super().__init__()
            import torch

            self.heads = heads
            self.w = nn.Parameter(torch.randn(width, width) / width ** 0.5)
            self.b = nn.Parameter(torch.zeros(width))
            self.g = nn.Parameter(torch.ones(width))
            self.emb = nn.Parameter(torch.randn(vocab, width))
            self.conv = nn.Parameter(torch.randn(channels, channels, 3, 3) / channels)
            self.cb = nn.Parameter(torch.zeros(channels))
            self.bn_w = nn.Parameter(torch.ones(channels))
            self.bn_b = nn.Parameter(torch.zeros(channels))

        def forward(self, x: Any, idx: Any, logits: Any, img: Any, target: Any) -> Any:
            import torch
            import torch.nn.functional as F

            b, t, w = x.shape
            other = torch.bfloat16 if x.dtype == torch.float32 else torch.float32
            q = x.view(b, t, self.heads, w // self.heads).transpose(1, 2)             # (B, H, T, D)
            return (F.linear(x, self.w, self.b), F.layer_norm(x, (w,), self.g, self.b), x.pow(2),
                    x.mean(-1, keepdim=True), torch.rsqrt(x), x * x, x + x, F.gelu(x), F.silu(x), F.relu(x),
                    torch.tanh(x), -x, torch.softmax(x, -1), torch.log_softmax(x, -1), torch.cat([x, x], -1),
                    x.transpose(1, 2).contiguous(), x.to(other), x.sum(),
                    F.scaled_dot_product_attention(q, q, q, is_causal=True), F.embedding(idx, self.emb),
                    F.cross_entropy(logits, target), F.mse_loss(x, x * 0.5),
                    F.conv2d(img, self.conv, self.cb, padding=1),
                    F.batch_norm(img, None, None, self.bn_w, self.bn_b, training=True),
                    F.max_pool2d(img, 2), F.adaptive_avg_pool2d(img, 1))

    return Probe


def _probe_loss(out: Any, *inputs: Any) -> Any:
    import torch

    return torch.stack([o.float().sum() for o in out]).sum()


def probe_ops(settings: Settings) -> dict[tuple[str, str], list[tuple[Any, tuple[bool, ...]]]]:
    """{(dtype, size): [(op node, which inputs need a gradient)]}: the Probe model traced (on the meta
    device, under each dtype's precision policy) at each size, one node per op family (its first), the
    loss's own ops and getitem / detach left out. Empty when the settings time no families."""
    if not settings.family_dtypes:
        return {}
    import torch

    from autoddl.graph import NodeKind
    from autoddl.trace import LOSS_MODULE_TYPE, trace

    out = {}
    for dtype in settings.family_dtypes:
        for size in settings.family_sizes:
            z = PROBE_SIZES[size]
            model = _make_probe_class()(z["width"], z["vocab"], z["channels"], z["heads"])
            b, t, w, v, c, side = (z[k] for k in ("batch", "seq", "width", "vocab", "channels", "side"))
            meta = torch.device("meta")
            inputs = (torch.empty(b, t, w, device=meta), torch.zeros(b, t, dtype=torch.long, device=meta),
                      torch.empty(b * t, v, device=meta), torch.empty(b, c, side, side, device=meta),
                      torch.zeros(b * t, dtype=torch.long, device=meta))
            with warnings.catch_warnings():          # mse_loss's broadcast_tensors has no FLOP formula
                warnings.simplefilter("ignore")
                graph = trace(model, inputs, _probe_loss, name=f"probe-{size}", param_dtype=dtype)
            seen, nodes = set(), []
            for node in graph.ops():
                if (node.module_type == LOSS_MODULE_TYPE or node.op_name in ("getitem", "detach", "broadcast_tensors")
                        or node.op_name in seen):
                    continue
                seen.add(node.op_name)
                needs = tuple(meta_.is_floating and graph[ref.node].kind is not NodeKind.BUFFER
                              for ref, meta_ in zip(node.inputs, node.input_metas))
                nodes.append((node, needs))
            out[(dtype, size)] = nodes
    return out


def broadcast_plan(graph: Any, mesh_shape: tuple[int, ...]) -> Any:
    """Every input, op and parameter all-B on ``mesh_shape``: every rank computes everything, no collectives."""
    from autoddl.graph import NodeKind
    from autoddl.plan import Mesh, Plan
    from autoddl.sbp import NdSbp, Signature

    b = NdSbp.broadcast(len(mesh_shape))
    sigs = {n.name: Signature((), (b,)) for n in graph.nodes_of(NodeKind.INPUT) + graph.nodes_of(NodeKind.BUFFER)}
    sigs.update({n.name: Signature(tuple(b for _ in n.inputs), tuple(b for _ in n.outputs)) for n in graph.ops()})
    return Plan("all-B", Mesh(tuple(mesh_shape)), sigs, {fqn: b for fqn in graph.parameters()},
                graph.fingerprint(), model=graph.model_name)


def zero1_plan(graph: Any, mesh_shape: tuple[int, ...]) -> Any:
    """:func:`broadcast_plan` with every parameter's optimizer states split on dim 0 of mesh axis 0
    (ZeRO-1's storage): after the optimizer, one all-gather per step rebuilds the parameters
    (``DistributedModel.sync_parameters``), which is what the calibration times."""
    return _split_storage(broadcast_plan(graph, mesh_shape), "all-B-zero1", "optimizer_storage")


def zero3_plan(graph: Any, mesh_shape: tuple[int, ...]) -> Any:
    """:func:`broadcast_plan` with every parameter kept split on dim 0 of mesh axis 0 (ZeRO-3's storage):
    each step gathers every parameter group before use (``executor.compiled.LocalStep.gather_group``),
    which is what the calibration times."""
    return _split_storage(broadcast_plan(graph, mesh_shape), "all-B-zero3", "param_storage")


def _split_storage(plan: Any, name: str, storage: str) -> Any:
    """``plan`` renamed, with its ``storage`` field (``param_storage`` or ``optimizer_storage``) split on
    dim 0 of mesh axis 0 for every parameter."""
    import dataclasses

    from autoddl.sbp import NdSbp, Split

    split = NdSbp((Split(0),) + tuple(NdSbp.broadcast(len(plan.mesh.shape)))[1:])
    return dataclasses.replace(plan, name=name, **{storage: {fqn: split for fqn in plan.param_storage}})
