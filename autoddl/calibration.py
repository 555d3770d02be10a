"""Calibration: measure this machine and make a cluster whose numbers come from it (``autoddl calibrate``).

    meas, cal = calibrate(Cluster.from_yaml(DEFAULT_BASE), Settings.default(2, "gloo"))
    cal.write("configs/local-cpu.yaml")

``executor.calibrate.measure`` times matmuls, memory bandwidth, per-op overhead and
every collective on ``--nproc`` ranks, ``--launches`` times (3 for a full calibration; each timing
the median over the launches, ``executor.calibrate.median_of_launches``); :func:`calibrate_cluster`
turns the timings into a ``Cluster``:

- ``device.peak_tflops``: per dtype (float32, bfloat16, float16 where it runs at a
  sane speed), the best matmul rate on the same shapes (per-op dispatch taken out);
  ``efficiency.compute``: what float32 matmuls of 1 GFLOP or more reach of the float32
  peak; ``compute_curve``: float32 efficiency by matmul size (read for every dtype);
- ``device.memory_bandwidth_gbps``: the best of copy / add over large arrays
  (achieved, so ``efficiency.memory`` is 1);
- ``op_overhead_us``: a tiny op's dispatch and autograd recording;
- ``links.intra_node``: per collective kind, ``costmodel.collectives.fit_collective``
  fits latency and bandwidth so that the cost model's formula reproduces the timings;
  the link gets the median over kinds (``efficiency.network`` is 1), and when a kind
  differs from it by more than 20% every kind's fit goes into ``collectives``;
- ``collectives.send_recv``: the same fit of one point-to-point send (half an isend / irecv
  ping-pong between two ranks; ``M/b + a``), always written: it prices a send inside a node
  (``costmodel.collectives.send_recv_time_s``); it is not part of the link's median.

- ``matmul_layouts``: for a dtype whose peak is more than ``SLOW_DTYPE_FACTOR`` below float32's (kept
  by ``--keep-slow-dtypes``: the device emulates it), its matmuls by operand layout over a grid of
  sizes (executor/calibrate_layouts.py; :func:`with_matmul_layouts`; ``--only matmul_layouts`` over
  ``--base``: :func:`calibrate_matmul_layouts`).

``--only KINDS`` (``Settings.comm_only``) times those communication kinds alone and writes
``--base`` with their fits put into ``collectives`` (:func:`calibrate_fits`), its other fields,
header and comments kept.

Fields not measured (name, device name and kind, nodes, inter-node link) come from
``--base``; every measured number gets a comment saying what was measured.
An API-level module (it imports ``costmodel`` and ``executor``); the command line
is ``autoddl.cli.calibrate``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from autoddl.cluster import (COLLECTIVE_KINDS, CONFIG_DIR, Backend, Cluster, CollectiveFits, Efficiency, LinkSpec,
                            RecomputeCost, yaml_comments)
from autoddl.collective_points import CollectivePoints, measured_points
from autoddl.loader import load_model_file
from autoddl.machine import this_machine
from autoddl.pipeline import stages_from_cuts
from autoddl.shard_program import BACKWARD, TaskKey, param_homes
from costmodel.collectives import CollectiveFit, CollectiveKind, fit_collective
from executor.calibrate import (LARGE_MATMUL_FLOPS, SLOW_DTYPE_FACTOR, CollectiveTiming, ComputeSummary, Measurements,
                                Settings, compute_summary, executor_glue_us, measure_launches, with_arrival_skew,
                                with_executor_overheads)
from executor.calibrate_layouts import LAYOUT_SIZES, MIN_TIME_S, QUICK_LAYOUT_SIZES, measure_matmul_layouts
from executor.calibrate_models import CHAIN_WIDTH, PROBE_SIZES
from executor.calibrate_shards import SHARD_CHAIN, ShardTaskSample, fit_shard_runner, measure_shard_tasks
from executor.shard_chain import WIDTH
from search.shards import shard_job

DEFAULT_BASE = CONFIG_DIR / "local-cpu.yaml"
DISAGREEMENT = 0.20          # a kind whose fit differs from the link by more than this gets its own entry
LATENCY_FLOOR_US = 5.0       # latencies within this many microseconds agree, whatever their ratio


MIN_R2 = 0.5   # a collective fit explaining less of its timings' variance than this is refused


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (readable YAML, no false precision)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


# -- fits ----------------------------------------------------------------------------------------
def fit_collectives(timings: Sequence[CollectiveTiming], backend: Backend | str,
                    failed: dict[str, str] | None = None, min_r2: float = MIN_R2) -> dict[str, CollectiveFit]:
    """One :class:`CollectiveFit` per timed kind, over every axis size and message size.

    A kind whose timings cannot be fitted (too noisy: they do not grow with the message
    size) or whose fit explains them worse than ``min_r2`` (R^2) is left out, with a warning
    on stderr and its reason in ``failed``; raises when no kind can be fitted.
    """
    by_kind: dict[str, list[tuple[int, float, float]]] = {}
    for t in timings:
        by_kind.setdefault(t.kind, []).append((t.n_devices, t.nbytes, t.time_s))
    fits, reasons = {}, {}
    for kind, samples in by_kind.items():
        try:
            fit = fit_collective(CollectiveKind(kind), backend, samples)
        except ValueError as exc:
            reasons[kind] = str(exc)
            continue
        if fit.r2 < min_r2:
            reasons[kind] = (f"its fit has R^2 {fit.r2:.2f} < {min_r2:g} (--min-r2): the timings are too noisy to "
                             "trust; run calibrate again on an idle machine")
            print(f"calibrate: warning: {kind} not used: {reasons[kind]}", file=sys.stderr)
            continue
        fits[kind] = fit
    if failed is not None:
        failed.update(reasons)
    if not fits:
        raise ValueError("calibrate: no collective could be fitted: " + "; ".join(reasons.values())
                         + ". The machine may be too busy: run again when it is idle")
    return fits


def combined_link(fits: dict[str, CollectiveFit]) -> LinkSpec:
    """The link's numbers: the median over kinds of the fitted latency and of the fitted bandwidth."""
    if not fits:
        raise ValueError("combined_link: no collective fits")
    return LinkSpec(bandwidth_gbps=statistics.median(f.bandwidth_gbps for f in fits.values()),
                    latency_us=statistics.median(f.latency_us for f in fits.values()))


