"""Measured collective times by size: the medians themselves, priced by interpolation.

gloo on a CPU whose cores the ranks share does not follow a latency-bandwidth line. Timed by
`autoddl calibrate` on the 2-core VM (2026-11-28 12:00 UTC, medians of 3 launches), an all-reduce on
4 ranks took 5.3-5.7 ms at every size from 4 KB to 1 MB, then 9.8 ms at 4 MB and 61 ms at 32 MB;
a line fitted to such 4-rank points (an earlier run: latency 706 us x 6 ring steps) says 4.2 ms for
the small sizes, where a tensor parallel step's all-reduces live, and the 2-rank line scaled to a
ring of 4 and doubled for the time-sharing said 10.3 ms. ``collective_points`` keeps what was measured, per

- the ranks the node ran at once while it was measured (``ranks_R``: a mesh that puts R ranks on
  a node is priced with them; the time-sharing of R ranks on the node's cores is in the numbers),
- the group's size (``group_N``: two groups of 2 running at once on 4 ranks are a 2x2 mesh's axis;
  N larger than R: a group across nodes, timed with R ranks busy on each, as `autoddl calibrate
  --across-hosts` times every rank of its hosts at once),
- the collective kind,

as ``[M bytes, microseconds]`` pairs (M as in costmodel/collectives.py: the full tensor on the
axis), sizes increasing, times not decreasing (the calibration's medians made monotone by
:func:`monotone`: a larger message is never faster, whatever one noisy median said)::

    collective_points:
      ranks_4:
        group_4:
          all_reduce: [[4096, 5420], [16384, 5610], ...]

:meth:`CollectiveCurve.time_s` interpolates linearly between the points, takes the smallest
point's time below it (the latency floor), and scales the largest point's time with M above it
(bandwidth-bound there). costmodel/collectives.py decides which collectives a curve prices.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class CollectiveCurve:
    """One (ranks busy, group size, kind)'s measured times: ``points`` = ((M bytes, microseconds), ...),
    bytes strictly increasing, microseconds positive and not decreasing."""

    points: tuple[tuple[int, float], ...]

    def time_s(self, nbytes: float) -> float:
        """Seconds for a collective of M = ``nbytes`` (module docstring: interpolated, floored, scaled)."""
        sizes = [b for b, _ in self.points]
        m = float(nbytes)
        if m <= sizes[0]:
            return self.points[0][1] * 1e-6
        if m >= sizes[-1]:
            return self.points[-1][1] * 1e-6 * m / sizes[-1]
        i = bisect.bisect_right(sizes, m)
        (b0, t0), (b1, t1) = self.points[i - 1], self.points[i]
        return (t0 + (t1 - t0) * (m - b0) / (b1 - b0)) * 1e-6

    def to_list(self) -> list[list[float]]:
        return [[int(b), float(t)] for b, t in self.points]


Key = tuple[int, int, str]          # (ranks busy on the node, group size, kind)


@dataclass(frozen=True)
class CollectivePoints:
    """Every measured curve, by (ranks busy on the node, group size, kind)."""

    curves: tuple[tuple[Key, CollectiveCurve], ...] = ()

    def get(self, ranks_busy: int, group: int, kind: Any) -> CollectiveCurve | None:
        want = (int(ranks_busy), int(group), getattr(kind, "value", kind))
        return next((c for k, c in self.curves if k == want), None)

    def merged(self, newer: "CollectivePoints") -> "CollectivePoints":
        """These curves with ``newer``'s in place of any for the same key."""
        curves = {**dict(self.curves), **dict(newer.curves)}
        return CollectivePoints(tuple(sorted(curves.items())))

    def to_dict(self) -> dict[str, dict[str, dict[str, list]]]:
        out: dict[str, dict[str, dict[str, list]]] = {}
        for (ranks, group, kind), curve in self.curves:
            out.setdefault(f"ranks_{ranks}", {}).setdefault(f"group_{group}", {})[kind] = curve.to_list()
        return out

    def __bool__(self) -> bool:
        return bool(self.curves)


def measured_points(timings: Iterable[tuple[str, int, int, float]], ranks_busy: int,
                    kinds: Sequence[str]) -> CollectivePoints:
    """Curves from ``(kind, group size, M bytes, seconds)`` medians timed with ``ranks_busy`` ranks of the
    node at once (`autoddl calibrate`), one per (group size, kind) of ``kinds``, made monotone."""
    by_curve: dict[tuple[int, str], dict[int, float]] = {}
    for kind, n, nbytes, seconds in timings:
        if kind in kinds:
            by_curve.setdefault((int(n), kind), {})[int(nbytes)] = float(seconds) * 1e6
    curves = []
    for (n, kind), times in sorted(by_curve.items()):
        sizes = sorted(times)
        us = [round(t, 1) for t in monotone([times[b] for b in sizes])]      # 0.1 us: as written
        curves.append(((int(ranks_busy), n, kind), CollectiveCurve(tuple(zip(sizes, us)))))
    return CollectivePoints(tuple(sorted(curves)))


