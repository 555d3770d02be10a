"""The ``plan`` command's trainer options (part of ``autoddl plan``, autoddl/cli/plan.py).

``--from-torchtitan TOML`` / ``--from-megatron FLAGS`` read a user's own configuration
(autoddl/trainers), search under its precision, recompute and batch sizes, and price it beside the
found plan (search/expressible.py ``price_config``). ``--emit torchtitan|megatron`` writes a plan in
that trainer's terms: the given configuration (``--degrees`` or ``--from-*``), else the best
configuration the trainer expresses (its structured space, every mesh factorisation), with a
header saying what autoddl predicted for it and how it compares with the found plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from autoddl.atomic import write_text_atomic
from autoddl.cli.plan import Planned, _search, _Tracer, training_of
from autoddl.cluster import Cluster
from autoddl.graph import NodeKind, OpGraph
from autoddl.loader import ModelFileError
from autoddl.pipeline import pipeline_degree
from autoddl.trainers import TrainerConfig
from autoddl.trainers.formats import DEFAULT_OUT, NAMES, TRAINERS, check_expressible, read_config, write_config
from autoddl.training import Training
from search.expressible import (best_config, check_priceable, price_config, recompute_variants, same_plan, slower,
                                structured_configs)
from search.planner import parse_degrees, recompute_blocks, resolve_cluster

# the gradient-reduce dtype a trainer uses when it is not told (torchtitan: float32 only; Megatron-LM:
# float32 for bf16, the compute dtype for fp16), as autoddl/trainers/*.py cite
TRAINER_REDUCE = {"torchtitan": {"fp32": "fp32", "bf16": "fp32", "fp16": "fp32"},
                  "megatron": {"fp32": "fp32", "bf16": "fp32", "fp16": "fp16"}}


def add_trainer_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("your trainer (torchtitan, Megatron-LM)")
    g.add_argument("--emit", choices=TRAINERS, help="write the plan as torchtitan job-config TOML or Megatron-LM "
                   "flags: the given configuration (--degrees, --from-*), else the best one the trainer expresses")
    g.add_argument("--emit-out", metavar="FILE", help="where --emit writes (default: "
                   + ", ".join(f"{v} for {k}" for k, v in DEFAULT_OUT.items()) + ")")
    g.add_argument("--from-torchtitan", metavar="TOML", help="price your torchtitan job config beside the found plan")
    g.add_argument("--from-megatron", metavar="FLAGS", help="price your Megatron-LM flags (a string, or a file "
                   "holding them) beside the found plan")


@dataclass
class UserConfig:
    """A configuration read with --from-torchtitan / --from-megatron."""

    config: TrainerConfig
    label: str                          # "your torchtitan job.toml"
    ignored: list[str]                  # flags that do not bear on the plan


@dataclass
class Emitted:
    trainer: str
    config: TrainerConfig
    scheme: object                      # search.planner.Scheme
    relation: str                       # how it compares with the found plan


def _user_source(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """(trainer, text, source name) of --from-torchtitan / --from-megatron, after checking the options."""
    given = [o for o in ("degrees", "from_torchtitan", "from_megatron") if getattr(args, o)]
    if len(given) > 1:
        raise ValueError(f"{' and '.join('--' + o.replace('_', '-') for o in given)}: give one configuration to price")
    if args.emit_out and not args.emit:
        raise ValueError("--emit-out names where --emit writes: add --emit torchtitan or --emit megatron")
    if args.from_torchtitan:
        path = args.from_torchtitan
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--from-torchtitan {path}: no such file (give a torchtitan job-config TOML)")
        with open(path, encoding="utf-8") as f:
            return "torchtitan", f.read(), path
    if args.from_megatron:
        text = args.from_megatron
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                return "megatron", f.read(), text
        return "megatron", text, "--from-megatron"
    return None


def search_with_trainer(args: argparse.Namespace, progress) -> tuple[Planned, _Tracer, UserConfig | None]:
    """``_search``, or with --from-*: the search under the user's configuration's settings, and the
    configuration priced beside it."""
    source = _user_source(args)
    if args.emit and args.reduce_dtype is None and args.precision != "fp32" and source is None:
        args.reduce_dtype = TRAINER_REDUCE[args.emit][args.precision]
    if args.emit and args.degrees:
        check_expressible(args.emit, _degrees_config(args))        # before the search, not after it
    tracer = _Tracer(args)
    if source is None:
        return _search(args, progress, tracer=tracer), tracer, None
    trainer, text, where = source
    planned = resolve_cluster(Cluster.from_yaml(args.cluster), args.devices)
    blocks = recompute_blocks(tracer(1, training_of(args))[0])
    config, ignored = read_config(trainer, text, devices=planned.num_devices, num_layers=len(blocks), source=where)
    check_priceable(config)                       # before the search, not after it
    if args.emit:
        check_expressible(args.emit, config)
    what = "flags" if where == "--from-megatron" else os.path.basename(where)
    user = UserConfig(config, f"your {NAMES[trainer]} {what}", ignored)
    args.micro_batch_size, args.global_batch_size = config.micro_batch_size, config.global_batch_size
    args.precision, args.reduce_dtype = config.precision, config.reduce_dtype
    args.recompute = config.recompute if config.recompute_every == 1 else "none"
    own = _Tracer(args, tracer.mf)
    own.graphs = tracer.graphs

    def price(t: _Tracer, training: Training):
        graph, batch, tr = t(config.data_parallel_degree, training)
        scheme = price_config(graph, planned, config, base=tr, name=user.label, memory_gb=args.memory_gb,
                              optimizer=args.optimizer)
        return scheme, graph, batch
    training = config.training(blocks, bucket_mb=args.bucket_mb)
    return _search(args, progress, training=training, tracer=own, given=price), own, user


def user_line(result: Planned, user: UserConfig) -> str:
    """``your configuration: X ms; found: Y ms (Z x)``."""
    mine = result.given
    line = f"{user.label} ({user.config.describe()}): {mine.step_time_s * 1e3:.3f} ms"
    if result.outcome is not None:
        found = result.outcome.found_breakdown.step_time_s
        line += f"; found: {found * 1e3:.3f} ms ({slower(mine.step_time_s, found):.2f}x)"
    seq = _sequence_length(result.graph)
    if seq is not None and user.config.seq_len not in (None, seq):
        line += (f"\nnote: priced at the model file's sequence length {seq}, not the configuration's "
                 f"{user.config.seq_len}; set the model file's (e.g. --set seq_len=N) to match")
    if user.ignored:
        line += f"\nnot read (no bearing on the plan): {' '.join(user.ignored)}"
    return line


def choose_emitted(args: argparse.Namespace, result: Planned, tracer: _Tracer, user: UserConfig | None) -> Emitted:
    """What --emit writes (module docstring), priced."""
    trainer = args.emit
    found = result.outcome.found_breakdown.step_time_s if result.outcome else None
    if result.given is not None:
        config = user.config if user else _degrees_config(args)
        check_expressible(trainer, config)
        relation = (f"the found plan: {found * 1e3:.3f} ms; this configuration takes "
                    f"{slower(result.given.step_time_s, found):.2f}x its step time" if found else "")
        return Emitted(trainer, _complete(config, result.given, result), result.given, relation)
    blocks = len(recompute_blocks(result.graph))
    settings = TrainerConfig(precision=args.precision, reduce_dtype=args.reduce_dtype, recompute="none",
                             num_layers=blocks or None)
    candidates = [v for c in structured_configs(trainer, result.planned, settings, max_pp=blocks or 1)
                  for v in recompute_variants(c, args.recompute)]

    def price(config: TrainerConfig):
        graph, batch, tr = tracer(config.data_parallel_degree, training_of(args))
        scheme = price_config(graph, result.planned, config, base=tr, name=f"{trainer} best",
                              memory_gb=args.memory_gb, optimizer=args.optimizer)
        scheme.plan.batch_size = batch
        return scheme
    best, tried = best_config(candidates, price, lambda c: check_expressible(trainer, c))
    if best is None:
        reasons = "; ".join(dict.fromkeys(p.reason for p in tried))
        raise ValueError(f"--emit {trainer}: no configuration {NAMES[trainer]} expresses applies here: {reasons}")
    plan, config_s = best.scheme.plan, best.scheme.step_time_s
    if found is None:
        relation = ""
    elif same_plan(plan, result.outcome.found):
        relation = f"this is the found plan ({found * 1e3:.3f} ms): nothing finer the search visited is faster"
    else:
        relation = (f"the found plan (per-op signatures, finer than {NAMES[trainer]} expresses): {found * 1e3:.3f} "
                    f"ms; this, the best of {sum(p.scheme is not None for p in tried)} configurations "
                    f"{NAMES[trainer]} expresses, is predicted {slower(config_s, found):.2f}x its step time")
        if config_s < found and best.config.pp > 1 and pipeline_degree(result.outcome.found) == 1:
            relation += " (pipeline stages, which the found plan's search did not try: add --pipeline)"
    result.extra.append(best.scheme)
    return Emitted(trainer, _complete(best.config, best.scheme, result), best.scheme, relation)


def _degrees_config(args: argparse.Namespace) -> TrainerConfig:
    if args.recompute == "auto":
        raise ValueError("--emit with --degrees and --recompute auto: a trainer takes one recompute policy for "
                         "every layer; give --recompute none, selective or full")
    return TrainerConfig.from_degrees(parse_degrees(args.degrees), zero=args.zero or 0, precision=args.precision,
                                      reduce_dtype=args.reduce_dtype, recompute=args.recompute)


def _complete(config: TrainerConfig, scheme, result: Planned) -> TrainerConfig:
    """``config`` with the batch sizes, sequence length and layer count of the plan that priced it."""
    plan, graph = scheme.plan, result.graphs.get((scheme.plan.batch_size, scheme.plan.training.param_dtype),
                                                 result.graph)
    batch = plan.batch_size
    if batch is None:
        try:
            batch = result.mf.batch_size
        except ModelFileError:
            batch = None
    d, k = config.data_parallel_degree, plan.training.micro_batches
    out = {"num_layers": config.num_layers or len(recompute_blocks(graph)) or None,
           "seq_len": _sequence_length(graph) or config.seq_len}           # what was priced
    if batch is not None and config.micro_batch_size is None:
        out.update(micro_batch_size=batch // d, global_batch_size=batch * k)
    return dataclasses.replace(config, **out)


def _sequence_length(graph: OpGraph) -> int | None:
    """T of a first input of (B, T) integer token ids."""
    inputs = graph.nodes_of(NodeKind.INPUT)
    meta = inputs[0].outputs[0] if inputs and inputs[0].outputs else None
    if meta is not None and meta.ndim == 2 and not meta.is_floating and meta.dtype != "bool":
        return int(meta.shape[1])
    return None


def report(args: argparse.Namespace, result: Planned, user: UserConfig | None, emitted: Emitted | None) -> None:
    """Prints the user's configuration beside the found plan, and writes what --emit chose."""
    if user is not None:
        print(user_line(result, user))
    if emitted is not None:
        print(f"wrote {write_emitted(args, emitted, result)} ({emitted.config.describe()}"
              + (f"; {emitted.relation}" if emitted.relation else "") + ")")


