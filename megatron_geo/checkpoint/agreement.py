"""Rank agreement around the collective steps of a checkpoint save or load.

A checkpoint save or load is a chain of collectives (DCP's plan and write/read exchanges, the parameter
all-gather, barriers) with local work in between: building the state dict, reading metadata, writing
``meta.json`` on rank 0. When one rank raises in such local work and leaves, the others wait in the next
collective until the process group's timeout. So every local phase ends in :func:`agree`: each rank says
whether it failed (one small all-gather of ``int64`` flags on the group's device) and, when any did, the
lowest failing rank's error is broadcast and *every* rank raises the same :class:`CheckpointRankError`;
the callers turn that into the documented exit code (see :mod:`megatron_geo.training.checkpointing`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..parallel import collectives as C

MESSAGE_BYTES = 1024  # UTF-8 bytes of the failing rank's error that reach the other ranks
KINDS = {1: "value", 2: "io", 3: "internal"}


class CheckpointRankError(RuntimeError):
    """A rank failed in a local phase of a collective checkpoint save or load; raised on every rank alike.

    Attributes:
        rank: the lowest global rank that failed.
        failed: how many ranks failed.
        kind: ``"value"`` (the failing rank raised ``ValueError``: the checkpoint does not fit this run, the
            message names the mismatch), ``"io"`` (``OSError`` or a DCP failure: a file could not be read or
            written), ``"internal"`` (any other exception).
        error_type: the class name of the failing rank's exception.
        message: its message (at most ``MESSAGE_BYTES`` bytes of UTF-8).
        phase: what the ranks were doing (e.g. ``"building the state dict"``).
    """

    def __init__(self, rank: int, failed: int, kind: str, error_type: str, message: str, phase: str):
        self.rank, self.failed, self.kind = rank, failed, kind
        self.error_type, self.message, self.phase = error_type, message, phase
        others = f" (and on {failed - 1} other rank(s))" if failed > 1 else ""
        super().__init__(f"{phase} failed on rank {rank}{others}: {error_type}: {message}")


def error_kind(err: BaseException) -> int:
    """The code of :data:`KINDS` for an exception."""
    if isinstance(err, ValueError):
        return 1
    if isinstance(err, (OSError, CheckpointException)):
        return 2
    return 3


def all_gather_ints(values: list[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank of ``group``), in group rank order.

    One all-gather of an ``int64`` tensor on ``device`` (the rank's ``pctx.device``: CUDA for NCCL, CPU for
    gloo) and one host read. Collective over ``group``.
    """
    n = len(values)
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.zeros(world * n, dtype=torch.int64, device=device)
    C.all_gather_into(out, mine, group)
    flat = out.tolist()
    return [flat[r * n : (r + 1) * n] for r in range(world)]


def _encode(text: str) -> bytes:
    data = text.encode("utf-8")[:MESSAGE_BYTES]
    return data.decode("utf-8", errors="ignore").encode("utf-8")  # never half a character


def _broadcast_text(text: str | None, group, group_src: int, device: torch.device) -> str:
    """``text`` of the rank with index ``group_src`` in ``group`` on every rank (collective; UTF-8 bytes in a
    ``uint8 [MESSAGE_BYTES + 2]`` tensor on ``device``, the first two bytes hold the length)."""
    buf = torch.zeros(MESSAGE_BYTES + 2, dtype=torch.uint8, device=device)
    if text is not None:
        data = _encode(text)
        payload = torch.tensor([len(data) // 256, len(data) % 256, *data], dtype=torch.uint8, device=device)
        buf[: payload.numel()].copy_(payload)
    C.broadcast(buf, group, group_src)
    host = buf.tolist()
    n = host[0] * 256 + host[1]
    return bytes(host[2 : 2 + n]).decode("utf-8", errors="replace")


def agree(error: BaseException | None, group, device: torch.device, phase: str) -> None:
    """End a local phase of a collective checkpoint step: raise on every rank when any rank failed.

    Collective over ``group`` (every rank calls it once per phase, in the same order). ``error`` is this
    rank's exception of the phase (None when it succeeded); ``device`` is ``pctx.device``.

    Raises:
        CheckpointRankError: on every rank when any rank passed an error (chained to ``error`` on the ranks
            that failed), naming the lowest failing rank and its error.
    """
    flags = all_gather_ints([0 if error is None else error_kind(error)], group, device)
    failed = [r for r, (f,) in enumerate(flags) if f]
    if not failed:
        return
    first = failed[0]
    me = dist.get_rank(group)
    text = None
    if me == first:
        text = f"{type(error).__name__}\n{(str(error).strip() or type(error).__name__)}"
    text = _broadcast_text(text, group, first, device)
    error_type, _, message = text.partition("\n")
    raise CheckpointRankError(
        dist.get_global_rank(group, first), len(failed), KINDS[flags[first][0]], error_type, message, phase
    ) from error
