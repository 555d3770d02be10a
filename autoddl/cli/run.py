"""``autoddl run PLAN_JSON``: run a plan on torchrun ranks, measure it, compare with the prediction.

The work is ``autoddl.runs``'s: the plan is checked against the model file (graph
hash, every signature) and the rank count before anything is launched, then the
ranks run through torchrun. This module prints: the predicted breakdown next to
the measured median / p10 / p90, the peak memory of every rank, with ``--check``
the largest relative errors against a single-process run (exit 1 above 1e-4),
and the collectives one step ran next to the ones the plan predicts, grouped by
(phase, kind, axis). A row per run (and one per ``--reference``, plan ``ddp``/``fsdp2``/``dtensor_tp``) is
appended to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from autoddl import runs
from autoddl.boxing import group_name
from autoddl.cli import EXPECTED_ERRORS, common_options, register, table
from autoddl.offload_program import ACTIVATIONS
from autoddl.plan import Plan
from autoddl.program import lower
from executor.launch import LaunchSpec
from executor.references import REFERENCE_NAMES, REFERENCES
from executor.measure import StepStats, append_row


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
    p.add_argument("--min-time-s", type=float, default=0.0, metavar="T",
                   help="time more steps where --steps would take less than T seconds at the warm-up's pace "
                        "(the plan and each reference its own count; default 0: exactly --steps)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="gloo: CPU ranks; nccl: one GPU per rank (default: nccl where CUDA is available, else gloo)")
    p.add_argument("--check", action="store_true",
                   help="first train a step (SGD) next to a single-process run; exit 1 if any relative error "
                        "of the loss, a gradient or an updated parameter is above 1e-4")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), help="optimizer of the timed steps (default: the plan's)")
    p.add_argument("--reference", action="append", default=[], choices=REFERENCES, metavar="KIND",
                   help="also time PyTorch's own implementation, a row with plan=KIND (repeatable): "
                        "ddp (DistributedDataParallel), fsdp2 (fully_shard per block), dtensor_tp "
                        "(parallelize_module, Colwise/Rowwise pairs)")
    p.add_argument("--reference-only", action="store_true", help="time only the references")
    p.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="with --reference: place and warm up the plan and its references, then run the measured "
                        "steps in R rounds, a share of each in turn, so that the machine's drift falls on both "
                        "sides of the ratio (default 1: the plan, then each reference)")
    p.add_argument("--ddp", action="store_true", help="shorthand for --reference ddp")
    p.add_argument("--ddp-only", action="store_true", help="shorthand for --reference ddp --reference-only")
    p.add_argument("--compile", action="store_true", help="also run the local program through torch.compile")
    p.add_argument("--profile", metavar="DIR", default="",
                   help="write a torch.profiler Chrome trace of one measured step per rank to DIR/rank<R>.json "
                        "(open beside `autoddl explain PLAN --trace predicted.json`)")
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


def collectives_table(predicted, measured) -> tuple[str, int]:
    """Side-by-side table of predicted and audited collectives; returns (text, groups that differ)."""
    rows, differ = [], 0
    for (phase, kind, axis), (pc, pb), (mc, mb) in runs.compare_collectives(predicted, measured):
        same = (pc, pb) == (mc, mb)
        differ += not same
        rows.append((phase, kind, group_name(axis), str(pc), f"{pb / 1e6:.4f}", str(mc), f"{mb / 1e6:.4f}",
                     "ok" if same else "MISMATCH"))
    text = table(("phase", "kind", "axis", "predicted n", "predicted MB", "measured n", "measured MB", ""),
                 rows) if rows else "(no collectives predicted or run)"
    return text, differ


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def print_summary(plan: Plan, result: dict[str, Any], cost: dict[str, Any], predicted_colls, note: str,
                  copies: list | None = None) -> int:
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
        rows = [("step", *map(_ms, times)) if what == "step" else ("  " + what, _ms(times[0]), "", "", "")
                for what, *times in runs.step_comparison(cost, result)]
        print(table(("ms", "predicted", "measured median", "p10", "p90"), rows))
        mem = cost.get("memory_bytes_per_device")
        print("peak memory per rank (MB above the start of the timed steps): "
              + ", ".join(f"rank {r}: {v:.1f}" for r, v in enumerate(result["peak_memory_mb"]))
              + (f"; predicted {mem / 1e6:.1f} per device" if mem else ""))
    for kind, timing in result.get("references", {}).items():
        ref = StepStats.of(timing["step_time_s"])
        line = f"{REFERENCE_NAMES[kind]}: median {_ms(ref.median_s)} ms (p10 {_ms(ref.p10_s)}, p90 {_ms(ref.p90_s)})"
        if "step_time_s" in result:
            line += f"; plan {plan.name!r} / {kind} = {StepStats.of(result['step_time_s']).median_s / ref.median_s:.2f}x"
        print(line)
    if "check" in result:
        worst = runs.check_worst(result["check"]["max_rel_error"])
        verdict = "OK" if result["check"]["ok"] else f"FAILED (above {result['check']['rtol']:g})"
        print(f"check against one process ({result['check']['steps']} step, {result['check']['optimizer']}): "
              + "; ".join(f"{kind} {v:.2e}" + (f" ({k})" if kind != "loss" else "") for kind, (v, k) in worst.items())
              + f" -> {verdict}")
    if "collectives" in result and predicted_colls is not None:
        text, differ = collectives_table(predicted_colls, result["collectives"])
        print("collectives of one step, predicted by the plan vs run (audit):")
        print(text)
        if differ:
            print(f"collectives: {differ} (phase, kind, axis) group(s) differ from the plan's prediction")
    if copies:
        differ += _copies_audit(copies, result.get("host_copies", []))
    return differ


def _copies_audit(copies: list, ran: list) -> int:
    """Offload: the host copies one step ran against the program's; returns 1 when they differ. Saved
    activations' copies are compared by direction and label (their bytes are autograd's, which the
    program's rule need not equal: executor/offload.py), their bytes reported beside."""
    def key(copy: str, nbytes: int, tensor: str) -> tuple:
        return (copy, -1 if tensor.endswith(ACTIVATIONS) else nbytes, tensor)

    def act_mb(rows) -> float:
        return sum(r[1] for r in rows if r[2].endswith(ACTIVATIONS)) / 1e6
    planned_rows = [(t.copy, t.nbytes, t.tensor) for t in copies]
    planned, got = sorted(key(*r) for r in planned_rows), sorted(key(*r) for r in ran)
    print(f"host copies of one step: {len(got)} ran ({sum(r[1] for r in ran) / 1e6:.3f} MB), the program's "
          f"{len(planned)} ({sum(r[1] for r in planned_rows) / 1e6:.3f} MB)"
          + (f"; saved activations {act_mb(ran):.3f} MB ran, {act_mb(planned_rows):.3f} MB by the program's rule"
             if any(r[2].endswith(ACTIVATIONS) for r in planned_rows) else "")
          + (": the same" if got == planned else ": they DIFFER"))
    return int(got != planned)


