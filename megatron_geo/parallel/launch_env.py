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


def _split_top_level(text: str) -> list[str]:
    """Split a Slurm host list at the commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError("unbalanced '['")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_range_set(body: str) -> list[str]:
    """``"001-003,070"`` -> ``["001", "002", "003", "070"]`` (zero padding kept, as Slurm does)."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r}")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of a Slurm host list, in Slurm's order, without calling ``scontrol``.

    Follows Slurm's syntax: hosts separated by commas; any number of bracket ranges per host, with text
    before, between and after them (``rack[1-2]-ib``, ``r[1-2]n[01-04]``); zero padding of ranges kept.

    Raises:
        LaunchError: the list cannot be parsed (names the value and the fix).
    """
    try:
        hosts = []
        for expr in _split_top_level(nodelist.strip()):
            pieces = re.split(r"(\[[^\]]*\])", expr)
            expanded = [""]
            for piece in pieces:
                if piece.startswith("["):
                    choices = _expand_range_set(piece[1:-1])
                    expanded = [h + c for h in expanded for c in choices]
                elif "[" in piece or "]" in piece:
                    raise ValueError(f"bad bracket in {expr!r}")
                else:
                    expanded = [h + piece for h in expanded]
            hosts += expanded
        if not hosts:
            raise ValueError("empty")
        return hosts
    except ValueError as e:
        raise LaunchError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r} ({e}); set MASTER_ADDR to the first "
                          f"node's hostname, or put scontrol on PATH") from None


def _expand_first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gh[001-064,070],login1`` or ``rack[1-2]-ib`` (no scontrol)."""
    return expand_hostlist(nodelist)[0]


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


# Launcher variables that allot GPUs to a process, in the order they are reported. Slurm sets
# SLURM_GPUS_ON_NODE (a count), SLURM_STEP_GPUS / SLURM_JOB_GPUS (GPU indices) when it gives the job GPUs,
# and CUDA_VISIBLE_DEVICES for the task. _NO_GPU_VALUES (compared in lower case) mean no GPU: unset lists,
# CUDA's "-1" (hide every device) and Slurm's "NoDevFiles".
GPU_ALLOTMENT_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")
_NO_GPU_VALUES = ("", "-1", "nodevfiles")


def allotted_gpus() -> tuple[str, str] | None:
    """The first of :data:`GPU_ALLOTMENT_VARIABLES` that gives this process GPUs, as ``(name, value)``, or None.

    ``SLURM_GPUS_ON_NODE`` counts when it is a positive integer; the others when set to anything but ``""``,
    ``-1`` or ``NoDevFiles`` (what Slurm sets where a job has no GPUs).
    """
    for name in GPU_ALLOTMENT_VARIABLES:
        raw = os.environ.get(name)
        if raw is None:
            continue
        value = raw.strip()
        if name == "SLURM_GPUS_ON_NODE":
            if value.isdigit() and int(value) > 0:
                return name, raw
        elif value.lower() not in _NO_GPU_VALUES:
            return name, raw
    return None


def require_cuda_if_allotted(device: str = "auto") -> None:
    """With ``train.device=auto``, refuse to fall back to the CPU on a process the launcher gave GPUs.

    A node whose CUDA is unusable (a CPU-only build of torch, a driver older than torch's CUDA) would
    otherwise train on the CPU with gloo, orders of magnitude slower, without a word. Call it before any
    process group exists. ``device`` other than ``auto`` (an explicit ``cpu`` or ``cuda``) is not checked here.

    Raises:
        LaunchError: GPUs are allotted (:func:`allotted_gpus` names the variable) but
            ``torch.cuda.is_available()`` is False; the message names the variable, this node, why CUDA is
            unusable as far as torch can tell, and the fixes.
    """
    if str(device).strip().lower() != "auto":
        return
    allotted = allotted_gpus()
    if allotted is None:
        return
    import socket

    import torch

    if torch.cuda.is_available():
        return
    name, value = allotted
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
        fix = "install a CUDA build of torch"
    else:
        why = (f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) finds no usable GPU: the NVIDIA "
               f"driver is missing or older than CUDA {torch.version.cuda} needs, or no device is visible")
        fix = "fix the NVIDIA driver (nvidia-smi must work) or install a torch built for the driver's CUDA"
    raise LaunchError(f"{name}={value!r} gives this process GPUs on {socket.gethostname()}, but {why}, so "
                      f"train.device=auto would train on the CPU with gloo (orders of magnitude slower); {fix}, or "
                      f"set train.device=cpu to run on the CPU on purpose")


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
