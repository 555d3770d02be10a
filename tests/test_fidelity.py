"""benchmarks/fidelity.py: MAPE, Spearman, the found-plan verdict and the summary, on synthetic data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fid():
    return load_benchmark("fidelity")


def test_mape_by_hand(fid):
    pred, meas = [10.0, 30.0, 5.0], [20.0, 20.0, 5.0]
    assert fid.mape(pred, meas) == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert fid.mape([1.0], [1.0]) == 0.0
    with pytest.raises(ValueError, match="equally many"):
        fid.mape([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        fid.mape([1.0], [0.0])


def test_spearman_orders_and_ties(fid):
    assert fid.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert fid.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one swap among 4: 1 - 6 * sum(d^2) / (n (n^2 - 1)) = 1 - 6 * 2 / 60 = 0.8
    assert fid.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties: predicted ranks (1.5, 1.5, 3), measured (1, 2, 3): Pearson of the ranks
    rp, rm = [1.5, 1.5, 3.0], [1.0, 2.0, 3.0]
    mp, mm = sum(rp) / 3, sum(rm) / 3
    want = sum((a - mp) * (b - mm) for a, b in zip(rp, rm)) / math.sqrt(
        sum((a - mp) ** 2 for a in rp) * sum((b - mm) ** 2 for b in rm))
    assert fid.spearman([5.0, 5.0, 7.0], [1.0, 2.0, 3.0]) == pytest.approx(want)
    scipy_stats = pytest.importorskip("scipy.stats")
    xs, ys = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0], [2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0]
    assert fid.spearman(xs, ys) == pytest.approx(scipy_stats.spearmanr(xs, ys).statistic)
    assert math.isnan(fid.spearman([1.0], [2.0])) and math.isnan(fid.spearman([1, 1, 1], [1, 2, 3]))


def _row(scheme, median, p10, p90, model="m", config="2", predicted=None):
    return {"model": model, "config": config, "scheme": scheme, "same_as": "", "median": median, "p10": p10,
            "p90": p90, "predicted": predicted if predicted is not None else median, "load": 1.0}


def test_found_verdict(fid):
    base = [_row("dp", 10.0, 9.0, 11.0), _row("tp", 12.0, 11.0, 13.0)]
    assert fid.found_verdict(base + [_row("found", 9.5, 9.0, 10.0)]) == ("fastest", "dp")
    assert fid.found_verdict(base + [_row("found", 10.5, 10.8, 12.0)]) == ("tied", "dp")      # p10 <= dp's p90
    assert fid.found_verdict(base + [_row("found", 12.0, 11.5, 12.5)]) == ("slower", "dp")    # 11.5 > 11.0
    assert fid.found_verdict([_row("found", 1.0, 1.0, 1.0)]) == ("fastest", "")
    with pytest.raises(ValueError, match="found"):
        fid.found_verdict(base)


def test_summarize_and_markdown(fid, tmp_path):
    rows = [_row("dp", 0.020, 0.019, 0.021, predicted=0.010), _row("found", 0.010, 0.009, 0.011, predicted=0.012),
            _row("tp", 0.030, 0.028, 0.033, predicted=0.030),
            _row("dp", 0.040, 0.039, 0.041, config="4", predicted=0.020),
            _row("found", 0.050, 0.045, 0.055, config="4", predicted=0.010)]
    s = fid.summarize(rows)
    assert s["per_mc"][("m", "2")]["mape"] == pytest.approx((0.5 + 0.2 + 0.0) / 3)
    assert s["per_mc"][("m", "2")]["spearman"] == pytest.approx(0.5)    # predicted order found<dp... swapped
    assert s["per_mc"][("m", "4")]["spearman"] == pytest.approx(-1.0)
    assert s["per_model"]["m"]["spearman_mean"] == pytest.approx(-0.25)
    assert s["per_model"]["m"]["spearman_min"] == pytest.approx(-1.0)
    assert s["per_model"]["m"]["verdicts"] == {"2": "fastest", "4": "slower"}
    assert s["mape"] == pytest.approx((0.5 + 0.2 + 0.0 + 0.5 + 0.8) / 5)
    assert math.isnan(s["mape_against_mean"])              # rows from before the mean was recorded
    rows[0]["mean"] = 0.0125                               # predicted 0.010: 20% off the mean, 50% off the median
    assert fid.summarize(rows)["mape_against_mean"] == pytest.approx(0.2)
    text = fid.markdown("S1", rows, s, "python benchmarks/fidelity.py")
    assert "| m | 5 | 40.0% | -0.25 (-1.00) | 2: fastest / 4: slower |" in text
    fid.plot(rows, tmp_path / "f.png", "t")
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_study_csv_round_trip(fid, tmp_path):
    from executor.measure import RUN_COLUMNS, append_row

    csv_path = tmp_path / "fidelity.csv"
    for study, med in (("A", "0.02"), ("B", "0.04")):
        append_row(csv_path, {"study": study, "model": "m", "config": "2", "scheme": "found", "same_as": "",
                              "predicted_step_s": "0.03", "measured_median_s": med, "measured_p10_s": med,
                              "measured_p90_s": med, "load_avg_1m": "1.5"}, columns=RUN_COLUMNS + fid.STUDY_COLUMNS)
    append_row(csv_path, {"study": "B", "model": "m", "config": "2", "scheme": "dp", "predicted_step_s": "0.01",
                          "error": "RuntimeError: boom"}, columns=RUN_COLUMNS + fid.STUDY_COLUMNS)
    append_row(csv_path, {"study": "two-hosts-C", "model": "m", "config": "2x2", "scheme": "dp", "same_as": "",
                          "predicted_step_s": "0.05", "measured_median_s": "0.06", "measured_p10_s": "0.06",
                          "measured_p90_s": "0.06", "load_avg_1m": "1", "testbed": "two hosts at 1000 Mbit/s"},
               columns=RUN_COLUMNS + fid.STUDY_COLUMNS)
    study, rows = fid.load_study(csv_path)          # the latest of its own: not the two-host testbed's
    assert study == "B" and len(rows) == 1 and rows[0]["median"] == 0.04 and rows[0]["predicted"] == 0.03
    assert fid.load_study(csv_path, "A")[1][0]["median"] == 0.02
    assert fid.load_study(csv_path, "two-hosts-C")[1][0]["median"] == 0.06     # by name
    assert math.isnan(rows[0]["mean"])
    assert float(fid._mean_step({"step_time_s": [0.01, 0.02, 0.06]})) == pytest.approx(0.03)    # median 0.02
    assert fid._mean_step({"error": "RuntimeError: boom"}) == ""


@pytest.fixture(scope="module")
def reprice():
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return load_benchmark("fidelity_reprice")


def test_reprice_report_by_hand(reprice):
    """MAPE both ways and the mean predicted / measured per (ranks, scheme), from synthetic rows."""
    rows = [{"scheme": "dp", "nproc": 2, "predicted": 12.0, "new": 9.0, "median": 10.0},
            {"scheme": "dp", "nproc": 4, "predicted": 20.0, "new": 22.0, "median": 20.0},
            {"scheme": "tp", "nproc": 4, "predicted": 15.0, "new": 30.0, "median": 30.0}]
    lines = reprice.report(rows)
    # study: (0.2 + 0 + 0.5) / 3; new: (0.1 + 0.1 + 0) / 3
    assert lines[0] == "3 runs: MAPE 23.3% as the study predicted, 6.7% with the new cluster"
    assert lines[1:3] == ["  2 ranks (1 runs): 20.0% -> 10.0%", "  4 ranks (2 runs): 25.0% -> 5.0%"]
    assert lines[4:] == ["  2 dp        1.20 ->  0.90", "  4 dp        1.00 ->  1.10", "  4 tp        0.50 ->  1.00"]


def test_reprice_with_the_study_cluster_gives_the_study_prediction(reprice, fid):
    """mlp on 2 ranks, planned with local-cpu as a study would, its rows' predictions read back: priced
    again with the same file, every plan is the study's and prices exactly as recorded; a row whose
    recorded prediction differs is left out and named."""
    import tempfile

    cluster = CPU_CLUSTER_PATH
    with tempfile.TemporaryDirectory() as tmp:
        items = fid.plan_all("mlp", fid.MODELS["mlp"], ["2"], cluster, Path(tmp))
    rows = [{"model": "mlp", "config": "2", "scheme": it["scheme"], "median": 0.01,
             "predicted": float(f"{it['plan'].cost.step_time_s:.6g}")} for it in items]
    rows[0]["predicted"] *= 1.01
    priced, skipped = reprice.reprice(rows, cluster, cluster)
    assert len(priced) == len(rows) - 1 and len(skipped) == 1 and skipped[0].startswith(f"mlp 2 {rows[0]['scheme']}:")
    for r in priced:
        assert r["new"] == pytest.approx(r["predicted"], rel=1e-5) and r["nproc"] == 2


def test_same_program_compares_every_storage(fid):
    """The found plan is labelled ``found=<baseline>`` only when it makes the baseline's decisions, the
    optimizer and gradient storages too: ZeRO-1 has data parallel's signatures and parameter storage."""
    import dataclasses

    from autoddl.plan import Mesh, Plan
    from autoddl.sbp import NdSbp, Signature

    dp = Plan(name="dp", mesh=Mesh((2,)), graph_hash="g", optimizer="adamw",
              signatures={"linear": Signature.parse("[S(0)], [B] -> [S(0)]")},
              param_storage={"fc.weight": NdSbp.parse("[B]")})
    zero1 = dataclasses.replace(dp, name="zero1", optimizer_storage={"fc.weight": NdSbp.parse("[S(0)]")})
    zero2 = dataclasses.replace(zero1, name="zero2", grad_storage={"fc.weight": NdSbp.parse("[S(0)]")})
    assert fid.same_program(dp, dataclasses.replace(dp, name="found"))
    assert not fid.same_program(dp, zero1) and not fid.same_program(zero1, zero2)
    assert fid.same_program(zero2, dataclasses.replace(zero2, name="found"))
