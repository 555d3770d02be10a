"""Cluster YAML: bundled configs, validation messages, round trip, resizing, mesh-axis links."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from autoddl.cluster import (
    CONFIG_DIR, DEFAULT_CLUSTER_PATH, Backend, Cluster, ClusterConfigError, DeviceSpec, Efficiency,
    LinkSpec, available_configs, bundled_config,
)

BUNDLED = ["dgx-a100-8", "h100-4x8", "h100-96gb-500w", "v100-16x1", "local-cpu"]

GOOD = {
    "name": "toy-2x4",
    "nodes": 2,
    "devices_per_node": 4,
    "device": {"name": "A100-SXM4-80GB", "kind": "cuda", "peak_tflops": 312, "memory_gb": 80,
               "memory_bandwidth_gbps": 2039},
    "links": {"intra_node": {"bandwidth_gbps": 300, "latency_us": 2.0},
              "inter_node": {"bandwidth_gbps": 25, "latency_us": 5.0}},
    "backend": "nccl",
    "efficiency": {"compute": 0.6, "memory": 0.7, "network": 0.8},
    "op_overhead_us": 10,
}


def write(tmp_path: Path, data, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def errors_of(tmp_path: Path, data) -> tuple[Path, list[str], str]:
    path = write(tmp_path, data)
    with pytest.raises(ClusterConfigError) as info:
        Cluster.from_yaml(path)
    return path, info.value.errors, str(info.value)


def edited(**changes) -> dict:
    """GOOD with dotted fields replaced (value None deletes the field)."""
    d = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = d
        for p in parents:
            target = target[p]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return d


# -- bundled configs --------------------------------------------------------------
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_config_loads_with_yaml_values(name):
    path = bundled_config(name)
    assert path == CONFIG_DIR / f"{name}.yaml" and bundled_config(f"{name}.yaml") == path
    raw = yaml.safe_load(path.read_text())
    c = Cluster.from_yaml(path)
    assert c.name == raw["name"] == name
    assert (c.nodes, c.devices_per_node) == (raw["nodes"], raw["devices_per_node"])
    assert c.num_devices == raw["nodes"] * raw["devices_per_node"]
    assert c.device.to_dict() == raw["device"]
    assert c.intra_node.to_dict() == raw["links"]["intra_node"]
    assert c.inter_node.to_dict() == raw["links"]["inter_node"]
    assert c.backend is Backend(raw["backend"])
    assert c.efficiency.to_dict() == raw["efficiency"]
    assert c.op_overhead_us == raw["op_overhead_us"]
    assert c.source == str(path)
    assert "\n" not in c.summary() and name in c.summary()


def test_bundled_hardware_numbers():
    a100 = Cluster.from_yaml(DEFAULT_CLUSTER_PATH)
    assert DEFAULT_CLUSTER_PATH.name == "dgx-a100-8.yaml"
    assert (a100.num_devices, a100.device.peak_tflops, a100.device.memory_bandwidth_gbps) == (8, 19.5, 2039)
    assert a100.device.peaks == {"float32": 19.5, "bfloat16": 312, "float16": 312}
    assert a100.efficiency == Efficiency(compute=0.869, memory=0.841, network=0.783, attention=0.737)
    assert a100.intra_node == LinkSpec(300, 2.0) and a100.inter_node.bandwidth_gbps == 25
    h100 = Cluster.from_yaml(bundled_config("h100-4x8"))
    assert (h100.nodes, h100.devices_per_node, h100.device.peak_tflops) == (4, 8, 67)
    assert [h100.device.peak_tflops_for(d) for d in ("float32", "bfloat16", "float16")] == [67, 989, 989]
    assert (h100.intra_node.bandwidth_gbps, h100.inter_node.bandwidth_gbps) == (450, 400 / 8)
    v100 = Cluster.from_yaml(bundled_config("v100-16x1"))
    assert (v100.nodes, v100.devices_per_node, v100.inter_node.bandwidth_gbps) == (16, 1, 25 / 8)
    assert v100.device.peaks == {"float32": 15.7, "float16": 125}                 # Volta: no bfloat16
    with pytest.raises(ClusterConfigError) as info:
        v100.device.peak_tflops_for("bfloat16")
    assert str(info.value).startswith(f"{bundled_config('v100-16x1')}: device.peak_tflops.bfloat16: missing: "
                                      "no bfloat16 peak for V100-SXM2-32GB (device.peak_tflops gives float32, "
                                      "float16)")
    cpu = Cluster.from_yaml(bundled_config("local-cpu"))
    assert (cpu.device.kind, cpu.backend, cpu.num_devices) == ("cpu", Backend.GLOO, 4)
    assert cpu.device.peak_tflops == cpu.device.peak_tflops_for("float32") > 0   # measured: `autoddl calibrate`
    assert "float32" in cpu.device.peaks and all(v > 0 for v in cpu.device.peaks.values())
    text = bundled_config("local-cpu").read_text()        # a half dtype: a measured peak, or why none
    assert all((d in cpu.device.peaks) != (f"no {d} peak: " in text) for d in ("bfloat16", "float16"))
    assert set(available_configs()) >= set(BUNDLED)


@pytest.mark.parametrize("name, assumed", [("dgx-a100-8", {"op_overhead_us"}),
                                            ("h100-4x8", set()),
                                            ("h100-96gb-500w", set()),
                                            ("v100-16x1", {"op_overhead_us"})])
def test_gpu_configs_cite_every_efficiency(name, assumed):
    """Each derating number and the per-op overhead has a comment beside it (the source above it); the ones no
    published measurement backs say "assumption"."""
    lines = bundled_config(name).read_text().splitlines()
    said = set()
    optional = tuple(k for k in ("attention",) if any(line.strip().startswith(f"{k}:") for line in lines))
    assert optional == (("attention",) if name in ("dgx-a100-8", "h100-4x8", "h100-96gb-500w") else ())
    for key in ("compute", "memory", "network", "op_overhead_us") + optional:
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
        assert "  # " in lines[at], (name, key)
        if "assumption" in " ".join(lines[max(0, at - 3):at + 1]).split(f"# {key}:")[-1]:
            said.add(key)
    assert said == assumed


# -- device peaks per dtype ---------------------------------------------------------------------
A100_PEAKS = {"float32": 19.5, "bfloat16": 312, "float16": 312}


def test_scalar_peak_serves_every_dtype():
    dev = Cluster.from_dict(GOOD).device
    assert (dev.peak_tflops, dev.peaks, dev.peaks_by_dtype) == (312.0, {}, ())
    dtypes = ("float32", "bfloat16", "fp16", "torch.float16", "int64")
    assert [dev.peak_tflops_for(d) for d in dtypes] == [312.0] * 5
    assert dev.to_dict()["peak_tflops"] == 312.0 and "(cuda, 312 TFLOPS, 80 GB" in Cluster.from_dict(GOOD).summary()


def test_peaks_per_dtype_load_with_aliases_and_look_up(tmp_path):
    path = write(tmp_path, edited(device__peak_tflops={"fp16": 312, "fp32": 19.5, "bf16": 312}))
    c = Cluster.from_yaml(path)
    assert c.device.peaks_by_dtype == (("float32", 19.5), ("bfloat16", 312.0), ("float16", 312.0))  # torch names
    assert c.device.peak_tflops == 19.5                                          # the float32 peak
    assert [c.device.peak_tflops_for(d) for d in ("float32", "fp32", "bfloat16", "torch.bfloat16", "float16")] == \
        [19.5, 19.5, 312.0, 312.0, 312.0]
    assert "(cuda, float32 19.5, bfloat16 312, float16 312 TFLOPS, 80 GB" in c.summary()
    assert c == Cluster.from_dict(edited(device__peak_tflops=A100_PEAKS)) and hash(c) == hash(
        Cluster.from_dict(edited(device__peak_tflops=A100_PEAKS)))
    assert c != Cluster.from_dict(edited(device__peak_tflops={"float32": 19.5, "bfloat16": 300}))
    assert c != Cluster.from_dict(edited(device__peak_tflops=19.5))              # one peak is not the mapping


def test_missing_dtype_names_file_field_and_dtype(tmp_path):
    path = write(tmp_path, edited(device__peak_tflops={"float32": 15.7, "float16": 125}))
    c = Cluster.from_yaml(path)
    with pytest.raises(ClusterConfigError) as info:
        c.device.peak_tflops_for("bf16")
    assert str(info.value) == (f"{path}: device.peak_tflops.bfloat16: missing: no bfloat16 peak for A100-SXM4-80GB "
                               "(device.peak_tflops gives float32, float16); add `bfloat16: <dense TFLOPS>` under "
                               "device.peak_tflops in the cluster file, or train in float32 / float16")
    with pytest.raises(ClusterConfigError, match=r"device.peak_tflops.int64: missing: .* peaks are given per "
                                                 r"training dtype \(float32, bfloat16, float16\)"):
        c.device.peak_tflops_for("torch.int64")
    big = c.resized(16)                                                           # the file stays named
    assert big.device.peaks == {"float32": 15.7, "float16": 125.0}
    with pytest.raises(ClusterConfigError, match=rf"^{path}: device.peak_tflops.bfloat16: missing"):
        big.device.peak_tflops_for("bfloat16")
    with pytest.raises(ClusterConfigError, match=r"^cluster 'toy-2x4': device.peak_tflops.bfloat16: missing"):
        dataclasses.replace(c, source="").device.peak_tflops_for("bfloat16")


@pytest.mark.parametrize("peaks, field, expected", [
    ({"float32": 19.5, "bfloat61": 312}, "device.peak_tflops.bfloat61",
     "unknown dtype; did you mean 'bfloat16'? known dtypes: float32, bfloat16, float16 (or fp32, bf16, fp16)"),
    ({"float32": 19.5, "int8": 624}, "device.peak_tflops.int8",
     "unknown dtype; known dtypes: float32, bfloat16, float16 (or fp32, bf16, fp16)"),
    ({"float32": 19.5, "bfloat16": 0}, "device.peak_tflops.bfloat16",
     "expected a positive number in TFLOPS (dense bfloat16 peak), got 0"),
    ({"float32": -19.5}, "device.peak_tflops.float32",
     "expected a positive number in TFLOPS (dense float32 peak), got -19.5"),
    ({"float32": 19.5, "fp16": "fast"}, "device.peak_tflops.fp16",
     "expected a positive number in TFLOPS (dense float16 peak), got 'fast'"),
    ({"float32": "19.5 TFLOPS"}, "device.peak_tflops.float32", "expected a positive number in TFLOPS (dense float32 "
     "peak), got '19.5 TFLOPS': wrong unit, drop the unit 'TFLOPS' and give the bare number in TFLOPS"),
    ({"bfloat16": 312, "float16": 312}, "device.peak_tflops.float32",
     "missing; the mapping needs the dense float32 peak in TFLOPS (parameters and optimizer math are float32; "
     "device.peak_tflops reads as it), got peaks for bfloat16, float16"),
    ({"fp32": 19.5, "float32": 19.5}, "device.peak_tflops.fp32",
     "float32 given twice (as 'float32' and 'fp32'); keep one"),
    ({}, "device.peak_tflops", "expected a positive number in TFLOPS (dense peak, used for every dtype) or a "
                               "mapping from dtype (float32, bfloat16, float16) to its dense peak in TFLOPS, float32 "
                               "included, got {}"),
])
def test_peaks_per_dtype_validation(tmp_path, peaks, field, expected):
    path, errors, _ = errors_of(tmp_path, edited(device__peak_tflops=peaks))
    assert errors == [f"{path}: {field}: {expected}"]


def test_peaks_per_dtype_errors_reported_together(tmp_path):
    path, errors, msg = errors_of(tmp_path, edited(device__peak_tflops={"float32": 0, "bf17": 1, "float16": "x"},
                                                   device__memory_gb=-1))
    assert [e.split(": ")[1] for e in errors] == ["device.peak_tflops.bf17", "device.peak_tflops.float16",
                                                  "device.peak_tflops.float32", "device.memory_gb"]   # file order
    assert msg.startswith(f"4 problems in {path}:")


def test_peaks_per_dtype_round_trip_with_comments(tmp_path):
    c = Cluster.from_dict(edited(device__peak_tflops={"bf16": 312, "float32": 19.5}))
    out = tmp_path / "c.yaml"
    c.to_yaml(out, comments={"device.peak_tflops": "dense", "device.peak_tflops.bfloat16": "datasheet"})
    text = out.read_text()
    assert "  peak_tflops:  # dense\n    float32: 19.5\n    bfloat16: 312  # datasheet\n  memory_gb: 80\n" in text
    back = Cluster.from_yaml(out)
    assert back == c and back.device.peaks == {"float32": 19.5, "bfloat16": 312.0}
    assert yaml.safe_load(text)["device"]["peak_tflops"] == {"float32": 19.5, "bfloat16": 312}
    scalar = Cluster.from_dict(GOOD)
    scalar.to_yaml(out)
    assert "  peak_tflops: 312\n" in out.read_text() and Cluster.from_yaml(out) == scalar


def test_device_spec_direct_construction_with_peaks():
    dev = DeviceSpec("A100", "cuda", {"fp32": 19.5, "bfloat16": 312}, 80, 2039)
    assert (dev.peak_tflops, dev.peaks) == (19.5, {"float32": 19.5, "bfloat16": 312})
    assert dev == DeviceSpec("A100", "cuda", 19.5, 80, 2039, peaks_by_dtype=(("bfloat16", 312), ("float32", 19.5)))
    faster = dataclasses.replace(dev, peak_tflops={"float32": 20, "bfloat16": 320, "float16": 320})
    assert faster.peak_tflops_for("float16") == 320 and faster.peak_tflops == 20
    with pytest.raises(ClusterConfigError, match=r"device.peak_tflops: 40.0 disagrees with the float32 peak 19.5 "
                                                 r"of its peaks per dtype \(float32 19.5, bfloat16 312 TFLOPS\)"):
        dataclasses.replace(dev, peak_tflops=40.0)
    with pytest.raises(ClusterConfigError, match=r"device.peak_tflops.float32: missing"):
        DeviceSpec("A100", "cuda", {"bf16": 312}, 80, 2039)
    c = Cluster.from_dict(GOOD)
    with pytest.raises(ClusterConfigError, match=r"device.peak_tflops.bfloat16: expected a positive number"):
        dataclasses.replace(c, device=dataclasses.replace(c.device, peak_tflops={"float32": 1, "bfloat16": -1}))


def test_bundled_config_unknown_name_lists_available():
    with pytest.raises(ClusterConfigError) as info:
        bundled_config("h100-4x9")
    msg = str(info.value)
    assert "'h100-4x9'" in msg and "Did you mean 'h100-4x8'" in msg
    assert all(n in msg for n in BUNDLED)


# -- from_dict, defaults ---------------------------------------------------------------
def test_from_dict_and_defaults():
    c = Cluster.from_dict(GOOD)
    assert c.device == DeviceSpec("A100-SXM4-80GB", "cuda", 312.0, 80.0, 2039.0)
    assert c.efficiency == Efficiency(0.6, 0.7, 0.8) and c.source == "<dict>"
    d = edited(efficiency=None, op_overhead_us=None, nodes=1, links__inter_node=None)
    one = Cluster.from_dict(d)
    assert one.efficiency == Efficiency() and one.op_overhead_us == 5.0
    assert one.inter_node == one.intra_node == LinkSpec(300, 2.0)     # nodes 1: inter defaults to intra
    partial = Cluster.from_dict(edited(efficiency={"network": 0.5}))
    assert partial.efficiency == Efficiency(1.0, 1.0, 0.5)
    assert partial.efficiency.attention is None and "attention" not in partial.to_dict()["efficiency"]
    attention = Cluster.from_dict(edited(efficiency__attention=0.339))
    assert attention.efficiency == Efficiency(0.6, 0.7, 0.8, attention=0.339)
    assert Cluster.from_dict(attention.to_dict()) == attention and "attention 0.339" in attention.summary()
    assert Cluster.from_dict(edited(device__peak_tflops="1e3")).device.peak_tflops == 1000.0


def test_direct_construction_is_validated():
    c = Cluster.from_dict(GOOD)
    assert dataclasses.replace(c, backend="gloo").backend is Backend.GLOO
    with pytest.raises(ClusterConfigError, match=r"device.peak_tflops: expected a positive number"):
        dataclasses.replace(c, device=dataclasses.replace(c.device, peak_tflops=0.0))
    with pytest.raises(ClusterConfigError, match=r"backend: unknown backend 'mpi'; known backends: nccl, gloo"):
        dataclasses.replace(c, backend="mpi")


# -- validation: one error each ------------------------------------------------------------
@pytest.mark.parametrize("changes, field, expected", [
    ({"device__peak_tflops": None}, "device.peak_tflops", "missing; expected a positive number in TFLOPS"),
    ({"name": None}, "name", "missing"),
    ({"backend": None}, "backend", "missing; expected one of nccl, gloo"),
    ({"links": None}, "links", "missing"),
    ({"links__intra_node": None}, "links.intra_node", "missing"),
    ({"links__inter_node": None}, "links.inter_node", "required when nodes > 1 (nodes is 2)"),
    ({"links__intra_node__latency_us": None}, "links.intra_node.latency_us", "missing; expected a non-negative"),
    ({"device__memory_gb": -80}, "device.memory_gb", "expected a positive number in GB (1e9 bytes) of device memory, got -80"),
    ({"device__memory_bandwidth_gbps": 0}, "device.memory_bandwidth_gbps", "expected a positive number in GB/s"),
    ({"links__inter_node__latency_us": -1.0}, "links.inter_node.latency_us", "expected a non-negative number in microseconds, got -1.0"),
    ({"op_overhead_us": -2}, "op_overhead_us", "expected a non-negative number"),
    ({"nodes": 0}, "nodes", "expected a positive integer (number of nodes; nodes * devices_per_node must be at least 1), got 0"),
    ({"devices_per_node": 2.5}, "devices_per_node", "expected a positive integer"),
    ({"devices_per_node": True}, "devices_per_node", "expected a positive integer"),
    ({"device__peak_tflops": "fast"}, "device.peak_tflops", "expected a positive number in TFLOPS"),
    ({"device__peak_tflops": float("inf")}, "device.peak_tflops", "got inf"),
    ({"device__kind": "tpu"}, "device.kind", "unknown device kind 'tpu'; known kinds: cuda, cpu"),
    ({"device__name": ""}, "device.name", "expected a device name"),
    ({"backend": "mpi"}, "backend", "unknown backend 'mpi'; known backends: nccl, gloo"),
    ({"device__kind": "cpu"}, "backend", "nccl needs cuda devices but device.kind is 'cpu'; use backend: gloo"),
    ({"efficiency__compute": 1.5}, "efficiency.compute", "expected a fraction in (0, 1], got 1.5"),
    ({"efficiency__network": 0}, "efficiency.network", "expected a fraction in (0, 1], got 0"),
    ({"efficiency__attention": 1.5}, "efficiency.attention", "expected a fraction in (0, 1] of the dtype's peak a "
     "fused attention kernel reaches (forward + backward, FlashAttention-2's FLOP count); leave it out to price "
     "attention at efficiency.compute, got 1.5"),
    ({"efficiency__attention": "fast"}, "efficiency.attention", "got 'fast'"),
    ({"efficiency__atention": 0.3}, "efficiency.atention", "unknown key; did you mean 'attention'?"),
    ({"device": "A100"}, "device", "expected a mapping with keys name, kind, peak_tflops"),
    ({"device__peak_tflop": 1}, "device.peak_tflop", "unknown key; did you mean 'peak_tflops'?"),
    ({"links__inter": {"bandwidth_gbps": 1, "latency_us": 1}}, "links.inter", "unknown key; did you mean 'inter_node'?"),
])
def test_single_validation_error(tmp_path, changes, field, expected):
    path, errors, _ = errors_of(tmp_path, edited(**changes))
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}: {field}: "), errors[0]
    assert expected in errors[0], errors[0]


def test_wrong_unit_gigabits(tmp_path):
    path, errors, msg = errors_of(tmp_path, edited(links__intra_node__bandwidth_gbps="300 Gb/s"))
    assert errors == [msg]
    assert msg.startswith(f"{path}: links.intra_node.bandwidth_gbps: expected a positive number in GB/s")
    assert "got '300 Gb/s': wrong unit, drop the unit 'Gb/s' and give the bare number in GB/s" in msg
    assert f"300 Gb/s = {300 / 8:g} GB/s" in msg


def test_wrong_unit_bytes(tmp_path):
    _, errors, _ = errors_of(tmp_path, edited(device__memory_gb="80 GB", device__peak_tflops="312TFLOPS"))
    assert len(errors) == 2                                          # reported in schema order
    assert "device.peak_tflops" in errors[0] and "drop the unit 'TFLOPS' and give the bare number in TFLOPS" in errors[0]
    assert "device.memory_gb" in errors[1] and "drop the unit 'GB' and give the bare number in GB" in errors[1]
    assert "Gb/s =" not in errors[1]


def test_unknown_top_level_key_suggests_closest(tmp_path):
    d = edited(devices_per_node=None)
    d["devices_per_nod"] = 4
    path, errors, _ = errors_of(tmp_path, d)
    assert f"{path}: devices_per_nod: unknown key; did you mean 'devices_per_node'?" in errors[0]
    assert f"{path}: devices_per_node: missing" in errors[1]
    _, errors, _ = errors_of(tmp_path, dict(GOOD, zzz=1))
    assert errors == [f"{tmp_path / 'x.yaml'}: zzz: unknown key; known keys: name, nodes, devices_per_node, "
                      "device, links, backend, efficiency, op_overhead_us, collectives, collective_points, "
                      "compute_curve, matmul_layouts, executor, cores_per_node, comm_measured_ranks_per_node, host_link, "
                      "host_memory_gb, host_memory_bandwidth_gbps, calibrated_on"]


def test_not_yaml_not_mapping_missing_file(tmp_path):
    path, errors, msg = errors_of(tmp_path, "name: [unclosed\nnodes: 1\n")
    assert errors == [msg] and msg.startswith(f"{path}: not valid YAML at line ") and "expected a mapping" in msg
    path, _, msg = errors_of(tmp_path, "- a\n- b\n")
    assert msg.startswith(f"{path}: expected a YAML mapping of cluster fields") and "got list" in msg
    path, _, msg = errors_of(tmp_path, "")
    assert "got NoneType" in msg
    missing = tmp_path / "h100-4x9.yaml"
    with pytest.raises(ClusterConfigError) as info:
        Cluster.from_yaml(missing)
    msg = str(info.value)
    assert msg.startswith(f"{missing}: no such cluster config file") and "h100-4x8.yaml?" in msg
    assert all(n in msg for n in BUNDLED)


def test_all_errors_reported_together(tmp_path):
    bad = edited(devices_per_node=0, device__kind="tpu", device__peak_tflops=-1,
                 links__intra_node__bandwidth_gbps="300 Gb/s", links__inter_node=None,
                 backend="mpi", efficiency__compute=2)
    bad["nodez"] = 2
    path, errors, msg = errors_of(tmp_path, bad)
    fields = ["nodez", "devices_per_node", "device.kind", "device.peak_tflops",
              "links.intra_node.bandwidth_gbps", "links.inter_node", "backend", "efficiency.compute"]
    assert [e.split(": ")[1] for e in errors] == fields
    assert all(e.startswith(f"{path}: ") for e in errors)
    lines = msg.splitlines()
    assert lines[0] == f"{len(fields)} problems in {path}:" and lines[1:] == errors


# -- to_yaml ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BUNDLED)
def test_round_trip(tmp_path, name):
    c = Cluster.from_yaml(bundled_config(name))
    out = tmp_path / "sub" / "out.yaml"
    c.to_yaml(out)
    back = Cluster.from_yaml(out)
    assert back == c and back.source == str(out)
    assert list(tmp_path.joinpath("sub").iterdir()) == [out]      # no temporary file left behind


def test_round_trip_awkward_values_and_comments(tmp_path):
    c = Cluster.from_dict(edited(name="weird: name # x", device__name="yes",
                                 device__peak_tflops=1e-05, links__intra_node__latency_us=0.1 + 0.2,
                                 efficiency__memory=1 / 3, op_overhead_us=0))
    out = tmp_path / "c.yaml"
    c.to_yaml(out, comments={"device.peak_tflops": "measured: 5 s matmul\non 1 thread",
                             "links.intra_node": "calibrated", "efficiency.memory": "copy # bench"})
    text = out.read_text()
    assert "  peak_tflops: 1.0e-05  # measured: 5 s matmul on 1 thread\n" in text
    assert "  intra_node:  # calibrated\n" in text
    assert "  memory: 0.3333333333333333  # copy # bench\n" in text
    back = Cluster.from_yaml(out)
    assert back == c and back.name == "weird: name # x" and back.device.name == "yes"
    assert back.intra_node.latency_us == 0.1 + 0.2 and back.efficiency.memory == 1 / 3
    with pytest.raises(KeyError, match="device.peak_tflop"):
        c.to_yaml(out, comments={"device.peak_tflop": "typo"})
    assert Cluster.from_yaml(out) == c                               # failed write left the file alone


# -- resized ----------------------------------------------------------------------------------
def test_resized():
    h100 = Cluster.from_yaml(bundled_config("h100-4x8"))
    big = h100.resized(64)
    assert (big.name, big.nodes, big.devices_per_node, big.num_devices) == ("h100-4x8@64", 8, 8, 64)
    assert (big.device, big.intra_node, big.inter_node, big.backend) == \
        (h100.device, h100.intra_node, h100.inter_node, h100.backend)
    assert big.device.peaks == {"float32": 67, "bfloat16": 989, "float16": 989}
    assert "H100-SXM5-80GB (cuda, float32 67, bfloat16 989, float16 989 TFLOPS, 80 GB" in big.summary()
    assert (h100.resized(8).nodes, h100.resized(8).devices_per_node) == (1, 8)
    four = h100.resized(4)
    assert (four.name, four.nodes, four.devices_per_node) == ("h100-4x8@4", 1, 4)
    assert four.resized(16).name == "h100-4x8@16"                   # no stacked suffixes
    assert h100.resized(32) is h100
    v100 = Cluster.from_yaml(bundled_config("v100-16x1"))
    assert (v100.resized(5).nodes, v100.resized(5).devices_per_node) == (5, 1)


@pytest.mark.parametrize("n, expected", [
    (12, "cannot lay out 12 devices on nodes of 8 devices: use a divisor of 8 (one partial node: 1, 2, 4, 8) "
         "or a multiple of 8 (whole nodes, e.g. 8 or 16)"),
    (3, "cannot lay out 3 devices on nodes of 8 devices"),
    (20, "e.g. 16 or 24"),
    (0, "cannot resize to 0 devices: expected a positive integer"),
])
def test_resized_errors(n, expected):
    h100 = Cluster.from_yaml(bundled_config("h100-4x8"))
    with pytest.raises(ClusterConfigError) as info:
        h100.resized(n)
    assert str(info.value).startswith("h100-4x8: ") and expected in str(info.value)


# -- link_for_axis ----------------------------------------------------------------------------
@pytest.mark.parametrize("mesh, links", [
    ((32,), ["inter"]),
    ((8,), ["intra"]),
    ((4, 8), ["inter", "intra"]),
    ((8, 4), ["inter", "intra"]),
    ((16, 2), ["inter", "intra"]),
    ((2, 2, 8), ["inter", "inter", "intra"]),
    ((8, 2, 2), ["inter", "intra", "intra"]),
    ((2, 16), ["inter", "inter"]),
])
def test_link_for_axis_h100(mesh, links):
    h100 = Cluster.from_yaml(bundled_config("h100-4x8"))
    by_name = {"intra": h100.intra_node, "inter": h100.inter_node}
    for axis, expected in enumerate(links):
        assert h100.link_for_axis(mesh, axis) == by_name[expected]
        inner = math.prod(mesh[axis:])
        assert (expected == "intra") == (inner <= h100.devices_per_node)
    assert h100.link_for_axis(mesh, -1) == h100.link_for_axis(mesh, len(mesh) - 1)


def test_link_for_axis_errors_and_single_gpu_nodes():
    h100 = Cluster.from_yaml(bundled_config("h100-4x8"))
    with pytest.raises(ValueError, match=r"axis 2 out of range for mesh \(4, 8\)"):
        h100.link_for_axis((4, 8), 2)
    with pytest.raises(ValueError, match="mesh shape must be positive integers"):
        h100.link_for_axis((4, 0), 0)
    v100 = Cluster.from_yaml(bundled_config("v100-16x1"))
    assert v100.link_for_axis((4, 4), 1) == v100.inter_node == LinkSpec(3.125, 30.0)
    assert v100.link_for_axis((16, 1), 1) == v100.intra_node       # a size-1 axis never leaves the device


def test_executor_section_round_trip_defaults_and_errors(tmp_path):
    from autoddl.cluster import ExecutorOverheads

    assert Cluster.from_dict(GOOD).executor == ExecutorOverheads() and "executor" not in Cluster.from_dict(GOOD).to_dict()
    c = Cluster.from_dict(edited(executor={"op_forward_us": 250, "collective_us": 800.5}))
    assert c.executor == ExecutorOverheads(op_forward_us=250.0, collective_us=800.5)   # the others default to 0
    assert "executor overheads: op_forward_us 250, collective_us 800.5" in c.summary()
    c.to_yaml(tmp_path / "c.yaml", comments={"executor.collective_us": "measured"})
    assert Cluster.from_yaml(tmp_path / "c.yaml") == c
    assert "collective_us: 800.5  # measured" in (tmp_path / "c.yaml").read_text()
    path, errors, _ = errors_of(tmp_path, edited(executor={"op_forwrd_us": 1, "param_us": -3,
                                                           "collective_us": "2 ms"}))
    assert errors == [
        f"{path}: executor.op_forwrd_us: unknown key; did you mean 'op_forward_us'? known keys: op_forward_us, "
        "op_backward_us, input_forward_us, input_backward_us, param_us, collective_us, step_us, param_sync_us, "
        "param_gather_us, shard_forward_us, shard_backward_us, shard_param_us, collective_compute_share, op_us, "
        "op_work, recompute, optimizer_ns, arrival_skew_us",
        f"{path}: executor.param_us: expected a non-negative number of microseconds per parameter use (leaf, "
        "grad sync, optimizer), got -3",
        f"{path}: executor.collective_us: expected a non-negative number of microseconds per collective beyond "
        "its latency, got '2 ms': wrong unit, drop the unit 'ms' and give the bare number in microseconds"]
    _, errors, _ = errors_of(tmp_path, edited(executor=[1, 2]))
    assert errors[0].endswith("executor: expected a mapping with keys op_forward_us, op_backward_us, "
                              "input_forward_us, input_backward_us, param_us, collective_us, step_us, param_sync_us, "
                              "param_gather_us, shard_forward_us, shard_backward_us, shard_param_us, "
                              "collective_compute_share, op_us, op_work, recompute, optimizer_ns, arrival_skew_us, got [1, 2]")


def test_executor_op_families_and_recompute_round_trip_and_look_up(tmp_path):
    from autoddl.cluster import ExecutorOverheads, OpCost, RecomputeCost

    c = Cluster.from_dict(edited(executor={
        "op_forward_us": 6, "op_us": {"float32": {"linear": [12, 30.5], "view": [9, 8], "add": [8, 7]},
                                      "bf16": {"scaled_dot_product_attention": [18, 300]}},
        "op_work": {"float32": {"linear": [[2, 0.8, 1.5], [200, 0.4, 0.5]]}},
        "recompute": {"selective": {"op_forward_us": 10, "op_backward_us": 36, "block_forward_us": 220}}}))
    ex = c.executor
    assert ex.op_us == {"float32": {"linear": (12.0, 30.5), "view": (9.0, 8.0), "add": (8.0, 7.0)},
                        "bfloat16": {"scaled_dot_product_attention": (18.0, 300.0)}}     # bf16 read as bfloat16
    assert ex.recompute == {"selective": RecomputeCost(op_forward_us=10, op_backward_us=36, block_forward_us=220)}
    assert ex.recompute_cost("full") == RecomputeCost() and ex.recompute_cost("none") == RecomputeCost()
    # an op's own family, its in-place op's, its family's representative; another dtype falls back to float32's
    linear = OpCost(12, 30.5, ((2.0, 0.8, 1.5), (200.0, 0.4, 0.5)))
    assert ex.op_cost("linear") == linear
    assert ex.op_cost("addmm") == ex.op_cost("mm") == ex.op_cost("linear", "bfloat16") == linear
    assert ex.op_cost("add_") == OpCost(8, 7) and ex.op_cost("transpose") == OpCost(9, 8)
    assert ex.op_cost("_scaled_dot_product_flash_attention_for_cpu", "bfloat16") == OpCost(18, 300)
    # work scales: flat beyond the curve's ends, piecewise-linear in log(roofline_us) between; 1 without a curve
    assert linear.work_at(1.0) == (0.8, 1.5) and linear.work_at(1e4) == (0.4, 0.5)
    assert linear.work_at(20.0) == pytest.approx((0.6, 1.0)) and OpCost(8, 7).work_at(5.0) == (1.0, 1.0)
    assert ex.op_cost("scaled_dot_product_attention") is None and ex.op_cost("gelu") is None
    assert ex.family_of("unsqueeze") == "view" and ex.family_of("getitem") is None
    assert "op families measured: 3 float32, 1 bfloat16 | recompute costs: selective" in c.summary()
    comments = {"executor.op_us.float32.linear": "sizes tiny, small", "executor.recompute.selective": "measured"}
    c.to_yaml(tmp_path / "c.yaml", comments=comments)
    text = (tmp_path / "c.yaml").read_text()
    assert "      linear: [12, 30.5]  # sizes tiny, small\n" in text and "    selective:  # measured\n" in text
    assert "      linear:\n        - [2, 0.8, 1.5]\n        - [200, 0.4, 0.5]\n" in text
    assert "      op_forward_us: 10\n" in text
    back = Cluster.from_yaml(tmp_path / "c.yaml")
    assert back == c and hash(back.executor) == hash(c.executor)
    assert ExecutorOverheads(op_us={"float32": {"add": [1, 2]}})          # measured tables alone make it non-empty
    with pytest.raises(ClusterConfigError, match="executor.op_work.float32.linear: no executor.op_us.float32.linear"):
        dataclasses.replace(c, executor=dataclasses.replace(ex, op_us={}))      # work scales without fixed costs


def test_executor_op_families_and_recompute_errors(tmp_path):
    path, errors, _ = errors_of(tmp_path, edited(executor={
        "op_us": {"bf61": {"linear": [1, 2]}, "float32": {"linear": [1, -2], "gelu": [3], "": [1, 1]},
                  "float16": [1, 2]},
        "op_work": {"float32": {"linear": [[0, 1, 1]], "gelu": [[5, 1, 1], [5, 2, 2]], "tanh": 3}},
        "recompute": {"selectiv": {}, "full": {"op_forward_us": "3 ms", "block_us": 1}}}))
    assert errors == [                                    # (the YAML file lists keys sorted)
        f"{path}: executor.op_us.bf61: unknown dtype; did you mean 'bfloat16'? known dtypes: float32, bfloat16, "
        "float16",
        f"{path}: executor.op_us.float16: expected a mapping from op family to [forward_us, backward_us], got [1, 2]",
        f"{path}: executor.op_us.float32: op family names must be non-empty strings, got ''",
        f"{path}: executor.op_us.float32.gelu: expected [forward_us, backward_us], non-negative numbers of "
        "microseconds per op of the family, got [3]",
        f"{path}: executor.op_us.float32.linear[1]: expected backward_us, a non-negative number of microseconds "
        "per op, got -2",
        f"{path}: executor.op_work.float32.gelu[1][0]: roofline_us must increase strictly along the curve, got 5.0 "
        "after 5.0",
        f"{path}: executor.op_work.float32.linear[0][0]: expected roofline_us, a positive number, got 0",
        f"{path}: executor.op_work.float32.tanh: expected a list of [roofline_us, forward_work, backward_work] "
        "points: the op's forward roofline time in microseconds (strictly increasing) and the multiples of the "
        "roofline its forward and backward take, got 3",
        f"{path}: executor.recompute.full.block_us: unknown key; did you mean 'block_forward_us'? known keys: "
        "op_forward_us, op_backward_us, matmul_forward_us, matmul_backward_us, block_forward_us, block_backward_us",
        f"{path}: executor.recompute.full.op_forward_us: expected a non-negative number of microseconds per op of "
        "the block but matmul-like ones, forward, got '3 ms': wrong unit, drop the unit 'ms' and give the bare "
        "number in microseconds",
        f"{path}: executor.recompute.selectiv: unknown key; did you mean 'selective'? known keys: selective, full"]
    _, errors, _ = errors_of(tmp_path, edited(executor={"op_us": {"float32": {"add": [1, 2]}},
                                                        "op_work": {"float32": {"gelu": [[1, 2, 2]]}}}))
    assert errors == [f"{path}: executor.op_work.float32.gelu: no executor.op_us.float32.gelu beside it; a family's "
                      "work scale goes with its fixed cost (give both, or neither)"]
    _, errors, _ = errors_of(tmp_path, edited(executor={"op_us": [1], "recompute": 3}))
    assert errors == [
        f"{path}: executor.op_us: expected a mapping from compute dtype (float32, bfloat16, float16) to {{op family "
        "(an aten op name, e.g. linear): [forward_us, backward_us]}, got [1]",
        f"{path}: executor.recompute: expected a mapping from recompute policy (selective, full) to {{op_forward_us, "
        "op_backward_us, matmul_forward_us, matmul_backward_us, block_forward_us, block_backward_us}, got 3"]


# -- the host side of a node (spilling to host memory) ------------------------------------------------

def test_host_fields_load_round_trip_and_are_optional(tmp_path):
    """Every bundled file describes its host but h100-96gb-500w (TorchTitan's text gives no host figures); an
    old file without the fields loads, and asking it for the host names each missing field and what to add."""
    a100 = Cluster.from_yaml(bundled_config("dgx-a100-8"))
    assert a100.host_link == LinkSpec(31.5, 10.0) and a100.host_memory_gb == 2000
    assert a100.host_memory_bandwidth_gbps == 409.6
    assert Cluster.from_dict(a100.to_dict()) == a100
    assert a100.host_bytes_per_device() == 2000e9 / 8
    assert Cluster.from_yaml(bundled_config("h100-4x8")).host_link.bandwidth_gbps == 63.0      # PCIe 5.0 x16
    assert Cluster.from_yaml(bundled_config("v100-16x1")).host_link.bandwidth_gbps == 15.75    # PCIe 3.0 x16
    for name in [*BUNDLED, "two-hosts"]:
        described = Cluster.from_yaml(bundled_config(name)).host_link is not None
        assert described == (name != "h100-96gb-500w"), name
    d = Cluster.from_yaml(bundled_config("two-hosts")).to_dict()
    for key in ("host_link", "host_memory_gb", "host_memory_bandwidth_gbps"):
        del d[key]
    old = Cluster.from_yaml(write(tmp_path, d, "old.yaml"))
    assert old.host_link is None and old.host_memory_gb is None
    with pytest.raises(ClusterConfigError) as exc:
        old.require_host("--offload params")
    assert [e.split(": ")[1] for e in exc.value.errors] == ["host_link", "host_memory_gb",
                                                            "host_memory_bandwidth_gbps"]
    assert "--offload params needs it" in exc.value.errors[0] and "--offload none" in exc.value.errors[0]


def test_host_fields_bad_values_name_the_field(tmp_path):
    d = dict(GOOD, host_link={"bandwidth_gbps": "31.5 GB/s", "latency_us": -1, "lat": 1}, host_memory_gb=0)
    path, errors, _ = errors_of(tmp_path, d)
    assert f"{path}: host_link.bandwidth_gbps: expected a positive number in GB/s per device, one direction, " \
           "got '31.5 GB/s': wrong unit" in errors[1]
    assert any(e.startswith(f"{path}: host_link.lat: unknown key") for e in errors)
    assert f"{path}: host_link.latency_us: expected a non-negative number in microseconds, got -1" in errors
    assert f"{path}: host_memory_gb: expected a positive number in GB (1e9 bytes) of host memory per node, got 0" \
        in errors


# -- an inter-node link the node's devices share (the two-host testbed) --------------------------------

def test_shared_inter_node_link_loads_round_trips_and_old_files_are_unchanged(tmp_path):
    """links.inter_node.shared_by_node / measured_flows load, write back (with comments) and read back
    equal; without them (GPU files: a NIC per device) the link is per device, written as before."""
    shared = edited(links__inter_node={"bandwidth_gbps": 0.06505, "latency_us": 810.3, "shared_by_node": True,
                                       "measured_flows": 2})
    c = Cluster.from_yaml(write(tmp_path, shared))
    assert c.inter_node == LinkSpec(0.06505, 810.3, shared_by_node=True, measured_flows=2)
    assert c.intra_node == LinkSpec(300, 2.0) and not c.intra_node.shared_by_node
    c.to_yaml(tmp_path / "back.yaml", comments={"links.inter_node.measured_flows": "2 groups at once"})
    text = (tmp_path / "back.yaml").read_text()
    assert "    shared_by_node: true\n" in text and "    measured_flows: 2  # 2 groups at once\n" in text
    assert Cluster.from_yaml(tmp_path / "back.yaml") == c
    gpu = Cluster.from_yaml(write(tmp_path, GOOD, "gpu.yaml"))
    assert gpu.to_dict()["links"]["inter_node"] == {"bandwidth_gbps": 25, "latency_us": 5.0}
    two = Cluster.from_yaml(bundled_config("two-hosts"))
    assert (two.inter_node.shared_by_node, two.inter_node.measured_flows) == (True, 2)
    for name in BUNDLED:
        assert not Cluster.from_yaml(bundled_config(name)).inter_node.shared_by_node
    # the link as each of k flows at once sees it: bandwidth * measured_flows / k, latency as measured
    assert c.inter_node.per_flow(1) == LinkSpec(0.1301, 810.3)
    assert c.inter_node.per_flow(4) == LinkSpec(0.06505 / 2, 810.3)
    assert gpu.inter_node.per_flow(1) is gpu.inter_node
    with pytest.raises(ValueError, match="flows must be a positive integer, got 0"):
        c.inter_node.per_flow(0)
    # where one flow alone reached less than the wire's share (the ranks' CPU limits it), none goes faster;
    # the CPU cost per byte is the link's whatever the flows
    capped = dataclasses.replace(c.inter_node, flow_bandwidth_gbps=0.1, cpu_ns_per_byte=0.8)
    assert capped.per_flow(1) == LinkSpec(0.1, 810.3, cpu_ns_per_byte=0.8)
    assert capped.per_flow(2) == LinkSpec(0.06505, 810.3, cpu_ns_per_byte=0.8)
    shared["links"]["inter_node"].update(flow_bandwidth_gbps=0.1, cpu_ns_per_byte=0.8)
    shared["links"]["intra_node"]["cpu_ns_per_byte"] = 0.3
    c = Cluster.from_yaml(write(tmp_path, shared, "capped.yaml"))
    assert (c.inter_node, c.intra_node.cpu_ns_per_byte) == (capped, 0.3)
    c.to_yaml(tmp_path / "capped-back.yaml")
    assert Cluster.from_yaml(tmp_path / "capped-back.yaml") == c


@pytest.mark.parametrize("inter, field, expected", [
    ({"shared_by_node": True}, "links.inter_node.measured_flows",
     "missing; shared_by_node: true needs a positive integer: the flows"),
    ({"measured_flows": 2}, "links.inter_node.measured_flows", "given without shared_by_node: true"),
    ({"shared_by_node": False, "measured_flows": 2}, "links.inter_node.measured_flows",
     "given without shared_by_node: true"),
    ({"shared_by_node": True, "measured_flows": 0}, "links.inter_node.measured_flows",
     "expected a positive integer: the flows (groups with a rank on each node) crossing the link at once "
     "while bandwidth_gbps was measured, got 0"),
    ({"shared_by_node": True, "measured_flows": 1.5}, "links.inter_node.measured_flows", "got 1.5"),
    ({"shared_by_node": "yes", "measured_flows": 2}, "links.inter_node.shared_by_node",
     "expected true or false: true when a node's devices all cross ONE link"),
    ({"shared_by_nodes": True, "measured_flows": 2}, "links.inter_node.shared_by_nodes",
     "unknown key; did you mean 'shared_by_node'?"),
    ({"flow_bandwidth_gbps": 0.1}, "links.inter_node.flow_bandwidth_gbps", "given without shared_by_node: true"),
    ({"shared_by_node": True, "measured_flows": 2, "flow_bandwidth_gbps": 0}, "links.inter_node.flow_bandwidth_gbps",
     "expected a positive number in GB/s: the bandwidth one flow reached alone"),
    ({"cpu_ns_per_byte": -0.5}, "links.inter_node.cpu_ns_per_byte",
     "expected a non-negative number of nanoseconds of host CPU a rank spends per byte"),
])
def test_shared_inter_node_link_bad_values_name_the_field(tmp_path, inter, field, expected):
    d = edited(links__inter_node={"bandwidth_gbps": 0.065, "latency_us": 810.0, **inter})
    if "shared_by_nodes" in inter:       # the misspelt key is refused; measured_flows alone also is
        d["links"]["inter_node"]["shared_by_node"] = True
    path, errors, _ = errors_of(tmp_path, d)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}: {field}: "), errors[0]
    assert expected in errors[0], errors[0]


def test_only_the_inter_node_link_may_be_shared(tmp_path):
    """intra_node, host_link and collective fits are per device: the sharing fields are unknown keys there."""
    d = edited(links__intra_node={"bandwidth_gbps": 300, "latency_us": 2.0, "shared_by_node": True})
    path, errors, _ = errors_of(tmp_path, d)
    assert len(errors) == 1 and errors[0].startswith(f"{path}: links.intra_node.shared_by_node: unknown key"), errors
    with pytest.raises(ClusterConfigError, match="links.intra_node.shared_by_node: unknown key"):
        dataclasses.replace(Cluster.from_dict(GOOD), intra_node=LinkSpec(300, 2.0, shared_by_node=True,
                                                                          measured_flows=2))


def test_yaml_comments_read_back_what_to_yaml_wrote(tmp_path):
    """The calibrated file rewritten with its own header and comments is the file, byte for byte (what
    ``autoddl calibrate --only shard_runner`` relies on to rewrite it in place)."""
    from autoddl.cluster import yaml_comments

    path = CONFIG_DIR / "local-cpu.yaml"
    header, comments = yaml_comments(path)
    assert header.splitlines()[0].startswith("Measured by `autoddl calibrate")
    assert header.splitlines()[4].startswith("  all_reduce: a ")               # indentation kept
    assert comments["compute_curve.0"] == "M x K x N: 64x64x64"                # list items by index
    assert comments["executor.op_us.float32.linear"].startswith("sizes tiny, small, medium, large: ")
    out = tmp_path / "again.yaml"
    Cluster.from_yaml(path).to_yaml(out, comments=comments, header=header)
    assert out.read_text() == path.read_text()
