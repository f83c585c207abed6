"""Quantize / dequantize kernels for low-precision gradient communication (pure PyTorch, CPU or CUDA).

Two families, both "scaled": the wire carries small integer codes plus FP32 (or E4M3) scales, and
``decode(encode(x))`` approximates ``x``.

- Scaled FP8 (OCP 8-bit Floating Point Specification (OFP8), rev. 1.0): E4M3 in its "fn" variant
  (no infinities, one NaN pattern per sign, max normal 448) and E5M2 (IEEE-like, max normal 57344).
  The element casts are torch's own ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` conversions
  (round to nearest, ties to even, subnormals as OFP8 defines them).
- NVFP4 (NVIDIA Blackwell's 4-bit format, as described in NVIDIA's "Introducing NVFP4" note and
  the PTX ISA ``e2m1`` type): E2M1 elements (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), one E4M3
  scale per 16 consecutive elements, and one FP32 "global" scale that maps the block scales into
  E4M3's range.

Rounding is round-to-nearest-even or unbiased stochastic rounding (the two neighbouring representable
values, chosen with probability proportional to closeness; ``E[decode] == x`` for in-range ``x``).

NaN policy: NaN in, NaN out (never silently 0 or max). A non-finite amax gives a NaN scale, so a
non-finite tensor decodes to NaN instead of being hidden by saturation; finite values beyond the
format's range saturate to +-max.
"""

from __future__ import annotations

import functools
import math
import sys

import torch
from torch import Tensor

from ..config.checks import choices_of
from ..config.schema import CommConfig

FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ROUNDINGS = choices_of(CommConfig, "rounding")  # comm.rounding, as the schema lists them

_FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}

NVFP4_BLOCK = 16
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
# E2M1 magnitudes indexed by their 3-bit code (exponent bits 2-1, mantissa bit 0).
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the value of each 4-bit code (sign bit 3): the grid, then its negation (code 8 is -0.0)
_E2M1_SIGNED = _E2M1_GRID + tuple(-v for v in _E2M1_GRID)
# Round-to-nearest boundaries: the midpoints between consecutive grid values, except that the
# midpoints whose tie goes up to the even code (0.75, 1.75, 3.5) are replaced by the FP32 value just
# below them (one FP32 ulp less: 2**-24, 2**-23, 2**-22).
_E2M1_BOUNDS = (0.25, 0.75 - 2.0**-24, 1.25, 1.75 - 2.0**-23, 2.5, 3.5 - 2.0**-22, 5.0)


