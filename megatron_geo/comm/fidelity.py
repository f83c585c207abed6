"""Offline gradient-fidelity measurement: what an N-rank low-precision reduce does to one parameter's
gradient, and the metrics of DESIGN.md section 4 (RelL2, SQNR, cosine, MaxErr, bound hits,
per-direction error).

A *codec* is a dict whose keys mirror the ``comm.*`` config keys (missing keys take these defaults)::

    {"dtype": "fp8_e4m3",       # fp32 | bf16 | fp8_e4m3 | fp8_e5m2 | nvfp4
     "scaling": "tensor",       # tensor (one FP32 scale per parameter) | block (one per block_size elements)
     "block_size": 128,         # elements per scale with scaling=block (fp8 only; nvfp4 is always 16)
     "transform": "none",       # none | hadamard (block-Hadamard rotation of the flattened parameter)
     "hadamard_block": 128,     # rotation block (power of two)
     "rounding": "nearest",     # nearest | stochastic
     "seed": 0}                 # Hadamard signs (hadamard_signs(hadamard_block, seed)) and stochastic draws

The numerics are the project's own kernels (:mod:`.codecs`, :mod:`.hadamard`), used the way
:class:`~megatron_geo.comm.lowp.LowPrecisionReducer` uses them, but per parameter instead of per bucket
chunk: each rank rotates (optional) and quantizes its own gradient with its own scale(s), every rank's
codes are decoded with that rank's scales, summed in FP32 and divided by N once, then rotated back.
Stochastic rounding draws from ``torch.Generator(device).manual_seed(seed * 1_000_003 + rank)``, so a
result is reproducible and :func:`fidelity_metrics` sees the same codes as :func:`simulate_reduce`.

Codec spec strings (CLI form, :func:`parse_codec` / :func:`codec_label`): ``DTYPE[:PART...]`` with parts
``tensor``, ``block`` or ``blockN``, ``hadamard`` or ``hadamardN``, ``stochastic``, ``nearest``, ``seedN``;
``+`` works as a separator too. Examples: ``fp8_e4m3:tensor``, ``fp8_e4m3:block128``,
``fp8_e4m3:tensor+hadamard128``, ``fp8_e4m3:tensor:stochastic``, ``nvfp4``, ``bf16``.

Transformed coordinates (GeoFP8 and its ablations, DESIGN.md section 1): :func:`simulate_geo_reduce` sends
``T_out^T G_r T_in`` instead of ``G_r`` through the same codec and maps the average back with the
inverses; :func:`build_coordinate_transform` builds ``T`` from a K-FAC factor as the low-rank GeoFP8
transform (:mod:`megatron_geo.geometry.transform`), at full rank, diagonal or block-diagonal, with the
trainer's relative damping; :func:`output_factor_from_grads` estimates the output-side factor.
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

from .codecs import (FP8_FORMATS, NVFP4_BLOCK, fp8_decode, fp8_encode, fp8_max, fp8_scale_from_amax, nvfp4_decode,
                     nvfp4_encode, nvfp4_global_scale)
from ..geometry.transform import LowRankTransform, build_transform, build_transform_from_sketch, sketch_matrix
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


# -- one rank's quantizer -----------------------------------------------------------------------------
def _pad_multiple(c: dict) -> int:
    m = 1
    if c["dtype"] == "nvfp4":
        m = NVFP4_BLOCK
    elif c["dtype"] in FP8_FORMATS and c["scaling"] == "block":
        m = c["block_size"]
    if c["transform"] == "hadamard":
        m = math.lcm(m, c["hadamard_block"])
    return m


def _to_wire(x: Tensor, c: dict, signs: Tensor | None) -> Tensor:
    """Flatten to FP32, zero-pad to the block multiple, rotate (optional): the vector that is quantized."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % _pad_multiple(c)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if signs is not None:
        hb = c["hadamard_block"]
        flat = block_hadamard(flat.view(-1, hb), signs.to(flat.device)).view(-1)
    return flat


def _from_wire(y: Tensor, c: dict, signs: Tensor | None, shape: torch.Size) -> Tensor:
    if signs is not None:
        hb = c["hadamard_block"]
        y = block_hadamard_inverse(y.view(-1, hb), signs.to(y.device)).view(-1)
    n = math.prod(shape)
    return y[:n].reshape(shape)


