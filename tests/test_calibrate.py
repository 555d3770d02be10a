"""`autoddl calibrate`: fits recover known latency/bandwidth, the schema's new sections, the cost model's use
of them, and one real --quick run on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import yaml

from autoddl import cli
from autoddl.calibration import calibrate_cluster, combined_link, disagreeing_kinds, fit_collectives
from autoddl.cluster import CONFIG_DIR, Backend, Cluster, ClusterConfigError, CollectiveFits, LinkSpec
from costmodel.collectives import (CollectiveKind as K, cluster_collective_time_s, collective_time_s,
                                   fit_collective)
from costmodel.compute import compute_efficiency, roofline_time_s
from executor.calibrate import (CollectiveTiming, MatmulTiming, Measurements, Settings, axis_sizes,
                                compute_summary)
from clusters import CPU_CLUSTER_PATH

MB = 2 ** 20
SIZES = [4096 * 4 ** i for i in range(7)] + [32 * MB]


def ring_time_s(kind: str, m: float, n: int, b: float, a: float) -> float:
    """The cost model's formulas, written out here (DESIGN.md "Cost model")."""
    return {
        "all_reduce": 2 * (n - 1) / n * m / b + 2 * (n - 1) * a,
        "all_gather": (n - 1) / n * m / b + (n - 1) * a,
        "reduce_scatter": (n - 1) / n * m / b + (n - 1) * a,
        "all_to_all": (n - 1) / n * (m / n) / b + (n - 1) * a,
        "broadcast": m / b + (n - 1) * a,
    }[kind]


GLOO_FORMULA = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "all_reduce",
                "all_to_all": "all_to_all", "broadcast": "broadcast"}      # what gloo runs for each kind


def base_cluster() -> Cluster:
    """The bundled local-cpu cluster without its measured per-kind fits, compute curve, executor overheads,
    core sharing and links' CPU cost (so times follow the link formulas alone)."""
    from autoddl.cluster import ExecutorOverheads

    c = Cluster.from_yaml(CPU_CLUSTER_PATH)
    return dataclasses.replace(c, collectives=CollectiveFits(), compute_curve=(), executor=ExecutorOverheads(),
                               cores_per_node=None, intra_node=dataclasses.replace(c.intra_node, cpu_ns_per_byte=0.0),
                               inter_node=dataclasses.replace(c.inter_node, cpu_ns_per_byte=0.0))


# -- fitting ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("kind", list(GLOO_FORMULA))
def test_fit_recovers_known_alpha_beta_exactly(kind, backend):
    a, b = 37e-6, 1.7e9                                      # 37 us, 1.7 GB/s
    formula = GLOO_FORMULA[kind] if backend == "gloo" else kind
    samples = [(n, m, ring_time_s(formula, m, n, b, a)) for n in (2, 4) for m in SIZES]
    fit = fit_collective(K(kind), backend, samples)
    assert fit.carried_as.value == formula and fit.points == len(samples)
    assert fit.latency_us == pytest.approx(37.0, rel=1e-9)
    assert fit.bandwidth_gbps == pytest.approx(1.7, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12) and fit.max_rel_residual < 1e-9
    assert fit.predict_s(5 * MB, 4) == pytest.approx(ring_time_s(formula, 5 * MB, 4, b, a), rel=1e-9)


def test_fit_is_least_squares_in_relative_error_and_reports_quality():
    a, b = 100e-6, 1e9
    clean = [(2, m, ring_time_s("all_reduce", m, 2, b, a)) for m in SIZES]
    noisy = [(n, m, t * (1.1 if i % 2 else 0.9)) for i, (n, m, t) in enumerate(clean)]
    fit = fit_collective(K.ALL_REDUCE, "gloo", noisy)
    pred = [ring_time_s("all_reduce", m, 2, fit.bandwidth_gbps * 1e9, fit.latency_us * 1e-6) for _, m, _ in noisy]
    rel = [abs(p - t) / t for p, (_, _, t) in zip(pred, noisy)]
    assert fit.max_rel_residual == pytest.approx(max(rel))
    t = [s[2] for s in noisy]
    mean = sum(t) / len(t)
    r2 = 1 - sum((p - x) ** 2 for p, x in zip(pred, t)) / sum((x - mean) ** 2 for x in t)
    assert fit.r2 == pytest.approx(r2) and 0.9 < fit.r2 < 1
    assert 0.8 < fit.bandwidth_gbps < 1.25 and 70 < fit.latency_us < 130


def test_fit_clamps_negative_latency_and_rejects_flat_timings():
    b = 2e9
    samples = [(2, m, m / b - 5e-6) for m in SIZES[3:]]    # unconstrained least squares: latency < 0
    fit = fit_collective(K.BROADCAST, "gloo", samples)
    w = [1 / t for _, _, t in samples]
    x = [m for _, m, _ in samples]                            # broadcast on 2: t = M / b + a
    inv_b = (sum(xi * wi * wi * ti for xi, wi, (_, _, ti) in zip(x, w, samples))
             / sum((xi * wi) ** 2 for xi, wi in zip(x, w)))
    assert fit.latency_us == 0 and fit.bandwidth_gbps == pytest.approx(1 / inv_b / 1e9)
    with pytest.raises(ValueError, match="do not grow with message size"):
        fit_collective(K.ALL_REDUCE, "gloo", [(2, m, 1e-3 / (i + 1)) for i, m in enumerate(SIZES)])
    with pytest.raises(ValueError, match="2 or more"):
        fit_collective(K.ALL_REDUCE, "gloo", [(2, 4096, 1e-4), (1, 8192, 1e-4)])


def test_combined_link_and_disagreeing_kinds():
    def timings(kind, a, b):
        return [CollectiveTiming(kind, 2, m, ring_time_s(GLOO_FORMULA[kind], m, 2, b, a), "synthetic") for m in SIZES]

    same = [t for k in GLOO_FORMULA for t in timings(k, 50e-6, 1e9)]
    fits = fit_collectives(same, "gloo")
    link = combined_link(fits)
    assert link.latency_us == pytest.approx(50) and link.bandwidth_gbps == pytest.approx(1)
    assert disagreeing_kinds(fits, link) == []
    mixed = [t for k, (a, b) in {"all_reduce": (50e-6, 1e9), "all_gather": (60e-6, 0.5e9),
                                 "reduce_scatter": (52e-6, 1.1e9), "all_to_all": (58e-6, 0.95e9),
                                 "broadcast": (30e-6, 3e9)}.items() for t in timings(k, a, b)]
    fits = fit_collectives(mixed, "gloo")
    link = combined_link(fits)
    assert link.latency_us == pytest.approx(52) and link.bandwidth_gbps == pytest.approx(1.0)   # medians
    assert disagreeing_kinds(fits, link) == ["all_gather", "broadcast"]
    flat = [CollectiveTiming("broadcast", 2, m, 1e-3, "synthetic") for m in SIZES]     # pure noise
    failed: dict[str, str] = {}
    fits = fit_collectives(timings("all_reduce", 50e-6, 1e9) + flat, "gloo", failed)
    assert list(fits) == ["all_reduce"] and "do not grow with message size" in failed["broadcast"]
    with pytest.raises(ValueError, match="no collective could be fitted.*idle"):
        fit_collectives(flat, "gloo")
    # a fit that explains its timings badly (R^2 below the threshold) is refused, with its R^2
    noisy = [CollectiveTiming("all_gather", 2, m, ring_time_s(GLOO_FORMULA["all_gather"], m, 2, 1e9, 50e-6)
                              * (3.0 if i % 2 else 0.3), "synthetic") for i, m in enumerate(SIZES)]
    failed = {}
    fits = fit_collectives(timings("all_reduce", 50e-6, 1e9) + noisy, "gloo", failed, min_r2=0.9)
    r2 = fit_collective(K.ALL_GATHER, "gloo", [(t.n_devices, t.nbytes, t.time_s) for t in noisy]).r2
    assert r2 < 0.9 and list(fits) == ["all_reduce"] and f"R^2 {r2:.2f} < 0.9" in failed["all_gather"]
    assert "all_gather" in fit_collectives(noisy, "gloo", {}, min_r2=r2 - 1e-9)