@functools.lru_cache(maxsize=64)
def _cached_const(values: tuple[float, ...], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _const(values: tuple[float, ...], device: torch.device) -> Tensor:
    """A small float32 constant table on ``device``: built once in eager mode (no host-to-device copy per
    call); inside a ``torch.compile`` trace a graph constant."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float32, device=device)
    return _cached_const(values, device)


@functools.lru_cache(maxsize=64)
def dp_divisor(dp: int, device: torch.device | str) -> Tensor:
    """float32 ``[1]`` tensor holding ``dp`` on ``device``: a new one per call (one fill on the device, no host
    sync; not cached, so a call under a fake-tensor mode never leaks a fake tensor into real steps).

    :func:`mean_over_sources` and :func:`.wire_sum.ring_mean` divide by this tensor instead of by the Python
    number, because a number lets a backend multiply by its reciprocal (one rounding more, off by one ulp for
    about a third of the quotients at DP 3): eager CUDA does so for any CPU-scalar divisor, and Inductor for
    any divisor that is a graph constant on every device but the CPU. A tensor on ``device`` that enters a
    compiled graph as an input is divided by with an IEEE division on every backend (on Triton with the
    division-rounding option of :func:`.compiled.eager_numerics_options`).

    Raises:
        ValueError: ``dp < 1``.
    """
    if dp < 1:
        raise ValueError(f"the DP size must be >= 1, got {dp}")
    return torch.full((1,), float(dp), dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=64)
def _first_row_index(dp: int, device: torch.device) -> Tensor:
    """int64 ``[dp]`` zeros on ``device``: every source's row added into row 0 by ``index_add_`` (made once)."""
    return torch.zeros(dp, dtype=torch.int64, device=device)


def mean_over_sources(vals: Tensor, divisor: Tensor, out: Tensor | None = None) -> Tensor:
    """float32 ``vals.shape[1:]``: the mean over dim 0 of float32 ``vals`` ``[dp, ...]`` (one row per DP source), as
    ``((((+0.0 + v_0) + v_1) + ...) + v_{dp-1}) / divisor``: one FP32 rounding per addition, strictly in source
    order, then one IEEE division.

    The order is fixed so that eager and compiled code compute the same sum at every DP size: ``Tensor.sum(dim=0)``
    leaves it to the backend (eager CPU switches to a cascade of 16-row partial sums past 16 rows, CUDA interleaves
    accumulators, Inductor unrolls small reductions and loops over larger ones). How each path keeps the order:

    - eager on the CPU: one ``index_add_`` of every row into a zeroed row (its CPU kernel adds the rows one after
      the other, in index order), so the number of ops does not grow with dp (three, as ``sum``, ``div_`` and the
      copy into ``out`` were);
    - compiled (any device) and eager elsewhere: a Python loop of additions, unrolled into the one fused kernel of
      the compiled graph (eagerly on a GPU: dp - 1 launches).

    The ``+0.0`` start is what a reduction starting from zero gives: a sum of negative zeros is ``+0.0``.
    ``divisor`` is :func:`dp_divisor` (a runtime tensor, so no backend turns the division into a reciprocal
    multiply).

    Args:
        vals: float32 ``[dp, ...]``, ``dp >= 1``.
        divisor: float32 tensor broadcastable to ``vals.shape[1:]`` on ``vals``' device, normally ``dp_divisor(dp,
            vals.device)``.
        out: float32 tensor of shape ``vals.shape[1:]`` (a view into a larger buffer is fine) that receives the
            mean, or None for a new tensor.

    Returns:
        ``out`` (or a new tensor) holding the mean; NaN in any source gives NaN.
    """
    if vals.device.type == "cpu" and not torch.compiler.is_compiling():
        return _row_sum_index_add(vals, out).div_(divisor)
    mean = _row_sum_loop(vals).div_(divisor)
    return mean if out is None else out.copy_(mean)


def _row_sum_index_add(vals: Tensor, out: Tensor | None = None) -> Tensor:
    """``+0.0 + v_0 + v_1 + ...`` over dim 0 of ``vals`` in one ``index_add_`` (sequential on the CPU), into ``out``
    (shape ``vals.shape[1:]``) or a new tensor."""
    acc = torch.empty(vals.shape[1:], dtype=vals.dtype, device=vals.device) if out is None else out
    acc.unsqueeze(0).zero_().index_add_(0, _first_row_index(vals.shape[0], vals.device), vals)
    return acc


def _row_sum_loop(vals: Tensor) -> Tensor:
    """``+0.0 + v_0 + v_1 + ...`` over dim 0 of ``vals`` as a Python loop of additions (a new tensor)."""
    acc = vals[0] + 0.0
    for i in range(1, vals.shape[0]):
        acc.add_(vals[i])
    return acc


def _compiling_on_cpu(t: Tensor) -> bool:
    """Inside a ``torch.compile`` trace for a CPU tensor: where inductor's C++ code runs FP8 conversions and
    narrow integer views lane by lane, so the codecs use integer arithmetic that vectorises instead (the same
    values, tested). Triton on a GPU has native conversions and takes the plain forms."""
    return torch.compiler.is_compiling() and t.device.type == "cpu"


def _check_fmt(fmt: str) -> None:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"unknown fp8 format {fmt!r}; choose one of {sorted(FP8_FORMATS)}")


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")


def _check_f32(x: Tensor, name: str) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")


def _check_u8(x: Tensor, name: str) -> None:
    if x.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 codes, got {x.dtype}")


def fp8_max(fmt: str) -> float:
    """Largest finite magnitude of an FP8 format: 448.0 (``fp8_e4m3``) or 57344.0 (``fp8_e5m2``).

    Raises:
        ValueError: unknown ``fmt``.
    """
    _check_fmt(fmt)
    return _FP8_MAX[fmt]


