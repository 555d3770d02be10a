"""OpGraph: the traced model as a networkx DiGraph of OpNode records.

One node per value-producing fx node of the exported program: user inputs,
parameters and buffers (placeholders), every aten op, and the graph output.
An edge ``u -> v`` carries ``refs``: the ``(out_index, in_slot)`` pairs saying
which output of ``u`` feeds which tensor input slot of ``v`` (a node may use the
same producer twice, e.g. ``x * x``).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator

import networkx as nx


class NodeKind(str, Enum):
    INPUT = "input"
    PARAMETER = "parameter"
    BUFFER = "buffer"
    OP = "op"
    OUTPUT = "output"


_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "_hash", hash((self.shape, self.dtype)))

    def __hash__(self) -> int:  # cached: metas key the search's memo tables
        return self._hash

    def __reduce__(self):  # unpickled through __init__: the cached hash is this process's (str hashes vary)
        return TensorMeta, (self.shape, self.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class TensorRef:
    """Output ``index`` of node ``node``; stands in for a tensor inside ``OpNode.args``."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return self.node if self.index == 0 else f"{self.node}[{self.index}]"


@functools.lru_cache(maxsize=4096)
def _op_name(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else target


@dataclass
class OpNode:
    name: str                                  # fx node name, unique in the graph
    kind: NodeKind
    target: str                                # "aten.mm.default"; parameter/buffer fqn; input name
    inputs: tuple[TensorRef, ...] = ()         # one per tensor argument, in argument order
    input_metas: tuple[TensorMeta, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()       # one per tensor output
    args: tuple = ()                           # fx args, tensors replaced by TensorRef
    kwargs: dict[str, Any] = field(default_factory=dict)
    flops: int = 0                             # forward FLOPs (multiply-add = 2)
    bytes_read: int = 0
    bytes_written: int = 0
    params: tuple[str, ...] = ()               # fqns of parameters this op reads directly
    module_path: str = ""                      # innermost nn.Module fqn, e.g. "transformer.h.3.attn"
    module_type: str = ""                      # its class name, e.g. "CausalSelfAttention"

    @property
    def op_name(self) -> str:
        """``aten.mm.default`` -> ``mm``; non-aten targets are returned whole."""
        return _op_name(self.target)

    @property
    def is_op(self) -> bool:
        return self.kind is NodeKind.OP

    def __str__(self) -> str:
        outs = ", ".join(map(str, self.outputs))
        return f"{self.name} = {self.target}({', '.join(map(str, self.inputs))}) -> {outs}"


class OpGraph:
    """The traced model: OpNodes in execution order over a networkx DiGraph."""

    def __init__(self, nodes: list[OpNode], *, model_name: str = "", exported: Any = None):
        self.model_name = model_name
        self.exported = exported  # torch.export.ExportedProgram, when traced in this process
        self.nx = nx.DiGraph()
        self._order: list[str] = []
        self._by_name: dict[str, OpNode] = {}     # name -> node: lookups without networkx's views
        for node in nodes:
            if node.name in self.nx:
                raise ValueError(f"duplicate node name {node.name!r}")
            self.nx.add_node(node.name, node=node)
            self._order.append(node.name)
            self._by_name[node.name] = node
            for slot, ref in enumerate(node.inputs):
                if ref.node not in self.nx:
                    raise ValueError(f"node {node.name!r} reads {ref.node!r} before it is defined")
                if self.nx.has_edge(ref.node, node.name):
                    self.nx.edges[ref.node, node.name]["refs"].append((ref.index, slot))
                else:
                    self.nx.add_edge(ref.node, node.name, refs=[(ref.index, slot)])

    # -- lookup ---------------------------------------------------------------
    def __getitem__(self, name: str) -> OpNode:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in the graph of {self.model_name or 'this model'}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.nx

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[OpNode]:
        return self.topo()

    def topo(self) -> Iterator[OpNode]:
        """All nodes in execution order (a topological order)."""
        return (self._by_name[n] for n in self._order)

    def ops(self) -> list[OpNode]:
        return [n for n in self.topo() if n.kind is NodeKind.OP]

    def nodes_of(self, kind: NodeKind) -> list[OpNode]:
        return [n for n in self.topo() if n.kind is kind]

    def parameters(self) -> dict[str, OpNode]:
        """Parameter placeholder nodes by fully qualified name."""
        return {n.target: n for n in self.nodes_of(NodeKind.PARAMETER)}

    def producers(self, name: str) -> list[OpNode]:
        return [self[p] for p in self.nx.predecessors(name)]

    def consumers(self, name: str) -> list[OpNode]:
        return [self[c] for c in self.nx.successors(name)]

    def uses(self, name: str) -> list[tuple[OpNode, int, int]]:
        """Every use of ``name``'s outputs: (consumer, out_index, in_slot)."""
        return [
            (self[c], out_index, slot)
            for c in self.nx.successors(name)
            for out_index, slot in self.nx.edges[name, c]["refs"]
        ]

    def meta_of(self, ref: TensorRef) -> TensorMeta:
        return self[ref.node].outputs[ref.index]

    # -- totals ---------------------------------------------------------------
    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.ops())

    @property
    def parameter_count(self) -> int:
        return sum(n.outputs[0].numel for n in self.nodes_of(NodeKind.PARAMETER))

    @property
    def parameter_bytes(self) -> int:
        return sum(n.outputs[0].nbytes for n in self.nodes_of(NodeKind.PARAMETER))

    def fingerprint(self) -> str:
        """Hash of the graph's structure and shapes; a plan is only valid for a matching graph."""
        h = hashlib.sha256()
        for n in self.topo():
            h.update(repr((n.name, n.kind.value, n.target, tuple(map(str, n.inputs)),
                           tuple(map(str, n.outputs)))).encode())
        return h.hexdigest()[:16]

    def to_frame(self):
        """Per-op table: op, target, output shape, GFLOPs, MB moved, parameters."""
        import pandas as pd

        rows = [
            {
                "op": n.name,
                "target": n.target,
                "output_shape": "x".join(map(str, n.outputs[0].shape)) if n.outputs else "",
                "gflops": n.flops / 1e9,
                "mb": (n.bytes_read + n.bytes_written) / 1e6,
                "params": ",".join(n.params),
                "module": n.module_path,
            }
            for n in self.ops()
        ]
        return pd.DataFrame(rows, columns=["op", "target", "output_shape", "gflops", "mb", "params", "module"])

    def __repr__(self) -> str:
        return (f"OpGraph({self.model_name or 'model'}: {len(self.ops())} ops, "
                f"{self.parameter_count:,} parameters, {self.total_flops / 1e9:.3f} GFLOPs forward)")
