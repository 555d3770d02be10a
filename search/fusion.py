"""Wave moves: a change that pays only once a whole chain of ops follows it.

Coordinate descent stops where a group of ops (RoPE's rotate-half chain between two
reshards, a q/k/v -> attention -> output path, a residual stream) would be cheaper under
other signatures, but moving any single op, forest or bounded region alone adds a reshard:
the plan keeps a reshard at each end of the group. Large domains (30-50 signatures per op on
a 2-D mesh) keep exact region moves to forests, and the rotate-half diamond is a cycle.

A wave starts at a reshard, an edge (u, v) whose cost is positive in the current plan: v
takes its best response to u (node cost plus that edge), and the change spreads breadth
first, each node reached taking its best response to the nodes already reached; the nodes
not reached yet are expected to follow, so their current choices do not count. A node whose
best response is its current choice stops the wave. The wave is a proposal; a fusion move
then picks, for every node it changed, the current or the proposed choice, exactly (variable
elimination over two-choice domains: search/forest.py's regions, cycles allowed), under the
memory room, the rest of the plan held fixed.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from search.forest import grow_region, solve_region_within
from search.problem import _Arrays

WAVE_SIZE = 256            # nodes a wave may change
FUSION_BUDGET = 1 << 12    # entries of the largest elimination table (two-choice domains: 12 nodes)


def propose_wave(A: _Arrays, ncv: list[np.ndarray], a: np.ndarray, u: int, v: int,
                 max_size: int = WAVE_SIZE) -> dict[int, int]:
    """Node -> proposed choice for the nodes a wave from the reshard (u, v) changes (v first)."""
    nbr, col_off, mcat = A.nbr_list, A.col_off_list, A.mcat
    reached = {u: int(a[u])}
    changed: dict[int, int] = {}
    queued = {u, v}
    queue = deque([v])
    while queue and len(changed) < max_size:
        x = queue.popleft()
        cols = [col_off[x][t] + reached[y] for t, y in enumerate(nbr[x]) if y in reached]
        resp = ncv[x] + mcat[x][:, cols].sum(axis=1)
        c = int(resp.argmin())
        if resp[a[x]] <= resp[c]:                # ties keep the current choice: the wave stops
            c = int(a[x])
        reached[x] = c
        if c == a[x]:
            continue
        changed[x] = c
        for y in nbr[x]:
            if y not in queued:
                queued.add(y)
                queue.append(y)
    return changed


def fuse(A: _Arrays, ncv: list[np.ndarray], memv: list[np.ndarray], a: np.ndarray,
         proposal: dict[int, int], room: float | None, budget: int = FUSION_BUDGET):
    """The best plan taking, on the proposal's nodes, either the current or the proposed choice,
    the rest fixed: (nodes, their new choices, their new node memory), or None when nothing fits.

    Nodes whose admission would exceed ``budget`` (too wide a cycle structure) keep their choice.
    """
    domains = {x: np.array([a[x], c], dtype=np.int64) for x, c in proposal.items()}
    region = grow_region(A, next(iter(proposal)), max_size=len(domains), budget=budget, domains=domains)
    order = region.order
    inside = set(order)
    unary = []
    for x in order:                              # node cost + edges to the nodes outside, over the domain
        cols = [A.col_off_list[x][t] + a[y] for t, y in enumerate(A.nbr_list[x]) if y not in inside]
        unary.append((ncv[x] + A.mcat[x][:, cols].sum(axis=1))[domains[x]][None, :])
    nodes = np.array(order, dtype=np.int64)
    mem_old = float(sum(memv[x][a[x]] for x in order))
    found = solve_region_within(region, unary, [memv[x][domains[x]] for x in order],
                                None if room is None else room + mem_old)
    if found is None:
        return None
    new = np.array([domains[x][j] for x, j in zip(order, found[0])], dtype=np.int64)
    return nodes, new, found[2]
