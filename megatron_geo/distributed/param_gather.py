"""The quantised parameter all-gather of the distributed optimizer (``comm.param_gather=fp8`` or ``nvfp4``).

The plain gather sends every owner's new parameters (its FP32 main params rounded to the model's parameter dtype) to
every replica. The quantised gather sends, per bucket, the *difference* between those new parameters ("target") and
what every replica holds now ("held": the bucket's parameter buffer, bitwise the same on every DP rank), in blocks of
128 elements with one scale each (:mod:`megatron_geo.comm.param_codec`), and every replica, the owner's included,
adds the same decoded difference to its held parameters, rounded to the parameter dtype:

    d = target - held            (owner, FP32, its own range)
    held <- round(held + D(Q(d)))  (every DP rank, every range, the same bytes and the same ops)

Hence the replicas stay bitwise equal (checked at log steps with a digest compared over the DP group,
:meth:`QuantizedParamGather.report`), and the quantisation error does not accumulate: the next step's difference
carries what this step's left behind (error feedback by construction, no residual to keep). The held parameters
differ from the rounded main params by about one step's quantisation error; :attr:`QuantizedParamGather.max_ulps`
tracks the largest deviation, in BF16 units in the last place (see :meth:`QuantizedParamGather.finish`). A
checkpoint saves the held parameters (``megatron_geo/checkpoint/state.py``) so that a resume continues bitwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.param_codec import GATHER_BLOCK, GatherCodec, bf16_ulp
from ..parallel import ParallelContext
from ..parallel import collectives as C
from .buckets import Bucket

_DIGEST_MOD = 2**31 - 1  # digests are sums of products below 2**62, reduced modulo this prime
_DIGEST_CHUNK = 1 << 14  # blocks per digest pass (bounds its int64 temporary to 16 MiB)
_HASH = 2654435761  # Knuth's multiplicative hash constant: block index -> digest weight


class ReplicaMismatchError(RuntimeError):
    """The DP replicas of a bucket's parameters are not bitwise equal (their digests differ)."""


class PendingGather:
    """An in-flight gather of one bucket; ``wait()`` waits for its collective, then runs ``finish`` (once)."""

    def __init__(self, work, finish: Callable[[], None]):
        self._work, self._finish, self._done = work, finish, False

    def wait(self) -> bool:
        if not self._done:
            self._work.wait()
            self._finish()
            self._done = True
        return True


