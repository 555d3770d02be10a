"""A graph at another batch read off two traces (autoddl/rebatch.py) equals the trace at that batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoddl.graph import NodeKind
from autoddl.loader import load_model_file
from autoddl.rebatch import at_batch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model,sizes,dtype", [("gpt", {"preset": "tiny"}, "bfloat16"),
                                               ("llama", {"preset": "tiny"}, "float32"),
                                               ("vgg", {"preset": "tiny"}, "float32")])
def test_graph_at_another_batch_equals_its_trace(model, sizes, dtype):
    mf = load_model_file(ROOT / "examples" / f"{model}.py", **sizes)
    traced = {b: mf.with_batch_size(b).trace(dtype) for b in (1, 2, 6)}
    for (b1, b2), b in (((1, 2), 6), ((2, 6), 1), ((1, 6), 2)):
        got = at_batch(traced[b1], b1, traced[b2], b2, b)
        assert got is not None, (b1, b2, b)
        assert list(got.topo()) == list(traced[b].topo())             # every field of every node
        assert got.fingerprint() == traced[b].fingerprint() and got.total_flops == traced[b].total_flops
        assert sorted(got.nx.edges(data=True)) == sorted(traced[b].nx.edges(data=True))


def test_graphs_that_differ_by_more_than_the_batch_give_none():
    gpt = ROOT / "examples" / "gpt.py"
    two = load_model_file(gpt, preset="tiny").trace()                 # batch 4
    three = load_model_file(gpt, preset="tiny", n_layer=3).trace()
    assert at_batch(two, 4, three, 8, 16) is None                     # other ops
    eight = load_model_file(gpt, preset="tiny", batch_size=8).trace()
    assert at_batch(two, 4, eight, 2, 16) is None                     # the inputs' dim 0 is not the batch said
    assert at_batch(two, 4, two, 4, 8) is None                        # one batch fixes no line
    assert at_batch(two, 4, eight, 8, 16).nodes_of(NodeKind.INPUT)[0].outputs[0].shape == (16, 32)
