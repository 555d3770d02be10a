"""Activation recompute in the compiled program: each recomputed block as a checkpointed submodule.

``outline_blocks`` moves the fx nodes of every block the plan recomputes
(``Training.recompute_of``) into a submodule called once in the program, run under
non-reentrant ``torch.utils.checkpoint``: ``full`` saves only the block's inputs and
runs the whole block (its boxing collectives included) forward again when backward
reaches it (without early stop: the ops after the last one that saves a tensor run too,
as Megatron's full recompute does); ``selective`` (``create_selective_checkpoint_contexts``) keeps the outputs
of matmul-like ops and of collectives but recomputes every second 2-D product (mm / addmm) of the
block and everything else, as torchtitan's selective-op policy. That is what the step program prices (autoddl/lowering.py:
``recomputed_ops`` and the recompute tasks). Parameter uses are made outside the block
(they are leaves with gradient hooks, made once per step) and passed in; while a block
is recomputed the collectives it runs are labelled ``recompute`` for the audit.
"""

from __future__ import annotations

import operator
from functools import partial
from typing import Callable

import torch
import torch.fx
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from autoddl.op_families import ALTERNATE_MM_ATEN, MATMUL_LIKE
from autoddl.training import Training

OP_META = "autoddl_op"        # fx node meta: the graph op the node was made for ("" for none)


class PlanRecomputeError(RuntimeError):
    """A block cannot be recomputed as one region; the message names the ops in the way."""


def selective_policy(counts: dict[bool, int], ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's op-level policy (autoddl/program.py ``selective_recomputes``): keep collective and
    matmul-like outputs but recompute every second 2-D product (aten mm / addmm) of the block,
    counted apart in the forward and in the recompute (``ctx.is_recompute``) as torchtitan counts."""
    if getattr(func, "namespace", "") in ("_c10d_functional", "_c10d_functional_autograd"):
        return CheckpointPolicy.MUST_SAVE
    name = getattr(func, "_opname", "")
    if name in ALTERNATE_MM_ATEN:
        counts[ctx.is_recompute] = counts.get(ctx.is_recompute, 0) + 1
        return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if name in MATMUL_LIKE else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(policy: Callable = selective_policy):
    """The checkpoint contexts of one run of a selectively recomputed block, with a fresh count of its
    2-D products (``checkpoint`` calls this ``context_fn`` once per forward of the block, as
    torchtitan's ``selective_checkpointing_context_fn``)."""
    return create_selective_checkpoint_contexts(partial(policy, {}))


class Checkpointed(torch.nn.Module):
    """One block's nodes as a module, run under checkpoint with its policy."""

    def __init__(self, body: torch.fx.GraphModule, policy: str, set_phase: Callable[[str], None]):
        super().__init__()
        self.body, self.policy, self.set_phase = body, policy, set_phase

    def forward(self, *inputs):
        context = selective_context if self.policy == "selective" else None
        kwargs = {"context_fn": context} if context is not None else {}
        with set_checkpoint_early_stop(False):     # recompute the whole block, as the program says
            return checkpoint(self._run, *inputs, use_reentrant=False, **kwargs)

    def _run(self, *inputs):
        recomputing = torch._C._current_graph_task_id() != -1     # called from autograd's backward
        if recomputing:
            self.set_phase("recompute")
        try:
            return self.body(*inputs)
        finally:
            if recomputing:
                self.set_phase("backward")


def outline_blocks(graph: torch.fx.Graph, root: torch.nn.Module, block_of_op: dict[str, str], training: Training,
                   param_use: Callable, set_phase: Callable[[str], None]) -> None:
    """Replace, in ``graph``, each recomputed block's nodes by one call of a ``Checkpointed``
    submodule added to ``root`` (module docstring)."""
    members: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        block = block_of_op.get(node.meta.get(OP_META) or "", "root")
        if training.recompute_of(block) != "none":
            members.setdefault(block, []).append(node)
    for index, (block, nodes) in enumerate(members.items()):
        body = [n for n in nodes if n.target != param_use]
        for use in (n for n in nodes if n.target == param_use):
            body[0].prepend(use)                 # no inputs: made before the block, passed in
        _check_contiguous(graph, block, body)
        name = f"recompute_{index}"
        root.add_module(name, Checkpointed(_extract(body), training.recompute_of(block), set_phase))
        _replace(graph, body, name)


def _check_contiguous(graph: torch.fx.Graph, block: str, body: list[torch.fx.Node]) -> None:
    inside = set(body)
    node, strays = body[0], []
    while node is not body[-1]:
        node = node.next
        if node not in inside:
            strays.append(f"{node.name} (of op {node.meta.get(OP_META) or '-'})")
    if strays:
        raise PlanRecomputeError(f"block {block} cannot be recomputed as one region: ops outside it run between "
                                 f"its ops ({', '.join(strays[:5])}); recompute 'none' for this block "
                                 "(training.recompute_blocks)")


def _extract(body: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A GraphModule of ``body``: placeholders for the outside values it reads, output the values
    read outside it (in ``_outputs`` order)."""
    inside = set(body)
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in body:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in env:
                env[arg] = sub.placeholder(f"in_{arg.name}")
        env[node] = sub.node_copy(node, lambda a: env[a])
    sub.output(tuple(env[n] for n in _outputs(body)))
    return torch.fx.GraphModule(torch.nn.Module(), sub, class_name="RecomputedBlock")


def _outputs(body: list[torch.fx.Node]) -> list[torch.fx.Node]:
    inside = set(body)
    return [n for n in body if any(u not in inside for u in n.users)]


def _replace(graph: torch.fx.Graph, body: list[torch.fx.Node], name: str) -> None:
    inside = set(body)
    inputs: list[torch.fx.Node] = []
    for node in body:
        inputs += [a for a in node.all_input_nodes if a not in inside and a not in inputs]
    outputs = _outputs(body)
    with graph.inserting_before(body[0]):
        call = graph.call_module(name, tuple(inputs))
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for node in reversed(body):
        graph.erase_node(node)
