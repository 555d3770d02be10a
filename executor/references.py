"""PyTorch's own implementations of the schemes autoddl plans, timed beside a plan on the same ranks.

- ``ddp``: DistributedDataParallel; each rank trains on its dim-0 shard of the batch.
- ``fsdp2``: ``fully_shard`` on every block (each child of an ``nn.ModuleList``), then on the
  root, as torchtitan applies FSDP2; each rank on its batch shard.
- ``dtensor_tp``: ``parallelize_module`` with ColwiseParallel / RowwiseParallel pairs (the
  Megatron pattern: the first linear(s) of an attention or MLP block column-wise, the output
  projection row-wise); every rank runs the whole batch. Head counts of the attention modules
  (``n_head``, ``n_kv_head``, ...) are divided by the degree, as torchtitan does, so that the
  attention reshapes its local heads.

Each builder returns the module to step and this rank's flat step values (in
``ModelFile.example_inputs`` order); the worker times them with the plan's optimizer.

Under the plan's training settings, as a user of each would write them: blocks (each child of
an ``nn.ModuleList``) wrapped in ``checkpoint_wrapper`` for recompute (selective: the same op
policy as autoddl's executor/recompute.py), then DDP / FSDP2 / TP applied; mixed precision by
FSDP2's ``MixedPrecisionPolicy`` and by ``torch.autocast`` for DDP and tensor parallel;
micro-steps by accumulating gradients, under DDP's ``no_sync`` but the last (``reference_step``).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads the names below at start-up
    import torch
    from torch import nn

    from autoddl.training import Training

REFERENCES = ("ddp", "fsdp2", "dtensor_tp")
REFERENCE_NAMES = {"ddp": "DistributedDataParallel", "fsdp2": "FSDP2 (fully_shard)",
                   "dtensor_tp": "DTensor tensor parallel (parallelize_module)"}

# names of output projections (row-wise) in GPT-2/nanoGPT, Llama/Mistral/Qwen, BERT-style MLPs and this
# project's examples; every other linear of a block that has one of these is column-wise
ROW_WISE = ("c_proj", "wo", "w2", "o_proj", "down_proj", "out_proj", "fc2", "dense_4h_to_h")
HEAD_COUNTS = ("n_head", "n_heads", "n_kv_head", "n_kv_heads", "num_heads", "num_key_value_heads")


def batch_shard(values: Sequence[torch.Tensor], world: int, rank: int, kind: str) -> tuple[torch.Tensor, ...]:
    """This rank's dim-0 shard of every batch tensor (the data-parallel references)."""
    for t in values:
        if t.shape[0] % world:
            raise ValueError(f"--reference {kind}: an input of shape {tuple(t.shape)} does not split into "
                             f"{world} equal batch shards along dim 0; use a batch size divisible by {world}")
    return tuple(t.chunk(world, dim=0)[rank] for t in values)


def build_reference(kind: str, model: nn.Module, values: Sequence[torch.Tensor],
                    device: torch.device, training: Training | None = None
                    ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """(module to train, this rank's step values) for reference ``kind`` (module docstring)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    model = _recomputed(copy.deepcopy(model).to(device), training)
    values = tuple(t.to(device) for t in values)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids), batch_shard(values, world, rank, kind)
    if kind == "fsdp2":
        return _fully_sharded(model, device, world, training), batch_shard(values, world, rank, kind)
    if kind == "dtensor_tp":
        return _tensor_parallel(model, device, world), values
    raise ValueError(f"unknown reference {kind!r}; choose one of {', '.join(REFERENCES)}")


def _blocks(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(ModuleList, index) of every repeated block."""
    from torch import nn

    return [(blocks, i) for blocks in [m for m in model.modules() if isinstance(m, nn.ModuleList)]
            for i in range(len(blocks))]


def _recomputed(model: nn.Module, training: Training | None) -> nn.Module:
    """Each block wrapped in ``checkpoint_wrapper`` under the training's recompute policy."""
    if training is None or training.recompute == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from executor.recompute import selective_context

    for blocks, i in _blocks(model):
        if training.recompute_of(f"block{i}") == "selective":
            blocks[i] = checkpoint_wrapper(blocks[i], context_fn=selective_context)
        elif training.recompute_of(f"block{i}") == "full":
            blocks[i] = checkpoint_wrapper(blocks[i])
    return model


def _fully_sharded(model: nn.Module, device: torch.device, world: int, training: Training | None = None
                   ) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    policy = MixedPrecisionPolicy()
    if training is not None and training.mixed:
        from autoddl.precision import torch_dtype

        policy = MixedPrecisionPolicy(param_dtype=torch_dtype(training.param_dtype),
                                      reduce_dtype=torch_dtype(training.grad_reduce_dtype))
    for blocks, i in _blocks(model):
        fully_shard(blocks[i], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def reference_step(kind: str, module: nn.Module, step_loss, values: Sequence[torch.Tensor], opt,
                   training: Training | None) -> float:
    """One optimizer step of a reference over this rank's ``values`` under ``training`` (module
    docstring); returns the loss (mean over micro-steps). ``step_loss(module, values)`` is one
    micro-step's eager loss."""
    import contextlib

    import torch

    k = training.micro_batches if training is not None else 1
    autocast = (kind != "fsdp2" and training is not None and training.mixed)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for i, chunk in enumerate(zip(*(t.chunk(k, dim=0) for t in values))):
        skip_sync = kind == "ddp" and i < k - 1
        with (module.no_sync() if skip_sync else contextlib.nullcontext()):
            with (torch.autocast(chunk[0].device.type, dtype=getattr(torch, training.param_dtype))
                  if autocast else contextlib.nullcontext()):
                loss = step_loss(module, chunk)
            (loss / k).backward()
        total += float(loss.detach())
    opt.step()
    return total / k


def tp_pairs(model: nn.Module) -> dict[str, str]:
    """``{linear fqn: "colwise" | "rowwise"}`` for every block holding a row-wise output projection."""
    from torch import nn

    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
        if not any(n in ROW_WISE for n in linears) or len(linears) < 2:
            continue
        for child in linears:
            plan[f"{name}.{child}" if name else child] = "rowwise" if child in ROW_WISE else "colwise"
    return plan


def _tensor_parallel(model: nn.Module, device: torch.device, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    pairs = tp_pairs(model)
    if not pairs:
        raise ValueError(f"--reference dtensor_tp: {type(model).__name__} has no block with a column -> row "
                         f"parallel linear pair (an output projection named one of {', '.join(ROW_WISE)})")
    for name, module in model.named_modules():
        if any(p.startswith(f"{name}.") for p in pairs):
            for attr in HEAD_COUNTS:
                value = getattr(module, attr, None)
                if isinstance(value, int):
                    if value % world:
                        raise ValueError(f"--reference dtensor_tp: {name}.{attr}={value} heads do not split "
                                         f"over {world} ranks")
                    setattr(module, attr, value // world)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(model, mesh, {fqn: style[s]() for fqn, s in pairs.items()})
