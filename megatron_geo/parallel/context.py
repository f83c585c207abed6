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

from .launch_env import LaunchEnv, detect_launch_env


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


def build_groups(rank: int, world_size: int, tp_size: int, device: torch.device, backend: str) -> ParallelContext:
    """Create the TP and DP groups on an initialised default process group (every rank calls all new_group)."""
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


def init_parallel(tp_size: int, device: str = "auto", backend: str = "auto", timeout_minutes: float = 30.0,
                  env: LaunchEnv | None = None) -> ParallelContext:
    """Initialise torch.distributed from the launcher environment and build the TP x DP context.

    ``device=auto`` picks CUDA (``cuda:LOCAL_RANK``) when available, else CPU; ``backend=auto`` picks NCCL
    on CUDA and gloo on CPU. A single process without a launcher gets a world of one (in-memory store).
    """
    env = env or detect_launch_env()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but CUDA is not available; use train.device=cpu")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
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
