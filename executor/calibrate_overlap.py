"""``autoddl calibrate --only collective_cpu``: the host CPU a collective takes from its ranks' compute,
per byte it sends (``links.*.cpu_ns_per_byte``; costmodel/simulate.py prices it).

On ``nproc`` local ranks (gloo on 127.0.0.1, ``threads`` intra-op threads each: as the executor runs
them), each repeat times, after a barrier, on every rank at once (``TRIES`` times, interleaved; the
least of each loop's tries is the repeat's):

- compute alone: ``matmuls`` float32 matmuls ``(M, K) @ (K, N)`` (``MATMUL_SHAPE``: a linear of the
  fidelity study's gpt-4x256, 8 x 128 tokens of width 256);
- collectives alone: ``collectives`` all-reduces of ``MESSAGE_BYTES`` (DDP's first gradient bucket)
  issued asynchronously on a process group of their own (the compiled executor syncs gradient buckets
  on one) and waited for at the end; its wall time, and the CPU time the rank's process spent
  meanwhile (``time.process_time``: every thread's, gloo's included, user + system, which holds the
  kernel's network stack run for the rank's sends);
- both: the same all-reduces issued asynchronously, then the same matmuls, then the wait.

``matmuls`` is chosen after a warm-up so that the compute alone lasts ``COVER`` times the collectives
alone (the collectives then run inside the compute, as an overlapped gradient bucket does). A
repeat's wall times are the slowest rank's least, its CPU time the ranks' mean least. The result,
``cpu_s``, is the median over repeats of that CPU per collective (:func:`median_cpu_s`); the CLI divides
it by the bytes a rank sent (costmodel/collectives.py ``cpu_ns_per_byte``, the inverse of the pricing).
Beside it, the compute the collectives cost in wall time, ``(both - compute) / collectives`` at least 0
(:func:`lost_compute_s`, median ``lost_s``), is reported as a cross-check: on loopback the two agree
(0.59 against 0.41-0.58 ns per byte), but across the testbed's 1 Gbit/s link that difference of two
half-second loops varied 3-5x between runs while the CPU time agreed within ~10% across runs and
rates. Locally the result is the median over several launches (where the OS placed the threads varies
between launches). Progress goes to stderr (rank 0).

``--across-hosts`` (:func:`measure_overlap_across_hosts`, in torchrun ranks under
benchmarks/two_hosts.py) runs the same loops on every rank with the all-reduces on the inter-host
groups (one rank per host, every group at once: a mesh axis across the hosts), so the kernel's CPU
for the link (TCP, the veth pair, the qdisc's shaping) is in it: the cost of the inter-host link.
"""

from __future__ import annotations

import math
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
    collective_cpu_s: float = 0.0      # the ranks' mean process CPU (all threads, user + system) during the collectives alone


@dataclass(frozen=True)
class OverlapResult:
    lost_s: float                      # median over repeats of the compute lost to one collective (wall)
    timings: tuple[OverlapTiming, ...]
    matmuls: int
    collectives: int
    nproc: int
    threads: int
    group_size: int                    # ranks of each all-reduce
    path: str = ""                     # where the all-reduces ran, when not on one group of all local ranks
    launches: int = 1                  # fresh launches, each its repeats; lost_s: the median of their medians
    cpu_s: float = 0.0                 # median over repeats (and launches) of the process CPU per collective


def lost_compute_s(t: OverlapTiming, collectives: int = COLLECTIVES) -> float:
    """The compute's slowdown beside the collectives, per collective, in seconds (at least 0)."""
    if t.collective_s <= 0:
        raise ValueError(f"lost_compute_s: the collectives alone took {t.collective_s} s; expected > 0")
    return max(0.0, t.both_s - t.compute_s) / collectives


def median_lost_s(timings: tuple[OverlapTiming, ...], collectives: int = COLLECTIVES) -> float:
    """The median over repeats of each repeat's :func:`lost_compute_s`."""
    return statistics.median(lost_compute_s(t, collectives) for t in timings)


def median_cpu_s(timings: tuple[OverlapTiming, ...], collectives: int = COLLECTIVES) -> float:
    """The median over repeats of the ranks' process CPU per collective, during the collectives alone."""
    return statistics.median(t.collective_cpu_s / collectives for t in timings)


