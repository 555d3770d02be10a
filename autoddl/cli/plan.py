"""``autoddl plan``, ``autoddl compare`` and ``autoddl explain``: the planner on the command line.

Training settings (``--precision``, ``--reduce-dtype``, ``--recompute``, ``--bucket-mb``, the batch
sizes) go into the ``Training`` every plan carries; the model is traced under ``--precision`` at the
micro-step batch ``--micro-batch-size`` x the data-parallel degree (every device for the search; the
dp and fsdp degrees for ``--degrees``), and ``--global-batch-size`` / that batch micro-steps make
one optimizer step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from autoddl import trace_cache
from autoddl.api import schemes_frame
from autoddl.boxing import group_name
from autoddl.cli import EXPECTED_ERRORS, add_model_options, common_options, model_overrides, register, table
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Cluster
from autoddl.graph import NodeKind, OpGraph
from autoddl.loader import ModelFile, ModelFileError, load_for_plan, load_model_file
from autoddl.offload import SPILL_LEVELS
from autoddl.ops import coverage_report
from autoddl.plan import Mesh, Plan
from autoddl.rebatch import at_batch
from autoddl.training import (DEFAULT_BUCKET_MB, DTYPES, OFFLOAD_CHOICES, RECOMPUTE_CHOICES, RECOMPUTE_POLICIES,
                              SCHEDULES, Training)
from search.pipeline_search import FULL_PRICES, best_fitting, search_3d
from search.planner import (SCHEMES, Scheme, SearchOutcome, data_parallel_degree, degrees_spec, inner_tp_plan,
                            parse_degrees, price_degrees, recompute_blocks, resolve_cluster, search)
from search.problem import NoFeasiblePlanError

EXPECTED_ERRORS.append(NoFeasiblePlanError)

PRECISIONS = tuple(DTYPES)                     # fp32, bf16, fp16
VARIANT_PRECISIONS = ("fp32", "bf16")          # compare --variants: precision x recompute
VARIANT_RECOMPUTE = RECOMPUTE_POLICIES         # none, selective, full
FIT_RETRIES = 3                                # --pipeline: estimates priced in full after the best, while none fits
NO_LIMIT_GB = 1e9                              # a variant nothing fits in is shown searched without a limit


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
                   help="activation recompute per repeated block: none, selective (recompute all but matmul "
                        "outputs), full, or auto (the planner chooses per block under the memory limit)")
    t.add_argument("--offload", choices=OFFLOAD_CHOICES, default="none",
                   help="spill to host memory: none, optimizer (fp32 masters, optimizer states and step on the "
                        "host), params (and each block's parameters, copied in one block ahead), activations (and "
                        "those blocks' saved activations, out after forward, in before backward), or auto (none, "
                        "then optimizer, params, activations: the first with which a plan fits); needs the cluster "
                        "file's host_link, host_memory_gb, host_memory_bandwidth_gbps")
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
                    recompute=args.recompute, offload=getattr(args, "offload", "none"))


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
            self.seconds += time.perf_counter() - t0
        return self.graphs[key]

    def _cached(self, batch: int | None, param_dtype: str) -> OpGraph:
        derived = self._rebatched(batch, param_dtype)
        if derived is not None:
            return derived
        def trace() -> OpGraph:
            return (self.mf.with_batch_size(batch) if batch else self.mf).trace(param_dtype)
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
                             optimizer=args.optimizer, progress=progress, training=tr)
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
        given_scheme, g3, batch3 = _search_pipeline(args, tracer, planned, training, progress)
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


def _search_pipeline(args: argparse.Namespace, tracer: "_Tracer", planned: Cluster, training: Training, progress
                     ) -> tuple[Scheme, OpGraph, int]:
    """search/pipeline_search.py's 3-D search; the best fast estimates priced by the full cost model."""
    limit = (args.memory_gb or planned.device.memory_gb) * 1e9
    sizes = (args.micro_batch_size,) if args.micro_batch_size else (1, 2)
    estimates = search_3d(lambda batch: tracer.at(batch, training.param_dtype),
                          lambda g, tp, tr: inner_tp_plan(g, planned, tp, tr, args.optimizer),
                          planned, training, args.global_batch_size, limit, sizes, progress)
    best = best_fitting(estimates, limit, k=FULL_PRICES + FIT_RETRIES)
    if not best:
        least = min((e.memory_bytes for e in estimates), default=math.inf)
        raise NoFeasiblePlanError(least, limit)
    priced = []
    for e in best:          # the fastest FULL_PRICES; further ones only while the full price does not fit
        if len(priced) >= FULL_PRICES and any(p[0].breakdown.fits_memory for p in priced):
            break
        dp = e.degrees[1][1]
        graph = tracer.at(e.micro_batch_size * dp, training.param_dtype)
        tr = dataclasses.replace(training, recompute=e.recompute,
                                 micro_batches=args.global_batch_size // (e.micro_batch_size * dp))
        scheme = price_degrees(graph, planned, e.degrees, model_name=graph.model_name, memory_gb=args.memory_gb,
                               optimizer=args.optimizer, training=tr, schedule=e.schedule,
                               virtual_stages=e.virtual_stages)
        bd = scheme.breakdown
        progress(f"3-D search: {e.text}: estimated {e.step_time_s:.3f} s, {e.memory_bytes / 1e9:.1f} GB; priced "
                 f"{scheme.step_time_s:.3f} s, {bd.memory_bytes_per_device / 1e9:.1f} GB"
                 + ("" if bd.fits_memory else " (does not fit: pricing the next estimate)"))
        priced.append((scheme, graph, e.micro_batch_size * dp))
    fits = [p for p in priced if p[0].breakdown.fits_memory] or priced
    return min(fits, key=lambda p: p[0].step_time_s)


# -- tables ---------------------------------------------------------------------------------------

MEMORY_PARTS = {            # --memory-breakdown column -> costmodel/memory.py categories
    "params GB": ("parameters", "working_params", "gathered_params"),
    "grads GB": ("gradients",),
    "optim GB": ("optimizer_states",),
    "activ GB": ("activations", "recomputed"),
    "spilled GB": ("spilled_params", "spilled_grads", "spilled_acts"),
    "other GB": ("buffers", "boxing_buffer"),
}


def _recompute_label(plan: Plan, graph: OpGraph | None) -> str:
    """``none`` / ``selective`` / ``full`` / ``30 sel + 2 full`` of the plan's blocks."""
    blocks = recompute_blocks(graph) if graph is not None else list(plan.training.recompute_blocks)
    policies = [plan.training.recompute_of(b) for b in blocks]
    if not policies or all(p == "none" for p in policies):
        return "none"
    if len(set(policies)) == 1:
        return policies[0]
    counts = {p: policies.count(p) for p in ("selective", "full") if p in policies}
    return " + ".join(f"{n} {'sel' if p == 'selective' else p}" for p, n in counts.items())


def _rate_column(schemes: list[Scheme]) -> str:
    costs = [s.plan.cost for s in schemes if s.plan is not None and s.plan.cost is not None]
    return "tok/s/dev" if any(c.tokens_per_s is not None for c in costs) else "samples/s/dev"


def _rate(plan: Plan) -> str:
    c = plan.cost
    rate = c.tokens_per_s if c.tokens_per_s is not None else c.samples_per_s
    return f"{rate / plan.devices:,.0f}" if rate is not None else "-"


def _memory_cells(bd, breakdown: bool) -> tuple[str, ...]:
    if not breakdown:
        return (f"{bd.memory_bytes_per_device / 1e9:.3f}",)
    return tuple(f"{sum(bd.memory.get(c, 0) for c in cats) / 1e9:.3f}" for cats in MEMORY_PARTS.values()) + \
        (f"{bd.memory_bytes_per_device / 1e9:.3f}",)


def _memory_header(breakdown: bool) -> tuple[str, ...]:
    return tuple(MEMORY_PARTS) + ("memory GB",) if breakdown else ("memory GB",)


def _print_schemes(schemes: list[Scheme], graphs: dict[str, OpGraph | None], breakdown: bool = False) -> None:
    """One row per scheme: step time, its parts, recompute (when any), throughput, memory."""
    rows, skipped = [], []
    show_recompute = any(s.plan is not None and _recompute_label(s.plan, graphs.get(s.name)) != "none"
                         for s in schemes)
    show_bubble = any(s.plan is not None and s.breakdown.bubble_s > 0 for s in schemes)
    show_offload = any(s.plan is not None and s.plan.training.offload_level != "none" for s in schemes)
    for s in schemes:
        if s.plan is None:
            skipped.append(f"{s.name}: not applicable: {s.reason}")
            continue
        bd, c = s.breakdown, s.plan.cost
        rows.append((s.name, str(s.plan.mesh), f"{bd.step_time_s * 1e3:.3f}", f"{bd.compute_s * 1e3:.3f}",
                     f"{(bd.boxing_forward_s + bd.boxing_backward_s) * 1e3:.3f}", f"{bd.grad_sync_s * 1e3:.3f}",
                     f"{bd.optimizer_s * 1e3:.3f}")
                    + ((f"{bd.bubble_s * 1e3:.3f}",) if show_bubble else ())
                    + ((_recompute_label(s.plan, graphs.get(s.name)),) if show_recompute else ())
                    + (_offload_cells(s) if show_offload else ())
                    + (_rate(s.plan), f"{c.model_tflops_per_device:.1f}" if c.model_tflops_per_device else "-")
                    + _memory_cells(bd, breakdown) + ("yes" if bd.fits_memory else "NO",))
    header = (("scheme", "mesh", "step ms", "compute ms", "boxing ms", "grad sync ms", "optimizer ms")
              + (("bubble ms",) if show_bubble else ()) + (("recompute",) if show_recompute else ())
              + (OFFLOAD_HEADER if show_offload else ()) + (_rate_column(schemes), "TFLOP/s/dev")
              + _memory_header(breakdown) + ("fits",))
    numeric = [i for i, h in enumerate(header) if h not in ("scheme", "mesh", "recompute", "fits") + OFFLOAD_HEADER]
    print(table(header, rows, numeric=numeric))
    for line in skipped:
        print(line)


OFFLOAD_HEADER = ("offload", "copies ms", "vs no offload", "host GB")


def _offload_cells(s: Scheme) -> tuple[str, ...]:
    """What a scheme spills, its host copies' time, its step against the same plan without offload
    (``does not fit`` there when it needs the offload), the host memory it uses per device."""
    level = s.plan.training.offload_level
    if level == "none":
        return ("none", "-", "-", "-")
    ratio = (f"{s.step_time_s / s.no_offload_s:.2f}x" if s.no_offload_s else "-") + \
        ("" if s.no_offload_fits else " (does not fit without)")
    blocks = s.plan.training.spill_blocks
    if level in SPILL_LEVELS:
        level += f" ({len(blocks)} blocks)" if blocks else " (all)"
    return (level, f"{s.breakdown.offload_s * 1e3:.3f}", ratio, f"{s.breakdown.host_memory_bytes / 1e9:.3f}")


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
            + (f", offload {getattr(args, 'offload', 'none')}" if getattr(args, "offload", "none") != "none" else ""))
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


