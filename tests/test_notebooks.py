"""The notebooks: committed with their outputs, built from notebooks/make_notebooks.py, and
re-executed headless (nbclient, this environment's ``python3`` kernel) without any error,
showing the numbers they claim.

The executions are slow (tracing GPT-2 XL / Llama 3 8B and searching every scheme):
01 and 03 take about 1.5-3.5 minutes each on 2 cores, so they are marked ``slow``. Each kernel
computes on one thread, so 01 and 03 are executed side by side, one per core, started together by
whichever of their tests runs first (``beside``); 04 runs gloo ranks and is executed alone.
Notebook 02 needs the fidelity study's ``results/fidelity.csv``; its real run is skipped when the
file is absent, but its code is executed against a small CSV written here either way.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
FIDELITY_CSV = ROOT / "results" / "fidelity.csv"
CELL_TIMEOUT_S = 300


def _builder():
    spec = importlib.util.spec_from_file_location("autoddl_make_notebooks", NB_DIR / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _builder()
FILES = {key: NB_DIR / name for key, (name, _) in MAKE.NOTEBOOKS.items()}


def execute(key: str) -> nbformat.NotebookNode:
    """Execute a fresh copy of notebook ``key`` (the committed file is not touched)."""
    nb = nbformat.read(FILES[key], as_version=4)
    return MAKE.execute(nb, cwd=NB_DIR, timeout_s=CELL_TIMEOUT_S)


SIDE_BY_SIDE = ("01", "03")        # pure cost-model work: one kernel thread each, one core each


@functools.cache
def _side_by_side() -> dict[str, Future]:
    pool = ThreadPoolExecutor(max_workers=len(SIDE_BY_SIDE), thread_name_prefix="notebook")
    runs = {key: pool.submit(execute, key) for key in SIDE_BY_SIDE}
    pool.shutdown(wait=False)
    return runs


def beside(key: str) -> nbformat.NotebookNode:
    """Notebook ``key`` (one of SIDE_BY_SIDE) executed, the others of SIDE_BY_SIDE started with it."""
    return _side_by_side()[key].result()


def summary(nb: nbformat.NotebookNode) -> dict:
    """The JSON the notebook's last cell prints after ``SUMMARY ``."""
    for cell in reversed(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                for line in out["text"].splitlines():
                    if line.startswith("SUMMARY "):
                        return json.loads(line[len("SUMMARY "):])
    raise AssertionError("no 'SUMMARY {...}' line in the notebook's outputs")


def pngs(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))


def errors(nb: nbformat.NotebookNode) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells for o in c.get("outputs", [])
            if o.get("output_type") == "error"]


# -- committed files -----------------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(FILES))
def test_committed_notebook_is_built_from_make_notebooks(key):
    committed = nbformat.read(FILES[key], as_version=4)
    nbformat.validate(committed)
    built = MAKE.build(key)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], (
        f"{FILES[key].name} differs from notebooks/make_notebooks.py; rebuild it: "
        f"python notebooks/make_notebooks.py --execute {key}")
    assert committed.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("key", ["01", "03", "04"] + (["02"] if FIDELITY_CSV.exists() else []))
