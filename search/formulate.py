"""Turn (graph, cluster, mesh) into a SearchProblem the search algorithms solve.

One problem node per graph node that produces a value (user inputs, parameters,
buffers, ops); the graph output takes its inputs as they are. Costs come from
the cost model: an op's node cost is its forward + backward compute, a
parameter's is its optimizer step; an edge's matrix holds the forward boxing
of the tensor plus the backward transition of its gradient (gradient sync for a
parameter edge). Memory per candidate: a parameter's local state
(:func:`param_state_bytes`); an op's saved activations.

Training settings (``Training``) price one optimizer step, as the step program runs it:

- ``micro_batches`` = k: an op's compute and an activation's boxing (forward and
  backward) happen k times; a parameter's forward move (a ZeRO-3 all-gather) and its
  gradient's reduce-scatter too, its gradient all-reduce once (``no_sync``); the
  optimizer once.
- recompute: an op that ``recomputed_ops`` recomputes runs its forward once more in
  backward (``costmodel.compute.op_forward_time_s``), and, in a ``full`` block, the
  forward boxing of its inputs again; it saves no activation but the outputs an op
  outside its block reads (costmodel/memory.py's ``activation_bytes`` rule).
- precision: the graph is traced in ``param_dtype`` (activations and working copies in
  it); parameters keep float32 masters, gradients cross the network in
  ``grad_reduce_dtype``.

The pairwise edge objective charges every consumer its own boxing; the plan's
final cost (``costmodel.plan_cost``) shares one redistribute among consumers
wanting the same layout, so it can only be lower.

Repeated layers make the problem cheap to build: candidates, cost vectors and
edge matrices are cached by a structural key (op, shapes, constant args), and
every (tensor, source layout, target layout) transition is priced once. An op's
recompute policy and which of its outputs it saves are part of its key (blocks may
differ in policy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from autoddl import ops
from autoddl.activations import kept_scores_bytes, saved_outputs
from autoddl.cluster import Cluster
from autoddl.flops import VIEW_OPS
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorRef
from autoddl.plan import Mesh, Plan
from autoddl.precision import MASTER_ITEMSIZE, itemsize
from autoddl.program import recomputed_ops, requires_grad
from autoddl.sbp import NdSbp, Signature
from autoddl.training import Training
from costmodel.boxing import (Group, edge_backward_transitions, grad_ndsbp, needed_grad_ndsbp, parameter_transitions_of,
                              transitions_of, transitions_time_s)
from costmodel.compute import op_compute_time_s, op_forward_time_s, optimizer_time_s
from costmodel.memory import param_state_bytes
from search.problem import SearchProblem

_PLACEHOLDERS = (NodeKind.INPUT, NodeKind.PARAMETER, NodeKind.BUFFER)


@dataclass
class Formulation:
    """A SearchProblem plus the graph nodes behind its indices."""

    problem: SearchProblem
    nodes: list[OpNode]
    mesh_shape: tuple[int, ...]
    index: dict[str, int] = field(default_factory=dict)
    cache: "FormulationCache | None" = None          # pass to formulate() for the same graph and mesh

    def signatures(self, assignment: np.ndarray) -> dict[str, Signature]:
        return {n.name: self.problem.choices[i][int(a)] for i, (n, a) in enumerate(zip(self.nodes, assignment))}


def recompute_plan(training: Training, mesh_shape: Sequence[int] = (1,)) -> Plan:
    """A plan holding only ``training``: what ``recomputed_ops`` reads (it needs no signatures)."""
    return Plan(name="", mesh=Mesh(tuple(mesh_shape)), signatures={}, param_storage={}, graph_hash="",
                training=training)


def recomputed_names(graph: OpGraph, training: Training) -> dict[str, str]:
    """Op name -> its block's policy, for every op ``recomputed_ops`` recomputes under ``training``."""
    return {n.name: training.recompute_of(block) for block, ops_ in recomputed_ops(graph, recompute_plan(training)).items()
            for n in ops_}


def structural_key(node: OpNode) -> tuple:
    """Same key -> same candidates and costs (repeated layers share them)."""
    return (node.kind, node.target if node.is_op else node.kind.value, node.input_metas, node.outputs,
            _args_key(node.args), _args_key(tuple(sorted(node.kwargs.items()))))


def _args_key(value: Any) -> Any:
    if isinstance(value, TensorRef):
        return ("ref", value.index)
    if isinstance(value, (list, tuple)):
        return tuple(_args_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _args_key(v)) for k, v in sorted(value.items()))
    return repr(value)


