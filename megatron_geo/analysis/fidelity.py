"""Offline gradient-fidelity measurement: what an N-rank low-precision reduce does to one parameter's
gradient, and the metrics of docs/design.md section 4 (RelL2, SQNR, cosine, MaxErr, bound hits,
per-direction error).

Codecs are the dicts / spec strings of :mod:`megatron_geo.comm.roundtrip` (``fp8_e4m3:tensor``,
``fp8_e4m3:block128``, ``fp8_e4m3:tensor+hadamard128``, ``fp8_e4m3:tensor:stochastic``, ``nvfp4``, ``bf16``).
Each rank rotates (optional) and quantizes its own gradient with its own scale(s), every rank's codes are
decoded with that rank's scales, summed in FP32 and divided by N once, then rotated back. Stochastic
rounding uses rank r's stream, so :func:`fidelity_metrics` sees the same codes as :func:`simulate_reduce`.

Transformed coordinates (GeoFP8 and its ablations, docs/design.md section 1): :func:`simulate_geo_reduce` sends
``T_out^T G_r T_in`` instead of ``G_r`` through the same codec and maps the average back with the
inverses; the transforms come from :mod:`.coordinates`; :func:`output_factor_from_grads` estimates the
output-side factor.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..comm.codecs import dp_divisor, mean_over_sources
from ..comm.roundtrip import from_wire, normalize_codec, quantize_wire, to_wire, wire_signs
from .coordinates import fp64_transform


def check_rank_grads(rank_grads: list[Tensor]) -> None:
    """Raise ValueError / TypeError unless ``rank_grads`` is a non-empty list of equal-shape float tensors."""
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
    check_rank_grads(rank_grads)
    signs = wire_signs(c)
    acc = torch.stack([quantize_wire(to_wire(g, c, signs), c, r)[0] for r, g in enumerate(rank_grads)])
    avg = mean_over_sources(acc, dp_divisor(len(rank_grads), acc.device))  # the reducer's order and division
    return from_wire(avg, c, signs, rank_grads[0].shape)


def _rank_masks(x: Tensor, c: dict, rank: int, signs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, int]:
    """(saturated, underflowed, non-zero) masks over the wire elements of rank ``rank``, and how many of
    the wire elements are counted (the parameter's elements; with a rotation, the padded rotated vector)."""
    y = to_wire(x, c, signs)
    dec, sat = quantize_wire(y, c, rank)
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
    sat, und, nz, n = _rank_masks(x, c, rank, wire_signs(c))
    s, u, z = int(sat.sum()), int(und.sum()), int(nz.sum())
    sat_f = s / n if n else 0.0
    und_f = u / z if z else 0.0
    return {
        "saturated": s,
        "underflow": u,
        "nonzero": z,
        "elements": n,
        "saturation": sat_f,
        "underflow_fraction": und_f,
        "bound_hits": sat_f + und_f,
    }


def _median(t: Tensor) -> float:
    return float(torch.quantile(t, 0.5))  # mean of the two middle values for even counts


def direction_errors(g_hat: Tensor, g: Tensor) -> dict:
    """Per-direction error of a 2-D estimate ``g_hat`` of ``g`` (docs/design.md section 4).

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
    signs = wire_signs(c)
    sat_any, und, nz, n = None, 0, 0, 0
    for r, x in enumerate(rank_grads):
        s, u, z, n = _rank_masks(x, c, r, signs)
        sat_any = s if sat_any is None else sat_any | s
        und += int(u.sum())
        nz += int(z.sum())
    n_sat = int(sat_any.sum())
    return {
        "saturated": n_sat,
        "elements": n,
        "saturation": n_sat / n if n else 0.0,
        "underflow_count": und,
        "nonzero": nz,
        "underflow": und / nz if nz else 0.0,
    }


def fidelity_metrics(
    g_hat: Tensor, rank_grads: list[Tensor], fmt: dict | str | None = None, *, directions: bool = True
) -> dict:
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
    check_rank_grads(rank_grads)
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
    out = {
        "rel_l2": rel,
        "sqnr_db": (-20.0 * math.log10(rel)) if rel > 0 else math.inf,
        "cosine": cos,
        "max_err": float(err.abs().max()) if err.numel() else 0.0,
        "norm": ng,
        "saturation": None,
        "underflow": None,
        "saturated": None,
        "elements": None,
        "underflow_count": None,
        "nonzero": None,
        "dir_err_top": None,
        "dir_err_tail": None,
        "n_directions": None,
    }
    if fmt is not None:
        out.update(_bound_hit_counts(rank_grads, normalize_codec(fmt)))
    if directions and g.dim() == 2:
        out.update(direction_errors(gh, g))
    return out


def output_factor_from_grads(rank_grads: list[Tensor]) -> Tensor:
    """K-FAC output factor estimated from N ranks' weight gradients ``G_r`` (``[d_out, d_in]``):
    ``S = sum_r G_r G_r^T / (N d_in)`` (FP64 accumulation, float32 ``[d_out, d_out]`` result). Each
    ``G_r = sum_t g_t a_t^T``, so up to the input factor this is E[g g^T]; only its eigenvectors and the
    ratios of its eigenvalues matter, because the damping is relative."""
    check_rank_grads(rank_grads)
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
    check_rank_grads(rank_grads)
    shape = rank_grads[0].shape
    if len(shape) != 2:
        raise ValueError(f"a transformed reduce needs 2-D [d_out, d_in] gradients, got shape {tuple(shape)}")
    if t_in is not None and t_in.d_in != shape[1]:
        raise ValueError(f"input-side transform has size {t_in.d_in}, the gradient d_in = {shape[1]}")
    if t_out is not None and t_out.d_in != shape[0]:
        raise ValueError(f"output-side transform has size {t_out.d_in}, the gradient d_out = {shape[0]}")


COLLECTIVES = ("fp32", "wire_sum")


def _reduce(wires: list[Tensor], c: dict, collective: str, prediv: bool) -> tuple[Tensor, dict]:
    """The averaged wire: per-rank scales and an FP32 sum (``fp32``, :func:`simulate_reduce`), or the paper's
    collective (``wire_sum``: one shared scale, codes summed in the wire format in ring order,
    :func:`megatron_geo.comm.wire_sum.simulate_wire_sum`, with its bound hits)."""
    if collective == "fp32":
        return simulate_reduce(wires, c), {}
    if collective != "wire_sum":
        raise ValueError(f"collective {collective!r} is not known; choose one of {', '.join(COLLECTIVES)}")
    if c["transform"] != "none" or c["scaling"] != "tensor" or c["rounding"] != "nearest":
        raise ValueError(
            "the wire_sum collective takes an fp8 codec with tensor scaling, round to nearest and no "
            "rotation, e.g. fp8_e4m3:tensor"
        )
    from ..comm.wire_sum import simulate_wire_sum

    avg, hits = simulate_wire_sum(wires, c["dtype"], prediv)
    return avg, {"wire_sum_saturated": hits["saturated"], "wire_sum_flushed": hits["flushed"]}


def _geo_reduce(rank_grads, c, t_in, t_out, fp64, collective: str = "fp32", prediv: bool = True):
    _check_2d(rank_grads, t_in, t_out)
    if fp64:
        t_in, t_out = fp64_transform(t_in), fp64_transform(t_out)
        wires = [to_transformed(g.double(), t_in, t_out).float() for g in rank_grads]
        avg, hits = _reduce(wires, c, collective, prediv)
        g_hat = from_transformed(avg.double(), t_in, t_out).float()
    else:
        wires = [to_transformed(g.float(), t_in, t_out) for g in rank_grads]
        avg, hits = _reduce(wires, c, collective, prediv)
        g_hat = from_transformed(avg, t_in, t_out)
    return g_hat, wires, hits


def simulate_geo_reduce(
    rank_grads: list[Tensor], codec: dict | str, t_in=None, t_out=None, *, fp64: bool = True
) -> Tensor:
    """An N-rank reduce of one linear weight's gradient in transformed coordinates (docs/design.md section 1,
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


def geo_reduce_and_metrics(
    rank_grads: list[Tensor],
    codec: dict | str,
    t_in=None,
    t_out=None,
    *,
    directions: bool = True,
    fp64: bool = True,
    collective: str = "fp32",
    prediv: bool = True,
) -> tuple[Tensor, dict]:
    """``(g_hat, metrics)``: :func:`simulate_geo_reduce` and :func:`geo_fidelity_metrics` of one reduce.

    ``collective``: ``fp32`` (per-rank scales, FP32 sum; the default and the trainer's ``comm.reduce_op=fp32_sum``)
    or ``wire_sum`` (the paper's collective, ``comm.reduce_op=wire_sum`` with ``comm.wire_sum_prediv=prediv``;
    adds ``wire_sum_saturated`` / ``wire_sum_flushed``, the collective's own bound-hit fractions)."""
    c = normalize_codec(codec)
    g_hat, wires, hits = _geo_reduce(rank_grads, c, t_in, t_out, fp64, collective, prediv)
    out = fidelity_metrics(g_hat, rank_grads, None, directions=directions)
    out.update(_bound_hit_counts(wires, c))
    out.update(hits)
    return g_hat, out


def geo_fidelity_metrics(
    rank_grads: list[Tensor], codec: dict | str, t_in=None, t_out=None, *, directions: bool = True, fp64: bool = True
) -> dict:
    """:func:`fidelity_metrics` of :func:`simulate_geo_reduce` against the exact FP64 average of the
    original ``rank_grads``; the bound-hit counts (saturation / underflow) are those of the wire tensors
    ``T_out^T G_r T_in``, i.e. of what is actually quantized. Same keys as :func:`fidelity_metrics`."""
    return geo_reduce_and_metrics(rank_grads, codec, t_in, t_out, directions=directions, fp64=fp64)[1]
