"""Write a file so that a crash leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import csv
import io
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    write_bytes_atomic(path, text.encode())


def write_csv_atomic(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """``rows`` as a CSV with header ``columns`` (missing values empty), written atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), restval="")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    write_text_atomic(path, buf.getvalue())


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
