"""``autoddl plan``: the planner on the command line, and the search every planning command shares.

Beside it: ``compare`` (autoddl/cli/compare.py), ``explain`` (explain.py), the tables
(plan_tables.py), ``--pipeline``'s 3-D search (plan_pipeline.py), the trainers' ``--emit`` and
``--from-*`` (plan_trainers.py). Here: the options, the model's traces (through the trace cache)
and the search they all run.

Training settings (``--precision``, ``--reduce-dtype``, ``--recompute``, ``--bucket-mb``, the batch
sizes) go into the ``Training`` every plan carries; the model is traced under ``--precision`` at the
micro-step batch ``--micro-batch-size`` x the data-parallel degree (every device for the search; the
dp and fsdp degrees for ``--degrees``), and ``--global-batch-size`` / that batch micro-steps make
one optimizer step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from autoddl import trace_cache
from autoddl.cli import EXPECTED_ERRORS, add_model_options, common_options, model_overrides, register
from autoddl.cli.plan_pipeline import search_pipeline
from autoddl.cli.plan_tables import plan_line, print_schemes
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Cluster
from autoddl.graph import OpGraph
from autoddl.loader import ModelFile, ModelFileError, load_model_file
from autoddl.ops import coverage_report
from autoddl.plan import Mesh, Plan
from autoddl.rebatch import at_batch
from autoddl.training import (ATTENTION_KERNELS, DEFAULT_BUCKET_MB, DTYPES, OFFLOAD_CHOICES, RECOMPUTE_CHOICES,
                              SCHEDULES, Training)
from search.planner import (SCHEMES, Scheme, SearchOutcome, data_parallel_degree, degrees_spec, parse_degrees,
                            price_degrees, resolve_cluster, search)
from search.problem import NoFeasiblePlanError

EXPECTED_ERRORS.append(NoFeasiblePlanError)

PRECISIONS = tuple(DTYPES)                     # fp32, bf16, fp16


def _add_search_options(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--cluster", metavar="YAML", default=str(DEFAULT_CLUSTER_PATH),
                   help=f"cluster description (default: the bundled {DEFAULT_CLUSTER_PATH.name})")
    p.add_argument("--devices", type=int, metavar="N", help="plan for N devices of the cluster's kind")
    p.add_argument("--mesh", metavar="AxB", help="search only this mesh shape, e.g. 2x4")
    p.add_argument("--memory-gb", type=float, metavar="X", help="per-device memory limit (default: the device's)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    t = p.add_argument_group("training settings")
    t.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="compute dtype of parameters and activations (FSDP2's param_dtype); bf16 / fp16 keep "
                        "float32 master weights and optimizer states (default fp32)")
    t.add_argument("--reduce-dtype", choices=PRECISIONS, help="dtype gradients are reduced in (default: --precision)")
    t.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="none",
                   help="activation recompute per repeated block: none, selective (torchtitan's: recompute all but "
                        "matmul outputs, and every second 2-D product), full, or auto (the planner chooses per block under the memory limit)")
    t.add_argument("--offload", choices=OFFLOAD_CHOICES, default="none",
                   help="spill to host memory: none, optimizer (fp32 masters, optimizer states and step on the "
                        "host), params (and each block's parameters, copied in one block ahead), activations (and "
                        "those blocks' saved activations, out after forward, in before backward), or auto (none, "
                        "then optimizer, params, activations: the first with which a plan fits); needs the cluster "
                        "file's host_link, host_memory_gb, host_memory_bandwidth_gbps")
    t.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash",
                   help="price attention as one fused kernel (flash, default) or as the separate Q.K^T, softmax, "
                        "dropout and probs.V kernels of Megatron-LM's 2021 attention, keeping the scores (unfused); "
                        "a pricing choice: the plan still runs torch's SDPA")
    t.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB, metavar="MB",
                   help=f"gradient-sync bucket size (default {DEFAULT_BUCKET_MB:g}, as DDP)")
    t.add_argument("--micro-batch-size", type=int, metavar="M",
                   help="samples per data-parallel rank per micro-step (sets the inputs' batch dim)")
    t.add_argument("--global-batch-size", type=int, metavar="G",
                   help="samples per optimizer step: G / (M x data-parallel degree) micro-steps")
    t.add_argument("--degrees", metavar="ROLE=N,...",
                   help="price this expert configuration beside the found plan, e.g. fsdp=8, dp=4,tp=8 or "
                        "pp=8,dp=16,tp=8 (roles pp, dp, fsdp, tp, sp = tp with sequence parallel; outer axis "
                        "first: pp outermost, tp or sp innermost)")
    t.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="with a pp degree: the pipeline schedule (default 1f1b)")
    t.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="with --schedule interleaved: chunks (virtual stages) per pp rank (default 1)")
    t.add_argument("--zero", type=int, choices=(1, 2), help="with --degrees dp=...: ZeRO-1 (optimizer states) or "
                   "ZeRO-2 (and gradients) sharded over the dp axis")
    t.add_argument("--no-search", action="store_true",
                   help="with --degrees, --from-* or --pipeline: price the given configuration / the 3-D search only")
    t.add_argument("--pipeline", action="store_true",
                   help="also search pipeline stages: pp x dp|fsdp x tp, schedule, micro-batch size (needs "
                        "--global-batch-size); the best is priced and written as the given plan")
    p.add_argument("--memory-breakdown", action="store_true",
                   help="memory per device by category: parameters (masters, working copies, gathered), "
                        "gradients, optimizer states, activations (saved and recomputed), other")


def training_of(args: argparse.Namespace) -> Training:
    """The Training of the command line's settings (one micro-step; the batch flags set micro_batches)."""
    return Training(bucket_mb=args.bucket_mb, param_dtype=args.precision, reduce_dtype=args.reduce_dtype,
                    recompute=args.recompute, offload=getattr(args, "offload", "none"),
                    attention=getattr(args, "attention", "flash"))


