"""SearchProblem: the plan search as a plain numeric problem.

The planner turns (graph, mesh, cluster) into this problem: one node per graph
node with a list of candidate signatures (opaque here), a cost per candidate
(compute, forward + backward, seconds), a cost matrix per graph edge (boxing
forward + backward between the producer's and the consumer's choice) and the
per-device memory of each candidate. Search algorithms (coordinate descent,
the exact ILP) work only on these arrays, so they are testable without the
cost model.

Objective:  sum_i node_cost[i][a_i] + sum_(u,v,M) M[a_u, a_v]
Memory:     base_mem + sum_i node_mem[i][a_i]  <=  memory_limit_bytes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np

GB = 1e9   # the unit of --memory-gb and of cluster.yaml's memory_gb


class NoFeasiblePlanError(RuntimeError):
    """No assignment fits the per-device memory limit, whatever the search does."""

    def __init__(self, min_memory_bytes: float, memory_limit_bytes: float,
                 largest: Sequence[tuple[str, float]] = ()):
        self.min_memory_bytes = float(min_memory_bytes)
        self.memory_limit_bytes = float(memory_limit_bytes)
        over = self.min_memory_bytes - self.memory_limit_bytes
        msg = (f"no plan fits the per-device memory limit of {self.memory_limit_bytes / GB:.3f} GB: "
               f"the plan using the least memory still needs {self.min_memory_bytes / GB:.3f} GB "
               f"per device ({over / GB:.3f} GB over). Use more devices, a larger --memory-gb, "
               f"or a smaller batch.")
        if largest:
            msg += " Largest minimum needs: " + ", ".join(f"{n} {b / GB:.3f} GB" for n, b in largest)
        super().__init__(msg)


@dataclass(frozen=True, eq=False)
class SearchResult:
    """What a search returns: the chosen candidate index per node and how it was found."""

    assignment: np.ndarray                  # (n,) int, index into problem.choices[i]
    cost: float                             # objective, seconds
    memory_bytes: float                     # per device, base_mem included
    method: str                             # "coordinate_descent" | "ilp"
    start: str                              # start the result descends from ("greedy", a baseline, "ilp")
    sweeps: int = 0                         # rounds of the descent that produced it
    start_costs: dict[str, float] = field(default_factory=dict)      # cost of each start as given
    descended_costs: dict[str, float] = field(default_factory=dict)  # cost after descending from it
    seconds: float = 0.0
    optimal: bool = False                   # proven optimal (ILP solved to the gap)
    mip_gap: float | None = None
    notes: tuple[str, ...] = ()

    def chosen(self, problem: "SearchProblem") -> dict[str, Any]:
        """Node name -> chosen candidate (signature)."""
        return {name: problem.choices[i][int(c)] for i, (name, c) in enumerate(zip(problem.nodes, self.assignment))}


@dataclass(frozen=True)
class _Arrays:
    """Flat, merged arrays for fast evaluation (built once per problem)."""

    k: np.ndarray                 # (n,) number of choices per node
    off: np.ndarray               # (n+1,) offsets of each node in the flat arrays
    nc: np.ndarray                # (sum k,) node cost
    mem: np.ndarray               # (sum k,) node memory
    eu: np.ndarray                # (E,) merged edges, eu < ev
    ev: np.ndarray                # (E,)
    emat: list[np.ndarray]        # (k_eu, k_ev) summed over parallel edges
    e_off: np.ndarray             # (E,) offsets into ec
    ec: np.ndarray                # (sum k_u*k_v,) flattened emat
    nbr: list[np.ndarray]         # per node: neighbour node indices
    nbr_edge: list[np.ndarray]    # per node: merged edge index of each neighbour
    mcat: list[np.ndarray]        # per node: (k_i, sum k_nbr) edge matrices oriented with i as rows
    col_off: list[np.ndarray]     # per node: column offset of each neighbour's block in mcat
    side_tgt: np.ndarray          # (T,) flat (node, choice) slot an edge term adds to
    side_base: np.ndarray         # (T,) ec index of that term is side_base + a[side_other] * side_mult
    side_other: np.ndarray
    side_mult: np.ndarray
    pad_idx: np.ndarray           # (n, kmax) flat index of (node, choice), 0 where the node has fewer
    pad_ok: np.ndarray            # (n, kmax) bool: choice exists
    side_start: np.ndarray        # (E+1,) side entries of merged edge e are side_start[e]:side_start[e+1]
    nbr_list: list[list[int]]     # the same neighbour structure as Python lists (fast scalar access)
    nbr_edge_list: list[list[int]]
    col_off_list: list[list[int]]
    k_list: list[int]

    def local_all(self, nc: np.ndarray, a: np.ndarray) -> np.ndarray:
        """(sum k,) cost of every (node, choice) with the neighbours at ``a``: node cost + edges."""
        w = self.ec[self.side_base + a[self.side_other] * self.side_mult]
        return nc + np.bincount(self.side_tgt, weights=w, minlength=len(nc))

    def edge_terms(self, edges: np.ndarray, a: np.ndarray) -> np.ndarray:
        """(sum k,) what merged ``edges`` add to ``local_all`` with the neighbours at ``a``."""
        lo, hi = self.side_start[edges], self.side_start[edges + 1]
        ent = np.repeat(lo - np.cumsum(np.concatenate(([0], (hi - lo)[:-1]))), hi - lo) + np.arange((hi - lo).sum())
        w = self.ec[self.side_base[ent] + a[self.side_other[ent]] * self.side_mult[ent]]
        return np.bincount(self.side_tgt[ent], weights=w, minlength=len(self.nc))

    def cost(self, a: np.ndarray) -> float:
        total = self.nc[self.off[:-1] + a].sum()
        if len(self.eu):
            total += self.ec[self.e_off + a[self.eu] * self.k[self.ev] + a[self.ev]].sum()
        return float(total)

    def memory(self, a: np.ndarray) -> float:
        return float(self.mem[self.off[:-1] + a].sum())


def memory_tolerance(limit: float) -> float:
    """Slack allowed on a memory comparison (float sums of byte counts)."""
    return 1e-12 * max(1.0, abs(limit))


@dataclass(frozen=True, eq=False)
class SearchProblem:
    """Per-node candidates with node costs, edge cost matrices and memory; see the module docstring.

    ``groups``: for block moves, a list of groups; a group is a list of "layer
    instances", each instance a list of node indices in corresponding order, and
    corresponding nodes of every instance have the same candidate lists, so one
    choice index means the same signature in each instance. Treat the problem
    as immutable once built (derived arrays are cached).
    """

    nodes: list[str]
    choices: list[list[Any]]
    node_cost: list[np.ndarray]                         # (k_i,) seconds
    edges: list[tuple[int, int, np.ndarray]]            # (u, v, (k_u, k_v) seconds)
    node_mem: list[np.ndarray] | None = None            # (k_i,) bytes per device; None -> zeros
    memory_limit_bytes: float | None = None
    base_mem: float = 0.0                               # bytes per device independent of choices
    groups: list[list[list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if n == 0:
            raise ValueError("SearchProblem: no nodes; the graph is empty")
        if len(set(self.nodes)) != n:
            raise ValueError("SearchProblem: node names are not unique")
        for field_name, seq in (("choices", self.choices), ("node_cost", self.node_cost)):
            if len(seq) != n:
                raise ValueError(f"SearchProblem: {field_name} has {len(seq)} entries for {n} nodes")
        mem = self.node_mem if self.node_mem is not None else [np.zeros(len(c)) for c in self.choices]
        if len(mem) != n:
            raise ValueError(f"SearchProblem: node_mem has {len(mem)} entries for {n} nodes")
        node_cost, node_mem = [], []
        for i, name in enumerate(self.nodes):
            k = len(self.choices[i])
            if k == 0:
                raise ValueError(f"SearchProblem: node {name!r} has no candidate signatures")
            node_cost.append(_vector(self.node_cost[i], k, f"node_cost of node {name!r}"))
            node_mem.append(_vector(mem[i], k, f"node_mem of node {name!r}", allow_negative=True))
        edges = []
        for j, edge in enumerate(self.edges):
            try:
                u, v, m = edge
            except (TypeError, ValueError):
                raise ValueError(f"SearchProblem: edge {j} is not a (u, v, matrix) triple") from None
            u, v = int(u), int(v)
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError(f"SearchProblem: edge {j} ({u} -> {v}) names a node outside 0..{n - 1}")
            if u == v:
                raise ValueError(f"SearchProblem: edge {j} is a self loop on node {self.nodes[u]!r}")
            what = f"edge {self.nodes[u]!r} -> {self.nodes[v]!r}"
            m = np.asarray(m, dtype=np.float64)
            want = (len(self.choices[u]), len(self.choices[v]))
            if m.shape != want:
                raise ValueError(f"SearchProblem: {what} has a cost matrix of shape {m.shape}, expected "
                                 f"{want} (candidates of {self.nodes[u]!r} x candidates of {self.nodes[v]!r})")
            _check_values(m, what)
            edges.append((u, v, m))
        if self.memory_limit_bytes is not None and not np.isfinite(self.memory_limit_bytes):
            raise ValueError(f"SearchProblem: memory_limit_bytes must be finite or None, "
                             f"got {self.memory_limit_bytes}")
        if not np.isfinite(self.base_mem):
            raise ValueError(f"SearchProblem: base_mem must be finite, got {self.base_mem}")
        groups = [[[int(x) for x in inst] for inst in g] for g in self.groups]
        for gi, g in enumerate(groups):
            if len(g) < 2:
                raise ValueError(f"SearchProblem: group {gi} has {len(g)} instance(s); a block move needs >= 2")
            seen: set[int] = set()
            for q, inst in enumerate(g):
                if len(inst) != len(g[0]):
                    raise ValueError(f"SearchProblem: group {gi} instance {q} has {len(inst)} nodes, "
                                     f"instance 0 has {len(g[0])}; instances must correspond node by node")
                for p, (x, x0) in enumerate(zip(inst, g[0])):
                    if not 0 <= x < n:
                        raise ValueError(f"SearchProblem: group {gi} instance {q} names node {x} outside 0..{n - 1}")
                    if x in seen:
                        raise ValueError(f"SearchProblem: group {gi} uses node {self.nodes[x]!r} twice")
                    seen.add(x)
                    if len(self.choices[x]) != len(self.choices[x0]):
                        raise ValueError(
                            f"SearchProblem: group {gi}: node {self.nodes[x]!r} (instance {q}, position {p}) has "
                            f"{len(self.choices[x])} candidates but {self.nodes[x0]!r} (instance 0) has "
                            f"{len(self.choices[x0])}; instances must be structurally identical")
        object.__setattr__(self, "node_cost", node_cost)
        object.__setattr__(self, "node_mem", node_mem)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "base_mem", float(self.base_mem))

    # -- construction from callbacks ------------------------------------------
    @classmethod
    def build(cls, nodes: Sequence[str], choices: Sequence[Sequence[Any]],
              node_cost_fn: Callable[[int, Sequence[Any]], Any],
              edge_list: Iterable[tuple[int, int, Hashable | None]],
              edge_cost_fn: Callable[[int, int], Any], *,
              node_mem_fn: Callable[[int, Sequence[Any]], Any] | None = None,
              memory_limit_bytes: float | None = None, base_mem: float = 0.0,
              groups: Sequence[Sequence[Sequence[int]]] = ()) -> "SearchProblem":
        """Fill the arrays from callbacks.

        ``node_cost_fn(i, choices[i])`` and ``node_mem_fn(i, choices[i])`` return a
        (k_i,) vector for node i. ``edge_list`` holds ``(u, v, cache_key)``;
        ``edge_cost_fn(u, v)`` returns the (k_u, k_v) matrix and is called once per
        distinct non-None cache key (edges whose tensor meta and candidate lists
        are identical share one matrix; the key must say so).
        """
        choices = [list(c) for c in choices]
        node_cost = [np.asarray(node_cost_fn(i, choices[i]), dtype=np.float64) for i in range(len(nodes))]
        node_mem = None
        if node_mem_fn is not None:
            node_mem = [np.asarray(node_mem_fn(i, choices[i]), dtype=np.float64) for i in range(len(nodes))]
        cache: dict[Hashable, np.ndarray] = {}
        edges = []
        for u, v, key in edge_list:
            if key is None:
                m = np.asarray(edge_cost_fn(u, v), dtype=np.float64)
            elif key in cache:
                m = cache[key]
            else:
                m = cache[key] = np.asarray(edge_cost_fn(u, v), dtype=np.float64)
            edges.append((u, v, m))
        return cls(list(nodes), choices, node_cost, edges, node_mem, memory_limit_bytes, base_mem,
                   [[list(inst) for inst in g] for g in groups])

    # -- evaluation -------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def num_choices(self) -> np.ndarray:
        return self._arrays.k

    def check_assignment(self, assignment: Any, what: str = "assignment") -> np.ndarray:
        """Return ``assignment`` as an int array, or raise naming the bad node."""
        a = np.asarray(assignment)
        if a.shape != (self.n,):
            raise ValueError(f"{what} has shape {a.shape}, expected ({self.n},): one choice index per node")
        if a.dtype.kind not in "iu":
            if a.dtype.kind == "f" and np.all(a == np.round(a)):
                a = a.astype(np.int64)
            else:
                raise ValueError(f"{what} must hold integer choice indices, got dtype {a.dtype}")
        a = a.astype(np.int64)
        bad = np.flatnonzero((a < 0) | (a >= self._arrays.k))
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"{what}: node {self.nodes[i]!r} gets choice {int(a[i])}, "
                             f"but it has {int(self._arrays.k[i])} candidates ({len(bad)} node(s) out of range)")
        return a

    def cost(self, assignment: Any) -> float:
        """Objective (seconds): node costs plus edge costs of the chosen candidates."""
        return self._arrays.cost(self.check_assignment(assignment))

    def memory(self, assignment: Any) -> float:
        """Per-device bytes: base_mem plus the chosen candidates' node_mem."""
        return self.base_mem + self._arrays.memory(self.check_assignment(assignment))

    def feasible(self, assignment: Any) -> bool:
        if self.memory_limit_bytes is None:
            return True
        return self.memory(assignment) <= self.memory_limit_bytes + memory_tolerance(self.memory_limit_bytes)

    def min_memory(self) -> float:
        """Exact smallest memory of any plan: base_mem + sum of per-node minimum node_mem."""
        return self.base_mem + float(sum(m.min() for m in self.node_mem))

    def check_memory_limit(self) -> None:
        """Raise NoFeasiblePlanError when even the least-memory plan exceeds the limit."""
        limit = self.memory_limit_bytes
        if limit is None:
            return
        need = self.min_memory()
        if need > limit + memory_tolerance(limit):
            mins = [(self.nodes[i], float(m.min())) for i, m in enumerate(self.node_mem)]
            largest = sorted(mins, key=lambda t: -t[1])[:3]
            raise NoFeasiblePlanError(need, limit, largest)

    @cached_property
    def _arrays(self) -> _Arrays:
        return _compile(self)


