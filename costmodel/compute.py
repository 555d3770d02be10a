"""Compute time of one op on its local shard (roofline), forward + backward, and the optimizer step.

Roofline: ``max(flops / (peak * eff_compute), bytes / (mem_bw * eff_memory)) + op_overhead``, with
``peak`` the device's peak in the dtype the op computes in (``compute_dtype``: bfloat16 under a
bf16 policy, since the graph is traced under it).
``eff_compute`` is ``cluster.efficiency.compute``, or, when the cluster has a
measured ``compute_curve`` (``autoddl calibrate``), the curve's efficiency at the
FLOPs of one op (piecewise-linear in log FLOPs, flat beyond its ends): small
matmuls reach a smaller fraction of peak than large ones.
Local work = full work / product of the mesh sizes of the axes that divide it.
An axis divides an op's work when some input or output is ``S`` on it (a
contracted split gives ``P`` outputs but still splits the work). An axis where
everything is ``B`` or ``P`` does not: replicated compute, and ``add(P, P) -> P``
or ``mul(P, B) -> P`` run full-size on every device.

Backward by op family (the same roofline on the scaled work, plus one overhead):
matmul-like ops (mm, addmm, linear, bmm, matmul, conv, SDPA) 2x the forward
FLOPs and bytes (grad of input and grad of weight); every other op 1x; views,
getitem and copies-by-view (autoddl.flops.VIEW_OPS) cost 0, forward and
backward, no launch overhead either. An op none of whose inputs needs a
gradient has no backward (``needs_backward=False``).

Attention (``cluster.efficiency.attention``, when set): a fused attention op (``SDPA_OPS``) is
priced as a FlashAttention kernel, in FlashAttention-2's own FLOP count (Dao, arXiv:2307.08691,
section 4.1), the count the field's published fractions are measured in: forward FLOPs halved when
the op is causal ("only half of the entries are calculated"), backward 2.5 x the forward ("2 matmuls in
the forward pass and 5 matmuls in the backward pass, due to recomputation"), both at ``attention`` x
the dtype's peak (the memory roofline as for any op), plus the op's overhead
(:func:`attention_time_s`). Without the field it is one more matmul-like op (2 x backward, full
FLOPs, ``compute``), as CPU clusters price it. Under ``Training.attention = "unfused"`` an attention
op is instead the separate kernels of autoddl/attention.py (:func:`unfused_attention_time_s`): its
batched matmuls at the matmul roofline (``compute`` or the compute curve at each matmul's FLOPs, full
FLOPs: an unfused kernel computes the masked half too) and its softmax / dropout passes over the
scores at the memory roofline, whatever ``efficiency.attention`` says; one op overhead as before.

Long softmax rows on CUDA (:func:`long_row_passes`): a loss over a vocabulary, or a softmax over a row
that one block's shared memory cannot hold, runs kernels that read the row from memory several times;
on a CUDA device such an op moves the passes ``CUDA_LONG_ROW_PASSES`` counts from the kernels' source
instead of its traced bytes (a family the cluster file measured keeps its measured multiples).

Emulated dtypes' linears (``cluster.matmul_layouts``, autoddl/matmul_layouts.py): a ``linear`` computing
in a dtype the cluster file has a measured layout table for takes its three products' measured times
(forward ``x @ W^T``; backward ``g @ W`` and ``g^T @ x``, on the device's share of M, K and N) instead of
its roofline and its family's work multiples, plus the family's fixed cost (:func:`layout_linear_s`).

Executor overheads (``cluster.executor``, 0 unless calibrated): autoddl's executor runs
every op, views included, as one call of its compiled local program. An op whose family
``autoddl calibrate`` measured (``executor.op_us`` / ``op_work`` for the op's compute dtype, else
float32: the op itself, its in-place op's, or its family's representative, e.g. ``mm`` ->
``linear``; ``ExecutorOverheads.op_cost``) takes ``forward_us + forward_work * roofline``
forward and ``backward_us + backward_work * backward roofline + param_us * parameters read``
backward: the family's measured fixed cost replaces ``op_overhead_us`` and the scalar per-op and
per-input fields, and its work scales (``OpCost.work_at`` the op's forward roofline time: the
family's measured curve) say how many times the roofline its kernels really take at that size
(views: the fixed cost alone). Any other op pays the roofline, ``op_overhead_us`` and
``op_forward_us + input_forward_us * inputs`` forward and, when it has a backward,
``op_backward_us + input_backward_us * inputs + param_us * parameters read`` backward (a
parameter use's leaf, its grad sync to storage and its optimizer share). ``getitem`` runs no
op and pays nothing.

Activation recompute (``executor.recompute`` per policy, :func:`recompute_overhead_s`): an op of a
checkpointed block pays the checkpoint's per-op forward cost, a recomputed op its per-op cost beyond
running its forward again, an op whose output selective recompute keeps its lookup, and each block
its own cost once forward and once when its recompute starts.

Time-sharing: on a CPU cluster whose nodes run fewer ranks at once than a mesh puts on
them (``cluster.cores_per_node``), every op's time is multiplied by
``cluster.time_sharing(mesh_shape)`` (ranks per node / cores_per_node).
"""

