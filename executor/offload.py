"""The host copies of the step program, run (``offload params``; what is spilled: autoddl/offload.py).

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

On CUDA the host buffers are pinned and the copies ``non_blocking`` on a side stream, the compute
stream waiting on an event before the group's use (untested: no GPU here). On CPU, host and device
are the same RAM: the copies are plain tensor copies, so the structure, the values that flow
through them (``--check``) and their count (``records``) are what is checked.

Not run: the program's copy of the kept (root) parameters' updated working copies back to the
device after the optimizer (``h2d parameters``): the executor's masters of those stay where the
optimizer updates them. ``offload optimizer`` runs as ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autoddl.offload import D2H, H2D
from autoddl.precision import working_copy
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
        self.start_step()

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.cuda else t

    def start_step(self) -> None:
        self.copied: set[tuple[str, int]] = set()        # (forward | backward, group) copied in this step
        self.events: dict[int, Any] = {}

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
        if self.cuda:
            torch.cuda.synchronize()
        return out
