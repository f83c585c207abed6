"""Per-layer choice of the exponent p of GeoFP8's D (``geo.power_search``), made at each refresh.

The whitening exponent of :func:`~megatron_geo.geometry.transform.build_transform` trades two errors:
shrinking the dominant input directions (``d_i < 1``) lowers the scale of the wire and the share of
bound hits, but mapping back multiplies the error along ``u_i`` by ``1 / d_i``. Which side wins depends
on the layer and the training stage (docs/geofp8_fidelity.md: p = 1/2 is 2.2x worse than Euclidean on a
trained tiny model, p = 1/4 better, p = 0 is Euclidean FP8 itself). So at a refresh, each candidate p
is tried on the gradient that is about to be reduced:

    err_p = sum over DP ranks of || Q(G_r T_p) T_p^-1 - G_r ||_F^2

with ``Q`` the configured codec's quantize-dequantize (round to nearest, one rank), ``G_r`` rank r's
local gradient and ``T_p = I + U (D^p - I) U^T`` the transform with ``D = (lambda_ref + damping) /
(lambda_i + damping)`` (power 1; p = 0 gives T = I). The sums are all-reduced over the DP group before
the choice, so every DP rank picks the same p (ties and non-finite errors: the earliest candidate).

Cost per refresh: ``len(powers)`` extra transform pairs and quantizations of each selected gradient,
``O(d_out d_in r)`` each, and one all-reduce of ``layers x len(powers)`` FP64 values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .transform import LowRankTransform, identity_transform


def with_power(base: LowRankTransform, p: float) -> LowRankTransform:
    """The transform whose D is ``base.d ** p`` (``base`` built with power 1); p = 0 is the identity.

    Args:
        base: ``U`` float32 ``[d_in, r]``, ``d`` float32 ``[r]`` (D at power 1, computed here in FP64).
        p: the exponent, in [0, 1].

    Returns:
        a :class:`LowRankTransform` sharing ``base.U`` (``U [d_in, 0]`` for p = 0).

    Raises:
        ValueError: p outside [0, 1].
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"power {p} must be in [0, 1]")
    if p == 0.0:
        return identity_transform(base.d_in, base.U.device)
    return LowRankTransform(base.U, (base.d.double() ** p).float())


def roundtrip_errors(
    grad: torch.Tensor, base: LowRankTransform, powers: list[float], roundtrip: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``|| T_p^-1 Q(G T_p) - G ||_F^2`` for each p of ``powers`` (FP64 ``[len(powers)]``, gradient units
    squared). Non-finite errors become +inf.

    Args:
        grad: one layer's local gradient ``[d_out, d_in]`` (any float dtype; upcast to float32).
        base: the layer's transform at power 1 (``build_transform(A, r, damping, power=1.0)``).
        roundtrip: the codec's quantize-dequantize of a float32 tensor, same shape.
    """
    g = grad.float()
    out = torch.empty(len(powers), dtype=torch.float64, device=g.device)  # on the gradient's device: no sync
    for j, p in enumerate(powers):
        t = with_power(base, p)
        err = t.apply_inverse(roundtrip(t.apply(g))) - g
        out[j] = err.double().pow(2).sum()
    return torch.where(torch.isfinite(out), out, torch.full_like(out, float("inf")))  # NaN and inf -> +inf


def pick_powers(errors: torch.Tensor, powers: list[float]) -> list[float]:
    """The power with the smallest (DP-summed) error per row of ``errors`` (FP64 ``[layers, len(powers)]``),
    as a list of ``layers`` floats; ties and rows without a finite error go to the earliest candidate."""
    out = []
    for row in errors.tolist():
        best = 0
        for j, e in enumerate(row):
            if e < row[best]:
                best = j
        out.append(powers[best])
    return out
