"""Schedule many jobs' shard tasks on the devices of one cluster: sharded-LRTF, and two baselines.

**Sharded-LRTF** (Nagrecha & Kumar, "Hydra: A System for Large Multi-Model Deep Learning",
arXiv:2110.08633, 2021: longest-remaining-time-first over model shards): whenever a device
is free it takes the next task of the job with the longest remaining time (the compute of its
tasks not yet placed) among the jobs whose next task is ready (its previous task has ended) and
may run there (a backward runs where its forward did, autoddl/shard_program.py); ties go to the
job listed first. A task starts once the device is free and its inputs have arrived: the bytes of
``JobPlacement.task_inputs``, each message priced by ``transfer_s(src, dst, nbytes)`` and received
one after another, from the moment the task is placed.

With ``prefetch`` (Hydra's double-buffering) a device places its *next* task when its current
one starts, so that task's transfers overlap the current compute; a device that finds no ready
job then tries again when the next running task ends. At one instant, devices that are free choose
before devices that look ahead (a busy device never takes a job an idle one could start now).
Without prefetch a device places a task only when it is free. Links are not contended (each message takes its alpha-beta time).

A spilled job's task (autoddl/shard_program.py: ``ShardedJob.host_copies``) also loads its shard
from host memory on the device's ``copy_h2d`` stream (autoddl/offload.py's ``copy_stream``: one
copy engine each way, copies one after another in placement order), from the moment it is placed
and once the shard's last write-back has ended, and starts once the load has ended; a backward's
write-back follows its end on the ``copy_d2h`` stream. Each copy is priced by ``host_copy_s(nbytes)``
(``costmodel.host.host_copy_time_s``). With prefetch the load of the next task overlaps the current
compute, so a device holds at most the running shard and the next one (and the activations its
jobs keep for their backwards); the makespan counts the last write-back.

**Memory** (given ``memory_bytes``, one device's): what a device holds over time is
autoddl/shard_memory.py's (running and prefetched shards, gradients, saved activations, resident
non-spilled shards). A task is placed only if its device stays within ``memory_bytes`` from then on
(bytes whose release is not yet known count as held for good); a ready job whose next task does not
fit is passed over for the next one by LRTF order, and when none fits the device tries again at the
next moment it lets bytes go (a prefetch is thus skipped, or delayed until the current task or a
write-back ends). Before scheduling, a shard whose backward alone does not fit one device is an
error naming the job, shard and bytes; a schedule that stops with every device holding bytes of
jobs that cannot go on (greedy placement does not look ahead) is an error too.

Baselines (finish time per job and the makespan), from each job's solo times:

- ``sequential``: one job at a time on all devices with its own best plan, in the listed order:
  job j finishes at the sum of ``steps x step_s`` of jobs 0..j;
- ``one_per_device``: each job alone on one device (when it fits), assigned longest first to the
  least loaded device (LPT; ties: lower device); the makespan is the most loaded device.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

from autoddl.shard_memory import MemoryLedger, schedule_memory, shard_need_bytes
from autoddl.shard_program import JobPlacement, ScheduledTask, ShardedJob, device_order

TransferFn = Callable[[int, int, int], float]
HostCopyFn = Callable[[int], float]


@dataclass
class Schedule:
    """Tasks in the order they were placed; per device they are in start order."""

    jobs: list[ShardedJob]
    devices: int
    tasks: list[ScheduledTask] = field(default_factory=list)

    @property
    def makespan_s(self) -> float:
        return max((t.done_s for t in self.tasks), default=0.0)

    def finish_s(self) -> list[float]:
        """Per job, when its last task (and its write-back) ends."""
        out = [0.0] * len(self.jobs)
        for t in self.tasks:
            out[t.job] = max(out[t.job], t.done_s)
        return out

    def on_device(self, device: int) -> list[ScheduledTask]:
        return device_order(self.tasks, device)

    def peak_memory_bytes(self) -> list[int]:
        """Per device, the most bytes it holds at once (autoddl/shard_memory.py)."""
        ledger = self.memory()
        return [ledger.peak_bytes(d) for d in range(self.devices)]

    def memory(self) -> MemoryLedger:
        """What each device holds over time (autoddl/shard_memory.py)."""
        return schedule_memory(self.jobs, self.tasks, self.devices)

    def busy_fraction(self) -> float:
        """Compute time over devices x makespan."""
        busy = sum(t.end_s - t.start_s for t in self.tasks)
        return busy / (self.devices * self.makespan_s) if self.makespan_s else 0.0


class _JobState:
    def __init__(self, job: ShardedJob):
        self.keys = list(job.tasks())
        self.durations = [job.duration_s(k) for k in self.keys]
        self.left = [sum(self.durations[i:]) for i in range(len(self.keys))] + [0.0]
        self.next = 0
        self.ready_s = 0.0
        self.placement = JobPlacement(job)
        self.host_ready_s = [0.0] * job.shards       # when each shard's last write-back ended

    @property
    def done(self) -> bool:
        return self.next == len(self.keys)


class _DeviceState:
    def __init__(self) -> None:
        self.free_s = 0.0
        self.h2d_free_s = 0.0
        self.d2h_free_s = 0.0
        self.last: tuple[int, int] | None = None     # (job, shard) of the task placed last


def lrtf_schedule(jobs: Sequence[ShardedJob], devices: int, transfer_s: TransferFn, *,
                  prefetch: bool = True, host_copy_s: HostCopyFn | None = None,
                  memory_bytes: float | None = None) -> Schedule:
    """The sharded-LRTF schedule of every task of ``jobs`` on ``devices`` (module docstring);
    ``host_copy_s``: seconds of one host copy, needed when a job is spilled; ``memory_bytes``: each
    device's memory (None: not limited)."""
    if devices < 1:
        raise ValueError(f"need at least one device to schedule on, got {devices}")
    spilled = [j.name for j in jobs if j.spill]
    if spilled and host_copy_s is None:
        raise ValueError(f"jobs {spilled} are spilled to host memory but no host copy price was given "
                         "(the cluster needs a host_link)")
    if memory_bytes is not None:
        _require_one_task_fits(jobs, memory_bytes)
    states = [_JobState(j) for j in jobs]
    out = Schedule(list(jobs), devices)
    dev = [_DeviceState() for _ in range(devices)]
    ledger = MemoryLedger(jobs, devices)

    def event(time: float, d: int) -> tuple[float, int, int]:
        return time, int(dev[d].free_s > time), d          # at one instant, free devices choose before busy ones

    events = [event(0.0, d) for d in range(devices)]     # the device places a task then
    sleeping: set[int] = set()
    while events:
        now, _, d = heapq.heappop(events)
        task, blocked = _pick(states, d, now, dev[d], transfer_s, host_copy_s, ledger, memory_bytes)
        if task is None:
            later = [s.ready_s for s in states if not s.done and s.ready_s > now]
            if blocked:                                  # ready but too big for now: try when bytes go
                later += ledger.releases_after(d, now) + [dev[d].free_s] * (dev[d].free_s > now)
            if later:
                heapq.heappush(events, event(min(later), d))
            else:
                sleeping.add(d)
            continue
        _commit(states[task.job], dev[d], task)
        ledger.add(task)
        out.tasks.append(task)
        for e in sleeping:
            heapq.heappush(events, event(task.end_s, e))
        sleeping.clear()
        heapq.heappush(events, event(task.start_s if prefetch else task.end_s, d))
    left = [jobs[i].name for i, s in enumerate(states) if not s.done]
    if left and memory_bytes is not None:
        raise ValueError(f"sharded-LRTF cannot place the next tasks of jobs {left} on any device: each device's "
                         f"{memory_bytes / 1e9:.3g} GB is taken by the shards and saved activations of jobs waiting "
                         f"for their next tasks (greedy placement does not look ahead; peak "
                         f"{', '.join(f'dev{d} {ledger.peak_bytes(d) / 1e9:.3g} GB' for d in range(devices))}); "
                         "cut the jobs into more shards (shards:), keep them in host memory (spill: host), "
                         "give them smaller batches or schedule fewer jobs at once")
    if left:
        raise RuntimeError(f"sharded-LRTF left tasks of {left} unplaced (a scheduler bug)")
    return out


