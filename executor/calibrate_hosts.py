"""``autoddl calibrate --across-hosts``: the link inside a host and the link between hosts, fitted apart.

Launched as torchrun ranks on several hosts (benchmarks/two_hosts.py runs it on two namespaced
hosts); ranks fill hosts in order, LOCAL_WORLD_SIZE per host. Every collective kind is timed on
each path of :data:`HOST_PATHS` with executor/calibrate.py's benchmark (``Bench.time_kind``);
rank 0 fits each path (``fit_host_paths``) and writes the cluster (``two_hosts_cluster``).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from autoddl.cluster import COLLECTIVE_KINDS
from autoddl.machine import calibrated_elsewhere, usable_cores
from executor.calibrate import Bench, CollectiveTiming, Settings

HOST_PATHS = {
    "intra_host": "the ranks of each host, every host at once (a mesh axis inside a node)",
    "inter_host": "one rank per host, every such group at once, sharing the link (a mesh axis across nodes)",
    "inter_host_alone": "one rank per host, one group alone on the link (the link's own rate)",
    "world": "every rank, one group across the hosts (several mesh axes flattened across nodes)",
}
CURVE_PATHS = ("intra_host", "world")   # timed with every rank busy: written as collective_points (below)
ALONE_KINDS = ("all_reduce", "all_gather")
CHECK_BYTES = 8_000_000             # the all-reduce compared with its alpha-beta prediction


@dataclass(frozen=True)
class HostTimings:
    """Collective timings per path (:data:`HOST_PATHS`) and the 8 MB all-reduces, from one launch."""

    settings: Settings
    nodes: int
    per_node: int
    paths: dict[str, tuple[CollectiveTiming, ...]]
    checks: dict[str, float]          # "inter_host_alone" / "inter_host" / "world": seconds of an 8 MB all-reduce
    link: dict[str, float]            # what the testbed set: rate_mbit, delay_ms (from its environment)
    machine: str = ""
    seconds: float = 0.0


def host_groups(world: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(each host's ranks, each set of ranks with one per host): 4 ranks, 2 per host -> [[0,1],[2,3]], [[0,2],[1,3]]."""
    if per_node < 1 or world % per_node or world // per_node < 2:
        raise ValueError(f"calibrate --across-hosts: {world} ranks with {per_node} per host is not 2 or more "
                         "whole hosts; launch one torchrun agent per host with the same --nproc-per-node")
    intra = [list(range(h * per_node, (h + 1) * per_node)) for h in range(world // per_node)]
    return intra, [list(range(r, world, per_node)) for r in range(per_node)]


def torchrun_hosts(what: str) -> tuple[int, int]:
    """(world size, ranks per host) of this torchrun rank; fails early on a launch that is not whole hosts."""
    if "RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        raise ValueError(f"{what} runs in torchrun ranks on several hosts; launch it with "
                         f"`python benchmarks/two_hosts.py -- -m autoddl {what} --out YAML`")
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    host_groups(world, per_node)
    return world, per_node


def testbed_command(options: str) -> str:
    """The command line that re-runs ``autoddl calibrate --across-hosts`` + ``options`` on the testbed at this rate."""
    rate = os.environ.get("TWO_HOSTS_RATE_MBIT", "?")
    return f"python benchmarks/two_hosts.py --rate-mbit {rate} -- -m autoddl calibrate --across-hosts{options}"


def _host_paths_rank(b: "Bench", per_node: int) -> dict[str, Any]:
    """One rank's timings of every path (and the 8 MB checks), keyed (path, kind, n, bytes)."""
    dist, sizes = b.dist, b.s.message_bytes
    intra, inter = host_groups(b.s.nproc, per_node)
    mine_intra = dist.new_subgroups_by_enumeration(intra)[0]
    mine_inter = dist.new_subgroups_by_enumeration(inter)[0]
    alone = dist.new_group(inter[0])
    results: dict[tuple, list[float]] = {}
    how: dict[tuple, str] = {}
    plan = [("intra_host", COLLECTIVE_KINDS, mine_intra, intra), ("inter_host", COLLECTIVE_KINDS, mine_inter, inter),
            ("world", COLLECTIVE_KINDS, None, [list(range(b.s.nproc))])]
    for path, kinds, group, sets in plan:
        ranks = tuple(next(s for s in sets if b.rank in s))
        for kind in kinds:
            reps, texts = b.time_kind(kind, sizes, len(ranks), group, ranks=ranks)
            results.update({(path, *k): v for k, v in reps.items()})
            how.update({(path, *k): v for k, v in texts.items()})
            b.say(f"{path} {kind} on {len(ranks)} ranks x {len(sets)} groups: "
                  + ", ".join(f"{k[2] >> 10} KB {statistics.median(v) * 1e3:.2f} ms" for k, v in reps.items()))
    if b.rank in inter[0]:
        for kind in ALONE_KINDS:
            reps, texts = b.time_kind(kind, sizes, len(inter[0]), alone, sync=alone, ranks=tuple(inter[0]))
            results.update({("inter_host_alone", *k): v for k, v in reps.items()})
            how.update({("inter_host_alone", *k): v for k, v in texts.items()})
            b.say(f"inter_host_alone {kind}: " + ", ".join(f"{k[2] >> 10} KB {statistics.median(v) * 1e3:.2f} ms"
                                                           for k, v in reps.items()))
    dist.barrier()
    return {"results": results, "how": how, "checks": _check_all_reduces(b, inter, mine_inter, alone)}


def _check_all_reduces(b: "Bench", inter: list[list[int]], mine_inter: Any, alone: Any) -> dict[str, list[float]]:
    """8 MB all-reduces: one cross-host group alone, every cross-host group at once, all ranks."""
    out: dict[str, list[float]] = {}
    cases = (("inter_host_alone", alone, alone, tuple(inter[0])),
             ("inter_host", mine_inter, None, tuple(next(s for s in inter if b.rank in s))),
             ("world", None, None, tuple(range(b.s.nproc))))
    for name, group, sync, ranks in cases:
        if b.rank in ranks:
            reps, _ = b.time_kind("all_reduce", (CHECK_BYTES,), len(ranks), group, sync=sync, ranks=ranks)
            out[name] = next(iter(reps.values()))
        b.dist.barrier()
    return out


def measure_across_hosts(settings: Settings, per_node: int) -> HostTimings | None:
    """Inside a torchrun rank (RANK, WORLD_SIZE, MASTER_* set): time every path; rank 0 gets the result."""
    rank = int(os.environ["RANK"])
    start = time.perf_counter()
    b = Bench(settings, rank)
    try:
        mine = _host_paths_rank(b, per_node)
        every: list[Any] = [None] * settings.nproc
        b.dist.all_gather_object(every, mine)
    finally:
        b.dist.destroy_process_group()
    if rank != 0:
        return None
    return _combine_hosts(settings, per_node, every, time.perf_counter() - start,
                          machine=f"{os.cpu_count()} cores shared by the hosts, torch {b.torch.__version__}")


def _combine_hosts(settings: Settings, per_node: int, ranks: list[dict], wall_s: float, machine: str) -> HostTimings:
    """Per point: each repetition's slowest rank among those that ran it, then the median over repetitions."""
    def median_of_max(key: Any, field_name: str) -> float:
        runs = [r[field_name][key] for r in ranks if key in r[field_name]]
        return statistics.median(max(run[i] for run in runs) for i in range(len(runs[0])))

    paths: dict[str, list[CollectiveTiming]] = {p: [] for p in HOST_PATHS}
    for key, how in ranks[0]["how"].items():
        path, kind, n, nbytes = key
        paths[path].append(CollectiveTiming(kind, n, nbytes, median_of_max(key, "results"), how))
    checks = {name: median_of_max(name, "checks") for name in ranks[0]["checks"]}
    link = {k: float(os.environ.get(f"TWO_HOSTS_{k.upper()}", "nan")) for k in ("rate_mbit", "delay_ms")}
    return HostTimings(settings, settings.nproc // per_node, per_node, {p: tuple(v) for p, v in paths.items()},
                       checks, link, machine, wall_s)


def _median_link(fits: dict[str, Any]) -> Any:
    from autoddl.cluster import LinkSpec

    if not fits:
        raise ValueError("calibrate --across-hosts: no collective of this path could be fitted (too noisy); "
                         "run again on an idle machine")
    return LinkSpec(bandwidth_gbps=float(f"{statistics.median(f.bandwidth_gbps for f in fits.values()):.4g}"),
                    latency_us=float(f"{statistics.median(f.latency_us for f in fits.values()):.4g}"))


def fit_host_paths(ht: HostTimings, fit_kinds: Callable[..., dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per path, one fit per kind: ``fit_kinds(timings, backend, failed)`` is the calibrate command's
    per-kind fit (``costmodel.collectives.fit_collective`` per kind), passed in so that the executor
    imports only the core. Kinds that cannot be fitted are left out of their path."""
    return {path: fit_kinds(list(timings), ht.settings.backend, {}) for path, timings in ht.paths.items()}


def _with_link(fit: Any, link: Any) -> Any:
    """``fit`` (its kind's formula) with ``link``'s latency and bandwidth: what the cost model predicts."""
    import dataclasses

    return dataclasses.replace(fit, latency_us=link.latency_us, bandwidth_gbps=link.bandwidth_gbps)


def check_lines(ht: HostTimings, fits: dict[str, dict[str, Any]], inter: Any) -> list[str]:
    """The 8 MB all-reduces measured against the alpha-beta predictions (and the link rate). ``inter``:
    links.inter_node, shared by each host's ranks, priced per flow (``LinkSpec.per_flow``) as the cost
    model prices it: the pairs at once are ``per_node`` flows, one ring over all ranks is 1."""
    m, rate = CHECK_BYTES, ht.link.get("rate_mbit", float("nan"))
    alone_fit, inter_fit = fits["inter_host_alone"].get("all_reduce"), fits["inter_host"].get("all_reduce")
    flows = inter.measured_flows if inter.shared_by_node else None
    lines = []
    for name, n, fit, what in (("inter_host_alone", 2, alone_fit, "one pair alone on the link"),
                               ("inter_host", 2, inter_fit and _with_link(inter_fit, inter.per_flow(ht.per_node)),
                                f"{ht.per_node} pairs at once (links.inter_node, {ht.per_node} flows of {flows})"),
                               ("world", ht.settings.nproc, inter_fit and _with_link(inter_fit, inter.per_flow(1)),
                                f"all {ht.settings.nproc} ranks (links.inter_node, n = {ht.settings.nproc}, "
                                f"one ring: 1 flow of {flows})"),
                               ("world", ht.settings.nproc, alone_fit, f"all {ht.settings.nproc} ranks with the "
                                "one-pair fit (a ring crosses the link once each way)")):
        if name not in ht.checks or fit is None:
            continue
        got, want = ht.checks[name], fit.predict_s(m, n)
        line = (f"  {what}: measured {got * 1e3:.1f} ms, alpha-beta {want * 1e3:.1f} ms "
                f"({(want - got) / got:+.0%})")
        if name == "inter_host_alone" and math.isfinite(rate):
            line += f", link rate alone {2 * (n - 1) / n * m * 8 / (rate * 1e6) * 1e3:.1f} ms"
        lines.append(line)
    return lines


def two_hosts_cluster(ht: HostTimings, fits: dict[str, dict[str, Any]], base: Any,
                      command: str = "") -> tuple[Any, dict[str, str], str]:
    """``base`` on ``ht.nodes`` x ``ht.per_node`` with both links fitted; its YAML comments and header."""
    import dataclasses

    from autoddl.cluster import CollectiveFits, LinkSpec

    intra, inter = _median_link(fits["intra_host"]), _median_link(fits["inter_host"])
    alone_fit = fits.get("inter_host_alone", {}).get("all_reduce")     # one flow: the flattened groups' all-reduce
    alone = float(f"{alone_fit.bandwidth_gbps:.4g}") if alone_fit else None
    inter = dataclasses.replace(inter, shared_by_node=True, measured_flows=ht.per_node,   # host_groups: per_node sets
                                flow_bandwidth_gbps=alone)
    intra = dataclasses.replace(intra, cpu_ns_per_byte=base.intra_node.cpu_ns_per_byte)   # loopback inside a host too
    per_kind = {k: LinkSpec(float(f"{f.bandwidth_gbps:.4g}"), float(f"{f.latency_us:.4g}"))
                for k, f in fits["intra_host"].items()}
    differ = [k for k, v in per_kind.items() if abs(v.bandwidth_gbps / intra.bandwidth_gbps - 1) > 0.2
              or abs(v.latency_us - intra.latency_us) / max(intra.latency_us, 5.0) > 0.2]
    cores = usable_cores()
    at_once = max(1, cores // ht.settings.threads // ht.nodes)
    cluster = dataclasses.replace(base, name="two-hosts" if ht.nodes == 2 else f"{ht.nodes}-hosts",
                                  nodes=ht.nodes, devices_per_node=ht.per_node, intra_node=intra, inter_node=inter,
                                  collectives=CollectiveFits(**per_kind) if differ else CollectiveFits(),
                                  collective_points=host_points(ht),
                                  cores_per_node=at_once, comm_measured_ranks_per_node=ht.per_node, source="")
    comments, header = _two_hosts_text(ht, fits, intra, inter, differ, cores, at_once, base, command)
    return cluster, comments, header


def host_points(ht: HostTimings) -> Any:
    """The curves of the paths timed with every rank of every host busy (:data:`CURVE_PATHS`), under
    ``ranks_<per host>``: a host's own groups (``group_<per host>``, a mesh axis inside a node) and the group
    of every rank across the hosts (``group_<world>``, axes flattened across nodes). Never the base file's:
    those were timed on one host. The pairs across the link (``inter_host``) share their group size with
    a host's own groups and keep their fit."""
    from autoddl.collective_points import measured_points

    timings = [(t.kind, t.n_devices, t.nbytes, t.time_s) for path in CURVE_PATHS for t in ht.paths.get(path, ())]
    return measured_points(timings, ht.per_node, COLLECTIVE_KINDS)


def _fit_line(f: Any) -> str:
    return (f"a {f.latency_us:.1f} us, b {f.bandwidth_gbps:.4f} GB/s ({f.carried_as.value} formula), "
            f"{f.points} points, R^2 {f.r2:.4f}, max rel residual {f.max_rel_residual:.0%}")


def _two_hosts_text(ht: HostTimings, fits: dict[str, dict[str, Any]], intra: Any, inter: Any, differ: list[str],
                    cores: int, at_once: int, base: Any, command: str) -> tuple[dict[str, str], str]:
    s, rate, delay = ht.settings, ht.link.get("rate_mbit", float("nan")), ht.link.get("delay_ms", float("nan"))
    sizes = sorted({t.nbytes for p in ht.paths.values() for t in p})
    span = f"{sizes[0] / 1024:g} KB .. {sizes[-1] / 2**20:g} MB, median of {s.repeats}"
    src = base.source or base.name
    if os.path.isabs(src) and Path(src).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        src = str(Path(src).resolve().relative_to(Path(__file__).resolve().parents[1]))
    comments = {
        "nodes": "hosts: network namespaces joined by a veth pair (benchmarks/two_hosts.py)",
        "devices_per_node": f"ranks per host ({s.threads} thread{'s' * (s.threads > 1)} each)",
        "device": f"from {src} (measured on this machine, 2 ranks); not re-measured here",
        "links.intra_node": (f"fitted: median over the {len(fits['intra_host'])} kinds, {ht.per_node} ranks of each "
                             f"host (gloo over lo, unshaped), every host at once; {span}"),
        "links.inter_node": (f"fitted: median over the {len(fits['inter_host'])} kinds, one rank per host, "
                             f"{ht.per_node} groups at once sharing the {rate:g} Mbit/s link (GB/s per flow of "
                             f"{ht.per_node}); {span}"),
        "links.inter_node.shared_by_node": ("the hosts are joined by ONE link (benchmarks/two_hosts.py): a host's "
                                            "ranks all cross it"),
        "links.inter_node.measured_flows": (f"the inter_host fits ran {ht.per_node} groups (one rank per host each) "
                                            "at once on the link"),
        "cores_per_node": (f"this machine's {cores} cores / {s.threads} thread{'s' * (s.threads > 1)} per rank / "
                           f"{ht.nodes} hosts: the hosts share the cores"),
        "comm_measured_ranks_per_node": (f"the links and collectives above were measured with all {ht.per_node} ranks "
                                         "of each host busy at once: their time-sharing is in the fits"),
    }
    if any(ht.paths.get(path) for path in CURVE_PATHS):
        comments[f"collective_points.ranks_{ht.per_node}"] = (
            f"measured: all {s.nproc} ranks busy ({ht.per_node} per host); group_{ht.per_node}: each host's own ranks "
            f"(intra_host), group_{s.nproc}: every rank, across the hosts (world); {span} of the slowest rank, "
            "made non-decreasing (autoddl/collective_points.py); the collectives a rank waits for are priced "
            "from these")
    if inter.flow_bandwidth_gbps is not None:
        comments["links.inter_node.flow_bandwidth_gbps"] = (
            "fitted: inter_host_alone's all_reduce, one group alone on the link (one flow: what an all-reduce over "
            "every rank, data parallel's gradient buckets, puts on it): no flow is priced faster")
    if intra.cpu_ns_per_byte:
        comments["links.intra_node.cpu_ns_per_byte"] = (f"from {src}: loopback inside a host too (links.inter_node's "
                                                        "is measured by `--across-hosts --only collective_cpu`)")
    if differ:
        comments["collectives"] = (f"per-kind intra-host fits ({', '.join(differ)} differ from links.intra_node by "
                                   "> 20%); used instead of it on intra-host axes")
        comments.update({f"collectives.{k}": _fit_line(f) for k, f in fits["intra_host"].items()})
    applied = "none (no netem qdisc in this kernel)" if delay == 0 else f"{delay:g} ms each way (netem)"
    lines = [f"Measured by `{command or 'autoddl calibrate --across-hosts'}` on {time.strftime('%Y-%m-%d %H:%M')}",
             f"under benchmarks/two_hosts.py: {ht.nodes} hosts x {ht.per_node} ranks, link between hosts tbf "
             f"{rate:g} Mbit/s each direction, added delay {applied}; on {ht.machine}; {ht.seconds:.0f} s.",
             "Units are in the field names: *_gbps = GB/s (1e9 bytes/s, per device, one direction), "
             "*_us = microseconds.",
             f"Collective fits (gloo; t = formula of costmodel.collectives with latency a, bandwidth b; {span}):"]
    for path, what in HOST_PATHS.items():
        lines.append(f" {path}: {what}")
        lines += [f"  {k}: {_fit_line(f)}" for k, f in fits.get(path, {}).items()]
    lines.append(f"All-reduce of {CHECK_BYTES / 1e6:g} MB across the link, measured vs predicted:")
    lines += check_lines(ht, fits, inter)
    lines.append(f"Fields not under links / collectives / cores_per_node / nodes come from {src}.")
    return comments, "\n".join(lines)


MEASURED_HERE = ("name", "nodes", "devices_per_node", "links", "collectives", "collective_points", "cores_per_node",
                 "comm_measured_ranks_per_node")     # the fields (and their sub-fields) the testbed calibration writes


def _base_comments(base_path: str) -> dict[str, str]:
    """The base file's comments on the fields taken from it (their sources stay beside the numbers)."""
    from autoddl.cluster import yaml_comments

    return {k: v for k, v in yaml_comments(base_path)[1].items() if k.split(".")[0] not in MEASURED_HERE}


def calibrate_across_hosts(out: str | None, base_path: str, fit_kinds: Callable[..., dict[str, Any]],
                           quick: bool = False) -> int:
    """``autoddl calibrate --across-hosts`` in one torchrun rank: measure; rank 0 fits and writes ``out``."""
    from autoddl.cluster import Cluster

    command = testbed_command((f" --out {out}" if out else "") + (" --quick" if quick else ""))
    world, per_node = torchrun_hosts("calibrate --across-hosts")
    base = Cluster.from_yaml(base_path)
    elsewhere = calibrated_elsewhere(base)
    if elsewhere and int(os.environ.get("RANK", "0")) == 0:
        print(f"calibrate --across-hosts: note: {elsewhere}; the device and op costs are taken from it", flush=True)
    settings = Settings.default(world, "gloo", quick=quick, threads=int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_before = os.getloadavg()[0]
    ht = measure_across_hosts(settings, per_node)
    if ht is None:
        return 0
    cluster, comments, header = two_hosts_cluster(ht, fit_host_paths(ht, fit_kinds), base, command)
    comments = {**_base_comments(base_path), **comments}
    header += (f"\n1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
               f"({os.cpu_count()} cores; other processes share them).")
    if out:
        cluster.to_yaml(out, comments=comments, header=header)
        print(f"wrote {out} ({ht.seconds:.0f} s)\n" + "\n".join(header.splitlines()[3:]), flush=True)
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            cluster.to_yaml(os.path.join(tmp, "c.yaml"), comments=comments, header=header)
            sys.stdout.write(open(os.path.join(tmp, "c.yaml")).read())
    return 0