def _scale_from_amax(amax: Tensor, denom: float) -> Tensor:
    """``amax / denom`` in FP32; 0 -> 1.0; non-finite -> NaN; a positive amax never gives scale 0."""
    a = amax.float()
    s = a / denom
    s = torch.where(a == 0, torch.ones_like(s), s)
    # a tiny positive amax can underflow to 0 in FP32; 0 would turn x / scale into inf / NaN
    s = torch.where((s == 0) & (a != 0), torch.full_like(s, torch.finfo(torch.float32).tiny), s)
    return torch.where(torch.isfinite(a), s, torch.full_like(s, math.nan))


def fp8_scale_from_amax(amax: Tensor, fmt: str) -> Tensor:
    """FP32 scale ``amax / fp8_max(fmt)`` that maps ``[-amax, amax]`` onto the format's full range.

    Args:
        amax: max ``|x|`` (any shape, e.g. ``[]`` per tensor or ``[nblk, 1]`` per block), ``>= 0``.
        fmt: ``"fp8_e4m3"`` or ``"fp8_e5m2"``.

    Returns:
        float32 tensor of ``amax``'s shape. Decoding multiplies by it. ``amax == 0`` gives 1.0; a
        positive amax whose quotient underflows gives the smallest normal FP32; a non-finite amax
        (inf or NaN) gives NaN, so the decoded tensor is NaN and overflow detection sees it.

    Raises:
        ValueError: unknown ``fmt``.
    """
    return _scale_from_amax(amax, fp8_max(fmt))


def _stochastic_round(y: Tensor, mbits: int, emin: int, generator: torch.Generator | None) -> Tensor:
    """Unbiased stochastic rounding of float32 ``y`` onto the grid of a binary float format with
    ``mbits`` mantissa bits, smallest normal ``2**emin`` and subnormals below it; ``|y|`` must already
    be within the format's range. Returns float32 grid values; NaN stays NaN; the sign is kept (also
    of a zero result).

    ``ulp`` is the grid spacing at ``|y|`` (a power of two, built from the FP32 exponent bits), so
    ``v = y / ulp`` and ``frac = v - floor(v)`` are exact and ``floor(v) + (u < frac)`` picks the upper
    neighbour with probability ``frac`` up to the resolution of the uniform draw ``u`` (exact on CPU,
    whose FP32 draws lie on a 2**-24 lattice, wherever ``frac`` is a multiple of 2**-24, as it is in
    the normal range; below that the error in probability is < 2**-24).
    """
    e = (y.view(torch.int32) >> 23) & 0xFF  # biased FP32 exponent (0 for FP32 subnormals)
    ulp = ((e.clamp_(min=emin + 127) - mbits) << 23).view(torch.float32)
    v = y / ulp
    fl = torch.floor(v)
    u = torch.rand(y.shape, generator=generator, device=y.device, dtype=torch.float32)
    q = (fl + (u < v - fl)) * ulp  # floor-based, so unbiased for negative v as well
    return q.copysign_(y)


_FP8_EMIN_MBITS = {"fp8_e4m3": (-6, 3), "fp8_e5m2": (-14, 2)}
# first non-finite magnitude code: E4M3fn has only NaN (0x7F), E5M2 is IEEE-like (0x7C inf, above NaN)
_FP8_SPECIAL = {"fp8_e4m3": 0x7F, "fp8_e5m2": 0x7C}


def _fp8_bits(fmt: str) -> tuple[int, int, int, float, int]:
    """The bit-level constants of ``fmt`` for :func:`fp8_codes` / :func:`fp8_values`, from its smallest normal
    exponent and mantissa width: (exponent bias difference to FP32 << 23, mantissa shift into FP32's field,
    largest subnormal code, subnormal step, first non-finite magnitude code)."""
    emin, mbits = _FP8_EMIN_MBITS[fmt]
    return (126 + emin) << 23, 23 - mbits, (1 << mbits) - 1, 2.0 ** (emin - mbits), _FP8_SPECIAL[fmt]


