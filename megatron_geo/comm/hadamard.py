"""Fixed, data-independent block rotation: random signs followed by a Sylvester-Hadamard transform.

``y = H_b (D x) / sqrt(b)`` per row, ``D = diag(signs)``, ``H_b`` the Sylvester Hadamard matrix
(``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``). ``H_b / sqrt(b)`` is symmetric and orthogonal,
so the rotation preserves norms and its inverse is ``D H_b y / sqrt(b)``. It spreads outliers across
a block before quantization (the randomized Hadamard transform of QuaRot / "Hadamard incoherence"
processing) and uses no statistics of the data, so every rank applies the same map.

The reducer applies it as one batched matmul per bucket, ``x.view(-1, b) @ M`` with
``M = D H_b / sqrt(b)`` in FP32 (:func:`hadamard_matrix`; inverse ``y @ M^T``): one pass over the bucket
instead of the ``2 log2(b)`` passes of the butterfly (:func:`block_hadamard`, kept as a reference). The
two agree to FP32 rounding (``tests/test_codecs.py``), not bitwise. The reducer runs those matmuls
inside :func:`exact_fp32`, so they stay IEEE FP32 even where TF32 was switched on for cuBLAS (NGC images
may do so; TF32 would make the rotation only ~1e-3 accurate), and FP32 under any active autocast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..parallel.precision import exact_fp32

__all__ = ["block_hadamard", "block_hadamard_inverse", "exact_fp32", "hadamard_matrix", "hadamard_signs"]


def hadamard_signs(block_size: int, seed: int) -> Tensor:
    """float32 ``[block_size]`` of +-1 drawn from ``torch.Generator().manual_seed(seed)`` (CPU).

    Identical on every rank and machine for the same ``(block_size, seed)``.

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (block_size,), generator=g, device="cpu")
    return (1 - 2 * bits).to(torch.float32)


def hadamard_matrix(signs: Tensor) -> Tensor:
    """float32 ``[b, b]`` ``M = diag(signs) H_b / sqrt(b)`` on ``signs``' device, so that a row vector rotates
    as ``x @ M`` (the same map as :func:`block_hadamard`) and ``(x @ M) @ M.T == x`` up to FP32 rounding.
    Built in FP64 and rounded once per entry.

    Raises:
        ValueError: ``b`` not a power of two.
    """
    b = signs.numel()
    if b < 1 or b & (b - 1):
        raise ValueError(f"block size b={b} is not a power of two")
    h = torch.ones((1, 1), dtype=torch.float64, device="cpu")
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    m = signs.to(device="cpu", dtype=torch.float64).view(b, 1) * h * b**-0.5
    return m.to(dtype=torch.float32, device=signs.device)


def _check(x: Tensor, signs: Tensor) -> int:
    if x.dim() != 2:
        raise ValueError(f"expected x of shape [nblk, b], got {tuple(x.shape)}")
    b = x.shape[1]
    if b < 1 or b & (b - 1):
        raise ValueError(f"block size b={b} is not a power of two")
    if signs.shape != (b,):
        raise ValueError(f"signs must have shape [{b}], got {tuple(signs.shape)}")
    return b


def _fwht(x: Tensor) -> Tensor:
    """Unnormalized Walsh-Hadamard transform along dim 1 in Sylvester (natural) order, O(b log b).

    ``x`` must be contiguous ``[n, b]``; it is used as scratch space (callers pass a fresh tensor).
    Stage ``h`` pairs element ``j`` with ``j + h`` inside each group of ``2h``: ``(u, v) -> (u+v, u-v)``.
    """
    n, b = x.shape
    out = torch.empty_like(x)
    h = 1
    while h < b:  # log2(b) butterfly stages; each is two vectorized ops over the whole tensor
        v = x.view(n, b // (2 * h), 2, h)
        o = out.view(n, b // (2 * h), 2, h)
        torch.add(v[:, :, 0], v[:, :, 1], out=o[:, :, 0])
        torch.sub(v[:, :, 0], v[:, :, 1], out=o[:, :, 1])
        x, out = out, x
        h *= 2
    return x


def block_hadamard(x: Tensor, signs: Tensor) -> Tensor:
    """Rotate each row: ``H_b (signs * x) / sqrt(b)``.

    Args:
        x: floating ``[nblk, b]`` (float32 in practice), ``b`` a power of two.
        signs: ``[b]`` of +-1 (:func:`hadamard_signs`).

    Returns:
        tensor of ``x``'s shape and dtype.

    Raises:
        ValueError: ``x`` not 2-D, ``b`` not a power of two, or ``signs`` not ``[b]``.
    """
    b = _check(x, signs)
    return _fwht((x * signs.to(x.dtype)).contiguous()).mul_(b**-0.5)


def block_hadamard_inverse(y: Tensor, signs: Tensor) -> Tensor:
    """Exact inverse of :func:`block_hadamard`: ``signs * (H_b y / sqrt(b))`` per row.

    Raises:
        ValueError: as :func:`block_hadamard`.
    """
    b = _check(y, signs)
    return _fwht(y.clone(memory_format=torch.contiguous_format)).mul_(signs.to(y.dtype) * (b**-0.5))
