"""Simulated-shard harness: execute an SBP signature on fake devices and compare with the full op.

For a traced OpNode, a Signature and a mesh shape, ``check_signature``
1. makes random full inputs (float64; integer ids in range for embedding/loss targets),
2. cuts each input per its NdSbp for every device coordinate (S: chunk per axis in order;
   B: copy; P: random addends that sum to the tensor, drawn per piece so the test is real),
3. runs on each device what the executor runs: ``autoddl.ops.local_callable`` with
   ``autoddl.ops.local_args`` (shape arguments rewritten to local shapes),
4. assembles every output per its NdSbp (concatenate for S, sum for P, copies must agree
   for B) and compares with the unsharded op; inputs an op mutates (batch_norm's running
   stats, in-place ops) are compared the same way,
5. checks the backward rule of DESIGN.md: given output gradients laid out S(d) for S(d)
   and B for B or P, the local input gradients read as S(d) for an S(d) input, B for a P
   input, and for a B input B when every output is B on that axis, else P.
Random ops are made deterministic (dropout p = 0) so that sharded and full runs agree.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Sequence

import torch

import autoddl.ops as rules
from autoddl.graph import NodeKind, OpNode, TensorMeta, TensorRef
from autoddl.sbp import Broadcast, NdSbp, Partial, Signature, Split

torch.set_num_threads(1)  # tiny ops: threads only contend on a shared machine (40x slower seen)

POSITIVE_OPS = {"log", "sqrt", "rsqrt", "pow", "log1p", "reciprocal", "batch_norm", "div", "div_",
                "binary_cross_entropy"}
_DTYPES = {"float64": torch.float64, "float32": torch.float64, "float16": torch.float64,
           "bfloat16": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
           "uint8": torch.uint8, "int8": torch.int8}


# -- inputs ----------------------------------------------------------------------------------
def make_inputs(node: OpNode, gen: torch.Generator) -> list[torch.Tensor]:
    """Random full inputs with values valid for the op (ids in range, positive where needed)."""
    out = []
    for slot, meta in enumerate(node.input_metas):
        dtype = _DTYPES.get(meta.dtype)
        if dtype is None:
            raise ValueError(f"shard_sim: no test values for dtype {meta.dtype} (node {node.name})")
        shape = meta.shape
        if dtype.is_floating_point:
            if node.op_name in POSITIVE_OPS or (node.op_name == "binary_cross_entropy" and slot == 1):
                t = torch.rand(shape, generator=gen, dtype=dtype) * 0.8 + 0.1
            else:
                t = torch.randn(shape, generator=gen, dtype=dtype)
            if node.op_name == "scaled_dot_product_attention" and slot == 3:
                t = t.clamp(-1, 1)
        elif dtype is torch.bool:
            t = torch.rand(shape, generator=gen) < 0.7
            if node.op_name == "scaled_dot_product_attention" and t.ndim >= 1:
                t[..., 0] = True  # no fully masked row (it would give NaN)
        else:
            t = torch.randint(0, _int_high(node, slot), shape, generator=gen, dtype=dtype)
        out.append(t)
    return out


def _int_high(node: OpNode, slot: int) -> int:
    metas = node.input_metas
    if node.op_name == "embedding" and slot == 1:
        return metas[0].shape[0]
    if node.op_name in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d") and slot == 1:
        return metas[0].shape[1] if metas[0].ndim >= 2 else metas[0].shape[0]
    if node.op_name == "index_select" and slot == 1:
        return metas[0].shape[rules.registry.norm_dim(rules.registry.bound_args(node)["dim"], metas[0].ndim)]
    return 4


# -- cutting and assembling ------------------------------------------------------------------
def coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def shard(full: torch.Tensor, nd: NdSbp, mesh_shape: Sequence[int], gen: torch.Generator) -> dict:
    """Each device's piece of ``full`` under ``nd`` (P: random addends, drawn per piece)."""
    pieces: dict[tuple, torch.Tensor] = {(): full}
    for sbp, n in zip(nd, mesh_shape):
        nxt = {}
        for prefix, t in pieces.items():
            if isinstance(sbp, Split):
                parts = torch.chunk(t, n, dim=sbp.dim)
            elif isinstance(sbp, Broadcast):
                parts = [t.clone() for _ in range(n)]
            else:
                rand = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
                parts = rand + [t - sum(rand, torch.zeros_like(t))]
            for i, p in enumerate(parts):
                nxt[prefix + (i,)] = p.clone(memory_format=torch.contiguous_format)
        pieces = nxt
    return pieces


