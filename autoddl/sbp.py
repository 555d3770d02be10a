"""SBP: how one logical tensor is laid out over one axis of a device mesh.

``Split(d)`` (printed ``S(d)``) cuts the tensor along dim ``d``; ``Broadcast()``
(``B``) gives every device a full copy; ``Partial()`` (``P``) gives every device a
full-shaped addend, the logical tensor being their sum. An ``NdSbp`` holds one SBP
per mesh axis and maps one to one onto DTensor's placements
(``Shard(d)`` / ``Replicate()`` / ``Partial()``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterator, Sequence, Union


class SbpBase:
    """What every SBP answers: which of the three it is (as DTensor's ``Placement``)."""

    def is_split(self, dim: int | None = None) -> bool:
        return False

    def is_broadcast(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Split(SbpBase):
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Split dim must be a non-negative int, got {self.dim!r}")

    def is_split(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True)
class Broadcast(SbpBase):
    def is_broadcast(self) -> bool:
        return True

    def __str__(self) -> str:
        return "B"

    __repr__ = __str__


@dataclass(frozen=True)
class Partial(SbpBase):
    """Every device holds an addend of the logical tensor (a sum reduction)."""

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return "P"

    __repr__ = __str__


Sbp = Union[Split, Broadcast, Partial]

B = Broadcast()
P = Partial()


def S(dim: int) -> Split:
    return Split(dim)


_SBP_RE = re.compile(r"^\s*(?:S\(\s*(\d+)\s*\)|(B)|(P))\s*$")


def parse_sbp(text: str) -> Sbp:
    """Parse ``S(0)``, ``B`` or ``P``."""
    m = _SBP_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse SBP {text!r}: expected S(<dim>), B or P")
    if m.group(1) is not None:
        return Split(int(m.group(1)))
    return B if m.group(2) else P


@dataclass(frozen=True)
class NdSbp:
    """One SBP per mesh axis, outermost axis first; prints as ``[S(0), B]``."""

    sbps: tuple[Sbp, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sbps", tuple(self.sbps))
        for s in self.sbps:
            if not isinstance(s, (Split, Broadcast, Partial)):
                raise TypeError(f"NdSbp entries must be Split/Broadcast/Partial, got {s!r}")
        key = tuple(str(s) for s in self.sbps)          # "S(0)", "B", "P": equal exactly when the SBPs are
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:  # cached: NdSbps key the search's memo tables
        return self._hash

    def __reduce__(self):  # unpickled through __init__: the cached hash is this process's (str hashes vary)
        return NdSbp, (self.sbps,)

    def __eq__(self, other: object) -> bool:  # on the cached strings: memo lookups compare many NdSbps
        if not isinstance(other, NdSbp):
            return NotImplemented
        return self is other or self._key == other._key

    @classmethod
    def of(cls, *sbps: Sbp) -> "NdSbp":
        return cls(tuple(sbps))

    @classmethod
    def broadcast(cls, ndim: int) -> "NdSbp":
        return cls((B,) * ndim)

    @classmethod
    def parse(cls, text: str) -> "NdSbp":
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            raise ValueError(f"cannot parse NdSbp {text!r}: expected e.g. '[S(0), B]'")
        inner = body[1:-1].strip()
        if not inner:
            raise ValueError(f"cannot parse NdSbp {text!r}: it names no mesh axis")
        try:
            return cls(tuple(parse_sbp(part.strip()) for part in inner.split(",")))
        except ValueError as exc:
            raise ValueError(f"cannot parse NdSbp {text!r}: {exc}") from None

    def __str__(self) -> str:
        return "[" + ", ".join(str(s) for s in self.sbps) + "]"

    __repr__ = __str__

    def __iter__(self) -> Iterator[Sbp]:
        return iter(self.sbps)

    def __len__(self) -> int:
        return len(self.sbps)

    def __getitem__(self, axis: int) -> Sbp:
        return self.sbps[axis]

    @property
    def is_broadcast(self) -> bool:
        return all(s.is_broadcast() for s in self.sbps)

    @property
    def has_partial(self) -> bool:
        return any(s.is_partial() for s in self.sbps)

    def split_factors(self, mesh_shape: Sequence[int], ndim: int) -> tuple[int, ...]:
        """How many pieces each tensor dim is cut into on a mesh of ``mesh_shape``."""
        self._check_mesh(mesh_shape)
        factors = [1] * ndim
        for sbp, size in zip(self.sbps, mesh_shape):
            if sbp.is_split():
                if sbp.dim >= ndim:
                    raise ValueError(f"{self} splits dim {sbp.dim} of a {ndim}-d tensor")
                factors[sbp.dim] *= size
        return tuple(factors)

    def divides(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        """True when every split dim of ``shape`` divides evenly over its mesh axes."""
        if any(s.is_split() and s.dim >= len(shape) for s in self.sbps):
            return False
        factors = self.split_factors(mesh_shape, len(shape))
        return all(d % f == 0 for d, f in zip(shape, factors))

    def local_shape(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of one device's piece; requires :meth:`divides`."""
        factors = self.split_factors(mesh_shape, len(shape))
        if not all(d % f == 0 for d, f in zip(shape, factors)):
            raise ValueError(f"{self} does not divide shape {tuple(shape)} on mesh {tuple(mesh_shape)}")
        return tuple(d // f for d, f in zip(shape, factors))

    def shard_fraction(self, mesh_shape: Sequence[int]) -> float:
        """Fraction of the full tensor's elements one device stores."""
        self._check_mesh(mesh_shape)
        return 1.0 / math.prod(n for s, n in zip(self.sbps, mesh_shape) if s.is_split())

    def to_placements(self) -> tuple:
        """DTensor placements, one per mesh axis."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor import Partial as DPartial

        out = []
        for s in self.sbps:
            if s.is_split():
                out.append(Shard(s.dim))
            elif s.is_broadcast():
                out.append(Replicate())
            else:
                out.append(DPartial())
        return tuple(out)

    @classmethod
    def from_placements(cls, placements: Sequence) -> "NdSbp":
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor import Partial as DPartial

        sbps: list[Sbp] = []
        for p in placements:
            if isinstance(p, Shard):
                sbps.append(Split(p.dim))
            elif isinstance(p, Replicate):
                sbps.append(B)
            elif isinstance(p, DPartial):
                if p.reduce_op != "sum":
                    raise ValueError(f"only sum partials map to SBP P, got reduce_op={p.reduce_op!r}")
                sbps.append(P)
            else:
                raise TypeError(f"no SBP for placement {p!r}")
        return cls(tuple(sbps))

    def _check_mesh(self, mesh_shape: Sequence[int]) -> None:
        if len(mesh_shape) != len(self.sbps):
            raise ValueError(f"{self} has {len(self.sbps)} axes but the mesh {tuple(mesh_shape)} has {len(mesh_shape)}")


@dataclass(frozen=True)
class Signature:
    """The NdSbp of each tensor input and each output of one op; prints ``[S(0)], [B] -> [S(0)]``."""

    inputs: tuple[NdSbp, ...]
    outputs: tuple[NdSbp, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "_hash", hash((self.inputs, self.outputs)))
        object.__setattr__(self, "_key", (tuple(getattr(nd, "_key", nd) for nd in self.inputs),
                                          tuple(getattr(nd, "_key", nd) for nd in self.outputs)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # unpickled through __init__, as NdSbp
        return Signature, (self.inputs, self.outputs)

    def __eq__(self, other: object) -> bool:  # on the NdSbps' cached strings: memo tables key on signatures
        if not isinstance(other, Signature):
            return NotImplemented
        return self is other or (self._hash == other._hash and self._key == other._key)

    def __str__(self) -> str:
        return ", ".join(map(str, self.inputs)) + " -> " + ", ".join(map(str, self.outputs))

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Signature":
        if "->" not in text:
            raise ValueError(f"cannot parse signature {text!r}: expected '<inputs> -> <outputs>'")
        lhs, rhs = text.split("->", 1)
        return cls(_parse_nd_list(lhs), _parse_nd_list(rhs))

    @property
    def mesh_ndim(self) -> int:
        return len((self.inputs + self.outputs)[0])

    def axis(self, i: int) -> tuple[tuple[Sbp, ...], tuple[Sbp, ...]]:
        """The 1-D signature on mesh axis ``i``: (input SBPs, output SBPs)."""
        return tuple(x[i] for x in self.inputs), tuple(x[i] for x in self.outputs)


def _parse_nd_list(text: str) -> tuple[NdSbp, ...]:
    """``"[S(0), B], [B, P]"`` -> two NdSbps; anything outside the brackets but commas is an error."""
    pieces = re.findall(r"\[[^\]]*\]", text)
    leftover = re.sub(r"\[[^\]]*\]", "", text)
    if leftover.replace(",", "").strip() or leftover.count(",") != max(len(pieces) - 1, 0):
        raise ValueError(f"cannot parse NdSbp list {text!r}: expected NdSbps separated by commas, "
                         "e.g. '[S(0), B], [B, B]'")
    return tuple(NdSbp.parse(p) for p in pieces)
