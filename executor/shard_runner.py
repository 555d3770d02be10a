"""Run one job's shard tasks on this rank: the traced graph's ops of one shard, eagerly.

Every rank builds the job's model with real weights (the job's seed) and traces it; a shard's
forward calls the aten op of each of its graph ops on real tensors (autograd records them), in
graph order. Tensors that cross shards (autoddl.shard_program's flows) are cut out of the autograd
graph at the reading shard (a leaf that needs a gradient), whether they came from this rank or
another, so that a shard's backward runs only its own ops: the backward is
``torch.autograd.backward`` of the shard's outgoing flows (and of the loss in the last shard) with
their gradients, after which the shard's own parameters (``param_homes``) take their SGD update
``p -= lr * grad``, as ``torch.optim.SGD`` without momentum does.

What crosses ranks is :meth:`ShardedModel.payload` (sent) and :meth:`ShardedModel.accept`
(received), named as ``autoddl.shard_program.Message.what``: ``params``, ``act:<tensor>``,
``grad:<tensor>``, and ``host`` (one element: the shard's write-back to host memory is done).

A spilled job's shard is copied from host memory into its parameters before a task
(:meth:`ShardedModel.load`) and from them back to host memory after its backward
(:meth:`ShardedModel.write_back`); host memory is a flat float32 tensor per shard that every rank
maps (executor/shard_worker.py). The load before a backward writes the bytes its forward read into
the same storage, under ``.data`` (autograd's saved tensors are that storage; their version is
left as it was).

This loop's own fixed costs (per forward / backward task beyond its ops, per parameter a backward
updates) are measured on it by executor/calibrate_shards.py (``autoddl calibrate --only shard_runner``)
and price its tasks (``executor.shard_*``, search/shards.py).
"""

from __future__ import annotations

from typing import Any

import torch

from autoddl import ops
from autoddl.graph import NodeKind, OpGraph, TensorRef
from autoddl.loader import ModelFile
from autoddl.pipeline import stages_from_cuts
from autoddl.precision import torch_dtype
from autoddl.program import used_parameters
from autoddl.shard_program import Flow, param_homes, shard_flows
from executor.compiled import _substitute