@dataclass
class FormulationCache:
    """What formulations of one graph on one mesh share across training settings (the planner's
    recompute levels): candidates, node vectors, edge matrices and the transition pricer, keyed by
    structure plus the settings they depend on. Pass the same one to ``formulate`` for the same
    graph, cluster, mesh and optimizer."""

    graph: OpGraph
    cluster: Cluster
    mesh: tuple[int, ...]
    optimizer: str
    nodes: list[OpNode] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    keys: list[tuple] = field(default_factory=list)
    rg: set[str] = field(default_factory=set)
    choices: list[list[Signature]] = field(default_factory=list)
    links: list[tuple[int, int, tuple]] = field(default_factory=list)     # (u, v, refs) per graph edge
    saved: dict[tuple[str, bool], tuple[bool, ...]] = field(default_factory=dict)
    costs: dict[tuple, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    edges: dict[tuple, np.ndarray] = field(default_factory=dict)
    pair: Any = None

    def __post_init__(self) -> None:
        graph = self.graph
        self.nodes = [n for n in graph.topo() if n.kind is not NodeKind.OUTPUT]
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.keys = [structural_key(n) for n in self.nodes]
        self.rg = requires_grad(graph)
        cand_cache: dict[tuple, list[Signature]] = {}
        for n, key in zip(self.nodes, self.keys):
            if key not in cand_cache:
                cand_cache[key] = ops.candidate_signatures(n, self.mesh, inner_collectives=True)
            self.choices.append(cand_cache[key])
        for u in self.nodes:
            for v_name in graph.nx.successors(u.name):
                if graph[v_name].kind is not NodeKind.OUTPUT:
                    self.links.append((self.index[u.name], self.index[v_name],
                                       tuple(graph.nx.edges[u.name, v_name]["refs"])))
        self.pair = _pair_pricer(self.mesh, self.cluster)

    def serves(self, graph: OpGraph, cluster: Cluster, mesh: tuple[int, ...], optimizer: str) -> bool:
        return (self.graph is graph and self.cluster is cluster and self.mesh == mesh
                and self.optimizer == optimizer)

    def saved_outputs(self, node: OpNode, recomputed: bool) -> tuple[bool, ...]:
        key = (node.name, recomputed)
        if key not in self.saved:
            self.saved[key] = _saved_outputs(self.graph, node, recomputed)
        return self.saved[key]


def formulate(graph: OpGraph, cluster: Cluster, mesh_shape: Sequence[int], *, optimizer: str = "adamw",
              memory_limit_bytes: float | None = None, training: Training | None = None,
              cache: FormulationCache | None = None) -> Formulation:
    """The SearchProblem of ``graph`` on ``mesh_shape`` for one optimizer step under ``training``
    (default ``Training()``; its ``recompute`` "auto" counts as none: the planner decides).
    ``cache``: shared by formulations of the same graph, cluster, mesh and optimizer."""
    training = training or Training()
    mesh = tuple(int(s) for s in mesh_shape)
    if cache is None or not cache.serves(graph, cluster, mesh, optimizer):
        cache = FormulationCache(graph, cluster, mesh, optimizer)
    nodes, index, keys, rg, choices = cache.nodes, cache.index, cache.keys, cache.rg, cache.choices
    recomputed = recomputed_names(graph, training)
    k = training.micro_batches
    setting = (k, training.param_dtype, training.attention)   # what node vectors depend on besides recompute

    def node_vectors(i: int) -> tuple[np.ndarray, np.ndarray]:
        n, key = nodes[i], keys[i]
        policy = recomputed.get(n.name, "none")
        saved = cache.saved_outputs(n, policy != "none")
        ck = (key, n.name in rg, policy, saved, setting)
        if ck not in cache.costs:
            cache.costs[ck] = _node_vectors(n, choices[i], mesh, cluster, optimizer, n.name in rg, training,
                                            policy != "none", saved)
        return cache.costs[ck]

    vectors = [node_vectors(i) for i in range(len(nodes))]

    grad_itemsize = itemsize(training.grad_reduce_dtype)
    edges = []
    for u, v, refs in cache.links:
        reboxed = recomputed.get(nodes[v].name) == "full"        # a full block boxes its inputs again
        ek = (keys[u], keys[v], refs, nodes[u].name in rg, reboxed, k, grad_itemsize)
        if ek not in cache.edges:
            cache.edges[ek] = _edge_matrix(nodes[u], nodes[v], refs, choices[u], choices[v],
                                           nodes[u].name in rg, cache.pair, k, 1 + reboxed, grad_itemsize)
        edges.append((u, v, cache.edges[ek]))

    policy_keys = [(key, recomputed.get(n.name, "none")) for n, key in zip(nodes, keys)]
    problem = SearchProblem(
        nodes=[n.name for n in nodes], choices=choices,
        node_cost=[c for c, _ in vectors], node_mem=[m for _, m in vectors], edges=edges,
        memory_limit_bytes=memory_limit_bytes, groups=layer_groups(nodes, policy_keys),
    )
    return Formulation(problem, nodes, mesh, index, cache)


def _saved_outputs(graph: OpGraph, node: OpNode, recomputed: bool) -> tuple[bool, ...]:
    """Which outputs of op ``node`` autograd keeps (autoddl/activations.py ``saved_outputs``)."""
    if not node.is_op:
        return ()
    kept = saved_outputs(graph, node, recomputed)
    return tuple(i in kept for i in range(len(node.outputs)))


def _node_vectors(node: OpNode, cands: list[Signature], mesh: tuple[int, ...], cluster: Cluster,
                  optimizer: str, needs_grad: bool, training: Training, recomputed: bool,
                  saved: tuple[bool, ...]) -> tuple[np.ndarray, np.ndarray]:
    cost = np.zeros(len(cands))
    mem = np.zeros(len(cands))
    if node.kind is NodeKind.PARAMETER:
        meta = node.outputs[0]
        for j, sig in enumerate(cands):
            frac = sig.outputs[0].shard_fraction(mesh)
            numel = meta.numel * frac
            if meta.is_floating:           # float32 masters, whatever the working dtype
                cost[j] = optimizer_time_s(numel * MASTER_ITEMSIZE, numel, optimizer, cluster, mesh)
                mem[j] = param_state_bytes(numel, training, optimizer)
            else:
                cost[j] = optimizer_time_s(meta.nbytes * frac, numel, optimizer, cluster, mesh)
                mem[j] = 2 * meta.nbytes * frac + optimizer_state_bytes(numel, optimizer)
    elif node.kind is NodeKind.OP:
        saves = node.op_name not in VIEW_OPS and node.op_name != "getitem"
        for j, sig in enumerate(cands):
            step = op_compute_time_s(node, sig, mesh, cluster, needs_backward=needs_grad,
                                     attention=training.attention)
            if recomputed:
                step += op_forward_time_s(node, sig, mesh, cluster, training.attention)
            inner = ops.inner_collectives(node, sig, mesh)
            if inner:       # the kernel's own collectives, forward (and again when recomputed), and
                # those autograd runs again in backward
                step += (1 + recomputed) * transitions_time_s([(c.kind, c.axis, c.nbytes) for c in inner], mesh, cluster)
                step += transitions_time_s([(c.kind, c.axis, c.nbytes) for c in inner if c.in_backward and needs_grad],
                                           mesh, cluster)
            cost[j] = training.micro_batches * step
            if saves:
                mem[j] = sum(m.nbytes * nd.shard_fraction(mesh)
                             for m, nd, kept in zip(node.outputs, sig.outputs, saved) if kept and m.dtype != "none")
                mem[j] += 0 if recomputed else kept_scores_bytes(node, sig, mesh, training)
    return cost, mem


# Divisible by every mesh size we meet, so a transition's bytes recover its divisor exactly.
_PROBE_BYTES = 2**40 * 3**6 * 5**3 * 7**2


def _pair_pricer(mesh: tuple[int, ...], cluster: Cluster):
    """Seconds of one edge's forward boxing plus its gradient's transitions over one optimizer step,
    memoised; the same transitions ``costmodel.plan_cost`` charges (an activation's gradient goes
    back through the executor's redistribute, a parameter's straight to its storage).

    ``price(fwd_bytes, grad_bytes, src, dst, grad, shape, k, fwd_times)``: ``shape`` a parameter's (None
    for an activation: a parameter's gather and sync over several axes are one collective where its
    shape nests evenly, autoddl.boxing.parameter_moves); ``k`` micro-steps;
    the forward boxing runs ``fwd_times`` times per micro-step (2 when a fully recomputed consumer
    boxes its input again). Every transition runs once per micro-step except a parameter
    gradient's all-reduce, once per step (the earlier micro-steps skip it, as DDP's ``no_sync``).

    Which collectives a transition runs depends only on the layouts; their bytes are the
    tensor's divided by a layout-given factor. So the collectives are found once per layout
    pair (with a probe size) and only re-priced per tensor size."""
    def probe(found) -> tuple:
        return tuple((kind, axis, _PROBE_BYTES // nbytes) for kind, axis, nbytes in found)

    @lru_cache(maxsize=None)
    def steps(src: NdSbp, dst: NdSbp, grad: NdSbp | None, shape: tuple[int, ...] | None) -> tuple[tuple, tuple]:
        if shape is None:                               # an activation
            forward = probe(transitions_of(_PROBE_BYTES, src, dst, mesh))
            backward = probe(edge_backward_transitions(_PROBE_BYTES, src, dst, grad, mesh)) if grad is not None else ()
            return forward, backward
        forward = probe(parameter_transitions_of(_PROBE_BYTES, src, dst, shape, mesh))
        backward = probe(parameter_transitions_of(_PROBE_BYTES, grad, needed_grad_ndsbp(src), shape, mesh)) \
            if grad is not None else ()
        return forward, backward

    @lru_cache(maxsize=None)
    def line(kind, axis: Group) -> tuple[float, float]:
        """(seconds, seconds per byte): every collective's time is alpha + bytes * beta."""
        alpha = transitions_time_s([(kind, axis, 0)], mesh, cluster)
        return alpha, (transitions_time_s([(kind, axis, 2**30)], mesh, cluster) - alpha) / 2**30

    def seconds(found: tuple, nbytes: int, is_param: bool, k: int) -> float:
        total = 0.0
        for kind, axis, div in found:
            alpha, per_byte = line(kind, axis)
            once = is_param and kind is CollectiveKind.ALL_REDUCE
            total += (1 if once else k) * (alpha + per_byte * (nbytes // div))
        return total

    @lru_cache(maxsize=None)
    def price(fwd_bytes: int, grad_bytes: int, src: NdSbp, dst: NdSbp, grad: NdSbp | None,
              shape: tuple[int, ...] | None, k: int = 1, fwd_times: int = 1) -> float:
        is_param = shape is not None
        forward, backward = steps(src, dst, grad, shape)
        return (k * fwd_times * seconds(forward, fwd_bytes, False, 1)
                + seconds(backward, grad_bytes, is_param, k))
    return price


def _edge_matrix(u: OpNode, v: OpNode, refs: tuple, cu: list[Signature], cv: list[Signature],
                 u_needs_grad: bool, price, k: int = 1, fwd_times: int = 1, grad_itemsize: int | None = None
                 ) -> np.ndarray:
    """(len(cu), len(cv)) seconds of edge u -> v over one step (``price``'s rules). A parameter's
    gradient crosses the network in ``grad_itemsize`` bytes per element (the reduce dtype)."""
    total = np.zeros((len(cu), len(cv)))
    is_param = u.kind is NodeKind.PARAMETER
    for out_index, slot in refs:
        meta = u.outputs[out_index]
        if meta.dtype == "none":
            continue
        with_grad = u_needs_grad and meta.is_floating
        grad_bytes = meta.numel * grad_itemsize if is_param and grad_itemsize else meta.nbytes
        srcs = [s.outputs[out_index] for s in cu]
        dsts = [(s.inputs[slot], grad_ndsbp(s.inputs[slot], s.outputs) if with_grad else None) for s in cv]
        su, si = _unique(srcs)
        du, di = _unique(dsts)
        times = 1 if is_param else fwd_times
        shape = tuple(meta.shape) if is_param else None
        table = np.array([[price(meta.nbytes, grad_bytes, s, d, g, shape, k, times) for d, g in du] for s in su])
        total += table[np.ix_(si, di)]
    return total


def _unique(items: list) -> tuple[list, np.ndarray]:
    pos: dict[Any, int] = {}
    inverse = np.array([pos.setdefault(x, len(pos)) for x in items], dtype=np.int64)
    return list(pos), inverse


_LAYER = re.compile(r"^(.*?\.)(\d+)(\..*|)$")


def layer_groups(nodes: list[OpNode], keys: list[tuple]) -> list[list[list[int]]]:
    """Repeated layers (``h.0``, ``h.1``, ...) as block-move groups of node indices.

    A node belongs to the instance named by the first numbered segment of its module
    path (parameters: of their fqn); instances whose node sequences have the same
    structural keys form one group.
    """
    instances: dict[tuple[str, str], list[int]] = {}
    for i, n in enumerate(nodes):
        path = n.target if n.kind is NodeKind.PARAMETER else n.module_path
        m = _LAYER.match(path or "")
        if m:
            instances.setdefault((m.group(1), m.group(2)), []).append(i)
    by_stack: dict[tuple, list[list[int]]] = {}
    for (stack, _), members in instances.items():
        shape = tuple(keys[i] for i in members)
        by_stack.setdefault((stack, shape), []).append(members)
    return [group for group in by_stack.values() if len(group) >= 2]
