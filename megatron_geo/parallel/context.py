"""The explicit parallel context: TP x DP process groups passed to whoever needs them.

Rank layout (Megatron's default order): ``rank = dp_rank * tp_size + tp_rank``, so the ranks of one
TP group are adjacent (same node when TP fits in a node) and DP groups stride by ``tp_size``.
No module-level process groups exist anywhere in the package.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .launch_env import LaunchEnv, LaunchError, detect_launch_env, require_cuda_if_allotted


@dataclass
class ParallelContext:
    """Ranks, sizes and process groups of one process.

    Attributes:
        tp_group / dp_group: ``torch.distributed`` process groups (for size 1 they still exist).
        device: where this rank computes (``cpu`` or ``cuda:LOCAL_RANK``).
    """

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    world_group: dist.ProcessGroup
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group."""
        return [self.dp_rank * self.tp_size + t for t in range(self.tp_size)]

    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group."""
        return [d * self.tp_size + self.tp_rank for d in range(self.dp_size)]


def indexed_device(device) -> torch.device:
    """``device`` (a name or ``torch.device``) with its index: ``cuda`` becomes ``cuda:<current device>``.

    Tensors made on ``cuda`` live on ``cuda:N``, and ``torch.device("cuda") != torch.device("cuda", 0)``: code that
    compares devices or builds placements from them (checkpoint shards) needs the indexed form.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def build_groups(rank: int, world_size: int, tp_size: int, device: torch.device, backend: str) -> ParallelContext:
    """Create the TP and DP groups on an initialised default process group (every rank calls all new_group)."""
    device = indexed_device(device)  # placements and device comparisons need the index
    if world_size % tp_size:
        raise ValueError(f"world size {world_size} is not divisible by tensor-parallel size {tp_size}")
    dp_size = world_size // tp_size
    tp_group = dp_group = None
    for d in range(dp_size):
        ranks = [d * tp_size + t for t in range(tp_size)]
        g = dist.new_group(ranks)
        if rank in ranks:
            tp_group = g
    for t in range(tp_size):
        ranks = [d * tp_size + t for d in range(dp_size)]
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    return ParallelContext(rank, world_size, rank % tp_size, tp_size, rank // tp_size, dp_size, tp_group, dp_group,
                           dist.group.WORLD, device, backend)


def _backends_of(group=None) -> set[str]:
    """The backend names of an initialised process group: ``{"gloo"}``, ``{"nccl"}``, or each of a multi-device
    spec such as ``"cpu:gloo,cuda:nccl"``."""
    spec = str(dist.get_backend(group)).lower()
    return {part.split(":")[-1].strip() for part in spec.split(",") if part.strip()}


def check_default_group(backend: str) -> None:
    """Refuse an already initialised default process group whose backend is not ``backend``.

    :func:`init_parallel` builds its TP and DP groups with ``dist.new_group``, which inherits the default group's
    backend: over a gloo world they would be gloo groups while the context says NCCL (and the reverse), and the
    first collective on a CUDA tensor would fail with a device error deep in the training step.

    Raises:
        LaunchError: naming both backends and the fix (destroy the existing group first, or ask for its backend).
    """
    if not dist.is_initialized():
        return
    have = _backends_of()
    if backend.lower() not in have:
        raise LaunchError(f"a default process group with backend {dist.get_backend()!r} is already initialised, but "
                          f"init_parallel would use {backend!r} (its TP/DP groups would silently be "
                          f"{dist.get_backend()!r} groups); call torch.distributed.destroy_process_group() first, or "
                          f"ask for parallel.backend={sorted(have)[0]} with a matching train.device")


def init_parallel(tp_size: int, device: str = "auto", backend: str = "auto", timeout_minutes: float = 30.0,
                  env: LaunchEnv | None = None) -> ParallelContext:
    """Initialise torch.distributed from the launcher environment and build the TP x DP context.

    ``device=auto`` picks CUDA (``cuda:LOCAL_RANK``) when available, else CPU -- but not where the launcher
    allotted GPUs that CUDA cannot use (:func:`~.launch_env.require_cuda_if_allotted`); ``backend=auto`` picks
    NCCL on CUDA and gloo on CPU. A single process without a launcher gets a world of one (in-memory store). An
    already initialised default process group is used as it is, provided its backend is the one chosen here.

    Raises:
        LaunchError: GPUs allotted but CUDA unusable with ``device=auto``, or an existing default process group
            with another backend (both before any process group is created or any collective runs).
        RuntimeError: ``device=cuda`` without CUDA.
    """
    env = env or detect_launch_env()
    if device == "auto":
        require_cuda_if_allotted(device)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available; use train.device=cpu")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    check_default_group(backend)
    if device == "cuda":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        if env.launcher == "single":
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            # the defaults detect_launch_env applied (127.0.0.1:29500) must reach env:// too
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
            init = f"tcp://{env.master_addr}:{env.master_port}" if env.launcher == "slurm" else "env://"
            kwargs = {"device_id": dev} if dev.type == "cuda" else {}
            dist.init_process_group(backend, init_method=init, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout, **kwargs)
    return build_groups(dist.get_rank(), dist.get_world_size(), tp_size, dev, backend)


def destroy_parallel() -> None:
    """Tear down torch.distributed if it is up."""
    if dist.is_initialized():
        dist.destroy_process_group()
