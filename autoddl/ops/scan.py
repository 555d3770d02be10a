"""Scans along one dim (cumsum, cumprod, logcumsumexp, cummax, cummin, diff) and histograms (histc).

A scan's output element depends on every element before it along the scanned dim, so
that dim is never split; any other dim may be, the operands following the output (diff's
``prepend``/``append`` by broadcasting). P passes through the linear scans of float
tensors (cumsum, diff): the scan of a sum is the sum of the scans. A position mask built
from an attention mask (``cumsum(mask != 0)``) is such a scan: split on the batch dim.

histc counts the input's values into ``bins`` bins fixed by its arguments: counting each
device's piece and adding the counts gives the whole count, so an input split on any dim
gives a P output (float counts only: integer results never get P, as in the pointwise
family); the output, ``bins`` long, has no dim of the input and is never split.

histc of an integer tensor has no CPU kernel (``histogram_cpu`` is float only); CUDA has
one. Models that choose by ``tensor.device.type`` (transformers' grouped_mm experts: float
on "cpu"/"mps", int elsewhere) take the integer branch when traced on the meta device, so
the traced op names an integer histc. Its local kernel counts an integer input in float64
(exact for integers below 2**53: the same bins) and returns the traced integer dtype, so
the traced graph runs on every device.
"""

from __future__ import annotations

from autoddl.graph import OpNode
from autoddl.ops.registry import B, P, S, Sig1D, bcast_sbp, bound_args, is_float, norm_dim, register, tensor_slot
from autoddl.sbp import Signature

SCANS = ("cumsum", "cumsum_", "cumprod", "logcumsumexp", "cummax", "cummin")
LINEAR_SCANS = ("cumsum", "cumsum_", "diff")


@register(*SCANS, "diff")
def scan(node: OpNode) -> list[Sig1D]:
    out_shape = node.outputs[0].shape
    dim = norm_dim(bound_args(node)["dim"], len(out_shape))
    sigs: list[Sig1D] = []
    for d in range(len(out_shape)):
        if d != dim:
            ins = tuple(bcast_sbp(S(d), out_shape, m.shape) for m in node.input_metas)
            sigs.append((ins, (S(d),) * len(node.outputs)))
    if node.op_name in LINEAR_SCANS and is_float(node.outputs[0]) and all(is_float(m) for m in node.input_metas):
        sigs.append(((P,) * len(node.inputs), (P,)))
    return sigs


def _histc_kernel(node: OpNode, sig: Signature, mesh_shape, coord):
    """An integer input is counted in float64 (module docstring); a float input runs the aten op."""
    if is_float(node.input_metas[0]):
        return None
    import torch

    def histc_of_integers(x, bins=100, min=0, max=0):
        return torch.histc(x.to(torch.float64), bins, min, max).to(x.dtype)

    return histc_of_integers


@register("histc", local_kernel=_histc_kernel)
def histc(node: OpNode) -> list[Sig1D]:
    if not is_float(node.outputs[0]):
        return []          # integer counts: broadcast only (no integer P)
    x = tensor_slot(node, "self")
    return [((S(d),), (P,)) for d in range(node.input_metas[x].ndim)]