# -- schema ----------------------------------------------------------------------------------------
def test_schema_collectives_and_curve_load_validate_and_round_trip(tmp_path):
    d = base_cluster().to_dict()
    d["collectives"] = {"all_reduce": {"latency_us": 80, "bandwidth_gbps": 1.5}, "broadcast": {
        "latency_us": 40.5, "bandwidth_gbps": 3}}
    d["compute_curve"] = [[0.0005, 0.3], [0.03, 0.8], [2, 0.95]]
    c = Cluster.from_dict(d)
    assert c.collectives.get(K.ALL_REDUCE) == LinkSpec(1.5, 80) and c.collectives.get("all_gather") is None
    assert c.compute_curve == ((0.0005, 0.3), (0.03, 0.8), (2.0, 0.95))
    out = tmp_path / "c.yaml"
    c.to_yaml(out, comments={"collectives.all_reduce": "fitted", "compute_curve.1": "256^3"}, header="line 1\nline 2")
    text = out.read_text()
    assert text.startswith("# line 1\n# line 2\nname: ")
    assert "  all_reduce:  # fitted\n" in text and "  - [0.03, 0.8]  # 256^3\n" in text
    back = Cluster.from_yaml(out)
    assert back == c and hash(back) == hash(c)
    assert yaml.safe_load(text)["compute_curve"] == [[0.0005, 0.3], [0.03, 0.8], [2, 0.95]]
    bad = dict(d, collectives={"all_reduc": {"latency_us": 1, "bandwidth_gbps": 1},
                               "broadcast": {"latency_us": -1, "bandwidth_gbps": 1}},
               compute_curve=[[0.1, 0.5], [0.05, 0.6], [1, 1.5], "x"])
    with pytest.raises(ClusterConfigError) as info:
        Cluster.from_dict(bad, source="bad.yaml")
    errors = info.value.errors
    assert any("collectives.all_reduc: unknown key; did you mean 'all_reduce'?" in e for e in errors)
    assert any("collectives.broadcast.latency_us: expected a non-negative number" in e for e in errors)
    assert any("compute_curve[1][0]: GFLOPs must increase strictly" in e for e in errors)
    assert any("compute_curve[2][1]: expected an efficiency (fraction of peak) in (0, 1], got 1.5" in e
               for e in errors)
    assert any("compute_curve[3]: expected a pair [gflop, efficiency], got 'x'" in e for e in errors)
    assert all(e.startswith("bad.yaml: ") for e in errors) and len(errors) == 5


# -- cost model ------------------------------------------------------------------------------------
def test_cost_model_uses_per_kind_fits_on_intra_node_axes():
    base = dataclasses.replace(base_cluster(), nodes=2, devices_per_node=2,
                               inter_node=LinkSpec(bandwidth_gbps=0.1, latency_us=500.0),
                               efficiency=dataclasses.replace(base_cluster().efficiency, network=0.5))
    fitted = dataclasses.replace(base, collectives=CollectiveFits(all_reduce=LinkSpec(3.0, 20.0),
                                                                  all_gather=LinkSpec(0.7, 90.0)))
    m, eff = 3 * MB, 0.5
    ar = ring_time_s("all_reduce", m, 2, 3.0e9 * eff, 20e-6)
    # mesh (2, 2): axis 1 is inside a node (fits apply), axis 0 crosses nodes (inter-node link)
    assert cluster_collective_time_s(K.ALL_REDUCE, m, (2, 2), 1, fitted) == pytest.approx(ar, rel=1e-12)
    assert cluster_collective_time_s(K.ALL_GATHER, m, (2, 2), -1, fitted) == pytest.approx(
        ring_time_s("all_gather", m, 2, 0.7e9 * eff, 90e-6), rel=1e-12)
    # gloo reduce-scatter is an all-reduce: without its own fit it takes all_reduce's
    assert cluster_collective_time_s(K.REDUCE_SCATTER, m, (2, 2), 1, fitted) == pytest.approx(ar, rel=1e-12)
    link = base.intra_node
    # all-to-all runs natively on gloo: without its own fit, the link and the all-to-all formula
    assert cluster_collective_time_s(K.ALL_TO_ALL, m, (2, 2), 1, fitted) == pytest.approx(
        ring_time_s("all_to_all", m, 2, link.bandwidth_gbps * 1e9 * eff, link.latency_us * 1e-6), rel=1e-12)
    assert cluster_collective_time_s(K.BROADCAST, m, (2, 2), 1, fitted) == pytest.approx(
        ring_time_s("broadcast", m, 2, link.bandwidth_gbps * 1e9 * eff, link.latency_us * 1e-6), rel=1e-12)
    assert cluster_collective_time_s(K.ALL_REDUCE, m, (2, 2), 0, fitted) == pytest.approx(
        ring_time_s("all_reduce", m, 2, 0.1e9 * eff, 500e-6), rel=1e-12)
    for kind in K:                                              # no fits: exactly collective_time_s
        for axis in (0, 1):
            assert cluster_collective_time_s(kind, m, (2, 2), axis, base) == collective_time_s(
                kind, m, 2, base.link_for_axis((2, 2), axis), base.backend, eff)


def test_compute_curve_sets_efficiency_by_op_flops():
    cpu = base_cluster()
    curved = dataclasses.replace(cpu, compute_curve=((0.001, 0.2), (0.1, 0.6), (10.0, 0.9)))
    assert compute_efficiency(1e6, curved) == pytest.approx(0.2)            # at a point
    assert compute_efficiency(1e3, curved) == 0.2 and compute_efficiency(1e12, curved) == 0.9   # flat ends
    w = math.log(1e9 / 1e8) / math.log(10 / 0.1)                            # 1 GFLOP between 0.1 and 10
    assert compute_efficiency(1e9, curved) == pytest.approx(0.6 + w * 0.3)
    assert compute_efficiency(1e9, cpu) == cpu.efficiency.compute           # no curve
    peak = cpu.device.peak_tflops * 1e12
    assert roofline_time_s(1e9, 8, curved) == pytest.approx(1e9 / (peak * 0.75))
    # backward of a matmul: 2 ops of the forward's size, read off the curve at that size
    assert roofline_time_s(2e8, 8, curved, op_flops=1e8) == pytest.approx(2e8 / (peak * 0.6))


def test_compute_summary_peak_and_curve():
    peak = 50e9                                                 # FLOP/s
    eff = {64: 0.2, 128: 0.5, 512: 0.8, 1024: 1.0}
    overhead = 5e-6
    mts = tuple(MatmulTiming(s, s, s, 2 * s ** 3 / (peak * e) + overhead) for s, e in eff.items())
    skinny = MatmulTiming(1024, 1024, 128, 2 * 1024 * 1024 * 128 / (peak * 0.6) + overhead)   # = 512^3 FLOPs
    # shorter than 10x the dispatch: its rate (65 GFLOP/s after taking out the dispatch) sets no peak
    tiny = MatmulTiming(32, 32, 32, 2e-6)
    summary = compute_summary((tiny,) + mts + (skinny,), overhead)
    assert summary.peak_tflops == pytest.approx(0.05)
    assert [e for _, e in summary.curve] == [1.0, 0.2, 0.5, 0.7, 1.0]       # 512^3 and skinny: median 0.7
    assert [g for g, _ in summary.curve] == [round(2 * s ** 3 / 1e9, 6) for s in (32, *eff)]
    assert summary.large_efficiency == pytest.approx(1.0)                     # 1024^3 = 2.1 GFLOP
    assert [len(g) for g in summary.groups] == [1, 1, 1, 2, 1]


