"""Fidelity study: the cost model's predicted step time against the executor's measured one.

For each example model at a small preset (batch sizes raised so that a step holds a few
ms of real compute, not only fixed costs), on 2 and 4 gloo ranks and a 2x2 mesh of the
calibrated ``configs/local-cpu.yaml``, and for gpt and llama tiny under issue 10's training
setting (``*-bf16-sel-4mb``: bf16 compute, selective recompute, 4 micro-steps of 4 samples per
step) on 2 ranks and 2x2, every applicable baseline and the found plan are
planned in-process (``autoddl.api.search_model``), then run by the executor: one torchrun
launch per (model, rank count) runs all its plans in turn (``executor.worker --plans``),
W warm-up steps each, then S measured steps (more where S take under ``--min-time-s``, 2 s by
default, at the plan's warm-up pace) in R rounds (each plan's share in turn, so that the
machine's drift over a launch falls on every plan alike), 1 intra-op thread per rank. Each plan's row (the
runs-table columns of ``executor.measure`` plus the study's) is appended atomically to
``results/fidelity.csv``; then, over the latest study in the CSV:

- MAPE per model: mean of |predicted - measured median| / measured median;
- Spearman rank correlation, per (model, mesh), of predicted vs measured step time over the
  schemes (per model: the mean over its meshes, and the smallest);
- whether the found plan was measured fastest: ``fastest`` (its median the smallest),
  ``tied`` (slower median, but its p10..p90 overlaps the best baseline's: within noise),
  ``slower`` (no overlap);

a Markdown table (``results/fidelity_summary.md``, ready for results/README.md) and
``results/fidelity.png`` (log-log, y = x, one colour per model, one marker per mesh).

    python benchmarks/fidelity.py                         # the whole study (~10-20 min on 2 cores)
    python benchmarks/fidelity.py --models mlp --configs 2 # a part of it
    python benchmarks/fidelity.py --analyze-only           # tables and plot from the CSV

4 ranks on a 2-core machine share cores (2 ranks per core): their compute and collectives
contend, which the calibration (2 ranks) does not see. The machine is shared: before each launch
the study waits until other work keeps at most ``--max-busy`` of the CPU busy (over 3 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS: dict[str, dict[str, Any]] = {       # model -> build_model / example_inputs keywords
    "gpt": {"preset": "tiny", "batch_size": 16},
    # compute-bound: one process needs > 100 ms a step here (benchmarks/executor_bench.py case (b))
    "gpt-4x256": {"preset": "tiny", "n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 128, "seq_len": 128,
                  "batch_size": 8},
    "llama": {"preset": "tiny", "batch_size": 16},
    "mlp": {"preset": "tiny", "width": 512, "batch_size": 64},
    "vgg": {"preset": "tiny", "batch_size": 32},
    "resnet": {"preset": "tiny", "batch_size": 32},
}
# Issue 10's training setting on CPU: bf16 compute with float32 masters, selective recompute of every
# block, 4 micro-steps of TRAINED_MICRO_BATCH samples (all data-parallel ranks together) per optimizer
# step, so one step's batch is the batch_size below, as in the float32 rows; on 2 ranks and 2x2.
TRAINED_MICRO_BATCH = 4
TRAINED = {"param_dtype": "bfloat16", "recompute": "selective", "micro_batches": 4}
MODELS.update({
    "gpt-bf16-sel-4mb": {"preset": "tiny", "batch_size": 16},
    "llama-bf16-sel-4mb": {"preset": "tiny", "batch_size": 16},
})
TRAINING: dict[str, dict[str, Any]] = {m: TRAINED for m in MODELS if m.endswith("-bf16-sel-4mb")}
CONFIGS: dict[str, tuple[int, ...]] = {"2": (2,), "4": (4,), "2x2": (2, 2)}
# how executor.measure.time_steps timed a step: studies before 20261127-063614 ran a barrier after every step
# ("barrier per step", empty in their rows), which neither a training loop nor the step program has;
# studies up to 20261127-101337 took a step's time as the ranks' mean ("back to back"), since then as
# that mean at the pace the job went, first start to last end (executor.measure.job_step_times)
STEP_TIMING = "back to back, job's pace"
# each plan's measured steps last at least this long (executor.measure.steps_for_min_time): studies up
# to 20261128-182018 ran 12 steps whatever their length, 0.13 s of gpt tiny (their rows' steps column)
MIN_TIME_S = 2.0
MODEL_CONFIGS: dict[str, tuple[str, ...]] = {m: ("2", "2x2") for m in TRAINING}   # default: every config
STUDY_COLUMNS = ("study", "scheme", "config", "same_as", "steps", "warmup", "omp_threads", "load_avg_1m", "error",
                 "rounds", "step_timing")


# -- the figures (pure; tests/test_fidelity.py) -------------------------------------------------
def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, |p - m| / m averaged, as a fraction (0.15 = 15%)."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError(f"mape: need equally many predictions and measurements, got {len(predicted)} / "
                         f"{len(measured)}")
    if any(m <= 0 for m in measured):
        raise ValueError(f"mape: measured times must be positive, got {list(measured)}")
    return statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured))


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson's r of the tie-averaged ranks); nan for fewer than 2
    points or when either side is constant (no order to compare)."""
    if len(predicted) != len(measured):
        raise ValueError(f"spearman: {len(predicted)} predictions vs {len(measured)} measurements")
    if len(predicted) < 2:
        return math.nan
    rp, rm = _ranks(predicted), _ranks(measured)
    mp, mm = statistics.fmean(rp), statistics.fmean(rm)
    cov = sum((a - mp) * (b - mm) for a, b in zip(rp, rm))
    var = math.sqrt(sum((a - mp) ** 2 for a in rp) * sum((b - mm) ** 2 for b in rm))
    return cov / var if var > 0 else math.nan


