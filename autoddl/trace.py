"""Trace an nn.Module with torch.export on the meta device into an OpGraph.

The model is copied onto the meta device first (parameters become meta tensors
of the same shape, no weight memory is allocated, the caller's model is not
touched), and export runs under ``torch.device("meta")`` so tensors created
inside ``forward()`` are meta too: a 175B-parameter model traces in seconds on
a laptop. When export fails, :class:`TraceError` names the construct, where it
is in the user's code, and what to change.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import operator
import os
import re
import sys
import sysconfig
import traceback
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from autoddl.flops import op_bytes, op_flops, short_name
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef
from autoddl.moe import fuse_experts
from autoddl.precision import cast_forward_inputs, working_copy
from autoddl.replicate import find_stack, replicated


class TraceError(RuntimeError):
    """The model could not be exported; the message names the construct, where it is and what to do.

    ``construct``, ``location`` and ``hint`` hold the three parts of the message;
    ``details`` the full original error and whatever torch printed while failing.
    """

    def __init__(self, message: str, *, construct: str = "", location: str = "", hint: str = "",
                 details: str = ""):
        super().__init__(message)
        self.construct, self.location, self.hint, self.details = construct, location, hint, details


# Ops export inserts to check metadata at run time; they produce nothing and nothing uses them.
_ASSERT_OPS = frozenset({"_assert_tensor_metadata", "_assert_scalar", "_assert_async",
                         "sym_constrain_range", "sym_constrain_range_for_size"})

LOSS_MODULE_TYPE = "loss_fn"  # module_type of the ops that loss_fn adds


class StepInputs(tuple):
    """One training step's tensors, flat, in the order of the traced graph's inputs.

    The order is: ``forward``'s positional inputs, its keyword inputs (``names`` says
    which), then the targets that only the loss takes. The tuple is what the
    executor feeds the graph (``dmodel(*step_inputs)``; a rank's batch shards keep
    the layout); ``split`` turns any flat sequence of this layout back into
    ``(args, kwargs, targets)``, and ``step_loss`` runs one eager step with it.
    ``has_targets`` is False for the classic convention, ``loss_fn(output, *inputs)``.
    """

    n_args: int
    kwarg_names: tuple[str, ...]
    target_names: tuple[str, ...]
    has_targets: bool
    targets_by_keyword: bool

    def __new__(cls, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                targets: Sequence[Any] | dict[str, Any] | None = None) -> "StepInputs":
        kwargs = dict(kwargs or {})
        by_keyword = isinstance(targets, dict)
        target_values = list(targets.values()) if by_keyword else list(targets or ())
        self = super().__new__(cls, (*args, *kwargs.values(), *target_values))
        self.n_args, self.kwarg_names = len(args), tuple(kwargs)
        self.target_names = tuple(targets) if by_keyword else tuple(
            "target" if i == 0 else f"target_{i}" for i in range(len(target_values)))
        self.has_targets, self.targets_by_keyword = targets is not None, by_keyword
        return self

    def layout(self) -> "StepInputs":
        """The same layout holding no tensors (None in every slot)."""
        args, kwargs, targets = self.split([None] * len(self))
        return StepInputs(args, kwargs, targets if self.has_targets else None)

    def __reduce__(self):
        args, kwargs, targets = self.split()
        return (StepInputs, (args, kwargs, targets if self.has_targets else None))

    def split(self, values: Sequence[Any] | None = None) -> tuple[tuple, dict[str, Any], Any]:
        """``(forward args, forward kwargs, targets)`` of ``values`` (default: these tensors).

        ``targets`` is a dict when the model file's example_targets() returned one, else a tuple."""
        values = tuple(self if values is None else values)
        if len(values) != len(self):
            raise ValueError(f"a step takes {len(self)} tensors ({', '.join(self.names(None))}), got {len(values)}")
        k = self.n_args + len(self.kwarg_names)
        targets = values[k:]
        return (values[:self.n_args], dict(zip(self.kwarg_names, values[self.n_args:k])),
                dict(zip(self.target_names, targets)) if self.targets_by_keyword else targets)

    def names(self, forward: Callable[..., Any] | None) -> list[str]:
        """Graph input names: ``forward``'s own positional parameter names, keyword names, target names."""
        positional = _positional_names(forward) if forward is not None else []
        args = [positional[i] if i < len(positional) else f"input_{i}" for i in range(self.n_args)]
        return args + list(self.kwarg_names) + list(self.target_names)

    def step_loss(self, model: Callable[..., Any], loss_fn: Callable[..., torch.Tensor],
                  values: Sequence[Any] | None = None) -> torch.Tensor:
        """One eager step's loss: ``loss_fn(model(*args, **kwargs), *targets)`` (or ``**targets``),
        or ``loss_fn(output, *args, **kwargs)`` when there are no targets."""
        args, kwargs, targets = self.split(values)
        output = model(*args, **kwargs)
        if not self.has_targets:
            return loss_fn(output, *args, **kwargs)
        return loss_fn(output, **targets) if self.targets_by_keyword else loss_fn(output, *targets)


