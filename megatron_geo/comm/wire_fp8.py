"""The scaled-FP8 wire format (OCP E4M3 / E5M2) of :class:`~megatron_geo.comm.lowp.LowPrecisionReducer`.

What travels: one uint8 code per element (torch's ``float8_e4m3fn`` / ``float8_e5m2`` casts of ``x / scale``,
:func:`.codecs.fp8_encode`) and one FP32 scale per scale segment (``amax / fp8_max``; a segment is a
parameter's piece of a rank range with ``scaling=tensor``, one ``block_size`` block with ``scaling=block``;
see :mod:`.scale_layout`).

How it is computed: every segment is a whole number of blocks of ``layout.granule`` elements, so a scale
reaches its elements as one value per block broadcast over a ``[blocks, granule]`` view; the amax is one
reduction per block followed by the layout's group max (whole tiles of one segment, then a scatter into the
groups: :mod:`.scale_layout`, which keeps no per-block table). Nothing has a
data-dependent shape and nothing syncs with the host; with ``comm.compile`` each step is one
``torch.compile`` graph (:mod:`.compiled`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .codecs import (
    FP8_FORMATS,
    dp_divisor,
    fp8_decode,
    fp8_encode,
    fp8_max,
    fp8_scale_from_amax,
    mean_over_sources,
)
from .compiled import maybe_compile
from .scale_layout import ScaleLayout


def block_amax(x: Tensor) -> Tensor:
    """``[nb]`` max ``|x|`` of each row of ``x`` ``[nb, granule]`` (NaN in a row gives NaN)."""
    return x.abs().amax(dim=1)


def _encoder(fmt: str):
    def encode(x: Tensor, scale: Tensor) -> Tensor:
        """uint8 codes ``[nb, granule]`` of float32 ``x`` ``[nb, granule]`` with one scale per row ``[nb]``."""
        return fp8_encode(x, scale.unsqueeze(1), fmt)

    return encode


def _encoder_ef(fmt: str):
    def encode_ef(x: Tensor, scale: Tensor, residual: Tensor) -> Tensor:
        """As ``encode``; also writes ``residual`` ``[nb, granule]`` = ``x - decode(codes)`` in place."""
        codes = fp8_encode(x, scale.unsqueeze(1), fmt)
        residual.copy_(x - fp8_decode(codes, scale.unsqueeze(1), fmt))
        return codes

    return encode_ef


def _decoder_sum(fmt: str):
    def decode_sum(codes: Tensor, scale: Tensor, out: Tensor, divisor: Tensor) -> Tensor:
        """Writes into float32 ``out`` ``[nb * granule]`` (and returns it) the mean over sources of ``codes``
        ``[dp, nb, granule]`` decoded with ``scale`` ``[dp, nb]`` (summed in FP32 in source order, then divided by
        ``divisor``, float32 ``[1]`` holding dp, once: :func:`.codecs.mean_over_sources`). ``out`` may be the
        bucket's own range: a compiled graph writes there directly."""
        mean_over_sources(fp8_decode(codes, scale.unsqueeze(2), fmt), divisor, out.view(codes.shape[1:]))
        return out

    return decode_sum


def _decoder(fmt: str):
    def decode(codes: Tensor, scale: Tensor) -> Tensor:
        """float32 ``[nb * granule]`` of ``codes`` ``[nb, granule]`` with one scale per row ``[nb]``."""
        return fp8_decode(codes, scale.unsqueeze(1), fmt).view(-1)

    return decode


