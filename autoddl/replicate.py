"""Trace a model's repeated stack of blocks once and replicate it: tracing cost O(1) in the block count.

A transformer's blocks (``nn.ModuleList`` / ``nn.Sequential`` children of one class with the same
parameters and buffers) export to the same ops, block after block. :func:`find_stack` finds that
stack; the caller exports the model with it cut to its first 2 and first 3 children (on the meta
device: cheap), and :func:`expand` builds the graph of ``n`` blocks from the 2-block one: block 1's
nodes (its ops, from its first op to the op before where block 2 would start, and its parameter and
buffer placeholders) are copied for blocks 2..n-1 with their names, module paths and fqns moved
along (``layers.1.`` -> ``layers.i.``; an op name's counter ``mm_7`` by what one block adds to it,
as torch.fx numbers repeated names), each copy reading the previous copy's outputs where block 1
read block 0's, and the ops after the stack reading the last copy's.

:func:`replicated` trusts this only when ``expand(graph_2, 3)`` equals the 3-block export node for
node (names, targets, inputs, metas, args, FLOPs, bytes, parameters, module paths, in order): a
forward that indexes ``self.layers[i]`` over a config range fails to export cut, a block whose ops
depend on its index (e.g. a per-layer scale or attention kind) differs from block 1 in block 2; either
way it returns None with the reason, and the caller exports the whole model. What the check cannot
see is a block past the third that differs (``if self.layer_idx % 4 == 3``): the stack's children
must also have equal plain attributes, apart from an int equal to their own index (``layer_idx``).
tests/test_trace_replicate.py compares replicated graphs and their plans with full exports.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
from typing import Any, Callable, Iterator

import torch
from torch import nn

from autoddl.graph import NodeKind, OpGraph, OpNode, TensorRef

MIN_BLOCKS = 4            # 3 blocks or fewer: the 3-block check export is the whole model
_COUNTER = re.compile(r"^(.*)_(\d+)$")


class NotReplicable(Exception):
    """The 2-block graph does not have the shape :func:`expand` relies on (the message says where)."""


@dataclasses.dataclass(frozen=True)
class Stack:
    path: str                 # fqn of the ModuleList / Sequential, e.g. "layers", "model.layers"
    n: int                    # its number of children


def find_stack(model: nn.Module) -> Stack | None:
    """The repeated stack holding the most parameters (>= MIN_BLOCKS like children), or None."""
    best: tuple[int, str, int] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < MIN_BLOCKS:
            continue
        children = list(module)
        if not _alike(children):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, path, len(children))
    return None if best is None or not best[1] else Stack(best[1], best[2])


def _plain(m: nn.Module, reprs: dict[int, str]) -> dict[tuple[str, str], str]:
    """(submodule, attribute) -> repr of every plain (non-tensor, non-module) attribute, and class names;
    ``reprs`` keeps the repr of objects the children share (a Hugging Face config) by id."""
    out: dict[tuple[str, str], str] = {}
    for name, sub in m.named_modules():
        out[(name, "__class__")] = type(sub).__name__
        for k, v in vars(sub).items():
            if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module)):
                out[(name, k)] = reprs[id(v)] if id(v) in reprs else reprs.setdefault(id(v), repr(v))
    return out


def _alike(children: list[nn.Module]) -> bool:
    """Same class, parameters, buffers (names, shapes, dtypes) and plain attributes, apart from
    attributes that hold each child's own index (a ``layer_idx``)."""
    tensors = [[(k, tuple(t.shape), t.dtype) for k, t in [*c.named_parameters(), *c.named_buffers()]]
               for c in children]
    reprs: dict[int, str] = {}
    plains = [_plain(c, reprs) for c in children]
    index = {key for key in plains[0] if all(p.get(key) == repr(i) for i, p in enumerate(plains))}
    return all(type(c) is type(children[0]) and t == tensors[0]
               and {k: v for k, v in p.items() if k not in index} == {k: v for k, v in plains[0].items()
                                                                      if k not in index}
               for c, t, p in zip(children, tensors, plains))


@contextlib.contextmanager
def truncated(model: nn.Module, stack: Stack, k: int) -> Iterator[None]:
    """``model`` with the stack cut to its first ``k`` children; restored on leaving."""
    parent_path, _, attr = stack.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    whole = getattr(parent, attr)
    cut = copy.copy(whole)                     # same class (a subclass keeps its forward), first k children
    cut._modules = dict(list(whole._modules.items())[:k])
    setattr(parent, attr, cut)
    try:
        yield
    finally:
        setattr(parent, attr, whole)