def found_verdict(rows: Iterable[dict[str, Any]]) -> tuple[str, str]:
    """(verdict, best baseline) for one (model, mesh): rows hold scheme, median, p10, p90 (seconds).

    ``fastest``: the found plan's median is the smallest; ``tied``: a baseline's median is smaller
    but the two p10..p90 ranges overlap (within noise); ``slower``: they do not overlap.
    """
    rows = list(rows)
    found = [r for r in rows if r["scheme"] == "found"]
    base = [r for r in rows if r["scheme"] != "found"]
    if not found:
        raise ValueError("found_verdict: no row with scheme 'found'")
    if not base:
        return "fastest", ""
    f = found[0]
    best = min(base, key=lambda r: r["median"])
    if f["median"] <= best["median"]:
        return "fastest", best["scheme"]
    if f["p10"] <= best["p90"]:
        return "tied", best["scheme"]
    return "slower", best["scheme"]


# -- planning and running ---------------------------------------------------------------------
def training_of(model: str) -> Any:
    """The study model's Training (the default one for the float32 rows)."""
    from autoddl.training import Training

    return Training(**TRAINING.get(model, {}))


def model_file(model: str) -> Path:
    """``examples/<file>.py`` of a study model: its name up to the first ``-`` (``gpt-4x256`` -> gpt)."""
    return ROOT / "examples" / f"{model.split('-')[0]}.py"


def plan_all(model: str, kwargs: dict[str, Any], configs: Sequence[str], cluster_path: Path,
             plan_dir: Path) -> list[dict[str, Any]]:
    """Every applicable baseline and the found plan per config, saved to ``plan_dir``; one dict each
    (with the traced graph its plan was priced on).

    Under a training setting with micro-steps (TRAINING) the model is traced at the micro-step batch
    TRAINED_MICRO_BATCH under its precision, and each plan records that batch (``plan.batch_size``):
    the worker then runs ``plan.batch_size x micro_batches`` samples per step (autoddl plan's
    ``--micro-batch-size`` / ``--global-batch-size`` do the same)."""
    from autoddl.api import search_model
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file

    model_py = model_file(model)
    training = training_of(model)
    mf = load_model_file(model_py, **kwargs)
    batch = TRAINED_MICRO_BATCH if training.micro_batches > 1 else None
    if batch is not None and batch * training.micro_batches != mf.batch_size:
        raise SystemExit(f"{model}: {training.micro_batches} micro-steps of {batch} samples are not the "
                         f"model's batch {mf.batch_size}")
    graph = (mf.with_batch_size(batch) if batch else mf).trace(training.param_dtype)
    cluster = Cluster.from_yaml(cluster_path)
    out = []
    for config in configs:
        if config not in MODEL_CONFIGS.get(model, tuple(CONFIGS)):
            continue
        shape = CONFIGS[config]
        outcome = search_model(graph, cluster, devices=math.prod(shape), mesh=shape, training=training)
        plans = {s.name: s for s in outcome.schemes if s.plan is not None and s.breakdown.fits_memory}
        for s in outcome.schemes:
            if s.name not in plans:
                print(f"  {model} {config}: {s.name} not run: {s.reason or 'does not fit memory'}", flush=True)
        for name, s in plans.items():
            plan = s.plan
            plan.set_provenance(model_file=model_py, model_args=kwargs, cluster_file=cluster_path)
            plan.batch_size = batch
            path = plan_dir / f"{model}-{config}-{name}.json"
            plan.save(path)
            same = [b for b, o in plans.items() if b != name and name == "found" and same_program(o.plan, plan)]
            out.append({"model": model, "config": config, "scheme": name, "path": path, "plan": plan,
                        "same_as": same[0] if same else "", "nproc": math.prod(shape), "graph": graph})
    return out


