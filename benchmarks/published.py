"""Predictions beside published measurements of the same training configuration: results/published.csv.

Each row is an expert configuration a published system measured, priced by autoddl with
``--degrees`` (not searched) under the same training settings, and the found plan for the
same job beside it. The cluster files' efficiencies come from component measurements
(matmul, bandwidth, collectives: their comments cite them), never from these rows.

- Llama-3-8B, sequence 8192, as TorchTitan trains it: bf16 parameters with float32 gradient
  reduction, FSDP over 8 H100, selective activation checkpointing, one sequence per GPU,
  global batch 8. Published:
  6,258 tokens/s/GPU (TorchTitan paper, arXiv:2410.06511, Table 2, FSDP, 8 GPUs) and 5,762 in
  the repository's benchmark (docs/performance.md); their H100s ran at 500 W.
- GPT 1.7B (24 layers, hidden 2304, 24 heads, sequence 2048, vocabulary 51200) on 32 A100
  (4 DGX nodes), fp16, global batch 512, data parallel with full activation recompute, as in
  Megatron-LM's weak-scaling table (Narayanan et al., SC'21, Table 1: 137 TFLOP/s per GPU,
  44% of peak). Megatron counts the recompute's forward in its FLOPs (4 x forward per
  step), so the prediction is put in those units too (``hardware_tflops_per_gpu``).

    python benchmarks/published.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoddl.atomic import write_csv_atomic  # noqa: E402
from autoddl.cluster import Cluster  # noqa: E402
from autoddl.graph import NodeKind  # noqa: E402
from autoddl.loader import load_model_file  # noqa: E402
from autoddl.training import Training  # noqa: E402
from search.planner import parse_degrees, price_degrees, search  # noqa: E402

OUT = ROOT / "results" / "published.csv"
COLUMNS = ["job", "cluster", "devices", "precision", "recompute", "micro_batches", "scheme", "mesh", "fits",
           "memory_gb", "step_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
           "published", "published_value", "predicted_over_published", "source", "plan_s"]

JOBS = [
    {"job": "llama3-8b seq 8192", "model": "examples/llama.py", "args": {"preset": "llama3-8b"},
     "cluster": "h100-4x8", "devices": 8, "batch": 8, "micro_batches": 1,
     "training": dict(param_dtype="bf16", reduce_dtype="fp32", recompute="selective"), "degrees": "fsdp=8",
     "metric": "tokens_per_s_per_gpu",
     "published": [("TorchTitan paper", 6258, "TorchTitan paper (arXiv:2410.06511): FSDP 8 H100, selective AC, "
                                              "as quoted in issue 10"),
                   ("TorchTitan repository", 5762, "TorchTitan repository benchmark, as quoted in issue 10")]},
    {"job": "gpt 1.7B seq 2048", "model": "examples/gpt.py",
     "args": {"preset": "gpt2-xl", "n_layer": 24, "n_embd": 2304, "n_head": 24, "vocab_size": 51200,
              "block_size": 2048, "seq_len": 2048},
     "cluster": "dgx-a100-8", "devices": 32, "batch": 128, "micro_batches": 4,
     "training": dict(param_dtype="fp16", recompute="full"), "degrees": "dp=32",
     "metric": "hardware_tflops_per_gpu",
     "published": [("Megatron-LM paper", 137, "Narayanan et al., SC'21, Table 1: 1.7B, 32 A100, batch 512, "
                                              "137 TFLOP/s per GPU (44% of peak), full recompute")]},
]


def row(job: dict, scheme: str, plan, bd, graph, seconds: float) -> dict:
    tokens = job["batch"] * job["micro_batches"] * graph.nodes_of(NodeKind.INPUT)[0].outputs[0].shape[1]
    forward = graph.total_flops * job["micro_batches"]
    recomputes = 4 if job["training"].get("recompute") == "full" else 3
    return {"job": job["job"], "cluster": job["cluster"], "devices": job["devices"],
            "precision": job["training"]["param_dtype"], "recompute": job["training"].get("recompute", "none"),
            "micro_batches": job["micro_batches"], "scheme": scheme, "mesh": "x".join(map(str, plan.mesh.shape)),
            "fits": bd.fits_memory, "memory_gb": round(bd.memory_bytes_per_device / 1e9, 2),
            "step_s": round(bd.step_time_s, 4),
            "tokens_per_s_per_gpu": round(tokens / bd.step_time_s / job["devices"]),
            "model_tflops_per_gpu": round(3 * forward / bd.step_time_s / job["devices"] / 1e12, 1),
            "hardware_tflops_per_gpu": round(recomputes * forward / bd.step_time_s / job["devices"] / 1e12, 1),
            "plan_s": round(seconds, 1)}


def main() -> int:
    rows = []
    for job in JOBS:
        t0 = time.perf_counter()
        training = Training(micro_batches=job["micro_batches"], **job["training"])
        mf = load_model_file(ROOT / job["model"], **job["args"]).with_batch_size(job["batch"])
        graph = mf.trace(training.param_dtype)
        cluster = Cluster.from_yaml(ROOT / "configs" / f"{job['cluster']}.yaml").resized(job["devices"])
        given = price_degrees(graph, cluster, parse_degrees(job["degrees"]), model_name=graph.model_name,
                              training=training)
        given_row = row(job, job["degrees"], given.plan, given.breakdown, graph, time.perf_counter() - t0)
        t1 = time.perf_counter()
        found = search(graph, cluster, model_name=graph.model_name, training=training)
        found_row = row(job, "found", found.found, found.found_breakdown, graph, time.perf_counter() - t1)
        for name, value, source in job["published"]:
            rows.append({**given_row, "published": name, "published_value": value,
                         "predicted_over_published": round(given_row[job["metric"]] / value, 3), "source": source})
        rows.append(found_row)
        print(f"{job['job']}: {job['degrees']} {given_row[job['metric']]} ({job['metric']}), found "
              f"{found_row[job['metric']]}; published {[v for _, v, _ in job['published']]}", flush=True)
    write_csv_atomic(OUT, rows, COLUMNS)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
