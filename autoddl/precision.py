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

# `--check` bound on max |distributed - single process| / max |single process| per tensor, by
# param_dtype. float32: sums taken in another order differ by a few ulp (2^-24) per rounding;
# 1e-4 leaves room for the ~1e3 roundings a gradient goes through. bfloat16 / float16 keep 8 / 11
# significant bits (unit roundoff u = 2^-8 / 2^-11): a sharded run rounds partial sums (each rank's
# share of a batch, reduced across ranks in reduce_dtype) that the single process does not, and the
# differences compound through every layer's backward; the bound is 16 u (2^-4 / 2^-7). Measured
# worst case, gpt / llama tiny on 2 ranks, bf16: 7.5 u (tests/test_training_runs.py).
CHECK_RTOL = {"float32": 1e-4, "bfloat16": 2.0 ** -4, "float16": 2.0 ** -7}


def check_rtol(param_dtype: str) -> float:
    return CHECK_RTOL[param_dtype]


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
