"""Matmul times by operand layout, measured for a dtype the device only emulates: ``matmul_layouts``.

Why. A CPU without bfloat16 instructions (the Zen 3 VM this project is measured on) multiplies
bfloat16 matrices in a generic loop whose speed depends on how the operands lie in memory, not only on
their size: ``(M, K) @ (K, N)`` with both operands row-major ("NN") ran at 1.3-3 GFLOP/s, with the
second a transposed view ("NT": a linear's forward ``x @ W^T``) at 4-9, with the first a transposed view
("TN": its weight gradient ``g^T @ x``) at 13-24 (one thread, M, K, N of 64 to 512; ``/tmp`` timings of
2026-11-29, the same spread in the calibration's own table). One peak and a FLOP-efficiency curve
price a linear's three matmuls at one rate, so bf16 linears whose outputs are wider than their inputs
(a 64 -> 512 output layer: 4.6 ms forward and backward, priced 2.5) were priced short. Float32, and
any dtype a device runs in hardware, comes from a tuned BLAS that hardly cares (float32 on the same
VM: the three layouts within 0.9-1.3x of each other at 64 to 512), so this table is only written for
a dtype slower than float32 by ``executor.calibrate.SLOW_DTYPE_FACTOR``.

What. Per dtype, rows ``[m, k, n, nn_us, nt_us, tn_us]``: the microseconds of an ``(m, k) @ (k, n)``
product in each layout (the per-call dispatch taken out), over a full grid (every combination of the
same sizes for m, k and n). :meth:`MatmulLayoutTable.time_s` reads a product of any size: its rate
(FLOP/s) interpolated linearly in log m, log k, log n between the grid's points and flat beyond the
grid's ends, the time ``2 m k n / rate``.

Which ops. A ``linear`` ``y = x W^T`` on ``(M, K)`` inputs (every leading dimension in M) and an
``(N, K)`` weight runs three products: forward NT ``(M, K) @ (K, N)``; the input gradient ``g W``, NN
``(M, N) @ (N, K)``; the weight gradient ``g^T x``, TN ``(N, M) @ (M, K)`` (:func:`linear_matmuls`).
Each mesh axis that splits the op splits the dimension its split names (:func:`local_linear_dims`).
costmodel/compute.py prices a linear in a dtype with a table by these products plus the family's fixed
cost; every other op as before.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

LAYOUTS = ("NN", "NT", "TN")     # (A, B) of A @ B: N a row-major operand, T a transposed view
ROW_FIELDS = ("m", "k", "n") + tuple(f"{layout.lower()}_us" for layout in LAYOUTS)


@dataclass(frozen=True)
class MatmulLayoutTable:
    """One dtype's measured products (module docstring); ``rows`` in m, k, n order over ``sizes``^3."""

    sizes: tuple[int, ...]                                           # the grid's values, increasing
    rows: tuple[tuple[int, int, int, float, float, float], ...]

    def time_s(self, layout: str, m: float, k: float, n: float) -> float:
        """Seconds of an ``(m, k) @ (k, n)`` product in ``layout`` (one of ``LAYOUTS``)."""
        if layout not in LAYOUTS:
            raise ValueError(f"matmul layout {layout!r}: choose one of {LAYOUTS}")
        if min(m, k, n) <= 0:
            return 0.0
        col = 3 + LAYOUTS.index(layout)
        corners = [_bracket(self._log_sizes, math.log(v)) for v in (m, k, n)]     # per dim: (i, i + 1, weight of i + 1)
        log_rate = 0.0
        for ci in range(8):
            weight, idx = 1.0, []
            for dim, (lo, hi, w) in enumerate(corners):
                upper = (ci >> dim) & 1
                weight *= w if upper else 1.0 - w
                idx.append(hi if upper else lo)
            if weight:
                log_rate += weight * math.log(self._rate(idx, col))
        return 2.0 * m * k * n / math.exp(log_rate)

    @functools.cached_property
    def _log_sizes(self) -> tuple[float, ...]:
        """log of each grid size, computed once (the search reads a table for every linear it prices)."""
        return tuple(math.log(s) for s in self.sizes)

    def _rate(self, idx: Sequence[int], col: int) -> float:
        """FLOP/s of the grid point at indices ``idx`` (of m, k, n) in column ``col``."""
        g = len(self.sizes)
        row = self.rows[(idx[0] * g + idx[1]) * g + idx[2]]
        return 2.0 * row[0] * row[1] * row[2] / (row[col] * 1e-6)

    def to_rows(self) -> list[list[float]]:
        return [list(r) for r in self.rows]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float]]) -> "MatmulLayoutTable":
        """A table from measured rows in any order; raises ValueError naming what is wrong."""
        errors: list[str] = []
        table = parse_table("matmul_layouts", "table", rows, errors)
        if errors:
            raise ValueError("; ".join(errors))
        return table


def _bracket(logs: Sequence[float], x: float) -> tuple[int, int, float]:
    """The grid indices around ``x`` and the weight of the upper one (flat beyond the ends)."""
    if x <= logs[0] or len(logs) == 1:
        return 0, 0, 0.0
    if x >= logs[-1]:
        return len(logs) - 1, len(logs) - 1, 0.0
    hi = bisect.bisect_left(logs, x)
    return hi - 1, hi, (x - logs[hi - 1]) / (logs[hi] - logs[hi - 1])


