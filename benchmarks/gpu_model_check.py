"""What a GPU cluster file predicts beside what benchmarks/gpu_components.py measured on that GPU.

Reads results/gpu_components.csv (measured on one GPU, rows by section) and writes
results/gpu_model_check.csv, one row per comparison:

- ``efficiency``: each measured bf16 / fp16 / fp32 matmul, attention kernel and memory pass as a
  fraction of the cluster's peak (``device.peak_tflops`` of its dtype, ``memory_bandwidth_gbps``),
  beside the fraction the cluster file assumes (``efficiency.compute`` or its ``compute_curve`` at the
  product's FLOPs, ``efficiency.attention``, ``efficiency.memory``).
- ``launch``: the measured per-op host cost (forward + backward) beside ``2 x op_overhead_us``.
- ``optimizer``: AdamW (foreach) over 1e9 float32 parameters beside ``optimizer_time_s`` (in-sample for
  configs/h100-4x8.yaml, whose ``executor.optimizer_ns`` is this measurement).
- ``block``: one Llama-3-8B block's forward + backward (+ recompute) at micro-batch 1 x 8192 and the
  rest of the 1-layer model (embedding, norm, output layer, float32 loss), measured with attention
  pinned to the flash backend (the kernel ``efficiency.attention`` describes), beside the cost
  model's simulated compute of the same ops: examples/llama.py traced under bf16 with 3 layers, priced
  by ``--degrees dp=1`` on one device of the cluster, each recompute policy; a block's prediction is
  the compute tasks of the ops under ``layers.1`` (forward, backward and recompute, launch overheads
  included; the float32 master copies and the optimizer, which the measurement did not run, are not
  ops of the block).
- ``step``: TorchTitan's recipe on one GPU (FSDP2 on a 1-rank group, float32 masters, selective
  recompute, AdamW) with 1 and 3 layers, beside the predicted step of ``--degrees dp=1`` (the
  masters' passes and the optimizer included), and one block's share by difference.

    python benchmarks/gpu_model_check.py                       # configs/h100-4x8.yaml, ~1 min
    python benchmarks/gpu_model_check.py --cluster configs/dgx-a100-8.yaml --measured OTHER.csv
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoddl.atomic import write_csv_atomic  # noqa: E402
from autoddl.cluster import Cluster  # noqa: E402
from autoddl.loader import load_model_file  # noqa: E402
from autoddl.training import Training  # noqa: E402
from costmodel.compute import compute_efficiency, optimizer_time_s  # noqa: E402
from search.planner import parse_degrees, price_degrees  # noqa: E402

COLUMNS = ["check", "name", "dtype", "shape", "measured", "predicted", "measured_over_predicted", "unit", "note"]
TOKENS = 8192


def efficiency_rows(measured: pd.DataFrame, cluster: Cluster) -> list[dict]:
    """Measured fractions of peak beside the cluster file's."""
    dev, eff = cluster.device, cluster.efficiency
    rows = []
    for r in measured[measured.section == "matmul"].itertuples():
        got = r.tflops / dev.peak_tflops_for(r.dtype)
        rows.append(_row("efficiency", r, got, compute_efficiency(r.flops, cluster),
                         f"of {dev.peak_tflops_for(r.dtype):g} TFLOPS {r.dtype}"))
    for r in measured[(measured.section == "attention") & (measured.samples > 0)].itertuples():
        rows.append(_row("efficiency", r, r.tflops / dev.peak_tflops_for(r.dtype), eff.attention,
                         "FlashAttention-2's FLOP count"))
    for r in measured[measured.section == "memory"].itertuples():
        rows.append(_row("efficiency", r, r.gbps / dev.memory_bandwidth_gbps, eff.memory,
                         f"of {dev.memory_bandwidth_gbps:g} GB/s, bytes read + written"))
    return rows


def _row(check: str, r, measured: float, predicted: float | None, note: str, unit: str = "fraction") -> dict:
    return {"check": check, "name": r.name, "dtype": r.dtype, "shape": r.shape, "measured": round(measured, 3),
            "predicted": None if predicted is None else round(predicted, 3),
            "measured_over_predicted": None if not predicted else round(measured / predicted, 3),
            "unit": unit, "note": note}


def launch_rows(measured: pd.DataFrame, cluster: Cluster) -> list[dict]:
    r = next(measured[measured.name == "autograd chain forward+backward"].itertuples(), None)
    if r is None:
        return []
    return [_row("launch", r, r.median_us, 2 * cluster.op_overhead_us,
                 "per op, forward + backward: 2 x op_overhead_us", unit="us")]


