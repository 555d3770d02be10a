"""Which machine a CPU cluster file was calibrated on, and whether it is this one.

A CPU cluster file (``configs/local-cpu.yaml``) describes the processor it was measured on: its
matmul peak per dtype, memory bandwidth, per-op costs and collectives. The same file read on
another processor predicts the other one's steps. That happened here: one day's 2-core VM had
no bfloat16 instructions (bfloat16 matmuls at half float32's rate, 13 GB/s of memory bandwidth),
the next day's had ``avx512_bf16`` (bfloat16 at 4x float32's rate, 25 GB/s), and a fidelity study
compared the second machine's steps with the first machine's file.

So ``autoddl calibrate`` writes ``calibrated_on: <fingerprint>`` into a CPU cluster file, and what
compares a prediction with a measurement (``autoddl run``, the benchmarks) asks
:func:`calibrated_elsewhere` first. The fingerprint is what sets a CPU's speed at this level:
the processor's name, family and model, the vector instruction sets torch's kernels pick from
(:data:`ISA_FLAGS`), the cores this process may use, and torch's version.
"""

from __future__ import annotations

import os
import platform
from typing import Any

# Instruction sets torch's CPU kernels dispatch on (ATen's CPU capability: AVX2 / AVX512; oneDNN's
# bfloat16 and AMX paths). A machine with and one without ``avx512_bf16`` differ 4x in bfloat16 matmuls.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo ({} off Linux)."""
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def fingerprint(cpuinfo: dict[str, str], cores: int, torch_version: str) -> str:
    """``AMD EPYC (family 26, model 2; avx2 fma avx512f avx512_bf16), 2 cores, torch 2.13.0+cpu``."""
    name = cpuinfo.get("model name") or platform.processor() or platform.machine()
    flags = set(cpuinfo.get("flags", "").split())
    isa = " ".join(f for f in ISA_FLAGS if f in flags)
    ids = ", ".join(f"{k} {cpuinfo[k]}" for k in ("cpu family", "model") if k in cpuinfo).replace("cpu family", "family")
    detail = "; ".join(part for part in (ids, isa) if part)
    return f"{name}{f' ({detail})' if detail else ''}, {cores} core{'s' * (cores != 1)}, torch {torch_version}"


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def this_machine() -> str:
    """This machine's :func:`fingerprint`."""
    import torch

    return fingerprint(_cpuinfo(), usable_cores(), torch.__version__)


def calibrated_elsewhere(cluster: Any, here: str | None = None) -> str | None:
    """Why ``cluster``'s predictions are not this machine's, or None: a CPU cluster file whose
    ``calibrated_on`` is another machine than ``here`` (default :func:`this_machine`). A GPU file,
    or a CPU file that does not say (written before the field, or by hand), gives None."""
    if cluster.device.kind != "cpu" or not cluster.calibrated_on:
        return None
    here = here or this_machine()
    if cluster.calibrated_on == here:
        return None
    where = cluster.source or cluster.name
    return (f"{where} was calibrated on {cluster.calibrated_on}; this machine is {here}: its predictions "
            f"describe the other machine. Calibrate this one: autoddl calibrate --base {where} --out {where}, "
            f"then autoddl calibrate --only collective_cpu --base {where} --out {where}")


def require_calibrated_here(path: Any, allow_other: bool = False) -> None:
    """Stop a benchmark that compares predictions with this machine's steps when the cluster file at
    ``path`` describes another machine (:func:`calibrated_elsewhere`), unless ``allow_other``."""
    from autoddl.cluster import Cluster

    why = calibrated_elsewhere(Cluster.from_yaml(path))
    if why and not allow_other:
        raise SystemExit(f"{why}; or pass --other-machine to measure against it anyway")
    if why:
        print(f"note: {why}", flush=True)