def run_run(args: argparse.Namespace) -> int:
    from executor.runtime import PlanExecutionError  # imported here: torch.distributed costs every command ~1 s

    if PlanExecutionError not in EXPECTED_ERRORS:
        EXPECTED_ERRORS.append(PlanExecutionError)
    plan = Plan.load(args.plan_json)
    references = list(dict.fromkeys(args.reference + ["ddp"] * (args.ddp or args.ddp_only)))
    reference_only = args.reference_only or args.ddp_only
    if reference_only and args.check:
        raise ValueError("--check checks the plan, which --reference-only / --ddp-only does not run; drop one")
    if reference_only and not references:
        raise ValueError("--reference-only needs at least one --reference KIND (ddp, fsdp2, dtensor_tp)")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps {args.steps} / --warmup {args.warmup}: need steps >= 1 and warmup >= 0")
    if args.min_time_s < 0 or (args.min_time_s and args.warmup < 1):
        raise ValueError(f"--min-time-s {args.min_time_s:g}: needs T >= 0 and --warmup >= 1, the steps that give "
                         f"the pace (got --warmup {args.warmup})")
    if args.rounds != 1 and not (references and 1 <= args.rounds <= args.steps and args.warmup >= 1):
        raise ValueError(f"--rounds {args.rounds}: needs a --reference, 1 <= rounds <= --steps ({args.steps}) "
                         f"and --warmup >= 1 (got {args.warmup})")
    model_py = args.model or plan.model
    if not model_py:
        raise ValueError(f"{args.plan_json} names no model file; pass --model MODEL_PY")
    nproc = runs.resolve_nproc(plan, args.nproc, args.nnodes)
    spec = LaunchSpec(nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                      timeout_s=args.timeout_s)
    mf, graph = runs.check_plan_matches(plan, args.plan_json, model_py)
    optimizer = args.optimizer or plan.optimizer
    if args.backend is None:
        import torch

        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    cluster, note = runs.load_cluster(plan, args.cluster, args.backend)
    cost = runs.predicted_cost(plan, graph, cluster, optimizer, own_cluster=args.cluster is None)
    predicted_colls = runs.predicted_collectives(plan, graph, cluster)

    where = f"node {args.node_rank} of {args.nnodes}, " if args.nnodes > 1 else ""
    print(f"launching {spec.world_size} ranks ({where}{nproc} here) of plan {plan.name!r} on mesh {plan.mesh} "
          f"with torchrun, backend {args.backend}", flush=True)
    res, result = runs.launch_run(spec, plan, args.plan_json, model_py, steps=args.steps, warmup=args.warmup,
                                  optimizer=optimizer, backend=args.backend, pg_timeout_s=args.pg_timeout_s,
                                  check=args.check, references=references, reference_only=reference_only,
                                  rounds=args.rounds, min_time_s=args.min_time_s,
                                  compile=args.compile, profile=str(Path(args.profile).resolve()) if args.profile else "")
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
    if result is None:
        raise ValueError(f"the run of {args.plan_json} ended without a result from rank 0")
    print_summary(plan, result, cost, predicted_colls, note, lower(graph, plan).copies())
    if args.out:
        for row in runs.csv_rows(plan, result, cost, runs.cluster_name(plan, cluster), mf.name):
            append_row(args.out, row)
        print(f"appended to {args.out}")
    if "check" in result and not result["check"]["ok"]:
        print(f"autoddl run: check failed: relative error above {result['check']['rtol']:g}", file=sys.stderr)
        return 1
    return 0