def disagreeing_kinds(fits: dict[str, CollectiveFit], link: LinkSpec, tolerance: float = DISAGREEMENT) -> list[str]:
    """Kinds whose fitted bandwidth or latency differs from ``link`` by more than ``tolerance`` (relative)."""
    out = []
    for kind, f in fits.items():
        bw = abs(f.bandwidth_gbps - link.bandwidth_gbps) / link.bandwidth_gbps
        lat = abs(f.latency_us - link.latency_us) / max(link.latency_us, LATENCY_FLOOR_US)
        if bw > tolerance or lat > tolerance:
            out.append(kind)
    return out


@dataclass(frozen=True)
class Calibration:
    """A measured cluster, the comments and header its YAML gets, and the fits behind it."""

    cluster: Cluster
    comments: dict[str, str]
    header: str
    fits: dict[str, CollectiveFit]
    compute: ComputeSummary | None          # None: only communication was timed (calibrate_fits)

    def write(self, path: str | os.PathLike) -> None:
        self.cluster.to_yaml(path, comments=self.comments, header=self.header)

    @classmethod
    def of_file(cls, path: str | os.PathLike) -> "Calibration":
        """The cluster file at ``path`` with its header and comments, to write again with some fields measured."""
        header, comments = yaml_comments(path)
        return cls(Cluster.from_yaml(path), comments, header, {}, None)


def _total_memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0



CPU_HOST_COMMENTS = {
    "host_link": "host and device are the same RAM on a CPU: a spill is a tensor copy",
    "host_link.bandwidth_gbps": "measured: copy over large arrays (bytes read + written) / 2, per rank",
    "host_link.latency_us": "measured: op_overhead_us, one copy_ call's dispatch",
    "host_memory_gb": "measured: the machine's RAM (shared with the devices on a CPU)",
    "host_memory_bandwidth_gbps": "measured: best of copy / add per rank x ranks at once",
}


def cpu_host(base: Cluster, meas: "Measurements", ram_gb: float, mem_gbps: float, nproc: int) -> dict:
    """The host fields of a CPU cluster from the memory measurement (CPU_HOST_COMMENTS); none for a GPU."""
    if base.device.kind != "cpu":
        return {}
    copy_gbps = meas.memory_gbps.get("copy", mem_gbps) / 2
    return {"host_link": LinkSpec(_sig(copy_gbps), _sig(meas.op_overhead_us, 3)), "host_memory_gb": _sig(ram_gb, 3),
            "host_memory_bandwidth_gbps": _sig(mem_gbps * nproc)}


def _require_cuda_base(base: Cluster) -> None:
    if base.device.kind != "cuda":
        raise ValueError(f"calibrate --backend nccl: the base cluster {base.source or base.name} has a "
                         f"{base.device.kind} device; pass --base with a cuda device (e.g. configs/dgx-a100-8.yaml)")


@dataclass(frozen=True)
class CommFits:
    """What the communication timings give: every kind's fit, the kinds that could not be fitted (why),
    the intra-node link (median over the collectives; a send is no collective), the collectives that
    disagree with it, and the ``collectives`` entries to write (every collective's when one disagrees,
    send_recv's always: it is the only price of a point-to-point send)."""

    fits: dict[str, CollectiveFit]
    failed: dict[str, str]
    link: LinkSpec | None
    odd: list[str]
    per_kind: dict[str, LinkSpec]

    @classmethod
    def of(cls, meas: Measurements, backend: Backend, min_r2: float) -> "CommFits":
        failed: dict[str, str] = {}
        fits = fit_collectives(meas.collectives, backend, failed, min_r2)
        colls = {k: f for k, f in fits.items() if k in COLLECTIVE_KINDS}
        link = _rounded_link(combined_link(colls)) if colls else None
        odd = disagreeing_kinds(colls, link) if link else []
        per_kind = {k: _rounded_link(f.link) for k, f in colls.items()} if odd else {}
        per_kind.update({k: _rounded_link(f.link) for k, f in fits.items() if k not in COLLECTIVE_KINDS})
        return cls(fits, failed, link, odd, per_kind)


def _rounded_link(link: LinkSpec) -> LinkSpec:
    return LinkSpec(bandwidth_gbps=_sig(link.bandwidth_gbps), latency_us=_sig(link.latency_us))