def _plan_line(label: str, plan: Plan, bd) -> str:
    c = plan.cost
    line = (f"{label}: mesh {plan.mesh}, predicted {bd.step_time_s * 1e3:.3f} ms per step, "
            f"{bd.memory_bytes_per_device / 1e9:.3f} GB per device")
    if c.tokens_per_s is not None:
        line += f", {c.tokens_per_s / plan.devices:,.0f} tokens/s per device"
    elif c.samples_per_s is not None:
        line += f", {c.samples_per_s / plan.devices:,.1f} samples/s per device"
    if c.model_tflops_per_device:
        line += f", {c.model_tflops_per_device:.1f} model TFLOP/s per device"
    return line + ("" if bd.fits_memory else " (does NOT fit)")


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
    _print_schemes(result.schemes, _graphs_by_scheme(result), args.memory_breakdown)
    print()
    if outcome is not None:
        found, bd = outcome.found, outcome.found_breakdown
        line = _plan_line("found plan", found, bd)
        best = outcome.best_baseline
        if best is not None:
            line += f"; {best.step_time_s / bd.step_time_s:.2f}x the speed of the best baseline " \
                    f"({best.name}, {best.step_time_s * 1e3:.3f} ms)"
        print(line)
        for note in found.notes:
            print(f"note: {note}")
    elif result.search_error:
        print(f"search: {result.search_error}")
    if given is not None:
        line = _plan_line(f"given {given.name}", given.plan, given.breakdown)
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


