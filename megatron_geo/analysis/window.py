"""Windowed fidelity with error feedback (docs/design.md section 4, windowed RelL2): RelL2 of the sum of K consecutive
reduced steps.

For steps k = 1..K with rank gradients ``G_{k,r}`` and a coordinate transform ``T`` fixed over the window
(GeoFP8 refreshes every 50 steps; ``T = I`` is Euclidean), each rank sends

    W_{k,r} = G_{k,r} T + R_{k-1,r}          (R_0 = 0; without error feedback R stays 0)
    Q_{k,r} = decode(encode(W_{k,r}))        (its own scale, :func:`~megatron_geo.comm.roundtrip.quantize_roundtrip`)
    R_{k,r} = W_{k,r} - Q_{k,r}              (with error feedback: the residual, kept in wire coordinates)

and the reduce returns ``g^_k = (sum_r Q_{k,r} / N) T^-1`` (FP32 accumulation, one division by N, the map back
in FP64 as :func:`~megatron_geo.analysis.fidelity.simulate_geo_reduce` does). The metric is
``||sum_k g^_k - sum_k g_k|| / ||sum_k g_k||`` with ``g_k`` the FP64 average. With error feedback the sum
telescopes: ``sum_k g^_k = sum_k g_k - (sum_r R_{K,r} / N) T^-1``, so the window's error is only the last
residual (what the windowed RelL2 of docs/design.md section 4 measures); without it the per-step
errors add up.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..comm.roundtrip import normalize_codec, quantize_roundtrip
from .coordinates import fp64_transform

MODES = ("euclidean", "euclidean_ef", "geo", "geo_ef")


def window_sum(
    step_grads: list[list[Tensor]], codec: dict | str, transform=None, error_feedback: bool = False
) -> tuple[Tensor, Tensor]:
    """``(sum_k g^_k, sum_k g_k)`` in FP64 (``[d_out, d_in]``) over the window (module docstring).

    Args:
        step_grads: K lists of N float32 rank gradients ``[d_out, d_in]`` (step-major).
        codec: an FP8/NVFP4/BF16 codec dict or spec string without rotation (per-rank scales).
        transform: input-side transform (``apply`` / ``apply_inverse``) or None (Euclidean).
        error_feedback: keep each rank's residual in wire coordinates.

    Raises:
        ValueError: an empty window, a rank count that changes between steps, or a codec with a rotation.
    """
    c = normalize_codec(codec)
    if c["transform"] != "none":
        raise ValueError("the windowed metric takes codecs without a rotation (transform=none)")
    if not step_grads or not step_grads[0]:
        raise ValueError("the window needs at least one step with at least one rank")
    n = len(step_grads[0])
    t = fp64_transform(transform)
    residual = [None] * n
    got = torch.zeros(step_grads[0][0].shape, dtype=torch.float64)
    want = torch.zeros_like(got)
    for grads in step_grads:
        if len(grads) != n:
            raise ValueError(f"every step needs the same number of ranks ({n}), got {len(grads)}")
        acc = torch.zeros(got.shape, dtype=torch.float32)
        for r, g in enumerate(grads):
            w = (t.apply(g.double()) if t is not None else g.double()).float()
            if error_feedback and residual[r] is not None:
                w = w + residual[r]
            q = quantize_roundtrip(w, c)
            if error_feedback:
                residual[r] = w - q
            acc += q
        avg = (acc / n).double()
        got += t.apply_inverse(avg) if t is not None else avg
        want += torch.stack([g.double() for g in grads]).mean(0)
    return got, want


def windowed_rel_l2(layers: list[tuple[list[list[Tensor]], object]], codec: dict | str) -> dict:
    """RelL2 of the window's sum for Euclidean, Euclidean + EF, geo and geo + EF: ``{mode: float}`` over
    :data:`MODES` (NaN where the window's reference sum is zero: a relative error of nothing is undefined), over
    the concatenation of ``layers`` (``[(step_grads, transform or None)]``, see
    :func:`window_sum`; a layer without a transform is Euclidean in the geo modes too, as an unselected layer
    is in the trainer)."""
    out = {}
    for mode in MODES:
        geo, ef = mode.startswith("geo"), mode.endswith("_ef")
        err2 = ref2 = 0.0
        for step_grads, transform in layers:
            got, want = window_sum(step_grads, codec, transform if geo else None, ef)
            err2 += float((got - want).norm()) ** 2
            ref2 += float(want.norm()) ** 2
        out[mode] = err2**0.5 / ref2**0.5 if ref2 > 0 else math.nan  # no reference: undefined, not 0
    return out
