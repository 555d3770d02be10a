"""executor.measure: percentiles, the step timer, peak memory, and the atomic runs table."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from executor import measure
from executor.measure import (RUN_COLUMNS, PeakMemory, StepStats, append_row, percentile, read_rows,
                              Share, job_step_times, steps_for_min_time, time_steps)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 37])
def test_percentile_matches_numpy(n):
    rng = np.random.default_rng(n)
    xs = list(rng.exponential(size=n))
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    s = StepStats.of(xs)
    assert (s.median_s, s.p10_s, s.p90_s, s.steps) == pytest.approx(
        (float(np.median(xs)), float(np.percentile(xs, 10)), float(np.percentile(xs, 90)), n))


def test_step_stats_needs_steps():
    with pytest.raises(ValueError, match="--steps"):
        StepStats.of([])


def test_time_steps_back_to_back_after_one_barrier_and_progress():
    calls, events, seen = [], [], []
    sleeps = [0.0, 0.0, 0.02, 0.01, 0.03]  # 2 warm-up steps, then 3 measured

    def step():
        time.sleep(sleeps[len(calls)])
        calls.append(1)
        events.append("step")

    def progress(kind, i, n, s):
        time.sleep(0.02)                    # a slow progress print is not any step's time
        seen.append((kind, i, n))

    t_before = time.perf_counter()
    share = time_steps(step, 3, 2, barrier=lambda: events.append("b"), sync=lambda: events.append("s"),
                       progress=progress)
    times = share.times_s
    assert len(calls) == 5 and len(times) == 3
    assert t_before + sum(sleeps[:2]) <= share.start_s < t_before + sum(sleeps[:2]) + 0.08   # after the warm-up
    for t, slept in zip(times, sleeps[2:]):
        assert slept <= t < slept + 0.015  # each measured step's own time, warm-up and progress excluded
    # the ranks start together before the warm-up and before the measured steps, leave together after;
    # no barrier between steps (a training loop runs none), a sync after each
    assert events == (["s", "b"] + ["step", "s"] * 2 + ["s", "b"] + ["step", "s"] * 3 + ["b"])
    assert seen == [("warmup", 1, 2), ("warmup", 2, 2), ("step", 1, 3), ("step", 2, 3), ("step", 3, 3)]
    with pytest.raises(ValueError):
        time_steps(step, 0, 1)


def _shares(*ranks):
    """Per rank: (start, times) of each of its shares."""
    return [[Share(start, tuple(times)) for start, times in rank] for rank in ranks]


def test_a_steps_time_is_the_ranks_mean_at_the_pace_the_job_went():
    # ranks kept in step by a collective: the early rank waits in the next step (5 + 15); the job took
    # 30 for 3 steps, as the ranks' means add up to
    kept = _shares([(0.0, [5.0, 15.0, 10.0])], [(0.0, [10.0, 10.0, 10.0])])
    assert job_step_times(kept, one_clock=True) == [7.5, 12.5, 10.0]
    # nothing keeps them in step (no communication): the job took 60, its slowest rank's pace, 20 a
    # step, where a mean over ranks would read 15
    apart = _shares([(0.0, [10.0, 10.0, 10.0])], [(0.0, [20.0, 20.0, 20.0])])
    assert job_step_times(apart, one_clock=True) == [20.0, 20.0, 20.0]
    # two ranks run alone at 10 a step while two wait for a core and leave the barrier 30 later: the
    # job took 60 for 3 steps, 20 a step, not the 10 every rank saw. On one clock the late start counts;
    # each rank on its own clock cannot see it
    late = _shares(*[[(100.0, [10.0, 10.0, 10.0])]] * 2, *[[(130.0, [10.0, 10.0, 10.0])]] * 2)
    assert job_step_times(late, one_clock=True) == [20.0, 20.0, 20.0]
    assert job_step_times(late, one_clock=False) == [10.0, 10.0, 10.0]
    # each share is scaled on its own, from its own barrier
    two = _shares([(0.0, [1.0, 3.0]), (50.0, [3.0])], [(0.0, [3.0, 1.0]), (52.0, [3.0])])
    assert job_step_times(two, one_clock=True) == [2.0, 2.0, 5.0]
    with pytest.raises(ValueError, match="different numbers of steps"):
        job_step_times(_shares([(0.0, [1.0, 2.0])], [(0.0, [1.0])]), one_clock=True)
    with pytest.raises(ValueError, match="different numbers of shares"):
        job_step_times(_shares([(0.0, [1.0])], [(0.0, [1.0]), (5.0, [1.0])]), one_clock=True)


def test_steps_for_min_time_adds_steps_to_a_fast_plan_only():
    # gpt tiny at 11 ms a step: 2 s need ceil(181.8) = 182 steps; the 4-layer GPT at 250 ms keeps its 12
    assert steps_for_min_time(12, 2.0, 0.011) == 182
    assert steps_for_min_time(12, 2.0, 0.25) == 12
    assert steps_for_min_time(12, 2.0, 2.0 / 12) == 12              # exactly enough already
    assert steps_for_min_time(12, 0.0, 0.011) == 12                 # off
    assert steps_for_min_time(12, 2.0, 0.0) == 12                   # no warm-up: no pace to plan by
    with pytest.raises(ValueError, match="steps >= 1"):
        steps_for_min_time(0, 2.0, 0.01)


def test_peak_memory_sees_a_100mb_tensor():
    mem = PeakMemory("cpu")
    mem.start()
    x = torch.ones(25_000_000)  # 100 MB, touched
    del x
    assert 95 <= mem.peak_mb() <= 140
    mem.start()  # a new window: the freed tensor is not counted again
    y = torch.ones(5_000_000)  # 20 MB
    assert 18 <= mem.peak_mb() <= 60
    del y


def test_git_commit(tmp_path):
    assert re.fullmatch(r"[0-9a-f]{4,40}|unknown", measure.git_commit())
    assert measure.git_commit(tmp_path) == "unknown"  # not a repository


def _row(i: int) -> dict:
    return measure.run_row(model="mlp", preset="tiny", cluster="local-cpu", plan=f"p{i}", mesh="2", nproc=2,
                           backend="gloo", predicted={"step_time_s": 0.001 * i, "compute_s": 0.0005},
                           stats=StepStats.of([0.01, 0.02, 0.03]), peak_memory_mb=12.5, commit="abc1234")


def test_append_row_accumulates_rows_with_the_run_columns(tmp_path):
    path = tmp_path / "sub" / "runs.csv"
    for i in range(3):
        append_row(path, _row(i))
    header, rows = read_rows(path)
    assert header == list(RUN_COLUMNS)
    assert [r["plan"] for r in rows] == ["p0", "p1", "p2"]
    r = rows[2]
    assert float(r["predicted_step_s"]) == pytest.approx(0.002) and r["predicted_comm_s"] == ""
    assert float(r["measured_median_s"]) == pytest.approx(0.02)
    assert float(r["measured_p10_s"]) == pytest.approx(0.012) and float(r["measured_p90_s"]) == pytest.approx(0.028)
    assert r["check_max_rel_err"] == "" and r["git_commit"] == "abc1234" and r["peak_memory_mb"] == "12.500"
    # a column the table does not know is kept, earlier rows get it empty
    append_row(path, {**_row(3), "note": "extra"})
    header, rows = read_rows(path)
    assert header[-1] == "note" and [r["note"] for r in rows] == ["", "", "", "extra"]
    assert [p.name for p in path.parent.iterdir()] == ["runs.csv"]  # no temporary file left


def test_append_row_failing_before_replace_keeps_the_table(tmp_path, monkeypatch):
    path = tmp_path / "runs.csv"
    append_row(path, _row(0))
    append_row(path, _row(1))
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk gone between the temporary write and the rename")

    monkeypatch.setattr(measure.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        append_row(path, _row(2))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["runs.csv"]  # the temporary file is removed


WRITER = textwrap.dedent('''
    import os, sys, time
    from executor import measure
    from executor.measure import StepStats

    def stall(src, dst):  # the temporary table is fully written: stall before the rename
        print("written", flush=True)
        time.sleep(60)

    measure.os.replace = stall
    row = measure.run_row(model="mlp", preset="tiny", cluster="c", plan="crashing", mesh="2", nproc=2,
                          backend="gloo", predicted=None, stats=StepStats.of([0.1]), peak_memory_mb=1.0,
                          commit="x")
    measure.append_row(sys.argv[1], row)
''')


def test_append_row_killed_mid_write_keeps_every_earlier_row(tmp_path):
    path = tmp_path / "runs.csv"
    for i in range(3):
        append_row(path, _row(i))
    before = path.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        temps = [p for p in tmp_path.iterdir() if p.name != "runs.csv"]
        assert len(temps) == 1 and "crashing" in temps[0].read_text()  # the new table, not yet in place
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert path.read_bytes() == before
    with open(path, newline="") as f:
        assert [r["plan"] for r in csv.DictReader(f)] == ["p0", "p1", "p2"]
    append_row(path, _row(3))  # the leftover temporary file does not get in the way
    assert [r["plan"] for r in read_rows(path)[1]] == ["p0", "p1", "p2", "p3"]
