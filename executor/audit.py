"""Record the collectives a training step really runs: kind, mesh axis, bytes, phase.

``CommRecorder`` is a TorchDispatchMode. The executor's boxing moves, gradient
buckets and layer-group gathers (forward and in autograd's backward) issue c10d
functional ops (``_c10d_functional.*``) on plain local tensors; the mode sees each
one with its process-group name, which maps to a mesh axis through
``mesh.get_group(axis).group_name`` (or to a tuple of axes, for a group the executor flattened
them into: executor.runtime.mesh_groups). What is recorded is what was dispatched (an
S(i)->S(j) all-to-all is ``all_to_all_single`` on every backend). What the process group does inside
a dispatched op is invisible to the mode and is stated here (``CARRIED_AS``): gloo
carries a reduce-scatter out as an all-reduce of the whole input plus a local chunk (the
mode sees ``reduce_scatter_tensor``; the record says ``all_reduce``). Kept apart from
autoddl.collective_kinds.BACKENDS on purpose: the audit checks the program against
what ran, so it does not read the program's own table.

``bytes`` is the size M of the full buffer of the alpha-beta formulas in
DESIGN.md: the tensor for all-reduce and broadcast, the gathered output for
all-gather, the (unscattered) input for reduce-scatter, the logical tensor for all-to-all (a rank's
input is its piece, M / n: costmodel/collectives.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoddl.boxing import Group, group_name, group_size

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
PHASES = ("setup", "forward", "recompute", "backward", "grad_sync", "optimizer")


@dataclass(frozen=True)
class CommRecord:
    kind: str        # one of KINDS (CollectiveKind values of costmodel)
    axis: Group      # mesh axis (or tuple of flattened axes) of the process group; -1 when none
    bytes: int       # M of the alpha-beta formula (see module docstring)
    phase: str       # one of PHASES
    tensor: str = "" # graph edge / parameter fqn being moved, when known
    dtype: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _functional_ops() -> dict[Any, str]:
    f = torch.ops._c10d_functional
    table = {
        f.all_reduce.default: "all_reduce",
        f.all_reduce_coalesced.default: "all_reduce",
        f.all_gather_into_tensor.default: "all_gather",
        f.all_gather_into_tensor_coalesced.default: "all_gather",
        f.reduce_scatter_tensor.default: "reduce_scatter",
        f.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
        f.all_to_all_single.default: "all_to_all",
        f.broadcast.default: "broadcast",
        torch.ops._c10d_functional_autograd.all_to_all_single.default: "all_to_all",
    }
    for name in ("all_reduce_", "all_reduce_coalesced_"):
        if hasattr(f, name):
            table[getattr(f, name).default] = "all_reduce"
    return table


# What a backend's process group really runs for a functional collective, where it differs.
# gloo, torch 2.13: ProcessGroupGloo::reduce_scatter_tensor_coalesced (reached by
# _reduce_scatter_base / funcol.reduce_scatter_tensor) clones the input, all-reduces the
# clone and copies out this rank's chunk (pytorch PR #118911).
CARRIED_AS: dict[str, dict[str, str]] = {"gloo": {"reduce_scatter": "all_reduce"}}


# position of the group-name argument and of the group size (None: no size arg) per kind
_GROUP_ARG = {"all_reduce": (2, None), "all_gather": (2, 1), "reduce_scatter": (3, 2),
              "all_to_all": (3, None), "broadcast": (2, None)}


class CommRecorder(TorchDispatchMode):
    """Records every c10d functional collective dispatched while active.

    Set ``phase`` (and optionally ``tensor``) from the caller to label records.
    """

    def __init__(self, mesh, groups: Mapping[Group, str] | None = None) -> None:
        """``groups``: process-group names by mesh axis or tuple of flattened axes (the executor's
        Boxer.groups); the mesh's own axes when not given."""
        super().__init__()
        self.records: list[CommRecord] = []
        self.phase = "forward"
        self.tensor = ""
        self._ops = _functional_ops()
        groups = groups or {i: mesh.get_group(i).group_name for i in range(mesh.ndim)}
        self._axis_of_group = {name: axis for axis, name in groups.items()}
        backend = _backend_name(mesh.get_group(0)) if mesh.ndim else ""
        self._carried_as = {name: CARRIED_AS.get(backend, {}) for name in groups.values()}
        self._axis_size = {axis: group_size(axis, tuple(mesh.shape)) for axis in groups}

    def note(self, kind: str, axis: int, nbytes: int, phase: str, tensor: str = "", dtype: str = "") -> None:
        """Record a communication the mode does not see: a pipeline stage's send (``send_recv``, issued
        by ``torch.distributed.isend``, not a functional collective), told by executor/pipelined.py."""
        self.records.append(CommRecord(kind, axis, int(nbytes), phase, tensor, dtype))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._ops.get(func)
        if kind is not None:
            self._record(kind, args)
        return func(*args, **kwargs)

    def _record(self, kind: str, args: tuple) -> None:
        group_pos, size_pos = _GROUP_ARG[kind]
        tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        group = args[group_pos] if len(args) > group_pos else None
        axis = self._axis_of_group.get(group, -1)
        n = int(args[size_pos]) if size_pos is not None else self._axis_size.get(axis, 1)
        ran = self._carried_as.get(group, {}).get(kind, kind)
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if kind in ("all_gather", "all_to_all"):
                nbytes *= n  # the gathered output; an all-to-all's logical tensor (this rank's input is M / n)
            self.records.append(CommRecord(ran, axis, int(nbytes), self.phase, self.tensor,
                                           str(t.dtype).removeprefix("torch.")))


@dataclass(frozen=True)
class OpRecord:
    """One aten op dispatched while an :class:`OpRecorder` was active (tests compare these with what
    the step program prices, e.g. costmodel/master_passes.py)."""

    phase: str
    op: str                       # the aten op's name (``_to_copy``, ``add``, ``mm``)
    in_dtypes: tuple[str, ...]    # of its tensor inputs, in order
    out_dtypes: tuple[str, ...]
    in_numels: tuple[int, ...]
    out_numels: tuple[int, ...]


class OpRecorder(CommRecorder):
    """A :class:`CommRecorder` that also records every aten op run (``ops``), labelled with the phase."""

    def __init__(self, mesh, groups: Mapping[Group, str] | None = None) -> None:
        super().__init__(mesh, groups)
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        ins = [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append(OpRecord(self.phase, func.overloadpacket.__name__,
                                 tuple(_dtype(t) for t in ins), tuple(_dtype(t) for t in outs),
                                 tuple(t.numel() for t in ins), tuple(t.numel() for t in outs)))
        return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _backend_name(group) -> str:
    """"gloo" / "nccl" / ... of a process group ("" when torch cannot say)."""
    try:
        import torch.distributed as dist

        return str(dist.get_backend(group)).lower()
    except Exception:  # a fake or custom group: record kinds as dispatched
        return ""


def summarize(records: list[CommRecord]) -> dict[str, dict[str, int]]:
    """Counts and bytes per ``phase/kind/axis``: ``{"forward/all_gather/axis0": {"count": 2, "bytes": 512}}``."""
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for r in records:
        key = f"{r.phase}/{r.kind}/axis{group_name(r.axis)}"
        counts[key] += 1
        nbytes[key] += r.bytes
    return {k: {"count": counts[k], "bytes": nbytes[k]} for k in sorted(counts)}
