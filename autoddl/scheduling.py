"""Plan a sweep of models on one cluster (``autoddl schedule``): shards, the schedule, the baselines.

For each job of JOBS.yaml: trace its model file (meta device, the job's arguments), cut it into
shards priced on one device with its precision, recompute and optimizer (search/shards.py), and
search its best plan on all the devices (the planner; or price the job's own ``plan:`` with the
cost model; baseline (a)). A job with ``spill: host`` (or ``auto`` when it does not fit one device
alone, or the sweep's jobs together do not fit the devices) keeps its shards in host memory, each
copy priced by ``costmodel.host.host_copy_time_s`` (search/shard_schedule.py). Then sharded-LRTF
schedules every shard task within each device's memory (search/shard_schedule.py; what a device
holds: autoddl/shard_memory.py), with and without prefetch, and the shorter is
kept (the lookahead of prefetch can cost more than the transfers it hides). Baselines: (a)
``sequential``, each job alone on all devices with its own best plan; (b) ``one_per_device``, each
job alone on one device when it fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.jobs import DTYPES, JobsFileError, JobSpec, load_jobs
from autoddl.loader import ModelFile, load_model_file
from autoddl.plan import Plan
from autoddl.shard_program import ShardedJob
from autoddl.training import Training
from costmodel.breakdown import plan_cost
from costmodel.host import host_copy_time_s
from search.planner import resolve_cluster, search
from search.shard_schedule import BaselineResult, Schedule, lrtf_schedule, one_per_device, sequential
from search.shards import SoloCost, shard_job, transfer_fn

CSV_COLUMNS = ["job", "device", "kind", "shard", "step", "start_s", "end_s", "transfer_s", "load_bytes",
               "load_start_s", "load_end_s", "writeback_bytes", "writeback_start_s", "writeback_end_s",
               "device_peak_bytes"]


@dataclass
class SweepPlan:
    specs: list[JobSpec]
    jobs: list[ShardedJob]
    solo_one: list[SoloCost]             # each job alone on one device
    best_step_s: list[float]             # each job's found plan on all the devices, one step
    best_mesh: list[str]
    schedule: Schedule                   # the kept sharded-LRTF schedule
    prefetch: bool                       # whether the kept one prefetches
    other_makespan_s: float              # the makespan of the other one
    sequential: BaselineResult
    one_per_device: BaselineResult
    cluster: Cluster

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]


def load_job_model(spec: JobSpec, device: str = "meta") -> ModelFile:
    """The job's model file with its arguments, built after ``torch.manual_seed(spec.seed)``."""
    torch.manual_seed(spec.seed)
    return load_model_file(spec.model, device=device, **spec.args)


def job_training(spec: JobSpec) -> Training:
    """The job's precision and recompute as the cost model's training settings."""
    return Training(param_dtype=DTYPES[spec.precision], recompute=spec.recompute)


def spilled(specs: list[JobSpec], solo: list[SoloCost], cluster: Cluster) -> list[bool]:
    """Per job, whether its shards live in host memory: ``host``; ``auto`` when it does not fit one
    device alone or the jobs alone on one device do not fit all the devices' memory at once."""
    crowded = sum(o.memory_bytes for o in solo) > cluster.num_devices * cluster.device.memory_gb * 1e9
    return [s.spill == "host" or (s.spill == "auto" and (crowded or not o.fits)) for s, o in zip(specs, solo)]


def own_plan_step(jobs_path: str | Path, index: int, spec: JobSpec, graph: OpGraph, cluster: Cluster
                  ) -> tuple[float, str]:
    """The step time and mesh of the job's ``plan:`` file on ``cluster``, priced by the cost model."""
    try:
        plan = Plan.load(spec.plan)
        return plan_cost(graph, plan, cluster).step_time_s, str(plan.mesh)
    except (ValueError, KeyError, OSError) as exc:
        raise JobsFileError(f"{jobs_path}: jobs[{index}] ({spec.name!r}): field 'plan': {spec.plan} cannot be priced "
                            f"for this job on {cluster.name} ({exc}); give a plan made for this model and cluster "
                            "(autoddl plan -o) or leave 'plan' out to search one") from None


