"""Expert plans (data, tensor, sequence parallel, ZeRO-3, DP x TP, FSDP x TP) as assignments of a SearchProblem.

Each baseline gives every mesh axis a role, and a role fixes what an expert fixes:

    role  user inputs      parameter storage         parameter use
    dp    S(0) (batch)     B                         B (replicated weights)
    zero  S(0) (batch)     S(0) where it divides     B (gathered for use)
    tp    B                as first used             as stored (no weight boxing)
    sp    B                as first used             as stored (stream split on the sequence)

Everything else (each op's signature) is chosen by one greedy pass in execution
order: the allowed candidate with the least compute plus boxing from the
already-placed producers. On a ``tp`` axis that pass finds Megatron's pattern by
itself: a linear fed a B activation splits its weight's output features (column
parallel), the next one splits its input features and yields P (row parallel),
and the P is all-reduced where a non-linear op needs it whole; an embedding
splits its table by vocabulary rows (P output).
On an ``sp`` axis the stream between those regions is split on the sequence
(dim 1): a linear or embedding splits its weight first, whatever boxing that
costs (so a column-parallel linear all-gathers its sequence-split input), and
a partial sum is reduce-scattered onto the sequence, not all-reduced.
On both, a weight is used as it is stored, so a weight used twice (GPT-2's
lm_head tied to the token embedding) is vocabulary-split for both uses.
A baseline that does not apply (no batch dim that divides, no sequence dim for
``sp``, no column -> row linear pair) is reported with the reason, never
silently replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from autoddl.graph import NodeKind, OpNode
from autoddl.op_families import MATMUL_OPS, VIEW_OPS
from autoddl.sbp import B, NdSbp, S, Sbp, Signature
from search.formulate import Formulation



@dataclass(frozen=True)
class BaselineSpec:
    name: str
    roles: tuple[str, ...]          # one role per mesh axis
    description: str


def baseline_specs(mesh_ndim: int) -> list[BaselineSpec]:
    """The expert plans that exist on a mesh with ``mesh_ndim`` axes."""
    if mesh_ndim == 1:
        return [
            BaselineSpec("dp", ("dp",), "data parallel: batch split, weights replicated, gradients all-reduced"),
            BaselineSpec("zero3", ("zero",), "ZeRO-3 / FSDP: batch split, weights sharded and gathered for use"),
            BaselineSpec("tp", ("tp",), "Megatron tensor parallel: column -> row linear pairs, heads split"),
            BaselineSpec("sp", ("sp",), "Megatron sequence parallel: tp with activations split on the sequence"),
        ]
    if mesh_ndim == 2:
        return [
            BaselineSpec("dp", ("dp", "dp"), "data parallel over both mesh axes"),
            BaselineSpec("zero3", ("zero", "zero"), "ZeRO-3 / FSDP over both mesh axes"),
            BaselineSpec("dp_tp", ("dp", "tp"), "data parallel across the outer axis, Megatron inside a node"),
            BaselineSpec("fsdp_tp", ("zero", "tp"), "ZeRO-3 / FSDP across the outer axis, Megatron inside a node "
                                                    "(torchtitan's 2-D)"),
        ]
    return [BaselineSpec("dp", ("dp",) * mesh_ndim, "data parallel over every mesh axis")]


EXCHANGED = {"dp_tp": "tp_dp", "fsdp_tp": "tp_fsdp"}    # a 2-D baseline -> its twin with the axes' roles exchanged


def exchanged_specs(mesh_ndim: int) -> list[BaselineSpec]:
    """The 2-D baselines whose axes play different roles, with the roles exchanged: Megatron on
    the outer axis, the batch split on the inner one (``tp_dp``, ``tp_fsdp``). No expert runs
    them by default (tp goes inside a node), but where the inner link is not much faster than
    the outer one a step may be cheaper so (issue 14: two hosts at 10 Gbit/s). None on other meshes."""
    if mesh_ndim != 2:
        return []
    return [BaselineSpec(EXCHANGED[s.name], s.roles[::-1], f"{s.name} with its mesh axes' roles exchanged: "
                                                           f"{s.roles[1]} on the outer axis, {s.roles[0]} inside")
            for s in baseline_specs(2) if s.name in EXCHANGED]


@dataclass(frozen=True)
class Baseline:
    spec: BaselineSpec
    assignment: np.ndarray | None
    reason: str = ""                # why it does not apply, when assignment is None

    @property
    def applicable(self) -> bool:
        return self.assignment is not None


def build_baseline(form: Formulation, spec: BaselineSpec) -> Baseline:
    """Greedy assignment obeying ``spec``'s roles, or a Baseline saying why it does not apply."""
    problem, nodes, mesh = form.problem, form.nodes, form.mesh_shape
    inputs = [n for n in nodes if n.kind is NodeKind.INPUT]
    batch_dims_split = [
        axis for axis, role in enumerate(spec.roles) if role in ("dp", "zero")
    ]
    if batch_dims_split and not any(_divides_on(n, 0, mesh, batch_dims_split) for n in inputs):
        return Baseline(spec, None, f"no user input has a batch dim divisible by {_prod(mesh, batch_dims_split)}")
    seq_axes = [axis for axis, role in enumerate(spec.roles) if role == "sp"]
    if seq_axes and not any(_has_sequence(n) and _divides_on(n, 1, mesh, seq_axes) for n in inputs):
        return Baseline(spec, None, f"no user input has a sequence dim (dim 1 of (batch, seq) token ids or of "
                                    f"(batch, seq, ...) values) divisible by {_prod(mesh, seq_axes)}")

    params = {n.name for n in nodes if n.kind is NodeKind.PARAMETER}
    n_nodes = len(nodes)
    assignment = np.full(n_nodes, -1, dtype=np.int64)
    lazy_params: set[int] = set()
    incoming: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n_nodes)]
    for u, v, mat in problem.edges:
        incoming[v].append((u, mat))

    from_inputs = _from_inputs(nodes)
    memo: dict[tuple, tuple[int, dict[int, int]]] = {}     # _greedy_key -> (choice, lazy storages by edge)
    for i, node in enumerate(nodes):
        cands = problem.choices[i]
        if node.kind in (NodeKind.INPUT, NodeKind.BUFFER):
            assignment[i] = _pick_placeholder(cands, _input_wish(node, spec.roles))
        elif node.kind is NodeKind.PARAMETER:
            if any(role in ("tp", "sp") for role in spec.roles):
                lazy_params.add(i)            # on tp/sp axes, stored as the first consumer uses it
            else:
                assignment[i] = _pick_placeholder(cands, _storage_wish(node, spec.roles))
        else:
            key = _greedy_key(i, node, params, assignment, lazy_params, incoming, problem, form.index,
                              node.name in from_inputs)
            if key not in memo:
                best, lazy = _greedy_op(i, node, cands, spec.roles, params, assignment, lazy_params, incoming,
                                        problem, form.index, node.name in from_inputs)
                memo[key] = best, {pos: lazy[u] for pos, (u, _) in enumerate(incoming[i]) if u in lazy}
            assignment[i], lazy = memo[key]
            for pos, a in lazy.items():
                u = incoming[i][pos][0]
                assignment[u] = a
                lazy_params.discard(u)
    for i in lazy_params:                     # a parameter nobody used: as its roles wish
        if assignment[i] < 0:
            assignment[i] = _pick_placeholder(problem.choices[i], _storage_wish(nodes[i], spec.roles))
    reason = _not_applicable(spec, form, assignment)
    return Baseline(spec, None if reason else assignment, reason)


