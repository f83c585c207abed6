"""The low-precision reducer's per-bucket scale bookkeeping is small, and the per-block maps it derives are the ones a
stored per-block table gives.

Size: at the llama_600m bucket layout (the trainer's plan, built on the meta device) at DP = 64, rank 0, every tensor
reachable from the reducer object after registration (walked here, independently of the reducer's own listing) comes
to at most 0.1 bytes per gradient element once the FP32 error-feedback residual (4 bytes per element by design) is set
aside. A per-block int64 table (one entry per 16-element block) alone would be 0.5 bytes per element. The bytes equal
what :func:`megatron_geo.comm.codec_tables.codec_table_bytes` counts from python ints.

Values: for many random bucket layouts (even and uneven ranges, empty ranges, parameters split across ranges,
alignment padding between parameters), tensor and block scaling, the layout's group amax, segment values, per-block
values and per-range segment amax equal those of per-block tables built by a plain loop over the blocks (a block's
scale group is the parameter whose extent holds it, else the padding group; its segment is its run of equal groups
within its range), read with the stored-table ops (``scatter_reduce`` over the block -> group table, ``index_select``
over the block -> segment tables), NaN included. The layout methods run the same ops whatever the DP size and the
ranges, with no host sync and no tensor made from host data, and the layout builds under a fake tensor mode.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helpers import dp_pctx
from megatron_geo.comm import build_reducer
from megatron_geo.comm.codec_tables import codec_table_bytes
from megatron_geo.comm.lowp import LowPrecisionReducer
from megatron_geo.comm.op_trace import OpRecorder
from megatron_geo.comm.scale_layout import build_scale_layout, layout_table_bytes
from megatron_geo.config import load_config

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 0.1  # bytes per gradient element
DP = 64


def _cfg(preset: str, opt: str):
    return load_config(
        [str(ROOT / "configs/llama_600m.yaml"), str(ROOT / f"configs/comm/{preset}.yaml")],
        ["train.device=cpu", "logging.wandb=disabled", f"optimizer.name={opt}"],
    )


def _llama_600m_buckets(cfg) -> list[tuple[list[int], list[int], list[int]]]:
    """``[(offsets, numels, bounds), ...]``: the trainer's buckets of llama_600m at DP = 64 for ``cfg`` (shapes from
    the meta device; the plan depends on the optimizer and on the codec's alignment)."""
    from megatron_geo.analysis.plan_report import meta_model_params, plan_layout

    params = meta_model_params(cfg, 1)
    numels = {n: int(torch.Size(shape).numel()) for n, shape, _ in params.infos}
    return [
        (list(pl.offsets), [numels[n] for n in names], list(pl.bounds)) for names, pl in plan_layout(cfg, DP, params)
    ]