def _require_one_task_fits(jobs: Sequence[ShardedJob], memory_bytes: float) -> None:
    """An error naming the first shard whose backward alone does not fit one device."""
    for job in jobs:
        for s in range(job.shards):
            need = shard_need_bytes(job, s)
            if need > memory_bytes:
                raise ValueError(
                    f"job {job.name!r}: shard {s} needs {need / 1e9:.3g} GB on one device for its backward "
                    f"(parameters and their gradients {2 * job.param_bytes[s] / 1e9:.3g} GB, optimizer states "
                    f"{job.states_of(s) / 1e9:.3g} GB, saved activations "
                    f"{job.activations_of(s) / 1e9:.3g} GB), above the device's "
                    f"{memory_bytes / 1e9:.3g} GB; cut the job into more shards (shards:), "
                    f"{'' if job.spill else 'keep it in host memory (spill: host), '}or give it a smaller batch")


def _pick(states: list[_JobState], device: int, now: float, dev: _DeviceState, transfer_s: TransferFn,
          host_copy_s: HostCopyFn | None, ledger: MemoryLedger, memory_bytes: float | None
          ) -> tuple[ScheduledTask | None, bool]:
    """The next task of the ready job with the longest remaining time whose next task may run on
    ``device`` and fits its memory; and whether a ready job was passed over for memory."""
    ready = [j for j, s in enumerate(states)
             if not s.done and s.ready_s <= now and s.placement.allowed(s.keys[s.next], device)]
    for j in sorted(ready, key=lambda i: (-states[i].left[states[i].next], i)):
        task = _plan(states[j], j, device, now, dev, transfer_s, host_copy_s)
        if memory_bytes is None or ledger.fits(task, memory_bytes):
            return task, False
    return None, bool(ready)


