"""Which FP32 scale covers which elements of a bucket buffer (the "scale segments").

A bucket buffer is cut into ``dp_size`` rank ranges ``[bounds[r], bounds[r + 1])`` (equal chunks in an even
plan). Each range is cut into consecutive segments; every segment has one scale and belongs to one
*scale group* whose amax sets that scale:

- ``tensor`` scaling: a group is one parameter (the paper's layer-wise Euclidean FP8); a parameter
  split across two chunks gives one segment in each chunk, both with the parameter's scale.
  Padding gets its own segments (amax 0, scale 1).
- ``block`` scaling: a group is one block of ``block_size`` elements; ranges are multiples of
  ``block_size`` (the shard plan aligns them), so blocks never straddle two ranks' shards.

``seg_scales[r]`` (``[K]``, padded to the same K for every range) is what the all-to-all sends to rank r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScaleLayout:
    """Per-bucket segment and block tables (int64 tensors on the buffer's device), built once per bucket.

    Every segment is a whole number of *blocks* of ``granule`` elements (parameters start at multiples of the
    codec's alignment and their scale group covers the padding up to the next one; rank ranges are multiples
    of it), so a per-segment value reaches the elements as one value per block, broadcast over a
    ``[blocks, granule]`` view: no per-element scale tensor, no data-dependent shape.

    Attributes:
        lengths: ``[dp, K]`` segment lengths per range, zero-padded to K; row r sums to ``sizes[r]``.
        groups: ``[dp, K]`` scale-group id of each segment (padding segments: group ``num_groups - 1``, amax 0).
        num_groups: number of scale groups (including the padding group).
        chunk: the range length of an even plan, else -1.
        block_size: set for block scaling (then every segment is one block), else None.
        sizes: elements of each rank's range (python ints).
        granule: elements per block (the codec's alignment: 16 for tensor-scaled FP8 and NVFP4, the block
            size for block scaling).
        block_group: ``[numel // granule]`` scale group of each block.
        block_seg: ``[numel // granule]`` segment index (0..K-1) of each block within its range.
        block_flat: ``[numel // granule]`` index of each block's segment in the flattened ``[dp * K]`` table.
        block_bounds: ``dp + 1`` block offsets of the ranges (python ints).
    """

    lengths: torch.Tensor
    groups: torch.Tensor
    num_groups: int
    chunk: int
    block_size: int | None
    sizes: list[int]
    granule: int
    block_group: torch.Tensor
    block_seg: torch.Tensor
    block_flat: torch.Tensor
    block_bounds: list[int]

    @property
    def numel(self) -> int:
        """Elements of the whole bucket buffer."""
        return sum(self.sizes)

    @property
    def dp_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def K(self) -> int:
        return self.lengths.shape[1]

    def row_blocks(self, r: int) -> slice:
        """The blocks of range ``r`` (a slice of the block tables)."""
        return slice(self.block_bounds[r], self.block_bounds[r + 1])

    def group_amax(self, block_amax: torch.Tensor) -> torch.Tensor:
        """Max per scale group, float32 ``[num_groups]``, from the per-block amax ``[numel // granule]`` of the
        whole buffer; NaN in a block makes its group's amax NaN (``scatter_reduce`` amax propagates NaN)."""
        out = torch.zeros(self.num_groups, dtype=torch.float32, device=block_amax.device)
        return out.scatter_reduce_(0, self.block_group, block_amax, reduce="amax", include_self=True)

    def row_segment_amax(self, block_amax: torch.Tensor, r: int) -> torch.Tensor:
        """Max per segment of range ``r`` alone, float32 ``[K]`` (empty segments 0), from the per-block amax
        of that range ``[blocks of r]``."""
        out = torch.zeros(self.K, dtype=torch.float32, device=block_amax.device)
        return out.scatter_reduce_(0, self.block_seg[self.row_blocks(r)], block_amax, reduce="amax", include_self=True)

    def segment_values(self, group_values: torch.Tensor) -> torch.Tensor:
        """``[dp, K]`` per-segment values (e.g. scales) from per-group values; padded segments get 1."""
        vals = group_values[self.groups]
        return torch.where(self.lengths > 0, vals, torch.ones_like(vals))

    def block_values(self, seg_vals: torch.Tensor) -> torch.Tensor:
        """Per-block values ``[numel // granule]`` of the whole buffer from ``seg_vals`` ``[dp, K]`` (every
        range's own)."""
        return seg_vals.reshape(-1).index_select(0, self.block_flat)

    def row_block_values(self, seg_vals: torch.Tensor, r: int) -> torch.Tensor:
        """Per-block values ``[..., blocks of range r]`` from ``seg_vals`` ``[..., K]`` (segments of range r)."""
        return seg_vals.index_select(-1, self.block_seg[self.row_blocks(r)])


def build_scale_layout(
    offsets: list[int], numels: list[int], bounds, dp_size: int, scaling: str, block_size: int, device, granule: int = 1
) -> ScaleLayout:
    """Segment and block tables for a bucket whose parameter i occupies ``[offsets[i], offsets[i] + numels[i])``
    (``numels[i]`` may include the alignment padding after it: its scale group then covers that padding).

    Args:
        bounds: the ``dp_size + 1`` rank-range boundaries, or an int ``chunk`` (even ranges).
        scaling: ``tensor`` (one group per parameter) or ``block`` (one per ``block_size`` elements).
        granule: elements per block of the block tables for tensor scaling (block scaling uses ``block_size``).
            Every segment must be a multiple of it.

    Raises:
        ValueError: a range or segment that is not a multiple of the granule (block size), or an unknown scaling.
    """
    if isinstance(bounds, int):
        bounds = [r * bounds for r in range(dp_size + 1)]
    sizes = [bounds[r + 1] - bounds[r] for r in range(dp_size)]
    even = all(n == sizes[0] for n in sizes)
    chunk = sizes[0] if even else -1
    if scaling == "block":
        bad = [n for n in sizes if n % block_size]
        if bad:
            raise ValueError(f"chunk {bad[0]} is not a multiple of comm.block_size={block_size}")
        granule = block_size
        k = max(1, max(sizes) // block_size)
        n_blocks = bounds[-1] // block_size
        pad_group = n_blocks
        rows = [
            [(block_size, bounds[r] // block_size + j) for j in range(sizes[r] // block_size)] for r in range(dp_size)
        ]
    elif scaling == "tensor":
        pad_group = len(numels)
        rows = []
        spans = sorted((off, off + n, i) for i, (off, n) in enumerate(zip(offsets, numels)) if n > 0)
        for r in range(dp_size):
            lo, hi = bounds[r], bounds[r + 1]
            row, pos = [], lo
            for s, e, i in spans:
                s, e = max(s, lo), min(e, hi)
                if s >= e:
                    continue
                if s > pos:
                    row.append((s - pos, pad_group))
                row.append((e - s, i))
                pos = e
            if pos < hi:
                row.append((hi - pos, pad_group))
            rows.append(row)
        bad = [(r, n) for r, row in enumerate(rows) for n, _ in row if n % granule]
        if bad:
            raise ValueError(
                f"range {bad[0][0]} has a scale segment of {bad[0][1]} elements, not a multiple of "
                f"the codec granule {granule}: parameter offsets, extents and rank ranges must be "
                f"aligned to the reducer's alignment() (plan the bucket with align={granule})"
            )
        k = max(1, max(len(r) for r in rows))
    else:
        raise ValueError(f"comm.scaling={scaling!r} is not supported; choose tensor or block")
    lengths = torch.zeros((dp_size, k), dtype=torch.int64, device="cpu")
    groups = torch.full((dp_size, k), pad_group, dtype=torch.int64, device="cpu")
    for r, row in enumerate(rows):
        if row:
            lengths[r, : len(row)] = torch.tensor([n for n, _ in row], device="cpu")
            groups[r, : len(row)] = torch.tensor([g for _, g in row], device="cpu")
    nblk = (lengths // granule).reshape(-1)  # blocks per segment
    total = sum(n // granule for row in rows for n, _ in row)  # known on the host: no data-dependent shape
    block_group = groups.reshape(-1).repeat_interleave(nblk, output_size=total)
    block_seg = torch.arange(k, device="cpu").expand(dp_size, k).reshape(-1).repeat_interleave(nblk, output_size=total)
    block_flat = torch.arange(dp_size * k, device="cpu").repeat_interleave(nblk, output_size=total)
    block_bounds = [b // granule for b in bounds]
    return ScaleLayout(
        lengths.to(device),
        groups.to(device),
        pad_group + 1,
        chunk,
        block_size if scaling == "block" else None,
        sizes,
        granule,
        block_group.to(device),
        block_seg.to(device),
        block_flat.to(device),
        block_bounds,
    )
