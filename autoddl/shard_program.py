"""Shard tasks of many models on one cluster (Hydra's shard parallelism): what a schedule is made of.

A job (one model of a sweep) is cut into K contiguous *shards* (autoddl/pipeline.py's stages at
repeated-block boundaries). One training step of the job is 2K *shard tasks*, strictly in order:
forward of shards 0..K-1, then backward of shards K-1..0; the backward of a shard ends with its
parameters' optimizer update (so a shard's parameters are final for the step once its backward is
done). A job's tasks never overlap; tasks of different jobs on different devices do.

Where a task runs decides what moves (:func:`task_inputs`, the one rule both the scheduler's
pricing and the executor's sends follow):

- a forward of shard s reads the shard's parameters where they are (the device of its previous
  forward; nowhere before the first: every device starts with the initial weights) and every
  tensor a :class:`Flow` brings into s, from the device that ran the flow's source forward in this
  step;
- a backward of shard s runs on the device of its forward (the saved activations are there) and
  reads the gradient of every flow leaving s that carries one, from the device that ran the flow's
  destination (its forward and backward ran there).

A *spilled* job (``ShardedJob.spill``, Hydra's spilling) keeps every shard's parameters in host
memory, with their optimizer states (``state_bytes``): a task of shard s first loads the parameters
(host -> device, ``load_bytes``) unless the device's previous task was the same job's shard s (they
are still there), a backward loads the states too, and writes both back after its update (device ->
host, ``writeback_bytes``). Its forwards then receive no ``params``
message; when the shard's last write-back ran on another device, a ``host`` message (no bytes: the
order of the write-back before the load) comes from that device instead.

A flow is a direct edge: an op output or a parameter produced or kept by shard ``src`` and read by
shard ``dst > src`` (a tensor read by two later shards is two flows; a tied weight read by the last
shard is a flow from the shard that keeps it, and its gradient comes back).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

from autoddl.graph import NodeKind, OpGraph
from autoddl.program import requires_grad, used_parameters

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Flow:
    """A tensor shard ``src`` sends to shard ``dst`` in forward (``nbytes``) and whose gradient
    (``grad_nbytes``, 0 when it has none) comes back in backward. ``tensor``: the graph node."""

    src: int
    dst: int
    nbytes: int
    grad_nbytes: int
    tensor: str = ""


@dataclass(frozen=True)
class ShardedJob:
    """One model of a sweep cut into shards: per shard the forward and backward seconds on one
    device (backward includes the shard's optimizer update) and the bytes of its parameters (what
    moves when the shard changes device), and the flows between shards."""

    name: str
    steps: int
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    param_bytes: tuple[int, ...]
    flows: tuple[Flow, ...] = ()
    cuts: tuple[str, ...] = ()        # the first repeated block of shards 1..K-1 (autoddl.pipeline)
    spill: bool = False               # the shards live in host memory (module docstring)
    state_bytes: tuple[int, ...] = () # per shard, its parameters' optimizer states (empty: none, as SGD)
    activation_bytes: tuple[int, ...] = ()   # per shard, what its forward saves for its backward (empty: none)

    def __post_init__(self) -> None:
        k = len(self.forward_s)
        if k < 1 or len(self.backward_s) != k or len(self.param_bytes) != k or \
                len(self.state_bytes) not in (0, k) or len(self.activation_bytes) not in (0, k):
            raise ValueError(f"job {self.name!r}: forward_s, backward_s, param_bytes (and state_bytes, activation_bytes) "
                             f"need one entry per shard (got {len(self.forward_s)}, {len(self.backward_s)}, "
                             f"{len(self.param_bytes)}, {len(self.state_bytes)}, {len(self.activation_bytes)})")
        if self.steps < 1:
            raise ValueError(f"job {self.name!r}: steps {self.steps} must be >= 1")
        bad = [f for f in self.flows if not 0 <= f.src < f.dst < k]
        if bad:
            raise ValueError(f"job {self.name!r}: flows {bad} must go from a shard to a later one (0..{k - 1})")

    @property
    def shards(self) -> int:
        return len(self.forward_s)

    @property
    def step_s(self) -> float:
        """One step on one device, nothing moved."""
        return sum(self.forward_s) + sum(self.backward_s)

    @property
    def total_s(self) -> float:
        return self.steps * self.step_s

    def tasks(self) -> Iterator["TaskKey"]:
        """Every task of the job in its order."""
        for step in range(self.steps):
            yield from (TaskKey(step, s, FORWARD) for s in range(self.shards))
            yield from (TaskKey(step, s, BACKWARD) for s in reversed(range(self.shards)))

    def duration_s(self, key: "TaskKey") -> float:
        return (self.forward_s if key.kind == FORWARD else self.backward_s)[key.shard]

    def states_of(self, shard: int) -> int:
        """Bytes of the optimizer states of ``shard``'s parameters (0 when none are given)."""
        return self.state_bytes[shard] if self.state_bytes else 0

    def activations_of(self, shard: int) -> int:
        """Bytes ``shard``'s forward saves for its backward (0 when none are given)."""
        return self.activation_bytes[shard] if self.activation_bytes else 0

    def host_copies(self, key: "TaskKey", resident: bool) -> tuple[int, int]:
        """(bytes loaded before ``key``, bytes written back after it) of a spilled job (module docstring);
        ``resident``: the device's previous task was this job's same shard. (0, 0) when not spilled."""
        if not self.spill:
            return 0, 0
        params = self.param_bytes[key.shard]
        if key.kind == FORWARD:
            return (0 if resident else params), 0
        states = self.states_of(key.shard)
        return (0 if resident else params) + states, params + states


