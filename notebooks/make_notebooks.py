"""Build the notebooks in this folder from the cells below, and optionally execute them.

The notebooks are committed with their outputs; this script is their reviewable
source. Edit the cells here, then rebuild and re-execute:

    python notebooks/make_notebooks.py                   # write all four, unexecuted
    python notebooks/make_notebooks.py --execute         # write and execute all four (outputs kept)
    python notebooks/make_notebooks.py --execute 02      # only 02 (needs results/fidelity.csv)
    python notebooks/make_notebooks.py --execute-only 02 # execute the existing 02 in place

Execution is headless: nbclient with the ``python3`` kernel of the running
interpreter's environment (ipykernel installs it under ``sys.prefix/share/jupyter``),
the notebook's folder as working directory. tests/test_notebooks.py runs them the same way.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
CELL_TIMEOUT_S = 600

SETUP = r"""
import json
import math
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

%matplotlib inline
T_START = time.perf_counter()
# the repository root: the first folder upwards holding configs/h100-4x8.yaml
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "configs" / "h100-4x8.yaml").exists())
pd.set_option("display.width", 220)
pd.set_option("display.max_columns", 40)
pd.set_option("display.max_colwidth", 70)
pd.set_option("display.precision", 2)
"""

# Per mesh axis: what the plan splits there, weighted by the FLOPs of the ops that read a
# weight matrix (the linears and the embedding lookups: nearly all of a transformer's FLOPs),
# plus the share of parameter bytes stored sharded on that axis. Shared by 01 and 03.
AXIS_ROLES = r"""
from autoddl.graph import NodeKind
from autoddl.sbp import Broadcast, Partial, Split
from autoddl.program import used_parameters


def axis_roles(graph, plan, cluster):
    '''One row per mesh axis: size, link, FLOP shares of the weight-reading ops that split the batch /
    the sequence / the weight (tensor parallel) / nothing on it, and the share of parameter bytes stored
    split on it (ZeRO when the weights are gathered for use, i.e. tensor% is small).'''
    params = used_parameters(graph)
    rows = []
    for axis, size in enumerate(plan.mesh.shape):
        share = dict.fromkeys(("batch", "sequence", "tensor", "replicated"), 0.0)
        total = 0.0
        for node in graph.ops():
            slots = [k for k, r in enumerate(node.inputs) if graph[r.node].kind is NodeKind.PARAMETER
                     and len(node.input_metas[k].shape) == 2]
            if not slots or not node.flops:
                continue
            sig = plan.signatures[node.name]
            acts = [k for k in range(len(node.inputs)) if graph[node.inputs[k].node].kind is not NodeKind.PARAMETER]
            weight_split = any(not isinstance(sig.inputs[k][axis], Broadcast) for k in slots)
            act = sig.inputs[acts[0]][axis] if acts else Broadcast()
            ndim = len(node.input_metas[acts[0]].shape) if acts else 0
            if weight_split:
                kind = "tensor"
            elif isinstance(act, Split) and act.dim == 0:
                kind = "batch"
            elif isinstance(act, Split) and ndim >= 3 and act.dim == ndim - 2:
                kind = "sequence"
            elif isinstance(act, (Split, Partial)):
                kind = "tensor"
            else:
                kind = "replicated"
            share[kind] += node.flops
            total += node.flops
        stored = sum(n.outputs[0].nbytes for fqn, n in params.items()
                     if isinstance(plan.param_storage[fqn][axis], Split))
        link = cluster.link_for_axis(plan.mesh.shape, axis)
        row = {"axis": axis, "size": size, "link": "intra-node" if link is cluster.intra_node else "inter-node"}
        row.update({f"{k}_%": 100 * v / total if total else 0.0 for k, v in share.items()})
        row["params_stored_split_%"] = 100 * stored / sum(n.outputs[0].nbytes for n in params.values())
        rows.append(row)
    return pd.DataFrame(rows)


def axis_label(row):
    '''"DP", "TP", "DP+ZeRO", "SP", ... from one axis_roles row (the largest FLOP share wins).'''
    shares = {"DP": row["batch_%"], "SP": row["sequence_%"], "TP": row["tensor_%"], "repl": row["replicated_%"]}
    label = max(shares, key=shares.get)
    if label != "TP" and row["params_stored_split_%"] >= 50:
        label += "+ZeRO"
    return label


def plan_label(graph, plan, cluster):
    '''e.g. "4x8 [DP+ZeRO | TP]": the mesh and each axis's role, outermost first.'''
    roles = axis_roles(graph, plan, cluster)
    return f"{plan.mesh} [" + " | ".join(axis_label(r) for _, r in roles.iterrows()) + "]"
