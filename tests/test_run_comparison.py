"""tools/run_comparison.py: the run plan (folders, seeds, wandb group, overrides), the sbatch submission
through a stand-in sbatch, skip-finished, and bad arguments."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL = [sys.executable, str(REPO / "tools" / "run_comparison.py")]


def test_dry_run_plan(tmp_path):
    res = subprocess.run(
        TOOL
        + [
            "--dry-run",
            "--presets",
            "bf16",
            "geofp8",
            "--seeds",
            "2",
            "--sweep-dir",
            str(tmp_path / "sw"),
            "--nproc",
            "4",
            "train.steps=7",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 4
    # seed-major order; every run: its folder, seed, the sweep's wandb group, then the extra overrides
    for line, (preset, seed) in zip(lines, [("bf16", 1), ("geofp8", 1), ("bf16", 2), ("geofp8", 2)]):
        assert "--nproc-per-node 4" in line and "--config configs/tiny.yaml" in line
        assert f"--config configs/comm/{preset}.yaml" in line
        assert f"train.run_dir={tmp_path / 'sw'}/{preset}-seed{seed} train.seed={seed}" in line
        assert "logging.wandb_group=sw" in line and f"logging.wandb_name={preset}-seed{seed}" in line
        assert line.endswith("train.steps=7")


def test_slurm_submission_uses_sbatch_with_the_same_args(tmp_path):
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls.txt"}\necho Submitted batch job 42\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    res = subprocess.run(
        TOOL
        + [
            "--slurm",
            "--sbatch-arg=--nodes=64",
            "--presets",
            "fp8",
            "--seed-list",
            "5",
            "--sweep-dir",
            str(tmp_path / "sw"),
            "train.steps=9",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    call = (tmp_path / "calls.txt").read_text().split()
    script = call.index(str(REPO / "scripts" / "slurm" / "pretrain.sbatch"))
    assert call[:script] == ["--job-name=fp8-seed5", "--nodes=64"]
    assert call[script + 1 :] == [
        "--config",
        os.path.relpath(REPO / "configs" / "tiny.yaml", tmp_path),
        "--config",
        os.path.relpath(REPO / "configs" / "comm" / "fp8.yaml", tmp_path),
        f"train.run_dir={tmp_path / 'sw'}/fp8-seed5",
        "train.seed=5",
        "logging.wandb_group=sw",
        "logging.wandb_name=fp8-seed5",
        "train.steps=9",
    ]
    assert "Submitted batch job 42" in res.stdout
    manifest = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert manifest["presets"] == ["fp8"] and manifest["seeds"] == [5] and manifest["launcher"] == "slurm"


def test_skip_finished_is_resume(tmp_path):
    d = tmp_path / "sw" / "bf16-seed1"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("train:\n  steps: 2\n")
    (d / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    res = subprocess.run(
        TOOL + ["--skip-finished", "--presets", "bf16", "--seeds", "1", "--sweep-dir", str(tmp_path / "sw")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 0 and "ok (already complete with the same arguments" in res.stdout


def _fake_sbatch(tmp_path):
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls.txt"}\necho Submitted batch job 7\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}


def test_rerun_into_a_sweep_refuses_other_arguments_unless_forced(tmp_path):
    env = _fake_sbatch(tmp_path)
    sw = tmp_path / "sw"
    base = TOOL + ["--slurm", "--presets", "fp8", "--seeds", "1", "--sweep-dir", str(sw)]
    res = subprocess.run(base + ["train.steps=9"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    run = sw / "fp8-seed1"
    assert json.loads((run / "sweep_args.json").read_text())["config_args"][-1] == "train.steps=9"
    manifest = (sw / "sweep.json").read_text()
    # finished with the same arguments: reported, not submitted again
    (run / "config.yaml").write_text("train:\n  steps: 9\n")
    (run / "metrics.jsonl").write_text('{"step": 9}\n')
    res = subprocess.run(base + ["train.steps=9"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0 and "ok (already complete with the same arguments" in res.stdout
    assert (tmp_path / "calls.txt").read_text().count("--job-name") == 1
    # the same folder named by a relative path is the same run
    res = subprocess.run(
        TOOL + ["--slurm", "--presets", "fp8", "--seeds", "1", "--sweep-dir", "sw", "train.steps=9"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0 and "already complete" in res.stdout, res.stderr
    # the same settings spelled in another order are the same run
    res = subprocess.run(
        base + ["train.log_interval=1", "train.steps=9"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert res.returncode == 0 and "already complete" in res.stdout, res.stderr
    manifest = (sw / "sweep.json").read_text()
    # other overrides into the same folder: an error naming the key and both values, nothing written
    res = subprocess.run(base + ["train.steps=20"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 2 and "train.steps: 9 -> 20" in res.stderr
    assert "--force" in res.stderr and (sw / "sweep.json").read_text() == manifest
    # --force: new runs; the old folder is moved aside, not deleted
    res = subprocess.run(base + ["--force", "train.steps=20"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    moved = list((sw / ".replaced").iterdir())
    assert len(moved) == 1 and (moved[0] / "metrics.jsonl").read_text() == '{"step": 9}\n'
    assert json.loads((run / "sweep_args.json").read_text())["config_args"][-1] == "train.steps=20"
    # a folder without a record needs --resume (or --force)
    (run / "sweep_args.json").unlink()
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    res = subprocess.run(base + ["train.steps=20"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 2 and "--resume" in res.stderr
    res = subprocess.run(base + ["--resume", "train.steps=20"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr


def test_configs_are_checked_before_anything_runs(tmp_path):
    sw = tmp_path / "sw"
    res = subprocess.run(
        TOOL + ["--presets", "bf16", "fp8", "--seeds", "1", "--sweep-dir", str(sw), "train.stepz=2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 2 and "run bf16-seed1" in res.stderr and "train.stepz" in res.stderr
    assert not sw.exists(), "nothing was created or launched"
    res = subprocess.run(
        TOOL
        + [
            "--dry-run",
            "--config",
            "configs/tiny.yaml",
            "--config",
            "configs/comm/fp8.yaml",
            "--presets",
            "bf16",
            "--seeds",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 2 and "both comm presets" in res.stderr
    res = subprocess.run(TOOL + ["--dry-run", "--presets", "bf16", "bf16"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "names bf16 twice" in res.stderr
    bad = [
        (["--presets", "fp8", "fp8_ef", "comm.error_feedback=true"], "resolve to the same comm settings"),
        (["--presets", "bf16", "train.run_dir =/tmp/elsewhere"], "train.run_dir is set per run"),
        (["--presets", "bf16", " train.seed=4"], "train.seed is set per run"),
        (["--presets", "bf16", "--seed-list", "-3"], "distinct integer >= 0"),
        (["--presets", "bf16", "--seed-list", "1", "1"], "distinct integer >= 0"),
        (["--presets", ","], "no presets"),
        (["--presets", "configs/tiny.yaml"], "not in a 'comm' folder"),
    ]
    for args, msg in bad:
        res = subprocess.run(
            TOOL + ["--dry-run", "--sweep-dir", str(tmp_path / "d"), *args], capture_output=True, text=True, cwd=REPO
        )
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)


def test_bad_arguments(tmp_path):
    res = subprocess.run(TOOL + ["--dry-run", "--presets", "fp9"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "unknown comm preset 'fp9'" in res.stderr and "fp8_ef" in res.stderr
    res = subprocess.run(TOOL + ["--dry-run", "--config", "nope.yaml"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "'nope.yaml' not found" in res.stderr
    res = subprocess.run(TOOL + ["--dry-run", "train.seed=3"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2 and "train.seed is set per run" in res.stderr


def test_ctrl_c_during_a_sweep_is_one_line_and_exit_130(tmp_path):
    import signal
    import time

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nsleep 600\n")  # outlives a slow start-up on a loaded machine
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    p = subprocess.Popen(
        TOOL + ["--slurm", "--presets", "fp8", "--seeds", "1", "--sweep-dir", str(tmp_path / "sw")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background (`make test &`, nohup) passes SIGINT on ignored, and Python then keeps
        # it ignored: give the tool the default disposition a terminal's Ctrl-C meets
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "sw" / "fp8-seed1" / "sweep_args.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (tmp_path / "sw" / "fp8-seed1" / "sweep_args.json").exists(), "the sweep never reached its first submit"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted; run the same command again" in err and "Traceback" not in err


def test_a_sweep_of_presets_shares_an_override_that_one_preset_switches_off(tmp_path):
    """geo.refresh_interval=10 means nothing to bf16 and fp8: they run, and say so; a voided key that would change
    what is trained (a data file with the embedded corpus) still refuses the sweep."""
    sw = tmp_path / "sw"
    common = ["--presets", "bf16", "fp8", "geofp8", "--seeds", "1", "--sweep-dir", str(sw)]
    res = subprocess.run(
        TOOL + ["--dry-run", *common, "geo.refresh_interval=10"], capture_output=True, text=True, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.endswith("geo.refresh_interval=10") for line in lines)
    res = subprocess.run(
        TOOL + ["--dry-run", *common, "data.train_prefix=data/train"], capture_output=True, text=True, cwd=REPO
    )
    assert res.returncode == 2 and "has no effect with data.source=shakespeare" in res.stderr, res.stderr
