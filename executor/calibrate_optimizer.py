"""The optimizer's step as the executor runs it, timed by size: the cluster file's ``executor.optimizer_ns``.

The cost model prices an optimizer step by the bytes its passes move (costmodel/compute.py
``optimizer_bytes``: AdamW's foreach passes move 80 bytes per float32 element). At
``memory_bandwidth_gbps``, timed over 128 MB arrays, that is right for parameters far beyond the
caches and too slow for those whose states stay in them: AdamW over 1M float32 elements, 2 ranks at
once on the 2-core VM, took 2.8 ms (29 GB/s of those bytes; 20 GB/s at 4M elements) where 15.8 GB/s
prices 5.3 ms. :func:`time_optimizer_steps` times the step itself (torch's foreach implementation,
built as the executor builds it: executor/runtime.py ``torch_optimizer``) over one float32 parameter
of each size of ``OPTIMIZER_NUMELS`` on every rank at once; :func:`fit_optimizer_ns` keeps the
nanoseconds per element beyond the smallest size, whose time (the step's fixed cost: per-call
dispatch, state lookups) the executor's ``step_us`` and ``param_us`` already price.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from autoddl.cluster import OPTIMIZER_KINDS

OPTIMIZER_NUMELS = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)   # 16K .. 4M float32 elements
BATCH_NUMEL = 1 << 20               # a timed batch of steps covers at least this many elements


def time_optimizer_steps(torch: Any, barrier: Callable[[], None], repeats: int,
                         numels: Sequence[int] = OPTIMIZER_NUMELS, device: Any = "cpu",
                         sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Per optimizer kind, the seconds of one step over one float32 parameter of each of ``numels``
    elements on ``device`` (its gradient set; 3 untimed steps first, so the states exist): the median
    of ``repeats`` batches of back-to-back steps (``sync`` after each batch), the ranks started together
    by ``barrier``."""
    from executor.runtime import torch_optimizer

    out: dict[str, list[float]] = {}
    for kind in OPTIMIZER_KINDS:
        out[kind] = []
        for numel in numels:
            param = torch.randn(numel, device=device, requires_grad=True)
            param.grad = torch.randn(numel, device=device)
            optimizer = torch_optimizer(kind, [param], 1e-3, foreach=True)
            for _ in range(3):
                optimizer.step()
            calls = max(1, BATCH_NUMEL // numel)
            sync()
            barrier()
            batches = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(calls):
                    optimizer.step()
                sync()
                batches.append((time.perf_counter() - t0) / calls)
            out[kind].append(statistics.median(batches))
    return out


def fit_optimizer_ns(numels: Sequence[int], seconds: Sequence[float]) -> tuple[tuple[int, float], ...]:
    """``((numel, ns per element), ...)`` at each size but the smallest: (t - t_smallest) / (numel -
    numel_smallest), the step's cost beyond its fixed part; a size not slower than the smallest is left
    out (noise)."""
    if len(numels) != len(seconds) or len(numels) < 2:
        raise ValueError(f"fit_optimizer_ns: need one time per size and at least two sizes, got {len(numels)} "
                         f"sizes and {len(seconds)} times")
    n0, t0 = numels[0], seconds[0]
    return tuple((int(n), float(f"{(t - t0) / (n - n0) * 1e9:.3g}"))
                 for n, t in zip(numels[1:], seconds[1:]) if t > t0)
