"""Two-host study: every baseline and the found plan on a 2x2 mesh across two namespaced hosts, at two link rates.

For each link rate (``--rates``, Mbit/s; default 1000 and 10000):

1. the cluster: ``configs/two-hosts.yaml`` when it was calibrated at that rate, else
   ``autoddl calibrate --across-hosts`` on the testbed at that rate, then its ``--only collective_cpu``
   across the same link, written to ``--work``;
2. per model (gpt and llama at sizes where communication matters, ``MODELS``): the planner on the
   2x2 mesh in-process (``autoddl.api.search_model``): every applicable baseline and the found plan,
   and each 2-D plan whose axes play different roles once more with its axes swapped (``tp_dp`` is
   ``dp_tp`` with Megatron across the hosts and data parallel inside them; ``found_swapped`` the
   found plan so), priced by the cost model on the same cluster;
3. a model's plans run on the testbed at that rate in one launch: ``python benchmarks/two_hosts.py
   --rate-mbit R -- -m executor.worker --plans ... --steps S --warmup W --rounds K`` (host 0 holds mesh
   axis 1, the inner one; axis 0 crosses the link): each plan placed and warmed up, then the measured
   steps in K interleaved rounds, each plan's share in turn, so that the machine's drift over the launch
   falls on every plan alike (studies before two-hosts-20261128 ran each plan in its own launch of 5
   steps, and the same program measured up to 45% apart); each row gets the study's columns
   (``link_mb``: MB the veth carried, both directions, over the launch: all its plans' start-up,
   warm-up, measured and audit steps).

``results/two_hosts.csv`` gets one row per run (the runs-table columns of ``executor.measure`` plus
``STUDY_COLUMNS``), and ``results/fidelity.csv`` the same run as the fidelity study's rows are, with a
``testbed`` column (``fidelity_row``; ``--export-fidelity`` adds a study measured before); then, per
(model, rate): MAPE of predicted vs measured step time, the Spearman rank correlation over the schemes,
and whether the found plan was measured fastest (or tied within p10..p90; ``benchmarks/fidelity.py``'s
rules).

    python benchmarks/two_hosts_study.py                          # the whole study (~10 min on 2 cores)
    python benchmarks/two_hosts_study.py --rates 1000 --models gpt --steps 3
    python benchmarks/two_hosts_study.py --analyze-only           # the tables (and results/two_hosts.png) from the CSV

Needs root and iproute2 (benchmarks/two_hosts.py); exits 3 with its reason otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TESTBED = ROOT / "benchmarks" / "two_hosts.py"
DEFAULT_CSV = ROOT / "results" / "two_hosts.csv"
FIDELITY_CSV = ROOT / "results" / "fidelity.csv"           # the rows join the fidelity study's, with a testbed
DEFAULT_CLUSTER = ROOT / "configs" / "two-hosts.yaml"
PLOT = ROOT / "results" / "two_hosts.png"                  # predicted vs measured, one colour per model and rate
MODELS: dict[str, dict[str, Any]] = {        # build_model / example_inputs keywords: weights big enough that
    "gpt": {"preset": "tiny", "n_embd": 256, "batch_size": 8},               # gradient sync across the link
    "llama": {"preset": "tiny", "dim": 256, "ffn_dim": 768, "batch_size": 8},  # costs as much as compute
}
MESH = (2, 2)                                 # axis 0 across the hosts, axis 1 inside a host
SWAPPED = {"dp_tp": "tp_dp", "found": "found_swapped"}
STUDY_COLUMNS = ("study", "rate_mbit", "delay_ms", "scheme", "axes", "link_mb", "cluster_file", "steps", "warmup",
                 "load_avg_1m", "error", "rounds")


# -- clusters ------------------------------------------------------------------------------------------
def calibrated_rate(path: Path) -> float | None:
    """The link rate a two-hosts YAML was calibrated at (from its header), or None."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines()[:3]:
        if "--rate-mbit" in line:
            try:
                return float(line.split("--rate-mbit", 1)[1].split()[0])
            except ValueError:
                return None
    return None


