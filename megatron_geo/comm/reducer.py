"""The reducer seam: how a bucket's FP32 gradient buffer is averaged over the DP group.

Every reducer implements the same two collectives on a flat FP32 bucket buffer laid out by
:mod:`megatron_geo.distributed.shard_plan`: DP rank r owns the range ``[bounds[r], bounds[r + 1])``
(equal chunks in an even plan, uneven ranges with whole-parameter ownership), registered per bucket with
:meth:`Reducer.register_bucket`, which returns the bucket's :class:`BucketReduction` (its layout and the reducer's
state for it) for the collectives:

- ``reduce_scatter(buf, bucket)``: afterwards this rank's range of ``buf`` holds the DP average of that range.
- ``all_reduce(buf, bucket)``: afterwards all of ``buf`` holds the DP average, bitwise identical on every rank
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..parallel import collectives as C
from ..parallel.trace import NO_RANGE, trace_range

if TYPE_CHECKING:
    from .scale_layout import ScaleLayout


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


@dataclass(eq=False)
class BucketReduction:
    """One registered bucket: its layout and the reducer's state for it, made by :meth:`Reducer.register_bucket`
    and handed to :meth:`Reducer.reduce_scatter` / :meth:`Reducer.all_reduce` to select the bucket. The reducer
    keeps it under ``key`` too (its checkpoint entries and persistent tensors are named by that key).

    Attributes:
        key: int, the bucket's key (the training bucket's ``index``).
        offsets: list[int], each parameter's start in the bucket buffer (elements).
        numels: list[int], each parameter's number of elements.
        bounds: list[int], ``dp_size + 1`` non-decreasing range boundaries from 0; DP rank r owns
            ``[bounds[r], bounds[r + 1])`` and ``bounds[-1]`` is the buffer's numel.
        device: ``torch.device`` of the bucket buffer and of the state below.
        layout: the low-precision reducer's scale layout (:class:`~.scale_layout.ScaleLayout`, its segment tables
            on ``device``), else ``None``.
        residual: the low-precision reducer's error-feedback residual (FP32 ``[bounds[-1]]`` on ``device``, in the
            coordinates that are quantised; ``comm.error_feedback``), else ``None``.
    """

    key: int
    offsets: list[int]
    numels: list[int]
    bounds: list[int]
    device: torch.device
    layout: ScaleLayout | None = None
    residual: torch.Tensor | None = None

    @property
    def even(self) -> bool:
        """Every rank's range has the same length."""
        b = self.bounds
        return all(b[r + 1] - b[r] == b[1] - b[0] for r in range(len(b) - 1))


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

    def register_bucket(
        self, key: int, offsets: list[int], numels: list[int], bounds: list[int] | int, device
    ) -> BucketReduction: ...

    def reduce_scatter(
        self, buf: torch.Tensor, bucket: BucketReduction | int | None = None, async_op: bool = True
    ) -> PendingReduction: ...

    def all_reduce(
        self, buf: torch.Tensor, bucket: BucketReduction | int | None = None, async_op: bool = True
    ) -> PendingReduction: ...

    def reset_bytes(self) -> int: ...

    def reset_error_feedback(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class Reducer:
    """Base class of every :class:`GradientReducer`. Subclasses set ``wire_dtype`` and implement
    :meth:`_reduce_scatter`; stateful ones override :meth:`state_dict` / :meth:`load_state_dict`.

    ``registered``: bucket key -> its :class:`BucketReduction`, in registration order.
    """

    name = "base"
    wire_dtype: torch.dtype = torch.float32
    telemetry: list | None = None  # only reducers with a low-precision codec append to it

    def __init__(self, dp_group, dp_size: int, dp_rank: int):
        self.group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.bytes_sent = 0
        self.registered: dict[int, BucketReduction] = {}

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
    @property
    def bounds(self) -> dict[int, list[int]]:
        """Bucket key -> the registered bucket's range boundaries (``dp_size + 1`` ints), a new dict."""
        return {k: b.bounds for k, b in self.registered.items()}

    def _resolve(self, bucket: BucketReduction | int | None) -> BucketReduction | None:
        """The registered bucket that ``bucket`` names: the object itself, or the one registered under an int key;
        ``None`` for ``None`` or an unregistered key (a buffer of even chunks).

        Raises:
            ValueError: a :class:`BucketReduction` that is not the one this reducer registered under its key.
        """
        if bucket is None:
            return None
        if isinstance(bucket, BucketReduction):
            if self.registered.get(bucket.key) is not bucket:
                raise ValueError(f"bucket {bucket.key!r} was not registered with this {self.name} reducer")
            return bucket
        return self.registered.get(bucket)

    def _bounds(self, buf: torch.Tensor, rb: BucketReduction | None) -> list[int]:
        if rb is None:  # an unregistered buffer: even chunks
            c = buf.numel() // self.dp_size
            return [r * c for r in range(self.dp_size + 1)]
        return rb.bounds

    def _chunk(self, buf: torch.Tensor, rb: BucketReduction | None) -> torch.Tensor:
        """This rank's range of ``buf``."""
        b = self._bounds(buf, rb)
        return buf[b[self.dp_rank] : b[self.dp_rank + 1]]

    def _even(self, rb: BucketReduction | None) -> bool:
        return rb is None or rb.even

    def _check(self, buf: torch.Tensor, rb: BucketReduction | None) -> None:
        if buf.dtype != torch.float32 or buf.dim() != 1:
            raise ValueError(f"reducer expects a flat float32 buffer, got {buf.dtype} {tuple(buf.shape)}")
        if rb is None and buf.numel() % self.dp_size:
            raise ValueError(
                f"reducer expects a flat float32 buffer of dp_size x chunk elements, got "
                f"{buf.dtype} {tuple(buf.shape)} with dp_size={self.dp_size}"
            )
        if rb is not None and rb.bounds[-1] != buf.numel():
            raise ValueError(
                f"bucket {rb.key!r} was registered with {rb.bounds[-1]} elements but the buffer has {buf.numel()}"
            )

    def register_bucket(
        self, key: int, offsets: list[int], numels: list[int], bounds: list[int] | int, device
    ) -> BucketReduction:
        """Register the layout of bucket ``key`` and make the reducer's state for it.

        Args:
            key: int naming the bucket (the training bucket's ``index``); registering a key again replaces it.
            offsets, numels: each parameter's start in the bucket buffer and its number of elements (ints).
            bounds: ``dp_size + 1`` range boundaries (rank r owns ``[bounds[r], bounds[r + 1])``), or an int
                ``chunk`` for an even plan (``bounds[r] = r * chunk``).
            device: ``torch.device`` (or its name) of the bucket buffer.

        Returns:
            The bucket's :class:`BucketReduction`, to pass to :meth:`reduce_scatter` / :meth:`all_reduce`.

        Raises:
            ValueError: ``bounds`` are not ``dp_size + 1`` non-decreasing offsets starting at 0.
        """
        if isinstance(bounds, int):
            bounds = [r * bounds for r in range(self.dp_size + 1)]
        if len(bounds) != self.dp_size + 1 or bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"bucket {key}: bounds {bounds[:4]}... must be {self.dp_size + 1} non-decreasing offsets starting at 0"
            )
        rb = BucketReduction(key, list(offsets), list(numels), list(bounds), torch.device(device))
        self.registered[key] = rb
        return rb

    def alignment(self) -> int:
        """Every rank's range must be a multiple of this many elements."""
        return 1

    def _cast_range(self, name: str):
        """The ``encode`` / ``decode`` range of a plain cast to the wire dtype: none for an FP32 wire (no cast)."""
        return NO_RANGE if self.wire_dtype == torch.float32 else trace_range(name)

    def _count_sent(self, buf: torch.Tensor, rb: BucketReduction | None, dtype: torch.dtype) -> None:
        """This rank sends every range but its own (reduce, all-to-all, ring reduce-scatter or gather)."""
        own = self._chunk(buf, rb).numel()
        self.bytes_sent += (buf.numel() - own) * dtype.itemsize

    def reduce_scatter(
        self, buf: torch.Tensor, bucket: BucketReduction | int | None = None, async_op: bool = True
    ) -> PendingReduction:
        """Average ``buf`` (FP32, ``[buffer_numel]``) over DP into this rank's range, in place.

        ``bucket``: what :meth:`register_bucket` returned for ``buf``, or its int key; ``None`` or an unregistered
        key means even chunks (a low-precision reducer needs the bucket registered).

        Raises:
            ValueError: ``buf`` is not flat FP32 of the registered size (unregistered: of ``dp_size`` equal chunks),
                or ``bucket`` was registered with another reducer.
        """
        rb = self._resolve(bucket)
        self._check(buf, rb)
        if self.dp_size == 1:
            return PendingReduction(None)
        pending = self._reduce_scatter(buf, rb)
        if not async_op:
            pending.wait()
        return pending

    def _reduce_scatter(self, buf: torch.Tensor, rb: BucketReduction | None) -> PendingReduction:
        raise NotImplementedError

    def all_reduce(
        self, buf: torch.Tensor, bucket: BucketReduction | int | None = None, async_op: bool = True
    ) -> PendingReduction:
        """Average all of ``buf`` over DP in place; every rank ends bitwise identical. ``bucket`` as in
        :meth:`reduce_scatter`.

        Raises:
            ValueError: as :meth:`reduce_scatter`, or the bucket has uneven ranges (use the even plan without the
                distributed optimizer).
        """
        rb = self._resolve(bucket)
        self._check(buf, rb)
        if self.dp_size == 1:
            return PendingReduction(None)
        if not self._even(rb):
            raise ValueError(f"all_reduce needs an even plan; bucket {rb.key if rb else None} has uneven ranges")
        rs = self._reduce_scatter(buf, rb)

        def gather() -> None:
            rs.wait()
            with self._cast_range("encode"):
                shard = self._chunk(buf, rb).to(self.wire_dtype)
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

    def _reduce_scatter(self, buf, rb):
        self._count_sent(buf, rb, torch.float32)
        if not self._even(rb):  # whole-parameter ownership: one reduce per owner range, in place
            with trace_range("collective"):
                work = C.reduce_ranges(buf, self._bounds(buf, rb), self.group, async_op=True)
            return PendingReduction(work, lambda: self._chunk(buf, rb).div_(self.dp_size))
        out = torch.empty(buf.numel() // self.dp_size, dtype=torch.float32, device=buf.device)
        with trace_range("collective"):
            work = C.reduce_scatter_into(out, buf, self.group, async_op=True)

        def epilogue():
            self._chunk(buf, rb).copy_(out).div_(self.dp_size)

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

    def _reduce_scatter(self, buf, rb):
        bounds = self._bounds(buf, rb)
        own = self._chunk(buf, rb)
        with trace_range("encode"):
            send = buf.to(self.wire_dtype)
        recv = torch.empty(self.dp_size * own.numel(), dtype=self.wire_dtype, device=buf.device)
        sizes = [bounds[r + 1] - bounds[r] for r in range(self.dp_size)]
        with trace_range("collective"):
            work = C.all_to_all_single(recv, send, self.group, [own.numel()] * self.dp_size, sizes, async_op=True)
        self._count_sent(buf, rb, self.wire_dtype)

        def epilogue():  # the FP32 sum accumulates straight from the wire dtype (no FP32 copy of recv)
            with trace_range("decode"):
                torch.sum(recv.view(self.dp_size, -1), dim=0, dtype=torch.float32, out=own)
                own.div_(self.dp_size)

        return PendingReduction(work, epilogue)
