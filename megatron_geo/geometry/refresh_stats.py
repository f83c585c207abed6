"""Per-layer statistics of a GeoFP8 refresh: where the gradient's energy lies among the K-FAC factor's
eigen-directions, and what follows from it (``docs/design.md``, "When geometry helps").

For one layer with the refresh's transform at power 1, ``U`` (``[d_in, r]``, A's top-r eigenvectors) and
``d1_i = (lambda_ref + damping) / (lambda_i + damping)`` (``[r]``), and the DP ranks' local gradients
``G_r`` (``[d_out, d_in]``):

- energies ``e_i = sum_r ||G_r u_i||^2`` (i = 1..r) and ``E = sum_r ||G_r||^2``; the remaining
  ``e_rest = E - sum_i e_i`` lies in the ``d_in - r`` other directions, at the mean eigenvalue ``lambda_ref``.
- slope ``s`` of energy against eigenvalue: the least-squares slope of ``log e`` against
  ``log((lambda + damping) / (lambda_ref + damping)) = -log d1`` over the r top points and the rest point
  ``(0, log(e_rest / (d_in - r)))`` (each point weight 1). ``s ~ 1``: noise-dominated gradients
  (``E||G u||^2`` grows like ``lambda``); ``s ~ 2``: gradients coherent across ranks (``G ~ B A``).
- ``auto_power(s) = clip(s / 4, 0, 1/2)`` (``geo.power=auto``; the layer stays Euclidean when the relative-precision
  model below predicts a gain under :data:`MIN_AUTO_GAIN` for that power). Source: the white-noise model below is
  minimised over any diagonal scaling in A's eigenbasis by ``d_i ~ e_i^(-1/4)`` (Cauchy-Schwarz); with
  ``e_i ~ lambda_i^s`` that is ``D = d1^(s/4)``. Capped at the paper's whitening 1/2; 0 is Euclidean.
- predicted RelL2 ratio (geo / Euclidean), two models for ``d = d1^p``:
  white noise (the quantisation error white in wire coordinates with energy proportional to the wire's):
  ``ratio^2 = (sum_i e_i d_i^2 + e_rest) (sum_i d_i^-2 + d_in - r) / (d_in E)``; relative precision (each
  wire element rounded with the same relative error, independently, as FP8 with a fresh scale does):
  ``ratio^2 = sum_k c_k q_k / E`` with ``c_k = sum_r ||G_r T e_k||^2`` the wire's column energies and
  ``q_k = ||e_k^T T^-1||^2 = 1 + sum_i U_ki^2 (d_i^-2 - 1)``. The white-noise model cannot see that a
  transform along one input channel gains nothing in a relative-precision format (``docs/design.md``, "When
  geometry helps"); the relative-precision one can, and is the ``pred_gain = 1 - ratio`` that ``geo.select=gain`` ranks
  by.
- spread of A's outlier eigenvectors: inverse participation ratio ``IPR(u) = sum_j u_j^4`` (1: one input
  channel; 1/k: k channels equally; ~3 / d_in: a dense Gaussian direction), averaged over the eigenvectors
  whose eigenvalue is at least twice the rest's (``d1 <= 1/2``; the top one if none is).
- cancellation across ranks in the top-r subspace: ``sqrt(sum_r ||G_r U||^2 / R) / ||sum_r G_r U / R||``
  (1: every rank sends the same gradient; ~sqrt(R): independent noise).

All functions work on tensors on the gradient's device and never synchronise with the host; the caller
reads the results once per refresh.
"""

from __future__ import annotations

import torch

OUTLIER_D1 = 0.5  # an outlier eigen-direction: (lambda + damping) >= 2 (lambda_ref + damping)
MAX_AUTO_POWER = 0.5  # the paper's whitening
# geo.power=auto keeps a layer Euclidean (p = 0) unless the relative-precision model predicts a RelL2 at least
# this much lower: a transform predicted to gain nothing (outliers confined to single input channels, i.i.d.
# gradients) only adds rounding noise and work. Measured predictions: 0.00 where the measured change is within
# noise of 0 (iid, channel-spikes), 0.12-0.85 where the transform helps (docs/geofp8_fidelity.md).
MIN_AUTO_GAIN = 0.05