def step_inputs(example_inputs: Any, targets: Any = None) -> StepInputs:
    """A StepInputs from a tensor, a tuple/list of tensors or a dict of keyword tensors (+ targets)."""
    if isinstance(example_inputs, StepInputs) and targets is None:
        return example_inputs
    if isinstance(example_inputs, StepInputs):
        args, kwargs, _ = example_inputs.split()
        return StepInputs(args, kwargs, targets)
    if isinstance(example_inputs, torch.Tensor):
        return StepInputs((example_inputs,), None, targets)
    if isinstance(example_inputs, dict):
        return StepInputs((), example_inputs, targets)
    return StepInputs(tuple(example_inputs), None, targets)


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def trace(model: nn.Module, example_inputs: Any, loss_fn: Callable[..., torch.Tensor] | None = None, *,
          targets: Any = None, name: str = "", param_dtype: str = "float32", replicate: bool = False,
          say: Callable[[str], None] | None = None) -> OpGraph:
    """Export ``model`` (and ``loss_fn`` if given) to an OpGraph on the meta device.

    ``example_inputs`` is a tuple of tensors (``model(*inputs)``), a dict of keyword
    tensors (``model(**inputs)``) or a :class:`StepInputs`; ``targets`` (a tuple or
    dict) go only to the loss: ``loss_fn(output, *targets)``. Without targets the loss
    is ``loss_fn(output, *inputs)``. With ``loss_fn`` the graph is the whole training
    step's forward (its output is the loss) and its inputs are ``StepInputs`` order;
    parameter fqns and module paths are those of ``model``. ``param_dtype``: traced under that
    mixed-precision policy (autoddl/precision.py): parameters and floating forward inputs in it.
    ``replicate``: export a repeated stack of blocks cut to 2 and 3 blocks and replicate it
    (autoddl/replicate.py; for planning: the graph has no ``exported`` program for the executor);
    when that is not trusted, ``say`` (default: stderr) gets one line why and the model is exported whole.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace() needs an nn.Module, got {type(model).__name__}")
    name = name or type(model).__name__
    step = step_inputs(example_inputs, targets)
    meta_inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in step)
    meta_inputs = cast_forward_inputs(meta_inputs, step.n_args + len(step.kwarg_names), param_dtype)
    meta_model = to_meta(model, param_dtype)
    fuse_experts(meta_model)           # MoE layers as one op (autoddl/moe.py)
    plain = loss_fn is None and not step.kwarg_names and not step.has_targets

    def export(m: nn.Module) -> OpGraph:
        return _export_graph(m if plain else _Step(m, loss_fn, step.layout()), meta_inputs, name,
                             plain=plain, loss_wrapped=loss_fn is not None)

    graph = None
    stack = find_stack(meta_model) if replicate else None
    if stack is not None:
        graph, why = replicated(meta_model, stack, export)
        if graph is None:
            (say or _to_stderr)(f"trace: {name}: exporting all {stack.n} blocks ({why})")
    if graph is None:
        graph = export(meta_model)
    warn_uncovered(graph)
    return graph


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _export_graph(root: nn.Module, meta_inputs: tuple, name: str, *, plain: bool, loss_wrapped: bool) -> OpGraph:
    """torch.export of ``root`` on meta, its higher-order regions inlined, as an OpGraph."""
    with _captured_torch_output() as printed:
        try:
            with torch.device("meta"):
                exported = torch.export.export(root, meta_inputs, strict=False)
        except Exception as exc:  # torch raises many types here; all mean "not exportable"
            raise _explain(exc, name, printed.getvalue()) from exc
    if printed.getvalue():
        sys.stderr.write(printed.getvalue())  # export succeeded: pass its warnings on
    inline_higher_order_ops(exported, name)
    return graph_from_exported(exported, name=name, strip_prefix="" if plain else "model.",
                               loss_wrapped=loss_wrapped)


def warn_uncovered(graph: OpGraph) -> None:
    """One UncoveredOpWarning listing the ops without an SBP rule or FLOP formula, if any."""
    from autoddl.ops import UncoveredOpWarning, coverage_report

    report = coverage_report(graph)
    if report:
        warnings.warn(f"{graph.model_name}: " + "; ".join(report.lines()), UncoveredOpWarning, stacklevel=3)


# Higher-order ops torch.export wraps a region of ops in, by name: the position of the region's
# submodule among the op's arguments. ``@torch.no_grad()`` / ``torch.set_grad_enabled`` give
# wrap_with_set_grad_enabled(enable, submod, *operands); ``torch.autocast`` gives
# wrap_with_autocast(device_type, dtype, enabled, cache_enabled, submod, *operands)
# (torch/_export/passes/replace_{set_grad,autocast}_with_hop_pass.py).
WRAPPER_HOPS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4, "wrap": 0}


def inline_higher_order_ops(exported: "torch.export.ExportedProgram", model_name: str = "") -> int:
    """Inline every region higher-order op of ``exported``'s graph module, in place; returns how many.

    The region's ops become ordinary nodes of the top-level graph (with their own
    ``stack_trace`` and ``nn_module_stack``), so the OpGraph and the graph module the
    executor runs agree node for node. A grad-disabled region's floating outputs pass
    through ``aten.detach`` (what leaving the region did); an autocast region must be
    disabled (HF rotary embeddings force fp32 this way), since its ops, inlined, would
    no longer run at the autocast dtype. Any other higher-order op (torch.cond,
    while_loop, map, flex_attention, ...) raises a TraceError naming it and its line.
    """
    gm = exported.graph_module
    count, renamed = _inline_all(gm, model_name)
    if count:
        for n in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
            gm.graph.erase_node(n)
        for name, child in list(gm.named_children()):
            if isinstance(child, torch.fx.GraphModule) and not any(
                    n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
                delattr(gm, name)
        gm.graph.lint()
        gm.recompile()
        for spec in exported.graph_signature.output_specs:
            arg_name = getattr(spec.arg, "name", None)
            if arg_name in renamed:
                spec.arg.name = renamed[arg_name]
    return count


def _check_inlinable(node: torch.fx.Node, model_name: str) -> None:
    """Raise a TraceError for a higher-order op autoddl cannot turn into ordinary ops."""
    hop = node.target.name()
    if hop == "wrap_with_autocast" and bool(node.args[2]):
        construct = (f"an enabled torch.autocast region (dtype {node.args[1]}, device {node.args[0]!r}) "
                     f"in forward(), exported as {hop}")
        hint = ("plan in fp32: remove the autocast context from forward() (or pass enabled=False); "
                "its ops, inlined, would no longer run at the autocast dtype")
    elif hop not in WRAPPER_HOPS:
        construct = f"the higher-order op torch.ops.higher_order.{hop} (control flow or a fused kernel)"
        hint = ("autoddl plans straight-line aten graphs: replace torch.cond / while_loop / map / scan by "
                "static Python control flow that depends only on shapes and config, and flex_attention "
                "by scaled_dot_product_attention with a mask")
    else:
        return
    location = _region_location(node)
    raise TraceError(f"cannot trace {model_name or 'the model'}: {construct}"
                     + (f"\n  at {location}" if location else "") + f"\n  what to do: {hint}",
                     construct=construct, location=location, hint=hint)


def _region_location(node: torch.fx.Node) -> str:
    """Where a higher-order op is in the user's code: its stack trace, else its region's first one."""
    location = _fx_location(node)
    if location:
        return location
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            sub = getattr(node.graph.owning_module, arg.target, None)
            for inner in getattr(getattr(sub, "graph", None), "nodes", ()):
                if _fx_location(inner):
                    return _fx_location(inner)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, mtype = list(stack.values())[-1]
        return f"module {path or '<root>'} ({getattr(mtype, '__name__', mtype)})"
    return ""


def _inline_region(gm: torch.fx.GraphModule, node: torch.fx.Node, model_name: str) -> dict[str, str]:
    """Copy the region's nodes before ``node``, rewire its users, erase it; old -> new output names."""
    hop = node.target.name()
    sub_pos = WRAPPER_HOPS[hop]
    sub = getattr(gm, node.args[sub_pos].target)
    _inline_all(sub, model_name)   # nested regions first
    operands = list(node.args[sub_pos + 1:])
    env: dict[torch.fx.Node, Any] = {}
    outputs: Any = None
    placeholders = iter(operands)
    with gm.graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                outputs = torch.fx.map_arg(inner.args[0], lambda n: env[n])
            elif inner.op == "get_attr":
                raise TraceError(f"cannot trace {model_name or 'the model'}: a {hop} region reads the "
                                 f"attribute {inner.target!r}, which autoddl cannot lift\n  at "
                                 f"{_region_location(node)}\n  what to do: register the tensor as a buffer")
            else:
                env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
        if hop == "wrap_with_set_grad_enabled" and not node.args[0]:
            outputs = _detached(gm.graph, outputs)
    return _replace_uses(node, outputs)


