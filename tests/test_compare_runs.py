"""tools/compare_runs.py on synthetic sweeps whose statistics are computed by hand here."""

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_runs", REPO / "tools" / "compare_runs.py")
cr = importlib.util.module_from_spec(_spec)
sys.modules["compare_runs"] = cr
_spec.loader.exec_module(cr)

# final validation losses per (mode, seed); bf16: mean 4.1, sample std 0.1; fp8: mean 4.3, std 0.1
FINAL_VAL = {"bf16": {1: 4.0, 2: 4.2, 3: 4.1}, "fp8": {1: 4.3, 2: 4.4, 3: 4.2}}
BYTES = {"bf16": [2000, 2000, 2000, 2000], "fp8": [1000, 1000, 1000, 1400]}  # means 2000 and 1100
TOKS = {"bf16": [1.0, 100.0, 200.0, 300.0], "fp8": [5.0, 50.0, 50.0, 50.0]}  # first step left out: 200, 50


def _write_run(d: Path, mode: str, seed: int, n_steps: int = 4, extra_val_shift: float = 0.0):
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"train:\n  seed: {seed}\n  steps: {n_steps}\ncomm:\n  dtype: {mode}\n")
    with open(d / "metrics.jsonl", "w") as f:
        for i in range(n_steps):
            rec = {
                "step": i + 1,
                "loss": 8.0 - i - (seed / 10),
                "comm_bytes": BYTES[mode][i],
                "tokens_per_sec": TOKS[mode][i],
                "skipped": False,
            }
            if i + 1 == 2:
                rec["val_loss"] = 6.0 + seed  # an earlier evaluation: must not count as final
            if i + 1 == n_steps:
                rec["val_loss"] = FINAL_VAL[mode][seed] + extra_val_shift
            f.write(json.dumps(rec) + "\n")


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sw"
    for mode in ("bf16", "fp8"):
        for seed in (1, 2, 3):
            _write_run(root / f"{mode}-seed{seed}", mode, seed)
    return root


def test_summary_known_answers(sweep):
    rows = {r["mode"]: r for r in cr.summarize(cr.group_modes(cr.load_sweep(sweep)), "bf16")}
    b, f = rows["bf16"], rows["fp8"]
    assert b["seeds"] == 3 and b["steps"] == 4
    assert b["final_val_loss_mean"] == pytest.approx(4.1) and b["final_val_loss_std"] == pytest.approx(0.1)
    assert f["final_val_loss_mean"] == pytest.approx(4.3) and f["final_val_loss_std"] == pytest.approx(0.1)
    assert f["gap"] == pytest.approx(0.2) and f["gap_sigma"] == pytest.approx(2.0)
    assert f["paired_gap"] == pytest.approx((0.3 + 0.2 + 0.1) / 3)
    assert b["gap"] == pytest.approx(0.0) and b["gap_sigma"] == pytest.approx(0.0)
    assert b["comm_bytes_per_step"] == 2000 and f["comm_bytes_per_step"] == pytest.approx(1100)
    assert f["bytes_rel"] == pytest.approx(0.55) and b["bytes_rel"] == 1.0
    assert b["tokens_per_sec"] == pytest.approx(200.0) and f["tokens_per_sec"] == pytest.approx(50.0)
    # final train loss: last step 8 - 3 - seed/10, mean over seeds 1..3
    assert f["final_train_loss_mean"] == pytest.approx(5.0 - 0.2)


def test_gap_series_is_same_seed_difference(sweep):
    modes = cr.group_modes(cr.load_sweep(sweep))
    steps, gaps = cr.gap_series(modes["fp8"], modes["bf16"], "val_loss")
    assert steps == [2, 4]
    assert [g[0] for g in gaps] == [0.0, 0.0, 0.0]  # the step-2 val loss depends on the seed only
    assert [g[1] for g in gaps] == pytest.approx([0.3, 0.2, 0.1])
    steps, gaps = cr.gap_series(modes["fp8"], modes["bf16"], "loss", smooth=2)
    assert steps == [1, 2, 3, 4] and all(v == pytest.approx(0.0) for g in gaps for v in g)


def test_moving_average():
    assert cr._moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert cr._moving_average([1.0, 3.0], 1) == [1.0, 3.0]


