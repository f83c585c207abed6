"""Newton-Schulz of one matrix split over a small group of members, each holding a block of it.

The distributed form of :func:`~megatron_geo.optim.muon.orthogonalize` (the idea of Megatron-Core's
"distributed" Muon mode). Work in the wide orientation ``X`` ``[m, n]``, ``m <= n``. Every quintic step
``X <- a X + (b R + c R^2) X`` touches ``X`` only through the Gram matrix ``R = X X^T`` ``[m, m]`` and the
product ``P X`` with ``P = b R + c R^2`` (a polynomial in ``R``). With ``X`` cut into column blocks
``X = [X_0 | ... | X_{g-1}]``:

- ``R = sum_i X_i X_i^T``: every member forms its partial Gram, one all-reduce sums them;
- ``P`` (``[m, m]``, small) is computed by every member alike (replicated), and ``(P X)_i = P X_i``: each
  member updates its own block, no communication.

So one iteration costs one all-reduce of ``m^2`` elements and ``4 m^2 n_i + 2 m^3`` FLOPs on member i
(unsplit: ``4 m^2 n + 2 m^3``). The Frobenius normalisation comes from the first all-reduce:
``||X||_F^2 = trace(sum_i X_i X_i^T)``, so the start Gram (of the unnormalised blocks) is divided by the
square of the norm instead of being formed again. The Gram form (:func:`~megatron_geo.optim.muon.gram_newton_schulz`,
Zhang, Amsel, Chen, Dao 2026) carries ``R`` and ``Q`` (both ``[m, m]``, replicated) and touches ``X`` only at the
start, at each restart (``X_i <- Q X_i``, a new all-reduce of the partial Grams) and at the end (``Q X_i``): one
all-reduce per Gram build.

In exact arithmetic the result equals the unsplit one; in floating point the partial Grams are summed in another
order (and the start Gram is scaled instead of re-formed), a difference of the order of the iteration's own
rounding.

The all-reduce and the block exchange are arguments, so the same code runs with a process group (one local
block per member) and in one process for a simulated group (all blocks local, the all-reduce a plain sum):

- ``all_reduce(parts) -> total``: ``parts`` are the local members' partial Grams (``[m, m]`` each); returns
  their sum over the whole group (``[m, m]``), the same on every member;
- ``exchange(send) -> recv``: ``send[k][j]`` is what local member k sends to group member j; returns
  ``recv[k][j]``, what local member k received from member j (a transpose over all members).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .muon import NS_CHOICES, NSSettings, gram_restarts

AllReduce = Callable[[list[torch.Tensor]], torch.Tensor]
Exchange = Callable[[list[list[torch.Tensor]]], list[list[torch.Tensor]]]


def _wide_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _normalised_start(
    blocks: Sequence[torch.Tensor], eps: float, dtype: torch.dtype, all_reduce: AllReduce
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The blocks divided by ``max(||X||_F, eps)`` (in ``dtype``) and the Gram matrix of the normalised ``X``.

    The partial Grams are formed in FP32 (FP64 for an FP64 ``dtype``) and summed by one ``all_reduce``; the norm
    is the square root of its trace, so no second collective is needed."""
    wide = _wide_dtype(dtype)
    xs = [b.to(wide) for b in blocks]
    gram = all_reduce([x @ x.T for x in xs])
    scale = gram.diagonal().sum().clamp(min=0).sqrt().clamp(min=eps)
    xs = [(x / scale).to(dtype).contiguous() for x in xs]
    return xs, (gram / (scale * scale)).to(dtype)


def split_quintic(
    blocks: Sequence[torch.Tensor],
    coeffs: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
    all_reduce: AllReduce,
) -> list[torch.Tensor]:
    """:func:`~megatron_geo.optim.muon.newton_schulz5` of ``X = [X_0 | ... ]`` on its column blocks.

    Args:
        blocks: the local members' column blocks ``X_i`` ``[m, n_i]`` of the wide orientation (``m <= n``),
            any float dtype.
        coeffs, steps, eps, dtype: as :func:`~megatron_geo.optim.muon.newton_schulz5` (torch.optim.Muon:
            ``(3.4445, -4.7750, 2.0315)``, 5, 1e-7; the iteration runs in ``dtype``).
        all_reduce: sums ``[m, m]`` partial Grams over the group (see the module docstring); called ``steps``
            times (the first also gives the Frobenius norm).

    Returns:
        The result's blocks, ``[m, n_i]`` each, in ``dtype``.
    """
    a, b, c = coeffs
    xs, gram = _normalised_start(blocks, eps, dtype, all_reduce)
    for t in range(steps):
        if t > 0:
            gram = all_reduce([x @ x.T for x in xs])
        poly = b * gram + c * (gram @ gram)
        xs = [a * x + poly @ x for x in xs]
    return xs


def split_gram(
    blocks: Sequence[torch.Tensor],
    coeffs: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
    all_reduce: AllReduce,
    restarts: tuple[int, ...] | None = None,
) -> list[torch.Tensor]:
    """:func:`~megatron_geo.optim.muon.gram_newton_schulz` of ``X = [X_0 | ... ]`` on its column blocks.

    Args and returns as :func:`split_quintic`; ``restarts`` as ``gram_newton_schulz`` (default
    :func:`~megatron_geo.optim.muon.gram_restarts`). ``all_reduce`` is called ``1 + len(restarts)`` times.
    """
    a, b, c = coeffs
    xs, gram = _normalised_start(blocks, eps, dtype, all_reduce)
    restart_at = set(gram_restarts(steps) if restarts is None else restarts)
    eye = torch.eye(gram.shape[0], dtype=dtype, device=gram.device)
    q: torch.Tensor | None = None
    for t in range(steps):
        if t > 0 and t in restart_at:
            assert q is not None
            xs = [q @ x for x in xs]
            gram = all_reduce([x @ x.T for x in xs])
            q = None
        z = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        q = z + a * eye if q is None else torch.addmm(q, z, q, beta=a)
        if t + 1 < steps and (t + 1) not in restart_at:
            s = torch.addmm(gram, gram, z, beta=a)
            gram = torch.addmm(s, z, s, beta=a)
    return xs if q is None else [q @ x for x in xs]


