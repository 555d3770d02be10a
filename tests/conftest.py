"""Shared fixtures: tiny model files written into tmp_path."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import textwrap
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import settings

# CI runs the same examples every time: property tests are derandomised (a failure reproduces
# in every checkout instead of appearing by luck). benchmarks/search_quality.py explores new
# random problems; HYPOTHESIS_PROFILE=explore does the same for the property tests locally.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# No test reads (or fills) the user's trace cache (autoddl/trace_cache.py, ~/.cache/autoddl): the
# session gets an empty one of its own, removed at exit; CLI subprocesses inherit it.
_TRACE_CACHE = tempfile.mkdtemp(prefix="autoddl-test-cache-")
os.environ["AUTODDL_CACHE_DIR"] = _TRACE_CACHE
atexit.register(shutil.rmtree, _TRACE_CACHE, ignore_errors=True)


@pytest.fixture
def write_model(tmp_path: Path) -> Callable[..., Path]:
    """``write_model(source, name="model.py") -> Path``: write a dedented model file into tmp_path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write
