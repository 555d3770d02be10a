"""An emulated dtype's matmuls by operand layout (autoddl/matmul_layouts.py): the table, its reading in
the cluster file, and a linear priced by it (costmodel/compute.py ``layout_linear_s``)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pathlib import Path

from autoddl.cluster import Cluster, ClusterConfigError
from autoddl.graph import NodeKind, OpNode, TensorMeta
from autoddl.matmul_layouts import MatmulLayoutTable, linear_matmuls, local_linear_dims
from autoddl.sbp import B, P, S, NdSbp, Signature
from clusters import CPU_CLUSTER_PATH
from costmodel.compute import op_backward_time_s, op_forward_time_s

SIZES = (32, 128)
BF16_CPU = Path(__file__).resolve().parents[1] / "results" / "bf16-cpu" / "cluster.yaml"   # bf16 calibrated in


def _rate(layout, m, k, n):
    """A made-up FLOP/s that differs by layout and grows 4x from m = 32 to m = 128 (k and n: flat)."""
    return {"NN": 1e9, "NT": 3e9, "TN": 10e9}[layout] * (m / 32)


def _table(sizes=SIZES):
    rows = [[m, k, n, *(2 * m * k * n / _rate(layout, m, k, n) * 1e6 for layout in ("NN", "NT", "TN"))]
            for m in sizes for k in sizes for n in sizes]
    return rows, MatmulLayoutTable.from_rows(list(reversed(rows)))          # any row order


def test_table_reads_its_points_interpolates_the_rate_in_log_size_and_is_flat_beyond():
    rows, table = _table()
    for m, k, n, nn, nt, tn in rows:
        assert [table.time_s(lay, m, k, n) * 1e6 for lay in ("NN", "NT", "TN")] == pytest.approx([nn, nt, tn])
    # m = 64 is halfway between 32 and 128 in log m: the rate's geometric mean, 2 x the rate at 32
    assert table.time_s("NT", 64, 100, 50) == pytest.approx(2 * 64 * 100 * 50 / (3e9 * 2))
    assert table.time_s("NN", 16, 32, 32) == pytest.approx(2 * 16 * 32 * 32 / 1e9)          # below: the m = 32 rate
    assert table.time_s("TN", 4096, 32, 32) == pytest.approx(2 * 4096 * 32 * 32 / 40e9)     # above: m = 128's
    assert table.time_s("NN", 0, 32, 32) == 0.0
    with pytest.raises(ValueError, match="layout 'TT'"):
        table.time_s("TT", 32, 32, 32)


def test_linear_products_and_the_share_each_split_leaves():
    assert linear_matmuls(8, 64, 512) == (("NT", 8, 64, 512), ("NN", 8, 512, 64), ("TN", 512, 8, 64))
    x, w = (4, 32, 64), (512, 64)                       # (B, T, K) input, (N, K) weight: M = 128
    assert local_linear_dims(x, w, [(B, B)], (2,)) == (128, 64, 512)
    assert local_linear_dims(x, w, [(S(0), B)], (2,)) == (64, 64, 512)           # data parallel: M
    assert local_linear_dims(x, w, [(B, S(0))], (2,)) == (128, 64, 256)          # column parallel: N
    assert local_linear_dims(x, w, [(S(2), S(1))], (2,)) == (128, 32, 512)       # row parallel: K, once
    assert local_linear_dims(x, w, [(S(0), B), (B, S(0))], (2, 4)) == (64, 64, 128)
    assert local_linear_dims(x, w, [(P, B)], (2,)) == (128, 64, 512)


def test_cluster_file_round_trip_and_errors_name_the_field(tmp_path):
    rows, table = _table()
    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    cluster = dataclasses.replace(base, matmul_layouts={"bfloat16": rows})
    assert cluster.matmul_layouts.get("bfloat16") == table and cluster.matmul_layouts.get("float16") is None
    path = tmp_path / "c.yaml"
    cluster.to_yaml(path)
    again = Cluster.from_yaml(path)
    assert again == cluster and hash(again) == hash(cluster) and "matmul layouts: bfloat16" in again.summary()
    bad = {**cluster.to_dict(), "matmul_layouts": {"bfloat16": rows[1:], "int8": rows}}
    with pytest.raises(ClusterConfigError) as err:
        Cluster.from_dict(bad, "x.yaml")
    text = str(err.value)
    assert "x.yaml: matmul_layouts: unknown dtype 'int8'" in text
    assert "x.yaml: matmul_layouts.bfloat16: the rows must cover every combination of the sizes [32, 128]" in text
    assert "missing 1, e.g. m, k, n = [32, 32, 32]" in text
    with pytest.raises(ClusterConfigError, match=r"matmul_layouts.bfloat16\[0\]: expected \[m, k, n, nn_us, nt_us, "
                                                 r"tn_us\] \(whole sizes, positive times\), got \[32, 32\]"):
        Cluster.from_dict({**bad, "matmul_layouts": {"bfloat16": [[32, 32]]}}, "x.yaml")


def _linear(x_shape, n, dtype):
    x, w = TensorMeta(x_shape, dtype), TensorMeta((n, x_shape[-1]), dtype)
    y = TensorMeta((*x_shape[:-1], n), dtype)
    m = math.prod(x_shape[:-1])
    return OpNode(name="linear", kind=NodeKind.OP, target="aten.linear.default", input_metas=(x, w),
                  outputs=(y,), flops=2 * m * x_shape[-1] * n, bytes_read=x.nbytes + w.nbytes, bytes_written=y.nbytes)


def test_a_bf16_linear_is_priced_by_its_three_products_and_the_family_fixed_cost():
    """On the calibrated CPU file with a table for bfloat16: forward = NT(M, K, N) + the family's fixed
    forward cost; backward = NN(M, N, K) + TN(N, M, K) + its fixed backward cost; data parallel over 2
    halves M. A float32 linear, and a bf16 linear on the file without the table, keep the roofline price."""
    rows, table = _table()
    base = dataclasses.replace(Cluster.from_yaml(BF16_CPU), matmul_layouts={})
    cluster = dataclasses.replace(base, matmul_layouts={"bfloat16": rows})
    node = _linear((2, 32, 64), 512, "bfloat16")                  # M 64, K 64, N 512
    fam = cluster.executor.op_cost("linear", "bfloat16")
    share = cluster.time_sharing((2,))
    sig = Signature((NdSbp((S(0),)), NdSbp((B,))), (NdSbp((S(0),)),))
    fwd = table.time_s("NT", 32, 64, 512) + fam.forward_us * 1e-6
    bwd = table.time_s("NN", 32, 512, 64) + table.time_s("TN", 512, 32, 64) + fam.backward_us * 1e-6
    bwd += cluster.executor.param_us * len(node.params) * 1e-6
    assert op_forward_time_s(node, sig, (2,), cluster) == pytest.approx(fwd * share)
    assert op_backward_time_s(node, sig, (2,), cluster) == pytest.approx(bwd * share)
    f32 = _linear((2, 32, 64), 512, "float32")
    assert op_forward_time_s(f32, sig, (2,), cluster) == op_forward_time_s(f32, sig, (2,), base)
    assert op_backward_time_s(f32, sig, (2,), cluster) == op_backward_time_s(f32, sig, (2,), base)
    assert op_forward_time_s(node, sig, (2,), cluster) != op_forward_time_s(node, sig, (2,), base)
