"""Exact optimisation of a forest-shaped block of nodes, the rest of the plan held fixed.

Coordinate descent uses these for its large moves: grow an induced forest
(every edge between two block nodes is a tree edge), then dynamic programming
over it finds the block's best choices exactly. Under a memory limit the block
must also fit in the room left: a Lagrangian DP (cost + lambda * memory, lambda
bisected) and, on small blocks, a Pareto DP over (cost, memory) that is exact
when its frontiers are not truncated.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from search.problem import _Arrays

PARETO_MAX_WORK = 600       # sum of block choices up to which the Pareto DP runs
PARETO_CAP = 64             # frontier points kept per (node, choice)
LAGRANGIAN_ROWS = 4         # root choices of a conditioned move given the Lagrangian DP
LAGRANGIAN_STEPS = 6        # bisection steps on lambda


def grow_forest(A: _Arrays, root: int, max_size: int, skip_root: bool = False):
    """Breadth-first from ``root``, keep a node when <= 1 neighbour is kept: an induced forest.

    Returns (order, parent, mxp, tree_edges): nodes in BFS order (parents
    first), the index in ``order`` of each node's parent (-1 for a tree root),
    the edge matrix oriented (k_node, k_parent) and the merged edge ids of the
    tree edges. With ``skip_root`` the root is left out and the forest grows
    from its neighbours, one tree at a time.
    """
    nbr, col_off, k = A.nbr_list, A.col_off_list, A.k_list
    order: list[int] = []
    parent: list[int] = []
    mxp: list[np.ndarray | None] = []
    tree_edges: list[int] = []
    where: dict[int, int] = {}                   # kept node -> its index in order
    seen = {root}
    queue = deque() if skip_root else deque([root])
    seeds = deque(nbr[root]) if skip_root else deque()
    while (queue or seeds) and len(order) < max_size:
        if queue:
            x = queue.popleft()
        else:
            x = seeds.popleft()
            if x in seen:
                continue
            seen.add(x)
        nb = nbr[x]
        kept = [j for j, y in enumerate(nb) if y in where]
        if len(kept) <= 1:
            where[x] = len(order)
            order.append(x)
            if kept:
                j = kept[0]
                p = nb[j]
                parent.append(where[p])
                mxp.append(A.mcat[x][:, col_off[x][j]:col_off[x][j] + k[p]])
                tree_edges.append(A.nbr_edge_list[x][j])
            else:
                parent.append(-1)
                mxp.append(None)
        for y in nb:
            if y not in seen:
                seen.add(y)
                queue.append(y)
    return order, parent, mxp, np.array(tree_edges, dtype=np.int64)


def forest_value(parent: list[int], mxp: list, unary: list[np.ndarray], vals: np.ndarray) -> np.ndarray:
    """(C,) objective of the block for each row of ``vals`` (C, L); ``unary[j]`` is (C, k_j)."""
    C, L = vals.shape
    k = np.array([u.shape[1] for u in unary])
    u_off = np.concatenate(([0], np.cumsum(k)[:-1]))
    flat_u = np.concatenate(unary, axis=1)                                   # (C, sum k)
    value = np.take_along_axis(flat_u, u_off[None, :] + vals, axis=1).sum(axis=1)
    child = np.array([j for j, p in enumerate(parent) if p >= 0], dtype=np.int64)
    if len(child):
        par = np.asarray(parent)[child]
        m_off = np.concatenate(([0], np.cumsum([mxp[j].size for j in child])[:-1]))
        flat_m = np.concatenate([mxp[j].ravel() for j in child])
        idx = m_off[None, :] + vals[:, child] * k[par][None, :] + vals[:, par]
        value = value + flat_m[idx].sum(axis=1)
    return value


def _memory(memv: list[np.ndarray], vals: np.ndarray) -> np.ndarray:
    flat = np.concatenate(memv)
    off = np.concatenate(([0], np.cumsum([len(m) for m in memv])[:-1]))
    return flat[off[None, :] + vals].sum(axis=1)


def solve_forest(parent: list[int], mxp: list, unary: list[np.ndarray], memv: list[np.ndarray],
                 room: np.ndarray | None, bound: np.ndarray, pareto: bool = True,
                 lam_hint: list[float] | None = None) -> list:
    """For each of C problems (``unary[j]`` is (C, k_j)), the cheapest block plan whose memory
    fits ``room[c]`` and whose cost is below ``bound[c]``: a list of (choices (L,), cost,
    memory), None where nothing qualifies.

    One batched DP first; its cost is a lower bound, so rows that cannot beat
    ``bound`` stop there. A row whose DP plan is too big is solved again with
    the Pareto DP (small blocks) and the Lagrangian DP on cost + lambda * memory,
    whose memory falls as lambda grows (bisection, all such rows at once).
    ``lam_hint`` (a one-element list) carries the last lambda that fitted from
    move to move, so the bisection starts near it; it is updated in place.
    """
    vals = forest_dp(parent, mxp, unary)
    value = forest_value(parent, mxp, unary, vals)
    mem = _memory(memv, vals)
    out: list = [None] * len(value)
    redo = []
    for c in np.flatnonzero(value < bound):
        if room is None or mem[c] <= room[c]:
            out[c] = (vals[c], float(value[c]), float(mem[c]))
        else:
            redo.append(int(c))
    if not redo:
        return out
    small = pareto and sum(len(m) for m in memv) <= PARETO_MAX_WORK   # the Lagrangian misses plans
    rest = []                                                           # inside its convex hull
    for c in redo:
        if small:
            pv, exact = pareto_forest(parent, mxp, [u[c] for u in unary], memv, float(room[c]))
            if pv is not None:
                v = pv[None, :]
                out[c] = (pv, float(forest_value(parent, mxp, [u[c:c + 1] for u in unary], v)[0]),
                          float(_memory(memv, v)[0]))
            if exact:
                continue
        rest.append(c)
    if rest:
        rest = sorted(rest, key=lambda c: value[c])[:LAGRANGIAN_ROWS]      # most promising lower bounds
        rows = np.array(rest)
        for c, sol in zip(rest, _lagrangian(parent, mxp, [u[rows] for u in unary], memv, room[rows],
                                            lam_hint if lam_hint is not None else [0.0])):
            if sol is not None and (out[c] is None or sol[1] < out[c][1]):
                out[c] = sol
    return out


def _lagrangian(parent, mxp, unary, memv, room: np.ndarray, lam_hint: list[float]) -> list:
    """Per row, the best plan that fits ``room`` among minimisers of cost + lambda * memory."""
    R = len(room)
    min_mem = sum(float(m.min()) for m in memv)
    spread_m = sum(float(np.ptp(m)) for m in memv)
    best: list = [None] * R
    if spread_m <= 0:
        return best
    lam0 = (sum(float(np.ptp(u[0])) for u in unary) + 1e-300) / spread_m
    possible = room >= min_mem

    def solve(lam: np.ndarray) -> np.ndarray:
        vals = forest_dp(parent, mxp, [u + lam[:, None] * m[None, :] for u, m in zip(unary, memv)])
        value = forest_value(parent, mxp, unary, vals)
        fits = _memory(memv, vals) <= room
        for c in np.flatnonzero(fits):
            if best[c] is None or value[c] < best[c][1]:
                best[c] = (vals[c], float(value[c]), float(_memory(memv, vals[c:c + 1])[0]))
        return fits

    warm = lam_hint[0] > 0                               # start at the last price that fitted
    lo, hi = (np.full(R, lam_hint[0] / 2), np.full(R, lam_hint[0])) if warm else (np.zeros(R), np.full(R, lam0))
    for _ in range(60):                                  # grow lambda until each row fits
        fits = solve(hi)
        if np.all(fits | ~possible):
            break
        lo, hi = np.where(fits, lo, hi), np.where(fits, hi, hi * (2 if warm else 4))
    for _ in range(1 if warm else LAGRANGIAN_STEPS):     # bisect towards the least lambda
        mid = 0.5 * (lo + hi)
        fits = solve(mid)
        lo, hi = np.where(fits, lo, mid), np.where(fits, mid, hi)
    if possible.any():
        lam_hint[0] = float(np.median(hi[possible]))
    return best


def _prune(cost: np.ndarray, mem: np.ndarray, room: float) -> np.ndarray:
    """Indices of the (cost, mem) Pareto frontier with mem <= room, sorted by mem."""
    keep = np.flatnonzero(mem <= room)
    if len(keep) == 0:
        return keep
    keep = keep[np.lexsort((cost[keep], mem[keep]))]
    c = cost[keep]
    prev_min = np.minimum.accumulate(np.concatenate(([np.inf], c[:-1])))
    return keep[c < prev_min]


def pareto_forest(parent: list[int], mxp: list, unary: list[np.ndarray], memv: list[np.ndarray],
                  room: float, cap: int = PARETO_CAP) -> tuple[np.ndarray | None, bool]:
    """Cheapest forest plan with memory <= room by a DP over (cost, memory) frontiers.

    Returns (choices or None when nothing fits, exact): exact unless a frontier
    had to be thinned to ``cap`` points.
    """
    L = len(parent)
    mins = [float(m.min()) for m in memv]
    memr = [m - mn for m, mn in zip(memv, mins)]          # >= 0, so partial sums only grow
    room_r = room - sum(mins)
    if room_r < 0:
        return None, True
    thinned = False

    def prune(cost: np.ndarray, mem: np.ndarray, cap: int) -> np.ndarray:
        nonlocal thinned
        keep = _prune(cost, mem, room_r)
        if len(keep) > cap:                               # thin evenly, keeping both ends
            thinned = True
            keep = keep[np.unique(np.linspace(0, len(keep) - 1, cap).round().astype(np.int64))]
        return keep

    children: list[list[int]] = [[] for _ in range(L)]
    for j, p in enumerate(parent):
        if p >= 0:
            children[p].append(j)
    # F[j]: frontier of j's subtree: cost, mem, choice of j, back (index into each child's frontier)
    F: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = [None] * L  # type: ignore[list-item]
    for j in range(L - 1, -1, -1):
        costs, mems, chs, backs = [], [], [], []
        for c in range(len(unary[j])):
            cost = np.array([unary[j][c]])
            mem = np.array([memr[j][c]])
            back = np.zeros((1, 0), dtype=np.int64)
            for ch in children[j]:
                fc, fm, fch, _ = F[ch]
                mc = fc + mxp[ch][fch, c]                  # child's frontier seen from choice c
                idx = prune(mc, fm, cap)
                cost = (cost[:, None] + mc[idx][None, :]).ravel()
                mem = (mem[:, None] + fm[idx][None, :]).ravel()
                back = np.hstack([np.repeat(back, len(idx), axis=0), np.tile(idx, len(back))[:, None]])
                keep = prune(cost, mem, cap)
                cost, mem, back = cost[keep], mem[keep], back[keep]
            costs.append(cost); mems.append(mem); backs.append(back)
            chs.append(np.full(len(cost), c, dtype=np.int64))
        F[j] = (np.concatenate(costs), np.concatenate(mems), np.concatenate(chs), np.concatenate(backs))
    roots = [j for j in range(L) if parent[j] < 0]
    cost, mem = np.zeros(1), np.zeros(1)
    back = np.zeros((1, 0), dtype=np.int64)
    for r in roots:                                       # the trees share the memory room
        fc, fm, _, _ = F[r]
        idx = prune(fc, fm, cap * 4)
        cost = (cost[:, None] + fc[idx][None, :]).ravel()
        mem = (mem[:, None] + fm[idx][None, :]).ravel()
        back = np.hstack([np.repeat(back, len(idx), axis=0), np.tile(idx, len(back))[:, None]])
        keep = prune(cost, mem, cap * 4)
        cost, mem, back = cost[keep], mem[keep], back[keep]
    if len(cost) == 0:
        return None, not thinned
    vals = np.zeros(L, dtype=np.int64)
    stack = [(r, int(back[-1, t])) for t, r in enumerate(roots)]   # last point: least cost
    while stack:
        j, point = stack.pop()
        vals[j] = F[j][2][point]
        for t, ch in enumerate(children[j]):
            stack.append((ch, int(F[j][3][point, t])))
    return vals, not thinned


def forest_dp(parent: list[int], mxp: list, unary: list[np.ndarray]) -> np.ndarray:
    """Exact minimisers (C, L) of sum unary[j][c, x_j] + sum mxp[j][x_j, x_parent(j)] over a forest,
    for C unary sets at once (``unary[j]`` is (C, k_j); nodes in BFS order, parents first)."""
    L = len(parent)
    total = [u.copy() for u in unary]
    arg: list[np.ndarray | None] = [None] * L
    for j in range(L - 1, -1, -1):
        p = parent[j]
        if p >= 0:
            m = mxp[j][None, :, :] + total[j][:, :, None]      # (C, k_j, k_p)
            arg[j] = m.argmin(axis=1)                          # (C, k_p)
            total[p] += m.min(axis=1)
    C = total[0].shape[0]
    rows = np.arange(C)
    vals = np.zeros((C, L), dtype=np.int64)
    for j in range(L):
        p = parent[j]
        vals[:, j] = total[j].argmin(axis=1) if p < 0 else arg[j][rows, vals[:, p]]
    return vals


# -- bounded-width regions ------------------------------------------------------------------
#
# A forest move cannot re-optimise a block with a cycle in it, and real graphs have short
# cycles everywhere (RoPE's rotate-half diamond, residual adds, a weight shared by two
# consumers), so a local minimum that needs a cyclic group of ops to change together stays
# put. A region move grows a block breadth first and keeps a node whenever eliminating the
# block in reverse order of admission keeps every table at most ``budget`` entries: a
# junction tree of bounded width, solved exactly by variable elimination. On a forest
# every table is one edge matrix, so this generalises the forest DP to cycles.

REGION_BUDGET = 1 << 14     # entries of the largest elimination table a region move builds
REGION_SIZE = 32            # nodes per region move
REGION_LAMBDAS = 12         # memory prices tried at once when the region's plan does not fit


class Region:
    """Nodes admitted in ``order``; ``scope[j]``: earlier positions node j's elimination
    table depends on (its earlier neighbours plus the fill its later neighbours send it);
    ``edges[j]``: (earlier position p, matrix (k_p, k_j)) for each region edge ending at j."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.scope: list[set[int]] = []
        self.edges: list[list[tuple[int, np.ndarray]]] = []
        self.edge_ids: list[int] = []
        self.plan: list[tuple] | None = None     # elimination plan, built on first solve

    def __len__(self) -> int:
        return len(self.order)


