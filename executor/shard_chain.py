"""A model file (autoddl/loader.py's interface) for ``autoddl calibrate --only shard_runner``: repeated
blocks of tiny element-wise ops, cut into shards and run by the shard runner (executor/shard_runner.py).

``build_model(blocks, ops, params)``: ``blocks`` blocks (``blocks.<i>``, the repeated blocks shards are
cut at), each ``ops`` products ``y = y * w`` of a ``(WIDTH, WIDTH)`` activation with a ``(WIDTH, WIDTH)``
factor; ``params`` of the factors are parameters (the first ones), the rest buffers, so two models with the
same ``ops`` and a different ``params`` run the same ops and differ only in the parameters a shard's
backward updates. The loss is the output's sum.
"""

import torch
from torch import nn

WIDTH = 16


class Block(nn.Module):
    def __init__(self, ops: int, params: int) -> None:
        super().__init__()
        if not 1 <= params <= ops:
            raise ValueError(f"shard_chain: params {params} must be in 1..ops ({ops}): a block needs a parameter "
                             "for its backward to run")
        self.ops = ops
        self.ws = nn.ParameterList(nn.Parameter(torch.full((WIDTH, WIDTH), 1.0)) for _ in range(params))
        for i in range(params, ops):
            self.register_buffer(f"b{i}", torch.full((WIDTH, WIDTH), 1.0))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for i in range(self.ops):
            y = y * (self.ws[i] if i < len(self.ws) else getattr(self, f"b{i}"))
        return y


class ShardChain(nn.Module):
    def __init__(self, blocks: int, ops: int, params: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(ops, params) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model(blocks: int = 4, ops: int = 4, params: int = 4) -> nn.Module:
    return ShardChain(blocks, ops, params)


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(WIDTH, WIDTH),)                 # (WIDTH, WIDTH)


def loss_fn(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.sum()
