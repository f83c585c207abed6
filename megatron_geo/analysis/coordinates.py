"""Coordinate transforms of one side of a linear layer's gradient for the offline ablations (docs/design.md
section 1 and the paper's Table II): GeoFP8's low-rank transform
(:func:`megatron_geo.geometry.transform.build_transform`) at any rank, full rank, diagonal and
block-diagonal approximations of the K-FAC factor, the trainer's sketched factor, any exponent of D, and
FP64 copies so that only the codec loses.

A transform here is any object with ``apply(g) = g T`` and ``apply_inverse(g) = g T^-1`` acting on the
last dimension of ``g`` (``[..., d]``, float32) and a ``d_in`` property.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..geometry.transform import LowRankTransform, build_transform, build_transform_from_sketch, sketch_matrix


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
            raise ValueError(
                f"block-diagonal transform of size {self.d_in} applied to a last dimension of {g.shape[-1]}"
            )
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
    return BlockDiagonalTransform(
        [
            build_transform(A[lo : min(lo + block, d), lo : min(lo + block, d)], min(block, d - lo), damping)
            for lo in range(0, d, block)
        ]
    )


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


def build_coordinate_transform(
    A: Tensor,
    kind: str = "lowrank",
    rank: int = 32,
    damping: float = 1e-3,
    block: int = 128,
    power: float = 0.5,
    sketch_size: int = 64,
    seed: int = 0,
):
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
            damping)) ** power``; 1/2 is GeoFP8's whitening (docs/design.md section 1), other values are an
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
