"""Running a plan and comparing it with its prediction: the logic behind ``autoddl run``.

Before anything is launched the plan is checked against the model file
(:func:`check_plan_matches`: graph hash, every signature via
``executor.runtime.validate_plan``) and the rank count (:func:`resolve_nproc`).
:func:`launch_run` starts the ranks through torchrun running ``executor.worker``
(``executor.launch``) and returns the worker's result. The prediction comes from
the plan itself or from the cost model (:func:`predicted_cost`,
``costmodel.breakdown.predicted_collectives``); :func:`step_comparison`,
:func:`compare_collectives` and :func:`check_worst` set the measurement next to
it, and :func:`csv_rows` makes the rows appended to the runs CSV
(``executor.measure.append_row``). An API-level module: it imports every layer;
printing is left to ``autoddl.cli.run``.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from autoddl.boxing import Group, group_axes
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Backend, Cluster
from autoddl.loader import load_for_plan
from autoddl.machine import calibrated_elsewhere
from autoddl.plan import Plan
from executor.launch import LaunchResult, LaunchSpec, launch
from executor.measure import StepStats, git_commit, run_row

PHASE_ORDER = {"setup": 0, "forward": 1, "recompute": 2, "backward": 3, "grad_sync": 4, "optimizer": 5}
BREAKDOWN = (("compute_s", "compute"), ("boxing_forward_s", "boxing forward"),
             ("boxing_backward_s", "boxing backward"), ("grad_sync_s", "grad sync"), ("optimizer_s", "optimizer"))


# -- before launching ----------------------------------------------------------------------------

def resolve_nproc(plan: Plan, nproc: int | None, nnodes: int) -> int:
    """Ranks per node; the total must be the plan's device count."""
    if nnodes < 1:
        raise ValueError(f"--nnodes {nnodes}: must be at least 1")
    if nproc is None:
        if plan.devices % nnodes:
            raise ValueError(f"plan {plan.name!r} is for {plan.devices} devices (mesh {plan.mesh}), which "
                             f"--nnodes {nnodes} does not divide; give --nproc with nnodes x nproc = {plan.devices}")
        return plan.devices // nnodes
    if nproc * nnodes != plan.devices:
        raise ValueError(f"--nproc {nproc} x --nnodes {nnodes} = {nproc * nnodes} ranks, but plan {plan.name!r} "
                         f"is for mesh {plan.mesh} = {plan.devices} devices; run with --nproc "
                         f"{plan.devices // nnodes if plan.devices % nnodes == 0 else '?'} or re-plan with "
                         f"`autoddl plan ... --devices {nproc * nnodes}`")
    return nproc


def check_plan_matches(plan: Plan, plan_path: str, model_py: str):
    """Trace the model file as the plan says (meta device); refuse a plan made for another graph."""
    from executor.runtime import validate_plan

    mf = load_for_plan(plan, path=model_py)
    graph = mf.trace(plan.training.param_dtype)
    got = graph.fingerprint()
    if plan.graph_hash != got:
        args = " ".join(f"--set {k}={v}" if k != "preset" else f"--preset {v}" for k, v in plan.model_args.items())
        raise ValueError(f"{plan_path} was made for a different graph: plan graph_hash {plan.graph_hash}, but "
                         f"{model_py} with {plan.model_args or 'no arguments'} traces to {got}. The model, its "
                         f"sizes or its loss changed since planning: re-run `autoddl plan {model_py} {args}`, "
                         f"or pass --model with the file the plan was made for")
    validate_plan(graph, plan)
    return mf, graph


def load_cluster(plan: Plan, path: str | None, backend: str) -> tuple[Cluster | None, str]:
    """The prediction's cluster, resized to the plan's devices, with the run's backend, and a note when
    it was calibrated on another machine than this one (:func:`autoddl.machine.calibrated_elsewhere`);
    or (None, why)."""
    source = path or plan.cluster_file or str(DEFAULT_CLUSTER_PATH)
    try:
        cluster = Cluster.from_yaml(source).resized(plan.devices)
        elsewhere = calibrated_elsewhere(cluster)
        return dataclasses.replace(cluster, backend=Backend(backend)), f"note: {elsewhere}" if elsewhere else ""
    except (OSError, ValueError) as exc:
        return None, f"no prediction: cluster {source}: {exc}"


def predicted_cost(plan: Plan, graph, cluster: Cluster | None, optimizer: str, own_cluster: bool) -> dict[str, Any]:
    """The planner's cost stored in the plan when it applies (same optimizer, the plan's own cluster),
    else the cost model's for this run's optimizer, cluster and backend, else {}."""
    if plan.cost is not None and optimizer == plan.optimizer and own_cluster:
        return plan.cost.to_dict()
    if cluster is None:
        return {}
    from costmodel.breakdown import plan_cost

    return plan_cost(graph, dataclasses.replace(plan, optimizer=optimizer), cluster).to_dict()


def predicted_collectives(plan: Plan, graph, cluster: Cluster | None):
    """The collectives one step of ``plan`` runs, by the cost model; None without a cluster."""
    if cluster is None:
        return None
    from costmodel.breakdown import predicted_collectives as _predicted

    return _predicted(graph, plan, cluster)


# -- launching -----------------------------------------------------------------------------------