def cluster_for_rate(rate: float, work: Path, quick: bool) -> Path:
    """configs/two-hosts.yaml if calibrated at ``rate`` on this machine, else a fresh calibration on the
    testbed at ``rate`` (over configs/local-cpu.yaml: its device and op costs)."""
    from autoddl.cluster import Cluster
    from autoddl.machine import calibrated_elsewhere

    if calibrated_rate(DEFAULT_CLUSTER) == rate and not calibrated_elsewhere(Cluster.from_yaml(DEFAULT_CLUSTER)):
        return DEFAULT_CLUSTER
    out = work / f"two-hosts-{rate:g}mbit.yaml"
    if calibrated_rate(out) == rate and not calibrated_elsewhere(Cluster.from_yaml(out)):
        return out
    print(f"calibrating the testbed at {rate:g} Mbit/s -> {out}", flush=True)
    testbed = [sys.executable, str(TESTBED), "--rate-mbit", f"{rate:g}", "--timeout-s", "590", "--",
               "-m", "autoddl", "calibrate", "--across-hosts"]
    quick_flag = ["--quick"] if quick else []
    # the links, then the inter-host link's CPU per byte sent (measured across this link: its kernel CPU is its own)
    for cmd in (testbed + ["--out", str(out)] + quick_flag,
                testbed + ["--only", "collective_cpu", "--base", str(out), "--out", str(out)] + quick_flag):
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0 or not out.exists():
            raise RuntimeError(f"calibration at {rate:g} Mbit/s failed (exit {res.returncode}): {' '.join(cmd)}\n"
                               + "\n".join((res.stdout + res.stderr).splitlines()[-20:]))
    return out


# -- plans -----------------------------------------------------------------------------------------------
def swap_axes(plan: Any, name: str) -> Any:
    """``plan`` with its two mesh axes exchanged (every NdSbp reversed), cost to be priced again."""
    from autoddl.plan import Mesh
    from autoddl.sbp import NdSbp, Signature

    def t(nd: NdSbp) -> NdSbp:
        return NdSbp(tuple(reversed(nd.sbps)))

    sigs = {k: Signature(tuple(t(x) for x in s.inputs), tuple(t(x) for x in s.outputs))
            for k, s in plan.signatures.items()}
    return dataclasses.replace(plan, name=name, mesh=Mesh(plan.mesh.shape[::-1], plan.mesh.axis_names),
                               signatures=sigs, param_storage={k: t(v) for k, v in plan.param_storage.items()},
                               optimizer_storage={k: t(v) for k, v in plan.optimizer_storage.items()},
                               grad_storage={k: t(v) for k, v in plan.grad_storage.items()},
                               cost=None, op_costs=[], notes=[f"{plan.name} with its mesh axes swapped"])


def plan_model(model: str, kwargs: dict[str, Any], cluster_path: Path, plan_dir: Path) -> list[dict[str, Any]]:
    """Every applicable baseline, the found plan and the swapped variants, saved; one dict per plan."""
    from autoddl.api import search_model
    from autoddl.cluster import Cluster
    from autoddl.loader import trace_model_file
    from costmodel.breakdown import plan_cost

    model_py = ROOT / "examples" / f"{model}.py"
    _, graph = trace_model_file(model_py, **kwargs)
    cluster = Cluster.from_yaml(cluster_path)
    outcome = search_model(graph, cluster, devices=4, mesh=MESH)
    plans = []
    for s in outcome.schemes:
        if s.plan is None or not s.breakdown.fits_memory:
            print(f"  {model}: {s.name} not run: {s.reason or 'does not fit memory'}", flush=True)
            continue
        plans.append(s.plan)
        swapped = swap_axes(s.plan, SWAPPED.get(s.name, ""))
        if s.name in SWAPPED and (swapped.signatures, swapped.param_storage) != (s.plan.signatures,
                                                                               s.plan.param_storage):
            plans.append(dataclasses.replace(swapped, cost=plan_cost(graph, swapped, cluster).report()))
    out = []
    for plan in plans:
        plan.model, plan.model_args, plan.cluster_file = str(model_py), dict(kwargs), str(cluster_path)
        path = plan_dir / f"{model}-{plan.name}.json"
        plan.save(path)
        out.append({"model": model, "scheme": plan.name, "path": path, "plan": plan})
    return out


