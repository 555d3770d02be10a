"""Time an emulated dtype's matmuls by operand layout: the cluster file's ``matmul_layouts``.

autoddl/matmul_layouts.py says why a dtype the device has no instructions for needs them and how the
cost model reads them. :func:`measure_matmul_layouts` starts ``nproc`` ranks (as executor/calibrate.py
does: one process per device, ``threads`` intra-op threads each, every rank timing the same product at
once, so that they share the machine as training ranks do) and times on each, for every dtype asked
and every ``(m, k) @ (k, n)`` of the grid ``sizes``^3, the product in each of the layouts NN, NT and
TN (``torch.mm(A, B, out=C)``, ``A`` a transposed view of a ``(k, m)`` tensor for T, ``B`` of an
``(n, k)`` one): one untimed call, then the median of single calls repeated for at least
``MIN_TIME_S`` (3 to 30 of them), less the rank's per-call dispatch (an ``add`` of 1-element tensors,
the median of 5 batches of 100; at most half the time is taken out). Per shape: the mean over ranks;
over ``launches`` launches, one after the other: the median.
"""

from __future__ import annotations

import math
import statistics
import sys
from datetime import timedelta
from typing import Any, Sequence

from autoddl.matmul_layouts import LAYOUTS
from executor.calibrate import per_call_s, tiny_add_s

LAYOUT_SIZES = (32, 128, 512)       # m, k and n each: 27 shapes; the largest NN bf16 product ~0.2 s on Zen 3
QUICK_LAYOUT_SIZES = (32, 64)
MIN_TIME_S = 0.02


def measure_matmul_layouts(dtypes: Sequence[str], nproc: int = 2, threads: int = 1,
                           sizes: Sequence[int] = LAYOUT_SIZES, launches: int = 1, timeout_s: float = 600.0,
                           verbose: bool = True) -> dict[str, list[tuple[int, int, int, float, float, float]]]:
    """``{dtype: [(m, k, n, nn_us, nt_us, tn_us), ...]}`` over ``sizes``^3 (module docstring)."""
    from executor.local_ranks import run_ranks

    runs = []
    for i in range(launches):
        if verbose and launches > 1:
            print(f"calibrate: matmul layouts, launch {i + 1} of {launches}", file=sys.stderr, flush=True)
        ranks = run_ranks(_rank, nproc, tuple(dtypes), tuple(sizes), nproc, verbose, timeout_s=timeout_s,
                          threads=threads)
        runs.append({d: [[statistics.fmean(r[d][j][c] for r in ranks) for c in range(len(LAYOUTS))]
                         for j in range(len(ranks[0][d]))] for d in dtypes})
    shapes = [(m, k, n) for m in sizes for k in sizes for n in sizes]
    return {d: [(*shape, *(float(f"{statistics.median(run[d][j][c] for run in runs):.4g}")
                           for c in range(len(LAYOUTS))))
                for j, shape in enumerate(shapes)] for d in dtypes}


def _rank(dtypes: tuple[str, ...], sizes: tuple[int, ...], nproc: int, verbose: bool) -> dict[str, list[list[float]]]:
    import os

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=nproc, timeout=timedelta(seconds=300))
    dispatch_s = tiny_add_s(torch, 100)
    out: dict[str, list[list[float]]] = {}
    for dtype in dtypes:
        out[dtype] = []
        for m in sizes:
            for k in sizes:
                for n in sizes:
                    us = [time_product(torch, dist.barrier, layout, m, k, n, dtype, dispatch_s) * 1e6
                          for layout in LAYOUTS]
                    out[dtype].append(us)
        if rank == 0 and verbose:
            big = out[dtype][-1]
            print(f"calibrate: {dtype} matmul layouts over {len(sizes)}^3 shapes; at {sizes[-1]}^3: "
                  + ", ".join(f"{layout} {t / 1e3:.1f} ms" for layout, t in zip(LAYOUTS, big)) + " (rank 0)",
                  file=sys.stderr, flush=True)
    return out


def layout_operands(torch: Any, layout: str, m: int, k: int, n: int, dtype: Any) -> tuple[Any, Any]:
    """(A, B) of an ``(m, k) @ (k, n)`` product in ``layout``: T a transposed view of a row-major tensor."""
    a = torch.randn(k, m, dtype=dtype).t() if layout[0] == "T" else torch.randn(m, k, dtype=dtype)   # (m, k)
    b = torch.randn(n, k, dtype=dtype).t() if layout[1] == "T" else torch.randn(k, n, dtype=dtype)   # (k, n)
    return a, b


def time_product(torch: Any, barrier: Any, layout: str, m: int, k: int, n: int, dtype: str,
                 dispatch_s: float = 0.0) -> float:
    """Median seconds of one product (module docstring), the ranks started together by ``barrier``."""
    a, b = layout_operands(torch, layout, m, k, n, getattr(torch, dtype))
    out = torch.empty(m, n, dtype=a.dtype)                                                  # (m, n)
    barrier()
    first = per_call_s(lambda: torch.mm(a, b, out=out), 1)
    reps = int(min(30, max(3, math.ceil(MIN_TIME_S / max(first, 1e-9)))))
    t = statistics.median(per_call_s(lambda: torch.mm(a, b, out=out), 1) for _ in range(reps))
    return max(t - dispatch_s, 0.5 * t)
