"""Run a function in N gloo processes and collect each rank's return value.

The function must be defined at module level in an importable test module. It receives the rank
and world size after ``torch.distributed`` is initialised and returns something picklable.

Every call starts N fresh processes (nothing a rank does leaks into the next test), but they are
forked from a fork server that has already imported torch, ``torch.distributed.checkpoint`` and the
package: a spawned process spends 5-12 s of CPU on those imports before the test's first line, a
forked one none. The child gets the caller's current environment and working directory (as a spawned
one would) and new Python/NumPy random seeds; its stdout/stderr are copied into the caller's, so
pytest shows them with the test that ran them.

``DIST_HARNESS_START=spawn`` restores plain spawned processes (to rule the fork server out).
"""

from __future__ import annotations

import io
import os
import socket
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# imported once in the fork server (tests/dist_preload.py lists the heavy imports)
PRELOAD = ["dist_harness", "dist_preload"]
_START = os.environ.get("DIST_HARNESS_START", "forkserver")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(start: str = _START):
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first call)
        _start_fork_server()
    return ctx


def _start_fork_server() -> None:
    """Start the fork server (once) with this folder on its import path.

    The server is a fresh interpreter whose ``sys.path`` lacks this folder (Python 3.11 ignores the ``sys_path`` it
    is handed), and it skips a preload module it cannot import without a word, so without this every rank
    imported torch and the package itself. ``PYTHONPATH`` is set only while the server starts.
    """
    from multiprocessing import forkserver

    here = os.path.dirname(os.path.abspath(__file__))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, old) if p)
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _fresh_process_state(env: dict, log_path: str) -> None:
    """What a spawned process would have: the caller's environment, unshared random seeds, own output."""
    os.environ.clear()
    os.environ.update(env)
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import faulthandler

    faulthandler.enable()  # a crash in C++ (gloo, torch) leaves its stack in the rank's output


def _all_ranks_up(rank: int, world: int, port: int) -> None:
    """Wait until every rank has built its process group (gloo's full mesh is connected).

    Without it a rank whose function runs no collective can finish and close its sockets while a peer
    is still connecting (``Gloo connectFullMesh failed ... Connection closed by peer``). A separate
    client of the rendezvous store: the process group itself sees no extra operation.
    """
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120))
    store.set(f"dist_harness/up/{rank}", "1")
    store.wait([f"dist_harness/up/{r}" for r in range(world)])


def _worker(rank, world, port, fn, args, queue, env=None, log_path=None):
    if env is not None:
        _fresh_process_state(env, log_path)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        _all_ranks_up(rank, world, port)
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes, not shared-memory tensors: the child may exit before the parent reads
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0, start: str | None = None) -> list:
    """Return ``[fn(0, world, *args), ..., fn(world - 1, world, *args)]`` computed in separate processes.

    ``start``: the multiprocessing start method (default ``DIST_HARNESS_START`` or ``forkserver``); ``spawn``
    gives every rank a fresh interpreter, which reads settings that torch and MKL fix once per process (e.g.
    ``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``) from this process's environment.

    Raises AssertionError with every failing rank's traceback; ``queue.Empty`` when a rank sends nothing
    within ``timeout`` seconds.
    """
    start = start or _START
    ctx = _context(start)
    queue = ctx.Queue()
    port = free_port()
    forked = start == "forkserver"
    logs = []
    procs = []
    for r in range(world_size):
        extra = ()
        if forked:
            fd, path = tempfile.mkstemp(prefix=f"dist-rank{r}-", suffix=".log")
            os.close(fd)
            logs.append(path)
            extra = (dict(os.environ), path)
        procs.append(ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, *extra)))
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, out = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{out}")
            results[rank] = out if status == "error" else torch.load(io.BytesIO(out), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for r, path in enumerate(logs):
            with open(path, errors="replace") as f:
                text = f.read()
            os.unlink(path)
            if text:
                sys.stderr.write(f"--- rank {r} output ---\n{text}")
    if errors:
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs))
        raise AssertionError("\n".join(errors) + f"\nexit codes: {codes}")
    return [results[r] for r in range(world_size)]
