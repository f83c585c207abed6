"""Paired seed verdicts of tools/verdict.py on synthetic runs with known answers (t table values from the
standard Student t table, not from the code under test)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from verdict import paired_verdict, seeds_needed, t_quantile  # noqa: E402

# two-sided 95% critical values of Student's t (any statistics table)
T975 = {1: 12.706205, 2: 4.302653, 4: 2.776445, 9: 2.262157, 16: 2.119905, 17: 2.109816}


def test_t_quantiles_match_the_table():
    for df, t in T975.items():
        assert t_quantile(df) == pytest.approx(t, abs=1e-5)


def test_three_seeds_t_interval_and_verdicts():
    ref = {0: 3.00, 1: 3.10, 2: 2.90}
    worse = {0: 3.10, 1: 3.22, 2: 2.98}  # d = 0.10, 0.12, 0.08: mean 0.1, sd 0.02
    v = paired_verdict(worse, ref)
    half = T975[2] * 0.02 / math.sqrt(3)
    assert v["method"] == "t" and v["n"] == 3
    assert v["mean"] == pytest.approx(0.1) and v["sd"] == pytest.approx(0.02)
    assert v["lo"] == pytest.approx(0.1 - half) and v["hi"] == pytest.approx(0.1 + half)
    assert v["verdict"] == "worse"
    better = {s: ref[s] - (worse[s] - ref[s]) for s in ref}
    assert paired_verdict(better, ref)["verdict"] == "better"
    noisy = {0: 3.05, 1: 3.05, 2: 2.90}  # d = 0.05, -0.05, 0: straddles 0
    v = paired_verdict(noisy, ref)
    assert v["verdict"] == "not distinguishable at 3 seeds" and v["lo"] < 0 < v["hi"]


def test_unpaired_seeds_are_left_out_and_one_pair_is_not_enough():
    v = paired_verdict({0: 3.1, 7: 9.0}, {0: 3.0, 1: 3.0})
    assert v["n"] == 1 and math.isnan(v["lo"]) and "needs >= 2 paired seeds" in v["verdict"]


def test_five_or_more_seeds_use_a_bootstrap_interval():
    ref = {s: 3.0 for s in range(8)}
    d = [-0.05, -0.04, -0.06, -0.05, -0.03, -0.055, -0.045, -0.05]
    v = paired_verdict({s: 3.0 + x for s, x in enumerate(d)}, ref)
    assert v["method"] == "bootstrap" and v["verdict"] == "better"
    assert min(d) <= v["lo"] < sum(d) / len(d) < v["hi"] <= max(d)
    assert paired_verdict({s: 3.0 + x for s, x in enumerate(d)}, ref) == v  # fixed resampling seed


def test_seeds_needed_to_resolve_a_gap():
    # mean 0.01, sd 0.02: n = 17 gives 2.119905 * 0.02 / sqrt(17) = 0.01028 > 0.01; n = 18 gives 0.009946
    assert T975[16] * 0.02 / math.sqrt(17) > 0.01 > T975[17] * 0.02 / math.sqrt(18)
    assert seeds_needed(0.01, 0.02) == 18
    assert seeds_needed(0.0, 0.02) == math.inf and seeds_needed(0.01, 0.0) == 2