class FP8Wire:
    """Encode / decode of bucket buffers in scaled FP8 (``fmt`` ``fp8_e4m3`` or ``fp8_e5m2``).

    ``rounding="stochastic"`` draws from ``generator`` and always runs eagerly (a generator cannot enter a
    compiled graph); ``compile`` applies to the rest.
    """

    def __init__(self, fmt: str, rounding: str, generator: torch.Generator | None, compile: bool):
        self.fmt, self.rounding, self.generator = fmt, rounding, generator
        # static: the granule (last dim of [nb, granule] views) and the DP size; the number of blocks varies
        self.amax = maybe_compile(block_amax, compile, {0: (1,)})
        self.encode = maybe_compile(_encoder(fmt), compile, {0: (1,)})
        self.encode_ef = maybe_compile(_encoder_ef(fmt), compile, {0: (1,), 2: (1,)})
        self.decode = maybe_compile(_decoder(fmt), compile, {0: (1,)})
        self.decode_sum = maybe_compile(_decoder_sum(fmt), compile, {0: (0, 2), 1: (0,)})

    def scales(self, amax: Tensor) -> Tensor:
        """FP32 scales ``amax / fp8_max`` (:func:`.codecs.fp8_scale_from_amax`)."""
        return fp8_scale_from_amax(amax, self.fmt)

    def _encode(self, x2: Tensor, bscale: Tensor, residual: Tensor | None) -> Tensor:
        if self.rounding == "stochastic":
            codes = fp8_encode(x2, bscale.unsqueeze(1), self.fmt, "stochastic", self.generator)
            if residual is not None:
                residual.copy_(x2 - fp8_decode(codes, bscale.unsqueeze(1), self.fmt))
            return codes
        if residual is not None:
            return self.encode_ef(x2, bscale, residual)
        return self.encode(x2, bscale)

    def encode_ranges(self, x: Tensor, layout: ScaleLayout, sync_amax=None, residual: Tensor | None = None):
        """Encode the whole buffer ``x`` ``[numel]`` for the reduce-scatter's all-to-all.

        Args:
            sync_amax: with ``comm.scale_sync=max``, a callable that MAX-reduces the per-group amax over DP.
            residual: the error-feedback residual ``[numel]`` (set to ``x - decode(codes)`` in place), or None.

        Returns:
            ``(codes, scales, shared)``: ``codes`` a list of ``(uint8 tensor, split sizes in bytes per
            destination rank)``; ``scales`` ``(float32 payload, split sizes per destination rank)``: the scales
            each rank needs to decode its range (:meth:`.scale_layout.ScaleLayout.scale_splits`), None with
            shared scales; ``shared`` the MAX-synchronised ``[dp, K]`` scales or None.
        """
        g = layout.granule
        x2 = x.view(-1, g)
        amax = layout.group_amax(self.amax(x2))
        if sync_amax is not None:
            amax = sync_amax(amax)
        seg = layout.segment_values(self.scales(amax))  # [dp, K]
        blocks = layout.block_values(seg)  # [num_blocks]
        encoded = self._encode(x2, blocks, None if residual is None else residual.view(-1, g))
        codes = [(encoded.view(-1), list(layout.sizes))]
        if sync_amax is not None:
            return codes, None, seg
        # block scaling: the per-block scales are the ranges' blocks back to back, what each destination needs
        send = blocks if layout.block_size is not None else seg.contiguous().view(-1)
        return codes, (send, layout.scale_splits()), None

    def roundtrip(self, x: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``decode(encode(x))`` of the whole buffer ``x`` ``[numel]`` with this rank's own scales (round to
        nearest; with shared scales, the local ones): what this rank's quantiser makes of its gradient."""
        g = layout.granule
        x2 = x.view(-1, g)
        seg = layout.segment_values(self.scales(layout.group_amax(self.amax(x2))))
        bscale = layout.block_values(seg)
        return self.decode(self.encode(x2, bscale), bscale)

    def decode_own(self, recv: list[Tensor], scales: Tensor, layout: ScaleLayout, r: int, out: Tensor) -> Tensor:
        """``out`` (FP32 ``[own]``, returned) <- the mean over sources of this rank's range ``r`` from the received
        codes ``recv[0]`` ``[dp * own]`` and every source's scales ``[dp, K']``, K' at least range r's segments
        (with block scaling the reducer sends exactly range r's blocks' scales, K' = ``layout.row_num_blocks(r)``)."""
        dp, g = scales.shape[0], layout.granule
        codes = recv[0].view(dp, -1, g)
        return self.decode_sum(codes, layout.row_block_values(scales, r), out, dp_divisor(dp, codes.device))

    def encode_chunk(self, x: Tensor, layout: ScaleLayout, r: int) -> Tensor:
        """Payload uint8 ``[1, bytes]`` of range ``r`` (``x``) for the all-gather stage of an all-reduce: its codes
        followed by its own per-segment scales ``[K]`` (amax of this range alone)."""
        g = layout.granule
        x2 = x.view(-1, g)
        seg = self.scales(layout.row_segment_amax(self.amax(x2), r))  # [K]
        codes = self._encode(x2, layout.row_block_values(seg, r), None)
        return torch.cat([codes.view(1, -1), seg.view(1, -1).view(torch.uint8)], dim=1)

    def decode_all(self, out: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``[numel]`` of every rank's range from the gathered payloads ``out`` ``[dp, bytes]`` (even plan)."""
        c, g = layout.chunk, layout.granule
        seg = out[:, c:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # [dp, K] (also dp = 1)
        return self.decode(out[:, :c].reshape(-1, g), layout.block_values(seg))

    def saturated(self, x: Tensor, payload: Tensor, layout: ScaleLayout) -> Tensor:
        """bool ``[numel]``: the elements whose code in the :meth:`encode_chunk` payload ``[1, bytes]`` of ``x``
        ``[numel]`` is +-fp8_max (clipped, or rounded onto the top of the range)."""
        codes = payload[0, : x.numel()]
        return codes.view(FP8_FORMATS[self.fmt]).float().abs() == fp8_max(self.fmt)