from __future__ import annotations

import math
from typing import Sequence

from autoddl.attention import unfused_passes
from autoddl.cluster import OPTIMIZER_KINDS, Cluster, OpCost
from autoddl.op_families import MATMUL_LIKE, SDPA_OPS, ZERO_COST  # noqa: F401  (read from here too)
from autoddl.graph import OpNode
from autoddl.matmul_layouts import linear_matmuls, local_linear_dims
from autoddl.precision import itemsize
from autoddl.program import work_divisor  # noqa: F401  (re-exported: the search prices with it)
from autoddl.sbp import Signature


OPTIMIZERS = OPTIMIZER_KINDS
_OPTIMIZER_ALIASES = {"sgd": "sgd", "adamw": "adamw", "adam": "adamw"}


def optimizer_kind(optimizer: str) -> str:
    """The optimizer family ``optimizer`` names (``OPTIMIZERS``; "adam" reads as "adamw"), case-blind."""
    kind = _OPTIMIZER_ALIASES.get(str(optimizer).lower())
    if kind is None:
        raise ValueError(f"unknown optimizer {optimizer!r} (Plan.optimizer); choose one of {OPTIMIZERS}")
    return kind


def backward_factor(op_name: str) -> float:
    """Backward work as a multiple of the forward work: 2 matmul-like, 0 views, 1 otherwise."""
    if op_name in ZERO_COST:
        return 0.0
    return 2.0 if op_name in MATMUL_LIKE else 1.0


def compute_efficiency(op_flops: float, cluster: Cluster) -> float:
    """Fraction of peak one op of ``op_flops`` FLOPs reaches: the compute curve, else ``efficiency.compute``."""
    curve = cluster.compute_curve
    if not curve or op_flops <= 0:
        return cluster.efficiency.compute
    x = math.log(op_flops / 1e9)
    xs = [math.log(g) for g, _ in curve]
    if x <= xs[0]:
        return curve[0][1]
    if x >= xs[-1]:
        return curve[-1][1]
    i = next(i for i in range(1, len(xs)) if x <= xs[i])
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return curve[i - 1][1] + w * (curve[i][1] - curve[i - 1][1])


def compute_dtype(node: OpNode) -> str:
    """The dtype an op computes in, whose peak it runs at: its first floating input's (a matmul of
    bfloat16 operands), else its first floating output's; float32 for anything else (float64,
    complex: priced at the float32 peak, the nearest one cluster files give)."""
    metas = list(node.input_metas) + list(node.outputs)
    dtype = next((m.dtype for m in metas if m.is_floating), "float32")
    return dtype if dtype in ("bfloat16", "float16") else "float32"


def roofline_time_s(flops: float, nbytes: float, cluster: Cluster, op_flops: float | None = None,
                    dtype: str = "float32") -> float:
    """max(compute time, memory time) on one device, without overhead, computing in ``dtype``.

    ``op_flops``: FLOPs of one op, where the compute curve is read (default ``flops``;
    a matmul's backward is 2 ops of the forward's size, not one of twice the size).
    """
    dev, eff = cluster.device, cluster.efficiency
    eff_compute = compute_efficiency(flops if op_flops is None else op_flops, cluster)
    return max(flops / (dev.peak_tflops_for(dtype) * 1e12 * eff_compute),
               nbytes / (dev.memory_bandwidth_gbps * 1e9 * eff.memory))


ATTENTION_BACKWARD_FACTOR = 2.5   # FlashAttention-2 (arXiv:2307.08691, 4.1): 5 backward matmuls vs 2 forward
_SDPA_IS_CAUSAL_ARG = 5            # scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, ...)