def _plan(state: _JobState, j: int, device: int, now: float, dev: _DeviceState, transfer_s: TransferFn,
          host_copy_s: HostCopyFn | None) -> ScheduledTask:
    """The job's next task placed on ``device`` at ``now`` (nothing changed)."""
    key = state.keys[state.next]
    inbox = state.placement.task_inputs(key, device)
    moved = sum(transfer_s(m.src, device, m.nbytes) for m in inbox)
    load, writeback = state.placement.job.host_copies(key, dev.last == (j, key.shard))
    load_start = load_end = now
    if load:
        load_start = max(now, dev.h2d_free_s, state.host_ready_s[key.shard])
        load_end = load_start + host_copy_s(load)
    start = max(dev.free_s, now + moved, load_end)
    end = start + state.durations[state.next]
    wb_start = wb_end = 0.0
    if writeback:
        wb_start = max(end, dev.d2h_free_s)
        wb_end = wb_start + host_copy_s(writeback)
    return ScheduledTask(j, key, device, start, end, moved, inbox, load, load_start if load else 0.0,
                         load_end if load else 0.0, writeback, wb_start, wb_end, placed_s=now)


def _commit(state: _JobState, dev: _DeviceState, task: ScheduledTask) -> None:
    """Place ``task`` (from :func:`_plan`): the device's streams and the job move on."""
    dev.free_s = task.end_s
    if task.load_bytes:
        dev.h2d_free_s = task.load_end_s
    if task.writeback_bytes:
        dev.d2h_free_s = state.host_ready_s[task.key.shard] = task.writeback_end_s
    dev.last = (task.job, task.key.shard)
    state.placement.place(task.key, task.device)
    state.next += 1
    state.ready_s = task.end_s


# -- baselines ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BaselineResult:
    name: str
    finish_s: tuple[float, ...] | None        # per job; None: not applicable
    reason: str = ""
    device_of: tuple[int, ...] = ()           # one_per_device: the device each job ran on

    @property
    def makespan_s(self) -> float | None:
        return max(self.finish_s, default=0.0) if self.finish_s is not None else None


def sequential(solo_total_s: Sequence[float]) -> BaselineResult:
    """One job after another, each on all devices (``solo_total_s``: steps x its best plan's step)."""
    finish, at = [], 0.0
    for t in solo_total_s:
        at += t
        finish.append(at)
    return BaselineResult("sequential", tuple(finish))


def one_per_device(one_device_total_s: Sequence[float], fits: Sequence[bool], devices: int,
                   names: Sequence[str]) -> BaselineResult:
    """Each job alone on one device, longest first onto the least loaded device (module docstring)."""
    too_big = [n for n, ok in zip(names, fits) if not ok]
    if too_big:
        return BaselineResult("one_per_device", None, f"{', '.join(too_big)} do not fit one device's memory")
    load = [0.0] * devices
    finish = [0.0] * len(one_device_total_s)
    device_of = [0] * len(one_device_total_s)
    for j in sorted(range(len(one_device_total_s)), key=lambda i: (-one_device_total_s[i], i)):
        d = min(range(devices), key=lambda k: (load[k], k))
        load[d] += one_device_total_s[j]
        finish[j], device_of[j] = load[d], d
    return BaselineResult("one_per_device", tuple(finish), device_of=tuple(device_of))
