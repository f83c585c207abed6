"""The scale layout derives its per-block values and its group / segment amax with data-parallel ops only, and they
give the values the per-segment kernels gave, bit for bit.

Reference: the formulation the layout used before, written here with the per-segment kernels
(``torch.segment_reduce`` max with initial 0 over each segment's run of blocks, then a ``scatter_reduce`` amax of the
segments into their groups; per-block values by ``repeat_interleave`` of the segment values by the blocks per
segment, with the output size known on the host). On a GPU those kernels give a segment to one thread block
(``segment_reduce``) or one warp (``repeat_interleave``), so a segment of hundreds of thousands of blocks (a large
matrix owned whole by one rank) runs serially.

Values: random layouts (even and uneven ranges, empty ranges, zero-length segments padding rows to K, gaps between
parameters, one parameter spanning several ranges, a single segment of 2**20 blocks) with NaN, +-inf, -0.0 / +0.0,
negative values and segments holding only NaN or only zeros: every method's result equals the reference's bits.
Where NaNs of different bits share a group, which one survives is not specified (nor was it on a GPU, where atomics
and the segmented reduction's tree set the order): NaN stays NaN and every other value is bitwise equal.

Kernels: under a ``TorchDispatchMode`` the layout methods run neither ``repeat_interleave`` nor ``segment_reduce``
(the reference does: the recorder sees them), and they run the same ops for short segments and for one huge one.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from megatron_geo.comm.op_trace import OpRecorder
from megatron_geo.comm.scale_layout import ScaleLayout, build_scale_layout

GRANULE = 16
BLOCK = 128


def _segment_lengths(lay: ScaleLayout) -> torch.Tensor:
    """int32 ``[dp, K]`` blocks per segment, from the segment ends (python ints)."""
    assert lay.seg_ends is not None
    ends = lay.seg_ends.view(-1).tolist()
    lengths = [e - s for s, e in zip([0] + ends[:-1], ends)]
    return torch.tensor(lengths, dtype=torch.int32).view(lay.dp_size, lay.K)


def _ref_group_amax(lay: ScaleLayout, block_amax: torch.Tensor) -> torch.Tensor:
    if lay.block_size is not None:
        return F.pad(block_amax.clamp_min(0.0), (0, 1))
    assert lay.groups is not None
    seg = torch.segment_reduce(block_amax, "max", lengths=_segment_lengths(lay).view(-1), unsafe=True, initial=0.0)
    base = torch.zeros(lay.num_groups, dtype=torch.float32)
    return base.scatter_reduce(0, lay.groups.view(-1), seg, reduce="amax", include_self=True)


def _ref_row_segment_amax(lay: ScaleLayout, block_amax: torch.Tensor, r: int) -> torch.Tensor:
    if lay.block_size is not None:
        return F.pad(block_amax.clamp_min(0.0), (0, lay.K - lay.row_num_blocks(r)))
    return torch.segment_reduce(block_amax, "max", lengths=_segment_lengths(lay)[r], unsafe=True, initial=0.0)


def _ref_block_values(lay: ScaleLayout, seg_vals: torch.Tensor) -> torch.Tensor:
    if lay.block_size is not None:
        assert lay.row_blocks is not None and lay.seg_index is not None
        counts = (lay.row_blocks - lay.seg_index).clamp_(0, 1)
    else:
        counts = _segment_lengths(lay)
    return seg_vals.reshape(-1).repeat_interleave(counts.view(-1), output_size=lay.num_blocks)


def _ref_row_block_values(lay: ScaleLayout, seg_vals: torch.Tensor, r: int) -> torch.Tensor:
    n = lay.row_num_blocks(r)
    if lay.block_size is not None:
        return seg_vals.narrow(-1, 0, n).clone(memory_format=torch.contiguous_format)
    return seg_vals.repeat_interleave(_segment_lengths(lay)[r], dim=seg_vals.dim() - 1, output_size=n)


def _random_layout(rng: random.Random, scaling: str, huge: bool = False):
    """``(offsets, extents, bounds)`` of a random bucket (elements; multiples of the granule): parameters with
    gaps between them (padding segments), even or uneven ranges (empty ones allowed), optionally one parameter
    of 2**20 blocks among small ones."""
    unit = BLOCK if scaling == "block" else GRANULE
    offsets, extents, pos = [], [], 0
    for i in range(rng.randint(1, 10)):
        pos += unit * rng.choice([0, 0, 1, 3])  # gap: a padding segment
        n = unit * (2**20 if huge and i == 0 else rng.randint(1, 40))
        offsets.append(pos)
        extents.append(n)
        pos += n
    total = pos // unit + rng.choice([0, 2])
    dp = rng.randint(1, 9)
    if rng.random() < 0.4:
        per = -(-total // dp)
        bounds = [r * per * unit for r in range(dp + 1)]
    else:
        cuts = sorted(rng.randint(0, total) for _ in range(dp - 1))
        bounds = [0] + [c * unit for c in cuts] + [total * unit]
    return offsets, extents, bounds


def _block_amax(rng: random.Random, n: int, gen: torch.Generator, nan_bits: list[int]) -> torch.Tensor:
    """float32 ``[n]``: random magnitudes with NaN (of the bits in ``nan_bits``), +-inf, -0.0 / +0.0 and negative
    values sprinkled in, and some runs holding only NaN or only zeros."""
    x = torch.rand(n, generator=gen) * 4
    if n == 0:
        return x
    specials = [float("inf"), float("-inf"), -0.0, 0.0, -1.5]
    for _ in range(rng.randint(0, 6)):
        x[rng.randrange(n)] = rng.choice(specials)
    bits = x.view(torch.int32)
    for _ in range(rng.randint(0, 3)):
        bits[rng.randrange(n)] = rng.choice(nan_bits)
    for fill in ("nan", "zeros", "negzeros"):
        if rng.random() < 0.3:
            lo = rng.randrange(n)
            hi = min(n, lo + rng.randint(1, 50))
            if fill == "nan":
                bits[lo:hi] = nan_bits[0]
            else:
                x[lo:hi] = 0.0 if fill == "zeros" else -0.0
    return x


NAN = 0x7FC00000  # float("nan")
OTHER_NANS = [NAN, 0x7FC00001, 0x7FFFFFFF, -0x00400000]  # the last: 0xFFC00000, a negative quiet NaN


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _same_but_nan_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and _same_bits(a.masked_fill(nan, 0.0), b.masked_fill(nan, 0.0))


def _check_layout(lay: ScaleLayout, rng: random.Random, seed: int, nan_bits: list[int]) -> None:
    gen = torch.Generator().manual_seed(seed)
    same = _same_bits if len(nan_bits) == 1 else _same_but_nan_bits
    bamax = _block_amax(rng, lay.num_blocks, gen, nan_bits)
    got, want = lay.group_amax(bamax), _ref_group_amax(lay, bamax)
    assert same(got, want), (got, want)
    sv = torch.randn(lay.dp_size, lay.K, generator=gen)
    sv.view(-1)[rng.randrange(sv.numel())] = float("nan")
    assert _same_bits(lay.block_values(sv), _ref_block_values(lay, sv))
    for r in range(lay.dp_size):
        lo, hi = lay.block_bounds[r], lay.block_bounds[r + 1]
        row = bamax[lo:hi]
        assert same(lay.row_segment_amax(row, r), _ref_row_segment_amax(lay, row, r)), r
        two = torch.stack([sv[r], -sv[r]])  # [sources, K]
        got_rows = lay.row_block_values(two, r)
        assert _same_bits(got_rows, _ref_row_block_values(lay, two, r)) and got_rows.is_contiguous()
        assert _same_bits(lay.row_block_values(sv[r], r), _ref_row_block_values(lay, sv[r], r))


CASES = [(s, seed) for s in ("tensor", "block") for seed in range(30)]


@pytest.mark.parametrize("scaling,seed", CASES, ids=[f"{s}-{i}" for s, i in CASES])
def test_parallel_derivations_equal_the_per_segment_kernels_bitwise(scaling, seed):
    rng = random.Random(seed)
    offsets, extents, bounds = _random_layout(rng, scaling)
    dp = len(bounds) - 1
    lay = build_scale_layout(offsets, extents, bounds, dp, scaling, BLOCK, "cpu", granule=GRANULE)
    _check_layout(lay, rng, seed, [NAN])


@pytest.mark.parametrize("seed", range(6))
def test_nan_stays_nan_whatever_its_bits(seed):
    """NaNs of different bits in one group or segment: the result is NaN where the reference's is, and every
    other value is bitwise equal."""
    rng = random.Random(1000 + seed)
    offsets, extents, bounds = _random_layout(rng, "tensor")
    lay = build_scale_layout(offsets, extents, bounds, len(bounds) - 1, "tensor", BLOCK, "cpu", granule=GRANULE)
    _check_layout(lay, rng, seed, OTHER_NANS)


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_a_segment_of_a_million_blocks_equals_the_per_segment_kernels_bitwise(scaling):
    """One parameter of 2**20 blocks (tensor scaling: one segment per range it covers) among small ones."""
    rng = random.Random(7)
    offsets, extents, bounds = _random_layout(rng, scaling, huge=True)
    lay = build_scale_layout(offsets, extents, bounds, len(bounds) - 1, scaling, BLOCK, "cpu", granule=GRANULE)
    assert lay.num_blocks >= 2**20
    _check_layout(lay, rng, 7, [NAN])
    whole = build_scale_layout([0], [GRANULE * 2**20], [0, GRANULE * 2**20], 1, "tensor", BLOCK, "cpu", GRANULE)
    _check_layout(whole, rng, 8, [NAN])


def test_empty_segments_and_ranges_give_zero_amax_and_no_blocks():
    """Range 1 is empty, range 0 pads its row to K with a zero-length segment; a segment of only NaN and one of
    only -0.0: group amax NaN and +0.0 (the max is taken with +0.0), empty segments +0.0."""
    g = GRANULE
    lay = build_scale_layout(
        [0, 2 * g, 5 * g], [2 * g, 3 * g, g], [0, 2 * g, 2 * g, 6 * g], 3, "tensor", BLOCK, "cpu", g
    )
    assert lay.K == 2 and [lay.row_num_blocks(r) for r in range(3)] == [2, 0, 4]
    bamax = torch.tensor([float("nan"), 1.0, -0.0, -0.0, -0.0, float("inf")])
    want = _ref_group_amax(lay, bamax)
    assert _same_bits(lay.group_amax(bamax), want)
    assert torch.isnan(want[0]) and want[1].item() == 0.0 and not want[1].signbit() and want[2].item() == float("inf")
    row0 = lay.row_segment_amax(bamax[:2], 0)
    assert _same_bits(row0, _ref_row_segment_amax(lay, bamax[:2], 0))
    assert torch.isnan(row0[0]) and row0[1].item() == 0.0 and not row0[1].signbit()
    assert _same_bits(lay.row_segment_amax(bamax[:0], 1), torch.zeros(2))
    assert lay.row_block_values(torch.ones(3, 2), 1).shape == (3, 0)


def _ops(lay: ScaleLayout) -> dict[str, list[str]]:
    """Aten ops (kernel-launching or not) of each layout method, in call order."""
    gen = torch.Generator().manual_seed(0)
    bamax = torch.rand(lay.num_blocks, generator=gen)
    gv = torch.rand(lay.num_groups, generator=gen)
    sv = torch.rand(lay.dp_size, lay.K, generator=gen)
    r = 0
    row = bamax[lay.block_bounds[r] : lay.block_bounds[r + 1]]
    calls = {
        "group_amax": lambda: lay.group_amax(bamax),
        "segment_values": lambda: lay.segment_values(gv),
        "block_values": lambda: lay.block_values(sv),
        "row_block_values": lambda: lay.row_block_values(sv, r),
        "row_segment_amax": lambda: lay.row_segment_amax(row, r),
    }
    out = {}
    for name, fn in calls.items():
        rec = OpRecorder(keep_events=True)
        with rec:
            fn()
        assert rec.bad == [], (name, rec.bad)
        out[name] = [op for kind, op, _ in rec.events if kind == "op"]
    return out


SERIAL = {"aten::repeat_interleave", "aten::segment_reduce", "aten::_segment_reduce_backward"}


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_layout_methods_run_no_per_segment_kernel_whatever_the_segment_sizes(scaling):
    """Short segments (64 parameters of 1-8 blocks over 4 ranges) and one segment of 2**18 blocks (a matrix owned
    whole): the same aten ops, none of them ``repeat_interleave`` or ``segment_reduce``."""
    unit = BLOCK if scaling == "block" else GRANULE
    numels = [unit * (1 + i % 8) for i in range(64)]
    offsets = [sum(numels[:i]) for i in range(64)]
    small = build_scale_layout(offsets, numels, -(-sum(numels) // (4 * unit)) * unit, 4, scaling, BLOCK, "cpu", GRANULE)
    n = unit * 2**18
    huge = build_scale_layout([0], [n], n, 1, scaling, BLOCK, "cpu", GRANULE)
    ops_small, ops_huge = _ops(small), _ops(huge)
    for name, names in ops_small.items():
        assert not SERIAL & set(names), (name, sorted(SERIAL & set(names)))
        assert names == ops_huge[name], (name, names, ops_huge[name])


def test_the_op_recorder_sees_the_per_segment_kernels():
    """The check above can fail: the reference's ops, recorded the same way, include both kernels."""
    lay = build_scale_layout([0], [GRANULE * 64], [0, GRANULE * 32, GRANULE * 64], 2, "tensor", BLOCK, "cpu", GRANULE)
    rec = OpRecorder()
    with rec:
        _ref_group_amax(lay, torch.rand(lay.num_blocks))
        _ref_block_values(lay, torch.rand(lay.dp_size, lay.K))
    assert {"aten::segment_reduce", "aten::repeat_interleave"} <= set(rec.ops)
