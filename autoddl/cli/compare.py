"""``autoddl compare``: every scheme's predicted breakdown as a table, a CSV and a chart; with
``--variants``, each precision x recompute variant of the found plan and the baselines."""

from __future__ import annotations

import argparse
import dataclasses

import pandas as pd

from autoddl.api import schemes_frame
from autoddl.cli import common_options, register, table
from autoddl.cli.plan import _add_search_options, _graphs_by_scheme, _search, _Tracer, training_of
from autoddl.cli.plan_tables import (MEMORY_PARTS, memory_cells, memory_header, rate, rate_column,
                                     recompute_label, print_schemes)
from autoddl.training import RECOMPUTE_POLICIES
from search.planner import Scheme, SearchOutcome
from search.problem import NoFeasiblePlanError

VARIANT_PRECISIONS = ("fp32", "bf16")          # compare --variants: precision x recompute
VARIANT_RECOMPUTE = RECOMPUTE_POLICIES         # none, selective, full
NO_LIMIT_GB = 1e9                              # a variant nothing fits in is shown searched without a limit


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
                   "precision": s.plan.training.param_dtype, "recompute": recompute_label(s.plan, None),
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
    print_schemes(result.schemes, _graphs_by_scheme(result), args.memory_breakdown)
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
                             f"{bd.step_time_s * 1e3:.3f}", rate(s.plan))
                            + memory_cells(bd, args.memory_breakdown) + ("yes" if bd.fits_memory else "NO",))
            df = _frame(result.schemes)
            df.insert(0, "variant", label)
            frames.append(df)
    header = ("variant", "scheme", "mesh", "step ms", rate_column(result.schemes)) + \
        memory_header(args.memory_breakdown) + ("fits",)
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
