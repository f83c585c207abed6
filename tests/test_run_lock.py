"""One live launch per run folder: the lock rank 0 holds on ``train.run_dir`` (and an outside ``checkpoint.dir``),
who it names when it refuses a second launch, and the locks that do not block (released, a dead process, the same
Slurm job, an old heartbeat, a file system without flock)."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

import pytest

from ckpt_helpers import tiny_train_overrides
from megatron_geo.config import ConfigError, load_config
from megatron_geo.training import run_lock
from megatron_geo.training.run_lock import LOCK_FILE, acquire_run_lock

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests/data/golden/corpus"
DATA = [
    "data.source=indexed",
    f"data.train_prefix={CORPUS}/train",
    f"data.valid_prefix={CORPUS}/valid",
    f"data.tokenizer_model={CORPUS}/tok.model",
    "model.vocab_size=96",
]


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def _cfg(run_dir: Path, *extra: str):
    run_dir.mkdir(parents=True, exist_ok=True)
    return load_config([], [f"train.run_dir={run_dir}", *extra])


def _dead_pid() -> int:
    for pid in range(4_000_000, 3_000_000, -7919):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid found")


def _write_record(run_dir: Path, **rec) -> Path:
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps(rec) + "\n")
    return path


def _no_flock(monkeypatch):
    import fcntl

    def unsupported(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", unsupported)


def test_a_second_launch_in_a_locked_run_folder_is_refused_naming_the_live_run(tmp_path):
    cfg = _cfg(tmp_path / "run")
    first = acquire_run_lock(cfg)
    try:
        with pytest.raises(ConfigError) as e:
            acquire_run_lock(cfg)
        msg = str(e.value)
        rec = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert msg.startswith(
            f"train.run_dir={tmp_path / 'run'} is in use by a live run (host {socket.gethostname()}, "
        )
        assert f"pid {os.getpid()}, started {rec['started']}" in msg and "use another train.run_dir" in msg, msg
        assert rec["run_dir"] == str((tmp_path / "run").resolve()) and "ended" not in rec
    finally:
        first.release()
    # released: the next launch takes it, and the record says the previous one ended
    assert "ended" in json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    acquire_run_lock(cfg).release()


def test_a_checkpoint_dir_outside_the_run_folder_is_locked_too(tmp_path):
    shared = tmp_path / "shared"
    a = acquire_run_lock(_cfg(tmp_path / "A", f"checkpoint.dir={shared}"))
    try:
        assert (shared / LOCK_FILE).is_file()
        with pytest.raises(ConfigError, match=rf"^checkpoint.dir={shared} is in use by a live run"):
            acquire_run_lock(_cfg(tmp_path / "B", f"checkpoint.dir={shared}"))
        assert "ended" in json.loads((tmp_path / "B" / LOCK_FILE).read_text())  # B's own lock was released
        acquire_run_lock(_cfg(tmp_path / "B")).release()  # B's folder itself is free again
    finally:
        a.release()
    # the default checkpoint folder is inside the run folder: one lock
    acquire_run_lock(_cfg(tmp_path / "C")).release()
    assert not (tmp_path / "C" / "checkpoints" / LOCK_FILE).exists()


def test_a_killed_runs_lock_does_not_block_a_requeue(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # a process killed on this host: the kernel dropped its flock, its record remains
    _write_record(run, host=socket.gethostname(), pid=_dead_pid(), started="2026-01-01T00:00:00")
    acquire_run_lock(_cfg(run)).release()


def test_a_slurm_requeue_is_not_blocked_by_its_own_previous_lock(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path / "run")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    previous = acquire_run_lock(cfg)  # still held: e.g. an NFS lock not yet expired after the node was killed
    try:
        lock = acquire_run_lock(cfg)
        assert len(lock.notes) == 1 and "SLURM_JOB_ID=4242: a requeue" in lock.notes[0], lock.notes
        lock.release()
        monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job is refused
        with pytest.raises(ConfigError, match="Slurm job 4242"):
            acquire_run_lock(cfg)
    finally:
        previous.release()


def test_a_lock_with_an_old_heartbeat_does_not_block(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path / "run")
    held = acquire_run_lock(cfg)
    try:
        old = time.time() - run_lock.STALE_S - 60
        os.utime(tmp_path / "run" / LOCK_FILE, (old, old))
        lock = acquire_run_lock(cfg)
        assert "heartbeat is" in lock.notes[0], lock.notes
        lock.release()
    finally:
        held.release()


def test_the_holder_touches_the_lock_file(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    path = tmp_path / "run" / LOCK_FILE
    lock = acquire_run_lock(_cfg(tmp_path / "run"))
    try:
        os.utime(path, (1.0, 1.0))
        deadline = time.time() + 5
        while path.stat().st_mtime < 10 and time.time() < deadline:
            time.sleep(0.05)
        assert path.stat().st_mtime > time.time() - 60
    finally:
        lock.release()


def test_without_flock_the_record_decides(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    run = tmp_path / "run"
    cfg = _cfg(run)
    # a live process of this host (this one's parent) holds it
    _write_record(run, host=socket.gethostname(), pid=os.getppid(), started="2026-01-01T00:00:00")
    with pytest.raises(
        ConfigError, match=rf"pid {os.getppid()}, started 2026-01-01T00:00:00.*remove {run / LOCK_FILE}"
    ):
        acquire_run_lock(cfg)
    # a live record of another host, heartbeat fresh: refused; old: taken over
    path = _write_record(run, host="node-elsewhere", pid=1, started="2026-01-01T00:00:00")
    with pytest.raises(ConfigError, match="host node-elsewhere, pid 1"):
        acquire_run_lock(cfg)
    old = time.time() - run_lock.STALE_S - 60
    os.utime(path, (old, old))
    acquire_run_lock(cfg).release()
    # a dead process of this host, and a released record: taken
    _write_record(run, host=socket.gethostname(), pid=_dead_pid(), started="2026-01-01T00:00:00")
    lock = acquire_run_lock(cfg)
    assert "no longer exists on this host" in lock.notes[0], lock.notes
    lock.release()
    lock = acquire_run_lock(cfg)  # the record of the launch just released
    assert lock.notes == []
    # while held, another launch is refused
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        acquire_run_lock(cfg)
    lock.release()


def test_a_second_launch_exits_2_before_training(tmp_path, capsys):
    import torch.distributed as dist

    from megatron_geo.training.cli import main

    run = tmp_path / "run"
    args = tiny_train_overrides(run, DATA, "train.steps=1", "train.eval_batches=0")
    held = acquire_run_lock(_cfg(run))
    try:
        capsys.readouterr()
        rc = main(args)
        out = capsys.readouterr()
    finally:
        held.release()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, out.err
    assert (
        lines[0].startswith(f"error: train.run_dir={run} is in use by a live run (host ")
        and f"pid {os.getpid()}" in lines[0]
    )
    assert not dist.is_initialized()
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
    assert not list((run / "checkpoints").glob("step_*"))
