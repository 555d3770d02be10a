"""SBP types: printing, parsing (property-tested), hashing, DTensor placements, local shapes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate, Shard

from autoddl.sbp import B, P, S, Broadcast, NdSbp, Partial, Signature, Split, parse_sbp

sbp_st = st.one_of(st.builds(Split, st.integers(0, 7)), st.just(Broadcast()), st.just(Partial()))
ndsbp_st = st.lists(sbp_st, min_size=1, max_size=4).map(lambda xs: NdSbp(tuple(xs)))


@st.composite
def signature_st(draw):
    axes = draw(st.integers(1, 4))
    one = st.lists(sbp_st, min_size=axes, max_size=axes).map(lambda xs: NdSbp(tuple(xs)))
    return Signature(tuple(draw(st.lists(one, min_size=0, max_size=3))),
                     tuple(draw(st.lists(one, min_size=1, max_size=2))))


def test_printing():
    assert (str(S(0)), str(S(3)), str(B), str(P)) == ("S(0)", "S(3)", "B", "P")
    assert repr(S(1)) == "S(1)"
    assert str(NdSbp.of(S(0), B)) == "[S(0), B]"
    assert str(NdSbp.of(P)) == "[P]"
    sig = Signature((NdSbp.of(S(0), B), NdSbp.of(B, S(1))), (NdSbp.of(S(0), S(1)),))
    assert str(sig) == "[S(0), B], [B, S(1)] -> [S(0), S(1)]"


@settings(max_examples=100, deadline=None)
@given(ndsbp_st)
def test_ndsbp_parse_round_trip(nd):
    assert NdSbp.parse(str(nd)) == nd
    assert NdSbp.parse(str(nd).replace(", ", ",")) == nd          # spacing does not matter
    assert NdSbp.parse("  " + str(nd).replace("(", "( ") + " ") == nd
    assert tuple(parse_sbp(str(s)) for s in nd) == nd.sbps


@settings(max_examples=100, deadline=None)
@given(signature_st())
def test_signature_parse_round_trip(sig):
    parsed = Signature.parse(str(sig))
    assert parsed == sig
    assert hash(parsed) == hash(sig)
    assert parsed.mesh_ndim == len(sig.outputs[0])


def test_signature_axis():
    sig = Signature.parse("[S(0), B], [B, S(1)] -> [S(0), P]")
    assert sig.axis(0) == ((S(0), B), (S(0),))
    assert sig.axis(1) == ((B, S(1)), (P,))


def test_hashable_and_frozen():
    assert S(0) == Split(0) and S(0) != S(1) and B == Broadcast() and P == Partial()
    assert len({S(0), Split(0), B, Broadcast(), P, S(1)}) == 4
    table = {NdSbp.of(S(0), B): "dp", Signature.parse("[B] -> [B]"): "rep"}
    assert table[NdSbp.parse("[S(0), B]")] == "dp"
    assert table[Signature.parse("[B]->[B]")] == "rep"
    nd = NdSbp.of(S(0), B)
    for obj, field in ((S(0), "dim"), (nd, "sbps"), (Signature.parse("[B] -> [B]"), "inputs")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, ())
    assert NdSbp([S(0), B]).sbps == (S(0), B)  # lists become tuples, so hashing works


def test_ndsbp_sequence_protocol():
    nd = NdSbp.of(S(2), P, B)
    assert len(nd) == 3 and nd[0] == S(2) and list(nd) == [S(2), P, B]
    assert NdSbp.broadcast(2) == NdSbp.of(B, B) and NdSbp.broadcast(2).is_broadcast
    assert nd.has_partial and not nd.is_broadcast


@settings(max_examples=100, deadline=None)
@given(ndsbp_st)
def test_dtensor_placements_round_trip(nd):
    placements = nd.to_placements()
    assert len(placements) == len(nd)
    for sbp, p in zip(nd, placements):
        if isinstance(sbp, Split):
            assert isinstance(p, Shard) and p.dim == sbp.dim
        elif isinstance(sbp, Broadcast):
            assert isinstance(p, Replicate)
        else:
            assert isinstance(p, DPartial) and p.reduce_op == "sum"
    assert NdSbp.from_placements(placements) == nd


def test_from_placements_examples_and_errors():
    assert NdSbp.from_placements([Shard(1), Replicate(), DPartial()]) == NdSbp.of(S(1), B, P)
    with pytest.raises(ValueError, match="avg"):
        NdSbp.from_placements([DPartial("avg")])
    with pytest.raises(TypeError, match="no SBP for placement"):
        NdSbp.from_placements(["Shard(0)"])


def test_local_shape_and_divides():
    mesh = (2, 4)
    assert NdSbp.of(S(0), S(1)).local_shape((8, 12), mesh) == (4, 3)
    assert NdSbp.of(S(0), S(0)).local_shape((16, 5), mesh) == (2, 5)      # both axes cut dim 0
    assert NdSbp.of(B, P).local_shape((3, 5), mesh) == (3, 5)             # P keeps the full shape
    assert NdSbp.of(S(1), B).split_factors(mesh, 3) == (1, 2, 1)
    assert NdSbp.of(S(0), S(1)).divides((8, 12), mesh)
    assert not NdSbp.of(S(0), S(0)).divides((12, 5), mesh)                 # 12 % 8 != 0
    assert not NdSbp.of(S(2), B).divides((4, 4), mesh)                     # no dim 2
    assert NdSbp.of(S(0), S(1)).shard_fraction(mesh) == pytest.approx(1 / 8)
    assert NdSbp.of(B, P).shard_fraction(mesh) == 1.0
    with pytest.raises(ValueError, match="does not divide"):
        NdSbp.of(S(0), S(0)).local_shape((12, 5), mesh)
    with pytest.raises(ValueError, match="splits dim 2 of a 2-d tensor"):
        NdSbp.of(S(2), B).local_shape((4, 4), mesh)
    with pytest.raises(ValueError, match="has 2 axes but the mesh"):
        NdSbp.of(S(0), B).local_shape((4, 4), (4,))


@pytest.mark.parametrize("text", ["X", "S(-1)", "S(a)", "S()", "s(0)", "BP", ""])
def test_parse_sbp_errors_name_the_text(text):
    with pytest.raises(ValueError, match=r"cannot parse SBP .*expected S\(<dim>\), B or P"):
        parse_sbp(text)


@pytest.mark.parametrize("text, match", [
    ("S(0), B", "expected e.g."),
    ("[]", "names no mesh axis"),
    ("[S(0), Q]", r"cannot parse SBP ' ?Q'"),
    ("[S(0),, B]", "cannot parse SBP"),
])
def test_ndsbp_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        NdSbp.parse(text)


def test_signature_parse_errors():
    with pytest.raises(ValueError, match="expected '<inputs> -> <outputs>'"):
        Signature.parse("[S(0)], [B]")
    with pytest.raises(ValueError, match="cannot parse SBP 'Q'"):
        Signature.parse("[Q] -> [B]")


def test_bad_constructor_values():
    with pytest.raises(ValueError, match="non-negative int"):
        Split(-1)
    with pytest.raises(TypeError, match="Split/Broadcast/Partial"):
        NdSbp(("S(0)",))