def _from_inputs(nodes: list[OpNode]) -> set[str]:
    """The ops that depend on a user input (topological ``nodes``): the others compute constants from
    parameters and buffers alone (a rotary table, a causal mask), which have no batch dim."""
    out = {n.name for n in nodes if n.kind is NodeKind.INPUT}
    for n in nodes:
        if n.kind is NodeKind.OP and any(ref.node in out for ref in n.inputs):
            out.add(n.name)
    return out


class _Axes(NamedTuple):
    """A spec's mesh axes by role: ``model`` the tp / sp axes, ``batch`` the dp / zero axes, ``seq``
    the sp axes."""
    roles: tuple[str, ...]
    model: list[int]
    batch: list[int]
    seq: list[int]

    @classmethod
    def of(cls, roles: tuple[str, ...]) -> "_Axes":
        return cls(roles, [axis for axis, role in enumerate(roles) if role in ("tp", "sp")],
                   [axis for axis, role in enumerate(roles) if role in ("dp", "zero")],
                   [axis for axis, role in enumerate(roles) if role == "sp"])


def _greedy_op(i: int, node: OpNode, cands: list[Signature], roles: tuple[str, ...], params: set[str],
               assignment: np.ndarray, lazy_params: set[int], incoming, problem, index: dict[str, int],
               from_inputs: bool = True) -> tuple[int, dict[int, int]]:
    """The allowed candidate with the smallest :func:`_expert_key`, and the storages it picks for the
    lazy parameters it reads (tp/sp axes: stored as their first consumer uses them).
    On tp/sp axes no activation is split on dim 0 (the all-B candidate is always allowed). On dp / zero
    axes an op that depends on no user input (``from_inputs`` False) stays replicated: data parallel
    splits the batch, and such a constant has none."""
    param_slots = {slot: ref.node for slot, ref in enumerate(node.inputs) if ref.node in params}
    axes = _Axes.of(roles)
    megatron = _megatron_layer(node, param_slots)
    node_cost, edge_rows, stored, placed = _placed_context(i, node, param_slots, params, assignment, incoming,
                                                           problem, index)
    best, best_key = -1, (np.inf,)
    lazy_choice: dict[int, int] = {}
    for j, sig in enumerate(cands):
        if not _candidate_allowed(node, sig, param_slots, axes, from_inputs):
            continue
        priced = _seconds_with_lazy_storages(node_cost[j], j, sig, edge_rows, lazy_params, problem, node, roles)
        if priced is None:
            continue
        total, chosen_lazy = priced
        sources = [(src, sig.inputs[slot]) for slot, src in placed]
        if not _layouts_allowed(node, sig, stored, sources, axes):
            continue
        key = _expert_key(node, sig, param_slots, sources, axes, megatron, total)
        if key < best_key:
            best, best_key, lazy_choice = j, key, chosen_lazy
    if best < 0:
        best = 0                              # the all-B signature is always first and always allowed
    return best, lazy_choice


