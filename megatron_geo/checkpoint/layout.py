"""Where a DP rank's piece of a (TP-sharded) parameter lies in the parameter's global, logical tensor.

Checkpoints store every parameter and every per-element optimizer state as one tensor of the
parameter's *global* shape (as if TP = 1, without the padded vocabulary rows), so that a checkpoint
saved at one DP x TP layout loads at any other. A rank owns a flat range ``[lo, hi)`` of its TP-local
tensor (see :mod:`megatron_geo.distributed.shard_plan`); that range is at most three rectangles of
the TP-local tensor (a partial first row, whole rows, a partial last row), and each rectangle maps
to a rectangle of the global tensor by offsetting the TP-partitioned dimension by
``tp_rank * local_size``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rect:
    """A rectangle of the global tensor and the flat range ``[flat_lo, flat_hi)`` of the TP-local
    tensor that holds it (row-major, so the range reshaped to ``sizes`` is the rectangle)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_lo: int
    flat_hi: int


def global_shape(
    local_shape: tuple[int, ...], partition_dim: int | None, tp_size: int, logical_rows: int | None = None
) -> tuple[int, ...]:
    """Global logical shape of a parameter whose TP-local shape is ``local_shape``.

    Args:
        partition_dim: dimension split over TP (None for TP-replicated parameters).
        logical_rows: rows of the unpadded tensor (the vocabulary size for the embedding and the
            output layer, whose padded rows are always zero); None keeps all rows.
    """
    shape = list(local_shape)
    if partition_dim is not None:
        shape[partition_dim] *= tp_size
    if logical_rows is not None:
        shape[0] = min(shape[0], logical_rows)
    return tuple(shape)


def piece_rects(
    local_shape: tuple[int, ...],
    partition_dim: int | None,
    tp_rank: int,
    lo: int,
    hi: int,
    logical_rows: int | None = None,
) -> list[Rect]:
    """The global rectangles of the flat range ``[lo, hi)`` of a TP-local tensor of ``local_shape``
    (1-D or 2-D), clipped to ``logical_rows``; empty pieces give no rectangle.

    Raises:
        ValueError: a tensor of more than two dimensions or a range outside the tensor.
    """
    numel = 1
    for s in local_shape:
        numel *= s
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"range [{lo}, {hi}) is outside a tensor of {numel} elements")
    if len(local_shape) == 1:
        off = tp_rank * local_shape[0] if partition_dim == 0 else 0
        rects = [Rect((off + lo,), (hi - lo,), lo, hi)] if hi > lo else []
        if logical_rows is not None:
            clipped = [_clip1(r, logical_rows) for r in rects]
            rects = [r for r in clipped if r is not None]
        return rects
    if len(local_shape) != 2:
        raise ValueError(f"only 1-D and 2-D parameters are supported, got shape {tuple(local_shape)}")
    rows, cols = local_shape
    row_off = tp_rank * rows if partition_dim == 0 else 0
    col_off = tp_rank * cols if partition_dim == 1 else 0
    local: list[tuple[int, int, int, int]] = []  # (row, n_rows, col, n_cols) in the local tensor
    pos = lo
    if hi > lo and pos % cols:
        r, c = divmod(pos, cols)
        n = min(cols - c, hi - pos)
        local.append((r, 1, c, n))
        pos += n
    if hi - pos >= cols:
        n_rows = (hi - pos) // cols
        local.append((pos // cols, n_rows, 0, cols))
        pos += n_rows * cols
    if hi > pos:
        local.append((pos // cols, 1, 0, hi - pos))
    out = []
    for r, nr, c, nc in local:
        flat_lo = r * cols + c
        gr = row_off + r
        if logical_rows is not None:
            if gr >= logical_rows:
                continue
            nr = min(nr, logical_rows - gr)
        out.append(Rect((gr, col_off + c), (nr, nc), flat_lo, flat_lo + nr * nc))
    return out


def _clip1(r: Rect, limit: int) -> Rect | None:
    start, n = r.offsets[0], r.sizes[0]
    if start >= limit:
        return None
    n = min(n, limit - start)
    return Rect((start,), (n,), r.flat_lo, r.flat_lo + n)
