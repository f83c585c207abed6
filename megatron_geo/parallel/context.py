"""The explicit parallel context: TP x DP process groups passed to whoever needs them.

Rank layout (Megatron's default order): ``rank = dp_rank * tp_size + tp_rank``, so the ranks of one
TP group are adjacent (same node when TP fits in a node) and DP groups stride by ``tp_size``.
No module-level process groups exist anywhere in the package.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .launch_env import RENDEZVOUS_TIMEOUT_VARIABLE, LaunchEnv, LaunchError, detect_launch_env, require_cuda_if_allotted


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
    return ParallelContext(
        rank,
        world_size,
        rank % tp_size,
        tp_size,
        rank // tp_size,
        dp_size,
        tp_group,
        dp_group,
        dist.group.WORLD,
        device,
        backend,
    )


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
        raise LaunchError(
            f"a default process group with backend {dist.get_backend()!r} is already initialised, but "
            f"init_parallel would use {backend!r} (its TP/DP groups would silently be "
            f"{dist.get_backend()!r} groups); call torch.distributed.destroy_process_group() first, or "
            f"ask for parallel.backend={sorted(have)[0]} with a matching train.device"
        )


_STORE_HOST_GRACE_S = 3.0


class _RendezvousIncomplete(Exception):
    """The rendezvous did not complete in time: what was seen, and why if known."""

    def __init__(self, what: str, why: str = ""):
        super().__init__(what)
        self.why = why


def _launch_variables(launcher: str) -> str:
    """``NAME=value`` of the launch variables set in this process's environment, comma-separated."""
    names = (
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_ID")
        if launcher == "slurm"
        else ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
    )
    seen = [f"{n}={os.environ[n]}" for n in (*names, "MASTER_ADDR", "MASTER_PORT") if n in os.environ]
    return ", ".join(seen) or "no launch variables"


def _rendezvous_hint(env: LaunchEnv) -> str:
    """What to do when the processes of ``env`` did not all meet."""
    if env.launcher == "slurm":
        return (
            f"launch with srun (one task per GPU), e.g. `srun python pretrain_llama.py ...` in the sbatch script "
            f"or salloc shell: python started directly reads the job's SLURM_NTASKS={env.world_size} but is one "
            f"process; if srun did start every task, check that {env.master_addr} (MASTER_ADDR) is the job's "
            f"first node and reachable from every node"
        )
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return (
            "start torchrun on every node with the same --nnodes and --master-addr/--master-port (or "
            f"--rdzv-endpoint), and check that {env.master_addr} is reachable from every node"
        )
    return (
        f"RANK/WORLD_SIZE say {env.world_size} processes but no launcher started the others: start them with "
        f"torchrun (--nproc-per-node, and --nnodes with --master-addr on every node), or unset RANK and "
        f"WORLD_SIZE to run one process; check MASTER_ADDR={env.master_addr}"
    )


def _rendezvous_cause(env: LaunchEnv, cause: BaseException) -> tuple[str, str, str | None]:
    """(what happened, why if known, a fix that replaces the launch hint or None for a timeout) for the exception
    that ended a rendezvous."""
    text = " ".join(str(cause).split())
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        import socket

        return (
            f"MASTER_PORT={env.master_port} is already in use on {socket.gethostname()}",
            "",
            "another job or run on this host holds it: set MASTER_PORT to a free port",
        )
    if isinstance(cause, _RendezvousIncomplete):
        return text, cause.why, None
    return f"{type(cause).__name__}: {text}", "", None


def _rendezvous_error(env: LaunchEnv, cause: BaseException) -> LaunchError:
    """One-line :class:`LaunchError` for a failed rendezvous: what was seen, the variables, the fix."""
    what, why, fix = _rendezvous_cause(env, cause)
    if fix is None:
        what += f" within {env.rendezvous_timeout_s:g} s"
        fix = (
            f"{_rendezvous_hint(env)}; {RENDEZVOUS_TIMEOUT_VARIABLE}=SECONDS waits longer for processes that "
            f"start slowly"
        )
    seen = "; ".join(part for part in (why, f"{env.launcher} launch", _launch_variables(env.launcher)) if part)
    return LaunchError(
        f"rank {env.rank}: the rendezvous of {env.world_size} processes at {env.master_addr}:"
        f"{env.master_port} failed: {what} ({seen}); {fix}"
    )


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.5, deadline - time.monotonic()))


def _wait_until_listening(addr: str, port: int, deadline: float) -> None:
    """Poll a plain TCP connection to ``addr:port`` until it is accepted (rank 0's store is up) or ``deadline``
    (``time.monotonic()``) passes; quieter than letting the store client retry, which logs every attempt.

    Raises:
        _RendezvousIncomplete: naming the address and the last connection error.
    """
    import socket

    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise _RendezvousIncomplete(
                f"no answer from rank 0's store at {addr}:{port}",
                f"{last.strerror or last}: rank 0 never started, or MASTER_ADDR/MASTER_PORT point elsewhere",
            )
        time.sleep(0.2)


