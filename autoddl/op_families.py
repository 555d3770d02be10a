"""Op families: which aten ops (by ``OpNode.op_name``) behave alike, in one table.

The FLOP formulas (autoddl/flops.py), the cost model's backward work and fixed costs
(costmodel/compute.py) and the expert baselines (search/baselines.py) all read their
families from here, so an op joins a family once. The SBP rules register per op in
autoddl/ops/ (one file per family).
"""

from __future__ import annotations

# Ops that return a view or alias of their input: no FLOPs, no bytes.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "slice", "select",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "getitem", "alias",
    "detach", "flatten", "unflatten", "narrow", "as_strided", "view_as", "expand_as", "movedim",
    "tensor_split", "_assert_tensor_metadata", "_assert_scalar", "_assert_async",
})

# Ops that copy memory without arithmetic: no FLOPs, bytes moved.
COPY_OPS = frozenset({"clone", "_to_copy", "contiguous", "copy", "copy_", "lift_fresh_copy",
                      "cat", "stack", "index_select", "gather", "index", "repeat", "roll", "flip",
                      "pad", "constant_pad_nd"})

# dtype conversions: a copy when the dtype changes, an alias otherwise.
CAST_OPS = frozenset({"to", "type_as", "type"})

FACTORY_OPS = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "arange", "zeros",
                          "ones", "full", "empty", "scalar_tensor", "fill", "fill_", "triu", "tril",
                          "new_zeros", "new_ones", "new_full", "new_empty", "rand", "randn", "rand_like",
                          "randn_like", "randint"})

REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm",
                        "linalg_vector_norm", "prod", "logsumexp", "argmax", "argmin", "var_mean",
                        "std_mean", "any", "all"})

# norm op -> position of its weight argument (a TensorRef when affine, None otherwise)
NORM_WEIGHT_ARG = {
    "layer_norm": 2, "native_layer_norm": 2, "group_norm": 2, "rms_norm": 2, "_fused_rms_norm": 2,
    "batch_norm": 1, "native_batch_norm": 1, "_native_batch_norm_legit": 1,
    "_native_batch_norm_legit_no_training": 1, "_native_batch_norm_legit_functional": 1,
    "native_group_norm": 1, "instance_norm": 1,
}
NORMS = frozenset(NORM_WEIGHT_ARG)

SDPA_OPS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_cudnn_attention"})

CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution"})
CONV_T_OPS = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})

SCAN_OPS = frozenset({"cumsum", "cumprod", "diff", "logcumsumexp", "histc", "bincount"})
SORT_OPS = frozenset({"sort", "topk", "argsort", "msort", "kthvalue"})
SORT_DIM_ARG = {"sort": 1, "argsort": 1, "topk": 2, "kthvalue": 2}   # position of the dim argument
UNTAGGED_ELEMENTWISE = frozenset({"__and__", "__or__", "__xor__", "__invert__", "__lshift__", "__rshift__",
                                   "floor_divide", "remainder", "fmod"})  # element-wise, no pointwise tag
INDEX_OPS = frozenset({"index_put", "index_put_", "scatter", "scatter_", "masked_scatter", "index_copy",
                        "_unsafe_index", "_unsafe_index_put", "masked_select", "take"})
# Matrix products: the ops a Megatron column -> row pair is made of.
MATMUL_OPS = frozenset({"linear", "mm", "addmm", "matmul", "bmm"})

# Ops whose backward is two products of the forward's size (input and weight gradients).
# Mixture-of-experts layers traced as one op (autoddl/moe.py): two expert matmuls per routed token.
MOE_OPS = frozenset({"autoddl.moe_experts.default"})

MATMUL_LIKE = MATMUL_OPS | {"baddbmm"} | CONV_OPS | SDPA_OPS | MOE_OPS

# The aten ops of one 2-D product (a linear, mm, addmm; a matmul folded to one): torchtitan's op-level
# selective activation checkpointing counts them in each block and recomputes every second one
# (autoddl/program.py ``recomputed_ops``, executor/recompute.py ``selective_context``).
ALTERNATE_MM_ATEN = frozenset({"mm", "addmm"})

# Ops that cost nothing to run: views, aliases and reading one output of a multi-output op.
ZERO_COST = VIEW_OPS | {"getitem"}