def replicated(model: nn.Module, stack: Stack, export: Callable[[nn.Module], OpGraph]) -> tuple[OpGraph | None, str]:
    """(the graph of ``model`` from its 2-block export, "") or (None, why not) (module docstring).

    ``export(model)`` is the caller's trace of the model as it is at the call."""
    try:
        with truncated(model, stack, 2):
            two = export(model)
        with truncated(model, stack, 3):
            three = export(model)
    except Exception as exc:  # noqa: BLE001 - any failure of the cut model means: export it whole
        first = (str(exc).splitlines() or [""])[0][:200]
        return None, f"the model with {stack.path} cut to 2-3 blocks does not export: {type(exc).__name__}: {first}"
    try:
        check = expand(two, stack.path, 3)
        differs = first_difference(check, three)
        if differs:
            return None, f"{stack.path}: 3 blocks replicated from 2 differ from their export: {differs}"
        return expand(two, stack.path, stack.n), ""
    except (NotReplicable, ValueError) as exc:
        return None, f"{stack.path}: {exc}"


def first_difference(a: OpGraph, b: OpGraph) -> str:
    """The first difference between the graphs' nodes (any OpNode field, or their order or count);
    empty when they are the same."""
    a_nodes, b_nodes = list(a.topo()), list(b.topo())
    for x, y in zip(a_nodes, b_nodes):
        if x != y:
            field = next((f.name for f in dataclasses.fields(OpNode) if getattr(x, f.name) != getattr(y, f.name)), "")
            return f"node {x.name!r} vs {y.name!r}: {field} {getattr(x, field)!r} vs {getattr(y, field)!r}"[:400]
    if len(a_nodes) != len(b_nodes):
        return f"{len(a_nodes)} nodes vs {len(b_nodes)}"
    return ""


def _block_of(path: str, stack: str) -> tuple[int, str] | None:
    """(block index, rest) of a module path or fqn under ``stack`` ("layers.1.attn" -> (1, ".attn"))."""
    if not path.startswith(stack + "."):
        return None
    head, dot, rest = path[len(stack) + 1:].partition(".")
    return (int(head), dot + rest) if head.isdigit() else None


def _moved(path: str, stack: str, shift: int) -> str:
    block = _block_of(path, stack)
    return path if block is None else f"{stack}.{block[0] + shift}{block[1]}"


def _counter(name: str) -> tuple[str, int]:
    m = _COUNTER.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _named(base: str, count: int) -> str:
    return f"{base}_{count}" if count else base


def _remap(value: Any, names: dict[str, str]) -> Any:
    if isinstance(value, TensorRef):
        return TensorRef(names.get(value.node, value.node), value.index)
    if isinstance(value, (list, tuple)):
        return type(value)(_remap(v, names) for v in value)
    if isinstance(value, dict):
        return {k: _remap(v, names) for k, v in value.items()}
    return value


