"""Coordinate descent over per-node choices (AutoDDL's search), with escapes.

From each start (the expert baselines and a greedy start: every node its
cheapest node cost) the descent visits nodes in topological order (reverse
order on alternate sweeps) and gives each the choice minimising its node cost
plus its edge costs to the neighbours held fixed, under the memory limit, until
a sweep improves nothing. Only nodes whose neighbourhood changed are revisited
(a node that was optimal stays optimal); when many are, one vectorised pass
over all nodes picks those with an improving move. An infeasible start is first
repaired (cheapest cost per byte saved). Local minima are escaped by
  * block moves over repeated layers: copy one instance's pattern to every
    instance, or set one position of every instance to the same choice;
  * forest moves (search/forest.py): the exact best choices of an induced
    forest of nodes, the rest held fixed; they subsume pair moves on edges
    (still available, off by default);
  * region moves (search/forest.py): the exact best choices of a region grown
    from a root that may contain cycles (variable elimination with bounded
    tables), tried from every root (up to ``region_roots``) on the best plan
    until none improves; a forest move cannot change a cyclic group such as
    RoPE's rotate-half diamond, which left llama tiny 10% above the optimum;
  * wave moves (search/fusion.py) on the best plan, before each region sweep: from
    each end of each reshard the change spreads op by op (each op its best response to
    the ops already reached) and a fusion move takes, exactly, the current or the
    proposed choice of every op it reached; region moves cannot take a cyclic chain of
    ops with 30-50 signatures each, which left llama tiny's RoPE chain sharded between
    two reshards on 2-D meshes (2-107% above the optimum);
  * Lagrangian starts when memory binds: descend on cost + lambda * memory;
  * restarts: an exact forest move conditioned on each choice of a root
    (roots taken in turn), or a random kick of a small connected region,
    then descent; they stop after ``restarts`` in a row gain nothing.
Every accepted move lowers the objective of a feasible plan, and the best
feasible start is itself a candidate, so the result is never worse than it.

On random 3-12 node chains, trees and DAGs (2-5 choices, optional memory
limit) the result was within 1% of the ILP optimum in 1200 of 1200 cases; on
one batch of 300, plain single-node descent managed 64% and descent with pair
moves, Lagrangian starts and region kicks but no forest moves 98%.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from search.fusion import fuse, propose_wave
from search.forest import Region, forest_value, grow_forest, grow_region, solve_forest, solve_region_within
from search.problem import SearchProblem, SearchResult, _Arrays, memory_tolerance

_REL_TOL = 1e-12
_LNS_SIZE = 128          # nodes re-optimised exactly by one restart move
_WAVE_WORK = 4           # node changes failed waves may propose per wave sweep, per node of the graph
_PATIENCE_TOL = 1e-4     # relative gain of a restart that resets the patience count


def _improves(new: float, old: float) -> bool:
    return old - new > _REL_TOL * abs(old)


@dataclass(frozen=True)
class _Block:
    """A set of nodes moved together; evaluates candidate value rows for them at once."""

    nodes: np.ndarray      # (t,) node indices
    off: np.ndarray        # (t,) flat offsets of those nodes
    touch: np.ndarray      # nodes and their neighbours (to mark dirty after a move)
    e_off: np.ndarray      # (E,) incident merged edges
    eu: np.ndarray
    ev: np.ndarray
    kv: np.ndarray
    pos_u: np.ndarray      # (E,) position of eu in nodes, or -1
    pos_v: np.ndarray

    @classmethod
    def of(cls, A: _Arrays, nodes: np.ndarray) -> "_Block":
        nodes = np.asarray(nodes, dtype=np.int64)
        edges = np.unique(np.concatenate([A.nbr_edge[i] for i in nodes] + [np.zeros(0, np.int64)]))
        pos = {int(x): j for j, x in enumerate(nodes)}
        eu, ev = A.eu[edges], A.ev[edges]
        touch = np.unique(np.concatenate([nodes] + [A.nbr[i] for i in nodes]))
        return cls(nodes, A.off[nodes], touch, A.e_off[edges], eu, ev, A.k[ev],
                   np.array([pos.get(int(x), -1) for x in eu], dtype=np.int64),
                   np.array([pos.get(int(x), -1) for x in ev], dtype=np.int64))

    def evaluate(self, A: _Arrays, nc: np.ndarray, a: np.ndarray, vals: np.ndarray):
        """Cost and node memory of the block's nodes + incident edges for each row of ``vals`` (c, t)."""
        cost = nc[self.off[None, :] + vals].sum(axis=1)
        mem = A.mem[self.off[None, :] + vals].sum(axis=1)
        if len(self.eu):
            u = np.where(self.pos_u >= 0, vals[:, np.maximum(self.pos_u, 0)], a[self.eu])
            v = np.where(self.pos_v >= 0, vals[:, np.maximum(self.pos_v, 0)], a[self.ev])
            cost = cost + A.ec[self.e_off + u * self.kv + v].sum(axis=1)
        return cost, mem


