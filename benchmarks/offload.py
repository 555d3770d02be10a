"""Spilling to host memory priced (issue 13 item 2): writes results/offload.csv (planning only).

A ~6B GPT (examples/gpt.py preset ``gpt-6b``: GPT-J-6B's sizes, 28 layers, hidden 4096, vocabulary
50400, sequence 2048) in bf16 with recompute auto and a global batch of 8 sequences, planned on
configs/a10-24gb.yaml (8 x A10 24 GB, PCIe 4.0 x16 to the host):

- ``1 x A10, --offload auto``: nothing fits one 24 GB device without spilling (the float32 masters
  alone are 23.4 GB), so the planner spills (the first level with which a plan fits); once with one
  micro-step of 8 sequences (each block copied in twice per step), once with 8 micro-steps of 1
  (each block copied in twice per micro-step);
- ``1 x A10, --offload activations``: the same, spilling the blocks' saved activations as well as
  their parameters (the fewest blocks with which it fits), whether or not ``auto`` chose it;
- ``1 x A10, --offload none``: the plan on the device alone, priced without the memory limit: what
  it would need;
- ``8 x A10, --offload none``: the same model and global batch on the whole server, no spilling.

Each row is `autoddl plan` run in-process (the commands are printed and kept in the CSV); its
plan JSON goes to results/plans/. Predictions only: no timing is taken here beyond the planning's.

    python benchmarks/offload.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoddl.atomic import write_csv_atomic  # noqa: E402
from autoddl.cli import main  # noqa: E402
from autoddl.plan import Plan  # noqa: E402

CLUSTER = "configs/a10-24gb.yaml"
COMMON = ["examples/gpt.py", "--preset", "gpt-6b", "--cluster", CLUSTER, "--precision", "bf16", "--recompute", "auto",
          "--global-batch-size", "8"]
RUNS = (   # (label, devices, offload, extra flags): every row a global batch of 8 sequences of 2048
    ("1 x A10, offload auto, 1 micro-step of 8", 1, "auto", ["--micro-batch-size", "8"]),
    ("1 x A10, offload auto, 8 micro-steps of 1", 1, "auto", ["--micro-batch-size", "1"]),
    ("1 x A10, offload activations, 1 micro-step of 8", 1, "activations", ["--micro-batch-size", "8"]),
    ("1 x A10, offload activations, 8 micro-steps of 1", 1, "activations", ["--micro-batch-size", "1"]),
    ("1 x A10, no offload (priced without the memory limit)", 1, "none", ["--micro-batch-size", "8",
                                                                          "--memory-gb", "1000"]),
    ("8 x A10, no offload", 8, "none", ["--micro-batch-size", "1"]),
)
COLUMNS = ["setting", "devices", "offload", "mesh", "recompute_blocks", "step_s", "tokens_per_s", "offload_copies_s",
           "memory_gb_per_device", "device_memory_gb", "fits", "host_memory_gb_per_device", "plan", "command", "note"]


def row(label: str, devices: int, offload: str, extra: list[str]) -> dict:
    tag = f"mb{extra[1]}" + ("-nolimit" if "--memory-gb" in extra else "")
    out = ROOT / "results" / "plans" / f"gpt-6b-a10x{devices}-offload-{offload}-{tag}.json"
    argv = ["plan", *COMMON, "--devices", str(devices), "--offload", offload, *extra, "--out", str(out)]
    print("autoddl " + " ".join(argv[:-1] + [str(out.relative_to(ROOT))]), flush=True)
    if main(argv) != 0:
        raise SystemExit(f"autoddl plan failed for {label!r}")
    plan = Plan.load(out)
    c = plan.cost
    blocks = plan.training.recompute_blocks
    return {
        "setting": label, "devices": devices, "offload": plan.training.offload, "mesh": str(plan.mesh),
        "recompute_blocks": (f"{sum(p != 'none' for p in blocks.values())} of 28 "
                             f"({', '.join(sorted(set(blocks.values())))})" if blocks else "none"),
        "step_s": f"{c.step_time_s:.4f}", "tokens_per_s": f"{c.tokens_per_s:.0f}" if c.tokens_per_s else "",
        "offload_copies_s": f"{c.offload_s:.4f}", "memory_gb_per_device": f"{c.memory_bytes_per_device / 1e9:.2f}",
        "device_memory_gb": 24, "fits": c.memory_bytes_per_device <= 24e9,
        "host_memory_gb_per_device": f"{c.host_memory_bytes_per_device / 1e9:.2f}",
        "plan": str(out.relative_to(ROOT)), "command": "autoddl " + " ".join(argv[:-2]),
        "note": next((n for n in plan.notes if n.startswith("offload")), ""),
    }


def main_() -> None:
    os.chdir(ROOT)
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    rows = [row(*run) for run in RUNS]
    path = ROOT / "results" / "offload.csv"
    write_csv_atomic(path, rows, COLUMNS)
    print(f"wrote {path.relative_to(ROOT)} in {time.perf_counter() - t0:.0f} s "
          f"(1-minute load average {load:.1f} before, {os.getloadavg()[0]:.1f} after)")
    for r in rows:
        print(f"{r['setting']:>52}: mesh {r['mesh']:>4}, offload {r['offload']:>9}, step {float(r['step_s']):.3f} s, "
              f"{r['memory_gb_per_device']} GB per device (fits 24 GB: {r['fits']}), host "
              f"{r['host_memory_gb_per_device']} GB, {r['tokens_per_s']} tokens/s")


if __name__ == "__main__":
    main_()
