"""``autoddl schedule``: the bundled spilled sweep planned and run on 2 gloo ranks (the issue's command),
a job's own plan priced instead of searched, and bad jobs files reported in one line."""

from __future__ import annotations

import csv
from pathlib import Path

from autoddl.cli import main
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
SWEEP = str(ROOT / "examples" / "sweep_spill.yaml")      # examples/sweep.yaml's jobs, three of them spilled
LOCAL = str(CPU_CLUSTER_PATH)


def test_the_bundled_spilled_sweep_schedules_and_runs_on_two_ranks_as_each_job_alone(tmp_path, capsys):
    runs = tmp_path / "runs.csv"
    rc = main(["schedule", SWEEP, "--cluster", LOCAL, "--devices", "2", "--steps", "2", "--out", str(tmp_path),
               "--run", "--runs-csv", str(runs)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "sharded-LRTF" in out and "sequential" in out and "one_per_device" in out
    assert "(each rank's task order = the schedule's)" in out and "-> OK" in out
    # run_sweep fails unless each task copied the schedule's bytes
    assert "host copies of spilled shards: " in out and "host copies (as the schedule's): " in out
    assert (tmp_path / "gantt.png").stat().st_size > 10_000
    assert "peak device memory (shards, gradients, saved activations): dev0 " in out and " of 6.32 GB" in out
    tasks = list(csv.DictReader((tmp_path / "schedule.csv").open()))
    assert len(tasks) == 4 * 2 * 2 * 2                       # 4 jobs x 2 steps x 2 shards x (F, B)
    loads = {t["job"]: 0 for t in tasks}
    for t in tasks:
        loads[t["job"]] += int(t["load_bytes"])
    # three jobs spill: host; gpt-w96-l3 (spill: auto) fits one device and the four fit the two devices
    assert sorted(job for job, n in loads.items() if n) == ["gpt-w128-l2", "gpt-w64-l2", "gpt-w64-l4"]
    for device in ("0", "1"):                                # a device runs one task at a time
        spans = sorted((float(t["start_s"]), float(t["end_s"])) for t in tasks if t["device"] == device)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    (row,) = list(csv.DictReader(runs.open()))
    predicted = max(max(float(t["end_s"]), float(t["writeback_end_s"])) for t in tasks)   # the last write-back too
    assert float(row["predicted_makespan_s"]) == float(f"{predicted:.6g}")
    assert float(row["measured_makespan_s"]) > 0 and float(row["loss_max_rel_error"]) <= 1e-5
    assert row["devices"] == "2" and row["jobs"] == "4"


def test_a_bad_jobs_file_is_one_line_naming_the_job_and_field(tmp_path, capsys):
    bad = tmp_path / "jobs.yaml"
    bad.write_text(f"jobs:\n  - {{name: a, model: {ROOT / 'examples' / 'gpt.py'}, steps: -2}}\n")
    assert main(["schedule", str(bad), "--cluster", LOCAL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoddl: error: ") and "jobs[0] ('a'): field 'steps'" in err


def test_run_refuses_settings_it_does_not_execute_naming_the_file_job_and_field(tmp_path, capsys):
    bad = tmp_path / "jobs.yaml"
    bad.write_text(f"jobs:\n  - {{name: a, model: {ROOT / 'examples' / 'gpt.py'}, steps: 1, precision: bf16}}\n")
    assert main(["schedule", str(bad), "--cluster", LOCAL, "--run"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: jobs[0] ('a'): precision: bf16: --run executes only precision: fp32" in err


def test_a_spilled_job_with_its_own_plan_is_priced_with_that_plan(tmp_path):
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from autoddl.training import Training
    from costmodel.breakdown import plan_cost
    from autoddl.scheduling import plan_sweep
    from search.planner import inner_tp_plan

    cluster = Cluster.from_yaml(LOCAL)
    graph = load_model_file(ROOT / "examples" / "gpt.py", preset="tiny").trace()
    plan = inner_tp_plan(graph, cluster.resized(1), 1, Training(), "sgd")     # the job's own plan, not searched
    plan.save(tmp_path / "own.json")
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"jobs:\n  - {{name: a, model: {ROOT / 'examples' / 'gpt.py'}, args: {{preset: tiny}}, steps: 2, "
                    "shards: 2, spill: host, plan: own.json}\n")
    sweep = plan_sweep(jobs, cluster, devices=2, progress=lambda _: None)
    assert sweep.best_step_s == [plan_cost(graph, plan, cluster.resized(2)).step_time_s]
    assert sweep.jobs[0].spill and sum(t.load_bytes for t in sweep.schedule.tasks) > 0
    # every shard written back once a step (the bundled sweep's test runs spilled jobs on gloo ranks)
    assert sum(t.writeback_bytes for t in sweep.schedule.tasks) == 2 * sum(sweep.jobs[0].param_bytes)
    # the job alone runs on device 0 (free devices choose in order); the most it holds is B1 with both
    # shards' activations, its shard and gradient, or B0 with shard 0's activations, shard and gradient
    # (shard 1's write-back is over before B0 starts: shard 0, with the embeddings, loads longer)
    job = sweep.jobs[0]
    (p0, p1), (a0, a1) = job.param_bytes, job.activation_bytes
    assert {t.device for t in sweep.schedule.tasks} == {0} and p0 > p1
    assert sweep.schedule.peak_memory_bytes() == [max(a0 + a1 + 2 * p1, a0 + 2 * p0), 0]


def test_spill_auto_spills_a_job_that_does_not_fit_one_device_or_a_sweep_that_does_not_fit_the_devices():
    import dataclasses

    from autoddl.cluster import Cluster
    from autoddl.jobs import JobSpec
    from autoddl.scheduling import spilled
    from search.shards import SoloCost

    cluster = Cluster.from_yaml(LOCAL).resized(2)
    memory = cluster.device.memory_gb * 1e9
    spec = JobSpec("a", "m.py", 1)
    specs = [dataclasses.replace(spec, spill=s) for s in ("none", "host", "auto")]
    small = SoloCost(1.0, int(0.1 * memory), True)
    assert spilled(specs, [small] * 3, cluster) == [False, True, False]
    big = SoloCost(1.0, int(1.2 * memory), False)                   # alone, it does not fit one device
    assert spilled(specs, [small, small, big], cluster) == [False, True, True]
    crowded = SoloCost(1.0, int(0.9 * memory), True)                # 3 x 0.9 of a device > 2 devices
    assert spilled(specs, [crowded] * 3, cluster) == [False, True, True]
