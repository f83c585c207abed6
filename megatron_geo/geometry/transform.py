"""GeoFP8's input-side coordinate transform from a low-rank, damped K-FAC input factor.

Given the K-FAC input factor A = E[a a^T] (``d_in x d_in``, symmetric PSD) of a linear layer, with
eigenpairs ``(lambda_i, u_i)`` sorted descending, U = ``[u_1 .. u_r]`` (the top ``r``), and
``lambda_ref`` = the mean of the remaining eigenvalues ``lambda_{r+1..d_in}`` (0 if r >= d_in):

    D   = diag( ((lambda_ref + damping) / (lambda_i + damping)) ** p ),   i = 1..r   (p = geo.power, default 1/2)
    T   = I + U (D - I) U^T
    T^-1 = I + U (D^-1 - I) U^T

T scales the r dominant input directions down to the level of the rest (whitening restricted to the
top-r subspace) and leaves the complement untouched. Because U has orthonormal columns,
T^-1 T = I exactly in exact arithmetic, and ``damping > 0`` bounds D^-1 <= ((lambda_1 + damping) /
damping) ** p even for a rank-deficient A. p = 1/2 is the whitening of the issue's suggested form;
p = 1/4 moves the dominant directions only halfway (measured in docs/geofp8_fidelity.md).
The gradient is communicated as G T (right-multiplication mixes
columns only, so rows stay independent) and mapped back as G^ T^-1; applying either costs
``O(d_out d_in r)``: ``G T = G + ((G U) (D - I)) U^T``.

Source: GeoFP8 / GIFT (arXiv 2607.07494), section "geometry-aware coordinates"; the paper leaves the
damping and the exact form unspecified; this is the form of ``docs/design.md``, "The transform T".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..parallel.precision import exact_fp32


@dataclass
class LowRankTransform:
    """``T = I + U diag(d - 1) U^T`` for one layer (or one TP slice of it).

    Attributes:
        U: float32 ``[d_in, r]`` orthonormal columns.
        d: float32 ``[r]`` the diagonal D (entries in (0, 1] when lambda_i >= lambda_ref).
    """

    U: torch.Tensor
    d: torch.Tensor

    @property
    def d_in(self) -> int:
        return self.U.shape[0]

    # Every application runs inside exact_fp32: IEEE FP32 matmuls (never TF32, whatever the caller's
    # torch.backends settings) and no autocast, so the round trip g T T^-1 is exact to FP32 rounding.
    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """``g T`` for ``g`` ``[..., d_in]`` (float32); returns a new tensor of the same shape."""
        with exact_fp32():
            return g + ((g @ self.U) * (self.d - 1.0)) @ self.U.T

    def apply_inverse(self, g: torch.Tensor) -> torch.Tensor:
        """``g T^-1`` for ``g`` ``[..., d_in]``."""
        with exact_fp32():
            return g + ((g @ self.U) * (1.0 / self.d - 1.0)) @ self.U.T

    def apply_(self, g: torch.Tensor) -> torch.Tensor:
        """``g <- g T`` in place for a 2-D ``g`` ``[rows, d_in]`` (float32); returns ``g``."""
        with exact_fp32():
            return g.addmm_((g @ self.U) * (self.d - 1.0), self.U.T)

    def apply_inverse_(self, g: torch.Tensor) -> torch.Tensor:
        """``g <- g T^-1`` in place for a 2-D ``g`` ``[rows, d_in]`` (float32); returns ``g``."""
        with exact_fp32():
            return g.addmm_((g @ self.U) * (1.0 / self.d - 1.0), self.U.T)

    def dense(self) -> torch.Tensor:
        """T as a dense ``[d_in, d_in]`` matrix (tests and small layers only)."""
        eye = torch.eye(self.d_in, dtype=self.U.dtype, device=self.U.device)
        return self.apply(eye)

    def checksum(self) -> str:
        """SHA-256 of the exact bytes of U and d: equal on every DP rank iff the transforms are identical."""
        h = hashlib.sha256()
        for t in (self.U, self.d):
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def identity_transform(d_in: int, device=None) -> LowRankTransform:
    """T = I (r = 0): used before the first refresh. float32 ``U [d_in, 0]`` and ``d [0]`` on ``device``."""
    return LowRankTransform(
        torch.zeros(d_in, 0, dtype=torch.float32, device=device), torch.ones(0, dtype=torch.float32, device=device)
    )


def build_transform(A: torch.Tensor, rank: int, damping: float, power: float = 0.5) -> LowRankTransform:
    """The damped rank-``rank`` transform of a K-FAC input factor ``A`` (``[d_in, d_in]``, symmetric).

    The eigendecomposition runs in FP64 (``torch.linalg.eigh``) for determinism and accuracy, without autocast
    (:func:`~megatron_geo.parallel.precision.exact_fp32`); the result is float32 on A's device. Eigenvalues below
    zero (round-off) are clipped to zero.

    Raises:
        ValueError: A not square, ``rank < 0`` or ``damping <= 0``.
    """
    if A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"K-FAC factor must be square [d_in, d_in], got {tuple(A.shape)}")
    if rank < 0:
        raise ValueError(f"geo.rank={rank} must be >= 0")
    if not damping > 0:
        raise ValueError(f"geo.damping={damping} must be > 0 (it bounds the inverse transform)")
    d_in = A.shape[0]
    r = min(rank, d_in)
    if r == 0:
        return identity_transform(d_in, A.device)
    with exact_fp32():
        return _build_transform(A, r, damping, power)


def _build_transform(A: torch.Tensor, r: int, damping: float, power: float) -> LowRankTransform:
    A64 = A.double()
    evals, evecs = torch.linalg.eigh(0.5 * (A64 + A64.T))  # ascending
    evals = evals.flip(0).clamp(min=0.0)
    evecs = evecs.flip(1)
    rest = evals[r:]
    lam_ref = rest.mean() if rest.numel() else torch.zeros((), dtype=torch.float64, device=A.device)
    d = ((lam_ref + damping) / (evals[:r] + damping)) ** power
    # a deterministic sign for every eigenvector (largest-magnitude entry positive)
    U = evecs[:, :r]
    idx = U.abs().argmax(dim=0)
    U = U * torch.where(U[idx, torch.arange(r, device=A.device)] < 0, -1.0, 1.0)
    return LowRankTransform(U.to(torch.float32).contiguous(), d.to(torch.float32))


def sketch_matrix(d_in: int, k: int, seed: int, device=None) -> torch.Tensor:
    """Orthonormal test matrix Omega ``[d_in, k]`` (float32), the same on every rank for a given seed."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d_in, k, generator=g, dtype=torch.float64))
    return q.to(device=device, dtype=torch.float32)