def same_program(a: Any, b: Any) -> bool:
    """Whether two plans make the same decisions: signatures and every storage (parameters, optimizer
    states, gradients: a ZeRO-1 plan is data parallel's signatures with the optimizer states sharded)."""
    return (a.signatures == b.signatures and a.param_storage == b.param_storage
            and a.optimizer_storage == b.optimizer_storage and a.grad_storage == b.grad_storage)


def cpu_busy(seconds: float = 3.0) -> float:
    """Fraction of the machine's CPU time busy over ``seconds`` (from /proc/stat; 0 where it cannot be read)."""
    def sample() -> list[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    try:
        a = sample()
        time.sleep(seconds)
        b = sample()
    except OSError:
        return 0.0
    d = [y - x for x, y in zip(a, b)]
    idle = d[3] + (d[4] if len(d) > 4 else 0)
    return 1.0 - idle / max(1, sum(d))


def wait_until_quiet(max_busy: float, timeout_s: float) -> float:
    """Before a launch: wait (at most ``timeout_s``) until nothing else keeps the CPU busy (at most
    ``max_busy`` of it over 3 s: the machine is shared, and other jobs slow the measured steps);
    returns the last busy fraction seen."""
    t0 = time.monotonic()
    busy = cpu_busy()
    while busy > max_busy and time.monotonic() - t0 < timeout_s:
        print(f"  waiting: the CPU is {busy:.0%} busy with other work", flush=True)
        time.sleep(10)
        busy = cpu_busy()
    return busy


def plans_worker_args(items: list[dict[str, Any]], out_dir: Path, model_py: Path, kwargs: dict[str, Any],
                      steps: int, warmup: int, rounds: int, min_time_s: float = 0.0) -> list[str]:
    """``executor.worker`` arguments timing every plan of ``items`` in one launch (in ``rounds``
    interleaved rounds: executor/worker.py ``run_many``; each plan at least ``steps`` steps and
    ``min_time_s`` seconds), each result written to ``out_dir``."""
    args = ["--plans", *[str(it["path"]) for it in items], "--out-dir", str(out_dir), "--model", str(model_py),
            "--steps", str(steps), "--warmup", str(warmup), "--rounds", str(rounds),
            "--min-time-s", f"{min_time_s:g}", "--quiet"]
    return args + [a for k, v in kwargs.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def worker_results(items: list[dict[str, Any]], out_dir: Path, error: str) -> dict[Path, dict[str, Any]]:
    """Plan path -> the result the worker wrote for it in ``out_dir``, else {"error": ``error``}."""
    results = {}
    for it in items:
        f = out_dir / f"{it['path'].stem}.json"
        results[it["path"]] = json.loads(f.read_text()) if f.exists() else {"error": error}
    return results


def run_plans(model: str, kwargs: dict[str, Any], nproc: int, items: list[dict[str, Any]], steps: int,
              warmup: int, out_dir: Path, timeout_s: float, rounds: int = 1,
              min_time_s: float = 0.0) -> dict[Path, dict[str, Any]]:
    """One torchrun launch of ``nproc`` ranks timing every plan of ``items`` (:func:`plans_worker_args`);
    plan path -> result."""
    from executor.launch import LaunchSpec, launch

    worker_args = plans_worker_args(items, out_dir, model_file(model), kwargs, steps, warmup, rounds, min_time_s)
    res = launch(LaunchSpec(nproc, omp_num_threads=1, timeout_s=timeout_s), worker_args)
    results = worker_results(items, out_dir, res.describe() if not res.ok else "no result written")
    if not res.ok:
        root = res.failures[0].traceback if res.failures else ""    # a rank killed by a signal: its stack
        print(f"  launch failed: {res.describe()}\n  " + "\n  ".join((root.splitlines() if root else [])[:40]
                                                                   + res.stderr_tail[-15:]), flush=True)
    return results


def result_row(model: str, plan: Any, nproc: int, result: dict[str, Any]) -> dict[str, Any] | None:
    """The runs-table row (executor.measure's columns) of one plan's result from an ``executor.worker
    --plans`` launch: its step times' median and p10 / p90, its prediction; None without step times."""
    from executor.measure import StepStats, git_commit, run_row

    if "step_time_s" not in result:
        return None
    return run_row(model=model, preset=" ".join(f"{k}={v}" for k, v in plan.model_args.items()),
                   cluster=plan.cluster, plan=plan.name, mesh=str(plan.mesh), nproc=nproc,
                   backend=result.get("backend", "gloo"), predicted=plan.cost.to_dict(),
                   stats=StepStats.of(result["step_time_s"]), peak_memory_mb=max(result["peak_memory_mb"]),
                   commit=git_commit(ROOT))


def study_row(it: dict[str, Any], result: dict[str, Any], study: str, steps: int, warmup: int,
              load: float) -> dict[str, Any]:
    plan = it["plan"]
    extra = {"study": study, "scheme": it["scheme"], "config": it["config"], "same_as": it["same_as"],
             "steps": result.get("steps", steps), "warmup": warmup, "rounds": result.get("rounds", 1),
             "step_timing": STEP_TIMING,
             "omp_threads": result.get("omp_num_threads", 1),
             "load_avg_1m": f"{load:.2f}", "error": result.get("error", ""),
             "measured_mean_s": _mean_step(result)}
    row = result_row(it["model"], plan, it["nproc"], result)
    if row is None:
        return {"model": it["model"], "plan": plan.name, "mesh": str(plan.mesh), "nproc": it["nproc"],
                "predicted_step_s": f"{plan.cost.step_time_s:.6g}", **extra}
    row.update(extra)
    return row


def _mean_step(result: dict[str, Any]) -> str:
    """The job's mean step (its steps' makespan over their number: the wall-clock time a step costs in a
    long run), beside the median the figures use: where nothing keeps the ranks in step (a plan without
    communication on more ranks than cores) the step times are bimodal and the median is a step that
    no other rank's time slice interrupted (mlp's replicated plan on 4 ranks: median 13.5-15.1 ms,
    p90 35-47 ms, studies 20261128-232703 .. 20261129-002005)."""
    times = result.get("step_time_s") or ()
    return f"{statistics.fmean(times):.6g}" if times else ""


# -- analysis -----------------------------------------------------------------------------------
def load_study(csv_path: Path, study: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Rows of ``study`` (default: the latest of this study's own, on loopback: rows without a
    ``testbed``, which benchmarks/two_hosts_study.py's rows name) that were measured, times as floats."""
    from executor.measure import read_rows

    _, rows = read_rows(csv_path)
    own = [r for r in rows if not r.get("testbed")]
    if not own and study is None:
        raise SystemExit(f"{csv_path}: no rows; run the study first (python benchmarks/fidelity.py)")
    study = study or max(r["study"] for r in own)
    out = []
    for r in rows:
        if r["study"] != study or not r.get("measured_median_s"):
            continue
        out.append({"model": r["model"], "config": r["config"], "scheme": r["scheme"], "same_as": r["same_as"],
                    "predicted": float(r["predicted_step_s"]), "median": float(r["measured_median_s"]),
                    "p10": float(r["measured_p10_s"]), "p90": float(r["measured_p90_s"]),
                    "load": float(r["load_avg_1m"] or "nan"), "mean": float(r.get("measured_mean_s") or "nan")})
    return study, out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model and per (model, config): MAPE, Spearman, found verdict; and overall MAPE."""
    by_mc: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        by_mc[(r["model"], r["config"])].append(r)
    per_mc = {}
    for (m, c), rs in by_mc.items():
        verdict, best = found_verdict(rs) if any(r["scheme"] == "found" for r in rs) else ("-", "")
        per_mc[(m, c)] = {"mape": mape([r["predicted"] for r in rs], [r["median"] for r in rs]),
                          "spearman": spearman([r["predicted"] for r in rs], [r["median"] for r in rs]),
                          "n": len(rs), "verdict": verdict, "best_baseline": best}
    per_model = {}
    for m in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == m]
        rhos = [v["spearman"] for (mm, _), v in per_mc.items() if mm == m and not math.isnan(v["spearman"])]
        per_model[m] = {"mape": mape([r["predicted"] for r in rs], [r["median"] for r in rs]), "n": len(rs),
                        "spearman_mean": statistics.fmean(rhos) if rhos else math.nan,
                        "spearman_min": min(rhos) if rhos else math.nan,
                        "verdicts": {c: v["verdict"] for (mm, c), v in per_mc.items() if mm == m}}
    overall = mape([r["predicted"] for r in rows], [r["median"] for r in rows]) if rows else math.nan
    with_mean = [r for r in rows if not math.isnan(r.get("mean", math.nan))]
    against_mean = (mape([r["predicted"] for r in with_mean], [r["mean"] for r in with_mean])
                    if with_mean else math.nan)
    return {"per_mc": per_mc, "per_model": per_model, "mape": overall, "n": len(rows),
            "mape_against_mean": against_mean}


def _f(x: float, pct: bool = False) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "-"
    return f"{x * 100:.1f}%" if pct else f"{x:.2f}"


def markdown(study: str, rows: list[dict[str, Any]], summary: dict[str, Any], command: str) -> str:
    loads = [r["load"] for r in rows if not math.isnan(r["load"])]
    lines = [f"Fidelity study `{study}`: `{command}`", "",
             f"{summary['n']} runs; overall MAPE {_f(summary['mape'], True)} (against each run's mean step rather "
             f"than its median: {_f(summary.get('mape_against_mean', math.nan), True)}); 1-minute load average during "
             f"the launches {min(loads):.1f} .. {max(loads):.1f} (2 cores)." if loads else "", "",
             "| model | runs | MAPE | Spearman mean (min) over meshes | found plan measured fastest? (2 / 4 / 2x2) |",
             "|---|---|---|---|---|"]
    for m, v in summary["per_model"].items():
        verdicts = " / ".join(f"{c}: {v['verdicts'].get(c, '-')}" for c in CONFIGS if c in v["verdicts"])
        lines.append(f"| {m} | {v['n']} | {_f(v['mape'], True)} | {_f(v['spearman_mean'])} "
                     f"({_f(v['spearman_min'])}) | {verdicts} |")
    lines += ["", "| model | mesh | schemes | MAPE | Spearman | found vs best baseline | predicted / measured ms "
              "(scheme: pred / median [p10, p90]) |", "|---|---|---|---|---|---|---|"]
    for (m, c), v in summary["per_mc"].items():
        rs = sorted((r for r in rows if r["model"] == m and r["config"] == c), key=lambda r: r["median"])
        detail = "; ".join(f"{r['scheme']}{'=' + r['same_as'] if r['same_as'] else ''}: {r['predicted'] * 1e3:.1f}"
                           f" / {r['median'] * 1e3:.1f} [{r['p10'] * 1e3:.1f}, {r['p90'] * 1e3:.1f}]" for r in rs)
        lines.append(f"| {m} | {c} | {v['n']} | {_f(v['mape'], True)} | {_f(v['spearman'])} | {v['verdict']}"
                     f"{' (' + v['best_baseline'] + ')' if v['best_baseline'] else ''} | {detail} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"2": "o", "4": "s", "2x2": "^"}
    models = list(dict.fromkeys(r["model"] for r in rows))
    colours = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(models)}
    fig, ax = plt.subplots(figsize=(7, 6))
    for r in rows:
        ms = [r["median"] * 1e3]
        err = [[ms[0] - r["p10"] * 1e3], [r["p90"] * 1e3 - ms[0]]]
        ax.errorbar([r["predicted"] * 1e3], ms, yerr=err, fmt=markers.get(r["config"], "x"),
                    color=colours[r["model"]], ms=6, mfc="none" if r["scheme"] != "found" else colours[r["model"]],
                    capsize=2, lw=0.8)
    values = [r["predicted"] * 1e3 for r in rows] + [r["median"] * 1e3 for r in rows]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
    ax.plot([lo, hi], [lo * 1.15, hi * 1.15], "k:", lw=0.7, label="±15%")
    ax.plot([lo, hi], [lo / 1.15, hi / 1.15], "k:", lw=0.7)
    for m in models:
        ax.plot([], [], "o", color=colours[m], label=m)
    for c, mk in markers.items():
        ax.plot([], [], mk, color="grey", mfc="none", label=f"mesh {c}")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted step time (ms)",
           ylabel="measured step time, median and p10..p90 (ms)", title=title)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def analyze(csv_path: Path, out_dir: Path, command: str, study: str | None = None) -> dict[str, Any]:
    study, rows = load_study(csv_path, study)
    summary = summarize(rows)
    text = markdown(study, rows, summary, command)
    from autoddl.atomic import write_text_atomic

    write_text_atomic(out_dir / "fidelity_summary.md", text)
    plot(rows, out_dir / "fidelity.png", f"predicted vs measured step time ({study}, local-cpu, gloo)")
    print(text)
    return summary


# -- the command ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--cluster", default=str(ROOT / "configs" / "local-cpu.yaml"))
    p.add_argument("--steps", type=int, default=12, help="measured steps of each plan, at least (default 12)")
    p.add_argument("--min-time-s", type=float, default=MIN_TIME_S,
                   help="and at least this many seconds of them, at the plan's warm-up pace "
                        f"(executor.measure.steps_for_min_time; default {MIN_TIME_S:g})")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3,
                   help="the measured steps of a launch's plans in this many interleaved rounds (each plan's "
                        "share in turn), so that the machine's drift falls on every plan alike (default 3)")
    p.add_argument("--out-dir", default=str(ROOT / "results"))
    p.add_argument("--analyze-only", action="store_true", help="only the tables and the plot, from the CSV")
    p.add_argument("--study", help="with --analyze-only: which study id (default: the latest)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per launch")
    p.add_argument("--max-busy", type=float, default=0.2,
                   help="before each launch, wait until at most this fraction of the CPU is busy (other jobs); "
                        "1 disables the wait (default 0.2)")
    p.add_argument("--max-wait-s", type=float, default=1800.0, help="the longest wait before one launch")
    p.add_argument("--other-machine", action="store_true",
                   help="measure even when --cluster was calibrated on another machine (autoddl/machine.py)")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    csv_path = out_dir / "fidelity.csv"
    command = "python benchmarks/fidelity.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                  if (argv if argv is not None else sys.argv[1:]) else "")
    if args.analyze_only:
        analyze(csv_path, out_dir, command, args.study)
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [m for m in models if m not in MODELS] + [c for c in configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown model or config {bad}; models: {', '.join(MODELS)}; configs: {', '.join(CONFIGS)}")
    from autoddl.cluster import ClusterConfigError
    from autoddl.machine import require_calibrated_here
    from executor.measure import append_row
    from executor.measure import RUN_COLUMNS

    require_calibrated_here(args.cluster, args.other_machine)

    study = time.strftime("%Y%m%d-%H%M%S")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autoddl-fidelity-") as tmp:
        tmp = Path(tmp)
        for model in models:
            kwargs = MODELS[model]
            tp = time.monotonic()
            try:
                items = plan_all(model, kwargs, configs, Path(args.cluster).resolve(), tmp / "plans")
            except ClusterConfigError as exc:     # e.g. a bfloat16 row on a CPU without bfloat16 matmuls
                print(f"[{time.monotonic() - t0:6.0f} s] {model}: not measured: {exc}", flush=True)
                continue
            print(f"[{time.monotonic() - t0:6.0f} s] {model} {kwargs}: {len(items)} plans in "
                  f"{time.monotonic() - tp:.1f} s", flush=True)
            for nproc in sorted({it["nproc"] for it in items}):
                group = [it for it in items if it["nproc"] == nproc]
                if args.max_busy < 1:
                    wait_until_quiet(args.max_busy, args.max_wait_s)
                load = os.getloadavg()[0]
                tl = time.monotonic()
                results = run_plans(model, kwargs, nproc, group, args.steps, args.warmup, tmp / "results",
                                    args.timeout_s, args.rounds, args.min_time_s)
                for it in group:
                    res = results[it["path"]]
                    append_row(csv_path, study_row(it, res, study, args.steps, args.warmup, load),
                               columns=RUN_COLUMNS + STUDY_COLUMNS)
                    if "step_time_s" in res:
                        med = statistics.median(res["step_time_s"])
                        print(f"  {model} {it['config']:>3} {it['scheme']:<6} predicted "
                              f"{it['plan'].cost.step_time_s * 1e3:8.2f} ms, measured median {med * 1e3:8.2f} ms",
                              flush=True)
                    else:
                        print(f"  {model} {it['config']:>3} {it['scheme']:<6} FAILED: {res.get('error')}", flush=True)
                print(f"[{time.monotonic() - t0:6.0f} s] {model} on {nproc} ranks: {len(group)} plans in "
                      f"{time.monotonic() - tl:.0f} s (load average {load:.1f} at start)", flush=True)
    analyze(csv_path, out_dir, command, study)
    return 0


if __name__ == "__main__":
    sys.exit(main())
