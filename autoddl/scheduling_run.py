"""``autoddl schedule --run``: run a sweep's schedule on gloo ranks and compare it with the prediction.

One rank per device (executor/shard_worker.py through torchrun, executor/launch.py). Afterwards:
the tasks each rank ran, in order, must be the schedule's for that device (else the run is not the
schedule that was priced, and this fails), and so must the bytes each task copied between host
memory and its device (a spilled job's loads and write-backs); the measured makespan (between the ranks' two barriers)
is set beside the predicted one; each job's per-step losses are compared with the job trained alone
in this process (same seed, same batch, same SGD), and the largest relative difference is reported
(bound 1e-5). A row per run is appended to a CSV with the 1-minute load average and every job's
per-step losses.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoddl.scheduling import SweepPlan
from autoddl.shard_program import task_to_dict
from executor.launch import LaunchSpec, launch
from executor.measure import append_row, git_commit, utc_now
from executor.shard_worker import train_alone

LOSS_RTOL = 1e-5


@dataclass
class SweepRun:
    measured_makespan_s: float
    losses: list[list[float]]                  # per job, per step: the sharded run's
    alone: list[list[float]]                   # the same job trained alone
    executed: dict[int, list[tuple]]           # device -> (job, step, shard, kind) in the order it ran them
    load_avg_1m: float
    spans: dict[int, list[tuple[float, float]]]   # device -> (start, end) of each of those tasks, measured
    copies: dict[int, list[tuple[int, int]]]      # device -> (bytes loaded, bytes written back) of each task

    @property
    def max_rel_error(self) -> float:
        return max(abs(a - b) / max(abs(b), 1e-30) for xs, ys in zip(self.losses, self.alone) for a, b in zip(xs, ys))


def job_dicts(sweep: SweepPlan) -> list[dict[str, Any]]:
    return [{"name": s.name, "model": s.model, "args": s.args, "seed": s.seed, "lr": s.lr, "cuts": list(j.cuts),
             "flows": [f.tensor for f in j.flows], "spill": j.spill} for s, j in zip(sweep.specs, sweep.jobs)]


def run_sweep(sweep: SweepPlan, timeout_s: float | None = 600.0) -> SweepRun:
    """Launch the schedule on one gloo rank per device; check the order it ran; compare the losses."""
    n = sweep.cluster.num_devices
    for spec in sweep.specs:
        if spec.unrunnable():
            raise ValueError(f"job {spec.name!r}: {', '.join(spec.unrunnable())}: the run executes only fp32, no "
                             "recompute and SGD (autoddl/jobs.py)")
    jobs = job_dicts(sweep)
    with tempfile.TemporaryDirectory(prefix="autoddl-schedule-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"jobs": jobs, "tasks": [task_to_dict(t) for t in sweep.schedule.tasks],
                                    "host_dir": tmp}))
        res = launch(LaunchSpec(n, omp_num_threads=1, timeout_s=timeout_s),
                     ["--spec", str(spec), "--out-dir", tmp], module="executor.shard_worker")
        if not res.ok:
            raise RuntimeError(f"the schedule's run failed:\n{res.describe()}\n" + "\n".join(res.stderr_tail[-25:]))
        load = os.getloadavg()[0]
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(n)]
    executed = {r["rank"]: [tuple(e[:4]) for e in r["executed"]] for r in ranks}
    for d in range(n):
        want = [(t.job, t.key.step, t.key.shard, t.key.kind) for t in sweep.schedule.on_device(d)]
        if executed[d] != want:
            raise RuntimeError(f"device {d} ran its tasks in the order {executed[d]}, not the schedule's {want}")
    copies = {r["rank"]: [tuple(e[6:8]) for e in r["executed"]] for r in ranks}
    for d in range(n):
        want = [(t.load_bytes, t.writeback_bytes) for t in sweep.schedule.on_device(d)]
        if copies[d] != want:
            raise RuntimeError(f"device {d} copied (loaded, written back) bytes {copies[d]} to and from host memory, "
                               f"not the schedule's {want}")
    losses = [[0.0] * s.steps for s in sweep.specs]
    for r in ranks:
        for j, per_step in r["losses"].items():
            for step, value in per_step.items():
                losses[int(j)][int(step)] = value
    alone = [train_alone(job, s.steps)[0] for job, s in zip(jobs, sweep.specs)]
    spans = {r["rank"]: [tuple(e[4:6]) for e in r["executed"]] for r in ranks}
    return SweepRun(max(r["makespan_s"] for r in ranks), losses, alone, executed, load, spans, copies)


def run_row(sweep: SweepPlan, run: SweepRun, jobs_file: str) -> dict[str, Any]:
    return {"time": utc_now(), "git_commit": git_commit(), "jobs_file": jobs_file, "cluster": sweep.cluster.name,
            "devices": sweep.cluster.num_devices, "jobs": len(sweep.specs),
            "tasks": len(sweep.schedule.tasks), "prefetch": sweep.prefetch,
            "predicted_makespan_s": f"{sweep.schedule.makespan_s:.6g}",
            "measured_makespan_s": f"{run.measured_makespan_s:.6g}",
            "measured_over_predicted": f"{run.measured_makespan_s / sweep.schedule.makespan_s:.3f}",
            "predicted_sequential_s": f"{sweep.sequential.makespan_s:.6g}",
            "predicted_one_per_device_s": ("" if sweep.one_per_device.makespan_s is None
                                           else f"{sweep.one_per_device.makespan_s:.6g}"),
            "loss_max_rel_error": f"{run.max_rel_error:.3g}", "load_avg_1m": f"{run.load_avg_1m:.2f}",
            "job_losses": "; ".join(f"{s.name}: " + " ".join(f"{x:.6g}" for x in losses)
                                    for s, losses in zip(sweep.specs, run.losses))}


def report_run(sweep: SweepPlan, run: SweepRun, jobs_file: str, csv_path: str) -> int:
    """Print measured vs predicted and the loss check; append the row; exit code 1 if the losses differ."""
    predicted = sweep.schedule.makespan_s
    print(f"ran the schedule on {sweep.cluster.num_devices} gloo ranks (each rank's task order = the schedule's)")
    loads = [c for per in run.copies.values() for c in per]
    if any(a or b for a, b in loads):
        print(f"host copies (as the schedule's): {sum(1 for a, _ in loads if a)} loads "
              f"({sum(a for a, _ in loads) / 1e6:.2f} MB), {sum(1 for _, b in loads if b)} write-backs "
              f"({sum(b for _, b in loads) / 1e6:.2f} MB)")
    print(f"makespan: predicted {predicted * 1e3:.2f} ms, measured {run.measured_makespan_s * 1e3:.2f} ms "
          f"({run.measured_makespan_s / predicted:.2f}x); 1-minute load average {run.load_avg_1m:.2f}")
    for spec, mine, alone in zip(sweep.specs, run.losses, run.alone):
        print(f"  {spec.name}: losses {', '.join(f'{x:.5f}' for x in mine)} (alone: "
              f"{', '.join(f'{x:.5f}' for x in alone)})")
    ok = run.max_rel_error <= LOSS_RTOL
    print(f"losses against each job trained alone: largest relative difference {run.max_rel_error:.2e} -> "
          + ("OK" if ok else f"FAILED (above {LOSS_RTOL:g})"))
    if csv_path:
        row = run_row(sweep, run, jobs_file)
        append_row(csv_path, row, columns=list(row))
        print(f"appended to {csv_path}")
    return 0 if ok else 1
