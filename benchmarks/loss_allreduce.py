"""What an asynchronous loss all-reduce costs a data-parallel step that DDP's does not pay.

Until 2026-11-28 the dp step program all-reduced the loss (4 bytes) as soon as the forward had it and
waited for it at the step's end only (``StepProgram.loss_async``), so every rank returned the same
loss; DDP returns each rank's own loss and runs no such collective. This benchmark measured what that
cost, and the loss now rides in the first float32 all-reduce bucket instead (``StepProgram.loss_bucket``);
programs without such a bucket (ZeRO-2/3, tensor parallel) and ``ParallelModule``, whose forward
returns the reduced loss, still run the asynchronous all-reduce. The variant names in the CSV are
those of the first runs ("the dp program" is the old program).

This times a synthetic data-parallel step on 2 gloo ranks, 1 thread each (matmuls for a forward and a
backward twice as long, then a 0.55 MB gradient all-reduce: gpt tiny's dp step on this machine),
without and with that asynchronous 4-byte all-reduce (a functional collective launched after the
forward, waited for after the gradient all-reduce), and with the loss carried as one more element of
the gradient all-reduce (no collective of its own: what the program does now), in interleaved rounds,
and appends one row per variant (step p10 / median / p90 / mean in ms) to results/loss_allreduce.csv
(atomically).

    python benchmarks/loss_allreduce.py          # ~30 s; run it on an idle machine
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

OUT = ROOT / "results" / "loss_allreduce.csv"
GRAD_BYTES = 140_000 * 4            # gpt tiny's one gradient bucket
FORWARD_MATMULS = 12                # 256 x 256 @ 256 x 256: about 6 ms here; the backward twice that
STEPS, WARMUP, ROUNDS = 12, 2, 10   # per variant and round
VARIANTS = ("no loss all-reduce (DDP)", "async loss all-reduce (the dp program)", "loss in the gradient all-reduce")
COLUMNS = ("time", "git_commit", "machine", "variant", "steps", "p10_ms", "median_ms", "p90_ms", "mean_ms",
           "load_avg_1m")


def rank_main(out_dir: str) -> None:
    """One torchrun rank: both variants in every round; rank 0 writes its step seconds per variant."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    grads = torch.zeros(GRAD_BYTES // 4)
    grads_and_loss = torch.zeros(GRAD_BYTES // 4 + 1)

    def step(variant: str) -> None:
        for _ in range(FORWARD_MATMULS):                  # forward
            a @ a
        loss = funcol.all_reduce(torch.ones(()), "sum", dist.group.WORLD) if variant == VARIANTS[1] else None
        for _ in range(2 * FORWARD_MATMULS):              # backward
            a @ a
        dist.all_reduce(grads_and_loss if variant == VARIANTS[2] else grads)   # gradient sync
        if loss is not None:
            funcol.wait_tensor(loss)                      # the step's end

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(ROUNDS):
        for variant in VARIANTS:
            dist.barrier()
            for i in range(WARMUP + STEPS):
                t = time.perf_counter()
                step(variant)
                if i >= WARMUP:
                    times[variant].append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        write_times(out_dir, times)
    dist.destroy_process_group()


def rows_of(times: dict[str, list[float]], machine: str, commit: str, load: float) -> list[dict[str, str]]:
    """One CSV row per variant: step quantiles and mean in milliseconds."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows = []
    for variant, ts in times.items():
        ms = sorted(t * 1e3 for t in ts)
        q = statistics.quantiles(ms, n=10)
        rows.append({"time": now, "git_commit": commit, "machine": machine, "variant": variant,
                     "steps": str(len(ms)), "p10_ms": f"{q[0]:.2f}", "median_ms": f"{statistics.median(ms):.2f}",
                     "p90_ms": f"{q[-1]:.2f}", "mean_ms": f"{statistics.fmean(ms):.2f}", "load_avg_1m": f"{load:.1f}"})
    return rows


def main() -> int:
    from autoddl.machine import this_machine
    from executor.measure import append_row, git_commit

    load = os.getloadavg()[0]
    times = run_pair(__file__, "autoddl-loss-ar-")
    if times is None:
        return 1
    rows = rows_of(times, this_machine(), git_commit(), load)
    for row in rows:
        append_row(OUT, row, columns=COLUMNS)
        print(f"{row['variant']:>40}: step p10 {row['p10_ms']} ms, median {row['median_ms']}, p90 {row['p90_ms']}, "
              f"mean {row['mean_ms']}")
    base = float(rows[0]["median_ms"])
    print(f"added to the median step: the loss's own all-reduce {float(rows[1]['median_ms']) - base:.2f} ms, "
          f"the loss in the gradient all-reduce {float(rows[2]['median_ms']) - base:.2f} ms; appended to {OUT}")
    return 0


if __name__ == "__main__":
    if is_rank(sys.argv):
        rank_main(is_rank(sys.argv))
    else:
        sys.exit(main())
