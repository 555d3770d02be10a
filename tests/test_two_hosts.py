"""Two hosts in network namespaces (benchmarks/two_hosts.py): one data-parallel plan checked across them.

Needs root and iproute2 (network namespaces, tc); skipped with the testbed's own reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "two_hosts.py"


def _unavailable() -> str | None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--check-only"], capture_output=True, text=True, timeout=30)
    if res.returncode == 0:
        return None
    return (res.stderr or res.stdout).strip() or f"two_hosts.py --check-only exited {res.returncode}"


def _our_namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith("a2h-")}


@pytest.mark.distributed
def test_dp_plan_checks_across_two_namespaced_hosts(tmp_path):
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    before = _our_namespaces()
    plan, result = tmp_path / "dp4.json", tmp_path / "result.json"
    made = subprocess.run([sys.executable, "-m", "autoddl", "plan", "examples/gpt.py", "--preset", "tiny",
                           "--cluster", "configs/local-cpu.yaml", "--devices", "4", "--scheme", "dp",
                           "--out", str(plan)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stdout + made.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1")      # 4 ranks on this machine's cores
    run = subprocess.run([sys.executable, str(SCRIPT), "--timeout-s", "90", "--", "-m", "executor.worker",
                          "--plan", str(plan), "--model", "examples/gpt.py", "--set", "preset=tiny", "--check",
                          "--steps", "1", "--pg-timeout-s", "60", "--out", str(result)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert "tbf 1000 Mbit/s each direction" in log and "inside a host: lo, unshaped" in log
    out = json.loads(result.read_text())
    assert (out["plan"], out["world_size"], out["mesh"]) == ("dp", 4, [4])
    assert out["check"]["ok"] is True and out["check"]["rtol"] == 1e-4
    assert max(out["check"]["max_rel_error"].values()) <= 1e-4
    assert out["hosts"] == ["host0", "host0", "host1", "host1"]      # node rank 0 holds ranks 0-1
    assert out["collectives_summary"]["grad_sync/all_reduce/axis0"]["count"] > 0
    assert _our_namespaces() <= before, f"namespaces left behind: {_our_namespaces() - before}"
