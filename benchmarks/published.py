"""Predictions beside published measurements of the same training configuration: results/published.csv.

Each row is an expert configuration a published system measured, priced by autoddl with
``--degrees`` (not searched) under the same training settings, and the found plan for the
same job beside it. The cluster files' efficiencies come from component measurements
(matmul, bandwidth, collectives: their comments cite them), never from these rows.

- Llama-3-8B, sequence 8192, as TorchTitan trains it: bf16 parameters with float32 gradient
  reduction and the loss in float32 (its train.py upcasts the logits: examples/llama.py
  ``float_logits``, set for every TorchTitan row), FSDP over 8 H100, selective activation
  checkpointing, one sequence per GPU,
  global batch 8; and at the repository's own batch (Table 1 of
  ``benchmarks/llama3_h100_202412_torchtitan.md``: local batch 2, global 16, 82.4 GiB, so
  ``--memory-gb 96``, their H100s' HBM2e). Published:
  6,258 tokens/s/GPU (TorchTitan paper, arXiv:2410.06511, Table 2, FSDP, 8 GPUs) and 5,762 in
  the repository's benchmark (docs/performance.md); their H100s ran at 500 W.
- GPT 1.7B (24 layers, hidden 2304, 24 heads, sequence 2048, vocabulary 51200) on 32 A100
  (4 DGX nodes), fp16, global batch 512, data parallel with full activation recompute, as in
  Megatron-LM's weak-scaling table (Narayanan et al., SC'21, Table 1: 137 TFLOP/s per GPU,
  44% of peak). Megatron counts the recompute's forward in its FLOPs (4 x forward per
  step), so the prediction is put in those units too (``hardware_tflops_per_gpu``). Priced twice:
  with attention as one fused kernel (flash, the default) and ``attention="unfused"``, as
  Megatron-LM ran it in 2021 (megatron/model/transformer.py ``ParallelAttention``: Q·Kᵀ by
  ``torch.baddbmm``, ``FusedScaleMaskSoftmax``, dropout, ``torch.bmm``; autoddl/attention.py).
- Llama 3.1 70B and 405B at scale, as TorchTitan measured them at the end of 2024 on H100s with
  96 GB HBM2e at 500 W (torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, torchtitan
  commit 820504e2, 2025-06-13; runs at torchtitan 9dec370 with torch 1963fc8): sequence 8192
  (the 70B / 405B train configs at 9dec370), bf16 parameters with float32 reduction (TorchTitan's
  defaults), full activation checkpointing, TP with sequence parallel (``sp``).
  Table 4: 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16 (global 512): 829 tokens/s/GPU.
  Table 5: 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256): 1F1B 100,
  interleaved 1F1B 128 tokens/s/GPU; micro-batches: TorchTitan's default at 9dec370, the pp
  degree (8, of 4 sequences; pipelining_utils.py), and 2 stages per rank for interleaved.
  Both ran with torch.compile and Float8 linears (Table 5 also AsyncTP), which autoddl does not
  model (it prices the matmuls in bf16): the rows say so beside the ratio.
- The same two models in bf16 (no Float8) from TorchTitan's docs/performance.md (commit 9dec370):
  405B on 128 H100 (96 GB), FSDP 16 x TP 8, local batch 2, full AC: 109 tokens/s/GPU; 70B on 64
  A100 80 GB, FSDP 64, local batch 1, full AC: 331 tokens/s/GPU.

Every TorchTitan job is priced three times: on ``h100-4x8`` (DGX H100: 700 W SXM5, 80 GB HBM3, the
hardware whose components were measured) and on the hardware TorchTitan describes,
``h100-96gb-500w`` (96 GB HBM2e at 2.4 TB/s, 500 W), at both ends of the peak its benchmark's footnote
bounds ("between SXM and NVL"): the SXM5 datasheet's in the file, then the H100 NVL datasheet's
(``NVL_PEAKS_TFLOPS``; the ``cluster`` column reads ``h100-96gb-500w nvl-peak``). The found plan is
searched on the first only.

Jobs without ``search`` price the given configuration only (the found plan of a 256- to
512-device job is issue 12's 3-D search, benchmarks/search_bench.py).

    python benchmarks/published.py
    python benchmarks/published.py --only "llama3.1-70b fsdp x tp"
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoddl.atomic import write_csv_atomic  # noqa: E402
from autoddl.cluster import Cluster, bundled_config  # noqa: E402
from autoddl.graph import NodeKind  # noqa: E402
from autoddl.loader import load_model_file  # noqa: E402
from autoddl.training import Training  # noqa: E402
from search.planner import parse_degrees, price_degrees, search  # noqa: E402

OUT = ROOT / "results" / "published.csv"
COLUMNS = ["job", "cluster", "devices", "precision", "recompute", "attention", "micro_batches", "scheme", "mesh", "fits",
           "memory_gb", "step_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
           "published", "published_value", "predicted_over_published", "source", "plan_s"]

TITAN_2024 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e2), H100 96 GB "
              "HBM2e at 500 W, seq 8192:")
TITAN_DOCS = "pytorch/torchtitan docs/performance.md (commit 9dec370), seq 8192:"
# TorchTitan's loss upcasts the bf16 logits: cross_entropy(pred.flatten(0, 1).float(), ...) (train.py at 9dec370)
TITAN_ARGS = {"float_logits": True}
# TorchTitan's H100s (configs/h100-96gb-500w.yaml): its benchmark's footnote puts their peak "between SXM and NVL".
# The file holds the SXM5 datasheet's peaks; these are the H100 NVL datasheet's (NVIDIA H100 product page and
# datasheet: BF16 and FP16 Tensor Core 1,671 TFLOPS with sparsity = 835.5 dense; FP32 60 TFLOPS).
TITAN_HARDWARE = "h100-96gb-500w"
NVL_PEAKS_TFLOPS = {"float32": 60.0, "bfloat16": 835.5, "float16": 835.5}

JOBS = [
    {"job": "llama3-8b seq 8192", "model": "examples/llama.py", "args": TITAN_ARGS | {"preset": "llama3-8b"},
     "cluster": "h100-4x8", "titan_hardware": True, "devices": 8, "batch": 8, "micro_batches": 1,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="selective"), "degrees": "fsdp=8",
     "metric": "tokens_per_s_per_gpu",
     "published": [("TorchTitan paper", 6258, "TorchTitan paper (arXiv:2410.06511): FSDP 8 H100, selective AC, "
                                              "as quoted in issue 10"),
                   ("TorchTitan repository", 5762, "TorchTitan repository benchmark, as quoted in issue 10")]},
    {"job": "llama3-8b seq 8192, local batch 2", "model": "examples/llama.py", "args": TITAN_ARGS | {"preset": "llama3-8b"},
     "cluster": "h100-4x8", "titan_hardware": True, "devices": 8, "batch": 16, "micro_batches": 1, "memory_gb": 96,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="selective"), "degrees": "fsdp=8",
     "metric": "tokens_per_s_per_gpu",
     "published": [("TorchTitan repository, Table 1", 5762, TITAN_2024 + " Table 1: Llama 3.1 8B, 8 H100, FSDP, "
                    "local batch 2 (global 16), selective AC, 82.4 GiB; no torch.compile, no Float8")]},
    {"job": "gpt 1.7B seq 2048", "model": "examples/gpt.py",
     "args": {"preset": "gpt2-xl", "n_layer": 24, "n_embd": 2304, "n_head": 24, "vocab_size": 51200,
              "block_size": 2048, "seq_len": 2048},
     "cluster": "dgx-a100-8", "devices": 32, "batch": 128, "micro_batches": 4,
     "training": dict(param_dtype="fp16", recompute="full"), "degrees": "dp=32",
     "metric": "hardware_tflops_per_gpu",
     "published": [("Megatron-LM paper", 137, "Narayanan et al., SC'21, Table 1: 1.7B, 32 A100, batch 512, "
                                              "137 TFLOP/s per GPU (44% of peak), full recompute")]},
    {"job": "gpt 1.7B seq 2048, unfused attention", "model": "examples/gpt.py",
     "args": {"preset": "gpt2-xl", "n_layer": 24, "n_embd": 2304, "n_head": 24, "vocab_size": 51200,
              "block_size": 2048, "seq_len": 2048},
     "cluster": "dgx-a100-8", "devices": 32, "batch": 128, "micro_batches": 4,
     "training": dict(param_dtype="fp16", recompute="full", attention="unfused"), "degrees": "dp=32",
     "metric": "hardware_tflops_per_gpu",
     "published": [("Megatron-LM paper", 137, "Narayanan et al., SC'21, Table 1 (as above), priced with attention "
                                              "unfused as Megatron-LM ran it then (baddbmm, FusedScaleMaskSoftmax, "
                                              "bmm); the traced GPT has no attention dropout (Megatron's had 0.1)")]},
    {"job": "llama3.1-70b fsdp x tp", "model": "examples/llama.py", "args": TITAN_ARGS | {"preset": "llama3-70b"},
     "cluster": "h100-4x8", "titan_hardware": True, "devices": 256, "batch": 512, "micro_batches": 1, "memory_gb": 96,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="full"), "degrees": "fsdp=32,sp=8",
     "metric": "tokens_per_s_per_gpu", "search": False,
     "published": [("TorchTitan repository, Table 4 (2D)", 829, TITAN_2024 + " Table 4: Llama 3.1 70B, 256 H100, "
                    "FSDP 32 x TP 8, local batch 16, full AC; torch.compile + Float8 (not modelled)")]},
    {"job": "llama3.1-405b fsdp x tp x pp, 1f1b", "model": "examples/llama.py", "args": TITAN_ARGS | {"preset": "llama3.1-405b"},
     "cluster": "h100-4x8", "titan_hardware": True, "devices": 512, "batch": 32, "micro_batches": 8, "memory_gb": 96,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="full"), "degrees": "pp=8,fsdp=8,sp=8",
     "schedule": "1f1b", "metric": "tokens_per_s_per_gpu", "search": False,
     "published": [("TorchTitan repository, Table 5 (1F1B)", 100, TITAN_2024 + " Table 5: Llama 3.1 405B, 512 H100, "
                    "FSDP 8 x TP 8 x PP 8, local batch 32, full AC; torch.compile + Float8 + AsyncTP (not modelled)")]},
    {"job": "llama3.1-405b fsdp x tp x pp, interleaved", "model": "examples/llama.py",
     "args": TITAN_ARGS | {"preset": "llama3.1-405b"}, "cluster": "h100-4x8", "titan_hardware": True, "devices": 512,
     "batch": 32, "micro_batches": 8, "memory_gb": 96,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="full"), "degrees": "pp=8,fsdp=8,sp=8", "schedule": "interleaved", "virtual_stages": 2,
     "metric": "tokens_per_s_per_gpu", "search": False,
     "published": [("TorchTitan repository, Table 5 (interleaved 1F1B)", 128, TITAN_2024 + " Table 5: as 1F1B, "
                    "interleaved 1F1B (2 stages per rank); torch.compile + Float8 + AsyncTP (not modelled)")]},
    {"job": "llama3.1-405b fsdp x tp, bf16", "model": "examples/llama.py", "args": TITAN_ARGS | {"preset": "llama3.1-405b"},
     "cluster": "h100-4x8", "titan_hardware": True, "devices": 128, "batch": 32, "micro_batches": 1, "memory_gb": 96,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="full"), "degrees": "fsdp=16,sp=8",
     "metric": "tokens_per_s_per_gpu", "search": False,
     "published": [("TorchTitan docs/performance.md", 109, TITAN_DOCS + " Llama 3.1 405B, 128 H100, FSDP 16 x TP 8, "
                    "local batch 2, full AC, no Float8 (bf16)")]},
    {"job": "llama3-70b fsdp, bf16, A100", "model": "examples/llama.py", "args": TITAN_ARGS | {"preset": "llama3-70b"},
     "cluster": "dgx-a100-8", "devices": 64, "batch": 64, "micro_batches": 1,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="full"), "degrees": "fsdp=64",
     "metric": "tokens_per_s_per_gpu", "search": False,
     "published": [("TorchTitan docs/performance.md", 331, TITAN_DOCS + " Llama 3 70B, 64 A100 80GB, FSDP 64, "
                    "local batch 1, full AC, bf16")]},
]


def row(job: dict, cluster_label: str, scheme: str, plan, bd, graph, seconds: float) -> dict:
    tokens = job["batch"] * job["micro_batches"] * graph.nodes_of(NodeKind.INPUT)[0].outputs[0].shape[1]
    forward = graph.total_flops * job["micro_batches"]
    recomputes = 4 if job["training"].get("recompute") == "full" else 3
    return {"job": job["job"], "cluster": cluster_label, "devices": job["devices"],
            "precision": job["training"]["param_dtype"], "recompute": job["training"].get("recompute", "none"),
            "attention": job["training"].get("attention", "flash"),
            "micro_batches": job["micro_batches"], "scheme": scheme, "mesh": "x".join(map(str, plan.mesh.shape)),
            "fits": bd.fits_memory, "memory_gb": round(bd.memory_bytes_per_device / 1e9, 2),
            "step_s": round(bd.step_time_s, 4),
            "tokens_per_s_per_gpu": round(tokens / bd.step_time_s / job["devices"]),
            "model_tflops_per_gpu": round(3 * forward / bd.step_time_s / job["devices"] / 1e12, 1),
            "hardware_tflops_per_gpu": round(recomputes * forward / bd.step_time_s / job["devices"] / 1e12, 1),
            "plan_s": round(seconds, 1)}


def load_cluster(name: str, devices: int) -> Cluster:
    return Cluster.from_yaml(bundled_config(name)).resized(devices)


def job_clusters(job: dict) -> list[tuple[str, Cluster]]:
    """(label, cluster) pairs the job's configuration is priced on: its own cluster file, then for
    TorchTitan's jobs the hardware it ran, at the SXM and the NVL end of its peak (module docstring)."""
    clusters = [(job["cluster"], load_cluster(job["cluster"], job["devices"]))]
    if job.get("titan_hardware"):
        titan = load_cluster(TITAN_HARDWARE, job["devices"])
        nvl = dataclasses.replace(titan, device=dataclasses.replace(titan.device, peak_tflops=NVL_PEAKS_TFLOPS))
        clusters += [(TITAN_HARDWARE, titan), (f"{TITAN_HARDWARE} nvl-peak", nvl)]
    return clusters


