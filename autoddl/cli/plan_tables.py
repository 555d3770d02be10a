"""The planning commands' tables: one row per scheme (step time and its parts, recompute, offload,
throughput, memory), and the one-line summary of a plan."""

from __future__ import annotations

from autoddl.cli import table
from autoddl.graph import OpGraph
from autoddl.offload import SPILL_LEVELS
from autoddl.plan import Plan
from search.planner import Scheme, recompute_blocks


MEMORY_PARTS = {            # --memory-breakdown column -> costmodel/memory.py categories
    "params GB": ("parameters", "working_params", "gathered_params"),
    "grads GB": ("gradients",),
    "optim GB": ("optimizer_states",),
    "activ GB": ("activations", "activation_grads", "recomputed"),
    "spilled GB": ("spilled_params", "spilled_grads", "spilled_acts"),
    "other GB": ("buffers", "boxing_buffer"),
}


def recompute_label(plan: Plan, graph: OpGraph | None) -> str:
    """``none`` / ``selective`` / ``full`` / ``30 sel + 2 full`` of the plan's blocks."""
    blocks = recompute_blocks(graph) if graph is not None else list(plan.training.recompute_blocks)
    policies = [plan.training.recompute_of(b) for b in blocks]
    if not policies or all(p == "none" for p in policies):
        return "none"
    if len(set(policies)) == 1:
        return policies[0]
    counts = {p: policies.count(p) for p in ("selective", "full") if p in policies}
    return " + ".join(f"{n} {'sel' if p == 'selective' else p}" for p, n in counts.items())


def rate_column(schemes: list[Scheme]) -> str:
    costs = [s.plan.cost for s in schemes if s.plan is not None and s.plan.cost is not None]
    return "tok/s/dev" if any(c.tokens_per_s is not None for c in costs) else "samples/s/dev"


def rate(plan: Plan) -> str:
    c = plan.cost
    per_s = c.tokens_per_s if c.tokens_per_s is not None else c.samples_per_s
    return f"{per_s / plan.devices:,.0f}" if per_s is not None else "-"


def memory_cells(bd, breakdown: bool) -> tuple[str, ...]:
    if not breakdown:
        return (f"{bd.memory_bytes_per_device / 1e9:.3f}",)
    return tuple(f"{sum(bd.memory.get(c, 0) for c in cats) / 1e9:.3f}" for cats in MEMORY_PARTS.values()) + \
        (f"{bd.memory_bytes_per_device / 1e9:.3f}",)


def memory_header(breakdown: bool) -> tuple[str, ...]:
    return tuple(MEMORY_PARTS) + ("memory GB",) if breakdown else ("memory GB",)


def print_schemes(schemes: list[Scheme], graphs: dict[str, OpGraph | None], breakdown: bool = False) -> None:
    """One row per scheme: step time, its parts, recompute (when any), throughput, memory. A scheme
    left unpriced (``Scheme.estimated``) shows the search objective as its step time, ``-`` for what
    only the full cost model gives, and ``estimated`` in a ``priced`` column, with the reason below."""
    rows, skipped = [], []
    show_recompute = any(s.plan is not None and recompute_label(s.plan, graphs.get(s.name)) != "none"
                         for s in schemes)
    show_bubble = any(s.breakdown is not None and s.breakdown.bubble_s > 0 for s in schemes)
    show_offload = any(s.plan is not None and s.plan.training.offload_level != "none" for s in schemes)
    show_priced = any(s.estimated for s in schemes)
    for s in schemes:
        if s.plan is None:
            skipped.append(f"{s.name}: not applicable: {s.reason}")
            continue
        if s.estimated:
            rows.append(_estimated_row(s, graphs, show_bubble, show_recompute, show_offload, breakdown))
            skipped.append(f"{s.name}: estimated, not priced by the full cost model (step ms: the search objective"
                           f"{'' if s.estimate_s is not None else ', none for this plan'}): {s.reason}")
            continue
        bd, c = s.breakdown, s.plan.cost
        rows.append((s.name, str(s.plan.mesh), f"{bd.step_time_s * 1e3:.3f}", f"{bd.compute_s * 1e3:.3f}",
                     f"{(bd.boxing_forward_s + bd.boxing_backward_s) * 1e3:.3f}", f"{bd.grad_sync_s * 1e3:.3f}",
                     f"{bd.optimizer_s * 1e3:.3f}")
                    + ((f"{bd.bubble_s * 1e3:.3f}",) if show_bubble else ())
                    + ((recompute_label(s.plan, graphs.get(s.name)),) if show_recompute else ())
                    + (_offload_cells(s) if show_offload else ())
                    + (rate(s.plan), f"{c.model_tflops_per_device:.1f}" if c.model_tflops_per_device else "-")
                    + memory_cells(bd, breakdown) + ("yes" if bd.fits_memory else "NO",)
                    + (("full",) if show_priced else ()))
    header = (("scheme", "mesh", "step ms", "compute ms", "boxing ms", "grad sync ms", "optimizer ms")
              + (("bubble ms",) if show_bubble else ()) + (("recompute",) if show_recompute else ())
              + (OFFLOAD_HEADER if show_offload else ()) + (rate_column(schemes), "TFLOP/s/dev")
              + memory_header(breakdown) + ("fits",) + (("priced",) if show_priced else ()))
    numeric = [i for i, h in enumerate(header)
               if h not in ("scheme", "mesh", "recompute", "fits", "priced") + OFFLOAD_HEADER]
    print(table(header, rows, numeric=numeric))
    for line in skipped:
        print(line)


