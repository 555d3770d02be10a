"""Device mesh shapes to search over.

A mesh shape lists axis sizes outermost first; devices are numbered row-major,
so the innermost (last) axis groups consecutive devices. The rule: the inner
axis of a multi-axis mesh stays inside a node, i.e. its size divides
``devices_per_node`` (consecutive groups of that size never straddle a node).
A 1-D mesh is always allowed (its only axis spans every device; it is
intra-node exactly when the devices fit in one node).

Exception, decided here: with ``devices_per_node == 1`` there is no intra-node
link at all, so every axis of every mesh is inter-node and the rule cannot
distinguish shapes. All factorisations are then allowed: a 2-D mesh still
differs from a 1-D one in which collectives it needs (DP x TP), and the cost
model prices each axis with the inter-node link.
"""

from __future__ import annotations

import math
import re

_SEPARATORS = re.compile(r"[x×,*\s]+")


def _factorisations(n: int, ndim: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of n into exactly ``ndim`` factors, each > 1."""
    if ndim == 1:
        return [(n,)] if n > 1 else []
    out = []
    for d in range(2, n + 1):
        if n % d == 0:
            out += [(d,) + rest for rest in _factorisations(n // d, ndim - 1)]
    return out


def mesh_shapes(num_devices: int, devices_per_node: int, max_ndim: int = 2) -> list[tuple[int, ...]]:
    """Every mesh shape for ``num_devices`` devices with 1..``max_ndim`` axes (see module rules).

    Order: by number of axes, then by outer sizes ascending, e.g. for 8 devices
    on one 8-device node: [(8,), (2, 4), (4, 2)].
    """
    for name, value in (("num_devices", num_devices), ("devices_per_node", devices_per_node),
                        ("max_ndim", max_ndim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mesh_shapes: {name} must be a positive integer, got {value!r}")
    if max_ndim > 3:
        raise ValueError(f"mesh_shapes: max_ndim {max_ndim} is not supported (1, 2 or 3 axes)")
    if num_devices == 1:
        return [(1,)]
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    for ndim in range(2, max_ndim + 1):
        shapes += [s for s in _factorisations(num_devices, ndim) if inner_axis_in_node(s, devices_per_node)]
    return shapes


def inner_axis_in_node(shape: tuple[int, ...], devices_per_node: int) -> bool:
    """The module's rule for ``shape``, whose size-1 entries take no mesh axis: with more than one
    axis, the innermost one divides ``devices_per_node`` (or nodes have one device)."""
    axes = [d for d in shape if d > 1]
    return len(axes) <= 1 or devices_per_node == 1 or devices_per_node % axes[-1] == 0


def role_splits(num_devices: int, devices_per_node: int, max_pp: int = 1) -> list[tuple[int, int, int]]:
    """Every (pp, data, tp) with pp x data x tp = ``num_devices`` and pp <= ``max_pp``, as a mesh
    (pp, data, tp) meeting the module's rule: pipeline stages outermost, tensor parallel innermost
    (inside a node), data parallel (to be split into replicated and sharded by the caller) between.
    The one enumeration of role degrees: trainers' structured spaces and the 3-D search use it."""
    out = []
    for tp in divisors(num_devices):
        for pp in divisors(num_devices // tp):
            data = num_devices // tp // pp
            if pp <= max_pp and inner_axis_in_node((pp, data, tp), devices_per_node):
                out.append((pp, data, tp))
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x4"`` / ``"2,4"`` / ``"(2, 4)"`` / ``"8"`` -> (2, 4) / (2, 4) / (2, 4) / (8,)."""
    body = str(text).strip().strip("()[]").strip()
    parts = [p for p in _SEPARATORS.split(body) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"cannot parse mesh {text!r}: expected positive sizes joined by 'x', e.g. 8 or 2x4")
    return shape


def mesh_size(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