def price_job(job: dict) -> list[dict]:
    """The job's rows: its --degrees configuration on each of its clusters beside each published figure,
    then the found plan on its own cluster."""
    training = Training(micro_batches=job["micro_batches"], **job["training"])
    mf = load_model_file(ROOT / job["model"], **job["args"]).with_batch_size(job["batch"])
    graph = mf.trace(training.param_dtype)
    label = job["degrees"] + (f" {job['schedule']}" if "schedule" in job else "")
    rows, clusters = [], job_clusters(job)
    for cluster_label, cluster in clusters:
        t0 = time.perf_counter()
        given = price_degrees(graph, cluster, parse_degrees(job["degrees"]), model_name=graph.model_name,
                              training=training, memory_gb=job.get("memory_gb"),
                              schedule=job.get("schedule", "1f1b"), virtual_stages=job.get("virtual_stages", 1))
        given_row = row(job, cluster_label, label, given.plan, given.breakdown, graph, time.perf_counter() - t0)
        rows += [{**given_row, "published": name, "published_value": value,
                  "predicted_over_published": round(given_row[job["metric"]] / value, 3), "source": source}
                 for name, value, source in job["published"]]
        print(f"{job['job']} on {cluster_label}: {label} {given_row[job['metric']]} ({job['metric']}, "
              f"{given_row['memory_gb']} GB, fits {given_row['fits']}); published "
              f"{[v for _, v, _ in job['published']]}", flush=True)
    if job.get("search", True):
        t1 = time.perf_counter()
        found = search(graph, clusters[0][1], model_name=graph.model_name, training=training,
                       memory_gb=job.get("memory_gb"))
        rows.append(row(job, job["cluster"], "found", found.found, found.found_breakdown, graph, time.perf_counter() - t1))
        print(f"{job['job']} on {job['cluster']}: found {rows[-1][job['metric']]}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="job names (the 'job' column) to run; the others' rows are kept")
    args = ap.parse_args(argv)
    kept = [] if not args.only or not OUT.exists() else \
        [r for r in csv.DictReader(OUT.open()) if r["job"] not in args.only]
    rows = list(kept)
    for job in JOBS:
        if args.only and job["job"] not in args.only:
            continue
        rows += price_job(job)
        write_csv_atomic(OUT, rows, COLUMNS)
    order = [j["job"] for j in JOBS]
    rows.sort(key=lambda r: order.index(r["job"]) if r["job"] in order else len(order))
    write_csv_atomic(OUT, rows, COLUMNS)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
