"""The planning speed-ups change no result: the greedy baselines decide each repeated block once
(search/baselines.py's memo on ``_greedy_key``), and the search found with that memo equals the
search found without it, plan for plan and price for price; graphs read from the trace cache hash
as freshly traced ones."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import search.baselines as baselines
import search.coordinate_descent as cd_module
from autoddl.cluster import Cluster
from autoddl.graph import TensorMeta
from autoddl.loader import load_model_file
from autoddl.sbp import NdSbp, Signature
from search.baselines import baseline_specs, build_baseline
from search.formulate import formulate
from search.planner import search
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dgx():
    return Cluster.from_yaml(ROOT / "configs" / "dgx-a100-8.yaml")


@pytest.fixture(scope="module")
def llama4():
    return load_model_file(ROOT / "examples" / "llama.py", preset="tiny", n_layers=4, batch_size=8).trace("float32")


def unmemoised(monkeypatch) -> None:
    """Every node's key unique: each op is decided by its own greedy pass, as before the memo."""
    fresh = itertools.count()
    monkeypatch.setattr(baselines, "_greedy_key", lambda *a, **k: next(fresh))


def counted(monkeypatch) -> list[int]:
    calls: list[int] = []
    greedy = baselines._greedy_op

    def spy(i, *args, **kwargs):
        calls.append(i)
        return greedy(i, *args, **kwargs)
    monkeypatch.setattr(baselines, "_greedy_op", spy)
    return calls


@pytest.mark.parametrize("mesh", [(8,), (4, 2)])   # where a key without the edges decides wrongly
def test_memoised_baselines_equal_the_op_by_op_pass(llama4, dgx, mesh, monkeypatch):
    form = formulate(llama4, dgx, mesh)
    with monkeypatch.context() as m:
        calls = counted(m)
        fast = [build_baseline(form, spec) for spec in baseline_specs(len(mesh))]
        memoised_calls = len(calls)
    with monkeypatch.context() as m:
        unmemoised(m)
        calls = counted(m)
        slow = [build_baseline(form, spec) for spec in baseline_specs(len(mesh))]
        all_calls = len(calls)
    for f, s in zip(fast, slow):
        assert f.reason == s.reason, f.spec.name
        assert (f.assignment is None) == (s.assignment is None), f.spec.name
        if f.assignment is not None:
            assert np.array_equal(f.assignment, s.assignment), f.spec.name
    assert any(f.applicable for f in fast)
    # 4 identical blocks: blocks 2-4 reuse block 1's decisions, so well under the op-by-op count.
    assert memoised_calls < 0.6 * all_calls, (memoised_calls, all_calls)


def test_search_with_the_memo_equals_the_search_without(llama4, dgx, monkeypatch):
    fast = search(llama4, dgx, mesh=(4, 2))
    with monkeypatch.context() as m:
        unmemoised(m)
        slow = search(llama4, dgx, mesh=(4, 2))
    assert fast.found.to_dict() == slow.found.to_dict()
    assert fast.found_breakdown.step_time_s == slow.found_breakdown.step_time_s
    assert [(s.name, s.step_time_s, s.reason) for s in fast.schemes] == \
        [(s.name, s.step_time_s, s.reason) for s in slow.schemes]


def test_unpickled_metas_and_layouts_hash_as_fresh_ones():
    """A trace cache written by another process (another string-hash seed) gives metas whose hash is
    this process's: equal keys meet in the search's memo tables (a stale cached hash missed them,
    making every re-plan slower than the first plan's search)."""
    code = ("import pickle, sys; from autoddl.graph import TensorMeta; from autoddl.sbp import Signature; "
            "sys.stdout.buffer.write(pickle.dumps([TensorMeta((4, 8), 'bfloat16'), "
            "Signature.parse('[S(0)], [B] -> [S(0)]')]))")
    env = {**os.environ, "PYTHONHASHSEED": "7", "PYTHONPATH": str(ROOT)}
    meta, sig = pickle.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                            check=True).stdout)
    fresh_meta, fresh_sig = TensorMeta((4, 8), "bfloat16"), Signature.parse("[S(0)], [B] -> [S(0)]")
    assert meta == fresh_meta and hash(meta) == hash(fresh_meta) and {fresh_meta: 1}[meta] == 1
    assert sig == fresh_sig and hash(sig) == hash(fresh_sig) and {fresh_sig: 1}[sig] == 1
    assert hash(sig.inputs[0]) == hash(NdSbp.parse("[S(0)]"))


def _slow_clock(monkeypatch) -> None:
    """Every reading of ``time.perf_counter`` 100 s after the one before: a machine so loaded that
    any clock bound is reached at once."""
    ticks = itertools.count(0.0, 100.0)
    monkeypatch.setattr(cd_module.time, "perf_counter", lambda: next(ticks))


def _decisions(plan) -> tuple:
    return (tuple(plan.mesh.shape), sorted((k, str(v)) for k, v in plan.signatures.items()),
            sorted((k, str(v)) for k, v in plan.param_storage.items()))


def test_the_found_plan_does_not_depend_on_the_clock(monkeypatch):
    """By default coordinate descent is bounded by its work, not the clock: llama tiny on local-cpu's
    2x2 (the case a loaded CI machine planned differently when the descent's restarts had a 1 s
    bound) gets the same plan when every clock reading is 100 s later than the last. With a clock
    bound the restarts stop at once, so the bound really is what this test removes."""
    local = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(4)
    graph = load_model_file(ROOT / "examples" / "llama.py", preset="tiny").trace("float32")
    calm = search(graph, local, mesh=(2, 2)).found
    restarts = []
    perturb = cd_module._Descent._perturb
    monkeypatch.setattr(cd_module._Descent, "_perturb", lambda self, *a: restarts.append(1) or perturb(self, *a))
    with monkeypatch.context() as m:
        _slow_clock(m)
        loaded = search(graph, local, mesh=(2, 2)).found
        unbounded, restarts[:] = len(restarts), []
        search(graph, local, mesh=(2, 2), cd_time_limit_s=1.0)
    assert _decisions(loaded) == _decisions(calm)
    assert unbounded > 0 and not restarts          # a clock bound would have cut every restart


def test_the_cli_collects_garbage_less_often_while_planning_and_restores_the_collector(tmp_path, monkeypatch):
    """autoddl/cli/__init__.py: the command runs under PLANNING_GC_THRESHOLD with the traced graph frozen
    out of the collector; both are undone on return (a user's process, or pytest's, keeps its own)."""
    import gc

    from autoddl import cli

    seen = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (seen.append(gc.get_threshold()), real_freeze()))
    before = gc.get_threshold()
    argv = ["plan", str(ROOT / "examples" / "mlp.py"), "--preset", "tiny", "--cluster",
            str(CPU_CLUSTER_PATH), "--devices", "2", "--out", str(tmp_path / "p.json")]
    assert cli.main(argv) == 0
    assert seen and all(t == cli.PLANNING_GC_THRESHOLD for t in seen)      # frozen while the threshold held
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert cli.main(argv + ["--devices", "0"]) == 2                          # an error restores them too
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    real_freeze()                                   # a caller (a notebook) froze its own objects: left as they were
    try:
        frozen, seen[:] = gc.get_freeze_count(), []
        assert frozen > 0 and cli.main(argv) == 0
        assert not seen and 0 < gc.get_freeze_count() <= frozen       # none unfrozen or added (a few freed)
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()