# -- runs ------------------------------------------------------------------------------------------------
def run_plans(items: list[dict[str, Any]], model: str, kwargs: dict[str, Any], rate: float,
              args: argparse.Namespace, run_dir: Path) -> tuple[dict[Path, dict[str, Any]], str]:
    """Every plan of ``items`` in one launch on the testbed at ``rate``: ``executor.worker --plans``
    places and warms up each, then times the measured steps in ``args.rounds`` interleaved rounds, each
    plan's share in turn (as benchmarks/fidelity.py does: plans launched one after the other measured
    up to 45% apart on the same program). Returns plan path -> the worker's result (or {"error": ...})
    and the MB the link carried over the launch, both directions, all its plans together."""
    out_dir = run_dir / f"{model}-results"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    from benchmarks.fidelity import plans_worker_args, worker_results

    cmd = [sys.executable, str(TESTBED), "--rate-mbit", f"{rate:g}", "--timeout-s", f"{args.timeout_s + 30:g}", "--",
           "-m", "executor.worker", *plans_worker_args(items, out_dir, ROOT / "examples" / f"{model}.py", kwargs,
                                                       args.steps, args.warmup, args.rounds)]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = (res.stdout + res.stderr).splitlines()
    failed = f"exit {res.returncode} after {time.monotonic() - t0:.0f} s: " + " | ".join(
        line for line in log[-6:] if line.strip())
    results = worker_results(items, out_dir, failed[:600])
    carried = next((line for line in log if "two_hosts: the link carried" in line), "")
    link_mb = sum(map(float, re.findall(r"([0-9.]+) MB", carried))) if carried else float("nan")   # both ways
    return results, f"{link_mb:.2f}"