class ShardedModel:
    """One job on this rank (module docstring)."""

    def __init__(self, mf: ModelFile, graph: OpGraph, cuts: tuple[str, ...], lr: float, device: str = "cpu"):
        self.graph, self.lr, self.device = graph, lr, torch.device(device)
        self.shard_of = stages_from_cuts(graph, cuts)
        self.shards = max(self.shard_of.values()) + 1
        self.homes = param_homes(graph, self.shard_of)
        self.flows: tuple[Flow, ...] = shard_flows(graph, self.shard_of)
        named = dict(mf.model.named_parameters(remove_duplicate=False))
        self.fqns = {node.name: fqn for fqn, node in used_parameters(graph).items()}
        self.params = {name: named[fqn] for name, fqn in self.fqns.items()}
        self.own = [[name for name, s in self.homes.items() if s == shard] for shard in range(self.shards)]
        self.ops = [[n for n in graph.ops() if self.shard_of[n.name] == s] for s in range(self.shards)]
        self.inputs = self._graph_inputs(mf)
        self.targets = {n.name: n.target for n in graph.exported.graph_module.graph.nodes if n.op == "call_function"}
        self.loss_ref = graph.nodes_of(NodeKind.OUTPUT)[0].inputs[-1]
        self.env: dict[tuple[int, str], Any] = {}            # (step, op) -> its output(s)
        self.leaves: dict[tuple[int, int], torch.Tensor] = {}           # (step, flow) -> its leaf in the reader
        self.received: dict[tuple[int, str], torch.Tensor] = {}         # (step, act:i | grad:i) from another rank
        self.losses: dict[int, float] = {}

    def _graph_inputs(self, mf: ModelFile) -> dict[str, torch.Tensor]:
        ep = self.graph.exported
        users = list(ep.graph_signature.user_inputs)
        buffers = dict(mf.model.named_buffers())
        out = {}
        for node in self.graph.nodes_of(NodeKind.INPUT) + self.graph.nodes_of(NodeKind.BUFFER):
            if node.kind is NodeKind.BUFFER:
                out[node.name] = buffers[node.target]
            elif node.name in users:
                out[node.name] = mf.example_inputs[users.index(node.name)]
            else:
                raise NotImplementedError(f"{self.graph.model_name}: graph input {node.name} is a lifted constant; "
                                          "running shards of such a model is not supported yet")
        return {k: v.to(self.device) for k, v in out.items()}

    # -- tensors by name -------------------------------------------------------------------------
    def _ref(self, tensor: str) -> TensorRef:
        """A flow's tensor name (``shard_flows``: the node, or ``node.index`` of a multi-output op)."""
        if tensor in self.graph.nx:
            return TensorRef(tensor, 0)
        node, _, index = tensor.rpartition(".")
        return TensorRef(node, int(index))

    def _produced(self, step: int, ref: TensorRef) -> Any:
        """A tensor in the autograd graph of the shard that made it (a kept parameter itself)."""
        if ref.node in self.params:
            return self.params[ref.node]
        out = self.env[(step, ref.node)]
        return out[ref.index] if isinstance(out, (tuple, list)) else out

    # -- tasks -------------------------------------------------------------------------------------
    def forward(self, step: int, shard: int) -> None:
        reads: dict[TensorRef, torch.Tensor] = {}
        for i, f in enumerate(self.flows):
            if f.dst == shard:
                value = self.received.pop((step, f"act:{i}"), None)
                value = self._produced(step, self._ref(f.tensor)) if value is None else value
                self.leaves[(step, i)] = reads[self._ref(f.tensor)] = value.detach().requires_grad_(f.grad_nbytes > 0)
        for node in self.ops[shard]:
            tensors = [self._value(step, shard, ref, reads) for ref in node.inputs]
            args, kwargs = ops.localize_devices(_substitute(node.args, tensors, [0]),
                                                _substitute(node.kwargs, tensors, [0]), self.device)
            self.env[(step, node.name)] = self._kernel(node)(*args, **kwargs)
        if shard == self.shards - 1:
            self.losses[step] = float(self._produced(step, self.loss_ref).detach())

    def _kernel(self, node):
        """The op's torch callable (as executor/compiled.py's: ``getitem`` reads an output already picked)."""
        return ops.aten_op(node) if node.target == "getitem" else self.targets.get(node.name) or ops.aten_op(node)

    def _value(self, step: int, shard: int, ref: TensorRef, reads: dict[TensorRef, torch.Tensor]) -> Any:
        node = self.graph[ref.node]
        if node.kind in (NodeKind.INPUT, NodeKind.BUFFER):
            return self.inputs[ref.node]
        if ref in reads:
            return reads[ref]
        return self._produced(step, ref)            # an op of this shard, or a parameter it keeps

    def warm_up(self) -> None:
        """One untimed forward and backward of every shard here, parameters left as they are (the first
        call of each op pays one-off costs that a step of a long run does not)."""
        for shard in range(self.shards):
            self.forward(-1, shard)
        for shard in reversed(range(self.shards)):
            self.backward(-1, shard, update=False)
        self.losses.pop(-1, None)
        self.forget_before(0)

    def backward(self, step: int, shard: int, update: bool = True) -> None:
        tensors, grads = [], []
        if shard == self.shards - 1:
            tensors, grads = [self._produced(step, self.loss_ref)], [None]
        for i, f in enumerate(self.flows):
            if f.src == shard and f.grad_nbytes:
                grad = self.received.pop((step, f"grad:{i}"), None)
                tensors.append(self._produced(step, self._ref(f.tensor)))
                grads.append(self._leaf_grad(step, i) if grad is None else grad)
        torch.autograd.backward(tensors, grads)
        with torch.no_grad():
            for name in self.own[shard]:
                p = self.params[name]
                if p.grad is not None and update:
                    p.add_(p.grad, alpha=-self.lr)
                p.grad = None

    def forget_before(self, step: int) -> None:
        """Drop what earlier steps kept: a task of ``step`` runs after every task of the steps before."""
        self.env = {k: v for k, v in self.env.items() if k[0] >= step}
        self.leaves = {k: v for k, v in self.leaves.items() if k[0] >= step}
        self.received = {k: v for k, v in self.received.items() if k[0] >= step}

    def _leaf_grad(self, step: int, i: int) -> torch.Tensor:
        leaf = self.leaves[(step, i)]
        return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)

    # -- messages ----------------------------------------------------------------------------------
    def payload(self, step: int, what: str, shard: int) -> torch.Tensor:
        """The tensor a message ``what`` carries (``Message.what``), on the rank that ran the task making it
        (``shard``'s backward for ``params``)."""
        if what == "params":
            return torch.cat([self.params[n].detach().reshape(-1) for n in self.own[shard]])
        if what == "host":
            return torch.zeros(1, device=self.device)
        kind, _, i = what.partition(":")
        if kind == "act":
            return self._produced(step, self._ref(self.flows[int(i)].tensor)).detach().contiguous()
        return self._leaf_grad(step, int(i)).contiguous()

    def buffer(self, what: str, shard: int) -> torch.Tensor:
        """An empty tensor to receive ``what`` into (``shard``: the shard whose parameters come)."""
        if what == "params":
            return torch.empty(sum(self.params[n].numel() for n in self.own[shard]), device=self.device)
        if what == "host":
            return torch.empty(1, device=self.device)
        meta = self.graph.meta_of(self._ref(self.flows[int(what.partition(":")[2])].tensor))
        return torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=self.device)

    def accept(self, step: int, what: str, shard: int, value: torch.Tensor) -> None:
        """Take a received message: parameters are copied in, tensors kept for the task that reads them."""
        if what == "params":
            self.load(shard, value)
        elif what != "host":                # host: only the order of a write-back before a load
            self.received[(step, what)] = value

    def load(self, shard: int, flat: torch.Tensor) -> int:
        """Copy ``flat`` (the shard's parameters, as :meth:`payload` lays them out) into them; the bytes."""
        at = 0
        with torch.no_grad():
            for name in self.own[shard]:
                p = self.params[name]
                p.data.copy_(flat[at: at + p.numel()].view_as(p))
                at += p.numel()
        return at * flat.element_size()

    def write_back(self, shard: int, host: torch.Tensor) -> int:
        """Copy the shard's parameters into ``host`` (flat, :meth:`payload`'s layout); the bytes."""
        flat = self.payload(0, "params", shard)
        host.copy_(flat)
        return flat.numel() * flat.element_size()