def _ranks_text(s: Settings, launches: int = 1) -> str:
    """How the ranks ran, and over how many launches a timing is the median (:func:`measure_launches`)."""
    launches = f"; each timing the median of {launches} launches" if launches > 1 else ""
    return f"{s.nproc} ranks at once, {s.threads} thread{'s' * (s.threads > 1)} each{launches}"


def _header(meas: Measurements, comm: CommFits, command: str, notes: Sequence[str] = ()) -> str:
    """The YAML's header: the command, machine, time per benchmark, one line per fit or failed kind."""
    s = meas.settings
    lines = [f"Measured by `{command or 'autoddl calibrate'}` on {time.strftime('%Y-%m-%d %H:%M')}",
             f"on {meas.machine}; {_ranks_text(s, meas.launches)}; {meas.seconds.get('total', 0):.0f} s ("
             + ", ".join(f"{k} {v:.0f} s" for k, v in meas.seconds.items() if k != "total") + ").",
             "Units are in the field names: *_gbps = GB/s (1e9 bytes/s, per device, one direction), "
             "*_us = microseconds."]
    if comm.fits or comm.failed:
        lines.append(f"Collective fits ({s.backend}; t = formula of costmodel.collectives with latency a, "
                     "bandwidth b):")
    lines += [f"  {k}: {_fit_text(f, meas)}" for k, f in comm.fits.items()]
    lines += [f"  {k}: not fitted, left to links.intra_node: {why}" for k, why in comm.failed.items()]
    return "\n".join(lines + list(notes))


def _measured_comments(meas: Measurements, base: Cluster, comp: ComputeSummary, comm: CommFits, dpn: int,
                       memory_gb: float, mem_kind: str) -> dict[str, str]:
    """Each measured field's comment (what was measured, how)."""
    s = meas.settings
    largest = comp.points[-1][0]
    n_large = sum(1 for mt, _ in comp.points if mt.flops >= LARGE_MATMUL_FLOPS)
    sizes = sorted({t.nbytes for t in meas.collectives})
    axes = sorted({t.n_devices for t in meas.collectives})
    span = f"{sizes[0] / 1024:g} KB .. {sizes[-1] / 2**20:g} MB, axis size{'s' * (len(axes) > 1)} " \
           f"{', '.join(map(str, axes))}, median of {s.repeats}"
    colls = [k for k in comm.fits if k in COLLECTIVE_KINDS]
    comments = {
        "devices_per_node": (f"ranks on this machine; calibrated with {s.nproc}"
                             + (f"; above {s.nproc} ranks they share cores (slower compute and collectives "
                                f"than measured)" if dpn > s.nproc else "")),
        "device.peak_tflops": (f"measured: best matmul rate per dtype over the same {len(comp.points)} shapes "
                               f"(per-op dispatch {meas.dispatch_us:.1f} us taken out), {_ranks_text(s, meas.launches)}"
                               + "".join(f"; no {d} peak: {why}" for d, why in meas.dropped_dtypes.items())
                               + "".join(f"; {d} kept though slow (--keep-slow-dtypes): {why} at worst"
                                         for d, why in meas.slow_dtypes.items())),
        "device.memory_gb": (f"measured: {_total_memory_gb():.1f} GB RAM / {dpn} devices"
                             if memory_gb != base.device.memory_gb or base.device.kind == "cpu" else "from base"),
        "device.memory_bandwidth_gbps": (
            f"measured: {mem_kind} over {s.memory_bytes >> 20} MB arrays (bytes read + written), per rank with "
            f"{_ranks_text(s, meas.launches)}; " + ", ".join(f"{k} {v:.2f}" for k, v in meas.memory_gbps.items())),
        "links.intra_node": (f"fitted: median over the {len(colls)} collective kinds of the per-kind fits below "
                             f"({s.backend}, {span})"),
        "efficiency.compute": ((f"measured: median efficiency of the {n_large} matmuls of >= "
                                f"{LARGE_MATMUL_FLOPS / 1e9:g} GFLOP" if n_large else
                                f"measured: efficiency of the largest matmul ({largest.m}x{largest.k}x{largest.n})")
                               + " (compute_curve is used instead when present)"),
        "efficiency.memory": "1: memory_bandwidth_gbps is already the achieved bandwidth",
        "efficiency.network": "1: the link and collectives numbers are achieved (fitted) values",
        "op_overhead_us": f"measured: add of 1-element tensors needing grad {meas.tiny_op_us:.1f} us, per rank",
        "compute_curve": "measured: matmul efficiency (of peak_tflops) by GFLOPs per matmul",
        "links.inter_node": ("not measured (one node): same as intra_node, for resized()"
                             if base.nodes == 1 else "from base: not measured on one machine"),
    }
    if base.device.kind == "cpu":
        comments.update(CPU_HOST_COMMENTS)
    if comm.per_kind:
        comments["collectives"] = ((f"per-kind fits ({', '.join(comm.odd)} differ from the link by > "
                                    f"{DISAGREEMENT:.0%}); " if comm.odd else "")
                                   + "used instead of links.intra_node (send_recv: for a send inside a node)")
        comments.update({f"collectives.{k}": _fit_text(comm.fits[k], meas) for k in comm.per_kind})
    for dtype, _, mt in comp.dtype_peaks:
        comments[f"device.peak_tflops.{dtype}"] = (f"measured: best {dtype} matmul rate, {mt.m}x{mt.k} @ "
                                                   f"{mt.k}x{mt.n}")
    for i, group in enumerate(comp.groups):
        comments[f"compute_curve.{i}"] = "M x K x N: " + ", ".join(f"{mt.m}x{mt.k}x{mt.n}" for mt in group)
    return comments


