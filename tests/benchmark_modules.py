"""The benchmark scripts (benchmarks/*.py, not a package) imported as modules for their tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` executed as a module named ``<name>_bench``."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
