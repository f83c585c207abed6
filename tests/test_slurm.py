"""The project's real sbatch script on a real (single-machine, two virtual nodes) Slurm cluster.

One job, CPU mode (tiny config, gloo, 2 nodes x 1 task): once it trains, the test preempts it for real
(SIGUSR1 to the training tasks, what ``--signal=USR1@300`` does before the time limit); the trainer saves a
checkpoint and exits with 4, the script requeues the job, the requeued start resumes from the checkpoint
and finishes, and the test checks the job's exit code, the log lines (stop, requeue, resume, rendezvous on
the first node, ETA line, summary) and that metrics.jsonl holds every step exactly once.

Skipped, with the reason, where Slurm is not installed (``.ci/run`` installs it) or the test is not root.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, missing_reason

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"


@pytest.fixture(scope="module")
def cluster():
    reason = missing_reason()
    if reason:
        print(f"SKIP test_slurm: {reason}")
        pytest.skip(reason)
    c = SlurmCluster(nodes=2, cpus=1)
    with c:
        yield c
    c.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release_requeued(c: SlurmCluster, job: str, deadline: float) -> bool:
    """Slurm holds a requeued job for ~2 min (BeginTime = now + 121 s); make it eligible now.

    Waits until the first start has fully ended on every node (a release while the old batch step is still
    completing makes Slurm kill the new start: "Job credential revoked"). Returns True once the job was seen
    requeued (Restarts >= 1) and released."""
    while time.monotonic() < deadline:
        r = c._run(["scontrol", "show", "job", job])
        info = r.stdout
        if "Restarts=" in info and not re.search(r"Restarts=0\b", info) and "JobState=PENDING" in info:
            states = c._run(["sinfo", "-h", "-N", "-o", "%T"]).stdout.split()
            if states and all(st == "idle" for st in states):
                time.sleep(1.0)
                c._run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
                return True
        elif "JobState=COMPLETED" in info or "JobState=FAILED" in info or r.returncode:
            return False
        time.sleep(0.3)
    return False


def _signal_training_processes(run_dir: str, sig: int) -> int:
    """Send ``sig`` to this job's training processes (what Slurm's --signal does to the tasks)."""
    n = 0
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmd.read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            len(argv) > 1
            and b"python" in Path(argv[0].decode()).name.encode()
            and argv[1].endswith(b"pretrain_llama.py")
            and f"train.run_dir={run_dir}".encode() in argv
            and b"--print-config" not in argv
        ):  # the ranks themselves, not srun (which forwards signals)
            os.kill(int(cmd.parent.name), sig)
            n += 1
    return n


def test_sbatch_preempted_by_signal_requeues_and_resumes_on_two_nodes(cluster, tmp_path):
    c = cluster
    t0 = time.monotonic()
    run_dir, out_dir = tmp_path / "run", tmp_path / "logs"
    out_dir.mkdir()
    steps = 30
    args = [
        "-N",
        "2",
        "--ntasks-per-node",
        "1",
        f"--output={out_dir}/%x-%j.out",
        "--job-name=mgtest",
        str(SBATCH),
        "--config",
        "configs/tiny.yaml",
        f"train.steps={steps}",
        "train.device=cpu",
        "parallel.backend=gloo",
        "train.eval_batches=1",
        "train.progress=false",
        f"train.run_dir={run_dir}",
        "logging.wandb=disabled",
    ]
    env = c.env({"MASTER_PORT": str(_free_port()), "MG_ETA_INTERVAL": "1", "OMP_NUM_THREADS": "1"})
    # no `sbatch --wait`: on this Slurm version it may return (exit 1) at the requeue instead of waiting for
    # the requeued start, so the test follows the job through its log instead
    sub = subprocess.run(["sbatch", "--parsable", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, f"sbatch failed: {sub.stdout}{sub.stderr}\n{c.logs()}"
    job = sub.stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 150

    def log_text() -> str:
        logs = sorted(out_dir.glob("mgtest-*.out"))
        return logs[0].read_text() if logs else ""

    # a real preemption: once training runs, SIGUSR1 to the job's tasks (what --signal=USR1@300 does)
    while time.monotonic() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert "training step exited" not in log_text(), "the job ended before it could be signalled\n" + log_text()
        time.sleep(0.1)
    assert _signal_training_processes(str(run_dir), signal.SIGUSR1) == 2
    released = _release_requeued(c, job, deadline)
    done = ("training finished", "failed with exit code", "not requeueing", "config check failed")
    while time.monotonic() < deadline and not any(d in log_text() for d in done):
        time.sleep(0.5)
    text = log_text()
    where = f"\njob log:\n{text}\n{c.logs()}"
    assert released, "the job was not requeued after its training step exited with 4" + where
    assert len(list(out_dir.glob("mgtest-*.out"))) == 1, "expected one log file per job"

    # first start: SIGUSR1 -> checkpoint -> exit 4 -> requeue; second start: resumes and finishes, both nodes
    assert "stopped by signal" in text and "training step exited with code 4" in text, where
    assert f"requeueing job {job} (restart 1" in text, where
    saved = int(re.search(r"stopped by signal \d+ after step (\d+)", text).group(1))
    assert "start 2:" in text and "2 nodes, 2 tasks" in text, where
    assert (
        f"resuming this run from its own checkpoint {run_dir}/checkpoints/step_{saved:08d}, at step {saved}" in text
    ), where
    first_node = c.node_names[0]
    assert f"waiting for 2 processes (slurm launch) at {first_node}:" in text, where
    assert "parallel: world=2 TP=1 DP=2 backend=gloo device=cpu" in text, where
    assert f"summary: {steps} steps" in text and "training finished" in text, where
    assert re.search(rf"\[eta\] final: step {steps}/{steps} \(100\.0%\)", text), where

    recs = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))  # nothing lost or repeated across the requeue
    assert all(r["consumed_samples"] == 16 * r["step"] for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"] and "val_loss" in recs[-1]
    print(
        f"slurm job {job}: SIGUSR1 at step {saved}, requeue, resume, {steps} steps on 2 virtual nodes in "
        f"{time.monotonic() - t0:.1f} s"
    )