def even_cuts(n: int, g: int) -> list[int]:
    """``g + 1`` offsets cutting ``n`` into ``g`` near-equal consecutive parts (the first ``n % g`` one larger)."""
    base, extra = divmod(n, g)
    out = [0]
    for i in range(g):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return out


def split_orthogonalize(
    row_blocks: Sequence[torch.Tensor],
    members: Sequence[int],
    row_cuts: Sequence[int],
    settings: NSSettings,
    all_reduce: AllReduce,
    exchange: Exchange,
    col_cuts: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """:func:`~megatron_geo.optim.muon.orthogonalize` of a ``[A, B]`` matrix held as row blocks by a group.

    Args:
        row_blocks: the local members' row blocks ``W[row_cuts[k]:row_cuts[k + 1]]`` ``[r_k, B]`` (any float
            dtype, one device).
        members: the group index of each local block (``0 .. g - 1``).
        row_cuts: ``g + 1`` row offsets of every member's block (``row_cuts[-1] == A``).
        settings: the iteration (:class:`~megatron_geo.optim.muon.NSSettings`): ``ns`` (``quintic`` or ``gram``,
            as ``orthogonalize``: a square matrix uses the quintic), ``coeffs``, ``steps``, ``eps`` and ``dtype`` as
            ``orthogonalize``.
        all_reduce, exchange: the group's collectives (module docstring). ``exchange`` is used only for a wide
            matrix (``A < B``): its row blocks are not column blocks of ``X = W``, so they are re-laid out to
            column blocks ``W[:, c_j:c_{j+1}]`` (``col_cuts``, default :func:`even_cuts` of ``B``) and back (two
            exchanges, each member sending its rows of the other members' columns). A tall or square ``W``
            needs none: a row block of ``W`` is a column block of ``X = W^T`` (for a square matrix
            ``NS(W) = NS(W^T)^T`` in exact arithmetic).

    Returns:
        The local members' row blocks of the result, ``[r_k, B]`` each, in ``settings.dtype``.

    Raises:
        ValueError: ``settings.ns`` unknown, blocks that do not match ``row_cuts``, or members out of range.
    """
    ns, coeffs, steps, eps, dtype = settings.ns, settings.coeffs, settings.steps, settings.eps, settings.dtype
    if ns not in NS_CHOICES:
        raise ValueError(f"optimizer.muon_ns={ns!r} is not one of {NS_CHOICES}; set optimizer.muon_ns=quintic or gram")
    g = len(row_cuts) - 1
    if len(row_blocks) != len(members) or any(not 0 <= k < g for k in members):
        raise ValueError(f"members {list(members)} must give one index in [0, {g}) per block")
    rows, cols = row_cuts[-1], row_blocks[0].shape[1]
    for blk, k in zip(row_blocks, members):
        if tuple(blk.shape) != (row_cuts[k + 1] - row_cuts[k], cols):
            raise ValueError(
                f"member {k}'s block has shape {tuple(blk.shape)}, but row_cuts {list(row_cuts)} give "
                f"{(row_cuts[k + 1] - row_cuts[k], cols)}"
            )
    use_gram = ns == "gram" and rows != cols

    def run(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        if use_gram:
            return split_gram(xs, coeffs, steps, eps, dtype, all_reduce)
        return split_quintic(xs, coeffs, steps, eps, dtype, all_reduce)

    if rows >= cols:  # tall or square: X = W^T, a row block of W is a column block of X
        return [o.T for o in run([blk.T for blk in row_blocks])]
    col_cuts = even_cuts(cols, g) if col_cuts is None else col_cuts
    if len(col_cuts) != g + 1 or col_cuts[0] != 0 or col_cuts[-1] != cols:
        raise ValueError(f"col_cuts {list(col_cuts)} must be {g + 1} offsets from 0 to {cols}")
    send = [[blk[:, col_cuts[j] : col_cuts[j + 1]] for j in range(g)] for blk in row_blocks]
    recv = exchange(send)  # recv[k][i]: member i's rows of local member k's columns
    col_blocks = [torch.cat(parts, dim=0) for parts in recv]  # [A, c_k]
    outs = run(col_blocks)
    back = [[o[row_cuts[i] : row_cuts[i + 1]] for i in range(g)] for o in outs]
    got = exchange(back)  # got[k][j]: member j's columns of local member k's rows
    return [torch.cat(parts, dim=1) for parts in got]


def local_group(g: int) -> tuple[AllReduce, Exchange]:
    """The collectives of a group of ``g`` members that are all local (one process holds every block, in member
    order): the all-reduce is the sum of the parts, the exchange a transpose. For tests and single-process use."""

    def all_reduce(parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) != g:
            raise ValueError(f"a local group of {g} members got {len(parts)} parts")
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def exchange(send: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        return [[send[j][k] for j in range(g)] for k in range(g)]

    return all_reduce, exchange
