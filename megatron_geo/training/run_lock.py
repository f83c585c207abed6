"""One live launch per run folder: rank 0 holds ``<train.run_dir>/run.lock`` (and ``<checkpoint.dir>/run.lock`` when
the checkpoints live outside the run folder) for the whole launch.

The lock is ``fcntl.flock`` on the file (the kernel releases it when the process ends, however it ends; NFS and
Lustre mounted with ``flock`` lock it across nodes), and the file holds a JSON record of the holder for the error
message: ``host``, ``pid``, ``slurm_job_id``, ``started`` and ``run_dir``. While the launch runs, a daemon thread
touches the file every :data:`HEARTBEAT_S` seconds; a clean end adds ``ended``.

A lock that is held is not in the way when

- the holder is the same Slurm job (``SLURM_JOB_ID`` equal: a requeue of the job is never blocked by its own
  previous launch, whose processes Slurm ended before requeueing it);
- its heartbeat is older than :data:`STALE_S` (a holder that stopped touching it: its node died).

On a file system without ``flock`` (``ENOLCK``, ``EOPNOTSUPP``, ...) the JSON record alone decides: a record that
is ended, of a process that no longer exists on this host, of the same Slurm job, or with an old heartbeat does
not block; any other does.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from pathlib import Path

from ..config import Config, ConfigError

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0  # how often the holder touches the lock file
STALE_S = 600.0  # a lock whose file was not touched for this long is a dead holder's


def _holder_record(run_dir: Path) -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_dir": str(run_dir.resolve()),
    }


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read_record(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        rec = json.loads(b"".join(chunks).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _write_record(fd: int, rec: dict) -> None:
    data = (json.dumps(rec) + "\n").encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)
    os.fsync(fd)


def _stale_reason(rec: dict, age_s: float, held: bool) -> str | None:
    """Why a lock whose holder is ``rec`` does not block this launch (None: it does). ``held``: ``flock`` says a
    live process holds it (then only the Slurm job and the heartbeat count: a pid of another PID namespace proves
    nothing)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and rec.get("slurm_job_id") == job:
        return f"it is this Slurm job's own (SLURM_JOB_ID={job}: a requeue)"
    if age_s > STALE_S:
        return f"its heartbeat is {age_s:.0f} s old (> {STALE_S:.0f} s)"
    if held:
        return None
    if not rec or rec.get("ended"):
        return "it was released"
    if rec.get("host") == socket.gethostname() and not _pid_alive(rec.get("pid")):
        return f"its process {rec.get('pid')} no longer exists on this host"
    return None


def _describe(rec: dict) -> str:
    if not rec:
        return "a process whose record is unreadable"
    job = f", Slurm job {rec['slurm_job_id']}" if rec.get("slurm_job_id") else ""
    return f"host {rec.get('host', '?')}, pid {rec.get('pid', '?')}{job}, started {rec.get('started', '?')}"


class RunLock:
    """The locks of one launch (rank 0). :meth:`release` (idempotent) marks the records ended and unlocks."""

    def __init__(self, fds: list[tuple[Path, int, bool]], record: dict, notes: list[str]):
        self._fds = fds  # (path, fd, flocked)
        self.record = record
        self.notes = notes  # lines for the log: stale locks taken over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if fds:
            self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for path, fd, _ in self._fds:
                try:
                    os.utime(fd)
                except OSError:
                    try:
                        os.utime(path)
                    except OSError:
                        pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        fds, self._fds = self._fds, []
        for _, fd, flocked in fds:
            try:
                _write_record(fd, dict(self.record, ended=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
            except OSError:
                pass
            if flocked:
                import fcntl

                try:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError:
                    pass
            os.close(fd)


def _lock_one(folder: Path, key: str, record: dict, notes: list[str]) -> tuple[Path, int, bool]:
    import fcntl

    path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(
            f"{key}: cannot create the lock file {path} ({e.strerror or e}); choose a writable folder"
        ) from None
    try:
        flocked = held = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                held = True
            # else: no flock on this file system (ENOLCK, EOPNOTSUPP, ENOSYS, EINVAL): the record alone decides
        if not flocked:
            rec = _read_record(fd)
            try:
                age = time.time() - os.fstat(fd).st_mtime
            except OSError:
                age = 0.0
            why = _stale_reason(rec, age, held)
            if why is None:
                raise ConfigError(
                    f"{key}={folder} is in use by a live run ({_describe(rec)}; {path}): two launches in one "
                    f"folder overwrite each other's checkpoints and outputs; wait for it to end, or use another "
                    f"{key}" + ("" if held else f" (if that run is gone, remove {path})")
                )
            if rec and not rec.get("ended"):
                notes.append(f"run lock: taking over {path} of {_describe(rec)}: {why}")
        _write_record(fd, record)
    except BaseException:
        os.close(fd)
        raise
    return path, fd, flocked


def acquire_run_lock(cfg: Config) -> RunLock:
    """Lock ``train.run_dir`` (and ``checkpoint.dir`` when it is outside the run folder) for this launch; call it
    on rank 0 only, once the folders exist.

    Raises:
        ConfigError: a live launch holds a lock (naming the folder, its host, pid, Slurm job and start time, and
            the fix), or a lock file cannot be created.
    """
    from ..checkpoint.manager import checkpoint_root

    run_dir = Path(cfg.train.run_dir)
    record = _holder_record(run_dir)
    folders = [("train.run_dir", run_dir)]
    root = checkpoint_root(cfg)
    try:
        root.resolve().relative_to(run_dir.resolve())
    except ValueError:
        folders.append(("checkpoint.dir", root))
    fds: list[tuple[Path, int, bool]] = []
    notes: list[str] = []
    try:
        for key, folder in folders:
            fds.append(_lock_one(folder, key, record, notes))
    except BaseException:
        RunLock(fds, record, []).release()
        raise
    return RunLock(fds, record, notes)
