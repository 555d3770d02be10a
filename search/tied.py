"""Repeated blocks planned once: the search problem with every block tied to its first instance.

A transformer's blocks are identical (search/formulate.py's ``layer_groups``: instances of one
stack whose nodes have the same structural keys, node by node, so one choice index means one
signature in each). Tying them gives a problem of one block's nodes (plus the nodes outside the
blocks) whose variables stand for every instance, as meta-pytorch/autoparallel does with its
"repeated subgraphs" (its PR #18 enforces one solution per repeated region: Llama-3-8B's solve
went from 118.7 s to 5.5 s):

- a representative's node cost and memory are the sums over the nodes it stands for;
- an edge ``u -> v`` becomes ``rep(u) -> rep(v)`` (parallel edges add up); an edge between two
  nodes of one class (the same position in two instances) costs ``M[a, a]``, added to the node cost.

So for every tied assignment ``a``: ``full.cost(expand(a)) == tied.cost(a)`` and the memories are
equal (exact, up to the order of the float sums): the search on the tied problem searches the
block-uniform plans of the full one. What it gives up is a plan in which blocks differ (the first
block beside the embedding, say); the planner prices the expanded plan with the full cost model
as any other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from search.coordinate_descent import coordinate_descent
from search.problem import NoFeasiblePlanError, SearchProblem, SearchResult


@dataclass(frozen=True, eq=False)
class Tied:
    """``problem`` with its repeated instances tied: ``reduced`` and the maps between the two."""

    problem: SearchProblem
    reduced: SearchProblem
    rep: np.ndarray                  # (n,) full node -> reduced node
    members: np.ndarray              # (m,) reduced node -> the full node it is (instance 0 or outside blocks)

    def expand(self, a: np.ndarray) -> np.ndarray:
        """The full assignment of a tied one: every instance takes its representative's choice."""
        return np.asarray(a, dtype=np.int64)[self.rep]

    def restrict(self, a: np.ndarray) -> np.ndarray:
        """A full assignment read at the representatives (instance 0's choices)."""
        return np.asarray(a, dtype=np.int64)[self.members]

    def result(self, r: SearchResult) -> SearchResult:
        """The full problem's result of a search of ``reduced``."""
        a = self.expand(r.assignment)
        return replace(r, assignment=a, cost=self.problem.cost(a), memory_bytes=self.problem.memory(a),
                       notes=r.notes + (f"repeated blocks tied: searched {self.reduced.n} of {self.problem.n} "
                                        "nodes, each block given the first block's choices",))


def tie_blocks(problem: SearchProblem) -> Tied | None:
    """``problem`` with its groups' instances tied to instance 0 (module docstring); None without groups."""
    if not problem.groups:
        return None
    n = problem.n
    cls = np.arange(n)
    for group in problem.groups:
        first = np.asarray(group[0], dtype=np.int64)
        for inst in group[1:]:
            cls[np.asarray(inst, dtype=np.int64)] = first
    members = np.flatnonzero(cls == np.arange(n))
    rep = np.empty(n, dtype=np.int64)
    rep[members] = np.arange(len(members))
    rep = rep[cls]
    cost = [problem.node_cost[i].copy() for i in members]
    mem = [problem.node_mem[i].copy() for i in members]
    for i in np.flatnonzero(cls != np.arange(n)):
        cost[rep[i]] += problem.node_cost[i]
        mem[rep[i]] += problem.node_mem[i]
    edges: dict[tuple[int, int], np.ndarray] = {}
    for u, v, m in problem.edges:
        ru, rv = int(rep[u]), int(rep[v])
        if ru == rv:
            cost[ru] += np.diag(m)
            continue
        key, mat = ((ru, rv), m) if ru < rv else ((rv, ru), m.T)
        edges[key] = edges[key] + mat if key in edges else mat.copy()
    reduced = SearchProblem(nodes=[problem.nodes[i] for i in members], choices=[problem.choices[i] for i in members],
                            node_cost=cost, edges=[(u, v, m) for (u, v), m in edges.items()], node_mem=mem,
                            memory_limit_bytes=problem.memory_limit_bytes, base_mem=problem.base_mem)
    return Tied(problem, reduced, rep, members)


def tied_descent(problem: SearchProblem, starts: dict[str, np.ndarray], *, tie: bool = True,
                 time_limit_s: float | None = None) -> SearchResult:
    """Coordinate descent on the tied problem (``tie`` and repeated blocks), its result expanded;
    else, or when no block-uniform plan fits the memory limit, on ``problem`` itself."""
    tied = tie_blocks(problem) if tie else None
    if tied is not None:
        try:
            found = coordinate_descent(tied.reduced, {k: tied.restrict(a) for k, a in starts.items()},
                                       time_limit_s=time_limit_s)
            return tied.result(found)
        except NoFeasiblePlanError:
            pass                                   # blocks that differ may still fit: search them all
    return coordinate_descent(problem, starts, time_limit_s=time_limit_s)