"""


def _code(*parts: str):
    """A code cell from source parts, each dedented on its own (shared snippets + the cell's own code)."""
    return new_code_cell("\n\n".join(textwrap.dedent(p).strip("\n") for p in parts))


def _md(src: str):
    return new_markdown_cell(textwrap.dedent(src).strip("\n"))


# ---------------------------------------------------------------------------------------------
# 01: compare schemes
# ---------------------------------------------------------------------------------------------
def nb01():
    cells = [
        _md(r"""
        # 01 · Comparing parallelization schemes

        GPT-2 XL (1.56 B parameters) and Llama 3 8B on two clusters — one DGX A100 (8 GPUs,
        `configs/dgx-a100-8.yaml`) and four DGX H100 (32 GPUs, `configs/h100-4x8.yaml`). For each, every
        expert scheme (data parallel `dp`, ZeRO-3 / FSDP `zero3`, Megatron tensor parallel `tp`,
        sequence parallel `sp`, 2-D `dp_tp`) and the plan autoddl's search finds, each priced by the
        analytical cost model: predicted step time, its breakdown and memory per device. Then what the
        found plan does differently from the best baseline, op by op, in one transformer block.

        Every number here is a **prediction** of the cost model (the YAML's datasheet numbers with derating
        assumptions), not a measurement; notebook 02 compares predictions with measured runs.

        Command-line equivalent (one model and cluster per call):

        ```
        autoddl compare examples/gpt.py --preset gpt2-xl --cluster configs/dgx-a100-8.yaml --plot gpt2xl-a100.png
        autoddl compare examples/llama.py --preset llama3-8b --set seq_len=2048 --cluster configs/h100-4x8.yaml
        autoddl plan examples/gpt.py --preset gpt2-xl --cluster configs/h100-4x8.yaml --out plan.json
        autoddl explain plan.json          # per op: signature, runner-up, collectives inserted
        ```

        **Llama at 2048 tokens.** The `llama3-8b` preset's batch is 8 × 8192 tokens. At 8192 nothing fits in
        80 GB on the 8 A100s (when this notebook was written the least-memory plan needed 152 GiB per device)
        and the search on `h100-4x8` took 44 s, so Llama is planned with `seq_len=2048` (batch 8 × 2048).
        GPT-2 XL uses its preset (batch 16 × 1024).
        """),
        _code(SETUP, r"""
        from autoddl.api import schemes_frame, search_model
        from autoddl.charts import SEGMENTS
        from autoddl.cluster import Cluster
        from autoddl.loader import trace_model_file
        from autoddl.program import lower
        """),
        _md(r"""
        ## Trace

        Each model file is traced once on the meta device (no weights are allocated) into an op graph with
        FLOPs and bytes per op.
        """),
        _code(r"""
        MODELS = {"gpt2-xl": ("examples/gpt.py", {"preset": "gpt2-xl"}),
                  "llama3-8b": ("examples/llama.py", {"preset": "llama3-8b", "seq_len": 2048})}
        CLUSTERS = ["dgx-a100-8", "h100-4x8"]
        graphs, tokens_per_step = {}, {}
        for name, (path, kw) in MODELS.items():
            t0 = time.perf_counter()
            mf, graph = trace_model_file(ROOT / path, **kw)
            graphs[name] = graph
            tokens_per_step[name] = math.prod(mf.example_inputs[0].shape)
            print(f"{name:10s} {graph.parameter_count / 1e9:.2f} B parameters, {len(graph.ops())} ops, "
                  f"batch {tuple(mf.example_inputs[0].shape)} = {tokens_per_step[name]} tokens per step, "
                  f"traced in {time.perf_counter() - t0:.1f} s")
        """),
        _md(r"""
        ## Search: every scheme, every mesh

        `autoddl.api.search_model` builds each baseline on its canonical mesh (`tp`, `sp` on the 1-D mesh of
        all devices; `dp`, `zero3` and `dp_tp` on nodes × GPUs-per-node, 2 × 4 on one node — the table's `mesh`
        column says which), then runs coordinate descent from the baselines on every mesh shape (1-D and 2-D,
        inner axis inside a node) and keeps the cheapest plan that fits the 80 GB per device. `schemes_frame` turns the outcome into one row per
        scheme (times in ms, memory in GB).
        """),
        _code(r"""
        outcomes, clusters, frames = {}, {}, []
        for model, graph in graphs.items():
            for cname in CLUSTERS:
                cluster = clusters[cname] = Cluster.from_yaml(ROOT / "configs" / f"{cname}.yaml")
                t0 = time.perf_counter()
                out = outcomes[model, cname] = search_model(graph, cluster)
                df = schemes_frame(out)
                df.insert(0, "cluster", cname)
                df.insert(0, "model", model)
                frames.append(df)
                print(f"{model:10s} on {cname:10s}: meshes {', '.join('x'.join(map(str, m)) for m in out.meshes)} "
                      f"searched in {time.perf_counter() - t0:.1f} s")
        table = pd.concat(frames, ignore_index=True)
        """),
        _md(r"""
        ## Every scheme's predicted step time, breakdown and memory

        `step_ms = compute_ms + boxing_fwd_ms + boxing_bwd_ms + grad_sync_ms + optimizer_ms` (no overlap of
        communication with compute is modelled). `x_found` is the scheme's step time over the found plan's
        (how many times slower). Schemes that do not apply say why: with 32 devices the batch of 16 (GPT-2 XL)
        or 8 (Llama) sequences cannot be split 32 ways, so neither `dp` nor `zero3` exists there.
        """),
        _code(r"""
        found_ms = table[table.scheme == "found"].set_index(["model", "cluster"])["step_ms"]
        table["x_found"] = [r.step_ms / found_ms[r.model, r.cluster] for r in table.itertuples()]
        table["tokens_per_s"] = [tokens_per_step[r.model] / (r.step_ms / 1e3) for r in table.itertuples()]
        show = table.copy()
        show["reason"] = show["reason"].str.slice(0, 70)
        cols = ["model", "cluster", "scheme", "mesh", "step_ms", "x_found", "compute_ms", "boxing_fwd_ms",
                "boxing_bwd_ms", "grad_sync_ms", "optimizer_ms", "memory_gb", "fits_memory", "tokens_per_s", "reason"]
        show = show[cols].round(2)
        show["tokens_per_s"] = show["tokens_per_s"].round(0)
        show.fillna({"reason": ""})
        """),
        _md(r"""
        ## Breakdown chart

        Stacked bars of each applicable scheme's predicted step time (left axis), memory per device as black
        diamonds (right axis), one panel per model and cluster. The same chart for one pair comes from
        `autoddl compare ... --plot cmp.png` (`autoddl.charts.breakdown_chart`).
        """),
        _code(r"""
        fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
        colors = plt.get_cmap("tab10").colors
        for ax, ((model, cname), _) in zip(axes.flat, outcomes.items()):
            rows = table[(table.model == model) & (table.cluster == cname) & table.applicable].reset_index(drop=True)
            labels = rows["scheme"] + "\n" + rows["mesh"]
            bottom = np.zeros(len(rows))
            for (column, label), color in zip(SEGMENTS, colors):
                ax.bar(labels, rows[column], bottom=bottom, label=label, color=color)
                bottom += rows[column].to_numpy()
            ax.set_ylabel("predicted step time (ms)")
            ax.set_title(f"{model} on {cname}")
            mem = ax.twinx()
            mem.plot(range(len(rows)), rows["memory_gb"], "kD", label="memory per device (GB)")
            mem.axhline(80, color="k", lw=0.6, ls=":")
            mem.set_ylim(0, max(85, rows["memory_gb"].max() * 1.1))
            mem.set_ylabel("GB per device")
        handles, names = axes.flat[0].get_legend_handles_labels()
        h2, n2 = mem.get_legend_handles_labels()
        fig.legend(handles + h2, names + n2, loc="lower center", ncol=6)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        plt.show()
        """),
        _md(r"""
        ## What the found plan does, axis by axis

        For each found plan and each applicable best baseline: per mesh axis, the share of weight-reading
        ops' FLOPs (linears, embedding lookups) that split the **batch** on that axis (data parallel), the
        **sequence**, or the **weights** (tensor parallel), or that are **replicated** on it, and the share of
        parameter bytes **stored split** on it (stored split but used whole = ZeRO / FSDP). The label names the
        largest share.
        """),
        _code(AXIS_ROLES, r"""

        role_rows = []
        for (model, cname), out in outcomes.items():
            best = out.best_baseline
            for who, scheme in (("found", out.schemes[-1]), ("best baseline", best)):
                if scheme is None:
                    role_rows.append({"model": model, "cluster": cname, "plan": who, "scheme": "none applies"})
                    continue
                roles = axis_roles(graphs[model], scheme.plan, clusters[cname])
                for _, r in roles.iterrows():
                    role_rows.append({"model": model, "cluster": cname, "plan": who, "scheme": scheme.name,
                                      "mesh": str(scheme.plan.mesh), "label": axis_label(r), **r.to_dict()})
        roles_table = pd.DataFrame(role_rows)
        roles_table[["axis", "size"]] = roles_table[["axis", "size"]].astype("Int64")
        roles_table.round(0)
        """),
        _md(r"""
        ## Layer by layer: the found plan against the best baseline in one transformer block

        For a block in the middle of the model: each op's SBP signature under the best baseline and under
        the found plan (`inputs -> outputs`, one entry per mesh axis, `S(d)` split on dim d, `B` broadcast,
        `P` partial sum), and the collectives each plan inserts at that op (`autoddl.program.lower(graph, plan).collectives()`:
        forward boxing, backward boxing, gradient sync). Shown for GPT-2 XL on `h100-4x8`, where the best
        baseline (`dp_tp`) and the found plan use the same 4 × 8 mesh, so signatures compare axis by axis.
        """),
        _code(r"""
        import re
        from collections import Counter, defaultdict

        def middle_block(graph):
            '''Module-path prefix of the middle repeated block, e.g. "transformer.h.24".'''
            found = {}
            for n in graph.ops():
                m = re.match(r"^(.*?\b(?:h|layers)\.)(\d+)(?:\.|$)", n.module_path)
                if m:
                    found[int(m.group(2))] = m.group(1) + m.group(2)
            return found[sorted(found)[len(found) // 2]]

        def collectives_by_op(graph, plan):
            out = defaultdict(list)
            for t in lower(graph, plan).collectives():
                out[t.op].append(f"{t.phase[:4]} {t.collective.value} ax{t.axis} {t.nbytes / 1e6:.1f}MB")
            return out

        def block_table(model, cname):
            graph, out = graphs[model], outcomes[model, cname]
            found, base = out.found, out.best_baseline.plan
            prefix = middle_block(graph)
            cf, cb = collectives_by_op(graph, found), collectives_by_op(graph, base)
            rows = []
            for n in graph.ops():
                if n.module_path != prefix and not n.module_path.startswith(prefix + "."):
                    continue
                sb, sf = str(base.signatures[n.name]), str(found.signatures[n.name])
                rows.append({"op": n.name, "aten": n.op_name, "module": n.module_path[len(prefix):].lstrip(".") or "(block)",
                             f"{out.best_baseline.name} signature": sb, "found signature": sf,
                             "differs": "yes" if sb != sf else "",
                             f"{out.best_baseline.name} collectives": "; ".join(cb.get(n.name, [])),
                             "found collectives": "; ".join(cf.get(n.name, []))})
            params = [{"parameter": fqn[len(prefix) + 1:], "shape": "x".join(map(str, n.outputs[0].shape)),
                       f"{out.best_baseline.name} storage": str(base.param_storage[fqn]),
                       "found storage": str(found.param_storage[fqn])}
                      for fqn, n in graph.parameters().items() if fqn.startswith(prefix + ".")]
            return prefix, pd.DataFrame(rows), pd.DataFrame(params)

        MODEL, CLUSTER = "gpt2-xl", "h100-4x8"
        out = outcomes[MODEL, CLUSTER]
        print(f"{MODEL} on {CLUSTER}: best baseline {out.best_baseline.name} on {out.best_baseline.plan.mesh} "
              f"({out.best_baseline.step_time_s * 1e3:.1f} ms), found plan on {out.found.mesh} "
              f"({out.found_breakdown.step_time_s * 1e3:.1f} ms, "
              f"{out.best_baseline.step_time_s / out.found_breakdown.step_time_s:.2f}x faster)")
        prefix, ops_df, params_df = block_table(MODEL, CLUSTER)
        print(f"block {prefix}: {len(ops_df)} ops, {(ops_df.differs == 'yes').sum()} with a different signature")
        ops_df
        """),
        _code(r"""
        stored = params_df.copy()
        print(f"parameters of {prefix}: storage NdSbp between steps (S(d) on an axis: each device keeps 1/n of dim d)")
        stored
        """),
        _md(r"""
        ## Which collectives differ, over the whole step

        Every collective one training step runs, counted by phase, kind and mesh axis, with the megabytes
        each device sends through it and the predicted time (`costmodel.collectives`), for the best baseline
        and the found plan of each model and cluster. This is where the step-time difference in the table
        above comes from.
        """),
        _code(r"""
        from autoddl.boxing import group_name
        from costmodel.collectives import cluster_collective_time_s

        def collective_counts(plan, breakdown, cluster):
            agg = defaultdict(lambda: [0, 0.0, 0.0])
            for c in breakdown.collectives:
                key = (c.phase, c.kind.value, group_name(c.axis))   # "0", or "0+1" flattened
                agg[key][0] += 1
                agg[key][1] += c.bytes / 1e6
                agg[key][2] += cluster_collective_time_s(c.kind, c.bytes, plan.mesh.shape, c.axis, cluster) * 1e3
            return agg

        diff_rows = []
        for (model, cname), out in outcomes.items():
            best = out.best_baseline
            if best is None:
                print(f"{model} on {cname}: no baseline applies, nothing to compare against")
                continue
            cb = collective_counts(best.plan, best.breakdown, clusters[cname])
            cf = collective_counts(out.found, out.found_breakdown, clusters[cname])
            for key in sorted(set(cb) | set(cf)):
                b, f = cb.get(key, [0, 0.0, 0.0]), cf.get(key, [0, 0.0, 0.0])
                diff_rows.append({"model": model, "cluster": cname, "baseline": f"{best.name} {best.plan.mesh}",
                                  "found": str(out.found.mesh), "phase": key[0], "collective": key[1], "axis": key[2],
                                  "baseline_count": b[0], "found_count": f[0], "baseline_MB": b[1], "found_MB": f[1],
                                  "baseline_ms": b[2], "found_ms": f[2]})
        diffs = pd.DataFrame(diff_rows)
        big = diffs[diffs[["baseline_ms", "found_ms"]].max(axis=1) >= 0.5]
        print(f"{len(big)} of {len(diffs)} (phase, collective, axis) groups take >= 0.5 ms in either plan; the rest "
              f"together: baseline {diffs.baseline_ms.sum() - big.baseline_ms.sum():.1f} ms, found "
              f"{diffs.found_ms.sum() - big.found_ms.sum():.1f} ms")
        big.round(1)
        """),
        _md(r"""
        Read the two tables together: an axis the baseline uses for Megatron tensor parallelism puts
        all-reduces (or all-gathers / reduce-scatters) of activations into every block, forward and backward;
        an axis used for data parallelism or ZeRO moves only parameters and their gradients (each parameter
        once per step: a gradient all-reduce for DP; an all-gather forward and a reduce-scatter of the
        gradient for ZeRO). The
        found plan picks, op by op, whichever is cheaper on that axis's link. The summary below is computed
        from the tables above.
        """),
        _code(r"""
        for (model, cname), out in outcomes.items():
            best, fb = out.best_baseline, out.found_breakdown
            found_roles = " | ".join(roles_table[(roles_table.model == model) & (roles_table.cluster == cname)
                                                 & (roles_table.plan == "found")]["label"])
            line = (f"{model} on {cname}: found {out.found.mesh} [{found_roles}] "
                    f"{fb.step_time_s * 1e3:.1f} ms (compute {fb.compute_s * 1e3:.1f}, communication "
                    f"{fb.comm_s * 1e3:.1f}, optimizer {fb.optimizer_s * 1e3:.1f}), {fb.memory_bytes_per_device / 1e9:.1f} GB")
            if best is not None:
                bb = best.breakdown
                d = diffs[(diffs.model == model) & (diffs.cluster == cname)]
                line += (f"; best baseline {best.name} {best.plan.mesh} {bb.step_time_s * 1e3:.1f} ms (compute "
                         f"{bb.compute_s * 1e3:.1f}, communication {bb.comm_s * 1e3:.1f}, optimizer "
                         f"{bb.optimizer_s * 1e3:.1f}), {bb.memory_bytes_per_device / 1e9:.1f} GB; "
                         f"collectives {int(d.baseline_count.sum())} -> {int(d.found_count.sum())}, "
                         f"{d.baseline_MB.sum() / 1e3:.2f} -> {d.found_MB.sum() / 1e3:.2f} GB sent per device")
            else:
                line += "; no baseline applies"
            print(line)
            if best is not None:
                split = roles_table[(roles_table.model == model) & (roles_table.cluster == cname)
                                    & (roles_table.plan == "best baseline")]["params_stored_split_%"].max()
                print(f"    {best.name} stores {split:.0f}% of parameter bytes split on some mesh axis "
                      "(0%: every device keeps every full weight between steps)")
        """),
        _md(r"""
        ## Llama-3-8B on 8 H100: precision x recompute x scheme

        The most common fine-tuning / pre-training setup: Llama-3-8B at sequence 8192, one sequence per
        GPU per micro-step (`--micro-batch-size 1`), a global batch of 8 sequences, on one node of 8 H100
        80GB (`configs/h100-4x8.yaml`, 8 devices). For each precision policy (fp32; bf16 working copies
        with fp32 masters, as FSDP2's `MixedPrecisionPolicy`) and activation recompute (none; selective:
        torchtitan's op policy, matmul and attention outputs kept except every second matmul's, the rest
        recomputed; full: each block recomputed from its input), the search
        runs on every mesh of 8 devices, and every expert baseline is priced with the same settings.
        Command-line equivalent of one cell of the table:

        ```
        autoddl plan examples/llama.py --preset llama3-8b --cluster configs/h100-4x8.yaml --devices 8 \
            --precision bf16 --recompute selective --micro-batch-size 1 --global-batch-size 8
        autoddl plan ... --degrees fsdp=8 --no-search      # the configuration TorchTitan measured
        ```
        """),
        _code(r"""
        from autoddl.loader import load_model_file
        from autoddl.training import Training
        from search.problem import NoFeasiblePlanError

        h100x8 = Cluster.from_yaml(ROOT / "configs" / "h100-4x8.yaml").resized(8)
        llama_file = load_model_file(ROOT / "examples" / "llama.py", preset="llama3-8b").with_batch_size(8)
        rows = []
        for precision in ("fp32", "bf16"):
            graph = llama_file.trace({"fp32": "float32", "bf16": "bfloat16"}[precision])
            for recompute in ("none", "selective", "full"):
                training = Training(param_dtype=precision, recompute=recompute)
                try:
                    out = search_model(graph, h100x8, training=training)
                except NoFeasiblePlanError as exc:
                    rows.append({"precision": precision, "recompute": recompute, "scheme": "(any)", "mesh": "",
                                 "step_s": np.nan, "tokens_per_s_per_gpu": np.nan,
                                 "memory_GB": exc.min_memory_bytes / 1e9, "fits": False})
                    continue
                for scheme in out.schemes:
                    if scheme.plan is None:
                        continue
                    bd = scheme.breakdown
                    rows.append({"precision": precision, "recompute": recompute, "scheme": scheme.name,
                                 "mesh": "x".join(map(str, scheme.plan.mesh.shape)), "step_s": bd.step_time_s,
                                 "tokens_per_s_per_gpu": 8 * 8192 / bd.step_time_s / 8,
                                 "memory_GB": bd.memory_bytes_per_device / 1e9, "fits": bd.fits_memory})
        llama_variants = pd.DataFrame(rows)
        llama_variants
        """),
        _md(r"""
        A row `(any)` means no plan fits in 80 GB with those settings and gives the least memory a plan
        would need: without recompute the activations of 8192 tokens exceed it in either precision.
        Recompute buys memory with step time (full more than selective), and fp32 computes at the
        FP32 peak (67 TFLOPS), an order of magnitude below bf16's, so bf16 with selective recompute is
        the fastest setting that fits, as practitioners run it. Every
        number is a prediction from the cluster file's datasheet peaks and the efficiencies measured on
        an H100 (results/README.md, `gpu_components.csv`); beside TorchTitan's measurement of `fsdp=8`,
        selective recompute (results/README.md, `published.csv`), the prediction is 1.11x the figure
        in TorchTitan's paper and 1.21x the one in its repository. Those were measured on 96 GB HBM2e
        H100s at 500 W, whose peak TorchTitan puts between the SXM and NVL datasheets': priced on
        `configs/h100-96gb-500w.yaml` at both ends the same plan is 0.93-1.04x the paper's figure and
        1.01-1.13x the repository's (within the 15% target at both ends).
        """),
        _code(r"""
        fits = llama_variants[llama_variants.fits]
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4))
        for (precision, recompute), group in fits.groupby(["precision", "recompute"], sort=False):
            label = f"{precision} {recompute}"
            ax_t.bar([f"{s}\n{label}" for s in group.scheme], group.step_s, label=label)
            ax_m.bar([f"{s}\n{label}" for s in group.scheme], group.memory_GB, label=label)
        ax_t.set_ylabel("predicted step time (s)")
        ax_m.set_ylabel("memory per device (GB)")
        ax_m.axhline(80, color="k", ls="--", lw=1)
        for ax in (ax_t, ax_m):
            ax.tick_params(axis="x", labelrotation=90, labelsize=7)
        fig.suptitle("Llama-3-8B, seq 8192, global batch 8, on 8 H100: what fits and how fast")
        fig.tight_layout()
        """),
        _md(r"""
        ## Numbers checked by `tests/test_notebooks.py`

        The test re-executes this notebook and checks, for every model and cluster, that the found plan's
        predicted step time is at most every applicable baseline's, and that the found plan fits in memory.
        """),
        _code(r"""
        summary = {f"{m}|{c}": {r.scheme: (None if pd.isna(r.step_ms) else round(float(r.step_ms), 4))
                               for r in table[(table.model == m) & (table.cluster == c)].itertuples()}
                   | {"found_fits": bool(outcomes[m, c].found_breakdown.fits_memory)}
                   for m, c in outcomes}
        summary["llama3-8b-variants"] = {f"{r.precision} {r.recompute} {r.scheme}": [
            None if pd.isna(r.step_s) else round(float(r.step_s), 4), round(float(r.memory_GB), 2), bool(r.fits)]
            for r in llama_variants.itertuples()}
        print(f"notebook executed in {time.perf_counter() - T_START:.0f} s")
        print("SUMMARY " + json.dumps(summary))
        """),
    ]
    return cells


# ---------------------------------------------------------------------------------------------
# 02: measured vs predicted
# ---------------------------------------------------------------------------------------------
def nb02():
    return [
        _md(r"""
        # 02 · Measured against predicted step time

        How good is the cost model? `benchmarks/fidelity.py` plans every applicable baseline and the found
        plan for the example models at small presets on the calibrated local CPU cluster
        (`configs/local-cpu.yaml`, gloo), runs each with the executor on 2 and 4 ranks and a 2 × 2 mesh, and
        appends one row per run to `results/fidelity.csv` (columns of `executor.measure.RUN_COLUMNS`:
        `predicted_step_s` and its `predicted_*` breakdown, `measured_median_s`, `measured_p10_s`,
        `measured_p90_s`, ..., plus the study's `study`, `scheme`, `config`, `same_as`, `load_avg_1m`, `error`).
        This notebook reads that CSV and shows:

        1. predicted against measured step time, log-log with the line y = x;
        2. per model: the mean absolute percentage error (MAPE) and the Spearman rank correlation of the
           schemes' order (does the model rank the schemes as the measurements do?);
        3. where the model is wrong and why: the largest residuals, which predicted term dominates them, and
           how the error depends on the share of communication and on the rank count.

        Command-line equivalent:

        ```
        python benchmarks/fidelity.py                  # the study: plans, runs, appends results/fidelity.csv
        python benchmarks/fidelity.py --analyze-only   # its own summary table and plot from the CSV
        autoddl run plan.json --nproc 4 --steps 20     # one measured-vs-predicted row for one plan
        ```

        Set `AUTODDL_FIDELITY_CSV` to read another CSV of the same columns.
        """),
        _code(SETUP, r"""
        import os

        pd.set_option("display.max_rows", 200)
        CSV = Path(os.environ.get("AUTODDL_FIDELITY_CSV", ROOT / "results" / "fidelity.csv"))
        if not CSV.is_file():
            raise FileNotFoundError(
                f"{CSV} does not exist: this notebook reads the fidelity study's measurements. Run the study first "
                "(`python benchmarks/fidelity.py`, 10-20 min on 2 cores), then execute this notebook "
                "(`python notebooks/make_notebooks.py --execute-only 02`).")
        raw = pd.read_csv(CSV)
        need = ["model", "plan", "mesh", "nproc", "predicted_step_s", "predicted_compute_s", "predicted_comm_s",
                "predicted_grad_sync_s", "predicted_optimizer_s", "measured_median_s", "measured_p10_s", "measured_p90_s"]
        missing = [c for c in need if c not in raw.columns]
        if missing:
            raise ValueError(f"{CSV}: missing columns {missing}; expected the columns of executor.measure.RUN_COLUMNS")
        if "testbed" in raw.columns:                     # the two-host studies' rows: results/README.md
            raw = raw[raw["testbed"].isna()]
        if "study" in raw.columns:                       # the latest study only
            raw["study"] = raw["study"].astype(str)
            STUDY = raw["study"].max()
            raw = raw[raw["study"] == STUDY]
        else:
            STUDY = "(no study column)"
        runs = raw.dropna(subset=["measured_median_s", "predicted_step_s"]).copy()
        if runs.empty:
            raise ValueError(f"{CSV}: study {STUDY} has no measured rows (every run failed?); see its error column")
        if "scheme" not in runs.columns:
            runs["scheme"] = runs["plan"]
        runs["mesh"] = runs["mesh"].astype(str)
        failed = raw[raw["measured_median_s"].isna()]
        print(f"{CSV.relative_to(ROOT) if CSV.is_relative_to(ROOT) else CSV}: study {STUDY}, {len(runs)} measured runs "
              f"of {runs.model.nunique()} models, {len(failed)} failed")
        if len(failed):
            print(failed[[c for c in ("model", "mesh", "scheme", "error") if c in failed.columns]].to_string(index=False))
        """),
        _md(r"""
        ## The runs

        Times in ms. `ratio` = measured median / predicted (above 1: the model is optimistic). `boxing` is
        the forward and backward boxing (`predicted_comm_s - predicted_grad_sync_s`); `comm_share` is the
        predicted communication (boxing + gradient sync) over the predicted step.
        """),
        _code(r"""
        ms = lambda c: runs[c] * 1e3
        runs["pred_ms"], runs["meas_ms"] = ms("predicted_step_s"), ms("measured_median_s")
        runs["p10_ms"], runs["p90_ms"] = ms("measured_p10_s"), ms("measured_p90_s")
        runs["compute_ms"] = ms("predicted_compute_s")
        runs["boxing_ms"] = ms("predicted_comm_s") - ms("predicted_grad_sync_s")
        runs["grad_sync_ms"] = ms("predicted_grad_sync_s")
        runs["optimizer_ms"] = ms("predicted_optimizer_s")
        runs["ratio"] = runs["meas_ms"] / runs["pred_ms"]
        runs["abs_pct_err"] = 100 * (runs["pred_ms"] - runs["meas_ms"]).abs() / runs["meas_ms"]
        runs["comm_share"] = (runs["boxing_ms"] + runs["grad_sync_ms"]) / runs["pred_ms"]
        cols = ["model", "nproc", "mesh", "scheme", "pred_ms", "meas_ms", "p10_ms", "p90_ms", "ratio", "abs_pct_err",
                "compute_ms", "boxing_ms", "grad_sync_ms", "optimizer_ms", "comm_share"]
        runs.sort_values(["model", "nproc", "mesh", "meas_ms"])[cols].round(3)
        """),
        _md(r"""
        ## Predicted against measured

        One point per run (median, with its p10..p90 range as an error bar), one colour per model, one marker
        per mesh, the found plan filled. On the line y = x the prediction is exact; the dotted lines are ±25 %.
        """),
        _code(r"""
        models = list(dict.fromkeys(runs.model))
        meshes = list(dict.fromkeys(runs.mesh))
        colours = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(models)}
        markers = dict(zip(meshes, "osD^v<>phX"))
        fig, ax = plt.subplots(figsize=(7.5, 6.5))
        for r in runs.itertuples():
            c = colours[r.model]
            ax.errorbar([r.pred_ms], [r.meas_ms], yerr=[[r.meas_ms - r.p10_ms], [r.p90_ms - r.meas_ms]],
                        fmt=markers[r.mesh], color=c, mfc=c if r.scheme == "found" else "none", ms=7, capsize=2, lw=0.8)
        lo = min(runs.pred_ms.min(), runs.p10_ms.min()) / 1.5
        hi = max(runs.pred_ms.max(), runs.p90_ms.max()) * 1.5
        ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
        for f in (1.25, 1 / 1.25):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.7, label="±25 %" if f > 1 else None)
        for m in models:
            ax.plot([], [], "o", color=colours[m], label=m)
        for mesh, mk in markers.items():
            ax.plot([], [], mk, color="grey", mfc="none", label=f"mesh {mesh}")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted step time (ms)",
               ylabel="measured step time (ms): median, p10..p90", title=f"fidelity study {STUDY}")
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        ax.legend(fontsize=8, ncol=2, loc="upper left")
        plt.show()
        """),
        _md(r"""
        ## Error per model

        - **MAPE**: mean over the model's runs of |predicted − measured| / measured.
        - **Spearman**: for each (model, mesh), the rank correlation between predicted and measured step time
          over the schemes run on that mesh (1: same order; ties averaged); per model the mean and the minimum
          over its meshes. Meshes with fewer than 3 schemes, or where all predictions are equal, give no value.
        - **found fastest**: on how many meshes the found plan's measured median was the smallest.
        """),
        _code(r"""
        def spearman(a, b):
            a, b = pd.Series(list(a)).rank(), pd.Series(list(b)).rank()
            if len(a) < 3 or a.nunique() < 2 or b.nunique() < 2:
                return float("nan")
            return float(a.corr(b))

        per_mesh = []
        for (model, mesh), g in runs.groupby(["model", "mesh"], sort=False):
            found = g[g.scheme == "found"]
            base = g[g.scheme != "found"]
            per_mesh.append({"model": model, "mesh": mesh, "schemes": len(g),
                             "MAPE_%": g.abs_pct_err.mean(), "spearman": spearman(g.pred_ms, g.meas_ms),
                             "found_fastest": (bool(found.meas_ms.min() <= base.meas_ms.min())
                                               if len(found) and len(base) else None)})
        per_mesh = pd.DataFrame(per_mesh)
        per_model = runs.groupby("model", sort=False).agg(runs=("ratio", "size"), MAPE_pct=("abs_pct_err", "mean"),
                                                           median_ratio=("ratio", "median"))
        per_model["spearman_mean"] = per_mesh.groupby("model", sort=False)["spearman"].mean()
        per_model["spearman_min"] = per_mesh.groupby("model", sort=False)["spearman"].min()
        per_model["found_fastest"] = per_mesh.groupby("model", sort=False)["found_fastest"].apply(
            lambda s: f"{int(s.dropna().sum())}/{int(s.notna().sum())}")
        OVERALL_MAPE = float(runs.abs_pct_err.mean())
        print(f"overall MAPE {OVERALL_MAPE:.1f} % over {len(runs)} runs; median measured/predicted "
              f"{runs.ratio.median():.2f}")
        display(per_model.round(3))
        per_mesh.round(3)
        """),
        _md(r"""
        ## Where the model is wrong, and why

        The residual of a run is log2(measured / predicted): +1 means the run took twice the predicted time.
        Below: the runs with the largest |residual|, with the predicted term that dominates each (the largest
        of compute, boxing, gradient sync, optimizer); the mean residual grouped by dominant term, by rank
        count and by mesh; and the rank correlation of the residual with the predicted communication share
        and with the machine's load at launch. The closing lines are computed from these tables. One fact of
        the setup to read them with: the study ran on a 2-core machine, so with 4 ranks two processes share
        each core, which the calibration (2 ranks, `configs/local-cpu.yaml`) did not see.
        """),
        _code(r"""
        terms = ["compute_ms", "boxing_ms", "grad_sync_ms", "optimizer_ms"]
        runs["dominant"] = runs[terms].idxmax(axis=1).str.replace("_ms", "")
        runs["residual_log2"] = np.log2(runs["ratio"])
        worst = runs.reindex(runs.residual_log2.abs().sort_values(ascending=False).index).head(8)
        display(worst[["model", "nproc", "mesh", "scheme", "pred_ms", "meas_ms", "ratio", "dominant", "compute_ms",
                       "boxing_ms", "grad_sync_ms", "optimizer_ms", "comm_share"]]
                .round(3))
        by = {k: runs.groupby(k)["residual_log2"].agg(["count", "mean", "min", "max"]) for k in ("dominant", "nproc", "mesh")}
        for k, t in by.items():
            print(f"residual log2(measured/predicted) by {k}:")
            print(t.round(2).to_string(), end="\n\n")
        rho_comm = spearman(runs.comm_share, runs.residual_log2)
        print(f"Spearman(comm_share, residual) = {rho_comm:.2f} over {len(runs)} runs")
        rho_load = float("nan")
        if "load_avg_1m" in runs.columns and runs.load_avg_1m.notna().sum() >= 3:
            rho_load = spearman(runs.load_avg_1m, runs.residual_log2)
            print(f"Spearman(1-minute load average at launch, residual) = {rho_load:.2f}; load "
                  f"{runs.load_avg_1m.min():.1f} .. {runs.load_avg_1m.max():.1f} on this machine's cores")
        """),
        _code(r"""
        over = runs[runs.ratio > 1.25]
        under = runs[runs.ratio < 1 / 1.25]
        print(f"{len(over)} of {len(runs)} runs took more than 1.25x the prediction (model optimistic), "
              f"{len(under)} less than 0.8x (model pessimistic).")
        d = by["dominant"]["mean"]
        print("mean residual by dominant predicted term: " +
              ", ".join(f"{k} {2 ** v:.2f}x ({int(by['dominant']['count'][k])} runs)" for k, v in d.items()))
        n = by["nproc"]["mean"]
        print("mean residual by rank count: " + ", ".join(f"{k} ranks {2 ** v:.2f}x" for k, v in n.items()))
        w = worst.iloc[0]
        print(f"largest miss: {w.model} {w.scheme} on mesh {w.mesh} ({w.nproc} ranks): predicted {w.pred_ms:.2f} ms, "
              f"measured {w.meas_ms:.2f} ms ({w.ratio:.2f}x); its prediction is dominated by {w.dominant} "
              f"({w[w.dominant + '_ms']:.2f} ms of {w.pred_ms:.2f}).")
        if not math.isnan(rho_comm):
            trend = "grows" if rho_comm > 0.3 else "shrinks" if rho_comm < -0.3 else "hardly changes"
            print(f"the measured/predicted ratio {trend} with the predicted communication share (Spearman {rho_comm:.2f}).")
        if not math.isnan(rho_load):
            trend = "grows" if rho_load > 0.3 else "shrinks" if rho_load < -0.3 else "hardly changes"
            print(f"it {trend} with the machine's load when the run was launched (Spearman {rho_load:.2f})"
                  + (": other processes on the same cores slow a run in a way no cost model of the plan can see."
                     if rho_load > 0.3 else "."))
        """),
        _md(r"""
        ## Numbers checked by `tests/test_notebooks.py`
        """),
        _code(r"""
        summary = {"study": STUDY, "runs": int(len(runs)), "overall_mape_pct": round(OVERALL_MAPE, 4),
                   "per_model_mape_pct": {m: round(float(v), 4) for m, v in per_model.MAPE_pct.items()}}
        print(f"notebook executed in {time.perf_counter() - T_START:.0f} s")
        print("SUMMARY " + json.dumps(summary))
        """),
    ]


# ---------------------------------------------------------------------------------------------
# 03: scaling
# ---------------------------------------------------------------------------------------------
def nb03():
    return [
        _md(r"""
        # 03 · Scaling: device count and inter-node bandwidth

        How the best plan for GPT-2 XL and its predicted throughput change

        1. from 8 to 1024 H100s (`h100-4x8.yaml` resized with `Cluster.resized`: 1 to 128 DGX H100 nodes of
           8 GPUs, 50 GB/s per GPU between nodes), and
        2. on the 32 GPUs of `h100-4x8` as the inter-node bandwidth per GPU drops from 50 GB/s (400 Gb/s
           InfiniBand) to 25, 12.5, 6.25 and 3.125 GB/s (25 Gb/s), via `dataclasses.replace` of the
           cluster's `inter_node` link.

        **Weak scaling.** Each GPU gets 2 sequences of 1024 tokens (GPT-2 XL's preset batch of 16 at 8 GPUs),
        so the global batch grows with the device count: 16 sequences (16 K tokens) at 8 GPUs, 2048 (2 M tokens)
        at 1024. With a fixed global batch the small counts do not fit in 80 GB or the large ones cannot split
        it. The model is traced at the first two batch sizes only: every shape, FLOP and byte count of its graph
        is affine in the batch, so the graph at each other batch is read off those two (`autoddl/rebatch.py`,
        checked against a trace by `tests/test_rebatch.py`).

        **Meshes searched (reduced for time).** A full search tries every 1-D and 2-D mesh (inner axis inside a
        node: inner size 2, 4 or 8). Here each device count N searches the 1-D mesh (N) — where `tp` and `sp`
        are built — the nodes × 8 mesh (N/8 × 8) — where `dp_tp` is built; `dp` and `zero3` exist on both — and,
        up to 32 GPUs, the N/2 × 2 mesh (8 GPUs: all three meshes 8, 2 × 4, 4 × 2). Left out: inner size 4 from
        16 GPUs on, inner size 2 from 64 on. When this notebook was written, a full search at 1024 GPUs put them
        far behind (256 × 4: 1682 ms, 512 × 2: 3215 ms per step against 962 ms on 128 × 8). The bandwidth sweep
        searches 4 × 8 and 16 × 2 only (the 1-D 32 mesh was the slowest at every bandwidth: 13 K to 121 K
        tokens/s against 97 K to 296 K on 4 × 8). With these cuts the notebook takes about 2 minutes of CPU
        time (2.5 to 3.5 minutes of wall time on 2 cores shared with other jobs: tracing and pricing plans).
        All numbers are cost-model predictions.

        Command-line equivalent of one point:

        ```
        autoddl compare examples/gpt.py --preset gpt2-xl --set batch_size=256 --cluster configs/h100-4x8.yaml --devices 128
        autoddl plan examples/gpt.py --preset gpt2-xl --set batch_size=2048 --cluster configs/h100-4x8.yaml --devices 1024 --mesh 128x8
        ```
        """),
        _code(SETUP, r"""
        import dataclasses

        from autoddl.api import schemes_frame, search_model
        from autoddl.cluster import Cluster
        from autoddl.loader import trace_model_file

        BASE = Cluster.from_yaml(ROOT / "configs" / "h100-4x8.yaml")
        SEQS_PER_DEVICE, SEQ_LEN = 2, 1024
        DEVICES = [8, 16, 32, 64, 128, 256, 512, 1024]
        INTER_GBPS = [50, 25, 12.5, 6.25, 3.125]
        BANDWIDTH_DEVICES, BANDWIDTH_MESHES = 32, [(4, 8), (16, 2)]


        def meshes_for(n, per_node=8):
            if n == per_node:
                return [(n,), (2, n // 2), (n // 2, 2)]
            return [(n,), (n // per_node, per_node)] + ([(n // 2, 2)] if n <= 32 else [])
        """, AXIS_ROLES),
        _md(r"""
        ## Device count: 8 to 1024 GPUs

        For each count: the graph at the count's global batch (traced, or read off the first two traces), search each mesh (`search_model(..., mesh=...)`,
        which also builds every baseline that applies on that mesh), and keep per mesh the found plan and the
        baselines. `search_s` is the planning time of that mesh.
        """),
        _code(r"""
        from autoddl.rebatch import at_batch
        from costmodel.collectives import cluster_collective_time_s


        def record(n, cluster, shape, scheme, graph, search_s=float("nan")):
            '''One row per costed scheme; latency_ms is what its collectives would take with zero bytes.'''
            bd = scheme.breakdown
            latency_s = sum(cluster_collective_time_s(c.kind, 0, shape, c.axis, cluster) for c in bd.collectives)
            return {"devices": n, "inter_gbps": cluster.inter_node.bandwidth_gbps, "mesh": "x".join(map(str, shape)),
                    "scheme": scheme.name, "step_ms": bd.step_time_s * 1e3, "compute_ms": bd.compute_s * 1e3,
                    "boxing_ms": (bd.boxing_forward_s + bd.boxing_backward_s) * 1e3, "grad_sync_ms": bd.grad_sync_s * 1e3,
                    "optimizer_ms": bd.optimizer_s * 1e3, "latency_ms": latency_s * 1e3,
                    "memory_gb": bd.memory_bytes_per_device / 1e9, "collectives": len(bd.collectives),
                    "grad_sync_collectives": sum(c.phase == "grad_sync" for c in bd.collectives),
                    "tokens": SEQS_PER_DEVICE * n * SEQ_LEN, "search_s": search_s,
                    "label": plan_label(graph, scheme.plan, cluster) if scheme.name == "found" else ""}


        graphs, records = {}, []
        for n in DEVICES:
            t0 = time.perf_counter()
            first = [(graphs[k], SEQS_PER_DEVICE * k) for k in list(graphs)[:2]]
            graph = at_batch(*first[0], *first[1], SEQS_PER_DEVICE * n) if len(first) == 2 else None
            if graph is None:                          # the first two batches (or a graph not affine in it): traced
                mf, graph = trace_model_file(ROOT / "examples/gpt.py", preset="gpt2-xl",
                                             batch_size=SEQS_PER_DEVICE * n, seq_len=SEQ_LEN)
            graphs[n] = graph
            trace_s = time.perf_counter() - t0
            cluster = BASE.resized(n)
            for shape in meshes_for(n):
                t1 = time.perf_counter()
                out = search_model(graph, cluster, mesh=shape)
                search_s = time.perf_counter() - t1
                records += [record(n, cluster, shape, s, graph, search_s) for s in out.schemes
                            if s.plan is not None and s.breakdown.fits_memory]
            print(f"{n:5d} GPUs: {'traced' if len(graphs) <= 2 else 'read off the first two traces'} in {trace_s:.1f} s, searched {len(meshes_for(n))} meshes in "
                  f"{time.perf_counter() - t0 - trace_s:.1f} s")
        runs = pd.DataFrame(records)
        runs["tokens_per_s"] = runs["tokens"] / (runs["step_ms"] / 1e3)
        """),
        _md(r"""
        ### The best plan at each device count

        `found` is the fastest found plan over the searched meshes; `baseline_*` the fastest expert scheme on
        any searched mesh (`dp` and `zero3` exist on 1-D and 2-D meshes, `tp` and `sp` on 1-D, `dp_tp` on 2-D). `efficiency` is tokens/s per GPU relative to 8 GPUs
        (1.0 = linear scaling). The label gives each mesh axis's role (outermost first) from the FLOP shares of
        the weight-reading ops: DP splits the batch, TP the weights, SP the sequence, `+ZeRO` when most
        parameter bytes are stored split on that axis while the weights are used whole.
        """),
        _code(r"""
        def best_per(df, keys):
            found = df[df.scheme == "found"].sort_values("step_ms").groupby(keys, sort=False).head(1)
            base = df[df.scheme != "found"].sort_values("step_ms").groupby(keys, sort=False).head(1)
            t = found.set_index(keys)[["mesh", "label", "step_ms", "tokens_per_s", "compute_ms", "boxing_ms",
                                       "grad_sync_ms", "optimizer_ms", "latency_ms", "memory_gb", "collectives"]]
            b = base.set_index(keys)[["scheme", "mesh", "step_ms", "tokens_per_s"]].add_prefix("baseline_")
            return t.join(b).sort_index()

        scaling = best_per(runs, ["devices"])
        scaling["tokens_per_s_per_gpu"] = scaling.tokens_per_s / scaling.index
        scaling["efficiency"] = scaling.tokens_per_s_per_gpu / scaling.tokens_per_s_per_gpu.iloc[0]
        scaling["x_baseline"] = scaling.baseline_step_ms / scaling.step_ms
        scaling.round(2)
        """),
        _code(r"""
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
        n = scaling.index.to_numpy()
        ax1.loglog(n, scaling.tokens_per_s, "o-", label="found plan")
        ax1.loglog(n, scaling.baseline_tokens_per_s, "s--", label="best baseline")
        ax1.loglog(n, scaling.tokens_per_s.iloc[0] * n / n[0], "k:", lw=0.8, label="linear from 8 GPUs")
        for i, (x, y, lab) in enumerate(zip(n, scaling.tokens_per_s, scaling.label)):
            ax1.annotate(lab, (x, y), textcoords="offset points", xytext=(-30, 10) if i % 2 else (6, -14), fontsize=7)
        ax1.set(xlabel="GPUs (H100, 8 per node)", ylabel="predicted tokens / s", title="GPT-2 XL, 2 x 1024 tokens per GPU")
        ax1.set_xticks(n, [str(v) for v in n])
        ax1.legend()
        parts = ["compute_ms", "boxing_ms", "grad_sync_ms", "optimizer_ms"]
        bottom = np.zeros(len(n))
        for c in parts:
            ax2.bar([str(v) for v in n], scaling[c], bottom=bottom, label=c.replace("_ms", ""))
            bottom += scaling[c].to_numpy()
        ax2.set(xlabel="GPUs", ylabel="predicted step time of the found plan (ms)", title="where the step goes")
        ax2.legend()
        fig.tight_layout()
        plt.show()
        """),
        _md(r"""
        ### Which mesh wins where

        Predicted tokens/s of the best plan found on each mesh shape (rows: device count; columns: the mesh's
        inner size, 1 for the 1-D mesh), relative to the best mesh at that count (1.0 = the winner; blank = not
        searched).
        """),
        _code(r"""
        f = runs[runs.scheme == "found"].copy()
        f["inner"] = f.mesh.map(lambda m: 1 if "x" not in m else int(m.split("x")[1]))
        grid = f.pivot_table(index="devices", columns="inner", values="tokens_per_s", aggfunc="max")
        rel = grid.div(grid.max(axis=1), axis=0)
        fig, ax = plt.subplots(figsize=(6, 5))
        im = ax.imshow(rel.to_numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(rel.columns)), [f"inner {c}" if c > 1 else "1-D" for c in rel.columns])
        ax.set_yticks(range(len(rel.index)), [str(v) for v in rel.index])
        for i in range(rel.shape[0]):
            for j in range(rel.shape[1]):
                v = rel.iat[i, j]
                if not np.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=9)
        ax.set(xlabel="mesh", ylabel="GPUs", title="tokens/s relative to the best mesh")
        fig.colorbar(im, ax=ax, shrink=0.8)
        plt.show()
        """),
        _md(r"""
        ## Inter-node bandwidth: 50 down to 3.125 GB/s per GPU on 32 GPUs

        The 32-GPU point of the sweep above (4 nodes, batch 64) re-planned with the `inter_node` link's
        bandwidth replaced; the intra-node NVLink (450 GB/s) is unchanged. 50 GB/s reuses the sweep's result.
        """),
        _code(r"""
        bw_records = [r for r in records if r["devices"] == BANDWIDTH_DEVICES
                      and r["mesh"] in {"x".join(map(str, m)) for m in BANDWIDTH_MESHES}]
        graph = graphs[BANDWIDTH_DEVICES]
        t0 = time.perf_counter()
        for gbps in INTER_GBPS:
            if gbps == BASE.inter_node.bandwidth_gbps:
                continue
            cluster = dataclasses.replace(BASE.resized(BANDWIDTH_DEVICES), name=f"h100-4x8 inter {gbps:g} GB/s",
                                          inter_node=dataclasses.replace(BASE.inter_node, bandwidth_gbps=gbps))
            for shape in BANDWIDTH_MESHES:
                out = search_model(graph, cluster, mesh=shape)
                bw_records += [record(BANDWIDTH_DEVICES, cluster, shape, s, graph) for s in out.schemes
                               if s.plan is not None and s.breakdown.fits_memory]
        print(f"{len(INTER_GBPS) - 1} bandwidths x {len(BANDWIDTH_MESHES)} meshes searched in "
              f"{time.perf_counter() - t0:.1f} s")
        bw_runs = pd.DataFrame(bw_records)
        bw_runs["tokens_per_s"] = bw_runs["tokens"] / (bw_runs["step_ms"] / 1e3)
        bandwidth = best_per(bw_runs, ["inter_gbps"]).sort_index(ascending=False)
        bandwidth["x_baseline"] = bandwidth.baseline_step_ms / bandwidth.step_ms
        bandwidth.round(2)
        """),
        _code(r"""
        fig, ax = plt.subplots(figsize=(8, 4.8))
        fb = bw_runs[bw_runs.scheme == "found"]
        for mesh, g in fb.groupby("mesh", sort=False):
            g = g.sort_values("inter_gbps")
            ax.plot(g.inter_gbps, g.tokens_per_s, "o-", label=f"found on {mesh}")
        ax.plot(bandwidth.index, bandwidth.baseline_tokens_per_s, "kx--", lw=0.8, label="best baseline (any mesh)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(INTER_GBPS, [f"{v:g}" for v in INTER_GBPS])
        ax.set(xlabel="inter-node bandwidth per GPU (GB/s)", ylabel="predicted tokens / s",
               title=f"GPT-2 XL on {BANDWIDTH_DEVICES} H100s (4 nodes)")
        ax.legend(fontsize=8)
        plt.show()
        """),
        _md(r"""
        ## Where pipeline stages start to win: devices x model size x inter-node bandwidth

        GPT-3 shapes (Brown et al. 2020, Table 2.1; 13B with d_model 5120, the table's 5140 does not split
        into its 40 heads of 128; 1.3B with 16 heads of 128) at sequence 2048, global batch 1536 (Megatron-LM's
        GPT-3 175B run, Narayanan et al. 2021), bf16, full recompute, micro-batch size 1, on 64, 256 and 1024
        H100s (`h100-4x8` resized) with 50, 12.5 and 3.125 GB/s per GPU between nodes. For each point the
        3-D search's fast estimate (`search/pipeline_search.py`: the tp plan of one stage simulated once per
        block, stages balanced, the schedule's makespan, the data-parallel sync and optimizer after it) of
        every pp x (dp | fsdp) x tp that fits in 80 GB, with `min_pp=1` so that the plans without stages
        (pp = 1: the same estimate with one stage) compete too. The chart shows the best unstaged plan's
        step time over the best staged one's: above 1, pipeline stages win. These are the search's
        estimates, not the full cost model's prices (pricing every point in full would take tens of
        minutes: GPT-3 175B's plan alone takes about a minute).

        Command-line equivalent of one staged point (the 3-D search, then the full price of its best):

        ```
        autoddl plan examples/gpt.py --preset gpt3-175b --cluster configs/h100-4x8.yaml --devices 1024 \
            --pipeline --no-search --precision bf16 --recompute full --global-batch-size 1536 --micro-batch-size 1
        ```
        """),
        _code(r"""
        from autoddl.loader import load_model_file
        from autoddl.training import Training
        from search.pipeline_search import search_3d
        from search.planner import inner_tp_plan

        PP_SIZES = {"1.3B": dict(n_layer=24, n_embd=2048, n_head=16), "13B": dict(n_layer=40, n_embd=5120, n_head=40),
                    "175B": dict(n_layer=96, n_embd=12288, n_head=96)}
        PP_DEVICES, PP_GBPS, PP_BATCH = [64, 256, 1024], [50, 12.5, 3.125], 1536
        training = Training(param_dtype="bf16", recompute="full")
        pp_rows = []
        t0 = time.perf_counter()
        for size, dims in PP_SIZES.items():
            graph = load_model_file(ROOT / "examples/gpt.py", preset="gpt3-175b", **dims).with_batch_size(1).trace("bfloat16")
            costs = {}                                  # block costs per tp: shared by every device count and link
            for gbps in PP_GBPS:
                for n in PP_DEVICES:
                    base = BASE.resized(n)
                    cluster = dataclasses.replace(base, inter_node=dataclasses.replace(base.inter_node, bandwidth_gbps=gbps))
                    est = search_3d(lambda batch, g=graph: g, lambda g, tp, tr, c=cluster: inner_tp_plan(g, c, tp, tr),
                                    cluster, training, PP_BATCH, cluster.device.memory_gb * 1e9, (1,), min_pp=1,
                                    block_cache=costs)
                    fit = [e for e in est if e.memory_bytes <= cluster.device.memory_gb * 1e9]
                    staged = min((e for e in fit if e.degrees[0][1] > 1), key=lambda e: e.step_time_s, default=None)
                    flat = min((e for e in fit if e.degrees[0][1] == 1), key=lambda e: e.step_time_s, default=None)
                    pp_rows.append({"size": size, "devices": n, "inter_gbps": gbps,
                                    "staged_s": staged.step_time_s if staged else np.nan,
                                    "staged": staged.text if staged else "nothing fits",
                                    "unstaged_s": flat.step_time_s if flat else np.nan,
                                    "unstaged": flat.text if flat else "nothing fits"})
            print(f"GPT-3 {size}: {graph.parameter_count / 1e9:.1f}B parameters, estimated at {len(PP_DEVICES) * len(PP_GBPS)} "
                  f"points ({time.perf_counter() - t0:.0f} s so far)")
        pipes = pd.DataFrame(pp_rows)
        pipes["stages_win_x"] = pipes.unstaged_s / pipes.staged_s
        pipes[["size", "devices", "inter_gbps", "unstaged_s", "staged_s", "stages_win_x", "staged", "unstaged"]].round(3)
        """),
        _code(r"""
        fig, axes = plt.subplots(1, len(PP_GBPS), figsize=(15, 4.5), sharey=True)
        for ax, gbps in zip(axes, PP_GBPS):
            for size in PP_SIZES:
                g = pipes[(pipes.inter_gbps == gbps) & (pipes["size"] == size)].sort_values("devices")
                ax.plot(g.devices, g.stages_win_x, "o-", label=f"GPT-3 {size}")
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(PP_DEVICES, [str(v) for v in PP_DEVICES])
            ax.set(xlabel="H100s (8 per node)", title=f"{gbps:g} GB/s per GPU between nodes")
        axes[0].set_ylabel("best unstaged / best staged step time\n(> 1: pipeline stages win)")
        axes[0].legend()
        fig.tight_layout()
        plt.show()
        """),
        _md(r"""
        ## Conclusions (computed)

        The lines below are generated from the tables above, so they stay true when the cost model or the
        configs change and the notebook is re-executed.
        """),
        _code(r"""
        s = scaling
        print(f"1. Throughput: {s.tokens_per_s.iloc[0]:,.0f} tokens/s on {s.index[0]} GPUs -> "
              f"{s.tokens_per_s.iloc[-1]:,.0f} on {s.index[-1]} ({s.tokens_per_s.iloc[-1] / s.tokens_per_s.iloc[0]:.1f}x for "
              f"{s.index[-1] // s.index[0]}x the GPUs; efficiency per GPU {s.efficiency.iloc[-1]:.2f}).")
        drop = s[s.efficiency < 0.8]
        if len(drop):
            nodes = BASE.resized(int(drop.index[0])).nodes
            print(f"   Per-GPU efficiency first falls below 0.8 at {drop.index[0]} GPUs ({drop.efficiency.iloc[0]:.2f}), "
                  f"{nodes} node{'s' if nodes > 1 else ''}: the step time goes {s.step_ms.iloc[0]:.0f} -> "
                  f"{drop.step_ms.iloc[0]:.0f} ms, the outer mesh axis now crossing the "
                  f"{BASE.inter_node.bandwidth_gbps:g} GB/s inter-node link instead of "
                  f"{BASE.intra_node.bandwidth_gbps:g} GB/s NVLink.")
        comm = (s.boxing_ms + s.grad_sync_ms) / s.step_ms
        print(f"2. Communication share of the found plan's step: {comm.iloc[0]:.0%} at {s.index[0]} GPUs, "
              f"{comm.iloc[-1]:.0%} at {s.index[-1]}; compute stays {s.compute_ms.min():.0f}-{s.compute_ms.max():.0f} ms "
              f"(weak scaling: same work per GPU).")
        changes = [f"{n}: {lab}" for n, lab, prev in zip(s.index, s.label, [None] + list(s.label[:-1])) if lab != prev]
        print("3. Found plan (mesh [axis roles]) where it changes: " + "; ".join(changes))
        print(f"4. Found plan vs best baseline: {s.x_baseline.min():.2f}x to {s.x_baseline.max():.2f}x faster "
              f"(best baseline: " + ", ".join(f"{n} {b}" for n, b in zip(s.index, s.baseline_scheme)) + ").")
        N = s.index[-1]
        comm_ms = s.boxing_ms.iloc[-1] + s.grad_sync_ms.iloc[-1]
        print(f"5. Latency: at {N} GPUs the found plan's {comm_ms:,.0f} ms of communication include "
              f"{s.latency_ms.iloc[-1]:,.0f} ms that its {s.collectives.iloc[-1]} collectives would take with zero bytes "
              f"(at {s.index[0]} GPUs: {s.latency_ms.iloc[0]:,.0f} of {s.boxing_ms.iloc[0] + s.grad_sync_ms.iloc[0]:,.0f} ms).")
        one_d = runs[(runs.devices == N) & (runs.mesh == str(N)) & (runs.scheme == "found")]
        if len(one_d) and one_d.iloc[0].grad_sync_collectives:
            r = one_d.iloc[0]
            n_params = len(graphs[N].parameters())
            print(f"   On the 1-D {N}-GPU mesh the best plan takes {r.step_ms:,.0f} ms, {r.latency_ms:,.0f} ms of it latency: "
                  f"{r.grad_sync_collectives} gradient-sync collectives for {n_params} parameter tensors (the cost "
                  f"model syncs each tensor on its own, no bucketing), each paying (n-1) or 2(n-1) link latencies on a ring of {N}.")
        b = bandwidth
        print(f"6. Inter-node bandwidth {b.index[0]:g} -> {b.index[-1]:g} GB/s on {BANDWIDTH_DEVICES} GPUs: found plan "
              f"{b.tokens_per_s.iloc[0]:,.0f} -> {b.tokens_per_s.iloc[-1]:,.0f} tokens/s "
              f"({b.tokens_per_s.iloc[-1] / b.tokens_per_s.iloc[0]:.2f}x), best baseline "
              f"{b.baseline_tokens_per_s.iloc[0]:,.0f} -> {b.baseline_tokens_per_s.iloc[-1]:,.0f} "
              f"({b.baseline_tokens_per_s.iloc[-1] / b.baseline_tokens_per_s.iloc[0]:.2f}x).")
        print("   Found plan per bandwidth: " + "; ".join(f"{g:g} GB/s {lab}" for g, lab in zip(b.index, b.label)))
        wins = pipes[pipes.stages_win_x > 1]
        for size in PP_SIZES:
            w = wins[wins["size"] == size]
            where = ", ".join(f"{n} GPUs at {g:g} GB/s ({x:.2f}x)" for n, g, x in zip(w.devices, w.inter_gbps, w.stages_win_x))
            print(f"7. GPT-3 {size}: pipeline stages win " + (f"at {where}" if len(w) else "nowhere on this grid")
                  + f" (of {len(PP_DEVICES) * len(PP_GBPS)} points).")
        """),
        _md(r"""
        ## Numbers checked by `tests/test_notebooks.py`
        """),
        _code(r"""
        summary = {"devices": {str(n): {"found_ms": round(float(r.step_ms), 4), "baseline_ms": round(float(r.baseline_step_ms), 4),
                                        "tokens_per_s": round(float(r.tokens_per_s), 1), "mesh": r.mesh}
                               for n, r in scaling.iterrows()},
                   "bandwidth": {f"{g:g}": {"found_ms": round(float(r.step_ms), 4), "baseline_ms": round(float(r.baseline_step_ms), 4)}
                                 for g, r in bandwidth.iterrows()},
                   "seqs_per_device": SEQS_PER_DEVICE, "seq_len": SEQ_LEN,
                   "pipeline": [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
                                for r in pipes.drop(columns="stages_win_x").to_dict("records")]}
        print(f"notebook executed in {time.perf_counter() - T_START:.0f} s")
        print("SUMMARY " + json.dumps(summary))
        """),
    ]

# ---------------------------------------------------------------------------------------------
# 04: many models on one cluster (Hydra's shard scheduling)
# ---------------------------------------------------------------------------------------------
def nb04():
    return [
        _md(r"""
        # 04 · Many models on one cluster: sharded-LRTF

        A sweep trains many variants of a model. Run one after another, each with its best plan on all
        devices, the devices wait on each model's sequential work; Hydra (Nagrecha & Kumar 2021) cuts every
        model into *shards* (contiguous groups of layers) and gives each free device the next shard task of the
        job with the longest remaining time (sharded-LRTF). `autoddl schedule` does this on the op graph
        (README, "Many models on one cluster"). This notebook compares, for two sweeps,

        - **sharded-LRTF**: every shard task scheduled on the devices (with or without prefetch, the shorter);
        - **sequential**: one model at a time on all devices, each with the planner's best plan;
        - **one per device**: each model alone on one device, longest first onto the least loaded device.

        1. **Measured here**: 8 small GPT variants (`examples/gpt.py` at the tiny preset with other widths,
           depths and learning rates; 2 shards each, 3 SGD steps) on 2 and on 4 gloo ranks of this 2-core
           machine (`configs/local-cpu.yaml`; 4 ranks share the 2 cores, which the prediction accounts for). Each
           run checks that every rank ran exactly its tasks of the schedule, in order, and that every job's
           losses equal the job trained alone in one process.
        2. **Predicted**: 8 GPT-2 variants (6 or 12 layers, 512 to 1024 wide, batch 8 x 1024 tokens, 200 steps)
           on one DGX A100 (`configs/dgx-a100-8.yaml`) and on 4 of its GPUs.

        Command-line equivalent of one run: `autoddl schedule examples/sweep.yaml --cluster configs/local-cpu.yaml --devices 2 --run`.
        """),
        _code(SETUP, r"""
        import os
        import tempfile

        import yaml
        from IPython.display import Image, display

        from autoddl.charts import gantt_chart
        from autoddl.cluster import Cluster
        from autoddl.scheduling import job_rows, plan_sweep
        from autoddl.scheduling_run import run_sweep

        GPT = str(ROOT / "examples" / "gpt.py")
        WORK = Path(tempfile.mkdtemp(prefix="autoddl-nb04-"))


        def write_jobs(name, jobs):
            path = WORK / f"{name}.yaml"
            path.write_text(yaml.safe_dump({"jobs": jobs}, sort_keys=False))
            return path


        def makespans(label, sweep, run=None):
            lrtf = sweep.schedule.makespan_s
            row = {"sweep": label, "devices": sweep.cluster.num_devices, "lrtf_s": lrtf,
                   "prefetch": sweep.prefetch, "busy": sweep.schedule.busy_fraction(),
                   "sequential_s": sweep.sequential.makespan_s, "one_per_device_s": sweep.one_per_device.makespan_s,
                   "sequential_over_lrtf": sweep.sequential.makespan_s / lrtf,
                   "one_per_device_over_lrtf": (sweep.one_per_device.makespan_s / lrtf
                                                if sweep.one_per_device.makespan_s is not None else float("nan"))}
            if run is not None:
                row.update({"measured_lrtf_s": run.measured_makespan_s,
                            "measured_over_predicted": run.measured_makespan_s / lrtf,
                            "loss_max_rel_error": run.max_rel_error, "load_avg_1m": run.load_avg_1m})
            return row


        def show_gantt(label, sweep):
            path = WORK / f"{label}.png"
            gantt_chart(sweep.schedule.tasks, sweep.names, sweep.cluster.num_devices,
                        f"{label}: sharded-LRTF, predicted makespan {sweep.schedule.makespan_s * 1e3:.1f} ms", str(path))
            display(Image(filename=str(path)))
        """),
        _md(r"""
        ## 1. Eight small GPTs on 2 and 4 ranks of this machine (measured)
        """),
        _code(r"""
        VARIANTS = [(64, 2, 0.01), (64, 3, 0.02), (96, 2, 0.01), (96, 3, 0.005),
                    (128, 2, 0.01), (128, 3, 0.02), (64, 4, 0.01), (96, 4, 0.005)]
        small = write_jobs("small", [
            {"name": f"w{w}-l{l}-lr{lr:g}", "model": GPT, "args": {"preset": "tiny", "n_embd": w, "n_layer": l},
             "steps": 3, "lr": lr, "seed": i, "shards": 2} for i, (w, l, lr) in enumerate(VARIANTS)])
        LOCAL = Cluster.from_yaml(ROOT / "configs" / "local-cpu.yaml")
        measured, small_sweeps = [], {}
        for n in (2, 4):
            sweep = plan_sweep(small, LOCAL, n, progress=lambda _msg: None)
            run = run_sweep(sweep)
            small_sweeps[n] = sweep
            measured.append(makespans(f"8 tiny GPTs on {n} ranks", sweep, run))
        measured = pd.DataFrame(measured).set_index("sweep")
        measured
        """),
        _code(r"""
        pd.DataFrame(job_rows(small_sweeps[2])).set_index("job")
        """),
        _code(r"""
        for n, sweep in small_sweeps.items():
            show_gantt(f"8 tiny GPTs on {n} ranks", sweep)
        """),
        _md(r"""
        ## 2. Eight GPT-2 variants on one DGX A100 (predicted)

        Each variant fits one 80 GB A100, so each job is one shard (the fewest that fit) and its tasks run one
        after another: with as many jobs as GPUs, no schedule of whole jobs ends before the longest job alone on
        one GPU, while `sequential` gives every job all 8 GPUs with its best plan. The same 8 jobs are also
        scheduled on 4 of the GPUs (`Cluster.resized(4)`), where two jobs share each GPU.
        """),
        _code(r"""
        DGX = Cluster.from_yaml(ROOT / "configs" / "dgx-a100-8.yaml")
        GPT2 = [(12, 768), (12, 1024), (6, 768), (6, 1024), (12, 512), (6, 512), (12, 640), (6, 640)]
        gpt2 = write_jobs("gpt2", [
            {"name": f"gpt2-l{l}-w{w}", "model": GPT,
             "args": {"preset": "gpt2-small", "n_layer": l, "n_embd": w, "n_head": 8, "batch_size": 8},
             "steps": 200, "lr": 1e-3, "seed": i} for i, (l, w) in enumerate(GPT2)])
        big_rows, big_sweeps = [], {}
        for n in (8, 4):
            sweep = plan_sweep(gpt2, DGX, n, progress=lambda _msg: None)
            big_sweeps[n] = sweep
            big_rows.append(makespans(f"8 GPT-2 variants on {n} A100s", sweep))
        big = pd.DataFrame(big_rows).set_index("sweep")
        big
        """),
        _code(r"""
        print("shards per job:", [j.shards for j in big_sweeps[8].jobs])
        pd.DataFrame(job_rows(big_sweeps[8])).set_index("job")
        """),
        _code(r"""
        for n, sweep in big_sweeps.items():
            show_gantt(f"8 GPT-2 variants on {n} A100s", sweep)
        """),
        _md(r"""
        ## What the numbers say

        The measured makespans were taken while other jobs loaded this machine's 2 cores (the `load_avg_1m`
        column). The kernel shares the cores per process, so 4 ranks get a larger share of them than 2 and can
        finish sooner despite sharing the cores among themselves: the measured / predicted ratios here say how
        loaded the machine was, not how good the prediction is. What the runs do show exactly: every rank ran
        the tasks the schedule gave its device, in order, and every job's losses equal the job trained alone.
        """),
        _code(r"""
        for label, r in pd.concat([measured, big]).iterrows():
            line = (f"{label}: sharded-LRTF {r.lrtf_s * 1e3:,.1f} ms predicted (devices busy {r.busy:.0%}); sequential "
                    f"{r.sequential_over_lrtf:.2f}x it, one per device {r.one_per_device_over_lrtf:.2f}x it")
            if "measured_lrtf_s" in r and not math.isnan(r.get("measured_lrtf_s", float("nan"))):
                line += (f"; measured {r.measured_lrtf_s * 1e3:,.1f} ms ({r.measured_over_predicted:.2f}x the prediction, "
                         f"load {r.load_avg_1m:.1f}), losses within {r.loss_max_rel_error:.1e} of each job alone")
            print(line)
        """),
        _md(r"""
        ## Numbers checked by `tests/test_notebooks.py`
        """),
        _code(r"""
        def plain(row):
            out = {}
            for k, v in row.items():
                v = v.item() if hasattr(v, "item") else v
                out[k] = None if isinstance(v, float) and math.isnan(v) else round(v, 6) if isinstance(v, float) else v
            return out

        summary = {"measured": {str(n): plain(r) for n, (_, r) in zip((2, 4), measured.iterrows())},
                   "predicted": {str(n): plain(r) for n, (_, r) in zip((8, 4), big.iterrows())}}
        print(f"notebook executed in {time.perf_counter() - T_START:.0f} s")
        print("SUMMARY " + json.dumps(summary))
        """),
    ]


NOTEBOOKS = {"01": ("01_compare_schemes.ipynb", nb01), "02": ("02_measured_vs_predicted.ipynb", nb02),
             "03": ("03_scaling.ipynb", nb03), "04": ("04_multi_model.ipynb", nb04)}


def build(key: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[key][1]())
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path = HERE, timeout_s: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell of ``nb`` in a fresh ``python3`` kernel (headless, this environment's ipykernel,
    the kernel inheriting this process's environment variables); raises CellExecutionError on the first error."""
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    return client.execute()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", nargs="*", default=list(NOTEBOOKS), help="notebooks to write: 01 02 03 04 (default: all)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--execute", action="store_true", help="also execute them, keeping the outputs")
    g.add_argument("--execute-only", action="store_true", help="execute the existing files in place, do not rebuild")
    g.add_argument("--markdown-only", action="store_true",
                   help="copy the markdown cells into the existing files, keeping their outputs (code must be unchanged)")
    args = p.parse_args(argv)
    bad = [w for w in args.which if w not in NOTEBOOKS]
    if bad:
        p.error(f"unknown notebook(s) {bad}; choose from {', '.join(NOTEBOOKS)}")
    for key in args.which:
        path = HERE / NOTEBOOKS[key][0]
        nb = nbformat.read(path, as_version=4) if args.execute_only or args.markdown_only else build(key)
        if args.markdown_only:
            fresh = build(key)
            if [(c.cell_type, c.source) for c in nb.cells if c.cell_type == "code"] != \
                    [(c.cell_type, c.source) for c in fresh.cells if c.cell_type == "code"] or len(nb.cells) != len(fresh.cells):
                raise SystemExit(f"{path.name}: its code cells changed; rebuild and execute it: --execute {key}")
            for old, new in zip(nb.cells, fresh.cells):
                old.source = new.source
        if args.execute or args.execute_only:
            t0 = time.perf_counter()
            execute(nb)
            print(f"{path.name}: executed in {time.perf_counter() - t0:.0f} s")
        nbformat.validate(nb)
        nbformat.write(nb, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