def layer_moments(grad: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """One rank's summable moments of a layer: ``[e_1..e_r, ||G||^2, (G U).flatten()]`` (FP64, on G's device).

    Args:
        grad: ``[d_out, d_in]`` local gradient (any float dtype).
        U: ``[d_in, r]`` orthonormal columns (float32).

    Summed over DP ranks, the first ``r + 1`` entries are ``e`` and ``E`` of the module docstring and the
    rest is ``sum_r G_r U`` (``[d_out, r]``).
    """
    g = grad.float()
    gu = g @ U.to(g.dtype)
    return torch.cat([gu.double().pow(2).sum(0), g.double().pow(2).sum().view(1), gu.double().reshape(-1)])


def energy_slope(e: torch.Tensor, total: torch.Tensor, d1: torch.Tensor, d_in: int) -> torch.Tensor:
    """The slope ``s`` of the module docstring (FP64 scalar tensor; 0 when the eigenvalues do not spread).

    Args:
        e: ``[r]`` energies along A's top-r eigenvectors; total: scalar ``E``.
        d1: ``[r]`` the transform's D at power 1 (``(lambda_ref + damping) / (lambda_i + damping)``).
        d_in: the layer's input size.
    """
    e, d1 = e.double(), d1.double()
    r = e.numel()
    floor = total.double().clamp(min=1e-300) * 1e-30
    x = -d1.clamp(min=1e-300).log()
    y = e.clamp(min=0).add(floor).log()
    if d_in > r:
        rest = (total.double() - e.sum()).clamp(min=0).add(floor) / (d_in - r)
        x = torch.cat([x, x.new_zeros(1)])
        y = torch.cat([y, rest.log().view(1)])
    xc, yc = x - x.mean(), y - y.mean()
    sxx = (xc * xc).sum()
    return torch.where(sxx > 1e-12, (xc * yc).sum() / sxx.clamp(min=1e-12), torch.zeros_like(sxx))


def auto_power(slope: torch.Tensor) -> torch.Tensor:
    """``geo.power=auto``: ``clip(s / 4, 0, 1/2)`` (FP64 tensor of the slope's shape)."""
    return (slope.double() / 4.0).clamp(0.0, MAX_AUTO_POWER)


def predicted_ratio(e: torch.Tensor, total: torch.Tensor, d: torch.Tensor, d_in: int) -> torch.Tensor:
    """White-noise model of RelL2(geo) / RelL2(Euclidean) for the transform with diagonal ``d`` (``[r]``)
    (module docstring); 1 for ``E = 0``. FP64 scalar tensor."""
    e, d, total = e.double(), d.double(), total.double()
    r = e.numel()
    rest = (total - e.sum()).clamp(min=0)
    wire = (e * d * d).sum() + rest
    back = (1.0 / (d * d)).sum() + (d_in - r)
    ratio2 = wire * back / (d_in * total.clamp(min=1e-300))
    return torch.where(total > 0, ratio2.sqrt(), torch.ones_like(ratio2))


def inverse_row_norms2(U: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``q_k = ||e_k^T T^-1||^2 = 1 + sum_i U_ki^2 (d_i^-2 - 1)`` (FP64 ``[d_in]``) of ``T = I + U (D - I) U^T``."""
    return 1.0 + (U.double().pow(2) * (d.double().pow(-2) - 1.0)).sum(1)


def relative_ratio(col_energy: torch.Tensor, U: torch.Tensor, d: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The relative-precision model's RelL2 ratio (module docstring) from the DP-summed column energies of
    the wire ``c`` (``[d_in]``), the transform's ``U`` (``[d_in, r]``) and ``d`` (``[r]``) and ``E``; 1 for
    ``E = 0``. FP64 scalar tensor."""
    q = inverse_row_norms2(U, d)
    total = total.double()
    ratio2 = (col_energy.double() * q).sum() / total.clamp(min=1e-300)
    return torch.where(total > 0, ratio2.sqrt(), torch.ones_like(ratio2))


def relative_gain(grads, T) -> torch.Tensor:
    """``1 - ratio`` of the relative-precision model (:func:`relative_ratio`) for transform ``T`` (a
    ``LowRankTransform``: ``apply``, ``U``, ``d``) and the ranks' gradients ``grads`` (``[d_out, d_in]`` each),
    summed over the list (one process holding every rank's gradient, as the fidelity tools do; the trainer
    sums the same column energies with an all-reduce). FP64 scalar tensor."""
    col = sum(T.apply(g.to(T.U.dtype)).double().pow(2).sum(0) for g in grads)
    total = sum(g.double().pow(2).sum() for g in grads)
    return 1.0 - relative_ratio(col, T.U, T.d, total)


def eigvec_ipr(U: torch.Tensor, d1: torch.Tensor) -> torch.Tensor:
    """Mean inverse participation ratio ``sum_j u_j^4`` of A's outlier eigenvectors: the columns of ``U``
    (``[d_in, r]``, unit columns) whose eigenvalue is at least twice the rest's (``d1 <= 1/2``), or the first
    column when there is none. FP64 scalar tensor; NaN for r = 0."""
    if U.shape[1] == 0:
        return torch.full((), float("nan"), dtype=torch.float64, device=U.device)
    ipr = U.double().pow(4).sum(0)
    keep = (d1.double() <= OUTLIER_D1) | (torch.arange(ipr.numel(), device=U.device) == 0)
    return (ipr * keep).sum() / keep.sum()


def cancellation(e: torch.Tensor, summed_gu: torch.Tensor, ranks: int) -> torch.Tensor:
    """``sqrt(sum_i e_i / R) / ||sum_r G_r U / R||`` (module docstring); inf when the mean projection is 0."""
    num = (e.double().sum() / ranks).sqrt()
    den = summed_gu.double().norm() / ranks
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(num, float("inf")))


def wire_bound_hits(wire: torch.Tensor, fmt_max: float, underflow_below: float) -> torch.Tensor:
    """``[saturated, flushed, non-zero, elements]`` counts (FP64) of one rank's wire tensor under tensor scaling
    (``scale = amax / fmt_max``): saturated = elements at the format max after scaling; flushed = non-zero
    elements at or below ``underflow_below`` (half the smallest subnormal: they round to zero)."""
    g = wire.float()
    amax = g.abs().max()
    ok = torch.isfinite(amax) & (amax > 0)
    y = g.abs() / torch.where(ok, amax / fmt_max, torch.ones_like(amax))
    nz = g != 0
    counts = torch.stack([(y >= fmt_max).sum(), ((y <= underflow_below) & nz).sum(), nz.sum()]).double()
    counts = torch.where(ok, counts, torch.zeros_like(counts))
    return torch.cat([counts, counts.new_full((1,), float(g.numel()))])