def _placed_context(i: int, node: OpNode, param_slots: dict[int, str], params: set[str], assignment: np.ndarray,
                    incoming, problem, index: dict[str, int]) -> tuple[list, list, list, list]:
    """What does not depend on node ``i``'s candidate, read once: its cost row, each incoming edge's
    placed producer's cost row (as floats, added in edge order) or None, the placed parameters'
    storages and the placed inputs' layouts, each by input slot."""
    node_cost = problem.node_cost[i].tolist()
    edge_rows = [(u, mat, mat[assignment[u]].tolist() if assignment[u] >= 0 else None) for u, mat in incoming[i]]
    stored = [(slot, problem.choices[index[name]][assignment[index[name]]].outputs[0])
              for slot, name in param_slots.items() if assignment[index[name]] >= 0]
    placed = [(slot, problem.choices[index[ref.node]][assignment[index[ref.node]]].outputs[ref.index])
              for slot, ref in enumerate(node.inputs)
              if ref.node not in params and ref.node in index and assignment[index[ref.node]] >= 0]
    return node_cost, edge_rows, stored, placed


def _candidate_allowed(node: OpNode, sig: Signature, param_slots: dict[int, str], axes: _Axes,
                       from_inputs: bool) -> bool:
    """The spec's rules on the candidate alone: its weight uses, no batch split on tp/sp axes, a
    vocab-parallel embedding, and nothing split on dp / zero axes for a constant (no user input)."""
    if (not _param_use_allowed(sig, param_slots, axes.roles)
            or (axes.model and _splits_batch(node, sig, param_slots, axes.model))
            or _not_vocab_parallel(node, sig, param_slots, axes.model)):
        return False
    return from_inputs or all(nd[axis].is_broadcast() for nd in sig.outputs for axis in axes.batch)