class QuantizedParamGather:
    """The encode / gather / decode of the quantised parameter difference, bucket by bucket.

    A gather's records (every rank's, ``record_bytes`` per 128 elements of the bucket) live from :meth:`start` to
    :meth:`finish` only: with the overlapped gather, from the update to the bucket's first use in the next forward,
    never through backward. Nothing but the running deviation is kept between steps.

    Args:
        codec: the ``comm.param_gather`` codec (:data:`megatron_geo.comm.param_codec.GATHER_CODECS`).
        buckets: the optimizer's buckets; every parameter offset and rank bound a multiple of 128 elements.
        pctx: the parallel context (DP group and rank, device).

    Attributes:
        byte_bounds: per bucket index, the ``dp + 1`` byte offsets of the ranks' records (python ints).
        max_ulps: float64 ``[]`` on the device: the largest deviation of this rank's owned held parameters from
            their target since the start of the launch, in BF16 ulps (see :meth:`finish`).
        bytes_sent: bytes this rank put on the wire since the last :meth:`reset_bytes` (``S - own`` record bytes
            per bucket and gather, as the ring all-gather sends).

    Raises:
        ValueError: a parameter offset or a rank bound of a bucket is not a multiple of 128 (plan the buckets with
            the alignment of :func:`megatron_geo.comm.param_codec.param_gather_alignment`).
    """

    def __init__(self, codec: GatherCodec, buckets: list[Bucket], pctx: ParallelContext):
        self.codec, self.pctx = codec, pctx
        self.byte_bounds: dict[int, list[int]] = {}
        dev = buckets[0].param_data.device if buckets else pctx.device
        for b in buckets:
            bad = [x for x in (*b.plan.bounds, *b.plan.offsets) if x % GATHER_BLOCK]
            if bad:
                raise ValueError(
                    f"bucket {b.index}: offset or rank bound {bad[0]} is not a multiple of {GATHER_BLOCK} elements; "
                    f"comm.param_gather={codec.name} needs the buckets planned with that alignment"
                )
            self.byte_bounds[b.index] = [x // GATHER_BLOCK * codec.record_bytes for x in b.plan.bounds]
        g = torch.Generator(device="cpu").manual_seed(999)
        self._elem_weights = torch.randint(1, 2**31, (GATHER_BLOCK * 2,), generator=g, device="cpu").to(dev)
        self.max_ulps = torch.zeros((), dtype=torch.float64, device=dev)
        self.bytes_sent = 0

    # -- one bucket's gather ------------------------------------------------------------------------------------------
    def start(self, b: Bucket, owned: list[tuple[int, torch.Tensor]]) -> PendingGather:
        """Encode this rank's difference for bucket ``b`` and start the gather of every rank's records.

        Args:
            b: the bucket (its ``param_data`` holds the replicas' current parameters).
            owned: ``(buffer_start, FP32 main param)`` of every piece of ``b`` this rank owns (its new parameters).

        Returns:
            The pending gather; its ``wait()`` applies the decoded differences (:meth:`finish`).
        """
        r = self.pctx.dp_rank
        lo, hi = b.plan.bounds[r], b.plan.bounds[r + 1]
        held = b.param_data[lo:hi]
        target = held.clone()
        for start, main in owned:
            target[start - lo : start - lo + main.numel()].copy_(main.reshape(-1))
        # every range of the records is written by the gather (this rank's by the encode)
        records = torch.empty(
            b.plan.buffer_numel // GATHER_BLOCK, self.codec.record_bytes, dtype=torch.uint8, device=held.device
        )
        own = records[lo // GATHER_BLOCK : hi // GATHER_BLOCK]
        if hi > lo:
            d = target.float() - held.float()
            self.codec.encode_into(d.view(-1, GATHER_BLOCK), own)
        self.bytes_sent += records.numel() - own.numel()
        work = C.all_gather_ranges(records.view(-1), self.byte_bounds[b.index], self.pctx.dp_group, async_op=True)
        return PendingGather(work, lambda: self.finish(b, records, target))

    def finish(self, b: Bucket, records: torch.Tensor, target: torch.Tensor) -> None:
        """Add every range's decoded difference to ``b``'s held parameters (rounded to their dtype) and fold this
        rank's deviation into :attr:`max_ulps`.

        The deviation of a 128-element block is ``max |held - target| / ulp(max |target|)``: BF16 ulps at the
        block's largest magnitude, the unit the block's scale is set in (an element near zero, whose own ulp is
        tiny, is measured against its block's, not its own). ``target`` is this rank's range of new parameters in
        the parameter dtype and ``records`` every rank's gathered records of ``b`` (:meth:`start`).
        """
        dec = self.codec.decode(records).view(-1)
        dec.add_(b.param_data)
        b.param_data.copy_(dec)
        r = self.pctx.dp_rank
        lo, hi = b.plan.bounds[r], b.plan.bounds[r + 1]
        if hi > lo:
            t = target.float().view(-1, GATHER_BLOCK)
            dev = (b.param_data[lo:hi].float().view(-1, GATHER_BLOCK) - t).abs().amax(dim=1)
            ulps = (dev.double() / bf16_ulp(t.abs().amax(dim=1))).amax()
            torch.maximum(self.max_ulps, ulps, out=self.max_ulps)

    def reset_bytes(self) -> int:
        """Return the bytes sent since the last reset and start counting again."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    # -- checks -------------------------------------------------------------------------------------------------------
    def digest(self, b: Bucket) -> torch.Tensor:
        """int64 ``[]`` on the device: a digest of the bits of ``b``'s parameter buffer, equal on two ranks when the
        buffers are bitwise equal (a position-weighted sum of its 16-bit halves modulo a prime: exact integer
        arithmetic, so the order of the sums cannot change it). No host sync."""
        halves = b.param_data.view(torch.int16).view(-1, GATHER_BLOCK * b.param_data.element_size() // 2)
        w = self._elem_weights[: halves.shape[1]]
        total = torch.zeros((), dtype=torch.int64, device=halves.device)
        for s in range(0, halves.shape[0], _DIGEST_CHUNK):
            h = halves[s : s + _DIGEST_CHUNK].to(torch.int64) & 0xFFFF
            rows = (h * w).sum(dim=1).remainder_(_DIGEST_MOD)  # < 2**31
            # a block's weight from its index (a multiplicative hash, < 2**31)
            idx = torch.arange(s, s + h.shape[0], dtype=torch.int64, device=h.device)
            bw = (idx * _HASH + 1).remainder_(_DIGEST_MOD) + 1
            total += (rows * bw).remainder_(_DIGEST_MOD).sum()
        return total.remainder_(_DIGEST_MOD)

    def report(self, buckets: list[Bucket]) -> dict:
        """``{"param_gather/max_ulps": float}``: :attr:`max_ulps`, the maximum over every rank (DP and TP), after
        checking that every bucket's parameters are bitwise equal on every DP rank. Collective over the DP group and
        (for the maximum) the world group; one host read. Call it with no gather in flight.

        Raises:
            ReplicaMismatchError: a bucket's digest differs between DP ranks (names the buckets).
        """
        pctx = self.pctx
        dig = (
            torch.stack([self.digest(b) for b in buckets])
            if buckets
            else torch.zeros(0, dtype=torch.int64, device=pctx.device)
        )
        both = torch.cat([dig, -dig])
        C.all_reduce(both, pctx.dp_group, op=dist.ReduceOp.MAX)
        worst = self.max_ulps.clone().view(1)
        C.all_reduce(worst, pctx.world_group, op=dist.ReduceOp.MAX)
        hi_lo = both.tolist()
        n = len(buckets)
        bad = [b.index for b, hi, neg_lo in zip(buckets, hi_lo[:n], hi_lo[n:]) if hi != -neg_lo]
        if bad:
            raise ReplicaMismatchError(
                f"the parameters of bucket(s) {bad} differ between DP ranks after the quantised parameter gather "
                f"(digest mismatch): every rank must decode the same records with the same code and device type"
            )
        return {"param_gather/max_ulps": float(worst.item())}
