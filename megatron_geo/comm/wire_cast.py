"""The plain-cast wire formats (FP32, BF16) of :class:`~megatron_geo.comm.lowp.LowPrecisionReducer`, used when a
transform (``comm.transform=hadamard``) runs in front of an unscaled wire: the values travel as ``x.to(dtype)``
(round to nearest even), no scales; the receiver sums straight from the wire dtype in FP32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scale_layout import ScaleLayout


class CastWire:
    """Encode / decode of bucket buffers as a plain cast to the floating-point ``dtype`` (``torch.bfloat16``; the
    registry entry of each cast format, :mod:`.formats`, names it)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def encode_ranges(self, x: Tensor, layout: ScaleLayout, sync_amax=None, residual: Tensor | None = None):
        """``([(wire bytes, split sizes in bytes)], None, None)``; ``residual`` (if given) <- ``x - wire`` in place."""
        wire = x.to(self.dtype)
        if residual is not None:
            torch.sub(x, wire.float(), out=residual)
        es = wire.element_size()
        return [(wire.view(torch.uint8), [n * es for n in layout.sizes])], None, None

    def roundtrip(self, x: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``x.to(dtype).float()`` of the whole buffer."""
        return x.to(self.dtype).float()

    def decode_own(self, recv: list[Tensor], scales, layout: ScaleLayout, r: int, out: Tensor) -> Tensor:
        """``out`` (FP32 ``[own]``, returned) <- the received ``[dp, own]`` values summed in FP32 straight from the
        wire dtype, / dp."""
        dp = layout.dp_size
        vals = recv[0].view(self.dtype).view(dp, -1)
        return torch.sum(vals, dim=0, dtype=torch.float32, out=out).div_(dp)

    def encode_chunk(self, x: Tensor, layout: ScaleLayout, r: int) -> Tensor:
        """Payload uint8 ``[1, bytes]``: range ``r`` (``x``) cast to the wire dtype."""
        return x.view(1, -1).to(self.dtype).contiguous().view(torch.uint8).view(1, -1)

    def decode_all(self, out: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``[numel]`` of the gathered payloads ``out`` ``[dp, bytes]``."""
        return out.view(self.dtype).reshape(-1).float()

    def saturated(self, x: Tensor, payload: Tensor, layout: ScaleLayout) -> Tensor:
        """bool ``[numel]``: finite elements of ``x`` that the cast in the :meth:`encode_chunk` payload ``[1, bytes]``
        turned into +-inf (bf16 overflow; never for fp32)."""
        wire = payload.view(self.dtype).reshape(-1)[: x.numel()]
        return torch.isinf(wire) & torch.isfinite(x)