def test_cli_writes_tables_and_plots(sweep, tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compare_runs.py"), str(sweep), "--out", str(out), "--smooth", "2"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["mode"] for r in rows] == ["bf16", "fp8"]
    assert float(rows[1]["gap_sigma"]) == pytest.approx(2.0) and float(rows[1]["bytes_rel"]) == pytest.approx(0.55)
    md = (out / "results.md").read_text()
    assert "| fp8 | 3 | 4.3000 ± 0.1000 | +0.2000 | +2.00 |" in md
    for name in ("loss.png", "gap_to_bf16.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_baseline_gives_nan_columns(tmp_path):
    _write_run(tmp_path / "sw" / "fp8-seed1", "fp8", 1)
    rows = cr.summarize(cr.group_modes(cr.load_sweep(tmp_path / "sw")), "bf16")
    assert math.isnan(rows[0]["gap"]) and math.isnan(rows[0]["bytes_rel"]) and math.isnan(rows[0]["final_val_loss_std"])


def test_bad_inputs(tmp_path, sweep):
    tool = [sys.executable, str(REPO / "tools" / "compare_runs.py")]
    res = subprocess.run(tool + [str(tmp_path / "nope")], capture_output=True, text=True)
    assert res.returncode == 2 and "nope" in res.stderr and "not found" in res.stderr
    # a run that has not written metrics yet: named, with the fix
    (sweep / "geofp8-seed1").mkdir()
    (sweep / "geofp8-seed1" / "config.yaml").write_text("train:\n  seed: 1\n")
    res = subprocess.run(tool + [str(sweep), "--no-plots"], capture_output=True, text=True)
    assert res.returncode == 2 and "geofp8-seed1" in res.stderr and "--skip-incomplete" in res.stderr
    res = subprocess.run(tool + [str(sweep), "--no-plots", "--skip-incomplete"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # a run that stopped before train.steps (still running, or failed)
    (sweep / "geofp8-seed1" / "config.yaml").write_text("train:\n  seed: 1\n  steps: 10\n")
    (sweep / "geofp8-seed1" / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')
    with pytest.raises(cr.CompareError, match="geofp8-seed1' stopped at step 1 of train.steps=10"):
        cr.load_sweep(sweep)
    assert ("geofp8", 1) not in {(r.mode, r.seed) for r in cr.load_sweep(sweep, skip_incomplete=True)}
    # a truncated line: file and line number named
    with open(sweep / "fp8-seed2" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss"\n')
    with pytest.raises(cr.CompareError, match=r"fp8-seed2.metrics\.jsonl:5"):
        cr.load_sweep(sweep, skip_incomplete=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(cr.CompareError, match="no runs"):
        cr.load_sweep(empty)


def test_offline_wandb_run_is_read(tmp_path, sweep):
    """A run folder with only an offline wandb run (written here by wandb itself) counts like metrics.jsonl."""
    pytest.importorskip("wandb")
    run_dir = sweep / "geofp8-seed2"
    run_dir.mkdir()
    script = (
        "import wandb\n"
        f"r = wandb.init(mode='offline', dir={str(run_dir)!r}, project='p', group='sw', name='geofp8-seed2',\n"
        "               config={'train': {'seed': 2}, 'comm': {'dtype': 'fp8_e4m3'}})\n"
        "for s in (1, 2, 3, 4):\n"
        "    rec = {'loss': 9.0 - s, 'comm_bytes': 1000, 'tokens_per_sec': 10.0 * s}\n"
        "    if s == 4:\n"
        "        rec['val_loss'] = 4.25\n"
        "    r.log(rec, step=s)\n"
        "r.finish()\n"
    )
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    runs = {(r.mode, r.seed): r for r in cr.load_sweep(sweep)}
    r = runs["geofp8", 2]
    assert [x["step"] for x in r.records] == [1, 2, 3, 4]
    assert r.final_val_loss == 4.25 and r.final_loss == 5.0 and r.tokens_per_sec == pytest.approx(30.0)
    with pytest.raises(cr.CompareError, match="not a wandb transaction log"):
        cr._wandb_records(b"garbage", Path("x.wandb"))


def test_empty_run_folder_is_reported_not_silently_skipped(sweep, capsys):
    (sweep / "stray-seed9").mkdir()
    runs = cr.load_sweep(sweep)
    assert len(runs) == 6 and "stray-seed9" not in {r.path.name for r in runs}
    err = capsys.readouterr().err
    assert f"warning: ignoring '{sweep / 'stray-seed9'}': no config.yaml, metrics.jsonl" in err
    assert "bf16-seed1" not in err


def test_verdicts_known_answers(sweep, tmp_path):
    """fp8 - bf16 per seed: 0.3, 0.2, 0.1 -> mean 0.2, sd 0.1, t(0.975, 2) = 4.302653 (table):
    interval 0.2 +- 0.24841 straddles 0 -> not distinguishable; seeds to resolve: smallest n with
    t(0.975, n-1) 0.1 / sqrt(n) < 0.2 -> n = 4 (3.182446 * 0.1 / 2 = 0.1591; n = 3: 0.2484)."""
    rows = {r["mode"]: r for r in cr.summarize(cr.group_modes(cr.load_sweep(sweep)), "bf16")}
    f = rows["fp8"]
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert f["ci_lo"] == pytest.approx(0.2 - half, abs=1e-6) and f["ci_hi"] == pytest.approx(0.2 + half, abs=1e-6)
    assert f["verdict"] == "not distinguishable at 3 seeds" and f["seeds_needed"] == 4 and f["ci_method"] == "t"
    assert rows["bf16"]["verdict"] == "reference"
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compare_runs.py"), str(sweep), "--no-plots"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    md = (sweep / "results.md").read_text()
    assert (
        f"| fp8 | 3 | +0.2000 | [{0.2 - half:+.4f}, {0.2 + half:+.4f}] (t) | **not distinguishable at 3 seeds** | 4 |"
        in md
    )


def test_rows_sorted_by_gap_and_modes_grouped_by_comm_label(tmp_path):
    root = tmp_path / "sw"
    for seed in (1, 2, 3):
        _write_run(root / f"bf16-seed{seed}", "bf16", seed)
        _write_run(root / f"a-seed{seed}", "fp8", seed, extra_val_shift=0.5)  # worst
        _write_run(root / f"b-seed{seed}", "fp8", seed, extra_val_shift=-0.6)  # best: d = -0.3, -0.4, -0.5
        # a folder name that is not the mode: its config's comm.label decides
        d = root / f"run{seed}"
        _write_run(d, "fp8", seed)
        (d / "config.yaml").write_text(
            f"train:\n  seed: {seed}\n  steps: 4\ncomm:\n  dtype: fp8_e4m3\n  label: fp8_e4m3+ef\n"
        )
    rows = cr.summarize(cr.group_modes(cr.load_sweep(root)), "bf16")
    assert [r["mode"] for r in rows] == ["bf16", "b", "fp8_e4m3+ef", "a"]
    assert [r["seeds"] for r in rows] == [3, 3, 3, 3]
    assert rows[1]["verdict"] == "better" and rows[3]["verdict"] == "worse"


def test_rel_err_plot_from_telemetry_records(tmp_path):
    root = tmp_path / "sw"
    for seed in (1, 2):
        _write_run(root / f"fp8-seed{seed}", "fp8", seed)
        m = root / f"fp8-seed{seed}" / "metrics.jsonl"
        recs = [json.loads(x) for x in m.read_text().splitlines()]
        recs[1].update(
            {
                "comm/rel_err/bucket0": 0.02,
                "comm/rel_err/bucket1": 0.04,
                "comm/rel_err/geo/l0": 0.01,
                "comm/rel_err/euclid/l0": 0.03,
            }
        )
        m.write_text("".join(json.dumps(r) + "\n" for r in recs))
    runs = cr.group_modes(cr.load_sweep(root))
    assert runs["fp8"][0].mean_series("comm/rel_err/bucket") == ([2], [pytest.approx(0.03)])
    p = cr.plot_rel_err(runs, tmp_path, "t")
    assert p is not None and p.read_bytes()[:4] == b"\x89PNG"
    assert cr.plot_rel_err(cr.group_modes(cr.load_sweep(tmp_path / "sw", False)), tmp_path, "t") is not None


def test_replaced_runs_are_ignored_and_unequal_lengths_are_flagged(sweep, tmp_path):
    old = sweep / ".replaced" / "bf16-seed1-20260101-000000"  # moved aside by run_comparison --force
    _write_run(old, "bf16", 1)
    runs = cr.load_sweep(sweep)
    assert len(runs) == 6 and all(".replaced" not in str(r.path) for r in runs)
    _write_run(sweep / "fp8_long-seed1", "fp8", 1, n_steps=4)
    m = sweep / "fp8_long-seed1" / "metrics.jsonl"
    m.write_text(
        m.read_text()
        + json.dumps({"step": 5, "loss": 1.0, "val_loss": 4.0, "comm_bytes": 1, "tokens_per_sec": 1.0})
        + "\n"
    )
    (sweep / "fp8_long-seed1" / "config.yaml").write_text("train:\n  seed: 1\n  steps: 5\n")
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compare_runs.py"), str(sweep), "--no-plots"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and "different lengths (4, 5 steps)" in res.stderr
    assert "different lengths" in (sweep / "results.md").read_text()
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "compare_runs.py"),
            str(sweep),
            "--out",
            str(sweep / "bf16-seed1" / "config.yaml"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "is a file" in res.stderr


def test_a_one_mode_sweep_has_no_verdict_table(tmp_path):
    root = tmp_path / "sw"
    for seed in (1, 2):
        _write_run(root / f"bf16-seed{seed}", "bf16", seed)
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "compare_runs.py"), str(root), "--no-plots"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and "Verdicts" not in (root / "results.md").read_text()
