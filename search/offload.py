"""Choosing what to spill to host memory (``Training.offload``; what each level spills:
autoddl/offload.py).

``auto`` plans without offload first; only when nothing fits does it try ``optimizer``, then
``params`` and ``activations`` together (block spilling: each plan at both, the faster that fits),
and keeps the first tier at which some plan fits, its fastest plan; under ``params`` /
``activations`` each plan spills the fewest repeated blocks, in block order, with which it fits
(``Training.spill_blocks``). A given level is applied to every plan. The plans offered are those of the search without the memory limit (the
fastest plans, memory aside: spilling changes what fits, not what is fast on the device), each
priced again with the level under the real limit (and, with ``recompute auto``, the fewest
recomputed blocks with which it then fits). Every offloaded scheme keeps its step time without
offload beside it (``Scheme.no_offload_s``, ``no_offload_fits``): the slowdown spilling costs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.offload import SPILL_LEVELS, check_offload, check_runnable_offload, spill_groups
from autoddl.plan import Plan
from autoddl.training import Training
from search.problem import NoFeasiblePlanError

UNLIMITED_GB = 1e9          # the memory limit of the search whose plans are offered for spilling
AUTO_TIERS = (("optimizer",), SPILL_LEVELS)   # tried in turn; within a tier the fastest plan that fits


def offload_search(graph: OpGraph, cluster: Cluster, search_fn: Callable, *, training: Training,
                   memory_gb: float | None = None, **kw):
    """``search.planner.search`` under ``training.offload`` (module docstring); a SearchOutcome."""
    from search.planner import Scheme, SearchOutcome, gb

    t0 = time.perf_counter()
    request, plain = training.offload, dataclasses.replace(training, offload="none")
    limit = (memory_gb if memory_gb is not None else cluster.device.memory_gb) * 1e9
    if request == "auto":
        try:
            outcome = search_fn(graph, cluster, training=plain, memory_gb=memory_gb, **kw)
            outcome.found.notes.append(f"offload auto: the plan fits {gb(limit)} per device without offload")
            return outcome
        except NoFeasiblePlanError:
            pass
    cluster.require_host(f"--offload {request}")
    say = kw.get("progress") or (lambda _msg: None)
    say(f"offload {request}: searching without the memory limit for the plans to spill"
        + (" (nothing fits without offload)" if request == "auto" else ""))
    free = search_fn(graph, cluster, training=plain, memory_gb=UNLIMITED_GB, **kw)

    def spilled(scheme, level: str):
        return spilled_scheme(graph, cluster, training, limit, scheme, level)

    def fastest(variants: list) -> Scheme:          # one scheme's plans at a tier's levels
        fits = [v for v in variants if v.plan is not None and v.breakdown.fits_memory]
        return min(fits, key=lambda v: v.step_time_s) if fits else variants[0]

    tiers = AUTO_TIERS if request == "auto" else ((request,),)
    for tier in tiers:
        schemes = [fastest([spilled(s, level) for level in tier]) for s in free.schemes if s.name != "found"]
        found = fastest([spilled(s, level) for s in free.schemes if s.name == "found" for level in tier])
        fitting = [s for s in schemes + [found] if s.plan is not None and s.breakdown.fits_memory]
        say(f"offload {' / '.join(tier)}: {len(fitting)} of {sum(s.plan is not None for s in schemes + [found])} plans fit "
            f"{gb(limit)} per device")
        if fitting:
            break
    if not fitting:
        priced = [s.breakdown.memory_bytes_per_device for s in schemes + [found] if s.plan is not None]
        raise NoFeasiblePlanError(min(priced, default=float("inf")), limit)
    best = min(fitting, key=lambda s: s.step_time_s)
    plan = Plan.from_dict({**best.plan.to_dict(), "name": "found"})
    plan.notes.append(offload_note(best, request, limit))
    best_found = Scheme("found", plan, best.breakdown, no_offload_s=best.no_offload_s,
                        no_offload_fits=best.no_offload_fits)
    return SearchOutcome(plan, best.breakdown, schemes + [best_found], free.meshes,
                         free.search_s + time.perf_counter() - t0, free.per_mesh, free.formulations)


def spilled_scheme(graph: OpGraph, cluster: Cluster, training: Training, limit: float, scheme, level: str):
    """``scheme`` (searched without offload) priced at offload ``level`` under ``limit`` bytes per device:
    the fewest spilled blocks that fit, the fewest recomputed blocks under ``recompute auto``; a Scheme
    without a plan, saying why, when the level does not apply (or would not run: check_runnable_offload)."""
    from search.planner import Scheme, fit_recompute, price, recompute_levels

    if scheme.plan is None:
        return scheme
    plan = with_offload(scheme.plan, level)
    try:
        check_offload(graph, plan)
    except ValueError as exc:
        return Scheme(scheme.name, None, None, str(exc))
    if level in SPILL_LEVELS:
        plan = fewest_blocks(graph, plan, cluster, limit)
    if training.recompute == "auto":
        plan, bd = fit_recompute(graph, plan, cluster, limit, recompute_levels(graph, training))
    else:
        bd = price(graph, plan, cluster, limit)
    try:
        check_runnable_offload(graph, plan)
    except ValueError as exc:
        return Scheme(scheme.name, None, None, str(exc))
    return Scheme(scheme.name, plan, bd, no_offload_s=scheme.breakdown.step_time_s,
                  no_offload_fits=scheme.breakdown.memory_bytes_per_device <= limit)


def fewest_blocks(graph: OpGraph, plan: Plan, cluster: Cluster, limit: float) -> Plan:
    """``plan`` (offload params / activations) spilling the fewest repeated blocks, in block order, with which it fits
    ``limit`` per device (memory falls block by block: bisection); every block when none does."""
    from search.planner import first_level, plan_memory

    blocks = [g.group for g in spill_groups(graph, plan)]

    def at(k: int) -> Plan:
        chosen = tuple(blocks[:k]) if k < len(blocks) else ()
        return dataclasses.replace(plan, training=dataclasses.replace(plan.training, spill_blocks=chosen))
    k = first_level(lambda k: plan_memory(graph, at(k), cluster) <= limit, 1, len(blocks))
    return at(len(blocks) if k is None else k)


def with_offload(plan: Plan, level: str) -> Plan:
    """A copy of ``plan`` spilling ``level`` (its cost cleared; a recompute choice made without the memory
    limit is no choice: its note goes, and ``fit_recompute`` chooses again)."""
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, offload=level), cost=None,
                               op_costs=[], notes=[n for n in plan.notes if not n.startswith("recompute auto")])


def offload_note(scheme, request: str, limit: float) -> str:
    """plan.notes's line on the level spilled and what it costs against the plan without it."""
    training = scheme.plan.training
    level = training.offload
    if level in SPILL_LEVELS:
        blocks = training.spill_blocks
        level += (f" ({len(blocks)} blocks spilled: {blocks[0]} .. {blocks[-1]})" if blocks else " (every block spilled)")
    why = ("nothing fits " + f"{limit / 1e9:.3g} GB per device without offload" if request == "auto"
           else f"--offload {level}")
    slow = scheme.step_time_s / scheme.no_offload_s if scheme.no_offload_s else float("nan")
    return (f"offload {level} ({why}): {slow:.2f}x the step of the same plan without offload "
            f"({scheme.no_offload_s * 1e3:.3f} ms, {'fits' if scheme.no_offload_fits else 'does not fit'} "
            f"without it); {scheme.breakdown.host_memory_bytes / 1e9:.3g} GB of host memory per device")