def _join_barrier(store: dist.Store, env: LaunchEnv, deadline: float) -> None:
    """Count this process in and wait until all ``env.world_size`` processes are (polling, no blocking waits).

    The keys carry torchrun's restart count: its store outlives a restart of the workers.

    Raises:
        _RendezvousIncomplete: with how many processes joined before ``deadline``.
    """
    key = f"megatron_geo/rendezvous/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if store.add(f"{key}/joined", 1) == env.world_size:
        store.set(f"{key}/complete", "1")
    while not store.check([f"{key}/complete"]):
        if time.monotonic() >= deadline:
            raise _RendezvousIncomplete(f"only {store.add(f'{key}/joined', 0)} of {env.world_size} processes joined")
        time.sleep(0.1)


def _torchrun_hosts_the_store() -> bool:
    """True under torchrun, whose agent already serves the store at MASTER_ADDR:MASTER_PORT (it says so in
    ``TORCHELASTIC_USE_AGENT_STORE``, the variable torch's own env:// rendezvous reads)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def rendezvous_store(env: LaunchEnv, collective_timeout: datetime.timedelta) -> dist.Store:
    """Meet the other processes of a multi-process launch at ``env.master_addr:env.master_port``.

    Rank 0 hosts the store (under torchrun its agent does); every process connects, counts itself in and waits
    until all ``env.world_size`` have, for at most ``env.rendezvous_timeout_s`` seconds in all (rank 0 waits 3 s
    longer, so that the others see the count before its store goes). The store is returned with
    ``collective_timeout`` and the prefix ``init_process_group`` itself would give it.

    Raises:
        LaunchError: one line: the address, how many processes joined (or the connection error), the launch
            variables seen and the fix (srun under Slurm, torchrun otherwise, a free MASTER_PORT).
    """
    # rank 0 holds its store a little longer than the others wait, so that they read the count and leave first
    # (a store that disappears under a waiting client makes it log a C++ stack)
    hosts = env.rank == 0 and not _torchrun_hosts_the_store()
    deadline = time.monotonic() + env.rendezvous_timeout_s + (_STORE_HOST_GRACE_S if hosts else 0.0)
    try:
        if not hosts:
            _wait_until_listening(env.master_addr, env.master_port, deadline)
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=hosts,
            timeout=_remaining(deadline),
            wait_for_workers=False,
            multi_tenant=True,
        )
        _join_barrier(store, env, deadline)
    except (dist.DistError, RuntimeError, OSError, ValueError, _RendezvousIncomplete) as e:
        raise _rendezvous_error(env, e) from None
    store.set_timeout(collective_timeout)
    return dist.PrefixStore("default_pg", store)


def _init_default_group(backend: str, env: LaunchEnv, dev: torch.device, timeout: datetime.timedelta) -> None:
    """Create the default process group of a multi-process launch after :func:`rendezvous_store`.

    Raises:
        LaunchError: the rendezvous failed, or a process left between it and the group's creation.
    """
    store = rendezvous_store(env, timeout)
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    try:
        dist.init_process_group(
            backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs
        )
    except (dist.DistError, RuntimeError) as e:
        raise LaunchError(
            f"rank {env.rank}: the {backend} process group of {env.world_size} processes could not be "
            f"created after they met at {env.master_addr}:{env.master_port} ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); another process probably stopped during start-up: see its "
            f"error"
        ) from None


def init_parallel(
    tp_size: int,
    device: str = "auto",
    backend: str = "auto",
    timeout_minutes: float = 30.0,
    env: LaunchEnv | None = None,
) -> ParallelContext:
    """Initialise torch.distributed from the launcher environment and build the TP x DP context.

    ``device=auto`` picks CUDA (``cuda:LOCAL_RANK``) when available, else CPU -- but not where the launcher
    allotted GPUs that CUDA cannot use (:func:`~.launch_env.require_cuda_if_allotted`); ``backend=auto`` picks
    NCCL on CUDA and gloo on CPU. A single process without a launcher gets a world of one (in-memory store). An
    already initialised default process group is used as it is, provided its backend is the one chosen here.
    Several processes first meet at the master's store (:func:`rendezvous_store`) for at most
    ``env.rendezvous_timeout_s`` seconds (``MG_RENDEZVOUS_TIMEOUT``); ``timeout_minutes`` bounds the collectives
    after that.

    Raises:
        LaunchError: GPUs allotted but CUDA unusable with ``device=auto``, or an existing default process group
            with another backend (both before any process group is created or any collective runs); a rendezvous
            that does not complete in time or a process group that cannot be created after it (one line with
            the address, the launch variables and the fix).
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
            _init_default_group(backend, env, dev, timeout)
            # the address detect_launch_env chose (Slurm's first node, 127.0.0.1:29500) for code reading env://
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
    return build_groups(dist.get_rank(), dist.get_world_size(), tp_size, dev, backend)


def destroy_parallel() -> None:
    """Tear down torch.distributed if it is up."""
    if dist.is_initialized():
        dist.destroy_process_group()
