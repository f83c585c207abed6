"""Stop requests: SIGTERM / SIGUSR1 from the scheduler (Slurm sends them before preemption or the time
limit, e.g. ``#SBATCH --signal=USR1@120``) and SIGINT (Ctrl-C) from a user. The first one only sets a flag; the loop checks it after each
step, all ranks agree (MAX all-reduce), a checkpoint is saved and the process exits with code 4. A second
signal of the same kind is handled as it would be without this module."""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from ..parallel import collectives as C

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Install handlers for :data:`STOP_SIGNALS`; ``requested(group)`` is True on every rank once any
    rank has received one (collective)."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        # a second signal of the same kind acts as usual (kills the process), e.g. when a rank is stuck in a
        # collective with a dead peer, or the launcher escalates
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def requested(self, group, device) -> bool:
        flag = torch.tensor([0 if self.signal is None else int(self.signal)], dtype=torch.int64, device=device)
        C.all_reduce(flag, group, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())
        return bool(flag.item())

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