def measure_overlap(nproc: int = 2, threads: int = 1, repeats: int = 7, launches: int = 5,
                    timeout_s: float = 300.0) -> OverlapResult:
    """Run the three loops (module docstring) on ``nproc`` local gloo ranks, ``launches`` times in fresh
    processes: the median over launches of each launch's median compute lost per collective (within a
    launch the repeats agree; between launches, where the OS placed the ranks' and gloo's threads, not)."""
    if nproc < 2:
        raise ValueError(f"calibrate --only collective_cpu: --nproc must be at least 2, got {nproc}")
    runs = [run_ranks(_rank, nproc, threads, repeats, timeout_s=timeout_s, threads=threads)[0]
            for _ in range(launches)]          # rank 0's: the times agreed, the slowest rank's
    per_launch = [tuple(OverlapTiming(*t) for t in run["times"]) for run in runs]
    lost = statistics.median(median_lost_s(t) for t in per_launch)
    return OverlapResult(lost, sum(per_launch, ()), runs[0]["matmuls"], COLLECTIVES, nproc, threads, nproc,
                         launches=launches, cpu_s=statistics.median(median_cpu_s(t) for t in per_launch))


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
                         path, cpu_s=median_cpu_s(timings))


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

    def timed_cpu(matmuls: int, collectives: bool) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds: every thread's, user + system) of one loop."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        works = [dist.all_reduce(x, group=group, async_op=True) for x in bufs] if collectives else []
        compute(matmuls)
        for w in works:
            w.wait()
        return time.perf_counter() - t0, time.process_time() - c0

    def timed(matmuls: int, collectives: bool) -> float:
        return timed_cpu(matmuls, collectives)[0]

    def agree(x: float, mean: bool = False) -> float:
        """The slowest rank's ``x`` (``mean``: the ranks' mean)."""
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if mean else dist.ReduceOp.MAX)
        return float(t.item()) / (dist.get_world_size() if mean else 1)

    compute(3)
    timed(0, True)                                                    # warm-up: connections, buffers
    one = agree(min(timed(4, False) for _ in range(3)) / 4)
    alone = agree(min(timed(0, True) for _ in range(3)))
    matmuls = max(4, round(COVER * alone / one))
    for _ in range(3):          # a cold first estimate gives too few: the compute must outlast the collectives
        took = agree(min(timed(matmuls, False) for _ in range(3)))
        if took >= COVER * alone * 0.9:
            break
        matmuls = math.ceil(matmuls * COVER * alone / took)
    say(f"{nproc_text(dist.get_world_size(), threads)}; {COLLECTIVES} all-reduces of {MESSAGE_BYTES / 1e6:g} MB "
        f"~{alone * 1e3:.1f} ms, {matmuls} matmuls {m}x{k} @ {k}x{n} ~{matmuls * one * 1e3:.1f} ms")
    times = []
    for i in range(repeats):
        tries = [(timed(matmuls, False), *timed_cpu(0, True), timed(matmuls, True)) for _ in range(TRIES)]
        # the least of each (outside load only adds): walls the slowest rank's, the CPU the ranks' mean
        t = (*(agree(min(x[j] for x in tries)) for j in (0, 1, 3)), agree(min(x[2] for x in tries), mean=True))
        times.append(t)
        say(f"repeat {i + 1}/{repeats}: compute {t[0] * 1e3:.1f} ms, collectives {t[1] * 1e3:.1f} ms "
            f"(CPU {t[3] * 1e3:.1f} ms), both {t[2] * 1e3:.1f} ms")
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
            f"{result.collectives}: "
            + (f"median over {result.launches} launches of the median of {len(result.timings) // result.launches} "
               "repeats" if result.launches > 1 else f"median of {len(result.timings)} repeats")
            + f" {result.lost_s * 1e3:.3g} ms (medians: compute {med[0]:.1f} ms, collectives {med[1]:.1f} ms, both "
            f"{med[2]:.1f} ms); the ranks' process CPU (all threads, user + system, mean over ranks) per all-reduce "
            f"during the all-reduces alone, the same medians: {result.cpu_s * 1e3:.3g} ms")
