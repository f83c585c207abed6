"""A diverged run's non-finite end is its result (never an earlier finite evaluation), and figures computed from
too few samples say so.

The sweeps are written the way the trainer writes them: ``config.yaml`` from ``dump_config`` of a loaded config,
``metrics.jsonl`` through :class:`~megatron_geo.training.metrics.MetricsLogger` (a non-finite float becomes
``null``). Expected gaps and intervals are computed here with numpy and scipy.stats.t from the values written."""

import csv
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from megatron_geo.config import dump_config, load_config
from megatron_geo.training.metrics import MetricsLogger, WandbSpec

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_runs", REPO / "tools" / "compare_runs.py")
cr = importlib.util.module_from_spec(_spec)
sys.modules["compare_runs"] = cr
_spec.loader.exec_module(cr)
import verdict  # noqa: E402  (tools/ is on the path now)
from verdict import paired_verdict  # noqa: E402

STEPS, EVAL = 6, 2
NAN = float("nan")
REF = {1: 3.20, 2: 3.31, 3: 3.12}  # bf16 final validation losses
GAP = {1: 0.052, 2: 0.054, 3: 0.047}  # fp8 - bf16 at the end, all clearly worse


def write_run(
    root: Path,
    dtype: str,
    seed: int,
    vals: dict[int, float],
    losses: dict[int, float] | None = None,
    stop_at: int | None = None,
    extra: tuple[str, ...] = (),
) -> Path:
    """A run folder: ``vals`` = {step: validation loss} (NaN allowed), ``losses`` = {step: train loss} (default
    a finite decreasing curve); ``stop_at``: the run ends there with a skipped step (non-finite gradient)."""
    d = root / f"{dtype}-seed{seed}"
    d.mkdir(parents=True)
    cfg = load_config(
        [],
        [
            f"comm.dtype={dtype}",
            f"train.seed={seed}",
            f"train.steps={STEPS}",
            f"train.eval_interval={EVAL}",
            "logging.wandb=disabled",
            *extra,
        ],
    )
    (d / "config.yaml").write_text(dump_config(cfg))
    log = MetricsLogger(str(d), True, WandbSpec("disabled", "p"))
    for step in range(1, (stop_at or STEPS) + 1):
        loss = (losses or {}).get(step, 6.0 - 0.3 * step)
        skipped = stop_at == step
        rec = {
            "step": step,
            "lr": 1e-3,
            "grad_norm": NAN if skipped else 1.0,
            "tokens_per_sec": 100.0,
            "comm_bytes": 10,
            "step_time_s": 0.1,
            "consumed_samples": step,
            "skipped": skipped,
            "loss": loss,
        }
        if step in vals:
            rec["val_loss"] = vals[step]
        log.log(rec)
    log.close()
    return d


def t_interval(d: list[float]) -> tuple[float, float, float]:
    """Mean and 95% Student t interval of the paired differences ``d``."""
    d = np.asarray(d, dtype=np.float64)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


@pytest.fixture
def sweep(tmp_path):
    """fp8 seed 3 diverges after its step-4 evaluation, which was 1.0 below its reference (a stale value that
    would make fp8 look better)."""
    root = tmp_path / "sw"
    for s in REF:
        write_run(root, "bf16", s, {2: 5.0, 4: 4.0, 6: REF[s]})
        if s == 3:
            write_run(root, "fp8_e4m3", s, {2: 5.0, 4: REF[s] - 1.0, 6: NAN}, losses={5: NAN, 6: NAN})
        else:
            write_run(root, "fp8_e4m3", s, {2: 5.0, 4: 4.0, 6: REF[s] + GAP[s]})
    return root


def test_the_trainer_writes_a_non_finite_evaluation_as_null(sweep):
    assert '"val_loss": null' in (sweep / "fp8_e4m3-seed3" / "metrics.jsonl").read_text()


def test_a_diverged_run_is_scored_by_its_non_finite_end(sweep):
    rows = {r["mode"]: r for r in cr.summarize(cr.group_modes(cr.load_sweep(sweep)), "bf16")}
    f = rows["fp8"]
    mean, lo, hi = t_interval([GAP[1], GAP[2]])
    assert f["paired_seeds"] == 2 and f["paired_gap"] == pytest.approx(mean, abs=1e-12)
    assert f["ci_lo"] == pytest.approx(lo, abs=1e-9) and f["ci_hi"] == pytest.approx(hi, abs=1e-9)
    assert lo > 0 and f["verdict"] == "worse"
    assert f["diverged"] == 1 and f["diverged_seeds"] == [3] and rows["bf16"]["diverged"] == 0
    # the unpaired mean and std are over the two runs that finished
    vals = [REF[1] + GAP[1], REF[2] + GAP[2]]
    assert f["final_val_loss_mean"] == pytest.approx(np.mean(vals)) and f["final_val_loss_std"] == pytest.approx(
        np.std(vals, ddof=1)
    )
    runs = {(r.mode, r.seed): r for r in cr.load_sweep(sweep)}
    bad = runs["fp8", 3]
    assert bad.diverged and math.isnan(bad.final_val_loss) and math.isnan(bad.final_loss)
    # the final train loss of the mode: the two finite runs' last losses
    assert f["final_train_loss_mean"] == pytest.approx(6.0 - 0.3 * STEPS)