def synthetic_measurements(kind_params: dict[str, tuple[float, float]],
                           dtype_rates: dict[str, float] | None = None) -> Measurements:
    """Matmuls at 40 GFLOP/s in float32 (and at ``dtype_rates`` FLOP/s in other dtypes, on the same shapes)."""
    settings = Settings.default(2, quick=True, threads=1)
    colls = tuple(CollectiveTiming(k, 2, m, ring_time_s(GLOO_FORMULA[k], m, 2, b, a), "synthetic")
                  for k, (a, b) in kind_params.items() for m in settings.message_bytes)
    mts = tuple(MatmulTiming(m, n, k, 2 * m * n * k / 40e9) for m, n, k in settings.matmul_shapes)
    by_dtype = {d: tuple(MatmulTiming(m, n, k, 2 * m * n * k / r, d) for m, n, k in settings.matmul_shapes)
                for d, r in (dtype_rates or {}).items()}
    return Measurements(settings=settings, matmuls=mts, memory_gbps={"copy": 9.0, "add": 7.5}, dispatch_us=0.0,
                        tiny_op_us=4.0, collectives=colls, seconds={"total": 1.0}, machine="test",
                        dtype_matmuls=by_dtype)


def test_calibrate_cluster_from_synthetic_measurements(tmp_path):
    agree = {k: (50e-6, 1.2e9) for k in GLOO_FORMULA}
    cal = calibrate_cluster(synthetic_measurements(agree), base_cluster(), devices_per_node=4, command="x")
    c = cal.cluster
    assert (c.name, c.backend, c.devices_per_node, c.device.name) == ("local-cpu", Backend.GLOO, 4, "cpu-core-avx2")
    assert c.intra_node == LinkSpec(1.2, 50.0) == c.inter_node and not c.collectives
    assert c.device.peak_tflops == 0.04 and c.efficiency.compute == 1.0 and c.device.memory_bandwidth_gbps == 9.0
    assert c.device.peaks == {"float32": 0.04}          # only float32 timed: a mapping, so bfloat16 is not guessed
    assert c.op_overhead_us == 4.0 and all(e == 1.0 for _, e in c.compute_curve)
    # the host side of a CPU (spilling): a copy moves half the bytes the copy rate counts (read + written)
    assert c.host_link == LinkSpec(4.5, 4.0) and c.host_memory_bandwidth_gbps == 2 * 9.0
    assert c.host_memory_gb == pytest.approx(4 * c.device.memory_gb, rel=0.01)
    out = tmp_path / "cal.yaml"
    cal.write(out)
    assert Cluster.from_yaml(out) == c
    text = out.read_text()
    assert "  bandwidth_gbps: 4.5  # measured: copy over large arrays (bytes read + written) / 2, per rank" in text
    assert "devices_per_node: 4  # ranks on this machine; calibrated with 2; above 2 ranks they share cores" in text
    differ = dict(agree, broadcast=(20e-6, 4e9))
    cal = calibrate_cluster(synthetic_measurements(differ), base_cluster(), command="x")
    assert cal.cluster.collectives.get("broadcast") == LinkSpec(4.0, 20.0)
    assert cal.cluster.collectives.get("all_reduce") == LinkSpec(1.2, 50.0)
    cal.write(out)
    assert Cluster.from_yaml(out) == cal.cluster and "  broadcast:  # a 20.0 us, b 4.000 GB/s" in out.read_text()
    # the links' CPU per byte is measured apart (--only collective_cpu): a full calibration keeps the base's
    base = base_cluster()
    base = dataclasses.replace(base, intra_node=dataclasses.replace(base.intra_node, cpu_ns_per_byte=0.7))
    c = calibrate_cluster(synthetic_measurements(agree), base, command="x").cluster
    assert c.intra_node == LinkSpec(1.2, 50.0, cpu_ns_per_byte=0.7) == c.inter_node


def test_calibrate_cluster_writes_a_peak_per_timed_dtype(tmp_path):
    meas = synthetic_measurements({k: (50e-6, 1.2e9) for k in GLOO_FORMULA})
    bf16 = tuple(MatmulTiming(m, n, k, 2 * m * n * k / (20e9 if m == n == k == 512 else 15e9), "bfloat16")
                 for m, n, k in meas.settings.matmul_shapes)                  # 20 GFLOP/s at its best, 512^3
    meas = dataclasses.replace(meas, dtype_matmuls={"bfloat16": bf16},
                               dropped_dtypes={"float16": "9x float32's time on 64x64 @ 64x64 (more than 8x)"})
    cal = calibrate_cluster(meas, base_cluster(), command="x")
    dev = cal.cluster.device
    assert dev.peaks == {"float32": 0.04, "bfloat16": 0.02} and dev.peak_tflops == 0.04
    assert dev.peak_tflops_for("bf16") == 0.02 and cal.compute.peaks == pytest.approx(dev.peaks)
    with pytest.raises(ClusterConfigError, match="device.peak_tflops.float16: missing"):
        dev.peak_tflops_for("float16")                  # dropped: no peak rather than a guessed one
    assert [d for d, _, _ in cal.compute.dtype_peaks] == ["float32", "bfloat16"]
    assert cal.comments["device.peak_tflops.bfloat16"] == "measured: best bfloat16 matmul rate, 512x512 @ 512x512"
    assert "no float16 peak: 9x float32's time on 64x64 @ 64x64" in cal.comments["device.peak_tflops"]
    out = tmp_path / "cal.yaml"
    cal.write(out)
    assert Cluster.from_yaml(out) == cal.cluster
    text = out.read_text()
    assert "  peak_tflops:  # measured: best matmul rate per dtype over the same 5 shapes" in text
    assert "    bfloat16: 0.02  # measured: best bfloat16 matmul rate, 512x512 @ 512x512\n" in text


def test_compute_summary_peak_per_dtype():
    dispatch = 5e-6
    f32 = tuple(MatmulTiming(s, s, s, 2 * s ** 3 / 50e9 + dispatch) for s in (256, 512, 1024))
    bf16 = tuple(MatmulTiming(s, s, s, 2 * s ** 3 / r + dispatch, "bfloat16")
                 for s, r in ((256, 10e9), (512, 24e9), (1024, 22e9)))
    summary = compute_summary(f32, dispatch, {"bfloat16": bf16})
    assert summary.peaks == pytest.approx({"float32": 0.05, "bfloat16": 0.024})
    assert summary.dtype_peaks[1][2] == bf16[1] and summary.peak_tflops == pytest.approx(0.05)
    assert [e for _, e in summary.curve] == [1.0, 1.0, 1.0]                 # the curve is float32's
    assert compute_summary(f32, dispatch).peaks == pytest.approx({"float32": 0.05})


def test_slow_dtype_is_timed_no_further_and_gets_no_peak():
    from executor.calibrate import SLOW_DTYPE_FACTOR, Bench, _combine

    shapes = ((64, 64, 64), (128, 128, 128), (256, 256, 256))
    settings = Settings.default(2, quick=True, threads=1, matmul_shapes=shapes)
    assert SLOW_DTYPE_FACTOR == 8
    per_call = {"float32": 1e-3, "bfloat16": 2e-3, "float16": 9e-3}
    bench = object.__new__(Bench)                     # the rank's logic alone: no process group
    bench.s, bench.rank = settings, 0
    bench.say = lambda text: None
    bench.agree_max = lambda value, group=None: value
    bench._time_matmul = lambda m, n, k, dtype: (per_call[dtype] * m / 64, 3)
    out = Bench.matmuls(bench)
    assert out["matmul"] == [1e-3, 2e-3, 4e-3] and out["matmul_dtypes"]["bfloat16"] == [2e-3, 4e-3, 8e-3]
    assert out["matmul_dtypes"]["float16"] == [9e-3]                         # dropped after the first shape
    assert out["matmul_dropped"] == {"float16": "9x float32's time on 64x64 @ 64x64 (more than 8x): not a dtype "
                                                "to train in on this machine"}
    rank = dict(out, memory_gbps={"copy": 1.0}, dispatch_us=1.0, tiny_op_us=2.0, collectives_how={},
                collectives={}, seconds={"matmul": 1.0}, machine="test")
    meas = _combine(settings, [rank, rank], 1.0)
    assert list(meas.dtype_matmuls) == ["bfloat16"] and meas.dropped_dtypes == out["matmul_dropped"]
    assert [mt.time_s for mt in meas.dtype_matmuls["bfloat16"]] == [2e-3, 4e-3, 8e-3]
    assert {mt.dtype for mt in meas.dtype_matmuls["bfloat16"]} == {"bfloat16"}
    with pytest.raises(ValueError, match="matmul_dtypes must start with float32"):
        Settings(matmul_dtypes=("bfloat16", "float32"))
    with pytest.raises(ValueError, match="matmul_dtypes must start with float32"):
        Settings(matmul_dtypes=("float32", "int8"))