def test_committed_notebook_has_outputs(key):
    nb = nbformat.read(FILES[key], as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    unexecuted = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unexecuted, (f"{FILES[key].name}: code cells {unexecuted} were not executed; commit it with outputs: "
                            f"python notebooks/make_notebooks.py --execute-only {key}")
    assert not errors(nb), f"{FILES[key].name} was committed with errors: {errors(nb)}"
    assert pngs(nb) >= 1, f"{FILES[key].name}: no inline PNG chart in its outputs"
    summary(nb)


# -- 01: compare schemes ----------------------------------------------------------------------------

@pytest.mark.slow
def test_01_compare_schemes_executes_and_found_beats_every_baseline():
    nb = beside("01")
    assert pngs(nb) >= 1
    s = summary(nb)
    variants = s.pop("llama3-8b-variants")
    assert set(s) == {"gpt2-xl|dgx-a100-8", "gpt2-xl|h100-4x8", "llama3-8b|dgx-a100-8", "llama3-8b|h100-4x8"}
    # Llama-3-8B at 8192 tokens on 8 H100: nothing fits without recompute; bf16 with selective
    # recompute fits, faster than with full recompute (which recomputes more) and than fp32
    assert variants["bf16 none (any)"][2] is False and variants["fp32 none (any)"][2] is False
    step, memory, fits = variants["bf16 selective found"]
    assert fits and memory <= 80 and step < variants["bf16 full found"][0] < variants["fp32 full found"][0]
    compared = 0
    for pair, steps in s.items():
        found = steps["found"]
        assert found is not None and found > 0, pair
        assert steps["found_fits"], f"{pair}: the found plan does not fit in memory"
        for scheme in ("dp", "zero3", "tp", "sp", "dp_tp"):
            if steps[scheme] is not None:
                compared += 1
                assert found <= steps[scheme] * (1 + 1e-9), f"{pair}: found {found} ms > {scheme} {steps[scheme]} ms"
    assert compared >= 6, f"only {compared} applicable baselines across the four pairs: {s}"
    # GPT-2 XL's compute alone on 8 A100s bounds the step from below: 6 * params * tokens / (8 * peak * eff)
    a100 = s["gpt2-xl|dgx-a100-8"]["found"] / 1e3
    assert a100 >= 6 * 1.5e9 * 16 * 1024 / (8 * 312e12), f"gpt2-xl on 8 A100: {a100} s is below the FLOP bound"


# -- 03: scaling ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_03_scaling_executes_with_consistent_throughput():
    nb = beside("03")
    assert pngs(nb) >= 3
    s = summary(nb)
    devices = s["devices"]
    assert sorted(map(int, devices)) == [8, 16, 32, 64, 128, 256, 512, 1024]
    for n, r in devices.items():
        assert r["found_ms"] <= r["baseline_ms"] * (1 + 1e-9), f"{n} GPUs: found {r} slower than the best baseline"
        tokens = s["seqs_per_device"] * int(n) * s["seq_len"]
        assert r["tokens_per_s"] == pytest.approx(tokens / (r["found_ms"] / 1e3), rel=1e-3), n
        rows, cols = (int(x) for x in r["mesh"].split("x")) if "x" in r["mesh"] else (int(r["mesh"]), 1)
        assert rows * cols == int(n), f"{n} GPUs: best mesh {r['mesh']}"
    bw = {float(k): v for k, v in s["bandwidth"].items()}
    assert sorted(bw) == [3.125, 6.25, 12.5, 25.0, 50.0]
    for gbps, r in bw.items():
        assert r["found_ms"] <= r["baseline_ms"] * (1 + 1e-9), f"{gbps} GB/s: {r}"
    # every baseline plan only gets slower as the inter-node link slows, so the best of them does too
    base = [bw[g]["baseline_ms"] for g in sorted(bw, reverse=True)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(base[1:], base)), f"best baseline vs bandwidth: {base}"
    # the 50 GB/s point is the 32-GPU point of the device sweep, on fewer meshes
    assert bw[50.0]["found_ms"] >= devices["32"]["found_ms"] * (1 - 1e-9)
    # where pipeline stages win: every (size, devices, link) point, staged plans with pp >= 2 against pp = 1
    pipes = {(r["size"], r["devices"], r["inter_gbps"]): r for r in s["pipeline"]}
    assert set(pipes) == {(z, n, g) for z in ("1.3B", "13B", "175B") for n in (64, 256, 1024) for g in (50, 12.5, 3.125)}
    for key, r in pipes.items():
        if r["staged_s"] is not None:
            assert r["staged"].startswith("pp=") and not r["staged"].startswith("pp=1,"), key
        if r["unstaged_s"] is not None:
            assert r["unstaged"].startswith("pp=1,"), key
    assert any(r["staged_s"] is not None and (r["unstaged_s"] is None or r["staged_s"] < r["unstaged_s"])
               for r in pipes.values()), "pipeline stages win nowhere"
    for (z, n, g), r in pipes.items():          # a slower link never makes the best plan of either kind faster
        for kind in ("staged_s", "unstaged_s"):
            slower = [pipes[(z, n, h)][kind] for h in (50, 12.5, 3.125) if h <= g]
            if r[kind] is not None and None not in slower:
                assert all(x >= r[kind] * (1 - 1e-9) for x in slower), (z, n, g, kind)


# -- 02: measured vs predicted ---------------------------------------------------------------------

def _write_fidelity_csv(path: Path) -> list[tuple[float, float]]:
    """Two studies; the latest has 6 measured runs and 1 failed one. Returns its (predicted, measured) s."""
    cols = ["study", "model", "preset", "cluster", "plan", "scheme", "config", "mesh", "nproc", "predicted_step_s",
            "predicted_compute_s", "predicted_comm_s", "predicted_grad_sync_s", "predicted_optimizer_s",
            "measured_median_s", "measured_p10_s", "measured_p90_s", "load_avg_1m", "error", "testbed"]
    latest = [  # model, scheme, mesh, nproc, predicted, compute, comm, grad_sync, optimizer, measured
        ("mlp", "dp", "2", 2, 0.010, 0.006, 0.003, 0.003, 0.001, 0.012),
        ("mlp", "tp", "2", 2, 0.020, 0.008, 0.011, 0.001, 0.001, 0.030),
        ("mlp", "found", "2", 2, 0.009, 0.006, 0.002, 0.002, 0.001, 0.010),
        ("gpt", "dp", "4", 4, 0.050, 0.030, 0.015, 0.015, 0.005, 0.040),
        ("gpt", "zero3", "4", 4, 0.060, 0.030, 0.025, 0.010, 0.005, 0.090),
        ("gpt", "found", "4", 4, 0.045, 0.030, 0.010, 0.010, 0.005, 0.050),
    ]
    lines = [",".join(cols)]
    for m, sch, mesh, n, p, c, cm, g, o, meas in latest:
        lines.append(f"20990101-000000,{m},tiny,local-cpu,{sch},{sch},{mesh},{mesh},{n},{p},{c},{cm},{g},{o},"
                     f"{meas},{meas * 0.9},{meas * 1.1},1.0,,")
    lines.append("20990101-000000,gpt,tiny,local-cpu,tp,tp,4,4,4,0.07,0.03,0.035,0.0,0.005,,,,1.0,timeout,")
    lines.append("20000101-000000,mlp,tiny,local-cpu,dp,dp,2,2,2,1.0,0.5,0.4,0.1,0.1,100.0,90.0,110.0,1.0,,")
    # a later two-host study (benchmarks/two_hosts_study.py): not the loopback study the notebook reads
    lines.append("two-hosts-20991231,gpt,tiny,two-hosts,dp,dp,2x2,2x2,4,1.0,0.5,0.4,0.1,0.1,9.0,8.0,10.0,1.0,,"
                 "two hosts at 1000 Mbit/s")
    path.write_text("\n".join(lines) + "\n")
    return [(r[4], r[9]) for r in latest]


def test_02_computes_mape_from_the_latest_study(tmp_path, monkeypatch):
    csv = tmp_path / "fidelity.csv"
    pairs = _write_fidelity_csv(csv)
    monkeypatch.setenv("AUTODDL_FIDELITY_CSV", str(csv))
    nb = MAKE.execute(MAKE.build("02"), cwd=NB_DIR, timeout_s=CELL_TIMEOUT_S)
    s = summary(nb)
    assert s["study"] == "20990101-000000" and s["runs"] == 6
    expected = 100 * sum(abs(p - m) / m for p, m in pairs) / len(pairs)
    assert s["overall_mape_pct"] == pytest.approx(expected, abs=1e-3)
    assert s["per_model_mape_pct"]["mlp"] == pytest.approx(100 * (0.2 / 1.2 + 1 / 3 + 0.1) / 3, abs=1e-3)
    assert pngs(nb) == 1


def test_02_says_how_to_make_the_missing_csv(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTODDL_FIDELITY_CSV", str(tmp_path / "absent.csv"))
    with pytest.raises(nbclient.exceptions.CellExecutionError) as info:
        MAKE.execute(MAKE.build("02"), cwd=NB_DIR, timeout_s=CELL_TIMEOUT_S)
    message = str(info.value)
    assert "absent.csv does not exist" in message and "benchmarks/fidelity.py" in message


@pytest.mark.slow
@pytest.mark.skipif(not FIDELITY_CSV.exists(),
                    reason="results/fidelity.csv is absent: run `python benchmarks/fidelity.py` first")
def test_02_measured_vs_predicted_on_the_study(monkeypatch):
    monkeypatch.delenv("AUTODDL_FIDELITY_CSV", raising=False)
    import pandas as pd

    nb = execute("02")
    s = summary(nb)
    raw = pd.read_csv(FIDELITY_CSV)
    if "testbed" in raw.columns:                # the two-host studies' rows are not the loopback study's
        raw = raw[raw["testbed"].isna()]
    if "study" in raw.columns:
        raw = raw[raw["study"].astype(str) == str(raw["study"].astype(str).max())]
    runs = raw.dropna(subset=["measured_median_s", "predicted_step_s"])
    expected = 100 * (abs(runs.predicted_step_s - runs.measured_median_s) / runs.measured_median_s).mean()
    assert s["runs"] == len(runs) > 0
    assert s["overall_mape_pct"] == pytest.approx(expected, abs=1e-3)
    assert math.isfinite(s["overall_mape_pct"])


# -- 04: many models on one cluster -----------------------------------------------------------------

@pytest.mark.slow
def test_04_multi_model_runs_the_schedules_and_every_job_trains_as_alone():
    nb = execute("04")
    assert pngs(nb) >= 4 and not errors(nb)
    s = summary(nb)
    assert set(s["measured"]) == {"2", "4"} and set(s["predicted"]) == {"8", "4"}
    for n, r in s["measured"].items():
        assert r["devices"] == int(n)
        assert r["loss_max_rel_error"] <= 1e-5, f"{n} ranks: a job's losses differ from the job alone"
        assert r["measured_lrtf_s"] > 0
    for r in [*s["measured"].values(), *s["predicted"].values()]:
        # busy = work / (devices x makespan): no schedule beats the work spread evenly over the devices
        assert 0 < r["busy"] <= 1 + 1e-9
        assert r["sequential_over_lrtf"] == pytest.approx(r["sequential_s"] / r["lrtf_s"], rel=1e-4)  # 6 decimals