def _admit_fill(region: Region, scope: set[int], k: "list[int] | dict[int, int]", budget: int) -> list | None:
    """Give a new last node ``scope``; pass the fill down the elimination chain.

    Eliminating node j sends a table over scope[j] minus its largest member z to z, so
    z's scope grows by that set, and so on down. Returns the (position, old scope)
    changes made, or None (nothing changed) when some table would exceed ``budget``.
    """
    sizes = [k[x] for x in region.order]       # k: choices per node (a list, or a dict over domains)
    changes: list[tuple[int, set[int]]] = []
    current = scope
    while current:
        z = max(current)
        add = current - {z} - region.scope[z]
        if not add:
            break
        grown = region.scope[z] | add
        if sizes[z] * math.prod(sizes[s] for s in grown) > budget:
            for pos, old in reversed(changes):
                region.scope[pos] = old
            return None
        changes.append((z, region.scope[z]))
        region.scope[z] = grown
        current = grown
    return changes


def grow_region(A: _Arrays, root: int, max_size: int = REGION_SIZE, budget: int = REGION_BUDGET,
                domains: dict[int, np.ndarray] | None = None) -> Region:
    """Breadth first from ``root``; keep a node when every elimination table stays within ``budget``.

    ``domains`` (a fusion move, search/fusion.py): node -> the choice indices it may take; only
    those nodes are admitted, tables and edge matrices are over the domains, and the solved
    values index into them.
    """
    nbr, col_off = A.nbr_list, A.col_off_list
    k = A.k_list if domains is None else {x: len(d) for x, d in domains.items()}
    region = Region()
    where: dict[int, int] = {}
    seen = {root}
    queue = deque([root])
    while queue and len(region) < max_size:
        x = queue.popleft()
        kept = [(j, where[y]) for j, y in enumerate(nbr[x]) if y in where]
        scope = {p for _, p in kept}
        own = k[x] * math.prod(k[region.order[p]] for p in scope)
        if own <= budget and _admit_fill(region, scope, k, budget) is not None:
            where[x] = len(region.order)
            region.order.append(x)
            region.scope.append(scope)
            region.edges.append([(p, _edge_matrix(A, x, j, region.order[p], domains)) for j, p in kept])
            region.edge_ids += [A.nbr_edge_list[x][j] for j, _ in kept]
        for y in nbr[x]:
            if y not in seen and (domains is None or y in domains):
                seen.add(y)
                queue.append(y)
    return region


