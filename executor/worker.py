"""One torchrun rank: load a model file and a plan, check, time and audit the planned training step.

    torchrun --nproc-per-node 2 -m executor.worker --plan plan.json --model examples/x.py \\
        --set preset=tiny --steps 10 --warmup 2 --check --ddp --out result.json

Every rank builds the model on CPU from the same seed (so parameters and the batch agree
everywhere), traces it, builds the mesh and places parameters by the plan. In order:

1. ``--check``: ``--check-steps`` steps next to a single-process reference, max relative errors
   of the loss, every gradient and every updated parameter (under ``--check-optimizer``, SGD by
   default: Adam divides by the gradient's running RMS, so a gradient that is zero in exact
   arithmetic, e.g. GPT's key bias, turns round-off into full-size updates that differ).
2. Timing: ``--warmup`` then ``--steps`` steps of the plan (``executor.measure.time_steps``,
   back to back after a barrier; rank 0 prints ``step i/S`` with the step time; a step's time is the
   job's: ``job_step_times``), peak memory per rank.
3. One more step under the collective audit.
4. ``--reference KIND`` (``--ddp``; ``--reference-only`` skips 1-3): the same steps with PyTorch's
   own implementation of the scheme (executor/references.py), e.g. DistributedDataParallel, every
   rank on its shard (dim 0) of the batch. With ``--rounds R`` the plan and its references are all
   placed and warmed up first and their measured steps run in R rounds, a share of each in turn, so
   that the machine's drift falls on both sides of the ratio alike.

Rank 0 writes the result JSON to ``--out`` (stdout without it).

Several plans in one launch (``--plans A.json B.json ... --out-dir DIR``, instead of ``--plan``):
the model is built and traced once, then each plan is timed in turn (steps 2-3 above, on its
own mesh; every plan must be for the launched world size) and rank 0 writes ``DIR/<stem>.json``
per plan as soon as it is done (with ``--rounds R``: every plan is placed and warmed up first, then
the measured steps run in R rounds, a share of each plan in turn). A plan that raises on every rank alike (it does not fit the
graph, a shape error) gets ``{"plan": ..., "error": ...}`` and the next plan runs; a launch
costs 10-15 s of process start, import and tracing on a small machine, which this shares. A rank that fails writes
``<--error-dir>/rank<R>.json`` (rank, error, traceback) before exiting non-zero, which is how
``autoddl run`` names the rank that failed. Test hook: ``AUTODDL_TEST_FAIL_RANK=R`` makes rank R
fail at its first timed step (``AUTODDL_TEST_FAIL_MODE``: ``raise``, default, ``kill``, a SIGKILL, or
``abort``, a SIGABRT).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import signal
import socket
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autoddl.atomic import write_text_atomic
from autoddl.loader import ModelFile, load_model_file
from autoddl.plan import Plan
from autoddl.precision import check_rtol
from autoddl.trace import trace
from executor.allocator import keep_freed_memory
from executor.audit import summarize
from executor.launch import record_fatal_signals
from executor.measure import PeakMemory, Share, job_step_times, steps_for_min_time, time_steps
from executor.references import REFERENCES, build_reference, reference_step
from executor.runtime import (audit_records, audit_step, build_optimizer, close_process_group, distributed_model,
                              init_mesh, run_check, torch_optimizer, train_step)

FAIL_RANK_ENV = "AUTODDL_TEST_FAIL_RANK"
FAIL_MODE_ENV = "AUTODDL_TEST_FAIL_MODE"


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    from autoddl.loader import parse_overrides

    try:
        return parse_overrides(pairs)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor.worker", description=__doc__.split("\n")[0])
    p.add_argument("--plan", help="plan JSON written by `autoddl plan`")
    p.add_argument("--plans", nargs="+", default=[], metavar="PLAN_JSON",
                   help="several plans run one after another in this launch (with --out-dir)")
    p.add_argument("--out-dir", default="", help="with --plans: rank 0 writes <out-dir>/<plan stem>.json")
    p.add_argument("--model", required=True, help="model file defining build_model / example_inputs")
    p.add_argument("--steps", type=int, default=1, help="timed training steps (default 1)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps before them (default 0)")
    p.add_argument("--min-time-s", type=float, default=0.0, metavar="T",
                   help="time more than --steps steps where they would take less than T seconds at the "
                        "warm-up's pace (each plan and reference its own count; needs --warmup; default 0)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --plans or --reference: place and warm up every plan (and reference), then time "
                        "the steps in this many rounds, each one's share in turn (default 1: one after the other)")
    p.add_argument("--check", action="store_true", help="compare with a single-process run first")
    p.add_argument("--check-steps", type=int, default=1, help="steps of the check (default 1)")
    p.add_argument("--check-optimizer", default="sgd", help="optimizer of the check (default sgd)")
    p.add_argument("--no-check-exit", action="store_true",
                   help="exit 0 when the check fails (the result JSON says so); default: exit 1")
    p.add_argument("--reference", action="append", default=[], choices=REFERENCES,
                   help="also time PyTorch's own implementation (repeatable): ddp, fsdp2, dtensor_tp")
    p.add_argument("--reference-only", action="store_true", help="time only the references")
    p.add_argument("--ddp", action="store_true", help="shorthand for --reference ddp")
    p.add_argument("--ddp-only", action="store_true", help="shorthand for --reference ddp --reference-only")
    p.add_argument("--compile", action="store_true", help="run the local program through torch.compile")
    p.add_argument("--profile", default="", metavar="DIR",
                   help="write a torch.profiler Chrome trace of one measured step per rank: DIR/rank<R>.json")
    p.add_argument("--out", default="", help="JSON result path (written by rank 0)")
    p.add_argument("--error-dir", default="", help="where a failing rank writes rank<R>.json")
    p.add_argument("--optimizer", default="", help="sgd | adamw for the timed steps (default: the plan's)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--pg-timeout-s", type=float, default=120.0,
                   help="process-group timeout: a collective waiting longer fails (default 120 s)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model size override passed to build_model / example_inputs")
    args = p.parse_args(argv)
    args.reference = list(dict.fromkeys(args.reference + ["ddp"] * (args.ddp or args.ddp_only)))
    args.reference_only = args.reference_only or args.ddp_only
    if args.reference_only and not args.reference:
        p.error("--reference-only needs at least one --reference KIND")
    if bool(args.plan) == bool(args.plans):
        p.error("give exactly one of --plan PLAN_JSON or --plans PLAN_JSON ... (with --out-dir)")
    if args.plans and (not args.out_dir or args.check or args.reference):
        p.error("--plans needs --out-dir and times plans only (no --check, --reference, --ddp)")
    if args.rounds < 1 or (args.rounds > 1 and not (args.plans or args.reference)) or args.rounds > args.steps:
        p.error(f"--rounds {args.rounds}: needs --plans or --reference and 1 <= rounds <= --steps ({args.steps})")
    if args.min_time_s < 0 or (args.min_time_s and args.warmup < 1):
        p.error(f"--min-time-s {args.min_time_s:g}: needs T >= 0 and --warmup >= 1 (the warm-up gives the pace)")
    if args.rounds > 1 and args.warmup < 1:
        p.error("--rounds > 1 needs --warmup >= 1 (each one's peak memory is taken over its warm-up)")
    return args


def _test_fail_hook(rank: int) -> None:
    """Test-only: make rank ``$AUTODDL_TEST_FAIL_RANK`` fail here (raise, die by SIGKILL, or abort: SIGABRT,
    as glibc aborts a process whose heap it finds corrupted)."""
    want = os.environ.get(FAIL_RANK_ENV, "")
    if want == "" or int(want) != rank:
        return
    mode = os.environ.get(FAIL_MODE_ENV, "raise")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "abort":
        os.abort()
    raise RuntimeError(f"{FAIL_RANK_ENV}={want}: test failure injected on rank {rank}")


def _sync_fn(device: str) -> Callable[[], None] | None:
    return torch.cuda.synchronize if device == "cuda" and torch.cuda.is_available() else None


def _progress(rank: int, label: str, quiet: bool):
    if rank != 0 or quiet:
        return None

    def show(kind: str, i: int, n: int, seconds: float) -> None:
        print(f"[{label}] {kind} {i}/{n}  {seconds * 1e3:.2f} ms", flush=True)

    return show


def _gather_timing(shares: list[Share], peak_mb: float, losses: list[float] | None = None) -> dict[str, Any]:
    """The job's time of each step (``job_step_times`` of every rank's ``shares``: the ranks' mean per
    step, at the pace the job went from its first start to its last end); peak memory and host of
    every rank (rank order); with ``losses``, those of the first rank that knows them (a pipeline's
    last stage; NaN elsewhere)."""
    mine = {"shares": shares, "peak_mb": peak_mb, "host": socket.gethostname(), "losses": losses or []}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    hosts = [r["host"] for r in every]
    out = {"step_time_s": job_step_times([r["shares"] for r in every], one_clock=len(set(hosts)) == 1),
           "peak_memory_mb": [r["peak_mb"] for r in every], "hosts": hosts}
    out["steps"] = len(out["step_time_s"])              # more than --steps under --min-time-s
    if losses is not None:
        out["losses"] = next((r["losses"] for r in every if not any(math.isnan(v) for v in r["losses"])), losses)
    return out


class _Timing:
    """Timed steps of one model on this rank (``step``), labelled ``name``; ``peak_mb`` None until taken."""

    name: str
    args: argparse.Namespace
    rank: int
    memory: PeakMemory
    shares: list[Share]                      # this rank's measured steps, one share per ``time`` call
    peak_mb: float | None
    warm_step_s: float = 0.0                 # the median of this rank's warm-up steps (0: none run)

    def step(self) -> None:
        raise NotImplementedError

    def _timed(self, steps: int, warmup: int, label: str) -> Share:
        return time_steps(self.step, steps, warmup, barrier=dist.barrier, sync=_sync_fn(self.args.device),
                          progress=_progress(self.rank, label, self.args.quiet))

    def warm_up(self, label: str) -> None:
        """``--warmup`` steps, their times thrown away but for their median, the pace ``measured_steps``
        plans by."""
        if self.args.warmup:
            share = self._timed(self.args.warmup, 0, label)
            self.warm_step_s = statistics.median(share.times_s)

    def measured_steps(self) -> int:
        """``--steps``, or more under ``--min-time-s`` (``steps_for_min_time``) at the slowest rank's
        warm-up pace: a collective of its own, so every rank runs the same number of steps."""
        if not self.args.min_time_s:
            return self.args.steps
        cuda = self.args.device == "cuda" and torch.cuda.is_available()      # nccl reduces device tensors only
        pace = torch.tensor([self.warm_step_s], dtype=torch.float64, device="cuda" if cuda else "cpu")
        dist.all_reduce(pace, op=dist.ReduceOp.MAX)
        return steps_for_min_time(self.args.steps, self.args.min_time_s, float(pace))

    def time(self, steps: int, warmup: int = 0) -> None:
        """``steps`` measured steps (after ``warmup`` more), one more share of ``shares``."""
        self.shares.append(self._timed(steps, warmup, self.name))
        if self.peak_mb is None:
            self.peak_mb = self.memory.peak_mb()


class PlanTiming(_Timing):
    """One plan's timed steps on this rank, in one go (``run``) or in rounds interleaved with other
    plans' (``run_many`` with ``--rounds``): the constructor places the model and runs the warm-up,
    ``time`` runs measured steps (called again for each round), ``finish`` gathers the times over ranks,
    profiles and audits one more step. Peak memory is this plan's from its placement to the end of its
    first measured steps, or, with ``memory_until_warm`` (plans interleaved: the others are placed in
    between), to the end of its warm-up."""

    def __init__(self, mf: ModelFile, graph, plan: Plan, mesh, args: argparse.Namespace, optimizer: str,
                 rank: int, memory_until_warm: bool = False) -> None:
        self.mf, self.plan, self.args, self.rank, self.name = mf, plan, args, rank, plan.name
        self.memory = PeakMemory(args.device)
        self.memory.start()
        self.dmodel = distributed_model(mf.model, graph, plan, mesh)
        if args.compile:
            self.dmodel.compile_local()
        self.opt = build_optimizer(optimizer, self.dmodel.parameters(), args.lr)
        self.losses: list[float] = []
        self.shares: list[Share] = []
        _test_fail_hook(rank)
        self.warm_up(f"{plan.name} warm-up")
        self.peak_mb = self.memory.peak_mb() if memory_until_warm else None

    def step(self) -> None:
        self.losses.append(train_step(self.dmodel, self.mf.example_inputs, self.opt))

    def finish(self) -> dict[str, Any]:
        out = _gather_timing(self.shares, self.peak_mb, self.losses)
        dmodel, inputs = self.dmodel, self.mf.example_inputs
        if self.args.profile:
            out["profile"] = _profile_step(lambda: train_step(dmodel, inputs, self.opt), self.args.profile, self.rank)
        dmodel.host_copies.records.clear()
        records = audit_records(dmodel, audit_step(dmodel, inputs, self.opt))
        out["collectives"] = [r.to_dict() for r in records]
        out["collectives_summary"] = summarize(records)
        out["host_copies"] = [[r.copy, r.nbytes, r.tensor] for r in dmodel.host_copies.records]   # offload params
        return out


def _profile_step(step: Callable[[], Any], out_dir: str, rank: int) -> str:
    """One more step under torch.profiler; its Chrome trace goes to ``out_dir/rank<R>.json``."""
    from torch.profiler import ProfilerActivity, profile

    path = Path(out_dir) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
    prof.export_chrome_trace(str(path))
    return str(path)


class ReferenceTiming(_Timing):
    """PyTorch's own implementation ``kind`` (executor/references.py) of the same steps, with the torch
    optimizer a user would pass it; timed as ``PlanTiming`` is (placed and warmed up by the constructor,
    ``time`` once or once per round, ``finish``)."""

    def __init__(self, kind: str, mf: ModelFile, args: argparse.Namespace, optimizer: str, rank: int,
                 training=None, memory_until_warm: bool = False) -> None:
        cuda = args.device == "cuda" and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.name, self.args, self.rank = kind, args, rank
        self.memory = PeakMemory(args.device)
        self.memory.start()
        self.module, self.values = build_reference(kind, mf.model, tuple(mf.example_inputs), device, training)
        self.opt = torch_optimizer(optimizer, self.module.parameters(), args.lr)
        self.loss_fn, self.training = mf.step_loss, training
        self.losses: list[float] = []                  # rank 0's loss (its batch shard for ddp / fsdp2)
        self.shares: list[Share] = []
        self.warm_up(f"{kind} warm-up")
        self.peak_mb = self.memory.peak_mb() if memory_until_warm else None

    def step(self) -> None:
        self.losses.append(reference_step(self.name, self.module, self.loss_fn, self.values, self.opt, self.training))

    def finish(self) -> dict[str, Any]:
        out = _gather_timing(self.shares, self.peak_mb)
        out["losses"] = self.losses
        return out


def traced_for(mf: ModelFile, plan: Plan) -> tuple[ModelFile, Any]:
    """``mf`` at the plan's micro-step batch, and its graph traced under the plan's precision."""
    if plan.batch_size:
        mf = mf.with_batch_size(plan.batch_size)
    return mf, trace(mf.model, mf.example_inputs, mf.loss_fn, name=mf.name, param_dtype=plan.training.param_dtype)


def optimizer_step_batch(mf: ModelFile, plan: Plan) -> ModelFile:
    """``mf`` (at the traced micro-step batch) with one optimizer step's batch: every micro-step's."""
    return mf.with_batch_size(mf.batch_size * plan.training.micro_batches)


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan.load(args.plan)
    torch.manual_seed(args.seed)
    mf, graph = traced_for(load_model_file(args.model, device="cpu", **_overrides(args.set)), plan)
    mf = optimizer_step_batch(mf, plan)
    mesh = init_mesh(plan, args.device, timeout_s=args.pg_timeout_s)
    rank = dist.get_rank()
    optimizer = args.optimizer or plan.optimizer
    result: dict[str, Any] = {
        "plan": plan.name, "model": mf.name, "mesh": list(plan.mesh.shape), "world_size": dist.get_world_size(),
        "optimizer": optimizer, "steps": args.steps, "warmup": args.warmup, "backend": dist.get_backend(),
        "omp_num_threads": torch.get_num_threads(),
    }
    if args.check and not args.reference_only:
        errors = run_check(mf.model, mf.example_inputs, mf.loss_fn, graph, plan, mesh,
                           optimizer=args.check_optimizer, lr=args.lr, steps=args.check_steps)
        rtol = check_rtol(plan.training.param_dtype)
        result["check"] = {"rtol": rtol, "ok": all(v <= rtol for v in errors.values()),
                           "optimizer": args.check_optimizer, "steps": args.check_steps, "max_rel_error": errors}
        gc.collect()
    rounds = args.rounds > 1
    makers = [] if args.reference_only else [
        ("plan", lambda: PlanTiming(mf, graph, plan, mesh, args, optimizer, rank, memory_until_warm=rounds))]
    makers += [(kind, lambda kind=kind: ReferenceTiming(kind, mf, args, optimizer, rank, plan.training,
                                                        memory_until_warm=rounds)) for kind in args.reference]
    result["references"] = {}
    for name, out in _timed_in_turn(makers, args) if not rounds else _timed_in_rounds(makers, args):
        if name == "plan":
            result.update(out)
        else:
            result["references"][name] = out
    return result


def _timed_in_turn(makers: list, args: argparse.Namespace):
    """(name, finished timing) of each, placed, timed and freed one after the other."""
    for name, make in makers:
        timing = make()
        timing.time(timing.measured_steps())
        yield name, timing.finish()
        del timing
        gc.collect()


def _timed_in_rounds(makers: list, args: argparse.Namespace):
    """(name, finished timing) of each, all placed and warmed up first, then the measured steps in
    ``--rounds`` rounds, each one's share in turn after one more warm-up step (as ``run_many``)."""
    placed = [(name, make()) for name, make in makers]
    for i, steps in _round_schedule([timing.measured_steps() for _, timing in placed], args.rounds):
        gc.collect()                          # the others' garbage is not collected in this one's steps
        placed[i][1].time(steps, warmup=1)
    return [(name, timing.finish()) for name, timing in placed]