def _seconds_with_lazy_storages(seconds: float, j: int, sig: Signature, edge_rows: list, lazy_params: set[int],
                                problem, node: OpNode, roles: tuple[str, ...]) -> tuple[float, dict[int, int]] | None:
    """Candidate ``j``'s compute + boxing seconds (``seconds`` its own cost) with the storage each lazy
    parameter it reads takes (its use's layout), or None when such a parameter has no matching storage."""
    chosen_lazy: dict[int, int] = {}
    for u, mat, row in edge_rows:
        if row is not None:
            seconds += row[j]
        elif u in lazy_params:
            a = _storage_matching(problem.choices[u], sig, problem.nodes[u], node, roles)
            if a is None:
                return None
            chosen_lazy[u] = a
            seconds += problem.node_cost[u][a] + mat[a, j]
    return seconds, chosen_lazy


def _layouts_allowed(node: OpNode, sig: Signature, stored: list, sources: list, axes: _Axes) -> bool:
    """The candidate's inputs against what is placed: each weight used as stored on the model axes,
    no boxing Megatron forbids, and no activation turned into a partial sum on a data-parallel axis."""
    if not all(_use_matches_storage(storage, sig.inputs[slot], axes.model) for slot, storage in stored):
        return False
    if any(_megatron_forbids(src, dst, axes.roles, axis, node) for src, dst in sources for axis in axes.model):
        return False
    return not any(d[axis].is_partial() and not s[axis].is_partial() for s, d in sources for axis in axes.batch)


def _expert_key(node: OpNode, sig: Signature, param_slots: dict[int, str], sources: list, axes: _Axes,
                megatron: bool, seconds: float) -> tuple:
    """(gathers a batch-split activation on a dp / zero axis, needs a forward collective on an
    activation, reduce-scatters onto the sequence (sp), minus the weight splits on tp/sp axes,
    seconds); for a linear or embedding on an sp axis (minus its weight's splits, needs a
    collective, slices a replicated activation, seconds). The leading terms make the expert pattern
    structural: a split batch stays split, and Megatron splits weights, even where the cost model
    alone would replicate."""
    gathers = int(any(s[axis].is_split() and not d[axis].is_split() for s, d in sources for axis in axes.batch))
    boxed = int(any(_collective_needed(src, dst) for src, dst in sources))
    if megatron and "sp" in axes.roles:     # the weight (not a bias) split, then as few collectives as can be
        splits = sum(sig.inputs[slot][axis].is_split() for slot in param_slots for axis in axes.model
                     if node.input_metas[slot].ndim == 2)
        sliced = sum(s.is_broadcast() and d.is_split() for src, dst in sources for s, d in zip(src, dst))
        return (gathers, -splits, boxed, sliced, seconds)
    splits = sum(sig.inputs[slot][axis].is_split() for slot in param_slots for axis in axes.model
                 if megatron or axes.roles[axis] == "tp")
    return (gathers, boxed, -_scatters_sequence(sources, sig, axes.seq), -splits, seconds)


def _greedy_key(i: int, node: OpNode, params: set[str], assignment: np.ndarray, lazy_params: set[int], incoming,
                problem, index: dict[str, int], from_inputs: bool) -> tuple:
    """Everything :func:`_greedy_op`'s choice for node ``i`` depends on: the node's structure, its
    candidates and cost vector (shared objects across repeated blocks: search/formulate.py's
    FormulationCache), each incoming edge's matrix and its producer's state (placed: its choice;
    a lazy parameter: its candidates, costs and the slot reading it), and the layouts of the placed
    producers and parameters. Equal keys give equal choices, so the blocks of a decoder are
    decided once."""
    slot_of = {ref.node: slot for slot, ref in reversed(list(enumerate(node.inputs)))}     # first slot reading
    edges = tuple((id(mat), int(assignment[u])) if assignment[u] >= 0 else
                  (id(mat), id(problem.choices[u]), id(problem.node_cost[u]), slot_of[problem.nodes[u]])
                  if u in lazy_params else (id(mat),) for u, mat in incoming[i])
    layouts = tuple((slot, ref.node in params, problem.choices[index[ref.node]][assignment[index[ref.node]]]
                     .outputs[0 if ref.node in params else ref.index])
                    for slot, ref in enumerate(node.inputs)
                    if ref.node in index and assignment[index[ref.node]] >= 0)
    params_at = tuple(slot for slot, ref in enumerate(node.inputs) if ref.node in params)
    return (id(problem.choices[i]), id(problem.node_cost[i]), node.op_name, node.input_metas, node.outputs,
            from_inputs, params_at, edges, layouts)


