"""One rank's codec round trip on a codec dict: the quantize-dequantize that ``geo.power_search`` scores
candidate transforms with (:meth:`megatron_geo.comm.lowp.LowPrecisionReducer.roundtrip`), and the
codec spec strings (:func:`parse_codec` / :func:`codec_label`: ``DTYPE[:PART...]`` with parts
``tensor``, ``block`` or ``blockN``, ``hadamard`` or ``hadamardN``, ``stochastic``, ``nearest``, ``seedN``; ``+``
works as a separator too, e.g. ``fp8_e4m3:block128``, ``fp8_e4m3:tensor+hadamard128``, ``nvfp4``) and the
per-rank quantizer the offline fidelity simulation (:mod:`megatron_geo.analysis.fidelity`) builds on.

A *codec* is a dict whose keys mirror the ``comm.*`` config keys (missing keys take these defaults)::

    {"dtype": "fp8_e4m3",       # fp32 | bf16 | fp8_e4m3 | fp8_e5m2 | nvfp4
     "scaling": "tensor",       # tensor (one FP32 scale per parameter) | block (one per block_size elements)
     "block_size": 128,         # elements per scale with scaling=block (fp8 only; nvfp4 is always 16)
     "transform": "none",       # none | hadamard (block-Hadamard rotation of the flattened parameter)
     "hadamard_block": 128,     # rotation block (power of two)
     "rounding": "nearest",     # nearest | stochastic
     "seed": 0}                 # Hadamard signs (hadamard_signs(hadamard_block, seed)) and stochastic draws

The numerics are the project's own kernels (:mod:`.codecs`, :mod:`.hadamard`), used the way
:class:`~megatron_geo.comm.lowp.LowPrecisionReducer` uses them, but per tensor instead of per bucket chunk.
Stochastic rounding draws from ``torch.Generator(device).manual_seed(seed * 1_000_003 + rank)``.
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

from .codecs import (FP8_FORMATS, NVFP4_BLOCK, fp8_decode, fp8_encode, fp8_max, fp8_scale_from_amax, nvfp4_decode,
                     nvfp4_encode, nvfp4_global_scale)
from .hadamard import block_hadamard, block_hadamard_inverse, hadamard_signs

DTYPES = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")
CODEC_DEFAULTS = {"dtype": "fp32", "scaling": "tensor", "block_size": 128, "transform": "none",
                  "hadamard_block": 128, "rounding": "nearest", "seed": 0}
_E2M1_TOP = 7  # magnitude index of 6.0, the largest E2M1 value


def is_pow2(v: int) -> bool:
    """True for a positive power of two (block and rotation sizes)."""
    return v > 0 and not v & (v - 1)


def normalize_codec(codec: dict | str) -> dict:
    """A complete, validated codec dict from a (partial) dict or a spec string (:func:`parse_codec`).

    Raises:
        ValueError: unknown key or value, a non-positive block size, or a Hadamard block that is not a
            power of two.
    """
    if isinstance(codec, str):
        return parse_codec(codec)
    unknown = set(codec) - set(CODEC_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown codec keys {sorted(unknown)}; valid keys: {sorted(CODEC_DEFAULTS)}")
    c = {**CODEC_DEFAULTS, **codec}
    for key, choices in (("dtype", DTYPES), ("scaling", ("tensor", "block")), ("transform", ("none", "hadamard")),
                         ("rounding", ("nearest", "stochastic"))):
        if c[key] not in choices:
            raise ValueError(f"codec {key}={c[key]!r} is not supported; choose one of {', '.join(choices)}")
    c["block_size"], c["hadamard_block"], c["seed"] = int(c["block_size"]), int(c["hadamard_block"]), int(c["seed"])
    if c["block_size"] <= 0:
        raise ValueError(f"codec block_size={c['block_size']} must be positive")
    if c["transform"] == "hadamard" and not is_pow2(c["hadamard_block"]):
        raise ValueError(f"codec hadamard_block={c['hadamard_block']} must be a power of two")
    return c


def parse_codec(spec: str) -> dict:
    """Codec dict from a spec string such as ``fp8_e4m3:block128`` or ``fp8_e4m3:tensor+hadamard128``.

    Raises:
        ValueError: unknown dtype or part.
    """
    parts = [p for p in re.split(r"[:+]", spec.strip()) if p]
    if not parts:
        raise ValueError("empty codec spec")
    c: dict = {"dtype": parts[0]}
    for p in parts[1:]:
        m = re.fullmatch(r"(tensor|block|hadamard|stochastic|nearest|seed)(\d*)", p)
        if not m:
            raise ValueError(f"codec spec {spec!r}: unknown part {p!r} (use tensor, blockN, hadamardN, "
                             f"stochastic, nearest, seedN)")
        word, num = m.groups()
        if word == "tensor":
            c["scaling"] = "tensor"
        elif word == "block":
            c["scaling"] = "block"
            if num:
                c["block_size"] = int(num)
        elif word == "hadamard":
            c["transform"] = "hadamard"
            if num:
                c["hadamard_block"] = int(num)
        elif word == "seed":
            c["seed"] = int(num or 0)
        else:
            c["rounding"] = word
    return normalize_codec(c)


def codec_label(codec: dict | str) -> str:
    """Canonical spec string of a codec (``parse_codec(codec_label(c)) == normalize_codec(c)``)."""
    c = normalize_codec(codec)
    s = c["dtype"]
    if c["dtype"] in FP8_FORMATS:
        s += ":" + ("tensor" if c["scaling"] == "tensor" else f"block{c['block_size']}")
    if c["transform"] == "hadamard":
        s += f"+hadamard{c['hadamard_block']}"
    if c["rounding"] == "stochastic":
        s += ":stochastic"
    if c["seed"]:
        s += f":seed{c['seed']}"
    return s


def pad_multiple(c: dict) -> int:
    """Elements per quantization / rotation block of codec ``c`` (the wire vector is padded to it)."""
    m = 1
    if c["dtype"] == "nvfp4":
        m = NVFP4_BLOCK
    elif c["dtype"] in FP8_FORMATS and c["scaling"] == "block":
        m = c["block_size"]
    if c["transform"] == "hadamard":
        m = math.lcm(m, c["hadamard_block"])
    return m


def to_wire(x: Tensor, c: dict, signs: Tensor | None) -> Tensor:
    """Flatten to FP32, zero-pad to the block multiple, rotate (optional): the vector that is quantized."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % pad_multiple(c)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if signs is not None:
        hb = c["hadamard_block"]
        flat = block_hadamard(flat.view(-1, hb), signs.to(flat.device)).view(-1)
    return flat


