"""Stop requests: SIGTERM / SIGUSR1 from the scheduler (Slurm sends them before preemption or the time
limit, e.g. ``#SBATCH --signal=USR1@120``) and SIGINT (Ctrl-C) from a user. The first one only sets a flag; the loop
checks it after each
step: every rank's flags ride on the step's gradient-norm all-reduce (:meth:`StopRequest.flags` /
:meth:`StopRequest.agree`, no collective or host read of their own), so all ranks agree, a checkpoint is saved and
the process exits with code 4. A second
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

    def flags(self) -> list[float]:
        """This rank's request as one count per signal of :data:`STOP_SIGNALS` (1 for the one received, else 0),
        to be summed over all ranks (``train_step(stop_flags=...)``)."""
        return [1.0 if self.signal == int(s) else 0.0 for s in STOP_SIGNALS]

    def agree(self, summed: list[float]) -> bool:
        """True on every rank when any rank received a stop signal; ``summed`` is :meth:`flags` summed over all
        ranks. A rank that got none takes the signal most ranks received (for the log line)."""
        if len(summed) != len(STOP_SIGNALS):
            raise ValueError(f"expected {len(STOP_SIGNALS)} summed stop flags, got {summed!r}")
        if not any(v > 0 for v in summed):
            return False
        if self.signal is None:
            self.signal = int(STOP_SIGNALS[max(range(len(summed)), key=lambda i: summed[i])])
        return True

    def requested(self, group, device) -> bool:
        """The same agreement as :meth:`agree` through its own MAX all-reduce and host read (collective), for
        callers outside the train step."""
        flag = torch.tensor([0 if self.signal is None else int(self.signal)], dtype=torch.int64, device=device)
        C.all_reduce(flag, group, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())
        return bool(flag.item())

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
