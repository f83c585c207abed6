"""Which FP32 scale covers which elements of a bucket buffer (the "scale segments").

A bucket buffer is cut into ``dp_size`` rank ranges ``[bounds[r], bounds[r + 1])`` (equal chunks in an even
plan). Each range is cut into consecutive segments; every segment has one scale and belongs to one
*scale group* whose amax sets that scale:

- ``tensor`` scaling: a group is one parameter (the paper's layer-wise Euclidean FP8); a parameter
  split across two chunks gives one segment in each chunk, both with the parameter's scale.
  Padding gets its own segments (amax 0, scale 1).
- ``block`` scaling: a group is one block of ``block_size`` elements; ranges are multiples of
  ``block_size`` (the shard plan aligns them), so blocks never straddle two ranks' shards.

With tensor scaling ``seg_scales[r]`` (``[K]``, padded to the same K for every range) is what the all-to-all sends
to rank r; with block scaling each rank is sent the scales of its own range's blocks only
(:meth:`ScaleLayout.scale_splits`), so uneven ranges (whole Muon matrices, GeoFP8 rows) cost no padding on the wire.

No table has an entry per block: the block -> segment maps are derived on the device when a reduction needs
them, with one fixed list of ops whatever the DP size, whether the ranges are even and how long the segments are
(see :class:`ScaleLayout`). Every op is data-parallel over blocks (a binary search of each block's segment, gathers,
a tiled max and scatters): none gives one thread, warp or thread block a whole segment, so a segment of millions
of blocks (a large matrix owned whole) costs what the same blocks cost in small segments.
:func:`layout_table_bytes` counts what a layout keeps without building it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ScaleLayout:
    """Per-bucket segment tables, built once at registration; none of them has an entry per block.

    Every segment is a whole number of *blocks* of ``granule`` elements (parameters start at multiples of the
    codec's alignment and their scale group covers the padding up to the next one; rank ranges are multiples
    of it), so a per-segment value reaches the elements as one value per block, broadcast over a
    ``[blocks, granule]`` view: no per-element scale tensor, no data-dependent shape.

    How the per-block values are derived (the same ops for every DP size, even or uneven ranges):

    - ``tensor`` scaling keeps ``[dp, K]`` tables (K: segments of the longest row, about the parameters of the
      bucket). Block b's segment is ``searchsorted(seg_ends, b, right=True)`` over the row-major ``seg_ends``
      (non-decreasing; an empty segment is never found, since the first end past b is a segment holding b;
      searching all ends but the last sends the positions past the buffer's end, which only round a max up to
      whole tiles, to the last segment).
      Per-block values gather the segment values at those indices. A scale group's amax is the max of its
      blocks' amax taken with 0, NaN propagating (:func:`_tiled_amax`: whole tiles of one segment reduced with
      ``amax``, then ``scatter_reduce`` amax into the groups).
    - ``block`` scaling: segment j of range r is block (and group) ``first_block[r] + j`` for ``j <
      row_blocks[r]``, so the maps are ``arange`` arithmetic on ``dp`` + ``K`` entries (and a search of each
      block's range among the ``dp`` range ends).

    Every derived tensor has a size known on the host (blocks of the buffer or of a range, rounded up to whole
    tiles), so no op waits for the device.

    Nothing syncs with the host and no tensor is made from host data after the build.

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
        groups: tensor scaling: int64 ``[dp, K]`` scale group of each segment (zero-length padding segments:
            the padding group); block scaling: None.
        seg_ends: tensor scaling: int32 ``[dp, K]`` block offset (from the start of the buffer) at which each
            segment ends; row-major it never decreases, and a zero-length segment ends where the one before it
            does; block scaling: None.
        empty: tensor scaling: bool ``[dp, K]``, the zero-length segments that pad a row to K; block: None.
        first_block: block scaling: int64 ``[dp, 1]`` first block of each range; tensor scaling: None.
        row_blocks: block scaling: int32 ``[dp, 1]`` blocks of each range; tensor scaling: None.
        seg_index: block scaling: int32 ``[K]`` ``0 .. K - 1``; tensor scaling: None.
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
    seg_ends: torch.Tensor | None = None
    empty: torch.Tensor | None = None
    first_block: torch.Tensor | None = None
    row_blocks: torch.Tensor | None = None
    seg_index: torch.Tensor | None = None

    TABLES = ("groups", "seg_ends", "empty", "first_block", "row_blocks", "seg_index")

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
        """The tensors this layout keeps for the whole run, by attribute name."""
        return {k: t for k in self.TABLES if (t := getattr(self, k)) is not None}

    def table_bytes(self) -> int:
        """Bytes of :meth:`tensors` (what the bucket's scale bookkeeping holds on the device); equals
        :func:`layout_table_bytes` of the same bucket."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def group_amax(self, block_amax: torch.Tensor) -> torch.Tensor:
        """Max per scale group, float32 ``[num_groups]``, from the per-block amax, float32 ``[num_blocks]``, of
        the whole buffer, each group's max taken with 0 (groups without blocks: 0); NaN in a block makes its
        group's amax NaN (``amax``, ``scatter_reduce`` amax and ``clamp_min`` all propagate NaN; which NaN's bits
        survive when a group holds NaNs of different bits is not specified)."""
        if self.block_size is not None:  # one group per block, in block order, then the padding group
            return F.pad(block_amax.clamp_min(0.0), (0, 1))
        assert self.seg_ends is not None and self.groups is not None
        tile, tiles = _tiling(self.num_blocks)
        pos = torch.arange(tile * tiles, dtype=torch.int32, device=block_amax.device)
        # every end but the last: the positions past the buffer's end fall in the last segment
        seg = torch.searchsorted(self.seg_ends.view(-1)[:-1], pos, right=True)
        return _tiled_amax(block_amax, seg, self.groups.view(-1).index_select(0, seg), self.num_groups, tile)

    def row_segment_amax(self, block_amax: torch.Tensor, r: int) -> torch.Tensor:
        """Max per segment of range ``r`` alone (taken with 0), float32 ``[K]`` (empty segments 0, NaN
        propagating as in :meth:`group_amax`), from the per-block amax of that range, float32
        ``[row_num_blocks(r)]``."""
        if self.block_size is not None:
            return F.pad(block_amax.clamp_min(0.0), (0, self.K - self.row_num_blocks(r)))
        assert self.seg_ends is not None
        tile, tiles = _tiling(self.row_num_blocks(r))
        start = self.block_bounds[r]
        pos = torch.arange(start, start + tile * tiles, dtype=torch.int32, device=block_amax.device)
        seg = torch.searchsorted(self.seg_ends[r, :-1], pos, right=True)  # past the range's end: the last segment
        return _tiled_amax(block_amax, seg, seg, self.K, tile)

    def segment_values(self, group_values: torch.Tensor) -> torch.Tensor:
        """``[dp, K]`` per-segment values (e.g. scales) from per-group values ``[num_groups]``; the segments that
        pad a row to K get 1."""
        if self.block_size is not None:
            assert self.first_block is not None and self.seg_index is not None and self.row_blocks is not None
            group = (self.first_block + self.seg_index).clamp_(max=self.num_groups - 1)  # [dp, K]
            return group_values[group].masked_fill_(self.seg_index >= self.row_blocks, 1.0)
        assert self.groups is not None and self.empty is not None
        return group_values[self.groups].masked_fill_(self.empty, 1.0)

    def scale_splits(self) -> list[int]:
        """Scales each DP rank's range needs, as split sizes of the reduce-scatter's scale all-to-all (python ints):
        block scaling one per block of the range (nothing padded; uneven ranges differ), tensor scaling the ``K``
        segments of a padded row."""
        if self.block_size is not None:
            return [n // self.granule for n in self.sizes]
        return [self.K] * self.dp_size

    def block_values(self, seg_vals: torch.Tensor) -> torch.Tensor:
        """Per-block values ``[num_blocks]`` of the whole buffer from ``seg_vals`` ``[dp, K]`` (every range's
        own), any dtype: a gather, so the values are copied bit for bit."""
        if self.block_size is not None:
            assert self.first_block is not None and self.row_blocks is not None
            first = self.first_block.view(-1)  # [dp]
            b = torch.arange(self.num_blocks, dtype=torch.int64, device=seg_vals.device)
            r = torch.searchsorted(first + self.row_blocks.view(-1), b, right=True)  # range of each block
            flat = b + (r * self.K - first[r])  # segment b - first[r] of row r
        else:
            assert self.seg_ends is not None
            b32 = torch.arange(self.num_blocks, dtype=torch.int32, device=seg_vals.device)
            flat = torch.searchsorted(self.seg_ends.view(-1), b32, right=True)
        return seg_vals.reshape(-1).index_select(0, flat)

    def row_block_values(self, seg_vals: torch.Tensor, r: int) -> torch.Tensor:
        """Per-block values ``[..., row_num_blocks(r)]`` (contiguous) from ``seg_vals`` ``[..., K]`` (segments of
        range r), any dtype, copied bit for bit."""
        n = self.row_num_blocks(r)
        if self.block_size is not None:
            return seg_vals.narrow(-1, 0, n).clone(memory_format=torch.contiguous_format)
        assert self.seg_ends is not None
        start = self.block_bounds[r]
        pos = torch.arange(start, start + n, dtype=torch.int32, device=seg_vals.device)
        return seg_vals.index_select(-1, torch.searchsorted(self.seg_ends[r], pos, right=True))


def _tiling(n: int) -> tuple[int, int]:
    """``(tile, tiles)`` for a max over ``n`` blocks (python ints): ``tile`` a power of two near ``sqrt(n)``
    (at least 2), ``tiles = ceil(n / tile)`` (at least 1), so ``tile * tiles >= n`` and both are
    ``O(sqrt(n))``."""
    tile = 1 << ((max(n, 1).bit_length() + 1) // 2)
    return tile, max(1, -(-n // tile))


def _tiled_amax(values: torch.Tensor, seg: torch.Tensor, target: torch.Tensor, n_out: int, tile: int) -> torch.Tensor:
    """Max of ``values`` per output slot, taken with 0 (slots without values: 0), NaN propagating.

    Position ``i`` holds ``values[i]`` (and ``-inf``, which changes no max, past ``values``' end); its value goes
    to slot ``target[i]``. ``seg`` is non-decreasing and ``target`` is a function of ``seg``, so a tile whose
    first and last positions share a ``seg`` is one run of one slot: its ``amax`` goes to that slot as one
    value and its positions go to the tile's spare slot ``n_out + tile index``; a tile that holds a run boundary
    sends each position to its slot and its ``amax`` to the spare. A run of any length therefore puts at most
    ``tiles + 2 * tile`` values (``O(sqrt(n))`` with :func:`_tiling`) on its slot, and a spare slot takes at most
    ``tile``, where a plain scatter would put all ``n`` positions of a run on one address (``scatter_reduce``
    amax is an atomic compare-and-swap per value on a GPU, serialised per address).

    Args:
        values: float ``[n]``, ``n <= seg.numel()``.
        seg: int64 ``[tiles * tile]``, non-decreasing.
        target: int64 ``[tiles * tile]`` in ``[0, n_out)``, equal wherever ``seg`` is.
        n_out: slots.
        tile: positions per tile.

    Returns:
        ``[n_out]`` of ``values``' dtype, a view of the first ``n_out`` entries of a ``[n_out + tiles]`` tensor.
    """
    tiles = seg.numel() // tile
    x = F.pad(values, (0, seg.numel() - values.numel()), value=float("-inf")).view(tiles, tile)
    seg2, target2 = seg.view(tiles, tile), target.view(tiles, tile)
    whole = seg2[:, 0] == seg2[:, -1]  # [tiles]: one run
    spare = torch.arange(n_out, n_out + tiles, dtype=torch.int64, device=values.device)
    out = values.new_zeros(n_out + tiles)
    out.scatter_reduce_(0, torch.where(whole, target2[:, 0], spare), x.amax(dim=1), reduce="amax", include_self=True)
    block_slot = torch.where(whole.unsqueeze(1), spare.unsqueeze(1), target2).view(-1)
    out.scatter_reduce_(0, block_slot, x.view(-1), reduce="amax", include_self=True)
    return out[:n_out]


@dataclass
class _Rows:
    """The host-side plan of a layout: python ints only (no tensor), shared by the builder and the byte count."""

    bounds: list[int]
    sizes: list[int]
    chunk: int
    granule: int
    k: int
    pad_group: int
    rows: list[list[tuple[int, int]]]  # tensor scaling: (length, group) of each segment of each range


def _plan_rows(offsets, numels, bounds, dp_size: int, scaling: str, block_size: int, granule: int) -> _Rows:
    if isinstance(bounds, int):
        bounds = [r * bounds for r in range(dp_size + 1)]
    bounds = [int(b) for b in bounds]
    if len(bounds) != dp_size + 1 or bounds[0] != 0:
        raise ValueError(
            f"range bounds {bounds[:3]}... ({len(bounds)} of them) for dp_size={dp_size}: give dp_size + 1 "
            f"boundaries starting at 0"
        )
    sizes = [bounds[r + 1] - bounds[r] for r in range(dp_size)]
    chunk = sizes[0] if all(n == sizes[0] for n in sizes) else -1
    rows: list[list[tuple[int, int]]] = []
    if scaling == "block":
        bad = [n for n in sizes if n % block_size]
        if bad:
            raise ValueError(f"chunk {bad[0]} is not a multiple of comm.block_size={block_size}")
        return _Rows(bounds, sizes, chunk, block_size, max(1, max(sizes) // block_size), bounds[-1] // block_size, [])
    if scaling != "tensor":
        raise ValueError(f"comm.scaling={scaling!r} is not supported; choose tensor or block")
    if bounds[-1] // granule >= 2**30:
        raise ValueError(
            f"a bucket of {bounds[-1]} elements has {bounds[-1] // granule} blocks of {granule}: the int32 segment "
            f"ends and block positions take under 2**30 blocks; use smaller buckets"
        )
    pad_group = len(numels)
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
        r, n = bad[0]
        raise ValueError(
            f"range {r} has a scale segment of {n} elements, not a multiple of "
            f"the codec granule {granule}: parameter offsets, extents and rank ranges must be "
            f"aligned to the reducer's alignment() (plan the bucket with align={granule})"
        )
    return _Rows(bounds, sizes, chunk, granule, max(1, max(len(r) for r in rows)), pad_group, rows)


def layout_table_bytes(
    offsets: list[int], numels: list[int], bounds, dp_size: int, scaling: str, block_size: int, granule: int = 1
) -> int:
    """Bytes of the tensors :func:`build_scale_layout` keeps for these arguments (:meth:`ScaleLayout.table_bytes`),
    from python ints alone: no tensor is built. Tensor scaling: ``dp x K`` int64 groups, int32 segment ends and
    bool padding flags; block scaling: ``dp`` int64 and int32 entries and ``K`` int32 ones.

    Raises:
        ValueError: as :func:`build_scale_layout`.
    """
    p = _plan_rows(offsets, numels, bounds, dp_size, scaling, block_size, granule)
    if scaling == "block":
        return (8 + 4) * dp_size + 4 * p.k
    return (8 + 4 + 1) * dp_size * p.k


def build_scale_layout(
    offsets: list[int], numels: list[int], bounds, dp_size: int, scaling: str, block_size: int, device, granule: int = 1
) -> ScaleLayout:
    """The segment tables (:class:`ScaleLayout`) of a bucket whose parameter i occupies
    ``[offsets[i], offsets[i] + numels[i])`` (``numels[i]`` may include the alignment padding after it: its scale
    group then covers that padding). Every tensor is made here, from python lists (so also under a fake tensor
    mode), and placed on ``device``.

    Args:
        bounds: the ``dp_size + 1`` rank-range boundaries, or an int ``chunk`` (even ranges).
        scaling: ``tensor`` (one group per parameter) or ``block`` (one per ``block_size`` elements).
        granule: elements per block for tensor scaling (block scaling uses ``block_size``). Every segment
            must be a multiple of it.
        device: where the tables live (their bytes: :func:`layout_table_bytes`).

    Raises:
        ValueError: a range or segment that is not a multiple of the granule (block size), ``dp_size + 1``
            bounds starting at 0 missing, an unknown scaling, or (tensor scaling) ``2**30`` blocks or more.
    """
    p = _plan_rows(offsets, numels, bounds, dp_size, scaling, block_size, granule)
    g, k = p.granule, p.k
    block_bounds = [b // g for b in p.bounds]
    layout = ScaleLayout(dp_size, k, p.pad_group + 1, p.chunk, None, p.sizes, g, block_bounds)

    def table(values, dtype):
        return torch.tensor(values, dtype=dtype, device="cpu").to(device)

    if scaling == "block":
        layout.block_size = block_size
        layout.first_block = table([[b] for b in block_bounds[:-1]], torch.int64)
        layout.row_blocks = table([[n // g] for n in p.sizes], torch.int32)
        layout.seg_index = torch.arange(k, dtype=torch.int32, device="cpu").to(device)
        return layout
    pad = [(0, p.pad_group)] * k
    full = [(row + pad)[:k] for row in p.rows]
    layout.groups = table([[grp for _, grp in row] for row in full], torch.int64)
    ends = list(itertools.accumulate(n // g for row in full for n, _ in row))  # row-major, from block 0
    layout.seg_ends = table([ends[r * k : (r + 1) * k] for r in range(dp_size)], torch.int32)
    layout.empty = table([[j >= len(row) for j in range(k)] for row in p.rows], torch.bool)
    return layout