def _inline_all(gm: torch.fx.GraphModule, model_name: str) -> tuple[int, dict[str, str]]:
    """Inline the region higher-order ops of one graph module; (how many, old -> new output names)."""
    count, renamed = 0, {}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            _check_inlinable(node, model_name)
            renamed.update(_inline_region(gm, node, model_name))
            count += 1
    return count, renamed


def _detached(graph: torch.fx.Graph, outputs: Any) -> Any:
    """``aten.detach`` of every floating tensor in ``outputs``: no gradient leaves a no_grad region."""
    def detach(n: torch.fx.Node) -> torch.fx.Node:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return n
        out = graph.call_function(torch.ops.aten.detach.default, (n,))
        out.meta.update({k: v for k, v in n.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        return out
    return torch.fx.map_arg(outputs, detach)


def _replace_uses(node: torch.fx.Node, outputs: Any) -> dict[str, str]:
    """Point the users of a region op (``getitem(node, i)`` or ``node`` itself) at ``outputs``."""
    renamed: dict[str, str] = {}
    for user in list(node.users):
        if user.target is operator.getitem and isinstance(outputs, (list, tuple)):
            new = outputs[user.args[1]]
            renamed[user.name] = new.name if isinstance(new, torch.fx.Node) else user.name
            user.replace_all_uses_with(new)
            node.graph.erase_node(user)
        else:
            user.replace_input_with(node, outputs)
    node.graph.erase_node(node)
    return renamed


def to_meta(model: nn.Module, param_dtype: str = "float32") -> nn.Module:
    """A copy of ``model`` whose parameters, buffers and plain tensor attributes live on the meta device.

    No data is copied; tied parameters stay tied; floating parameters become ``param_dtype``.
    """
    memo: dict[int, Any] = {}
    attrs = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in list(model.parameters()) + list(model.buffers()) + attrs:
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            meta = working_copy(meta, param_dtype)
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class _Step(nn.Module):
    """One training step's forward as a module of flat inputs (``StepInputs`` order).

    ``forward(*flat)`` calls ``model(*args, **kwargs)`` and, with a ``loss_fn``, returns
    its loss; the graph's inputs are named after model.forward's arguments, the
    keyword inputs and the targets.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, step: StepInputs):
        super().__init__()
        self.model, self.loss_fn, self.step = model, loss_fn, step
        names = step.names(model.forward)
        if len(set(names)) != len(names):
            raise TraceError(f"the step's inputs have repeated names {names}: give targets names that "
                             "differ from forward()'s inputs")
        call = self._step

        def forward(*flat):
            return call(*flat)

        forward.__signature__ = inspect.Signature(  # export names input placeholders after these
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
        self.forward = forward

    def _step(self, *flat):
        if self.loss_fn is None:
            args, kwargs, _ = self.step.split(flat)
            return self.model(*args, **kwargs)
        return self.step.step_loss(self.model, self.loss_fn, flat)


def graph_from_exported(exported: "torch.export.ExportedProgram", *, name: str = "",
                        strip_prefix: str = "", loss_wrapped: bool | None = None) -> OpGraph:
    """Convert an ExportedProgram's graph into OpNodes (FLOPs, bytes, parameter fqns, module paths).

    ``strip_prefix`` ("model." when a loss wrapper was traced) is removed from
    parameter/buffer fqns and module paths; ops of the wrapper itself get
    ``module_type == "loss_fn"`` when ``loss_wrapped`` (default: a prefix was given).
    """
    loss_wrapped = bool(strip_prefix) if loss_wrapped is None else loss_wrapped
    sig = exported.graph_signature
    param_of = dict(sig.inputs_to_parameters)
    buffer_of = {**dict(sig.inputs_to_buffers), **dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}))}
    root_path = strip_prefix.rstrip(".")

    def fqn(s: str) -> str:
        if strip_prefix and s == root_path:
            return ""
        return s[len(strip_prefix):] if strip_prefix and s.startswith(strip_prefix) else s

    alias = tied_aliases(exported)
    nodes: list[OpNode] = []
    param_placeholder: dict[str, str] = {}
    for fx_node in exported.graph.nodes:
        if fx_node.op == "placeholder":
            if fx_node.name in alias:
                continue
            if fx_node.name in param_of:
                kind, target = NodeKind.PARAMETER, fqn(param_of[fx_node.name])
                param_placeholder[fx_node.name] = target
            elif fx_node.name in buffer_of:
                kind, target = NodeKind.BUFFER, fqn(buffer_of[fx_node.name])
            else:
                kind, target = NodeKind.INPUT, fx_node.name
            nodes.append(OpNode(fx_node.name, kind, target, outputs=_metas(fx_node, name)))
        elif fx_node.op == "call_function":
            if short_name(_target_name(fx_node.target)) in _ASSERT_OPS and not fx_node.users:
                continue
            nodes.append(_op_node(fx_node, param_placeholder, fqn, name, alias, loss_wrapped=loss_wrapped))
        elif fx_node.op == "output":
            refs, args = _refs_and_args(fx_node.args[0], alias)
            nodes.append(OpNode(fx_node.name, NodeKind.OUTPUT, "output", inputs=refs,
                                input_metas=tuple(_meta_of_ref(nodes, r) for r in refs), args=(args,)))
        else:
            raise TraceError(f"cannot convert the exported graph of {name}: unexpected fx node "
                             f"{fx_node.op} {fx_node.target}; autoddl handles placeholder, call_function "
                             f"and output nodes only")
    return OpGraph(nodes, model_name=name, exported=exported)


def tied_aliases(exported: "torch.export.ExportedProgram") -> dict[str, str]:
    """Placeholder name -> the placeholder it duplicates, for tied parameters/buffers.

    Export gives a tied tensor (e.g. ``lm_head.weight is wte.weight``) one placeholder
    per name. The OpGraph keeps only the first; every use of the others points at
    it, so a tied weight is one node (counted once, planned once). An executor
    walking the exported graph feeds an alias placeholder the value of its target.
    """
    sig = exported.graph_signature
    alias: dict[str, str] = {}
    first_holder: dict[int, str] = {}
    for ph_name, state_name in [*sig.inputs_to_parameters.items(), *sig.inputs_to_buffers.items()]:
        tensor = exported.state_dict.get(state_name)
        if tensor is None:  # non-persistent buffers are not in state_dict
            continue
        target = first_holder.setdefault(id(tensor), ph_name)
        if target != ph_name:
            alias[ph_name] = target
    return alias


def _op_node(fx_node: torch.fx.Node, param_placeholder: dict[str, str], fqn, model_name: str,
             alias: dict[str, str], *, loss_wrapped: bool) -> OpNode:
    target = _target_name(fx_node.target)
    if fx_node.target is operator.getitem:
        src, index = fx_node.args
        ref = TensorRef(alias.get(src.name, src.name), int(index))
        refs, args = (ref,), (ref, index)
    else:
        refs, args = _refs_and_args(fx_node.args, alias)
    kw_refs, kwargs = _refs_and_args(fx_node.kwargs, alias)
    refs = refs + kw_refs
    outputs = _metas(fx_node, model_name)
    by_name = {alias.get(n.name, n.name): n for n in fx_node.all_input_nodes}
    input_metas = tuple(_metas(by_name[r.node], model_name)[r.index] for r in refs)
    short = short_name(target)
    read, written = op_bytes(short, input_metas, outputs, args)
    stack = fx_node.meta.get("nn_module_stack") or {}
    module_path, module_type = "", ""
    if stack:
        path, mtype = list(stack.values())[-1]
        module_path = fqn(path)
        module_type = getattr(mtype, "__name__", str(mtype)).rsplit(".", 1)[-1]
        if loss_wrapped and len(stack) == 1:  # only the wrapper on the stack: an op of loss_fn
            module_type = LOSS_MODULE_TYPE
    return OpNode(
        name=fx_node.name, kind=NodeKind.OP, target=target, inputs=refs, input_metas=input_metas,
        outputs=outputs, args=args, kwargs=kwargs,
        flops=op_flops(short, input_metas, outputs, args, kwargs), bytes_read=read, bytes_written=written,
        params=tuple(param_placeholder[r.node] for r in refs if r.node in param_placeholder),
        module_path=module_path, module_type=module_type,
    )


def _target_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def _refs_and_args(value: Any, alias: dict[str, str] | None = None) -> tuple[tuple[TensorRef, ...], Any]:
    """Replace fx Nodes inside (nested) args with TensorRefs (through ``alias``); return the refs in order too."""
    refs: list[TensorRef] = []
    alias = alias or {}

    def walk(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            ref = TensorRef(alias.get(v.name, v.name), 0)
            refs.append(ref)
            return ref
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    walked = walk(value)
    return tuple(refs), walked


def _metas(fx_node: torch.fx.Node, model_name: str = "") -> tuple[TensorMeta, ...]:
    """TensorMeta of each tensor the fx node produces; a TraceError for a data-dependent shape."""
    val = fx_node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else (val,)
    out = []
    for v in vals:
        if not isinstance(v, torch.Tensor):
            if isinstance(val, (list, tuple)):
                out.append(TensorMeta((), "none"))  # keeps output indices aligned
            continue
        if any(not isinstance(d, int) for d in v.shape):
            _raise_dynamic_shape(fx_node, v, model_name)
        out.append(TensorMeta(tuple(v.shape), str(v.dtype).removeprefix("torch.")))
    return tuple(out)


def _raise_dynamic_shape(fx_node: torch.fx.Node, value: torch.Tensor, model_name: str) -> None:
    location = _fx_location(fx_node)
    hint = ("autoddl needs every shape to be known from the example inputs' shapes: use a fixed-shape "
            "form (torch.where / masked_fill instead of x[mask] or nonzero(); pad to a maximum length)")
    construct = f"op {_target_name(fx_node.target)} returns a data-dependent shape {list(value.shape)}"
    raise TraceError(f"cannot trace {model_name or 'the model'}: {construct}" + (f"\n  at {location}" if location else "")
                     + f"\n  what to do: {hint}", construct=construct, location=location, hint=hint)


def _fx_location(fx_node: torch.fx.Node) -> str:
    trace_text = fx_node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace_text)
    if not frames:
        return ""
    file, line, func, code = frames[-1]
    return f"{file}:{line} in {func}: `{code.strip()}`"


def _meta_of_ref(nodes: list[OpNode], ref: TensorRef) -> TensorMeta:
    for n in reversed(nodes):
        if n.name == ref.node:
            return n.outputs[ref.index] if ref.index < len(n.outputs) else TensorMeta((), "none")
    raise TraceError(f"the exported graph's output refers to unknown node {ref.node!r}")


@contextlib.contextmanager
def _captured_torch_output():
    """Collect what torch prints or logs during export (a failing export dumps partial graphs)."""
    buf = io.StringIO()

    class _Capture(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno < logging.WARNING:
                return True
            buf.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")
            return False

    capture = _Capture()
    handlers = {h for name, lg in list(logging.root.manager.loggerDict.items())
                if name.split(".")[0] == "torch" and not name.startswith("torch.__")
                and isinstance(lg, logging.Logger) for h in lg.handlers}
    for h in handlers:
        h.addFilter(capture)
    try:
        with contextlib.redirect_stderr(buf):
            yield buf
    finally:
        for h in handlers:
            h.removeFilter(capture)


# (predicate on "<ExceptionType>: <message>", construct, what to do)
_DATA_DEPENDENT_HINT = (
    "autoddl traces on the meta device, where tensors have shapes but no values, so Python cannot "
    "branch on or read a tensor's value. Make the branch depend on shapes or config only (e.g. "
    "`if x.shape[1] > 512`), compute both sides and pick with torch.where, or use torch.cond")
_CASES: tuple[tuple[Callable[[str], bool], str, str], ...] = (
    (lambda t: "GuardOnDataDependentSymNode" in t and "extract specialized" in t,
     "data-dependent value: a tensor's value is turned into a Python number (.item(), int(), float(), "
     ".tolist()) and used as a size, index or in a branch",
     _DATA_DEPENDENT_HINT),
    (lambda t: "GuardOnDataDependentSymNode" in t or "data-dependent" in t.lower(),
     "data-dependent control flow: a Python `if`/`while`/`assert`/`bool()` on a tensor's value "
     "(export cannot guard on it)",
     _DATA_DEPENDENT_HINT),
    (lambda t: "DynamicOutputShapeException" in t or "DataDependentOutputException" in t,
     "an op whose output shape depends on tensor values (nonzero, unique, boolean-mask indexing x[mask])",
     "use a fixed-shape form: torch.where or masked_fill instead of x[mask] / nonzero()"),
    (lambda t: "DeviceMismatch" in t or "found at least two devices" in t,
     "a tensor pinned to a real device inside forward() (e.g. torch.tensor(..., device='cpu'), "
     ".cuda(), .to('cpu'), or a plain tensor attribute that is not a registered buffer)",
     "create tensors with device=x.device, and register constant tensors with register_buffer() "
     "so they move with the model"),
    (lambda t: "Meta" in t and ("NotImplementedError" in t or "Could not run" in t),
     "an op without a meta-device kernel (a custom or backend-only op)",
     "use standard torch ops in forward(), or register a fake/meta implementation for the custom op "
     "(torch.library.register_fake)"),
    (lambda t: "Unsupported" in t.split(":", 1)[0],
     "an unsupported Python construct in forward()",
     "keep forward() to tensor ops, static Python loops and submodule calls"),
)
_DEFAULT_HINT = ("run `model(*example_inputs)` eagerly to check that forward() works on these inputs, "
                 "and keep forward() free of data-dependent branches, .item() and device-pinned tensors")


def _explain(exc: Exception, model_name: str, printed: str = "") -> TraceError:
    """Turn an export failure into a TraceError naming the construct, its location and the fix."""
    text = f"{type(exc).__name__}: {exc}"
    torch_says = text.strip().splitlines()[0][:300]
    construct, hint = "forward() failed while exporting", _DEFAULT_HINT
    for matches, what, fix in _CASES:
        if matches(text):
            construct, hint = what, fix
            break
    location = _user_location(exc)
    message = (f"cannot trace {model_name} with torch.export: {construct}"
               + (f"\n  at {location}" if location else "")
               + f"\n  torch says: {torch_says}"
               + f"\n  what to do: {hint}")
    details = "".join(traceback.format_exception(exc)) + (f"\ntorch printed:\n{printed}" if printed else "")
    return TraceError(message, construct=construct, location=location, hint=hint, details=details)


_NOT_USER = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, __file__)) + (
    sysconfig.get_paths()["stdlib"] + os.sep,)


def _user_location(exc: BaseException) -> str:
    """``file:line in func: `code` `` of the innermost frame of user code in the failure's traceback."""
    original, found = exc, ""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for fr in traceback.extract_tb(exc.__traceback__):
            path = os.path.abspath(fr.filename)
            if fr.filename.startswith("<") or path.startswith(_NOT_USER):
                continue
            found = f"{fr.filename}:{fr.lineno} in {fr.name}: `{(fr.line or '').strip()}`"
        if found:
            return found
        exc = exc.__cause__ or exc.__context__
    m = re.search(r'The following call raised this error:\n\s*File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)',
                  str(original))
    return f"{m.group(1)}:{m.group(2)} in {m.group(3)}: `{m.group(4).strip()}`" if m else ""
