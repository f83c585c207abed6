"""Read rank/world/master address from the launcher: torchrun, srun (Slurm), or none (one process)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass


class LaunchError(RuntimeError):
    """The launch environment is inconsistent (e.g. a rank outside the world)."""


@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"


def _expand_first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gh[001-064,070],login1`` without calling scontrol."""
    m = re.match(r"^([^\[,]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise LaunchError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR explicitly")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_master_addr(nodelist: str) -> str:
    """Hostname of the first node of the job (``scontrol show hostnames`` when available)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    return _expand_first_host(nodelist)


def _int_env(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name, "")
    if raw == "" and default is not None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r} is not an integer; unset it or fix the launcher "
                          f"that sets it") from None


def detect_launch_env() -> LaunchEnv:
    """Detect the launcher from the environment.

    torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Slurm (``srun`` one process per
    task, no torchrun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR defaults to the first host
    of SLURM_JOB_NODELIST and MASTER_PORT to 29500 + (SLURM_JOB_ID % 1000). Otherwise one process.

    Raises:
        LaunchError: non-integer variables or a rank outside ``[0, world_size)``.
    """
    if ("RANK" in os.environ) != ("WORLD_SIZE" in os.environ):
        have, lack = ("RANK", "WORLD_SIZE") if "RANK" in os.environ else ("WORLD_SIZE", "RANK")
        raise LaunchError(f"{have} is set but {lack} is not; launch with torchrun (which sets both), or unset {have}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        env = LaunchEnv(_int_env("RANK"), _int_env("WORLD_SIZE"), _int_env("LOCAL_RANK", 0),
                        os.environ.get("MASTER_ADDR", "127.0.0.1"), _int_env("MASTER_PORT", 29500), "torchrun")
    elif "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "127.0.0.1"))
        addr = os.environ.get("MASTER_ADDR") or slurm_master_addr(nodelist)
        job = _int_env("SLURM_JOB_ID", 0)
        port = _int_env("MASTER_PORT", 29500 + job % 1000)
        env = LaunchEnv(_int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS"), _int_env("SLURM_LOCALID", 0),
                        addr, port, "slurm")
    else:
        env = LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single")
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise LaunchError(f"rank {env.rank} is outside world size {env.world_size} ({env.launcher} launch); check the "
                          f"launcher's RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS")
    if not 0 < env.master_port < 65536 and env.launcher != "single":
        raise LaunchError(f"MASTER_PORT={env.master_port} is not a TCP port (1-65535)")
    if env.world_size == 1:  # e.g. one Slurm task: nothing to rendezvous with
        env = LaunchEnv(0, 1, env.local_rank, "127.0.0.1", 0, "single")
    return env
