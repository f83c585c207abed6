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
    """Per-bucket segment tables (all int64 tensors on the buffer's device).

    Attributes:
        lengths: ``[dp, K]`` segment lengths per range, zero-padded to K; row r sums to ``sizes[r]``.
        groups: ``[dp, K]`` scale-group id of each segment (padding segments: group ``num_groups - 1``, amax 0).
        num_groups: number of scale groups (including the padding group).
        chunk: the range length of an even plan, else -1.
        block_size: set for block scaling (then every segment is one block), else None.
        sizes: elements of each rank's range (python ints).
    """

    lengths: torch.Tensor
    groups: torch.Tensor
    num_groups: int
    chunk: int
    block_size: int | None
    sizes: list[int] | None = None
    used_lengths: torch.Tensor | None = None   # tensor scaling: lengths of the non-empty segments, in order
    used_groups: torch.Tensor | None = None    # ... and their scale groups (so no boolean mask per call)
    used_per_row: list[int] | None = None      # non-empty segments of each range (python ints)

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

    def group_amax(self, x: torch.Tensor) -> torch.Tensor:
        """Max |x| per scale group, float32 ``[num_groups]``; NaN anywhere in a group makes its amax NaN."""
        if self.block_size is not None:
            amax = x.view(-1, self.block_size).abs().amax(dim=1)
            if self.chunk >= 0:
                return amax
            return torch.cat([amax, amax.new_zeros(1)])  # + the padding group of uneven rows
        # max/amax reductions propagate NaN (torch semantics), so a NaN anywhere reaches its group's amax;
        # the non-empty segments were listed once at build time: no boolean mask, no data-dependent shape
        seg_amax = torch.segment_reduce(x.abs(), "max", lengths=self.used_lengths, unsafe=True, initial=0.0)
        out = torch.zeros(self.num_groups, dtype=torch.float32, device=x.device)
        return out.scatter_reduce_(0, self.used_groups, seg_amax, reduce="amax", include_self=True)

    def row_amax(self, x: torch.Tensor, r: int) -> torch.Tensor:
        """Max |x| per segment of range ``r`` alone (``x`` is that range), float32 ``[1, K]`` (empty ones 0)."""
        if self.block_size is not None:
            amax = x.view(-1, self.block_size).abs().amax(dim=1)
            return torch.cat([amax, amax.new_zeros(self.K - amax.numel())]).view(1, -1)
        n = self.used_per_row[r]
        seg = torch.segment_reduce(x.abs(), "max", lengths=self.lengths[r, :n], unsafe=True, initial=0.0)
        return torch.cat([seg, seg.new_zeros(self.K - n)]).view(1, -1)

    def segment_values(self, group_values: torch.Tensor) -> torch.Tensor:
        """``[dp, K]`` per-segment values (e.g. scales) from per-group values; padded segments get 1."""
        if self.block_size is not None and self.chunk >= 0:
            return group_values.view(self.dp_size, -1)
        vals = group_values[self.groups]
        return torch.where(self.lengths > 0, vals, torch.ones_like(vals))

    def expand(self, seg_vals: torch.Tensor, chunk_index: int) -> torch.Tensor:
        """Per-element values ``[..., sizes[chunk_index]]`` of range ``chunk_index`` from ``seg_vals`` ``[..., K]``."""
        n = self.sizes[chunk_index]
        if self.block_size is not None:
            return seg_vals[..., : n // self.block_size].repeat_interleave(self.block_size, dim=-1)
        return seg_vals.repeat_interleave(self.lengths[chunk_index], dim=-1, output_size=n)

    def expand_all(self, seg_vals: torch.Tensor) -> torch.Tensor:
        """Per-element values ``[numel]`` of the whole buffer from ``seg_vals`` ``[dp, K]`` (every range's own)."""
        if self.block_size is not None and self.chunk >= 0:
            return seg_vals.reshape(-1).repeat_interleave(self.block_size)
        return seg_vals.reshape(-1).repeat_interleave(self.lengths.reshape(-1), output_size=self.numel)


def build_scale_layout(offsets: list[int], numels: list[int], bounds, dp_size: int, scaling: str,
                       block_size: int, device) -> ScaleLayout:
    """Segment tables for a bucket whose parameter i occupies ``[offsets[i], offsets[i] + numels[i])``.

    ``bounds``: the ``dp_size + 1`` rank-range boundaries, or an int ``chunk`` (even ranges).

    Raises:
        ValueError: block scaling with a range that is not a multiple of ``block_size``, or an unknown scaling.
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
        if even:
            k = chunk // block_size
            lengths = torch.full((dp_size, k), block_size, dtype=torch.int64, device=device)
            groups = torch.arange(dp_size * k, device=device).view(dp_size, k)
            return ScaleLayout(lengths, groups, dp_size * k, chunk, block_size, sizes)
        k = max(sizes) // block_size
        n_blocks = bounds[-1] // block_size
        lengths = torch.zeros((dp_size, k), dtype=torch.int64, device="cpu")
        groups = torch.full((dp_size, k), n_blocks, dtype=torch.int64, device="cpu")
        for r in range(dp_size):
            kr = sizes[r] // block_size
            lengths[r, :kr] = block_size
            groups[r, :kr] = torch.arange(bounds[r] // block_size, bounds[r] // block_size + kr, device="cpu")
        return ScaleLayout(lengths.to(device), groups.to(device), n_blocks + 1, chunk, block_size, sizes)
    if scaling != "tensor":
        raise ValueError(f"comm.scaling={scaling!r} is not supported; choose tensor or block")
    pad_group = len(numels)
    rows: list[list[tuple[int, int]]] = []
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
    k = max(1, max(len(r) for r in rows))
    lengths = torch.zeros((dp_size, k), dtype=torch.int64, device="cpu")
    groups = torch.full((dp_size, k), pad_group, dtype=torch.int64, device="cpu")
    for r, row in enumerate(rows):
        for j, (n, g) in enumerate(row):
            lengths[r, j], groups[r, j] = n, g
    used = lengths.reshape(-1) > 0
    return ScaleLayout(lengths.to(device), groups.to(device), pad_group + 1, chunk, None, sizes,
                       lengths.reshape(-1)[used].to(device), groups.reshape(-1)[used].to(device),
                       [len(row) for row in rows])


@dataclass
class BlockRuns:
    """Scale groups at the granularity of fixed blocks (NVFP4's 16 elements): ``lengths[r, j]`` consecutive
    blocks of range r belong to group ``groups[r, j]`` (a block belongs to the group of its first element;
    parameters start block-aligned, so a block only ever holds one parameter and, after its end, padding).
    Zero-length runs pad every row to the same K. ``[dp, K]`` int64 tensors on the buffer's device."""

    lengths: torch.Tensor
    groups: torch.Tensor
    blocks: list[int]          # blocks per range

    def values(self, group_values: torch.Tensor) -> torch.Tensor:
        """``[dp, K]`` per-run values from per-group values; padded runs get 1."""
        vals = group_values[self.groups]
        return torch.where(self.lengths > 0, vals, torch.ones_like(vals))

    def expand_all(self, run_vals: torch.Tensor) -> torch.Tensor:
        """Per-block values ``[total blocks]`` of the whole buffer from ``[dp, K]`` run values."""
        return run_vals.reshape(-1).repeat_interleave(self.lengths.reshape(-1), output_size=sum(self.blocks))

    def expand_row(self, run_vals: torch.Tensor, r: int) -> torch.Tensor:
        """Per-block values ``[..., blocks[r]]`` of range r from ``[..., K]`` run values."""
        return run_vals.repeat_interleave(self.lengths[r], dim=-1, output_size=self.blocks[r])


def block_runs(layout: ScaleLayout, block: int, device) -> BlockRuns:
    """:class:`BlockRuns` of a tensor-scaling layout whose ranges are multiples of ``block``.

    Raises:
        ValueError: a range that is not a multiple of ``block``.
    """
    lengths, groups = layout.lengths.cpu().tolist(), layout.groups.cpu().tolist()
    rows = []
    for r, n in enumerate(layout.sizes):
        if n % block:
            raise ValueError(f"range {r} has {n} elements, not a multiple of {block}")
        starts, pos = [], 0  # (element start, group) of each segment
        for ln, g in zip(lengths[r], groups[r]):
            if ln:
                starts.append((pos, g))
                pos += ln
        runs, j = [], 0
        for b in range(n // block):
            e = b * block
            while j + 1 < len(starts) and starts[j + 1][0] <= e:
                j += 1
            g = starts[j][1]
            if runs and runs[-1][1] == g:
                runs[-1][0] += 1
            else:
                runs.append([1, g])
        rows.append(runs)
    k = max(1, max(len(r) for r in rows))
    pad = layout.num_groups - 1
    lt = torch.zeros((len(rows), k), dtype=torch.int64, device="cpu")
    gt = torch.full((len(rows), k), pad, dtype=torch.int64, device="cpu")
    for r, runs in enumerate(rows):
        for j, (ln, g) in enumerate(runs):
            lt[r, j], gt[r, j] = ln, g
    return BlockRuns(lt.to(device), gt.to(device), [n // block for n in layout.sizes])
