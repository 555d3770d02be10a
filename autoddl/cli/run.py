"""``autoddl run PLAN_JSON``: run a plan on torchrun ranks, measure it, compare with the prediction.

Before anything is launched the plan is checked against the model file here: its
graph hash (the model changed since planning?), every signature
(``executor.runtime.validate_plan``) and the rank count. Then
``executor.launch`` starts the ranks through torchrun running
``executor.worker``; rank 0 prints each step's time, and this process prints
the predicted breakdown next to the measured median / p10 / p90, the peak
memory of every rank, with ``--check`` the largest relative errors against a
single-process run (exit 1 above 1e-4), and the collectives one step ran next
to the ones the plan predicts (``costmodel.breakdown.predicted_collectives``),
grouped by (phase, kind, axis). A row per run (and one with plan "ddp" for
``--ddp``) is appended to ``--out`` (``executor.measure.append_row``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from autoddl.cli import EXPECTED_ERRORS, _table, common_options, register
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Backend, Cluster
from autoddl.loader import load_model_file
from autoddl.plan import Plan
from autoddl.trace import trace
from executor.launch import LaunchSpec, launch
from executor.measure import StepStats, append_row, git_commit, run_row

CHECK_RTOL = 1e-4
PHASE_ORDER = {"setup": 0, "forward": 1, "backward": 2, "grad_sync": 3, "optimizer": 4}


@register
def add_run(subparsers) -> None:
    p = subparsers.add_parser(
        "run", parents=[common_options()], help="run a plan on torchrun ranks and measure it against the prediction",
        description="Launch PLAN_JSON on torchrun ranks (gloo on CPU, nccl on GPU), time it, optionally check it "
                    "against one process, audit its collectives, and append the measurement to a CSV.")
    p.add_argument("plan_json", metavar="PLAN_JSON", help="plan written by `autoddl plan`")
    p.add_argument("--model", metavar="MODEL_PY", help="model file (default: the one the plan was made for)")
    p.add_argument("--nproc", type=int, metavar="N", help="ranks per node (default: the plan's devices / --nnodes)")
    p.add_argument("--steps", type=int, default=10, metavar="S", help="measured steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="warm-up steps before them (default 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="gloo: CPU ranks; nccl: one GPU per rank (default gloo)")
    p.add_argument("--check", action="store_true",
                   help="first train a step (SGD) next to a single-process run; exit 1 if any relative error "
                        "of the loss, a gradient or an updated parameter is above 1e-4")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), help="optimizer of the timed steps (default: the plan's)")
    p.add_argument("--ddp", action="store_true", help="also time PyTorch DistributedDataParallel (a plan=ddp row)")
    p.add_argument("--ddp-only", action="store_true", help="time only DistributedDataParallel")
    p.add_argument("--out", default="results/runs.csv", metavar="CSV", help="runs table to append to "
                   "(default results/runs.csv; '' for none)")
    p.add_argument("--cluster", metavar="YAML", help="cluster for the prediction (default: the plan's)")
    p.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes (one `autoddl run` per node)")
    p.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank, 0..nnodes-1")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="A", help="address of node 0")
    p.add_argument("--master-port", type=int, metavar="P", help="port on node 0 (needed with --nnodes > 1)")
    p.add_argument("--pg-timeout-s", type=float, default=120.0, metavar="T",
                   help="a collective waiting longer than this fails (default 120)")
    p.add_argument("--timeout-s", type=float, metavar="T", help="kill every rank after T seconds")
    p.add_argument("--verbose", action="store_true", help="print torchrun's log even when the run succeeds")
    p.set_defaults(func=run_run)


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

    mf = load_model_file(model_py, **plan.model_args)
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn, name=mf.name)
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
    """The prediction's cluster, resized to the plan's devices, with the run's backend; or (None, why)."""
    source = path or plan.cluster_file or str(DEFAULT_CLUSTER_PATH)
    try:
        cluster = Cluster.from_yaml(source).resized(plan.devices)
        return dataclasses.replace(cluster, backend=Backend(backend)), ""
    except (OSError, ValueError) as exc:
        return None, f"no prediction: cluster {source}: {exc}"


def predicted_cost(plan: Plan, graph, cluster: Cluster | None, optimizer: str, own_cluster: bool) -> dict[str, Any]:
    """The planner's cost stored in the plan when it applies (same optimizer, the plan's own cluster),
    else the cost model's for this run's optimizer, cluster and backend, else {}."""
    if plan.cost.get("step_time_s") is not None and optimizer == plan.optimizer and own_cluster:
        return dict(plan.cost)
    if cluster is None:
        return {}
    from costmodel.breakdown import plan_cost

    return plan_cost(graph, dataclasses.replace(plan, optimizer=optimizer), cluster).to_dict()