def assemble(pieces: dict, nd: NdSbp, mesh_shape: Sequence[int], what: str, rtol: float, atol: float):
    """The logical tensor from device pieces (S: concatenate, P: sum, B: copies must agree)."""
    for axis in reversed(range(len(mesh_shape))):
        sbp, groups = nd[axis], {}
        for c, t in sorted(pieces.items()):
            groups.setdefault(c[:axis], []).append(t)
        merged = {}
        for prefix, parts in groups.items():
            if isinstance(sbp, Split):
                merged[prefix] = torch.cat(parts, dim=sbp.dim)
            elif isinstance(sbp, Partial):
                merged[prefix] = sum(parts[1:], parts[0])
            else:
                for i, p in enumerate(parts[1:], 1):
                    if not _close(p, parts[0], rtol, atol):
                        raise AssertionError(f"{what}: B on mesh axis {axis} but device {prefix + (i,)} "
                                             f"holds a different value than device {prefix + (0,)}")
                merged[prefix] = parts[0]
        pieces = merged
    return pieces[()]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        return torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return torch.equal(a, b)


# -- running ---------------------------------------------------------------------------------
def fill(value: Any, tensors: Sequence[torch.Tensor], counter: list) -> Any:
    """Replace TensorRefs (in argument order) by ``tensors``; devices become cpu."""
    if isinstance(value, TensorRef):
        counter[0] += 1
        return tensors[counter[0] - 1]
    if isinstance(value, torch.device):
        return torch.device("cpu")
    if isinstance(value, list):
        return [fill(v, tensors, counter) for v in value]
    if isinstance(value, tuple):
        return tuple(fill(v, tensors, counter) for v in value)
    if isinstance(value, dict):
        return {k: fill(v, tensors, counter) for k, v in value.items()}
    return value


