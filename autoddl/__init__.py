"""autoddl: automatic SBP parallelisation planning for PyTorch training."""

from autoddl.cluster import (
    DEFAULT_CLUSTER_PATH, Backend, Cluster, ClusterConfigError, DeviceSpec, Efficiency, LinkSpec, bundled_config,
)
from autoddl.flops import register_flops
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef
from autoddl.loader import ModelFile, ModelFileError, default_loss, load_model_file, trace_model_file
from autoddl.sbp import B, P, S, Broadcast, NdSbp, Partial, Signature, Split, parse_sbp
from autoddl.trace import TraceError, trace
from autoddl.plan import Mesh, Plan
from autoddl.training import Training
from autoddl.api import compare, parallelize, plan

__all__ = [
    "Mesh", "Plan", "Training", "compare", "parallelize", "plan",
    "ModelFile", "ModelFileError", "default_loss", "load_model_file", "trace_model_file",
    "Backend", "Cluster", "ClusterConfigError", "DeviceSpec", "Efficiency", "LinkSpec",
    "DEFAULT_CLUSTER_PATH", "bundled_config",
    "B", "P", "S", "Broadcast", "NdSbp", "Partial", "Signature", "Split", "parse_sbp",
    "NodeKind", "OpGraph", "OpNode", "TensorMeta", "TensorRef",
    "TraceError", "trace", "register_flops",
]
__version__ = "0.1.0"