# -- after the run -------------------------------------------------------------------------------

def group_collectives(items) -> dict[tuple[str, str, int], tuple[int, int]]:
    """(phase, kind, axis) -> (count, bytes) for audit records (dicts) or costmodel Collectives."""
    out: dict[tuple[str, str, int], list[int]] = defaultdict(lambda: [0, 0])
    for c in items:
        get = c.get if isinstance(c, dict) else lambda k: getattr(c, k)
        kind = get("kind")
        key = (get("phase"), getattr(kind, "value", kind), int(get("axis")))
        out[key][0] += 1
        out[key][1] += int(get("bytes"))
    return {k: (v[0], v[1]) for k, v in out.items()}


def collectives_table(predicted, measured) -> tuple[str, int]:
    """Side-by-side table of predicted and audited collectives; returns (text, groups that differ)."""
    p, m = group_collectives(predicted), group_collectives(measured)
    rows, differ = [], 0
    for key in sorted(set(p) | set(m), key=lambda k: (PHASE_ORDER.get(k[0], 9), k[1], k[2])):
        pc, pb = p.get(key, (0, 0))
        mc, mb = m.get(key, (0, 0))
        same = (pc, pb) == (mc, mb)
        differ += not same
        rows.append((key[0], key[1], str(key[2]), str(pc), f"{pb / 1e6:.4f}", str(mc), f"{mb / 1e6:.4f}",
                     "ok" if same else "MISMATCH"))
    text = _table(("phase", "kind", "axis", "predicted n", "predicted MB", "measured n", "measured MB", ""),
                  rows) if rows else "(no collectives predicted or run)"
    return text, differ


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def print_summary(plan: Plan, result: dict[str, Any], cost: dict[str, Any], predicted_colls, note: str) -> int:
    """The human summary; returns the number of collective groups that differ from the prediction."""
    world = result.get("world_size")
    print()
    print(f"plan {plan.name!r} on mesh {plan.mesh} ({world} ranks, {result.get('backend')}), model "
          f"{result.get('model')} {plan.model_args or ''}, optimizer {result.get('optimizer')}, "
          f"{result.get('warmup')} warm-up + {result.get('steps')} measured steps, "
          f"{result.get('omp_num_threads')} threads per rank")
    if note:
        print(note)
    differ = 0
    if "step_time_s" in result:
        stats = StepStats.of(result["step_time_s"])
        rows = [("step", _ms(cost.get("step_time_s")), _ms(stats.median_s), _ms(stats.p10_s), _ms(stats.p90_s))]
        for key, label in (("compute_s", "  compute"), ("boxing_forward_s", "  boxing forward"),
                           ("boxing_backward_s", "  boxing backward"), ("grad_sync_s", "  grad sync"),
                           ("optimizer_s", "  optimizer")):
            rows.append((label, _ms(cost.get(key)), "", "", ""))
        print(_table(("ms", "predicted", "measured median", "p10", "p90"), rows))
        mem = cost.get("memory_bytes_per_device")
        print("peak memory per rank (MB above the start of the timed steps): "
              + ", ".join(f"rank {r}: {v:.1f}" for r, v in enumerate(result["peak_memory_mb"]))
              + (f"; predicted {mem / 1e6:.1f} per device" if mem else ""))
    if "ddp" in result:
        ddp = StepStats.of(result["ddp"]["step_time_s"])
        line = f"DistributedDataParallel: median {_ms(ddp.median_s)} ms (p10 {_ms(ddp.p10_s)}, p90 {_ms(ddp.p90_s)})"
        if "step_time_s" in result:
            line += f"; plan {plan.name!r} / ddp = {StepStats.of(result['step_time_s']).median_s / ddp.median_s:.2f}x"
        print(line)
    if "check" in result:
        errors = result["check"]["max_rel_error"]
        worst = {kind: max(((v, k) for k, v in errors.items() if k.split("/")[0] == kind), default=(0.0, "-"))
                 for kind in ("loss", "grad", "param")}
        verdict = "OK" if result["check"]["ok"] else f"FAILED (above {CHECK_RTOL:g})"
        print(f"check against one process ({result['check']['steps']} step, {result['check']['optimizer']}): "
              + "; ".join(f"{kind} {v:.2e}" + (f" ({k})" if kind != "loss" else "") for kind, (v, k) in worst.items())
              + f" -> {verdict}")
    if "collectives" in result and predicted_colls is not None:
        text, differ = collectives_table(predicted_colls, result["collectives"])
        print("collectives of one step, predicted by the plan vs run (audit):")
        print(text)
        if differ:
            print(f"collectives: {differ} (phase, kind, axis) group(s) differ from the plan's prediction")
    return differ


