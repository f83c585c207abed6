"""The project's real sbatch script on a real (single-machine, two virtual nodes) Slurm cluster.

One job, CPU mode (tiny config, gloo, 2 nodes x 1 task): its first start plays a preemption (the
training step exits with code 4, as the trainer does after writing its checkpoint on SIGTERM/SIGUSR1),
so the script must requeue the job; the requeued start trains for real, and the test checks the job's
exit code, the log lines (requeue, rendezvous on the first node, ETA line, summary) and metrics.jsonl.

Skipped, with the reason, where Slurm is not installed (``.ci/run`` installs it) or the test is not root.
"""

from __future__ import annotations

import json
import os
import re
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

    Returns True once the job was seen requeued (Restarts >= 1) and released."""
    while time.monotonic() < deadline:
        r = c._run(["scontrol", "show", "job", job])
        info = r.stdout
        if "Restarts=" in info and not re.search(r"Restarts=0\b", info) and "JobState=PENDING" in info:
            c._run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            return True
        if "JobState=COMPLETED" in info or "JobState=FAILED" in info or r.returncode:
            return False
        time.sleep(0.3)
    return False


def test_sbatch_requeue_then_train_on_two_nodes(cluster, tmp_path):
    c = cluster
    t0 = time.monotonic()
    run_dir, out_dir = tmp_path / "run", tmp_path / "logs"
    out_dir.mkdir()
    # First start: the training step exits 4 (checkpoint written after a stop signal); later starts: real.
    stub = tmp_path / "python_stub.sh"
    real = ROOT / ".venv" / "bin" / "python"
    real = real if real.exists() else Path(os.environ.get("PYTHON", "python3"))
    stub.write_text(
        "#!/bin/bash\n"
        'if [[ "$1" == pretrain_llama.py && " $* " != *" --print-config "* && "${SLURM_RESTART_COUNT:-0}" == 0 ]]; '
        'then echo "stub: rank ${SLURM_PROCID} simulates a preemption checkpoint"; exit 4; fi\n'
        f'exec {real} "$@"\n')
    stub.chmod(0o755)
    args = ["-N", "2", "--ntasks-per-node", "1", f"--output={out_dir}/%x-%j.out", "--job-name=mgtest", str(SBATCH),
            "--config", "configs/tiny.yaml", "train.steps=3", "train.device=cpu", "parallel.backend=gloo",
            "train.eval_batches=1", "train.progress=false", f"train.run_dir={run_dir}", "logging.wandb=disabled"]
    env = c.env({"MASTER_PORT": str(_free_port()), "MG_PYTHON": str(stub), "MG_ETA_INTERVAL": "1",
                 "OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen(["sbatch", "--wait", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        job = None
        while job is None and time.monotonic() < deadline:
            q = c._run(["squeue", "-h", "-n", "mgtest", "-o", "%i"]).stdout.split()
            job = q[0] if q else None
            if job is None:
                time.sleep(0.2)
        assert job, f"the job never appeared in squeue\n{c.logs()}"
        released = _release_requeued(c, job, deadline)
        out, err = proc.communicate(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = sorted(out_dir.glob("mgtest-*.out"))
    text = logs[0].read_text() if logs else ""
    where = f"\nsbatch stdout/stderr: {out}{err}\njob log:\n{text}\n{c.logs()}"
    assert released, "the job was not requeued after its training step exited with 4" + where
    assert proc.returncode == 0, f"sbatch --wait exited with {proc.returncode}" + where
    assert len(logs) == 1, f"expected one log file per job, got {logs}"

    # first start: exit 4 -> requeue; second start (SLURM_RESTART_COUNT=1): real training, both nodes
    assert "training step exited with code 4" in text and f"requeueing job {job} (restart 1" in text, where
    assert text.count("stub: rank") == 2, where
    assert "start 2:" in text and "2 nodes, 2 tasks" in text, where
    first_node = c.node_names[0]
    assert f"rendezvous {first_node}:" in text, where
    assert f"waiting for 2 processes (slurm launch) at {first_node}:" in text, where
    assert "parallel: world=2 TP=1 DP=2 backend=gloo device=cpu" in text, where
    assert "summary: 3 steps" in text and "training finished" in text, where
    assert re.search(r"\[eta\] final: step 3/3 \(100\.0%\) \| [0-9.]+ s/step \| [0-9,]+ tok/s \| ETA 0s", text), where

    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["consumed_samples"] == 16 * r["step"] for r in recs)
    assert all(7.0 < r["loss"] < 8.5 for r in recs), recs  # ln(2048) = 7.62 at init on the tiny vocab
    assert "val_loss" in recs[-1] and recs[-1]["val_loss"] > 0
    assert all(r["comm_bytes"] > 0 for r in recs)
    print(f"slurm job {job}: requeue + 3 training steps on 2 virtual nodes in {time.monotonic() - t0:.1f} s")
