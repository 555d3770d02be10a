"""How far apart two calibrations of the same machine land, with one launch and with several.

``autoddl calibrate`` is run ``--repeat`` times (default 2) with ``--launches 1`` and as often with
``--launches 3`` (the default), one after the other, each over ``configs/local-cpu.yaml`` into a
temporary file. For each number the cost model reads most (peak, memory bandwidth, the executor's
fixed costs, the all-reduce and all-gather fits, four op families), the spread between the runs of
one setting is ``max / min - 1``. Rows are appended (the file rewritten atomically) to
``results/calibration_spread.csv``, one per field and setting, and a Markdown table goes to stdout.

    python benchmarks/calibration_spread.py               # ~7 min on the 2-core VM
    python benchmarks/calibration_spread.py --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoddl.atomic import write_csv_atomic  # noqa: E402
from executor.measure import read_rows  # noqa: E402

COLUMNS = ["time", "field", "unit", "launches", "values", "spread"]

FIELDS = (
    ("device.peak_tflops.float32", "TFLOPS"), ("device.memory_bandwidth_gbps", "GB/s"),
    ("efficiency.compute", ""), ("op_overhead_us", "us"),
    ("executor.op_forward_us", "us"), ("executor.op_backward_us", "us"), ("executor.param_us", "us"),
    ("executor.collective_us", "us"), ("executor.step_us", "us"),
    ("collectives.all_reduce.latency_us", "us"), ("collectives.all_reduce.bandwidth_gbps", "GB/s"),
    ("collectives.all_gather.latency_us", "us"), ("collectives.all_gather.bandwidth_gbps", "GB/s"),
    *((f"executor.op_us.float32.{fam}.{i}", "us") for fam in ("linear", "layer_norm", "gelu", "conv2d")
      for i in (0, 1)),
)


def field_value(cluster: dict, dotted: str) -> float:
    value = cluster
    for part in dotted.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return float(value)


def calibrate(launches: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "autoddl", "calibrate", "--nproc", "2", "--backend", "gloo",
           "--base", str(ROOT / "configs" / "local-cpu.yaml"), "--devices-per-node", "4",
           "--launches", str(launches), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return yaml.safe_load(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2, help="calibrations per setting (default 2)")
    p.add_argument("--out", default=str(ROOT / "results" / "calibration_spread.csv"))
    args = p.parse_args(argv)
    if args.repeat < 2:
        raise SystemExit("--repeat must be at least 2: a spread needs two calibrations")
    runs: dict[int, list[dict]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for launches in (1, 3):
            for i in range(args.repeat):
                print(f"[{time.perf_counter() - start:5.0f} s] calibrate --launches {launches} ({i + 1} of "
                      f"{args.repeat})", file=sys.stderr, flush=True)
                runs.setdefault(launches, []).append(calibrate(launches, Path(tmp) / f"l{launches}_{i}.yaml"))
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows: list[dict] = []
    table = ["| field | one launch: values (spread) | three launches: values (spread) |", "|---|---|---|"]
    spreads: dict[int, list[float]] = {1: [], 3: []}
    for dotted, unit in FIELDS:
        cells = []
        for launches, clusters in runs.items():
            values = [field_value(c, dotted) for c in clusters]
            spread = max(values) / min(values) - 1 if min(values) > 0 else float("nan")
            spreads[launches].append(spread)
            rows.append({"time": when, "field": dotted, "unit": unit, "launches": launches,
                         "values": " ".join(f"{v:g}" for v in values), "spread": f"{spread:.4f}"})
            cells.append(f"{' / '.join(f'{v:g}' for v in values)} ({spread:.0%})")
        table.append(f"| `{dotted}` {unit} | " + " | ".join(cells) + " |")
    table.append("| median spread over the fields | " + " | ".join(
        f"{statistics.median(s):.0%}" for s in spreads.values()) + " |")
    write_csv_atomic(args.out, read_rows(args.out)[1] + rows, COLUMNS)      # every earlier run's rows are kept
    print(f"`python benchmarks/calibration_spread.py --repeat {args.repeat}`, {when}, "
          f"{time.perf_counter() - start:.0f} s\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
