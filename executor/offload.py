"""The host copies of the step program, run (``offload``; what is spilled: autoddl/offload.py).

Each spilled group's working parameters live in host buffers between uses (``host``: the working
copies in ``param_dtype``, refreshed from the float32 masters after each optimizer step, as the
host's optimizer writes them); on the device the group has one slot per parameter whose storage is
empty until the group is copied in. As the program orders it (autoddl/offload_program.py):

- forward: the first use of group g copies g in (unless prefetched) and prefetches g + 1;
- after g's last forward op its slots are freed (storage resized to nothing, as FSDP2 frees
  gathered parameters; autograd's saved tensors share it), except for the last group, which stays;
  when backward reaches that op, g is copied in again into the very tensors autograd saved
  (unless prefetched) and g - 1 is prefetched;
- at the end of backward each group's synced gradients are copied out to host buffers, which are
  what is added to the masters' gradients (``GradSync(copy_out=...)``).

The optimizer on the host (every level but ``none``): the kept parameters' float32 masters (all
of them under ``optimizer``) live in host buffers (``kept``), where the optimizer steps them (their
``_autoddl_opt_local``: what the optimizer steps, and what the gradient sync writes the gradient to);
the synced gradients are copied out to the host at the end of backward (``d2h gradients``) and,
after the step, the updated working copies back into the device's parameters (``h2d parameters``:
:meth:`copy_back`). The spilled groups' masters stay where they were (their gradients reach the
host by ``copy_out``, their working copies by :meth:`refresh`).

On CUDA the host buffers are pinned and the copies ``non_blocking`` on a side stream, the compute
stream waiting on an event before the group's use (untested: no GPU here). On CPU, host and device
are the same RAM: the copies are plain tensor copies between separate buffers, so the structure,
the values that flow through them (``--check``) and their count and bytes (``records``) are what is
checked.

Saved activations (``offload activations``): the compiled program calls :meth:`enter_block` where
forward enters another block, and the forward runs under ``saved_tensors_hooks`` (as
``torch.autograd.graph.save_on_cpu``): what autograd saves in a spilled group's forward (but the
last group's, and parameters and inputs, which are leaves) is copied to a host buffer when saved
(one record per group when its forward is done), and when backward first unpacks one of them the
whole group is copied back and the group before prefetched, as the program orders it. The bytes
are autograd's (what its kernels keep), which the program's (autoddl/activations.py's rule) need
not equal: the audit compares the copies and reports both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autoddl.offload import D2H, H2D
from autoddl.offload_program import ACTIVATIONS
from autoddl.precision import itemsize, working_copy
from autoddl.program import StepProgram


@dataclass(frozen=True)
class CopyRecord:
    """One host copy that ran: direction, bytes, and the program's label for it."""

    copy: str
    nbytes: int
    tensor: str


