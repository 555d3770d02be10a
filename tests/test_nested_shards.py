"""ZeRO over two mesh axes as one collective over their flattened group (autoddl.boxing
``flatten_nested_shards``): the moves, the pieces each rank holds, the programs and their buckets."""

import math
from pathlib import Path

import pytest
import torch

from autoddl.boxing import (boxing_moves, flatten_nested_shards, gradient_moves, group_rank, group_size,
                            group_split_dim)
from autoddl.collective_kinds import CollectiveKind
from autoddl.sbp import NdSbp

RS, AG = CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER
P = NdSbp.parse


def _collectives(moves):
    return [(m.kind, m.group, m.nbytes) for m in moves if m.kind is not None]


def test_a_gradient_reduce_scattered_over_two_axes_is_one_reduce_scatter_over_both():
    shape, nbytes = (8, 6), 8 * 6 * 4
    chain = gradient_moves(nbytes, P("[P, P]"), P("[S(0), S(0)]"), (2, 2))
    assert _collectives(chain) == [(RS, 0, nbytes), (RS, 1, nbytes // 2)]      # DTensor's order: outer first
    flat = flatten_nested_shards(chain, shape, (2, 2))
    assert _collectives(flat) == [(RS, (0, 1), nbytes)]                        # M: the whole gradient
    assert flat[0].before == P("[P, P]") and flat[0].after == P("[S(0), S(0)]")


def test_a_parameter_gathered_over_two_axes_is_one_all_gather_over_both():
    shape, nbytes = (8, 6), 8 * 6 * 4
    chain = boxing_moves(nbytes, P("[S(0), S(0)]"), P("[B, B]"), (2, 2))
    assert _collectives(chain) == [(AG, 1, nbytes // 2), (AG, 0, nbytes)]      # inner axis first
    flat = flatten_nested_shards(chain, shape, (2, 2))
    assert _collectives(flat) == [(AG, (0, 1), nbytes)]


def test_the_dim_a_group_splits_is_its_first_axis_split():
    # ZeRO over 2x2: S(0),S(0) is one split of rows over the flattened group (0, 1), as each of the
    # executor's gather unpacking, reduce-scatter packing and parameter sync joins the pieces
    assert group_split_dim(P("[S(0), S(0)]"), (0, 1)) == 0
    assert group_split_dim(P("[B, S(1)]"), 1) == 1
    move = flatten_nested_shards(boxing_moves(64 * 4, P("[S(0), S(0)]"), P("[B, B]"), (2, 2)),
                                 (8, 8), (2, 2))[0]
    assert move.group == (0, 1) and group_split_dim(move.before, move.group) == 0
    with pytest.raises(ValueError, match="does not split on mesh axis 0"):
        group_split_dim(P("[B, S(0)]"), (0, 1))


def test_three_axes_flatten_into_one_group():
    shape, nbytes = (16, 4), 16 * 4 * 4
    chain = gradient_moves(nbytes, P("[P, P, P]"), P("[S(0), S(0), S(0)]"), (2, 2, 2))
    assert _collectives(flatten_nested_shards(chain, shape, (2, 2, 2))) == [(RS, (0, 1, 2), nbytes)]


@pytest.mark.parametrize("src,dst,shape,why", [
    ("[P, P]", "[S(0), S(0)]", (6, 4), "6 rows do not split evenly into 4: the nested pieces are not the flat ones"),
    ("[P, P]", "[S(0), S(1)]", (8, 8), "two dims: no flat piece"),
    ("[P, P]", "[S(0), B]", (8, 8), "a reduce-scatter then an all-reduce: two kinds"),
    ("[P, P, B]", "[S(0), B, S(0)]", (8, 8), "only axes 0 and 2 scatter, and axis 1 reduces in between"),
])
def test_chains_that_do_not_nest_evenly_stay(src, dst, shape, why):
    mesh = (2,) * len(P(src))
    chain = gradient_moves(math.prod(shape) * 4, P(src), P(dst), mesh)
    assert flatten_nested_shards(chain, shape, mesh) == chain, why


def test_a_flat_rank_holds_the_nested_piece():
    """Rank (a0, a1)'s piece of [S(0), S(0)] is chunk a0 then chunk a1 of it: chunk a0 * 2 + a1 of
    four, its rank in the flattened group (group_rank); what one collective over the group leaves."""
    x = torch.arange(8 * 3).reshape(8, 3)
    for a0 in range(2):
        for a1 in range(2):
            nested = x.chunk(2, 0)[a0].chunk(2, 0)[a1]
            r = group_rank((0, 1), (a0, a1), (2, 2))
            assert r == a0 * 2 + a1 and torch.equal(nested, x.chunk(group_size((0, 1), (2, 2)), 0)[r])
    assert group_rank(1, (1, 0), (2, 2)) == 0 and group_size(1, (2, 3)) == 3 and group_size((0, 1), (2, 3)) == 6


def test_flattened_chain_moves_the_same_bytes():
    """The ring formula over n = 4 ranks: (n-1)/n * M per rank, as the chain's 1/2 * M + 1/2 * M/2;
    n - 1 = 3 latency steps against the chain's 1 + 1."""
    from costmodel.collectives import native_time_s

    m, bw, lat = 64e6, 1e9, 1e-4
    one = native_time_s(RS, m, 4, bw, 0.0)
    chain = native_time_s(RS, m, 2, bw, 0.0) + native_time_s(RS, m / 2, 2, bw, 0.0)
    assert one == pytest.approx(chain) == pytest.approx(0.75 * m / bw)
    assert native_time_s(RS, m, 4, math.inf, lat) == pytest.approx(3 * lat)


@pytest.fixture(scope="module")
def gpt_2x2():
    """gpt tiny's baselines on the 2x2 mesh of local-cpu."""
    from autoddl.cluster import Cluster
    from autoddl.loader import load_model_file
    from autoddl.trace import trace
    from clusters import cluster_path
    from search.planner import search

    root = Path(__file__).resolve().parents[1]
    mf = load_model_file(root / "examples" / "gpt.py", device="cpu", preset="tiny")
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn, name="gpt")
    outcome = search(graph, Cluster.from_yaml(cluster_path("local-cpu")).resized(4), mesh=(2, 2))
    return graph, {s.name: s.plan for s in outcome.schemes if s.plan is not None}


def test_zero2_on_two_axes_reduce_scatters_in_buckets_over_both(gpt_2x2):
    """Every gradient of gpt tiny (its dims divide by 4) reduce-scattered over both axes at once, in
    one bucket (1.1 MB: under DDP's 25 MB), and the updated parameters gathered back in one
    all-gather over both; it was one reduce-scatter on axis 0 and one all-reduce on axis 1 per
    parameter (56 collectives, the optimizer storage split on axis 0 only)."""
    from autoddl.program import lower

    graph, plans = gpt_2x2
    plan = plans["zero2"]
    program = lower(graph, plan)
    synced = [u for u in program.param_uses if u.grad is not None]
    assert len(synced) == 28 and {u.fqn for u in synced} == set(plan.grad_storage)
    for u in synced:
        storage = plan.grad_storage[u.fqn]
        assert storage[0] == storage[1] and storage[0].is_split()           # [S(d), S(d)]
        assert _collectives(u.grad_sync) == [(RS, (0, 1), u.meta.numel * 4)] and u.bucket == 0
    assert [(b.kind, b.axis, len(b.uses)) for b in program.buckets] == [(RS, (0, 1), 28)]
    grad_sync = [(t.collective, t.axis) for t in program.collectives() if t.phase == "grad_sync"]
    assert grad_sync == [(RS, (0, 1))]
    assert [(s.axis, len(s.fqns)) for s in program.param_syncs] == [((0, 1), 28)]


def test_zero3_on_two_axes_gathers_layer_groups_over_both(gpt_2x2):
    """gpt tiny's ZeRO-3 storages ([S(0), S(0)]) gathered by layer group over both axes at once
    and their gradients reduce-scattered in buckets over both: no per-parameter chain left."""
    from autoddl.program import lower

    graph, plans = gpt_2x2
    program = lower(graph, plans["zero3"])
    used = [u for u in program.param_uses if u.forward]
    assert used and all(u.gather >= 0 for u in used)
    assert {program.gathers[u.gather].axis for u in used} == {(0, 1)}
    for u in used:
        assert _collectives(u.forward) == [(AG, (0, 1), u.meta.nbytes)]
    assert all(u.bucket >= 0 for u in program.param_uses if u.grad is not None)
    per_param = [t for t in program.collectives() if t.tensor in {u.fqn for u in program.param_uses}]
    assert per_param == []


@pytest.mark.parametrize("shape,flat", [((8, 6), True), ((6, 8), False)])
def test_the_search_prices_a_parameter_as_the_lowering_runs_it(shape, flat):
    """The search's per-edge price (search.formulate's pair pricer) of a ZeRO-3 parameter on 2x2
    (stored [S(0), S(0)], used [B, B], its gradient [P, P]) is its gather and its gradient sync as the
    lowering's ParamUse runs them: one all-gather and one reduce-scatter over (0, 1) where its rows
    divide by 4 (8), two of each, one per axis, where they do not (6); priced by hand from the fit."""
    from autoddl.cluster import Cluster
    from clusters import cluster_path
    from costmodel.boxing import parameter_transitions_of, transitions_time_s
    from costmodel.collectives import cluster_collective_time_s
    from search.formulate import _pair_pricer

    cluster, mesh = Cluster.from_yaml(cluster_path("dgx-a100-8")).resized(4), (2, 2)
    nbytes = math.prod(shape) * 4
    storage, use, grad = P("[S(0), S(0)]"), P("[B, B]"), P("[P, P]")
    gather = parameter_transitions_of(nbytes, storage, use, shape, mesh)
    sync = parameter_transitions_of(nbytes, grad, storage, shape, mesh)
    if flat:
        assert gather == [(AG, (0, 1), nbytes)] and sync == [(RS, (0, 1), nbytes)]
    else:
        assert gather == [(AG, 1, nbytes // 2), (AG, 0, nbytes)] and sync == [(RS, 0, nbytes), (RS, 1, nbytes // 2)]
    by_hand = sum(cluster_collective_time_s(kind, m, mesh, group, cluster, host_waits=True)
                  for kind, group, m in gather + sync)
    price = _pair_pricer(mesh, cluster)(nbytes, nbytes, storage, use, grad, shape)
    assert price == pytest.approx(by_hand, rel=1e-9) == pytest.approx(transitions_time_s(gather + sync, mesh, cluster))


def test_the_search_prices_every_zero3_use_of_gpt_as_its_program_runs_it(gpt_2x2):
    """For every parameter use of gpt tiny's ZeRO-3 program on 2x2, the search's pair price equals
    the collectives of the use's gather and gradient sync in the program (one over (0, 1) each)."""
    from autoddl.boxing import collectives_of
    from autoddl.cluster import Cluster
    from autoddl.program import lower
    from clusters import cluster_path
    from costmodel.boxing import transitions_time_s
    from search.formulate import _pair_pricer

    graph, plans = gpt_2x2
    cluster, mesh = Cluster.from_yaml(cluster_path("local-cpu")).resized(4), (2, 2)
    price = _pair_pricer(mesh, cluster)
    uses = [u for u in lower(graph, plans["zero3"]).param_uses if u.grad is not None]
    assert uses
    for u in uses:
        ran = collectives_of(u.forward) + collectives_of(u.grad_sync)
        assert [group for _, group, _ in ran] == [(0, 1), (0, 1)]
        assert price(u.meta.nbytes, u.meta.nbytes, u.storage, u.dst, u.grad, tuple(u.meta.shape)) == \
            pytest.approx(transitions_time_s(ran, mesh, cluster), rel=1e-9), u.fqn
