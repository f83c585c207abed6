"""The reducer seam: how a bucket's FP32 gradient buffer is averaged over the DP group.

Every reducer implements the same two collectives on a flat FP32 bucket buffer laid out by
:mod:`megatron_geo.distributed.shard_plan`: DP rank r owns the range ``[bounds[r], bounds[r + 1])``
(equal chunks in an even plan, uneven ranges with whole-parameter ownership), registered per bucket with
:meth:`Reducer.register_bucket`:

- ``reduce_scatter(buf)``: afterwards this rank's range of ``buf`` holds the DP average of that range.
- ``all_reduce(buf)``: afterwards all of ``buf`` holds the DP average, bitwise identical on every rank
  (implemented as reduce-scatter + all-gather of the averaged shard, so the result cannot differ; even
  plans only).

The averaging (sum, then ``/ dp_size``) happens exactly once, in FP32 (``docs/design.md``, "Invariants of the
reduction path", 1).
``bytes_sent`` counts what this rank itself puts on the wire, from the sizes of the tensors handed
to the collectives: a reduce-scatter, all-to-all or all-gather of a bucket of S elements sends
``S - own`` elements per rank, ``own`` being this rank's range (ring algorithm; exact for all-to-all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..parallel import collectives as C
from ..parallel.trace import NO_RANGE, trace_range


class PendingReduction:
    """An in-flight reduction; ``wait()`` finishes it (waits for the collectives, runs the epilogue)."""

    def __init__(self, work, epilogue: Callable[[], None] | None = None):
        self._work, self._epilogue, self._done = work, epilogue, False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            with trace_range("collective"):
                self._work.wait()
        if self._epilogue is not None:
            self._epilogue()
        self._done = True


class GradientReducer(Protocol):
    """What the gradient sync, the distributed optimizer, the checkpoint and the trainer call on a reducer.

    ``name``: the ``comm.dtype`` it implements; ``bytes_sent``: bytes this rank put on the wire since the last
    :meth:`reset_bytes`; ``telemetry``: ``None``, or while armed (``comm.telemetry_interval``) a list that each
    reduction appends ``(name, numerator, denominator)`` device scalars to; ``geo``: the GeoFP8 state whose
    transforms the reducer applies (``geometry.GeoState``), or ``None``.
    """

    name: str
    bytes_sent: int
    telemetry: list | None

    @property
    def geo(self): ...

    def alignment(self) -> int: ...

    def register_bucket(self, key: int, offsets: list[int], numels: list[int], bounds, device) -> None: ...

    def reduce_scatter(self, buf: torch.Tensor, key=None, async_op: bool = True) -> PendingReduction: ...

    def all_reduce(self, buf: torch.Tensor, key=None, async_op: bool = True) -> PendingReduction: ...

    def reset_bytes(self) -> int: ...

    def reset_error_feedback(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class Reducer:
    """Base class of every :class:`GradientReducer`. Subclasses set ``wire_dtype`` and implement
    :meth:`_reduce_scatter`; stateful ones override :meth:`state_dict` / :meth:`load_state_dict`."""

    name = "base"
    wire_dtype: torch.dtype = torch.float32
    telemetry: list | None = None  # only reducers with a low-precision codec append to it

    def __init__(self, dp_group, dp_size: int, dp_rank: int):
        self.group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.bytes_sent = 0
        self.bounds: dict[int, list[int]] = {}

    # -- state ----------------------------------------------------------------------------------------
    @property
    def geo(self):
        """The GeoFP8 state (``geometry.GeoState``) whose transforms this reducer applies, or ``None``."""
        return None

    def reset_error_feedback(self) -> None:
        """Zero the error-feedback residuals (after a skipped step); a no-op for reducers without any."""

    def state_dict(self) -> dict:
        """The reducer's own training state: ``{"residuals": {bucket key: FP32 [bucket numel]}}`` (error
        feedback, in the coordinates that are quantised) and ``"generator"`` (uint8 stochastic-rounding generator
        state) where it has them. Tensors are references to the live state (as ``nn.Module.state_dict``)."""
        return {}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` returned (copied in; absent entries keep their current value).

        Raises:
            KeyError: ``sd`` names a bucket this reducer has no residual for.
            ValueError: a residual's size differs from the registered bucket's.
        """
        if sd.get("residuals"):
            raise KeyError(
                f"{self.name} reducer keeps no error-feedback residuals; got buckets {sorted(sd['residuals'])}"
            )

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, chunk_numel: int, dtype: torch.dtype) -> None:
        self.bytes_sent += (self.dp_size - 1) * chunk_numel * dtype.itemsize

    def reset_bytes(self) -> int:
        """Return the bytes sent since the last reset and start counting again."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    # -- layout --------------------------------------------------------------------------------------
    def _bounds(self, buf: torch.Tensor, key) -> list[int]:
        b = self.bounds.get(key)
        if b is None:  # an unregistered buffer: even chunks
            c = buf.numel() // self.dp_size
            return [r * c for r in range(self.dp_size + 1)]
        return b

    def _chunk(self, buf: torch.Tensor, key=None) -> torch.Tensor:
        """This rank's range of ``buf``."""
        b = self._bounds(buf, key)
        return buf[b[self.dp_rank] : b[self.dp_rank + 1]]

    def _even(self, buf: torch.Tensor, key) -> bool:
        b = self._bounds(buf, key)
        return all(b[r + 1] - b[r] == b[1] - b[0] for r in range(self.dp_size))

    def _check(self, buf: torch.Tensor, key=None) -> None:
        if buf.dtype != torch.float32 or buf.dim() != 1:
            raise ValueError(f"reducer expects a flat float32 buffer, got {buf.dtype} {tuple(buf.shape)}")
        b = self.bounds.get(key)
        if b is None and buf.numel() % self.dp_size:
            raise ValueError(
                f"reducer expects a flat float32 buffer of dp_size x chunk elements, got "
                f"{buf.dtype} {tuple(buf.shape)} with dp_size={self.dp_size}"
            )
        if b is not None and b[-1] != buf.numel():
            raise ValueError(f"bucket {key!r} was registered with {b[-1]} elements but the buffer has {buf.numel()}")

    def register_bucket(self, key: int, offsets: list[int], numels: list[int], bounds, device) -> None:
        """Tell the reducer the layout of bucket ``key``: parameter offsets/sizes and the rank ranges.

        ``bounds``: ``dp_size + 1`` range boundaries (rank r owns ``[bounds[r], bounds[r + 1])``), or an
        int ``chunk`` for an even plan (``bounds[r] = r * chunk``).
        """
        if isinstance(bounds, int):
            bounds = [r * bounds for r in range(self.dp_size + 1)]
        if len(bounds) != self.dp_size + 1 or bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"bucket {key}: bounds {bounds[:4]}... must be {self.dp_size + 1} non-decreasing offsets starting at 0"
            )
        self.bounds[key] = list(bounds)

    def alignment(self) -> int:
        """Every rank's range must be a multiple of this many elements."""
        return 1

    def _cast_range(self, name: str):
        """The ``encode`` / ``decode`` range of a plain cast to the wire dtype: none for an FP32 wire (no cast)."""
        return NO_RANGE if self.wire_dtype == torch.float32 else trace_range(name)

    def _count_sent(self, buf: torch.Tensor, key, dtype: torch.dtype) -> None:
        """This rank sends every range but its own (reduce, all-to-all, ring reduce-scatter or gather)."""
        own = self._chunk(buf, key).numel()
        self.bytes_sent += (buf.numel() - own) * dtype.itemsize

    def reduce_scatter(self, buf: torch.Tensor, key=None, async_op: bool = True) -> PendingReduction:
        """Average ``buf`` (FP32, ``[buffer_numel]``) over DP into this rank's range, in place.

        ``key`` names the bucket (see :meth:`register_bucket`); an unregistered key means even chunks.
        """
        self._check(buf, key)
        if self.dp_size == 1:
            return PendingReduction(None)
        pending = self._reduce_scatter(buf, key)
        if not async_op:
            pending.wait()
        return pending

    def _reduce_scatter(self, buf: torch.Tensor, key=None) -> PendingReduction:
        raise NotImplementedError

    def all_reduce(self, buf: torch.Tensor, key=None, async_op: bool = True) -> PendingReduction:
        """Average all of ``buf`` over DP in place; every rank ends bitwise identical.

        Raises:
            ValueError: bucket ``key`` has uneven ranges (use the even plan without the distributed optimizer).
        """
        self._check(buf, key)
        if self.dp_size == 1:
            return PendingReduction(None)
        if not self._even(buf, key):
            raise ValueError(f"all_reduce needs an even plan; bucket {key} has uneven ranges")
        rs = self._reduce_scatter(buf, key)

        def gather() -> None:
            rs.wait()
            with self._cast_range("encode"):
                shard = self._chunk(buf, key).to(self.wire_dtype)
            out = torch.empty(buf.numel(), dtype=self.wire_dtype, device=buf.device)
            with trace_range("collective"):
                C.all_gather_into(out, shard, self.group)
            self._count(shard.numel(), self.wire_dtype)
            with self._cast_range("decode"):
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
        self._count_sent(buf, key, torch.float32)
        if not self._even(buf, key):  # whole-parameter ownership: one reduce per owner range, in place
            with trace_range("collective"):
                work = C.reduce_ranges(buf, self._bounds(buf, key), self.group, async_op=True)
            return PendingReduction(work, lambda: self._chunk(buf, key).div_(self.dp_size))
        out = torch.empty(buf.numel() // self.dp_size, dtype=torch.float32, device=buf.device)
        with trace_range("collective"):
            work = C.reduce_scatter_into(out, buf, self.group, async_op=True)

        def epilogue():
            self._chunk(buf, key).copy_(out).div_(self.dp_size)

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
        bounds = self._bounds(buf, key)
        own = self._chunk(buf, key)
        with trace_range("encode"):
            send = buf.to(self.wire_dtype)
        recv = torch.empty(self.dp_size * own.numel(), dtype=self.wire_dtype, device=buf.device)
        sizes = [bounds[r + 1] - bounds[r] for r in range(self.dp_size)]
        with trace_range("collective"):
            work = C.all_to_all_single(recv, send, self.group, [own.numel()] * self.dp_size, sizes, async_op=True)
        self._count_sent(buf, key, self.wire_dtype)

        def epilogue():  # the FP32 sum accumulates straight from the wire dtype (no FP32 copy of recv)
            with trace_range("decode"):
                torch.sum(recv.view(self.dp_size, -1), dim=0, dtype=torch.float32, out=own)
                own.div_(self.dp_size)

        return PendingReduction(work, epilogue)
