"""``autoddl explain``: why each op of a plan got its signature (its cost against the runner-up with
every neighbour held), the weight layouts it uses, the collectives the plan inserts for it, and the
simulated step as a Chrome trace."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import numpy as np

from autoddl import trace_cache
from autoddl.boxing import group_name
from autoddl.cli import common_options, register, table
from autoddl.cli.plan import _say
from autoddl.cluster import DEFAULT_CLUSTER_PATH, Cluster
from autoddl.graph import NodeKind
from autoddl.loader import load_for_plan
from autoddl.plan import ROLE_WORDS, Plan


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


NARROW = {"op": 16, "signature": 30, "runner-up": 10, "weight layouts": 18, "collectives": 18}  # 100 wide
SHORT_PHASE = {"forward": "fwd", "backward": "bwd", "grad_sync": "sync", "optimizer": "opt"}
SHORT_KIND = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "broadcast": "BC",
              "send_recv": "P2P"}


def plan_in_words(plan: Plan) -> str:
    """``data parallel over 2, tensor parallel over 4``: the mesh axes by role."""
    return ", ".join(f"{ROLE_WORDS.get(name.rstrip('0123456789'), name)} over {n}"
                     for name, n in zip(plan.mesh.axis_names, plan.mesh.shape))


def run_explain(args: argparse.Namespace) -> int:
    from autoddl.program import lower
    from search.formulate import formulate

    plan = Plan.load(args.plan_json)
    name, graph = _traced_for(plan, args.plan_json)
    cluster = Cluster.from_yaml(plan.cluster_file or DEFAULT_CLUSTER_PATH).resized(plan.mesh.size)
    form = formulate(graph, cluster, plan.mesh.shape, optimizer=plan.optimizer, training=plan.training)
    picked = [i for i, n in enumerate(form.nodes) if n.kind is NodeKind.OP and (not args.op or _matches(n, args.op))]
    if args.op and not picked:
        raise ValueError(f"--op {args.op}: no op, module path or parameter of {name} is called that; see "
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
    dtype = plan.training.param_dtype
    if os.path.isfile(plan.model):
        graph = trace_cache.traced(plan.model, plan.model_args, plan.batch_size, dtype,
                                   lambda: load_for_plan(plan).trace(dtype), _say)
    else:                                              # load_for_plan says what is wrong with it
        graph = load_for_plan(plan).trace(dtype)
    if graph.fingerprint() != plan.graph_hash:
        raise ValueError(f"{path} was made for another graph of {plan.model} (hash {plan.graph_hash}, "
                         f"now {graph.fingerprint()}); re-run `autoddl plan`")
    return Path(plan.model).stem, graph


def _matches(node, name: str) -> bool:
    """``name`` is the op, its module (or a module above it) or one of the parameters it reads."""
    path = node.module_path
    return name == node.name or name in node.params or path == name or path.startswith(name + ".")


def _explain_rows(form, assignment: np.ndarray, picked: list[int], plan: Plan, graph, program,
                  wide: bool) -> list[tuple[str, ...]]:
    by_op: dict[str, list[str]] = {}
    for t in program.collectives():
        text = (f"{t.phase} {t.collective.value} axis {group_name(t.axis)} {t.nbytes / 1e6:.3f} MB ({t.tensor})" if wide
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
    from costmodel.simulate import bubble_s, chrome_trace, simulate

    timeline = simulate(program, graph, plan, cluster)
    write_text_atomic(path, json.dumps(chrome_trace(timeline, ranks=min(plan.devices, 8))))
    bubble = bubble_s(timeline, program)
    print(f"wrote {path}: the simulated step, {timeline.step_time_s * 1e3:.3f} ms "
          f"({max(0.0, timeline.exposed_comm_s - bubble) * 1e3:.3f} ms communication not overlapped"
          + (f", {bubble * 1e3:.3f} ms pipeline bubble)" if program.pipeline is not None else ")"))


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