@dataclass(frozen=True)
class _Group:
    grid: np.ndarray            # (m, L) node index of instance q, position p
    whole: _Block               # every node of every instance
    columns: list[_Block]       # position p of every instance


class _Engine:
    """Mutable descent state: assignment, its node-memory sum, and work lists."""

    def __init__(self, A: _Arrays, nc: np.ndarray, limit: float | None, groups: list[_Group],
                 pair_moves: bool, forest_roots: int, rng: np.random.Generator):
        self.A, self.nc, self.limit, self.groups = A, nc, limit, groups
        self.pair_moves, self.rng = pair_moves, rng
        self.forest_roots = forest_roots
        self.waves = True                  # wave moves in region polish (search/fusion.py)
        self.ncv = np.split(nc, A.off[1:-1])
        self.memv = np.split(A.mem, A.off[1:-1])
        n = len(A.k)
        self.dirty = np.ones(n, bool)
        self.pair_dirty = np.ones(n, bool)
        self.blocked = np.zeros(n, bool)
        self.lam_hint = [0.0]              # last memory price (s/B) whose forest plan fitted
        self.regions: dict[int, tuple[Region, np.ndarray]] = {}  # root -> its region and what it reads
        self.moves = 0                     # move counter: changed_at[i] is the move that last set node i
        self.changed_at = np.zeros(n, np.int64)
        self.region_failed_at = np.full(n, -1, np.int64)   # move count when root's region move last failed
        self.wave_failed: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # (u, v) -> (move count, reads)
        self.a = np.zeros(n, np.int64)
        self.mem_now = 0.0

    def reset(self, a: np.ndarray, dirty: np.ndarray | None = None) -> None:
        self.a = a.copy()
        self.moves += 1
        self.changed_at[:] = self.moves
        self.mem_now = self.A.memory(self.a)
        if dirty is None:
            self.dirty[:] = True
            self.pair_dirty[:] = True
        else:
            self.dirty[:] = dirty
            self.pair_dirty[:] = dirty
        self.blocked[:] = False

    def local(self, i: int) -> np.ndarray:
        m = self.A.mcat[i]
        if m.shape[1] == 0:
            return self.ncv[i]
        return self.ncv[i] + m[:, self.A.col_off[i] + self.a[self.A.nbr[i]]].sum(axis=1)

    def _moved(self, nodes, dmem: float, touch: np.ndarray | None = None) -> None:
        """Record a move of ``nodes``: they and their neighbours (``touch``) need another look."""
        if touch is None:
            touch = list(nodes)
            for i in nodes:
                touch.extend(self.A.nbr[i].tolist())
        self.dirty[touch] = True
        self.pair_dirty[touch] = True
        self.moves += 1
        self.changed_at[np.asarray(nodes, dtype=np.int64)] = self.moves
        self.mem_now += dmem
        if dmem < 0 and self.limit is not None:       # more room: retry moves memory blocked
            self.dirty |= self.blocked
            self.pair_dirty |= self.blocked
            self.blocked[:] = False

    # -- moves ------------------------------------------------------------------
    def _batch_candidates(self) -> None:
        """Evaluate every node at once; keep dirty only those with an improving (or blocked) move."""
        A, a = self.A, self.a
        n = len(a)
        rows = np.arange(n)
        lm = np.where(A.pad_ok, A.local_all(self.nc, a)[A.pad_idx], np.inf)        # (n, kmax)
        cur = lm[rows, a]
        tol = _REL_TOL * np.abs(cur)
        gain = cur - lm.min(axis=1)
        if self.limit is not None:
            mm = A.mem[A.pad_idx]
            dmv = mm - mm[rows, a][:, None]
            feas_gain = cur - np.where(dmv <= self.limit - self.mem_now, lm, np.inf).min(axis=1)
            self.blocked |= (gain > tol) & ~(feas_gain > tol)
            gain = feas_gain
        self.dirty[:] = gain > tol

    def node_pass(self, reverse: bool) -> bool:
        if self.dirty.sum() > max(64, len(self.a) // 16):     # many to look at: vectorised first cut
            self._batch_candidates()
        changed = False
        a, limit = self.a, self.limit
        order = range(len(a) - 1, -1, -1) if reverse else range(len(a))
        for i in order:
            if not self.dirty[i]:
                continue
            self.dirty[i] = False
            vec = self.local(i)
            cur = a[i]
            best = int(vec.argmin())
            dm = 0.0
            if limit is not None:
                mv = self.memv[i]
                dmv = mv - mv[cur]
                slack = limit - self.mem_now
                if dmv[best] > slack:
                    masked = np.where(dmv <= slack, vec, np.inf)
                    feas = int(masked.argmin())
                    self.blocked[i] = _improves(vec[best], masked[feas])
                    best = feas
                dm = float(dmv[best])
            if best != cur and _improves(vec[best], vec[cur]):
                a[i] = best
                changed = True
                self._moved((i,), dm)
        return changed

    def pair_pass(self) -> bool:
        A, a, limit = self.A, self.a, self.limit
        check = self.pair_dirty.copy()
        self.pair_dirty[:] = False
        changed = False
        for e in range(len(A.eu)):
            u, v = int(A.eu[e]), int(A.ev[e])
            if not (check[u] or check[v] or self.pair_dirty[u] or self.pair_dirty[v]):
                continue
            m = A.emat[e]
            au, av = a[u], a[v]
            J = (self.local(u) - m[:, av])[:, None] + (self.local(v) - m[au, :])[None, :] + m
            if limit is not None:
                dmem = self.memv[u][:, None] + self.memv[v][None, :] - (self.memv[u][au] + self.memv[v][av])
                J = np.where(dmem <= limit - self.mem_now, J, np.inf)
            flat = int(J.argmin())
            bu, bv = divmod(flat, m.shape[1])
            if (bu, bv) != (au, av) and _improves(J[bu, bv], J[au, av]):
                dm = 0.0 if limit is None else float(dmem[bu, bv])
                a[u], a[v] = bu, bv
                changed = True
                self._moved((u, v), dm)
        return changed

    def _try_block(self, block: _Block, vals: np.ndarray) -> bool:
        """Apply the best row of ``vals`` (c, t) to ``block`` if it lowers the cost within memory."""
        A, a = self.A, self.a
        cur = a[block.nodes][None, :]
        c0, m0 = block.evaluate(A, self.nc, a, cur)
        cost, mem = block.evaluate(A, self.nc, a, vals)
        dmem = mem - m0[0]
        if self.limit is not None:
            cost = np.where(dmem <= self.limit - self.mem_now, cost, np.inf)
        best = int(cost.argmin())
        if not _improves(cost[best], c0[0]):
            return False
        a[block.nodes] = vals[best]
        self._moved(block.nodes, float(dmem[best]), block.touch)
        return True

    def block_pass(self) -> bool:
        changed = False
        for g in self.groups:
            pats = np.unique(self.a[g.grid], axis=0)          # (patterns, L)
            if len(pats) > 1:
                m = g.grid.shape[0]
                changed |= self._try_block(g.whole, np.tile(pats, (1, m)))
            for p, col in enumerate(g.columns):
                k = int(self.A.k[g.grid[0, p]])
                vals = np.repeat(np.arange(k)[:, None], len(col.nodes), axis=1)
                changed |= self._try_block(col, vals)
        return changed

    def repair(self) -> None:
        """Lower memory until the plan fits: cheapest cost per byte saved first."""
        if self.limit is None:
            return
        A, a = self.A, self.a
        n = len(a)
        rows = np.arange(n)
        while self.mem_now > self.limit:
            lm = A.local_all(self.nc, a)[A.pad_idx]                          # (n, kmax)
            mm = np.where(A.pad_ok, A.mem[A.pad_idx], np.inf)
            saved = mm[rows, a][:, None] - mm
            ok = saved > 0
            ratio = np.where(ok, (lm - lm[rows, a][:, None]) / np.where(ok, saved, 1.0), np.inf)
            first = ratio.min(axis=1)
            order = np.flatnonzero(np.isfinite(first))
            if len(order) == 0:     # every node at its least memory: check_memory_limit prevents this
                return
            moved = np.zeros(n, bool)
            for i in order[np.argsort(first[order], kind="stable")]:
                if moved[A.nbr[i]].any():                  # a neighbour moved: score it afresh
                    r = self._ratio_move(int(i))
                    if r is None:
                        continue
                    best, dm = r[1], r[2]
                else:
                    best = int(ratio[i].argmin())
                    dm = -float(saved[i, best])
                a[i] = best
                moved[i] = True
                self._moved((int(i),), dm)
                if self.mem_now <= self.limit:
                    break

    def _ratio_move(self, i: int):
        mv = self.memv[i]
        saved = mv[self.a[i]] - mv
        if not (saved > 0).any():
            return None
        vec = self.local(i)
        ratio = np.where(saved > 0, (vec - vec[self.a[i]]) / np.where(saved > 0, saved, 1.0), np.inf)
        best = int(ratio.argmin())
        return float(ratio[best]), best, -float(saved[best])

    def forest_move(self, root: int, max_size: int, condition: bool = False, pareto: bool = True) -> bool:
        """Re-optimise exactly an induced forest grown from ``root``, the rest held fixed.

        Nodes are taken breadth first when at most one of their neighbours is
        already in the block, so the block is a forest and dynamic programming
        over it is exact. With ``condition`` the root stays out of the forest and
        each of its choices is tried in turn (the forest then spans cycles
        through the root). Under a memory limit the DP minimises
        cost + lambda * memory with the smallest lambda (bisection) that fits.
        """
        A, a = self.A, self.a
        order, parent, mxp, tree_edges = grow_forest(A, root, max_size, skip_root=condition)
        if len(order) < (1 if condition else 2):
            return False
        nodes = np.array(order, dtype=np.int64)
        # unary[j]: (C, k_j) node cost + edges to nodes outside the block, one row per root choice
        if len(order) * 8 > len(a):                          # big block: all nodes at once
            flat = A.local_all(self.nc, a)
            if len(tree_edges):
                flat -= A.edge_terms(tree_edges, a)
            unary = [flat[A.off[x]:A.off[x + 1]][None, :] for x in order]
        else:
            unary = [self.local(x)[None, :] for x in order]
            for j, p in enumerate(parent):
                if p >= 0:
                    unary[j] = unary[j] - mxp[j][:, a[order[p]]][None, :]
                    unary[p] = unary[p] - mxp[j][a[order[j]], :][None, :]
        n_rows = int(A.k[root]) if condition else 1
        if condition:                      # the root's edges to the block: one row per root choice
            nbr_root = A.nbr_list[root]
            pos = {x: j for j, x in enumerate(order)}
            in_block = np.array([x in pos for x in nbr_root], dtype=bool)
            for t, x in enumerate(nbr_root):
                if in_block[t]:
                    e_cols = A.col_off_list[x][A.nbr_list[x].index(root)]
                    block = A.mcat[x][:, e_cols:e_cols + n_rows]             # (k_x, k_root)
                    j = pos[x]
                    unary[j] = unary[j] - block[:, a[root]][None, :] + block.T
            r_out = ~in_block
            r_cost = self.ncv[root] + A.mcat[root][:, A.col_off[root][r_out] + a[A.nbr[root][r_out]]].sum(axis=1)
            r_mem = self.memv[root]
            rows = a[root]
            unary = [np.broadcast_to(u, (n_rows, u.shape[1])) if u.shape[0] != n_rows else u for u in unary]
        else:
            r_cost, r_mem, rows = np.zeros(1), np.zeros(1), 0
        moved = np.append(nodes, root) if condition else nodes
        mem_old = float(A.mem[A.off[moved] + a[moved]].sum())
        cur_val = float(forest_value(parent, mxp, [u[rows:rows + 1] for u in unary], a[nodes][None, :])[0]
                        + r_cost[rows])
        room = None if self.limit is None else self.limit - self.mem_now + mem_old - r_mem
        bound = cur_val - r_cost - _REL_TOL * abs(cur_val)       # a block plan must beat this to help
        sols = solve_forest(parent, mxp, unary, [self.memv[x] for x in order], room, bound, pareto, self.lam_hint)
        best = min(((s[1] + float(r_cost[c]), c) for c, s in enumerate(sols) if s is not None), default=None)
        if best is None or not _improves(best[0], cur_val):
            return False
        c = best[1]
        vals, _, mem = sols[c]
        a[nodes] = vals
        if condition:
            a[root] = c
        touch = np.unique(np.concatenate([moved] + [A.nbr[x] for x in moved]))
        self._moved(moved, mem + float(r_mem[c]) - mem_old, touch)
        return True

    def forest_round(self) -> bool:
        """Forest moves from up to ``forest_roots`` random roots; True at the first that improves."""
        n = len(self.a)
        roots = self.rng.permutation(n)[:min(n, self.forest_roots)]
        return any(self.forest_move(int(r), n, pareto=False) for r in roots)

    def region_move(self, root: int) -> bool:
        """Re-optimise exactly a bounded-width region grown from ``root``, the rest held fixed
        (search/forest.py: cycles inside the region are allowed, unlike a forest move)."""
        A, a = self.A, self.a
        if root not in self.regions:                     # the region depends on the graph only
            region = grow_region(A, root)
            reads = np.unique(np.concatenate([np.array(region.order, dtype=np.int64)]
                                             + [A.nbr[x] for x in region.order]))
            self.regions[root] = (region, reads)
        region, reads = self.regions[root]
        if len(region) < 2 or self.changed_at[reads].max() < self.region_failed_at[root]:
            return False                                 # nothing it reads changed since it last failed
        self.region_failed_at[root] = self.moves + 1
        order = region.order
        unary = [self.local(x)[None, :] for x in order]
        for j, edges in enumerate(region.edges):          # region edges are the DP's, not the unary's
            for p, m in edges:
                unary[j] = unary[j] - m[a[order[p]], :][None, :]
                unary[p] = unary[p] - m[:, a[order[j]]][None, :]
        nodes = np.array(order, dtype=np.int64)
        mem_old = float(A.mem[A.off[nodes] + a[nodes]].sum())
        room = None if self.limit is None else self.limit - self.mem_now + mem_old
        found = solve_region_within(region, unary, [self.memv[x] for x in order], room)
        return found is not None and self._accept(nodes, found[0], found[2] - mem_old)

    def _accept(self, nodes: np.ndarray, new: np.ndarray, dmem: float) -> bool:
        """Set ``nodes`` to ``new`` when that lowers the whole objective (no rounding loops)."""
        a = self.a
        old = a[nodes].copy()
        cost_old = self.total()
        a[nodes] = new
        if not _improves(self.total(), cost_old):
            a[nodes] = old
            return False
        touch = np.unique(np.concatenate([nodes] + [self.A.nbr[x] for x in nodes]))
        self._moved(nodes, dmem, touch)
        return True

    def wave_move(self, u: int, v: int) -> int:
        """A wave from the reshard (u, v) (search/fusion.py), taken where the fusion move says.
        Returns -1 when it improved the plan, else the nodes the wave proposed to change (its work)."""
        key = (u, v)
        failed = self.wave_failed.get(key)
        if failed is not None and self.changed_at[failed[1]].max() < failed[0]:
            return 0                                     # nothing it reads changed since it last failed
        A, a = self.A, self.a
        proposal = propose_wave(A, self.ncv, a, u, v)
        found = None
        if proposal:
            room = None if self.limit is None else self.limit - self.mem_now
            found = fuse(A, self.ncv, self.memv, a, proposal, room)
        if found is not None:
            nodes, new, mem_new = found
            mem_old = float(A.mem[A.off[nodes] + a[nodes]].sum())
            if self._accept(nodes, new, mem_new - mem_old):
                return -1
        reads = np.array([u, v] + list(proposal) + [y for x in proposal for y in A.nbr_list[x]], dtype=np.int64)
        self.wave_failed[key] = (self.moves + 1, np.unique(reads))
        return len(proposal)

    def wave_sweep(self, max_sweeps: int, deadline: float | None) -> bool:
        """Waves from both ends of every reshard of the plan, costliest first, each success
        followed by descent, until a pass improves nothing, ``deadline`` passes or the failed
        waves of this call proposed ``_WAVE_WORK`` x n node changes in all (on problems where
        every edge costs something, random ones, each pass would try every edge)."""
        improved = False
        work = _WAVE_WORK * len(self.a) if self.waves else 0
        for _ in range(max_sweeps):
            A, a = self.A, self.a
            cost = A.ec[A.e_off + a[A.eu] * A.k[A.ev] + a[A.ev]] if len(A.eu) else np.zeros(0)
            cut = np.flatnonzero(cost > 0)
            moved = False
            for e in cut[np.argsort(-cost[cut], kind="stable")]:
                for u, v in ((int(A.eu[e]), int(A.ev[e])), (int(A.ev[e]), int(A.eu[e]))):
                    if work <= 0 or (deadline is not None and time.perf_counter() > deadline):
                        return improved
                    done = self.wave_move(u, v)
                    work -= max(done, 0)
                    if done < 0:
                        moved = improved = True
                        self.descend(max_sweeps, forest=False)
                        break
            if not moved:
                break
        return improved

    def total(self) -> float:
        """The engine's objective (its own node costs, e.g. with a memory price) of the current plan."""
        A, a = self.A, self.a
        edges = A.ec[A.e_off + a[A.eu] * A.k[A.ev] + a[A.ev]].sum() if len(A.eu) else 0.0
        return float(self.nc[A.off[:-1] + a].sum() + edges)

    def region_sweep(self, max_sweeps: int, deadline: float | None, roots: int) -> bool:
        """Region moves from up to ``roots`` roots (all of them on small graphs, in random order),
        each followed by descent, until a pass improves nothing or ``deadline`` passes; True when
        anything improved. Roots whose region saw no change since they last failed are skipped."""
        improved = False
        for _ in range(max_sweeps):
            moved = False
            for root in self.rng.permutation(len(self.a))[:roots]:
                if deadline is not None and time.perf_counter() > deadline:
                    return improved
                if self.region_move(int(root)):
                    moved = improved = True
                    self.descend(max_sweeps, forest=False)
            if not moved:
                break
        return improved

    def descend(self, max_sweeps: int, forest: bool = True) -> int:
        """Descend to a local minimum (all move kinds; forest moves when ``forest``); returns sweeps."""
        self.repair()
        sweeps = 0
        while sweeps < max_sweeps:
            sweeps += 1
            self.node_pass(reverse=sweeps % 2 == 0)
            if self.dirty.any():
                continue
            if self.pair_moves and self.pair_pass():
                continue
            if self.groups and self.block_pass():
                continue
            if not (forest and self.forest_round()):
                break
        return sweeps


def _compile_groups(problem: SearchProblem, A: _Arrays) -> list[_Group]:
    out = []
    for g in problem.groups:
        grid = np.array(g, dtype=np.int64)                   # (m, L)
        cols = [_Block.of(A, grid[:, p]) for p in range(grid.shape[1])]
        out.append(_Group(grid, _Block.of(A, grid.ravel()), cols))
    return out


def coordinate_descent(problem: SearchProblem, starts: dict[str, np.ndarray] | None = None, *,
                       max_sweeps: int = 50, restarts: int = 24, seed: int = 0,
                       pair_moves: bool = False, block_moves: bool = True, forest_roots: int = 2,
                       lagrangian: bool = True, polish: int = 4, region_roots: int = 256,
                       wave_moves: bool = True,
                       time_limit_s: float | None = None,
                       progress: Callable[[str], None] | None = None) -> SearchResult:
    """Search ``problem`` from each start (name -> (n,) choice indices) plus a greedy start.

    Raises NoFeasiblePlanError when no plan fits the memory limit. Restarts
    perturb the best plan until ``restarts`` in a row improve nothing (at most
    4 * ``restarts``); ``time_limit_s`` bounds the restarts only (the descents
    from the starts always finish). ``polish``: how many of the best distinct
    local minima get forest moves (``forest_roots`` roots tried per round).
    ``region_roots``: roots per sweep of exact region moves on the best plan (0: none);
    ``wave_moves``: wave moves from the best plan's reshards before each region sweep;
    ``time_limit_s`` also bounds these sweeps.
    ``progress`` receives one line per start and per improving restart.
    """
    t0 = time.perf_counter()
    problem.check_memory_limit()
    search = _Descent(problem, block_moves, pair_moves, forest_roots, wave_moves, seed, max_sweeps, progress)
    all_starts = {name: problem.check_assignment(a, f"start {name!r}") for name, a in (starts or {}).items()}
    greedy = np.array([int(c.argmin()) for c in problem.node_cost], dtype=np.int64)
    all_starts["greedy" if "greedy" not in all_starts else "greedy (cheapest node cost)"] = greedy
    search.best = (np.inf, "", greedy, 0)
    pool = search.from_starts(all_starts, lagrangian)                   # 1. plain descent from every start
    search.polish_minima(pool, polish)                                  # 2. forest moves on the best few
    deadline = None if time_limit_s is None else t0 + time_limit_s
    if region_roots or wave_moves:                                      # 2b. exact region and wave moves
        search.region_polish(deadline, region_roots)
    before = search.best[0]
    search.restarts(restarts, t0, time_limit_s)                         # 3. restarts
    if search.best[0] < before:                                         # polish what the restarts found
        search.engine.reset(search.best[2])
        search.offer_engine(search.engine.descend(max_sweeps))
        if region_roots or wave_moves:
            search.region_polish(deadline, region_roots)
    cost, name, a, sweeps = search.best
    feasible_start_costs = [search.start_costs[s] for s, a0 in all_starts.items() if problem.feasible(a0)]
    assert not feasible_start_costs or cost <= min(feasible_start_costs), "descent lost its best start"
    return SearchResult(assignment=a, cost=float(cost), memory_bytes=problem.memory(a),
                        method="coordinate_descent", start=name, sweeps=sweeps,
                        start_costs=search.start_costs, descended_costs=search.descended,
                        seconds=time.perf_counter() - t0)


class _Descent:
    """One search's engine, random stream and best feasible plan so far: the stages of
    :func:`coordinate_descent`, in its order (the random stream is drawn in that order)."""

    def __init__(self, problem: SearchProblem, block_moves: bool, pair_moves: bool, forest_roots: int,
                 wave_moves: bool, seed: int, max_sweeps: int, progress: Callable[[str], None] | None) -> None:
        self.problem, self.A, self.max_sweeps = problem, problem._arrays, max_sweeps
        self.limit = None
        if problem.memory_limit_bytes is not None:
            self.limit = (problem.memory_limit_bytes - problem.base_mem
                          + memory_tolerance(problem.memory_limit_bytes))
        self.groups = _compile_groups(problem, self.A) if block_moves else []
        self.rng = np.random.default_rng(seed)
        self.engine = _Engine(self.A, self.A.nc, self.limit, self.groups, pair_moves, forest_roots, self.rng)
        self.engine.waves = wave_moves
        self.say = progress or (lambda _msg: None)
        self.best: tuple[float, str, np.ndarray, int] = (np.inf, "", np.zeros(0, np.int64), 0)  # cost, start, a, sweeps
        self.start_costs: dict[str, float] = {}
        self.descended: dict[str, float] = {}

    def offer(self, cost: float, name: str, a: np.ndarray, sweeps: int) -> None:
        if cost < self.best[0] and (self.limit is None or self.A.memory(a) <= self.limit):
            self.best = (cost, name, a.copy(), sweeps)

    def offer_engine(self, sweeps: int) -> None:
        """The engine's plan, found from the best plan in ``sweeps`` more sweeps."""
        self.offer(self.A.cost(self.engine.a), self.best[1], self.engine.a, self.best[3] + sweeps)

    def from_starts(self, all_starts: dict[str, np.ndarray], lagrangian: bool) -> list[tuple]:
        """Plain descent (node and block moves) from every start, and from Lagrangian starts when
        memory may bind: the local minima, as (cost, name, plan, sweeps)."""
        A, engine, pool = self.A, self.engine, []
        for name, a0 in all_starts.items():
            self.start_costs[name] = A.cost(a0)
            self.offer(self.start_costs[name], name, a0, 0)      # a feasible start is itself a candidate
            engine.reset(a0)
            sweeps = engine.descend(self.max_sweeps, forest=False)
            self.descended[name] = A.cost(engine.a)
            pool.append((self.descended[name], name, engine.a.copy(), sweeps))
            self.say(f"start {name}: {self.start_costs[name]:.6g} -> {self.descended[name]:.6g} s in {sweeps} sweeps")
        max_mem = float(sum(m.max() for m in self.problem.node_mem))
        if lagrangian and self.limit is not None and max_mem > self.limit:
            for lam, a in _lagrangian_starts(A, self.groups, self.rng, self.max_sweeps):
                name = f"lagrangian(lambda={lam:.3g} s/B)"
                engine.reset(a)
                sweeps = engine.descend(self.max_sweeps, forest=False)
                self.descended[name] = A.cost(engine.a)
                pool.append((self.descended[name], name, engine.a.copy(), sweeps))
        return pool

    def polish_minima(self, pool: list[tuple], polish: int) -> None:
        """Escapes (forest moves) from the ``polish`` best distinct local minima of ``pool``."""
        pool.sort(key=lambda t: t[0])
        polished: list[np.ndarray] = []
        for cost, name, a, sweeps in pool:
            self.offer(cost, name, a, sweeps)
            if len(polished) < polish and not any(np.array_equal(a, b) for b in polished):
                polished.append(a)
                self.engine.reset(a)
                sweeps += self.engine.descend(self.max_sweeps)
                self.offer(self.A.cost(self.engine.a), name, self.engine.a, sweeps)

    def region_polish(self, deadline: float | None, roots: int) -> None:
        """Exact region and wave moves from the best plan (cyclic blocks forest moves cannot take)."""
        self.offer_engine(_region_polish(self.engine, self.best[2], self.max_sweeps, deadline, roots))

    def restarts(self, patience: int, t0: float, time_limit_s: float | None) -> None:
        """Exact re-optimisation around a root (roots in turn) or a random kick of a region, then
        descent, until ``patience`` restarts in a row gain nothing (at most 4 x ``patience``)."""
        A, engine, n = self.A, self.engine, self.problem.n
        roots = self.rng.permutation(n)              # exact moves visit every root before repeating one
        since_improved = r = 0
        while since_improved < patience and r < 4 * patience:
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                self.say(f"time limit reached after {r} restarts")
                break
            moved = self._perturb(r, roots)
            r += 1
            since_improved += 1
            if not moved:
                continue
            sweeps = engine.descend(self.max_sweeps, forest=False)
            cost = A.cost(engine.a)
            if _improves(cost, self.best[0]) and (self.limit is None or engine.mem_now <= self.limit):
                self.say(f"restart {r}: {self.best[0]:.6g} -> {cost:.6g} s")
                if self.best[0] - cost > _PATIENCE_TOL * abs(self.best[0]):   # only a real gain buys more
                    since_improved = 0
            self.offer(cost, self.best[1], engine.a, self.best[3] + sweeps)

    def _perturb(self, r: int, roots: np.ndarray) -> bool:
        """Restart ``r``'s move on a copy of the best plan, loaded into the engine; whether it moved."""
        A, engine, n, a = self.A, self.engine, self.problem.n, self.best[2].copy()
        if r % 2 == 0:                               # exact re-optimisation around a root, each root choice
            engine.reset(a, np.zeros(n, bool))
            return engine.forest_move(int(roots[(r // 2) % n]), _LNS_SIZE, condition=True)
        region = _region(A, int(self.rng.integers(n)), int(self.rng.integers(1, max(2, min(12, n // 2)) + 1)))
        a[region] = self.rng.integers(0, A.k[region])      # random kick of a connected region
        touched = np.zeros(n, bool)
        touched[region] = True
        for i in region:
            touched[A.nbr[i]] = True
        engine.reset(a, touched)
        return True


def _region_polish(engine: _Engine, a: np.ndarray, max_sweeps: int, deadline: float | None,
                   roots: int) -> int:
    """Region sweeps from ``a`` until none improves, then forest moves; returns descent sweeps."""
    engine.reset(a)
    sweeps = engine.descend(max_sweeps, forest=False)
    while True:
        waves = engine.wave_sweep(max_sweeps, deadline)        # cheap: only from the plan's reshards
        if not (engine.region_sweep(max_sweeps, deadline, roots) or waves):
            return sweeps
        sweeps += engine.descend(max_sweeps)


def _lagrangian_starts(A: _Arrays, groups, rng, max_sweeps: int):
    """Minimisers of cost + lambda * memory (unconstrained) for a grid of lambda."""
    k_range_cost = sum(float(np.ptp(c)) for c in np.split(A.nc, A.off[1:-1]))
    k_range_mem = sum(float(np.ptp(m)) for m in np.split(A.mem, A.off[1:-1]))
    if k_range_mem <= 0:
        return
    lam0 = max(k_range_cost, 1e-30) / k_range_mem
    for mult in (0.1, 0.3, 1.0, 3.0, 10.0):
        lam = lam0 * mult
        nc = A.nc + lam * A.mem
        engine = _Engine(A, nc, None, groups, False, 0, rng)
        engine.reset(np.array([int(c.argmin()) for c in np.split(nc, A.off[1:-1])], dtype=np.int64))
        engine.descend(max_sweeps, forest=False)
        yield lam, engine.a


def _region(A: _Arrays, root: int, size: int) -> np.ndarray:
    """Up to ``size`` nodes connected to ``root`` (breadth first)."""
    seen = {root}
    queue = deque([root])
    while queue and len(seen) < size:
        for j in A.nbr[queue.popleft()]:
            if len(seen) >= size:
                break
            if int(j) not in seen:
                seen.add(int(j))
                queue.append(int(j))
    return np.array(sorted(seen), dtype=np.int64)