@dataclass
class Planned:
    """What `plan` / `compare` computed: the search's outcome and the --degrees configuration."""

    tracer: "_Tracer"                                  # the model file's traces (and the file, built lazily)
    cluster: Cluster                                   # as the file says
    planned: Cluster                                   # resized to --devices
    outcome: SearchOutcome | None
    given: Scheme | None
    graph: OpGraph                                     # the found plan's (else the given one's)
    trace_s: float
    search_error: str = ""                             # why the search found nothing (with --degrees)
    graphs: dict = field(default_factory=dict)         # (batch, param_dtype) -> traced graph
    extra: list = field(default_factory=list)          # more priced schemes (--emit's best configuration)

    @property
    def mf(self) -> ModelFile:
        """The model file, built on first use (a cached trace does not build it)."""
        return self.tracer.mf

    @property
    def schemes(self) -> list[Scheme]:
        return (list(self.outcome.schemes) if self.outcome else []) + ([self.given] if self.given else []) + \
            list(self.extra)


def step_batch(micro_batch: int | None, global_batch: int | None, dp_degree: int) -> tuple[int | None, int]:
    """(the traced micro-step's batch M x D, micro-steps G / (M x D)) for data-parallel degree D;
    (None, 1) without the flags: the model file's own batch, one micro-step. Only G: M = G / D."""
    for flag, value in (("--micro-batch-size", micro_batch), ("--global-batch-size", global_batch)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be a positive number of samples")
    if micro_batch is None and global_batch is None:
        return None, 1
    if micro_batch is None:
        if global_batch % dp_degree:
            raise ValueError(f"--global-batch-size {global_batch} does not split over the data-parallel degree "
                             f"{dp_degree}; give a multiple of {dp_degree}, or --micro-batch-size too")
        return global_batch, 1
    batch = micro_batch * dp_degree
    if global_batch is None:
        return batch, 1
    if global_batch % batch:
        raise ValueError(f"--global-batch-size {global_batch} / (--micro-batch-size {micro_batch} x data-parallel "
                         f"degree {dp_degree} = {batch}) = {global_batch / batch:g} micro-steps, not a positive "
                         f"integer; give a global batch that is a multiple of {batch}")
    return batch, global_batch // batch


class _Tracer:
    """Traces the model file once per (micro-step batch, precision), through the on-disk trace cache
    (autoddl/trace_cache.py): a graph traced by an earlier run with the same key is read back, and
    the model file is then not even built (``mf`` loads it on first use). Once two batches are
    traced in one precision, the graph at any other batch is read off them (autoddl/rebatch.py)."""

    def __init__(self, args: argparse.Namespace, mf: ModelFile | None = None):
        self.args, self._mf, self.graphs, self.seconds = args, mf, {}, 0.0

    @property
    def path(self) -> str:
        """The model file's absolute path (as ``ModelFile.path``), without building it."""
        return self._mf.path if self._mf is not None else str(Path(self.args.model_py).expanduser().resolve())

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def mf(self) -> ModelFile:
        if self._mf is None:
            self._mf = load_model_file(self.args.model_py, **model_overrides(self.args))
        return self._mf

    def __call__(self, dp_degree: int, training: Training) -> tuple[OpGraph, int | None, Training]:
        batch, k = step_batch(self.args.micro_batch_size, self.args.global_batch_size, dp_degree)
        return self.at(batch, training.param_dtype), batch, dataclasses.replace(training, micro_batches=k)

    def at(self, batch: int | None, param_dtype: str) -> OpGraph:
        """The graph of a micro-step of ``batch`` samples (None: the model file's batch), traced once."""
        key = (batch, param_dtype)
        if key not in self.graphs:
            t0 = time.perf_counter()
            self.graphs[key] = self._cached(batch, param_dtype)
            if getattr(self.args, "gc_freeze", False):
                gc.freeze()     # the graph lives until the command ends: out of the collector's way (cli main)
            self.seconds += time.perf_counter() - t0
        return self.graphs[key]

    def _cached(self, batch: int | None, param_dtype: str) -> OpGraph:
        derived = self._rebatched(batch, param_dtype)
        if derived is not None:
            return derived
        def trace() -> OpGraph:
            return (self.mf.with_batch_size(batch) if batch else self.mf).trace(param_dtype, replicate=True, say=_say)
        if not os.path.isfile(self.path):              # load_model_file says what is wrong with it
            return trace()
        return trace_cache.traced(self.path, model_overrides(self.args), batch, param_dtype, trace, _say)

    def _rebatched(self, batch: int | None, param_dtype: str) -> OpGraph | None:
        """The graph at ``batch`` read off two graphs traced here at other batches (autoddl/rebatch.py)."""
        have = sorted(b for b, dt in self.graphs if dt == param_dtype and b is not None and b != batch)
        if batch is None or len(have) < 2:
            return None
        b1, b2 = have[:2]
        graph = at_batch(self.graphs[(b1, param_dtype)], b1, self.graphs[(b2, param_dtype)], b2, batch)
        if graph is not None:
            print(f"trace: {graph.model_name} at batch {batch} in {param_dtype} read off its traces at batches {b1} "
                  f"and {b2}", file=sys.stderr)
        return graph


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def _provenance(scheme: Scheme | None, args: argparse.Namespace, overrides: dict, batch: int | None,
                tracer: "_Tracer") -> None:
    if scheme is not None and scheme.plan is not None:
        scheme.plan.set_provenance(model_file=tracer.path, model_args=overrides, cluster_file=args.cluster)
        scheme.plan.batch_size = batch


GivenPricer = Callable[["_Tracer", Training], tuple[Scheme, OpGraph, "int | None"]]


def _search(args: argparse.Namespace, progress, training: Training | None = None,
            tracer: _Tracer | None = None, given: GivenPricer | None = None) -> Planned:
    """The search under ``training`` and, beside it, the user's configuration: ``--degrees``, or
    ``given`` ((tracer, training) -> its scheme, graph and traced batch; --from-torchtitan/-megatron)."""
    overrides = model_overrides(args)
    training = training or training_of(args)
    cluster = Cluster.from_yaml(args.cluster)
    planned = resolve_cluster(cluster, args.devices)
    mesh = Mesh.parse(args.mesh).shape if args.mesh else None
    degrees = parse_degrees(args.degrees) if args.degrees else None
    if degrees:
        degrees_spec(degrees, planned)                 # refuse bad degrees before tracing
        given = _degrees_pricer(args, planned, degrees)
    elif args.no_search and given is None and not args.pipeline:
        raise ValueError("--no-search prices only a given configuration: add --degrees (e.g. --degrees fsdp=8), "
                         "--from-torchtitan, --from-megatron or --pipeline")
    if args.pipeline and (given is not None or not args.global_batch_size):
        raise ValueError("--pipeline searches pipeline stages for a --global-batch-size (give one) and replaces "
                         "--degrees / --from-* (drop them)")
    tracer = tracer or _Tracer(args)
    outcome, given_scheme, graph, error = None, None, None, ""
    if not args.no_search:
        graph, batch, tr = tracer(planned.num_devices, training)
        try:
            outcome = search(graph, planned, model_name=graph.model_name, mesh=mesh, memory_gb=args.memory_gb,
                             optimizer=args.optimizer, progress=progress, training=tr,
                             price_all_baselines=getattr(args, "price_all_baselines", True) or args.scheme != "found")
        except NoFeasiblePlanError as exc:
            if given is None and not args.pipeline:
                raise
            error = str(exc)
        for scheme in outcome.schemes if outcome else ():
            _provenance(scheme, args, overrides, batch, tracer)
    if given is not None:
        given_scheme, g2, batch2 = given(tracer, training)
        _provenance(given_scheme, args, overrides, batch2, tracer)
        graph = graph or g2
    if args.pipeline:
        given_scheme, g3, batch3 = search_pipeline(args, tracer, planned, training, progress)
        _provenance(given_scheme, args, overrides, batch3, tracer)
        graph = graph or g3
    return Planned(tracer, cluster, planned, outcome, given_scheme, graph, tracer.seconds, error, tracer.graphs)


def _degrees_pricer(args: argparse.Namespace, planned: Cluster, degrees: list[tuple[str, int]]) -> GivenPricer:
    def price(tracer: _Tracer, training: Training) -> tuple[Scheme, OpGraph, int | None]:
        g2, batch2, tr2 = tracer(data_parallel_degree(degrees), training)
        scheme = price_degrees(g2, planned, degrees, model_name=g2.model_name, memory_gb=args.memory_gb,
                               optimizer=args.optimizer, training=tr2, zero=args.zero or 0,
                               schedule=args.schedule, virtual_stages=args.virtual_stages)
        return scheme, g2, batch2
    return price


# -- tables ---------------------------------------------------------------------------------------

def _graphs_by_scheme(result: Planned) -> dict[str, OpGraph | None]:
    out: dict[str, OpGraph | None] = {s.name: result.graph for s in (result.outcome.schemes if result.outcome else [])}
    for given in ([result.given] if result.given is not None else []) + list(result.extra):
        p = given.plan
        out[given.name] = result.graphs.get((p.batch_size, p.training.param_dtype), result.graph)
    return out


def _training_line(training: Training, result: Planned, args: argparse.Namespace) -> str:
    reduce = training.grad_reduce_dtype
    precision = next(k for k, v in DTYPES.items() if v == training.param_dtype)
    text = (f"training: {precision}" + (f" (gradients reduced in {next(k for k, v in DTYPES.items() if v == reduce)})"
                                        if reduce != training.param_dtype else "")
            + f", recompute {args.recompute}, buckets {training.bucket_mb:g} MB"
            + (f", offload {getattr(args, 'offload', 'none')}" if getattr(args, "offload", "none") != "none" else "")
            + (", attention priced unfused" if training.attention == "unfused" else ""))
    plan = result.outcome.found if result.outcome else result.given.plan if result.given else None
    if plan is not None and plan.batch_size:
        k = plan.training.micro_batches
        text += (f", micro-step batch {plan.batch_size} (all data-parallel ranks), {k} micro-step{'s' * (k != 1)}, "
                 f"global batch {plan.batch_size * k}")
    else:
        try:
            text += f", the model file's batch ({result.mf.batch_size}), 1 micro-step"
        except ModelFileError:
            text += ", the model file's batch, 1 micro-step"
    return text


@register
def add_plan(subparsers) -> None:
    p = subparsers.add_parser("plan", parents=[common_options()], help="find the fastest SBP plan for a model",
                              description="Trace MODEL_PY, search SBP signatures on every mesh shape, and "
                                          "print the found plan next to every expert baseline.")
    _add_search_options(p)
    p.add_argument("--out", default="plan.json", metavar="PLAN_JSON", help="where to write the plan")
    p.add_argument("--scheme", default="found", choices=SCHEMES,
                   help="which plan to write: found (default) or a baseline (with --degrees: the given one)")
    p.add_argument("--verbose", action="store_true", help="print the per-op table of the found plan")
    p.add_argument("--price-all-baselines", action="store_true",
                   help="price every baseline with the full cost model; by default those that cannot fit the "
                        "memory limit (what they keep without lowering is over it) are shown estimated")
    from autoddl.cli.plan_trainers import add_trainer_options

    add_trainer_options(p)
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from autoddl.cli import plan_trainers

    result, tracer, user = plan_trainers.search_with_trainer(args, progress=lambda m: print("  " + m, file=sys.stderr))
    emitted = plan_trainers.choose_emitted(args, result, tracer, user) if args.emit else None
    graph, cluster, outcome, given = result.graph, result.cluster, result.outcome, result.given
    print(f"model:    {result.tracer.name} ({result.tracer.path}) {graph.parameter_count / 1e6:,.1f}M parameters, "
          f"{len(graph.ops())} ops, traced in {result.trace_s:.2f} s")
    planned = result.planned
    print(f"cluster:  {cluster.summary()}")
    if planned.num_devices != cluster.num_devices:
        print(f"planned:  {planned.nodes}x{planned.devices_per_node} of {cluster.name} (--devices {args.devices})")
    print(_training_line(training_of(args), result, args))
    if outcome is not None:
        print(f"searched: meshes {', '.join('x'.join(map(str, m)) for m in outcome.meshes)} "
              f"in {outcome.search_s:.2f} s")
    print()
    print_schemes(result.schemes, _graphs_by_scheme(result), args.memory_breakdown)
    print()
    if outcome is not None:
        found, bd = outcome.found, outcome.found_breakdown
        line = plan_line("found plan", found, bd)
        best = outcome.best_baseline
        if best is not None:
            priced = " priced" if any(s.estimated and not s.floor_bytes for s in outcome.schemes) else ""
            line += f"; {best.step_time_s / bd.step_time_s:.2f}x the speed of the best baseline{priced} " \
                    f"({best.name}, {best.step_time_s * 1e3:.3f} ms)"
        print(line)
        for note in found.notes:
            print(f"note: {note}")
    elif result.search_error:
        print(f"search: {result.search_error}")
    if given is not None:
        line = plan_line(f"given {given.name}", given.plan, given.breakdown)
        if outcome is not None:
            line += f"; the found plan is {given.step_time_s / outcome.found_breakdown.step_time_s:.2f}x its speed"
        print(line)
        for note in given.plan.notes:
            print(f"note: {note}")
    plan_trainers.report(args, result, user, emitted)
    for line in coverage_report(graph).lines():
        print(f"warning: {line}")
    if given is not None:
        chosen = given
    else:
        chosen = next((s for s in outcome.schemes if s.name == args.scheme), None)
        if chosen is None or chosen.plan is None:
            why = chosen.reason if chosen is not None else "no such scheme"
            raise ValueError(f"--scheme {args.scheme}: {why}; choose one of "
                             f"{', '.join(s.name for s in outcome.schemes if s.plan is not None)}")
    if args.verbose:
        print()
        print(chosen.plan.summary().to_string(index=False))
    chosen.plan.save(args.out)
    by = f" given by {'--degrees ' if args.degrees else ''}{chosen.name}" if given else ""
    print(f"wrote {args.out} ({chosen.plan.name} plan{by})")
    _print_next(args.out, chosen.plan, planned)
    return 0


def _print_next(path: str, plan: Plan, cluster: Cluster) -> None:
    """What to run next with the plan just written."""
    backend = "" if cluster.backend.value == "nccl" else " --backend gloo"
    print("next:")
    print(f"  autoddl explain {path}                          # why each op got its signature")
    print(f"  autoddl explain {path} --trace predicted.json   # the simulated step (open in ui.perfetto.dev)")
    ranks = f"--nproc {plan.devices}"
    if plan.devices > cluster.devices_per_node:   # one `autoddl run` per node
        ranks = (f"--nproc {cluster.devices_per_node} --nnodes {plan.devices // cluster.devices_per_node} "
                 "--node-rank R --master-addr NODE0 --master-port 29500")
    print(f"  autoddl run {path} {ranks}{backend} --check --reference ddp   # run it, check it, time it beside DDP")