OFFLOAD_HEADER = ("offload", "copies ms", "vs no offload", "host GB")


def _estimated_row(s: Scheme, graphs: dict[str, OpGraph | None], show_bubble: bool, show_recompute: bool,
                   show_offload: bool, breakdown: bool) -> tuple[str, ...]:
    """An unpriced scheme's row: the search objective as step ms, its memory floor (``>`` it) in the
    total memory column and ``NO`` fits when it cannot fit, its kernels' floor (``>``) as compute ms
    when it cannot be chosen, ``-`` elsewhere."""
    step = f"{s.estimate_s * 1e3:.3f}" if s.estimate_s is not None else "-"
    compute = f">{s.floor_s * 1e3:.3f}" if s.floor_s else "-"
    memory = ("-",) * (len(MEMORY_PARTS) if breakdown else 0) + (f">{s.floor_bytes / 1e9:.3f}" if s.floor_bytes
                                                                else "-",)
    return ((s.name, str(s.plan.mesh), step, compute) + ("-",) * 3 + (("-",) if show_bubble else ())
            + ((recompute_label(s.plan, graphs.get(s.name)),) if show_recompute else ())
            + (("-",) * len(OFFLOAD_HEADER) if show_offload else ()) + ("-", "-") + memory
            + ("NO" if s.floor_bytes else "-", "estimated"))


def _offload_cells(s: Scheme) -> tuple[str, ...]:
    """What a scheme spills, its host copies' time, its step against the same plan without offload
    (``does not fit`` there when it needs the offload), the host memory it uses per device."""
    level = s.plan.training.offload_level
    if level == "none":
        return ("none", "-", "-", "-")
    ratio = (f"{s.step_time_s / s.no_offload_s:.2f}x" if s.no_offload_s else "-") + \
        ("" if s.no_offload_fits else " (does not fit without)")
    blocks = s.plan.training.spill_blocks
    if level in SPILL_LEVELS:
        level += f" ({len(blocks)} blocks)" if blocks else " (all)"
    return (level, f"{s.breakdown.offload_s * 1e3:.3f}", ratio, f"{s.breakdown.host_memory_bytes / 1e9:.3f}")


def plan_line(label: str, plan: Plan, bd) -> str:
    c = plan.cost
    line = (f"{label}: mesh {plan.mesh}, predicted {bd.step_time_s * 1e3:.3f} ms per step, "
            f"{bd.memory_bytes_per_device / 1e9:.3f} GB per device")
    if c.tokens_per_s is not None:
        line += f", {c.tokens_per_s / plan.devices:,.0f} tokens/s per device"
    elif c.samples_per_s is not None:
        line += f", {c.samples_per_s / plan.devices:,.1f} samples/s per device"
    if c.model_tflops_per_device:
        line += f", {c.model_tflops_per_device:.1f} model TFLOP/s per device"
    return line + ("" if bd.fits_memory else " (does NOT fit)")
