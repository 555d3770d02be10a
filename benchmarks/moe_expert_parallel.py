"""Expert parallelism priced: writes results/moe_expert_parallel.csv (planning only, ~15 s).

A Mixtral of 0.43B parameters (HF ``MixtralConfig``: hidden 1024, 8 experts of FFN 3584,
top-2, 4 layers, vocabulary 32000; built on the meta device, nothing allocated) at batch 8 x
sequence 1024, planned on one mesh axis of each cluster. Three plans per cluster:

- ``dp``: the data-parallel baseline (experts replicated, their gradients all-reduced);
- ``dp+ep``: the same with every MoE layer expert-parallel (autoddl/ops/moe.py): experts stored
  and used S(0) on the expert dim, each token's pairs dispatched to their experts' devices and
  combined back by all-to-all;
- ``found``: what the search picks, and whether its MoE layers are expert-parallel.

    python benchmarks/moe_expert_parallel.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
              num_attention_heads=16, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=2048, router_aux_loss_coef=0.0, use_cache=False)
BATCH, SEQ = 8, 1024
CLUSTERS = (("dgx-a100-8", 8), ("h100-4x8", 8))
COLUMNS = ["cluster", "devices", "plan", "moe_layers_expert_parallel", "step_ms", "comm_ms", "memory_gb_per_device",
           "speedup_vs_dp"]


def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def trace_mixtral():
    import transformers

    import autoddl

    config = transformers.MixtralConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config).train()
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return autoddl.trace(model, {"input_ids": ids}, loss_fn, targets={"labels": ids}, name="mixtral-0.4b")


def expert_parallel(plan, graph):
    """``plan`` with every MoE layer expert-parallel on its one mesh axis (module docstring)."""
    from autoddl.moe import TARGET
    from autoddl.sbp import NdSbp, S, Signature

    ep = Signature.parse("[S(0)], [S(0)], [S(0)], [S(0)], [S(0)] -> [S(0)]")
    sigs, storage = dict(plan.signatures), dict(plan.param_storage)
    for node in graph.ops():
        if node.target == TARGET:
            sigs[node.name] = ep
            storage.update({fqn: NdSbp.of(S(0)) for fqn in node.params})
    return dataclasses.replace(plan, name="dp+ep", signatures=sigs, param_storage=storage)


def rows_for(graph, cluster_name: str, devices: int, cd_time_limit_s: float) -> list[dict]:
    from autoddl.cluster import Cluster
    from autoddl.moe import TARGET
    from costmodel.breakdown import plan_cost
    from search.planner import search

    cluster = Cluster.from_yaml(ROOT / "configs" / f"{cluster_name}.yaml").resized(devices)
    outcome = search(graph, cluster, mesh=(devices,), cd_time_limit_s=cd_time_limit_s)
    dp = next(s for s in outcome.schemes if s.name == "dp").plan
    moe = [n.name for n in graph.ops() if n.target == TARGET]
    rows, dp_ms = [], None
    for plan in (dp, expert_parallel(dp, graph), outcome.found):
        cost = plan_cost(graph, plan, cluster)
        dp_ms = dp_ms or cost.step_time_s * 1e3
        ep = sum(plan.signatures[n].inputs[3][0].is_split(0) and plan.signatures[n].inputs[0][0].is_split(0)
                 for n in moe)
        rows.append({"cluster": cluster_name, "devices": devices, "plan": plan.name,
                     "moe_layers_expert_parallel": f"{ep}/{len(moe)}", "step_ms": round(cost.step_time_s * 1e3, 3),
                     "comm_ms": round(cost.comm_s * 1e3, 3),
                     "memory_gb_per_device": round(cost.memory_bytes_per_device / 1e9, 2),
                     "speedup_vs_dp": round(dp_ms / (cost.step_time_s * 1e3), 3)})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    from autoddl.atomic import write_csv_atomic

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cd-seconds", type=float, default=20.0, help="coordinate descent time per search")
    p.add_argument("--out", default=str(ROOT / "results" / "moe_expert_parallel.csv"))
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    graph = trace_mixtral()
    rows = [r for name, devices in CLUSTERS for r in rows_for(graph, name, devices, args.cd_seconds)]
    write_csv_atomic(args.out, rows, COLUMNS)
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