def matrix_from_keys(row_keys: Sequence[Hashable], col_keys: Sequence[Hashable],
                     fn: Callable[[Hashable, Hashable], float]) -> np.ndarray:
    """(len(row_keys), len(col_keys)) matrix calling ``fn`` once per distinct key pair.

    Many candidate signatures share the NdSbp of one tensor, so boxing costs
    depend on far fewer pairs than the matrix has entries.
    """
    rk, r_inv = _unique_inverse(row_keys)
    ck, c_inv = _unique_inverse(col_keys)
    small = np.array([[float(fn(r, c)) for c in ck] for r in rk], dtype=np.float64).reshape(len(rk), len(ck))
    return small[np.ix_(r_inv, c_inv)]


def _unique_inverse(keys: Sequence[Hashable]) -> tuple[list[Hashable], np.ndarray]:
    index: dict[Hashable, int] = {}
    inv = np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)
    return list(index), inv


def _vector(x: Any, k: int, what: str, allow_negative: bool = False) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64)
    if v.shape != (k,):
        raise ValueError(f"SearchProblem: {what} has shape {v.shape}, expected ({k},): one value per candidate")
    _check_values(v, what, allow_negative)
    return v


def _check_values(v: np.ndarray, what: str, allow_negative: bool = False) -> None:
    if not np.all(np.isfinite(v)):
        raise ValueError(f"SearchProblem: {what} holds non-finite values; "
                         f"drop impossible candidates instead of giving them an infinite cost")
    if not allow_negative and v.size and v.min() < 0:
        raise ValueError(f"SearchProblem: {what} holds a negative cost ({v.min():g}); times must be >= 0")


