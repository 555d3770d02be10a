"""Microbenchmarks of this machine for ``autoddl calibrate``: matmuls, memory, per-op overhead, collectives.

``measure(settings)`` starts ``settings.nproc`` ranks the way the executor runs them
(one process per device; gloo on 127.0.0.1, or NCCL one GPU per rank; ``threads``
intra-op threads per rank = one rank's share of the cores) and runs every benchmark
on all ranks at once, so each rank sees the contention it sees in training:

- matmul ``(M, K) @ (K, N)`` over square and skinny shapes (median time per shape), in
  float32 and, on the same shapes, in each other dtype of ``Settings.matmul_dtypes``
  (bfloat16, float16) for that dtype's peak; a dtype running more than
  ``SLOW_DTYPE_FACTOR`` times slower than float32 on a shape is left out (no peak), unless
  ``Settings.keep_slow_dtypes`` (``--keep-slow-dtypes``: priced as slow as measured);
- memory bandwidth: ``copy_`` and ``add(out=)`` over arrays far beyond the caches;
- per-op overhead: ``add`` of 1-element tensors (without grad: the dispatch a
  benchmarked matmul pays too; with grad: plus the autograd recording a training
  step pays);
- the executor's own fixed costs (``executor``): autoddl's executor (the compiled local
  program of DistributedModel, train_step with AdamW) runs chains of tiny ops under an all-B plan
  on a mesh of every rank (no collectives), three kinds of chain (one input per op, two
  inputs, two inputs one of which a parameter) at two lengths, forward alone and whole
  steps; least squares over the chains give the per-op, per-input and per-parameter
  costs (:func:`fit_executor_overheads`); and one boxing move of the executor (P -> B, S -> B:
  a functional collective and its wait) of a 4 KB tensor against the bare collective gives the
  per-collective cost;
- each collective kind on every mesh-axis size that divides ``nproc`` (subgroups of
  consecutive ranks, all running at once, as the axes of a 2-D mesh do), over message
  sizes ``M`` defined as in ``costmodel.collectives``, carried out the way the
  executor's backend runs it (gloo: reduce-scatter is gloo's all-reduce + chunk);
- point-to-point sends (``send_recv``) between the ranks of each pair (0-1, 2-3, ...; every pair at
  once, as pipeline stages run), as torch.distributed.pipelining's stages send (its ``_batch_p2p``
  issues a batch of sends as ``dist.isend`` and the matching receives as ``dist.irecv``, then waits):
  a ping-pong of ``isend`` + wait and ``irecv`` + wait of M bytes each way; the time of one send is
  half a round trip.

``Settings.kinds`` picks the communication kinds to time and ``comm_only`` skips everything else
(``autoddl calibrate --only send_recv``).

Small messages run back to back in batches after a barrier, so a rank's exit skew
from the barrier does not count; a point's time is the median over repetitions of
the slowest rank. This module returns raw timings and the compute summaries; the
collective fits (which need ``costmodel``) live in ``autoddl.calibration``. The benchmarks'
models are in executor/calibrate_models.py; ``--across-hosts`` in executor/calibrate_hosts.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

from autoddl.cluster import (FITTED_KINDS, PEAK_DTYPES, SKEW_BASE_MS, ExecutorOverheads,
                             RecomputeCost)
from autoddl.machine import usable_cores
from executor.calibrate_models import (CHAIN_KINDS, CHAIN_WIDTH, PROBE_SIZES, block_input, block_model, broadcast_plan,
                                       chain_loss, chain_model, probe_ops, zero1_plan, zero3_plan)
from executor.calibrate_optimizer import OPTIMIZER_NUMELS, fit_optimizer_ns, time_optimizer_steps
from executor.calibrate_skew import (SKEW_BYTES, SKEW_COMPUTE_MS, SKEW_REPEAT_FACTOR, fit_skew_us, skew_points,
                                    time_arrival_skew)
from executor.local_ranks import run_ranks

SQUARE_SIZES = (64, 128, 256, 512, 1024, 2048)
SKINNY_SHAPES = ((2048, 2048, 64), (2048, 64, 2048), (64, 2048, 2048), (2048, 256, 256),
                 (256, 2048, 256), (256, 256, 2048), (1024, 1024, 128), (4096, 64, 64))   # (M, N, K)
MESSAGE_BYTES = tuple(4096 * 4 ** i for i in range(7)) + (32 << 20,)                      # 4 KB .. 32 MB
QUICK_MESSAGE_BYTES = (4096, 32 << 10, 256 << 10, 1 << 20, 4 << 20)
LARGE_MATMUL_FLOPS = 1e9            # matmuls at least this big give efficiency.compute
MATMUL_DTYPES = ("float32", "bfloat16", "float16")   # timed on the same shapes; float32 gives the curve
SLOW_DTYPE_FACTOR = 8.0             # a dtype this many times slower than float32 on a shape gets no peak
SLOW_CALL_S = 0.05                  # an op family's call this slow is timed in two passes only
FULL_LAUNCHES = 3                   # a full calibration's launches (median of each timing; Settings.launches)
MESSAGES_PER_CALL = {"send_recv": 2}  # a timed send_recv call is a ping-pong: two one-way messages
# The compute between two boxing moves when collective_us is timed: a move in a step follows the ops
# since the previous one (0.2-1 ms per layer in the fidelity study's tiny models), and each rank gets
# there at its own time; the wait (the peer is late, or its waiting thread was descheduled, as a
# virtual machine's idle vCPU is) is part of what a step pays per move, which back-to-back calls hide.
STEP_GAP_S = SKEW_BASE_MS * 1e-3




def default_threads(nproc: int) -> int:
    """One rank's share of the cores this process may use (the executor's OMP_NUM_THREADS)."""
    return max(1, usable_cores() // max(1, nproc))


def ranks_at_once(threads: int) -> int:
    """How many ranks of ``threads`` intra-op threads this machine's cores run at once: the
    ``cores_per_node`` a CPU calibration writes."""
    return max(1, usable_cores() // threads)


def ranks_per_core(settings: "Settings") -> float:
    """How many of the calibration's ranks share a core: for gloo ranks on this machine's CPU,
    ``Cluster.time_sharing`` of the cluster file it writes (ranks / :func:`ranks_at_once`); 1 on
    accelerators."""
    if settings.backend != "gloo":
        return 1.0
    return max(1.0, settings.nproc / ranks_at_once(settings.threads))


def axis_sizes(nproc: int) -> tuple[int, ...]:
    """Mesh-axis sizes ``nproc`` ranks can form: every divisor > 1 (nproc 4 -> 2, 4)."""
    return tuple(n for n in range(2, nproc + 1) if nproc % n == 0)


@dataclass(frozen=True)
class Settings:
    """What ``measure`` runs; ``Settings.default(...)`` gives the CLI's defaults."""

    nproc: int = 2
    backend: str = "gloo"
    threads: int = 1
    matmul_shapes: tuple[tuple[int, int, int], ...] = ()     # (M, N, K)
    message_bytes: tuple[int, ...] = MESSAGE_BYTES
    memory_bytes: int = 128 << 20     # per array (copy: 2 arrays, add: 3) on every rank
    repeats: int = 7                  # timed repetitions per collective point / memory benchmark
    matmul_time_s: float = 0.25       # per matmul shape (at least 3 repetitions)
    batch_time_s: float = 0.01        # a timed batch of a small collective lasts at least this
    timeout_s: float = 600.0
    quick: bool = False
    verbose: bool = True              # rank 0 prints one line per benchmark to stderr
    executor_chains: tuple[int, int] = (8, 40)   # ops per chain (short, long) of the executor benchmark
    executor_reps: int = 15           # timed steps per chain (after 2 untimed)
    family_sizes: tuple[str, ...] = tuple(PROBE_SIZES)  # sizes (PROBE_SIZES names) each op family is timed at
    family_dtypes: tuple[str, ...] = MATMUL_DTYPES      # compute dtypes each op family is timed in
    family_passes: int = 25           # timed passes over the op families of one size and dtype (median)
    recompute_chains: tuple[int, int] = (8, 24)   # ops per block (short, long) of the recompute benchmark
    shard_steps: int = 30             # timed steps of each shard-runner model (executor/calibrate_shards.py)
    matmul_dtypes: tuple[str, ...] = MATMUL_DTYPES   # float32 first; the others get a peak each
    kinds: tuple[str, ...] = FITTED_KINDS   # communication kinds timed (send_recv: on pairs of ranks)
    comm_only: bool = False           # time the communication kinds only (no compute, memory or executor)
    launches: int = 1                 # times every benchmark is launched; each timing: the median over them
    keep_slow_dtypes: bool = False    # give a dtype a peak however slow (else: none past SLOW_DTYPE_FACTOR)

    def __post_init__(self) -> None:
        if isinstance(self.launches, bool) or not isinstance(self.launches, int) or self.launches < 1:
            raise ValueError(f"calibrate: --launches must be a positive integer, got {self.launches!r}")
        bad_kinds = [k for k in self.kinds if k not in FITTED_KINDS]
        if bad_kinds or not self.kinds:
            raise ValueError(f"calibrate: --only: unknown communication kinds {bad_kinds or '(none given)'}; "
                             f"known: {', '.join(FITTED_KINDS)}")
        if self.comm_only and "send_recv" in self.kinds and self.nproc % 2:
            raise ValueError(f"calibrate: send_recv is timed on pairs of ranks: --nproc must be even, got {self.nproc}")
        if not self.matmul_dtypes or self.matmul_dtypes[0] != "float32" or len(set(self.matmul_dtypes)) != len(
                self.matmul_dtypes) or not set(self.matmul_dtypes) <= set(PEAK_DTYPES):
            raise ValueError(f"calibrate: matmul_dtypes must start with float32 and name each of {PEAK_DTYPES} at "
                             f"most once, got {self.matmul_dtypes}")
        if self.nproc < 2:
            raise ValueError(f"calibrate: --nproc must be at least 2 to time collectives, got {self.nproc}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"calibrate: --backend must be gloo or nccl, got {self.backend!r}")
        if self.threads < 1:
            raise ValueError(f"calibrate: --threads must be at least 1, got {self.threads}")
        bad = [z for z in self.family_sizes if z not in PROBE_SIZES]
        if bad or len(self.family_sizes) < 2 or not set(self.family_dtypes) <= set(PEAK_DTYPES):
            raise ValueError(f"calibrate: family_sizes must name at least 2 of {tuple(PROBE_SIZES)} (got "
                             f"{self.family_sizes}) and family_dtypes only {PEAK_DTYPES} (got {self.family_dtypes})")

    @classmethod
    def default(cls, nproc: int = 2, backend: str = "gloo", quick: bool = False,
                threads: int | None = None, **overrides: Any) -> "Settings":
        """Full settings (3 launches, about 2-3 min for 2 ranks on 2 cores) or ``quick`` ones (one launch,
        ~10 s, for tests)."""
        if quick:
            base = dict(matmul_shapes=tuple((s, s, s) for s in SQUARE_SIZES[:4]) + ((512, 512, 64),),
                        message_bytes=QUICK_MESSAGE_BYTES, memory_bytes=32 << 20, repeats=3,
                        matmul_time_s=0.05, batch_time_s=0.002, executor_chains=(4, 12), executor_reps=5,
                        family_sizes=("tiny", "small"), family_dtypes=("float32", "bfloat16"), family_passes=9,
                        recompute_chains=(4, 12), shard_steps=8)
        else:
            base = dict(matmul_shapes=tuple((s, s, s) for s in SQUARE_SIZES) + SKINNY_SHAPES, launches=FULL_LAUNCHES)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(nproc=nproc, backend=backend, quick=quick,
                   threads=threads if threads is not None else default_threads(nproc), **base)


@dataclass(frozen=True)
class MatmulTiming:
    m: int
    n: int
    k: int
    time_s: float                     # median over repetitions, mean over ranks
    dtype: str = "float32"            # the dtype of A, B and the output

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class CollectiveTiming:
    kind: str                         # a COLLECTIVE_KINDS name
    n_devices: int                    # mesh-axis size
    nbytes: int                       # M as in costmodel.collectives
    time_s: float                     # median over repetitions of the slowest rank
    how: str                          # what ran, e.g. "gloo all_reduce"




@dataclass(frozen=True)
class ChainTiming:
    """One chain the executor ran: its op / input / parameter-use counts and median times."""

    kind: str                         # a CHAIN_KINDS name
    ops: int                          # ops the executor runs (getitem excluded), as costmodel counts them
    inputs: int                       # tensor inputs over those ops
    params: int                       # parameter uses over those ops
    forward_s: float                  # median forward (local program + loss to B), max over ranks
    step_s: float                     # median train_step (forward, backward, grad sync, AdamW)
    eager_forward_s: float = 0.0      # the same chain as a plain module, no executor: forward + loss
    eager_step_s: float = 0.0         # ... and its backward (0: not timed)


@dataclass(frozen=True)
class ExecutorTimings:
    chains: tuple[ChainTiming, ...]
    move_us: dict[str, float]          # "all_reduce" (P -> B) / "all_gather" (S -> B): the executor's move in a step
    raw_us: dict[str, float]           # the bare gloo / nccl collective on the same tensor
    param_syncs: tuple[tuple[int, float, float], ...] = ()   # ZeRO-1 sync: (parameters, sync us, bare all-gather us)
    param_gathers: tuple[tuple[int, float, float], ...] = ()  # ZeRO-3 gather: (parameters, gather us, bare us)


@dataclass(frozen=True)
class ExecutorFit:
    overheads: ExecutorOverheads
    step_fixed_us: float              # per-step intercept (input placement, loss, zero_grad); not costed
    max_rel_residual: float           # over the chains' step times


def fit_executor_overheads(timings: ExecutorTimings) -> ExecutorFit:
    """Per-op, per-input and per-parameter-use costs by non-negative least squares over the chains.

    forward: ``t = op_f * ops + in_f * inputs + c_f``; step: ``t = op * ops + in * inputs +
    param * params + c``; backward terms are the step's minus the forward's (at least 0).
    Per collective: the median over kinds of (the executor's move as a step pays it - the bare
    collective back to back: ``Bench.executor``), at least 0.
    """
    from scipy.optimize import nnls

    import numpy as np

    ch = timings.chains
    if len({c.kind for c in ch}) < len(CHAIN_KINDS) or len(ch) < 4:
        raise ValueError(f"fit_executor_overheads: need every chain kind {CHAIN_KINDS} at 2 lengths, got "
                         f"{[(c.kind, c.ops) for c in ch]}")
    fwd_x = np.array([[c.ops, c.inputs, 1.0] for c in ch])                 # (chains, 3)
    step_x = np.array([[c.ops, c.inputs, c.params, 1.0] for c in ch])      # (chains, 4)
    fwd_t = np.array([c.forward_s for c in ch])
    step_t = np.array([c.step_s for c in ch])
    w = 1.0 / step_t                                                      # relative residuals
    f, _ = nnls(fwd_x * (1.0 / fwd_t)[:, None], np.ones(len(ch)))
    a, _ = nnls(step_x * w[:, None], np.ones(len(ch)))
    pred = step_x @ a
    diffs = [timings.move_us[k] - timings.raw_us[k] for k in timings.move_us if k in timings.raw_us]
    overheads = ExecutorOverheads(
        op_forward_us=float(f[0]) * 1e6, op_backward_us=max(0.0, float(a[0] - f[0])) * 1e6,
        input_forward_us=float(f[1]) * 1e6, input_backward_us=max(0.0, float(a[1] - f[1])) * 1e6,
        param_us=float(a[2]) * 1e6, collective_us=max(0.0, statistics.median(diffs)) if diffs else 0.0)
    return ExecutorFit(overheads, float(a[3]) * 1e6, float(np.max(np.abs(pred - step_t) / step_t)))


def fit_param_sync_us(timings: ExecutorTimings, per_copy_us: float) -> float | None:
    """``executor.param_sync_us``: what a ZeRO-1/2 parameter sync costs the host per parameter beyond its
    all-gather and the copy each parameter is priced at (``per_copy_us``: a copy pass's fixed cost,
    costmodel/copy_passes.py): the slope, over the two chain lengths, of the sync less the bare
    all-gather of its buffer, less ``per_copy_us``; at least 0. None when the syncs were not timed."""
    return _per_param_beyond_bare(timings.param_syncs, per_copy_us)


def fit_param_gather_us(timings: ExecutorTimings, per_copy_us: float) -> float | None:
    """``executor.param_gather_us``: what a ZeRO-3 group gather costs the host per parameter it packs and
    unpacks, beyond its all-gather and the copy each parameter is priced at: as :func:`fit_param_sync_us`,
    from the gathers of ``timings.param_gathers``. None when the gathers were not timed."""
    return _per_param_beyond_bare(timings.param_gathers, per_copy_us)


def _per_param_beyond_bare(rows: Sequence[tuple[int, float, float]], per_copy_us: float) -> float | None:
    """The slope over the parameter counts of ``rows`` ((parameters, executor us, bare collective us))
    of the executor's time less the bare collective's, less ``per_copy_us``; at least 0; None without
    two parameter counts."""
    rows = sorted(rows)
    if len(rows) < 2 or rows[-1][0] == rows[0][0]:
        return None
    (p1, sync1, bare1), (p2, sync2, bare2) = rows[0], rows[-1]
    return max(0.0, ((sync2 - bare2) - (sync1 - bare1)) / (p2 - p1) - per_copy_us)


def executor_glue_us(timings: ExecutorTimings) -> tuple[float, float] | None:
    """What the executor adds to an op beyond the op itself (microseconds, forward and backward): per
    chain kind without parameter uses (unary, binary), the slope over the chain length of the
    executor's forward and backward (step - forward) less the same chain's as a plain module; the
    mean over the kinds, at least 0. None when the plain chains were not timed."""
    by: dict[str, list[ChainTiming]] = {}
    for c in timings.chains:
        if c.kind in ("unary", "binary") and c.eager_step_s > 0:
            by.setdefault(c.kind, []).append(c)
    fwd, bwd = [], []
    for cs in by.values():
        if len(cs) < 2:
            continue
        a, b = min(cs, key=lambda c: c.ops), max(cs, key=lambda c: c.ops)
        n = b.ops - a.ops
        ex_f, ea_f = (b.forward_s - a.forward_s) / n, (b.eager_forward_s - a.eager_forward_s) / n
        ex_b = ((b.step_s - b.forward_s) - (a.step_s - a.forward_s)) / n
        ea_b = ((b.eager_step_s - b.eager_forward_s) - (a.eager_step_s - a.eager_forward_s)) / n
        fwd.append(ex_f - ea_f)
        bwd.append(ex_b - ea_b)
    if not fwd:
        return None
    return max(0.0, statistics.fmean(fwd)) * 1e6, max(0.0, statistics.fmean(bwd)) * 1e6


def interleaved_call_times(fns: Sequence[Callable[[], Any]], passes: int) -> list[float]:
    """Median seconds per call of each of ``fns``, run in turn for ``passes`` passes (after one untimed),
    each call timed alone and its result kept until the pass ends; a call slower than SLOW_CALL_S (a
    CPU's float16 convolution backward can take a second) runs in two passes only.

    Each pass starts one op further along (pass p runs ``fns[p % n:] + fns[:p % n]``): the first call of
    a pass, after the previous pass's results are freed, measured 17 us for a view that takes 5 us
    anywhere else on this machine (2026-11-27); in a fixed order one family (``view``, the probe's first
    op) paid that in every pass and was priced 30-55 us per view. Rotated, each op is first in at most
    ceil(passes / n) passes, which the median leaves out."""
    n = len(fns)
    times: list[list[float]] = [[] for _ in fns]
    for p in range(passes + 1):
        kept = []
        for i in (*range(p % n, n), *range(p % n)):
            if p > 2 and times[i] and min(times[i]) > SLOW_CALL_S:
                continue
            t0 = time.perf_counter()
            kept.append(fns[i]())
            if p:
                times[i].append(time.perf_counter() - t0)
        del kept
    return [min(t) if min(t) > SLOW_CALL_S else statistics.median(t) for t in times]


@dataclass(frozen=True)
class FamilyTiming:
    """One op family timed on synthetic inputs in one dtype and size: its forward (with autograd
    recording) and backward (the op's autograd node, the grad call's own cost taken out), median over
    repetitions, mean over ranks; with the traced op's FLOPs and bytes for the cost model's roofline."""

    family: str                       # the op's name (OpNode.op_name), e.g. "linear"
    dtype: str
    size: str                         # a PROBE_SIZES name
    flops: int
    nbytes: int                       # bytes read + written
    forward_s: float
    backward_s: float                 # 0 when the op has no backward


@dataclass(frozen=True)
class RecomputeTiming:
    """Blocks of ``ops`` ops (``kind``: element-wise, or matmuls, every second of which selective
    recompute runs again) run plainly (``policy`` none) or checkpointed as the executor does (full, selective):
    median forward and forward + backward, max over ranks."""

    kind: str                         # "elementwise" | "matmul"
    policy: str                       # "none" | "full" | "selective"
    ops: int
    forward_s: float
    step_s: float


def fit_recompute(timings: Sequence[RecomputeTiming]) -> dict[str, RecomputeCost]:
    """Per policy, what checkpointing adds, from blocks of two lengths: per kind (element-wise,
    matmul) and policy, the slope over the block length of the forward ``f`` and of the backward
    ``b`` (step - forward) and their intercepts (the block's own cost). Per op: forward
    ``f_policy - f_none``; backward ``b_policy - b_none``, less ``f_none`` times the share of ops run
    again (full: every op; selective: the element-wise ones and every second matmul, torchtitan's
    policy as executor/recompute.py runs it; the chains have even lengths). Per block: the intercepts' differences,
    averaged over the two kinds. Every cost at least 0."""
    by = {(t.kind, t.policy, t.ops): t for t in timings}
    kinds, policies = ("elementwise", "matmul"), ("full", "selective")
    lengths = sorted({t.ops for t in timings})
    if len(lengths) < 2 or any((k, p, n) not in by for k in kinds for p in ("none",) + policies for n in lengths[:2]):
        raise ValueError(f"fit_recompute: need every kind {kinds} under none, full and selective at 2 block "
                         f"lengths, got {sorted(by)}")
    n1, n2 = lengths[0], lengths[-1]

    def line(kind: str, policy: str, part: str) -> tuple[float, float]:
        """(slope per op, intercept) in microseconds of the forward ("f") or backward ("b")."""
        def t(n: int) -> float:
            x = by[(kind, policy, n)]
            return (x.forward_s if part == "f" else x.step_s - x.forward_s) * 1e6
        slope = (t(n2) - t(n1)) / (n2 - n1)
        return slope, t(n1) - slope * n1

    out = {}
    for policy in policies:
        per: dict[str, tuple[float, float]] = {}
        blocks_f, blocks_b = [], []
        for kind in kinds:
            (f0, F0), (fp, Fp) = line(kind, "none", "f"), line(kind, policy, "f")
            (b0, B0), (bp, Bp) = line(kind, "none", "b"), line(kind, policy, "b")
            rerun = 1.0 if policy == "full" or kind == "elementwise" else 0.5
            per[kind] = (max(0.0, fp - f0), max(0.0, bp - b0 - rerun * f0))
            blocks_f.append(Fp - F0)
            blocks_b.append(Bp - B0)
        out[policy] = RecomputeCost(op_forward_us=per["elementwise"][0], op_backward_us=per["elementwise"][1],
                                    matmul_forward_us=per["matmul"][0], matmul_backward_us=per["matmul"][1],
                                    block_forward_us=max(0.0, statistics.fmean(blocks_f)),
                                    block_backward_us=max(0.0, statistics.fmean(blocks_b)))
    return out


@dataclass(frozen=True)
class Measurements:
    settings: Settings
    matmuls: tuple[MatmulTiming, ...]  # float32 (the efficiency curve)
    memory_gbps: dict[str, float]     # {"copy": GB/s, "add": GB/s} per rank, bytes read + written
    dispatch_us: float                # add of 1-element tensors, no grad (what a timed matmul pays too)
    tiny_op_us: float                 # add of 1-element tensors needing grad (dispatch + autograd)
    collectives: tuple[CollectiveTiming, ...]
    seconds: dict[str, float] = field(default_factory=dict)    # wall time per benchmark section
    machine: str = ""
    executor: ExecutorTimings | None = None                     # the executor's own fixed costs
    dtype_matmuls: dict[str, tuple[MatmulTiming, ...]] = field(default_factory=dict)   # other dtypes, same shapes
    dropped_dtypes: dict[str, str] = field(default_factory=dict)  # dtype -> why it got no peak (too slow)
    slow_dtypes: dict[str, str] = field(default_factory=dict)     # dtype -> how slow, kept (--keep-slow-dtypes)
    families: tuple[FamilyTiming, ...] = ()                      # each op family per dtype and size
    recompute: tuple[RecomputeTiming, ...] = ()                  # checkpointed blocks against plain ones
    optimizer_s: dict[str, tuple[float, ...]] = field(default_factory=dict)   # kind -> a step at OPTIMIZER_NUMELS
    arrival_skew: tuple[tuple[float, float], ...] = ()          # (compute_s, extra_s) per SKEW_COMPUTE_MS
    launches: int = 1                                            # launches each timing is the median of

    @property
    def op_overhead_us(self) -> float:
        """Per-op cost besides the kernel: the dispatch and autograd recording of a tiny op."""
        return self.tiny_op_us


@dataclass(frozen=True)
class ComputeSummary:
    """Peak, large-matmul efficiency and the efficiency curve implied by matmul timings."""

    peak_tflops: float                            # best achieved (dispatch taken out) by a long matmul
    large_efficiency: float                       # median efficiency of matmuls >= LARGE_MATMUL_FLOPS
    curve: tuple[tuple[float, float], ...]        # (GFLOP, efficiency), GFLOP strictly increasing
    points: tuple[tuple[MatmulTiming, float], ...]  # every timing with its efficiency, by FLOPs
    groups: tuple[tuple[MatmulTiming, ...], ...]  # the timings behind each curve point
    dtype_peaks: tuple[tuple[str, float, MatmulTiming], ...] = ()  # (dtype, TFLOPS, best timing), float32 first

    @property
    def peaks(self) -> dict[str, float]:
        """Peak TFLOPS per measured dtype (float32 alone when no other dtype was timed)."""
        return {d: p for d, p, _ in self.dtype_peaks} or {"float32": self.peak_tflops}


def _rates(matmuls: tuple[MatmulTiming, ...], dispatch_s: float) -> tuple[dict[MatmulTiming, float], float]:
    """Each timing's FLOP/s with the dispatch taken out, and the peak: the best rate among matmuls lasting
    at least 10x the dispatch (so a noisy dispatch time cannot inflate it)."""
    rate = {mt: mt.flops / max(mt.time_s - dispatch_s, 0.5 * mt.time_s) for mt in matmuls}
    long = [r for mt, r in rate.items() if mt.time_s >= 10 * dispatch_s] or list(rate.values())
    return rate, max(long)


def compute_summary(matmuls: tuple[MatmulTiming, ...], dispatch_s: float,
                    dtype_matmuls: dict[str, tuple[MatmulTiming, ...]] | None = None) -> ComputeSummary:
    """Achieved FLOP/s = flops / (time - dispatch_s): the cost model adds the per-op overhead itself.

    ``matmuls`` (float32) give the peak, the curve and the large-matmul efficiency:
    efficiencies are capped at 1; points within a factor of 2 in FLOPs form one curve point
    (median efficiency at the geometric mean FLOPs), so a square and a skinny matmul of one
    size average out. ``dtype_matmuls`` (other dtypes) give one peak each, by the same rule.
    """
    if not matmuls:
        raise ValueError("compute_summary: no matmul timings")
    rate, peak = _rates(matmuls, dispatch_s)
    dtype_peaks = []
    for dtype, timings in {"float32": matmuls, **(dtype_matmuls or {})}.items():
        if timings:
            r, best = _rates(timings, dispatch_s)
            dtype_peaks.append((dtype, best / 1e12, next(mt for mt, x in r.items() if x == best)))
    points = tuple(sorted(((mt, min(1.0, r / peak)) for mt, r in rate.items()), key=lambda p: p[0].flops))
    groups: list[list[tuple[MatmulTiming, float]]] = []
    for p in points:
        if groups and p[0].flops < 2 * groups[-1][0][0].flops:
            groups[-1].append(p)
        else:
            groups.append([p])
    curve = tuple((round(math.exp(statistics.fmean(math.log(mt.flops / 1e9) for mt, _ in g)), 6),
                   round(min(1.0, max(1e-3, statistics.median(e for _, e in g))), 4)) for g in groups)
    large = [e for mt, e in points if mt.flops >= LARGE_MATMUL_FLOPS] or [points[-1][1]]
    return ComputeSummary(peak_tflops=peak / 1e12, large_efficiency=statistics.median(large), curve=curve,
                          points=points, groups=tuple(tuple(mt for mt, _ in g) for g in groups),
                          dtype_peaks=tuple(dtype_peaks))


# -- running the ranks ---------------------------------------------------------------------------
def measure(settings: Settings, start_method: str = "fork") -> Measurements:
    """Run every benchmark on ``settings.nproc`` local ranks and combine their timings.

    ``fork`` (default) starts ranks in a fraction of a second; the calling process must
    not have initialised a process group. Raises with the failing rank's traceback, or
    ``TimeoutError`` after ``settings.timeout_s`` (every rank is killed).
    """
    if start_method == "fork":             # ranks inherit these imports (seconds each on 2 busy cores)
        import torch.distributed.device_mesh  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
    start = time.perf_counter()
    probes = {} if settings.comm_only else probe_ops(settings)   # traced once here; ranks get them (fork) or a copy
    try:
        results = run_ranks(_bench_rank, settings.nproc, settings, probes, timeout_s=settings.timeout_s,
                            start_method=start_method, threads=settings.threads)
    except TimeoutError as exc:
        raise TimeoutError(f"calibrate: {exc}") from None
    except RuntimeError as exc:
        raise RuntimeError(f"calibrate: {exc}") from None
    return _combine(settings, results, time.perf_counter() - start)


def measure_launches(settings: Settings, start_method: str = "fork") -> Measurements:
    """:func:`measure` launched ``settings.launches`` times, one after the other, combined by
    :func:`median_of_launches`; rank 0 says which launch runs."""
    launches = []
    for i in range(settings.launches):
        if settings.verbose and settings.launches > 1:
            print(f"calibrate: launch {i + 1} of {settings.launches}", file=sys.stderr, flush=True)
        launches.append(measure(settings, start_method))
    return median_of_launches(launches)


def median_of_launches(launches: Sequence[Measurements]) -> Measurements:
    """One Measurements from several launches of the same settings: each timing (every float field,
    at any depth) the median over the launches, what was timed (shapes, sizes, counts, labels) as the
    first launch says, the wall times added up. On a shared machine one launch's numbers move by tens
    of percent from one minute to the next (two full launches a minute apart on the 2-core VM
    measured memory bandwidth 12.3 and 7.7 GB/s, executor.param_us 69 and 98 us); the median of three
    keeps one slow or fast minute out of the cluster file (benchmarks/calibration_spread.py)."""
    if not launches:
        raise ValueError("median_of_launches: no launches to combine")
    merged = _median_merge(list(launches), "measurements")
    seconds = {k: sum(m.seconds.get(k, 0.0) for m in launches) for k in launches[0].seconds}
    return dataclasses.replace(merged, seconds=seconds, launches=len(launches))


def _median_merge(values: list[Any], where: str) -> Any:
    first = values[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{f.name: _median_merge([getattr(v, f.name) for v in values],
                                                                   f"{where}.{f.name}")
                                             for f in dataclasses.fields(first) if f.init})
    if isinstance(first, dict):
        if any(v.keys() != first.keys() for v in values):
            raise ValueError(f"median_of_launches: the launches timed different {where} keys; calibrate again")
        return {k: _median_merge([v[k] for v in values], f"{where}[{k!r}]") for k in first}
    if isinstance(first, (tuple, list)):
        if any(len(v) != len(first) for v in values):
            raise ValueError(f"median_of_launches: the launches timed different numbers of {where}; calibrate again")
        return type(first)(_median_merge(list(column), f"{where}[{i}]") for i, column in enumerate(zip(*values)))
    if isinstance(first, float):
        return statistics.median(values)
    return first


def _combine(settings: Settings, ranks: list[dict], wall_s: float) -> Measurements:
    """Compute: mean over ranks of each rank's median. Collectives: median over reps of the max over ranks."""
    mean = statistics.fmean
    matmuls = tuple(MatmulTiming(m, n, k, mean(r["matmul"][i] for r in ranks))
                    for i, (m, n, k) in enumerate(settings.matmul_shapes if "matmul" in ranks[0] else ()))
    dropped = dict(ranks[0].get("matmul_dropped", {}))
    dtype_matmuls = {dtype: tuple(MatmulTiming(m, n, k, mean(r["matmul_dtypes"][dtype][i] for r in ranks), dtype)
                                  for i, (m, n, k) in enumerate(settings.matmul_shapes))
                     for dtype in ranks[0].get("matmul_dtypes", {}) if dtype not in dropped}
    colls = []
    for key, how in ranks[0]["collectives_how"].items():
        per_rep = [max(r["collectives"][key][i] for r in ranks) for i in range(settings.repeats)]
        kind, n, nbytes = key
        colls.append(CollectiveTiming(kind, n, nbytes, statistics.median(per_rep), how))
    seconds = {k: max(r["seconds"][k] for r in ranks) for k in ranks[0]["seconds"]}
    seconds["total"] = wall_s
    executor = None
    if "chains" in ranks[0]:
        chains = tuple(ChainTiming(*c[:4], *(max(r["chains"][i][j] for r in ranks) for j in range(4, len(c))))
                       for i, c in enumerate(ranks[0]["chains"]))
        executor = ExecutorTimings(chains, {k: max(r["move_us"][k] for r in ranks)
                                            for k in ranks[0]["move_us"]},
                                   {k: max(r["raw_us"][k] for r in ranks) for k in ranks[0]["raw_us"]},
                                   *(tuple((int(row[0]), *(max(r[key][i][j] for r in ranks) for j in (1, 2)))
                                           for i, row in enumerate(ranks[0].get(key, ())))
                                     for key in ("param_syncs", "param_gathers")))
    return Measurements(
        settings=settings, matmuls=matmuls,
        memory_gbps={k: mean(r["memory_gbps"][k] for r in ranks) for k in ranks[0].get("memory_gbps", {})},
        dispatch_us=mean(r.get("dispatch_us", 0.0) for r in ranks), tiny_op_us=mean(r.get("tiny_op_us", 0.0) for r in ranks),
        collectives=tuple(colls), seconds=seconds, machine=ranks[0]["machine"], executor=executor,
        dtype_matmuls=dtype_matmuls, dropped_dtypes=dropped, slow_dtypes=dict(ranks[0].get("matmul_slow", {})),
        **_combine_families(ranks, ranks_per_core(settings)))


def _combine_families(ranks: list[dict], sharing: float) -> dict[str, Any]:
    """Families and optimizer steps: mean over ranks of each rank's median (as compute). Recompute blocks:
    max over ranks. Arrival skew: the slowest rank's, per repetition, beyond the compute as priced at
    ``sharing`` ranks per core (``skew_points``)."""
    mean = statistics.fmean
    out: dict[str, Any] = {}
    if "families" in ranks[0]:
        out["families"] = tuple(FamilyTiming(*f[:5], mean(r["families"][i][5] for r in ranks),
                                             mean(r["families"][i][6] for r in ranks))
                                for i, f in enumerate(ranks[0]["families"]))
    if "arrival_skew" in ranks[0]:
        out["arrival_skew"] = skew_points([r["arrival_skew"] for r in ranks], sharing)
    if "optimizer_s" in ranks[0]:
        out["optimizer_s"] = {k: tuple(mean(r["optimizer_s"][k][i] for r in ranks) for i in range(len(v)))
                              for k, v in ranks[0]["optimizer_s"].items()}
    if "recompute" in ranks[0]:
        out["recompute"] = tuple(RecomputeTiming(*c[:3], max(r["recompute"][i][3] for r in ranks),
                                                 max(r["recompute"][i][4] for r in ranks))
                                 for i, c in enumerate(ranks[0]["recompute"]))
    return out


def per_call_s(fn: Callable[[], Any], calls: int, sync: Callable[[], None] = lambda: None) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``, ``sync`` before and after (an
    accelerator's queue drained)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def tiny_add_s(torch: Any, calls: int, device: Any = "cpu", grad: bool = False,
               sync: Callable[[], None] = lambda: None) -> float:
    """Seconds of an ``add`` of 1-element tensors (needing a gradient when ``grad``: autograd's cost too):
    the median of 5 batches of ``calls`` back-to-back calls (:func:`per_call_s`)."""
    a, b = (torch.ones(1, device=device, requires_grad=grad) for _ in range(2))
    return statistics.median(per_call_s(lambda: torch.add(a, b), calls, sync) for _ in range(5))


def _bench_rank(settings: Settings, probes: dict | None = None) -> dict:
    """One rank's benchmarks (run by :func:`executor.local_ranks.run_ranks`, which sets RANK)."""
    return Bench(settings, int(os.environ["RANK"]), probes or {}).run()


# -- the benchmarks, inside one rank ---------------------------------------------------------------
class Bench:
    def __init__(self, settings: Settings, rank: int, probes: dict | None = None) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.s, self.rank = torch, dist, settings, rank
        self.probes = probes or {}
        torch.set_num_threads(settings.threads)
        if settings.backend == "nccl":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
            self.sync: Callable[[], None] = torch.cuda.synchronize
        else:
            self.device, self.sync = torch.device("cpu"), (lambda: None)
        dist.init_process_group(settings.backend, rank=rank, world_size=settings.nproc,
                                timeout=timedelta(seconds=max(60.0, settings.timeout_s)))
        self.seconds: dict[str, float] = {}

    def say(self, text: str) -> None:
        if self.rank == 0 and self.s.verbose:
            print(f"calibrate: {text}", file=sys.stderr, flush=True)

    def agree_max(self, value: float, group: Any = None) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=group)
        return float(t.item())

    def time_calls(self, fn: Callable[[], Any], calls: int) -> float:
        """Seconds per call of ``calls`` back-to-back calls of ``fn`` (:func:`per_call_s`)."""
        return per_call_s(fn, calls, self.sync)

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                                          f"{os.cpu_count()} cores, torch {self.torch.__version__}"}
        compute = (("overhead", self.overhead), ("executor", self.executor), ("families", self.families),
                   ("recompute", self.recompute), ("memory", self.memory), ("optimizer", self.optimizer),
                   ("matmul", self.matmuls))
        comm = (("collectives", self.collectives),) + (
            (("arrival_skew", self.arrival_skew),) if "all_reduce" in self.s.kinds else ())
        for name, fn in comm if self.s.comm_only else compute + comm:
            self.dist.barrier()
            t0 = time.perf_counter()
            out.update(fn())
            self.seconds[name] = time.perf_counter() - t0
        out["seconds"] = self.seconds
        return out

    def overhead(self) -> dict[str, float]:
        calls = 300 if self.s.quick else 2000
        dispatch, tiny = (tiny_add_s(self.torch, calls, self.device, grad, self.sync) for grad in (False, True))
        self.say(f"per-op overhead: add of 1-element tensors {dispatch * 1e6:.1f} us ({tiny * 1e6:.1f} us with "
                 "grad) (rank 0)")
        return {"dispatch_us": dispatch * 1e6, "tiny_op_us": tiny * 1e6}

    def executor(self) -> dict[str, Any]:
        """Chains of tiny ops through autoddl's executor, and its boxing moves against bare collectives."""
        torch, dist = self.torch, self.dist
        from torch.distributed.device_mesh import init_device_mesh

        from autoddl.boxing import boxing_moves
        from autoddl.sbp import NdSbp
        from autoddl.trace import trace
        from executor.moves import Boxer
        from executor.runtime import DistributedModel, build_optimizer, train_step

        mesh = init_device_mesh(self.device.type, (self.s.nproc,))
        x = torch.randn(CHAIN_WIDTH, CHAIN_WIDTH, device=self.device)          # (W, W)
        chains, param_graphs = [], {}
        for kind in CHAIN_KINDS:
            for n in self.s.executor_chains:
                torch.manual_seed(0)
                model = chain_model(kind, n).to(self.device)
                graph = trace(model, (x,), chain_loss, name=f"chain-{kind}-{n}")
                if kind == "param":
                    param_graphs[n] = graph                     # traced once: _param_syncs runs them again
                ops = [o for o in graph.ops() if o.op_name != "getitem"]
                dmodel = DistributedModel(model, graph, broadcast_plan(graph, (self.s.nproc,)), mesh)
                opt = build_optimizer("adamw", dmodel.parameters())
                fwd = self._median_step(lambda: dmodel(x))
                step = self._median_step(lambda: train_step(dmodel, (x,), opt))

                def eager_step(model=model) -> None:
                    model.zero_grad(set_to_none=True)
                    chain_loss(model(x), x).backward()

                eager = (self._median_step(lambda model=model: chain_loss(model(x), x)), self._median_step(eager_step))
                chains.append((kind, len(ops), sum(len(o.inputs) for o in ops), sum(len(o.params) for o in ops),
                               fwd, step, *eager))
                self.say(f"executor chain {kind} x {n}: {len(ops)} ops, forward {fwd * 1e3:.2f} ms, "
                         f"step {step * 1e3:.2f} ms (rank 0)")
        t = torch.ones(1024, device=self.device)                                 # 4 KB
        gathered = torch.empty(1024 * self.s.nproc, device=self.device)
        boxer = Boxer((self.s.nproc,), (self.rank,), {0: dist.group.WORLD.group_name}, self.s.backend)
        calls = 10 if self.s.quick else 40
        moves = {kind: (boxing_moves(4096, NdSbp.parse(src), NdSbp.parse("[B]"), (self.s.nproc,)),)
                 for kind, src in (("all_reduce", "[P]"), ("all_gather", "[S(0)]"))}
        cases = {"all_reduce": (lambda: boxer.run(moves["all_reduce"][0], t, (1024,)),
                                lambda: dist.all_reduce(t)),
                 "all_gather": (lambda: boxer.run(moves["all_gather"][0], t, (1024 * self.s.nproc,)),
                                lambda: dist.all_gather_into_tensor(gathered, t))}
        gap = self._step_gap()
        move_us, raw_us = {}, {}
        for kind, (move_fn, raw_fn) in cases.items():
            move_fn(), raw_fn()
            reps_move, reps_raw = [], []
            for _ in range(self.s.repeats):                 # interleaved: all three see the same load
                self.dist.barrier()
                in_step = self.time_calls(lambda move_fn=move_fn: (gap(), move_fn()), calls)
                self.dist.barrier()
                reps_move.append(in_step - self.time_calls(gap, calls))
                self.dist.barrier()
                reps_raw.append(self.time_calls(raw_fn, calls))
            move_us[kind] = statistics.median(reps_move) * 1e6
            raw_us[kind] = statistics.median(reps_raw) * 1e6
            self.say(f"executor {kind} of 4 KB: the executor's move after {STEP_GAP_S * 1e3:g} ms of compute "
                     f"{move_us[kind]:.0f} us, bare {self.s.backend} back to back {raw_us[kind]:.0f} us (rank 0)")
        return {"chains": chains, "move_us": move_us, "raw_us": raw_us,
                "param_syncs": self._param_syncs(mesh, x, param_graphs),
                "param_gathers": self._param_gathers(mesh, x, param_graphs)}

    def _param_syncs(self, mesh: Any, x: Any, graphs: dict[int, Any]) -> list[list[float]]:
        """ZeRO-1's parameter sync (``DistributedModel.sync_parameters``) of the ``param`` chains against the
        bare all-gather of the same buffer (:meth:`_against_bare_gather`)."""
        return self._against_bare_gather(mesh, x, graphs, zero1_plan, "ZeRO-1 parameter sync",
                                         lambda dmodel: dmodel.sync_parameters)

    def _param_gathers(self, mesh: Any, x: Any, graphs: dict[int, Any]) -> list[list[float]]:
        """A ZeRO-3 group gather as a step runs it (executor/compiled.py ``LocalStep.gather_group``: the shards
        packed and all-gathered, then unpacked into whole parameters; a chain has no repeated blocks, so its
        parameters are one group) against the bare all-gather of the same buffer (:meth:`_against_bare_gather`)."""
        def gather_all(dmodel: Any) -> Callable[[], Any]:
            step, groups = dmodel.step, range(len(dmodel.program.gathers))
            return lambda: [step.gather_group(g) for g in groups]
        return self._against_bare_gather(mesh, x, graphs, zero3_plan, "ZeRO-3 group gather", gather_all)

    def _against_bare_gather(self, mesh: Any, x: Any, graphs: dict[int, Any], plan_of: Callable[..., Any],
                             what: str, runner: Callable[[Any], Callable[[], Any]]) -> list[list[float]]:
        """``runner(dmodel)()`` (a flat all-gather of every parameter as the executor runs it) on a
        ``plan_of(graph, mesh shape)`` plan of each ``param`` chain (``graphs``: their traced graphs by length,
        as the chains traced them; each gets a fresh model, stepped once so that its shards and states
        exist), against the bare all-gather of the same buffer: per chain length, [parameters, executor us,
        bare us], each the median over repetitions (the two interleaved, each the mean over back-to-back
        calls). None timed when the ranks do not divide the chains' rows."""
        torch, dist = self.torch, self.dist
        if CHAIN_WIDTH % self.s.nproc:
            return []
        from executor.runtime import DistributedModel, build_optimizer, train_step

        calls, rows = (10 if self.s.quick else 40), []
        for n, graph in graphs.items():
            torch.manual_seed(0)
            model = chain_model("param", n).to(self.device)
            dmodel = DistributedModel(model, graph, plan_of(graph, (self.s.nproc,)), mesh)
            train_step(dmodel, (x,), build_optimizer("adamw", dmodel.parameters()))
            run = runner(dmodel)
            numel = sum(p.numel() for p in model.parameters()) // self.s.nproc
            piece = torch.ones(numel, device=self.device)                                  # this rank's shards
            gathered = torch.empty(numel * self.s.nproc, device=self.device)
            timed, bares = [], []
            for _ in range(self.s.repeats):
                self.dist.barrier()
                timed.append(self.time_calls(run, calls))
                self.dist.barrier()
                bares.append(self.time_calls(lambda: dist.all_gather_into_tensor(gathered, piece), calls))
            params = len(list(model.parameters()))
            rows.append([params, statistics.median(timed) * 1e6, statistics.median(bares) * 1e6])
            self.say(f"executor {what} of {params} parameters: {rows[-1][1]:.0f} us, the bare all-gather of "
                     f"its buffer {rows[-1][2]:.0f} us (rank 0)")
        return rows

    def _step_gap(self) -> Callable[[], Any]:
        """Matmuls taking about STEP_GAP_S, the same number on every rank: the compute between two moves."""
        a = self.torch.randn(CHAIN_WIDTH, CHAIN_WIDTH, device=self.device)
        one = self.agree_max(statistics.median(self.time_calls(lambda: a @ a, 20) for _ in range(3)))
        n = max(1, round(STEP_GAP_S / max(one, 1e-9)))

        def gap() -> None:
            for _ in range(n):
                a @ a
        return gap

    def _median_step(self, fn: Callable[[], Any]) -> float:
        """Median seconds of ``fn`` over ``executor_reps`` runs, each started after a barrier."""
        for _ in range(2):
            fn()
        times = []
        for _ in range(self.s.executor_reps):
            self.dist.barrier()
            times.append(self.time_calls(fn, 1))
        return statistics.median(times)

    def families(self) -> dict[str, Any]:
        """Each probed op (:func:`probe_ops`) on synthetic inputs of each size and dtype: its forward and
        its backward (``autograd.grad`` of its output; the grad call's own cost, timed through a view,
        taken out). The ops of one size and dtype run in turn, each call timed alone, for
        ``family_passes`` passes (median per op; :func:`interleaved_call_times`, each pass starting one
        op further along), their outputs kept until the pass ends: as in a
        training step, an op follows other ops (not itself, with its code and data hot) and allocates
        fresh memory for what it returns."""
        rows: list = []
        for (dtype, size), nodes in self.probes.items():
            self.dist.barrier()
            calls = [self._op_calls(node, needs) for node, needs in nodes]
            fwd = interleaved_call_times([c[0] for c in calls], self.s.family_passes)
            bwd = interleaved_call_times([c[1] for c in calls if c[1] is not None] + [self._grad_call(dtype)],
                                         self.s.family_passes)
            base, bwd_of = bwd[-1], iter(bwd[:-1])
            for i, ((node, _), (_, grad_fn)) in enumerate(zip(nodes, calls)):
                b = max(0.0, next(bwd_of) - base) if grad_fn is not None else 0.0
                rows.append((node.op_name, dtype, size, node.flops, node.bytes_read + node.bytes_written, fwd[i], b))
            self.say(f"op families in {dtype} at size {size}: " + ", ".join(
                f"{r[0]} {r[5] * 1e6:.0f}/{r[6] * 1e6:.0f}" for r in rows if r[1:3] == (dtype, size))
                + " us forward/backward (rank 0)")
        return {"families": rows} if rows else {}

    def _grad_call(self, dtype: str) -> Callable[[], Any]:
        """``autograd.grad`` through a view: what a backward timing pays besides the op's node."""
        torch = self.torch
        x = torch.randn(8, device=self.device, dtype=getattr(torch, dtype), requires_grad=True)
        y, g = x.view(-1), torch.ones(8, device=self.device, dtype=getattr(torch, dtype))
        return lambda: torch.autograd.grad(y, [x], g, retain_graph=True)

    def _op_calls(self, node: Any, needs: tuple[bool, ...]) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
        """A probed op run as the compiled program runs it (its aten op on local tensors), on random inputs:
        (its forward, the backward of its output into the inputs needing a gradient, or None)."""
        torch = self.torch
        from autoddl import ops
        from executor.compiled import _substitute

        # ``contiguous`` copies only an input laid out otherwise (the probe's, as a model's, is a transpose's
        # output): given a contiguous one it returns it and measures no copy, so it gets a transposed view
        strided = node.op_name == "contiguous"
        tensors = []
        for meta, grad in zip(node.input_metas, needs):
            dt = getattr(torch, meta.dtype)
            if meta.is_floating and strided and meta.ndim >= 2:
                shape = (*meta.shape[:-2], meta.shape[-1], meta.shape[-2])
                t = torch.randn(shape, device=self.device, dtype=dt).transpose(-1, -2).detach().requires_grad_(grad)
            elif meta.is_floating:
                t = torch.randn(meta.shape, device=self.device, dtype=dt).requires_grad_(grad)
            else:
                t = torch.randint(0, 2, meta.shape, device=self.device, dtype=dt)
            tensors.append(t)
        args, kwargs = ops.localize_devices(_substitute(tuple(node.args), tensors, [0]),
                                            _substitute(dict(node.kwargs), tensors, [0]), self.device)
        kernel = ops.aten_op(node)

        def run() -> Any:
            return kernel(*args, **kwargs)

        out = run()
        if isinstance(out, (tuple, list)):
            out = next((t for t in out if isinstance(t, torch.Tensor) and t.requires_grad), None)
        leaves = [t for t in tensors if t.requires_grad]
        if out is None or not out.requires_grad or not leaves:
            return run, None
        g = torch.ones_like(out)
        return run, (lambda: torch.autograd.grad(out, leaves, g, retain_graph=True, allow_unused=True))

    def recompute(self) -> dict[str, Any]:
        """Blocks of element-wise ops and of matmuls at two lengths, run plainly and checkpointed as the
        executor checkpoints a recomputed block (executor.recompute.Checkpointed, full and selective)."""
        torch = self.torch
        from executor.recompute import Checkpointed

        rows = []
        for kind in ("elementwise", "matmul"):
            for n in self.s.recompute_chains:
                torch.manual_seed(0)
                body = block_model(kind, n).to(self.device)
                x = block_input(torch, self.device)                     # (B, T, C)
                for policy in ("none", "full", "selective"):
                    block = body if policy == "none" else Checkpointed(body, policy, lambda phase: None)

                    def step(block=block) -> None:
                        block(x).sum().backward()

                    fwd = self._median_step(lambda block=block: block(x))
                    full = self._median_step(step)
                    rows.append((kind, policy, n, fwd, full))
                self.say(f"recompute {kind} x {n}: " + ", ".join(
                    f"{r[1]} {r[3] * 1e6:.0f}/{r[4] * 1e6:.0f}" for r in rows[-3:]) + " us forward/step (rank 0)")
        return {"recompute": rows}

    def memory(self) -> dict[str, Any]:
        torch = self.torch
        numel = self.s.memory_bytes // 4
        src = torch.rand(numel, device=self.device)
        dst, c = torch.empty_like(src), torch.empty_like(src)
        dst.copy_(src)
        c.copy_(src)
        gbps = {}
        for name, fn, moved in (("copy", lambda: dst.copy_(src), 2), ("add", lambda: torch.add(src, dst, out=c), 3)):
            self.dist.barrier()
            fn()
            t = statistics.median(self.time_calls(fn, 1) for _ in range(self.s.repeats))
            gbps[name] = moved * numel * 4 / t / 1e9
        self.say(f"memory bandwidth over {self.s.memory_bytes >> 20} MB arrays: copy {gbps['copy']:.2f} GB/s, "
                 f"add {gbps['add']:.2f} GB/s (read + written, rank 0)")
        return {"memory_gbps": gbps}

    def optimizer(self) -> dict[str, Any]:
        """The optimizer's step by size (executor/calibrate_optimizer.py)."""
        timed = time_optimizer_steps(self.torch, self.dist.barrier, self.s.repeats, device=self.device,
                                     sync=self.sync)
        self.say("optimizer step over " + ", ".join(f"{n >> 10}K" for n in OPTIMIZER_NUMELS) + " elements: "
                 + "; ".join(f"{k} " + ", ".join(f"{t * 1e3:.2f}" for t in v) + " ms" for k, v in timed.items())
                 + " (rank 0)")
        return {"optimizer_s": timed}

    def arrival_skew(self) -> dict[str, Any]:
        """All-reduces after computing apart (executor/calibrate_skew.py)."""
        timed = time_arrival_skew(self.torch, self.dist, SKEW_REPEAT_FACTOR * self.s.repeats, self.device,
                                  self.sync)
        self.say("arrival skew: 4 KB all-reduce after " + ", ".join(
            f"{c:g} ms: its return {statistics.median(t - x for x, t in rows) * 1e3:.2f} ms after its compute time"
            for c, rows in zip(SKEW_COMPUTE_MS, timed["rows"])) + " (rank 0)")
        return {"arrival_skew": timed}

    def matmuls(self) -> dict[str, Any]:
        """Each shape in float32, then in each other dtype still timed (the same shapes, one after the other,
        so both see the same load). A dtype whose median on a shape is more than SLOW_DTYPE_FACTOR times
        float32's (agreed over ranks, so every rank drops it at once) is timed no further and gets no peak,
        unless ``Settings.keep_slow_dtypes`` (``--keep-slow-dtypes``)."""
        extra = [d for d in self.s.matmul_dtypes if d != "float32"]
        times: list[float] = []
        by_dtype: dict[str, list[float]] = {d: [] for d in extra}
        dropped: dict[str, str] = {}
        slow: dict[str, tuple[float, str]] = {}   # kept though slow (--keep-slow-dtypes): the slowest shape
        threads = f"{self.s.threads} thread{'s' * (self.s.threads > 1)}"
        for m, n, k in self.s.matmul_shapes:
            t32, reps = self._time_matmul(m, n, k, "float32")
            times.append(t32)
            self.say(f"matmul ({m}x{k}) @ ({k}x{n}): {t32 * 1e3:.3f} ms, {2 * m * n * k / t32 / 1e9:.1f} GFLOP/s "
                     f"({reps} reps, {threads}, rank 0)")
            agreed32 = self.agree_max(t32)
            for dtype in [d for d in extra if d not in dropped]:
                t, reps = self._time_matmul(m, n, k, dtype)
                by_dtype[dtype].append(t)
                self.say(f"{dtype} matmul ({m}x{k}) @ ({k}x{n}): {t * 1e3:.3f} ms, "
                         f"{2 * m * n * k / t / 1e9:.1f} GFLOP/s ({reps} reps, {threads}, rank 0)")
                ratio = self.agree_max(t) / max(agreed32, 1e-12)
                if ratio <= SLOW_DTYPE_FACTOR:
                    continue
                slower = f"{ratio:.0f}x float32's time on {m}x{k} @ {k}x{n}"
                if self.s.keep_slow_dtypes:
                    if ratio > slow.get(dtype, (0.0, ""))[0]:
                        slow[dtype] = (ratio, slower)
                else:
                    dropped[dtype] = (f"{slower} (more than {SLOW_DTYPE_FACTOR:g}x): not a dtype to train in "
                                      "on this machine")
                    self.say(f"{dtype} matmuls: {dropped[dtype]}; timed no further, no {dtype} peak")
        return {"matmul": times, "matmul_dtypes": by_dtype, "matmul_dropped": dropped,
                "matmul_slow": {dtype: why for dtype, (_, why) in slow.items()}}

    def _time_matmul(self, m: int, n: int, k: int, dtype: str) -> tuple[float, int]:
        """Median seconds of ``(M, K) @ (K, N)`` in ``dtype`` (after 2 untimed calls: the first call of a
        dtype may set up its kernels), and the repetitions it took."""
        torch = self.torch
        dt = getattr(torch, dtype)
        a = torch.randn(m, k, device=self.device, dtype=dt)                  # (M, K)
        b = torch.randn(k, n, device=self.device, dtype=dt)                  # (K, N)
        out = torch.empty(m, n, device=self.device, dtype=dt)                # (M, N)
        self.dist.barrier()
        torch.mm(a, b, out=out)
        warm = self.time_calls(lambda: torch.mm(a, b, out=out), 1)
        reps = int(min(50, max(3, math.ceil(self.s.matmul_time_s / max(self.agree_max(warm), 1e-9)))))
        return statistics.median(self.time_calls(lambda: torch.mm(a, b, out=out), 1) for _ in range(reps)), reps

    def collectives(self) -> dict[str, Any]:
        results: dict[tuple[str, int, int], list[float]] = {}
        how: dict[tuple[str, int, int], str] = {}
        for n in axis_sizes(self.s.nproc):
            group = None
            if n < self.s.nproc:
                group, _ = self.dist.new_subgroups(group_size=n)
            for kind in self.s.kinds:
                if kind == "send_recv" and n != 2:            # one sender, one receiver
                    continue
                reps, texts = self.time_kind(kind, self.s.message_bytes, n, group)
                results.update(reps)
                how.update(texts)
                first, last = (statistics.median(reps[k]) for k in (min(reps), max(reps)))
                self.say(f"{kind} on {n} of {self.s.nproc} ranks ({texts[max(reps)]}): "
                         f"{first * 1e6:.0f} us at {self.s.message_bytes[0] >> 10} KB .. "
                         f"{last * 1e3:.2f} ms at {self.s.message_bytes[-1] >> 10} KB (rank 0)")
        return {"collectives": results, "collectives_how": how}

    def time_kind(self, kind: str, sizes: tuple[int, ...], n: int, group: Any, sync: Any = None,
                  ranks: tuple[int, ...] | None = None) -> tuple[dict, dict]:
        """``kind`` on ``group`` (``n`` ranks) at every size: {(kind, n, bytes): seconds per rep}, {key: label}.

        Barriers and the agreed warm-up time are over ``sync`` (default: every rank, so groups
        that run at once start together); ``ranks``: the group's global ranks (default consecutive).
        """
        results, how = {}, {}
        for nbytes in sizes:
            op, real_bytes, text = self.collective_op(kind, nbytes, n, group, ranks)
            op()
            self.dist.barrier(group=sync)
            warm = self.agree_max(statistics.median(self.time_calls(op, 1) for _ in range(3)), sync)
            calls = int(min(200, max(1, math.ceil(self.s.batch_time_s / max(warm, 1e-9)))))
            reps = []
            for _ in range(self.s.repeats):
                self.dist.barrier(group=sync)
                reps.append(self.time_calls(op, calls) / MESSAGES_PER_CALL.get(kind, 1))
            results[(kind, n, real_bytes)], how[(kind, n, real_bytes)] = reps, text
        return results, how

    def collective_op(self, kind: str, nbytes: int, n: int, group: Any,
                      ranks: tuple[int, ...] | None = None) -> tuple[Callable[[], Any], int, str]:
        """A closure running ``kind`` on ``M ~= nbytes`` (rounded so every piece divides), the real M, a label.

        ``ranks``: the group's global ranks; default ``n`` consecutive ranks holding this one."""
        ranks = ranks or tuple(range(self.rank // n * n, self.rank // n * n + n))
        torch, dist, dev = self.torch, self.dist, self.device
        unit = 8 * n * n                                   # float32 elements: rows and columns split by n
        numel = max(unit, nbytes // 4 // unit * unit)
        cols = 8 * n
        rows = numel // cols
        full = torch.zeros(rows, cols, device=dev)         # (rows, cols): M bytes
        piece = torch.zeros(rows // n, cols, device=dev)   # (rows / n, cols): M / n bytes
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        backend = self.s.backend
        if kind == "all_reduce":
            return (lambda: dist.all_reduce(full, group=group)), numel * 4, f"{backend} all_reduce"
        if kind == "all_gather":
            return (lambda: gather(full, piece, group=group)), numel * 4, f"{backend} all_gather"
        if kind == "reduce_scatter":
            text = f"{backend} reduce_scatter" + (" (gloo: all_reduce + chunk)" if backend == "gloo" else "")
            return (lambda: scatter(piece, full, group=group)), numel * 4, text
        if kind == "all_to_all":
            recv = torch.empty_like(piece)
            return (lambda: dist.all_to_all_single(recv, piece, group=group)), numel * 4, f"{backend} all_to_all"
        if kind == "broadcast":
            src = ranks[0]                                 # the group's first global rank
            return (lambda: dist.broadcast(full, src=src, group=group)), numel * 4, f"{backend} broadcast"
        if kind == "send_recv":                            # the pair's first rank sends first
            peer = ranks[1] if self.rank == ranks[0] else ranks[0]
            order = (True, False) if self.rank == ranks[0] else (False, True)

            def ping_pong() -> None:
                for send in order:
                    (dist.isend(full, dst=peer) if send else dist.irecv(full, src=peer)).wait()
            return ping_pong, numel * 4, f"{backend} isend/irecv + wait, half a ping-pong"
        raise ValueError(f"calibrate: no benchmark for communication kind {kind!r}; known: {FITTED_KINDS}")


def with_executor_overheads(cluster: Any, comments: dict[str, str], meas: Measurements) -> tuple[Any, dict[str, str]]:
    """``cluster`` with ``executor`` set from ``meas.executor`` and ``op_overhead_us`` a tiny op's
    dispatch + autograd, and for gloo on CPU
    ``cores_per_node`` = this machine's cores / threads per rank; comments to match.
    Unchanged when the executor was not timed."""
    import dataclasses

    if meas.executor is None:
        return cluster, comments
    fit = fit_executor_overheads(meas.executor)
    ex = ExecutorOverheads(**{k: _round3(v) for k, v in fit.overheads.scalars().items()})
    ex = dataclasses.replace(ex, step_us=_round3(fit.step_fixed_us),     # measured apart (--only collective_cpu)
                             collective_compute_share=cluster.executor.collective_compute_share)
    per_copy_us = meas.tiny_op_us + ex.op_forward_us + ex.input_forward_us   # a copy pass's fixed cost (unmeasured op)
    per_parameter = (   # field, its fit, the timings it is fitted on, what they timed
        ("param_sync_us", fit_param_sync_us, meas.executor.param_syncs, "ZeRO-1's parameter sync"),
        ("param_gather_us", fit_param_gather_us, meas.executor.param_gathers,
         "a ZeRO-3 group gather (pack, all-gather, unpack)"))
    for field_name, fit_us, _, _ in per_parameter:
        us = fit_us(meas.executor, per_copy_us)
        if us is not None:
            ex = dataclasses.replace(ex, **{field_name: _round3(us)})
    if meas.optimizer_s:
        ex = dataclasses.replace(ex, optimizer_ns={k: fit_optimizer_ns(OPTIMIZER_NUMELS, v)
                                                   for k, v in meas.optimizer_s.items()})
    ex, skew_comments = with_arrival_skew(ex, cluster.executor, meas)
    s = meas.settings
    chains = ", ".join(f"{c.kind} {c.ops} ops {c.step_s * 1e3:.1f} ms" for c in meas.executor.chains)
    diffs = ", ".join(f"{k} {meas.executor.move_us[k]:.0f} us vs {meas.executor.raw_us[k]:.0f} us"
                      for k in meas.executor.move_us)
    out = dict(comments)
    out["op_overhead_us"] = (f"measured: add of 1-element tensors needing grad {meas.tiny_op_us:.1f} us, per rank "
                             "(the executor's own per-op cost is in executor)")
    out["executor"] = (f"measured: autoddl's executor on chains of tiny ops, all-B plan on {s.nproc} ranks, "
                       f"AdamW, median of {s.executor_reps} steps ({chains}); non-negative least squares, max "
                       f"rel residual {fit.max_rel_residual:.0%}; step_us is the fit's per-step intercept")
    out["executor.collective_us"] = (f"a boxing move as a step pays it - the bare collective back to back, 4 KB: "
                                     f"the executor's move (functional collective + wait) after {STEP_GAP_S * 1e3:g} "
                                     "ms of matmuls on every rank, less the matmuls alone, mean over the calls of a "
                                     f"repetition, median of {s.repeats} interleaved repetitions: {diffs}; median "
                                     "over kinds")
    if ex.optimizer_ns:
        out["executor.optimizer_ns"] = (
            "measured: torch's foreach step (executor/runtime.py torch_optimizer) over one float32 parameter of "
            + ", ".join(f"{n >> 10}K" for n in OPTIMIZER_NUMELS) + f" elements, {s.nproc} ranks at once, "
            f"{s.threads} thread{'s' * (s.threads > 1)} each, median of {s.repeats} batches: "
            + "; ".join(f"{k} " + ", ".join(f"{t * 1e3:.3g}" for t in v) + " ms" for k, v in meas.optimizer_s.items())
            + "; ns per element beyond the smallest size (executor/calibrate_optimizer.py)")
    out.update(skew_comments)
    for field_name, _, timed, what in per_parameter:
        if getattr(ex, field_name) > 0:         # 0 is left out of the file (not priced), comment and all
            rows = ", ".join(f"{p} parameters {t:.0f} us vs {bare:.0f} us" for p, t, bare in timed)
            out[f"executor.{field_name}"] = (
                f"measured: {what} of chains of {CHAIN_WIDTH}x{CHAIN_WIDTH} parameters against the bare all-gather "
                f"of its buffer, median of {s.repeats} interleaved repetitions ({rows}); per parameter, the slope "
                f"of the difference less a copy pass's fixed cost ({per_copy_us:.1f} us)")
    at_once = ranks_at_once(s.threads)
    if s.backend == "gloo" and cluster.device.kind == "cpu":
        out["cores_per_node"] = (f"this machine's {usable_cores()} cores / {s.threads} "
                                 f"thread{'s' * (s.threads > 1)} per rank: "
                                 f"more ranks than {at_once} time-share the cores")
    else:
        at_once = None
    return dataclasses.replace(cluster, executor=ex, op_overhead_us=_round3(meas.tiny_op_us),
                               cores_per_node=at_once), out


def with_arrival_skew(ex: ExecutorOverheads, base: ExecutorOverheads,
                      meas: Measurements) -> tuple[ExecutorOverheads, dict[str, str]]:
    """``ex`` with ``arrival_skew_us`` the base's, and for the ranks this calibration ran, the slope of
    its arrival-skew points (executor/calibrate_skew.py); the comment to match. Unchanged when not timed."""
    import dataclasses

    if not meas.arrival_skew:
        return dataclasses.replace(ex, arrival_skew_us=base.arrival_skew_us), {}
    s = meas.settings
    us = _round3(fit_skew_us(meas.arrival_skew))
    ex = dataclasses.replace(ex, arrival_skew_us={**base.arrival_skew_us, s.nproc: us})
    points = ", ".join(f"{e * 1e3:+.2f} ms after {c * 1e3:.1f} ms" for c, e in meas.arrival_skew)
    return ex, {f"executor.arrival_skew_us.ranks_{s.nproc}": (
        f"measured: a {SKEW_BYTES >> 10} KB all-reduce after each rank's matmuls, {s.nproc} ranks at once, "
        f"{s.threads} thread{'s' * (s.threads > 1)} each: the slowest rank's time to its return less the compute as "
        f"priced (the ranks' median CPU time x {ranks_per_core(s):g} ranks per core), less the bare all-reduce, "
        f"median of {SKEW_REPEAT_FACTOR * s.repeats} interleaved repetitions "
        f"({points}); slope against sqrt(compute ms) - sqrt(0.5) (executor/calibrate_skew.py)")}


def _round3(x: float) -> float:
    return float(f"{x:.3g}") if x else 0.0
