"""What spilling to host memory costs (autoddl/offload.py says what is spilled): a copy on the
host link and the optimizer step on the host.

- a copy of M bytes between host and device memory: ``host_link.latency_us + M / host_link.bandwidth_gbps``
  (one device's link, one direction; copies are issued one at a time on the program's ``copy`` stream);
- the optimizer step on the host: the same memory-bound pass as on a device
  (``costmodel.compute.optimizer_bytes``) at the host's memory bandwidth, which the node's devices
  share (``host_memory_bandwidth_gbps / devices_per_node`` each, every rank stepping at once).
"""

from __future__ import annotations

from autoddl.cluster import Cluster
from costmodel.compute import optimizer_bytes


def host_copy_time_s(nbytes: float, cluster: Cluster) -> float:
    """Seconds to copy ``nbytes`` between one device and host memory."""
    cluster.require_host("a host copy (offload)")
    link = cluster.host_link
    return link.latency_us * 1e-6 + nbytes / (link.bandwidth_gbps * 1e9)


def host_optimizer_time_s(param_bytes_local: float, param_numel_local: float, optimizer: str,
                          cluster: Cluster) -> float:
    """Seconds of one rank's optimizer step over its masters on the host (module docstring)."""
    cluster.require_host("the optimizer step on the host (offload)")
    per_device = cluster.host_memory_bandwidth_gbps * 1e9 / cluster.devices_per_node
    return optimizer_bytes(param_bytes_local, param_numel_local, optimizer) / per_device