def run_many(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--plans``: build and trace the model once, then time each plan; rank 0 writes one JSON per plan.

    With ``--rounds R`` (> 1) every plan is placed and warmed up first, then the measured steps run in R
    rounds, each plan's share in turn after one more warm-up step, so that the machine's drift over the
    launch falls on every plan alike (on the 2-core VMs the first plan of a launch ran 10-20% slower than
    the same program run last: results/README.md)."""
    plans = [(Path(path), Plan.load(path)) for path in args.plans]
    torch.manual_seed(args.seed)
    mf = load_model_file(args.model, device="cpu", **_overrides(args.set))
    graphs: dict[tuple, tuple[ModelFile, Any]] = {}   # by the plans' precision and batch: traced once each
    rank = -1
    placed: list[tuple[Path, dict[str, Any], PlanTiming | None]] = []
    for path, plan in plans:
        key = (plan.training.param_dtype, plan.batch_size)
        if key not in graphs:
            graphs[key] = traced_for(mf, plan)
        graph = graphs[key][1]
        mf = optimizer_step_batch(graphs[key][0], plan)
        mesh = init_mesh(plan, args.device, timeout_s=args.pg_timeout_s)
        rank = dist.get_rank()
        optimizer = args.optimizer or plan.optimizer
        result: dict[str, Any] = {
            "plan": plan.name, "plan_file": str(path), "model": mf.name, "mesh": list(plan.mesh.shape),
            "world_size": dist.get_world_size(), "optimizer": optimizer, "steps": args.steps,
            "warmup": args.warmup, "rounds": args.rounds, "backend": dist.get_backend(),
            "omp_num_threads": torch.get_num_threads(),
        }
        timing = _attempt(result, rank, lambda: PlanTiming(mf, graph, plan, mesh, args, optimizer, rank,
                                                           memory_until_warm=args.rounds > 1))
        if args.rounds == 1:                        # one plan after the other: time it, then free it
            if timing is not None:
                _attempt(result, rank, lambda: timing.time(timing.measured_steps()))
            _finish(path, result, timing, args, rank)
            gc.collect()
        placed.append((path, result, timing))
    if args.rounds > 1:
        timed = [(result, timing) for _, result, timing in placed if timing is not None and "error" not in result]
        for i, steps in _round_schedule([timing.measured_steps() for _, timing in timed], args.rounds):
            result, timing = timed[i]
            if "error" not in result:               # a plan that failed in an earlier round is not run again
                _attempt(result, rank, lambda: timing.time(steps, warmup=1))
        for path, result, timing in placed:
            _finish(path, result, timing, args, rank)
    return [result for _, result, _ in placed]


def _round_schedule(counts: list[int], rounds: int) -> list[tuple[int, int]]:
    """(index, steps) in running order: round by round, each of ``counts``' timings its share of its own
    measured steps (:func:`_round_steps`) in turn."""
    shares = [_round_steps(count, rounds) for count in counts]
    return [(i, share[r]) for r in range(rounds) for i, share in enumerate(shares)]


def _round_steps(steps: int, rounds: int) -> list[int]:
    """``steps`` measured steps split over ``rounds`` as evenly as they go (12 over 3: 4, 4, 4)."""
    return [steps // rounds + (r < steps % rounds) for r in range(rounds)]      # rounds <= steps: none empty


def _attempt(result: dict[str, Any], rank: int, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None with ``result["error"]`` set: a plan that raises on every rank alike (it does not
    fit the graph, a shape error) is recorded and the launch goes on with the next plan."""
    try:
        return fn()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{result['plan']}] failed on rank {rank}: {result['error']}", file=sys.stderr, flush=True)
        return None


