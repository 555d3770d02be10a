"""The mixed-precision policy (``Training.param_dtype`` / ``reduce_dtype``), written once for
tracing, pricing and running.

As FSDP2's ``MixedPrecisionPolicy``: the parameters a step computes with are working copies in
``param_dtype`` of float32 masters (which the optimizer updates, with its states); floating
forward inputs are cast to ``param_dtype`` (``cast_forward_inputs``); buffers and targets are left
as they are. A model is traced under the policy, so the graph's parameter and activation metas are
the working dtype and every op's explicit casts (an RMSNorm computing its variance in float32)
are captured as they will run; the masters exist only in the memory accounting and the executor.
"""

from __future__ import annotations

from typing import Sequence

import torch

MASTER_DTYPE = "float32"      # what parameters, their gradients and optimizer states are kept in
MASTER_ITEMSIZE = 4


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    return getattr(torch, name)


def working_copy(t: torch.Tensor, param_dtype: str) -> torch.Tensor:
    """A floating parameter's working copy in ``param_dtype`` (itself when already so)."""
    dtype = torch_dtype(param_dtype)
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def cast_forward_inputs(values: Sequence[torch.Tensor], n_forward: int, param_dtype: str) -> tuple:
    """The first ``n_forward`` values (forward's inputs; the rest are targets) with floating
    tensors cast to ``param_dtype``."""
    return tuple(working_copy(v, param_dtype) if i < n_forward and isinstance(v, torch.Tensor) else v
                 for i, v in enumerate(values))


def itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype_name)).element_size()