def test_keep_slow_dtypes_times_them_through_and_says_how_slow():
    """--keep-slow-dtypes: a dtype 9-36x float32's time keeps every shape's timing and a peak; the file's
    comment names its slowest shape. --dtypes picks the dtypes timed besides float32."""
    from autoddl.cli import build_parser
    from autoddl.cli.calibrate import _command, _dtype_settings
    from executor.calibrate import Bench, _combine

    shapes = ((64, 64, 64), (128, 128, 128), (256, 256, 256))
    settings = Settings.default(2, quick=True, threads=1, matmul_shapes=shapes, keep_slow_dtypes=True,
                                **_dtype_settings("float16"))
    assert settings.matmul_dtypes == settings.family_dtypes == ("float32", "float16")
    per_call = {"float32": 1e-3, "float16": 9e-3}
    bench = object.__new__(Bench)
    bench.s, bench.rank = settings, 0
    bench.say = lambda text: None
    bench.agree_max = lambda value, group=None: value
    bench._time_matmul = lambda m, n, k, dtype: (per_call[dtype] * (m / 64) ** (2 if dtype == "float16" else 1), 3)
    out = Bench.matmuls(bench)
    assert out["matmul_dtypes"]["float16"] == pytest.approx([9e-3, 36e-3, 144e-3]) and not out["matmul_dropped"]
    assert out["matmul_slow"] == {"float16": "36x float32's time on 256x256 @ 256x256"}
    rank = dict(out, memory_gbps={"copy": 1.0}, dispatch_us=1.0, tiny_op_us=2.0, collectives_how={},
                collectives={}, seconds={"matmul": 1.0}, machine="test")
    meas = _combine(settings, [rank, rank], 1.0)
    assert list(meas.dtype_matmuls) == ["float16"] and meas.slow_dtypes == out["matmul_slow"]
    assert _dtype_settings(None) == {}
    args = build_parser().parse_args(["calibrate", "--out", "x.yaml", "--dtypes", "bfloat16", "--keep-slow-dtypes"])
    assert _command(args).endswith("--out x.yaml --dtypes bfloat16 --keep-slow-dtypes")   # the file's header
    for bad in ("float32", "int8", "bfloat16,bfloat16"):
        with pytest.raises(ValueError, match="name each of bfloat16, float16 at most once"):
            _dtype_settings(bad)


# -- the real thing, quick ---------------------------------------------------------------------
SHARD_FIELDS = ("shard_forward_us", "shard_backward_us", "shard_param_us")


def test_axis_sizes():
    assert axis_sizes(2) == (2,) and axis_sizes(4) == (2, 4) and axis_sizes(6) == (2, 3, 6)


def test_quick_calibration_on_two_gloo_ranks(tmp_path, capfd):
    out, raw = tmp_path / "local.yaml", tmp_path / "raw.csv"
    assert cli.main(["calibrate", "--nproc", "2", "--quick", "--out", str(out), "--raw", str(raw)]) == 0
    c = Cluster.from_yaml(out)
    assert (c.name, c.backend, c.device.kind, c.devices_per_node) == ("local-cpu", Backend.GLOO, "cpu", 4)
    numbers = [c.device.peak_tflops, c.device.memory_bandwidth_gbps, c.intra_node.bandwidth_gbps,
               c.intra_node.latency_us, c.op_overhead_us, c.efficiency.compute]
    assert all(x > 0 and math.isfinite(x) for x in numbers), numbers
    assert 1e-3 < c.device.peak_tflops < 10 and c.compute_curve[-1][0] == pytest.approx(2 * 512 ** 3 / 1e9, rel=1e-3)
    assert c.compute_curve and all(0 < e <= 1 for _, e in c.compute_curve)
    # bfloat16 matmuls run on every x86 / Arm CPU torch supports, timed on the same shapes: a peak of their
    # own, or (a CPU without bfloat16 instructions, 10-100x float32's time) none and the reason in the file
    assert "float32" in c.device.peaks and all(0 < p < 10 for p in c.device.peaks.values())
    text = out.read_text()
    half = [d for d in ("bfloat16", "float16") if d in c.device.peaks]
    assert all((d in c.device.peaks) != (f"no {d} peak: " in text) for d in ("bfloat16", "float16"))
    assert all(f"    {d}: " in text and f"# measured: best {d} matmul rate, " in text for d in half)
    c.to_yaml(tmp_path / "again.yaml")
    assert Cluster.from_yaml(tmp_path / "again.yaml") == c
    printed, err = capfd.readouterr()
    assert all(f"{d} {c.device.peaks[d]:g}" in printed for d in half)     # the summary calibrate prints
    n_shapes = len(Settings.default(2, quick=True).matmul_shapes)
    assert err.count("calibrate: matmul") == n_shapes
    assert ("bfloat16" in half) == (err.count("calibrate: bfloat16 matmul") == n_shapes)   # else dropped early
    assert all(f"calibrate: {k} on 2 of 2 ranks" in err for k in [*GLOO_FORMULA, "send_recv"])
    rows = raw.read_text().splitlines()
    assert rows[0] == "benchmark,what,n_devices,bytes_or_flops,time_s" and len(rows) > 25
    # each op family timed per dtype on synthetic inputs: a fixed cost and a work scale each; recompute's costs
    families = {"linear", "layer_norm", "scaled_dot_product_attention", "embedding", "cross_entropy_loss",
                "softmax", "gelu", "silu", "mul", "add", "view", "conv2d"}
    ex = c.executor
    timed = ["float32"] + [d for d in half if d == "bfloat16"]          # a dtype without a peak: no families
    assert set(ex.op_us) == set(ex.op_work) == set(timed)
    for dtype in timed:
        assert families <= set(ex.op_us[dtype]) and set(ex.op_work[dtype]) == set(ex.op_us[dtype]) - {
            "view", "transpose"}                        # views: a fixed cost, no roofline
        assert all(f >= 0 and b >= 0 and math.isfinite(f + b) for f, b in ex.op_us[dtype].values())
        assert all(len(c) == 1 and min(c[0]) > 0 for c in ex.op_work[dtype].values())   # 2 sizes: 1 point
    assert ex.op_us["float32"]["linear"][0] > 0 and ex.op_us["float32"]["linear"][1] > 0
    assert set(ex.recompute) == {"full", "selective"}
    assert err.count("calibrate: op families in ") == 4 and err.count("calibrate: recompute ") == 4
    assert "op families measured: " in printed and "op_us:  # measured: per op family" in text
    assert any(r.startswith("family,") for r in rows) and any(r.startswith("recompute,") for r in rows)
    # the shard runner's own costs (autoddl schedule --run), timed on its 4 models
    assert err.count("calibrate: shard runner, ") == 4
    assert min(ex.shard_forward_us, ex.shard_backward_us, ex.shard_param_us) >= 0
    for field in SHARD_FIELDS:      # a cost fitted to 0 (a quick fit on a noisy VM) is left out, comment and all
        assert (getattr(ex, field) > 0) == (f"\n  {field}: " in text), field
    # ZeRO-1's parameter sync, timed on the param chains of both lengths against the bare all-gather
    assert err.count("calibrate: executor ZeRO-1 parameter sync of ") == 2
    assert ex.param_sync_us >= 0 and (ex.param_sync_us > 0) == ("\n  param_sync_us: " in text)
    # a ZeRO-3 group gather of the same chains' parameters, likewise
    assert err.count("calibrate: executor ZeRO-3 group gather of ") == 2
    assert ex.param_gather_us >= 0 and (ex.param_gather_us > 0) == ("\n  param_gather_us: " in text)