@register
def add_compare(subparsers) -> None:
    p = subparsers.add_parser("compare", parents=[common_options()],
                              help="every scheme's predicted breakdown, as a table and a chart")
    _add_search_options(p)
    p.add_argument("--variants", action="store_true",
                   help="also each precision x recompute variant (fp32/bf16 x none/selective/full) of the found "
                        "plan and the baselines: step time and memory")
    p.add_argument("--plot", metavar="PNG", help="write a stacked bar chart of the breakdowns")
    p.add_argument("--csv", metavar="CSV", help="write the table as CSV")
    p.set_defaults(func=run_compare)


def _frame(schemes: list[Scheme]) -> pd.DataFrame:
    """schemes_frame's columns, plus throughput and the memory categories (GB)."""
    df = schemes_frame(SearchOutcome(None, None, schemes, [], 0.0))
    extra = []
    for s in schemes:
        row: dict = {}
        if s.plan is not None and s.plan.cost is not None:
            c = s.plan.cost
            row = {"tokens_per_s": c.tokens_per_s, "samples_per_s": c.samples_per_s,
                   "model_tflops_per_device": c.model_tflops_per_device,
                   "precision": s.plan.training.param_dtype, "recompute": _recompute_label(s.plan, None),
                   "micro_batches": s.plan.training.micro_batches}
            row.update({name.replace(" GB", "_gb"): sum(s.breakdown.memory.get(k, 0) for k in cats) / 1e9
                        for name, cats in MEMORY_PARTS.items()})
        extra.append(row)
    return pd.concat([df, pd.DataFrame(extra)], axis=1)