def plan_sweep(jobs_path: str | Path, cluster: Cluster, devices: int | None = None, steps: int | None = None,
               progress=print, best_plans: dict | None = None) -> SweepPlan:
    """Everything ``autoddl schedule`` prints (module docstring); ``steps`` overrides every job's.
    ``best_plans``: a dict kept between calls, (model, arguments, settings, cluster) -> the best plan's
    step and mesh, so that sweeps of the same models on the same cluster search each model once."""
    best_plans = {} if best_plans is None else best_plans
    specs = load_jobs(jobs_path)
    if steps is not None:
        specs = [dataclasses.replace(s, steps=steps) for s in specs]
    cluster = resolve_cluster(cluster, devices)
    n = cluster.num_devices
    jobs, solo, best, meshes = [], [], [], []
    for i, spec in enumerate(specs):
        graph = load_job_model(spec).trace()
        job, one = shard_job(spec.name, graph, cluster, spec.steps, spec.shards, spec.optimizer, job_training(spec),
                             spill=spec.spill != "none")
        key = (spec.model, repr(sorted(spec.args.items())), spec.precision, spec.recompute, spec.optimizer,
               spec.plan, cluster.name)
        if key not in best_plans and spec.plan:
            best_plans[key] = own_plan_step(jobs_path, i, spec, graph, cluster)
        elif key not in best_plans:
            outcome = search(graph, cluster, model_name=graph.model_name, optimizer=spec.optimizer,
                             training=job_training(spec))
            best_plans[key] = (outcome.found_breakdown.step_time_s, str(outcome.found.mesh))
        jobs.append(job), solo.append(one)
        best.append(best_plans[key][0]), meshes.append(best_plans[key][1])
        progress(f"{spec.name}: {job.shards} shards, {job.step_s * 1e3:.2f} ms a step on one device, "
                 f"{best[-1] * 1e3:.2f} ms with {'its plan' if spec.plan else 'its best plan'} on {n} ({meshes[-1]})")
    jobs = [dataclasses.replace(j, spill=True) if s else j for j, s in zip(jobs, spilled(specs, solo, cluster))]
    for job in jobs:
        if job.spill:
            cluster.require_host(f"job {job.name!r}'s shards in host memory (spill in {jobs_path})")
    move, memory = transfer_fn(cluster), cluster.device.memory_gb * 1e9
    with_prefetch = lrtf_schedule(jobs, n, move, prefetch=True, host_copy_s=lambda b: host_copy_time_s(b, cluster),
                                  memory_bytes=memory)
    without = lrtf_schedule(jobs, n, move, prefetch=False, host_copy_s=lambda b: host_copy_time_s(b, cluster),
                            memory_bytes=memory)
    kept, other = (with_prefetch, without) if with_prefetch.makespan_s <= without.makespan_s else \
        (without, with_prefetch)
    return SweepPlan(specs, jobs, solo, best, meshes, kept, kept is with_prefetch, other.makespan_s,
                     sequential([b * s.steps for b, s in zip(best, specs)]),
                     one_per_device([o.step_s * s.steps for o, s in zip(solo, specs)], [o.fits for o in solo], n,
                                    [s.name for s in specs]), cluster)


def job_rows(sweep: SweepPlan) -> list[dict[str, Any]]:
    """One row per job: steps, shards, solo times and its finish time under each schedule (seconds)."""
    lrtf = sweep.schedule.finish_s()
    rows = []
    for j, spec in enumerate(sweep.specs):
        rows.append({"job": spec.name, "steps": spec.steps, "shards": sweep.jobs[j].shards,
                     "spilled": sweep.jobs[j].spill,
                     "solo_one_device_s": sweep.solo_one[j].step_s * spec.steps,
                     "solo_best_plan_s": sweep.best_step_s[j] * spec.steps,
                     "finish_lrtf_s": lrtf[j],
                     "finish_sequential_s": sweep.sequential.finish_s[j],
                     "finish_one_per_device_s": (sweep.one_per_device.finish_s[j]
                                                 if sweep.one_per_device.finish_s is not None else None)})
    return rows


def task_rows(schedule: Schedule, names: list[str]) -> list[dict[str, Any]]:
    """The schedule as CSV rows (``CSV_COLUMNS``), in placement order; ``device_peak_bytes``: the most
    its device holds while it runs (autoddl/shard_memory.py)."""
    memory = schedule.memory()
    return [{"job": names[t.job], "device": t.device, "kind": t.key.kind, "shard": t.key.shard, "step": t.key.step,
             "start_s": f"{t.start_s:.9f}", "end_s": f"{t.end_s:.9f}", "transfer_s": f"{t.transfer_s:.9f}",
             "load_bytes": t.load_bytes, "load_start_s": f"{t.load_start_s:.9f}", "load_end_s": f"{t.load_end_s:.9f}",
             "writeback_bytes": t.writeback_bytes, "writeback_start_s": f"{t.writeback_start_s:.9f}",
             "writeback_end_s": f"{t.writeback_end_s:.9f}",
             "device_peak_bytes": memory.peak_bytes(t.device, t.start_s, t.end_s)}
            for t in schedule.tasks]