def _finish(path: Path, result: dict[str, Any], timing: PlanTiming | None, args: argparse.Namespace,
            rank: int) -> None:
    """Gather, profile and audit a timed plan (``PlanTiming.finish``); rank 0 writes its JSON."""
    if timing is not None and "error" not in result:
        _attempt(result, rank, lambda: result.update(timing.finish()))
    if rank == 0:
        _write_json(Path(args.out_dir) / f"{path.stem}.json", result)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))


def _report_failure(args: argparse.Namespace, exc: BaseException) -> None:
    rank = int(os.environ.get("RANK", "-1"))
    text = f"{type(exc).__name__}: {exc}"
    print(f"autoddl worker: rank {rank} failed: {text}", file=sys.stderr, flush=True)
    if args.error_dir:
        _write_json(Path(args.error_dir) / f"rank{rank}.json", {
            "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "error": text,
            "traceback": traceback.format_exc(), "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        })


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record_fatal_signals(args.error_dir)    # a rank killed by a signal still says where it was
    keep_freed_memory()                     # each step's freed tensors serve the next (executor/allocator.py)
    try:
        if args.plans:
            run_many(args)
            gc.collect()                    # see below
            close_process_group()
            return 0
        result = run(args)
        gc.collect()
        # ^ models in reference cycles (the executor's hooks make them) and what they hold (meshes, their
        # groups) freed while the process group is open, not at interpreter teardown, where live gloo
        # threads abort a rank (runtime._shut_down). One launch in 12 of executor_bench with --rounds
        # (every model alive to the end) aborted so ("terminate called without an active exception")
    except BaseException as exc:
        _report_failure(args, exc)
        raise  # non-zero exit; torchrun then stops the other ranks
    try:
        if dist.get_rank() == 0:
            if args.out:
                _write_json(Path(args.out), result)
            else:
                print(json.dumps(result, indent=1))
    finally:
        close_process_group()
    check_ok = result.get("check", {}).get("ok", True)
    return 0 if check_ok or args.no_check_exit else 1


if __name__ == "__main__":
    sys.exit(main())