def _edge_matrix(A: _Arrays, x: int, j: int, y: int, domains: dict[int, np.ndarray] | None) -> np.ndarray:
    """The matrix (k_y, k_x) of the edge between ``x`` and its ``j``-th neighbour ``y``, over the domains."""
    col = A.col_off_list[x][j]
    if domains is None:
        return A.mcat[x][:, col:col + A.k_list[y]].T
    return A.mcat[x][domains[x][None, :], col + domains[y][:, None]]


def _broadcast_shape(axes: list[int], target: list[int], sizes: list[int]) -> tuple[int, ...]:
    """Shape that lets a table over ``axes`` (a sorted subset of ``target``) broadcast against ``target``."""
    present = set(axes)
    return tuple(sizes[t] if t in present else 1 for t in target)


def _elimination_plan(region: Region, sizes: list[int]) -> list[tuple]:
    """Per position j (built once per region): its table's axes, the sum of its region edges
    over them, the shape its unary takes, and who sends it a message in which shape."""
    senders: list[list[int]] = [[] for _ in range(len(region))]
    for y, scope in enumerate(region.scope):
        if scope:
            senders[max(scope)].append(y)
    plan = []
    for j in range(len(region)):
        axes = sorted(region.scope[j]) + [j]
        static = np.zeros(tuple(sizes[t] for t in axes))
        for p, m in region.edges[j]:
            static = static + m.reshape(_broadcast_shape([p, j], axes, sizes))
        inbox = [(y, _broadcast_shape(sorted(region.scope[y]), axes, sizes)) for y in senders[j]]
        plan.append((axes, static[None], _broadcast_shape([j], axes, sizes), inbox))
    return plan