def run_compare(args: argparse.Namespace) -> int:
    if args.variants:
        return _run_variants(args)
    result = _search(args, progress=None)
    print(f"{result.tracer.name} on {result.cluster.name}:")
    _print_schemes(result.schemes, _graphs_by_scheme(result), args.memory_breakdown)
    if result.search_error:
        print(f"search: {result.search_error}")
    df = _frame(result.schemes)
    _write_outputs(args, df, f"{result.tracer.name} on {result.cluster.name}")
    return 0


def _write_outputs(args: argparse.Namespace, df: pd.DataFrame, title: str) -> None:
    if args.csv:
        df.to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    if args.plot:
        from autoddl.charts import breakdown_chart

        breakdown_chart(df, title, args.plot)
        print(f"wrote {args.plot}")


def _run_variants(args: argparse.Namespace) -> int:
    """Each precision x recompute variant: the search (found plan and baselines) under it. A variant
    in which nothing fits is searched without the limit, to show what it would need."""
    tracer = _Tracer(args)
    frames, rows = [], []
    title = ""
    for precision in VARIANT_PRECISIONS:
        for recompute in VARIANT_RECOMPUTE:
            label = f"{precision}/{recompute}"
            training = dataclasses.replace(training_of(args), param_dtype=precision, recompute=recompute)
            try:
                result = _search(args, progress=None, training=training, tracer=tracer)
                note = ""
            except NoFeasiblePlanError as exc:
                unlimited = argparse.Namespace(**{**vars(args), "memory_gb": NO_LIMIT_GB})
                result = _search(unlimited, progress=None, training=training, tracer=tracer)
                limit = exc.memory_limit_bytes
                for s in result.schemes:
                    if s.breakdown is not None:
                        s.breakdown.memory_limit_bytes = int(limit)
                note = "nothing fits: searched without the memory limit"
            title = f"{result.tracer.name} on {result.cluster.name}"
            for s in result.schemes:
                if s.plan is None:
                    continue
                bd = s.breakdown
                rows.append((label, s.name + (" *" if note and s.name == "found" else ""), str(s.plan.mesh),
                             f"{bd.step_time_s * 1e3:.3f}", _rate(s.plan))
                            + _memory_cells(bd, args.memory_breakdown) + ("yes" if bd.fits_memory else "NO",))
            df = _frame(result.schemes)
            df.insert(0, "variant", label)
            frames.append(df)
    header = ("variant", "scheme", "mesh", "step ms", _rate_column(result.schemes)) + \
        _memory_header(args.memory_breakdown) + ("fits",)
    numeric = [i for i, h in enumerate(header) if h not in ("variant", "scheme", "mesh", "fits")]
    print(f"{title}: precision x recompute variants")
    print(table(header, rows, numeric=numeric))
    if any(r[1].endswith(" *") for r in rows):
        print("* nothing fits this variant's memory limit: the plan shown was searched without it")
    df = pd.concat(frames, ignore_index=True)
    plot = df.assign(scheme=df["variant"] + " " + df["scheme"])
    if args.csv:
        df.to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    if args.plot:
        from autoddl.charts import breakdown_chart

        breakdown_chart(plot, f"{title}: precision x recompute", args.plot)
        print(f"wrote {args.plot}")
    return 0