def priced_llama(cluster: Cluster, layers: int, recompute: str):
    """The cost breakdown of examples/llama.py's Llama-3-8B with ``layers`` blocks at micro-batch 1 x 8192,
    bf16 with float32 reduction, ``--degrees dp=1`` on one device of ``cluster``, and its graph."""
    training = Training(param_dtype="bf16", reduce_dtype="fp32", recompute=recompute)
    mf = load_model_file(ROOT / "examples" / "llama.py", preset="llama3-8b", n_layers=layers, seq_len=TOKENS,
                         float_logits=True).with_batch_size(1)
    graph = mf.trace(training.param_dtype)
    scheme = price_degrees(graph, cluster.resized(1), parse_degrees("dp=1"), model_name="llama3-8b",
                           training=training, memory_gb=1e6)
    return scheme.breakdown, graph


def op_compute_ms(breakdown, graph) -> dict[str, float]:
    """Simulated compute of the graph's ops (forward, backward, recompute, launch overheads), ms, by part:
    the block index under ``layers.`` or ``rest``; the master copies and the optimizer are no graph op."""
    module = {n.name: n.module_path for n in graph.ops()}
    compute: dict[str, float] = defaultdict(float)
    for t in breakdown.timeline.tasks:
        if t.task.is_collective or t.task.op not in module:
            continue
        path = module[t.task.op]
        compute[path.split(".")[1] if path.startswith("layers.") else "rest"] += t.duration_s * 1e3
    return compute


def measured_ms(measured: pd.DataFrame, section: str, name: str) -> tuple[float, object] | None:
    """The median (ms) and the row of the last measurement named ``name`` in ``section``, if any."""
    rows = list(measured[(measured.section == section) & (measured.name == name)
                         & (measured.samples > 0)].itertuples())
    return None if not rows else (rows[-1].median_us / 1e3, rows[-1])


def block_rows(measured: pd.DataFrame, cluster: Cluster, sdpa: str = "flash") -> list[dict]:
    """The bf16 model's forward + backward: one block and the rest, each recompute policy (graph ops only)."""
    rows = []
    for recompute in ("none", "selective", "full"):
        label = f"recompute {recompute}, sdpa {sdpa}"
        block = measured_ms(measured, "block", f"llama3-8b one block, {label}")
        one_layer = measured_ms(measured, "block", f"llama3-8b 1 layers, {label}")
        if block is None or one_layer is None:
            continue
        compute = op_compute_ms(*priced_llama(cluster, 3, recompute))
        rows.append(_row("block", block[1], block[0], compute["1"],
                         "forward + backward (+ recompute) of one block, ms", unit="ms"))
        rows.append(_row("block", one_layer[1]._replace(name=f"llama3-8b rest of the model, {label}"),
                         one_layer[0] - block[0], compute["rest"],
                         "embedding, final norm, output layer, float32 loss: 1 layer's step less one block, ms",
                         unit="ms"))
    return rows


def fsdp_rows(measured: pd.DataFrame, cluster: Cluster, sdpa: str = "flash") -> list[dict]:
    """TorchTitan's recipe on one GPU (FSDP2, masters, AdamW) against the predicted step of dp=1."""
    rows, steps = [], {}
    label = f"recompute selective, sdpa {sdpa}"
    for layers in (1, 3):
        got = measured_ms(measured, "fsdp", f"llama3-8b {layers} layers, {label}")
        if got is None:
            return rows
        steps[layers] = priced_llama(cluster, layers, "selective")[0].step_time_s * 1e3
        rows.append(_row("step", got[1], got[0], steps[layers],
                         "FSDP2 on 1 rank (fp32 masters, AdamW foreach) vs the step of --degrees dp=1, ms", unit="ms"))
    block = measured_ms(measured, "fsdp", f"llama3-8b one block, {label}")
    if block is not None:
        rows.append(_row("step", block[1], block[0], (steps[3] - steps[1]) / 2,
                         "one block's share of the step: (3 layers - 1 layer) / 2, ms", unit="ms"))
    return rows


def optimizer_rows(measured: pd.DataFrame, cluster: Cluster) -> list[dict]:
    got = measured_ms(measured, "optimizer", "adamw foreach")
    if got is None:
        return []
    numel = 1_000_000_000
    return [_row("optimizer", got[1], got[0], optimizer_time_s(4.0 * numel, numel, "adamw", cluster) * 1e3,
                 "AdamW foreach over 1e9 float32 parameters, ms", unit="ms")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=str(ROOT / "configs" / "h100-4x8.yaml"))
    ap.add_argument("--measured", default=str(ROOT / "results" / "gpu_components.csv"))
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu_model_check.csv"))
    args = ap.parse_args(argv)
    measured = pd.read_csv(args.measured)
    cluster = Cluster.from_yaml(args.cluster)
    rows = (efficiency_rows(measured, cluster) + launch_rows(measured, cluster) + optimizer_rows(measured, cluster)
            + block_rows(measured, cluster) + fsdp_rows(measured, cluster))
    write_csv_atomic(args.out, rows, COLUMNS)
    table = pd.DataFrame(rows, columns=COLUMNS)
    with pd.option_context("display.width", 200, "display.max_colwidth", 48):
        print(table[["check", "name", "shape", "measured", "predicted", "measured_over_predicted", "unit"]]
              .to_string(index=False))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