def write_emitted(args: argparse.Namespace, emitted: Emitted, result: Planned) -> str:
    """Writes the emitted configuration with its header; returns the path."""
    bd, plan, mf, planned = emitted.scheme.breakdown, emitted.scheme.plan, result.mf, result.planned
    name = NAMES[emitted.trainer]
    rate = plan.cost.tokens_per_s if plan.cost.tokens_per_s is not None else plan.cost.samples_per_s
    unit = "tokens" if plan.cost.tokens_per_s is not None else "samples"
    header = [f"{name} settings from `autoddl plan` for {mf.name} ({os.path.relpath(mf.path)}) on {planned.nodes} x "
              f"{planned.devices_per_node} devices of {result.cluster.name}",
              f"configuration: {emitted.config.describe()}",
              f"autoddl predicts {bd.step_time_s * 1e3:.3f} ms per optimizer step, "
              f"{bd.memory_bytes_per_device / 1e9:.3f} GB per device"
              + (f", {rate / plan.devices:,.0f} {unit}/s per device" if rate else "")
              + ("" if bd.fits_memory else " (does NOT fit the memory limit)")]
    header += [emitted.relation] if emitted.relation else []
    if emitted.trainer == "megatron":
        header.append(f"launch on {emitted.config.devices} GPUs: Megatron-LM's data-parallel size is the world size "
                      "/ (tensor x pipeline sizes)")
        if emitted.config.recompute == "selective":
            header.append("autoddl priced selective recompute as torchtitan's per-op policy (matmul outputs kept but every "
                          "second mm); "
                          "Megatron's recomputes --recompute-modules (default core_attn)")
    else:
        header.append("sections of a torchtitan job TOML (torchtitan/config/job_config.py); torchtitan after #2386 "
                      "takes the same names as --section.option flags")
    path = args.emit_out or DEFAULT_OUT[emitted.trainer]
    write_text_atomic(path, write_config(emitted.trainer, emitted.config, header))
    return path