def csv_rows(plan: Plan, result: dict[str, Any], cost: dict[str, Any], cluster_name: str,
             model_name: str) -> list[dict[str, Any]]:
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
    if "ddp" in result:
        rows.append(run_row(plan="ddp", mesh=str(result["world_size"]), predicted=None,
                            stats=StepStats.of(result["ddp"]["step_time_s"]),
                            peak_memory_mb=max(result["ddp"]["peak_memory_mb"]), **common))
    return rows


# -- the command ---------------------------------------------------------------------------------

def run_run(args: argparse.Namespace) -> int:
    from executor.interpreter import PlanExecutionError  # imported here: DTensor costs every command ~1 s

    if PlanExecutionError not in EXPECTED_ERRORS:
        EXPECTED_ERRORS.append(PlanExecutionError)
    plan = Plan.load(args.plan_json)
    if args.ddp_only and args.check:
        raise ValueError("--check checks the plan, which --ddp-only does not run; drop one of them")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps {args.steps} / --warmup {args.warmup}: need steps >= 1 and warmup >= 0")
    model_py = args.model or plan.model
    if not model_py:
        raise ValueError(f"{args.plan_json} names no model file; pass --model MODEL_PY")
    nproc = resolve_nproc(plan, args.nproc, args.nnodes)
    spec = LaunchSpec(nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                      timeout_s=args.timeout_s)
    mf, graph = check_plan_matches(plan, args.plan_json, model_py)
    optimizer = args.optimizer or plan.optimizer
    cluster, note = load_cluster(plan, args.cluster, args.backend)
    cost = predicted_cost(plan, graph, cluster, optimizer, own_cluster=args.cluster is None)
    predicted_colls = None
    if cluster is not None:
        from costmodel.breakdown import predicted_collectives

        predicted_colls = predicted_collectives(graph, plan, cluster)

    with tempfile.TemporaryDirectory(prefix="autoddl-run-") as tmp:
        result_json = Path(tmp) / "result.json"
        worker_args = ["--plan", str(Path(args.plan_json).resolve()), "--model", str(Path(model_py).resolve()),
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--optimizer", optimizer,
                       "--device", "cuda" if args.backend == "nccl" else "cpu", "--out", str(result_json),
                       "--pg-timeout-s", str(args.pg_timeout_s), "--no-check-exit"]
        worker_args += [a for k, v in plan.model_args.items() for a in ("--set", f"{k}={json.dumps(v)}")]
        worker_args += ["--check"] * args.check + ["--ddp"] * args.ddp + ["--ddp-only"] * args.ddp_only
        where = f"node {args.node_rank} of {args.nnodes}, " if args.nnodes > 1 else ""
        print(f"launching {spec.world_size} ranks ({where}{nproc} here) of plan {plan.name!r} on mesh {plan.mesh} "
              f"with torchrun, backend {args.backend}", flush=True)
        res = launch(spec, worker_args)
        if not res.ok:
            print(f"autoddl run: the run failed after {res.duration_s:.1f} s:\n{res.describe()}", file=sys.stderr)
            root = res.failures[0] if res.failures and res.failures[0].traceback else None
            if root is not None and not args.verbose:
                print(f"--- rank {root.rank}'s traceback (torchrun's whole log: --verbose) ---\n"
                      + root.traceback.rstrip(), file=sys.stderr)
            else:
                tail = res.stderr_tail if args.verbose else res.stderr_tail[-25:]
                print("--- torchrun log" + ("" if args.verbose else " (tail)") + " ---\n" + "\n".join(tail),
                      file=sys.stderr)
            return 1
        if args.verbose:
            print("\n".join(res.stderr_tail), file=sys.stderr)
        if args.node_rank != 0:
            print(f"node {args.node_rank}: its ranks finished in {res.duration_s:.1f} s; node 0 prints the results")
            return 0
        result = json.loads(result_json.read_text())
    print_summary(plan, result, cost, predicted_colls, note)
    if args.out:
        name = plan.cluster or (cluster.name.split("@")[0] if cluster else "")
        for row in csv_rows(plan, result, cost, name, mf.name):
            append_row(args.out, row)
        print(f"appended to {args.out}")
    if "check" in result and not result["check"]["ok"]:
        print(f"autoddl run: check failed: relative error above {CHECK_RTOL:g}", file=sys.stderr)
        return 1
    return 0