def _compile(p: SearchProblem) -> _Arrays:
    n = p.n
    k = np.array([len(c) for c in p.choices], dtype=np.int64)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(k, out=off[1:])
    nc = np.concatenate(p.node_cost)
    mem = np.concatenate(p.node_mem)
    merged: dict[tuple[int, int], np.ndarray] = {}
    for u, v, m in p.edges:
        key, mat = ((u, v), m) if u < v else ((v, u), m.T)
        merged[key] = merged[key] + mat if key in merged else mat.copy()
    keys = list(merged)
    eu = np.array([u for u, _ in keys], dtype=np.int64)
    ev = np.array([v for _, v in keys], dtype=np.int64)
    emat = [np.ascontiguousarray(merged[key]) for key in keys]
    sizes = np.array([m.size for m in emat], dtype=np.int64)
    e_off = np.zeros(len(emat), dtype=np.int64)
    if len(emat):
        np.cumsum(sizes[:-1], out=e_off[1:])
    ec = np.concatenate([m.ravel() for m in emat]) if emat else np.zeros(0)
    inc: list[list[tuple[int, int, np.ndarray]]] = [[] for _ in range(n)]
    for e, (u, v) in enumerate(keys):
        inc[u].append((v, e, emat[e]))
        inc[v].append((u, e, emat[e].T))
    nbr, nbr_edge, mcat, col_off = [], [], [], []
    for i in range(n):
        nbr.append(np.array([j for j, _, _ in inc[i]], dtype=np.int64))
        nbr_edge.append(np.array([e for _, e, _ in inc[i]], dtype=np.int64))
        blocks = [m for _, _, m in inc[i]]
        mcat.append(np.ascontiguousarray(np.hstack(blocks)) if blocks else np.zeros((k[i], 0)))
        widths = np.array([b.shape[1] for b in blocks], dtype=np.int64)
        co = np.zeros(len(blocks), dtype=np.int64)
        if len(blocks):
            np.cumsum(widths[:-1], out=co[1:])
        col_off.append(co)
    # edge e = (u, v): u's choice c gets M[c, a_v] = ec[e_off + c*k_v + a_v]; v's d gets ec[e_off + a_u*k_v + d]
    kv = k[ev]
    tgt, base, other, mult = [], [], [], []
    for e in range(len(emat)):
        u, v = int(eu[e]), int(ev[e])
        tgt += [off[u] + np.arange(k[u]), off[v] + np.arange(k[v])]
        base += [e_off[e] + np.arange(k[u]) * kv[e], e_off[e] + np.arange(k[v])]
        other += [np.full(k[u], v), np.full(k[v], u)]
        mult += [np.ones(k[u], np.int64), np.full(k[v], kv[e])]
    cat = (lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64))
    cols = np.arange(int(k.max()))
    pad_ok = cols[None, :] < k[:, None]
    pad_idx = np.where(pad_ok, off[:-1, None] + cols[None, :], 0)
    side_start = np.zeros(len(emat) + 1, dtype=np.int64)
    np.cumsum(k[eu] + k[ev], out=side_start[1:])
    return _Arrays(k, off, nc, mem, eu, ev, emat, e_off, ec, nbr, nbr_edge, mcat, col_off,
                   cat(tgt), cat(base), cat(other), cat(mult), pad_idx, pad_ok, side_start,
                   [x.tolist() for x in nbr], [x.tolist() for x in nbr_edge], [x.tolist() for x in col_off],
                   k.tolist())
