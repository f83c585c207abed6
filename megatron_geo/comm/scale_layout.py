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

from dataclasses import dataclass, field

import torch


@dataclass
class ScaleLayout:
    """Per-bucket segment tables of one bucket, built once at registration; nothing here grows with the bucket.

    Every segment is a whole number of *blocks* of ``granule`` elements (parameters start at multiples of the
    codec's alignment and their scale group covers the padding up to the next one; rank ranges are multiples
    of it), so a per-segment value reaches the elements as one value per block, broadcast over a
    ``[blocks, granule]`` view: no per-element scale tensor, no data-dependent shape.

    The block -> segment map is never stored per block (an int64 entry per 16-element block would be 0.5 bytes per
    gradient element for each table). It is derived where it is needed:

    - ``tensor`` scaling: the few segments of each range are held as two ``[dp, K]`` tables (K: segments of the
      longest row, about the parameters of the bucket; their blocks per segment also as python ints). A scale
      group's amax is ``segment_reduce`` max over the runs of blocks (initial 0, NaN propagating), then a
      ``scatter_reduce`` over the ``dp x K`` segments; per-block values are the segment values expanded over
      their runs and concatenated (up to :data:`CAT_RUNS` non-empty runs), else ``repeat_interleave`` with
      int32 run lengths and the output size known on the host. Nothing syncs with the host (``unsafe=True``
      skips ``segment_reduce``'s checks, which read the lengths back) and no shape depends on data.
    - ``block`` scaling: segment j of range r is block ``block_bounds[r] + j``, so the maps are slices and
      ``arange`` arithmetic; no table is kept at all (an even plan: per-block values are the ``[dp, K]`` table's
      own storage).

    Attributes:
        dp_size: ranges (DP ranks).
        K: segments per range, padded to the longest row.
        num_groups: number of scale groups (including the padding group ``num_groups - 1``, amax 0).
        chunk: the range length of an even plan, else -1.
        block_size: set for block scaling (then every segment is one block), else None.
        sizes: elements of each rank's range (python ints).
        granule: elements per block (the codec's alignment: 16 for tensor-scaled FP8 and NVFP4, the block
            size for block scaling).
        block_bounds: ``dp + 1`` block offsets of the ranges (python ints).
        groups: tensor scaling: int64 ``[dp, K]`` scale-group id of each segment (padding segments: the padding
            group); block scaling: None (segment j of row r is group ``block_bounds[r] + j``).
        seg_blocks: tensor scaling: int32 ``[dp * K]`` blocks per segment (its length // ``granule``, flattened);
            block scaling: None.
        seg_blocks_host: ``seg_blocks`` as python ints (tensor scaling), else empty.
    """

    dp_size: int
    K: int
    num_groups: int
    chunk: int
    block_size: int | None
    sizes: list[int]
    granule: int
    block_bounds: list[int]
    groups: torch.Tensor | None = None
    seg_blocks: torch.Tensor | None = None
    seg_blocks_host: list[int] = field(default_factory=list)

    @property
    def lengths(self) -> torch.Tensor | None:
        """Tensor scaling: int64 ``[dp, K]`` segment lengths per range, zero-padded to K (row r sums to
        ``sizes[r]``), derived from ``seg_blocks``; block scaling: None (every segment of row r below
        ``sizes[r] // block_size`` is one block)."""
        return None if self.seg_blocks is None else self.seg_blocks.view(self.dp_size, self.K).long() * self.granule

    @property
    def numel(self) -> int:
        """Elements of the whole bucket buffer."""
        return sum(self.sizes)

    @property
    def num_blocks(self) -> int:
        """Blocks of ``granule`` elements in the whole buffer (python int)."""
        return self.block_bounds[-1] - self.block_bounds[0]

    def row_num_blocks(self, r: int) -> int:
        """Blocks of range ``r`` (python int)."""
        return self.block_bounds[r + 1] - self.block_bounds[r]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this layout keeps for the whole run, by attribute name (empty for block scaling)."""
        return {k: t for k in ("groups", "seg_blocks") if (t := getattr(self, k)) is not None}

    def table_bytes(self) -> int:
        """Bytes of :meth:`tensors` (what the bucket's scale bookkeeping holds on the device)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def _row_blocks(self, r: int) -> torch.Tensor:
        assert self.seg_blocks is not None
        return self.seg_blocks.view(self.dp_size, self.K)[r]

    def group_amax(self, block_amax: torch.Tensor) -> torch.Tensor:
        """Max per scale group, float32 ``[num_groups]``, from the per-block amax ``[num_blocks]`` of the whole
        buffer, each group's max taken with 0 (groups without blocks: 0); NaN in a block makes its group's amax NaN
        (``scatter_reduce`` amax and ``clamp_min`` both propagate NaN)."""
        if self.block_size is not None:  # one group per block, in block order, then the padding group
            return torch.cat([block_amax.clamp_min(0.0), block_amax.new_zeros(1)])
        assert self.groups is not None and self.seg_blocks is not None
        seg = torch.segment_reduce(block_amax, "max", lengths=self.seg_blocks, unsafe=True, initial=0.0)
        out = torch.zeros(self.num_groups, dtype=torch.float32, device=block_amax.device)
        return out.scatter_reduce_(0, self.groups.reshape(-1), seg, reduce="amax", include_self=True)

    def row_segment_amax(self, block_amax: torch.Tensor, r: int) -> torch.Tensor:
        """Max per segment of range ``r`` alone (taken with 0), float32 ``[K]`` (empty segments 0), from the
        per-block amax of that range ``[row_num_blocks(r)]``."""
        if self.block_size is not None:
            return torch.cat([block_amax.clamp_min(0.0), block_amax.new_zeros(self.K - self.row_num_blocks(r))])
        # the row's K segments, empty ones at the initial 0
        return torch.segment_reduce(block_amax, "max", lengths=self._row_blocks(r), unsafe=True, initial=0.0)

    def segment_values(self, group_values: torch.Tensor) -> torch.Tensor:
        """``[dp, K]`` per-segment values (e.g. scales) from per-group values ``[num_groups]``; padded segments
        get 1."""
        if self.block_size is None:
            assert self.groups is not None and self.seg_blocks is not None
            vals = group_values[self.groups]
            return torch.where(self.seg_blocks.view(self.dp_size, self.K) > 0, vals, torch.ones_like(vals))
        dp, k, dev = self.dp_size, self.K, group_values.device
        if self.chunk > 0:  # even: row r holds groups r*K .. r*K + K - 1, in order
            return group_values[: dp * k].view(dp, k)
        j = torch.arange(k, device=dev)
        first = torch.tensor(self.block_bounds[:-1], device=dev).unsqueeze(1)  # [dp, 1], a few bytes per call
        valid = j < torch.tensor([self.row_num_blocks(r) for r in range(dp)], device=dev).unsqueeze(1)
        index = torch.where(valid, first + j, torch.full_like(first + j, self.num_groups - 1))
        vals = group_values[index]
        return torch.where(valid, vals, torch.ones_like(vals))

    def block_values(self, seg_vals: torch.Tensor) -> torch.Tensor:
        """Per-block values ``[num_blocks]`` of the whole buffer from ``seg_vals`` ``[dp, K]`` (every range's
        own)."""
        flat = seg_vals.reshape(-1)
        if self.block_size is None:
            assert self.seg_blocks is not None
            return _expand_runs(flat, self.seg_blocks, self.seg_blocks_host, self.num_blocks)
        if self.chunk > 0:
            return flat
        dp, k = self.dp_size, self.K
        counts = torch.tensor([self.row_num_blocks(r) for r in range(dp)], device=flat.device).unsqueeze(1)
        keep = (torch.arange(k, device=flat.device) < counts).reshape(-1).long()  # 1 for real segments
        return flat.repeat_interleave(keep, output_size=self.num_blocks)

    def row_block_values(self, seg_vals: torch.Tensor, r: int) -> torch.Tensor:
        """Per-block values ``[..., row_num_blocks(r)]`` from ``seg_vals`` ``[..., K]`` (segments of range r)."""
        n = self.row_num_blocks(r)
        if self.block_size is not None:
            return seg_vals[..., :n].contiguous()
        k = self.K
        return _expand_runs(seg_vals, self._row_blocks(r), self.seg_blocks_host[r * k : (r + 1) * k], n)


CAT_RUNS = 64  # up to this many non-empty runs, per-block values are one cat of expanded views


def _expand_runs(vals: torch.Tensor, counts: torch.Tensor, counts_host: list[int], total: int) -> torch.Tensor:
    """``vals`` ``[..., S]`` with value s repeated ``counts[s]`` times along the last dim: ``[..., total]``
    (``total = sum(counts)``). Few runs: one ``cat`` of expanded views (one write per output value, no index);
    many: ``repeat_interleave`` with the int32 ``counts`` (a transient int32 index of ``total`` entries)."""
    runs = [(s, n) for s, n in enumerate(counts_host) if n]
    if len(runs) <= CAT_RUNS:
        lead = vals.shape[:-1]
        if not runs:
            return vals.new_empty((*lead, 0))
        return torch.cat([vals[..., s : s + 1].expand(*lead, n) for s, n in runs], dim=-1)
    return vals.repeat_interleave(counts, dim=vals.dim() - 1, output_size=total)


def build_scale_layout(
    offsets: list[int], numels: list[int], bounds, dp_size: int, scaling: str, block_size: int, device, granule: int = 1
) -> ScaleLayout:
    """The segment tables (:class:`ScaleLayout`) of a bucket whose parameter i occupies
    ``[offsets[i], offsets[i] + numels[i])`` (``numels[i]`` may include the alignment padding after it: its scale
    group then covers that padding).

    Args:
        bounds: the ``dp_size + 1`` rank-range boundaries, or an int ``chunk`` (even ranges).
        scaling: ``tensor`` (one group per parameter) or ``block`` (one per ``block_size`` elements).
        granule: elements per block for tensor scaling (block scaling uses ``block_size``). Every segment
            must be a multiple of it.
        device: where the tables live (tensor scaling: an int64 and an int32 table of ``dp_size x K`` entries; block
            scaling keeps none).

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
        pad_group = bounds[-1] // block_size  # one group per block, then the padding group
        rows: list[list[tuple[int, int]]] = []
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
    block_bounds = [b // granule for b in bounds]
    layout = ScaleLayout(dp_size, k, pad_group + 1, chunk, None, sizes, granule, block_bounds)
    if scaling == "block":  # the maps are arange arithmetic on block_bounds: nothing to keep
        layout.block_size = block_size
        return layout
    lengths = torch.zeros((dp_size, k), dtype=torch.int64, device="cpu")
    groups = torch.full((dp_size, k), pad_group, dtype=torch.int64, device="cpu")
    for r, row in enumerate(rows):
        if row:
            lengths[r, : len(row)] = torch.tensor([n for n, _ in row], device="cpu")
            groups[r, : len(row)] = torch.tensor([g for _, g in row], device="cpu")
    layout.groups = groups.to(device)
    seg_blocks = (lengths // granule).reshape(-1)
    layout.seg_blocks = seg_blocks.to(torch.int32).to(device)
    layout.seg_blocks_host = [int(n) for n in seg_blocks.tolist()]
    return layout