def worker_args(plan: Plan, plan_path: str, model_py: str, result_json: str | Path, *, steps: int, warmup: int,
                optimizer: str, backend: str, pg_timeout_s: float, check: bool = False,
                references: Sequence[str] = (), reference_only: bool = False, compile: bool = False,
                profile: str = "", rounds: int = 1, min_time_s: float = 0.0) -> list[str]:
    """The ``executor.worker`` command line of one run (model sizes passed as ``--set KEY=<json>``)."""
    out = ["--plan", str(Path(plan_path).resolve()), "--model", str(Path(model_py).resolve()),
           "--steps", str(steps), "--warmup", str(warmup), "--optimizer", optimizer,
           "--device", "cuda" if backend == "nccl" else "cpu", "--out", str(result_json),
           "--pg-timeout-s", str(pg_timeout_s), "--no-check-exit"]
    out += [a for k, v in plan.model_args.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    out += [a for kind in references for a in ("--reference", kind)]
    out += ["--check"] * check + ["--reference-only"] * reference_only + ["--compile"] * compile
    out += ["--rounds", str(rounds)] * (rounds != 1)
    out += ["--min-time-s", f"{min_time_s:g}"] * (min_time_s > 0)
    return out + (["--profile", profile] if profile else [])


def launch_run(spec: LaunchSpec, plan: Plan, plan_path: str, model_py: str,
               **options: Any) -> tuple[LaunchResult, dict[str, Any] | None]:
    """Run ``plan`` on torchrun ranks; returns torchrun's result and the worker's result JSON
    (None when the run failed or this node is not node 0). ``options``: those of :func:`worker_args`."""
    with tempfile.TemporaryDirectory(prefix="autoddl-run-") as tmp:
        result_json = Path(tmp) / "result.json"
        res = launch(spec, worker_args(plan, plan_path, model_py, result_json, **options))
        if not res.ok or not result_json.exists():
            return res, None
        return res, json.loads(result_json.read_text())


# -- prediction vs measurement -------------------------------------------------------------------

def step_comparison(cost: dict[str, Any], result: dict[str, Any]) -> list[tuple[str, float | None, ...]]:
    """``(what, predicted_s, measured median_s, p10_s, p90_s)``: the step, then its predicted breakdown
    (measured only as a whole step)."""
    stats = StepStats.of(result["step_time_s"])
    rows: list[tuple] = [("step", cost.get("step_time_s"), stats.median_s, stats.p10_s, stats.p90_s)]
    rows += [(label, cost.get(key), None, None, None) for key, label in BREAKDOWN]
    return rows


def check_worst(errors: dict[str, float]) -> dict[str, tuple[float, str]]:
    """The largest relative error of the loss, the gradients and the parameters, with its tensor."""
    return {kind: max(((v, k) for k, v in errors.items() if k.split("/")[0] == kind), default=(0.0, "-"))
            for kind in ("loss", "grad", "param")}


def group_collectives(items) -> dict[tuple[str, str, Group], tuple[int, int]]:
    """(phase, kind, axis) -> (count, bytes) for audit records (dicts) or costmodel Collectives; the
    axis of a collective over several axes' flattened group is their tuple (a list in JSON)."""
    out: dict[tuple[str, str, int], list[int]] = defaultdict(lambda: [0, 0])
    for c in items:
        get = c.get if isinstance(c, dict) else lambda k: getattr(c, k)
        kind = get("kind")
        axis = get("axis")
        axis = tuple(axis) if isinstance(axis, (list, tuple)) else int(axis)
        key = (get("phase"), getattr(kind, "value", kind), axis)
        out[key][0] += 1
        out[key][1] += int(get("bytes"))
    return {k: (v[0], v[1]) for k, v in out.items()}


def compare_collectives(predicted, measured) -> list[tuple[tuple[str, str, Group], tuple[int, int], tuple[int, int]]]:
    """``(key, predicted (count, bytes), measured (count, bytes))`` per (phase, kind, axis), in step order."""
    p, m = group_collectives(predicted), group_collectives(measured)
    keys = sorted(set(p) | set(m), key=lambda k: (PHASE_ORDER.get(k[0], 9), k[1], group_axes(k[2])))
    return [(key, p.get(key, (0, 0)), m.get(key, (0, 0))) for key in keys]


def csv_rows(plan: Plan, result: dict[str, Any], cost: dict[str, Any], cluster_name: str,
             model_name: str) -> list[dict[str, Any]]:
    """The runs-CSV rows of one run: the plan's (with its prediction), then one per ``--reference``
    (``plan`` column ``ddp``, ``fsdp2`` or ``dtensor_tp``)."""
    preset = " ".join(str(v) if k == "preset" else f"{k}={v}" for k, v in plan.model_args.items())
    common = dict(model=model_name, preset=preset, cluster=cluster_name, nproc=result["world_size"],
                  backend=result["backend"], commit=git_commit())
    rows = []
    if "step_time_s" in result:
        errors = result.get("check", {}).get("max_rel_error")
        rows.append(run_row(plan=plan.name, mesh=str(plan.mesh), predicted=cost,
                            stats=StepStats.of(result["step_time_s"]),
                            peak_memory_mb=max(result["peak_memory_mb"]),
                            check_max_rel_err=max(errors.values()) if errors else None, **common))
    for kind, timing in result.get("references", {}).items():
        rows.append(run_row(plan=kind, mesh=str(result["world_size"]), predicted=None,
                            stats=StepStats.of(timing["step_time_s"]),
                            peak_memory_mb=max(timing["peak_memory_mb"]), **common))
    return rows


def cluster_name(plan: Plan, cluster: Cluster | None) -> str:
    """The cluster column of the runs CSV."""
    return plan.cluster or (cluster.name.split("@")[0] if cluster else "")