def monotone(times: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``times`` in least squares (pool adjacent violators): a
    median that reads faster than a smaller message's is averaged with it."""
    blocks: list[list[float]] = []          # [mean, weight]
    for t in times:
        blocks.append([float(t), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1), (m2, w2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


_RANKS, _GROUP = re.compile(r"^ranks_(\d+)$"), re.compile(r"^group_(\d+)$")
_WHAT = ("a mapping ranks_R (R: ranks the node ran at once) -> group_N (N: ranks in the group) -> kind -> "
         "[[M bytes, microseconds], ...] (`autoddl calibrate` writes it)")


def parse_collective_points(src: str, value: Any, errors: list[str],
                            kinds: Sequence[str]) -> CollectivePoints | None:
    """``collective_points`` of a cluster file (module docstring) -> CollectivePoints; None, with every
    error appended, when anything is wrong. ``kinds``: the collective kinds a curve may be given for."""
    n_before = len(errors)
    curves: list[tuple[Key, CollectiveCurve]] = []
    if not isinstance(value, dict):
        errors.append(f"{src}: collective_points: expected {_WHAT}, got {value!r}")
        return None
    for ranks_key, groups in value.items():
        ranks = _key_number(_RANKS, ranks_key, src, "collective_points.", "ranks_R", errors)
        if not isinstance(groups, dict):
            errors.append(f"{src}: collective_points.{ranks_key}: expected a mapping group_N -> kind -> points, "
                          f"got {groups!r}")
            continue
        for group_key, by_kind in groups.items():
            where = f"collective_points.{ranks_key}.{group_key}"
            group = _key_number(_GROUP, group_key, src, f"collective_points.{ranks_key}.", "group_N", errors)
            if group is not None and group < 2:
                errors.append(f"{src}: {where}: a group of {group} rank: a collective's group has 2 ranks or more")
            if not isinstance(by_kind, dict):
                errors.append(f"{src}: {where}: expected a mapping kind -> points, got {by_kind!r}")
                continue
            for kind, points in by_kind.items():
                if kind not in kinds:
                    errors.append(f"{src}: {where}.{kind}: unknown collective kind; known: {', '.join(kinds)}")
                    continue
                curve = _curve(src, f"{where}.{kind}", points, errors)
                if curve and ranks and group:
                    curves.append(((ranks, group, kind), curve))
    return CollectivePoints(tuple(sorted(curves))) if len(errors) == n_before else None


def _key_number(pattern: re.Pattern, key: Any, src: str, parent: str, form: str, errors: list[str]) -> int | None:
    m = pattern.match(str(key))
    if not m or int(m.group(1)) < 1:
        errors.append(f"{src}: {parent}{key}: expected a key {form} with a positive integer for the letter "
                      f"(e.g. {form.replace('R', '4').replace('N', '2')})")
        return None
    return int(m.group(1))


def _curve(src: str, where: str, points: Any, errors: list[str]) -> CollectiveCurve | None:
    """``[[bytes, us], ...]``: at least one pair, bytes strictly increasing, us positive and not decreasing."""
    expected = ("a list of [M bytes, microseconds] pairs, bytes > 0 strictly increasing, microseconds > 0 not "
                "decreasing")
    if not isinstance(points, (list, tuple)) or not points:
        errors.append(f"{src}: {where}: expected {expected}, got {points!r}")
        return None
    out: list[tuple[int, float]] = []
    for i, pair in enumerate(points):
        ok = (isinstance(pair, (list, tuple)) and len(pair) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in pair))
        if not ok:
            errors.append(f"{src}: {where}[{i}]: expected a pair [M bytes > 0, microseconds > 0], got {pair!r}")
            return None
        if out and (pair[0] <= out[-1][0] or pair[1] < out[-1][1]):
            errors.append(f"{src}: {where}[{i}]: {list(pair)!r} after {list(out[-1])!r}: expected {expected} "
                          "(calibrate again, or sort the pairs and make the times monotone)")
            return None
        out.append((int(pair[0]), float(pair[1])))
    return CollectiveCurve(tuple(out))