def _megatron_forbids(src: NdSbp, dst: NdSbp, roles: tuple[str, ...], axis: int, node: OpNode) -> bool:
    """Megatron moves activations only by gathering (S->B) or reducing (P->B; P->S, a reduce-scatter,
    for sequence parallelism); never by all-to-all nor by slicing a replicated one (B->S).
    Tensor and sequence parallelism reduce a partial sum right away: no op takes a P activation,
    except, under sequence parallelism, a view (a row-parallel linear on flattened tokens is viewed
    back to (batch, sequence, hidden) before its reduce-scatter onto the sequence)."""
    s, d = src[axis], dst[axis]
    if d.is_partial() and s.is_partial() and roles[axis] == "sp" and node.op_name in VIEW_OPS:
        return False
    if d.is_partial() or (roles[axis] == "tp" and s.is_partial() and d.is_split()):
        return True
    if s == d or not d.is_split():
        return False
    return not s.is_partial()


def _megatron_layer(node: OpNode, param_slots: dict[int, str]) -> bool:
    """A layer whose weight Megatron always splits on the model axis: a linear / matmul with a 2-D
    parameter (column or row parallel) or an embedding table (vocabulary parallel)."""
    if node.op_name == "embedding":
        return 0 in param_slots
    return node.op_name in MATMUL_OPS and any(node.input_metas[slot].ndim == 2 for slot in param_slots)


def _scatters_sequence(sources: list[tuple[NdSbp, NdSbp]], sig: Signature, seq_axes: list[int]) -> int:
    """Sequence parallelism reduce-scatters a partial sum onto the sequence dim (dim 1 of the
    (batch, sequence, hidden) stream): 1 when the op takes a P input there and yields S(1)."""
    return int(any(src[a].is_partial() and not dst[a].is_partial() and sig.outputs and sig.outputs[0][a] == S(1)
                   for src, dst in sources for a in seq_axes))


def _use_matches_storage(storage: NdSbp, use: NdSbp, model_axes: list[int]) -> bool:
    """On tp/sp axes a weight is used as it is stored (B storage may be used as P: that is local).
    A weight used twice (a tied embedding and output projection) thus gets one layout both uses
    share: the first use's, which the second must take too."""
    return all(use[a] == storage[a] or (use[a].is_partial() and storage[a].is_broadcast()) for a in model_axes)


def _splits_batch(node: OpNode, sig: Signature, param_slots: dict[int, str], model_axes: list[int]) -> bool:
    """Tensor and sequence parallelism never split an activation's dim 0 (the batch) on their axes.
    An input of lower rank than the output broadcasts against the output's trailing dims (a (T, C)
    position embedding added to a (B, T, C) stream): its dim 0 is the sequence, not the batch."""
    out_nd = node.outputs[0].ndim if node.outputs else 0
    activations = [nd for slot, nd in enumerate(sig.inputs)
                   if slot not in param_slots and node.input_metas[slot].ndim >= out_nd] + list(sig.outputs)
    return any(nd[axis] == S(0) for nd in activations for axis in model_axes)


def _collective_needed(src, dst) -> bool:
    """True unless ``src`` -> ``dst`` is free on every axis: equal, or slicing a replicated tensor.
    Making a partial sum (S->P, B->P) counts as needing one: it defers a reduction."""
    return any(s != d and not (s.is_broadcast() and d.is_split()) for s, d in zip(src, dst))


def _not_vocab_parallel(node: OpNode, sig: Signature, param_slots: dict[int, str], model_axes: list[int]) -> bool:
    """Megatron splits an embedding table only by vocabulary rows (VocabParallelEmbedding)."""
    if node.op_name != "embedding":
        return False
    return any(sig.inputs[slot][axis].is_split() and sig.inputs[slot][axis] != S(0)
               for slot in param_slots for axis in model_axes)


def _param_use_allowed(sig: Signature, param_slots: dict[int, str], roles: tuple[str, ...]) -> bool:
    for slot in param_slots:
        for axis, role in enumerate(roles):
            if role in ("dp", "zero") and not sig.inputs[slot][axis].is_broadcast():
                return False
    return True


