"""The ``autoddl`` command line, the top layer: one module per command, over the API.

Each command module (``autoddl.cli.trace``, ``plan``, ``compare``, ``explain``,
``run``, ``calibrate``, ``schedule``) only parses arguments and prints; the work is done by
the API-level modules below it (``autoddl.api``, ``autoddl.runs``,
``autoddl.calibration``). A subcommand is registered with :func:`register`; its
add function creates its parser (``subparsers.add_parser(name,
parents=[common_options()])``) and sets ``func``, a function ``(args) -> int``
returning the exit code. Modules listed in ``COMMAND_MODULES`` are imported by
:func:`build_parser` so that their ``@register`` calls run. Expected failures (bad model file, untraceable model,
bad option) print one line ``autoddl: error: ...`` and exit 2; ``--debug``
prints the traceback too.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import traceback
from typing import Any, Callable, Sequence

from autoddl.loader import ModelFileError, parse_overrides
from autoddl.trace import TraceError

AddFn = Callable[["argparse._SubParsersAction"], None]

SUBCOMMANDS: dict[str, AddFn] = {}
# imported before parsing, for their @register
COMMAND_MODULES: list[str] = ["autoddl.cli.trace", "autoddl.cli.plan", "autoddl.cli.compare", "autoddl.cli.explain",
                              "autoddl.cli.run", "autoddl.cli.calibrate", "autoddl.cli.schedule"]
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


# A command builds millions of small objects that live until it ends (graph nodes, layouts, program
# tasks) and makes few reference cycles; under the default gen-0 threshold (700 allocations) the cyclic
# collector walked them again and again: ~15% of the CPU time of re-planning Llama-3-8B on 8x8
# (2.45 -> 2.1 s with this threshold and the traced graph frozen, autoddl/cli/plan.py, unless the caller
# had frozen objects of its own). Both restored on return.
PLANNING_GC_THRESHOLD = (100_000, 50, 50)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``autoddl`` and ``python -m autoddl``; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and usage errors
        return int(exc.code or 0)
    threshold = gc.get_threshold()
    gc.set_threshold(*PLANNING_GC_THRESHOLD)
    args.gc_freeze = gc.get_freeze_count() == 0     # a caller's own frozen objects are left as they were
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
    finally:
        if args.gc_freeze:
            gc.unfreeze()
        gc.set_threshold(*threshold)


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError) and exc.filename:
        text = f"{exc.strerror or 'no such file'}: {exc.filename}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


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
    # one KEY=VALUE per --set (a list of them would swallow MODEL_PY when --set comes first)
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="a keyword argument for build_model()/example_inputs(), JSON value or string, "
                             "e.g. --set n_layer=2; repeat for more")


def table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = (3, 4)) -> str:
    """A plain-text table: columns padded to their widest cell, ``numeric`` columns right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = []
    for row in (header, *rows):
        cells = [str(c).rjust(w) if i in numeric else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
