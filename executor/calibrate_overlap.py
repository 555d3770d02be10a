"""``autoddl calibrate --only collective_cpu``: the host CPU a collective takes from its ranks' compute,
per byte it sends (``links.*.cpu_ns_per_byte``; costmodel/simulate.py prices it).

On ``nproc`` local ranks (gloo on 127.0.0.1, ``threads`` intra-op threads each: as the executor runs
them), each repeat times, after a barrier, on every rank at once (``TRIES`` times, interleaved; the
least of each loop's tries is the repeat's):

- compute alone: ``matmuls`` float32 matmuls ``(M, K) @ (K, N)`` (``MATMUL_SHAPE``: a linear of the
  fidelity study's gpt-4x256, 8 x 128 tokens of width 256);
- collectives alone: ``collectives`` all-reduces of ``MESSAGE_BYTES`` (DDP's first gradient bucket)
  issued asynchronously on a process group of their own (the compiled executor syncs gradient buckets
  on one) and waited for at the end;
- both: the same all-reduces issued asynchronously, then the same matmuls, then the wait.

``matmuls`` is chosen after a warm-up so that the compute alone lasts ``COVER`` times the collectives
alone (the collectives then run inside the compute, as an overlapped gradient bucket does). A
repeat's time of each loop is the slowest rank's least; the compute it lost to one collective is
``(both - compute) / collectives``, at least 0 (:func:`lost_compute_s`), and the result is the median
over repeats. The CLI turns it into nanoseconds per byte sent (costmodel/collectives.py
``cpu_ns_per_byte``, the inverse of the pricing). Progress goes to stderr (rank 0).

``--across-hosts`` (:func:`measure_overlap_across_hosts`, in torchrun ranks under
benchmarks/two_hosts.py) runs the same loops on every rank with the all-reduces on the inter-host
groups (one rank per host, every group at once: a mesh axis across the hosts), so the kernel's CPU
for the link (TCP, softirq, the qdisc's shaping) is in it: the cost of the inter-host link.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from executor.local_ranks import run_ranks

MATMUL_SHAPE = (1024, 256, 256)      # (M, N, K)
MESSAGE_BYTES = 1_000_000            # DDP's first bucket (autoddl.lowering.FIRST_BUCKET_BYTES)
COLLECTIVES = 8                      # all-reduces per timed loop
COVER = 2.0                          # compute alone lasts this many times the collectives alone
TRIES = 3                            # a repeat's time of each loop: the least of this many, interleaved


@dataclass(frozen=True)
class OverlapTiming:
    """One repeat, seconds (the slowest rank's): each loop alone and both at once."""

    compute_s: float
    collective_s: float
    both_s: float


@dataclass(frozen=True)
class OverlapResult:
    lost_s: float                      # median over repeats of the compute lost to one collective
    timings: tuple[OverlapTiming, ...]
    matmuls: int
    collectives: int
    nproc: int
    threads: int
    group_size: int                    # ranks of each all-reduce
    path: str = ""                     # where the all-reduces ran, when not on one group of all local ranks


def lost_compute_s(t: OverlapTiming, collectives: int = COLLECTIVES) -> float:
    """The compute's slowdown beside the collectives, per collective, in seconds (at least 0)."""
    if t.collective_s <= 0:
        raise ValueError(f"lost_compute_s: the collectives alone took {t.collective_s} s; expected > 0")
    return max(0.0, t.both_s - t.compute_s) / collectives


def median_lost_s(timings: tuple[OverlapTiming, ...], collectives: int = COLLECTIVES) -> float:
    """The median over repeats of each repeat's :func:`lost_compute_s`."""
    return statistics.median(lost_compute_s(t, collectives) for t in timings)


def measure_overlap(nproc: int = 2, threads: int = 1, repeats: int = 15, timeout_s: float = 300.0) -> OverlapResult:
    """Run the three loops (module docstring) on ``nproc`` local gloo ranks; the median compute lost per collective."""
    if nproc < 2:
        raise ValueError(f"calibrate --only collective_cpu: --nproc must be at least 2, got {nproc}")
    ranks = run_ranks(_rank, nproc, threads, repeats, timeout_s=timeout_s, threads=threads)
    timings = tuple(OverlapTiming(*ranks[0]["times"][i]) for i in range(repeats))     # agreed: the slowest rank's
    return OverlapResult(median_lost_s(timings), timings, ranks[0]["matmuls"], COLLECTIVES, nproc, threads, nproc)


def measure_overlap_across_hosts(threads: int = 1, repeats: int = 15) -> OverlapResult | None:
    """Inside torchrun ranks on several hosts (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_* set): the
    loops with the all-reduces on the inter-host groups, all at once; rank 0 gets the result."""
    import torch.distributed as dist

    from executor.calibrate_hosts import host_groups, torchrun_hosts

    world, per_node = torchrun_hosts("calibrate --across-hosts --only collective_cpu")
    inter = host_groups(world, per_node)[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    times = _loops(dist.new_subgroups_by_enumeration(inter)[0], threads, repeats)
    if int(os.environ["RANK"]) != 0:
        return None
    rate = os.environ.get("TWO_HOSTS_RATE_MBIT", "?")
    path = (f"{world // per_node} hosts x {per_node} ranks (benchmarks/two_hosts.py), the all-reduces on the "
            f"{len(inter)} inter-host groups {inter} at once across the tbf {rate} Mbit/s link")
    timings = tuple(OverlapTiming(*t) for t in times["times"])
    return OverlapResult(median_lost_s(timings), timings, times["matmuls"], COLLECTIVES, world, threads, len(inter[0]),
                         path)


def _rank(threads: int, repeats: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    return _loops(dist.new_group(list(range(dist.get_world_size()))), threads, repeats)   # the collectives' own


def _loops(group: object, threads: int, repeats: int) -> dict:
    """The three loops (module docstring) in this rank, the all-reduces on ``group``; destroys the process group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rank = dist.get_rank()
    m, n, k = MATMUL_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    bufs = [torch.ones(MESSAGE_BYTES // 4) for _ in range(COLLECTIVES)]

    def say(text: str) -> None:
        if rank == 0:
            print(f"calibrate collective_cpu: {text}", file=sys.stderr, flush=True)

    def compute(count: int) -> None:
        for _ in range(count):
            torch.mm(a, b)

    def timed(matmuls: int, collectives: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(x, group=group, async_op=True) for x in bufs] if collectives else []
        compute(matmuls)
        for w in works:
            w.wait()
        return time.perf_counter() - t0

    def agree(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    compute(3)
    timed(0, True)                                                    # warm-up: connections, buffers
    one = agree(min(timed(4, False) for _ in range(3)) / 4)
    alone = agree(min(timed(0, True) for _ in range(3)))
    matmuls = max(4, round(COVER * alone / one))
    say(f"{nproc_text(dist.get_world_size(), threads)}; {COLLECTIVES} all-reduces of {MESSAGE_BYTES / 1e6:g} MB "
        f"~{alone * 1e3:.1f} ms, {matmuls} matmuls {m}x{k} @ {k}x{n} ~{matmuls * one * 1e3:.1f} ms")
    times = []
    for i in range(repeats):
        tries = [(timed(matmuls, False), timed(0, True), timed(matmuls, True)) for _ in range(TRIES)]
        t = tuple(agree(min(x[j] for x in tries)) for j in range(3))    # the least of each: outside load only adds
        times.append(t)
        say(f"repeat {i + 1}/{repeats}: compute {t[0] * 1e3:.1f} ms, collectives {t[1] * 1e3:.1f} ms, "
            f"both {t[2] * 1e3:.1f} ms")
    dist.destroy_process_group()
    return {"times": times, "matmuls": matmuls}


def nproc_text(nproc: int, threads: int) -> str:
    return f"{nproc} gloo ranks, {threads} thread{'s' * (threads > 1)} each"


def describe(result: OverlapResult, command: str) -> str:
    """The YAML comment for the measured field: how it was measured and the median times."""
    med = [statistics.median(getattr(t, f) for t in result.timings) * 1e3
           for f in ("compute_s", "collective_s", "both_s")]
    return (f"measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC by `{command}` "
            f"(load average {os.getloadavg()[0]:.1f}): {nproc_text(result.nproc, result.threads)}"
            + (f"; {result.path}: " if result.path else ", ")
            + f"{result.collectives} async all-reduces of {MESSAGE_BYTES / 1e6:g} MB on their own group of "
            f"{result.group_size} beside {result.matmuls} matmuls {MATMUL_SHAPE[0]}x{MATMUL_SHAPE[2]} @ "
            f"{MATMUL_SHAPE[2]}x{MATMUL_SHAPE[1]}; compute lost per all-reduce, (both - compute alone) / "
            f"{result.collectives}: median of {len(result.timings)} repeats {result.lost_s * 1e3:.3g} ms (medians: "
            f"compute {med[0]:.1f} ms, collectives {med[1]:.1f} ms, both {med[2]:.1f} ms)")
