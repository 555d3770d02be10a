"""Launch N gloo processes on 127.0.0.1 (tests, calibration), with a timeout that kills every rank.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, sets the
torchrun environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
OMP_NUM_THREADS=threads) in each, calls ``fn(*args)`` there and returns each rank's return
value (passed back through a pickle file). The default start method is "fork": ranks
inherit the parent's imports and objects (a traced graph, an ExportedProgram), which
makes a launch take a fraction of a second instead of re-importing torch and
re-tracing in every rank (~15 s on 2 cores); the parent must not have initialised a
process group. With "spawn", ``fn`` and ``args`` must be picklable. A rank that raises makes the
whole call raise with that rank's traceback; a run that exceeds ``timeout_s`` is
killed (all ranks) and raises ``TimeoutError`` -- tests never hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, args: tuple, rank: int, world_size: int, port: int, out_dir: str,
               threads: int) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": str(threads),
    })
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        import torch

        from executor.allocator import keep_freed_memory

        keep_freed_memory()     # as the worker's ranks do: calibrated as the plans run (executor/allocator.py)
        torch.set_num_threads(threads)
        result = ("ok", fn(*args))
    except BaseException:  # report every failure, including SystemExit, to the parent
        result = ("error", traceback.format_exc())
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, out)


def _any_failed(procs: list, out_dir: str) -> bool:
    for r, p in enumerate(procs):
        if p.is_alive():
            continue
        path = Path(out_dir) / f"rank{r}.pkl"
        if not path.exists():
            return True  # died without writing a result (killed, segfault)
        with open(path, "rb") as f:
            if pickle.load(f)[0] == "error":
                return True
    return False


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 60.0,
              start_method: str = "fork", threads: int = 1) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return their results, rank order."""
    ctx = mp.get_context(start_method)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="autoddl-ranks-") as out_dir:
        procs = [ctx.Process(target=_rank_main, args=(fn, args, r, world_size, port, out_dir, threads),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        alive: list[int] = []
        try:
            while True:
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                if not alive or time.monotonic() > deadline or _any_failed(procs, out_dir):
                    break  # a failed rank leaves the others blocked in a collective: stop them all
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results, errors = [], []
        for r in range(world_size):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"--- rank {r} ---\n{value}")
            results.append(value if status == "ok" else None)
        if errors:
            raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(errors))
        if alive and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {alive} of {world_size} still running after {timeout_s:.0f} s; "
                               f"killed all ranks (a collective probably hung: mismatched plans across ranks?)")
        missing = [r for r, v in enumerate(results) if v is None and not (Path(out_dir) / f"rank{r}.pkl").exists()]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            raise RuntimeError(f"ranks {missing} exited without a result (exit codes {codes})")
        return results
