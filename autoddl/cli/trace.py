"""``autoddl trace MODEL_PY``: the traced op table of a model file."""

from __future__ import annotations

import argparse
import time

from autoddl.cli import add_model_options, common_options, model_overrides, register, table
from autoddl.loader import load_model_file
from autoddl.ops import coverage_report
from autoddl.trace import trace


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
    print(table(("op", "target", "output shape", "GFLOPs", "MB", "parameters"), rows))
    if args.top and len(shown) < len(ops):
        print(f"(top {len(shown)} of {len(ops)} ops by FLOPs)")
    print()
    print(f"model:      {mf.name} ({mf.path})")
    print(f"ops:        {len(ops)}")
    print(f"parameters: {graph.parameter_count:,} ({graph.parameter_bytes / 1e6:,.1f} MB)")
    print(f"GFLOPs:     {graph.total_flops / 1e9:,.6f} forward (loss included)")
    print(f"trace:      {trace_s:.2f} s")
    for line in coverage_report(graph).lines():
        print(f"warning:    {line}")
    return 0