def _storage_matching(param_cands: list[Signature], sig: Signature, param_name: str, node: OpNode,
                      roles: tuple[str, ...]) -> int | None:
    """The storage a lazy parameter gets from its first use: on tp/sp axes the use itself (B where
    the use is P: B -> P is local), on dp/zero axes what the role stores: B, or for zero S(d) on the
    first dim d the use does not split (S(0) unless tp splits dim 0 already; then B when none divides).
    A zero split on a dim tp splits too would nest the wrong way (rank (z, t) holding piece z*T + t,
    not tp piece t's z-th part) and each use would gather over tp as well; on another dim the use is
    one all-gather over the zero axis, as FSDP2 over tp gathers (torchtitan: ``_StridedShard``)."""
    use = next(sig.inputs[slot] for slot, ref in enumerate(node.inputs) if ref.node == param_name)
    as_used = tuple(B if s.is_partial() else s for s in use)
    taken = {s.dim for s in as_used if s.is_split()}
    zero_splits = [S(d) for d in range(max(taken, default=0) + 2) if d not in taken] + [B]
    for split in zero_splits:
        wanted = tuple((split if role == "zero" else B) if role in ("dp", "zero") else s
                       for role, s in zip(roles, as_used))
        for a, cand in enumerate(param_cands):
            if tuple(cand.outputs[0]) == wanted:
                return a
    return None


def _input_wish(node: OpNode, roles: tuple[str, ...]) -> tuple[Sbp, ...]:
    wish = []
    for role in roles:
        if role in ("dp", "zero") and node.kind is NodeKind.INPUT and node.outputs[0].ndim >= 1:
            wish.append(S(0))
        else:
            wish.append(B)
    return tuple(wish)


def _storage_wish(node: OpNode, roles: tuple[str, ...]) -> tuple[Sbp, ...]:
    return tuple(S(0) if role == "zero" and node.outputs[0].ndim >= 1 else B for role in roles)


def _pick_placeholder(cands: list[Signature], wish: tuple[Sbp, ...]) -> int:
    """The candidate matching ``wish`` on most axes (B where a wished split does not divide)."""
    best, best_score = 0, -1
    for j, sig in enumerate(cands):
        nd = sig.outputs[0] if sig.outputs else None
        if nd is None:
            return 0
        score = sum(2 if s == w else (1 if s.is_broadcast() else -5) for s, w in zip(nd, wish))
        if score > best_score:
            best, best_score = j, score
    return best


def _not_applicable(spec: BaselineSpec, form: Formulation, assignment: np.ndarray) -> str:
    if not any(role in ("tp", "sp") for role in spec.roles):
        return ""
    params = {n.name for n in form.nodes if n.kind is NodeKind.PARAMETER}
    column = row = 0
    for i, node in enumerate(form.nodes):
        if node.kind is not NodeKind.OP or node.op_name not in MATMUL_OPS:
            continue
        sig = form.problem.choices[i][assignment[i]]
        for slot, ref in enumerate(node.inputs):
            if ref.node not in params or node.input_metas[slot].ndim != 2:
                continue
            for axis, s in enumerate(sig.inputs[slot]):
                if s.is_split() and spec.roles[axis] in ("tp", "sp"):
                    # by what the split does, whatever the weight's layout ((out, in) for linear,
                    # (in, out) for addmm / mm): contracted -> P output (row), kept -> split output
                    row += sig.outputs[0][axis].is_partial()
                    column += sig.outputs[0][axis].is_split()
    if column == 0 or row == 0:
        return ("no column -> row parallel linear pair "
                f"({column} column-split and {row} row-split weights)")
    return ""


def _has_sequence(node: OpNode) -> bool:
    """Token ids (batch, seq) or values (batch, seq, features...): a (batch, features) input has none."""
    meta = node.outputs[0]
    return meta.ndim >= 3 or (meta.ndim == 2 and not meta.is_floating)


def _divides_on(node: OpNode, dim: int, mesh: tuple[int, ...], axes: list[int]) -> bool:
    meta = node.outputs[0]
    return meta.ndim > dim and meta.shape[dim] % _prod(mesh, axes) == 0


def _prod(mesh: tuple[int, ...], axes: list[int]) -> int:
    out = 1
    for a in axes:
        out *= mesh[a]
    return out