def calibrate_cluster(meas: Measurements, base: Cluster, devices_per_node: int | None = None,
                      command: str = "", min_r2: float = MIN_R2) -> Calibration:
    """Turn ``meas`` into a cluster: measured fields replaced, the rest from ``base`` (module docstring).
    Timings of the communication kinds alone (``Settings.comm_only``): :func:`calibrate_fits`."""
    s = meas.settings
    if s.comm_only:
        return calibrate_fits(meas, base, devices_per_node, command, min_r2)
    backend = Backend(s.backend)
    if backend is Backend.NCCL:
        _require_cuda_base(base)
    dpn = devices_per_node or max(base.devices_per_node, s.nproc)
    if dpn < s.nproc:
        raise ValueError(f"calibrate: --devices-per-node {dpn} is less than --nproc {s.nproc}")
    comp = compute_summary(meas.matmuls, meas.dispatch_us * 1e-6, meas.dtype_matmuls)
    mem_kind, mem_gbps = max(meas.memory_gbps.items(), key=lambda kv: kv[1])
    memory_gb = base.device.memory_gb
    if base.device.kind == "cpu" and _total_memory_gb() > 0:
        memory_gb = _sig(_total_memory_gb() / dpn, 3)
    comm = CommFits.of(meas, backend, min_r2)
    timed = timed_points(meas)
    if comm.link is None:
        raise ValueError("calibrate: no collective could be fitted (only " + ", ".join(comm.fits)
                         + "): the link needs one; run again when the machine is idle")
    link = dataclasses.replace(comm.link, cpu_ns_per_byte=base.intra_node.cpu_ns_per_byte)   # measured apart
    cluster = dataclasses.replace(
        base, devices_per_node=dpn, backend=backend,
        device=dataclasses.replace(base.device, peak_tflops={d: _sig(p) for d, p in comp.peaks.items()},
                                   memory_gb=memory_gb, memory_bandwidth_gbps=_sig(mem_gbps)),
        intra_node=link, inter_node=link if base.nodes == 1 else base.inter_node,
        efficiency=Efficiency(compute=_sig(min(1.0, comp.large_efficiency), 3), memory=1.0, network=1.0),
        op_overhead_us=_sig(meas.op_overhead_us, 3), collectives=CollectiveFits(**comm.per_kind),
        collective_points=base.collective_points.merged(timed),
        compute_curve=comp.curve, source="", **cpu_host(base, meas, _total_memory_gb() or memory_gb * dpn, mem_gbps, s.nproc),
        calibrated_on=this_machine() if base.device.kind == "cpu" else base.calibrated_on)
    comments = {**_measured_comments(meas, base, comp, comm, dpn, memory_gb, mem_kind),
                **_points_comments(meas, timed)}
    if base.device.kind == "cpu":
        comments["calibrated_on"] = ("the machine measured (autoddl/machine.py); `autoddl run` and the benchmarks "
                                     "say so when they run on another")
    if link.cpu_ns_per_byte:
        comments["links.intra_node.cpu_ns_per_byte"] = ("kept from the base file: measured apart by `autoddl "
                                                        "calibrate --only collective_cpu`")
        if base.nodes == 1:
            comments["links.inter_node.cpu_ns_per_byte"] = "as links.intra_node (one node)"
    notes = [f"devices_per_node {dpn} > {s.nproc} calibrated ranks: with more ranks than {s.nproc} they share "
             "cores, so compute and collectives run slower than these numbers."] if dpn > s.nproc else []
    cluster, comments = with_executor_overheads(cluster, comments, meas)
    cluster, comments = with_op_families(cluster, comments, meas)
    return Calibration(cluster=cluster, comments=comments, header=_header(meas, comm, command, notes),
                       fits=comm.fits, compute=comp)


def calibrate_fits(meas: Measurements, base: Cluster, devices_per_node: int | None = None, command: str = "",
                   min_r2: float = MIN_R2) -> Calibration:
    """``autoddl calibrate --only KINDS``: ``base`` with the fits of the timed kinds written into
    ``collectives`` (replacing the base's entries for those kinds) and ``devices_per_node`` when given;
    every other field, the links included, is the base's (the command line keeps the base file's
    header and comments: ``autoddl.cli.calibrate``); the timed medians go into ``collective_points``
    under the ranks that ran. On more ranks than the base's ``cores_per_node`` (they time-shared the
    cores) the fits are not taken: only the curves are written.
    """
    s = meas.settings
    if Backend(s.backend) is not base.backend:
        raise ValueError(f"calibrate --only: timed on {s.backend} but the base cluster {base.source or base.name} "
                         f"uses {base.backend.value}; pass --backend {base.backend.value} or another --base")
    timed = timed_points(meas)
    comments = _points_comments(meas, timed)
    shared = bool(base.cores_per_node) and s.nproc > base.cores_per_node   # the ranks time-shared the cores
    failed: dict[str, str] = {}
    fits = {} if shared else fit_collectives(meas.collectives, s.backend, failed, min_r2)
    entries = {**dict(base.collectives.items()), **{k: _rounded_link(f.link) for k, f in fits.items()}}
    executor, skew_comments = with_arrival_skew(base.executor, base.executor, meas)
    cluster = dataclasses.replace(base, collectives=CollectiveFits(**entries),
                                  collective_points=base.collective_points.merged(timed), source="",
                                  devices_per_node=devices_per_node or base.devices_per_node, executor=executor)
    comments.update({f"collectives.{k}": f"measured: {_fit_text(f, meas)}" for k, f in fits.items()})
    comments.update(skew_comments)
    comm = CommFits(fits, failed, None, [], {})
    if not shared:
        note = (f"Only {', '.join(s.kinds)} timed (--only)"
                + (f" and the ranks' arrival skew (executor.arrival_skew_us.ranks_{s.nproc})"
                   if meas.arrival_skew else "")
                + f"; every other field is from {base.source or base.name}.")
    else:
        note = (f"Only {', '.join(s.kinds)} timed (--only), on {s.nproc} ranks, more than cores_per_node "
                f"({base.cores_per_node}): their curves are in collective_points.ranks_{s.nproc} (what a mesh of "
                f"{s.nproc} ranks on a node pays for a collective its ranks wait for)"
                + (f", the ranks' arrival skew in executor.arrival_skew_us.ranks_{s.nproc}"
                   if meas.arrival_skew else "")
                + f"; the fits and every other field are from {base.source or base.name}.")
    return Calibration(cluster=cluster, comments=comments, header=_header(meas, comm, command, [note]),
                       fits=fits, compute=None)