def test_calibrate_rejects_bad_options_before_measuring(capsys):
    assert cli.main(["calibrate", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "calibrate --backend nccl: the base cluster" in err and "pass --base with a cuda device" in err
    assert cli.main(["calibrate", "--nproc", "1"]) == 2
    assert "autoddl: error: calibrate: --nproc must be at least 2 to time collectives, got 1" in capsys.readouterr().err


# -- the executor's fixed costs ------------------------------------------------------------------
def _chains(op_f, op_b, in_f, in_b, param, fixed_f, fixed):
    from executor.calibrate import ChainTiming

    out = []
    for kind, ops, inputs, params in (("unary", 10, 11, 1), ("unary", 42, 43, 1), ("binary", 10, 16, 1),
                                      ("binary", 42, 64, 1), ("param", 10, 19, 9), ("param", 42, 83, 41)):
        fwd = op_f * ops + in_f * inputs + fixed_f
        step = (op_f + op_b) * ops + (in_f + in_b) * inputs + param * params + fixed
        out.append(ChainTiming(kind, ops, inputs, params, fwd * 1e-6, step * 1e-6))
    return tuple(out)


def test_fit_executor_overheads_recovers_exact_costs():
    from autoddl.cluster import ExecutorOverheads
    from executor.calibrate import ExecutorTimings, fit_executor_overheads

    timings = ExecutorTimings(_chains(200, 60, 30, 90, 400, 500, 2000), {"all_reduce": 1700.0, "all_gather": 1500.0},
                              {"all_reduce": 1000.0, "all_gather": 1000.0})
    fit = fit_executor_overheads(timings)
    got = fit.overheads.scalars()
    want = ExecutorOverheads(200, 60, 30, 90, 400, 600).scalars()     # collective: median(700, 500)
    assert got == pytest.approx(want, rel=1e-6)
    assert fit.step_fixed_us == pytest.approx(2000, rel=1e-6) and fit.max_rel_residual < 1e-9
    # a backward cheaper than its forward part cannot be negative; a redistribute cheaper than the bare call gives 0
    neg = ExecutorTimings(timings.chains, {"all_reduce": 900.0}, {"all_reduce": 1000.0})
    assert fit_executor_overheads(neg).overheads.collective_us == 0.0
    with pytest.raises(ValueError, match="every chain kind"):
        fit_executor_overheads(ExecutorTimings(timings.chains[:2], {}, {}))


def test_fit_param_sync_us_is_the_slope_beyond_the_bare_gather_and_the_priced_copy():
    from executor.calibrate import ExecutorTimings, fit_param_sync_us

    def timings(*rows):
        return ExecutorTimings(_chains(200, 60, 30, 90, 400, 500, 2000), {}, {}, tuple(rows))

    # sync = 900 us fixed + 80 us per parameter + the all-gather (1000 us + 10 us per parameter's bytes)
    rows = [(p, 900 + 80 * p + 1000 + 10 * p, 1000 + 10 * p) for p in (9, 41)]
    assert fit_param_sync_us(timings(*rows), per_copy_us=16.0) == pytest.approx(64.0)
    assert fit_param_sync_us(timings(*reversed(rows)), per_copy_us=16.0) == pytest.approx(64.0)
    assert fit_param_sync_us(timings(*rows), per_copy_us=100.0) == 0.0        # cheaper than priced: none
    assert fit_param_sync_us(timings(rows[0]), per_copy_us=16.0) is None      # one length: no slope
    assert fit_param_sync_us(timings(), per_copy_us=16.0) is None


def test_fit_param_gather_us_is_the_slope_beyond_the_bare_gather_and_the_priced_copy():
    """The same slope as the sync's, from the ZeRO-3 gathers' rows alone (the syncs' rows are ignored)."""
    from executor.calibrate import ExecutorTimings, fit_param_gather_us

    # gather = 700 us fixed + 45 us per parameter + the all-gather (800 us + 12 us per parameter's bytes)
    gathers = tuple((p, 700 + 45 * p + 800 + 12 * p, 800 + 12 * p) for p in (9, 41))
    syncs = tuple((p, 5000.0 * p, 1.0) for p in (9, 41))
    timings = ExecutorTimings(_chains(200, 60, 30, 90, 400, 500, 2000), {}, {}, syncs, gathers)
    assert fit_param_gather_us(timings, per_copy_us=8.0) == pytest.approx(37.0)
    assert fit_param_gather_us(dataclasses.replace(timings, param_gathers=gathers[:1]), per_copy_us=8.0) is None
    assert fit_param_gather_us(dataclasses.replace(timings, param_gathers=()), per_copy_us=8.0) is None


def test_with_executor_overheads_sets_section_and_dispatch_only_op_overhead(tmp_path):
    from executor.calibrate import ExecutorTimings, with_executor_overheads

    syncs = ((9, 9 * 500.0 + 2000, 2000.0), (41, 41 * 500.0 + 2000, 2000.0))      # 500 us per parameter
    meas = dataclasses.replace(synthetic_measurements({k: (50e-6, 1.2e9) for k in GLOO_FORMULA}), executor=ExecutorTimings(
        _chains(200, 60, 30, 90, 400, 500, 2000), {"all_reduce": 1700.0}, {"all_reduce": 1000.0}, syncs))
    cal = calibrate_cluster(meas, base_cluster(), devices_per_node=4, command="x")
    cluster, comments = with_executor_overheads(cal.cluster, cal.comments, meas)
    assert cluster.op_overhead_us == 4.0                         # tiny op with grad; the DTensor round is in executor
    assert (cluster.executor.op_forward_us, cluster.executor.param_us, cluster.executor.collective_us) == \
        pytest.approx((200, 400, 700))
    assert "chains of tiny ops" in comments["executor"] and "4 KB" in comments["executor.collective_us"]
    assert cluster.executor.param_sync_us == pytest.approx(500 - 4 - 200 - 30)   # less a copy pass's fixed cost:
    # the tiny op, op_forward_us and one input_forward_us (costmodel.compute.forward_time_s, measured=False)
    assert "41 parameters 22500 us vs 2000 us" in comments["executor.param_sync_us"]
    cluster.to_yaml(tmp_path / "c.yaml", comments=comments, header="h")
    assert Cluster.from_yaml(tmp_path / "c.yaml") == cluster
    assert with_executor_overheads(cal.cluster, cal.comments, synthetic_measurements(
        {k: (50e-6, 1.2e9) for k in GLOO_FORMULA})) == (cal.cluster, cal.comments)     # not timed: unchanged


# -- op families and recompute -------------------------------------------------------------------------
def test_fit_recompute_recovers_per_op_and_per_block_costs():
    from executor.calibrate import RecomputeTiming, fit_recompute

    # per op (us): forward f, backward b plainly; a policy adds fwd_x forward, bwd_x backward per op (plus the
    # op's forward again where it is recomputed) and block_f / block_b per block
    plain = {"elementwise": (3.0, 5.0), "matmul": (8.0, 20.0)}
    add = {("full", "elementwise"): (4, 3), ("full", "matmul"): (9, 6),
           ("selective", "elementwise"): (11, 36), ("selective", "matmul"): (25, 30)}
    block = {"full": (100, 200), "selective": (220, 90)}
    rows = []
    for kind, (f, b) in plain.items():
        for n in (8, 24):
            rows.append(RecomputeTiming(kind, "none", n, (50 + f * n) * 1e-6, (50 + f * n + 80 + b * n) * 1e-6))
            for policy in ("full", "selective"):
                fx, bx = add[(policy, kind)]
                rerun = 1.0 if policy == "full" or kind == "elementwise" else 0.5   # every second mm
                fwd = 50 + block[policy][0] + (f + fx) * n
                bwd = 80 + block[policy][1] + (b + bx + f * rerun) * n
                rows.append(RecomputeTiming(kind, policy, n, fwd * 1e-6, (fwd + bwd) * 1e-6))
    got = fit_recompute(rows)
    for policy in ("full", "selective"):
        c = got[policy]
        assert (c.op_forward_us, c.op_backward_us) == pytest.approx(add[(policy, "elementwise")])
        assert (c.matmul_forward_us, c.matmul_backward_us) == pytest.approx(add[(policy, "matmul")])
        assert (c.block_forward_us, c.block_backward_us) == pytest.approx(block[policy])
    with pytest.raises(ValueError, match="need every kind"):
        fit_recompute(rows[:3])


def _family_measurements(cluster, a_f=6.0, s_f=0.5, a_b=12.0, s_b=2.0):
    """Synthetic family timings: t = a + s x roofline of the probed op (the Probe's real sizes), in float32,
    for linear, gelu and view (no roofline: a alone); the chain ops timed at 2 us forward and backward."""
    from costmodel.compute import backward_factor
    from executor.calibrate import FamilyTiming
    from executor.calibrate_models import probe_ops

    settings = Settings.default(2, quick=True, family_dtypes=("float32",), family_sizes=("tiny", "small", "medium"))
    rows = []
    for (dtype, size), nodes in probe_ops(settings).items():
        for node, _ in nodes:
            if node.op_name not in ("linear", "gelu", "view"):
                continue
            nbytes, k = node.bytes_read + node.bytes_written, backward_factor(node.op_name)
            xf = roofline_time_s(node.flops, nbytes, cluster) * 1e6 if k else 0.0
            xb = roofline_time_s(k * node.flops, k * nbytes, cluster, op_flops=node.flops) * 1e6 if k else 0.0
            rows.append(FamilyTiming(node.op_name, dtype, size, node.flops, nbytes, (a_f + s_f * xf) * 1e-6,
                                     (a_b + s_b * xb) * 1e-6))
    meas = dataclasses.replace(synthetic_measurements({k: (50e-6, 1.2e9) for k in GLOO_FORMULA}), settings=settings,
                               families=tuple(rows))
    return meas


def test_op_family_fit_recovers_fixed_costs_and_work_scales_and_adds_the_executors_own_cost(tmp_path):
    from autoddl.calibration import fit_op_families, with_op_families
    from executor.calibrate import ChainTiming, ExecutorTimings, executor_glue_us

    cal = calibrate_cluster(synthetic_measurements({k: (50e-6, 1.2e9) for k in GLOO_FORMULA}), base_cluster(),
                            devices_per_node=4, command="x")
    meas = _family_measurements(cal.cluster)
    fits = {f.family: f for f in fit_op_families(meas, cal.cluster)}
    assert set(fits) == {"linear", "gelu", "view"}
    for name in ("linear", "gelu"):
        f = fits[name]
        assert (f.forward_us, f.backward_us) == pytest.approx((6.0, 12.0), rel=1e-6)
        assert len(f.work) == 2 and f.work[0][0] < f.work[1][0]            # the sizes but the smallest
        assert all((a, b) == pytest.approx((0.5, 2.0), rel=1e-6) for _, a, b in f.work)
    assert f.sizes == ("tiny", "small", "medium") and f.times_us[0] == pytest.approx((6.0 + 0.5 * 0, 12.0), abs=1.0)
    assert (fits["view"].forward_us, fits["view"].backward_us, fits["view"].work) == (6.0, 12.0, ())
    # a dtype the device has no peak for (its matmuls too slow to train in: no roofline) is left out, not a crash
    assert cal.cluster.device.peaks == {"float32": 0.04}
    fp16 = dataclasses.replace(meas, families=meas.families + tuple(dataclasses.replace(f, dtype="float16")
                                                                    for f in meas.families))
    assert sorted((f.dtype, f.family) for f in fit_op_families(fp16, cal.cluster)) == \
        [("float32", "gelu"), ("float32", "linear"), ("float32", "view")]
    # the executor's own cost per op (its chains less the same chains as plain modules: 5 us forward, 3 backward)
    # is added
    chains = tuple(ChainTiming(kind, n, n, 0, (100 + 9 * n) * 1e-6, (300 + 9 * n + 7 * n) * 1e-6,
                               (80 + 4 * n) * 1e-6, (200 + 4 * n + 4 * n) * 1e-6)
                   for kind in ("unary", "binary") for n in (10, 42))
    assert executor_glue_us(ExecutorTimings(chains, {}, {})) == pytest.approx((5.0, 3.0))
    meas = dataclasses.replace(meas, executor=ExecutorTimings(chains, {}, {}))
    cluster, comments = with_op_families(cal.cluster, cal.comments, meas)
    assert cluster.executor.op_us["float32"] == {"linear": (11.0, 15.0), "gelu": (11.0, 15.0), "view": (11.0, 15.0)}
    assert "5.0 us forward, 3.0 us backward" in comments["executor.op_us"]
    assert set(cluster.executor.op_work["float32"]) == {"linear", "gelu"}                  # a view has no roofline
    mm = cluster.executor.op_cost("mm")
    assert (mm.forward_us, mm.backward_us) == (11.0, 15.0) and mm.work_at(1.0) == pytest.approx((0.5, 2.0), rel=1e-3)
    assert "synthetic inputs at sizes tiny, small, medium" in comments["executor.op_us"]
    assert comments["executor.op_us.float32.gelu"].startswith("sizes tiny, small, medium: ")
    cluster.to_yaml(tmp_path / "c.yaml", comments=comments, header="h")
    assert Cluster.from_yaml(tmp_path / "c.yaml") == cluster


# -- point-to-point sends ----------------------------------------------------------------------------
def send_recv_timings(a: float, b: float) -> tuple[CollectiveTiming, ...]:
    """One-way send times of the send_recv formula, M/b + a (costmodel.collectives), at the quick sizes."""
    return tuple(CollectiveTiming("send_recv", 2, m, m / b + a, "synthetic")
                 for m in Settings.default(2, quick=True).message_bytes)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_send_recv_fit_recovers_known_alpha_beta_exactly(backend):
    fit = fit_collective(K.SEND_RECV, backend, [(t.n_devices, t.nbytes, t.time_s)
                                                for t in send_recv_timings(85e-6, 2.5e9)])
    assert fit.carried_as is K.SEND_RECV and fit.points == 5
    assert fit.latency_us == pytest.approx(85.0, rel=1e-9) and fit.bandwidth_gbps == pytest.approx(2.5, rel=1e-9)


def test_calibrate_cluster_writes_the_send_recv_fit_apart_from_the_link(tmp_path):
    """Collectives that agree leave no per-kind entries, but send_recv's fit is always written, and the
    link is the median over the collectives alone (a send at 10x their bandwidth does not move it)."""
    meas = synthetic_measurements({k: (50e-6, 1.2e9) for k in GLOO_FORMULA})
    meas = dataclasses.replace(meas, collectives=meas.collectives + send_recv_timings(80e-6, 12e9))
    cal = calibrate_cluster(meas, base_cluster(), command="x")
    c = cal.cluster
    assert c.intra_node == LinkSpec(1.2, 50.0) and c.collectives.items() == [("send_recv", LinkSpec(12.0, 80.0))]
    out = tmp_path / "cal.yaml"
    cal.write(out)
    assert Cluster.from_yaml(out) == c and "  send_recv:  # a 80.0 us, b 12.000 GB/s, send_recv formula" in out.read_text()


def test_calibrate_only_send_recv_adds_its_fit_to_the_base(tmp_path):
    """--only send_recv: the base cluster with collectives.send_recv set, every other field (the base's
    own per-kind fits included) unchanged."""
    from autoddl.calibration import calibrate_fits

    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    settings = Settings.default(2, quick=True, kinds=("send_recv",), comm_only=True)
    meas = Measurements(settings=settings, matmuls=(), memory_gbps={}, dispatch_us=0.0, tiny_op_us=0.0,
                        collectives=send_recv_timings(120e-6, 3e9), seconds={"total": 1.0}, machine="test")
    cal = calibrate_cluster(meas, base, command="autoddl calibrate --only send_recv")
    assert cal.cluster == dataclasses.replace(base, collectives=dataclasses.replace(
        base.collectives, send_recv=LinkSpec(3.0, 120.0)))
    assert calibrate_fits(meas, base).cluster == cal.cluster
    out = tmp_path / "sr.yaml"
    cal.write(out)
    assert Cluster.from_yaml(out) == cal.cluster
    assert "Only send_recv timed (--only); every other field is from" in out.read_text()
    with pytest.raises(ValueError, match="timed on gloo but the base cluster .* uses nccl"):
        calibrate_fits(meas, Cluster.from_yaml(CONFIG_DIR / "dgx-a100-8.yaml"))
    with pytest.raises(ValueError, match="--only: unknown communication kinds \\['send'\\]"):
        Settings.default(2, kinds=("send",), comm_only=True)


def test_calibrate_only_keeps_the_base_files_header_and_comments(tmp_path):
    """--only send_recv over a calibrated file: the command line keeps the base file's header (this run's
    appended) and every comment of a field it did not measure, and comments the fit it wrote; before,
    the rewritten file lost every source comment of the base."""
    from autoddl.calibration import Calibration
    from autoddl.cli.calibrate import _over_base_file

    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    settings = Settings.default(2, quick=True, kinds=("send_recv",), comm_only=True)
    meas = Measurements(settings=settings, matmuls=(), memory_gbps={}, dispatch_us=0.0, tiny_op_us=0.0,
                        collectives=send_recv_timings(120e-6, 3e9), seconds={"total": 1.0}, machine="test")
    cal = calibrate_cluster(meas, base, command="autoddl calibrate --only send_recv")
    base_file = tmp_path / "base.yaml"
    base.to_yaml(base_file, comments={"device.memory_gb": "measured by hand", "collectives.send_recv": "old fit"},
                 header="the full calibration")
    out = tmp_path / "out.yaml"
    _over_base_file(cal, str(base_file)).write(out)
    again = Calibration.of_file(out)
    assert again.cluster == cal.cluster and again.comments["device.memory_gb"] == "measured by hand"
    assert again.comments["collectives.send_recv"].startswith("measured: a 120.0 us, b 3.000 GB/s")
    assert again.header.startswith("the full calibration\nThen: Measured by `autoddl calibrate --only send_recv`")


def test_quick_send_recv_calibration_on_two_gloo_ranks(tmp_path, capfd):
    """A real --only send_recv run: half a gloo isend / irecv ping-pong between 2 ranks, fitted and
    written over --base. R^2 is not asserted here (the test machine is shared; the synthetic tests
    check the fit), so --min-r2 lets any fit through."""
    out, raw = tmp_path / "sr.yaml", tmp_path / "sr.csv"
    assert cli.main(["calibrate", "--nproc", "2", "--quick", "--only", "send_recv", "--min-r2=-1e9",
                     "--base", str(CPU_CLUSTER_PATH), "--out", str(out), "--raw", str(raw)]) == 0
    c = Cluster.from_yaml(out)
    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    fit = c.collectives.get("send_recv")
    assert fit.bandwidth_gbps > 0 and fit.latency_us >= 0 and math.isfinite(fit.bandwidth_gbps + fit.latency_us)
    assert dataclasses.replace(c, collectives=base.collectives) == base
    rows = raw.read_text().splitlines()[1:]
    sizes = Settings.default(2, quick=True).message_bytes
    assert [r.split(",")[-3:-1] for r in rows] == [["2", str(m)] for m in sizes]      # one row per size, no other
    assert "calibrate: send_recv on 2 of 2 ranks (gloo isend/irecv + wait, half a ping-pong)" in capfd.readouterr().err


# -- the shard runner's own fixed costs (autoddl schedule --run) ------------------------------------

def _shard_samples(fwd_us, bwd_us, param_us, op_f_us, op_b_us):
    """Tasks of 8, 9, 32 and 33 ops (1 or all factors parameters) timed exactly as the model says."""
    from executor.calibrate_shards import ShardTaskSample

    out = []
    for ops, params in ((8, 2), (8, 8), (9, 2), (9, 8), (32, 2), (32, 32), (33, 2), (33, 32)):
        priced = 1e-4 + 3e-6 * ops
        out.append(ShardTaskSample("F", ops, 0, priced + (fwd_us + op_f_us * ops) * 1e-6, priced))
        out.append(ShardTaskSample("B", ops, params, priced + (bwd_us + op_b_us * ops + param_us * params) * 1e-6,
                                   priced))
    return out


def test_fit_shard_runner_recovers_known_task_parameter_and_op_costs():
    from executor.calibrate_shards import fit_shard_runner

    fit = fit_shard_runner(_shard_samples(11.0, 33.0, 5.5, 2.0, -2.5))
    assert (fit.forward_us, fit.backward_us, fit.param_us) == pytest.approx((11.0, 33.0, 5.5), abs=1e-6)
    assert (fit.op_forward_us, fit.op_backward_us) == pytest.approx((2.0, -2.5), abs=1e-6)
    assert fit.max_rel_residual == pytest.approx(0.0, abs=1e-9)
    # a task that takes less than its ops' price gets no negative fixed cost: 0, and the residual says so
    low = fit_shard_runner(_shard_samples(-20.0, 33.0, 5.5, 0.0, 0.0))
    assert low.forward_us == 0.0 and low.backward_us == pytest.approx(33.0) and low.max_rel_residual > 0
    same_params = [s for s in _shard_samples(1, 1, 1, 0, 0) if s.params in (0, 2)]     # params never vary apart
    with pytest.raises(ValueError, match="op and parameter counts vary apart"):
        fit_shard_runner(same_params)


def test_with_shard_runner_fits_each_task_less_its_ops_as_the_schedule_prices_them(monkeypatch):
    """The glue: every calibration model priced by search/shards.py (fields 0), its shards' op and
    parameter counts, and the fit; the measurement replaced by those prices plus known costs."""
    import autoddl.calibration as calibration
    from autoddl.calibration import Calibration, SHARD_RUNS, with_shard_runner
    from autoddl.loader import load_model_file
    from executor.calibrate_shards import SHARD_CHAIN, ShardTaskTiming
    from search.shards import shard_job

    base = Cluster.from_yaml(CPU_CLUSTER_PATH)
    zero = dataclasses.replace(base, executor=dataclasses.replace(
        base.executor, shard_forward_us=0.0, shard_backward_us=0.0, shard_param_us=0.0)).resized(2)
    # by hand: 4 blocks of `ops` muls cut 2 | 2; shard 1 also runs the loss's sum; params per block 1 or ops
    counts = {(4, 1): ((8, 2), (9, 2)), (4, 4): ((8, 8), (9, 8)), (16, 1): ((32, 2), (33, 2)),
              (16, 16): ((32, 32), (33, 32))}

    def fake(runs, nproc, threads, steps, timeout_s, verbose):
        out = []
        for sizes, cuts in runs:
            job, _ = shard_job("x", load_model_file(SHARD_CHAIN, **sizes).trace(), zero, 1, 2)
            assert cuts == job.cuts == ("blocks.2",)
            for s, (ops, params) in enumerate(counts[(sizes["ops"], sizes["params"])]):
                out.append(ShardTaskTiming(tuple(sorted(sizes.items())), s, "F",
                                           job.forward_s[s] + (12.0 + 1.5 * ops) * 1e-6))
                out.append(ShardTaskTiming(tuple(sorted(sizes.items())), s, "B",
                                           job.backward_s[s] + (30.0 - 1.0 * ops + 6.0 * params) * 1e-6))
        return out

    monkeypatch.setattr(calibration, "measure_shard_tasks", fake)
    assert len(SHARD_RUNS) == 4
    cal = with_shard_runner(Calibration(base, {}, "", {}, None), Settings.default(2, quick=True))
    ex = cal.cluster.executor
    assert (ex.shard_forward_us, ex.shard_backward_us, ex.shard_param_us) == (12.0, 30.0, 6.0)
    assert dataclasses.replace(cal.cluster, executor=base.executor) == base
    assert "per op beyond the priced ops 1.5 us forward, -1.0 us backward" in cal.comments["executor.shard_forward_us"]


def test_calibrate_only_shard_runner_rewrites_the_base_keeping_its_comments(tmp_path, capfd):
    """A real --only shard_runner run on 2 gloo ranks: the three fields measured (not asserted beyond being
    sane numbers: the test machine is shared), every other line of the base file as it was."""
    base_path = CPU_CLUSTER_PATH
    out = tmp_path / "shards.yaml"
    assert cli.main(["calibrate", "--nproc", "2", "--quick", "--only", "shard_runner", "--base", str(base_path),
                     "--out", str(out)]) == 0
    c, base = Cluster.from_yaml(out), Cluster.from_yaml(base_path)
    ex = c.executor
    assert all(x >= 0 and math.isfinite(x) for x in (ex.shard_forward_us, ex.shard_backward_us, ex.shard_param_us))
    assert dataclasses.replace(c, executor=base.executor) == base
    new = out.read_text().splitlines()
    kept = [line for line in new if "shard_" not in line]
    assert kept == [line for line in base_path.read_text().splitlines() if "shard_" not in line]
    written = {f: line for line in new for f in SHARD_FIELDS if line.startswith(f"  {f}: ")}
    assert all("  # " in line for line in written.values())               # each written field says how it was fitted
    assert set(written) == {f for f in SHARD_FIELDS if getattr(ex, f) > 0}     # a cost fitted to 0 is left out
    assert capfd.readouterr().err.count("calibrate: shard runner, ") == 4
    assert cli.main(["calibrate", "--only", "shard_runner,send_recv"]) == 2
    assert "shard_runner is timed alone" in capfd.readouterr().err


def test_the_contiguous_probe_copies_a_transposed_input():
    """``contiguous`` given a tensor already contiguous returns that tensor, so a probe on synthetic
    (contiguous) inputs timed no copy; the probe's call gets a transposed view, as a model's ``contiguous``
    does (after a transpose), and each call returns a new contiguous tensor of the op's shape."""
    import torch

    from executor.calibrate import Bench
    from executor.calibrate_models import probe_ops

    settings = Settings.default(2, quick=True, family_dtypes=("float32",), family_sizes=("tiny", "small"))
    (node, needs), = [(n, k) for n, k in probe_ops(settings)[("float32", "small")] if n.op_name == "contiguous"]
    bench = Bench.__new__(Bench)                    # no process group: only the op's call is built
    bench.torch, bench.device = torch, torch.device("cpu")
    forward, _ = bench._op_calls(node, needs)
    first, second = forward(), forward()
    assert first.is_contiguous() and tuple(first.shape) == node.outputs[0].shape
    assert first.data_ptr() != second.data_ptr()    # copied, not the input handed back
    assert torch.equal(first, second)


def test_the_op_families_are_timed_in_a_rotating_order():
    """The first call of a pass pays for what the pass before it freed (17 us for a 5 us view here):
    with every pass starting one op further along, an op that is slow only when it runs first is timed
    at its ordinary speed, as are the others; in a fixed order the first op would be timed slow."""
    from executor.calibrate import interleaved_call_times

    calls: list[int] = []

    def op(i: int):
        def run():
            calls.append(i)
            if len(calls) % 4 == 1:           # the first call of a pass (4 ops, every pass runs all 4)
                time.sleep(0.004)
            return i
        return run

    medians = interleaved_call_times([op(i) for i in range(4)], passes=9)
    assert len(calls) == 4 * 10                          # one untimed pass, then 9
    assert max(medians) < 0.002, medians                 # the 4 ms first call is in no op's median
    firsts = [calls[4 * p] for p in range(10)]
    assert firsts == [p % 4 for p in range(10)]          # pass p starts at op p mod 4


def test_a_calibration_takes_each_timing_as_the_median_of_its_launches():
    """Three launches of the same settings: every timing (matmuls, memory, collectives, the per-op cost)
    is the median of the three, what was timed is kept, the wall times add up, and the fitted file
    says so in its header; launches that timed different things are refused."""
    from executor.calibrate import median_of_launches

    agree = {k: (50e-6, 1.2e9) for k in GLOO_FORMULA}
    base = synthetic_measurements(agree)
    scale = (1.0, 1.6, 0.7)                      # a launch in a quiet, a busy and a quick minute
    launches = [dataclasses.replace(
        base, matmuls=tuple(dataclasses.replace(m, time_s=m.time_s * f) for m in base.matmuls),
        memory_gbps={k: v / f for k, v in base.memory_gbps.items()}, tiny_op_us=base.tiny_op_us * f,
        collectives=tuple(dataclasses.replace(c, time_s=c.time_s * f) for c in base.collectives),
        seconds={"total": 10.0 * f}) for f in scale]
    med = median_of_launches(launches)
    assert med.launches == 3 and med.seconds == {"total": pytest.approx(33.0)}
    assert [m.time_s for m in med.matmuls] == [m.time_s for m in base.matmuls]          # the median: x1.0
    assert med.memory_gbps == base.memory_gbps and med.tiny_op_us == base.tiny_op_us
    assert [(c.kind, c.nbytes, c.time_s) for c in med.collectives] == \
        [(c.kind, c.nbytes, c.time_s) for c in base.collectives]
    assert med.settings == base.settings and med.machine == base.machine
    one_slow = median_of_launches([launches[1], launches[1], launches[0]])    # the median, not the mean
    assert one_slow.tiny_op_us == pytest.approx(base.tiny_op_us * 1.6)
    cal = calibrate_cluster(med, base_cluster(), devices_per_node=4, command="x")
    assert "each timing the median of 3 launches" in cal.header.splitlines()[1]
    assert cal.cluster.device.memory_bandwidth_gbps == 9.0
    with pytest.raises(ValueError, match="different numbers of measurements.collectives"):
        median_of_launches([base, dataclasses.replace(base, collectives=base.collectives[:-1])])
    with pytest.raises(ValueError, match="--launches must be a positive integer"):
        Settings.default(2, launches=0)
    assert Settings.default(2).launches == 3 and Settings.default(2, quick=True).launches == 1


def test_emulated_dtypes_are_those_more_than_the_slow_factor_below_float32():
    from autoddl.calibration import emulated_dtypes
    from executor.calibrate import SLOW_DTYPE_FACTOR

    base = Cluster.from_yaml(CPU_CLUSTER_PATH)

    def with_peaks(**peaks):
        return dataclasses.replace(base, device=dataclasses.replace(base.device, peak_tflops=peaks))

    assert emulated_dtypes(with_peaks(float32=1.0, bfloat16=0.99 / SLOW_DTYPE_FACTOR, float16=0.5)) == ("bfloat16",)
    assert emulated_dtypes(with_peaks(float32=1.0, bfloat16=1.01 / SLOW_DTYPE_FACTOR)) == ()
    assert emulated_dtypes(base) == ()


def test_calibrate_only_matmul_layouts_times_the_emulated_dtype_over_the_base(tmp_path, capfd):
    """A real --only matmul_layouts run on 2 gloo ranks over the bf16 CPU file (bfloat16 emulated there):
    a table over the quick grid 32, 64 (every time positive; not compared, the machine is shared), every
    other field as in the base, the header saying what was measured; a base with no emulated dtype is
    refused with what to do."""
    base_path = CONFIG_DIR.parent / "results" / "bf16-cpu" / "cluster.yaml"
    out = tmp_path / "layouts.yaml"
    assert cli.main(["calibrate", "--nproc", "2", "--quick", "--only", "matmul_layouts", "--base", str(base_path),
                     "--out", str(out)]) == 0
    c, base = Cluster.from_yaml(out), Cluster.from_yaml(base_path)
    table = c.matmul_layouts.get("bfloat16")
    assert c.matmul_layouts.dtypes() == ("bfloat16",) and table.sizes == (32, 64)
    assert [r[:3] for r in table.rows] == [(m, k, n) for m in (32, 64) for k in (32, 64) for n in (32, 64)]
    assert all(math.isfinite(t) and t > 0 for r in table.rows for t in r[3:])
    assert dataclasses.replace(c, matmul_layouts=base.matmul_layouts) == base
    text = out.read_text()
    assert "# matmul_layouts: measured by `autoddl calibrate --nproc 2 --backend gloo --base" in text
    assert "  bfloat16:  # 2 ranks at once, 1 thread each; median of single calls" in text
    assert "calibrate: bfloat16 matmul layouts over 2^3 shapes" in capfd.readouterr().err
    assert cli.main(["calibrate", "--nproc", "2", "--quick", "--only", "matmul_layouts", "--base",
                     str(CPU_CLUSTER_PATH)]) == 2
    assert "gives no dtype a peak more than 8x below float32's (an emulated one)" in capfd.readouterr().err