def is_causal(node: OpNode) -> bool:
    """Whether an attention op masks causally (its ``is_causal`` argument, keyword or positional)."""
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    return len(node.args) > _SDPA_IS_CAUSAL_ARG and node.args[_SDPA_IS_CAUSAL_ARG] is True


def attention_time_s(node: OpNode, flops: float, nbytes: float, cluster: Cluster, backward: bool) -> float | None:
    """Roofline seconds of one fused attention op's local work (``flops``, ``nbytes``: its forward's)
    under ``efficiency.attention`` (module docstring), forward or backward, without overhead; None
    when the op is no attention op or the cluster gives no attention efficiency."""
    eff = cluster.efficiency.attention
    if eff is None or node.op_name not in SDPA_OPS:
        return None
    work = (0.5 if is_causal(node) else 1.0) * (ATTENTION_BACKWARD_FACTOR if backward else 1.0)
    dev = cluster.device
    return max(work * flops / (dev.peak_tflops_for(compute_dtype(node)) * 1e12 * eff),
               (2.0 if backward else 1.0) * nbytes / (dev.memory_bandwidth_gbps * 1e9 * cluster.efficiency.memory))


def unfused_attention_time_s(node: OpNode, divisor: float, cluster: Cluster, backward: bool) -> float:
    """Roofline seconds of one attention op run unfused (autoddl/attention.py ``unfused_passes``), its
    local share 1 / ``divisor``, forward or backward, without overhead: each pass at
    :func:`roofline_time_s` (its own FLOPs on the compute curve; elementwise passes memory-bound)."""
    dtype = compute_dtype(node)
    return sum(roofline_time_s(p.flops, p.nbytes, cluster, dtype=dtype)
               for p in unfused_passes(node, divisor, backward=backward))


def _attention_work_s(node: OpNode, divisor: float, flops: float, nbytes: float, cluster: Cluster,
                      backward: bool, attention: str) -> float | None:
    """An attention op's work seconds under the ``attention`` setting (module docstring); None for
    any other op, or flash attention on a cluster without ``efficiency.attention``."""
    if attention == "unfused" and node.op_name in SDPA_OPS:
        return unfused_attention_time_s(node, divisor, cluster, backward)
    return attention_time_s(node, flops, nbytes, cluster, backward)


def executor_cost(node: OpNode, cluster: Cluster) -> OpCost | None:
    """The measured cost of ``node``'s op family in its compute dtype (module docstring), or None."""
    if not cluster.executor.op_us:
        return None
    return cluster.executor.op_cost(node.op_name, compute_dtype(node))


def executor_forward_s(node: OpNode, cluster: Cluster) -> float:
    """The executor's fixed forward cost of one op: its family's measured one, else per op plus per
    tensor input (0 for getitem)."""
    if not node.is_op or node.op_name == "getitem":
        return 0.0
    fam = executor_cost(node, cluster)
    if fam is not None:
        return fam.forward_us * 1e-6
    ex = cluster.executor
    return (ex.op_forward_us + ex.input_forward_us * len(node.inputs)) * 1e-6


def forward_time_s(op_name: str, dtype: str, work_s: float, cluster: Cluster, inputs: int = 1,
                   measured: bool = True) -> float:
    """Forward seconds on one device of an op of family ``op_name`` computing in ``dtype`` whose
    roofline time is ``work_s``: the family's measured work scale times ``work_s`` plus its fixed
    cost (unless not ``measured``: a family whose measurement does not describe this op), else
    ``work_s`` plus ``op_overhead_us`` and the executor's per-op and per-input costs.
    Graph ops (:func:`op_forward_time_s`) and the master passes (costmodel/master_passes.py) both
    price through it."""
    ex = cluster.executor
    fam = ex.op_cost(op_name, dtype) if ex.op_us and measured else None
    if fam is not None:
        return fam.work_at(work_s * 1e6)[0] * work_s + fam.forward_us * 1e-6
    return work_s + (cluster.op_overhead_us + ex.op_forward_us + ex.input_forward_us * inputs) * 1e-6


