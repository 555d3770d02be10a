"""Issue 10's CPU setting run for real: results/training_runs.csv.

gpt and llama ("tiny" preset) planned with bf16 (fp32 masters, bf16 gradient reduction),
selective activation recompute and 4 micro-steps (micro-batch 2 per data-parallel rank, global
batch 8 x the data-parallel degree), on 2 gloo ranks (mesh 2) and 4 (mesh 2x2), then run with
``autoddl run --check`` (loss, gradients and parameters against one process under the same
policy and micro-steps) beside DistributedDataParallel and FSDP2 under the same settings
(executor/references.py: checkpoint_wrapper, autocast / MixedPrecisionPolicy, no_sync). Each
``autoddl run`` appends its rows (the plan's: predicted, measured median / p10 / p90, check
error; one per reference) to the CSV atomically.

    python benchmarks/training_runs.py            # ~4 min on 2 cores; run it on an idle machine
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

OUT = ROOT / "results" / "training_runs.csv"
CLUSTER = ROOT / "configs" / "local-cpu.yaml"
SETTINGS = ["--precision", "bf16", "--recompute", "selective", "--micro-batch-size", "2"]
MESHES = {"2": ["--devices", "2"], "2x2": ["--devices", "4", "--mesh", "2x2"]}


def main(argv: list[str]) -> int:
    """Every model on every mesh; ``--other-machine``: measure even when configs/local-cpu.yaml was
    calibrated on another machine (autoddl/machine.py)."""
    require_calibrated_here(CLUSTER, "--other-machine" in argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failed = []
    with tempfile.TemporaryDirectory(prefix="autoddl-training-") as tmp:
        for model in ("gpt", "llama"):
            for mesh, mesh_args in MESHES.items():
                ranks = int(mesh_args[1])
                plan_json = Path(tmp) / f"{model}-{mesh}.json"
                code = autoddl(["plan", str(ROOT / "examples" / f"{model}.py"), "--preset", "tiny", "--cluster",
                                str(CLUSTER), *mesh_args, *SETTINGS, "--global-batch-size", str(8 * ranks),
                                "--out", str(plan_json)])
                code = code or autoddl(["run", str(plan_json), "--check", "--steps", "10", "--warmup", "3",
                                        "--reference", "ddp", "--reference", "fsdp2", "--out", str(OUT)])
                if code:
                    failed.append(f"{model} {mesh}")
    print(f"appended to {OUT}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
