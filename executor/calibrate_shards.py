"""Time the shard runner's tasks for ``autoddl calibrate`` (its own fixed costs; ``--only shard_runner``).

``measure_shard_tasks(runs, ...)`` starts ``nproc`` ranks (as executor/calibrate.py does: one process per
device, gloo on 127.0.0.1, ``threads`` intra-op threads each) and on every rank at once runs each model of
``runs`` (executor/shard_chain.py with the given sizes, cut at the given shard cuts) the way ``autoddl
schedule --run`` does: built and warmed up as executor/shard_worker.py builds a job, then ``steps`` training
steps of its shard tasks on one device through ``shard_worker.run_tasks`` (forward of every shard, then
backward of every shard in reverse, each backward ending with its parameters' SGD update). A task's time
is from the end of the previous task to its own end, so what the run loop does between tasks
(``forget_before``, the task's messages: none here) counts with the task it precedes; the first step is
left out (its first task has no previous one). Per shard and kind: the median over the steps, mean over
ranks. The fit (what these times say per task and per parameter) is ``autoddl.calibration``'s.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from autoddl.shard_program import BACKWARD, FORWARD

SHARD_CHAIN = Path(__file__).with_name("shard_chain.py")     # the model file the runs build


@dataclass(frozen=True)
class ShardTaskTiming:
    """One shard task kind of one calibration model: the median seconds of its task."""

    args: tuple[tuple[str, int], ...]     # the model's sizes (build_model keywords), sorted
    shard: int
    kind: str                             # autoddl.shard_program FORWARD | BACKWARD
    seconds: float                        # median over steps from the previous task's end, mean over ranks


def measure_shard_tasks(runs: Sequence[tuple[dict[str, int], tuple[str, ...]]], nproc: int = 2, threads: int = 1,
                        steps: int = 30, timeout_s: float = 600.0, verbose: bool = True) -> list[ShardTaskTiming]:
    """Each run (model sizes, shard cuts) timed on ``nproc`` ranks at once (module docstring)."""
    from executor.local_ranks import run_ranks

    if steps < 2:
        raise ValueError(f"calibrate: the shard runner needs at least 2 timed steps (the first is left out), got {steps}")
    ranks = run_ranks(_rank, nproc, list(runs), steps, nproc, verbose, timeout_s=timeout_s, threads=threads)
    out = []
    for i, (sizes, _) in enumerate(runs):
        for key in ranks[0][i]:
            out.append(ShardTaskTiming(tuple(sorted(sizes.items())), key[0], key[1],
                                       statistics.fmean(r[i][key] for r in ranks)))
    return out


def _rank(runs: list[tuple[dict[str, int], tuple[str, ...]]], steps: int, nproc: int, verbose: bool) -> list[dict]:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=nproc, timeout=timedelta(seconds=120))
    out = []
    for sizes, cuts in runs:
        dist.barrier()                      # every rank runs the same model at once
        times = time_one(sizes, cuts, steps)
        out.append(times)
        if rank == 0 and verbose:
            text = ", ".join(f"{kind}{shard} {t * 1e6:.0f}" for (shard, kind), t in times.items())
            print(f"calibrate: shard runner, {sizes}: {text} us per task (rank 0)", file=sys.stderr, flush=True)
    return out


def time_one(sizes: dict[str, int], cuts: tuple[str, ...], steps: int) -> dict[tuple[int, str], float]:
    """(shard, kind) -> median seconds of that task over ``steps`` steps after the first, one process."""
    import time

    from autoddl.shard_program import ScheduledTask, ShardedJob
    from executor.shard_worker import build_job, message_maps, run_tasks

    model = build_job({"name": "shard-chain", "model": str(SHARD_CHAIN), "args": sizes, "seed": 0, "lr": 1e-4,
                       "cuts": list(cuts)})
    model.warm_up()
    k = model.shards
    job = ShardedJob("shard-chain", steps, (0.0,) * k, (0.0,) * k, (0,) * k)
    tasks = [ScheduledTask(0, key, 0, float(i), float(i), 0.0) for i, key in enumerate(job.tasks())]
    executed = run_tasks([model], tasks, message_maps(tasks, 0), _no_message, _no_message, time.perf_counter)
    per: dict[tuple[int, str], list[float]] = {}
    for prev, row in zip(executed, executed[1:]):
        _, step, shard, kind, _, end = row[:6]
        if step >= 1:
            per.setdefault((shard, kind), []).append(end - prev[5])
    return {key: statistics.median(ts) for key, ts in sorted(per.items())}


def _no_message(*_: Any) -> None:
    raise RuntimeError("calibrate: a one-device shard run has no messages")


# -- the fit ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardTaskSample:
    """A timed task beside its price without the runner's fixed costs (its ops, search/shards.py)."""

    kind: str                             # FORWARD | BACKWARD
    ops: int                              # graph ops the task runs
    params: int                           # parameters it updates (0 for a forward)
    measured_s: float
    priced_s: float


@dataclass(frozen=True)
class ShardRunnerFit:
    """The runner's fixed costs (microseconds): per forward task, per backward task, per parameter a
    backward updates; and, not priced, what the runner takes per op beyond the ops' priced time
    (forward, backward: negative when it takes less) and the largest relative residual."""

    forward_us: float
    backward_us: float
    param_us: float
    op_forward_us: float
    op_backward_us: float
    max_rel_residual: float


def fit_shard_runner(samples: Sequence[ShardTaskSample]) -> ShardRunnerFit:
    """Least squares, relative (each row weighted by 1 / its measured time), of ``measured - priced``:
    forward ``= forward_us + op_forward_us * ops``, backward ``= backward_us + op_backward_us * ops +
    param_us * params``. The per-op slopes absorb the ops' pricing error so that it does not leak into the
    fixed costs; a negative task or parameter cost is written as 0."""
    import numpy as np

    fwd = [s for s in samples if s.kind == FORWARD]
    bwd = [s for s in samples if s.kind == BACKWARD]
    xf = np.array([[1.0, s.ops] for s in fwd]).reshape(-1, 2)
    xb = np.array([[1.0, s.ops, s.params] for s in bwd]).reshape(-1, 3)
    if np.linalg.matrix_rank(xf) < 2 or np.linalg.matrix_rank(xb) < 3:
        raise ValueError(f"fit_shard_runner: need forward tasks of 2 op counts and backward tasks whose op and "
                         f"parameter counts vary apart, got (kind, ops, params) "
                         f"{sorted({(s.kind, s.ops, s.params) for s in samples})}")

    def solve(x, rows):
        t = np.array([s.measured_s for s in rows])
        y = t - np.array([s.priced_s for s in rows])
        coef = np.linalg.lstsq(x / t[:, None], y / t, rcond=None)[0]
        return coef, t, y

    f, tf, yf = solve(xf, fwd)
    b, tb, yb = solve(xb, bwd)
    f_kept = np.array([max(0.0, f[0]), f[1]])
    b_kept = np.array([max(0.0, b[0]), b[1], max(0.0, b[2])])
    rel = np.concatenate([np.abs(xf @ f_kept - yf) / tf, np.abs(xb @ b_kept - yb) / tb])
    return ShardRunnerFit(float(f_kept[0]) * 1e6, float(b_kept[0]) * 1e6, float(b_kept[2]) * 1e6,
                          float(f[1]) * 1e6, float(b[1]) * 1e6, float(rel.max()))
