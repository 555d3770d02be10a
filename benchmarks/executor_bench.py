"""autoddl's compiled executor against PyTorch's own schemes, side by side: writes results/executor.csv.

On 2 gloo ranks, for each case below, every plan runs in one launch together with the
PyTorch implementation of the same scheme (same model, batch, optimizer and ranks):
dp vs DistributedDataParallel, zero3 vs FSDP2, tp vs DTensor tensor parallel, and the
found plan beside all three. Both are placed and warmed up first, then their ``--steps`` measured
steps run in ``--rounds`` interleaved rounds (``autoddl run --rounds``), so that the machine's drift
over the launch falls on both sides of the ratio. Medians; p10-p90. Each pairing is launched
``--launches`` times (3): the same program measured 0.97x and 1.24x DDP in two launches minutes apart
on the 2-core VM (gpt tiny, 2026-11-27), so a row is the launch with the median ratio, every
launch's ratio beside it.

    python benchmarks/executor_bench.py                     # every case (about 25 min on 2 cores)
    python benchmarks/executor_bench.py --only gpt-tiny --steps 24 --rounds 4

Cases: (a) gpt tiny at batch 16; (b) a compute-bound GPT (4 layers, 256 wide, 8 x 128
tokens); (c) VGG tiny at batch 64 (>= 100 ms a step here). Plans are made with
``autoddl plan --cluster configs/local-cpu.yaml --devices 2`` and kept in results/plans/.
The CSV is rewritten atomically after every run, so an interrupted benchmark keeps
what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoddl.atomic import write_csv_atomic  # noqa: E402
from executor.measure import read_rows  # noqa: E402

CASES = {
    "gpt-tiny": ("examples/gpt.py", ["preset=\"tiny\"", "batch_size=16"]),
    "gpt-4x256": ("examples/gpt.py", ["preset=\"tiny\"", "n_layer=4", "n_embd=256", "n_head=4", "block_size=128",
                                      "seq_len=128", "batch_size=8"]),
    "vgg-tiny": ("examples/vgg.py", ["preset=\"tiny\"", "batch_size=64"]),
}
COUNTERPART = {"dp": "ddp", "zero3": "fsdp2", "tp": "dtensor_tp"}
COLUMNS = ["case", "model", "sets", "plan", "reference", "plan_median_ms", "plan_p10_ms", "plan_p90_ms",
           "reference_median_ms", "reference_p10_ms", "reference_p90_ms", "ratio", "target_ratio", "met",
           "predicted_ms", "steps", "warmup", "rounds", "launches", "launch_ratios", "note"]
TARGET = 1.10


def sh(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "autoddl", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env)


def make_plan(case: str, scheme: str) -> Path | None:
    """``results/plans/executor-<case>-<scheme>.json``, or None when the scheme does not apply."""
    model, sets = CASES[case]
    out = Path("results/plans") / f"executor-{case}-{scheme}.json"
    args = ["plan", model, "--cluster", "configs/local-cpu.yaml", "--devices", "2", "--scheme", scheme,
            "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    proc = sh(*args)
    if proc.returncode != 0 or not (ROOT / out).exists():
        print(f"  {case}/{scheme}: not applicable ({(proc.stderr or proc.stdout).strip().splitlines()[-1:]})")
        return None
    return out


def dtensor_tp_applies(case: str) -> str:
    """"" when DTensor tensor parallel applies to the case's model, else why not."""
    from autoddl.loader import load_model_file
    from executor.references import tp_pairs

    model, sets = CASES[case]
    from autoddl.loader import parse_overrides

    mf = load_model_file(ROOT / model, device="meta", **parse_overrides(sets))
    return "" if tp_pairs(mf.model) else f"dtensor_tp: {type(mf.model).__name__} has no named column -> row linear pair"


