"""Plan a model: every mesh shape, the expert baselines, coordinate descent from them, the best Plan.

For each mesh shape (every 1-D and 2-D factorisation of the device count with
the inner axis inside a node, or the one the user gave) the graph is turned
into a SearchProblem, the baselines that exist on that mesh are built, and
coordinate descent starts from them and from a greedy plan (on a 2-D mesh
whose outer axis crosses nodes, also from DP x TP and FSDP x TP with their axes'
roles exchanged, when near the best start: ``_Search.exchanged_starts``). Every
candidate plan is then priced by the full cost model (``costmodel.plan_cost``), and the
cheapest one that fits the per-device memory limit is the found plan. The
found plan is never worse than a baseline: each baseline is itself a start,
and a baseline whose full cost beats the descent's result would be returned.

Every plan carries the search's ``Training`` (precision, recompute, micro-batches), and the
search objective prices one optimizer step under it (search/formulate.py). ``recompute="auto"``
chooses recompute per block (``Training.recompute_blocks``) under the memory limit, per mesh:
from nothing recomputed, blocks are recomputed one at a time in block order, selective first,
then full (the levels of :func:`recompute_levels`), until the mesh's best plan fits, as the full
cost model counts memory. Memory falls level by level, so the first level that fits is found by
bisection (of the formulation's least memory while the search finds nothing that fits, then of
the full cost model's memory of the plan found), and the search runs again at that level.
Baselines take the first level at which they fit themselves. ``Training.offload`` other than
none is search/offload.py's: it runs this search and spills the plans it finds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from autoddl.cluster import Cluster
from autoddl.graph import NodeKind, OpGraph
from autoddl.pipeline import pipeline_degree, repeated_blocks, with_pp_axis
from autoddl.plan import ROLE_WORDS, Mesh, Plan, axis_roles
from autoddl.program import lower
from autoddl.training import Training
from costmodel.breakdown import CostBreakdown, compute_floor_s, plan_cost, predicted_collectives
from costmodel.memory import activation_bytes, memory_bytes, memory_floor_bytes, recomputed_bytes
from search.baselines import BaselineSpec, baseline_specs, build_baseline, exchanged_specs
from search.formulate import Formulation, FormulationCache, formulate
from search.meshes import inner_axis_in_node, mesh_shapes
from search.stages import stage_cuts
from search.tied import tied_descent
from search.problem import NoFeasiblePlanError, memory_tolerance
from search.zero import ZERO_STAGES, data_parallel_axes, with_zero


NEAR_BEST = 1.05    # meshes (and exchanged starts) whose search objective is within 5% of the best
                    # get the full cost model


SCHEMES = ("found", "dp", "zero1", "zero2", "zero3", "tp", "sp", "dp_tp", "fsdp_tp")   # `autoddl plan --scheme`


class PlanningError(ValueError):
    """Bad planning input (devices, mesh, memory); the message says which and what to do."""


@dataclass
class Scheme:
    """One scheme's outcome: a costed plan, or why it does not apply."""

    name: str
    plan: Plan | None
    breakdown: CostBreakdown | None
    reason: str = ""
    no_offload_s: float | None = None        # spilled (search/offload.py): the step of the plan without it
    no_offload_fits: bool = True             # ... and whether that fits the memory limit
    estimate_s: float | None = None          # estimated (not priced): the search objective, where there is one
    floor_bytes: int = 0                     # ... and its memory floor, over the limit (price_unless_unfit)
    floor_s: float = 0.0                     # ... or its compute floor, over the found plan's step

    @property
    def step_time_s(self) -> float:
        return self.breakdown.step_time_s if self.breakdown else math.inf

    @property
    def estimated(self) -> bool:
        """A plan left unpriced by the full cost model: it cannot fit or cannot be chosen
        (:func:`price_unless_unfit`)."""
        return self.plan is not None and self.breakdown is None and self.reason != PENDING


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
        fitting = [s for s in self.schemes if s.name != "found" and s.breakdown is not None and s.breakdown.fits_memory]
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
    """The mesh an expert would run ``spec`` on: 1-D over all devices, DP x TP and FSDP x TP as
    nodes x node."""
    n = cluster.num_devices
    if spec.name not in ("dp_tp", "fsdp_tp"):  # dp, zero3, tp, sp: one axis over every device
        return (n,) if len(spec.roles) == 1 else None
    inner = cluster.devices_per_node if cluster.nodes > 1 else _largest_inner(n)
    if inner in (1, n) or n % inner:
        return None
    return (n // inner, inner)


def _largest_inner(n: int) -> int:
    """For one node: the largest proper factor <= n / 2 (8 devices -> 2 x 4)."""
    return max((d for d in range(2, n) if n % d == 0 and d <= n // 2), default=1)


# -- training: recompute levels, throughput, pricing ------------------------------------------------

def recompute_blocks(graph: OpGraph) -> list[str]:
    """The repeated blocks recompute is decided for, in forward order (``root`` is never recomputed)."""
    return repeated_blocks(graph)


def recompute_levels(graph: OpGraph, training: Training) -> list[dict[str, str]]:
    """``recompute="auto"``'s choices in the order it tries them: level 0 recomputes nothing; level
    i <= n (n blocks) recomputes the first i blocks selectively; level n + j all of them, the first
    j in full. Blocks the user gave a policy in ``recompute_blocks`` keep it."""
    free = [b for b in recompute_blocks(graph) if b not in training.recompute_blocks]
    levels = []
    for i in range(2 * len(free) + 1):
        selective, full = min(i, len(free)), max(0, i - len(free))
        levels.append({**{b: "full" if j < full else "selective" if j < selective else "none"
                          for j, b in enumerate(free)}, **training.recompute_blocks})
    return levels


def at_level(training: Training, blocks: dict[str, str]) -> Training:
    return dataclasses.replace(training, recompute_blocks=dict(blocks))


def with_training(plan: Plan, training: Training) -> Plan:
    """A copy of ``plan`` (not yet priced) running under ``training``."""
    return dataclasses.replace(plan, training=training, notes=list(plan.notes), cost=None, op_costs=[])


def recompute_summary(training: Training, graph: OpGraph) -> str:
    """``selective in 32 of 32 blocks, full in 3 (layers.0 .. layers.2)``, or ``nothing recomputed``."""
    blocks = recompute_blocks(graph)
    by = {p: [b for b in blocks if training.recompute_of(b) == p] for p in ("selective", "full")}
    parts = []
    for policy, names in by.items():
        if names:
            where = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            parts.append(f"{policy} in {len(names)} of {len(blocks)} blocks ({where})")
    return ", ".join(parts) or "nothing recomputed"


def throughput(graph: OpGraph, plan: Plan, step_time_s: float) -> dict[str, float | None]:
    """The CostReport's throughput fields over one optimizer step (autoddl/plan.py's CostReport):
    tokens (first input integer token ids (B, T)) or samples per second, and the model's TFLOP/s per
    device: 3 x the forward FLOPs of every micro-step (recompute not counted), over the step time."""
    out: dict[str, float | None] = {"tokens_per_s": None, "samples_per_s": None, "model_tflops_per_device": None}
    if not step_time_s > 0:
        return out
    k = plan.training.micro_batches
    inputs = graph.nodes_of(NodeKind.INPUT)
    if inputs and inputs[0].outputs and inputs[0].outputs[0].ndim >= 1:
        meta = inputs[0].outputs[0]
        if meta.ndim == 2 and not meta.is_floating and meta.dtype != "bool":
            out["tokens_per_s"] = meta.shape[0] * meta.shape[1] * k / step_time_s
        else:
            out["samples_per_s"] = meta.shape[0] * k / step_time_s
    forward_flops = sum(n.flops for n in graph.ops())
    out["model_tflops_per_device"] = 3 * forward_flops * k / step_time_s / plan.devices / 1e12
    return out


def price(graph: OpGraph, plan: Plan, cluster: Cluster, limit_bytes: float) -> CostBreakdown:
    """The full cost model's breakdown of ``plan`` under ``limit_bytes`` per device; sets ``plan.cost``
    (with throughput) and ``plan.op_costs``."""
    bd = plan_cost(graph, plan, cluster)
    bd.memory_limit_bytes = int(limit_bytes)
    plan.cost = dataclasses.replace(bd.report(), **throughput(graph, plan, bd.step_time_s))
    plan.op_costs = bd.op_rows()
    return bd


PENDING = "not priced yet"      # a baseline Scheme :meth:`_Search.choose` prices or estimates


def price_unless_unfit(graph: OpGraph, plan: Plan, cluster: Cluster, limit_bytes: float,
                       estimate_s: float | None = None, beat_s: float = math.inf) -> Scheme:
    """``plan`` priced by the full cost model, unless it provably cannot fit ``limit_bytes`` or be
    faster than ``beat_s`` (the best fitting plan already priced): what it keeps that needs no step
    program (costmodel/memory.py ``memory_floor_bytes``: parameters, gradients, optimizer states,
    buffers, working copies stored whole, activations) is already over the limit, or its kernels
    alone (costmodel/breakdown.py ``compute_floor_s``) take longer than ``beat_s``; either way no
    search could choose it. Such a plan is *estimated*: not lowered or simulated, its Scheme holds
    ``estimate_s`` (the search objective, when the caller has one) and the floor (`autoddl plan`
    marks it in the table; ``--price-all-baselines`` prices it)."""
    floor = memory_floor_bytes(graph, plan, enough_bytes=limit_bytes)
    if floor is not None and floor > limit_bytes:
        return Scheme(plan.name, plan, None, f"cannot fit: at least {gb(floor)} per device (parameters, gradients, "
                      f"optimizer states, ...) over the {gb(limit_bytes)} limit",
                      estimate_s=estimate_s, floor_bytes=floor)
    kernels = compute_floor_s(graph, plan, cluster) if beat_s < math.inf else 0.0
    if kernels > beat_s:
        return Scheme(plan.name, plan, None, f"cannot be chosen: its kernels alone take {kernels * 1e3:.3f} ms, more "
                      f"than the {beat_s * 1e3:.3f} ms step of the best plan priced", estimate_s=estimate_s,
                      floor_s=kernels)
    return Scheme(plan.name, plan, price(graph, plan, cluster, limit_bytes))


def plan_memory(graph: OpGraph, plan: Plan, cluster: Cluster) -> int:
    """Per-device bytes of ``plan`` as the full cost model counts them, without simulating its timeline."""
    program = lower(graph, plan)
    return memory_bytes(graph, plan, predicted_collectives(graph, plan, cluster, program), program)["total"]


def memory_at_levels(graph: OpGraph, plan: Plan, cluster: Cluster) -> Callable[[Training], int]:
    """``training -> plan_memory(graph, plan under training, cluster)`` for trainings that differ from
    ``plan.training`` in recompute only: of the cost model's categories (costmodel/memory.py) only
    ``activations`` and ``recomputed`` depend on what is recomputed (the parameters and their gathers
    do not, and a recomputed forward boxes no larger tensor than forward did), so the program is
    lowered once and only those two are counted again. With pipeline stages the activations are
    those of the micro-batches in flight on the rank that needs the most, and with saved activations
    spilled (``offload activations``) what stays on the device: counted in full."""
    if pipeline_degree(plan) > 1 or plan.training.offload_level == "activations":
        return lambda training: plan_memory(graph, dataclasses.replace(plan, training=training), cluster)
    program = lower(graph, plan)
    mem = memory_bytes(graph, plan, predicted_collectives(graph, plan, cluster, program), program)
    fixed = mem["total"] - mem["activations"] - mem["recomputed"]

    def at(training: Training) -> int:
        other = dataclasses.replace(plan, training=training)
        return fixed + sum(activation_bytes(graph, other).values()) + recomputed_bytes(graph, other)
    return at


def first_level(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The smallest level in ``lo..hi`` that ``fits`` (levels save memory in order: bisection), or
    None when even ``hi`` does not."""
    if lo > hi or not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def gb(nbytes: float) -> str:
    """``91.9 GB`` / ``0.00327 GB``: three significant digits (GB = 1e9 bytes, as --memory-gb)."""
    return f"{nbytes / 1e9:.3g} GB"


def auto_note(plan: Plan, graph: OpGraph, limit: float, before: float | None, exact: bool) -> str:
    """plan.notes's line on what ``recompute auto`` chose and why."""
    chosen = recompute_summary(plan.training, graph)
    have = plan.cost.memory_bytes_per_device if plan.cost is not None else 0
    if before is None:
        return (f"recompute auto on mesh {plan.mesh}: {chosen}: the plan fits without recompute "
                f"({gb(have)} of {gb(limit)} per device)")
    need = f"needs {gb(before)}" if exact else f"needs at least {gb(before)} (the search's estimate)"
    fit = "fits" if have <= limit else "still does not fit"
    return (f"recompute auto on mesh {plan.mesh}: {chosen}, the fewest blocks in order (selective first, then "
            f"full) with which it {fit}: without recompute the best plan on this mesh {need} per device, over "
            f"the {gb(limit)} limit; with it {gb(have)}")


def assignment_plan(name: str, form: Formulation, assignment: np.ndarray, graph_hash: str, model_name: str,
                    cluster: Cluster, optimizer: str, training: Training) -> Plan:
    """The Plan of a SearchProblem assignment (signatures, storages, role-named mesh axes)."""
    sigs = form.signatures(assignment)
    storage = {n.target: sigs.pop(n.name).outputs[0] for n in form.nodes if n.kind is NodeKind.PARAMETER}
    roles = axis_roles(sigs, storage, len(form.mesh_shape))
    return Plan(name=name, mesh=Mesh(form.mesh_shape, roles), signatures=sigs, param_storage=storage,
                graph_hash=graph_hash, model=model_name, cluster=cluster.name, optimizer=optimizer,
                training=training)


def fit_recompute(graph: OpGraph, plan: Plan, cluster: Cluster, limit: float,
                  levels: list[dict[str, str]]) -> tuple[Plan, CostBreakdown]:
    """``plan`` (fixed signatures) at the first recompute level with which it fits (the last if none),
    priced, with a note on the choice: how a baseline or a given configuration takes ``auto``."""
    base = plan.training
    first = with_training(plan, at_level(base, levels[0]))
    memory = memory_at_levels(graph, first, cluster)
    before = memory(first.training)
    if before <= limit or len(levels) == 1:
        bd = price(graph, first, cluster, limit)
        first.notes.append(auto_note(first, graph, limit, None, True))
        return first, bd
    level = first_level(lambda i: memory(at_level(base, levels[i])) <= limit, 1, len(levels) - 1)
    chosen = with_training(plan, at_level(base, levels[len(levels) - 1 if level is None else level]))
    bd = price(graph, chosen, cluster, limit)
    chosen.notes.append(auto_note(chosen, graph, limit, before, True))
    return chosen, bd


def search(graph: OpGraph, cluster: Cluster, *, model_name: str = "", mesh: tuple[int, ...] | None = None,
           memory_gb: float | None = None, optimizer: str = "adamw", cd_time_limit_s: float | None = None,
           progress: Callable[[str], None] | None = None, training: Training | None = None,
           tie_blocks: bool = True, price_all_baselines: bool = True) -> SearchOutcome:
    """Search every mesh; return the found plan and each baseline, all priced by the full cost model
    and all carrying ``training`` (module docstring; ``recompute="auto"`` chooses per block).
    ``price_all_baselines=False`` (`autoddl plan`'s default) leaves the baselines that provably
    cannot fit unpriced (:func:`price_unless_unfit`; not under ``recompute="auto"``, which prices a
    baseline per level): the found plan and the best baseline are the same either way.
    ``tie_blocks``: search repeated blocks once, each given the first's choices (search/tied.py).
    ``cd_time_limit_s``: None (default) bounds coordinate descent by its work alone (restarts and
    sweeps: search/coordinate_descent.py), so the same inputs give the same plan on any machine,
    loaded or not; a number also stops its restarts on the clock (the plan then depends on speed)."""
    training = training or Training()
    if training.offload != "none":            # spilling to host memory: search/offload.py
        from search.offload import offload_search
        return offload_search(graph, cluster, search, training=training, memory_gb=memory_gb, model_name=model_name,
                              mesh=mesh, optimizer=optimizer, cd_time_limit_s=cd_time_limit_s, progress=progress,
                              tie_blocks=tie_blocks)
    t0 = time.perf_counter()
    if memory_gb is not None and memory_gb <= 0:
        raise PlanningError(f"--memory-gb {memory_gb}: must be a positive number of GB per device")
    limit = (memory_gb if memory_gb is not None else cluster.device.memory_gb) * 1e9
    meshes = resolve_meshes(cluster, mesh)
    run = _Search(graph, cluster, model_name, mesh, limit, optimizer, cd_time_limit_s, progress or (lambda _m: None),
                  training, tie_blocks, price_all_baselines)
    for shape in meshes:
        run.on_mesh(shape)
    best_plan, best_bd = run.choose()
    unfit = [s.name for s in run.baselines.values() if s.estimated and s.floor_bytes]
    slower = [s.name for s in run.baselines.values() if s.estimated and not s.floor_bytes]
    if unfit or slower:
        why = ([f"{', '.join(unfit)} cannot fit {gb(limit)} per device (what they keep without lowering is over it)"]
               if unfit else []) + ([f"{', '.join(slower)} cannot be chosen (their kernels alone take longer than the "
                                     "found plan's step)"] if slower else [])
        best_plan.notes.append(f"baselines not priced by the full cost model: {'; '.join(why)}")
    order = [s.name for spec_nd in (1, 2) for s in baseline_specs(spec_nd)] + ["zero1", "zero2"]
    schemes = sorted(run.baselines.values(), key=lambda s: order.index(s.name))
    schemes.append(Scheme("found", best_plan, best_bd))
    return SearchOutcome(best_plan, best_bd, schemes, meshes, time.perf_counter() - t0, run.per_mesh,
                         run.formulations)


class _Search:
    """One :func:`search`'s state, stage by stage: per mesh the baselines (:meth:`baselines_on`)
    and the descent at the recompute level that fits (:meth:`descend`), then the full cost model's
    choice among the candidates (:meth:`choose`)."""

    def __init__(self, graph: OpGraph, cluster: Cluster, model_name: str, mesh: tuple[int, ...] | None,
                 limit: float, optimizer: str, cd_time_limit_s: float | None, say: Callable[[str], None],
                 training: Training, tie_blocks: bool, price_all_baselines: bool = True):
        self.graph, self.cluster, self.model_name, self.mesh, self.limit = graph, cluster, model_name, mesh, limit
        self.optimizer, self.cd_time_limit_s, self.say = optimizer, cd_time_limit_s, say
        self.training, self.tie_blocks = training, tie_blocks
        self.graph_hash = graph.fingerprint()
        self.auto = training.recompute == "auto"
        self.estimate = not price_all_baselines and not self.auto       # price_unless_unfit the baselines
        self.levels = recompute_levels(graph, training) if self.auto else [dict(training.recompute_blocks)]
        self.top = len(self.levels) - 1
        self.baselines: dict[str, Scheme] = {}
        self.per_mesh: list[dict] = []
        self.formulations: dict[tuple[int, ...], Formulation] = {}
        self.min_memory = math.inf
        self.descended: list[tuple] = []  # (mesh, formulation, search result, level, priced plan or None, breakdown)
        self.exchanged: list[tuple[BaselineSpec, Formulation, np.ndarray]] = []    # kept starts (exchanged_starts)

    def at(self, level: int) -> Training:
        return at_level(self.training, self.levels[level])

    def plan_of(self, name: str, form: Formulation, assignment: np.ndarray, tr: Training) -> Plan:
        return assignment_plan(name, form, assignment, self.graph_hash, self.model_name, self.cluster,
                               self.optimizer, tr)

    def can_fit(self, form: Formulation) -> bool:
        return form.problem.min_memory() <= self.limit + memory_tolerance(self.limit)

    def on_mesh(self, shape: tuple[int, ...]) -> None:
        """Formulate ``shape``, build its baselines, descend, and record the outcome."""
        tm = time.perf_counter()
        memo: dict[int, Formulation] = {}
        cache = FormulationCache(self.graph, self.cluster, shape, self.optimizer)

        def form_at(i: int) -> Formulation:
            if i not in memo:
                memo[i] = formulate(self.graph, self.cluster, shape, optimizer=self.optimizer,
                                    memory_limit_bytes=self.limit, training=self.at(i), cache=cache)
            return memo[i]

        form = self.formulations[shape] = form_at(0)
        starts = self.baselines_on(shape, form)
        outcome, form, level, before, exact = self.descend(form_at, starts)
        where = "x".join(map(str, shape))
        if outcome is None:
            need = form.problem.min_memory()
            self.min_memory = min(self.min_memory, need)
            self.per_mesh.append({"mesh": shape, "fits": False, "min_memory_bytes": need,
                                  "seconds": time.perf_counter() - tm})
            self.say(f"mesh {where}: nothing fits {self.limit / 1e9:.1f} GB per device"
                     + (" even with every block recomputed in full" if self.auto else ""))
            return
        result, plan, bd = outcome
        self.formulations[shape] = form
        if plan is not None:
            plan.notes.append(auto_note(plan, self.graph, self.limit, before, exact))
        self.descended.append((shape, form, result, level, plan, bd))
        summary = recompute_summary(self.at(level), self.graph)
        self.per_mesh.append({"mesh": shape, "fits": bd.fits_memory if bd is not None else True,
                              "objective_s": result.cost, "start": result.start,
                              "seconds": time.perf_counter() - tm, "recompute": summary})
        self.say(f"mesh {where:>6}: {result.cost * 1e3:10.3f} ms search objective "
                 f"(from {result.start}, {time.perf_counter() - tm:.2f} s)" + (f"; {summary}" if self.auto else ""))

    def baselines_on(self, shape: tuple[int, ...], form: Formulation) -> dict[str, np.ndarray]:
        """The baselines on ``shape``: each applicable one is a descent start; on its canonical mesh
        (or the mesh the user gave) it is priced (at the first recompute level it fits, under auto)."""
        starts: dict[str, np.ndarray] = {}
        for spec in baseline_specs(len(shape)):
            base = build_baseline(form, spec)
            is_canonical = self.mesh is not None or canonical_mesh(spec, self.cluster) == shape
            if base.applicable:
                starts[spec.name] = base.assignment
                if is_canonical:
                    if self.estimate:           # priced or estimated once the found plan is priced (choose)
                        plan = self.plan_of(spec.name, form, base.assignment, self.at(0))
                        self.baselines[spec.name] = Scheme(spec.name, plan, None, PENDING,
                                                           estimate_s=form.problem.cost(base.assignment))
                    else:
                        self.baselines[spec.name] = Scheme(spec.name, *self.priced(spec.name, form, base.assignment))
            elif is_canonical:
                self.baselines[spec.name] = Scheme(spec.name, None, None, base.reason)
        return {**starts, **self.exchanged_starts(shape, form, starts)}

    def priced(self, name: str, form: Formulation, assignment: np.ndarray) -> tuple[Plan, CostBreakdown]:
        """A fixed assignment (a baseline's) as a plan priced by the full cost model, at the first
        recompute level at which it fits under auto."""
        plan = self.plan_of(name, form, assignment, self.at(0))
        return fit_recompute(self.graph, plan, self.cluster, self.limit, self.levels) if self.auto \
            else (plan, price(self.graph, plan, self.cluster, self.limit))

    def exchanged_starts(self, shape: tuple[int, ...], form: Formulation,
                         starts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """On a 2-D mesh whose axes cross different links (the outer one across nodes, the inner one
        inside), the 2-D baselines with their axes' roles exchanged (search/baselines.py's
        ``exchanged_specs``: ``tp_dp`` runs Megatron across the outer axis). Descent cannot reach
        such a plan from its twin (every op's roles would have to move at once), and the search
        objective can rank the descent's own plan above it where the full cost model does not
        (issue 14, llama tiny at 256 wide on two hosts at 10 Gbit/s: tp_dp 76.9 ms, the found plan
        dp_tp's 82.9), so a kept one is both a start and a candidate :meth:`choose` prices; it is
        not a baseline of the table. Kept only when its search objective is within ``NEAR_BEST`` of
        the best baseline start's on the mesh (the objective ranks plans this close only roughly:
        gpt there, tp_dp 2% above dp_tp by it, 7% below the found dp by the full cost model), so
        that where tp across nodes is hopeless (Llama-3-8B on 8x8 of h100-4x8: 4x the best start's
        objective) it costs two greedy builds and no descent or pricing."""
        if len(shape) != 2 or self.cluster.link_for_axis(shape, 0) is self.cluster.link_for_axis(shape, 1):
            return {}
        best = min((form.problem.cost(a) for a in starts.values()), default=math.inf)
        kept: dict[str, np.ndarray] = {}
        for spec in exchanged_specs(2):
            base = build_baseline(form, spec)
            if base.applicable and form.problem.cost(base.assignment) <= NEAR_BEST * best:
                kept[spec.name] = base.assignment
                self.exchanged.append((spec, form, base.assignment))
        return kept

    def descend(self, form_at: Callable[[int], Formulation], starts: dict[str, np.ndarray]) -> tuple:
        """Coordinate descent from ``starts`` at the first recompute level where the mesh's best plan
        fits (module docstring): (outcome: (result, priced plan or None, breakdown or None) or None
        when nothing fits, the formulation, the level, the memory before recompute, whether exact)."""
        level, before, exact, top = 0, None, True, self.top
        while True:
            form = form_at(level)
            if not self.can_fit(form):          # the search's own estimate: nothing fits at this level
                if not self.auto or level == top:
                    return None, form, level, before, exact
                if before is None:
                    before, exact = form.problem.min_memory(), False
                nxt = first_level(lambda i: self.can_fit(form_at(i)), level + 1, top)
                if nxt is None:
                    return None, form_at(top), top, before, exact
                level = nxt
                continue
            result = tied_descent(form.problem, starts, tie=self.tie_blocks, time_limit_s=self.cd_time_limit_s)
            starts = {**starts, "previous level": result.assignment}
            if not self.auto:
                return (result, None, None), form, level, before, exact
            plan = self.plan_of("found", form, result.assignment, self.at(level))
            memory = memory_at_levels(self.graph, plan, self.cluster)
            here = memory(plan.training)
            if here <= self.limit or level == top:
                return (result, plan, price(self.graph, plan, self.cluster, self.limit)), form, level, before, exact
            if before is None:
                before, exact = here, True
            nxt = first_level(lambda i: memory(self.at(i)) <= self.limit, level + 1, top)  # noqa: B023
            level = top if nxt is None else nxt

    def choose(self) -> tuple[Plan, CostBreakdown]:
        """The cheapest fitting candidate under the full cost model: the descent's plan on each mesh
        near the best objective (and its ZeRO variants), and every baseline."""
        candidates: list[tuple[Plan, CostBreakdown]] = []
        # Only meshes near the best objective are worth the full cost model (it can only be lower).
        best_objective = min((r.cost for _, _, r, *_ in self.descended), default=math.inf)
        for _shape, form, result, level, plan, bd in self.descended:
            if plan is not None:                      # auto: priced already, to decide the level
                candidates.append((plan, bd))
            elif result.cost <= NEAR_BEST * best_objective:
                plan = self.plan_of("found", form, result.assignment, self.at(level))
                candidates.append((plan, price(self.graph, plan, self.cluster, self.limit)))
        self.baselines.update(zero_baselines(self.graph, self.baselines.get("dp"), self.cluster, self.limit,
                                             self.estimate))
        candidates += [zero_variant(self.graph, p, stage, self.cluster, self.limit) for p, _ in list(candidates)
                       for stage in ZERO_STAGES if p.name == "found" and data_parallel_axes(p)]
        exchanged = [self.priced(spec.name, form, a) for spec, form, a in self.exchanged]
        beat = min((bd.step_time_s for _, bd in candidates + exchanged if bd.fits_memory), default=math.inf)
        self.baselines = {k: price_unless_unfit(self.graph, s.plan, self.cluster, self.limit, s.estimate_s, beat)
                          if s.reason == PENDING else s for k, s in self.baselines.items()}
        for scheme in self.baselines.values():
            if scheme.breakdown is not None:
                candidates.append((scheme.plan, scheme.breakdown))
        candidates += exchanged
        fitting = [(p, bd) for p, bd in candidates if bd.fits_memory]
        if not fitting:         # the error names the least memory of any plan: price those left unpriced
            priced = {k: Scheme(k, s.plan, price(self.graph, s.plan, self.cluster, self.limit))
                      for k, s in self.baselines.items() if s.estimated}
            self.baselines.update(priced)
            candidates += [(s.plan, s.breakdown) for s in priced.values()]
            fitting = [(p, bd) for p, bd in candidates if bd.fits_memory]
        if not fitting:
            need = min([bd.memory_bytes_per_device for _, bd in candidates] + [self.min_memory])
            raise NoFeasiblePlanError(need, self.limit)
        best_plan, best_bd = min(fitting, key=lambda pb: pb[1].step_time_s)
        if best_plan.name != "found":               # a baseline beat the descent under the full cost model
            kept = next((f"{s.name} start ({s.description})" for s, *_ in self.exchanged if s.name == best_plan.name),
                        f"{best_plan.name} baseline")
            best_plan = Plan.from_dict({**best_plan.to_dict(), "name": "found"})
            best_plan.notes.append(f"the search kept the {kept}: no plan it visited was cheaper "
                                   "under the full cost model")
        return best_plan, best_bd


def zero_variant(graph: OpGraph, plan: Plan, stage: int, cluster: Cluster, limit: float,
                 name: str | None = None) -> tuple[Plan, CostBreakdown]:
    """``plan`` with ZeRO-``stage`` optimizer (and gradient) storages on its data-parallel axis
    (search/zero.py), priced by the full cost model."""
    zeroed = with_zero(graph, plan, stage, name=name or plan.name)
    return zeroed, price(graph, zeroed, cluster, limit)


def zero_baselines(graph: OpGraph, dp: Scheme | None, cluster: Cluster, limit: float,
                   estimate: bool = False) -> dict[str, Scheme]:
    """``zero1`` and ``zero2``: the data-parallel baseline with ZeRO-1 / ZeRO-2 storages
    (``estimate``: unpriced, ``PENDING`` for :meth:`_Search.choose`; no search objective to show)."""
    if dp is None or dp.plan is None or not data_parallel_axes(dp.plan):
        why = dp.reason if dp is not None and dp.plan is None and dp.reason \
            else "no data-parallel axis of more than one device"
        return {f"zero{s}": Scheme(f"zero{s}", None, None, why) for s in ZERO_STAGES}
    if estimate:            # priced or estimated by _Search.choose
        return {f"zero{s}": Scheme(f"zero{s}", with_zero(graph, dp.plan, s, name=f"zero{s}"), None, PENDING)
                for s in ZERO_STAGES}
    return {f"zero{s}": Scheme(f"zero{s}", *zero_variant(graph, dp.plan, s, cluster, limit, name=f"zero{s}"))
            for s in ZERO_STAGES}


# -- a given configuration (--degrees) ------------------------------------------------------------

DEGREE_ROLES = {"pp": "pp", "dp": "dp", "fsdp": "zero", "tp": "tp", "sp": "sp"}    # --degrees role -> baseline role
_SPEC_NAMES = {("dp",): "dp", ("zero",): "zero3", ("tp",): "tp", ("sp",): "sp", ("dp", "tp"): "dp_tp",
               ("zero", "tp"): "fsdp_tp", ("dp", "sp"): "dp_sp", ("zero", "sp"): "fsdp_sp",
               ("pp", "dp", "tp"): "megatron_3d", ("pp", "zero", "tp"): "fsdp_tp_pp",
               ("pp", "dp", "sp"): "megatron_3d_sp", ("pp", "zero", "sp"): "fsdp_sp_pp"}
# --degrees sp is Megatron's tensor parallel with sequence parallel (axis_roles' sp: a sequence split alone)
_DEGREE_WORDS = {**{r: ROLE_WORDS[r] for r in DEGREE_ROLES}, "sp": f"{ROLE_WORDS['tp']} with {ROLE_WORDS['sp']}"}
MODEL_ROLES = ("tp", "sp")      # tensor parallel, without or with sequence parallel: the innermost degree


def parse_degrees(text: str) -> list[tuple[str, int]]:
    """``"dp=4,tp=8"`` -> [("dp", 4), ("tp", 8)] (outer axis first); a clear error for anything else."""
    out: list[tuple[str, int]] = []
    for part in [p.strip() for p in str(text).split(",") if p.strip()]:
        role, sep, value = part.partition("=")
        role = role.strip().lower()
        if not sep:
            raise PlanningError(f"--degrees {text}: {part!r} is not ROLE=DEGREE; e.g. --degrees dp=4,tp=8")
        if role not in DEGREE_ROLES:
            raise PlanningError(f"--degrees {text}: unknown role {role!r}; the roles are "
                                f"{', '.join(DEGREE_ROLES)} (e.g. --degrees fsdp=8 or dp=4,tp=8)")
        try:
            degree = int(value)
        except ValueError:
            degree = 0
        if degree < 1:
            raise PlanningError(f"--degrees {text}: {role}={value.strip()} is not a positive integer degree")
        if role in dict(out):
            raise PlanningError(f"--degrees {text}: role {role} is given twice; give each role once")
        out.append((role, degree))
    if not out:
        raise PlanningError(f"--degrees {text!r}: give at least one ROLE=DEGREE, e.g. --degrees fsdp=8")
    return out


def degrees_text(degrees: list[tuple[str, int]]) -> str:
    return ",".join(f"{r}={d}" for r, d in degrees)


def data_parallel_degree(degrees: list[tuple[str, int]]) -> int:
    """How many ways the batch is split: the product of the dp and fsdp degrees."""
    return math.prod(d for r, d in degrees if r in ("dp", "fsdp"))


def pipeline_split(degrees: list[tuple[str, int]]) -> tuple[int, list[tuple[str, int]]]:
    """(the pp degree, the other degrees): pp must come first, the outermost axis (across nodes)."""
    roles = [r for r, _ in degrees]
    if "pp" not in roles:
        return 1, list(degrees)
    if roles[0] != "pp":
        raise PlanningError(f"--degrees {degrees_text(degrees)}: pp must be the outermost (first) degree, its "
                            "stages across nodes; e.g. --degrees pp=8,dp=16,tp=8")
    inner = list(degrees[1:]) or [("dp", 1)]
    return degrees[0][1], inner


def degrees_spec(degrees: list[tuple[str, int]], cluster: Cluster) -> tuple[BaselineSpec, tuple[int, ...]]:
    """The expert plan and mesh of ``degrees`` on ``cluster``, after checking them (errors name the
    degree and every device count involved). Degree-1 roles take no mesh axis; a pp degree > 1 is
    the outermost axis, its roles the spec's first."""
    text = degrees_text(degrees)
    n, per_node = cluster.num_devices, cluster.devices_per_node
    for role, d in degrees:
        if n % d:
            raise PlanningError(f"--degrees {text}: {role}={d} does not divide the {n} devices of cluster "
                                f"{cluster.name}; each degree must divide the device count")
    if math.prod(d for _, d in degrees) != n:
        product = " x ".join(f"{r}={d}" for r, d in degrees)
        raise PlanningError(f"--degrees {text}: {product} = {math.prod(d for _, d in degrees)} devices, but cluster "
                            f"{cluster.name} has {n}; give degrees whose product is {n} (or --devices "
                            f"{math.prod(d for _, d in degrees)})")
    pp, inner = pipeline_split(degrees)
    axes = [(r, d) for r, d in inner if d > 1] or [inner[0]]
    roles = [r for r, _ in axes]
    model = [r for r in roles if r in MODEL_ROLES]
    if len(model) > 1:
        raise PlanningError(f"--degrees {text}: tp (tensor parallel) and sp (tensor parallel with sequence "
                            "parallel) are one degree; give one of them")
    if model and roles[-1] != model[0]:
        m = model[0]
        raise PlanningError(f"--degrees {text}: {m} must be the innermost (last) degree, inside a node; "
                            f"e.g. --degrees {','.join(f'{r}={d}' for r, d in axes if r != m)},{m}={dict(axes)[m]}")
    if not inner_axis_in_node((pp,) + tuple(d for _, d in axes), per_node):
        raise PlanningError(f"--degrees {text}: the innermost degree {axes[-1][0]}={axes[-1][1]} must divide the "
                            f"{per_node} devices of a node (it runs inside one); put the axis that spans nodes first")
    if pp > 1:
        axes = [("pp", pp)] + axes
        roles = ["pp"] + roles
    base_roles = tuple(DEGREE_ROLES[r] for r in roles)
    name = _SPEC_NAMES.get(base_roles, "_".join(roles))
    words = ", ".join(f"{_DEGREE_WORDS[r]} over {d}" for r, d in axes)
    return BaselineSpec(name, base_roles, words), tuple(d for _, d in axes)


def price_degrees(graph: OpGraph, cluster: Cluster, degrees: list[tuple[str, int]], *, model_name: str = "",
                  memory_gb: float | None = None, optimizer: str = "adamw",
                  training: Training | None = None, zero: int = 0, schedule: str = "1f1b",
                  virtual_stages: int = 1) -> Scheme:
    """The expert configuration ``degrees`` (``parse_degrees``) built as a baseline on its mesh and
    priced under ``training`` by the full cost model (``recompute="auto"``: the first recompute level
    at which it fits). With a pp degree, the baseline of the other degrees runs inside each stage,
    the stages cut where search/stages.py balances them, under pipeline ``schedule`` with
    ``virtual_stages`` chunks per pp rank (both ignored without pp). Raises PlanningError when it
    does not apply, saying why."""
    training = training or Training()
    text = degrees_text(degrees)
    spec, shape = degrees_spec(degrees, cluster)
    pp = shape[0] if spec.roles[0] == "pp" else 1
    if pp > 1:
        training = pipeline_training(graph, training, pp, schedule, virtual_stages, text)
        text += f" --schedule {schedule}" + (f" --virtual-stages {virtual_stages}" if virtual_stages > 1 else "")
        spec, shape = BaselineSpec(spec.name, spec.roles[1:], spec.description), shape[1:]
    limit = (memory_gb if memory_gb is not None else cluster.device.memory_gb) * 1e9
    levels = recompute_levels(graph, training) if training.recompute == "auto" else [dict(training.recompute_blocks)]
    form = formulate(graph, cluster, shape, optimizer=optimizer, memory_limit_bytes=limit,
                     training=at_level(training, levels[0]))
    base = build_baseline(form, spec)
    if not base.applicable:
        raise PlanningError(f"--degrees {text}: {spec.description} does not apply to "
                            f"{graph.model_name or 'this model'}: {base.reason}")
    plan = assignment_plan(spec.name, form, base.assignment, graph.fingerprint(), model_name, cluster, optimizer,
                           at_level(training, levels[0]))
    plan.notes.append(f"the configuration given by --degrees {text}: {spec.description}, priced as given "
                      "(not searched)")
    if zero:
        if "dp" not in spec.roles:
            raise PlanningError(f"--zero {zero} shards optimizer states over the dp axis; --degrees {text} has "
                                "none (fsdp already shards parameters, gradients and optimizer states)")
        plan = with_zero(graph, plan, zero, name=plan.name)
        text += f" --zero {zero}"
    if pp > 1:
        plan = staged(graph, plan, cluster, pp)
    plan, bd = fit_recompute(graph, plan, cluster, limit, levels) if len(levels) > 1 else \
        (plan, price(graph, plan, cluster, limit))
    return Scheme(text, plan, bd)


def inner_tp_plan(graph: OpGraph, cluster: Cluster, tp: int, training: Training, optimizer: str = "adamw") -> Plan:
    """The plan inside one pipeline stage of one data-parallel rank: Megatron tp over a (tp,) mesh
    (the dp baseline on (1,) when tp is 1), unpriced (search/pipeline_search.py's fast estimate)."""
    shape, spec = (tp,), baseline_specs(1)[2 if tp > 1 else 0]
    form = formulate(graph, cluster.resized(tp), shape, optimizer=optimizer, training=training)
    base = build_baseline(form, spec)
    if not base.applicable:
        raise PlanningError(f"tp={tp}: {spec.description} does not apply to {graph.model_name or 'this model'}: "
                            f"{base.reason}")
    return assignment_plan(spec.name, form, base.assignment, graph.fingerprint(), graph.model_name, cluster,
                           optimizer, training)


def pipeline_training(graph: OpGraph, training: Training, pp: int, schedule: str, virtual_stages: int,
                      text: str) -> Training:
    """``training`` under pipeline ``schedule``, after checking it fits the model and the micro-batches."""
    try:
        tr = dataclasses.replace(training, schedule=schedule, virtual_stages=virtual_stages)
    except ValueError as exc:
        raise PlanningError(f"--degrees {text}: {exc}") from None
    blocks = len(recompute_blocks(graph))
    if blocks < pp * virtual_stages:
        raise PlanningError(f"--degrees {text}: {pp} stages x {virtual_stages} virtual stages need as many repeated "
                            f"blocks; {graph.model_name or 'the model'} has {blocks}: use a smaller pp degree")
    if schedule == "interleaved" and tr.micro_batches % pp:
        raise PlanningError(f"--degrees {text}: interleaved 1F1B needs the micro-batch count ({tr.micro_batches}) to "
                            f"be a multiple of pp={pp}; set --global-batch-size / --micro-batch-size so that it is")
    return tr


def staged(graph: OpGraph, plan: Plan, cluster: Cluster, pp: int) -> Plan:
    """``plan`` (inside one stage) on an outer pp axis of ``pp``, cut into balanced stages."""
    cuts = stage_cuts(graph, plan, cluster, pp * plan.training.virtual_stages)
    out = with_pp_axis(plan, pp)
    out.training = dataclasses.replace(out.training, stage_cuts=cuts)
    out.notes.append(f"pipeline: {pp} stages x {plan.training.virtual_stages} virtual, {plan.training.schedule}, "
                     f"{plan.training.micro_batches} micro-batches; stages start at blocks {', '.join(cuts)} "
                     "(balanced by simulated time and memory)")
    return out
