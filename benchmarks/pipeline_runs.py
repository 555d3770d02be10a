"""Issue 12's pipelined plans run for real: rows appended to results/training_runs.csv.

gpt and llama ("tiny" preset; 4 blocks where 4 stages or 2 x 2 virtual stages need them) priced
as ``autoddl plan --degrees pp=...`` (micro-batch 2 per data-parallel rank, global batch 8: 4
micro-batches, 2 with dp=2 or fsdp=2), then run with ``autoddl run --check --reference ddp`` (3 warm-up + 10
measured steps, 1 thread per rank): the stages as torch.distributed.pipelining PipelineStages under
the plan's schedule (pp=2 x fsdp=2: each stage's ZeRO-3 group gathered once per step), checked against
one process, the sends audited. Each run's rows (the plan's: predicted, measured median / p10 / p90,
check error; DDP's) are appended atomically with the 1-minute load average at its start
(``load_avg_1m``: the machine is shared).

    python benchmarks/pipeline_runs.py                  # every case, ~5 min on 2 cores
    python benchmarks/pipeline_runs.py pp=2,fsdp=2      # only the cases of these degrees
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoddl.cli import main as autoddl  # noqa: E402
from autoddl.machine import require_calibrated_here  # noqa: E402
from executor.measure import append_row, read_rows  # noqa: E402

OUT = ROOT / "results" / "training_runs.csv"
CLUSTER = ROOT / "configs" / "local-cpu.yaml"
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8"]
CASES = [  # (model, blocks, ranks, degrees, schedule arguments)
    ("gpt", 2, 2, "pp=2", ["--schedule", "1f1b"]),
    ("gpt", 2, 2, "pp=2", ["--schedule", "gpipe"]),
    ("gpt", 4, 2, "pp=2", ["--schedule", "interleaved", "--virtual-stages", "2"]),
    ("gpt", 2, 4, "pp=2,dp=2", ["--schedule", "1f1b"]),
    ("gpt", 2, 4, "pp=2,tp=2", ["--schedule", "1f1b"]),
    ("gpt", 4, 4, "pp=4", ["--schedule", "1f1b"]),
    ("gpt", 2, 4, "pp=2,fsdp=2", ["--schedule", "1f1b"]),
    ("llama", 2, 4, "pp=2,dp=2", ["--schedule", "1f1b"]),
    ("llama", 2, 4, "pp=2,fsdp=2", ["--schedule", "1f1b"]),
    ("llama", 4, 4, "pp=4", ["--schedule", "1f1b"]),
]


def run_case(tmp: Path, model: str, blocks: int, ranks: int, degrees: str, schedule: list[str], out: Path = OUT
             ) -> int:
    """Plan and run one case; its rows go to ``out`` with the load average at the start."""
    layers = ["--set", f"{'n_layer' if model == 'gpt' else 'n_layers'}={blocks}"] if blocks != 2 else []
    plan_json = tmp / f"{model}-{degrees}-{schedule[1]}.json"
    code = autoddl(["plan", str(ROOT / "examples" / f"{model}.py"), "--preset", "tiny", *layers, "--cluster",
                    str(CLUSTER), "--devices", str(ranks), "--degrees", degrees, *schedule, *BATCH, "--no-search",
                    "--out", str(plan_json)])
    if code:
        return code
    load = os.getloadavg()[0]
    csv = tmp / "rows.csv"
    csv.unlink(missing_ok=True)
    code = autoddl(["run", str(plan_json), "--check", "--steps", "10", "--warmup", "3", "--reference", "ddp",
                    "--out", str(csv)])
    for row in read_rows(csv)[1] if csv.exists() else []:
        append_row(out, {**row, "load_avg_1m": f"{load:.2f}", "schedule": schedule[1] + (f" V={schedule[3]}" if len(schedule) > 2 else ""),
                         "degrees": degrees})
    return code


def main(argv: list[str]) -> int:
    """Every case, or those whose degrees are in the command line's arguments; ``--other-machine``:
    measure even when configs/local-cpu.yaml was calibrated on another machine (autoddl/machine.py)."""
    require_calibrated_here(CLUSTER, "--other-machine" in argv)
    only = [a for a in argv if a != "--other-machine"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failed = []
    cases = [c for c in CASES if not only or c[3] in only]
    if not cases:
        print(f"no case has degrees {only}; the cases' degrees are {sorted({c[3] for c in CASES})}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="autoddl-pipeline-") as tmp:
        for model, blocks, ranks, degrees, schedule in cases:
            if run_case(Path(tmp), model, blocks, ranks, degrees, schedule):
                failed.append(f"{model} {degrees} {' '.join(schedule)}")
    print(f"appended to {OUT}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
