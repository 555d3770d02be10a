"""How late the ranks meet at a collective after computing apart: the cluster file's ``executor.arrival_skew_us``.

Ranks that compute C ms each and then meet in a collective do not arrive together: a rank's
computation is paused by the operating system (other ranks' threads, gloo's, the VM's), so the last
one arrives later than the ranks' compute times say, and more so the longer they computed apart.
Measured (session 22, a 4 KB all-reduce after C ms of matmuls, less the slowest rank's C and the bare
all-reduce): +1.8 ms at C = 7 and +3.6 at 28 on 2 ranks, +2.6 at 8 and +5.8 at 32 on 4; about
k (sqrt(C) - sqrt(0.5 ms)). ``executor.collective_us`` already holds what a step pays at 0.5 ms
(``STEP_GAP_S``), so the cost model adds the growth beyond it (costmodel/simulate.py).

:func:`time_arrival_skew` times, on every rank at once, ``SKEW_BYTES`` all-reduces alone and after
each of ``SKEW_COMPUTE_MS`` of 256 x 256 matmuls (as many on every rank), each started by a barrier,
the compute times interleaved within each repetition (the machine's drift falls on each alike).
A rank's compute is read on the CPU clock of its thread where the device is the CPU: the work as the
cost model prices it (an op's calibrated time, x ``Cluster.time_sharing`` where ranks outnumber the
cores), without the pauses that make the skew. :func:`skew_points` takes, per compute time, the
median over repetitions of the slowest rank's time to the all-reduce's return, less that priced
compute (the ranks' median, x the ranks per core), less the bare all-reduce; :func:`fit_skew_us` is
the slope of those points against sqrt(C) - sqrt(0.5 ms), in microseconds per sqrt(ms) (an
intercept taken out: what a barrier's own skew adds at every C).

Session 23's version subtracted the slowest rank's own wall-clock compute, which already holds the
pauses the skew is made of: it read 32 us per sqrt(ms) on 2 ranks of the 2-core VM where this
reading gives 410-720 over three launches (a /tmp script, 80 repetitions; session 22: 545-780).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from autoddl.cluster import SKEW_BASE_MS, arrival_skew_x

# compute before the all-reduce, ms; the first: the gap executor.collective_us is timed after
SKEW_COMPUTE_MS = (SKEW_BASE_MS, 2.0, 4.0, 8.0, 16.0, 32.0)
SKEW_BYTES = 4096
SKEW_REPEAT_FACTOR = 10     # repetitions per calibration repeat: a pause is rare, its median needs many
MATMUL_SIDE = 256


def time_arrival_skew(torch: Any, dist: Any, repeats: int, device: Any = "cpu",
                      sync: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """This rank's timings: ``bare`` (seconds of each bare all-reduce) and ``rows`` (per compute time
    of ``SKEW_COMPUTE_MS``, ``(compute_s, to_return_s)`` per repetition), on ``device`` (``sync``: e.g.
    ``torch.cuda.synchronize``, before each time is read). ``compute_s`` is this thread's CPU time on
    the CPU, else wall-clock time (module docstring)."""
    work_clock = time.thread_time if str(device) == "cpu" else time.perf_counter
    a, b = (torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device) for _ in range(2))
    out = torch.empty(MATMUL_SIDE, MATMUL_SIDE, device=device)
    units = []
    for _ in range(5):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b, out=out)
        sync()
        units.append((time.perf_counter() - t0) / 20)
    unit = torch.tensor([statistics.median(units)], dtype=torch.float64, device=device)
    dist.all_reduce(unit, op=dist.ReduceOp.MAX)         # every rank runs as many matmuls
    calls = [max(1, round(c_ms * 1e-3 / float(unit))) for c_ms in SKEW_COMPUTE_MS]
    buf = torch.zeros(SKEW_BYTES // 4, device=device)
    dist.all_reduce(buf)
    sync()
    bare: list[float] = []
    rows: list[list[tuple[float, float]]] = [[] for _ in SKEW_COMPUTE_MS]
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        bare.append(time.perf_counter() - t0)
        for row, n in zip(rows, calls):
            dist.barrier()
            t0, w0 = time.perf_counter(), work_clock()
            for _ in range(n):
                torch.mm(a, b, out=out)
            sync()
            compute = work_clock() - w0
            dist.all_reduce(buf)
            sync()
            row.append((compute, time.perf_counter() - t0))
    return {"bare": bare, "rows": rows}


def skew_points(ranks: Sequence[dict[str, Any]], ranks_per_core: float = 1.0) -> tuple[tuple[float, float], ...]:
    """``((compute_s, extra_s), ...)`` per compute time from every rank's :func:`time_arrival_skew`:
    the compute as priced, ``ranks_per_core`` (at least 1) x the median of every rank's compute; the
    extra, the median over repetitions of the slowest rank's time to the return, less that compute,
    less the median of the slowest rank's bare all-reduce."""
    sharing = max(1.0, ranks_per_core)
    bare = statistics.median(max(r["bare"][i] for r in ranks) for i in range(len(ranks[0]["bare"])))
    points = []
    for j in range(len(ranks[0]["rows"])):
        reps = range(len(ranks[0]["rows"][j]))
        compute = sharing * statistics.median(r["rows"][j][i][0] for r in ranks for i in reps)
        to_return = statistics.median(max(r["rows"][j][i][1] for r in ranks) for i in reps)
        points.append((compute, to_return - compute - bare))
    return tuple(points)


def fit_skew_us(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``extra_s`` (in us) against ``arrival_skew_x`` (autoddl/cluster.py), with an
    intercept; at least 0."""
    if len(points) < 2:
        raise ValueError(f"fit_skew_us: need at least two compute times, got {len(points)}")
    xs = [arrival_skew_x(c) for c, _ in points]
    ys = [e * 1e6 for _, e in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_skew_us: the compute times are all the same")
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
