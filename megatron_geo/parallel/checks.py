"""Start-up checks of the ``parallel`` section: its rules against the world size and the device, and the keys
that ``parallel.distributed_optimizer=false`` gives no effect."""

from __future__ import annotations

import math

from ..config.checks import InertRule, check_positive
from ..config.errors import ConfigError
from ..config.schema import ParallelConfig

_NOTHING_GATHERED = "parallel.distributed_optimizer=false (nothing is gathered)"


def check_parallel_config(p: ParallelConfig, world_size: int, device: str) -> None:
    """Check the ``parallel`` keys for ``world_size`` processes on ``device`` (``train.device``).

    Checked: ``tensor`` and ``bucket_size`` positive; the world size a multiple of ``tensor``; ``backend=nccl``
    not with ``train.device=cpu``; ``timeout_minutes`` a positive number.

    Raises:
        ConfigError: naming the key, the bad value and the fix.
    """
    check_positive("parallel", p, ("tensor", "bucket_size"))
    if world_size % p.tensor:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor={p.tensor}; launch a multiple of "
            f"{p.tensor} processes or change parallel.tensor"
        )
    if p.backend == "nccl" and device == "cpu":
        raise ConfigError("parallel.backend=nccl needs CUDA; use parallel.backend=gloo (or auto) with train.device=cpu")
    if not (math.isfinite(p.timeout_minutes) and p.timeout_minutes > 0):
        raise ConfigError(f"parallel.timeout_minutes={p.timeout_minutes} must be a positive number of minutes")


def parallel_inert_keys(p: ParallelConfig) -> list[InertRule]:
    """The keys that ``parallel.distributed_optimizer=false`` gives no effect (nothing is gathered):
    ``comm.param_gather`` and ``parallel.overlap_param_gather``."""
    if p.distributed_optimizer:
        return []
    fix = "set parallel.distributed_optimizer=true"
    return [
        (("comm.param_gather",), _NOTHING_GATHERED, fix),
        (("parallel.overlap_param_gather",), _NOTHING_GATHERED, fix),
    ]
