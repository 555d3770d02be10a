"""JOBS.yaml: the models of a sweep to train on one cluster (``autoddl schedule``).

::

    jobs:
      - name: gpt-w64            # unique; default: the model file's stem and the job's index
        model: gpt.py            # model file, relative to this YAML file (or absolute)
        args: {preset: tiny}     # keywords for build_model() / example_inputs() (as --preset / --set)
        steps: 4                 # optimizer steps to train
        lr: 0.01                 # SGD learning rate (default 0.01)
        seed: 0                  # torch.manual_seed before build_model() and example_inputs() (default 0)
        shards: 2                # shards to cut the model into (default: the fewest that fit a device)
        spill: none              # none | host | auto: where the shards live between their tasks (below)
        precision: fp32          # fp32 | bf16: compute dtype the shards are priced with
        recompute: none          # none | full: activation recompute per repeated block, for pricing
        optimizer: sgd           # sgd | adamw: the optimizer the shards' updates are priced with
        plan: best.json          # the job's own plan (autoddl plan -o) for the one-model-at-a-time
                                 # baseline, priced with the cost model instead of searched

``spill: host`` keeps every shard's parameters in host memory (Hydra's spilling): a shard is
loaded over the host link before each of its tasks (not when the device's previous task was the
same shard), with its optimizer states before its backward, and both are written back after it;
``auto`` spills the job only when it does not fit one device alone or the sweep's jobs do not all
fit the devices at once. ``autoddl schedule --run``
runs fp32, no recompute and SGD only, and refuses the others naming the job and field; it runs
``spill`` and ignores ``plan`` (a baseline's price).

Every error names the file, the job (index and name) and the field, says what was wrong and what
is expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FIELDS = ("name", "model", "args", "steps", "lr", "seed", "shards", "spill", "precision", "recompute", "optimizer",
          "plan")
CHOICES = {"spill": ("none", "host", "auto"), "precision": ("fp32", "bf16"), "recompute": ("none", "full"),
           "optimizer": ("sgd", "adamw")}
RUNNABLE = {"precision": "fp32", "recompute": "none", "optimizer": "sgd"}     # what --run executes
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
REQUIRED = ("model", "steps")


@dataclass(frozen=True)
class JobSpec:
    """One model of the sweep (module docstring); ``model`` is an absolute path."""

    name: str
    model: str
    steps: int
    args: dict[str, Any] = field(default_factory=dict, hash=False)
    lr: float = 0.01
    seed: int = 0
    shards: int | None = None
    spill: str = "none"
    precision: str = "fp32"
    recompute: str = "none"
    optimizer: str = "sgd"
    plan: str | None = None           # absolute path of the job's own plan JSON

    def unrunnable(self) -> list[str]:
        """``field: value`` of each setting ``autoddl schedule --run`` does not execute (``RUNNABLE``)."""
        return [f"{k}: {getattr(self, k)}" for k, v in RUNNABLE.items() if getattr(self, k) != v]


class JobsFileError(ValueError):
    """JOBS.yaml is missing, not YAML, or a job's field is wrong."""


def load_jobs(path: str | Path) -> list[JobSpec]:
    """The jobs of ``path`` in file order, checked (module docstring)."""
    src = Path(path)
    try:
        data = yaml.safe_load(src.read_text())
    except FileNotFoundError:
        raise JobsFileError(f"{src}: no such jobs file; write one as in examples/sweep.yaml") from None
    except yaml.YAMLError as exc:
        raise JobsFileError(f"{src}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or not data["jobs"]:
        raise JobsFileError(f"{src}: expected a mapping with a non-empty list 'jobs:' of jobs "
                            "(each with at least 'model' and 'steps'), as in examples/sweep.yaml")
    extra = sorted(set(data) - {"jobs"})
    if extra:
        raise JobsFileError(f"{src}: unknown top-level key(s) {extra}; the file holds only 'jobs:'")
    jobs = [_job(src, i, raw) for i, raw in enumerate(data["jobs"])]
    seen: dict[str, int] = {}
    for i, job in enumerate(jobs):
        if job.name in seen:
            raise JobsFileError(f"{src}: jobs[{i}] and jobs[{seen[job.name]}] are both named {job.name!r}; "
                                "give each job a unique 'name'")
        seen[job.name] = i
    return jobs


def _job(src: Path, index: int, raw: Any) -> JobSpec:
    where = f"{src}: jobs[{index}]"
    if not isinstance(raw, dict):
        raise JobsFileError(f"{where}: expected a mapping with 'model' and 'steps', got {type(raw).__name__}")
    if isinstance(raw.get("name"), str):
        where += f" ({raw['name']!r})"
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise JobsFileError(f"{where}: unknown field(s) {unknown}; a job has {', '.join(FIELDS)}")
    missing = [f for f in REQUIRED if f not in raw]
    if missing:
        raise JobsFileError(f"{where}: missing field(s) {missing}; e.g. model: gpt.py, steps: 4")

    def bad(name: str, expected: str) -> JobsFileError:
        return JobsFileError(f"{where}: field '{name}': expected {expected}, got {raw[name]!r}")

    model = raw["model"]
    if not isinstance(model, str) or not model:
        raise bad("model", "the path of a model file (relative to this YAML file)")
    model_path = (src.parent / model).resolve() if not Path(model).is_absolute() else Path(model)
    if not model_path.is_file():
        raise JobsFileError(f"{where}: field 'model': {model!r} is not a file (looked for {model_path}); paths "
                            "are relative to the jobs file")
    if not _positive_int(raw["steps"]):
        raise bad("steps", "a positive integer number of optimizer steps")
    args = raw.get("args", {})
    if not isinstance(args, dict) or not all(isinstance(k, str) and k.isidentifier() for k in args):
        raise bad("args", "a mapping of keyword arguments for build_model(), e.g. {preset: tiny, n_layer: 2}")
    lr = raw.get("lr", 0.01)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
        raise bad("lr", "a positive learning rate")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise bad("seed", "a non-negative integer")
    shards = raw.get("shards")
    if shards is not None and not _positive_int(shards):
        raise bad("shards", "a positive integer (or leave it out: the fewest shards that fit a device)")
    name = raw.get("name", f"{model_path.stem}-{index}")
    if not isinstance(name, str) or not name or any(c.isspace() or c == "," for c in name):
        raise bad("name", "a non-empty name without spaces or commas")
    settings = {}
    for key, choices in CHOICES.items():
        settings[key] = raw.get(key, choices[0])
        if settings[key] not in choices:
            raise bad(key, " or ".join(choices))
    plan = raw.get("plan")
    if plan is not None:
        plan_path = src.parent / plan if isinstance(plan, str) and plan else None
        if plan_path is None or not plan_path.is_file():
            raise JobsFileError(f"{where}: field 'plan': {plan!r} is not a file (looked for {plan_path}); give the "
                                "path of the job's plan JSON (autoddl plan -o), relative to the jobs file")
        plan = str(plan_path.resolve())
    return JobSpec(name, str(model_path), int(raw["steps"]), dict(args), float(lr), seed, shards, plan=plan,
                   **settings)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
