"""How late the ranks meet at a collective after computing apart: the cluster file's ``executor.arrival_skew_us``.

Ranks that compute C ms each and then meet in a collective do not arrive together: a rank's
computation is paused by the operating system (other ranks' threads, gloo's, the VM's), so the last
one arrives later than the ranks' compute times say, and more so the longer they computed apart.
Measured (session 22, a 4 KB all-reduce after C ms of matmuls, less the slowest rank's C and the bare
all-reduce): +1.8 ms at C = 7 and +3.6 at 28 on 2 ranks, +2.6 at 8 and +5.8 at 32 on 4; about
k (sqrt(C) - sqrt(0.5 ms)). ``executor.collective_us`` already holds what a step pays at 0.5 ms
(``STEP_GAP_S``), so the cost model adds the growth beyond it (costmodel/simulate.py).

:func:`time_arrival_skew` times, on every rank at once, ``SKEW_BYTES`` all-reduces alone and after
each of ``SKEW_COMPUTE_MS`` of 256 x 256 matmuls (as many on every rank), each repetition started
by a barrier; :func:`skew_points` takes, per compute time, the median over repetitions of the
slowest rank's time to the all-reduce's return less the slowest rank's compute, less the bare
all-reduce; :func:`fit_skew_us` is the slope of those points against sqrt(C) - sqrt(0.5 ms), in
microseconds per sqrt(ms) (an intercept taken out: what a barrier's own skew adds at every C).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from autoddl.cluster import SKEW_BASE_MS, arrival_skew_x

SKEW_COMPUTE_MS = (SKEW_BASE_MS, 8.0, 32.0)   # compute before the all-reduce; the first: collective_us's gap
SKEW_BYTES = 4096
SKEW_REPEAT_FACTOR = 3      # repetitions per calibration repeat: the skew is noisier than a bare collective
MATMUL_SIDE = 256


def time_arrival_skew(torch: Any, dist: Any, repeats: int, device: Any = "cpu",
                      sync: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """This rank's timings: ``bare`` (seconds of each bare all-reduce) and ``rows`` (per compute time
    of ``SKEW_COMPUTE_MS``, ``(compute_s, to_return_s)`` per repetition), on ``device`` (``sync``: e.g.
    ``torch.cuda.synchronize``, before each time is read)."""
    a, b = (torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device) for _ in range(2))
    out = torch.empty(MATMUL_SIDE, MATMUL_SIDE, device=device)
    for _ in range(5):
        torch.mm(a, b, out=out)
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b, out=out)
    sync()
    unit = torch.tensor([(time.perf_counter() - t0) / 20], dtype=torch.float64, device=device)
    dist.all_reduce(unit, op=dist.ReduceOp.MAX)         # every rank runs as many matmuls
    buf = torch.zeros(SKEW_BYTES // 4, device=device)
    dist.all_reduce(buf)
    sync()
    bare = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        bare.append(time.perf_counter() - t0)
    rows = []
    for c_ms in SKEW_COMPUTE_MS:
        calls = max(1, round(c_ms * 1e-3 / float(unit)))
        reps = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b, out=out)
            sync()
            compute = time.perf_counter() - t0
            dist.all_reduce(buf)
            sync()
            reps.append((compute, time.perf_counter() - t0))
        rows.append(reps)
    return {"bare": bare, "rows": rows}


def skew_points(ranks: Sequence[dict[str, Any]]) -> tuple[tuple[float, float], ...]:
    """``((compute_s, extra_s), ...)`` per compute time from every rank's :func:`time_arrival_skew`:
    per repetition the slowest rank's time to the return less the slowest rank's compute, its median
    less the median of the slowest rank's bare all-reduce; the compute is the median of the slowest's."""
    bare = statistics.median(max(r["bare"][i] for r in ranks) for i in range(len(ranks[0]["bare"])))
    points = []
    for j in range(len(ranks[0]["rows"])):
        reps = range(len(ranks[0]["rows"][j]))
        compute = [max(r["rows"][j][i][0] for r in ranks) for i in reps]
        total = [max(r["rows"][j][i][1] for r in ranks) for i in reps]
        points.append((statistics.median(compute), statistics.median(t - c for t, c in zip(total, compute)) - bare))
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
