"""One rank's codec round trip on a codec dict: the quantize-dequantize that ``geo.power_search`` scores
candidate transforms with (:meth:`megatron_geo.comm.lowp.LowPrecisionReducer.roundtrip`), and the
codec spec strings (:func:`parse_codec` / :func:`codec_label`: ``DTYPE[:PART...]`` with parts
``tensor``, ``block`` or ``blockN``, ``hadamard`` or ``hadamardN``, ``stochastic``, ``nearest``, ``seedN``; ``+``
works as a separator too, e.g. ``fp8_e4m3:block128``, ``fp8_e4m3:tensor+hadamard128``, ``nvfp4``) and the
per-rank quantizer the offline fidelity simulation (:mod:`megatron_geo.analysis.fidelity`) builds on.

A *codec* is a dict whose keys mirror the ``comm.*`` config keys (missing keys take the schema's
``CommConfig()`` defaults, shown here)::

    {"dtype": "fp8_e4m3",       # a registered wire format (megatron_geo.comm.formats.FORMATS)
     "scaling": "tensor",       # tensor (one FP32 scale per parameter) | block (one per block_size elements)
     "block_size": 128,         # elements per scale with scaling=block (formats with block scaling only)
     "transform": "none",       # none | hadamard (block-Hadamard rotation of the flattened parameter)
     "hadamard_block": 128,     # rotation block (power of two)
     "rounding": "nearest",     # nearest | stochastic
     "seed": 0}                 # Hadamard signs (hadamard_signs(hadamard_block, seed)) and stochastic draws

One codec implementation: the quantizer is the format's own wire class (``formats.get_format(dtype).make_wire``),
the one the low-precision reducer sends buckets with, run on a one-parameter, one-rank scale layout
(:func:`.scale_layout.build_scale_layout`): the tensor is one parameter of a bucket owned by one DP rank, encoded
as the all-reduce's gather stage encodes a range (:meth:`~megatron_geo.comm.formats.Wire.encode_chunk`) and
decoded from that payload. The Hadamard rotation is the reducer's too: one FP32 matmul with
:func:`.hadamard.hadamard_matrix` per block row under :func:`.hadamard.exact_fp32`.
Stochastic rounding draws from ``torch.Generator(device).manual_seed(seed * 1_000_003 + rank)``.
"""

from __future__ import annotations

import functools
import math
import re

import torch
from torch import Tensor

from ..config.checks import choices_of
from ..config.schema import CommConfig
from .formats import FORMATS, comm_view, get_format
from .hadamard import exact_fp32, hadamard_matrix, hadamard_signs
from .scale_layout import ScaleLayout, build_scale_layout

#: the ``comm`` keys a per-tensor round trip reads (the rest of the section concerns the collective)
CODEC_KEYS = ("dtype", "scaling", "block_size", "transform", "hadamard_block", "rounding")
#: a codec dict's keys and defaults: the schema's ``CommConfig()`` values of :data:`CODEC_KEYS`, and ``seed`` 0
CODEC_DEFAULTS = {**{k: getattr(CommConfig(), k) for k in CODEC_KEYS}, "seed": 0}
#: the values a codec's choice keys take: the schema's, less the learned GeoFP8 transform (a per-tensor round trip
#: has no statistics to build it from)
CODEC_CHOICES = {
    "scaling": choices_of(CommConfig, "scaling"),
    "transform": tuple(t for t in choices_of(CommConfig, "transform") if t != "geo"),
    "rounding": choices_of(CommConfig, "rounding"),
}


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
    for key, choices in {"dtype": tuple(FORMATS), **CODEC_CHOICES}.items():
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
            raise ValueError(
                f"codec spec {spec!r}: unknown part {p!r} (use tensor, blockN, hadamardN, stochastic, nearest, seedN)"
            )
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
    if get_format(c["dtype"]).block_scaling:
        s += ":" + ("tensor" if c["scaling"] == "tensor" else f"block{c['block_size']}")
    if c["transform"] == "hadamard":
        s += f"+hadamard{c['hadamard_block']}"
    if c["rounding"] == "stochastic":
        s += ":stochastic"
    if c["seed"]:
        s += f":seed{c['seed']}"
    return s


def pad_multiple(c: dict) -> int:
    """Elements per quantization / rotation block of codec ``c`` (the wire vector is padded to it): the format's
    alignment (:attr:`.formats.WireFormat.alignment`), with a rotation its lcm with ``hadamard_block``."""
    m = get_format(c["dtype"]).alignment(comm_view(c))
    if c["transform"] == "hadamard":
        m = math.lcm(m, c["hadamard_block"])
    return m


def _rotate(flat: Tensor, signs: Tensor, inverse: bool) -> Tensor:
    """``flat`` ``[n]`` (a multiple of the block) rotated per block row as the reducer rotates a bucket: one IEEE FP32
    matmul with ``M = hadamard_matrix(signs)`` (``M^T`` for the inverse)."""
    b = signs.numel()
    m = hadamard_matrix(signs.to(flat.device))
    with exact_fp32():
        return torch.mm(flat.view(-1, b), m.t().contiguous() if inverse else m).view(-1)