def test_the_tables_and_the_csv_name_the_diverged_run(sweep, tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compare_runs.py"), str(sweep), "--out", str(out), "--no-plots"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    mean, lo, hi = t_interval([GAP[1], GAP[2]])
    md = (out / "results.md").read_text()
    assert f"| fp8 | 2 | {mean:+.4f} | [{lo:+.4f}, {hi:+.4f}] (t) | **worse** |" in md
    assert "1 diverged: seed 3 |" in md and "| fp8 | 3 (1 diverged: seed 3) |" in md
    with open(out / "results.csv") as fh:
        rows = {r["mode"]: r for r in csv.DictReader(fh)}
    assert rows["fp8"]["diverged"] == "1" and rows["fp8"]["diverged_seeds"] == "3"
    assert float(rows["fp8"]["paired_gap"]) == pytest.approx(mean) and rows["fp8"]["verdict"] == "worse"


def test_a_non_finite_last_train_loss_is_diverged_even_with_a_finite_last_evaluation(tmp_path):
    """The last ``loss`` logged is null after the last (finite) evaluation: the run's end is non-finite."""
    root = tmp_path / "sw"
    for s in REF:
        write_run(root, "bf16", s, {2: 5.0, 4: 4.0, 6: REF[s]})
        write_run(root, "fp8_e4m3", s, {2: 5.0, 4: 4.0, 6: REF[s] + GAP[s]}, losses={6: NAN} if s == 1 else None)
    rows = {r["mode"]: r for r in cr.summarize(cr.group_modes(cr.load_sweep(root)), "bf16")}
    mean, lo, hi = t_interval([GAP[2], GAP[3]])
    assert rows["fp8"]["diverged_seeds"] == [1] and rows["fp8"]["paired_gap"] == pytest.approx(mean)
    assert rows["fp8"]["ci_lo"] == pytest.approx(lo) and rows["fp8"]["ci_hi"] == pytest.approx(hi)


def test_a_run_stopped_on_a_non_finite_step_is_diverged_not_incomplete(tmp_path):
    """train.nonfinite=stop: the trainer logs the skipped step and stops at step 5 of 6; its last evaluation
    (step 4) is finite and 1.0 below the reference, and must not be its result."""
    root = tmp_path / "sw"
    for s in REF:
        write_run(root, "bf16", s, {2: 5.0, 4: 4.0, 6: REF[s]})
        if s == 2:
            write_run(root, "fp8_e4m3", s, {2: 5.0, 4: REF[s] - 1.0}, stop_at=5, extra=("train.nonfinite=stop",))
        else:
            write_run(root, "fp8_e4m3", s, {2: 5.0, 4: 4.0, 6: REF[s] + GAP[s]})
    rows = {r["mode"]: r for r in cr.summarize(cr.group_modes(cr.load_sweep(root)), "bf16")}
    mean, lo, hi = t_interval([GAP[1], GAP[3]])
    assert rows["fp8"]["diverged_seeds"] == [2] and rows["fp8"]["paired_seeds"] == 2
    assert rows["fp8"]["paired_gap"] == pytest.approx(mean) and rows["fp8"]["verdict"] == "worse"
    # with train.nonfinite=skip, max_skipped_steps=2 skips in a row stop the run the same way
    root2 = tmp_path / "sw2"
    write_run(root2, "bf16", 1, {2: 5.0, 4: 4.0}, losses={4: NAN}, stop_at=4, extra=("train.max_skipped_steps=1",))
    assert cr.load_sweep(root2)[0].diverged
    # a run that stopped on a finite step is still incomplete, not diverged
    root3 = tmp_path / "sw3"
    d = write_run(root3, "bf16", 1, {2: 5.0})
    (d / "metrics.jsonl").write_text("".join((d / "metrics.jsonl").read_text().splitlines(True)[:3]))
    with pytest.raises(cr.CompareError, match="stopped at step 3 of train.steps=6"):
        cr.load_sweep(root3)


def test_a_diverged_reference_seed_drops_its_pair_and_is_named(tmp_path):
    root = tmp_path / "sw"
    for s in REF:
        write_run(
            root,
            "bf16",
            s,
            {2: 5.0, 4: REF[s] + 1.0, 6: NAN if s == 2 else REF[s]},
            losses={6: NAN} if s == 2 else None,
        )
        write_run(root, "fp8_e4m3", s, {2: 5.0, 4: 4.0, 6: REF[s] + GAP[s]})
    rows = {r["mode"]: r for r in cr.summarize(cr.group_modes(cr.load_sweep(root)), "bf16")}
    mean, _, _ = t_interval([GAP[1], GAP[3]])
    assert rows["fp8"]["paired_gap"] == pytest.approx(mean) and rows["fp8"]["reference_diverged_seeds"] == [2]
    assert rows["bf16"]["final_val_loss_mean"] == pytest.approx((REF[1] + REF[3]) / 2)
    table = cr.verdict_table(cr.summarize(cr.group_modes(cr.load_sweep(root)), "bf16"), "bf16")
    assert "bf16 1 diverged: seed 2" in table


def test_verdict_of_pairs_with_non_finite_values():
    ref = {1: 3.0, 2: 3.1, 3: 2.9}
    v = paired_verdict({1: 3.05, 2: math.inf, 3: 2.96}, ref)
    mean, lo, hi = t_interval([0.05, 0.06])
    assert v["n"] == 2 and v["diverged"] == [2] and v["mean"] == pytest.approx(mean)
    assert v["lo"] == pytest.approx(lo) and v["hi"] == pytest.approx(hi)
    v = paired_verdict({1: NAN, 2: NAN, 3: NAN}, ref)
    assert v["n"] == 0 and v["verdict"] == "diverged (all 3 paired seeds)"


def test_seeds_to_resolve_says_when_it_cannot_be_estimated(tmp_path):
    # the sweep tables: one paired seed of a +0.10 gap, and one finished run of a mode
    root = tmp_path / "sw"
    write_run(root, "bf16", 1, {2: 5.0, 4: 4.0, 6: 3.0})
    write_run(root, "bf16", 2, {2: 5.0, 4: 4.0, 6: 3.2})
    write_run(root, "fp8_e4m3", 1, {2: 5.0, 4: 4.0, 6: 3.1})
    rows = cr.summarize(cr.group_modes(cr.load_sweep(root)), "bf16")
    table = cr.verdict_table(rows, "bf16")
    assert "| unknown (one pair) |" in table and "never" not in table
    assert "none (needs >= 2 pairs, has 1)" in table
    assert "3.1000 ± n/a (1 finite run)" in cr.markdown_table(rows, "bf16")
    describe_seeds_needed = verdict.describe_seeds_needed
    one = paired_verdict({1: 3.1}, {1: 3.0})  # one pair, gap +0.10
    assert one["mean"] == pytest.approx(0.1) and describe_seeds_needed(one) == "unknown (one pair)"
    assert describe_seeds_needed(paired_verdict({}, {1: 3.0})) == "unknown (no pairs)"
    zero = paired_verdict({1: 3.1, 2: 2.9}, {1: 3.0, 2: 3.0})  # d = +0.1, -0.1: mean exactly 0
    assert zero["mean"] == 0 and describe_seeds_needed(zero) == "never (gap 0)"
    # a gap far below the spread: past the search limit, not "never"
    tiny = paired_verdict({1: 3.0 + 1e-6 + 0.1, 2: 3.0 + 1e-6 - 0.1}, {1: 3.0, 2: 3.0})
    assert tiny["mean"] != 0 and describe_seeds_needed(tiny) == "more than 100,000"
    # seeds to resolve an ordinary gap: the smallest n with t(0.975, n-1) sd / sqrt(n) < |mean|
    d = [0.10, 0.12, 0.08]
    n = next(k for k in range(2, 100) if stats.t.ppf(0.975, k - 1) * np.std(d, ddof=1) / math.sqrt(k) < np.mean(d))
    assert describe_seeds_needed(
        paired_verdict({i: 3 + x for i, x in enumerate(d)}, {i: 3.0 for i in range(3)})
    ) == str(n)


def test_seed_aggregate_of_the_fidelity_summary():
    """One seed non-finite: no mean over the others; one finite value: no sd (not 0)."""
    from megatron_geo.analysis.geo_report import _with_spread
    from megatron_geo.analysis.summary import aggregate

    agg = aggregate([{"seed": 0, "x": 0.5, "y": 1.0}, {"seed": 1, "x": NAN, "y": 3.0}])
    assert agg["x"] is None and agg["spread"]["x"]["n"] == 1 and agg["spread"]["x"]["sd"] is None
    assert agg["y"] == 2.0 and agg["spread"]["y"]["sd"] == pytest.approx(np.std([1.0, 3.0], ddof=1))
    assert "finite in 1 of 2 seeds" in _with_spread(agg, "x", ".3f")


def test_windowed_rel_l2_of_a_zero_reference_is_undefined():
    import torch

    from megatron_geo.analysis.window import windowed_rel_l2

    zero = [[torch.zeros(2, 16), torch.zeros(2, 16)]]
    out = windowed_rel_l2([(zero, None)], "fp8_e4m3:tensor")
    assert all(math.isnan(v) for v in out.values())
