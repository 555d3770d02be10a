"""Measured step time and memory, and the runs table they are appended to.

A run's timing is ``time_steps``: W warm-up steps, then S measured steps run back
to back as a training loop runs them, the ranks started together by a barrier and
each step timed on each rank from its start to the next step's (after
``torch.cuda.synchronize`` on CUDA); no barrier between steps, which no training
loop runs and the cost model does not price. ``job_step_times`` turns the
ranks' times into the job's: the ranks' mean per step, at the pace the job went.
The summary is ``StepStats`` (median, p10, p90). Peak memory per rank is
``PeakMemory``:
on CUDA ``torch.cuda.max_memory_allocated`` after a reset; on CPU the growth of
the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` when the kernel allows it, else ``ru_maxrss``) above
the resident set at ``start()``, taken once the free blocks the process kept
(executor/allocator.py) have gone back to the kernel.

``append_row`` adds one row to a CSV atomically: it reads the table, writes
the whole table plus the row to a temporary file in the same directory and
``os.replace``-s it over the old one, so a crash at any point leaves either the
old table or the new one, never a torn file.
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import os
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from autoddl.atomic import write_csv_atomic
from autoddl.machine import this_machine
from executor.allocator import release_freed_memory

RUN_COLUMNS = (
    "time", "git_commit", "model", "preset", "cluster", "plan", "mesh", "nproc", "backend",
    "predicted_step_s", "predicted_compute_s", "predicted_comm_s", "predicted_grad_sync_s",
    "predicted_optimizer_s", "measured_median_s", "measured_p10_s", "measured_p90_s", "peak_memory_mb",
    "check_max_rel_err", "machine",
)


# -- step time ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepStats:
    median_s: float
    p10_s: float
    p90_s: float
    steps: int

    @classmethod
    def of(cls, times_s: Sequence[float]) -> "StepStats":
        if not times_s:
            raise ValueError("StepStats.of: no step times (run at least one measured step, --steps >= 1)")
        return cls(statistics.median(times_s), percentile(times_s, 10), percentile(times_s, 90), len(times_s))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default): q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of an empty sequence")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Share:
    """One rank's measured steps of one ``time_steps`` call: ``start_s``, when the barrier before them let
    this rank go, and ``times_s``, each step's time, on this rank's ``time.perf_counter`` clock."""
    start_s: float
    times_s: tuple[float, ...]


def time_steps(step: Callable[[], Any], steps: int, warmup: int, *, barrier: Callable[[], None] | None = None,
               sync: Callable[[], None] | None = None,
               progress: Callable[[str, int, int, float], None] | None = None) -> Share:
    """Run ``warmup`` then ``steps`` calls of ``step`` back to back; return this rank's ``Share``: when
    the measured steps started and the time of each, in seconds.

    The ranks start together (``sync()``, e.g. ``torch.cuda.synchronize``, then ``barrier()``) before the
    warm-up and again before the first measured step, and leave together after the last (untimed). In
    between no barrier: a barrier is a collective of its own (0.5-4 ms on the 2-core VMs of
    results/collective_waits.csv, 15-20% of a tiny model's step) that a training loop does not run and
    the step program does not contain. A measured step is timed from its start to the next one's
    (``sync()`` at each boundary): a rank that waits in a collective for a slower rank pays the wait in
    that step, as it does in training. ``progress(kind, i, n, seconds)`` is called after each step with
    kind "warmup" or "step" (i counted from 1), outside the timed window.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"time_steps: need steps >= 1 and warmup >= 0, got steps={steps} warmup={warmup}")
    barrier = barrier or (lambda: None)
    sync = sync or (lambda: None)
    progress = progress or (lambda kind, i, n, seconds: None)
    sync()
    barrier()
    for i in range(warmup):
        t0 = time.perf_counter()
        step()
        sync()
        progress("warmup", i + 1, warmup, time.perf_counter() - t0)
    sync()
    barrier()
    start_s = time.perf_counter()
    times: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        progress("step", i + 1, steps, times[-1])
    barrier()
    return Share(start_s, tuple(times))


def steps_for_min_time(steps: int, min_time_s: float, step_s: float) -> int:
    """The measured steps of a plan: ``steps``, or as many more as take ``min_time_s`` at ``step_s`` a
    step (its warm-up's pace), so that a fast plan's median is not taken over a few scheduler ticks:
    12 steps of gpt tiny (11 ms each) last 0.13 s on the 2-core VMs, where one rank descheduled for
    4 ms (results/collective_waits.csv) moves a step by a third; the same program measured twice in
    one launch read 11.8 and 15.5 ms (study 20261128-182018). ``min_time_s`` 0 or an unknown pace
    (``step_s`` <= 0): ``steps``."""
    if steps < 1:
        raise ValueError(f"steps_for_min_time: need steps >= 1, got {steps}")
    if min_time_s <= 0 or step_s <= 0:
        return steps
    return max(steps, math.ceil(min_time_s / step_s))


