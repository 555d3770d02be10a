"""``autoddl calibrate``: measure this machine and write a cluster YAML whose numbers come from it.

    autoddl calibrate --nproc 2 --out configs/local-cpu.yaml [--base YAML] [--backend gloo] [--quick]
    autoddl calibrate --nproc 2 --only send_recv --out /tmp/send_recv.yaml   # one kind's fit over --base
    autoddl calibrate --nproc 2 --only shard_runner --base configs/local-cpu.yaml --out configs/local-cpu.yaml
        # the shard runner's executor.shard_* fields over --base, its comments kept
    autoddl calibrate --nproc 2 --only collective_cpu --base configs/local-cpu.yaml --out configs/local-cpu.yaml
        # links.intra_node.cpu_ns_per_byte (executor/calibrate_overlap.py) over --base, its comments kept
    autoddl calibrate --nproc 2 --only matmul_layouts --base results/bf16-cpu/cluster.yaml --out /tmp/x.yaml
        # an emulated dtype's matmuls by operand layout (autoddl/matmul_layouts.py) over --base
    python benchmarks/two_hosts.py --rate-mbit 1000 -- -m autoddl calibrate --across-hosts --only collective_cpu \
        --base configs/two-hosts.yaml --out configs/two-hosts.yaml   # links.inter_node's, the all-reduces across the link

The measuring and fitting are ``autoddl.calibration``'s (its docstring says what each
field is made of); this module parses the options, writes the files and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import tempfile
from pathlib import Path

from autoddl.calibration import (DEFAULT_BASE, MIN_R2, Calibration, calibrate, calibrate_matmul_layouts,
                                 calibrate_shard_runner, write_raw)
from autoddl.cli import common_options, register
from autoddl.cluster import FITTED_KINDS, Backend, Cluster
from autoddl.collective_kinds import CollectiveKind
from autoddl.machine import calibrated_elsewhere
from executor.calibrate import MATMUL_DTYPES, SLOW_DTYPE_FACTOR, Settings

SHARD_RUNNER = "shard_runner"      # --only: the shard runner's fixed costs instead of communication kinds
COLLECTIVE_CPU = "collective_cpu"      # --only: links.*.cpu_ns_per_byte (executor/calibrate_overlap.py)
MATMUL_LAYOUTS = "matmul_layouts"      # --only: an emulated dtype's matmuls by layout (executor/calibrate_layouts.py)
OTHER_DTYPES = tuple(d for d in MATMUL_DTYPES if d != "float32")   # --dtypes: timed besides float32


@register
def add_calibrate(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "calibrate", parents=[common_options()],
        help="measure this machine (matmul, memory, op overhead, collectives) and write a cluster YAML",
        description="Run microbenchmarks on --nproc local ranks and fit the cluster file's numbers to them: "
                    "peak TFLOPS and the matmul efficiency curve, memory bandwidth, per-op overhead, and the "
                    "latency / bandwidth of each collective on each mesh-axis size. Progress goes to stderr.")
    p.add_argument("--nproc", type=int, default=2, help="ranks to run (mesh-axis sizes: its divisors; default 2)")
    p.add_argument("--backend", choices=[b.value for b in Backend], default="gloo",
                   help="collective backend (default gloo; nccl needs one GPU per rank)")
    p.add_argument("--out", metavar="YAML", help="write the cluster here (default: print it to stdout)")
    p.add_argument("--base", metavar="YAML", default=str(DEFAULT_BASE),
                   help=f"cluster file giving the fields not measured (default {DEFAULT_BASE})")
    p.add_argument("--quick", action="store_true", help="fewer shapes and sizes (~15 s; for tests)")
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores / nproc)")
    p.add_argument("--launches", type=int, metavar="L",
                   help="launch every benchmark L times, one after the other, and take each timing's median over "
                        "them, so that one busy or quiet minute of a shared machine does not make the file "
                        "(default 3; 1 with --quick)")
    p.add_argument("--devices-per-node", type=int, metavar="N",
                   help="devices_per_node to write (default: the base's, at least --nproc)")
    p.add_argument("--raw", metavar="CSV", help="also write every timing to this CSV file")
    p.add_argument("--min-r2", type=float, default=MIN_R2, metavar="R2",
                   help=f"refuse, with a warning, a collective fit whose R^2 is below this (default {MIN_R2:g})")
    p.add_argument("--only", metavar="KINDS",
                   help=f"time only these communication kinds (comma-separated: {', '.join(FITTED_KINDS)}) and "
                        "write --base with their fits in its collectives section, every other field as it was; "
                        "or shard_runner alone: time the shard runner of `autoddl schedule --run` and write --base "
                        "with its executor.shard_* fields, every other field and comment as it was; "
                        f"or {COLLECTIVE_CPU} alone: the host CPU a collective takes from its ranks' compute per "
                        "byte sent, written into --base as links.intra_node.cpu_ns_per_byte (with --across-hosts: "
                        "links.inter_node's), every other field and comment as it was; "
                        f"or {MATMUL_LAYOUTS} alone: the matmuls of --base's emulated dtypes (or --dtypes) by "
                        "operand layout, written into --base as matmul_layouts")
    p.add_argument("--dtypes", metavar="DTYPES",
                   help="dtypes to time besides float32, each getting a peak and op-family costs (comma-separated, "
                        f"of {', '.join(OTHER_DTYPES)}; default: all of them)")
    p.add_argument("--keep-slow-dtypes", action="store_true",
                   help=f"give a dtype its measured peak even where it runs more than {SLOW_DTYPE_FACTOR:g}x slower "
                        "than float32 (a CPU without its instructions), so that plans in it are priced as slow as "
                        "they run; by default such a dtype gets no peak and planning in it is refused")
    p.add_argument("--across-hosts", action="store_true", help="run as torchrun ranks on several hosts "
                   "(benchmarks/two_hosts.py -- -m autoddl calibrate --across-hosts): fit intra- and inter-host links; "
                   f"with --only {COLLECTIVE_CPU}: measure it with the all-reduces on the inter-host groups")
    p.set_defaults(func=run_calibrate)


def _dtype_settings(dtypes: str | None) -> dict[str, tuple[str, ...]]:
    """``--dtypes bfloat16`` -> the matmul and op-family dtypes float32 + those (empty: the defaults)."""
    if dtypes is None:
        return {}
    names = tuple(d.strip() for d in dtypes.split(",") if d.strip())
    if not set(names) <= set(OTHER_DTYPES) or len(set(names)) != len(names):
        raise ValueError(f"calibrate --dtypes {dtypes}: name each of {', '.join(OTHER_DTYPES)} at most once "
                         "(float32 is always timed)")
    return {"matmul_dtypes": ("float32",) + names, "family_dtypes": ("float32",) + names}


def run_calibrate(args: argparse.Namespace) -> int:
    kinds = tuple(k.strip() for k in args.only.split(",")) if args.only else ()
    if args.across_hosts and not kinds:     # measured by executor.calibrate, fitted per kind by autoddl.calibration
        from autoddl.calibration import fit_collectives
        from executor.calibrate_hosts import calibrate_across_hosts
        return calibrate_across_hosts(args.out, args.base, fit_collectives, quick=args.quick)
    if args.across_hosts and kinds != (COLLECTIVE_CPU,):
        raise ValueError(f"calibrate --across-hosts --only {args.only}: across hosts, --only takes "
                         f"{COLLECTIVE_CPU} alone; leave --only out to fit both links")
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise ValueError(f"--devices-per-node must be a positive integer, got {args.devices_per_node}")
    apart = {SHARD_RUNNER: _calibrate_shard_runner, COLLECTIVE_CPU: _calibrate_collective_cpu,
             MATMUL_LAYOUTS: _calibrate_matmul_layouts}
    alone = [k for k in apart if k in kinds]      # measured apart, written over --base
    if alone and kinds != (alone[0],):
        raise ValueError(f"calibrate --only {args.only}: {alone[0]} is timed alone; give --only {alone[0]} "
                         "and the communication kinds in another run")
    if alone:
        return apart[alone[0]](args)
    base = Cluster.from_yaml(args.base)
    if args.only:
        _note_other_machine(base)
    only = {"kinds": kinds, "comm_only": True} if args.only else {}
    settings = Settings.default(args.nproc, args.backend, quick=args.quick, threads=args.threads,
                                launches=args.launches, keep_slow_dtypes=args.keep_slow_dtypes,
                                **_dtype_settings(args.dtypes), **only)
    print(f"calibrate: {settings.nproc} {settings.backend} ranks, {settings.threads} thread(s) each, "
          f"{'quick' if settings.quick else 'full'} settings, {settings.launches} launch(es)", file=sys.stderr,
          flush=True)
    meas, cal = calibrate(base, settings, args.devices_per_node, _command(args), args.min_r2)
    if args.only:
        cal = _over_base_file(cal, args.base)
    if args.raw:
        write_raw(meas, args.raw)
    if _write(cal, args.out):
        print(f"wrote {args.out} ({meas.seconds['total']:.0f} s)")
        print(Cluster.from_yaml(args.out).summary())
        for line in cal.header.splitlines()[3:]:
            print(line)
    return 0


def _over_base_file(cal: Calibration, base_path: str) -> Calibration:
    """``--only KINDS``: the base file's header and comments kept, the measured fields' comments
    replaced, and this run's header (command, fits) appended to the base's."""
    base = Calibration.of_file(base_path)
    replaced = tuple(cal.comments)
    comments = {k: v for k, v in base.comments.items()
                if not any(k == r or k.startswith(r + ".") for r in replaced)}
    return dataclasses.replace(cal, comments={**comments, **cal.comments},
                               header=f"{base.header}\nThen: {cal.header}" if base.header else cal.header)


def _write(cal, out: str | None) -> bool:
    """Write ``cal`` to ``out``, or print its YAML when no ``out`` is given; whether a file was written."""
    if out:
        cal.write(out)
        return True
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        cal.write(path)
        sys.stdout.write(path.read_text())
    return False


def _note_other_machine(base: Cluster) -> None:
    """``--only`` writes a few fields over ``base``: say so when the rest describe another machine."""
    why = calibrated_elsewhere(base)
    if why:
        print(f"calibrate: note: {why}; --only replaces only the fields it times", file=sys.stderr, flush=True)


def _calibrate_shard_runner(args: argparse.Namespace) -> int:
    """``--only shard_runner`` (``autoddl.calibration.calibrate_shard_runner``)."""
    _note_other_machine(Cluster.from_yaml(args.base))
    settings = Settings.default(args.nproc, args.backend, quick=args.quick, threads=args.threads)
    print(f"calibrate: the shard runner on {settings.nproc} ranks, {settings.threads} thread(s) each",
          file=sys.stderr, flush=True)
    cal = calibrate_shard_runner(args.base, settings, _command(args))
    if _write(cal, args.out):
        ex = cal.cluster.executor
        print(f"wrote {args.out}: executor.shard_forward_us {ex.shard_forward_us:g}, shard_backward_us "
              f"{ex.shard_backward_us:g}, shard_param_us {ex.shard_param_us:g}")
    return 0


def _calibrate_matmul_layouts(args: argparse.Namespace) -> int:
    """``--only matmul_layouts`` (``autoddl.calibration.calibrate_matmul_layouts``)."""
    _note_other_machine(Cluster.from_yaml(args.base))
    dtypes = _dtype_settings(args.dtypes).get("matmul_dtypes", ("float32",))[1:] or None
    settings = Settings.default(args.nproc, args.backend, quick=args.quick, threads=args.threads,
                                launches=args.launches)
    cal = calibrate_matmul_layouts(args.base, settings, _command(args), dtypes)
    if _write(cal, args.out):
        print(f"wrote {args.out}: matmul_layouts for " + ", ".join(cal.cluster.matmul_layouts.dtypes()))
    return 0


def _calibrate_collective_cpu(args: argparse.Namespace) -> int:
    """``--only collective_cpu`` (executor/calibrate_overlap.py): --base with the link's
    ``cpu_ns_per_byte`` measured (``links.intra_node``, and ``inter_node`` on one node; across hosts
    ``links.inter_node``) and ``executor.collective_compute_share`` dropped (the per-byte cost replaces
    it on CPUs), its header and every other comment kept."""
    from costmodel.collectives import cpu_ns_per_byte
    from executor.calibrate_hosts import testbed_command
    from executor.calibrate_overlap import MESSAGE_BYTES, describe, measure_overlap, measure_overlap_across_hosts

    if args.backend != Backend.GLOO.value:
        raise ValueError(f"calibrate --only {COLLECTIVE_CPU} times gloo ranks on this CPU; NCCL's SM use is not "
                         "timed here (GPU cluster files take executor.collective_compute_share from a published "
                         "measurement, as configs/h100-4x8.yaml does)")
    base = Calibration.of_file(args.base)        # a bad base fails before the timing
    _note_other_machine(base.cluster)
    threads = args.threads or 1
    if args.across_hosts:                        # torchrun ranks under benchmarks/two_hosts.py: rank 0 writes
        result = measure_overlap_across_hosts(threads, 5 if args.quick else 15)     # one launch: torchrun's
        if result is None:
            return 0
        command = testbed_command(f" --only {COLLECTIVE_CPU} --base {shlex.quote(str(args.base))}"
                                  + (f" --out {shlex.quote(args.out)}" if args.out else "")
                                  + (" --quick" if args.quick else ""))
    else:
        launches, repeats = (1, 5) if args.quick else (5, 7)
        result, command = measure_overlap(args.nproc, threads, repeats=repeats, launches=launches), _command(args)
    cluster = base.cluster
    ns = cpu_ns_per_byte(result.cpu_s, CollectiveKind.ALL_REDUCE, MESSAGE_BYTES, result.group_size, cluster.backend)
    ns = float(f"{ns:.3g}")
    links = ("inter_node",) if args.across_hosts else ("intra_node",) + (("inter_node",) if cluster.nodes == 1 else ())
    cluster = dataclasses.replace(cluster, executor=dataclasses.replace(cluster.executor, collective_compute_share=0.0),
                                  **{k: dataclasses.replace(getattr(cluster, k), cpu_ns_per_byte=ns) for k in links})
    text = describe(result, command) + f"; per byte a rank sends (an all-reduce on {result.group_size} ranks): {ns:g} ns"
    comments = {k: v for k, v in base.comments.items() if k != "executor.collective_compute_share"}
    comments.update({f"links.{k}.cpu_ns_per_byte": text if i == 0 else f"as links.{links[0]} (one node)"
                     for i, k in enumerate(links)})
    if _write(dataclasses.replace(base, cluster=cluster, comments=comments), args.out):
        print(f"wrote {args.out}: " + ", ".join(f"links.{k}.cpu_ns_per_byte {ns:g}" for k in links))
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (for the YAML's header)."""
    parts = ["autoddl calibrate", f"--nproc {args.nproc}", f"--backend {args.backend}"]
    parts += [f"--base {shlex.quote(str(args.base))}"] if Path(args.base) != DEFAULT_BASE else []
    parts += [f"--out {shlex.quote(args.out)}"] if args.out else []
    parts += ["--quick"] if args.quick else []
    parts += [f"--threads {args.threads}"] if args.threads else []
    parts += [f"--launches {args.launches}"] if args.launches else []
    parts += [f"--devices-per-node {args.devices_per_node}"] if args.devices_per_node else []
    parts += [f"--only {args.only}"] if args.only else []
    parts += [f"--dtypes {args.dtypes}"] if args.dtypes else []
    parts += ["--keep-slow-dtypes"] if args.keep_slow_dtypes else []
    return " ".join(parts)
