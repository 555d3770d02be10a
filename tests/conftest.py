"""Shared fixtures: tiny model files written into tmp_path."""

from __future__ import annotations

import os
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


@pytest.fixture
def write_model(tmp_path: Path) -> Callable[..., Path]:
    """``write_model(source, name="model.py") -> Path``: write a dedented model file into tmp_path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write
