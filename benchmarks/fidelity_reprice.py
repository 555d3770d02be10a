"""Price a measured fidelity study's plans with another cluster file: what its error would have been.

    python benchmarks/fidelity_reprice.py CLUSTER_YAML [--study ID] [--study-cluster YAML]

Re-plans every (model, mesh) of the study (default: the latest in results/fidelity.csv) with the
cluster it was planned with (``--study-cluster``, default configs/local-cpu.yaml), checks that each
plan prices as the study recorded (the same plan: otherwise the row is left out and named), prices
it with CLUSTER_YAML, and prints the MAPE of both against the same measured medians, per mesh size
and as the mean predicted / measured per scheme. Nothing is run or timed: a calibration can be judged
against measurements already taken (e.g. a fresh `autoddl calibrate --out /tmp/fresh.yaml`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity  # noqa: E402  (the study's models, plans and loader)

ROOT = Path(__file__).resolve().parents[1]
SAME_PLAN_REL = 1e-5          # a re-planned plan is the study's when it prices within this of its record (6 digits)


def reprice(study_rows: list[dict[str, Any]], study_cluster: Path, cluster: Path) -> tuple[list[dict], list[str]]:
    """The study's rows with ``new``: each re-planned plan priced with ``cluster``; and the rows left out."""
    from autoddl.cluster import Cluster
    from costmodel.breakdown import plan_cost

    new_cluster = Cluster.from_yaml(cluster)
    wanted = {(r["model"], r["config"], r["scheme"]): r for r in study_rows}
    out, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="autoddl-reprice-") as tmp:
        for model in dict.fromkeys(r["model"] for r in study_rows):
            configs = sorted({r["config"] for r in study_rows if r["model"] == model})
            for it in fidelity.plan_all(model, fidelity.MODELS[model], configs, study_cluster, Path(tmp)):
                row = wanted.get((model, it["config"], it["scheme"]))
                if row is None:
                    continue
                if abs(it["plan"].cost.step_time_s / row["predicted"] - 1) > SAME_PLAN_REL:
                    skipped.append(f"{model} {it['config']} {it['scheme']}: re-planned at "
                                   f"{it['plan'].cost.step_time_s * 1e3:.2f} ms, the study's {row['predicted'] * 1e3:.2f}")
                    continue
                out.append({**row, "new": plan_cost(it["graph"], it["plan"], new_cluster).step_time_s,
                            "nproc": it["nproc"]})
    return out, skipped


def report(rows: list[dict[str, Any]]) -> list[str]:
    """MAPE of the study's predictions and of the new ones, overall and per mesh size; and the mean
    predicted / measured per (mesh size, scheme), both ways."""
    def mape(key: str, rs: list[dict]) -> float:
        return fidelity.mape([r[key] for r in rs], [r["median"] for r in rs])

    lines = [f"{len(rows)} runs: MAPE {mape('predicted', rows):.1%} as the study predicted, "
             f"{mape('new', rows):.1%} with the new cluster"]
    by_n: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_n[r["nproc"]].append(r)
    lines += [f"  {n} ranks ({len(rs)} runs): {mape('predicted', rs):.1%} -> {mape('new', rs):.1%}"
              for n, rs in sorted(by_n.items())]
    lines.append("mean predicted / measured: ranks scheme  study -> new")
    by_scheme: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in rows:
        by_scheme[(r["nproc"], r["scheme"])].append(r)
    for (n, scheme), rs in sorted(by_scheme.items()):
        old = statistics.fmean(r["predicted"] / r["median"] for r in rs)
        new = statistics.fmean(r["new"] / r["median"] for r in rs)
        lines.append(f"  {n} {scheme:8s} {old:5.2f} -> {new:5.2f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/fidelity_reprice.py", description=__doc__.split("\n")[0])
    p.add_argument("cluster", type=Path, help="the cluster file to price the study's plans with")
    p.add_argument("--study", help="study id in results/fidelity.csv (default: the latest)")
    p.add_argument("--study-cluster", type=Path, default=ROOT / "configs" / "local-cpu.yaml",
                   help="the cluster the study planned with (default configs/local-cpu.yaml)")
    p.add_argument("--csv", type=Path, default=ROOT / "results" / "fidelity.csv")
    args = p.parse_args(argv)
    study, rows = fidelity.load_study(args.csv, args.study)
    priced, skipped = reprice(rows, args.study_cluster.resolve(), args.cluster)
    print(f"study {study}: its plans re-planned with {args.study_cluster}, priced with {args.cluster}")
    for line in skipped:
        print(f"  left out (not the study's plan): {line}")
    if not priced:
        print("no plan of the study could be re-planned as it was; give the cluster it planned with "
              "(--study-cluster)", file=sys.stderr)
        return 1
    print("\n".join(report(priced)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