def solve_region(region: Region, unary: list[np.ndarray]) -> np.ndarray:
    """Exact minimisers (C, L) of sum unary[j][c, x_j] + region edge costs, by variable
    elimination in reverse admission order (``unary[j]`` is (C, k_j))."""
    L = len(region)
    C = unary[0].shape[0]
    if region.plan is None:
        region.plan = _elimination_plan(region, [u.shape[1] for u in unary])
    messages: list[np.ndarray] = [None] * L  # type: ignore[list-item]
    argmins: list[np.ndarray] = [None] * L  # type: ignore[list-item]
    for j in range(L - 1, -1, -1):
        axes, static, unary_shape, inbox = region.plan[j]
        table = static + unary[j].reshape((C,) + unary_shape)
        for y, shape in inbox:
            table = table + messages[y].reshape((C,) + shape)
        argmins[j] = table.argmin(axis=-1)
        messages[j] = table.min(axis=-1)
    vals = np.zeros((C, L), dtype=np.int64)
    rows = np.arange(C)
    for j in range(L):
        vals[:, j] = argmins[j][(rows,) + tuple(vals[:, s] for s in region.plan[j][0][:-1])]
    return vals


def region_value(region: Region, unary: list[np.ndarray], vals: np.ndarray) -> np.ndarray:
    """(C,) objective of the region for each row of ``vals`` (C, L)."""
    rows = np.arange(vals.shape[0])
    value = sum(u[np.minimum(rows, u.shape[0] - 1), vals[:, j]] for j, u in enumerate(unary))
    for j, edges in enumerate(region.edges):
        for p, m in edges:
            value = value + m[vals[:, p], vals[:, j]]
    return value


