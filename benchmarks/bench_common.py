"""Shared pieces of the multi-process CPU benchmarks: synthetic batches and a spawn-and-collect helper."""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def synthetic_batches(cfg, dp_rank: int, dp_size: int, step: int) -> list[dict]:
    """This DP rank's micro-batches of a random-token global batch (seeded by ``step``), as the trainer slices."""
    g = torch.Generator().manual_seed(step)
    t = cfg.train
    data = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, cfg.model.seq_length + 1), generator=g)
    per = t.global_batch_size // dp_size
    mine = data[dp_rank * per : (dp_rank + 1) * per]
    return [
        {
            "tokens": mine[i : i + t.micro_batch_size, :-1],
            "labels": mine[i : i + t.micro_batch_size, 1:],
            "loss_mask": torch.ones(t.micro_batch_size, cfg.model.seq_length),
        }
        for i in range(0, per, t.micro_batch_size)
    ]


def _entry(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = fn(rank, world, args)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


class WorkerError(RuntimeError):
    """A benchmark worker process exited with an error (its traceback is on stderr)."""


def run_gloo(fn, nproc: int, args, timeout: float = 7200):
    """Run ``fn(rank, world, args)`` in ``nproc`` spawned gloo processes; return rank 0's result.

    Raises:
        ValueError: ``nproc < 1``.
        WorkerError: a worker exited with a non-zero code (the others are terminated), or no result
            arrived within ``timeout`` seconds.
    """
    if nproc < 1:
        raise ValueError(f"--nproc={nproc} must be >= 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, nproc, port, fn, args, queue)) for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                out = queue.get(timeout=1.0)
                break
            except queue_mod.Empty:
                bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if bad:
                    raise WorkerError(
                        "benchmark worker(s) failed: "
                        + ", ".join(f"rank {r} exit code {c}" for r, c in bad)
                        + " (see the traceback above)"
                    ) from None
                if time.monotonic() > deadline:
                    raise WorkerError(f"no result from the benchmark workers within {timeout:.0f} s") from None
        for p in procs:
            p.join()
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
