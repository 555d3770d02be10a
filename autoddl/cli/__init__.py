"""The ``autoddl`` command line: one argparse subcommand per ``add_<name>(subparsers)`` function.

A subcommand is registered with :func:`register`; its add function creates its
parser (``subparsers.add_parser(name, parents=[common_options()])``) and sets
``func``, a function ``(args) -> int`` returning the exit code. Modules listed in
``COMMAND_MODULES`` are imported by :func:`build_parser` so that their
``@register`` calls run. Expected failures (bad model file, untraceable model,
bad option) print one line ``autoddl: error: ...`` and exit 2; ``--debug``
prints the traceback too.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import time
import traceback
from typing import Any, Callable, Sequence

from autoddl.loader import ModelFileError, load_model_file
from autoddl.trace import TraceError, trace

AddFn = Callable[["argparse._SubParsersAction"], None]

SUBCOMMANDS: dict[str, AddFn] = {}
COMMAND_MODULES: list[str] = ["autoddl.plan_cli", "autoddl.run_cli", "autoddl.calibrate_cli"]  # imported before parsing, for their @register
# Failures that are the user's input, reported in one line; command modules may append their own.
EXPECTED_ERRORS: list[type[BaseException]] = [ModelFileError, TraceError, FileNotFoundError, ValueError]


def register(add_fn: AddFn) -> AddFn:
    """Register ``add_<name>(subparsers)``; usable as a decorator. The subcommand is ``<name>``."""
    name = add_fn.__name__.removeprefix("add_").replace("_", "-")
    SUBCOMMANDS[name] = add_fn
    return add_fn


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes (pass as ``parents=[common_options()]``)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the full traceback")
    return parent


def build_parser() -> argparse.ArgumentParser:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(
        prog="autoddl", description="Plan, explain and run SBP parallelisations of PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="on an error, print the full traceback")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in sorted(SUBCOMMANDS):
        SUBCOMMANDS[name](subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``autoddl`` and ``python -m autoddl``; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and usage errors
        return int(exc.code or 0)
    try:
        return int(args.func(args) or 0)
    except tuple(EXPECTED_ERRORS) as exc:
        if args.debug:
            traceback.print_exc()
            details = getattr(exc, "details", "")
            if details:
                print(details, file=sys.stderr)
        print(f"autoddl: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError) and exc.filename:
        text = f"{exc.strerror or 'no such file'}: {exc.filename}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["n_layer=2", "name=gpt"]`` -> ``{"n_layer": 2, "name": "gpt"}`` (Python literals, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"--set expects key=value with a Python identifier as key, got {item!r}")
        try:
            out[key] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            out[key] = raw.strip()
    return out


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for build_model/example_inputs from ``--preset`` and ``--set``."""
    overrides = parse_overrides(args.set or [])
    if args.preset is not None:
        overrides["preset"] = args.preset
    return overrides


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``MODEL_PY [--preset NAME] [--set key=value ...]``, shared by commands that take a model file."""
    parser.add_argument("model_py", metavar="MODEL_PY",
                        help="model file defining build_model() and example_inputs()")
    parser.add_argument("--preset", metavar="NAME",
                        help="passed as preset=NAME to build_model() and example_inputs()")
    parser.add_argument("--set", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                        help="keyword arguments for build_model()/example_inputs(), e.g. --set n_layer=2")


# -- autoddl trace ---------------------------------------------------------------------------------
@register
def add_trace(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "trace", parents=[common_options()],
        help="trace a model file on the meta device and print its op table",
        description="Trace one training step's forward (loss included) on the meta device and print "
                    "every op with its output shape, forward GFLOPs, MB moved and parameters.")
    add_model_options(p)
    p.add_argument("--top", type=int, metavar="N",
                   help="show only the N ops with the most FLOPs (default: every op, in execution order)")
    p.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    if args.top is not None and args.top < 1:
        raise ValueError(f"--top must be a positive number of ops, got {args.top}")
    mf = load_model_file(args.model_py, **model_overrides(args))
    start = time.perf_counter()
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn, name=mf.name)
    trace_s = time.perf_counter() - start
    ops = graph.ops()
    shown = sorted(ops, key=lambda n: -n.flops)[: args.top] if args.top else ops
    rows = [(n.name, n.op_name, "x".join(map(str, n.outputs[0].shape)) if n.outputs else "-",
             f"{n.flops / 1e9:.6f}", f"{(n.bytes_read + n.bytes_written) / 1e6:.3f}",
             ",".join(n.params) or "-") for n in shown]
    print(_table(("op", "target", "output shape", "GFLOPs", "MB", "parameters"), rows))
    if args.top and len(shown) < len(ops):
        print(f"(top {len(shown)} of {len(ops)} ops by FLOPs)")
    print()
    print(f"model:      {mf.name} ({mf.path})")
    print(f"ops:        {len(ops)}")
    print(f"parameters: {graph.parameter_count:,} ({graph.parameter_bytes / 1e6:,.1f} MB)")
    print(f"GFLOPs:     {graph.total_flops / 1e9:,.6f} forward (loss included)")
    print(f"trace:      {trace_s:.2f} s")
    return 0


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    numeric = {3, 4}
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = []
    for row in (header, *rows):
        cells = [str(c).rjust(w) if i in numeric else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
