"""OpGraph: topology helpers, uses(), totals, fingerprint, table, construction errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoddl
from autoddl.graph import NodeKind, OpGraph, OpNode, TensorMeta, TensorRef


class Square(nn.Module):
    """fc(x) * fc(x) + bias_buf: one producer used twice by the same op."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("shift", torch.zeros(d))

    def forward(self, x):
        h = self.fc(x)                 # (B, d)
        return h * h + self.shift


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return autoddl.trace(Square(), (torch.randn(2, 4),))


def test_node_kinds_and_order(graph):
    kinds = [n.kind for n in graph.topo()]
    assert kinds == [NodeKind.PARAMETER, NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.INPUT,
                     NodeKind.OP, NodeKind.OP, NodeKind.OP, NodeKind.OUTPUT]
    assert [n.target for n in graph.ops()] == ["aten.linear.default", "aten.mul.Tensor", "aten.add.Tensor"]
    assert list(graph.parameters()) == ["fc.weight", "fc.bias"]
    assert [n.target for n in graph.nodes_of(NodeKind.BUFFER)] == ["shift"]
    assert len(graph) == 8 and list(iter(graph)) == list(graph.topo())


def test_topological_order_defines_before_use(graph):
    seen: set[str] = set()
    for node in graph.topo():
        assert all(ref.node in seen for ref in node.inputs), node
        seen.add(node.name)


def test_producers_consumers_and_uses(graph):
    linear, mul, add = graph.ops()
    assert {(p.kind, p.target) for p in graph.producers(linear.name)} == {
        (NodeKind.INPUT, "x"), (NodeKind.PARAMETER, "fc.weight"), (NodeKind.PARAMETER, "fc.bias")}
    assert [c.name for c in graph.consumers(linear.name)] == [mul.name]
    # mul reads linear's output in both slots: two uses through one edge
    assert sorted((c.name, out, slot) for c, out, slot in graph.uses(linear.name)) == [
        (mul.name, 0, 0), (mul.name, 0, 1)]
    assert graph.nx.edges[linear.name, mul.name]["refs"] == [(0, 0), (0, 1)]
    assert [(c.name, slot) for c, _, slot in graph.uses(mul.name)] == [(add.name, 0)]
    assert graph.meta_of(TensorRef(linear.name)) == TensorMeta((2, 4), "float32")


def test_totals(graph):
    assert graph.parameter_count == 4 * 4 + 4
    assert graph.parameter_bytes == (4 * 4 + 4) * 4
    assert graph.total_flops == sum(n.flops for n in graph.ops()) == (2 * 2 * 4 * 4 + 8) + 8 + 8
    assert "3 ops" in repr(graph) and "20 parameters" in repr(graph)


def test_to_frame(graph):
    df = graph.to_frame()
    assert list(df.columns) == ["op", "target", "output_shape", "gflops", "mb", "params", "module"]
    assert len(df) == 3
    row = df.iloc[0]
    assert row["params"] == "fc.weight,fc.bias" and row["output_shape"] == "2x4" and row["module"] == "fc"
    assert row["gflops"] == pytest.approx((2 * 2 * 4 * 4 + 8) / 1e9)


def test_fingerprint_stable_and_shape_sensitive(graph):
    again = autoddl.trace(Square(), (torch.randn(2, 4),))
    assert again.fingerprint() == graph.fingerprint()
    other_batch = autoddl.trace(Square(), (torch.randn(3, 4),))
    assert other_batch.fingerprint() != graph.fingerprint()
    other_width = autoddl.trace(Square(8), (torch.randn(2, 8),))
    assert other_width.fingerprint() != graph.fingerprint()


def test_lookup_error_names_the_node(graph):
    with pytest.raises(KeyError, match="no node named 'nope' in the graph of Square"):
        graph["nope"]
    assert "x" in graph and "nope" not in graph


def _meta(*shape):
    return (TensorMeta(shape, "float32"),)


def test_construction_errors():
    x = OpNode("x", NodeKind.INPUT, "x", outputs=_meta(2))
    with pytest.raises(ValueError, match="duplicate node name 'x'"):
        OpGraph([x, OpNode("x", NodeKind.INPUT, "x", outputs=_meta(2))])
    reads_later = OpNode("y", NodeKind.OP, "aten.neg.default", inputs=(TensorRef("z"),), outputs=_meta(2))
    with pytest.raises(ValueError, match="node 'y' reads 'z' before it is defined"):
        OpGraph([x, reads_later])


def test_hand_built_graph_multi_output():
    x = OpNode("x", NodeKind.INPUT, "x", outputs=_meta(4, 2))
    split = OpNode("split", NodeKind.OP, "aten.split.Tensor", inputs=(TensorRef("x"),),
                   outputs=_meta(2, 2) + _meta(2, 2))
    add = OpNode("add", NodeKind.OP, "aten.add.Tensor", inputs=(TensorRef("split", 0), TensorRef("split", 1)),
                 outputs=_meta(2, 2), flops=4)
    g = OpGraph([x, split, add], model_name="hand")
    assert [(c.name, out, slot) for c, out, slot in g.uses("split")] == [("add", 0, 0), ("add", 1, 1)]
    assert split.op_name == "split" and OpNode("p", NodeKind.PARAMETER, "fc.weight").op_name == "fc.weight"
    assert g.total_flops == 4 and str(TensorRef("split", 1)) == "split[1]"