def executor_backward_s(node: OpNode, cluster: Cluster) -> float:
    """The executor's fixed backward cost of one op: its family's measured one, else per op and per
    tensor input; plus per parameter read (0 for getitem)."""
    if not node.is_op or node.op_name == "getitem":
        return 0.0
    ex = cluster.executor
    fam = executor_cost(node, cluster)
    fixed = fam.backward_us if fam is not None else ex.op_backward_us + ex.input_backward_us * len(node.inputs)
    return (fixed + ex.param_us * len(node.params)) * 1e-6


def recompute_overhead_s(node: OpNode, policy: str, phase: str, recomputed: bool, cluster: Cluster,
                         first_in_block: bool = False) -> float:
    """What checkpointing under ``policy`` adds to one task of an op in a checkpointed block
    (``executor.recompute``, per matmul-like op or other op): ``forward``: its forward share;
    ``recompute``: its backward share beyond the forward it runs again; ``backward`` of an op the
    block does not recompute (``recomputed`` False): a kept (matmul-like) output's backward share, a
    view's forward fixed cost and backward share (selective recompute runs views again all the
    same). ``first_in_block``: the block's first forward task / first recompute task, which also pays
    the block's own cost. 0 outside a block (policy none), for getitem, and for the backward task of
    a recomputed op (its recompute task pays). Seconds on one rank running alone (the caller applies
    ``cluster.time_sharing``)."""
    if policy == "none" or not node.is_op:
        return 0.0
    cost = cluster.executor.recompute_cost(policy)
    matmul = node.op_name in MATMUL_LIKE
    block = 0.0
    if phase == "forward":
        block = cost.block_forward_us if first_in_block else 0.0
        per_op = cost.matmul_forward_us if matmul else cost.op_forward_us
    elif phase == "recompute":
        block = cost.block_backward_us if first_in_block else 0.0
        per_op = cost.matmul_backward_us if matmul else cost.op_backward_us
    elif recomputed:
        per_op = 0.0
    elif node.op_name in ZERO_COST:
        return (0.0 if node.op_name == "getitem" else executor_forward_s(node, cluster) + cost.op_backward_us * 1e-6)
    else:
        per_op = cost.matmul_backward_us if matmul else cost.op_backward_us
    return (block + (0.0 if node.op_name == "getitem" else per_op)) * 1e-6


# CUDA's softmax kernels (aten/src/ATen/native/cuda/SoftMax.cu, ``host_softmax``): a row of more than
# 1024 elements that one block's default shared memory (``sharedMemPerBlock``, 48 KB) cannot hold runs
# ``cunn_SoftMaxForward``, which reads the row three times (its max, its sum of exponentials, the
# output's epilogue) and writes it once; the backward, ``cunn_SoftMaxBackward``, reads the gradient twice
# (its sum, the epilogue) and the output once and writes once. Such a row's bytes, forward and backward,
# in passes over the op's first input (the traced bytes count one read of each input, one write of
# each output, and the backward as much again):
# - cross_entropy_loss of 2-D logits (N, C): log_softmax's 3 reads + 1 write of the log-probabilities;
#   backward: nll_loss_backward's zero-filled (N, C) gradient (1 write) + log_softmax's backward (4);
# - log_softmax: 4 and 4; softmax: 4 and 7 (its backward first forms grad * output: 2 reads, 1 write).
# Rows the shared memory holds (one read, one write) keep their traced bytes (their backward, the same
# cunn_SoftMaxBackward above 1024 elements, reads its gradient twice: left out); so does every op of a
# family whose cost the cluster file measured (``executor.op_work``: multiples of the traced roofline).
CUDA_LONG_ROW_PASSES = {"cross_entropy_loss": (4.0, 5.0), "log_softmax": (4.0, 4.0),
                        "_log_softmax": (4.0, 4.0), "softmax": (4.0, 7.0), "_softmax": (4.0, 7.0),
                        "_safe_softmax": (4.0, 7.0)}
CUDA_SHARED_MEMORY_PER_BLOCK_BYTES = 48 * 1024
CUDA_PERSISTENT_SOFTMAX_ELEMENTS = 1024      # host_softmax's one-warp-per-row kernel up to this row