class HostCopies:
    """One rank's spilled groups (module docstring); inert when the program spills nothing."""

    def __init__(self, program: StepProgram, local_params: dict[str, torch.Tensor], param_dtype: str,
                 device: torch.device):
        self.program, self.local_params, self.param_dtype = program, local_params, param_dtype
        self.groups = program.spills
        self.group_of = {f: g.index for g in self.groups for f in g.fqns}
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.host = {f: self._pin(working_copy(local_params[f], param_dtype).detach().clone()) for f in self.group_of}
        self.slot = {f: torch.empty_like(h, device=device) for f, h in self.host.items()}
        for t in self.slot.values():
            t.untyped_storage().resize_(0)
        self.last_forward = {g.index: "" for g in self.groups}
        for node, sources in program.op_inputs.items():
            for s in sources:
                if isinstance(s, int) and program.param_uses[s].fqn in self.group_of:
                    self.last_forward[self.group_of[program.param_uses[s].fqn]] = node
        self.records: list[CopyRecord] = []
        self.act_group = {g.group: g.index for g in self.groups if g.act_bytes}
        self.act_resident = max(self.act_group.values(), default=-1)
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # fqn -> (host master, device parameter)
        self.start_step()

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.cuda else t

    def start_step(self) -> None:
        self.copied: set[tuple[str, int]] = set()        # (forward | backward, group) copied in this step
        self.events: dict[int, Any] = {}
        self.current = -1                                # the spilled group whose forward saves to the host
        self.saved: dict[int, list[list[torch.Tensor | None]]] = {}   # group -> [host buffer, device copy]

    def keep_masters(self, params: dict[str, Any]) -> None:
        """The optimizer on the host: each kept parameter (``fqn -> nn.Parameter`` placed by the
        executor) gets its float32 master in a host buffer, which the optimizer steps."""
        for fqn, p in params.items():
            if fqn in self.group_of or not p.requires_grad or fqn in self.kept:
                continue
            local = p._autoddl_local
            master = self._pin(local.detach().to("cpu", copy=True))
            p._autoddl_opt_local = master
            self.kept[fqn] = (master, local)

    def copy_back(self) -> None:
        """After the optimizer step: the kept parameters' updated working copies to the device."""
        if not self.kept:
            return
        nbytes = 0
        with torch.no_grad():
            for master, local in self.kept.values():
                work = working_copy(master, self.param_dtype)
                local.copy_(work.to(local.device, non_blocking=self.cuda))
                nbytes += work.numel() * itemsize(self.param_dtype)
        self.records.append(CopyRecord(H2D, nbytes, f"{H2D} parameters"))

    def refresh(self) -> None:
        """After the optimizer step (on the host): the spilled groups' working copies from the masters."""
        with torch.no_grad():
            for f, h in self.host.items():
                h.copy_(working_copy(self.local_params[f], self.param_dtype))

    # -- copies in ---------------------------------------------------------------------------------
    def _copy_in(self, when: str, g: int) -> None:
        group = self.groups[g]
        self.copied.add((when, g))
        with torch.no_grad():
            for f in group.fqns:
                slot, host = self.slot[f], self.host[f]
                slot.untyped_storage().resize_(host.numel() * host.element_size())
                with torch.autograd._unsafe_preserve_version_counter(slot):
                    if self.cuda:
                        with torch.cuda.stream(self.stream):
                            slot.copy_(host, non_blocking=True)
                    else:
                        slot.copy_(host)
        if self.cuda:
            self.events[g] = self.stream.record_event()
        self.records.append(CopyRecord(H2D, group.param_bytes, f"{H2D} {group.group} {when}"))

    def _need(self, when: str, g: int, step: int) -> None:
        if (when, g) not in self.copied:
            self._copy_in(when, g)
        if 0 <= g + step < len(self.groups) and (when, g + step) not in self.copied:
            self._copy_in(when, g + step)
        if self.cuda and g in self.events:
            torch.cuda.current_stream().wait_event(self.events.pop(g))

    def fetch(self, fqn: str) -> torch.Tensor:
        """A spilled parameter for its forward use: its slot, its group copied in."""
        self._need("forward", self.group_of[fqn], +1)
        return self.slot[fqn]

    def after_forward_op(self, out: Any, op: str) -> Any:
        """After ``op``: free the groups whose last forward op it is (but the last group), and hook
        ``out``'s gradient to copy them in again when backward reaches ``op``."""
        groups = [g for g, last in self.last_forward.items() if last == op]
        anchor = out if isinstance(out, torch.Tensor) else next(
            (t for t in out if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if not groups or anchor is None or not anchor.requires_grad:
            return out
        resident = len(self.groups) - 1
        for g in groups:
            if g == resident:
                self.copied.add(("backward", g))          # still on the device
                continue
            for f in self.groups[g].fqns:
                self.slot[f].untyped_storage().resize_(0)
        anchor.register_hook(lambda grad: self._backward_reached(groups))
        return out

    def _backward_reached(self, groups: list[int]) -> None:
        for g in sorted(groups, reverse=True):
            self._need("backward", g, -1)

    # -- copies out ------------------------------------------------------------------------------
    def copy_out(self, synced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The synced gradients of each spilled group, copied to host buffers (the group's last
        backward first, as the program copies them out); the others as they are."""
        out = dict(synced)
        for group in reversed(self.groups):
            fqns = [f for f in group.fqns if f in synced]
            if not fqns:
                continue
            for f in fqns:
                g = synced[f]
                host = self._pin(torch.empty(g.shape, dtype=g.dtype))
                host.copy_(g, non_blocking=self.cuda)
                # the executor keeps every master where the optimizer steps it: on CUDA, the device
                out[f] = host.to(g.device, non_blocking=True) if self.cuda else host
            self.records.append(CopyRecord(D2H, group.grad_bytes, f"{D2H} {group.group} gradients"))
        kept = [f for f in synced if f in self.kept]
        for f in kept:                   # the optimizer on the host: the kept parameters' gradients
            host = self._pin(torch.empty(synced[f].shape, dtype=synced[f].dtype))
            out[f] = host.copy_(synced[f], non_blocking=self.cuda)
        if kept:
            self.records.append(CopyRecord(D2H, sum(out[f].nbytes for f in kept), f"{D2H} gradients"))
        if self.cuda:
            torch.cuda.synchronize()
        return out

    # -- saved activations -------------------------------------------------------------------------
    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks a forward runs under (module docstring)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def enter_block(self, block: str) -> None:
        """Forward enters ``block``: the group it leaves has its saved activations on the host."""
        self.end_forward()
        g = self.act_group.get(block, -1)
        self.current = g if g != self.act_resident else -1
        if self.current >= 0:
            self.saved[g] = []

    def end_forward(self) -> None:
        g, self.current = self.current, -1
        if g >= 0:
            self.records.append(CopyRecord(D2H, sum(h.nbytes for h, _ in self.saved[g]),
                                           f"{D2H} {self.groups[g].group} {ACTIVATIONS}"))

    def _pack(self, t: torch.Tensor) -> Any:
        g = self.current
        base = t._base if t._base is not None else t
        if g < 0 or base.is_leaf:                          # parameters and inputs: not activations
            return t
        host = self._pin(torch.empty(t.shape, dtype=t.dtype))
        host.copy_(t, non_blocking=self.cuda)
        self.saved[g].append([host, None])
        return (g, len(self.saved[g]) - 1, t.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        g, i, device = packed
        for k in (g, g - 1):                               # the group, and the one before prefetched
            if k in self.saved and (ACTIVATIONS, k) not in self.copied:
                self._copy_back(k, device)
        pair = self.saved[g][i]
        if pair[1] is None:          # unpacked again (retain_graph): from the host once more, not a program copy
            return pair[0].to(device)
        value, pair[1] = pair[1], None                     # autograd holds it now; freed after its use
        return value

    def _copy_back(self, g: int, device: torch.device) -> None:
        self.copied.add((ACTIVATIONS, g))
        for pair in self.saved[g]:
            pair[1] = pair[0].to(device, non_blocking=True) if self.cuda else pair[0].clone()
        self.records.append(CopyRecord(H2D, sum(h.nbytes for h, _ in self.saved[g]),
                                       f"{H2D} {self.groups[g].group} {ACTIVATIONS}"))