def _walk_tensors(obj) -> dict[int, tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` through attributes, dicts, lists and tuples, by storage address."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    stack = [("reducer", obj)]
    while stack:
        path, o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.setdefault(o.untyped_storage().data_ptr(), (path, o))
        elif isinstance(o, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in o.items())
        elif isinstance(o, (list, tuple, set)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(o))
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not callable(o):
            stack.extend((f"{path}.{k}", v) for k, v in vars(o).items())
    return found


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


CASES = [(p, opt) for p in ("fp8", "fp8_block", "nvfp4", "geofp8", "fp8_hadamard") for opt in ("muon", "adamw")]


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_llama_600m_tables_at_dp64_are_under_a_tenth_of_a_byte_per_element(case):
    preset, opt = case
    cfg = _cfg(preset, opt)
    buckets = _llama_600m_buckets(cfg)
    red = build_reducer(cfg.comm, dp_pctx(DP), device="cpu")
    assert isinstance(red, LowPrecisionReducer)
    grad_elements = 0
    for key, (offsets, numels, bounds) in enumerate(buckets):
        red.register_bucket(key, offsets, numels, bounds, "cpu")
        grad_elements += bounds[-1]
    assert grad_elements > 6e8  # the whole model's gradient buffers
    walked = _walk_tensors(red)
    residual = {t.untyped_storage().data_ptr() for t in red.residuals.values()}
    # error feedback's residual is the algorithm's state: 4 bytes per element of each bucket, nothing else
    assert sum(_nbytes(t) for t in red.residuals.values()) == (4 * grad_elements if cfg.comm.error_feedback else 0)
    rest = {p: v for p, v in walked.items() if p not in residual}
    rest_bytes = sum(_nbytes(t) for _, t in rest.values())
    per_element = rest_bytes / grad_elements
    assert per_element <= LIMIT, (
        f"{preset} at DP={DP}: {per_element:.4f} bytes per gradient element kept after registration: "
        + ", ".join(f"{path} {_nbytes(t)} B" for path, t in sorted(rest.values(), key=lambda v: -_nbytes(v[1]))[:5])
    )
    # the fixed Hadamard rotation: signs [b] and M, M^T [b, b] FP32, once per reducer whatever the buckets
    b = cfg.comm.hadamard_block
    fixed = (4 * b + 2 * 4 * b * b) if cfg.comm.transform == "hadamard" else 0
    # the reducer's listing names every tensor the walk found; its table bytes are the rest, and the pure count's
    listed = {t.untyped_storage().data_ptr() for t in red.persistent_tensors().values()}
    assert listed == set(walked), sorted(path for p, (path, _) in walked.items() if p not in listed)
    assert red.index_table_bytes() == rest_bytes - fixed
    assert codec_table_bytes(cfg.comm, buckets, DP) == red.index_table_bytes()


def test_plain_reducers_keep_no_tables():
    for preset in ("fp32", "bf16"):
        assert codec_table_bytes(_cfg(preset, "adamw").comm, [([0], [64], [0, 32, 64])], 2) == 0


# ---------------------------------------------------------------------------------------- the derived block maps
def _max_nan(a: float, b: float) -> float:
    """max(a, b) where a NaN on either side wins."""
    return a if a != a else b if b != b else max(a, b)


def _stored_tables(offsets, extents, bounds, scaling, block, granule):
    """Per-block tables built by a plain loop over the blocks: ``(block_group, block_range, block_seg)`` lists, the
    ``[dp][K]`` segment group and length tables, num_groups and K."""
    g = block if scaling == "block" else granule
    pad = bounds[-1] // block if scaling == "block" else len(offsets)
    dp = len(bounds) - 1
    bgroup, brange, bseg = [], [], []
    rows_g, rows_n = [], []
    for r in range(dp):
        seg, prev = -1, None
        row_g, row_n = [], []
        for s in range(bounds[r], bounds[r + 1], g):
            if scaling == "block":
                grp = s // block
            else:
                grp = next((i for i in range(len(offsets)) if offsets[i] <= s < offsets[i] + extents[i]), pad)
            if grp != prev or scaling == "block":
                seg, prev = seg + 1, grp
                row_g.append(grp)
                row_n.append(0)
            row_n[-1] += g
            bgroup.append(grp)
            brange.append(r)
            bseg.append(seg)
        rows_g.append(row_g)
        rows_n.append(row_n)
    k = max(1, max(len(x) for x in rows_g))
    groups = [x + [pad] * (k - len(x)) for x in rows_g]
    lengths = [x + [0] * (k - len(x)) for x in rows_n]
    return (bgroup, brange, bseg), groups, lengths, pad + 1, k


def _random_layout(rng: random.Random, scaling: str):
    """(offsets, extents, bounds, block, granule) of a random bucket: 1-6 parameters with gaps of padding between
    them, cut into 1-9 ranges (equal chunks or uneven, some empty)."""
    granule, block = 16, 128
    unit = block if scaling == "block" else granule
    offsets, extents, pos = [], [], 0
    for _ in range(rng.randint(1, 6)):
        pos += unit * rng.choice([0, 0, 1, 3])  # padding before the parameter (its own group)
        n = unit * rng.randint(1, 12)
        offsets.append(pos)
        extents.append(n)
        pos += n
    total_units = -(-(pos + unit * rng.choice([0, 2])) // unit)
    dp = rng.randint(1, 9)
    if rng.random() < 0.4:  # even chunks
        per = -(-total_units // dp)
        bounds = [r * per * unit for r in range(dp + 1)]
    else:  # uneven cuts, empty ranges allowed
        cuts = sorted(rng.randint(0, total_units) for _ in range(dp - 1))
        bounds = [0] + [c * unit for c in cuts] + [total_units * unit]
    return offsets, extents, bounds, block, granule


LAYOUTS = [("tensor", seed) for seed in range(40)] + [("block", seed) for seed in range(40)]


@pytest.mark.parametrize("scaling,seed", LAYOUTS, ids=[f"{s}-{i}" for s, i in LAYOUTS])
def test_derived_block_maps_equal_the_stored_tables(scaling, seed):
    rng = random.Random(seed)
    offsets, extents, bounds, block, granule = _random_layout(rng, scaling)
    dp = len(bounds) - 1
    lay = build_scale_layout(offsets, extents, bounds, dp, scaling, block, "cpu", granule=granule)
    (bgroup, brange, bseg), groups, lengths, num_groups, k = _stored_tables(
        offsets, extents, bounds, scaling, block, granule
    )
    nb = len(bgroup)
    assert (lay.num_groups, lay.K, lay.num_blocks) == (num_groups, k, nb)
    assert lay.chunk == (bounds[1] if len(set(b - a for a, b in zip(bounds, bounds[1:]))) == 1 else -1)
    block_group = torch.tensor(bgroup, dtype=torch.int64)
    block_flat = torch.tensor([r * k + s for r, s in zip(brange, bseg)], dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    bamax = torch.rand(nb, generator=gen) + 0.5
    if nb > 2:
        bamax[rng.randrange(nb)] = float("nan")
    # group amax: stored-table op (scatter over the block -> group table) and a plain loop
    want = torch.zeros(num_groups).scatter_reduce_(0, block_group, bamax, reduce="amax", include_self=True)
    loop = [0.0] * num_groups
    for grp, v in zip(bgroup, bamax.tolist()):
        loop[grp] = _max_nan(loop[grp], v)
    torch.testing.assert_close(want, torch.tensor(loop), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(lay.group_amax(bamax), want, equal_nan=True, rtol=0, atol=0)
    # segment values: the group's value for each segment of each range, 1 for the segments padding a row to K
    gv = torch.rand(num_groups, generator=gen) + 2
    seg_want = torch.where(torch.tensor(lengths) > 0, gv[torch.tensor(groups)], torch.ones(dp, k))
    assert torch.equal(lay.segment_values(gv), seg_want)
    # per-block values of the whole buffer and of each range; segment amax of each range
    sv = torch.rand(dp, k, generator=gen)
    assert torch.equal(lay.block_values(sv), sv.reshape(-1).index_select(0, block_flat))
    for r in range(dp):
        mine = [i for i in range(nb) if brange[i] == r]
        block_seg = torch.tensor([bseg[i] for i in mine], dtype=torch.int64)
        got = lay.row_block_values(sv[r], r)
        assert torch.equal(got, sv[r].index_select(0, block_seg))
        two = torch.stack([sv[r], sv[r] * 2])  # [sources, K], as decode_own's scales
        assert torch.equal(lay.row_block_values(two, r), two.index_select(1, block_seg))
        row = bamax[mine] if mine else bamax[:0]
        seg_amax = torch.zeros(k).scatter_reduce_(0, block_seg, row, reduce="amax", include_self=True)
        torch.testing.assert_close(lay.row_segment_amax(row, r), seg_amax, equal_nan=True, rtol=0, atol=0)
    # what is kept: a few entries per segment (tensor) or per range and per row slot (block), never per block
    assert lay.table_bytes() == layout_table_bytes(offsets, extents, bounds, dp, scaling, block, granule)
    assert lay.table_bytes() == ((8 + 4 + 1) * dp * k if scaling == "tensor" else 12 * dp + 4 * k)


def _method_ops(lay) -> tuple[list[tuple[str, int]], list[str]]:
    """Kernel-launching ops of each layout method (view ops excluded) and the sync-forcing ones seen."""
    gen = torch.Generator().manual_seed(0)
    bamax = torch.rand(lay.num_blocks, generator=gen)
    gv = torch.rand(lay.num_groups, generator=gen)
    sv = torch.rand(lay.dp_size, lay.K, generator=gen)
    r = lay.dp_size - 1
    row = bamax[lay.block_bounds[r] : lay.block_bounds[r + 1]]
    calls = {
        "group_amax": lambda: lay.group_amax(bamax),
        "segment_values": lambda: lay.segment_values(gv),
        "block_values": lambda: lay.block_values(sv),
        "row_block_values": lambda: lay.row_block_values(sv, r),
        "row_segment_amax": lambda: lay.row_segment_amax(row, r),
    }
    counts, bad = [], []
    for name, fn in calls.items():
        rec = OpRecorder()
        with rec:
            fn()
        counts.append((name, rec.work))
        bad += rec.bad
    return counts, bad


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_layout_ops_do_not_depend_on_the_dp_size_or_the_ranges(scaling):
    """The same ops for even and uneven ranges at DP = 1, 8 and 64 (a bucket of 70 parameters), none forcing a sync."""
    unit = 128
    numels = [unit * (1 + i % 5) for i in range(70)]
    offsets = [sum(numels[:i]) for i in range(70)]
    total = sum(numels) + 64 * unit * 8
    seen = {}
    for dp in (1, 8, 64):
        per = -(-total // (dp * unit)) * unit
        even = [r * per for r in range(dp + 1)]
        uneven = [0] + sorted({min(total, (r * 7919) % total // unit * unit) for r in range(1, dp)}) + [total]
        uneven += [total] * (dp + 1 - len(uneven))
        for kind, bounds in (("even", even), ("uneven", uneven)):
            lay = build_scale_layout(offsets, numels, bounds, dp, scaling, unit, "cpu", granule=16)
            counts, bad = _method_ops(lay)
            assert bad == [], (dp, kind, bad)
            seen[(dp, kind)] = counts
    assert len({tuple(c) for c in seen.values()}) == 1, seen


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_layout_builds_and_runs_under_a_fake_tensor_mode(scaling):
    """The fake-device train step builds every layout under ``FakeTensorMode``: nothing reads a tensor's values back
    to the host, at the build or in a reduction."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lay = build_scale_layout([0, 256], [256, 384], [0, 256, 512, 640], 3, scaling, 128, "cpu", granule=16)
        bamax = torch.rand(lay.num_blocks)
        seg = lay.segment_values(lay.group_amax(bamax))
        assert tuple(seg.shape) == (3, lay.K)
        assert tuple(lay.block_values(seg).shape) == (lay.num_blocks,)
        assert tuple(lay.row_block_values(seg, 1).shape) == (3, lay.row_num_blocks(1))
        assert tuple(lay.row_segment_amax(bamax[: lay.row_num_blocks(0)], 0).shape) == (lay.K,)
