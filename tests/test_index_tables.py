"""The low-precision reducer's bookkeeping after registration is small: for every scaled preset of configs/comm on the
tiny model's buckets (the trainer's plan at DP = 2 and 8, muon and adamw), the tensors reachable from the reducer
object (walked here, independently of the reducer's own listing) come to at most 0.1 bytes per gradient element,
once the FP32 error-feedback residual (4 bytes per element by design) and the fixed transform's bucket-independent
constants are set aside. Per-block int64 tables (one entry per 16-element block) would be 0.5 bytes per element
each.

The derived block maps equal a plain-Python reference built here from the offsets and range bounds (a block's scale
group is the parameter whose extent holds it, else the padding group; its segment is the run of equal groups of its
range), for tensor and block scaling, even and uneven ranges, NaN included; and the reducer's persistent tensors are
what the plan report counts."""

from pathlib import Path

import pytest
import torch

from megatron_geo.analysis.plan_report import meta_model_params, plan_figures, plan_layout
from megatron_geo.comm import build_reducer
from megatron_geo.comm.lowp import LowPrecisionReducer
from megatron_geo.comm.scale_layout import build_scale_layout
from megatron_geo.config import load_config

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "configs/comm").glob("*.yaml"))
LIMIT = 0.1  # bytes per gradient element


def _cfg(preset: str, opt: str):
    return load_config(
        [str(ROOT / "configs/tiny.yaml"), str(ROOT / f"configs/comm/{preset}.yaml")],
        ["train.device=cpu", "logging.wandb=disabled", f"optimizer.name={opt}"],
    )


def _scaled(preset: str) -> bool:
    from megatron_geo.comm.formats import get_format

    return get_format(_cfg(preset, "adamw").comm.dtype).scaled


SCALED = [p for p in PRESETS if _scaled(p)]


def _registered(preset: str, opt: str, dp: int):
    cfg = _cfg(preset, opt)
    params = meta_model_params(cfg, 1)
    red = build_reducer(cfg.comm, None, dp, 0, device="cpu")
    assert isinstance(red, LowPrecisionReducer)
    numels = {n: int(torch.Size(shape).numel()) for n, shape, _ in params.infos}
    grad_elements = 0
    for key, (names, pl) in enumerate(plan_layout(cfg, dp, params)):
        red.register_bucket(key, list(pl.offsets), [numels[n] for n in names], list(pl.bounds), "cpu")
        grad_elements += pl.buffer_numel
    return cfg, params, red, grad_elements


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
        elif hasattr(o, "__dataclass_fields__"):
            stack.extend((f"{path}.{k}", getattr(o, k)) for k in o.__dataclass_fields__)
    return found


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


CASES = [(p, opt, dp) for p in SCALED for opt in ("muon", "adamw") for dp in (2, 8)]


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{o}-dp{d}" for p, o, d in CASES])
def test_bookkeeping_after_registration_is_under_a_tenth_of_a_byte_per_element(case):
    preset, opt, dp = case
    cfg, _, red, grad_elements = _registered(preset, opt, dp)
    walked = _walk_tensors(red)
    residual_ptrs = {t.untyped_storage().data_ptr() for t in red.residuals.values()}
    # error feedback's residual is the algorithm's state: 4 bytes per element of each bucket, nothing else
    assert sum(_nbytes(t) for t in red.residuals.values()) == (4 * grad_elements if cfg.comm.error_feedback else 0)
    # the fixed Hadamard rotation: signs [b] and M, M^T [b, b] FP32, once per reducer whatever the buckets
    b = cfg.comm.hadamard_block
    fixed = (4 * b + 2 * 4 * b * b) if cfg.comm.transform == "hadamard" else 0
    transform_ptrs = {
        t.untyped_storage().data_ptr() for t in vars(red.transform).values() if isinstance(t, torch.Tensor)
    }
    assert sum(_nbytes(walked[p][1]) for p in transform_ptrs) == fixed
    rest = {p: v for p, v in walked.items() if p not in residual_ptrs and p not in transform_ptrs}
    rest_bytes = sum(_nbytes(t) for _, t in rest.values())
    per_element = rest_bytes / grad_elements
    assert per_element <= LIMIT, (
        f"{preset} at DP={dp}: {per_element:.4f} bytes per gradient element kept after registration: "
        + ", ".join(f"{path} {_nbytes(t)} B" for path, t in sorted(rest.values(), key=lambda v: -_nbytes(v[1]))[:5])
    )
    # the reducer's own listing names every tensor the walk found, and the plan report counts the layouts' bytes
    listed = {t.untyped_storage().data_ptr() for t in red.persistent_tensors().values()}
    assert listed == set(walked), sorted(path for p, (path, _) in walked.items() if p not in listed)
    assert red.index_table_bytes() == rest_bytes
    figs = plan_figures(cfg, dp)
    assert figs["codec_table_bytes_per_rank"] == rest_bytes
    assert figs["rank0"]["bytes"]["codec_tables"] == rest_bytes