def _signs(c: dict) -> Tensor | None:
    return hadamard_signs(c["hadamard_block"], c["seed"]) if c["transform"] == "hadamard" else None


def _generator(c: dict, rank: int, device) -> torch.Generator | None:
    if c["rounding"] != "stochastic":
        return None
    g = torch.Generator(device=device)
    g.manual_seed(c["seed"] * 1_000_003 + rank)
    return g


def _quantize(y: Tensor, c: dict, rank: int) -> tuple[Tensor, Tensor]:
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
    gen = _generator(c, rank, y.device)
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
    return _from_wire(_quantize(_to_wire(x, c, None), c, 0)[0], c, None, x.shape)


def _check_grads(rank_grads: list[Tensor]) -> None:
    if not rank_grads:
        raise ValueError("rank_grads is empty: need the gradient of at least one rank")
    shape = rank_grads[0].shape
    for i, t in enumerate(rank_grads):
        if t.shape != shape:
            raise ValueError(f"rank {i}'s gradient has shape {tuple(t.shape)}, rank 0's {tuple(shape)}")
        if not t.is_floating_point():
            raise TypeError(f"rank {i}'s gradient has dtype {t.dtype}; expected float32")


def simulate_reduce(rank_grads: list[Tensor], codec: dict | str) -> Tensor:
    """What an N-rank reduce of one parameter through ``codec`` returns (the averaged gradient).

    Each rank flattens its gradient, zero-pads it to the quantization/rotation block (nvfp4: 16; block
    scaling: ``block_size``; Hadamard: ``hadamard_block``), rotates it (``transform=hadamard``), quantizes
    it with its own scale(s) (tensor: ``amax / fmt_max`` over the whole parameter; block: one per
    ``block_size`` contiguous elements; nvfp4: E4M3 scale per 16 elements under the parameter's FP32
    global scale ``amax / (448 * 6)``), and is decoded with those scales; the N decoded vectors are summed
    in FP32 and divided by N once, then rotated back, unpadded and reshaped.

    Args:
        rank_grads: N gradients of one parameter, float32 (other float dtypes are upcast), any identical
            shape, on one device.
        codec: codec dict (module docstring) or spec string.

    Returns:
        float32 tensor of the gradients' shape.

    Raises:
        ValueError / TypeError: empty list, mismatched shapes, non-float gradients, bad codec.
    """
    c = normalize_codec(codec)
    _check_grads(rank_grads)
    signs = _signs(c)
    acc = torch.stack([_quantize(_to_wire(g, c, signs), c, r)[0] for r, g in enumerate(rank_grads)])
    avg = acc.sum(dim=0).div_(len(rank_grads))
    return _from_wire(avg, c, signs, rank_grads[0].shape)


def _rank_masks(x: Tensor, c: dict, rank: int, signs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, int]:
    """(saturated, underflowed, non-zero) masks over the wire elements of rank ``rank``, and how many of
    the wire elements are counted (the parameter's elements; with a rotation, the padded rotated vector)."""
    y = _to_wire(x, c, signs)
    dec, sat = _quantize(y, c, rank)
    nz = y != 0
    und = nz & (dec == 0)
    n = y.numel() if signs is not None else x.numel()
    return sat[:n], und[:n], nz[:n], n


def bound_hits(x: Tensor, codec: dict | str, rank: int = 0) -> dict:
    """Bound hits of one tensor (one rank's gradient) under ``codec``.

    Counted on the quantized (wire) elements: the tensor's elements, or with ``transform=hadamard`` the
    rotated, zero-padded vector. Saturated: the code is the format's largest magnitude (see
    :func:`simulate_reduce` for the scales; with per-tensor amax scaling that is essentially only the
    amax element). Underflow: a non-zero element whose decoded value is exactly 0.

    Args:
        x: gradient, float32, any shape.
        codec: codec dict or spec string.
        rank: selects the stochastic-rounding stream (as in :func:`simulate_reduce`).

    Returns:
        ``{"saturated": int, "underflow": int, "nonzero": int, "elements": int, "saturation": float
        (saturated / elements), "underflow_fraction": float (underflow / nonzero; 0 when nonzero == 0),
        "bound_hits": float (saturation + underflow_fraction)}``.
    """
    c = normalize_codec(codec)
    sat, und, nz, n = _rank_masks(x, c, rank, _signs(c))
    s, u, z = int(sat.sum()), int(und.sum()), int(nz.sum())
    sat_f = s / n if n else 0.0
    und_f = u / z if z else 0.0
    return {"saturated": s, "underflow": u, "nonzero": z, "elements": n, "saturation": sat_f,
            "underflow_fraction": und_f, "bound_hits": sat_f + und_f}


