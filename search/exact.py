"""Exact reference: the search problem as an integer program solved by HiGHS.

Binary x[i,c] = 1 when node i takes choice c (one per node). Each merged edge
e = (u, v) has continuous y[e,c,d] in [0, 1] tied to x by the marginal
constraints sum_d y[e,c,d] = x[u,c] and sum_c y[e,c,d] = x[v,d]; with x
one-hot these force y[e] to be the outer product, i.e. y = x_u * x_v, and the
LP relaxation is much tighter than y >= x_u + x_v - 1. Minimise
sum nc * x + sum M * y subject to sum node_mem * x <= limit - base_mem.
Used to measure how far coordinate descent is from the optimum on graphs small
enough to solve.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from search.problem import SearchProblem, SearchResult

log = logging.getLogger("autoddl.search")

DEFAULT_MAX_VARIABLES = 200_000


def ilp_size(problem: SearchProblem) -> int:
    """Number of ILP variables: one per (node, choice) plus one per (edge, choice pair)."""
    A = problem._arrays
    return int(A.k.sum() + sum(m.size for m in A.emat))


def exact_refusal(problem: SearchProblem, max_variables: int = DEFAULT_MAX_VARIABLES) -> str | None:
    """Why ``exact`` would refuse ``problem`` (too large), or None."""
    size = ilp_size(problem)
    if size > max_variables:
        return (f"exact search skipped: the ILP would have {size:,} variables, above the limit of "
                f"{max_variables:,} (raise max_variables, or compare on a smaller model)")
    return None


def exact(problem: SearchProblem, time_limit_s: float = 60.0, *,
          max_variables: int = DEFAULT_MAX_VARIABLES, mip_rel_gap: float = 1e-7) -> SearchResult | None:
    """Solve ``problem`` to optimality with HiGHS; None (reason logged) if too large or no solution in time.

    Raises NoFeasiblePlanError when no plan fits the memory limit. A result
    found before the time limit but not proven optimal has ``optimal=False``.
    """
    t0 = time.perf_counter()
    problem.check_memory_limit()
    reason = exact_refusal(problem, max_variables)
    if reason is not None:
        log.info(reason)
        return None
    A = problem._arrays
    nx = int(A.k.sum())
    ny = [m.size for m in A.emat]
    nvar = nx + sum(ny)
    c = np.concatenate([A.nc] + [m.ravel() for m in A.emat])

    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    # one choice per node
    for i in range(problem.n):
        idx = np.arange(A.off[i], A.off[i + 1])
        rows.append(np.full(len(idx), r)); cols.append(idx); vals.append(np.ones(len(idx)))
        r += 1
    lo += [1.0] * r
    hi += [1.0] * r
    # marginals: sum_d y[e,c,d] - x[u,c] = 0 and sum_c y[e,c,d] - x[v,d] = 0
    y0 = nx
    for e, m in enumerate(A.emat):
        ku, kv = m.shape
        u, v = int(A.eu[e]), int(A.ev[e])
        ygrid = y0 + np.arange(ku * kv).reshape(ku, kv)
        for cc in range(ku):
            rows.append(np.full(kv + 1, r)); cols.append(np.append(ygrid[cc], A.off[u] + cc))
            vals.append(np.append(np.ones(kv), -1.0)); r += 1
        for d in range(kv):
            rows.append(np.full(ku + 1, r)); cols.append(np.append(ygrid[:, d], A.off[v] + d))
            vals.append(np.append(np.ones(ku), -1.0)); r += 1
        lo += [0.0] * (ku + kv)
        hi += [0.0] * (ku + kv)
        y0 += ku * kv
    constraints = [LinearConstraint(
        sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, nvar)),
        np.array(lo), np.array(hi))]
    if problem.memory_limit_bytes is not None:
        row = np.zeros((1, nvar))
        row[0, :nx] = A.mem
        constraints.append(LinearConstraint(row, -np.inf, problem.memory_limit_bytes - problem.base_mem))
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    res = milp(c, constraints=constraints, integrality=integrality, bounds=Bounds(0.0, 1.0),
               options={"time_limit": float(time_limit_s), "mip_rel_gap": mip_rel_gap, "disp": False})
    if res.x is None:
        log.info("exact search found no solution: %s (status %s)", res.message, res.status)
        return None
    assignment = np.array([int(np.argmax(res.x[A.off[i]:A.off[i + 1]])) for i in range(problem.n)],
                          dtype=np.int64)
    cost = problem.cost(assignment)
    gap = getattr(res, "mip_gap", None)
    notes = () if res.status == 0 else (f"HiGHS stopped early: {res.message}",)
    return SearchResult(assignment=assignment, cost=cost, memory_bytes=problem.memory(assignment),
                        method="ilp", start="ilp", seconds=time.perf_counter() - t0,
                        optimal=res.status == 0, mip_gap=None if gap is None else float(gap), notes=notes)
