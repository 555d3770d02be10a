"""``autoddl schedule``: the bundled sweep planned and run on 2 gloo ranks (the issue's command), and a
bad jobs file reported in one line."""

from __future__ import annotations

import csv
from pathlib import Path

from autoddl.cli import main

ROOT = Path(__file__).resolve().parents[1]
SWEEP = str(ROOT / "examples" / "sweep.yaml")
LOCAL = str(ROOT / "configs" / "local-cpu.yaml")


def test_the_bundled_sweep_schedules_and_runs_on_two_ranks_as_each_job_alone(tmp_path, capsys):
    runs = tmp_path / "runs.csv"
    rc = main(["schedule", SWEEP, "--cluster", LOCAL, "--devices", "2", "--steps", "2", "--out", str(tmp_path),
               "--run", "--runs-csv", str(runs)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "sharded-LRTF" in out and "sequential" in out and "one_per_device" in out
    assert "(each rank's task order = the schedule's)" in out and "-> OK" in out
    assert (tmp_path / "gantt.png").stat().st_size > 10_000
    tasks = list(csv.DictReader((tmp_path / "schedule.csv").open()))
    assert len(tasks) == 4 * 2 * 2 * 2                       # 4 jobs x 2 steps x 2 shards x (F, B)
    for device in ("0", "1"):                                # a device runs one task at a time
        spans = sorted((float(t["start_s"]), float(t["end_s"])) for t in tasks if t["device"] == device)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    (row,) = list(csv.DictReader(runs.open()))
    predicted = max(float(t["end_s"]) for t in tasks)
    assert float(row["predicted_makespan_s"]) == float(f"{predicted:.6g}")
    assert float(row["measured_makespan_s"]) > 0 and float(row["loss_max_rel_error"]) <= 1e-5
    assert row["devices"] == "2" and row["jobs"] == "4"


def test_a_bad_jobs_file_is_one_line_naming_the_job_and_field(tmp_path, capsys):
    bad = tmp_path / "jobs.yaml"
    bad.write_text(f"jobs:\n  - {{name: a, model: {ROOT / 'examples' / 'gpt.py'}, steps: -2}}\n")
    assert main(["schedule", str(bad), "--cluster", LOCAL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoddl: error: ") and "jobs[0] ('a'): field 'steps'" in err
