"""The paper's Euclidean collective (``comm.reduce_op=wire_sum``): FP8 codes summed in the wire format.

GeoFP8's paper (arXiv 2607.07494, Euclidean baseline) reduces FP8 gradients with the collective's own sum:
every rank quantises its gradient with one scale shared by the DP group (the MAX of the ranks' amax, so the
codes of different ranks mean the same thing), and the reduce-scatter adds codes in FP8, rounding the partial
sum back to FP8 at every hop of the ring. This module is the numerics of that sum, exactly:

- codes: ``c_r = RNE_sat(x_r / s)``, ``s = fp8_scale_from_amax(N * max_r amax_r)`` with pre-division
  (``comm.wire_sum_prediv=true``, the sum of N codes cannot leave the range; small values flush to zero
  sooner) or ``s = fp8_scale_from_amax(max_r amax_r)`` without (the sum saturates at the format's max:
  the paper's "upper bound hits");
- ring order: the chunk owned by rank ``o`` starts at rank ``o + 1`` and visits ``o + 2, ..., o`` (mod N),
  as in a ring reduce-scatter; at each hop ``p <- RNE_sat(p + c_r)``, where ``RNE_sat`` rounds to nearest,
  ties to even, and clamps to ``[-max, max]`` (NCCL's saturating FP8 conversion);
- result: ``p * s / N`` in FP32 (the one division by N: the documented exception to invariant 1 of docs/design.md
  section 3), in
  that order: the summed codes are decoded with ``s`` itself and the FP32 product divided by N
  (:func:`ring_mean`), on the reduce-scatter path and on the all-reduce path alike (there the summed codes
  travel with ``s``, not with ``s / N``: a pre-divided scale below 2^-126 is an FP32 subnormal with fewer
  significant bits than ``s``, and decoding with it would round differently).

The hop sum is formed in FP32: the sum of two FP8 values has at most 24 significant bits for E4M3 and is
rounded at most innocuously for E5M2 (24 >= 2 * 3 + 2 bits, the double-rounding bound for addition), so
``RNE_sat`` of the FP32 sum is the correctly rounded FP8 sum. ``tests/test_wire_sum.py`` checks this against
an independent FP64 simulation with a hand-written rounding to the FP8 grid.

Used by :class:`~megatron_geo.comm.lowp.LowPrecisionReducer` (exact emulation over an all-to-all of the codes,
or NCCL's native FP8 reduce-scatter where it exists) and by the fidelity tools (:func:`simulate_wire_sum`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config.checks import choices_of
from ..config.schema import CommConfig
from .codecs import FP8_FORMATS, dp_divisor, fp8_decode, fp8_encode, fp8_max, fp8_scale_from_amax

REDUCE_OPS = choices_of(CommConfig, "reduce_op")  # comm.reduce_op, as the schema lists them


def ring_order(dp: int, owner: int) -> list[int]:
    """Ranks in the order a ring reduce-scatter adds them into ``owner``'s chunk: ``owner + 1, ..., owner``."""
    return [(owner + 1 + i) % dp for i in range(dp)]


def ring_sum(codes: Tensor, owner: int, fmt: str) -> tuple[Tensor, Tensor]:
    """Sum FP8 codes in ring order, re-rounding to the format at every hop.

    Args:
        codes: uint8 ``[dp, n]``, row r = rank r's FP8 codes of ``owner``'s chunk (all with the same scale).
        owner: the rank whose chunk this is (sets the ring order, :func:`ring_order`).
        fmt: ``"fp8_e4m3"`` or ``"fp8_e5m2"``.

    Returns:
        ``(total, saturated)``: uint8 ``[n]`` codes of the sum (``RNE_sat`` at each of the ``dp - 1`` hops;
        NaN stays NaN), and bool ``[n]``: the partial sum left ``[-max, max]`` at some hop.

    Cost: ``dp - 1`` dependent steps of a few element-wise ops (the ring is sequential; no host sync).
    """
    f8, m = FP8_FORMATS[fmt], fp8_max(fmt)
    order = ring_order(codes.shape[0], owner)
    vals = codes.view(f8)
    acc = vals[order[0]].float()
    saturated = torch.zeros(acc.shape, dtype=torch.bool, device=acc.device)
    for src in order[1:]:
        s = acc + vals[src].float()
        saturated |= s.abs() > m
        acc = s.clamp_(-m, m).to(f8).float()
    return acc.to(f8).view(torch.uint8), saturated