@dataclass(frozen=True)
class TaskKey:
    step: int
    shard: int
    kind: str               # FORWARD | BACKWARD

    def __str__(self) -> str:
        return f"{self.kind}{self.shard}@{self.step}"


@dataclass(frozen=True)
class Message:
    """Bytes a task receives before it runs: ``what`` is ``params``, ``act:<i>`` or ``grad:<i>``
    (the value or the gradient of the job's flow i); from device ``src``, sent there when the job's
    task ``producer`` ended."""

    src: int
    nbytes: int
    what: str               # params | act:<i> | grad:<i> | host
    producer: TaskKey


@dataclass(frozen=True)
class ScheduledTask:
    """A task placed on a device: it receives ``inbox`` (``transfer_s`` in all), then computes from
    ``start_s`` to ``end_s``."""

    job: int
    key: TaskKey
    device: int
    start_s: float
    end_s: float
    transfer_s: float
    inbox: tuple[Message, ...] = ()
    load_bytes: int = 0               # a spilled shard: host -> device before it, on the device's h2d copy stream
    load_start_s: float = 0.0
    load_end_s: float = 0.0
    writeback_bytes: int = 0          # a spilled shard's backward: device -> host after it (d2h stream)
    writeback_start_s: float = 0.0
    writeback_end_s: float = 0.0
    placed_s: float = 0.0             # when the scheduler placed it: its messages start arriving then

    @property
    def done_s(self) -> float:
        """When the task and its write-back have ended."""
        return max(self.end_s, self.writeback_end_s)

    def label(self, names: Sequence[str]) -> str:
        return f"{names[self.job]}:{self.key}"


class JobPlacement:
    """Where a job's shards are while it is scheduled: the device of each shard's latest forward
    (its saved activations and, after its backward, its updated parameters)."""

    def __init__(self, job: ShardedJob):
        self.job = job
        self.forward_device: list[int | None] = [None] * job.shards

    def allowed(self, key: TaskKey, device: int) -> bool:
        """A backward runs where its forward did."""
        return key.kind == FORWARD or self.forward_device[key.shard] == device

    def task_inputs(self, key: TaskKey, device: int) -> tuple[Message, ...]:
        """What ``key`` on ``device`` receives (module docstring), before it runs."""
        job, where = self.job, self.forward_device
        out: list[Message] = []
        if key.kind == FORWARD:
            home = where[key.shard]
            if job.spill and home is not None and home != device:
                out.append(Message(home, 0, "host", TaskKey(key.step - 1, key.shard, BACKWARD)))
            elif home is not None and home != device and job.param_bytes[key.shard]:
                out.append(Message(home, job.param_bytes[key.shard], "params",
                                   TaskKey(key.step - 1, key.shard, BACKWARD)))
            out += [Message(where[f.src], f.nbytes, f"act:{i}", TaskKey(key.step, f.src, FORWARD))
                    for i, f in enumerate(job.flows) if f.dst == key.shard and where[f.src] != device]
        else:
            out += [Message(where[f.dst], f.grad_nbytes, f"grad:{i}", TaskKey(key.step, f.dst, BACKWARD))
                    for i, f in enumerate(job.flows) if f.src == key.shard and f.grad_nbytes and where[f.dst] != device]
        return tuple(out)

    def place(self, key: TaskKey, device: int) -> None:
        if not self.allowed(key, device):
            raise ValueError(f"job {self.job.name!r}: backward of shard {key.shard} must run on device "
                             f"{self.forward_device[key.shard]}, where its forward ran, not {device}")
        if key.kind == FORWARD:
            self.forward_device[key.shard] = device


