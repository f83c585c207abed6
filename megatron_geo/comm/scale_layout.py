"""Which FP32 scale covers which elements of a bucket buffer (the "scale segments").

A bucket buffer is ``dp_size`` chunks of ``chunk`` elements. Each chunk is cut into consecutive
segments; every segment has one scale and belongs to one *scale group* whose amax sets that scale:

- ``tensor`` scaling: a group is one parameter (the paper's layer-wise Euclidean FP8); a parameter
  split across two chunks gives one segment in each chunk, both with the parameter's scale.
  Padding gets its own segments (amax 0, scale 1).
- ``block`` scaling: a group is one block of ``block_size`` elements; chunks are multiples of
  ``block_size`` (the shard plan aligns them), so blocks never straddle two ranks' shards.

``seg_scales[r]`` (``[K]``, padded to the same K for every chunk) is what the all-to-all sends to rank r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScaleLayout:
    """Per-bucket segment tables (all int64 tensors on the buffer's device).

    Attributes:
        lengths: ``[dp, K]`` segment lengths per chunk, zero-padded to K; each row sums to ``chunk``.
        groups: ``[dp, K]`` scale-group id of each segment (padding segments: group ``num_groups - 1``, amax 0).
        num_groups: number of scale groups (including the padding group).
        block_size: set for block scaling (then every segment is one block), else None.
    """

    lengths: torch.Tensor
    groups: torch.Tensor
    num_groups: int
    chunk: int
    block_size: int | None

    @property
    def dp_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def K(self) -> int:
        return self.lengths.shape[1]

    def group_amax(self, x: torch.Tensor) -> torch.Tensor:
        """Max |x| per scale group, float32 ``[num_groups]``; NaN anywhere in a group makes its amax NaN."""
        if self.block_size is not None:
            return x.view(-1, self.block_size).abs().amax(dim=1)
        flat_len = self.lengths.reshape(-1)
        used = flat_len > 0
        # max/amax reductions propagate NaN (torch semantics), so a NaN anywhere reaches its group's amax
        seg_amax = torch.segment_reduce(x.abs(), "max", lengths=flat_len[used], unsafe=True, initial=0.0)
        out = torch.zeros(self.num_groups, dtype=torch.float32, device=x.device)
        return out.scatter_reduce_(0, self.groups.reshape(-1)[used], seg_amax, reduce="amax", include_self=True)

    def segment_values(self, group_values: torch.Tensor) -> torch.Tensor:
        """``[dp, K]`` per-segment values (e.g. scales) from per-group values; padded segments get 1."""
        if self.block_size is not None:
            return group_values.view(self.dp_size, -1)
        vals = group_values[self.groups]
        return torch.where(self.lengths > 0, vals, torch.ones_like(vals))

    def expand(self, seg_vals: torch.Tensor, chunk_index: int) -> torch.Tensor:
        """Per-element values ``[..., chunk]`` of chunk ``chunk_index`` from ``seg_vals`` ``[..., K]``."""
        if self.block_size is not None:
            return seg_vals.repeat_interleave(self.block_size, dim=-1)
        return seg_vals.repeat_interleave(self.lengths[chunk_index], dim=-1)


def build_scale_layout(offsets: list[int], numels: list[int], chunk: int, dp_size: int, scaling: str,
                       block_size: int, device) -> ScaleLayout:
    """Segment tables for a bucket whose parameter i occupies ``[offsets[i], offsets[i] + numels[i])``.

    Raises:
        ValueError: block scaling with a chunk that is not a multiple of ``block_size``, or an unknown scaling.
    """
    if scaling == "block":
        if chunk % block_size:
            raise ValueError(f"chunk {chunk} is not a multiple of comm.block_size={block_size}")
        k = chunk // block_size
        lengths = torch.full((dp_size, k), block_size, dtype=torch.int64, device=device)
        groups = torch.arange(dp_size * k, device=device).view(dp_size, k)
        return ScaleLayout(lengths, groups, dp_size * k, chunk, block_size)
    if scaling != "tensor":
        raise ValueError(f"comm.scaling={scaling!r} is not supported; choose tensor or block")
    pad_group = len(numels)
    rows: list[list[tuple[int, int]]] = []
    spans = sorted((off, off + n, i) for i, (off, n) in enumerate(zip(offsets, numels)) if n > 0)
    for r in range(dp_size):
        lo, hi = r * chunk, (r + 1) * chunk
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
    k = max(len(r) for r in rows)
    lengths = torch.zeros((dp_size, k), dtype=torch.int64)
    groups = torch.full((dp_size, k), pad_group, dtype=torch.int64)
    for r, row in enumerate(rows):
        for j, (n, g) in enumerate(row):
            lengths[r, j], groups[r, j] = n, g
    return ScaleLayout(lengths.to(device), groups.to(device), pad_group + 1, chunk, None)