@register
def add_explain(subparsers) -> None:
    p = subparsers.add_parser("explain", parents=[common_options()],
                              help="why each op got its signature, and which collectives the plan inserts")
    p.add_argument("plan_json", metavar="PLAN_JSON")
    p.add_argument("--op", metavar="NAME", help="explain only the ops matching NAME: an op name (linear_3), a module "
                   "path (transformer.h.0.mlp) or a parameter name (transformer.h.0.mlp.c_fc.weight)")
    p.add_argument("--wide", action="store_true", help="every cell in full (default: fit a 100-column terminal)")
    p.add_argument("--trace", metavar="JSON", help="write the simulated step as a Chrome-trace / Perfetto JSON "
                   "(one track per stream per rank; open it in ui.perfetto.dev or chrome://tracing)")
    p.set_defaults(func=run_explain)


ROLE_WORDS = {"pp": "pipeline stages", "dp": "data parallel", "fsdp": "ZeRO-3 / FSDP", "tp": "tensor parallel", "sp": "sequence parallel",
              "rep": "replicated"}
NARROW = {"op": 16, "signature": 30, "runner-up": 10, "weight layouts": 18, "collectives": 18}  # 100 wide
SHORT_PHASE = {"forward": "fwd", "backward": "bwd", "grad_sync": "sync", "optimizer": "opt"}
SHORT_KIND = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "broadcast": "BC",
              "send_recv": "P2P"}


def plan_in_words(plan: Plan) -> str:
    """``data parallel over 2, tensor parallel over 4``: the mesh axes by role."""
    return ", ".join(f"{ROLE_WORDS.get(name.rstrip('0123456789'), name)} over {n}"
                     for name, n in zip(plan.mesh.axis_names, plan.mesh.shape))


def run_explain(args: argparse.Namespace) -> int:
    from autoddl.program import lower
    from search.formulate import formulate

    plan = Plan.load(args.plan_json)
    name, graph = _traced_for(plan, args.plan_json)
    cluster = Cluster.from_yaml(plan.cluster_file or DEFAULT_CLUSTER_PATH).resized(plan.mesh.size)
    form = formulate(graph, cluster, plan.mesh.shape, optimizer=plan.optimizer, training=plan.training)
    picked = [i for i, n in enumerate(form.nodes) if n.kind is NodeKind.OP and (not args.op or _matches(n, args.op))]
    if args.op and not picked:
        raise ValueError(f"--op {args.op}: no op, module path or parameter of {name} is called that; see "
                         f"`autoddl trace {plan.model}` for the op names and module paths")
    program = lower(graph, plan)
    rows = _explain_rows(form, _assignment_of(plan, form), picked, plan, graph, program, wide=args.wide)
    width = None if args.wide else 100
    say = print if args.wide else (lambda text: print(textwrap.fill(text, width)))
    say(f"{plan_in_words(plan)}: {plan} ({plan.devices} devices, cluster {cluster.name})")
    if plan.cost is not None:
        c = plan.cost
        say(f"predicted step {c.step_time_s * 1e3:.3f} ms: compute {c.compute_s * 1e3:.3f}, communication "
            f"{c.comm_s * 1e3:.3f} of which {c.exposed_comm_s * 1e3:.3f} not overlapped, optimizer "
            f"{c.optimizer_s * 1e3:.3f}; {c.memory_bytes_per_device / 1e9:.3f} GB per device")
    header = tuple(NARROW)       # weight layouts: each parameter's storage -> the layout the op uses it in
    print(table(header, [tuple(_clip(c, NARROW[h], args.wide) for h, c in zip(header, r)) for r in rows],
                numeric=(2,)))
    if not args.wide:
        print("(cells cut to fit 100 columns: --wide shows them whole)")
    if args.trace:
        _write_trace(args.trace, graph, plan, program, cluster)
    return 0