def _median(t: Tensor) -> float:
    return float(torch.quantile(t, 0.5))  # mean of the two middle values for even counts


def direction_errors(g_hat: Tensor, g: Tensor) -> dict:
    """Per-direction error of a 2-D estimate ``g_hat`` of ``g`` (DESIGN.md section 4).

    With ``g = U S V^T`` (FP64 thin SVD), ``e_i = |u_i^T (g_hat - g) v_i| / s_i`` over the numerically
    non-zero singular values (``s_i > s_1 * max(m, n) * eps_fp64``, torch.linalg.matrix_rank's
    tolerance; division by a zero singular value is undefined). ``top``: median of ``e_i`` over the first
    quarter of those directions (at least 1); ``tail``: median over the last quarter (at least 1).

    Returns:
        ``{"dir_err_top": float | None, "dir_err_tail": float | None, "n_directions": int}``
        (None when ``g`` is zero).
    """
    gd = g.double()
    err = g_hat.double() - gd
    u, s, vh = torch.linalg.svd(gd, full_matrices=False)
    if s.numel() == 0 or s[0] == 0:
        return {"dir_err_top": None, "dir_err_tail": None, "n_directions": 0}
    keep = s > s[0] * max(gd.shape) * torch.finfo(torch.float64).eps
    k = int(keep.sum())
    u, s, vh = u[:, :k], s[:k], vh[:k]
    e = ((u.T @ err) * vh).sum(dim=1).abs() / s
    q = max(1, k // 4)
    return {"dir_err_top": _median(e[:q]), "dir_err_tail": _median(e[-q:]), "n_directions": k}


def _bound_hit_counts(rank_grads: list[Tensor], c: dict) -> dict:
    """Bound-hit counts of N ranks' wire tensors (see :func:`fidelity_metrics`: ``saturated`` = elements
    at the top of the range on at least one rank, ``underflow_count`` summed over ranks)."""
    signs = _signs(c)
    sat_any, und, nz, n = None, 0, 0, 0
    for r, x in enumerate(rank_grads):
        s, u, z, n = _rank_masks(x, c, r, signs)
        sat_any = s if sat_any is None else sat_any | s
        und += int(u.sum())
        nz += int(z.sum())
    n_sat = int(sat_any.sum())
    return {"saturated": n_sat, "elements": n, "saturation": n_sat / n if n else 0.0, "underflow_count": und,
            "nonzero": nz, "underflow": und / nz if nz else 0.0}


def fidelity_metrics(g_hat: Tensor, rank_grads: list[Tensor], fmt: dict | str | None = None, *,
                     directions: bool = True) -> dict:
    """Fidelity of a reduced gradient ``g_hat`` against the exact average of ``rank_grads``.

    With ``g = sum_r g_r / N`` in FP64 and ``err = g_hat - g`` (FP64):

    - ``rel_l2`` = ||err|| / ||g|| (0 if both are 0, inf if only g is 0); ``sqnr_db`` = -20 log10(rel_l2)
      (inf for an exact result); ``cosine`` = <g_hat, g> / (||g_hat|| ||g||) (1 if both are 0, NaN if one
      is); ``max_err`` = max |err|; ``norm``: ||g||.
    - with ``fmt`` (the codec, dict or spec string, used to quantize the ranks' gradients again exactly
      as :func:`simulate_reduce` does): ``saturation`` = fraction of wire elements whose code is the top
      of the range on at least one rank (``saturated`` / ``elements``); ``underflow`` = non-zero elements
      that decode to 0, over all ranks (``underflow_count`` / ``nonzero``). None without ``fmt``.
    - for 2-D gradients with ``directions``: ``dir_err_top``, ``dir_err_tail``, ``n_directions``
      (:func:`direction_errors`); None otherwise.

    Args:
        g_hat: the reduced gradient, any float dtype, the shape of each rank's gradient.
        rank_grads: the N per-rank gradients (float32).
        fmt: codec dict / spec string, or None to skip the bound-hit counts.
        directions: compute the per-direction error (an FP64 SVD) for 2-D gradients.

    Returns:
        dict of Python floats / ints / None with the keys named above.
    """
    _check_grads(rank_grads)
    if g_hat.shape != rank_grads[0].shape:
        raise ValueError(f"g_hat has shape {tuple(g_hat.shape)}, the gradients {tuple(rank_grads[0].shape)}")
    g = torch.stack([t.double() for t in rank_grads]).mean(dim=0)
    gh = g_hat.double()
    err = gh - g
    ng, ne, nh = float(g.norm()), float(err.norm()), float(gh.norm())
    if ng > 0:
        rel = ne / ng
    else:
        rel = 0.0 if ne == 0 else math.inf
    if ng > 0 and nh > 0:
        cos = float((gh * g).sum()) / (nh * ng)
    else:
        cos = 1.0 if ng == 0 and nh == 0 else math.nan
    out = {"rel_l2": rel, "sqnr_db": (-20.0 * math.log10(rel)) if rel > 0 else math.inf, "cosine": cos,
           "max_err": float(err.abs().max()) if err.numel() else 0.0, "norm": ng,
           "saturation": None, "underflow": None, "saturated": None, "elements": None,
           "underflow_count": None, "nonzero": None,
           "dir_err_top": None, "dir_err_tail": None, "n_directions": None}
    if fmt is not None:
        out.update(_bound_hit_counts(rank_grads, normalize_codec(fmt)))
    if directions and g.dim() == 2:
        out.update(direction_errors(gh, g))
    return out


# -- reduces in transformed coordinates (GeoFP8 and its ablations) -------------------------------------
# A transform here is any object with ``apply(g) = g T`` and ``apply_inverse(g) = g T^-1`` acting on the
# last dimension of ``g`` (``[..., d]``, float32): :class:`~megatron_geo.geometry.transform.LowRankTransform`
# (GeoFP8's own, DESIGN.md section 1), or the two ablation forms below.
class DiagonalTransform:
    """``T = diag(s)``: the transform of a diagonal approximation of the K-FAC factor.

    Attributes:
        s: float32 ``[d]``, positive.
    """

    def __init__(self, s: Tensor):
        self.s = s

    @property
    def d_in(self) -> int:
        return self.s.shape[0]

    def apply(self, g: Tensor) -> Tensor:
        """``g T`` for ``g`` ``[..., d]`` (float32)."""
        return g * self.s

    def apply_inverse(self, g: Tensor) -> Tensor:
        """``g T^-1`` for ``g`` ``[..., d]``."""
        return g / self.s

    def dense(self) -> Tensor:
        """T as a dense ``[d, d]`` float32 matrix."""
        return torch.diag(self.s)


class BlockDiagonalTransform:
    """``T = blockdiag(T_1, .., T_k)`` over consecutive groups of features (the last group may be shorter).

    Attributes:
        blocks: the per-group transforms (:class:`~megatron_geo.geometry.transform.LowRankTransform`),
            in feature order; group j covers features ``offsets[j] .. offsets[j + 1] - 1``.
    """

    def __init__(self, blocks: list):
        self.blocks = list(blocks)
        self.offsets = [0]
        for b in self.blocks:
            self.offsets.append(self.offsets[-1] + b.d_in)

    @property
    def d_in(self) -> int:
        return self.offsets[-1]

    def _map(self, g: Tensor, inverse: bool) -> Tensor:
        if g.shape[-1] != self.d_in:
            raise ValueError(f"block-diagonal transform of size {self.d_in} applied to a last dimension of "
                             f"{g.shape[-1]}")
        parts = []
        for b, lo, hi in zip(self.blocks, self.offsets[:-1], self.offsets[1:]):
            x = g[..., lo:hi]
            parts.append(b.apply_inverse(x) if inverse else b.apply(x))
        return torch.cat(parts, dim=-1)

    def apply(self, g: Tensor) -> Tensor:
        """``g T`` for ``g`` ``[..., d]`` (float32)."""
        return self._map(g, False)

    def apply_inverse(self, g: Tensor) -> Tensor:
        """``g T^-1`` for ``g`` ``[..., d]``."""
        return self._map(g, True)

    def dense(self) -> Tensor:
        """T as a dense ``[d, d]`` float32 matrix."""
        return torch.block_diag(*[b.dense() for b in self.blocks])


def relative_damping(A: Tensor, rel: float) -> float:
    """Absolute damping ``rel * trace(A) / d`` (``rel`` times A's mean eigenvalue), as
    :meth:`megatron_geo.geometry.geo.GeoState.refresh` computes it from ``geo.damping``."""
    return rel * max(float(A.diagonal().double().mean()), 1e-30)


def diagonal_transform(A: Tensor, damping: float) -> DiagonalTransform:
    """``T = diag( ((mean_i A_ii + damping) / (A_jj + damping)) ** 1/2 )`` from the diagonal of ``A``
    (``[d, d]``; FP64 arithmetic, float32 result); ``damping`` is absolute and must be > 0."""
    if not damping > 0:
        raise ValueError(f"damping={damping} must be > 0")
    a = A.diagonal().double().clamp(min=0.0)
    return DiagonalTransform(((a.mean() + damping) / (a + damping)).sqrt().float())


def block_diagonal_transform(A: Tensor, block: int, damping: float) -> BlockDiagonalTransform:
    """Block-diagonal transform: for every group of ``block`` consecutive features (the last one may be
    shorter), :func:`~megatron_geo.geometry.transform.build_transform` of A's diagonal block at full rank
    (rank = the group's size, so ``lambda_ref = 0`` and ``D = (damping / (lambda_i + damping)) ** 1/2``:
    ``T_j = damping ** 1/2 (A_jj + damping I) ** -1/2``; the same absolute ``damping`` in every block keeps
    the blocks on one scale). ``A``: ``[d, d]`` symmetric PSD; ``damping`` absolute, > 0."""
    if block <= 0:
        raise ValueError(f"block size {block} must be positive")
    d = A.shape[0]
    return BlockDiagonalTransform([build_transform(A[lo:min(lo + block, d), lo:min(lo + block, d)],
                                                   min(block, d - lo), damping) for lo in range(0, d, block)])


TRANSFORM_KINDS = ("lowrank", "full", "diag", "block", "sketch")


def _with_power(t, power: float):
    """The same transform with every scale raised to ``2 * power`` (``d = ratio ** 1/2`` -> ``ratio ** power``)."""
    if power == 0.5:
        return t
    if isinstance(t, LowRankTransform):
        return LowRankTransform(t.U, (t.d.double() ** (2.0 * power)).float())
    if isinstance(t, DiagonalTransform):
        return DiagonalTransform((t.s.double() ** (2.0 * power)).float())
    return BlockDiagonalTransform([_with_power(b, power) for b in t.blocks])


def build_coordinate_transform(A: Tensor, kind: str = "lowrank", rank: int = 32, damping: float = 1e-3,
                               block: int = 128, power: float = 0.5, sketch_size: int = 64, seed: int = 0):
    """A coordinate transform of one side of a linear layer's gradient from its K-FAC factor ``A``.

    Args:
        A: ``[d, d]`` symmetric PSD factor (input side: E[a a^T]; output side: E[g g^T]), any float dtype.
        kind: ``lowrank`` (GeoFP8: :func:`~megatron_geo.geometry.transform.build_transform` at ``rank``),
            ``full`` (the same at rank ``d``: ``T = damping ** 1/2 (A + damping I) ** -1/2``, damped
            whitening), ``diag`` (:func:`diagonal_transform`) or ``block`` (:func:`block_diagonal_transform`
            with blocks of ``block``) or ``sketch`` (the trainer's ``geo.statistics=sketch``: the rank-``rank``
            transform from the Nystrom sketch ``A Omega`` with ``sketch_size`` columns and A's trace, via
            :func:`~megatron_geo.geometry.transform.build_transform_from_sketch`; Omega seeded by ``seed``).
        damping: relative to A's mean eigenvalue (:func:`relative_damping`), as ``geo.damping``.
        power: exponent of the eigenvalue ratio in D, ``D = ((lambda_ref + damping) / (lambda_i +
            damping)) ** power``; 1/2 is GeoFP8's whitening (DESIGN.md section 1), other values are an
            ablation (1/4: half-way whitening in log scale; see docs/geofp8_fidelity.md).

    Returns:
        an object with ``apply`` / ``apply_inverse`` / ``dense`` (float32).
    """
    damp = relative_damping(A, damping)
    if kind == "lowrank":
        t = build_transform(A, rank, damp)
    elif kind == "full":
        t = build_transform(A, A.shape[0], damp)
    elif kind == "diag":
        t = diagonal_transform(A, damp)
    elif kind == "block":
        t = block_diagonal_transform(A, block, damp)
    elif kind == "sketch":
        omega = sketch_matrix(A.shape[0], min(sketch_size, A.shape[0]), seed, A.device)
        Af = A.float()
        t = build_transform_from_sketch(Af @ omega, omega, float(Af.double().trace()), rank, damp)
    else:
        raise ValueError(f"unknown transform kind {kind!r}; choose one of {', '.join(TRANSFORM_KINDS)}")
    return _with_power(t, power)


def output_factor_from_grads(rank_grads: list[Tensor]) -> Tensor:
    """K-FAC output factor estimated from N ranks' weight gradients ``G_r`` (``[d_out, d_in]``):
    ``S = sum_r G_r G_r^T / (N d_in)`` (FP64 accumulation, float32 ``[d_out, d_out]`` result). Each
    ``G_r = sum_t g_t a_t^T``, so up to the input factor this is E[g g^T]; only its eigenvectors and the
    ratios of its eigenvalues matter, because the damping is relative."""
    _check_grads(rank_grads)
    if rank_grads[0].dim() != 2:
        raise ValueError(f"the output factor needs 2-D gradients, got shape {tuple(rank_grads[0].shape)}")
    S = torch.zeros(rank_grads[0].shape[0], rank_grads[0].shape[0], dtype=torch.float64, device=rank_grads[0].device)
    for g in rank_grads:
        gd = g.double()
        S += gd @ gd.T
    return (S / (len(rank_grads) * rank_grads[0].shape[1])).float()


def input_gram_from_grads(rank_grads: list[Tensor]) -> Tensor:
    """``sum_r G_r^T G_r / (N d_out)`` (float32 ``[d_in, d_in]``): where the gradients' own energy lies
    among the input directions (an oracle factor for ablations, not a K-FAC statistic)."""
    return output_factor_from_grads([g.T for g in rank_grads])


def fp64_transform(t):
    """An FP64 copy of a transform (None stays None), for applying it without FP32 round-off.

    A :class:`~megatron_geo.geometry.transform.LowRankTransform`'s float32 ``U`` is orthonormal only to
    ~1e-7, and the inverse formula amplifies that by up to ``1 / min(d)``; the copy re-orthonormalizes
    ``U`` in FP64 (QR with the signs of R's diagonal made positive, i.e. Gram-Schmidt of U's columns,
    a change of O(1e-7)) so that ``T^-1 T = I`` to FP64 round-off. Diagonal and block-diagonal
    transforms are converted entry by entry / block by block.
    """
    if t is None:
        return None
    if isinstance(t, LowRankTransform):
        U = t.U.double()
        if U.shape[1]:
            q, r = torch.linalg.qr(U)
            sign = torch.sign(torch.diagonal(r))
            U = q * torch.where(sign == 0, torch.ones_like(sign), sign)
        return LowRankTransform(U, t.d.double())
    if isinstance(t, DiagonalTransform):
        return DiagonalTransform(t.s.double())
    if isinstance(t, BlockDiagonalTransform):
        return BlockDiagonalTransform([fp64_transform(b) for b in t.blocks])
    raise TypeError(f"fp64_transform: unsupported transform type {type(t).__name__}")


def to_transformed(g: Tensor, t_in=None, t_out=None) -> Tensor:
    """The wire tensor ``T_out^T G T_in`` of a ``[d_out, d_in]`` gradient, computed in ``g``'s dtype (the
    transforms must have the same dtype); a side whose transform is None is left as it is.
    ``T_out^T G`` is computed as ``(G^T T_out)^T`` with ``t_out.apply``."""
    y = g
    if t_in is not None:
        y = t_in.apply(y)
    if t_out is not None:
        y = t_out.apply(y.T).T
    return y.contiguous()


def from_transformed(y: Tensor, t_in=None, t_out=None) -> Tensor:
    """Inverse of :func:`to_transformed`: ``T_out^-T Y T_in^-1`` ``[d_out, d_in]`` in ``y``'s dtype."""
    if t_out is not None:
        y = t_out.apply_inverse(y.T).T
    if t_in is not None:
        y = t_in.apply_inverse(y)
    return y.contiguous()


def _check_2d(rank_grads: list[Tensor], t_in, t_out) -> None:
    _check_grads(rank_grads)
    shape = rank_grads[0].shape
    if len(shape) != 2:
        raise ValueError(f"a transformed reduce needs 2-D [d_out, d_in] gradients, got shape {tuple(shape)}")
    if t_in is not None and t_in.d_in != shape[1]:
        raise ValueError(f"input-side transform has size {t_in.d_in}, the gradient d_in = {shape[1]}")
    if t_out is not None and t_out.d_in != shape[0]:
        raise ValueError(f"output-side transform has size {t_out.d_in}, the gradient d_out = {shape[0]}")


def _geo_reduce(rank_grads, c, t_in, t_out, fp64):
    _check_2d(rank_grads, t_in, t_out)
    if fp64:
        t_in, t_out = fp64_transform(t_in), fp64_transform(t_out)
        wires = [to_transformed(g.double(), t_in, t_out).float() for g in rank_grads]
        g_hat = from_transformed(simulate_reduce(wires, c).double(), t_in, t_out).float()
    else:
        wires = [to_transformed(g.float(), t_in, t_out) for g in rank_grads]
        g_hat = from_transformed(simulate_reduce(wires, c), t_in, t_out)
    return g_hat, wires


def simulate_geo_reduce(rank_grads: list[Tensor], codec: dict | str, t_in=None, t_out=None, *,
                        fp64: bool = True) -> Tensor:
    """An N-rank reduce of one linear weight's gradient in transformed coordinates (DESIGN.md section 1,
    steps 3-4): every rank sends ``W_r = T_out^T G_r T_in`` (:func:`to_transformed`; both transforms must
    be the same on every rank, as the DP-all-reduced statistics make them in the trainer), the wires go
    through :func:`simulate_reduce` (float32 wire, per-rank scales, FP32 sum, one division by N), and the
    average is mapped back with :func:`from_transformed`. With both transforms None this is
    :func:`simulate_reduce`.

    Args:
        rank_grads: N float32 gradients ``[d_out, d_in]``.
        codec: codec dict or spec string (module docstring).
        t_in, t_out: input-side (size d_in) / output-side (size d_out) transform or None.
        fp64: apply the transforms in FP64 (:func:`fp64_transform`) so that only the codec loses (the
            default; with an ``fp32`` codec the result is the exact average to ~1e-7); False: the
            trainer's float32 arithmetic with the float32 transforms.

    Returns:
        float32 ``[d_out, d_in]``.
    """
    return _geo_reduce(rank_grads, normalize_codec(codec), t_in, t_out, fp64)[0]


def geo_reduce_and_metrics(rank_grads: list[Tensor], codec: dict | str, t_in=None, t_out=None, *,
                           directions: bool = True, fp64: bool = True) -> tuple[Tensor, dict]:
    """``(g_hat, metrics)``: :func:`simulate_geo_reduce` and :func:`geo_fidelity_metrics` of one reduce."""
    c = normalize_codec(codec)
    g_hat, wires = _geo_reduce(rank_grads, c, t_in, t_out, fp64)
    out = fidelity_metrics(g_hat, rank_grads, None, directions=directions)
    out.update(_bound_hit_counts(wires, c))
    return g_hat, out


def geo_fidelity_metrics(rank_grads: list[Tensor], codec: dict | str, t_in=None, t_out=None, *,
                         directions: bool = True, fp64: bool = True) -> dict:
    """:func:`fidelity_metrics` of :func:`simulate_geo_reduce` against the exact FP64 average of the
    original ``rank_grads``; the bound-hit counts (saturation / underflow) are those of the wire tensors
    ``T_out^T G_r T_in``, i.e. of what is actually quantized. Same keys as :func:`fidelity_metrics`."""
    return geo_reduce_and_metrics(rank_grads, codec, t_in, t_out, directions=directions, fp64=fp64)[1]
