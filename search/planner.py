"""Plan a model: every mesh shape, the expert baselines, coordinate descent from them, the best Plan.

For each mesh shape (every 1-D and 2-D factorisation of the device count with
the inner axis inside a node, or the one the user gave) the graph is turned
into a SearchProblem, the baselines that exist on that mesh are built, and
coordinate descent starts from them and from a greedy plan. Every candidate
plan is then priced by the full cost model (``costmodel.plan_cost``), and the
cheapest one that fits the per-device memory limit is the found plan. The
found plan is never worse than a baseline: each baseline is itself a start,
and a baseline whose full cost beats the descent's result would be returned.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from autoddl.cluster import Cluster
from autoddl.graph import NodeKind, OpGraph
from autoddl.plan import Mesh, Plan, axis_roles
from costmodel.breakdown import CostBreakdown, plan_cost
from search.baselines import BaselineSpec, baseline_specs, build_baseline
from search.coordinate_descent import coordinate_descent
from search.formulate import Formulation, formulate
from search.meshes import mesh_shapes
from search.problem import NoFeasiblePlanError


NEAR_BEST = 1.05    # meshes whose search objective is within 5% of the best get the full cost model


SCHEMES = ("found", "dp", "zero3", "tp", "sp", "dp_tp")   # what `autoddl plan --scheme` can write


class PlanningError(ValueError):
    """Bad planning input (devices, mesh, memory); the message says which and what to do."""


@dataclass
class Scheme:
    """One scheme's outcome: a costed plan, or why it does not apply."""

    name: str
    plan: Plan | None
    breakdown: CostBreakdown | None
    reason: str = ""

    @property
    def step_time_s(self) -> float:
        return self.breakdown.step_time_s if self.breakdown else math.inf


@dataclass
class SearchOutcome:
    found: Plan
    found_breakdown: CostBreakdown
    schemes: list[Scheme]                        # baselines first (in spec order), then "found"
    meshes: list[tuple[int, ...]]
    search_s: float
    per_mesh: list[dict] = field(default_factory=list)
    formulations: dict[tuple[int, ...], Formulation] = field(default_factory=dict)

    @property
    def best_baseline(self) -> Scheme | None:
        fitting = [s for s in self.schemes if s.name != "found" and s.plan is not None and s.breakdown.fits_memory]
        return min(fitting, key=lambda s: s.step_time_s, default=None)


def resolve_cluster(cluster: Cluster, devices: int | None) -> Cluster:
    if devices is None or devices == cluster.num_devices:
        return cluster
    if devices < 1:
        raise PlanningError(f"--devices {devices}: must be a positive device count")
    return cluster.resized(devices)


def resolve_meshes(cluster: Cluster, mesh: tuple[int, ...] | None) -> list[tuple[int, ...]]:
    n = cluster.num_devices
    if mesh is not None:
        if math.prod(mesh) != n:
            raise PlanningError(f"--mesh {'x'.join(map(str, mesh))}: its {math.prod(mesh)} devices do not match "
                                f"the {n} devices of cluster {cluster.name}; give a mesh whose sizes multiply to {n}")
        return [tuple(mesh)]
    return mesh_shapes(n, cluster.devices_per_node, max_ndim=2)


