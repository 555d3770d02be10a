"""Two hosts on one machine: network namespaces joined by a shaped veth pair, one torchrun agent per host.

    python benchmarks/two_hosts.py [--rate-mbit 1000] [--delay-ms 0.2] -- -m executor.worker --plan p.json ...
    python benchmarks/two_hosts.py -- autoddl run plan.json --steps 5      # node flags are appended per host
    python benchmarks/two_hosts.py --measure-paths                          # TCP rate / RTT of both paths
    python benchmarks/two_hosts.py --check-only                             # can this machine do it? (exit 0 / 3)

What it builds (root and iproute2 needed; every name carries a per-run suffix):

- two namespaces ``a2h-<pid>-<tag>-h0`` / ``-h1`` ("hosts"), each with loopback up, joined by a
  veth pair ``h0-<tag>`` (10.201.0.1/24 in host 0) <-> ``h1-<tag>`` (10.201.0.2/24 in host 1).
  The addresses exist only inside these namespaces; nothing else is ever contacted.
- the link between hosts: on each veth end's egress, a token bucket (``tbf``) at ``--rate-mbit``,
  under a ``netem`` delay of ``--delay-ms`` where the kernel has netem (it says so when not).
- intra-host traffic: both ranks of a host bind gloo to the host's veth address
  (``GLOO_SOCKET_IFNAME`` = its veth end, gloo uses one interface per process), and a packet to an
  address of one's own namespace is routed through ``lo`` by the kernel's local table, never out
  of the veth. So the veth's qdiscs shape exactly the traffic between hosts and the traffic inside a
  host runs at loopback speed; ``--measure-paths`` shows it with the veth's byte counters. Measured
  here (2 cores, 2026-11-23, ``--measure-paths``, 64 MB over TCP): inside a host 16.9-18.4 Gbit/s,
  0.0 MB on the veth, 64.1 MB on lo; between hosts 953-958 Mbit/s at ``--rate-mbit 1000``, all 64.1 MB
  on the veth; at 10000 the link outruns what 2 busy cores push through it (6.6 Gbit/s). A gloo
  all-reduce of 8 MB: 10-19 ms inside a host, 67-75 ms between hosts at 1 Gbit/s (64 ms from the rate).
- delay: this machine's kernel has no netem (CONFIG_NET_SCH_NETEM unset; only tbf, htb and fifo
  qdiscs), so ``--delay-ms`` is applied only where netem exists; the describe line says which.

How the command after ``--`` runs, on both hosts at once (cwd: the repository; env: GLOO_SOCKET_IFNAME,
OMP_NUM_THREADS=1 unless set, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE):

- ``-m module ...`` or ``script.py ...``: under ``torchrun --nnodes 2 --node-rank R --nproc-per-node N``
  with its rendezvous on host 0's veth address (RANK / WORLD_SIZE set by torchrun per rank);
- ``autoddl run ...``: as is, plus ``--nnodes 2 --node-rank R --master-addr A --master-port P --nproc N``
  (autoddl run starts torchrun itself);
- anything else: as is, with ``{node_rank}``, ``{master_addr}``, ``{master_port}``, ``{nnodes}`` and
  ``{nproc}`` in its words replaced per host.

Host lines are printed prefixed ``[h0]`` / ``[h1]``. Teardown (processes, then namespaces, which
takes their veth ends with them) runs in ``finally``, at exit and on SIGINT / SIGTERM / SIGHUP; a
run killed with SIGKILL leaves its namespaces, which the next run removes (their pid is gone).
Exit code: the first non-zero exit of a host, 124 on ``--timeout-s``, 3 when this machine cannot
build the testbed (not root, no ``ip``, ``ip netns add`` refused), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
NS_PREFIX = "a2h-"
SUBNET = "10.201.0"          # private range, used only inside the namespaces this script creates
MASTER_PORT = 29500          # a fresh namespace has no listeners: always free
UNAVAILABLE = 3
DEFAULT_RATE_MBIT = 1000.0
DEFAULT_DELAY_MS = 0.2


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip`` / ``tc`` command; raise with its stderr when it fails and ``check``."""
    res = subprocess.run(list(args), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


# -- can this machine do it? ------------------------------------------------------------------------
def probe() -> str | None:
    """None when namespaces can be made here, else the one-line reason why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "two_hosts: needs root (network namespaces and tc); run as root or skip the two-host runs"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"two_hosts: `{tool}` not found; install iproute2 (apt-get install iproute2)"
    name = f"{NS_PREFIX}{os.getpid()}-probe"
    res = sh("ip", "netns", "add", name, check=False)
    if res.returncode != 0:
        return f"two_hosts: `ip netns add` failed ({res.stderr.strip()}); this container cannot make namespaces"
    sh("ip", "netns", "del", name, check=False)
    return None


def netem_available(ns: str, dev: str) -> bool:
    """Whether the kernel has the netem qdisc (tried on ``dev`` and removed again)."""
    res = sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "9:", "netem", "delay", "1ms",
             check=False)
    if res.returncode == 0:
        sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
    return res.returncode == 0


def remove_stale() -> list[str]:
    """Delete namespaces left by runs of this script whose process is gone (killed with SIGKILL)."""
    gone = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name[len(NS_PREFIX):].split("-")
        if not name.startswith(NS_PREFIX) or not parts[0].isdigit() or _alive(int(parts[0])):
            continue
        _kill_ns_pids(name)
        if sh("ip", "netns", "del", name, check=False).returncode == 0:
            gone.append(name)
        shutil.rmtree(Path("/etc/netns", name), ignore_errors=True)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns_pids(ns: str) -> None:
    """SIGKILL every process still inside namespace ``ns`` (only ever ones this script started there)."""
    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


# -- the testbed ------------------------------------------------------------------------------------
@dataclass
class Host:
    index: int
    ns: str
    dev: str

    @property
    def addr(self) -> str:
        return f"{SUBNET}.{self.index + 1}"


@dataclass
class Testbed:
    """Two namespaced hosts and the shaped link between them; a context manager that always tears down."""

    rate_mbit: float = DEFAULT_RATE_MBIT
    delay_ms: float = DEFAULT_DELAY_MS
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    delay_applied: bool = False

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"two_hosts: --rate-mbit must be positive, got {self.rate_mbit}")
        if self.delay_ms < 0:
            raise ValueError(f"two_hosts: --delay-ms must be >= 0, got {self.delay_ms}")
        base = f"{NS_PREFIX}{os.getpid()}-{self.tag}"
        self.hosts = [Host(i, f"{base}-h{i}", f"h{i}-{self.tag}") for i in range(2)]

    def __enter__(self) -> "Testbed":
        try:
            self.create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def create(self) -> None:
        h0, h1 = self.hosts
        for h in self.hosts:
            sh("ip", "netns", "add", h.ns)
            self.write_etc(h)
        sh("ip", "link", "add", "name", h0.dev, "netns", h0.ns, "type", "veth",
           "peer", "name", h1.dev, "netns", h1.ns)
        for h in self.hosts:
            sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
            sh("ip", "-n", h.ns, "link", "set", h.dev, "up")
        self.delay_applied = self.delay_ms > 0 and netem_available(h0.ns, h0.dev)
        for h in self.hosts:
            self.shape(h)

    def write_etc(self, h: Host) -> None:
        """/etc/netns/<ns>/{hosts,resolv.conf}, bind-mounted by `ip netns exec`: the hosts' names resolve
        from the file (c10d looks peers' names up), and no DNS server is ever asked."""
        etc = Path("/etc/netns", h.ns)
        etc.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{a}{g.addr} {g.ns} host{g.index}\n" for g in self.hosts for a in ("", "::ffff:"))
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")   # c10d asks for v4-mapped
        (etc / "resolv.conf").write_text("# two_hosts: no DNS inside the testbed\noptions attempts:1 timeout:1\n")

    def shape(self, h: Host) -> None:
        """Egress of ``h``'s veth end: netem delay (when applied) over a tbf at the link rate."""
        rate_bps = self.rate_mbit * 1e6
        burst = max(64 << 10, int(rate_bps / 8 / 1000))     # 1 ms of the rate, at least 64 KB
        parent = ["root"]
        if self.delay_applied:
            sh("tc", "-n", h.ns, "qdisc", "add", "dev", h.dev, "root", "handle", "1:", "netem",
               "delay", f"{self.delay_ms}ms", "limit", "100000")
            parent = ["parent", "1:1"]
        sh("tc", "-n", h.ns, "qdisc", "add", "dev", h.dev, *parent, "handle", "2:", "tbf",
           "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms")

    def describe(self) -> str:
        h0, h1 = self.hosts
        delay = (f"netem delay {self.delay_ms:g} ms" if self.delay_applied else
                 "no delay added" + (" (the kernel has no netem qdisc: --delay-ms "
                                     f"{self.delay_ms:g} not applied; the link's latency is the veth's own)"
                                     if self.delay_ms > 0 else ""))
        return (f"two_hosts: {h0.ns} ({h0.addr}, {h0.dev}) <-> {h1.ns} ({h1.addr}, {h1.dev}); "
                f"tbf {self.rate_mbit:g} Mbit/s each direction, {delay}; inside a host: lo, unshaped")

    def teardown(self) -> None:
        """Stop every process, then delete both namespaces (their veth ends go with them). Idempotent."""
        for p in self.procs:
            _stop_group(p)
        self.procs.clear()
        for h in self.hosts:
            if Path("/run/netns", h.ns).exists():
                _kill_ns_pids(h.ns)
                sh("ip", "netns", "del", h.ns, check=False)
            shutil.rmtree(Path("/etc/netns", h.ns), ignore_errors=True)

    def env(self, h: Host, nproc: int) -> dict[str, str]:
        env = dict(os.environ, GLOO_SOCKET_IFNAME=h.dev, NNODES="2", NODE_RANK=str(h.index),
                   MASTER_ADDR=self.hosts[0].addr, MASTER_PORT=str(MASTER_PORT), NPROC_PER_NODE=str(nproc),
                   PYTHONUNBUFFERED="1", TWO_HOSTS_RATE_MBIT=f"{self.rate_mbit:g}",
                   TWO_HOSTS_DELAY_MS=f"{self.delay_ms if self.delay_applied else 0:g}")
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        return env

    def start(self, h: Host, argv: Sequence[str], nproc: int) -> subprocess.Popen:
        """Start ``argv`` inside host ``h`` (its own session, so its whole tree can be stopped)."""
        uts = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"host{h.index}"] \
            if shutil.which("unshare") else []         # its own host name too (the runs table's hosts column)
        p = subprocess.Popen(["ip", "netns", "exec", h.ns, *uts, *argv], cwd=ROOT, env=self.env(h, nproc),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             start_new_session=True)
        self.procs.append(p)
        return p


def _stop_group(p: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM ``p``'s session (torchrun passes it to its ranks), SIGKILL after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


# -- running a command on both hosts -----------------------------------------------------------------
def host_argv(command: Sequence[str], h: Host, master_addr: str, nproc: int) -> list[str]:
    """What host ``h`` runs for ``command`` (module docstring: torchrun, autoddl run, or placeholders)."""
    cmd = list(command)
    if not cmd:
        raise ValueError("two_hosts: give the command to run after `--` (e.g. -- -m executor.worker ...)")
    if cmd[0] == "-m" or cmd[0].endswith(".py"):
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(h.index),
                "--nproc-per-node", str(nproc), "--master-addr", master_addr, "--master-port", str(MASTER_PORT),
                "--max-restarts", "0", *cmd]
    if cmd[:2] == ["autoddl", "run"]:
        exe = str(Path(sys.executable).with_name("autoddl"))
        return [exe, *cmd[1:], "--nnodes", "2", "--node-rank", str(h.index), "--master-addr", master_addr,
                "--master-port", str(MASTER_PORT), "--nproc", str(nproc)]
    fill = dict(node_rank=h.index, master_addr=master_addr, master_port=MASTER_PORT, nnodes=2, nproc=nproc)
    return [word.format(**fill) if "{" in word else word for word in cmd]


def run_on_hosts(bed: Testbed, command: Sequence[str], nproc: int = 2, timeout_s: float | None = None,
                 out=None) -> int:
    """Run ``command`` on both hosts, stream their lines prefixed ``[hN]``; the first non-zero exit code."""
    out = out or sys.stdout
    lock = threading.Lock()
    master = bed.hosts[0].addr
    procs = [bed.start(h, host_argv(command, h, master, nproc), nproc) for h in bed.hosts]
    pumps = [threading.Thread(target=_pump, args=(p, f"[h{i}] ", out, lock), daemon=True)
             for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or (deadline is not None and time.monotonic() > deadline):
            for p in procs:          # one host failed: its peer would wait in a collective until timeout
                _stop_group(p)
            break
        time.sleep(0.05)
    for t in pumps:
        t.join(5)
    codes = [p.returncode for p in procs]
    if deadline is not None and time.monotonic() > deadline and any(c not in (0,) for c in codes):
        print(f"two_hosts: the command ran past --timeout-s {timeout_s:g} and was stopped", file=sys.stderr)
        return 124
    return next((c for c in codes if c != 0), 0)


def _pump(p: subprocess.Popen, prefix: str, out, lock: threading.Lock) -> None:
    for line in iter(p.stdout.readline, ""):
        with lock:
            out.write(prefix + line)
            out.flush()


# -- both paths, measured -----------------------------------------------------------------------------
PROBE_PORT = 5201


def link_bytes(ns: str, dev: str) -> tuple[int, int]:
    """(tx, rx) bytes of ``dev`` in namespace ``ns``, from the kernel's counters."""
    data = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)[0]
    stats = data.get("stats64") or data["stats"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def _serve(addr: str, port: int) -> None:
    """Probe server (inside host 0): 'T' + 8-byte n -> read n bytes, answer 1 byte; 'P' -> echo bytes."""
    srv = socket.create_server((addr, port))
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            mode = conn.recv(1)
            if mode == b"T":
                left = int.from_bytes(_recv_exact(conn, 8), "big")
                while left > 0:
                    left -= len(conn.recv(min(left, 1 << 20)))
                conn.sendall(b"k")
            elif mode == b"P":
                while (b := conn.recv(1)):
                    conn.sendall(b)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("probe: connection closed early")
        buf += chunk
    return buf


def _client(addr: str, port: int, nbytes: int, pings: int) -> None:
    """Probe client: prints JSON {"mbit_s": throughput of nbytes, "rtt_us": median 1-byte round trip}."""
    with socket.create_connection((addr, port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = bytes(1 << 20)
        t0 = time.perf_counter()
        c.sendall(b"T" + nbytes.to_bytes(8, "big"))
        for off in range(0, nbytes, len(payload)):
            c.sendall(payload[: min(len(payload), nbytes - off)])
        _recv_exact(c, 1)
        secs = time.perf_counter() - t0
    with socket.create_connection((addr, port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"P")
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            c.sendall(b"x")
            _recv_exact(c, 1)
            rtts.append(time.perf_counter() - t)
    print(json.dumps({"mbit_s": nbytes * 8 / secs / 1e6, "rtt_us": statistics.median(rtts) * 1e6}))


def measure_paths(bed: Testbed, nbytes: int = 64 << 20, pings: int = 200) -> dict[str, dict]:
    """TCP throughput and RTT host 0 -> host 0 (intra) and host 1 -> host 0 (inter), and what each put on the veth."""
    h0, h1 = bed.hosts
    me = [sys.executable, str(Path(__file__).resolve())]
    server = bed.start(h0, [*me, "--_serve", h0.addr, str(PROBE_PORT)], 1)
    if server.stdout.readline().strip() != "ready":
        raise RuntimeError("two_hosts: the probe server in host 0 did not start")
    out = {}
    for name, h in (("intra_host", h0), ("inter_host", h1)):
        before = link_bytes(h0.ns, h0.dev), link_bytes(h0.ns, "lo")
        res = sh("ip", "netns", "exec", h.ns, *me, "--_client", h0.addr, str(PROBE_PORT), str(nbytes), str(pings))
        after = link_bytes(h0.ns, h0.dev), link_bytes(h0.ns, "lo")
        out[name] = dict(json.loads(res.stdout.strip().splitlines()[-1]), bytes=nbytes,
                         veth_rx_bytes=after[0][1] - before[0][1], lo_rx_bytes=after[1][1] - before[1][1])
    _stop_group(server, grace_s=1)
    return out


def print_paths(paths: dict[str, dict], bed: Testbed) -> None:
    for name, m in paths.items():
        print(f"two_hosts: {name:10s} TCP {m['mbit_s']:8.0f} Mbit/s ({m['bytes'] >> 20} MB), RTT {m['rtt_us']:6.0f} us "
              f"(median of 1-byte round trips); host 0's veth received {m['veth_rx_bytes'] / 2**20:7.1f} MB, "
              f"its lo {m['lo_rx_bytes'] / 2**20:7.1f} MB")
    print(f"two_hosts: link set to {bed.rate_mbit:g} Mbit/s, "
          f"{bed.delay_ms if bed.delay_applied else 0:g} ms added delay each way")


# -- the command ---------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python benchmarks/two_hosts.py", description=__doc__.split("\n")[0],
                                usage="%(prog)s [options] [-- COMMAND ...]")
    p.add_argument("--rate-mbit", type=float, default=DEFAULT_RATE_MBIT,
                   help=f"link rate between the hosts, each direction (default {DEFAULT_RATE_MBIT:g})")
    p.add_argument("--delay-ms", type=float, default=DEFAULT_DELAY_MS,
                   help=f"added one-way delay between the hosts, netem (default {DEFAULT_DELAY_MS:g})")
    p.add_argument("--nproc-per-host", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--timeout-s", type=float, help="stop the command after this many seconds (exit 124)")
    p.add_argument("--check-only", action="store_true", help="only say whether this machine can build the testbed")
    p.add_argument("--measure-paths", action="store_true",
                   help="measure TCP rate and RTT inside a host and between the hosts (before the command)")
    p.add_argument("--_serve", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--_client", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(own)
    if not (command or args.check_only or args.measure_paths or args._serve or args._client):
        p.error("nothing to run: give a command after `--`, or --measure-paths / --check-only")
    return args, command


def _on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)      # unwinds through finally: the testbed is torn down


def main(argv: Sequence[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    if args._serve:
        _serve(args._serve[0], int(args._serve[1]))
        return 0
    if args._client:
        _client(args._client[0], int(args._client[1]), int(args._client[2]), int(args._client[3]))
        return 0
    reason = probe()
    if reason:
        print(reason, file=sys.stderr)
        return UNAVAILABLE
    if args.check_only:
        print("two_hosts: ok: root, iproute2 and network namespaces are available")
        return 0
    for name in remove_stale():
        print(f"two_hosts: removed namespace {name} left by a killed run", file=sys.stderr)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    bed = Testbed(args.rate_mbit, args.delay_ms)
    atexit.register(bed.teardown)
    with bed:
        print(bed.describe(), flush=True)
        if args.measure_paths:
            print_paths(measure_paths(bed), bed)
        code = 0
        if command:
            h0 = bed.hosts[0]
            before = link_bytes(h0.ns, h0.dev)
            code = run_on_hosts(bed, command, args.nproc_per_host, args.timeout_s)
            sent, received = (a - b for a, b in zip(link_bytes(h0.ns, h0.dev), before))
            print(f"two_hosts: the link carried {sent / 1e6:.2f} MB host0 -> host1 and {received / 1e6:.2f} MB "
                  "host1 -> host0 during the command", flush=True)
    sys.stdout.flush()
    print(f"two_hosts: torn down (exit {code})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