def run(plan: Path, references: list[str], steps: int, warmup: int, rounds: int) -> list[dict[str, str]]:
    """One launch: the plan and its references, their measured steps in ``rounds`` interleaved rounds;
    the runs-CSV rows (plan first)."""
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "runs.csv"
        args = ["run", str(plan), "--nproc", "2", "--steps", str(steps), "--warmup", str(warmup),
                "--rounds", str(rounds), "--out", str(csv_path)]
        for r in references:
            args += ["--reference", r]
        proc = sh(*args)
        if proc.returncode != 0:
            raise RuntimeError(f"autoddl {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
        return read_rows(csv_path)[1]


def _ms(row: dict[str, str], key: str) -> float:
    return float(row[key]) * 1e3


def rows_of(case: str, scheme: str, runs: list[dict[str, str]], steps: int, warmup: int, rounds: int) -> list[dict]:
    plan, refs = runs[0], runs[1:]
    if not refs:
        return []
    best = min(refs, key=lambda r: float(r["measured_median_s"]))
    versus = [best] if scheme == "found" else refs
    out = []
    for ref in versus:
        ratio = float(plan["measured_median_s"]) / float(ref["measured_median_s"])
        out.append({
            "case": case, "model": CASES[case][0], "sets": " ".join(CASES[case][1]), "plan": scheme,
            "reference": ref["plan"], "plan_median_ms": f"{_ms(plan, 'measured_median_s'):.2f}",
            "plan_p10_ms": f"{_ms(plan, 'measured_p10_s'):.2f}", "plan_p90_ms": f"{_ms(plan, 'measured_p90_s'):.2f}",
            "reference_median_ms": f"{_ms(ref, 'measured_median_s'):.2f}",
            "reference_p10_ms": f"{_ms(ref, 'measured_p10_s'):.2f}",
            "reference_p90_ms": f"{_ms(ref, 'measured_p90_s'):.2f}", "ratio": f"{ratio:.3f}",
            "target_ratio": TARGET, "met": ratio <= TARGET,
            "predicted_ms": f"{_ms(plan, 'predicted_step_s'):.2f}" if plan.get("predicted_step_s") else "",
            "steps": steps, "warmup": warmup, "rounds": rounds,
            "note": "fastest of " + ", ".join(r["plan"] for r in refs) if scheme == "found" else "",
        })
    return out


def median_launch(launches: list[list[dict]]) -> list[dict]:
    """Per reference (the found plan: its one row), the launch whose ratio is the median over the
    launches (the lower middle of an even count), with every launch's ratio in ``launch_ratios``."""
    by: dict[str, list[dict]] = {}
    for rows in launches:
        for r in rows:
            by.setdefault("found" if r["plan"] == "found" else r["reference"], []).append(r)
    out = []
    for rows in by.values():
        ranked = sorted(rows, key=lambda r: float(r["ratio"]))
        pick = dict(ranked[(len(ranked) - 1) // 2])
        out.append({**pick, "launches": len(rows), "launch_ratios": " ".join(r["ratio"] for r in rows)})
    return out


def _in_case_order(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: list(CASES).index(r["case"]) if r["case"] in CASES else len(CASES))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4,
                   help="the plan's and its references' measured steps in this many interleaved rounds (default 4)")
    p.add_argument("--launches", type=int, default=3,
                   help="launches of each pairing; a row is the launch with the median ratio (default 3)")
    p.add_argument("--out", default=str(ROOT / "results" / "executor.csv"))
    args = p.parse_args(argv)
    if args.launches < 1:
        raise SystemExit(f"--launches must be at least 1, got {args.launches}")
    kept = [r for r in read_rows(args.out)[1] if r["case"] not in args.only] if Path(args.out).exists() else []
    rows: list[dict] = []
    t0 = time.monotonic()
    for case in args.only:
        plans = {s: make_plan(case, s) for s in ("dp", "zero3", "tp", "found")}
        why_not = dtensor_tp_applies(case)
        if why_not and plans["tp"] is not None:
            print(f"  {case}/tp: not compared ({why_not})")
            plans["tp"] = None
        applicable = [COUNTERPART[s] for s in COUNTERPART if plans[s] is not None]
        for scheme, plan in plans.items():
            if plan is None:
                continue
            refs = applicable if scheme == "found" else [COUNTERPART[scheme]]
            launches = []
            for i in range(args.launches):
                print(f"[{time.monotonic() - t0:5.0f} s] {case}: {scheme} beside {', '.join(refs)} "
                      f"(launch {i + 1} of {args.launches})", flush=True)
                runs = run(plan, refs, args.steps, args.warmup, args.rounds)
                launches.append(rows_of(case, scheme, runs, args.steps, args.warmup, args.rounds))
                for r in launches[-1]:
                    print(f"    {r['plan']} {r['plan_median_ms']} ms vs {r['reference']} {r['reference_median_ms']} "
                          f"ms: {r['ratio']}x", flush=True)
            new = median_launch(launches)
            for r in new:
                print(f"  median launch: {r['plan']} vs {r['reference']} {r['ratio']}x (launches {r['launch_ratios']})",
                      flush=True)
            rows += new
            write_csv_atomic(args.out, _in_case_order(kept + rows), COLUMNS)     # the other cases' rows kept
    print(f"wrote {args.out} ({len(rows)} rows, {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