def from_wire(y: Tensor, c: dict, signs: Tensor | None, shape: torch.Size) -> Tensor:
    """Inverse of :func:`to_wire`: rotate back (optional), unpad, reshape to ``shape``."""
    if signs is not None:
        hb = c["hadamard_block"]
        y = block_hadamard_inverse(y.view(-1, hb), signs.to(y.device)).view(-1)
    n = math.prod(shape)
    return y[:n].reshape(shape)


def wire_signs(c: dict) -> Tensor | None:
    """The Hadamard signs of codec ``c`` (None without a rotation)."""
    return hadamard_signs(c["hadamard_block"], c["seed"]) if c["transform"] == "hadamard" else None


def rounding_generator(c: dict, rank: int, device) -> torch.Generator | None:
    """The stochastic-rounding stream of ``rank`` (None for round to nearest)."""
    if c["rounding"] != "stochastic":
        return None
    g = torch.Generator(device=device)
    g.manual_seed(c["seed"] * 1_000_003 + rank)
    return g


def quantize_wire(y: Tensor, c: dict, rank: int) -> tuple[Tensor, Tensor]:
    """Decode(encode(y)) of one rank's wire vector ``y`` (FP32, 1-D, padded) and its saturation mask.

    Saturated: the element's code is the format's largest magnitude (fp8: +-fp8_max, nvfp4: E2M1 6.0
    times its block scale), i.e. it was clipped or rounded onto the top of the range; bf16: a finite
    value that became inf. fp32 never saturates.
    """
    dt = c["dtype"]
    if dt == "fp32":
        return y.clone(), torch.zeros_like(y, dtype=torch.bool)
    if dt == "bf16":
        dec = y.to(torch.bfloat16).float()
        return dec, torch.isinf(dec) & torch.isfinite(y)
    gen = rounding_generator(c, rank, y.device)
    if dt == "nvfp4":
        blocks = y.view(-1, NVFP4_BLOCK)
        g = nvfp4_global_scale(y.abs().amax())
        packed, bscale = nvfp4_encode(blocks, g, c["rounding"], gen)
        dec = nvfp4_decode(packed, bscale, g).view(-1)
        idx = torch.stack([packed & 7, (packed >> 4) & 7], dim=-1).view(-1)
        return dec, idx == _E2M1_TOP
    if c["scaling"] == "block":
        v = y.view(-1, c["block_size"])
        scale = fp8_scale_from_amax(v.abs().amax(dim=1, keepdim=True), dt)
    else:
        v = y
        scale = fp8_scale_from_amax(y.abs().amax(), dt)
    codes = fp8_encode(v, scale, dt, c["rounding"], gen)
    dec = fp8_decode(codes, scale, dt).view(-1)
    sat = codes.view(FP8_FORMATS[dt]).float().abs().view(-1) == fp8_max(dt)
    return dec, sat


def quantize_roundtrip(x: Tensor, codec: dict | str) -> Tensor:
    """``decode(encode(x))`` of one tensor through ``codec`` (one rank, no reduce): round to nearest,
    no rotation, one scale over the whole tensor (tensor scaling) or per ``block_size`` elements of the
    flattened tensor (block scaling; NVFP4: its 16-element blocks under a per-tensor FP32 scale).

    Args:
        x: any float tensor (upcast to float32).
        codec: codec dict (module docstring) or spec string; its ``rounding`` and ``transform`` are ignored.

    Returns:
        float32 tensor of ``x``'s shape.
    """
    c = {**normalize_codec(codec), "rounding": "nearest", "transform": "none"}
    return from_wire(quantize_wire(to_wire(x, c, None), c, 0)[0], c, None, x.shape)
