"""Launch ranks with torch.distributed's own launcher (torchrun) and say which rank failed and why.

``launch(spec, worker_args)`` starts, in a subprocess (its own session, so the
whole tree can be killed), ``python -m executor.launch --failures-json F --
<torchrun args> -m executor.worker <worker_args>``: this module's ``main`` calls
``torch.distributed.run.main`` and, when a rank fails, writes torchrun's
failure records (global rank, exit code) to F. torchrun's agent watches its
ranks (every 0.1 s) and stops all of them as soon as one exits non-zero, so a
rank that raises or dies ends the run within seconds; a rank blocked in a
collective on a peer that is alive but stuck fails after the worker's
process-group timeout. Each failing worker also writes ``<error_dir>/rank<R>.json``
with its exception, which ``LaunchResult.failures`` merges with torchrun's
records: the message names the rank and the error. A rank killed by a fatal signal raises no
exception; :func:`record_fatal_signals`, which workers call first, has the fault handler write every
thread's Python stack to ``<error_dir>/fault<R>.txt`` then, and that is the rank's traceback.

Worker stdout (rank 0's progress) is passed through as it comes; stderr
(torchrun's logs, tracebacks) is kept and its tail returned, to print on failure.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

WORKER_MODULE = "executor.worker"
# errors a rank gets because a peer went away: a consequence, never the root cause
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|communicator was aborted|"
                        r"NCCL.*(abort|remote)|Socket Timeout", re.IGNORECASE)


@dataclass(frozen=True)
class LaunchSpec:
    """Where ranks run: ``nproc_per_node`` on each of ``nnodes``; this process is node ``node_rank``."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None   # None on one node: torchrun picks a free port
    omp_num_threads: int | None = None  # None: max(1, cores // nproc_per_node), unless set in the env
    timeout_s: float | None = None   # kill the whole launch after this long

    def __post_init__(self) -> None:
        problems = []
        if self.nproc_per_node < 1:
            problems.append(f"nproc_per_node={self.nproc_per_node} must be >= 1")
        if self.nnodes < 1:
            problems.append(f"nnodes={self.nnodes} must be >= 1")
        if not 0 <= self.node_rank < max(self.nnodes, 1):
            problems.append(f"node_rank={self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.master_port is None:
            problems.append(f"nnodes={self.nnodes} needs a master_port every node agrees on (--master-port)")
        if problems:
            raise ValueError("launch: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass(frozen=True)
class RankFailure:
    rank: int
    exitcode: int | None   # negative: killed by that signal
    error: str             # "Type: message" from the worker, else what the exit code says
    traceback: str = ""
    host: str = ""

    @property
    def secondary(self) -> bool:
        """This rank stopped because another one failed (a peer's connection closed, or torchrun's SIGTERM)."""
        return bool(_PEER_LOST.search(self.error)) or self.exitcode == -signal.SIGTERM

    def describe(self) -> str:
        where = f" on {self.host}" if self.host else ""
        if self.secondary:
            first = self.error.splitlines()[0] if self.error else ""
            return f"rank {self.rank}{where} stopped because another rank failed ({first[:160]})"
        return f"rank {self.rank}{where} failed: {self.error}"


@dataclass
class LaunchResult:
    returncode: int
    duration_s: float
    failures: list[RankFailure] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.failures and not self.timed_out

    def describe(self) -> str:
        """What went wrong, root cause first (the earliest worker error), in a few lines."""
        if self.ok:
            return "all ranks finished"
        lines = []
        if self.timed_out:
            lines.append(f"the launch ran past its timeout ({self.duration_s:.0f} s) and was killed")
        for f in self.failures:
            lines.append(f.describe())
        if not lines:
            lines.append(f"torchrun exited with code {self.returncode} and no rank reported an error; "
                         f"see its log below")
        return "\n".join(lines)


def default_omp_threads(nproc_per_node: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc_per_node)


def torchrun_args(spec: LaunchSpec) -> list[str]:
    args = [f"--nproc-per-node={spec.nproc_per_node}", f"--nnodes={spec.nnodes}", "--max-restarts=0"]
    if spec.nnodes > 1 or spec.master_port is not None:
        args += [f"--node-rank={spec.node_rank}", f"--master-addr={spec.master_addr}",
                 f"--master-port={spec.master_port}"]
    return args


def launch(spec: LaunchSpec, worker_args: Sequence[str], *, module: str = WORKER_MODULE,
           env: dict[str, str] | None = None, stdout: IO[str] | None = None) -> LaunchResult:
    """Run ``python -m module worker_args`` on every rank of this node through torchrun; wait for it."""
    stdout = stdout or sys.stdout
    run_env = dict(os.environ if env is None else env)
    if spec.omp_num_threads is not None:
        run_env["OMP_NUM_THREADS"] = str(spec.omp_num_threads)
    else:
        run_env.setdefault("OMP_NUM_THREADS", str(default_omp_threads(spec.nproc_per_node)))
    run_env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory(prefix="autoddl-launch-") as tmp:
        failures_json = Path(tmp) / "failures.json"
        error_dir = Path(tmp) / "errors"
        cmd = [sys.executable, "-m", "executor.launch", "--failures-json", str(failures_json), "--",
               *torchrun_args(spec), "-m", module, *worker_args, "--error-dir", str(error_dir)]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env,
                                start_new_session=True, bufsize=1)
        tail: collections.deque[str] = collections.deque(maxlen=200)
        readers = [threading.Thread(target=_pump, args=(proc.stdout, stdout.write, stdout.flush), daemon=True),
                   threading.Thread(target=_pump, args=(proc.stderr, tail.append), daemon=True)]
        for t in readers:
            t.start()
        timed_out = False
        try:
            proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc)
        except BaseException:  # KeyboardInterrupt: take every rank down with us
            _kill_tree(proc)
            raise
        for t in readers:
            t.join(5)
        duration = time.monotonic() - start
        failures = _failures(failures_json, error_dir)
        return LaunchResult(proc.returncode if not timed_out else -1, duration, failures,
                            [line.rstrip("\n") for line in tail], timed_out)