def measured_row(it: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The runs-table row of one plan's worker result (executor.measure's columns), or {"error": ...}."""
    from benchmarks.fidelity import result_row

    row = result_row(it["model"], it["plan"], 4, result)
    return row if row is not None else {"error": result.get("error") or "no step times in the result"}


def study_row(it: dict[str, Any], row: dict[str, Any], study: str, rate: float, delay_ms: float,
              args: argparse.Namespace) -> dict[str, Any]:
    plan = it["plan"]
    out = {"model": it["model"], "plan": plan.name, "mesh": str(plan.mesh), "nproc": 4,
           "predicted_step_s": f"{plan.cost.step_time_s if plan.cost else float('nan'):.6g}", **row}
    out.update({"study": study, "rate_mbit": f"{rate:g}", "delay_ms": f"{delay_ms:g}", "scheme": it["scheme"],
                "axes": "swapped" if it["scheme"] in SWAPPED.values() else "as planned",
                "cluster_file": _shown(Path(plan.cluster_file)), "steps": args.steps, "warmup": args.warmup,
                "rounds": args.rounds, "load_avg_1m": f"{os.getloadavg()[0]:.2f}", "error": row.get("error", "")})
    return out


def fidelity_row(row: dict[str, Any]) -> dict[str, Any]:
    """A study row as results/fidelity.csv holds it: the runs-table columns, benchmarks/fidelity.py's
    study columns (config 2x2) and ``testbed`` ("two hosts at R Mbit/s"), which keeps these rows out
    of the loopback study that fidelity.py and notebook 02 read by default."""
    from benchmarks.fidelity import STEP_TIMING

    out = {k: v for k, v in row.items() if k not in ("rate_mbit", "delay_ms", "axes", "link_mb")}
    out.update(config="2x2", same_as="", omp_threads=1, step_timing=STEP_TIMING,
               testbed=f"two hosts at {row['rate_mbit']} Mbit/s")
    return out


def append_fidelity_rows(rows: list[dict[str, Any]], fidelity_csv: Path) -> int:
    """Append ``rows`` (this study's) to ``fidelity_csv`` as :func:`fidelity_row` makes them, leaving out
    those already there (same study, testbed, model and scheme); how many were appended."""
    from benchmarks.fidelity import STUDY_COLUMNS as FIDELITY_COLUMNS
    from executor.measure import RUN_COLUMNS, append_row, read_rows

    _, have = read_rows(fidelity_csv) if fidelity_csv.exists() else ([], [])
    seen = {(r["study"], r.get("testbed", ""), r["model"], r["scheme"]) for r in have}
    appended = 0
    for row in map(fidelity_row, rows):
        key = (row["study"], row["testbed"], row["model"], row["scheme"])
        if key not in seen:
            append_row(fidelity_csv, row, columns=RUN_COLUMNS + FIDELITY_COLUMNS + ("testbed",))
            seen.add(key)
            appended += 1
    return appended


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it, else absolute."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def delay_applied(rate: float) -> float:
    """The delay the testbed really adds (0 where the kernel has no netem), from its own describe line."""
    res = subprocess.run([sys.executable, str(TESTBED), "--rate-mbit", f"{rate:g}", "--", "true"],
                         cwd=ROOT, capture_output=True, text=True)
    first = res.stdout.splitlines()[0] if res.stdout else ""
    if "netem delay" in first:
        return float(first.split("netem delay", 1)[1].split()[0])
    return 0.0


# -- analysis --------------------------------------------------------------------------------------------
def analyze(csv_path: Path, study: str | None = None) -> list[str]:
    """Per (model, rate) of the latest study: MAPE, Spearman and the found plan's verdict; printable lines."""
    from benchmarks.fidelity import found_verdict, mape, plot, spearman
    from executor.measure import read_rows

    _, rows = read_rows(csv_path)
    if not rows:
        raise SystemExit(f"{csv_path}: no rows; run the study first (python benchmarks/two_hosts_study.py)")
    study = study or max(r["study"] for r in rows)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["study"] == study and r.get("measured_median_s"):
            groups.setdefault((r["model"], r["rate_mbit"]), []).append(
                {"scheme": r["scheme"], "predicted": float(r["predicted_step_s"]),
                 "median": float(r["measured_median_s"]), "p10": float(r["measured_p10_s"]),
                 "p90": float(r["measured_p90_s"]), "link_mb": r.get("link_mb") or "?"})
    lines = [f"study {study} ({csv_path.relative_to(ROOT) if csv_path.is_relative_to(ROOT) else csv_path})"]
    for (model, rate), g in sorted(groups.items()):
        pred, meas = [r["predicted"] for r in g], [r["median"] for r in g]
        verdict, best = found_verdict([r for r in g if r["scheme"] != "found_swapped"]) \
            if any(r["scheme"] == "found" for r in g) else ("no found plan", "")
        lines.append(f"{model} at {rate} Mbit/s: MAPE {mape(pred, meas):.1%}, Spearman {spearman(pred, meas):.2f} "
                     f"over {len(g)} plans; found plan {verdict}" + (f" (best baseline {best})" if best else ""))
        for r in sorted(g, key=lambda r: r["median"]):
            lines.append(f"    {r['scheme']:14s} predicted {r['predicted'] * 1e3:8.1f} ms   measured "
                         f"{r['median'] * 1e3:8.1f} ms (p10 {r['p10'] * 1e3:.1f}, p90 {r['p90'] * 1e3:.1f}), "
                         f"link {r['link_mb']} MB")
    points = [dict(r, model=f"{model} at {rate} Mbit/s", config="2x2") for (model, rate), g in sorted(groups.items())
              for r in g]
    if points:
        plot(points, PLOT, f"two hosts: predicted vs measured step time ({study})")
        lines.append(f"wrote {PLOT.relative_to(ROOT)}")
    return lines


# -- the command -----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/two_hosts_study.py", description=__doc__.split("\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1000.0, 10000.0], metavar="MBIT",
                   help="link rates between the hosts, Mbit/s (default 1000 10000)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=12, help="measured steps per plan (default 12)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per plan (default 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="a launch's plans time their measured steps in this many interleaved rounds (default 3)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per launch: one model's plans at one rate "
                                                                  "(default 900)")
    p.add_argument("--csv", type=Path, default=DEFAULT_CSV, help=f"rows appended here (default {DEFAULT_CSV.name})")
    p.add_argument("--work", type=Path, default=Path("/tmp/autoddl-two-hosts-study"),
                   help="plans, per-run CSVs and calibrations at other rates (default /tmp/autoddl-two-hosts-study)")
    p.add_argument("--quick-calibration", action="store_true", help="calibrate other rates with --quick")
    p.add_argument("--fidelity-csv", type=Path, default=FIDELITY_CSV,
                   help=f"each row also joins this CSV with a testbed column (default {FIDELITY_CSV.name})")
    p.add_argument("--export-fidelity", action="store_true",
                   help="only append the latest study's rows of --csv to --fidelity-csv (those not there yet)")
    p.add_argument("--analyze-only", action="store_true", help="only print the tables of the latest study")
    return p.parse_args(argv)


def run_study(args: argparse.Namespace, study: str) -> int:
    from executor.measure import RUN_COLUMNS, append_row

    failures = 0
    for rate in args.rates:
        cluster = cluster_for_rate(rate, args.work, args.quick_calibration)
        delay = delay_applied(rate)
        print(f"== {rate:g} Mbit/s, added delay {delay:g} ms, cluster {_shown(cluster)}", flush=True)
        for model in args.models:
            plan_dir = args.work / f"{rate:g}mbit"
            plan_dir.mkdir(parents=True, exist_ok=True)
            items = plan_model(model, MODELS[model], cluster, plan_dir)
            results, link_mb = run_plans(items, model, MODELS[model], rate, args, plan_dir)
            for it in items:
                row = dict(measured_row(it, results[it["path"]]), link_mb=link_mb)
                out = study_row(it, row, study, rate, delay, args)
                append_row(args.csv, out, columns=RUN_COLUMNS + STUDY_COLUMNS)
                append_fidelity_rows([out], args.fidelity_csv)
                failures += bool(out["error"])
                measured = f"{float(out['measured_median_s']) * 1e3:.1f} ms" if out.get("measured_median_s") else \
                    f"FAILED: {out['error']}"
                print(f"  {model:6s} {it['scheme']:14s} predicted {float(out['predicted_step_s']) * 1e3:8.1f} ms, "
                      f"measured {measured}", flush=True)
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.export_fidelity:
        from executor.measure import read_rows

        _, rows = read_rows(args.csv)
        study = max(r["study"] for r in rows)
        appended = append_fidelity_rows([r for r in rows if r["study"] == study], args.fidelity_csv)
        print(f"study {study}: {appended} rows appended to {_shown(args.fidelity_csv)}")
        return 0
    if not args.analyze_only:
        probe = subprocess.run([sys.executable, str(TESTBED), "--check-only"], capture_output=True, text=True)
        if probe.returncode != 0:
            print((probe.stderr or probe.stdout).strip(), file=sys.stderr)
            return probe.returncode
        args.work.mkdir(parents=True, exist_ok=True)
        study = time.strftime("two-hosts-%Y%m%d-%H%M%S")
        failures = run_study(args, study)
        if failures:
            print(f"{failures} plan run(s) failed; their rows say why (error column)", file=sys.stderr)
    print("\n".join(analyze(args.csv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