def _traced_for(plan: Plan, path: str):
    """The model file the plan was made for, traced; refuses a graph the plan was not made for."""
    if not plan.model:
        raise ValueError(f"{path}: the plan names no model file; re-run `autoddl plan MODEL_PY`")
    dtype = plan.training.param_dtype
    if os.path.isfile(plan.model):
        graph = trace_cache.traced(plan.model, plan.model_args, plan.batch_size, dtype,
                                   lambda: load_for_plan(plan).trace(dtype), _say)
    else:                                              # load_for_plan says what is wrong with it
        graph = load_for_plan(plan).trace(dtype)
    if graph.fingerprint() != plan.graph_hash:
        raise ValueError(f"{path} was made for another graph of {plan.model} (hash {plan.graph_hash}, "
                         f"now {graph.fingerprint()}); re-run `autoddl plan`")
    return Path(plan.model).stem, graph


def _matches(node, name: str) -> bool:
    """``name`` is the op, its module (or a module above it) or one of the parameters it reads."""
    path = node.module_path
    return name == node.name or name in node.params or path == name or path.startswith(name + ".")


def _explain_rows(form, assignment: np.ndarray, picked: list[int], plan: Plan, graph, program,
                  wide: bool) -> list[tuple[str, ...]]:
    by_op: dict[str, list[str]] = {}
    for t in program.collectives():
        text = (f"{t.phase} {t.collective.value} axis {group_name(t.axis)} {t.nbytes / 1e6:.3f} MB ({t.tensor})" if wide
                else f"{SHORT_PHASE[t.phase]} {SHORT_KIND[t.collective.value]} {t.nbytes / 1e6:.2f}MB")
        by_op.setdefault(t.op, []).append(text)
    rows = []
    for i in picked:
        node = form.nodes[i]
        local = _local_costs(form, assignment, i)
        chosen = assignment[i]
        runner = next((int(j) for j in np.argsort(local) if j != chosen), None)
        extra = f"+{(local[runner] - local[chosen]) * 1e6:.1f} us" if runner is not None else "only"
        sig = form.problem.choices[i][chosen]
        weights = [f"{graph[r.node].target}: {plan.param_storage[graph[r.node].target]} -> {sig.inputs[slot]}"
                   if wide else f"{plan.param_storage[graph[r.node].target]}->{sig.inputs[slot]}"
                   for slot, r in enumerate(node.inputs) if graph[r.node].kind is NodeKind.PARAMETER]
        weights = weights if wide else list(dict.fromkeys(weights))
        name = f"{node.name} ({node.module_path})" if wide and node.module_path else node.name
        rows.append((name, str(sig), extra, " ".join(weights) or "-", "; ".join(by_op.get(node.name, [])) or "-"))
    return rows


def _clip(text: str, width: int, wide: bool) -> str:
    return text if wide or len(text) <= width else text[: width - 1] + "~"


def _write_trace(path: str, graph, plan: Plan, program, cluster: Cluster) -> None:
    import json

    from autoddl.atomic import write_text_atomic
    from costmodel.simulate import bubble_s, chrome_trace, simulate

    timeline = simulate(program, graph, plan, cluster)
    write_text_atomic(path, json.dumps(chrome_trace(timeline, ranks=min(plan.devices, 8))))
    bubble = bubble_s(timeline, program)
    print(f"wrote {path}: the simulated step, {timeline.step_time_s * 1e3:.3f} ms "
          f"({max(0.0, timeline.exposed_comm_s - bubble) * 1e3:.3f} ms communication not overlapped"
          + (f", {bubble * 1e3:.3f} ms pipeline bubble)" if program.pipeline is not None else ")"))


def _assignment_of(plan: Plan, form) -> np.ndarray:
    out = np.zeros(len(form.nodes), dtype=np.int64)
    for i, node in enumerate(form.nodes):
        want = (plan.signatures.get(node.name) if node.kind is not NodeKind.PARAMETER
                else next((s for s in form.problem.choices[i] if s.outputs[0] == plan.param_storage[node.target]),
                          None))
        choices = form.problem.choices[i]
        if want not in choices:
            raise ValueError(f"plan signature {want} of {node.name} is not a candidate on mesh {plan.mesh}")
        out[i] = choices.index(want)
    return out


def _local_costs(form, assignment: np.ndarray, i: int) -> np.ndarray:
    """Node i's cost for each of its candidates with every neighbour held at the plan's choice."""
    p = form.problem
    total = p.node_cost[i].copy()
    for u, v, mat in p.edges:
        if v == i:
            total += mat[assignment[u], :]
        elif u == i:
            total += mat[:, assignment[v]]
    return total
