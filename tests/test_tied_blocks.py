"""Repeated blocks planned once (search/tied.py): the tied problem prices every block-uniform plan
exactly as the full problem does, the found plan gives every block the first block's choices, and
its full-cost-model step time is that of the untied search within a stated tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autoddl.cluster import Cluster
from autoddl.loader import load_model_file
from search.formulate import formulate
from search.planner import search
from search.tied import tie_blocks, tied_descent

ROOT = Path(__file__).resolve().parents[1]
DGX = ROOT / "configs" / "dgx-a100-8.yaml"
# The tied search's found step time against the untied one's: at most this much slower. Measured
# 2026-11-23: equal (ratio 1.00000) on gpt tiny x4 (dgx-a100-8 8 and 2x4) and llama tiny x4 (2x4);
# the gpt2-small case on h100-4x8 8x4 (slow) passes within it.
TOLERANCE = 0.02


def graph_of(model: str, **sizes):
    return load_model_file(ROOT / "examples" / f"{model}.py", **sizes).trace("float32")


@pytest.fixture(scope="module")
def gpt4():
    return graph_of("gpt", preset="tiny", n_layer=4)


@pytest.fixture(scope="module")
def dgx():
    return Cluster.from_yaml(DGX)


def test_tied_problem_prices_uniform_plans_exactly(gpt4, dgx):
    problem = formulate(gpt4, dgx, (2, 4)).problem
    tied = tie_blocks(problem)
    (group,) = problem.groups                              # the 4 blocks: one stack
    assert len(group) == 4 and tied.reduced.n == problem.n - 3 * len(group[0])
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.integers(0, tied.reduced.num_choices)
        full = tied.expand(a)
        for inst in group[1:]:                             # every instance takes instance 0's choices
            assert np.array_equal(full[inst], full[group[0]])
        assert np.array_equal(tied.restrict(full), a)
        assert problem.cost(full) == pytest.approx(tied.reduced.cost(a), rel=1e-12)
        assert problem.memory(full) == pytest.approx(tied.reduced.memory(a), rel=1e-12)


def test_no_groups_nothing_to_tie(dgx):
    one = graph_of("gpt", preset="tiny", n_layer=1)
    assert tie_blocks(formulate(one, dgx, (8,)).problem) is None


def test_tied_descent_gives_every_block_the_first_blocks_choices(gpt4, dgx):
    problem = formulate(gpt4, dgx, (2, 4)).problem
    result = tied_descent(problem, {}, time_limit_s=1.0)
    (group,) = problem.groups
    for inst in group[1:]:
        assert np.array_equal(result.assignment[inst], result.assignment[group[0]])
    assert result.cost == pytest.approx(problem.cost(result.assignment), rel=1e-12)
    assert "repeated blocks tied" in result.notes[-1]
    untied = tied_descent(problem, {}, tie=False, time_limit_s=1.0)
    assert result.cost <= untied.cost * (1 + TOLERANCE)


@pytest.mark.parametrize("model,sizes,cluster,devices,mesh", [
    ("gpt", dict(preset="tiny", n_layer=4), "dgx-a100-8", None, (8,)),
    ("gpt", dict(preset="tiny", n_layer=4), "dgx-a100-8", None, (2, 4)),
    ("llama", dict(preset="tiny", n_layers=4), "dgx-a100-8", None, (2, 4)),
    pytest.param("gpt", dict(preset="gpt2-small", batch_size=8), "h100-4x8", None, (8, 4),
                 marks=pytest.mark.slow),       # the mid-size preset: ~4 minutes of two searches at load 7
])
def test_tied_search_matches_the_full_search(model, sizes, cluster, devices, mesh):
    graph = graph_of(model, **sizes)
    c = Cluster.from_yaml(ROOT / "configs" / f"{cluster}.yaml")
    tied = search(graph, c, mesh=mesh, tie_blocks=True)
    full = search(graph, c, mesh=mesh, tie_blocks=False)
    assert tied.found_breakdown.step_time_s <= full.found_breakdown.step_time_s * (1 + TOLERANCE)
