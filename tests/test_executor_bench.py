"""benchmarks/executor_bench.py's reduction of several launches of one pairing to one row."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("executor_bench")


def _row(plan: str, reference: str, ratio: float, plan_ms: float) -> dict:
    return {"plan": plan, "reference": reference, "ratio": f"{ratio:.3f}", "plan_median_ms": f"{plan_ms:.2f}"}


def test_a_row_is_the_launch_with_the_median_ratio(bench):
    launches = [[_row("dp", "ddp", 1.187, 23.8)], [_row("dp", "ddp", 0.969, 19.9)], [_row("dp", "ddp", 1.0, 21.0)]]
    (row,) = bench.median_launch(launches)
    assert (row["ratio"], row["plan_median_ms"]) == ("1.000", "21.00")      # that launch's numbers, whole
    assert row["launches"] == 3 and row["launch_ratios"] == "1.187 0.969 1.000"
    # the found plan keeps one row whatever reference was fastest in each launch; of two, the lower
    found = [[_row("found", "ddp", 1.242, 24.6)], [_row("found", "fsdp2", 1.0, 21.0)]]
    (row,) = bench.median_launch(found)
    assert (row["reference"], row["ratio"], row["launch_ratios"]) == ("fsdp2", "1.000", "1.242 1.000")
    # a scheme beside two references (one launch): one row per reference
    both = bench.median_launch([[_row("dp", "ddp", 1.1, 20.0), _row("dp", "fsdp2", 0.5, 20.0)]])
    assert [(r["reference"], r["ratio"]) for r in both] == [("ddp", "1.100"), ("fsdp2", "0.500")]