def timed_points(meas: Measurements) -> CollectivePoints:
    """The timed collectives' medians as curves measured with ``settings.nproc`` ranks busy
    (autoddl/collective_points.py)."""
    return measured_points(((t.kind, t.n_devices, t.nbytes, t.time_s) for t in meas.collectives),
                           meas.settings.nproc, COLLECTIVE_KINDS)


def _points_comments(meas: Measurements, timed: CollectivePoints) -> dict[str, str]:
    """The comment on the curves this calibration wrote (``timed``: :func:`timed_points`; none when it
    timed no collective)."""
    s = meas.settings
    if not timed:
        return {}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {f"collective_points.ranks_{s.nproc}": (
        f"measured {when}: {_ranks_text(s, meas.launches)}, each group of a size running the collective at once, "
        f"back to back; median of {s.repeats} repetitions of the slowest rank, in microseconds by M bytes, made "
        "non-decreasing (autoddl/collective_points.py)")}


# -- op families and recompute: what the executor's ops really cost ---------------------------------
MIN_WORK = 0.1     # a family's work scale is at least this (its sizes may be too small to show the work)


@dataclass(frozen=True)
class FamilyFit:
    """One family in one dtype: fixed microseconds per op, forward and backward, and the work scales
    (``(roofline_us, forward, backward)`` points, :class:`autoddl.cluster.OpCost`)."""

    family: str
    dtype: str
    forward_us: float
    backward_us: float
    work: tuple[tuple[float, float, float], ...]
    sizes: tuple[str, ...]                    # smallest first
    times_us: tuple[tuple[float, float], ...]  # measured (forward, backward) per size


def _fixed_and_scales(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, list[float]]:
    """(fixed cost a, work scale per size from the second on) of times ``ts`` at roofline times ``xs``
    (microseconds, smallest first): ``a`` from the line through the two smallest sizes (the smallest
    is nearly all fixed cost), then each larger size's ``(t - a) / x``; scales at least MIN_WORK."""
    if len(xs) < 2 or xs[1] <= xs[0]:
        return max(0.0, statistics.median(ts)), [1.0] * (len(xs) - 1)
    first = max(MIN_WORK, (ts[1] - ts[0]) / (xs[1] - xs[0]))
    a = max(0.0, ts[0] - first * xs[0])
    return a, [max(MIN_WORK, (t - a) / x) for x, t in zip(xs[1:], ts[1:])]


def fit_op_families(meas: Measurements, cluster: Cluster) -> list[FamilyFit]:
    """Per (dtype, family), from its forward and backward times over the sizes against the cost model's
    roofline of the traced op on ``cluster`` (the calibrated device): a fixed cost and the work scale
    at each size but the smallest (:func:`_fixed_and_scales`); a view (no roofline): the median time,
    no scales. Microseconds of the op alone (:func:`with_op_families` adds the executor's own). A dtype
    the device has no peak for (its matmuls were too slow to train in: ``Bench.matmuls``) has no
    roofline, so its families are left out."""
    from autoddl.op_families import ZERO_COST
    from costmodel.compute import backward_factor, roofline_time_s

    groups: dict[tuple[str, str], list] = {}
    peaks = cluster.device.peaks if cluster.device.peaks_by_dtype else None
    for ft in meas.families:
        if peaks is None or ft.dtype in peaks:
            groups.setdefault((ft.dtype, ft.family), []).append(ft)
    out = []
    for (dtype, family), fts in groups.items():
        k = backward_factor(family)
        xf = [roofline_time_s(f.flops, f.nbytes, cluster, dtype=dtype) * 1e6 for f in fts]
        order = sorted(range(len(fts)), key=lambda i: xf[i])
        fts, xf = [fts[i] for i in order], [xf[i] for i in order]
        xb = [roofline_time_s(k * f.flops, k * f.nbytes, cluster, op_flops=f.flops, dtype=dtype) * 1e6 for f in fts]
        tf, tb = [f.forward_s * 1e6 for f in fts], [f.backward_s * 1e6 for f in fts]
        times = tuple(zip(tf, tb))
        sizes = tuple(f.size for f in fts)
        if family in ZERO_COST or k == 0:
            out.append(FamilyFit(family, dtype, statistics.median(tf), statistics.median(tb), (), sizes, times))
            continue
        af, wf = _fixed_and_scales(xf, tf)
        ab, wb = _fixed_and_scales(xb, tb)
        out.append(FamilyFit(family, dtype, af, ab, tuple(zip(xf[1:], wf, wb)), sizes, times))
    return out