def job_step_times(shares_by_rank: Sequence[Sequence[Share]], one_clock: bool) -> list[float]:
    """The job's step times from each rank's: ``shares_by_rank[r][k]`` is rank r's share k (one
    ``time_steps`` call, which the ranks start together at a barrier).

    A share's steps took the job from its first rank's start to its last rank's end (its makespan).
    Step i's time is the ranks' mean time of step i, scaled so that the share's steps add up to that
    makespan. Where collectives keep the ranks in step the two agree (a rank that waits for a slower
    one pays the wait in its own step) and the scale is ~1. Where nothing does (a plan with no
    communication), a rank that ran ahead has not made the job faster, nor has one that left the
    barrier late because it waited for a core; a mean over ranks counted both. Measured once (4
    single-threaded gloo ranks on the 2-core VM, 6 steps of 60 matmuls 256 x 256 after a barrier, each
    rank's start and ends on one clock): the ranks left the barrier up to 35 ms apart, and their mean
    step read 59 ms where the job took 67 ms a step; mlp's no-communication plan on 4 ranks read 22.5
    ms (study 20261127-101337) where the job took ~36. Per-step ends are no better: a late pair of
    ranks makes a first step of 40 and then steps of 10 where the job's pace is 20.
    With ``one_clock`` (every rank on one host: ``time.perf_counter`` is the same monotonic clock in
    every process) the ranks' starts and ends are compared as they are; otherwise each rank's are
    counted from its own start.
    """
    if not shares_by_rank:
        raise ValueError("job_step_times: no ranks")
    shares = [len(rank) for rank in shares_by_rank]
    if len(set(shares)) != 1:
        raise ValueError(f"job_step_times: the ranks timed different numbers of shares {shares}")
    out: list[float] = []
    for share in zip(*shares_by_rank):
        counts = [len(s.times_s) for s in share]
        if len(set(counts)) != 1:
            raise ValueError(f"job_step_times: the ranks timed different numbers of steps {counts} in one share")
        starts = [s.start_s if one_clock else 0.0 for s in share]
        makespan = max(start + sum(s.times_s) for s, start in zip(share, starts)) - min(starts)
        mean = [sum(times) / len(share) for times in zip(*(s.times_s for s in share))]
        scale = makespan / sum(mean) if sum(mean) > 0 else 1.0
        out += [t * scale for t in mean]
    return out


# -- memory ---------------------------------------------------------------------------------------

def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory this process used for the work between ``start()`` and ``peak_mb()``, in MB (1e6 bytes)."""

    def __init__(self, device: str = "cpu"):
        import torch  # here, not at module level: the runs table needs no torch

        self._torch = torch
        self.cuda = device == "cuda" and torch.cuda.is_available()
        self._base_kb = 0
        self._hwm_reset = False

    def start(self) -> None:
        if self.cuda:
            cuda = self._torch.cuda
            cuda.synchronize()
            cuda.reset_peak_memory_stats()
            self._base_kb = cuda.memory_allocated() // 1024
            return
        release_freed_memory()      # what earlier work freed and the process kept (executor/allocator.py)
        self._hwm_reset = _reset_hwm() and _status_kb("VmHWM") is not None
        rss = _status_kb("VmRSS")
        self._base_kb = rss if (self._hwm_reset and rss is not None) else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def peak_mb(self) -> float:
        """Peak above the level at ``start()``: CUDA allocated bytes, or CPU resident set."""
        if self.cuda:
            cuda = self._torch.cuda
            cuda.synchronize()
            return max(0, cuda.max_memory_allocated() - self._base_kb * 1024) / 1e6
        peak_kb = _status_kb("VmHWM") if self._hwm_reset else None
        if peak_kb is None:
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, peak_kb - self._base_kb) * 1024 / 1e6


# -- the runs table -------------------------------------------------------------------------------

def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """``git rev-parse --short HEAD`` of the repository holding ``cwd`` (this package by default)."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def read_rows(path: str | os.PathLike) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a CSV; ([], []) when it does not exist or is empty."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return [], []
    reader = csv.DictReader(io.StringIO(text))
    rows = list(reader)
    return list(reader.fieldnames or []), rows


def append_row(path: str | os.PathLike, row: Mapping[str, Any], columns: Sequence[str] = RUN_COLUMNS) -> None:
    """Append ``row`` to the CSV at ``path`` atomically (read, write a temp file alongside, os.replace).

    Columns are ``columns`` followed by any other column the existing file or the row has;
    missing values are empty. A row key outside them is kept, never dropped.
    """
    path = Path(path)
    header, rows = read_rows(path)
    cols = list(columns) + [c for c in header if c not in columns]
    cols += [c for c in row if c not in cols]
    rows.append(dict(row))
    write_csv_atomic(path, rows, cols)


def run_row(*, model: str, preset: str, cluster: str, plan: str, mesh: str, nproc: int, backend: str,
            predicted: Mapping[str, float] | None, stats: StepStats, peak_memory_mb: float,
            check_max_rel_err: float | None = None, commit: str | None = None) -> dict[str, Any]:
    """One row of the runs table (RUN_COLUMNS); ``predicted`` is a plan's cost dict or None."""
    p = predicted or {}

    def pred(key: str) -> Any:
        return f"{p[key]:.6g}" if key in p and p[key] is not None else ""

    return {
        "time": utc_now(), "git_commit": commit if commit is not None else git_commit(), "model": model,
        "preset": preset, "cluster": cluster, "plan": plan, "mesh": mesh, "nproc": nproc, "backend": backend,
        "predicted_step_s": pred("step_time_s"), "predicted_compute_s": pred("compute_s"),
        "predicted_comm_s": pred("comm_s"), "predicted_grad_sync_s": pred("grad_sync_s"),
        "predicted_optimizer_s": pred("optimizer_s"), "measured_median_s": f"{stats.median_s:.6g}",
        "measured_p10_s": f"{stats.p10_s:.6g}", "measured_p90_s": f"{stats.p90_s:.6g}",
        "peak_memory_mb": f"{peak_memory_mb:.3f}",
        "check_max_rel_err": "" if check_max_rel_err is None else f"{check_max_rel_err:.3g}",
        "machine": this_machine(),
    }
