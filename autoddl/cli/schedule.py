"""``autoddl schedule JOBS.yaml``: many models' shards on one cluster (Hydra's sharded-LRTF).

Prints one row per job (steps, shards, its solo times, its finish time under each schedule) and the
three makespans with their ratios; writes ``gantt.png`` (device x time, one colour per job) and
``schedule.csv`` (every task: job, device, kind, shard, step, start, end, transfer, a spilled
shard's host copies: bytes, start and end of its load and write-back, and the most its device
holds while it runs) to ``--out``; each device's peak memory is printed.
With ``--run`` the schedule runs on gloo ranks (autoddl/scheduling_run.py): measured
against predicted makespan, each job's losses against the job trained alone in one process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autoddl.atomic import write_csv_atomic
from autoddl.charts import gantt_chart
from autoddl.cli import EXPECTED_ERRORS, common_options, register, table
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Cluster
from autoddl.jobs import JobsFileError, load_jobs
from autoddl.scheduling import CSV_COLUMNS, SweepPlan, job_rows, plan_sweep, task_rows

if JobsFileError not in EXPECTED_ERRORS:
    EXPECTED_ERRORS.append(JobsFileError)


@register
def add_schedule(subparsers) -> None:
    p = subparsers.add_parser(
        "schedule", parents=[common_options()],
        help="schedule many models' shards on one cluster (sharded-LRTF) against one-at-a-time and one-per-device",
        description="Cut every model of JOBS_YAML into shards, schedule their tasks on the cluster's devices "
                    "(sharded-LRTF: a free device takes the next shard task of the job with the longest remaining "
                    "time), and compare the makespan with one model at a time on all devices (its best plan) and "
                    "one model per device.")
    p.add_argument("jobs_yaml", metavar="JOBS_YAML",
                   help="the jobs (schema: autoddl/jobs.py, e.g. examples/sweep.yaml)")
    p.add_argument("--cluster", default=str(DEFAULT_CLUSTER_PATH), metavar="YAML", help="cluster (default dgx-a100-8)")
    p.add_argument("--devices", type=int, metavar="N", help="devices to use (default: the cluster's)")
    p.add_argument("--steps", type=int, metavar="S", help="train every job S steps (default: each job's own)")
    p.add_argument("--out", metavar="DIR", help="where gantt.png and schedule.csv go (default <JOBS stem>_schedule)")
    p.add_argument("--run", action="store_true", help="run the schedule on gloo ranks, one per device, and measure it")
    p.add_argument("--runs-csv", default="results/schedule_runs.csv", metavar="CSV",
                   help="with --run: the table measured vs predicted makespan is appended to")
    p.add_argument("--timeout-s", type=float, default=600.0, metavar="T", help="with --run: kill the ranks after T s")
    p.set_defaults(func=run_schedule)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.3g} MB"


def print_sweep(sweep: SweepPlan) -> None:
    rows = [(r["job"], str(r["steps"]), str(r["shards"]) + (" (host)" if r["spilled"] else ""),
             _ms(r["solo_one_device_s"]), _ms(r["solo_best_plan_s"]),
             _ms(r["finish_lrtf_s"]), _ms(r["finish_sequential_s"]), _ms(r["finish_one_per_device_s"]))
            for r in job_rows(sweep)]
    n = sweep.cluster.num_devices
    print(table(("job", "steps", "shards", "alone on 1 (ms)", f"alone on {n}, best plan (ms)", "ends: sharded-LRTF",
                 "ends: sequential", "ends: one per device"), rows, numeric=(1, 2, 3, 4, 5, 6, 7)))
    lrtf = sweep.schedule.makespan_s
    print(f"predicted makespan on {sweep.cluster.name} ({n} devices):")
    print(f"  sharded-LRTF ({'with' if sweep.prefetch else 'without'} prefetch): {_ms(lrtf)} ms, devices busy "
          f"{sweep.schedule.busy_fraction():.0%} (the schedule {'without' if sweep.prefetch else 'with'} prefetch: "
          f"{_ms(sweep.other_makespan_s)} ms)")
    peaks = sweep.schedule.peak_memory_bytes()
    each = ", ".join(f"dev{d} {_gb(b)}" for d, b in enumerate(peaks))
    print(f"  peak device memory (shards, gradients, saved activations): {each} of "
          f"{_gb(sweep.cluster.device.memory_gb * 1e9)}")
    copies = [t for t in sweep.schedule.tasks if t.load_bytes or t.writeback_bytes]
    if copies:
        load_s = sum(t.load_end_s - t.load_start_s for t in copies)
        back_s = sum(t.writeback_end_s - t.writeback_start_s for t in copies)
        print(f"  host copies of spilled shards: {sum(1 for t in copies if t.load_bytes)} loads "
              f"({sum(t.load_bytes for t in copies) / 1e6:.2f} MB, {_ms(load_s)} ms), "
              f"{sum(1 for t in copies if t.writeback_bytes)} write-backs "
              f"({sum(t.writeback_bytes for t in copies) / 1e6:.2f} MB, {_ms(back_s)} ms) on the copy streams")
    for base, what in ((sweep.sequential, "one model at a time, each with its best plan on all devices"),
                       (sweep.one_per_device, "one model per device")):
        if base.makespan_s is None:
            print(f"  {base.name} ({what}): not applicable: {base.reason}")
        else:
            print(f"  {base.name} ({what}): {_ms(base.makespan_s)} ms ({base.makespan_s / lrtf:.2f}x sharded-LRTF)")


def refuse_unrunnable(jobs_yaml: str) -> None:
    """``--run`` executes fp32, no recompute, SGD (autoddl/jobs.py): refuse a job asking for more."""
    for i, spec in enumerate(load_jobs(jobs_yaml)):
        bad = spec.unrunnable()
        if bad:
            raise JobsFileError(f"{jobs_yaml}: jobs[{i}] ({spec.name!r}): {', '.join(bad)}: --run executes only "
                                "precision: fp32, recompute: none, optimizer: sgd; plan without --run, or remove "
                                "these fields to run the job")


def run_schedule(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be >= 1")
    if args.run:
        refuse_unrunnable(args.jobs_yaml)
    cluster = Cluster.from_yaml(args.cluster)
    sweep = plan_sweep(args.jobs_yaml, cluster, args.devices, args.steps)
    print_sweep(sweep)
    out = Path(args.out or f"{Path(args.jobs_yaml).stem}_schedule")
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "schedule.csv", task_rows(sweep.schedule, sweep.names), CSV_COLUMNS)
    gantt_chart(sweep.schedule.tasks, sweep.names, sweep.cluster.num_devices,
                f"{Path(args.jobs_yaml).name} on {sweep.cluster.name}: sharded-LRTF, predicted makespan "
                f"{_ms(sweep.schedule.makespan_s)} ms", str(out / "gantt.png"))
    print(f"wrote {out / 'gantt.png'} and {out / 'schedule.csv'}")
    if not args.run:
        return 0
    from autoddl.scheduling_run import report_run, run_sweep   # imported here: torch.distributed is slow to import

    return report_run(sweep, run_sweep(sweep, timeout_s=args.timeout_s), args.jobs_yaml, args.runs_csv)