def _pump(stream: IO[str], sink, flush=None) -> None:
    for line in iter(stream.readline, ""):
        sink(line)
        if flush is not None:
            flush()


def _kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the launch's session (torchrun forwards it to the ranks), SIGKILL after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


_FAULT_FILE: IO[str] | None = None     # open for the process's life: the fault handler writes into it when it dies


def record_fatal_signals(error_dir: str) -> None:
    """In a launched rank: on a fatal signal (SIGSEGV, SIGABRT: glibc aborts a process whose heap it finds
    corrupted, SIGBUS, SIGFPE, SIGILL) every thread's Python stack goes to ``<error_dir>/fault<R>.txt``,
    which :func:`_failures` reports as the rank's traceback. Nothing without ``error_dir``."""
    global _FAULT_FILE
    if not error_dir:
        return
    Path(error_dir).mkdir(parents=True, exist_ok=True)
    _FAULT_FILE = open(Path(error_dir) / f"fault{os.environ.get('RANK', '-1')}.txt", "w")
    faulthandler.enable(file=_FAULT_FILE, all_threads=True)


def _fault_text(error_dir: Path, rank: int) -> str:
    """What the fault handler wrote when rank ``rank`` died of a signal ("" when it did not)."""
    try:
        return (error_dir / f"fault{rank}.txt").read_text()
    except OSError:
        return ""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exited without an exit code"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (the process died without a Python error: out of memory, a crash or a kill)"
    return f"exited with code {code}"


def _failures(failures_json: Path, error_dir: Path) -> list[RankFailure]:
    """Worker error files and torchrun's records, merged per rank; the earliest worker error first."""
    errors: dict[int, dict] = {}
    if error_dir.is_dir():
        for f in error_dir.glob("rank*.json"):
            try:
                data = json.loads(f.read_text())
                errors[int(data["rank"])] = data
            except (ValueError, KeyError, OSError):
                continue
    agent: dict[int, dict] = {}
    if failures_json.exists():
        try:
            agent = {int(k): v for k, v in json.loads(failures_json.read_text()).items()}
        except (ValueError, OSError):
            agent = {}
    out = []
    for rank in set(errors) | set(agent):
        e, a = errors.get(rank, {}), agent.get(rank, {})
        exitcode = a.get("exitcode")
        died = not e and exitcode is not None and exitcode < 0
        out.append(RankFailure(rank, exitcode, e.get("error") or _exit_text(exitcode),
                               _fault_text(error_dir, rank) if died else e.get("traceback", ""), e.get("host", "")))
    # root causes first (in the order their errors happened; a rank that died reported no time),
    # then the ranks that only stopped because of them
    when = {r: errors.get(r, {}).get("time", "") for r in errors}
    return sorted(out, key=lambda f: (f.secondary, when.get(f.rank, ""), f.rank))


# -- the agent process -----------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """``python -m executor.launch --failures-json F -- <torchrun args>``: torchrun, failures to F."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--failures-json" or argv[2] != "--":
        print("usage: python -m executor.launch --failures-json PATH -- <torchrun arguments>", file=sys.stderr)
        return 2
    failures_json, torchrun = Path(argv[1]), argv[3:]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(torchrun)
    except ChildFailedError as exc:
        records = {str(rank): {"exitcode": f.exitcode, "local_rank": f.local_rank, "pid": f.pid,
                               "message": f.message} for rank, f in exc.failures.items()}
        tmp = failures_json.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, failures_json)
        print(f"torchrun: {len(records)} rank(s) failed: {sorted(exc.failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
