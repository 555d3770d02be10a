"""How long one small gloo all-reduce takes on this machine, back to back and as a step issues it.

A training step issues a collective after some compute, and each rank gets there at its own time; a
microbenchmark issues them back to back. On a virtual machine the two differ: a rank that waits
leaves its vCPU idle, the hypervisor deschedules it, and the message that should wake it may wait
for the host's next scheduler tick. This times 128 KB all-reduces (the size of the study's tiny
models' activations) on 2 gloo ranks, 1 thread each, after 0, 0.5, 2, 6 and 12 ms of matmuls on every rank
(a step's phases between two collectives: 6-12 ms is resnet tiny's forward or backward here),
in interleaved rounds, and writes per pattern the p10 / median / p90 / mean and the share of calls
over 1 ms to results/collective_waits.csv (appended atomically, one row per pattern and run).

    python benchmarks/collective_waits.py          # ~90 s; run it on an idle machine
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from torchrun_pair import is_rank, run_pair, write_times  # noqa: E402

OUT = ROOT / "results" / "collective_waits.csv"
MESSAGE_BYTES = 128 << 10
GAPS_MS = (0.0, 0.5, 2.0, 6.0, 12.0)   # compute before each all-reduce, every rank the same
CALLS = 60                       # per pattern and round (the first 5 of each untimed)
ROUNDS = 3
COLUMNS = ("time", "git_commit", "machine", "pattern", "message_bytes", "calls", "p10_us", "median_us", "p90_us",
           "mean_us", "share_over_1ms", "load_avg_1m")


def rank_main(out_dir: str) -> None:
    """One torchrun rank: every pattern in every round; rank 0 writes its seconds per call."""
    
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    x = torch.zeros(MESSAGE_BYTES // 4)
    a = torch.randn(128, 128)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per_matmul = (time.perf_counter() - t0) / 20
    counts = torch.tensor([max(1, round(g * 1e-3 / per_matmul)) if g else 0 for g in GAPS_MS])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)            # the same compute on every rank
    times: dict[str, list[float]] = {f"after {g:g} ms of compute" if g else "back to back": [] for g in GAPS_MS}
    for _ in range(ROUNDS):
        for (pattern, out), n in zip(times.items(), counts.tolist()):
            dist.barrier()
            for i in range(CALLS):
                for _ in range(n):
                    a @ a
                t = time.perf_counter()
                dist.all_reduce(x)
                if i >= 5:
                    out.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        write_times(out_dir, times)
    dist.destroy_process_group()


def rows_of(times: dict[str, list[float]], machine: str, commit: str, load: float) -> list[dict[str, str]]:
    """One CSV row per pattern: quantiles and mean in microseconds, the share of calls over 1 ms."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows = []
    for pattern, ts in times.items():
        us = sorted(t * 1e6 for t in ts)
        q = statistics.quantiles(us, n=10)
        rows.append({"time": now, "git_commit": commit, "machine": machine, "pattern": pattern,
                     "message_bytes": str(MESSAGE_BYTES), "calls": str(len(us)), "p10_us": f"{q[0]:.0f}",
                     "median_us": f"{statistics.median(us):.0f}", "p90_us": f"{q[-1]:.0f}",
                     "mean_us": f"{statistics.fmean(us):.0f}",
                     "share_over_1ms": f"{sum(u > 1000 for u in us) / len(us):.2f}", "load_avg_1m": f"{load:.1f}"})
    return rows


def main() -> int:
    from autoddl.machine import this_machine
    from executor.measure import append_row, git_commit

    load = os.getloadavg()[0]
    times = run_pair(__file__, "autoddl-waits-")
    if times is None:
        return 1
    for row in rows_of(times, this_machine(), git_commit(), load):
        append_row(OUT, row, columns=COLUMNS)
        print(f"{row['pattern']:>26}: p10 {row['p10_us']:>5} us, median {row['median_us']:>5}, p90 {row['p90_us']:>5}, "
              f"mean {row['mean_us']:>5}; over 1 ms: {float(row['share_over_1ms']):.0%}")
    print(f"appended to {OUT}")
    return 0


if __name__ == "__main__":
    if is_rank(sys.argv):
        rank_main(is_rank(sys.argv))
    else:
        sys.exit(main())
