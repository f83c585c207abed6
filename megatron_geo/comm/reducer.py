"""The reducer seam: how a bucket's FP32 gradient buffer is averaged over the DP group.

Every reducer implements the same two collectives on a flat buffer of ``dp_size * chunk`` FP32
elements laid out by :mod:`megatron_geo.distributed.shard_plan`:

- ``reduce_scatter(buf)``: afterwards chunk ``dp_rank`` of ``buf`` holds the DP average of that chunk.
- ``all_reduce(buf)``: afterwards all of ``buf`` holds the DP average, bitwise identical on every rank
  (implemented as reduce-scatter + all-gather of the averaged shard, so the result cannot differ).

The averaging (sum, then ``/ dp_size``) happens exactly once, in FP32 (DESIGN.md section 3, invariant 1).
``bytes_sent`` counts what this rank itself puts on the wire, from the sizes of the tensors handed
to the collectives: a reduce-scatter, all-to-all or all-gather of a ``dp * chunk`` buffer sends
``(dp - 1) * chunk`` elements per rank (ring algorithm; exact for all-to-all).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .collectives import all_gather_flat, reduce_scatter_flat


class PendingReduction:
    """An in-flight reduction; ``wait()`` finishes it (waits for the collectives, runs the epilogue)."""

    def __init__(self, work, epilogue: Callable[[], None] | None = None):
        self._work, self._epilogue, self._done = work, epilogue, False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._epilogue is not None:
            self._epilogue()
        self._done = True


class Reducer:
    """Base class. Subclasses set ``wire_dtype`` and implement :meth:`_reduce_scatter`."""

    name = "base"
    wire_dtype: torch.dtype = torch.float32

    def __init__(self, dp_group, dp_size: int, dp_rank: int):
        self.group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.bytes_sent = 0

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, chunk_numel: int, dtype: torch.dtype) -> None:
        self.bytes_sent += (self.dp_size - 1) * chunk_numel * torch.empty((), dtype=dtype).element_size()

    def reset_bytes(self) -> int:
        """Return the bytes sent since the last reset and start counting again."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    # -- collectives --------------------------------------------------------------------------------
    def _chunk(self, buf: torch.Tensor) -> torch.Tensor:
        c = buf.numel() // self.dp_size
        return buf[self.dp_rank * c:(self.dp_rank + 1) * c]

    def _check(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.float32 or buf.dim() != 1 or buf.numel() % self.dp_size:
            raise ValueError(f"reducer expects a flat float32 buffer of dp_size x chunk elements, got "
                             f"{buf.dtype} {tuple(buf.shape)} with dp_size={self.dp_size}")

    def register_bucket(self, key: int, offsets: list[int], numels: list[int], chunk: int, device) -> None:
        """Tell the reducer the layout of bucket ``key`` (parameter offsets/sizes, chunk). Stateless here."""

    def alignment(self) -> int:
        """Chunk sizes must be a multiple of this many elements."""
        return 1

    def reduce_scatter(self, buf: torch.Tensor, key=None, async_op: bool = True) -> PendingReduction:
        """Average ``buf`` (FP32, ``[dp_size * chunk]``) over DP into this rank's chunk, in place.

        ``key`` names the bucket (see :meth:`register_bucket`) for reducers with per-bucket state.
        """
        self._check(buf)
        if self.dp_size == 1:
            return PendingReduction(None)
        pending = self._reduce_scatter(buf, key)
        if not async_op:
            pending.wait()
        return pending

    def _reduce_scatter(self, buf: torch.Tensor, key=None) -> PendingReduction:
        raise NotImplementedError

    def all_reduce(self, buf: torch.Tensor, key=None, async_op: bool = True) -> PendingReduction:
        """Average all of ``buf`` over DP in place; every rank ends bitwise identical."""
        self._check(buf)
        if self.dp_size == 1:
            return PendingReduction(None)
        rs = self._reduce_scatter(buf, key)

        def gather() -> None:
            rs.wait()
            shard = self._chunk(buf).to(self.wire_dtype)
            out = torch.empty(buf.numel(), dtype=self.wire_dtype, device=buf.device)
            all_gather_flat(out, shard, group=self.group)
            self._count(shard.numel(), self.wire_dtype)
            buf.copy_(out)

        pending = PendingReduction(None, gather)
        if not async_op:
            pending.wait()
        return pending


class FP32Reducer(Reducer):
    """Reduce-scatter in FP32 (the collective's own sum), then ``/ dp_size``."""

    name = "fp32"
    wire_dtype = torch.float32

    def _reduce_scatter(self, buf, key=None):
        out = torch.empty(buf.numel() // self.dp_size, dtype=torch.float32, device=buf.device)
        work = reduce_scatter_flat(out, buf, group=self.group, async_op=True)
        self._count(out.numel(), torch.float32)

        def epilogue():
            self._chunk(buf).copy_(out).div_(self.dp_size)

        return PendingReduction(work, epilogue)


class CastReducer(Reducer):
    """Cast to ``wire_dtype`` -> all-to-all -> upcast -> sum over ranks in FP32 -> ``/ dp_size``.

    The collective only moves bytes; the sum is ours, in FP32, in rank order, so it is deterministic
    and never re-rounds in the wire format (unlike a ring reduce in BF16/FP8).
    """

    name = "cast"

    def __init__(self, dp_group, dp_size, dp_rank, wire_dtype: torch.dtype):
        super().__init__(dp_group, dp_size, dp_rank)
        self.wire_dtype = wire_dtype

    def _reduce_scatter(self, buf, key=None):
        send = buf.to(self.wire_dtype)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self._count(send.numel() // self.dp_size, self.wire_dtype)

        def epilogue():
            parts = recv.view(self.dp_size, -1).float()
            self._chunk(buf).copy_(parts.sum(dim=0)).div_(self.dp_size)

        return PendingReduction(work, epilogue)


def build_reducer(comm, dp_group, dp_size: int, dp_rank: int, seed: int = 0, device=None) -> Reducer:
    """The reducer for a ``comm`` config section (or just a ``comm.dtype`` string).

    fp32 -> :class:`FP32Reducer`; bf16 -> :class:`CastReducer`; fp8_e4m3 / fp8_e5m2 / nvfp4 ->
    :class:`~megatron_geo.comm.lowp.LowPrecisionReducer` with the section's scaling, rounding, error
    feedback, transform and scale sync.

    Raises:
        ValueError: an unknown ``comm.dtype``.
    """
    dtype = comm if isinstance(comm, str) else comm.dtype
    plain = isinstance(comm, str) or comm.transform == "none"
    if dtype == "fp32" and plain:
        return FP32Reducer(dp_group, dp_size, dp_rank)
    if dtype == "bf16" and plain:
        r = CastReducer(dp_group, dp_size, dp_rank, torch.bfloat16)
        r.name = "bf16"
        return r
    if dtype in ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"):
        from .lowp import LowPrecisionReducer

        kw = {} if isinstance(comm, str) else dict(
            scaling=comm.scaling, block_size=comm.block_size, rounding=comm.rounding,
            error_feedback=comm.error_feedback, transform=comm.transform, hadamard_block=comm.hadamard_block,
            scale_sync=comm.scale_sync)
        return LowPrecisionReducer(dp_group, dp_size, dp_rank, dtype, seed=seed, device=device, **kw)
    raise ValueError(f"comm.dtype={dtype!r} is not supported; choose fp32, bf16, fp8_e4m3, fp8_e5m2 or nvfp4")
