"""A rendezvous that cannot complete ends within MG_RENDEZVOUS_TIMEOUT with one line naming what was seen and
the fix (exit code 2), never a traceback after parallel.timeout_minutes."""

import datetime
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dist_harness import free_port
from megatron_geo.parallel.launch_env import LaunchEnv, LaunchError, detect_launch_env

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_VARS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "MG_RENDEZVOUS_TIMEOUT",
]
COLLECTIVES = datetime.timedelta(minutes=30)  # parallel.timeout_minutes' default: never what a failure waits for


@pytest.fixture
def launch(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _rendezvous(env: LaunchEnv) -> tuple[str, float]:
    """(message of the LaunchError, seconds it took) of a rendezvous that must fail."""
    from megatron_geo.parallel.context import rendezvous_store

    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        rendezvous_store(env, COLLECTIVES)
    return str(err.value), time.monotonic() - t0


def test_slurm_variables_without_srun_exit_2_with_the_srun_hint(tmp_path):
    """The sbatch body (or an salloc shell) running python directly: one process that Slurm's variables call
    rank 0 of 2. It must stop after MG_RENDEZVOUS_TIMEOUT (2 s here), not parallel.timeout_minutes."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        MG_RENDEZVOUS_TIMEOUT="2",
        WANDB_MODE="disabled",
    )
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_llama.py"),
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "logging.wandb=disabled",
            "train.progress=false",
            "train.eval_batches=0",
            f"train.run_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    elapsed = time.monotonic() - t0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    line = lines[0]
    for part in (
        f"127.0.0.1:{port}",
        "only 1 of 2 processes joined within 2 s",
        "SLURM_PROCID=0",
        "SLURM_NTASKS=2",
        "launch with srun (one task per GPU)",
        "MG_RENDEZVOUS_TIMEOUT",
    ):
        assert part in line, (part, line)
    assert "Traceback" not in r.stderr and elapsed < 120  # interpreter start-up + 2 s, far from 30 minutes


def test_torchrun_style_variables_without_peers(launch):
    launch.setenv("RANK", "0")
    launch.setenv("WORLD_SIZE", "2")
    port = free_port()
    msg, took = _rendezvous(LaunchEnv(0, 2, 0, "127.0.0.1", port, "torchrun", 1.0))
    assert "only 1 of 2 processes joined within 1 s" in msg and f"127.0.0.1:{port}" in msg
    assert "RANK=0" in msg and "WORLD_SIZE=2" in msg and "torchrun" in msg and "\n" not in msg
    assert 1.0 < took < 15  # 1 s, and 3 s more while rank 0 hosts the store


def test_other_ranks_give_up_when_rank_0_never_starts(launch):
    """Rank 1 alone (rank 0 never started, or MASTER_ADDR/MASTER_PORT point where nothing listens)."""
    launch.setenv("SLURM_PROCID", "1")
    launch.setenv("SLURM_NTASKS", "4")
    port = free_port()
    msg, took = _rendezvous(LaunchEnv(1, 4, 0, "127.0.0.1", port, "slurm", 1.5))
    assert f"no answer from rank 0's store at 127.0.0.1:{port} within 1.5 s" in msg
    assert "Connection refused" in msg and "SLURM_PROCID=1" in msg and "srun" in msg
    assert took < 15


def test_wrong_master_addr(launch):
    launch.setenv("MASTER_ADDR", "no-such-host.invalid")
    msg, took = _rendezvous(LaunchEnv(1, 2, 0, "no-such-host.invalid", free_port(), "torchrun", 1.0))
    assert "no-such-host.invalid" in msg and "MASTER_ADDR=no-such-host.invalid" in msg and took < 15


def test_master_port_in_use(launch):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        msg, took = _rendezvous(LaunchEnv(0, 2, 0, "127.0.0.1", port, "slurm", 30.0))
    assert f"MASTER_PORT={port} is already in use" in msg and "free port" in msg
    assert took < 10  # immediate, not after the rendezvous timeout


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e999"])
def test_bad_rendezvous_timeout_is_a_launch_error(launch, value):
    launch.setenv("RANK", "0")
    launch.setenv("WORLD_SIZE", "2")
    launch.setenv("MG_RENDEZVOUS_TIMEOUT", value)
    with pytest.raises(LaunchError, match=rf"MG_RENDEZVOUS_TIMEOUT='{value}' is not a positive number of seconds"):
        detect_launch_env()


def test_rendezvous_timeout_setting(launch):
    launch.setenv("MG_RENDEZVOUS_TIMEOUT", "abc")
    assert detect_launch_env().launcher == "single"  # one process: nothing to wait for, not read
    launch.setenv("RANK", "0")
    launch.setenv("WORLD_SIZE", "2")
    launch.setenv("MG_RENDEZVOUS_TIMEOUT", "2.5")
    assert detect_launch_env().rendezvous_timeout_s == 2.5
    launch.delenv("MG_RENDEZVOUS_TIMEOUT")
    assert detect_launch_env().rendezvous_timeout_s == 60.0


def _meet(ranks_and_delays, world: int, port: int, timeout_s: float) -> dict:
    """Run ``rendezvous_store`` for each ``(rank, delay)`` in its own thread (the store is thread-safe); per rank
    the store or the LaunchError's message."""
    from megatron_geo.parallel.context import rendezvous_store

    out = {}

    def one(rank, delay):
        time.sleep(delay)
        try:
            out[rank] = rendezvous_store(LaunchEnv(rank, world, 0, "127.0.0.1", port, "slurm", timeout_s), COLLECTIVES)
        except LaunchError as e:
            out[rank] = str(e)

    threads = [threading.Thread(target=one, args=rd) for rd in ranks_and_delays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_processes_that_start_apart_still_meet(launch):
    """Three processes starting 0.7 s apart meet within the rendezvous timeout and share the store."""
    out = _meet([(r, 0.7 * r) for r in range(3)], 3, free_port(), 10.0)
    assert sorted(out) == [0, 1, 2] and not any(isinstance(v, str) for v in out.values()), out
    out[2].set("from_rank_2", "hello")
    assert out[0].get("from_rank_2") == b"hello" == out[1].get("from_rank_2")


def test_every_process_that_came_says_how_many_did(launch):
    """Two of three processes start: both stop with the same count (rank 0 keeps its store until the other read it)."""
    port = free_port()
    out = _meet([(0, 0.0), (1, 0.3)], 3, port, 1.5)
    for rank in (0, 1):
        assert out[rank].startswith(
            f"rank {rank}: the rendezvous of 3 processes at 127.0.0.1:{port} failed: only 2 "
            f"of 3 processes joined within 1.5 s"
        ), out[rank]