def long_row_passes(node: OpNode, cluster: Cluster) -> tuple[float, float] | None:
    """(forward, backward) passes over ``node``'s first input when a CUDA softmax kernel reads its rows
    from memory several times (``CUDA_LONG_ROW_PASSES``), else None: not on a CUDA device, another
    op, a row that fits, a softmax over another dim, or a family the cluster measured."""
    passes = CUDA_LONG_ROW_PASSES.get(node.op_name)
    if passes is None or cluster.device.kind != "cuda" or executor_cost(node, cluster) is not None:
        return None
    rows = node.input_metas[0]
    if node.op_name == "cross_entropy_loss":
        last_dim = rows.ndim == 2
    else:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        last_dim = isinstance(dim, int) and dim in (-1, rows.ndim - 1)
    row = rows.shape[-1] if rows.ndim else 1
    fits = (row <= CUDA_PERSISTENT_SOFTMAX_ELEMENTS
            or row * itemsize(rows.dtype) <= CUDA_SHARED_MEMORY_PER_BLOCK_BYTES)
    return passes if last_dim and not fits else None


def kernel_bytes(node: OpNode, divisor: float, cluster: Cluster, backward: bool) -> float:
    """Bytes the kernels of ``node``'s local work move, forward or backward: its traced bytes (times
    :func:`backward_factor` backward), or a long softmax row's passes (:func:`long_row_passes`)."""
    passes = long_row_passes(node, cluster)
    if passes is not None:
        rows = node.input_metas[0]
        return passes[backward] * rows.numel * itemsize(rows.dtype) / divisor
    factor = backward_factor(node.op_name) if backward else 1.0
    return factor * (node.bytes_read + node.bytes_written) / divisor


def layout_linear_s(node: OpNode, sig: Signature, mesh_shape: Sequence[int], cluster: Cluster,
                    backward: bool) -> float | None:
    """A ``linear``'s forward product, or its two backward products, read from the cluster's measured
    layout table for its compute dtype (module docstring); None for any other op or dtype."""
    table = cluster.matmul_layouts.get(compute_dtype(node)) if cluster.matmul_layouts else None
    if table is None or node.op_name != "linear" or len(node.input_metas) < 2:
        return None
    x, w = node.input_metas[0].shape, node.input_metas[1].shape           # (..., K), (N, K)
    placements = [(sig.inputs[0][axis], sig.inputs[1][axis]) for axis in range(len(mesh_shape))]
    forward, *grads = linear_matmuls(*local_linear_dims(x, w, placements, mesh_shape))
    return sum(table.time_s(*mm) for mm in (grads if backward else [forward]))


def op_forward_time_s(node: OpNode, sig: Signature, mesh_shape: Sequence[int], cluster: Cluster,
                      attention: str = "flash") -> float:
    if not node.is_op:
        return 0.0
    share = cluster.time_sharing(tuple(mesh_shape))
    if node.op_name in ZERO_COST:
        return executor_forward_s(node, cluster) * share
    measured = layout_linear_s(node, sig, mesh_shape, cluster, backward=False)
    if measured is not None:      # the products' measured time, the family's fixed cost (its work at 0)
        return (measured + forward_time_s(node.op_name, compute_dtype(node), 0.0, cluster,
                                          inputs=len(node.inputs))) * share
    d = work_divisor(sig, mesh_shape)
    flops, nbytes = node.flops / d, (node.bytes_read + node.bytes_written) / d
    attn = _attention_work_s(node, d, flops, nbytes, cluster, False, attention)
    work = attn if attn is not None else roofline_time_s(flops, kernel_bytes(node, d, cluster, False), cluster,
                                                         dtype=compute_dtype(node))
    return forward_time_s(node.op_name, compute_dtype(node), work, cluster, inputs=len(node.inputs)) * share


def op_backward_time_s(node: OpNode, sig: Signature, mesh_shape: Sequence[int], cluster: Cluster,
                       attention: str = "flash") -> float:
    factor = backward_factor(node.op_name)
    if not node.is_op:
        return 0.0
    share = cluster.time_sharing(tuple(mesh_shape))
    if factor == 0:
        return executor_backward_s(node, cluster) * share
    fam = executor_cost(node, cluster)
    fixed_s = executor_backward_s(node, cluster) + (0.0 if fam is not None else cluster.op_overhead_us * 1e-6)
    measured = layout_linear_s(node, sig, mesh_shape, cluster, backward=True)
    if measured is not None:
        return (measured + fixed_s) * share
    d = work_divisor(sig, mesh_shape)
    flops, nbytes, dtype = node.flops / d, (node.bytes_read + node.bytes_written) / d, compute_dtype(node)
    attn = _attention_work_s(node, d, flops, nbytes, cluster, True, attention)
    work = attn if attn is not None else roofline_time_s(factor * flops, kernel_bytes(node, d, cluster, True),
                                                         cluster, op_flops=flops, dtype=dtype)
    if fam is not None:       # the work scale at the op's size: its forward roofline
        size_us = roofline_time_s(flops, nbytes, cluster, dtype=dtype) * 1e6
        return (fam.work_at(size_us)[1] * work + fixed_s) * share
    return (work + fixed_s) * share


