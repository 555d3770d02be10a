"""``autoddl plan --pipeline``: search/pipeline_search.py's 3-D search, its best fast estimates priced
by the full cost model."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.training import Training
from search.pipeline_search import FULL_PRICES, best_fitting, search_3d
from search.planner import Scheme, inner_tp_plan, price_degrees
from search.problem import NoFeasiblePlanError

if TYPE_CHECKING:
    from autoddl.cli.plan import _Tracer

FIT_RETRIES = 3                                # estimates priced in full after the best, while none fits


def search_pipeline(args: argparse.Namespace, tracer: "_Tracer", planned: Cluster, training: Training, progress
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