def with_op_families(cluster: Cluster, comments: dict[str, str], meas: Measurements) -> tuple[Cluster, dict[str, str]]:
    """``cluster`` with ``executor.op_us`` / ``op_work`` (each family's fit, its fixed part plus what the
    executor adds to an op beyond the op itself: ``executor.calibrate.executor_glue_us``) and
    ``executor.recompute`` (``executor.calibrate.fit_recompute``);
    comments to match. Unchanged when neither was timed."""
    from executor.calibrate import fit_recompute

    if not meas.families and not meas.recompute:
        return cluster, comments
    ex, out = cluster.executor, dict(comments)
    op_us: dict[str, dict[str, tuple[float, float]]] = {}
    op_work: dict[str, dict[str, tuple[float, float]]] = {}
    if meas.families:
        glue = executor_glue_us(meas.executor) if meas.executor is not None else None
        glue_f, glue_b = glue or (0.0, 0.0)
        fits = fit_op_families(meas, cluster)
        for f in fits:
            op_us.setdefault(f.dtype, {})[f.family] = (_sig(f.forward_us + glue_f, 3), _sig(f.backward_us + glue_b, 3))
            if f.work:
                op_work.setdefault(f.dtype, {})[f.family] = tuple((_sig(x, 4), _sig(a, 3), _sig(b, 3))
                                                                 for x, a, b in f.work)
            out[f"executor.op_us.{f.dtype}.{f.family}"] = (
                f"sizes {', '.join(f.sizes)}: " + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in f.times_us)
                + " us forward/backward")
        sizes = sorted({ft.size for ft in meas.families}, key=list(PROBE_SIZES).index)
        dtypes = list(dict.fromkeys(f.dtype for f in fits))
        out["executor.op_us"] = (
            f"measured: per op family and compute dtype ({', '.join(dtypes)}), [forward_us, backward_us] fixed "
            f"per op: each family's op (executor.calibrate Probe) on synthetic inputs at sizes "
            f"{', '.join(sizes)} (the ops of a size in turn, each call timed alone, their outputs kept to the end "
            f"of the pass), forward with autograd recording, backward of its autograd node, median of "
            f"{meas.settings.family_passes} passes; fixed: the line through the two smallest sizes at roofline 0 "
            f"(op_work: (t - fixed) / roofline at each larger size); plus the executor's own "
            + (f"per-op cost beyond the op ({glue_f:.1f} us forward, {glue_b:.1f} us backward: the executor's chains "
               "of element-wise ops less the same chains as plain modules, per op)" if glue else
               "per-op cost: not timed, 0"))
        out["executor.op_work"] = ("measured: per op family and dtype, [roofline_us, forward_work, backward_work] at "
                                   "each size but the smallest: the op's forward roofline time and the multiples of "
                                   f"the roofline its forward and backward take beyond the fixed cost (at least "
                                   f"{MIN_WORK:g})")
    recompute = {}
    if meas.recompute:
        recompute = {p: RecomputeCost(**{k: _sig(v, 3) for k, v in dataclasses.asdict(c).items()})
                     for p, c in fit_recompute(meas.recompute).items()}
        lengths = sorted({t.ops for t in meas.recompute})
        out["executor.recompute"] = (
            f"measured: blocks of {' and '.join(map(str, lengths))} element-wise ops and of as many linears "
            f"({CHAIN_WIDTH} -> {CHAIN_WIDTH} with a bias, on 3-D inputs: 4 aten ops each) run plainly and under the "
            "executor's checkpoint (full, selective); per op "
            "the slopes' differences (backward: beyond running the op again), per block the intercepts'")
    ex = dataclasses.replace(ex, op_us=op_us or ex.op_us, op_work=op_work or ex.op_work,
                             recompute=recompute or ex.recompute)
    return dataclasses.replace(cluster, executor=ex), out


def _fit_text(f: CollectiveFit, meas: Measurements) -> str:
    how = next((t.how for t in meas.collectives if t.kind == f.kind.value), "")
    return (f"a {f.latency_us:.1f} us, b {f.bandwidth_gbps:.3f} GB/s, {f.carried_as.value} formula, "
            f"{f.points} points, R^2 {f.r2:.4f}, max rel residual {f.max_rel_residual:.0%} ({how})")