def fp8_encode(
    x: Tensor, scale: Tensor, fmt: str, rounding: str = "nearest", generator: torch.Generator | None = None
) -> Tensor:
    """Encode ``x / scale`` as FP8 codes.

    Args:
        x: float32, any shape.
        scale: float32, broadcastable to ``x`` (e.g. ``[nblk, 1]`` against ``x`` of ``[nblk, blk]``).
        fmt: ``"fp8_e4m3"`` (OCP E4M3fn) or ``"fp8_e5m2"``.
        rounding: ``"nearest"`` (ties to even, torch's cast) or ``"stochastic"`` (unbiased, between
            the two neighbouring representable values, subnormals included; exact values unchanged).
        generator: source of the uniform draws for stochastic rounding (``torch.rand(...,
            generator=generator)``), on ``x``'s device; ``None`` uses torch's default generator.

    Returns:
        uint8 codes of ``x``'s shape (the FP8 bit patterns). ``x / scale`` is clamped to
        ``[-max, max]`` before rounding (finite overflow and inf saturate); NaN stays NaN.

    Raises:
        ValueError: unknown ``fmt`` or ``rounding``, or ``scale`` that broadcasts ``x`` to a larger shape.
        TypeError: ``x`` is not float32.
    """
    _check_fmt(fmt)
    _check_rounding(rounding)
    _check_f32(x, "x")
    m = _FP8_MAX[fmt]
    y = (x / scale.float()).clamp_(-m, m)  # clamp keeps NaN
    if y.shape != x.shape:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not broadcast to x {tuple(x.shape)}")
    if rounding == "stochastic":
        emin, mbits = _FP8_EMIN_MBITS[fmt]
        y = _stochastic_round(y, mbits, emin, generator)  # now exactly representable: the cast is exact
    if _compiling_on_cpu(y):  # the same codes from integer arithmetic, which vectorises
        return fp8_codes(y, fmt)
    return y.to(FP8_FORMATS[fmt]).view(torch.uint8)