@dataclass(frozen=True)
class Transfer:
    """One message of a schedule: ``what`` of job ``job`` from device ``src`` (after its task
    ``after``) to device ``dst`` (before its task ``before``), matched by ``tag``."""

    job: int
    src: int
    dst: int
    tag: int
    what: str
    after: TaskKey
    before: TaskKey


def device_order(tasks: Sequence[ScheduledTask], device: int) -> list[ScheduledTask]:
    """The tasks of ``device`` in the order it runs them: by start."""
    return sorted((t for t in tasks if t.device == device), key=lambda t: (t.start_s, t.end_s))


def transfers(tasks: Sequence[ScheduledTask]) -> list[Transfer]:
    """Every message of a schedule, numbered (``tag``) in placement order: the same list on every rank."""
    out: list[Transfer] = []
    for t in tasks:
        first = len(out)
        out += [Transfer(t.job, m.src, t.device, first + i, m.what, m.producer, t.key) for i, m in enumerate(t.inbox)]
    return out


def task_to_dict(t: ScheduledTask) -> dict:
    """A scheduled task as JSON-able data (what ``autoddl schedule --run`` hands its ranks)."""
    return dataclasses.asdict(t)


def task_from_dict(d: dict) -> ScheduledTask:
    inbox = tuple(Message(m["src"], m["nbytes"], m["what"], TaskKey(**m["producer"])) for m in d["inbox"])
    copies = {k: d[k] for k in ("load_bytes", "load_start_s", "load_end_s", "writeback_bytes", "writeback_start_s",
                                "writeback_end_s", "placed_s") if k in d}
    return ScheduledTask(d["job"], TaskKey(**d["key"]), d["device"], d["start_s"], d["end_s"], d["transfer_s"], inbox,
                         **copies)


# -- from the op graph -----------------------------------------------------------------------------

def param_homes(graph: OpGraph, shard_of: dict[str, int]) -> dict[str, int]:
    """Parameter node -> the shard that keeps it (and updates it): the shard of its first reader."""
    return {node.name: shard_of[graph.consumers(node.name)[0].name] for node in used_parameters(graph).values()}


def shard_flows(graph: OpGraph, shard_of: dict[str, int]) -> tuple[Flow, ...]:
    """Every flow (module docstring) of ``graph`` cut by ``shard_of`` (op name -> shard): op outputs
    and kept parameters read by later shards. Inputs and buffers are read where they are needed."""
    grads = requires_grad(graph)
    homes = param_homes(graph, shard_of)
    out: list[Flow] = []
    for node in graph.topo():
        if node.kind is NodeKind.OP:
            src, metas = shard_of[node.name], enumerate(node.outputs)
        elif node.name in homes:
            src, metas = homes[node.name], [(0, node.outputs[0])]
        else:
            continue
        for index, meta in metas:
            readers = sorted({shard_of[c.name] for c, i, _ in graph.uses(node.name) if c.is_op and i == index})
            grad = meta.nbytes if node.name in grads and meta.is_floating else 0
            name = node.name if len(node.outputs) == 1 else f"{node.name}.{index}"
            out += [Flow(src, dst, meta.nbytes, grad, name) for dst in readers if dst > src]
    return tuple(out)
