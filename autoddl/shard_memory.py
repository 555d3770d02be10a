"""What each device holds while it runs a shard schedule (Hydra's memory): bytes over time per device.

A device's memory is a sum of intervals, each held from a time to a later one (``MemoryLedger``
adds a placed task's; the scheduler asks it whether a task fits before placing it, and the same
ledger replayed over a finished schedule gives each device's peak):

- **activations**: a forward of shard s keeps its saved activations (``ShardedJob.activation_bytes[s]``,
  from ``search.stages.block_costs``: one micro-batch, the job's batch) from its start until the end
  of the same step's backward of s (which runs on the same device);
- **gradients**: a backward holds a gradient per parameter of its shard (``param_bytes[s]``) from
  its start to its end (the shard's update ends the backward);
- **a spilled shard** (parameters, and for a backward its optimizer states) is on the device from
  the start of its load (host -> device; with prefetch during the previous task: the prefetched
  shard) until its forward ends or its backward's write-back ends; a task that finds the shard
  resident (the device's previous task was the same shard, so nothing was loaded) holds it from
  the moment the previous task let it go, so the shard is counted once and without a gap (and
  until the later of its own end and the previous write-back's, when that outlasts it);
- **a non-spilled shard** (parameters and optimizer states, ``param_bytes + state_bytes``) is on the
  device of its forward from the moment that forward is placed (its parameters start arriving) until
  the shard's next forward on another device starts (they were sent there) or the job's last
  backward of the shard ends (the job is done; its shards are no longer counted).

An interval holds [start, end): at one instant releases come before acquisitions (a task starts once
the one before it has ended). An interval whose end is not known yet (a forward's activations before
its backward is placed, a non-spilled shard before it moves) is held forever until it is. Not
counted: the receive buffers of messages (flows' activations and gradients), the framework's
workspace, every rank's initial copy of the weights in the executor.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

from autoddl.shard_program import BACKWARD, FORWARD, ScheduledTask, ShardedJob


def shard_need_bytes(job: ShardedJob, shard: int) -> int:
    """The most one task of ``shard`` holds alone on an empty device: its backward's parameters,
    gradients, optimizer states and the activations its forward kept (module docstring)."""
    return 2 * job.param_bytes[shard] + job.states_of(shard) + job.activations_of(shard)


@dataclass
class _Interval:
    device: int
    start_s: float
    end_s: float            # math.inf: not known yet
    nbytes: int


@dataclass
class MemoryLedger:
    """The intervals of the tasks placed so far (module docstring), per device."""

    jobs: Sequence[ShardedJob]
    devices: int
    intervals: list[_Interval] = field(default_factory=list)
    _active: dict[int, list[_Interval]] = field(default_factory=dict)  # not ended before the latest check
    _open: dict[tuple, _Interval] = field(default_factory=dict)       # activations / a non-spilled shard
    _last: dict[int, ScheduledTask] = field(default_factory=dict)     # each device's latest task
    _let_go: dict[int, float] = field(default_factory=dict)           # when it lets that task's spilled shard go
    _profiles: dict[int, _Profile] = field(default_factory=dict)

    def add(self, task: ScheduledTask) -> None:
        """Record ``task`` (placed after every task already added)."""
        opens, closes = self._effects(task)
        for key, end in closes:
            if key in self._open:                 # (an interval of no bytes was never opened)
                self._open.pop(key).end_s = end
        for key, iv in opens:
            self.intervals.append(iv)
            self._active.setdefault(iv.device, []).append(iv)
            if key is not None:
                self._open[key] = iv
        if self.jobs[task.job].spill:
            self._let_go[task.device] = self._lets_go(task)
        self._last[task.device] = task
        self._profiles.clear()

    def fits(self, task: ScheduledTask, limit_bytes: float) -> bool:
        """Whether adding ``task`` keeps its device at or under ``limit_bytes`` from its placement on
        (the scheduler asks in time order: intervals ended by then are dropped for good)."""
        opens, closes = self._effects(task)
        new = [iv for _, iv in opens if iv.device == task.device]
        if not new:
            return True
        now = task.placed_s
        active = self._active[task.device] = [iv for iv in self._active.get(task.device, []) if iv.end_s > now]
        ended = {id(self._open[key]): end for key, end in closes if key in self._open}
        held = [_Interval(iv.device, iv.start_s, ended.get(id(iv), iv.end_s), iv.nbytes) for iv in active] + new
        return _Profile(held).peak(now) <= limit_bytes

    def releases_after(self, device: int, time_s: float) -> list[float]:
        """The known times after ``time_s`` at which ``device`` lets bytes go."""
        return [iv.end_s for iv in self._active.get(device, []) if time_s < iv.end_s < math.inf]

    def peak_bytes(self, device: int, from_s: float = -math.inf, to_s: float = math.inf) -> int:
        """The most bytes ``device`` holds at once in [``from_s``, ``to_s``)."""
        if device not in self._profiles:
            self._profiles[device] = _Profile([iv for iv in self.intervals if iv.device == device])
        return int(self._profiles[device].peak(from_s, to_s))

    def _effects(self, task: ScheduledTask) -> tuple[list[tuple[tuple | None, _Interval]], list[tuple[tuple, float]]]:
        """(intervals ``task`` opens, keyed when their end is not known yet; open intervals it closes)."""
        job, key, d = self.jobs[task.job], task.key, task.device
        s = key.shard
        opens: list[tuple[tuple | None, _Interval]] = []
        closes: list[tuple[tuple, float]] = []
        if key.kind == FORWARD:
            opens.append((("act", task.job, key.step, s), _Interval(d, task.start_s, math.inf, job.activations_of(s))))
        else:
            closes.append((("act", task.job, key.step, s), task.end_s))
            opens.append((None, _Interval(d, task.start_s, task.end_s, job.param_bytes[s])))
        if job.spill:
            opens += [(None, iv) for iv in self._spilled(job, task)]
        else:
            home = ("shard", task.job, s)
            where = self._open.get(home)
            if key.kind == FORWARD and (where is None or where.device != d):
                if where is not None:
                    closes.append((home, task.start_s))
                opens.append((home, _Interval(d, task.placed_s, math.inf, job.param_bytes[s] + job.states_of(s))))
            if key.kind == BACKWARD and key.step == job.steps - 1:
                closes.append((home, task.end_s))
        return [(k, iv) for k, iv in opens if iv.nbytes and iv.end_s > iv.start_s], closes

    def _spilled(self, job: ShardedJob, task: ScheduledTask) -> list[_Interval]:
        """A spilled shard's intervals on the task's device (module docstring)."""
        d, s = task.device, task.key.shard
        out = [_Interval(d, task.load_start_s, self._lets_go(task), task.load_bytes)] if task.load_bytes else []
        prev = self._last.get(d)
        if prev is not None and (prev.job, prev.key.shard) == (task.job, s):      # resident: nothing loaded for it
            out.append(_Interval(d, self._let_go[d], self._lets_go(task), job.param_bytes[s]))
        return out

    def _lets_go(self, task: ScheduledTask) -> float:
        """When the task's device lets its spilled shard go: after the task or its write-back, or
        later when the shard was already held until then (a write-back outlasting the next task)."""
        own = task.writeback_end_s if task.key.kind == BACKWARD else task.end_s
        prev = self._last.get(task.device)
        if prev is not None and (prev.job, prev.key.shard) == (task.job, task.key.shard):
            return max(own, self._let_go[task.device])
        return own


class _Profile:
    """Bytes held over time by ``intervals``: after each event, in time order (releases before
    acquisitions at a tie: a task starts once the one before it has ended)."""

    def __init__(self, intervals: Sequence[_Interval]):
        events = sorted([(iv.start_s, iv.nbytes) for iv in intervals] +
                        [(iv.end_s, -iv.nbytes) for iv in intervals if iv.end_s < math.inf])
        self.times = [t for t, _ in events]
        self.held = list(itertools.accumulate(delta for _, delta in events))

    def peak(self, from_s: float, to_s: float = math.inf) -> float:
        """The most bytes held at once in [``from_s``, ``to_s``)."""
        first = bisect.bisect_right(self.times, from_s)           # events after from_s
        at_from = self.held[first - 1] if first else 0
        return max([at_from] + self.held[first:bisect.bisect_left(self.times, to_s)])


def schedule_memory(jobs: Sequence[ShardedJob], tasks: Sequence[ScheduledTask], devices: int) -> MemoryLedger:
    """The ledger of a finished schedule (``tasks`` in placement order)."""
    ledger = MemoryLedger(jobs, devices)
    for t in tasks:
        ledger.add(t)
    return ledger