def ring_mean(decoded_total: Tensor, dp: int) -> Tensor:
    """The DP mean ``p * s / N`` from the decoded ring sum, in place.

    Args:
        decoded_total: float32, any shape: the summed codes ``p`` decoded with the shared scale ``s`` itself
            (``p * s``, one FP32 rounding); never with a pre-divided ``s / N``.
        dp: the DP size ``N`` (>= 1).

    Returns:
        ``decoded_total`` divided by ``dp`` (one more FP32 rounding, an IEEE division by the float32 tensor
        :func:`.codecs.dp_divisor` on every backend; a Python-number divisor is a multiplication by its reciprocal
        on CUDA): the collective's documented result.
    """
    return decoded_total.div_(dp_divisor(dp, decoded_total.device))


def wire_sum_scale(amax: Tensor, fmt: str, dp: int, prediv: bool) -> Tensor:
    """FP32 shared scale(s) from the DP-wide amax (any shape): ``amax * dp / max`` with pre-division, else
    ``amax / max`` (:func:`.codecs.fp8_scale_from_amax`; 0 -> 1, non-finite -> NaN)."""
    return fp8_scale_from_amax(amax * dp if prediv else amax, fmt)


def simulate_wire_sum(rank_grads: list[Tensor], fmt: str, prediv: bool = True) -> tuple[Tensor, dict]:
    """What the paper's FP8 collective returns for one parameter (tensor scaling, round to nearest).

    The flattened tensor is cut into ``N`` near-equal chunks, chunk ``o`` reduced in the ring order that
    ends at rank ``o`` (:func:`ring_sum`), with one scale shared by all ranks (:func:`wire_sum_scale`).

    Args:
        rank_grads: N float32 tensors of one shape (rank r's gradient).
        fmt: ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        prediv: divide by N before the sum (inside the scale) instead of after it.

    Returns:
        ``(avg, hits)``: float32 tensor of the gradients' shape (the DP average as the collective leaves it),
        and ``{"saturated": fraction of elements whose partial sum hit the format's max at some hop,
        "flushed": fraction of non-zero inputs (over all ranks) whose own code is zero}``.

    Raises:
        ValueError: unknown ``fmt``, no gradients, or gradients of different shapes.
    """
    if fmt not in FP8_FORMATS:
        raise ValueError(f"wire_sum needs an fp8 format (fp8_e4m3 or fp8_e5m2), got {fmt!r}")
    if not rank_grads or any(g.shape != rank_grads[0].shape for g in rank_grads):
        raise ValueError("simulate_wire_sum needs one or more gradients of one shape")
    n = len(rank_grads)
    x = torch.stack([g.detach().float().reshape(-1) for g in rank_grads])  # [N, numel]
    scale = wire_sum_scale(x.abs().amax(), fmt, n, prediv)
    codes = fp8_encode(x, scale, fmt)
    flushed = ((codes.view(FP8_FORMATS[fmt]).float() == 0) & (x != 0)).sum() / x.numel()
    totals, sats = [], []
    for o, idx in enumerate(torch.arange(x.shape[1], device=x.device).tensor_split(n)):
        t, s = ring_sum(codes[:, idx], o, fmt)
        totals.append(t)
        sats.append(s)
    avg = ring_mean(fp8_decode(torch.cat(totals), scale, fmt), n)
    hits = {"saturated": float(torch.cat(sats).float().mean()) if x.shape[1] else 0.0, "flushed": float(flushed)}
    return avg.view(rank_grads[0].shape), hits
