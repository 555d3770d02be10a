"""Trace an nn.Module with torch.export on the meta device into an OpGraph.

The model is copied onto the meta device first (parameters become meta tensors
of the same shape, no weight memory is allocated), so a 175B-parameter model
traces in seconds on a laptop.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from autoddl.flops import op_bytes, op_flops
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef


class TraceError(RuntimeError):
    """The model could not be exported; the message names the construct and what to do."""


_HINTS = (
    ("data-dependent", "data-dependent control flow or shapes: replace Python `if tensor...` with "
                       "torch.cond or make the branch depend on static sizes/config only"),
    ("guard", "a branch depends on a tensor value or a dynamic size: make it depend on static "
              "sizes/config only, or use torch.cond"),
    ("Unsupported", "an unsupported Python construct in forward(): keep forward() to tensor ops, "
                    "static loops and module calls"),
    ("item()", "a .item()/.tolist() call pulls a tensor value into Python: compute with tensors instead"),
    ("meta", "an op has no meta-device kernel: build the model with standard torch ops"),
)


def trace(model: nn.Module, example_inputs: Sequence[torch.Tensor],
          loss_fn: Callable[..., torch.Tensor] | None = None, *, name: str = "") -> OpGraph:
    """Export ``model`` (and ``loss_fn(output, *inputs)`` if given) to an OpGraph on the meta device."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace() needs an nn.Module, got {type(model).__name__}")
    example_inputs = tuple(example_inputs)
    meta_model = to_meta(model)
    meta_inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in example_inputs)
    root: nn.Module = _WithLoss(meta_model, loss_fn) if loss_fn is not None else meta_model
    prefix = "model." if loss_fn is not None else ""
    try:
        exported = torch.export.export(root, meta_inputs, strict=False)
    except Exception as exc:  # torch raises many types here; all mean "not exportable"
        raise TraceError(_explain(exc, name or type(model).__name__)) from exc
    return graph_from_exported(exported, name=name or type(model).__name__, strip_prefix=prefix)


def to_meta(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        return self.loss_fn(self.model(*inputs), *inputs)


def graph_from_exported(exported: "torch.export.ExportedProgram", *, name: str = "",
                        strip_prefix: str = "") -> OpGraph:
    """Convert an ExportedProgram's graph into OpNodes (FLOPs, bytes, parameter fqns, module paths)."""
    sig = exported.graph_signature
    param_of = dict(sig.inputs_to_parameters)
    buffer_of = dict(sig.inputs_to_buffers)

    def fqn(s: str) -> str:
        return s[len(strip_prefix):] if strip_prefix and s.startswith(strip_prefix) else s

    nodes: list[OpNode] = []
    param_placeholder: dict[str, str] = {}
    for fx_node in exported.graph.nodes:
        if fx_node.op == "placeholder":
            if fx_node.name in param_of:
                kind, target = NodeKind.PARAMETER, fqn(param_of[fx_node.name])
                param_placeholder[fx_node.name] = target
            elif fx_node.name in buffer_of:
                kind, target = NodeKind.BUFFER, fqn(buffer_of[fx_node.name])
            else:
                kind, target = NodeKind.INPUT, fx_node.name
            nodes.append(OpNode(fx_node.name, kind, target, outputs=_metas(fx_node.meta.get("val"))))
        elif fx_node.op == "call_function":
            nodes.append(_op_node(fx_node, param_placeholder, fqn))
        elif fx_node.op == "output":
            refs, args = _refs_and_args(fx_node.args[0])
            nodes.append(OpNode(fx_node.name, NodeKind.OUTPUT, "output", inputs=refs,
                                input_metas=tuple(_meta_of_ref(nodes, r) for r in refs), args=(args,)))
        else:
            raise TraceError(f"unexpected fx node {fx_node.op} {fx_node.target} in the exported graph")
    return OpGraph(nodes, model_name=name, exported=exported)


def _op_node(fx_node: torch.fx.Node, param_placeholder: dict[str, str], fqn) -> OpNode:
    target = _target_name(fx_node.target)
    if fx_node.target is operator.getitem:
        src, index = fx_node.args
        refs, args = (TensorRef(src.name, int(index)),), (TensorRef(src.name, int(index)), index)
    else:
        refs, args = _refs_and_args(fx_node.args)
    kw_refs, kwargs = _refs_and_args(fx_node.kwargs)
    refs = refs + kw_refs
    outputs = _metas(fx_node.meta.get("val"))
    by_name = {n.name: n for n in fx_node.all_input_nodes}
    input_metas = tuple(_metas(by_name[r.node].meta.get("val"))[r.index] for r in refs)
    short = target.split(".")[1] if target.startswith("aten.") else target
    read, written = op_bytes(short, input_metas, outputs)
    stack = fx_node.meta.get("nn_module_stack") or {}
    module_path, module_type = ("", "")
    if stack:
        path, mtype = list(stack.values())[-1]
        module_path = path
        module_type = getattr(mtype, "__name__", str(mtype)).rsplit(".", 1)[-1]
    return OpNode(
        name=fx_node.name, kind=NodeKind.OP, target=target, inputs=refs, input_metas=input_metas,
        outputs=outputs, args=args, kwargs=kwargs,
        flops=op_flops(short, input_metas, outputs, args), bytes_read=read, bytes_written=written,
        params=tuple(param_placeholder[r.node] for r in refs if r.node in param_placeholder),
        module_path=fqn(module_path), module_type=module_type,
    )


def _target_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def _refs_and_args(value: Any) -> tuple[tuple[TensorRef, ...], Any]:
    """Replace fx Nodes inside (nested) args with TensorRefs; return the refs in order too."""
    refs: list[TensorRef] = []

    def walk(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            ref = TensorRef(v.name, 0)
            refs.append(ref)
            return ref
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    walked = walk(value)
    return tuple(refs), walked


def _metas(val: Any) -> tuple[TensorMeta, ...]:
    if isinstance(val, torch.Tensor):
        return (TensorMeta(tuple(val.shape), str(val.dtype).removeprefix("torch.")),)
    if isinstance(val, (list, tuple)):
        return tuple(
            TensorMeta(tuple(v.shape), str(v.dtype).removeprefix("torch."))
            if isinstance(v, torch.Tensor) else TensorMeta((), "none")
            for v in val
        )
    return ()  # a node that returns nothing (e.g. an in-place update's unused result) or a scalar


def _meta_of_ref(nodes: list[OpNode], ref: TensorRef) -> TensorMeta:
    for n in reversed(nodes):
        if n.name == ref.node:
            return n.outputs[ref.index] if ref.index < len(n.outputs) else TensorMeta((), "none")
    raise TraceError(f"output refers to unknown node {ref.node!r}")


def _explain(exc: Exception, model_name: str) -> str:
    text = f"{type(exc).__name__}: {exc}"
    first = text.strip().splitlines()[0][:400]
    hint = next((h for key, h in _HINTS if key.lower() in text.lower()), None)
    hint = hint or "simplify forward() to static tensor code (no data-dependent branches, no .item())"
    return f"cannot trace {model_name} with torch.export: {first}\n  what to do: {hint}"
