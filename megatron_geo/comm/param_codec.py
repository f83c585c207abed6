"""Wire formats of the low-precision parameter all-gather (``comm.param_gather``).

After the optimizer step the owner of a range of a bucket does not send its new parameters: it sends the
*difference* ``d = new - held`` between the new parameter (its FP32 main param rounded to the model's parameter
dtype) and what every replica holds now, quantised in blocks of :data:`GATHER_BLOCK` elements; every replica, the
owner's included, adds the same decoded difference to the parameter it holds (rounded to the parameter dtype).
This module is the codec of ``d``; the gather itself is :mod:`megatron_geo.distributed.param_gather`.

A bucket's parameter buffer is viewed as ``[blocks, 128]`` (the shard plan aligns every parameter start and every
rank range to 128 elements when the gather is quantised, so no block holds two parameters or two ranks' elements,
and a TP-replicated norm weight is encoded alike on every TP rank). Each block travels as one fixed-size *record*
of bytes, so a rank's range of blocks is one contiguous byte range and the gather of a bucket is one collective:

- ``fp8``: 128 OCP E4M3 codes of ``d / s`` (torch's ``float8_e4m3fn`` cast, round to nearest even, clamped to
  +-448 first) and the block's FP32 scale ``s = amax(|d|) / 448`` (:func:`.codecs.fp8_scale_from_amax`; an
  all-zero block has scale 1): 132 bytes per 128 elements, 1.031 bytes per element;
- ``nvfp4``: 64 bytes of packed E2M1 codes, eight E4M3 scales (one per 16 elements) and one FP32 scale of the
  128-element block ``amax / (448 * 6)`` (the codecs of :mod:`.codecs`, with the block's amax in place of a
  tensor's): 76 bytes per 128 elements, 0.594 bytes per element.

Values: ``auto`` (default) and ``bf16`` gather the parameters themselves (nothing of this module runs): ``auto`` in
``train.param_dtype``, exactly as before the key existed; ``bf16`` is the same plain gather, and is accepted only
with ``train.param_dtype=bf16`` (for FP32 parameters it would be a lossy gather without error feedback).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config.errors import ConfigError
from .codecs import (
    NVFP4_BLOCK,
    fp8_decode,
    fp8_encode,
    fp8_scale_from_amax,
    nvfp4_block_scales,
    nvfp4_decode,
    nvfp4_element_codes,
    nvfp4_global_scale,
    pack_nibbles,
)

GATHER_BLOCK = 128
"""Elements per quantisation block of the parameter difference (one FP32 scale each)."""

PLAIN_GATHERS = ("auto", "bf16")
"""``comm.param_gather`` values that gather the parameters themselves, in the model's parameter dtype."""

_FP8 = "fp8_e4m3"
_SUB = GATHER_BLOCK // NVFP4_BLOCK  # NVFP4 scale blocks per gather block


def _fp8_encode(d: Tensor, out: Tensor) -> None:
    amax = d.abs().amax(dim=1)
    scale = fp8_scale_from_amax(amax, _FP8)  # [nb]
    out[:, :GATHER_BLOCK].copy_(fp8_encode(d, scale.unsqueeze(1), _FP8))
    out[:, GATHER_BLOCK:].copy_(scale.unsqueeze(1).view(torch.uint8))


def _fp8_decode(rec: Tensor) -> Tensor:
    scale = rec[:, GATHER_BLOCK:].contiguous().view(torch.float32)  # [nb, 1]
    return fp8_decode(rec[:, :GATHER_BLOCK], scale, _FP8)


def _nvfp4_encode(d: Tensor, out: Tensor) -> None:
    nb = d.shape[0]
    g = nvfp4_global_scale(d.abs().amax(dim=1))  # [nb]: one FP32 scale per 128 elements
    x = d.reshape(nb * _SUB, NVFP4_BLOCK)
    codes, _, divisor = nvfp4_block_scales(x.abs().amax(dim=1), g.repeat_interleave(_SUB, output_size=nb * _SUB))
    packed = pack_nibbles(nvfp4_element_codes(x, divisor))  # [nb * 8, 8]
    half = GATHER_BLOCK // 2
    out[:, :half].copy_(packed.view(nb, half))
    out[:, half : half + _SUB].copy_(codes.view(nb, _SUB))
    out[:, half + _SUB :].copy_(g.unsqueeze(1).view(torch.uint8))