def sketch_shift(Y: torch.Tensor) -> float:
    """The Nystrom shift ``nu = eps_fp32 ||Y||_F sqrt(d_in)`` of :func:`build_transform_from_sketch` for a sketch
    ``Y`` ``[d_in, k]`` (any float dtype; units of A's entries).

    ``eps_fp32 = torch.finfo(torch.float32).eps``, the precision of :class:`~megatron_geo.geometry.stats.InputStats`'
    FP32 accumulation, whatever dtype ``Y`` arrives in (never the eps of a low-precision dtype: BF16's would shift
    by about half of ``||Y||`` at ``d_in = 4096``).
    """
    return torch.finfo(torch.float32).eps * max(float(Y.double().norm()), 1e-300) * Y.shape[0] ** 0.5


def build_transform_from_sketch(
    Y: torch.Tensor, omega: torch.Tensor, trace: float, rank: int, damping: float, power: float = 0.5
) -> LowRankTransform:
    """The transform of :func:`build_transform` from a randomized sketch ``Y = A Omega`` instead of A.

    Nystrom approximation of a PSD matrix from a sketch (Tropp, Yurtsever, Udell & Cevher 2017,
    "Fixed-rank approximation of a positive-semidefinite matrix from streaming data", Alg. 3):
    ``nu = eps ||Y||``, ``Y_nu = Y + nu Omega``, ``C = chol(Omega^T Y_nu)``, ``U S V^T = svd(Y_nu C^-T)``,
    ``lambda = max(S^2 - nu, 0)``; the top ``rank`` pairs are used, and ``lambda_ref`` (the mean of the
    remaining eigenvalues) comes from the exact ``trace(A)``: ``(trace - sum_top lambda) / (d_in - rank)``.
    Exact when rank(A) <= k. Memory ``O(d_in k)`` instead of ``O(d_in^2)``. ``eps`` is FP32's
    (:func:`sketch_shift`); the work runs in FP64 without autocast; the result is float32 on Y's device.

    Args:
        Y: ``[d_in, k]`` float32 sketch (DP-averaged); omega: ``[d_in, k]`` the test matrix used.
        trace: trace(A) (DP-averaged sum of squared inputs per token).
    """
    d_in, k = Y.shape
    r = min(rank, k, d_in)
    if r == 0:
        return identity_transform(d_in, Y.device)
    with exact_fp32():
        return _build_transform_from_sketch(Y, omega, trace, r, damping, power)


def _build_transform_from_sketch(
    Y: torch.Tensor, omega: torch.Tensor, trace: float, r: int, damping: float, power: float
) -> LowRankTransform:
    d_in = Y.shape[0]
    Y64, O64 = Y.double(), omega.to(device=Y.device, dtype=torch.float64)
    # shift by the precision of the sketch itself (FP32 accumulation), so B stays positive definite
    nu = sketch_shift(Y64)
    Yn = Y64 + nu * O64
    B = O64.T @ Yn
    C = torch.linalg.cholesky(0.5 * (B + B.T))
    F = torch.linalg.solve_triangular(C, Yn.T, upper=False).T  # Yn C^-T
    U, S, _ = torch.linalg.svd(F, full_matrices=False)
    lam = (S**2 - nu).clamp(min=0.0)
    top = lam[:r]
    lam_ref = max(trace - float(top.sum()), 0.0) / (d_in - r) if d_in > r else 0.0
    d = ((lam_ref + damping) / (top + damping)) ** power
    Ur = U[:, :r]
    idx = Ur.abs().argmax(dim=0)
    Ur = Ur * torch.where(Ur[idx, torch.arange(r, device=Y.device)] < 0, -1.0, 1.0)
    return LowRankTransform(Ur.to(torch.float32).contiguous(), d.to(torch.float32))
