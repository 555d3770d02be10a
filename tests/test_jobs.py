"""JOBS.yaml: the schema of autoddl/jobs.py and its errors (file, job, field, what to do)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoddl.jobs import JobSpec, JobsFileError, load_jobs

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "m.py").write_text("def build_model():\n    pass\n")
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    return path


def test_the_bundled_sweep_loads_with_paths_relative_to_the_file():
    jobs = load_jobs(ROOT / "examples" / "sweep.yaml")
    assert [j.name for j in jobs] == ["gpt-w64-l2", "gpt-w128-l2", "gpt-w64-l4", "gpt-w96-l3"]
    assert all(j.model == str(ROOT / "examples" / "gpt.py") for j in jobs)
    assert jobs[1].args == {"preset": "tiny", "n_embd": 128} and jobs[2].lr == 0.02 and jobs[3].seed == 1
    assert {j.steps for j in jobs} == {4} and {j.shards for j in jobs} == {2}


def test_defaults(tmp_path):
    (job,) = load_jobs(_write(tmp_path, "jobs:\n  - {model: m.py, steps: 3}\n"))
    assert job == JobSpec("m-0", str(tmp_path / "m.py"), 3, {}, 0.01, 0, None)


@pytest.mark.parametrize("text, message", [
    ("jobs: []\n", "non-empty list 'jobs:'"),
    ("jobs:\n  - {model: m.py, steps: 3}\nextra: 1\n", "unknown top-level key(s) ['extra']"),
    ("jobs:\n  - {model: m.py}\n", "jobs[0]: missing field(s) ['steps']"),
    ("jobs:\n  - {name: a, model: m.py, steps: 0}\n", "jobs[0] ('a'): field 'steps': expected a positive integer"),
    ("jobs:\n  - {name: a, model: nope.py, steps: 1}\n", "jobs[0] ('a'): field 'model': 'nope.py' is not a file"),
    ("jobs:\n  - {model: m.py, steps: 1, lr: -1}\n", "field 'lr': expected a positive learning rate, got -1"),
    ("jobs:\n  - {model: m.py, steps: 1, shards: 1.5}\n", "field 'shards': expected a positive integer"),
    ("jobs:\n  - {model: m.py, steps: 1, args: [1]}\n", "field 'args': expected a mapping"),
    ("jobs:\n  - {model: m.py, steps: 1, epochs: 2}\n", "unknown field(s) ['epochs']"),
    ("jobs:\n  - {name: a, model: m.py, steps: 1}\n  - {name: a, model: m.py, steps: 2}\n",
     "jobs[1] and jobs[0] are both named 'a'"),
    ("jobs: [\n", "not valid YAML"),
])
def test_bad_files_name_the_file_job_and_field(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(JobsFileError) as info:
        load_jobs(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_a_missing_file_says_what_to_write(tmp_path):
    with pytest.raises(JobsFileError, match="no such jobs file; write one as in examples/sweep.yaml"):
        load_jobs(tmp_path / "none.yaml")


def test_per_job_settings_and_what_the_run_refuses(tmp_path):
    (tmp_path / "best.json").write_text("{}")
    (job,) = load_jobs(_write(tmp_path, "jobs:\n  - {name: a, model: m.py, steps: 3, spill: host, precision: bf16,"
                                        " recompute: full, optimizer: adamw, plan: best.json}\n"))
    assert (job.spill, job.precision, job.recompute, job.optimizer) == ("host", "bf16", "full", "adamw")
    assert job.plan == str(tmp_path / "best.json")
    assert job.unrunnable() == ["precision: bf16", "recompute: full", "optimizer: adamw"]
    (plain,) = load_jobs(_write(tmp_path, "jobs:\n  - {model: m.py, steps: 3}\n"))
    assert (plain.spill, plain.precision, plain.recompute, plain.optimizer, plain.plan) == (
        "none", "fp32", "none", "sgd", None) and plain.unrunnable() == []


@pytest.mark.parametrize("field, value, message", [
    ("spill", "disk", "field 'spill': expected none or host or auto, got 'disk'"),
    ("precision", "fp16", "field 'precision': expected fp32 or bf16, got 'fp16'"),
    ("recompute", "selective", "field 'recompute': expected none or full, got 'selective'"),
    ("optimizer", "adam", "field 'optimizer': expected sgd or adamw, got 'adam'"),
    ("plan", "nope.json", "field 'plan': 'nope.json' is not a file"),
])
def test_bad_settings_name_the_file_job_and_field(tmp_path, field, value, message):
    path = _write(tmp_path, f"jobs:\n  - {{name: a, model: m.py, steps: 1, {field}: {value}}}\n")
    with pytest.raises(JobsFileError) as info:
        load_jobs(path)
    assert f"{path}: jobs[0] ('a'): {message}" in str(info.value)