def _nvfp4_decode(rec: Tensor) -> Tensor:
    nb, half = rec.shape[0], GATHER_BLOCK // 2
    packed = rec[:, :half].reshape(nb * _SUB, NVFP4_BLOCK // 2)
    codes = rec[:, half : half + _SUB].reshape(nb * _SUB)
    g = rec[:, half + _SUB :].contiguous().view(torch.float32)  # [nb, 1]
    return nvfp4_decode(packed, codes, g.repeat_interleave(_SUB, dim=0, output_size=nb * _SUB)).view(nb, GATHER_BLOCK)


@dataclass(frozen=True)
class GatherCodec:
    """One quantised ``comm.param_gather`` format.

    Attributes:
        name: the ``comm.param_gather`` value (``fp8``, ``nvfp4``).
        record_bytes: bytes one :data:`GATHER_BLOCK`-element block travels as (codes and scales).
        encode_into: ``(d, out) -> None``: FP32 ``d`` ``[nb, 128]`` encoded into uint8 ``out`` ``[nb, record_bytes]``
            (a view into the bucket's payload buffer). No host sync, no data-dependent shape.
        decode: uint8 records ``[nb, record_bytes]`` -> FP32 ``[nb, 128]``, the decoded difference (NaN where the
            block's amax was not finite).
    """

    name: str
    record_bytes: int
    encode_into: Callable[[Tensor, Tensor], None]
    decode: Callable[[Tensor], Tensor]

    @property
    def bytes_per_element(self) -> float:
        """Wire bytes per parameter element, scales included (fp8 1.031, nvfp4 0.594)."""
        return self.record_bytes / GATHER_BLOCK

    def encode(self, d: Tensor) -> Tensor:
        """uint8 ``[nb, record_bytes]``: the records of FP32 ``d`` ``[nb, 128]`` (a new tensor on ``d``'s device).

        Raises:
            ValueError: ``d`` is not ``[nb, 128]``.
            TypeError: ``d`` is not float32.
        """
        if d.dim() != 2 or d.shape[1] != GATHER_BLOCK:
            raise ValueError(f"d must be [nb, {GATHER_BLOCK}], got {tuple(d.shape)}")
        if d.dtype != torch.float32:
            raise TypeError(f"d must be float32, got {d.dtype}")
        out = torch.empty(d.shape[0], self.record_bytes, dtype=torch.uint8, device=d.device)
        self.encode_into(d, out)
        return out


GATHER_CODECS: dict[str, GatherCodec] = {
    "fp8": GatherCodec("fp8", GATHER_BLOCK + 4, _fp8_encode, _fp8_decode),
    "nvfp4": GatherCodec("nvfp4", GATHER_BLOCK // 2 + _SUB + 4, _nvfp4_encode, _nvfp4_decode),
}


def gather_codec(name: str) -> GatherCodec | None:
    """The codec of ``comm.param_gather=name``; None for the plain gathers (``auto``, ``bf16``).

    Raises:
        ValueError: an unknown value (the message lists the valid ones).
    """
    if name in PLAIN_GATHERS:
        return None
    try:
        return GATHER_CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"comm.param_gather={name!r} is not supported; choose one of {', '.join((*PLAIN_GATHERS, *GATHER_CODECS))}"
        ) from None


def param_gather_alignment(comm) -> int:
    """Elements every parameter start and rank range of a bucket must be a multiple of for ``comm.param_gather``:
    :data:`GATHER_BLOCK` for the quantised gathers, else 1."""
    return 1 if comm.param_gather in PLAIN_GATHERS else GATHER_BLOCK


def gather_bytes_per_element(comm, param_dtype: torch.dtype) -> float:
    """Wire bytes per parameter element of the parameter gather: the parameter dtype's size for the plain gathers,
    the codec's record bytes per element otherwise.

    Raises:
        ValueError: an unknown ``comm.param_gather``.
    """
    codec = gather_codec(comm.param_gather)
    return float(param_dtype.itemsize) if codec is None else codec.bytes_per_element


def check_param_gather(comm, param_dtype: torch.dtype) -> None:
    """Reject a ``comm.param_gather`` value, or one that makes no sense with parameters of ``param_dtype`` (the
    model's parameter dtype, as :func:`megatron_geo.model.llama.param_dtype` parses ``train.param_dtype``).

    Raises:
        ConfigError: an unknown value (lists the valid ones), or ``bf16`` with FP32 parameters (the fix: ``auto``
            to gather the FP32 parameters as they are, ``fp8`` / ``nvfp4`` for the quantised difference, or
            ``train.param_dtype=bf16``).
    """
    try:
        gather_codec(comm.param_gather)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if comm.param_gather == "bf16" and param_dtype != torch.bfloat16:
        raise ConfigError(
            "comm.param_gather=bf16 with train.param_dtype=fp32: a plain BF16 gather would round every replica's "
            "FP32 parameters to BF16 each step (and the owner's would differ from the others'); use "
            "comm.param_gather=auto to gather them as they are, comm.param_gather=fp8 or nvfp4 to send the "
            "quantised difference, or train.param_dtype=bf16"
        )


def bf16_ulp(x: Tensor) -> Tensor:
    """float64 ``x.shape``: the BF16 unit in the last place at ``|x|`` (FP32 ``x``, any shape): ``2**(e - 7)`` for a
    value in ``[2**e, 2**(e + 1))``, ``2**-133`` (the subnormal spacing) below the smallest normal and at 0."""
    e = (x.float().abs().view(torch.int32) >> 23) & 0xFF  # the biased exponent, the same field in FP32 and BF16
    return torch.exp2((e.clamp(min=1) - 134).to(torch.float64))