def canonical_mesh(spec: BaselineSpec, cluster: Cluster) -> tuple[int, ...] | None:
    """The mesh an expert would run ``spec`` on: 1-D over all devices, DP x TP as nodes x node."""
    n = cluster.num_devices
    if spec.name != "dp_tp":                  # dp, zero3, tp, sp: one axis over every device
        return (n,) if len(spec.roles) == 1 else None
    inner = cluster.devices_per_node if cluster.nodes > 1 else _largest_inner(n)
    if inner in (1, n) or n % inner:
        return None
    return (n // inner, inner)


def _largest_inner(n: int) -> int:
    """For one node: the largest proper factor <= n / 2 (8 devices -> 2 x 4)."""
    return max((d for d in range(2, n) if n % d == 0 and d <= n // 2), default=1)


def search(graph: OpGraph, cluster: Cluster, *, model_name: str = "", mesh: tuple[int, ...] | None = None,
           memory_gb: float | None = None, optimizer: str = "adamw", cd_time_limit_s: float = 1.0,
           progress: Callable[[str], None] | None = None) -> SearchOutcome:
    """Search every mesh; return the found plan and each baseline, all priced by the full cost model."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    if memory_gb is not None and memory_gb <= 0:
        raise PlanningError(f"--memory-gb {memory_gb}: must be a positive number of GB per device")
    limit = (memory_gb if memory_gb is not None else cluster.device.memory_gb) * 1e9
    meshes = resolve_meshes(cluster, mesh)
    graph_hash = graph.fingerprint()

    def make_plan(name: str, form: Formulation, assignment: np.ndarray) -> tuple[Plan, CostBreakdown]:
        sigs = form.signatures(assignment)
        storage = {n.target: sigs.pop(n.name).outputs[0] for n in form.nodes if n.kind is NodeKind.PARAMETER}
        roles = axis_roles(sigs, storage, len(form.mesh_shape))
        plan = Plan(name=name, mesh=Mesh(form.mesh_shape, roles),
                    signatures=sigs, param_storage=storage, graph_hash=graph_hash, model=model_name,
                    cluster=cluster.name, optimizer=optimizer)
        bd = plan_cost(graph, plan, cluster)
        bd.memory_limit_bytes = int(limit)
        plan.cost, plan.op_costs = bd.report(), bd.op_rows()
        return plan, bd

    baselines: dict[str, Scheme] = {}
    candidates: list[tuple[Plan, CostBreakdown]] = []
    per_mesh: list[dict] = []
    formulations: dict[tuple[int, ...], Formulation] = {}
    min_memory = math.inf
    descended: list[tuple[tuple[int, ...], Formulation, object]] = []
    for shape in meshes:
        tm = time.perf_counter()
        form = formulate(graph, cluster, shape, optimizer=optimizer, memory_limit_bytes=limit)
        formulations[shape] = form
        starts: dict[str, np.ndarray] = {}
        for spec in baseline_specs(len(shape)):
            base = build_baseline(form, spec)
            is_canonical = mesh is not None or canonical_mesh(spec, cluster) == shape
            if base.applicable:
                starts[spec.name] = base.assignment
                if is_canonical:
                    plan, bd = make_plan(spec.name, form, base.assignment)
                    baselines[spec.name] = Scheme(spec.name, plan, bd)
            elif is_canonical:
                baselines[spec.name] = Scheme(spec.name, None, None, base.reason)
        try:
            result = coordinate_descent(form.problem, starts, time_limit_s=cd_time_limit_s)
        except NoFeasiblePlanError as exc:
            min_memory = min(min_memory, exc.min_memory_bytes)
            per_mesh.append({"mesh": shape, "fits": False, "min_memory_bytes": exc.min_memory_bytes,
                             "seconds": time.perf_counter() - tm})
            say(f"mesh {'x'.join(map(str, shape))}: nothing fits {limit / 1e9:.1f} GB per device")
            continue
        descended.append((shape, form, result))
        per_mesh.append({"mesh": shape, "fits": True, "objective_s": result.cost, "start": result.start,
                         "seconds": time.perf_counter() - tm})
        say(f"mesh {'x'.join(map(str, shape)):>6}: {result.cost * 1e3:10.3f} ms search objective "
            f"(from {result.start}, {time.perf_counter() - tm:.2f} s)")
    # Only meshes near the best objective are worth the full cost model (it can only be lower).
    best_objective = min((r.cost for _, _, r in descended), default=math.inf)
    for shape, form, result in descended:
        if result.cost <= NEAR_BEST * best_objective:
            candidates.append(make_plan("found", form, result.assignment))
    for scheme in baselines.values():
        if scheme.plan is not None:
            candidates.append((scheme.plan, scheme.breakdown))
    fitting = [(p, bd) for p, bd in candidates if bd.fits_memory]
    if not fitting:
        need = min([bd.memory_bytes_per_device for _, bd in candidates] + [min_memory])
        raise NoFeasiblePlanError(need, limit)
    best_plan, best_bd = min(fitting, key=lambda pb: pb[1].step_time_s)
    if best_plan.name != "found":               # a baseline beat the descent under the full cost model
        kept = best_plan.name
        best_plan = Plan.from_dict({**best_plan.to_dict(), "name": "found"})
        best_plan.notes.append(f"the search kept the {kept} baseline: no plan it visited was cheaper "
                               "under the full cost model")
    order = [s.name for spec_nd in (1, 2) for s in baseline_specs(spec_nd)]
    schemes = sorted(baselines.values(), key=lambda s: order.index(s.name))
    schemes.append(Scheme("found", best_plan, best_bd))
    return SearchOutcome(best_plan, best_bd, schemes, meshes, time.perf_counter() - t0, per_mesh, formulations)