def parse_table(src: str, where: str, value: Any, errors: list[str]) -> MatmulLayoutTable | None:
    """``matmul_layouts.<dtype>``: rows ``[m, k, n, nn_us, nt_us, tn_us]`` over a full grid (None on error)."""
    expected = (f"a list of rows [{', '.join(ROW_FIELDS)}]: positive sizes and microseconds, one row for each "
                "combination of the same sizes for m, k and n (as `autoddl calibrate` writes it)")
    if not isinstance(value, (list, tuple)) or not value:
        errors.append(f"{src}: {where}: expected {expected}, got {value!r}")
        return None
    rows: dict[tuple[int, int, int], tuple[float, ...]] = {}
    for i, row in enumerate(value):
        ok = (isinstance(row, (list, tuple)) and len(row) == len(ROW_FIELDS)
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in row)
              and all(float(x).is_integer() for x in row[:3]))
        if not ok:
            errors.append(f"{src}: {where}[{i}]: expected [{', '.join(ROW_FIELDS)}] (whole sizes, positive "
                          f"times), got {row!r}")
            continue
        key = tuple(int(x) for x in row[:3])
        if key in rows:
            errors.append(f"{src}: {where}[{i}]: the shape m={key[0]}, k={key[1]}, n={key[2]} appears twice; "
                          "keep one row per shape")
        rows[key] = tuple(float(x) for x in row[3:])
    if errors:
        return None
    sizes = tuple(sorted({s for key in rows for s in key}))
    missing = [(m, k, n) for m in sizes for k in sizes for n in sizes if (m, k, n) not in rows]
    if missing:
        errors.append(f"{src}: {where}: the rows must cover every combination of the sizes {list(sizes)} for m, k "
                      f"and n; missing {len(missing)}, e.g. m, k, n = {list(missing[0])}: calibrate again "
                      "(`autoddl calibrate --only matmul_layouts`)")
        return None
    return MatmulLayoutTable(sizes, tuple((m, k, n, *rows[(m, k, n)])
                                          for m in sizes for k in sizes for n in sizes))


@dataclass(frozen=True)
class MatmulLayouts:
    """The cluster's tables by dtype (hashable, as the cluster is); ``{dtype: rows}`` or tables build it."""

    tables: tuple[tuple[str, MatmulLayoutTable], ...] = ()

    @classmethod
    def of(cls, value: Any) -> "MatmulLayouts":
        if isinstance(value, MatmulLayouts):
            return value
        return cls(tuple((d, t if isinstance(t, MatmulLayoutTable) else MatmulLayoutTable.from_rows(t))
                         for d, t in dict(value or {}).items()))

    def get(self, dtype: str) -> MatmulLayoutTable | None:
        return next((t for d, t in self.tables if d == dtype), None)

    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.tables)

    def __bool__(self) -> bool:
        return bool(self.tables)

    def to_dict(self) -> dict[str, list[list[float]]]:
        return {d: t.to_rows() for d, t in self.tables}


def parse_layouts(src: str, value: Any, errors: list[str], dtypes: Sequence[str]) -> MatmulLayouts:
    """``matmul_layouts: {dtype: rows}`` (module docstring); the tables that parsed."""
    if not isinstance(value, dict):
        errors.append(f"{src}: matmul_layouts: expected a mapping of dtype ({', '.join(dtypes)}) to rows "
                      f"[{', '.join(ROW_FIELDS)}], got {value!r}")
        return MatmulLayouts()
    out = {}
    for dtype, rows in value.items():
        if dtype not in dtypes:
            errors.append(f"{src}: matmul_layouts: unknown dtype {dtype!r}; known: {', '.join(dtypes)}")
            continue
        table = parse_table(src, f"matmul_layouts.{dtype}", rows, errors)
        if table is not None:
            out[dtype] = table
    return MatmulLayouts.of(out)


def linear_matmuls(m: float, k: float, n: float) -> tuple[tuple[str, float, float, float], ...]:
    """(forward, input gradient, weight gradient) products of a linear on ``(m, k)`` inputs and an
    ``(n, k)`` weight, each ``(layout, m, k, n)`` of ``(m, k) @ (k, n)``."""
    return ("NT", m, k, n), ("NN", m, n, k), ("TN", n, m, k)


def local_linear_dims(input_shape: Sequence[int], weight_shape: Sequence[int], placements: Sequence[Any],
                      mesh_shape: Sequence[int]) -> tuple[float, float, float]:
    """(M, K, N) of one device's share of a linear: M every input dimension but the last, K the last,
    N the weight's first. ``placements``: per mesh axis, the (input, weight) placements (``is_split()``,
    ``dim``); an axis splitting the input's leading dimensions divides M, its last or the weight's second
    K, the weight's first N."""
    m = float(math.prod(input_shape[:-1]))
    k, n = float(input_shape[-1]), float(weight_shape[0])
    last = len(input_shape) - 1
    for (x, w), size in zip(placements, mesh_shape):
        if x.is_split():
            if x.dim == last:
                k /= size
            else:
                m /= size
        elif w.is_split():
            if w.dim == 0:
                n /= size
            else:
                k /= size
    return m, k, n
