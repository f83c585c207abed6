"""The NVFP4 wire format of :class:`~megatron_geo.comm.lowp.LowPrecisionReducer`.

What travels: E2M1 codes packed two per byte, one E4M3 block scale per 16 elements (both from
:func:`.codecs.nvfp4_encode`), and one FP32 "global" scale per scale segment: the parameter's
``amax / (448 * 6)`` (:func:`.codecs.nvfp4_global_scale`) over the whole bucket, like tensor-scaled FP8.
Parameters start 16-aligned and their segment covers the padding after them (:mod:`.scale_layout` with
granule 16), so no block holds two parameters and a TP-replicated norm weight is encoded the same on every
TP rank.

The global scale reaches each 16-element block through the layout's per-block values (derived from its
per-segment tables in each reduction, :mod:`.scale_layout`). With
``comm.compile`` each step is one ``torch.compile`` graph: the block amax (shared with the global scale's
amax), the block scales (vectorised over blocks), the element codes with their packing, and on the receive
side the unpacking and the sum over DP.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .codecs import (
    NVFP4_BLOCK,
    _e2m1_values,
    dp_divisor,
    mean_over_sources,
    nvfp4_block_scales,
    nvfp4_decode,
    nvfp4_element_codes,
    nvfp4_encode,
    nvfp4_global_scale,
    pack_nibbles,
    unpack_nibbles,
)
from .compiled import maybe_compile
from .scale_layout import ScaleLayout
from .wire_fp8 import block_amax

_E2M1_TOP = 7  # magnitude code of 6.0, the largest E2M1 value


def _encode(x: Tensor, divisor: Tensor) -> Tensor:
    """uint8 ``[nb, 8]`` packed E2M1 codes of float32 ``x`` ``[nb, 16]`` with the block divisors ``[nb]``."""
    return pack_nibbles(nvfp4_element_codes(x, divisor))


def _encode_ef(x: Tensor, divisor: Tensor, scale: Tensor, g: Tensor, residual: Tensor) -> Tensor:
    """As :func:`_encode`; also writes ``residual`` ``[nb, 16]`` = ``x - decode`` in place (the decoded value
    ``(e2m1 * block scale) * global`` as :func:`.codecs.nvfp4_decode`, from the codes before packing)."""
    codes = nvfp4_element_codes(x, divisor)
    residual.copy_(x - (_e2m1_values(codes.to(torch.int32)) * scale.unsqueeze(1)) * g.unsqueeze(1))
    return pack_nibbles(codes)


def _sum_sources(codes: Tensor, bscale: Tensor, g: Tensor, out: Tensor, divisor: Tensor) -> Tensor:
    """Writes into float32 ``out`` ``[nb * 16]`` (and returns it) the mean over sources of the E2M1 ``codes``
    ``[dp, nb, 16]`` (uint8, one per element) with block scale codes ``[dp, nb]`` and global scales ``[dp, nb]``
    (each value ``(e2m1 * block scale) * global`` as :func:`.codecs.nvfp4_decode`, FP32 sum in source order, then
    one division by ``divisor``, float32 ``[1]`` holding dp: :func:`.codecs.mean_over_sources`)."""
    s = bscale.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    vals = (_e2m1_values(codes.to(torch.int32)) * s) * g.unsqueeze(-1)
    mean_over_sources(vals, divisor, out.view(codes.shape[1:]))
    return out


def _sum_packed(packed: Tensor, bscale: Tensor, g: Tensor, out: Tensor, divisor: Tensor) -> Tensor:
    """As :func:`_sum_sources` from the packed codes ``[dp, nb, 8]``: the unpacking inside the same graph (GPUs,
    where Triton extracts the nibbles in registers; on CPU the unpacking is its own graph)."""
    dp, nb = packed.shape[0], packed.shape[1]
    return _sum_sources(unpack_nibbles(packed).view(dp, nb, NVFP4_BLOCK), bscale, g, out, divisor)


def _decode(packed: Tensor, bscale: Tensor, g: Tensor) -> Tensor:
    """float32 ``[nb * 16]`` of ``packed`` ``[nb, 8]``, block scale codes ``[nb]``, global scales ``[nb]``."""
    return nvfp4_decode(packed, bscale, g.unsqueeze(1)).view(-1)


class NVFP4Wire:
    """Encode / decode of bucket buffers in NVFP4 (``rounding="stochastic"`` runs eagerly with ``generator``)."""

    def __init__(self, rounding: str, generator: torch.Generator | None, compile: bool):
        self.rounding, self.generator = rounding, generator
        # separate graphs: the per-block scale arithmetic vectorises over blocks only on its own (fused into the
        # element loop it runs once per 16 elements, scalar), and the nibble (un)packing goes through an integer
        # view of another width, which a graph materialises anyway
        # static: the 16-element block (8 packed bytes) and the DP size; the number of blocks varies
        self.amax = maybe_compile(block_amax, compile, {0: (1,)})
        self.block_scales = maybe_compile(nvfp4_block_scales, compile)
        self.encode = maybe_compile(_encode, compile, {0: (1,)})
        self.encode_ef = maybe_compile(_encode_ef, compile, {0: (1,), 4: (1,)})
        self.unpack = maybe_compile(unpack_nibbles, compile)
        self.sum_sources = maybe_compile(_sum_sources, compile, {0: (0, 2), 1: (0,), 2: (0,)})
        self.sum_packed = maybe_compile(_sum_packed, compile, {0: (0, 2), 1: (0,), 2: (0,)})
        self.decode = maybe_compile(_decode, compile, {0: (1,)})

    def _encode(self, x2: Tensor, bamax: Tensor, g: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """``(packed [nb, 8], block scale codes [nb])`` of ``x2`` ``[nb, 16]`` with its block amax ``[nb]`` and the
        global scale of each block ``[nb]``; sets ``residual`` ``[nb, 16]`` to ``x2 - decode`` when given."""
        if self.rounding == "stochastic":
            packed, bscale = nvfp4_encode(x2, g.unsqueeze(1), "stochastic", self.generator)
            if residual is not None:
                residual.copy_(x2 - nvfp4_decode(packed, bscale, g.unsqueeze(1)))
            return packed, bscale
        bscale, scale, divisor = self.block_scales(bamax, g)
        if residual is not None:
            return self.encode_ef(x2, divisor, scale, g, residual), bscale
        return self.encode(x2, divisor), bscale

    def encode_ranges(self, x: Tensor, layout: ScaleLayout, sync_amax=None, residual: Tensor | None = None):
        """Encode the whole buffer ``x`` ``[numel]``; see :meth:`.wire_fp8.FP8Wire.encode_ranges` (NVFP4 has no
        shared scales: ``sync_amax`` must be None). Two payloads travel: packed codes and block scale codes."""
        assert sync_amax is None, "comm.scale_sync=max is fp8 only"
        x2 = x.view(-1, NVFP4_BLOCK)
        bamax = self.amax(x2)  # [nb]
        seg = layout.segment_values(nvfp4_global_scale(layout.group_amax(bamax)))  # [dp, K]
        packed, bscale = self._encode(
            x2, bamax, layout.block_values(seg), None if residual is None else residual.view(-1, NVFP4_BLOCK)
        )
        sizes = layout.sizes
        codes = [(packed.view(-1), [n // 2 for n in sizes]), (bscale.view(-1), [n // NVFP4_BLOCK for n in sizes])]
        return codes, (seg.contiguous().view(-1), layout.scale_splits()), None

    def roundtrip(self, x: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``decode(encode(x))`` of the whole buffer ``x`` ``[numel]`` (round to nearest, this rank's scales)."""
        x2 = x.view(-1, NVFP4_BLOCK)
        bamax = self.amax(x2)
        g = layout.block_values(layout.segment_values(nvfp4_global_scale(layout.group_amax(bamax))))
        packed, bscale = self._encode(x2, bamax, g, None)
        return self.decode(packed, bscale, g)

    def decode_own(self, recv: list[Tensor], scales: Tensor, layout: ScaleLayout, r: int, out: Tensor) -> Tensor:
        """``out`` (FP32 ``[own]``, returned) <- the mean over sources of range ``r`` (packed codes ``recv[0]``, block
        scales ``recv[1]``, every source's global scales ``scales`` ``[dp, K]``)."""
        dp = scales.shape[0]
        g = layout.row_block_values(scales, r)  # [dp, nb]
        divisor = dp_divisor(dp, recv[0].device)
        if recv[0].device.type != "cpu":
            return self.sum_packed(recv[0].view(dp, -1, NVFP4_BLOCK // 2), recv[1].view(dp, -1), g, out, divisor)
        codes = self.unpack(recv[0]).view(dp, -1, NVFP4_BLOCK)
        return self.sum_sources(codes, recv[1].view(dp, -1), g, out, divisor)

    def encode_chunk(self, x: Tensor, layout: ScaleLayout, r: int) -> Tensor:
        """Payload uint8 ``[1, bytes]`` of range ``r``: packed codes, block scale codes, then its own
        per-segment global scales ``[K]`` (amax of this range alone)."""
        x2 = x.view(-1, NVFP4_BLOCK)
        bamax = self.amax(x2)
        seg = nvfp4_global_scale(layout.row_segment_amax(bamax, r))  # [K]
        packed, bscale = self._encode(x2, bamax, layout.row_block_values(seg, r), None)
        return torch.cat([packed.view(1, -1), bscale.view(1, -1), seg.view(1, -1).view(torch.uint8)], dim=1)

    def decode_all(self, out: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``[numel]`` of every rank's range from the gathered payloads ``out`` ``[dp, bytes]`` (even plan)."""
        c = layout.chunk
        nb = c // NVFP4_BLOCK
        packed = out[:, : c // 2].reshape(-1, NVFP4_BLOCK // 2)
        bscale = out[:, c // 2 : c // 2 + nb].reshape(-1)
        seg = out[:, c // 2 + nb :].clone(memory_format=torch.contiguous_format).view(torch.float32)  # [dp, K]
        return self.decode(packed, bscale, layout.block_values(seg))

    def saturated(self, x: Tensor, payload: Tensor, layout: ScaleLayout) -> Tensor:
        """bool ``[numel]``: the elements whose E2M1 code in the :meth:`encode_chunk` payload ``[1, bytes]`` of ``x``
        ``[numel]`` is the top magnitude 6.0 (times its block scale)."""
        packed = payload[0, : x.numel() // 2]
        return torch.stack([packed & 7, (packed >> 4) & 7], dim=-1).view(-1) == _E2M1_TOP