def write_raw(meas: Measurements, path: str | os.PathLike) -> None:
    """Every timing as CSV rows ``benchmark, what, n_devices, bytes_or_flops, time_s``."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["benchmark", "what", "n_devices", "bytes_or_flops", "time_s"])
        for mt in meas.matmuls:
            w.writerow(["matmul", f"{mt.m}x{mt.k}x{mt.n}", 1, int(mt.flops), mt.time_s])
        for dtype, timings in meas.dtype_matmuls.items():
            for mt in timings:
                w.writerow(["matmul", f"{dtype} {mt.m}x{mt.k}x{mt.n}", 1, int(mt.flops), mt.time_s])
        for t in meas.collectives:
            w.writerow(["collective", f"{t.kind}: {t.how}", t.n_devices, t.nbytes, t.time_s])
        for k, v in meas.memory_gbps.items():
            w.writerow(["memory_gbps", k, 1, meas.settings.memory_bytes, v])
        if not meas.settings.comm_only:
            w.writerow(["overhead_us", "tiny add", 1, 0, meas.dispatch_us])
            w.writerow(["overhead_us", "tiny add with grad", 1, 0, meas.tiny_op_us])
        for ft in meas.families:            # one row per direction; bytes_or_flops: the op's FLOPs
            w.writerow(["family", f"{ft.dtype} {ft.family} {ft.size} forward", 1, ft.flops, ft.forward_s])
            w.writerow(["family", f"{ft.dtype} {ft.family} {ft.size} backward", 1, ft.flops, ft.backward_s])
        for rt in meas.recompute:
            w.writerow(["recompute", f"{rt.kind} {rt.policy} {rt.ops} ops forward", 1, 0, rt.forward_s])
            w.writerow(["recompute", f"{rt.kind} {rt.policy} {rt.ops} ops step", 1, 0, rt.step_s])


def calibrate(base: Cluster, settings: Settings, devices_per_node: int | None = None,
              command: str = "", min_r2: float = MIN_R2) -> tuple[Measurements, Calibration]:
    """Measure this machine with ``settings`` (``executor.calibrate.measure``) and fit a cluster over ``base``."""
    if devices_per_node is not None and devices_per_node < 1:
        raise ValueError(f"--devices-per-node must be a positive integer, got {devices_per_node}")
    if settings.backend == Backend.NCCL.value:
        import torch

        _require_cuda_base(base)
        if torch.cuda.device_count() < settings.nproc:
            raise ValueError(f"calibrate --backend nccl needs one GPU per rank: --nproc {settings.nproc}, "
                             f"{torch.cuda.device_count()} GPUs visible; use --backend gloo or a smaller --nproc")
    meas = measure_launches(settings)
    cal = calibrate_cluster(meas, base, devices_per_node, command, min_r2)
    return meas, cal if settings.comm_only else with_matmul_layouts(with_shard_runner(cal, settings), settings)


# -- an emulated dtype's matmuls by operand layout (autoddl/matmul_layouts.py) ------------------------
def emulated_dtypes(cluster: Cluster) -> tuple[str, ...]:
    """The dtypes whose peak is more than ``SLOW_DTYPE_FACTOR`` below float32's (kept by
    ``--keep-slow-dtypes``): the device has no instructions for them."""
    f32 = cluster.device.peak_tflops_for("float32")
    return tuple(d for d, p in cluster.device.peaks_by_dtype if d != "float32" and p * SLOW_DTYPE_FACTOR < f32)


def with_matmul_layouts(cal: Calibration, settings: Settings, dtypes: Sequence[str] | None = None) -> Calibration:
    """``cal`` with ``matmul_layouts`` measured for ``dtypes`` (default :func:`emulated_dtypes`; unchanged
    when there are none): executor/calibrate_layouts.py on ``settings.nproc`` ranks, ``settings.launches``
    launches."""
    dtypes = tuple(emulated_dtypes(cal.cluster) if dtypes is None else dtypes)
    if not dtypes:
        return cal
    sizes = QUICK_LAYOUT_SIZES if settings.quick else LAYOUT_SIZES
    rows = measure_matmul_layouts(dtypes, settings.nproc, settings.threads, sizes, settings.launches,
                                  settings.timeout_s, settings.verbose)
    cluster = dataclasses.replace(cal.cluster, matmul_layouts={**cal.cluster.matmul_layouts.to_dict(), **rows})
    comments = {k: v for k, v in cal.comments.items() if k.split(".")[:2] not in [["matmul_layouts", d] for d in dtypes]}
    comments["matmul_layouts"] = ("measured: matmuls of an emulated dtype by operand layout, rows [m, k, n, NN us, "
                                  "NT us, TN us] of (m, k) @ (k, n), T a transposed view, per-call dispatch taken "
                                  "out (executor/calibrate_layouts.py; priced: autoddl/matmul_layouts.py)")
    for d in dtypes:
        comments[f"matmul_layouts.{d}"] = (f"{_ranks_text(settings, settings.launches)}; median of single calls "
                                           f"over >= {MIN_TIME_S * 1e3:g} ms (3-30 calls); m, k, n each of "
                                           f"{list(sizes)}")
    return dataclasses.replace(cal, cluster=cluster, comments=comments)


def calibrate_matmul_layouts(base_path: str | os.PathLike, settings: Settings, command: str = "",
                             dtypes: Sequence[str] | None = None) -> Calibration:
    """``autoddl calibrate --only matmul_layouts``: the cluster file at ``base_path`` with ``matmul_layouts``
    measured for ``dtypes`` (default: its emulated ones), its header and every other comment kept."""
    base = Calibration.of_file(base_path)
    dtypes = tuple(emulated_dtypes(base.cluster) if dtypes is None else dtypes)
    if not dtypes:
        raise ValueError(f"calibrate --only matmul_layouts: {base_path} gives no dtype a peak more than "
                         f"{SLOW_DTYPE_FACTOR:g}x below float32's (an emulated one); name the dtypes with --dtypes, "
                         "or calibrate one in first with --dtypes DTYPE --keep-slow-dtypes")
    note = (f"matmul_layouts: measured by `{command or 'autoddl calibrate --only matmul_layouts'}` on "
            f"{time.strftime('%Y-%m-%d %H:%M')}, only this field.")
    header = "\n".join([line for line in base.header.splitlines() if not line.startswith("matmul_layouts:")]
                       + [note])
    return with_matmul_layouts(dataclasses.replace(base, header=header), settings, dtypes)


# -- the shard runner (``autoddl schedule --run``): its own fixed costs ------------------------------
SHARD_RUNS = tuple(dict(blocks=4, ops=n, params=p) for n in (4, 16) for p in (1, n))   # executor/shard_chain.py
SHARD_COUNT = 2


def with_shard_runner(cal: Calibration, settings: Settings) -> Calibration:
    """``cal`` with ``executor.shard_forward_us``, ``shard_backward_us`` and ``shard_param_us`` measured: the
    shard runner runs each of ``SHARD_RUNS`` cut into ``SHARD_COUNT`` shards on ``settings.nproc`` ranks at
    once (executor/calibrate_shards.py), and each task's time less its ops priced as ``autoddl schedule``
    prices them (search/shards.py on ``cal.cluster`` with those three fields 0) is fitted per task, per op
    and per parameter (``fit_shard_runner``); the per-op slopes go into the comment only."""
    ex = cal.cluster.executor
    zero = dataclasses.replace(cal.cluster, executor=dataclasses.replace(
        ex, shard_forward_us=0.0, shard_backward_us=0.0, shard_param_us=0.0)).resized(settings.nproc)
    runs, counts, priced = [], [], []
    for sizes in SHARD_RUNS:
        graph = load_model_file(SHARD_CHAIN, **sizes).trace()
        job, _ = shard_job("shard-chain", graph, zero, 1, SHARD_COUNT)
        shard_of = stages_from_cuts(graph, job.cuts)
        ops = Counter(shard_of[n.name] for n in graph.ops())
        params = Counter(param_homes(graph, shard_of).values())
        runs.append((sizes, job.cuts))
        counts.append((ops, params))
        priced.append(job)
    timings = measure_shard_tasks(runs, settings.nproc, settings.threads, settings.shard_steps,
                                  settings.timeout_s, settings.verbose)
    samples = []
    for t in timings:
        i = next(i for i, (sizes, _) in enumerate(runs) if tuple(sorted(sizes.items())) == t.args)
        (ops, params), job = counts[i], priced[i]
        samples.append(ShardTaskSample(t.kind, ops[t.shard], params[t.shard] if t.kind == BACKWARD else 0,
                                       t.seconds, job.duration_s(TaskKey(0, t.shard, t.kind))))
    fit = fit_shard_runner(samples)
    cluster = dataclasses.replace(cal.cluster, executor=dataclasses.replace(
        ex, shard_forward_us=_sig(fit.forward_us, 3), shard_backward_us=_sig(fit.backward_us, 3),
        shard_param_us=_sig(fit.param_us, 3)))
    per_task = ", ".join(f"{dict(t.args)['ops']}/{dict(t.args)['params']} {t.kind}{t.shard} {t.seconds * 1e6:.0f}"
                         for t in timings)
    comments = {**cal.comments,
                "executor.shard_forward_us": (
                    f"measured: the shard runner (executor/shard_runner.py) on executor/shard_chain.py (4 blocks of "
                    f"{' or '.join(sorted({str(r['ops']) for r in SHARD_RUNS}, key=int))} muls of {WIDTH}x{WIDTH} tensors, by a "
                    f"parameter once per block or every time, else by a buffer) cut into {SHARD_COUNT} shards, "
                    f"{_ranks_text(settings)}, load average {os.getloadavg()[0]:.1f}, median of {settings.shard_steps} "
                    f"steps per task (ops/params kind+shard us: "
                    f"{per_task}); least squares of each task's time less its ops as search/shards.py prices them: "
                    f"per forward task (this), per op beyond the priced ops {fit.op_forward_us:.1f} us forward, "
                    f"{fit.op_backward_us:.1f} us backward (not priced), max rel residual {fit.max_rel_residual:.0%}"),
                "executor.shard_backward_us": "the same fit: per backward task (autograd.backward of its outputs)",
                "executor.shard_param_us": "the same fit: per parameter a backward updates (p -= lr * grad)"}
    # a field fitted to 0 is not written (Cluster.to_yaml leaves unpriced zeros out): neither is its comment
    written = cluster.to_dict().get("executor", {})
    comments = {k: v for k, v in comments.items()
                if not k.startswith("executor.shard_") or k.removeprefix("executor.") in written}
    return dataclasses.replace(cal, cluster=cluster, comments=comments)


def calibrate_shard_runner(base_path: str | os.PathLike, settings: Settings, command: str = "") -> Calibration:
    """``autoddl calibrate --only shard_runner``: the cluster file at ``base_path`` with the shard runner's
    three fields measured (:func:`with_shard_runner`), its header and every other comment kept."""
    base = Calibration.of_file(base_path)
    note = (f"executor.shard_*: measured by `{command or 'autoddl calibrate --only shard_runner'}` on "
            f"{time.strftime('%Y-%m-%d %H:%M')}, only these fields.")
    header = "\n".join([line for line in base.header.splitlines() if not line.startswith("executor.shard_*:")]
                       + [note])
    return with_shard_runner(dataclasses.replace(base, header=header), settings)
