"""The launch scripts without a cluster: the 64-node wrappers' sbatch command lines and configs, the
sbatch script's refusal outside a job, launch_local.sh on CPU, and the ETA helper."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_geo.config import load_config
from megatron_geo.training.eta import eta_line, eta_seconds, format_duration, metrics_eta_line, read_metrics
from megatron_geo.training.validate import validate_config

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "comm").glob("*.yaml"))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, env=None, **kw):
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("model", ["llama_300m", "llama_600m"])
def test_paper_wrappers_build_the_64_node_command_for_every_preset(model):
    assert len(PRESETS) >= 11
    for preset in PRESETS:
        r = _run([f"scripts/slurm/{model}.sh", preset, "train.steps=7"], env={"DRY_RUN": "1", "MG_VALIDATE": "0"})
        assert r.returncode == 0, r.stderr
        argv = shlex.split(r.stdout)
        assert argv[0] == "sbatch"
        assert "--nodes=64" in argv and "--ntasks-per-node=1" in argv and "--gpus-per-node=1" in argv
        i = argv.index("scripts/slurm/pretrain.sbatch")
        train_args = argv[i + 1 :]
        assert train_args[:4] == ["--config", f"configs/{model}.yaml", "--config", f"configs/comm/{preset}.yaml"]
        assert f"train.run_dir=runs/{model}_{preset}_n64" in train_args and train_args[-1] == "train.steps=7"
        # the resolved config is valid for 64 processes (global batch 512 = micro 4 x DP 64 x 2)
        cfg = load_config([str(ROOT / train_args[1]), str(ROOT / train_args[3])], train_args[4:])
        validate_config(cfg, 64)
        assert cfg.train.global_batch_size == 512 and cfg.train.steps == 7


def test_wrapper_validates_the_config_before_submitting():
    r = _run(["scripts/slurm/llama_300m.sh", "fp8", "train.stepz=1"], env={"DRY_RUN": "true"})
    assert r.returncode == 2 and "Did you mean 'train.steps'" in r.stderr and not r.stdout
    r = _run(["scripts/slurm/llama_600m.sh", "fp8"], env={"DRY_RUN": "1", "NODES": "3"})
    assert r.returncode == 2 and "not divisible by train.micro_batch_size=4 x data-parallel size 3" in r.stderr
    r = _run(["scripts/slurm/llama_600m.sh", "fp8"], env={"DRY_RUN": "maybe"})
    assert r.returncode == 2 and "DRY_RUN=maybe" in r.stderr


def test_wrapper_rejects_bad_preset_and_nodes():
    r = _run(["scripts/slurm/llama_600m.sh", "fp9"], env={"DRY_RUN": "1"})
    assert r.returncode == 2 and "comm preset 'fp9' not found" in r.stderr and "geofp8" in r.stderr
    r = _run(["scripts/slurm/llama_300m.sh", "bf16"], env={"DRY_RUN": "1", "NODES": "sixty"})
    assert r.returncode == 2 and "NODES=sixty" in r.stderr
    r = _run(
        ["scripts/slurm/llama_300m.sh", "bf16"],
        env={
            "DRY_RUN": "1",
            "NODES": "8",
            "GPUS_PER_NODE": "0",
            "PARTITION": "gh",
            "TIME": "02:00:00",
            "MG_VALIDATE": "0",
        },
    )
    argv = shlex.split(r.stdout)
    assert "--nodes=8" in argv and "--partition=gh" in argv and "--time=02:00:00" in argv
    assert not any(a.startswith("--gpus-per-node") for a in argv)
    assert "train.run_dir=runs/llama_300m_bf16_n8" in argv


def test_sbatch_script_outside_a_job_says_how_to_run_it():
    r = _run(["bash", "scripts/slurm/pretrain.sbatch", "--config", "configs/tiny.yaml"])
    assert r.returncode == 2 and "submit it with sbatch" in r.stderr


def test_sbatch_script_declares_preemption_and_per_job_logs():
    text = (ROOT / "scripts" / "slurm" / "pretrain.sbatch").read_text()
    directives = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert any(d.startswith("--signal=USR1@") for d in directives)
    assert any(d.startswith("--output=") and "%j" in d for d in directives)
    assert "scontrol requeue" in text and "NCCL_IB_HCA" in text


def _sbatch_with_fake_srun(tmp_path, extra_env):
    """pretrain.sbatch as a job's batch shell would run it, with an ``srun`` on PATH that records its arguments
    and the environment the tasks would get (the container mode skips the pre-flight's Python)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "srun.txt"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(
        '#!/bin/bash\n{ printf \'arg %s\\n\' "$@"; echo "env OMP_NUM_THREADS=${OMP_NUM_THREADS:-}"; '
        'echo "env SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-}"; } > ' + shlex.quote(str(record)) + "\nexit 0\n"
    )
    srun.chmod(0o755)
    env = {k: v for k, v in ENV.items() if k not in ("OMP_NUM_THREADS", "SRUN_CPUS_PER_TASK")}
    env.update(
        {
            "PATH": f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}",
            "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "n1",
            "SLURM_NTASKS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MG_ETA_INTERVAL": "0",
            "MG_CONTAINER_IMAGE": "image.sqsh",
            **extra_env,
        }
    )
    r = subprocess.run(
        ["bash", "scripts/slurm/pretrain.sbatch", "--config", "configs/tiny.yaml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = record.read_text().splitlines() if record.exists() else []
    args = [ln[4:] for ln in lines if ln.startswith("arg ")]
    task_env = dict(ln[4:].split("=", 1) for ln in lines if ln.startswith("env "))
    return r, args, task_env


@pytest.mark.parametrize("cpus,omp,want_omp", [("72", None, "72"), ("16", "4", "4"), (None, None, "1")])
def test_sbatch_gives_srun_tasks_the_jobs_cpus_per_task(tmp_path, cpus, omp, want_omp):
    """srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): the script passes it on, and each task's
    OMP_NUM_THREADS matches it (unless set on purpose); without one, Slurm's default and one thread."""
    extra = {**({"SLURM_CPUS_PER_TASK": cpus} if cpus else {}), **({"OMP_NUM_THREADS": omp} if omp else {})}
    r, args, task_env = _sbatch_with_fake_srun(tmp_path, extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert args and "pretrain_llama.py" in args
    cpu_flags = [a for a in args[: args.index("pretrain_llama.py")] if a.startswith("--cpus-per-task")]
    assert cpu_flags == ([f"--cpus-per-task={cpus}"] if cpus else [])
    assert task_env["OMP_NUM_THREADS"] == want_omp
    assert task_env["SRUN_CPUS_PER_TASK"] == (cpus or "")
    assert f"OMP_NUM_THREADS={want_omp}" in r.stdout


def test_sbatch_rejects_a_bad_cpus_per_task(tmp_path):
    r, args, _ = _sbatch_with_fake_srun(tmp_path, {"SLURM_CPUS_PER_TASK": "lots"})
    assert r.returncode == 2 and "'lots'" in r.stderr and "--cpus-per-task" in r.stderr and not args


def test_launch_local_trains_two_cpu_processes(tmp_path):
    r = _run(
        [
            "scripts/launch_local.sh",
            "--config",
            "configs/tiny.yaml",
            "train.steps=2",
            "train.device=cpu",
            "train.eval_batches=0",
            "train.progress=false",
            "logging.wandb=disabled",
            f"train.run_dir={tmp_path}",
            "model.num_layers=1",
        ],
        env={"NPROC": "2", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[launch_local] 2 process(es)" in r.stdout
    assert "parallel: world=2 TP=1 DP=2" in r.stdout
    recs = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [x["step"] for x in recs] == [1, 2]


def test_launch_local_rejects_bad_nproc():
    r = _run(["scripts/launch_local.sh", "--config", "configs/tiny.yaml"], env={"NPROC": "two"})
    assert r.returncode == 2 and "NPROC=two" in r.stderr


# -- ETA ---------------------------------------------------------------------------------------------------------


def test_format_duration_and_eta_seconds():
    assert format_duration(5) == "5s"
    assert format_duration(185) == "3m05s"
    assert format_duration(2 * 3600 + 3 * 60 + 29) == "2h03m"
    assert format_duration(86400 + 2 * 3600 + 3 * 60) == "1d02h03m"
    assert format_duration(float("nan")) == "?"
    assert eta_seconds(100, 1100, 1.5) == 1500.0
    assert eta_seconds(1100, 1100, 1.5) == 0.0
    with pytest.raises(ValueError, match="step=1200"):
        eta_seconds(1200, 1100, 1.0)
    with pytest.raises(ValueError, match="total_steps=0"):
        eta_seconds(0, 0, 1.0)
    with pytest.raises(ValueError, match="seconds_per_step=-1"):
        eta_seconds(1, 10, -1.0)


def test_eta_line_values():
    import time as _t

    now = _t.mktime((2025, 5, 1, 12, 0, 0, 0, 0, -1))
    line = eta_line(120, 20000, [1.0, 1.5], 512 * 4096, now=now)
    # mean 1.25 s/step, 19880 steps left -> 24850 s = 6h54m10s; 2,097,152 tokens / 1.25 s
    assert line == ("step 120/20000 (0.6%) | 1.250 s/step | 1,677,722 tok/s | ETA 6h54m (finish 2025-05-01 18:54)")
    with pytest.raises(ValueError, match="recent_step_times is empty"):
        eta_line(1, 2, [], 10)


def test_metrics_eta_line_skips_first_step_and_partial_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    recs = [
        {"step": 1, "step_time_s": 9.0, "tokens_per_sec": 100.0},
        {"step": 2, "step_time_s": 2.0, "tokens_per_sec": 1000.0},
        {"step": 3, "step_time_s": 2.0, "tokens_per_sec": 1000.0},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "step_ti')
    got = read_metrics(str(p))
    assert [r["step"] for r in got] == [1, 2, 3]
    line = metrics_eta_line(got, 10, now=0)
    assert line.startswith("step 3/10 (30.0%) | 2.000 s/step | 1,000 tok/s | ETA 14s")
    assert metrics_eta_line([], 10) is None
    (tmp_path / "config.yaml").write_text("train:\n  steps: 10\n")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "megatron_geo/training/eta.py"),
            "--run-dir",
            str(tmp_path),
            "--once",
            "--prefix",
            "[eta]",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.startswith("[eta] step 3/10 (30.0%) | 2.000 s/step"), r.stdout + r.stderr