def solve_region_within(region: Region, unary: list[np.ndarray], memv: list[np.ndarray],
                        room: float | None) -> tuple[np.ndarray, float, float] | None:
    """The region's cheapest plan whose node memory fits ``room``: (choices, cost, memory).

    Exact when the unconstrained optimum fits; otherwise the cheapest fitting minimiser
    of cost + lambda * memory over a geometric grid of lambda, refined once around the
    smallest price that fits. None when no price makes it fit.
    """
    vals = solve_region(region, unary)
    mem = float(sum(m[v] for m, v in zip(memv, vals[0])))
    if room is None or mem <= room:
        return vals[0], float(region_value(region, unary, vals)[0]), mem
    spread_m = sum(float(np.ptp(m)) for m in memv)
    if spread_m <= 0:
        return None
    lam0 = (sum(float(np.ptp(u)) for u in unary) + 1e-300) / spread_m
    grid = lam0 * np.geomspace(1e-3, 1e3, REGION_LAMBDAS)
    best = None
    for _ in range(2):
        vals = solve_region(region, [u + grid[:, None] * m[None, :] for u, m in zip(unary, memv)])
        mems = sum(m[vals[:, j]] for j, m in enumerate(memv))
        costs = region_value(region, unary, vals)
        fits = np.flatnonzero(mems <= room)
        if len(fits) == 0:
            return best
        c = int(fits[np.argmin(costs[fits])])
        if best is None or costs[c] < best[1]:
            best = (vals[c], float(costs[c]), float(mems[c]))
        first = int(fits.min())
        lo = grid[first - 1] if first > 0 else grid[first] / 10
        grid = np.linspace(lo, grid[first], REGION_LAMBDAS)
    return best
