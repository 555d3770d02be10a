"""Shared fixtures: tiny model files written into tmp_path."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def write_model(tmp_path: Path) -> Callable[..., Path]:
    """``write_model(source, name="model.py") -> Path``: write a dedented model file into tmp_path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write
