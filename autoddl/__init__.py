"""autoddl: automatic SBP parallelisation planning for PyTorch training."""

from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef
from autoddl.sbp import B, P, S, Broadcast, NdSbp, Partial, Signature, Split, parse_sbp
from autoddl.trace import TraceError, trace

__all__ = [
    "B", "P", "S", "Broadcast", "NdSbp", "Partial", "Signature", "Split", "parse_sbp",
    "NodeKind", "OpGraph", "OpNode", "TensorMeta", "TensorRef",
    "TraceError", "trace",
]
__version__ = "0.1.0"
