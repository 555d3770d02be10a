"""Traced graphs kept on disk, so that planning the same model again skips torch.export.

A traced OpGraph depends on the model file's source, the arguments it is built with (``--preset``,
``--set``), the micro-step batch it is traced at, the precision policy it is traced under, the
torch version that exports it and autoddl's own tracer (the modules listed in ``TRACER_SOURCES``).
Those six make the :class:`TraceKey`; its digest names the file ``<cache dir>/traces/<digest>.pkl``.
The cache dir is ``$AUTODDL_CACHE_DIR`` when set (the tests point it at a temporary folder), else
``~/.cache/autoddl``. Files are written atomically (autoddl/atomic.py) and hold the key beside the
graph's nodes: a file whose key differs, or that cannot be read, is a miss and is overwritten.

What the key cannot see: modules the model file imports (e.g. a Hugging Face model's library code
beside ``examples/hf/hf.py``); delete the cache dir after changing those. A cached graph carries no
``ExportedProgram`` (``graph.exported`` is None): it is for planning, not for the executor.
The files are pickles: the cache dir must be the user's own (as ``~/.cache`` is).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from autoddl.atomic import write_bytes_atomic
from autoddl.graph import OpGraph

CACHE_ENV = "AUTODDL_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/autoddl")
TRACER_SOURCES = ("trace.py", "replicate.py", "flops.py", "graph.py", "moe.py", "precision.py", "loader.py")   # under autoddl/
FORMAT = 1                                       # bumped when the file layout changes


def cache_dir() -> Path:
    """Where traces are kept: ``$AUTODDL_CACHE_DIR``, else ``~/.cache/autoddl``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tracer_digest() -> str:
    """The hash of autoddl's tracer sources: a changed tracer misses every older trace."""
    here = Path(__file__).resolve().parent
    return _sha256(b"".join((here / name).read_bytes() for name in TRACER_SOURCES))


@dataclass(frozen=True)
class TraceKey:
    """Everything a traced graph depends on (module docstring)."""

    model_sha256: str            # the model file's bytes
    model_args: str              # its build arguments, as sorted JSON
    batch: int | None            # the micro-step batch traced (None: the file's own)
    param_dtype: str             # the precision policy traced under
    torch_version: str
    tracer_sha256: str

    @classmethod
    def of(cls, model_path: str | os.PathLike, model_args: dict[str, Any], batch: int | None,
           param_dtype: str) -> "TraceKey":
        return cls(_sha256(Path(model_path).read_bytes()), json.dumps(model_args, sort_keys=True, default=repr),
                   batch, str(param_dtype), torch.__version__, tracer_digest())

    @property
    def digest(self) -> str:
        return _sha256(json.dumps([FORMAT, asdict(self)], sort_keys=True).encode())[:32]

    def path(self) -> Path:
        return cache_dir() / "traces" / f"{self.digest}.pkl"


def load(key: TraceKey) -> OpGraph | None:
    """The graph stored under ``key``, or None (no file, another key in it, or unreadable)."""
    try:
        with open(key.path(), "rb") as f:
            stored = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:                              # a truncated or foreign file: trace again, overwrite it
        return None
    if not isinstance(stored, dict) or stored.get("format") != FORMAT or stored.get("key") != asdict(key):
        return None
    return OpGraph(stored["nodes"], model_name=stored["model_name"])


def store(key: TraceKey, graph: OpGraph) -> Path:
    """Keep ``graph`` under ``key`` (atomically); returns the file written."""
    path = key.path()
    data = pickle.dumps({"format": FORMAT, "key": asdict(key), "model_name": graph.model_name,
                         "nodes": list(graph.topo())}, protocol=pickle.HIGHEST_PROTOCOL)
    write_bytes_atomic(path, data)
    return path


def traced(model_path: str | os.PathLike, model_args: dict[str, Any], batch: int | None, param_dtype: str,
           trace: Callable[[], OpGraph], say: Callable[[str], None] = lambda _m: None) -> OpGraph:
    """The graph kept under this key, else ``trace()``, kept under it; ``say`` gets one line on a hit."""
    key = TraceKey.of(model_path, model_args, batch, param_dtype)
    graph = load(key)
    if graph is not None:
        say(f"trace cache: {graph.model_name} at batch {batch or 'of the file'} in {param_dtype} read from "
            f"{key.path()}")
        return graph
    graph = trace()
    store(key, graph)
    return graph
