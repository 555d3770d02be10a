"""The host copies of a step program under ``Training.offload`` (what is spilled: autoddl/offload.py).

The lowering (autoddl/lowering.py) calls a :class:`SpillTasks` at five points:

- ``before_forward(node)``: the spilled groups whose parameters ``node`` reads are copied in
  (host -> device) unless already there, the op waiting for them; the next group's copy is
  launched at once without waiting (prefetch), after the task issued last, so that at most two
  groups are on the device: the one computing and the one arriving;
- ``after_forward(node)`` (``offload activations``): after a spilled group's last forward op, its
  saved activations are copied out (device -> host), but the last group's, which backward starts with;
- ``before_backward(node, ops)``: the same in reverse order for the groups that ``node``'s backward
  (and the recompute of ``ops`` there) reads; the group forward ended with is still on the device;
  under ``activations``, the saved activations of the blocks those ops run in are copied in first
  (each after its copy out), the group before prefetched;
- ``after_backward(node)``: a group whose gradients are all complete (and their buckets launched)
  has them copied out (device -> host);
- ``optimizer(deps)``: the remaining gradients copied out, the optimizer step on the host, the kept
  parameters' updated working copies copied back in.

Copies run on the ``copy_h2d`` / ``copy_d2h`` streams (a copy engine each way), one at a time per
stream in issue order, each priced as
``host_link.latency_us + bytes / host_link.bandwidth_gbps`` (costmodel/host.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from autoddl.graph import NodeKind, OpNode
from autoddl.offload import D2H, H2D, HOST, copy_stream, grad_bytes, kept_parameters, spill_groups, working_bytes
from autoddl.program import ParamUse, Task, block_of

ACTIVATIONS = "activations"          # the copy-in key and label of a group's saved activations

if TYPE_CHECKING:
    from autoddl.lowering import _Lowering


class SpillTasks:
    """The copy tasks of one program (module docstring); inert under ``offload none``."""

    def __init__(self, low: "_Lowering"):
        self.low = low
        self.groups = spill_groups(low.graph, low.plan)
        low.prog.spills = list(self.groups)
        self.group_of = {f: g.index for g in self.groups for f in g.fqns}
        self.copied_in: dict[tuple[str, int], int] = {}   # (forward | backward, group) -> copy task
        self.resident = -1                                # the group forward ended with
        self.grads_left = {g.index: 0 for g in self.groups}
        self.buckets_of: dict[int, set[int]] = {g.index: set() for g in self.groups}
        self.copied_out: list[int] = []
        # offload activations: the block of each spilled group with saved activations, its last forward op,
        # its copy out; the last such group's stay on the device
        self.act_group = {g.group: g.index for g in self.groups if g.act_bytes}
        self.last_forward_op = {block_of(n): n.name for n in low.graph.ops() if block_of(n) in self.act_group}
        self.act_resident = max(self.act_group.values(), default=-1)
        self.act_out: dict[int, int] = {}
    def groups_read(self, nodes: Iterable[OpNode]) -> list[int]:
        graph = self.low.graph
        return sorted({self.group_of[graph[r.node].target] for n in nodes for r in n.inputs
                       if graph[r.node].kind is NodeKind.PARAMETER and graph[r.node].target in self.group_of})

    # -- copies in ------------------------------------------------------------------------------
    def copy_in(self, when: str, g: int, op: str, prefetch: bool) -> int:
        """Issue group ``g``'s copy in: a prefetch after the task issued last (the buffer it fills is
        free once that is done), else at once."""
        low = self.low
        deps = (low.last,) if prefetch and low.last is not None else ()
        group = self.groups[g]
        if when == ACTIVATIONS:                                 # after they went out
            deps = tuple(sorted(set(deps) | {self.act_out[g]}))
        nbytes = group.act_bytes if when == ACTIVATIONS else group.param_bytes
        task = low.emit(host=False, deps=deps, phase="offload", stream=copy_stream(H2D), op=op, nbytes=nbytes,
                        tensor=f"{H2D} {group.group} {when}", copy=H2D)
        self.copied_in[(when, g)] = task.id
        return task.id

    def need(self, when: str, g: int, op: str, step: int) -> None:
        """Group ``g`` is read by ``op``: wait for its copy (issued now unless prefetched), and
        prefetch the group ``step`` further on."""
        if (when, g) not in self.copied_in:
            self.copy_in(when, g, op, prefetch=False)
        task = self.copied_in[(when, g)]
        if task >= 0:
            self.low.wait_for.append(task)
        nxt = g + step
        if when == ACTIVATIONS and nxt not in self.act_out:          # nothing of it went out
            return
        if 0 <= nxt < len(self.groups) and (when, nxt) not in self.copied_in:
            self.copy_in(when, nxt, op, prefetch=True)

    def before_forward(self, node: OpNode) -> None:
        for g in self.groups_read([node]):
            self.need("forward", g, node.name, +1)
            self.resident = max(self.resident, g)

    def after_forward(self, node: OpNode) -> None:
        """``offload activations``: a spilled group's forward is done: its saved activations go out."""
        g = self.act_group.get(block_of(node), -1)
        if g < 0 or self.last_forward_op[block_of(node)] != node.name or g == self.act_resident:
            return
        group = self.groups[g]
        task = self.low.emit(host=False, phase="offload", stream=copy_stream(D2H), op=node.name,
                             nbytes=group.act_bytes, tensor=f"{D2H} {group.group} {ACTIVATIONS}", copy=D2H)
        self.act_out[g] = task.id

    def before_backward(self, node: OpNode, ops: list[OpNode]) -> None:
        blocks = {block_of(n) for n in [node] + ops}
        for g in sorted((self.act_group[b] for b in blocks if b in self.act_group), reverse=True):
            if g == self.act_resident:
                self.copied_in.setdefault((ACTIVATIONS, g), -1)   # never left the device
            self.need(ACTIVATIONS, g, node.name, -1)
        for g in reversed(self.groups_read([node] + ops)):
            if g == self.resident and ("backward", g) not in self.copied_in:
                self.copied_in[("backward", g)] = -1          # still on the device
            self.need("backward", g, node.name, -1)

    # -- copies out -----------------------------------------------------------------------------
    def count_gradients(self, uses: list[ParamUse]) -> None:
        for use in uses:
            if use.grad is not None and use.fqn in self.group_of:
                g = self.group_of[use.fqn]
                self.grads_left[g] += 1
                if use.bucket >= 0:
                    self.buckets_of[g].add(use.bucket)

    def gradient_ready(self, use: ParamUse) -> None:
        if use.grad is not None and use.fqn in self.group_of:
            self.grads_left[self.group_of[use.fqn]] -= 1

    def after_backward(self, op: str, final: bool = False) -> None:
        """Copy out each group whose gradients are complete and whose buckets were launched."""
        low = self.low
        for group in self.groups:
            g = group.index
            launched = all(b < len(low.bucket_tasks) for b in self.buckets_of[g])
            if self.grads_left[g] != 0 or not (launched or final) or not group.grad_bytes:
                continue
            labels = {f"bucket{b}" for b in self.buckets_of[g]}
            syncs = tuple(t.id for t in low.prog.tasks if t.phase == "grad_sync" and t.tensor in labels)
            deps = tuple(sorted(set(((low.last,) if low.last is not None else ()) + syncs)))
            task = low.emit(host=False, deps=deps, phase="offload", stream=copy_stream(D2H), op=op,
                            nbytes=group.grad_bytes, tensor=f"{D2H} {group.group} gradients", copy=D2H)
            self.copied_out.append(task.id)
            self.grads_left[g] = -1                          # done

    # -- the optimizer on the host --------------------------------------------------------------
    def optimizer(self, deps: tuple[int, ...]) -> Task:
        """Gradients out, the optimizer step on the host, updated kept parameters back in."""
        low = self.low
        graph, plan = low.graph, low.plan
        kept = kept_parameters(graph, plan)
        out_bytes = sum(grad_bytes(plan, f, meta) for f, meta in kept.items())
        waits = deps + tuple(self.copied_out)
        if out_bytes:
            out = low.emit(host=False, deps=deps, phase="offload", stream=copy_stream(D2H), op="optimizer",
                           nbytes=out_bytes, tensor=f"{D2H} gradients", copy=D2H)
            waits += (out.id,)
        step = low.emit(deps=tuple(sorted(set(waits))), phase="optimizer", stream=HOST, op="optimizer",
                        tensor="on the host")
        in_bytes = sum(working_bytes(plan, f, meta) for f, meta in kept.items())
        if in_bytes:
            return low.emit(phase="offload", stream=copy_stream(H2D), op="optimizer", nbytes=in_bytes,
                            tensor=f"{H2D} parameters", copy=H2D)
        return step