# ---------------------------------------------------------------------------------------- the derived block maps
def _max_nan(a: float, b: float) -> float:
    """max(a, b) where a NaN on either side wins."""
    return a if a != a else b if b != b else max(a, b)


def _reference(offsets, extents, bounds, scaling, block, granule):
    """Plain-Python maps of every block: (scale group, range, segment index within the range), num_groups, K."""
    g = block if scaling == "block" else granule
    n_params = len(offsets)
    pad = bounds[-1] // block if scaling == "block" else n_params
    blocks = []
    k_max = 1
    for r in range(len(bounds) - 1):
        seg, prev = -1, None
        for s in range(bounds[r], bounds[r + 1], g):
            if scaling == "block":
                grp = s // block
            else:
                grp = next((i for i in range(n_params) if offsets[i] <= s < offsets[i] + extents[i]), pad)
            if grp != prev or scaling == "block":
                seg, prev = seg + 1, grp
            blocks.append((grp, r, seg))
        k_max = max(k_max, seg + 1)
    return blocks, pad + 1, k_max


LAYOUTS = [
    # (offsets, extents, bounds, scaling, block size, granule)
    ([0, 48, 96, 304], [48, 48, 208, 16], [0, 96, 192, 320], "tensor", 128, 16),  # even, a parameter split
    ([0, 64, 160], [64, 96, 32], [0, 160, 192, 256], "tensor", 128, 16),  # uneven, tail padding
    ([0, 16], [16, 16], [0, 32, 32, 64], "tensor", 128, 16),  # an empty range
    ([0], [1024], [0, 512, 1024], "block", 128, 16),  # even block scaling
    ([0], [896], [0, 512, 768, 896, 896], "block", 128, 16),  # uneven, an empty range
]


@pytest.mark.parametrize("cat_runs", [64, 0], ids=["cat", "repeat_interleave"])
@pytest.mark.parametrize("spec", LAYOUTS, ids=[f"{s[3]}-{i}" for i, s in enumerate(LAYOUTS)])
def test_derived_block_maps_equal_a_plain_reference(spec, cat_runs, monkeypatch):
    import megatron_geo.comm.scale_layout as sl

    monkeypatch.setattr(sl, "CAT_RUNS", cat_runs)  # both ways of expanding segment values over their blocks
    offsets, extents, bounds, scaling, block, granule = spec
    dp = len(bounds) - 1
    lay = build_scale_layout(offsets, extents, bounds, dp, scaling, block, "cpu", granule=granule)
    blocks, num_groups, k = _reference(offsets, extents, bounds, scaling, block, granule)
    assert (lay.num_groups, lay.K, lay.num_blocks) == (num_groups, k, len(blocks))
    gen = torch.Generator().manual_seed(0)
    bamax = torch.rand(len(blocks), generator=gen) + 0.5
    if len(blocks) > 2:
        bamax[1] = float("nan")
    # group amax: max with 0 over each group's blocks, NaN propagating
    want = [0.0] * num_groups
    for (grp, _, _), v in zip(blocks, bamax.tolist()):
        want[grp] = _max_nan(want[grp], v)
    torch.testing.assert_close(lay.group_amax(bamax), torch.tensor(want), equal_nan=True, rtol=0, atol=0)
    # segment values: group value of each segment of each range, 1 for padded segments
    gv = torch.arange(num_groups, dtype=torch.float32) + 10
    seg_want = torch.ones(dp, k)
    for grp, r, s in blocks:
        seg_want[r, s] = gv[grp]
    seg = lay.segment_values(gv)
    assert torch.equal(seg, seg_want)
    # block values of the whole buffer and of one range; segment amax of one range
    sv = torch.rand(dp, k, generator=gen)
    assert torch.equal(lay.block_values(sv), torch.tensor([sv[r, s].item() for _, r, s in blocks]))
    for r in range(dp):
        mine = [(i, s) for i, (_, rr, s) in enumerate(blocks) if rr == r]
        got = lay.row_block_values(sv[r], r)  # the segments of range r
        assert torch.equal(got, torch.tensor([sv[r, s].item() for _, s in mine]).reshape(-1))
        two = torch.stack([sv[r], sv[r] * 2])  # [sources, K], as decode_own's scales
        assert torch.equal(lay.row_block_values(two, r), torch.stack([got, got * 2]))
        seg_amax = [0.0] * k
        for i, s in mine:
            v = bamax[i].item()
            seg_amax[s] = _max_nan(seg_amax[s], v)
        row = bamax[[i for i, _ in mine]] if mine else bamax[:0]
        torch.testing.assert_close(lay.row_segment_amax(row, r), torch.tensor(seg_amax), equal_nan=True, rtol=0, atol=0)
    # what is kept: an int64 (groups) and an int32 (blocks per segment) [dp, K] table with tensor scaling, nothing
    # with block scaling
    assert lay.table_bytes() == ((8 + 4) * dp * k if scaling == "tensor" else 0)