def fp8_codes(y: Tensor, fmt: str) -> Tensor:
    """uint8 FP8 bit patterns of float32 ``y`` already clamped to the format's range (``[-max, max]``, NaN allowed),
    rounded to nearest, ties to even: the codes of torch's ``y.to(float8)`` (tested on every rounding boundary
    of both formats), from integer arithmetic on the FP32 bits instead of the element-wise FP8 conversion,
    which compiled CPU code runs lane by lane.

    Normal range: the FP32 bits rounded at the format's last mantissa bit (add half an ulp minus one plus the
    kept lowest bit: ties go to even) and re-biased; a carry into the exponent is the next binade, exactly as
    RNE wants. Below the smallest normal: ``round(|y| / smallest subnormal)`` (torch.round is ties-to-even and
    the product is exact), which reaches the smallest normal's code when it rounds up. NaN gives 0x7F with the
    sign bit kept, as torch's cast does.

    Raises:
        ValueError: unknown ``fmt``.
    """
    _check_fmt(fmt)
    bias, shift, _, sub_step, _ = _fp8_bits(fmt)
    b = y.view(torch.int32)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    half = (1 << (shift - 1)) - 1
    normal = ((a + half + ((a >> shift) & 1)) - bias) >> shift  # (exponent - bias diff, mantissa)
    sub = torch.round(y.abs() * (1.0 / sub_step)).to(torch.int32)  # 0 .. 2**mbits (the smallest normal)
    code = torch.where(a < bias + (1 << 23), sub, normal)  # below 2**(1 - format bias): subnormal
    code = torch.where(a > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(torch.uint8)


def fp8_decode(codes: Tensor, scale: Tensor, fmt: str) -> Tensor:
    """float32 ``codes.view(fp8).float() * scale``; ``scale`` broadcastable to ``codes``.

    Raises:
        ValueError: unknown ``fmt``.
        TypeError: ``codes`` is not uint8.
    """
    _check_fmt(fmt)
    _check_u8(codes, "codes")
    if _compiling_on_cpu(codes):  # the same values from integer arithmetic, which vectorises
        return fp8_values(codes, fmt) * scale.float()
    return codes.view(FP8_FORMATS[fmt]).float() * scale.float()


def fp8_values(codes: Tensor, fmt: str) -> Tensor:
    """float32 values of the uint8 FP8 bit patterns ``codes`` (any shape), built from integer arithmetic: the same
    values as torch's ``codes.view(float8).float()`` (OFP8 rev. 1.0) for all 256 codes of both formats
    (``tests/test_codec_compile.py``), but without the element-wise FP8 conversion, which compiled CPU code
    runs lane by lane.

    Normal codes: the magnitude bits shifted into FP32's exponent and mantissa fields plus the bias difference
    (E4M3: ``(m << 20) + (120 << 23)``; E5M2: ``(m << 21) + (112 << 23)``); the non-finite codes (E4M3 0x7F,
    E5M2 0x7C-0x7F) get FP32's all-ones exponent, so a zero mantissa is inf (E5M2 0x7C) and any other NaN;
    subnormals: mantissa times the smallest subnormal (2**-9, 2**-16); bit 7 is the sign (-0.0 included).
    Selects take int32 masks and integer constants only: a float constant select or a uint8 mask turns the
    compiled CPU loop scalar (measured 5x slower).

    Raises:
        ValueError: unknown ``fmt``.
    """
    _check_fmt(fmt)
    bias, shift, sub_max, sub_step, special = _fp8_bits(fmt)
    c = codes.to(torch.int32)
    mag = c & 0x7F
    bits = (mag << shift) + bias
    bits = torch.where(mag >= special, bits | 0x7F800000, bits)  # inf / NaN
    v = torch.where(mag <= sub_max, mag.float() * sub_step, bits.view(torch.float32))
    return torch.where((c & 0x80) != 0, -v, v)


def nvfp4_global_scale(amax: Tensor) -> Tensor:
    """FP32 per-tensor scale ``amax / (448 * 6)``, so the largest block scale fits E4M3.

    ``amax == 0`` gives 1.0; non-finite amax gives NaN (the whole tensor then decodes to NaN).
    """
    return _scale_from_amax(amax, _E4M3_MAX * _E2M1_MAX)


def _global_rows(global_scale: Tensor, nblk: int) -> Tensor:
    try:
        return torch.broadcast_to(global_scale.float(), (nblk, 1))
    except RuntimeError as e:
        raise ValueError(
            f"global_scale of shape {tuple(global_scale.shape)} is not broadcastable to [nblk, 1] = [{nblk}, 1]"
        ) from e


def _e2m1_index(a: Tensor, rounding: str, generator: torch.Generator | None) -> Tensor:
    """Magnitude code (0-7, int32) on the E2M1 grid of ``a`` in ``[0, 6]`` (NaN gives 7).

    Nearest: the number of rounding boundaries strictly below ``a``: ``torch.bucketize`` in eager mode, and in a
    compiled graph ``7 - #(a <= boundary)`` (seven comparisons that vectorise; a NaN compares false with every
    boundary, so it gets 7 without an ``isnan`` pass). At the midpoints whose tie goes up to the even code (0.75 -> 1.0,
    1.75 -> 2.0,
    3.5 -> 4.0) the boundary is the FP32 value just below the midpoint, so "a > boundary" means
    "a >= midpoint"; the other ties stay down (even code).
    """
    if rounding == "nearest":
        if not torch.compiler.is_compiling():  # eager: one bucketize, the same codes (NaN above every boundary)
            return torch.bucketize(a, _const(_E2M1_BOUNDS, a.device), out_int32=True)
        below = (a <= _E2M1_BOUNDS[0]).to(torch.int32)
        for b in _E2M1_BOUNDS[1:]:
            below = below + (a <= b).to(torch.int32)
        return 7 - below
    q = _stochastic_round(a, 1, 0, generator)  # E2M1: 1 mantissa bit, min normal 1, subnormal 0.5
    return torch.bucketize(q, _const(_E2M1_GRID, a.device), out_int32=True).clamp_(max=7)  # q's grid index


# Nibble (un)packing through a wider integer view (8 codes per int64 word) runs as plain vectorised integer
# arithmetic; it relies on the byte order of the view, so big-endian hosts take the per-pair form instead.
_LITTLE_ENDIAN = sys.byteorder == "little"


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 ``[..., n / 2]``: 4-bit ``codes`` (uint8 ``[..., n]``, values 0-15, ``n`` a multiple of 16, contiguous)
    packed two per byte, element ``2i`` in the low nibble and ``2i + 1`` in the high one.

    In a compiled CPU graph eight codes are read as one int64 word (little-endian: code ``j`` in byte ``j``) and
    folded into four bytes with shifts and masks, one vectorised pass instead of a strided pair loop; eagerly
    (fewer, larger ops) and on a GPU the even and odd codes are combined directly.
    """
    if not _LITTLE_ENDIAN or not _compiling_on_cpu(codes):  # eager or GPU: the pairs directly
        pairs = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)
    v = codes.view(torch.int64)  # [..., n / 8], byte j = code j (< 16)
    p = v & 0x0F
    for j in range(1, 8):  # code j (bits 8j..8j+3) -> bits 4j..4j+3
        p = p | ((v >> (4 * j)) & (0x0F << (4 * j)))
    return p.to(torch.int32).view(torch.uint8)  # the low 32 bits hold the 4 packed bytes


def unpack_nibbles(packed: Tensor) -> Tensor:
    """uint8 ``[..., 2m]``: the 4-bit codes of uint8 ``packed`` ``[..., m]`` (``m`` a multiple of 4, contiguous),
    low nibble first: the inverse of :func:`pack_nibbles`."""
    if not _LITTLE_ENDIAN or not _compiling_on_cpu(packed):  # eager or GPU: the two nibbles stacked
        return torch.stack((packed & 15, packed >> 4), dim=-1).view(*packed.shape[:-1], 2 * packed.shape[-1])
    v = packed.view(torch.int32).to(torch.int64)  # 4 packed bytes per word
    o = v & 0x0F
    for j in range(1, 8):  # nibble j (bits 4j..4j+3) -> byte j (bits 8j..8j+3)
        o = o | (((v >> (4 * j)) & 0x0F) << (8 * j))
    return o.view(torch.uint8)


def nvfp4_block_scales(block_amax: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The E4M3 block scales of NVFP4 from each block's amax.

    ``s = block_amax / (6 * global)`` rounded to E4M3 (nearest-even, saturating at 448; the smallest positive
    E4M3, 2**-9, if that rounds to 0 for a non-zero block; NaN, code 0x7F, if the amax is not finite or ``s``
    is NaN).

    Args:
        block_amax: float32 ``[nblk]``, max ``|x|`` of each 16-element block.
        global_scale: float32 ``[nblk]`` (or broadcastable), the per-tensor scale of each block's tensor.

    Returns:
        ``(codes, scale, divisor)``: uint8 ``[nblk]`` E4M3 bit patterns, their float32 values ``s``, and the
        float32 element divisor ``s * global`` (1.0 where that is 0: all-zero blocks).
    """
    s_units = block_amax / (_E2M1_MAX * global_scale)
    bad = ((block_amax - block_amax) != 0) | (s_units != s_units)  # amax inf or NaN, or NaN units
    s = torch.clamp(s_units, max=_E4M3_MAX).to(torch.float8_e4m3fn).float()
    s = torch.where((s == 0) & (block_amax > 0), 2.0**-9, s)
    s = torch.where(bad, math.nan, s)  # +NaN: the one NaN pattern 0x7F on every backend
    divisor = s * global_scale
    return s.to(torch.float8_e4m3fn).view(torch.uint8), s, torch.where(divisor == 0, 1.0, divisor)


def nvfp4_element_codes(
    x: Tensor, divisor: Tensor, rounding: str = "nearest", generator: torch.Generator | None = None
) -> Tensor:
    """uint8 ``[nblk, 16]`` 4-bit E2M1 codes (sign bit 3 | magnitude index bits 0-2) of float32 ``x``
    ``[nblk, 16]`` divided by its block's ``divisor`` ``[nblk]`` (:func:`nvfp4_block_scales`), clamped to +-6.

    The sign is the FP32 sign bit of the quotient (-0.0 included); a NaN element gets magnitude code 7.
    """
    y = x / divisor.unsqueeze(1)
    a = y.abs().clamp(max=_E2M1_MAX)
    codes = _e2m1_index(a, rounding, generator) | ((y.view(torch.int32) < 0).to(torch.int32) << 3)
    return codes.to(torch.uint8)


def nvfp4_encode(
    x: Tensor, global_scale: Tensor, rounding: str = "nearest", generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Encode blocks of 16 FP32 values as NVFP4.

    Per block: ``s = block_amax / (6 * global)`` rounded to E4M3 (:func:`nvfp4_block_scales`), then elements
    ``x / (s * global)`` clamped to +-6 and rounded to the E2M1 grid (nearest-even or stochastic;
    :func:`nvfp4_element_codes`), packed two per byte (:func:`pack_nibbles`).

    Args:
        x: float32 ``[nblk, 16]``.
        global_scale: float32 broadcastable to ``[nblk, 1]`` (one value per row is allowed, so rows
            may belong to different tensors); normally :func:`nvfp4_global_scale` of the tensor amax.
        rounding: ``"nearest"`` or ``"stochastic"`` (elements only; block scales are always nearest).
        generator: uniform draws for stochastic rounding, on ``x``'s device.

    Returns:
        ``(packed, block_scale_codes)``: uint8 ``[nblk, 8]`` with element ``2i`` in the low nibble and
        ``2i+1`` in the high nibble (code = sign bit 3 | magnitude index bits 0-2), and uint8
        ``[nblk]`` E4M3 bit patterns. E2M1 has no NaN: a block holding NaN or inf (or a NaN global
        scale) gets the NaN block scale code, so the whole block decodes to NaN.

    Raises:
        ValueError: ``x`` not ``[nblk, 16]``, ``global_scale`` not broadcastable, unknown ``rounding``.
        TypeError: ``x`` is not float32.
    """
    _check_rounding(rounding)
    _check_f32(x, "x")
    if x.dim() != 2 or x.shape[1] != NVFP4_BLOCK:
        raise ValueError(f"x must be [nblk, {NVFP4_BLOCK}], got {tuple(x.shape)}")
    g = _global_rows(global_scale, x.shape[0]).reshape(-1)
    s_code, _, divisor = nvfp4_block_scales(x.abs().amax(dim=1), g)
    return pack_nibbles(nvfp4_element_codes(x.contiguous(), divisor, rounding, generator)), s_code


def _e2m1_values(c: Tensor) -> Tensor:
    """float32 E2M1 value of integer 4-bit codes ``c`` (bit 3 sign, bits 0-2 the magnitude index ``k`` into
    0, 0.5, 1, 1.5, 2, 3, 4, 6): ``k / 2`` for ``k < 4``, ``k - 2`` for ``k < 6``, else ``2k - 8``; code 8 is
    -0.0. Exact. Eagerly a table lookup; in a compiled graph float arithmetic and selects (they vectorise)."""
    if not torch.compiler.is_compiling():  # eager: one lookup in the 16-entry table
        return _const(_E2M1_SIGNED, c.device)[c.long()]
    k = c & 7
    kf = k.float()
    mag = torch.where(k < 4, kf * 0.5, torch.where(k < 6, kf - 2.0, kf * 2.0 - 8.0))
    return torch.where((c & 8) != 0, -mag, mag)


def e2m1_unpack(packed: Tensor) -> Tensor:
    """float32 ``[..., 2n]``: the E2M1 values of uint8 ``packed`` ``[..., n]`` (element ``2i`` in the low nibble,
    ``2i+1`` in the high one, as :func:`nvfp4_encode` packs them; ``n`` a multiple of 4)."""
    return _e2m1_values(unpack_nibbles(packed.contiguous()).to(torch.int32))


def nvfp4_decode(packed: Tensor, block_scale_codes: Tensor, global_scale: Tensor) -> Tensor:
    """float32 ``[nblk, 16]``: ``e2m1 * e4m3_block_scale * global_scale``.

    Args:
        packed: uint8 ``[nblk, 8]`` as produced by :func:`nvfp4_encode`.
        block_scale_codes: uint8 ``[nblk]`` E4M3 bit patterns.
        global_scale: float32 broadcastable to ``[nblk, 1]``.

    Raises:
        ValueError: wrong shapes.
        TypeError: codes not uint8.
    """
    _check_u8(packed, "packed")
    _check_u8(block_scale_codes, "block_scale_codes")
    half = NVFP4_BLOCK // 2
    if packed.dim() != 2 or packed.shape[1] != half or block_scale_codes.shape != packed.shape[:1]:
        raise ValueError(
            f"expected packed [nblk, {half}] and block_scale_codes [nblk], got "
            f"{tuple(packed.shape)} and {tuple(block_scale_codes.shape)}"
        )
    nblk = packed.shape[0]
    g = _global_rows(global_scale, nblk)
    vals = e2m1_unpack(packed)
    s = block_scale_codes.view(torch.float8_e4m3fn).float().view(nblk, 1)
    return (vals * s) * g  # e2m1 * e4m3 is exact in FP32; one rounding for the global scale