class _Template:
    """The 2-block graph cut into placeholders, ops before block 1, block 1's ops and the rest."""

    def __init__(self, graph: OpGraph, stack: str):
        self.stack = stack
        nodes = list(graph.topo())
        self.placeholders = [n for n in nodes if n.kind in (NodeKind.INPUT, NodeKind.PARAMETER, NodeKind.BUFFER)]
        body = nodes[len(self.placeholders):]
        if any(n.kind not in (NodeKind.OP, NodeKind.OUTPUT) for n in body):
            raise NotReplicable("a placeholder after the first op")
        starts = [next((i for i, n in enumerate(body) if (_block_of(n.module_path, stack) or (-1,))[0] == b), None)
                  for b in (0, 1)]
        if None in starts or starts[1] <= starts[0] or starts[1] + starts[1] - starts[0] > len(body):
            raise NotReplicable(f"no ops of {stack}.0 followed by ops of {stack}.1")
        s0, s1 = starts
        length = s1 - s0
        self.pre, self.head, self.block0 = body[:s0], body[:s1 + length], body[s0:s1]
        self.block1, self.tail = body[s1:s1 + length], body[s1 + length:]
        self.delta = self._counter_steps()
        self.unit_holders = {b: [n for n in self.placeholders if n.kind is not NodeKind.INPUT
                                 and (_block_of(n.target, stack) or (-1,))[0] == b] for b in (0, 1)}
        self.holder_name = self._holder_names()

    def _counter_steps(self) -> dict[str, int]:
        """Per fx name base, how far one block moves its counter (block 1's name minus block 0's)."""
        delta: dict[str, int] = {}
        for a, b in zip(self.block0, self.block1):
            (base_a, ca), (base_b, cb) = _counter(a.name), _counter(b.name)
            if base_a != base_b or a.target != b.target or cb <= ca or delta.setdefault(base_a, cb - ca) != cb - ca:
                raise NotReplicable(f"blocks 0 and 1 differ at ops {a.name!r} / {b.name!r}")
        return delta

    def _holder_names(self) -> dict[str, Callable[[int], str]]:
        """Block 1's placeholder name -> its name in block i (the one character that says "1")."""
        zero, one = self.unit_holders[0], self.unit_holders[1]
        if len(zero) != len(one) or not one:
            raise NotReplicable("blocks 0 and 1 have different parameters")
        names: dict[str, Callable[[int], str]] = {}
        for a, b in zip(zero, one):
            cut = len(os.path.commonprefix([a.name, b.name]))
            if a.name[cut:cut + 1] != "0" or b.name[cut:cut + 1] != "1" or a.name[cut + 1:] != b.name[cut + 1:]:
                raise NotReplicable(f"placeholders {a.name!r} / {b.name!r} are not named by their block")
            names[b.name] = lambda i, p=b.name[:cut], s=b.name[cut + 1:]: f"{p}{i}{s}"
        return names

    def late_names(self, n: int) -> dict[str, str]:
        """Names of the ops outside blocks 0 and 1 that torch.fx numbered after block 1's (the ops
        after the stack, and regions inlined after export) -> their names with ``n`` blocks."""
        last = {}
        for op in self.block1:
            base, count = _counter(op.name)
            last[base] = max(count, last.get(base, 0))
        out = {}
        for op in (*self.pre, *self.tail):
            base, count = _counter(op.name)
            if base in last and count > last[base]:
                out[op.name] = _named(base, count + (n - 2) * self.delta[base])
        return out

    def renames(self, shift: int) -> dict[str, str]:
        """Names of blocks 0 and 1's nodes -> those of blocks 0 + shift and 1 + shift."""
        out: dict[str, str] = {}
        for block in (self.block0, self.block1):
            for n in block:
                base, count = _counter(n.name)
                out[n.name] = _named(base, count + shift * self.delta[base])
        for b, holders in self.unit_holders.items():
            for z, one in zip(holders, self.unit_holders[1]):
                out[z.name] = self.holder_name[one.name](b + shift)
        return out

    def moved(self, node: OpNode, name: str, names: dict[str, str], shift: int) -> OpNode:
        return dataclasses.replace(
            node, name=name, target=_moved(node.target, self.stack, shift) if node.kind in (
                NodeKind.PARAMETER, NodeKind.BUFFER) else node.target,
            inputs=_remap(node.inputs, names), args=_remap(node.args, names), kwargs=_remap(node.kwargs, names),
            params=tuple(_moved(p, self.stack, shift) for p in node.params),
            module_path=_moved(node.module_path, self.stack, shift))


def expand(graph: OpGraph, stack: str, n: int) -> OpGraph:
    """The graph of the model with ``n`` blocks in ``stack`` from ``graph``, its 2-block export."""
    if n < 2:
        raise ValueError(f"expand needs n >= 2 blocks, got {n}")
    t = _Template(graph, stack)
    renames = {s: t.renames(s) for s in range(1, n - 1)}
    one = {h.name for h in t.unit_holders[1]}
    nodes: list[OpNode] = []
    for k, holder in enumerate(t.placeholders):
        nodes.append(holder)
        ends_run = holder.name in one and (k + 1 == len(t.placeholders) or t.placeholders[k + 1].name not in one)
        if ends_run:
            run = []
            for h in reversed(t.placeholders[:k + 1]):
                if h.name not in one:
                    break
                run.insert(0, h)
            for s in range(1, n - 1):
                nodes.extend(t.moved(h, renames[s][h.name], renames[s], s) for h in run)
    late = t.late_names(n)
    nodes.extend(t.moved(op, late.get(op.name, op.name), late, 0) for op in t.head)
    for s in range(1, n - 1):
        names = {**late, **renames[s]}
        nodes.extend(t.moved(op, names[op.name], names, s) for op in t.block1)
    last = {**late, **renames.get(n - 2, {})}
    nodes.extend(t.moved(op, late.get(op.name, op.name), last, n - 2) for op in t.tail)
    return OpGraph(nodes, model_name=graph.model_name)
