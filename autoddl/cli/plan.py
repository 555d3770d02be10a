"""``autoddl plan``, ``autoddl compare`` and ``autoddl explain``: the planner on the command line."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time

import numpy as np

from autoddl.api import schemes_frame, search_model
from autoddl.cli import EXPECTED_ERRORS, add_model_options, common_options, model_overrides, register, table
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Cluster
from autoddl.graph import NodeKind
from autoddl.loader import load_model_file, trace_model_file
from autoddl.ops import coverage_report
from autoddl.plan import Mesh, Plan
from autoddl.trace import trace
from search.planner import SCHEMES, resolve_cluster
from search.problem import NoFeasiblePlanError

EXPECTED_ERRORS.append(NoFeasiblePlanError)


def _add_search_options(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--cluster", metavar="YAML", default=str(DEFAULT_CLUSTER_PATH),
                   help=f"cluster description (default: the bundled {DEFAULT_CLUSTER_PATH.name})")
    p.add_argument("--devices", type=int, metavar="N", help="plan for N devices of the cluster's kind")
    p.add_argument("--mesh", metavar="AxB", help="search only this mesh shape, e.g. 2x4")
    p.add_argument("--memory-gb", type=float, metavar="X", help="per-device memory limit (default: the device's)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))


def _search(args: argparse.Namespace, progress):
    t0 = time.perf_counter()
    overrides = model_overrides(args)
    mf, graph = trace_model_file(args.model_py, **overrides)
    trace_s = time.perf_counter() - t0
    cluster = Cluster.from_yaml(args.cluster)
    mesh = Mesh.parse(args.mesh).shape if args.mesh else None
    outcome = search_model(graph, cluster, devices=args.devices, mesh=mesh, memory_gb=args.memory_gb,
                           optimizer=args.optimizer, progress=progress)
    for scheme in outcome.schemes:
        if scheme.plan is not None:
            scheme.plan.set_provenance(model_file=mf.path, model_args=overrides, cluster_file=args.cluster)
    return mf, graph, cluster, outcome, trace_s


def _print_schemes(outcome) -> None:
    df = schemes_frame(outcome)
    rows, skipped = [], []
    for r in df.to_dict("records"):
        if not r["applicable"]:
            skipped.append(f"{r['scheme']}: not applicable: {r['reason']}")
            continue
        rows.append((r["scheme"], r["mesh"], f"{r['step_ms']:.3f}", f"{r['compute_ms']:.3f}",
                     f"{r['boxing_fwd_ms'] + r['boxing_bwd_ms']:.3f}", f"{r['grad_sync_ms']:.3f}",
                     f"{r['optimizer_ms']:.3f}", f"{r['memory_gb']:.3f}", "yes" if r["fits_memory"] else "NO"))
    print(table(("scheme", "mesh", "step ms", "compute ms", "boxing ms", "grad sync ms", "optimizer ms",
                  "memory GB", "fits"), rows))
    for line in skipped:
        print(line)


@register
def add_plan(subparsers) -> None:
    p = subparsers.add_parser("plan", parents=[common_options()], help="find the fastest SBP plan for a model",
                              description="Trace MODEL_PY, search SBP signatures on every mesh shape, and "
                                          "print the found plan next to every expert baseline.")
    _add_search_options(p)
    p.add_argument("--out", default="plan.json", metavar="PLAN_JSON", help="where to write the plan")
    p.add_argument("--scheme", default="found", choices=SCHEMES,
                   help="which plan to write: found (default) or a baseline")
    p.add_argument("--verbose", action="store_true", help="print the per-op table of the found plan")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    mf, graph, cluster, outcome, trace_s = _search(args, progress=lambda m: print("  " + m, file=sys.stderr))
    found, bd = outcome.found, outcome.found_breakdown
    print(f"model:    {mf.name} ({mf.path}) {graph.parameter_count / 1e6:,.1f}M parameters, "
          f"{len(graph.ops())} ops, traced in {trace_s:.2f} s")
    planned = resolve_cluster(cluster, args.devices)
    print(f"cluster:  {cluster.summary()}")
    if planned.num_devices != cluster.num_devices:
        print(f"planned:  {planned.nodes}x{planned.devices_per_node} of {cluster.name} (--devices {args.devices})")
    print(f"searched: meshes {', '.join('x'.join(map(str, m)) for m in outcome.meshes)} "
          f"in {outcome.search_s:.2f} s")
    print()
    _print_schemes(outcome)
    print()
    best = outcome.best_baseline
    line = f"found plan: mesh {found.mesh}, predicted {bd.step_time_s * 1e3:.3f} ms per step, " \
           f"{bd.memory_bytes_per_device / 1e9:.3f} GB per device"
    if best is not None:
        line += f"; {best.step_time_s / bd.step_time_s:.2f}x the speed of the best baseline " \
                f"({best.name}, {best.step_time_s * 1e3:.3f} ms)"
    print(line)
    for note in found.notes:
        print(f"note: {note}")
    for line in coverage_report(graph).lines():
        print(f"warning: {line}")
    chosen = next((s for s in outcome.schemes if s.name == args.scheme), None)
    if chosen is None or chosen.plan is None:
        why = chosen.reason if chosen is not None else "no such scheme"
        raise ValueError(f"--scheme {args.scheme}: {why}; choose one of "
                         f"{', '.join(s.name for s in outcome.schemes if s.plan is not None)}")
    if args.verbose:
        print()
        print(chosen.plan.summary().to_string(index=False))
    chosen.plan.save(args.out)
    print(f"wrote {args.out} ({chosen.name} plan)")
    _print_next(args.out, chosen.plan, resolve_cluster(cluster, args.devices))
    return 0


def _print_next(path: str, plan: Plan, cluster: Cluster) -> None:
    """What to run next with the plan just written."""
    backend = "" if cluster.backend.value == "nccl" else " --backend gloo"
    print("next:")
    print(f"  autoddl explain {path}                          # why each op got its signature")
    print(f"  autoddl explain {path} --trace predicted.json   # the simulated step (open in ui.perfetto.dev)")
    ranks = f"--nproc {plan.devices}"
    if plan.devices > cluster.devices_per_node:   # one `autoddl run` per node
        ranks = (f"--nproc {cluster.devices_per_node} --nnodes {plan.devices // cluster.devices_per_node} "
                 "--node-rank R --master-addr NODE0 --master-port 29500")
    print(f"  autoddl run {path} {ranks}{backend} --check --reference ddp   # run it, check it, time it beside DDP")


@register
def add_compare(subparsers) -> None:
    p = subparsers.add_parser("compare", parents=[common_options()],
                              help="every scheme's predicted breakdown, as a table and a chart")
    _add_search_options(p)
    p.add_argument("--plot", metavar="PNG", help="write a stacked bar chart of the breakdowns")
    p.add_argument("--csv", metavar="CSV", help="write the table as CSV")
    p.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    mf, graph, cluster, outcome, _ = _search(args, progress=None)
    print(f"{mf.name} on {cluster.name}:")
    _print_schemes(outcome)
    df = schemes_frame(outcome)
    if args.csv:
        df.to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    if args.plot:
        from autoddl.charts import breakdown_chart

        breakdown_chart(df, f"{mf.name} on {cluster.name}", args.plot)
        print(f"wrote {args.plot}")
    return 0


@register
def add_explain(subparsers) -> None:
    p = subparsers.add_parser("explain", parents=[common_options()],
                              help="why each op got its signature, and which collectives the plan inserts")
    p.add_argument("plan_json", metavar="PLAN_JSON")
    p.add_argument("--op", metavar="NAME", help="explain only the ops matching NAME: an op name (linear_3), a module "
                   "path (transformer.h.0.mlp) or a parameter name (transformer.h.0.mlp.c_fc.weight)")
    p.add_argument("--wide", action="store_true", help="every cell in full (default: fit a 100-column terminal)")
    p.add_argument("--trace", metavar="JSON", help="write the simulated step as a Chrome-trace / Perfetto JSON "
                   "(one track per stream per rank; open it in ui.perfetto.dev or chrome://tracing)")
    p.set_defaults(func=run_explain)


ROLE_WORDS = {"dp": "data parallel", "fsdp": "ZeRO-3 / FSDP", "tp": "tensor parallel", "sp": "sequence parallel",
              "rep": "replicated"}
NARROW = {"op": 16, "signature": 30, "runner-up": 10, "weight layouts": 18, "collectives": 18}  # 100 wide
SHORT_PHASE = {"forward": "fwd", "backward": "bwd", "grad_sync": "sync", "optimizer": "opt"}
SHORT_KIND = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "broadcast": "BC"}


def plan_in_words(plan: Plan) -> str:
    """``data parallel over 2, tensor parallel over 4``: the mesh axes by role."""
    return ", ".join(f"{ROLE_WORDS.get(name.rstrip('0123456789'), name)} over {n}"
                     for name, n in zip(plan.mesh.axis_names, plan.mesh.shape))


def run_explain(args: argparse.Namespace) -> int:
    from autoddl.program import lower
    from search.formulate import formulate

    plan = Plan.load(args.plan_json)
    mf, graph = _traced_for(plan, args.plan_json)
    cluster = Cluster.from_yaml(plan.cluster_file or DEFAULT_CLUSTER_PATH).resized(plan.mesh.size)
    form = formulate(graph, cluster, plan.mesh.shape, optimizer=plan.optimizer)
    picked = [i for i, n in enumerate(form.nodes) if n.kind is NodeKind.OP and (not args.op or _matches(n, args.op))]
    if args.op and not picked:
        raise ValueError(f"--op {args.op}: no op, module path or parameter of {mf.name} is called that; see "
                         f"`autoddl trace {plan.model}` for the op names and module paths")
    program = lower(graph, plan)
    rows = _explain_rows(form, _assignment_of(plan, form), picked, plan, graph, program, wide=args.wide)
    width = None if args.wide else 100
    say = print if args.wide else (lambda text: print(textwrap.fill(text, width)))
    say(f"{plan_in_words(plan)}: {plan} ({plan.devices} devices, cluster {cluster.name})")
    if plan.cost is not None:
        c = plan.cost
        say(f"predicted step {c.step_time_s * 1e3:.3f} ms: compute {c.compute_s * 1e3:.3f}, communication "
            f"{c.comm_s * 1e3:.3f} of which {c.exposed_comm_s * 1e3:.3f} not overlapped, optimizer "
            f"{c.optimizer_s * 1e3:.3f}; {c.memory_bytes_per_device / 1e9:.3f} GB per device")
    header = tuple(NARROW)       # weight layouts: each parameter's storage -> the layout the op uses it in
    print(table(header, [tuple(_clip(c, NARROW[h], args.wide) for h, c in zip(header, r)) for r in rows],
                numeric=(2,)))
    if not args.wide:
        print("(cells cut to fit 100 columns: --wide shows them whole)")
    if args.trace:
        _write_trace(args.trace, graph, plan, program, cluster)
    return 0


def _traced_for(plan: Plan, path: str):
    """The model file the plan was made for, traced; refuses a graph the plan was not made for."""
    if not plan.model:
        raise ValueError(f"{path}: the plan names no model file; re-run `autoddl plan MODEL_PY`")
    mf = load_model_file(plan.model, **plan.model_args)
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn, name=mf.name)
    if graph.fingerprint() != plan.graph_hash:
        raise ValueError(f"{path} was made for another graph of {plan.model} (hash {plan.graph_hash}, "
                         f"now {graph.fingerprint()}); re-run `autoddl plan`")
    return mf, graph


def _matches(node, name: str) -> bool:
    """``name`` is the op, its module (or a module above it) or one of the parameters it reads."""
    path = node.module_path
    return name == node.name or name in node.params or path == name or path.startswith(name + ".")


def _explain_rows(form, assignment: np.ndarray, picked: list[int], plan: Plan, graph, program,
                  wide: bool) -> list[tuple[str, ...]]:
    by_op: dict[str, list[str]] = {}
    for t in program.collectives():
        text = (f"{t.phase} {t.collective.value} axis {t.axis} {t.nbytes / 1e6:.3f} MB ({t.tensor})" if wide
                else f"{SHORT_PHASE[t.phase]} {SHORT_KIND[t.collective.value]} {t.nbytes / 1e6:.2f}MB")
        by_op.setdefault(t.op, []).append(text)
    rows = []
    for i in picked:
        node = form.nodes[i]
        local = _local_costs(form, assignment, i)
        chosen = assignment[i]
        runner = next((int(j) for j in np.argsort(local) if j != chosen), None)
        extra = f"+{(local[runner] - local[chosen]) * 1e6:.1f} us" if runner is not None else "only"
        sig = form.problem.choices[i][chosen]
        weights = [f"{graph[r.node].target}: {plan.param_storage[graph[r.node].target]} -> {sig.inputs[slot]}"
                   if wide else f"{plan.param_storage[graph[r.node].target]}->{sig.inputs[slot]}"
                   for slot, r in enumerate(node.inputs) if graph[r.node].kind is NodeKind.PARAMETER]
        weights = weights if wide else list(dict.fromkeys(weights))
        name = f"{node.name} ({node.module_path})" if wide and node.module_path else node.name
        rows.append((name, str(sig), extra, " ".join(weights) or "-", "; ".join(by_op.get(node.name, [])) or "-"))
    return rows


def _clip(text: str, width: int, wide: bool) -> str:
    return text if wide or len(text) <= width else text[: width - 1] + "~"


def _write_trace(path: str, graph, plan: Plan, program, cluster: Cluster) -> None:
    import json

    from autoddl.atomic import write_text_atomic
    from costmodel.simulate import chrome_trace, simulate

    timeline = simulate(program, graph, plan, cluster)
    write_text_atomic(path, json.dumps(chrome_trace(timeline, ranks=min(plan.devices, 8))))
    print(f"wrote {path}: the simulated step, {timeline.step_time_s * 1e3:.3f} ms "
          f"({timeline.exposed_comm_s * 1e3:.3f} ms communication not overlapped)")


def _assignment_of(plan: Plan, form) -> np.ndarray:
    out = np.zeros(len(form.nodes), dtype=np.int64)
    for i, node in enumerate(form.nodes):
        want = (plan.signatures.get(node.name) if node.kind is not NodeKind.PARAMETER
                else next((s for s in form.problem.choices[i] if s.outputs[0] == plan.param_storage[node.target]),
                          None))
        choices = form.problem.choices[i]
        if want not in choices:
            raise ValueError(f"plan signature {want} of {node.name} is not a candidate on mesh {plan.mesh}")
        out[i] = choices.index(want)
    return out


def _local_costs(form, assignment: np.ndarray, i: int) -> np.ndarray:
    """Node i's cost for each of its candidates with every neighbour held at the plan's choice."""
    p = form.problem
    total = p.node_cost[i].copy()
    for u, v, mat in p.edges:
        if v == i:
            total += mat[assignment[u], :]
        elif u == i:
            total += mat[:, assignment[v]]
    return total