def to_wire(x: Tensor, c: dict, signs: Tensor | None) -> Tensor:
    """Flatten to FP32, zero-pad to :func:`pad_multiple`, rotate (optional; the reducer's matmul, :func:`_rotate`):
    the vector that is quantized, float32 ``[padded numel]``."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % pad_multiple(c)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if signs is not None:
        flat = _rotate(flat, signs, inverse=False)
    return flat


def from_wire(y: Tensor, c: dict, signs: Tensor | None, shape: torch.Size) -> Tensor:
    """Inverse of :func:`to_wire`: rotate back (optional), unpad, reshape to ``shape``."""
    if signs is not None:
        y = _rotate(y, signs, inverse=True)
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


@functools.lru_cache(maxsize=32)
def _one_parameter_layout(numel: int, scaling: str, block_size: int, granule: int, device: str) -> ScaleLayout:
    return build_scale_layout([0], [numel], numel, 1, scaling, block_size, device, granule=granule)


def tensor_granule(c: dict, numel: int) -> int:
    """Elements per block of a one-tensor layout of codec ``c`` (a tensor of ``numel`` elements is zero-padded to a
    multiple of it): the format's granule without a transform; an unscaled cast reads no block tables, so there the
    whole tensor is one block."""
    fmt = get_format(c["dtype"])
    if not fmt.scaled:
        return max(numel, 1)
    comm = comm_view(c, transform="none")
    return fmt.granule(comm) if fmt.granule is not None else fmt.alignment(comm)


def tensor_layout(c: dict, numel: int, device) -> ScaleLayout:
    """The scale layout of a bucket holding one parameter of ``numel`` elements (a multiple of
    :func:`tensor_granule`) owned by one DP rank, for codec ``c`` (cached: the power search and the fidelity tools
    round-trip the same shapes again and again).

    Raises:
        ValueError: ``numel`` is not a multiple of the granule, or an unknown ``c["dtype"]``.
    """
    fmt = get_format(c["dtype"])
    comm = comm_view(c, transform="none")
    return _one_parameter_layout(
        numel, fmt.layout_scaling(comm), int(c["block_size"]), tensor_granule(c, numel), str(torch.device(device))
    )


def tensor_wire(c: dict, rank: int, device):
    """The wire class of codec ``c`` (``formats.get_format(dtype).make_wire``, eager) for DP rank ``rank``: its
    stochastic rounding draws from :func:`rounding_generator`."""
    return get_format(c["dtype"]).make_wire(comm_view(c, transform="none"), rounding_generator(c, rank, device), False)


def quantize_wire(y: Tensor, c: dict, rank: int) -> tuple[Tensor, Tensor]:
    """Decode(encode(y)) of one rank's wire vector ``y`` (FP32, 1-D) and its saturation mask, both ``[len(y)]``.

    The format's wire class (:func:`tensor_wire`) encodes ``y`` as one parameter of a one-rank bucket
    (:func:`tensor_layout`; zero-padded to the format's block internally, which changes no scale) with the codec's
    rounding, as the all-reduce's gather stage encodes a range, and decodes that payload.

    Saturated (:meth:`~megatron_geo.comm.formats.Wire.saturated`): the element's code is the format's largest
    magnitude (fp8: +-fp8_max, nvfp4: E2M1 6.0 times its block scale), i.e. it was clipped or rounded onto the top
    of the range; bf16: a finite value that became inf. fp32 never saturates.

    Raises:
        ValueError: an unknown ``c["dtype"]``.
    """
    n = y.numel()
    if n == 0:
        get_format(c["dtype"])
        return y.float().clone(), torch.zeros_like(y, dtype=torch.bool)
    x = y.reshape(-1).float()
    pad = (-n) % tensor_granule(c, n)
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    layout = tensor_layout(c, x.numel(), x.device)
    wire = tensor_wire(c, rank, x.device)
    payload = wire.encode_chunk(x, layout, 0)
    return wire.decode_all(payload, layout)[:n], wire.saturated(x, payload, layout)[:n]


def quantize_roundtrip(x: Tensor, codec: dict | str) -> Tensor:
    """``decode(encode(x))`` of one tensor through ``codec`` (one rank, no reduce): round to nearest,
    no rotation, one scale over the whole tensor (tensor scaling) or per ``block_size`` elements of the
    flattened tensor (block scaling; NVFP4: its 16-element blocks under a per-tensor FP32 scale).
    The format's own wire class does the work (:func:`quantize_wire`).

    Args:
        x: any float tensor (upcast to float32).
        codec: codec dict (module docstring) or spec string; its ``rounding`` and ``transform`` are ignored.

    Returns:
        float32 tensor of ``x``'s shape.
    """
    c = {**normalize_codec(codec), "rounding": "nearest", "transform": "none"}
    return from_wire(quantize_wire(to_wire(x, c, None), c, 0)[0], c, None, x.shape)
