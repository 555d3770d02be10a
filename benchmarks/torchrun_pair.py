"""Two gloo ranks of a benchmark script under torchrun, one thread each, and the times rank 0 kept.

A script that times something on 2 ranks (benchmarks/collective_waits.py, benchmarks/loss_allreduce.py)
runs itself as ``SCRIPT --rank OUT_DIR`` on each rank (:func:`is_rank`), and rank 0 writes
``{label: [seconds, ...]}`` with :func:`write_times`; :func:`run_pair` launches the two ranks from the
benchmark's ``main`` and returns what rank 0 wrote, or None (the launch's output tail printed) when a
rank failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TIMES_FILE = "times.json"


def is_rank(argv: list[str]) -> str | None:
    """The output folder when ``argv`` is a rank's (``SCRIPT --rank OUT_DIR``), else None."""
    return argv[2] if len(argv) > 2 and argv[1] == "--rank" else None


def write_times(out_dir: str, times: dict[str, list[float]]) -> None:
    Path(out_dir, TIMES_FILE).write_text(json.dumps(times))


def run_pair(script: str, prefix: str, timeout_s: float = 300) -> dict[str, list[float]] | None:
    """``script --rank DIR`` on 2 local ranks (torchrun, a free port, OMP_NUM_THREADS=1); rank 0's times."""
    from executor.local_ranks import free_port

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), script, "--rank", tmp]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if res.returncode != 0:
            print(res.stdout[-2000:] + res.stderr[-2000:], file=sys.stderr)
            return None
        return json.loads(Path(tmp, TIMES_FILE).read_text())