def _deterministic(node: OpNode, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if node.op_name in ("dropout", "native_dropout", "feature_dropout"):
        args = (args[0], 0.0) + tuple(args[2:])
    if node.op_name == "scaled_dot_product_attention":
        kwargs = dict(kwargs)
        if len(args) > 4:
            args = args[:4] + (0.0,) + tuple(args[5:])
        elif "dropout_p" in kwargs:
            kwargs["dropout_p"] = 0.0
    return args, kwargs


def call(node: OpNode, fn, args: tuple, kwargs: dict, tensors: Sequence[torch.Tensor]) -> list:
    counter = [0]
    a = fill(args, tensors, counter)
    k = fill(kwargs, tensors, counter)
    a, k = _deterministic(node, a, k)
    result = fn(*a, **k)
    if isinstance(result, torch.Tensor):
        return [result]
    if result is None:
        return []
    return list(result)


def _tol(t: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol): float64 results must match to 1e-9; a result cast to a lower precision
    (``_to_copy(dtype=float32)``) to that precision's rounding."""
    if t.dtype.is_floating_point and t.dtype != torch.float64:
        return 1e-5, 1e-6
    return 1e-7, 1e-9


def _needs_grad(node: OpNode, slot: int, t: torch.Tensor) -> bool:
    if not t.dtype.is_floating_point:
        return False
    if node.op_name == "batch_norm" and slot >= 3:   # running stats: updated, not differentiated
        return False
    return True


def _grad_flags(node: OpNode, full_in: list[torch.Tensor]) -> list[bool]:
    """Which inputs to differentiate: floating ones, minus those aten says have no gradient
    (class weights of nll_loss, pos_weight of bce, ...)."""
    flags = [_needs_grad(node, i, x) for i, x in enumerate(full_in)]
    for _ in range(len(flags)):
        try:
            args = [x.clone().requires_grad_(f).clone() for x, f in zip(full_in, flags)]
            call(node, rules.aten_op(node), tuple(node.args), dict(node.kwargs), args)
            return flags
        except RuntimeError as exc:
            m = re.search(r"not differentiable with respect to argument '(\w+)'", str(exc))
            slot = rules.registry.tensor_slot(node, m.group(1)) if m else None
            if slot is None or not flags[slot]:
                raise
            flags[slot] = False
    return flags


def check_signature(node: OpNode, sig: Signature, mesh_shape: Sequence[int], seed: int = 0,
                    backward: bool = True) -> None:
    """Raise AssertionError unless ``sig`` executed on ``mesh_shape`` reproduces the full op."""
    mesh_shape = tuple(mesh_shape)
    gen = torch.Generator().manual_seed(seed)
    what = f"{node.name} ({node.target}) {sig} on mesh {mesh_shape}"
    full_in = make_inputs(node, gen)
    flags = _grad_flags(node, full_in) if backward else [False] * len(full_in)
    leaves = [t.clone().requires_grad_(f) for t, f in zip(full_in, flags)]
    full_args = [t.clone() if t.requires_grad else t.clone() for t in leaves]
    op = rules.aten_op(node)
    full_out = call(node, op, tuple(node.args), dict(node.kwargs), full_args)

    cut = [shard(t, nd, mesh_shape, gen) for t, nd in zip(full_in, sig.inputs)]
    l_args, l_kwargs = rules.local_args(node, sig, mesh_shape)
    dev_leaves, dev_args, dev_out = {}, {}, {}
    for c in coords(mesh_shape):
        dev_leaves[c] = [cut[i][c].requires_grad_(leaves[i].requires_grad) for i in range(len(cut))]
        dev_args[c] = [t.clone() for t in dev_leaves[c]]
        fn = rules.local_callable(node, sig, mesh_shape, c)
        try:
            dev_out[c] = call(node, fn, l_args, l_kwargs, dev_args[c])
        except Exception as exc:
            raise AssertionError(f"{what}: device {c} failed: {type(exc).__name__}: {exc}") from exc

    for i, meta in enumerate(node.outputs):
        if meta.dtype == "none" or i >= len(full_out):
            continue
        rtol, atol = _tol(full_out[i])
        got = assemble({c: dev_out[c][i] for c in dev_out}, sig.outputs[i], mesh_shape, f"{what} output {i}",
                       rtol, atol)
        if not _close(got, full_out[i].detach(), rtol, atol):
            raise AssertionError(f"{what}: output {i} differs from the unsharded op "
                                 f"(max abs err {_err(got, full_out[i])})")
    for i, nd in enumerate(sig.inputs):   # inputs the op mutated
        if not torch.equal(full_args[i].detach(), full_in[i]):
            got = assemble({c: dev_args[c][i].detach() for c in dev_args}, nd, mesh_shape,
                           f"{what} mutated input {i}", 1e-7, 1e-9)
            if not _close(got, full_args[i].detach(), 1e-7, 1e-9):
                raise AssertionError(f"{what}: mutated input {i} differs from the unsharded op")

    if backward:
        _check_backward(node, sig, mesh_shape, gen, what, leaves, full_out, dev_leaves, dev_out)


def _err(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return f"{(a.double() - b.double()).abs().max().item():.3g}"


def _check_backward(node, sig, mesh_shape, gen, what, leaves, full_out, dev_leaves, dev_out) -> None:
    diff_outs = [i for i, t in enumerate(full_out) if t.requires_grad and t.dtype.is_floating_point]
    wrt = [i for i, t in enumerate(leaves) if t.requires_grad]
    if not diff_outs or not wrt:
        return
    grads_out = [torch.randn(full_out[i].shape, generator=gen, dtype=full_out[i].dtype) for i in diff_outs]
    full_g = torch.autograd.grad([full_out[i] for i in diff_outs], [leaves[i] for i in wrt], grads_out,
                                 allow_unused=True)
    # gradient layout of each output: S(d) for S(d), B for B or P
    cut_g = [shard(g, NdSbp(tuple(s if isinstance(s, Split) else Broadcast() for s in sig.outputs[i])),
                   mesh_shape, gen) for g, i in zip(grads_out, diff_outs)]
    dev_g = {}
    for c in dev_out:
        outs = [dev_out[c][i] for i in diff_outs]
        dev_g[c] = torch.autograd.grad(outs, [dev_leaves[c][i] for i in wrt], [g[c] for g in cut_g],
                                       allow_unused=True)
    for k, i in enumerate(wrt):
        layout = []
        for axis, s in enumerate(sig.inputs[i]):
            if isinstance(s, Split):
                layout.append(s)
            elif isinstance(s, Partial):
                layout.append(Broadcast())
            else:
                out_b = all(isinstance(o[axis], Broadcast) for o in sig.outputs)
                layout.append(Broadcast() if out_b else Partial())
        pieces = {c: (g[k] if g[k] is not None else torch.zeros_like(dev_leaves[c][i])) for c, g in dev_g.items()}
        got = assemble(pieces, NdSbp(tuple(layout)), mesh_shape, f"{what} grad of input {i}", 1e-7, 1e-9)
        want = full_g[k] if full_g[k] is not None else torch.zeros_like(leaves[i])
        if not _close(got, want, 1e-7, 1e-9):
            raise AssertionError(f"{what}: gradient of input {i} (read as {NdSbp(tuple(layout))}) differs "
                                 f"from the unsharded op (max abs err {_err(got, want)})")


def check_all(node: OpNode, mesh_shape: Sequence[int], seed: int = 0, backward: bool = True) -> int:
    """Check every candidate signature of ``node`` on ``mesh_shape``; returns how many ran."""
    sigs = rules.candidate_signatures(node, mesh_shape)
    for k, sig in enumerate(sigs):
        check_signature(node, sig, mesh_shape, seed=seed + k, backward=backward)
    return len(sigs)


# -- hand-made nodes -------------------------------------------------------------------------
def make_node(target: str, *args: Any, **kwargs: Any) -> OpNode:
    """An OpNode for one aten call, as ``autoddl.trace`` makes it, without the cost of an export.

    Tensors in ``args``/``kwargs`` (any device; only shape and dtype are used) become
    TensorRefs ``in0, in1, ...`` in argument order; outputs come from running the op on meta."""
    metas: list[TensorMeta] = []
    refs: list[TensorRef] = []

    def to_ref(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            refs.append(TensorRef(f"in{len(refs)}"))
            metas.append(TensorMeta(tuple(v.shape), str(v.dtype).removeprefix("torch.")))
            return refs[-1]
        if isinstance(v, (list, tuple)):
            return type(v)(to_ref(x) for x in v)
        return v

    def to_meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to("meta")
        if isinstance(v, (list, tuple)):
            return type(v)(to_meta(x) for x in v)
        return v

    node_args, node_kwargs = to_ref(tuple(args)), {k: to_ref(v) for k, v in kwargs.items()}
    probe = OpNode("probe", NodeKind.OP, target)
    out = rules.aten_op(probe)(*to_meta(args), **{k: to_meta(v) for k, v in kwargs.items()})
    outs = [out] if isinstance(out, torch.Tensor) else [] if out is None else list(out)
    outputs = tuple(TensorMeta(tuple(o.shape), str(o.dtype).removeprefix("torch.")) for o in outs)
    return OpNode(target.split(".")[1], NodeKind.OP, target, inputs=tuple(refs), input_metas=tuple(metas),
                  outputs=outputs, args=node_args, kwargs=node_kwargs)
