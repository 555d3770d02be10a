"""Nightly-style search-quality hunt: coordinate descent against the exact ILP on new problems.

The property tests run fixed examples (derandomised); this explores new ones. Each run
draws a fresh base seed (printed, and given again with ``--seed`` to reproduce a run) and
  * plans every small example model on every bundled cluster and mesh the ILP solves
    within ``--ilp-limit-s``, coordinate descent as the planner runs it (baselines as
    starts, 1 s limit) but with the run's search seed;
  * then, until ``--seconds`` are spent, random problems drawn as the tests draw them
    (chains, trees and DAGs of 3-16 nodes, 2-5 choices, optional memory limit).
A problem where coordinate descent ends more than ``--tolerance-pct`` above the proven
optimum is a miss; misses are appended to results/search_quality.csv (rewritten
atomically) with what reproduces them. One progress line per problem.

    python benchmarks/search_quality.py --seconds 600
    python benchmarks/search_quality.py --seconds 60 --no-models --seed 123
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from autoddl.atomic import write_text_atomic  # noqa: E402
from search.coordinate_descent import coordinate_descent  # noqa: E402
from search.exact import exact  # noqa: E402
from search.problem import SearchProblem  # noqa: E402
from test_search_algorithms import random_problem  # noqa: E402  (the tests' generator)

MODELS = [("mlp", "tiny"), ("mlp", "large"), ("gpt", "tiny"), ("llama", "tiny"), ("vgg", "tiny"),
          ("vgg", "vgg16"), ("resnet", "tiny"), ("gpt", "gpt2-small"), ("resnet", "resnet50")]
CLUSTERS = ["local-cpu", "dgx-a100-8", "v100-16x1", "h100-4x8"]
COLUMNS = ["found_at", "run_seed", "problem", "reproduce", "cd_cost", "ilp_cost", "gap_pct", "cd_s", "ilp_s"]
KINDS = ("chain", "tree", "dag")
LIMIT_FRACS = (None, 0.05, 0.2, 0.4, 0.7)
EDGE_SCALES = (0.1, 1.0, 5.0)


def random_case(rng: np.random.Generator) -> tuple[str, str, SearchProblem]:
    """One random problem as the property tests draw them, with the call that rebuilds it."""
    args = dict(seed=int(rng.integers(0, 2**32)), n=int(rng.integers(3, 17)), kind=str(rng.choice(KINDS)),
                limit_frac=LIMIT_FRACS[int(rng.integers(len(LIMIT_FRACS)))],
                edge_scale=EDGE_SCALES[int(rng.integers(len(EDGE_SCALES)))],
                base_mem=float(rng.choice([0.0, 1000.0])))
    label = f"random {args['kind']} n={args['n']} seed={args['seed']}"
    call = "random_problem(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
    return label, call, random_problem(**args)


def model_cases():
    """(label, reproduce, problem, starts) for every example model, bundled cluster and mesh."""
    import autoddl
    from autoddl.cluster import Cluster
    from search.baselines import baseline_specs, build_baseline
    from search.exact import exact_refusal
    from search.formulate import formulate
    from search.planner import resolve_meshes

    for model, preset in MODELS:
        _, graph = autoddl.trace_model_file(ROOT / "examples" / f"{model}.py", preset=preset)
        for cname in CLUSTERS:
            cluster = Cluster.from_yaml(ROOT / "configs" / f"{cname}.yaml")
            for shape in resolve_meshes(cluster, None):
                form = formulate(graph, cluster, shape, memory_limit_bytes=cluster.device.memory_gb * 1e9)
                if exact_refusal(form.problem) is not None:
                    continue
                starts = {spec.name: b.assignment for spec in baseline_specs(len(shape))
                          if (b := build_baseline(form, spec)).applicable}
                mesh = "x".join(map(str, shape))
                yield (f"{model}:{preset} on {cname} mesh {mesh}",
                       f"examples/{model}.py --preset {preset} --cluster configs/{cname}.yaml --mesh {mesh}",
                       form.problem, starts)


def compare(problem: SearchProblem, starts: dict, cd_seed: int, cd_limit_s: float | None,
            ilp_limit_s: float) -> dict | None:
    """CD and ILP costs and times; None when the ILP proves no optimum in time or nothing fits."""
    from search.problem import NoFeasiblePlanError
    try:
        t0 = time.perf_counter()
        cd = coordinate_descent(problem, starts, seed=cd_seed, time_limit_s=cd_limit_s)
        cd_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt = exact(problem, time_limit_s=ilp_limit_s)
        ilp_s = time.perf_counter() - t0
    except NoFeasiblePlanError:
        return None
    if opt is None or not opt.optimal:
        return None
    gap = (cd.cost - opt.cost) / opt.cost * 100 if opt.cost > 0 else 0.0
    return {"cd_cost": cd.cost, "ilp_cost": opt.cost, "gap_pct": gap, "cd_s": cd_s, "ilp_s": ilp_s}


def append_misses(path: Path, rows: list[dict]) -> None:
    """Rewrite ``path`` atomically with its old rows and ``rows`` after them."""
    old = []
    if path.exists():
        with path.open(newline="") as f:
            old = list(csv.DictReader(f))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(old + rows)
    write_text_atomic(path, buf.getvalue())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0, help="stop starting new problems after this")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: fresh entropy)")
    ap.add_argument("--tolerance-pct", type=float, default=1.0)
    ap.add_argument("--ilp-limit-s", type=float, default=60.0)
    ap.add_argument("--no-models", action="store_true", help="random problems only")
    ap.add_argument("--out", default=str(ROOT / "results" / "search_quality.csv"))
    args = ap.parse_args(argv)
    run_seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(run_seed)
    print(f"search quality run, seed {run_seed}, {args.seconds:.0f} s", flush=True)
    t_end = time.perf_counter() + args.seconds
    tried, gaps, misses = 0, [], []
    models = iter(()) if args.no_models else model_cases()

    def cases():
        for label, call, problem, starts in models:
            yield label, call, problem, starts, 1.0          # as the planner runs it
        while True:
            label, call, problem = random_case(rng)
            yield label, call, problem, {}, None

    for label, call, problem, starts, cd_limit in cases():
        if time.perf_counter() > t_end:
            break
        cd_seed = int(rng.integers(0, 2**31))
        res = compare(problem, starts, cd_seed, cd_limit, args.ilp_limit_s)
        if res is None:
            print(f"[{tried + 1}] {label}: skipped (no proven optimum, or nothing fits)", flush=True)
            continue
        tried += 1
        gaps.append(res["gap_pct"])
        miss = res["gap_pct"] > args.tolerance_pct
        print(f"[{tried}] {label}: cd {res['cd_cost']:.6g} ilp {res['ilp_cost']:.6g} gap {res['gap_pct']:.3f}% "
              f"(cd {res['cd_s']:.2f} s, ilp {res['ilp_s']:.2f} s){'  MISS' if miss else ''}", flush=True)
        if miss:
            row = {"found_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "run_seed": run_seed,
                   "problem": label, "reproduce": f"{call}; coordinate_descent(seed={cd_seed})", **res}
            misses.append(row)
            append_misses(Path(args.out), [row])
    worst = max(gaps, default=0.0)
    print(f"{tried} problems, max gap {worst:.3f}%, {len(misses)} misses above {args.tolerance_pct}%"
          + (f" appended to {args.out}" if misses else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
