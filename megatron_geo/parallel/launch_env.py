"""Read rank/world/master address from the launcher: torchrun, srun (Slurm), or none (one process)."""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass


class LaunchError(RuntimeError):
    """The launch environment is inconsistent (e.g. a rank outside the world)."""


# How long the processes of a multi-process launch wait for each other to connect (the rendezvous), in seconds.
# The collectives' own timeout (parallel.timeout_minutes) starts only after it.
RENDEZVOUS_TIMEOUT_VARIABLE = "MG_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 60.0


@dataclass
class LaunchEnv:
    """Where this process sits in the launch.

    Attributes:
        rendezvous_timeout_s: seconds every process waits for all the others to connect to the store at
            ``master_addr:master_port`` (:data:`RENDEZVOUS_TIMEOUT_VARIABLE`, default 60).
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S


# Slurm's host-list separators (outside brackets) and its limit on the hosts of one range (hostlist.c).
_HOSTLIST_SEPARATORS = ", \t"
_MAX_RANGE_HOSTS = 65536
_FIX_NODELIST = "set MASTER_ADDR to the first node's hostname, or put scontrol on PATH"


def _split_top_level(text: str) -> list[str]:
    """Split a Slurm host list at the separators (comma, space, tab) outside brackets; empty items dropped.

    Raises:
        ValueError: a bracket opened inside another, a ``]`` without its ``[``, or a ``[`` never closed.
    """
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            if depth:
                raise ValueError("nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError("']' without '['")
            depth = 0
        if ch in _HOSTLIST_SEPARATORS and not depth:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError("'[' never closed")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_range_set(body: str) -> list[str]:
    """``"001-003,070"`` -> ``["001", "002", "003", "070"]``.

    Each item is ``N`` or ``N-M`` in decimal digits with ``N <= M`` and at most 65536 values; a value is
    zero-padded to the number of digits of ``N`` (Slurm's rule: ``[09-10]`` gives 09, 10; ``[9-010]`` gives 9, 10).

    Raises:
        ValueError: an empty item, a non-digit bound, a descending or too long range.
    """
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or not lo.isascii() or not hi.isascii():
            raise ValueError(f"bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r}")
        if int(hi) - int(lo) + 1 > _MAX_RANGE_HOSTS:
            raise ValueError(f"range {item!r} has more than {_MAX_RANGE_HOSTS} hosts")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def _parse_host_expression(expr: str) -> tuple[list[str], list[list[str]]]:
    """``"r[1-2]n[01-02]"`` -> texts ``["r", "n"]`` and groups ``[["1", "2"], ["01", "02"]]``: text ``i``
    precedes group ``i``. A name without brackets is one text and no groups.

    Raises:
        ValueError: text after the last bracket group (Slurm refuses it too), or a bad range.
    """
    pieces = re.split(r"\[([^\]]*)\]", expr)  # text, group, text, group, ..., text
    texts, groups = pieces[0::2], [_expand_range_set(body) for body in pieces[1::2]]
    if groups and texts[-1]:
        raise ValueError(f"text {texts[-1]!r} after the last bracket of {expr!r}")
    return (texts[:-1] if groups else texts), groups


def _expand_host_expression(texts: list[str], groups: list[list[str]]):
    """The hosts of one parsed expression, in ``scontrol show hostnames`` order.

    Slurm expands the last group as the host's number suffix and each earlier group as part of the prefix,
    the rightmost first, recursively: the last group varies fastest, then the first, the second, ..., and the
    second-to-last slowest (``a[1-2]b[1-2]c[1-2]``: a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...).
    """
    if not groups:
        yield texts[0]
        return
    order = list(range(len(groups) - 2, -1, -1)) + [len(groups) - 1]  # slowest first
    for values in itertools.product(*(groups[g] for g in order)):
        chosen = dict(zip(order, values))
        yield "".join(texts[g] + chosen[g] for g in range(len(groups)))


def iter_hostlist(nodelist: str):
    """Every host of a Slurm host list, lazily, in ``scontrol show hostnames`` order (see :func:`expand_hostlist`).

    The whole list is parsed (and refused if bad) before the first host is given.

    Raises:
        LaunchError: the list cannot be parsed (names the value and the fix).
    """
    try:
        parsed = [_parse_host_expression(expr) for expr in _split_top_level(nodelist)]
        if not parsed:
            raise ValueError("empty")
    except ValueError as e:
        raise LaunchError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r} ({e}); {_FIX_NODELIST}") from None
    for texts, groups in parsed:
        yield from _expand_host_expression(texts, groups)


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of a Slurm host list, in ``scontrol show hostnames`` order, without calling ``scontrol``.

    Accepted syntax (Slurm 22.05's, checked against ``scontrol show hostnames``): host expressions separated by
    commas, spaces or tabs outside brackets (empty ones skipped); an expression is a name with any number of
    bracket groups ``[R,R,...]``, ``R`` being ``N`` or ``N-M`` (ASCII digits, ``N <= M``, at most 65536 hosts),
    with text before and between the groups but none after the last one (``rack[1-2]-ib`` is refused, as Slurm
    refuses it); a value keeps the digit count of ``N`` (``[09-10]``: 09, 10). Repeated hosts are kept and the
    expressions keep their order. Within an expression the last group varies fastest, then the first, the
    second, ..., the second-to-last slowest (``a[1-2]b[1-2]c[1-2]``: a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...).

    Nothing beyond Slurm's syntax is accepted. Refused although Slurm takes them (as literal host names or with
    odd results): a ``[`` never closed or a ``]`` outside a group, nested brackets, and range bounds with
    spaces, signs or a missing upper bound (``n[1-]``).

    Raises:
        LaunchError: the list cannot be parsed (names the value and the fix).
    """
    return list(iter_hostlist(nodelist))


def _expand_first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gh[001-064,070],login1`` (no scontrol; the whole list is
    checked, only the first host is expanded)."""
    return next(iter_hostlist(nodelist))


def slurm_master_addr(nodelist: str) -> str:
    """Hostname of the first node of the job (``scontrol show hostnames`` when available)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
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
        raise LaunchError(
            f"environment variable {name}={raw!r} is not an integer; unset it or fix the launcher that sets it"
        ) from None


def rendezvous_timeout_s() -> float:
    """Seconds to wait for every process to join the rendezvous: ``MG_RENDEZVOUS_TIMEOUT`` if set, else 60.

    Raises:
        LaunchError: the variable is not a positive finite number of seconds.
    """
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise LaunchError(
            f"{RENDEZVOUS_TIMEOUT_VARIABLE}={raw!r} is not a positive number of seconds; set it to "
            f"how long the processes may take to start and connect (default "
            f"{DEFAULT_RENDEZVOUS_TIMEOUT_S:g}), or unset it"
        )
    return value


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
        why = (
            f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) finds no usable GPU: the NVIDIA "
            f"driver is missing or older than CUDA {torch.version.cuda} needs, or no device is visible"
        )
        fix = "fix the NVIDIA driver (nvidia-smi must work) or install a torch built for the driver's CUDA"
    raise LaunchError(
        f"{name}={value!r} gives this process GPUs on {socket.gethostname()}, but {why}, so "
        f"train.device=auto would train on the CPU with gloo (orders of magnitude slower); {fix}, or "
        f"set train.device=cpu to run on the CPU on purpose"
    )


def detect_launch_env() -> LaunchEnv:
    """Detect the launcher from the environment.

    torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Slurm (``srun`` one process per
    task, no torchrun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR defaults to the first host
    of SLURM_JOB_NODELIST and MASTER_PORT to 29500 + (SLURM_JOB_ID % 1000). Otherwise one process.

    A multi-process launch also reads ``MG_RENDEZVOUS_TIMEOUT`` (:func:`rendezvous_timeout_s`).

    Raises:
        LaunchError: non-integer variables, a rank outside ``[0, world_size)``, a port outside 1-65535 or a bad
            ``MG_RENDEZVOUS_TIMEOUT``.
    """
    if ("RANK" in os.environ) != ("WORLD_SIZE" in os.environ):
        have, lack = ("RANK", "WORLD_SIZE") if "RANK" in os.environ else ("WORLD_SIZE", "RANK")
        raise LaunchError(f"{have} is set but {lack} is not; launch with torchrun (which sets both), or unset {have}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        env = LaunchEnv(
            _int_env("RANK"),
            _int_env("WORLD_SIZE"),
            _int_env("LOCAL_RANK", 0),
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            _int_env("MASTER_PORT", 29500),
            "torchrun",
        )
    elif "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "127.0.0.1"))
        addr = os.environ.get("MASTER_ADDR") or slurm_master_addr(nodelist)
        job = _int_env("SLURM_JOB_ID", 0)
        port = _int_env("MASTER_PORT", 29500 + job % 1000)
        env = LaunchEnv(
            _int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS"), _int_env("SLURM_LOCALID", 0), addr, port, "slurm"
        )
    else:
        env = LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single")
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise LaunchError(
            f"rank {env.rank} is outside world size {env.world_size} ({env.launcher} launch); check the "
            f"launcher's RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS"
        )
    if not 0 < env.master_port < 65536 and env.launcher != "single":
        raise LaunchError(f"MASTER_PORT={env.master_port} is not a TCP port (1-65535)")
    if env.world_size == 1:  # e.g. one Slurm task: nothing to rendezvous with
        return LaunchEnv(0, 1, env.local_rank, "127.0.0.1", 0, "single")
    env.rendezvous_timeout_s = rendezvous_timeout_s()
    return env