def op_compute_time_s(node: OpNode, sig: Signature, mesh_shape: Sequence[int], cluster: Cluster,
                      needs_backward: bool = True, attention: str = "flash") -> float:
    """Forward + backward seconds of ``node`` run with signature ``sig`` on ``mesh_shape``
    (``attention``: ``Training.attention``)."""
    fwd = op_forward_time_s(node, sig, mesh_shape, cluster, attention)
    return fwd + (op_backward_time_s(node, sig, mesh_shape, cluster, attention) if needs_backward else 0.0)


def optimizer_bytes(param_bytes_local: float, param_numel_local: float, optimizer: str) -> float:
    """Bytes one optimizer step moves per device, as the executor runs it: torch's foreach
    implementation (executor/runtime.py ``LocalShardOptimizer``), pass by pass.

    SGD (no momentum, no weight decay): ``_foreach_add_(params, grads)``: read param + grad, write
    param = 3 x param bytes.
    AdamW (torch 2.13 torch/optim/adam.py ``_multi_tensor_adam``, not capturable): ``mul_`` (decoupled
    weight decay) and ``addcdiv_`` read and write the param (4 x param bytes); ``lerp_`` and
    ``addcmul_`` read the grad (2 x param bytes: the masters' gradients share their dtype); the fp32
    states: m by ``lerp_`` (read, write) and ``addcdiv_`` (read): 3 x 4 bytes; v by ``mul_``,
    ``addcmul_`` (read, write each) and ``sqrt`` (read): 5 x 4; the denominator ``sqrt`` writes,
    ``div_`` and ``add_`` (eps) read and write, ``addcdiv_`` reads: 6 x 4. In all 6 x param bytes +
    56 x numel (80 bytes per fp32 element, against 28 for a fused single pass).
    """
    kind = optimizer_kind(optimizer)
    if kind == "sgd":
        return 3.0 * param_bytes_local
    return 6.0 * param_bytes_local + 56.0 * param_numel_local


def optimizer_state_bytes(param_numel_local: float, optimizer: str) -> float:
    """Optimizer state kept per device: AdamW 2 fp32 states per element, SGD none."""
    kind = optimizer_kind(optimizer)
    return 8.0 * param_numel_local if kind == "adamw" else 0.0


def optimizer_time_s(param_bytes_local: float, param_numel_local: float, optimizer: str,
                     cluster: Cluster, mesh_shape: Sequence[int] | None = None) -> float:
    """Memory-bound optimizer step over the local parameters (:func:`optimizer_bytes`), slowed like
    every other compute by ``cluster.time_sharing(mesh_shape)`` when the mesh is given.

    Where the cluster file has the optimizer's measured step (``executor.optimizer_ns``: ns per float32
    element by local parameter count), that, scaled by :func:`optimizer_bytes` to the parameters' dtype;
    else the bytes at ``memory_bandwidth_gbps``, which is timed on arrays far beyond the caches: a step
    whose states fit in them runs faster (AdamW over 1M float32 elements, 2 ranks at once on the 2-core
    VM: 2.8 ms, 29 GB/s of :func:`optimizer_bytes`' 84 MB, against 15.8 GB/s measured over 128 MB arrays)."""
    share = cluster.time_sharing(tuple(mesh_shape)) if mesh_shape is not None else 1.0
    nbytes = optimizer_bytes(param_bytes_local, param_numel_local, optimizer)
    ns = cluster.executor.optimizer_ns_per_element(optimizer_kind(optimizer), param_numel_local)
    if ns is not None:
        fp32_bytes = optimizer_bytes(4.0 * param_numel_local, param_numel_local, optimizer)
        return share * param_numel_local * ns * 1e-9 * (nbytes / fp32_bytes if fp32_bytes else 1.0)
    return share * nbytes / (cluster.device.memory_bandwidth_gbps * 1e9 * cluster.efficiency.memory)
