"""The on-disk trace cache (autoddl/trace_cache.py): a stored graph reads back equal to a fresh
trace, any change of its key misses, a broken file is a miss, and `autoddl plan` run twice traces
once (the second run builds no model) and writes the same plan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from autoddl import trace_cache
from autoddl.cli import main
from autoddl.cli import plan as plan_cli
from autoddl.loader import ModelFile, load_model_file
from autoddl.trace_cache import TraceKey

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "cache"
    monkeypatch.setenv(trace_cache.CACHE_ENV, str(where))
    return where


@pytest.fixture(scope="module")
def gpt_tiny():
    mf = load_model_file(GPT, preset="tiny").with_batch_size(8)
    return mf.trace("bfloat16")


def test_tests_never_read_the_users_cache():
    # conftest points every test session at an empty folder of its own
    assert trace_cache.cache_dir() != trace_cache.DEFAULT_CACHE_DIR.expanduser()


def test_stored_graph_reads_back_equal(cache, gpt_tiny):
    key = TraceKey.of(GPT, {"preset": "tiny"}, 8, "bfloat16")
    assert trace_cache.load(key) is None
    path = trace_cache.store(key, gpt_tiny)
    assert path.parent == cache / "traces" and path.is_file()
    back = trace_cache.load(key)
    assert back is not None and back.exported is None
    assert back.fingerprint() == gpt_tiny.fingerprint()
    assert list(back.topo()) == list(gpt_tiny.topo())          # every OpNode field, args and FLOPs included
    assert back.total_flops == gpt_tiny.total_flops and back.model_name == "gpt"
    assert sorted(back.nx.edges(data=True)) == sorted(gpt_tiny.nx.edges(data=True))


def test_any_change_of_the_key_misses(cache, gpt_tiny, tmp_path, monkeypatch):
    model = tmp_path / "gpt.py"
    model.write_text(GPT.read_text())
    key = TraceKey.of(model, {"preset": "tiny"}, 8, "bfloat16")
    trace_cache.store(key, gpt_tiny)
    assert trace_cache.load(TraceKey.of(model, {"preset": "tiny"}, 8, "bfloat16")) is not None
    for other in (TraceKey.of(model, {"preset": "tiny", "n_layer": 3}, 8, "bfloat16"),   # model arguments
                  TraceKey.of(model, {"preset": "tiny"}, 16, "bfloat16"),                # batch
                  TraceKey.of(model, {"preset": "tiny"}, None, "bfloat16"),              # the file's own batch
                  TraceKey.of(model, {"preset": "tiny"}, 8, "float32")):                 # precision
        assert other.digest != key.digest and trace_cache.load(other) is None
    model.write_text(GPT.read_text() + "\n# edited\n")                                   # the model's source
    assert trace_cache.load(TraceKey.of(model, {"preset": "tiny"}, 8, "bfloat16")) is None
    model.write_text(GPT.read_text())
    monkeypatch.setattr(torch, "__version__", "0.0.1")                                   # another torch
    assert trace_cache.load(TraceKey.of(model, {"preset": "tiny"}, 8, "bfloat16")) is None
    monkeypatch.undo()
    monkeypatch.setenv(trace_cache.CACHE_ENV, str(cache))
    monkeypatch.setattr(trace_cache, "tracer_digest", lambda: "another tracer")          # autoddl's tracer
    assert trace_cache.load(TraceKey.of(model, {"preset": "tiny"}, 8, "bfloat16")) is None


def test_a_broken_or_foreign_file_is_a_miss_and_is_overwritten(cache, gpt_tiny):
    key = TraceKey.of(GPT, {"preset": "tiny"}, 8, "bfloat16")
    key.path().parent.mkdir(parents=True)
    key.path().write_bytes(b"not a pickle")
    assert trace_cache.load(key) is None
    other = TraceKey.of(GPT, {"preset": "tiny"}, 4, "bfloat16")
    trace_cache.store(other, gpt_tiny)
    key.path().write_bytes(other.path().read_bytes())          # a file holding another key
    assert trace_cache.load(key) is None
    trace_cache.store(key, gpt_tiny)
    assert trace_cache.load(key).fingerprint() == gpt_tiny.fingerprint()
    assert not [p for p in key.path().parent.iterdir() if p.suffix == ".tmp"]   # atomic: no leftovers


def test_the_tracer_reads_the_cache_without_building_the_model(cache, monkeypatch, capsys):
    args = argparse.Namespace(model_py=str(GPT), preset="tiny", set=None, micro_batch_size=None,
                              global_batch_size=None)
    traced = []
    real_trace = ModelFile.trace
    monkeypatch.setattr(ModelFile, "trace",
                        lambda self, dt="float32", **kw: traced.append(dt) or real_trace(self, dt, **kw))
    first = plan_cli._Tracer(args).at(8, "bfloat16")
    assert traced == ["bfloat16"]
    assert "trace cache" not in capsys.readouterr().err

    def no_build(*a, **k):
        raise AssertionError("a cached trace must not build the model file")
    monkeypatch.setattr(plan_cli, "load_model_file", no_build)
    tracer = plan_cli._Tracer(args)
    again = tracer.at(8, "bfloat16")
    assert traced == ["bfloat16"] and again.fingerprint() == first.fingerprint()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trace cache: gpt at batch 8 in bfloat16 read from ")
    assert tracer.name == "gpt" and tracer.path == str(GPT.resolve())


def test_plan_twice_traces_once_and_writes_the_same_plan(cache, tmp_path, capsys):
    common = [str(GPT), "--preset", "tiny", "--cluster", str(ROOT / "configs" / "dgx-a100-8.yaml"),
              "--precision", "bf16", "--micro-batch-size", "2", "--mesh", "8"]
    assert main(["plan", *common, "--out", str(tmp_path / "a.json")]) == 0
    assert "trace cache:" not in capsys.readouterr().err
    assert main(["plan", *common, "--out", str(tmp_path / "b.json")]) == 0
    assert "trace cache: gpt at batch 16 in bfloat16 read from" in capsys.readouterr().err
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a == b and a["graph_hash"]
    assert main(["explain", str(tmp_path / "a.json"), "--op", "linear"]) == 0    # explain reads it too
    assert "trace cache: gpt at batch 16 in bfloat16 read from" in capsys.readouterr().err


def test_the_tracer_reads_a_third_batch_off_two_traces(cache, monkeypatch, capsys):
    args = argparse.Namespace(model_py=str(GPT), preset="tiny", set=None, micro_batch_size=None,
                              global_batch_size=None)
    tracer = plan_cli._Tracer(args)
    tracer.at(1, "bfloat16"), tracer.at(2, "bfloat16")
    traced = []
    real_trace = ModelFile.trace
    monkeypatch.setattr(ModelFile, "trace",
                        lambda self, dt="float32", **kw: traced.append(dt) or real_trace(self, dt, **kw))
    capsys.readouterr()
    derived = tracer.at(12, "bfloat16")
    assert traced == [] and "read off its traces at batches 1 and 2" in capsys.readouterr().err
    fresh = real_trace(load_model_file(GPT, preset="tiny").with_batch_size(12), "bfloat16")
    assert list(derived.topo()) == list(fresh.topo())
    tracer.at(3, "float32")                                  # another precision: traced
    assert traced == ["float32"]
