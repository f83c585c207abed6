"""Codecs (FP8, NVFP4) and the block Hadamard rotation against independent FP64 brute-force references.

References enumerate every representable value of a format (all 256 FP8 bit patterns, the 16 E2M1
codes) and pick the nearest in FP64, ties to the even code; the Hadamard reference is an explicit
Sylvester matrix product in FP64.
"""

import math

import pytest
import torch

from megatron_geo.comm.codecs import (
    NVFP4_BLOCK,
    fp8_decode,
    fp8_encode,
    fp8_max,
    fp8_scale_from_amax,
    nvfp4_decode,
    nvfp4_encode,
    nvfp4_global_scale,
)
from megatron_geo.comm.formats import comm_view, get_format
from megatron_geo.comm.hadamard import block_hadamard, block_hadamard_inverse, hadamard_signs

FMTS = ["fp8_e4m3", "fp8_e5m2"]
_DT = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}  # OCP OFP8 spec, table 1
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# -- FP64 references ---------------------------------------------------------------------------------
def _fp8_table(fmt):
    """(values FP64, codes) of every finite FP8 bit pattern."""
    codes = torch.arange(256, dtype=torch.uint8)
    v = codes.view(_DT[fmt]).double()
    keep = torch.isfinite(v)
    return v[keep], codes[keep].long()


def _e2m1_table():
    codes = torch.arange(16)
    mag = torch.tensor(_E2M1, dtype=torch.float64)[codes & 7]
    return torch.where(codes >= 8, -mag, mag), codes


def _nearest(v, table, codes, chunk=4096):
    """Nearest table value to each of v (FP64, 1-D), ties to the even code (mantissa LSB 0)."""
    out = torch.empty_like(v)
    weight = 2.0 - (codes % 2).double()  # among equally near candidates, even codes win
    for i in range(0, v.numel(), chunk):
        d = (v[i : i + chunk, None] - table[None, :]).abs()
        cand = d == d.min(dim=1, keepdim=True).values
        out[i : i + chunk] = table[(cand.double() * weight).argmax(dim=1)]
    return out


def _fp8_ref(x, fmt, scale=1.0):
    """Nearest-even FP8 of x / scale with saturation, times scale, in FP64 (NaN stays NaN)."""
    m = _MAX[fmt]
    y = (x.double() / scale).clamp(-m, m).flatten()
    table, codes = _fp8_table(fmt)
    out = torch.full_like(y, math.nan)
    ok = ~torch.isnan(y)
    out[ok] = _nearest(y[ok], table, codes)
    return out.view(x.shape) * scale


def _nvfp4_ref(x, g):
    """The two-level NVFP4 scheme in FP64: E4M3 block scale (nearest-even, saturating, min 2**-9
    for non-zero blocks), E2M1 elements (nearest-even, clamped to 6). Returns FP64 [nblk, 16]."""
    x = x.double()
    g = torch.as_tensor(g, dtype=torch.float64).expand(x.shape[0], 1)
    bamax = x.abs().amax(dim=1, keepdim=True)
    e4_table, e4_codes = _fp8_table("fp8_e4m3")
    s = _nearest((bamax / (6 * g)).clamp(max=448.0).flatten(), e4_table, e4_codes).view(-1, 1)
    s = torch.where((s == 0) & (bamax > 0), 2.0**-9, s)
    denom = s * g
    y = (x / torch.where(denom == 0, 1.0, denom)).clamp(-6, 6)
    e2_table, e2_codes = _e2m1_table()
    q = _nearest(y.flatten(), e2_table, e2_codes).view(y.shape)
    return q * s * g


def _fp8_sweep(fmt):
    """Every grid value, midpoints (ties), points just off the midpoints, quarter points, values
    beyond max, +-0, and log-uniform randoms across the whole range including subnormals."""
    table, _ = _fp8_table(fmt)
    pos = torch.unique(table[table >= 0]).float()  # sorted, exactly representable in FP32
    lo, hi = pos[:-1], pos[1:]
    mid = (lo + hi) / 2  # exact in FP32 (one more mantissa bit)
    parts = [pos, mid, torch.nextafter(mid, hi), torch.nextafter(mid, lo), lo + (hi - lo) / 4, lo + 3 * (hi - lo) / 4]
    m = _MAX[fmt]
    parts.append(torch.tensor([m * 1.0001, m * 1.03, m * 1.5, m * 4, 1e30, 3e38, 0.0]))
    g = torch.Generator().manual_seed(0)
    tiny = float(pos[1])
    parts.append(torch.exp(torch.empty(5000).uniform_(math.log(tiny / 8), math.log(m * 2), generator=g)))
    v = torch.cat(parts)
    return torch.cat([v, -v])


# -- FP8 ------------------------------------------------------------------------------------------
def test_fp8_max_and_unknown_format():
    assert fp8_max("fp8_e4m3") == 448.0 and fp8_max("fp8_e5m2") == 57344.0
    with pytest.raises(ValueError):
        fp8_max("fp8_e3m4")
    with pytest.raises(ValueError):
        fp8_encode(torch.zeros(2), torch.tensor(1.0), "fp8_e4m3", rounding="up")
    with pytest.raises(TypeError):
        fp8_encode(torch.zeros(2, dtype=torch.bfloat16), torch.tensor(1.0), "fp8_e4m3")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 2.0**5])
def test_fp8_nearest_matches_fp64_bruteforce(fmt, scale):
    x = _fp8_sweep(fmt) * scale  # power-of-two scale: x / scale is exact
    s = torch.tensor(scale)
    codes = fp8_encode(x, s, fmt)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    out = fp8_decode(codes, s, fmt)
    assert out.dtype == torch.float32
    ref = _fp8_ref(x, fmt, scale)
    bad = (out.double() != ref).nonzero().flatten()
    assert bad.numel() == 0, f"x={x[bad[:5]].tolist()} got={out[bad[:5]].tolist()} ref={ref[bad[:5]].tolist()}"
    assert out.abs().max().item() == _MAX[fmt] * scale  # saturation, never inf/NaN


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_per_block_scale_broadcast_and_error_bound(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-6, 6, 64).unsqueeze(1)
    scale = fp8_scale_from_amax(x.abs().amax(dim=1, keepdim=True), fmt)
    assert scale.shape == (64, 1) and scale.dtype == torch.float32
    out = fp8_decode(fp8_encode(x, scale, fmt), scale, fmt)
    ref = _fp8_ref(x, fmt, scale.double())
    # the reference divides in FP64, the codec in FP32: allow a differing rounding only at a rare tie;
    # code * scale is a single FP32 rounding of the exact product, so compare with ref rounded to FP32
    assert (out != ref.float()).float().mean() < 1e-3
    # relative error of normal-range values: half an ulp = 2**-(mantissa bits + 1), plus FP32 slack
    mbits = 3 if fmt == "fp8_e4m3" else 2
    normal = x.abs() / scale >= 2.0 ** (-6 if fmt == "fp8_e4m3" else -14)
    rel = ((out - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(mbits + 1) * (1 + 1e-5)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fp8_nan_zero_and_saturation(fmt, rounding):
    gen = torch.Generator().manual_seed(3)
    s = torch.tensor(1.0)
    x = torch.tensor([1.0, math.nan, -2.0, -math.nan, 1e9, -1e9, math.inf, -math.inf, 0.0, -0.0])
    out = fp8_decode(fp8_encode(x, s, fmt, rounding, gen), s, fmt)
    m = _MAX[fmt]
    assert torch.isnan(out[[1, 3]]).all()
    assert out[[0, 2, 4, 5, 6, 7, 8, 9]].tolist() == [1.0, -2.0, m, -m, m, -m, 0.0, 0.0]
    z = torch.zeros(1000)
    zs = fp8_scale_from_amax(z.abs().amax(), fmt)
    outz = fp8_decode(fp8_encode(z, zs, fmt, rounding, gen), zs, fmt)
    assert torch.equal(outz, z) and not torch.isnan(outz).any()


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_scale_from_amax(fmt):
    m = _MAX[fmt]
    amax = torch.tensor([0.0, m, 2 * m, math.inf, math.nan, -math.inf])
    s = fp8_scale_from_amax(amax, fmt)
    assert s.dtype == torch.float32
    assert s[:3].tolist() == [1.0, 1.0, 2.0]
    assert torch.isnan(s[3:]).all()
    # a NaN scale (non-finite tensor) makes the decoded tensor NaN, not a saturated finite value
    x = torch.tensor([1.0, math.inf, 3.0])
    sc = fp8_scale_from_amax(x.abs().amax(), fmt)
    for rounding in ("nearest", "stochastic"):
        assert torch.isnan(fp8_decode(fp8_encode(x, sc, fmt, rounding), sc, fmt)).all()
    # a positive amax that underflows amax / max never gives scale 0 (which would produce NaN)
    x = torch.tensor([0.0, 1e-45, -1e-45])
    sc = fp8_scale_from_amax(x.abs().amax(), fmt)
    assert sc.item() > 0
    assert torch.isfinite(fp8_decode(fp8_encode(x, sc, fmt), sc, fmt)).all()


def _neighbours(y, fmt):
    table, _ = _fp8_table(fmt)
    t = torch.unique(table)
    yd = y.double()
    lo = torch.stack([t[t <= v].max() for v in yd])
    hi = torch.stack([t[t >= v].min() for v in yd])
    return lo, hi


_SR_POINTS = {
    "fp8_e4m3": [0.3, 1.1, -5.3, 300.0, 440.0, 2.0**-9 * 1.3, -(2.0**-9) * 6.75, 2.0**-10],
    "fp8_e5m2": [0.3, 1.1, -5.3, 50000.0, 2.0**-16 * 1.3, -(2.0**-16) * 2.75, 2.0**-17],
}


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_stochastic_unbiased_two_neighbours(fmt):
    n = 100_000
    y = torch.tensor(_SR_POINTS[fmt], dtype=torch.float32)
    x = y.unsqueeze(1).expand(-1, n).contiguous()
    gen = torch.Generator().manual_seed(123)
    s = torch.tensor(1.0)
    out = fp8_decode(fp8_encode(x, s, fmt, "stochastic", gen), s, fmt).double()
    lo, hi = _neighbours(y, fmt)
    for i in range(len(y)):
        vals = set(torch.unique(out[i]).tolist())
        assert vals <= {lo[i].item(), hi[i].item()}, (y[i].item(), vals)
        p = (y[i].double() - lo[i]) / (hi[i] - lo[i])
        se = (hi[i] - lo[i]) * math.sqrt(p * (1 - p) / n)
        assert abs(out[i].mean() - y[i].double()) <= 5 * se + 1e-12, (y[i].item(), out[i].mean().item())


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_stochastic_exact_values_range_and_reproducible(fmt):
    table, _ = _fp8_table(fmt)
    exact = table.float().repeat(8)
    s = torch.tensor(1.0)
    gen = torch.Generator().manual_seed(5)
    assert torch.equal(fp8_decode(fp8_encode(exact, s, fmt, "stochastic", gen), s, fmt), exact)
    m = _MAX[fmt]
    x = torch.empty(50_000).uniform_(-1.2 * m, 1.2 * m, generator=gen)
    c1 = fp8_encode(x, s, fmt, "stochastic", torch.Generator().manual_seed(9))
    c2 = fp8_encode(x, s, fmt, "stochastic", torch.Generator().manual_seed(9))
    c3 = fp8_encode(x, s, fmt, "stochastic", torch.Generator().manual_seed(10))
    assert torch.equal(c1, c2) and not torch.equal(c1, c3)
    out = fp8_decode(c1, s, fmt)
    assert torch.isfinite(out).all() and out.abs().max() <= m
    # values beyond max saturate to exactly +-max
    big = x.abs() >= m
    assert torch.equal(out[big], torch.sign(x[big]) * m)


# -- NVFP4 ----------------------------------------------------------------------------------------
def test_nvfp4_packing_layout():
    # with global scale 1 and a block amax of 6, the block scale is exactly 1 and x is on the grid
    codes = [7, 9, 2, 11, 4, 5, 14, 0, 1, 15, 3, 2, 12, 13, 6, 8]  # sign bit 3 | magnitude index
    x = torch.tensor([[(-1.0 if c & 8 else 1.0) * _E2M1[c & 7] for c in codes]])
    packed, sc = nvfp4_encode(x, torch.tensor(1.0))
    assert packed.dtype == torch.uint8 and packed.shape == (1, 8)
    assert packed[0].tolist() == [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(8)]
    assert sc.tolist() == [0x38]  # E4M3 1.0 = 0 0111 000
    # hand-made bytes: 0x21 -> low nibble 1 (0.5) first, high nibble 2 (1.0) second; 0xF8 -> -0, -6
    out = nvfp4_decode(
        torch.tensor([[0x21, 0xF8, 0x00, 0x00, 0x00, 0x00, 0x00, 0x7A]], dtype=torch.uint8),
        torch.tensor([0x40], dtype=torch.uint8),
        torch.tensor(0.5),
    )  # 0x40 = 2.0
    assert out[0].tolist()[:4] == [0.5, 1.0, 0.0, -6.0]
    assert out[0].tolist()[-2:] == [-1.0, 6.0]  # 0x7A: low 0xA = -1.0, high 0x7 = 6.0 (x 2 x 0.5)


def test_nvfp4_handmade_ties_and_scale_edge_cases():
    one = torch.tensor(1.0)
    rows = torch.tensor(
        [
            # block scale exactly 1: every E2M1 tie (0.25, 0.75, ..., 5) goes to the even code
            [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.1],
            # amax/6 = 1.0625 is an E4M3 tie -> scale 1.0 (even), so 6.375 clamps to 6
            [6.375, 1.0, -2.0, 3.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4.6],
            # amax/6 = 2**-12 rounds to 0 in E4M3 -> smallest positive 2**-9 instead
            [6 * 2.0**-12, -3 * 2.0**-12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2.0**-12],
            # amax/6 = 1e4 saturates the block scale at 448; elements clamp to +-6
            [6e4, -3e4, 2e3, 1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0.0] * 16,
        ]
    )
    packed, sc = nvfp4_encode(rows, one)
    out = nvfp4_decode(packed, sc, one)
    ref = _nvfp4_ref(rows, 1.0)
    assert torch.equal(out.double(), ref)
    assert out[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert out[1, 0].item() == 6.0 and out[3, 0].item() == 448.0 * 6
    assert torch.equal(out[4], torch.zeros(16))


@pytest.mark.parametrize("rows_global", [False, True])
def test_nvfp4_matches_fp64_reference(rows_global):
    g = torch.Generator().manual_seed(2)
    nblk = 1024
    x = torch.randn(nblk, NVFP4_BLOCK, generator=g) * torch.exp(torch.randn(nblk, 1, generator=g) * 3)
    x[::7, 3] = 0.0
    if rows_global:  # rows belong to different "tensors" with their own global scales
        gs = nvfp4_global_scale(x.view(8, -1).abs().amax(dim=1)).repeat_interleave(nblk // 8).view(nblk, 1)
    else:
        gs = nvfp4_global_scale(x.abs().amax())
    packed, sc = nvfp4_encode(x, gs)
    assert packed.shape == (nblk, 8) and sc.shape == (nblk,) and sc.dtype == torch.uint8
    out = nvfp4_decode(packed, sc, gs)
    assert out.dtype == torch.float32 and out.shape == x.shape
    ref = _nvfp4_ref(x, gs.double())
    assert torch.equal(out.double(), ref.float().double())
    # power-of-two global scale: every step is exact in FP32, so results are bit-identical too
    gp = torch.tensor(2.0**-10)
    out = nvfp4_decode(*nvfp4_encode(x, gp), gp)
    assert torch.equal(out.double(), _nvfp4_ref(x, 2.0**-10))


def test_nvfp4_gaussian_error_bound():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8192, NVFP4_BLOCK, generator=g)
    gs = nvfp4_global_scale(x.abs().amax())
    out = nvfp4_decode(*nvfp4_encode(x, gs), gs)
    err = (out - x).abs()
    bamax = x.abs().amax(dim=1, keepdim=True)
    # per element: at most one unit (half the 4..6 gap) of size (amax/6)(1 + 2**-4) (E4M3 scale rounding)
    assert (err <= bamax / 6 * (1 + 2.0**-4) * (1 + 1e-6)).all()
    # aggregate relative error (empirical bound; measured 0.095 for this seed)
    assert torch.linalg.norm(err) / torch.linalg.norm(x) < 0.11


def test_nvfp4_stochastic_unbiased_and_reproducible():
    n = 20_000
    block = torch.tensor([6.0, 0.3, -0.6, 1.2, -1.7, 2.2, 2.9, -3.3, 4.5, -5.5, 0.1, 0.0, 5.9, 1.0, -0.01, 3.75])
    x = block.expand(n, -1).contiguous()
    one = torch.tensor(1.0)
    p1, s1 = nvfp4_encode(x, one, "stochastic", torch.Generator().manual_seed(7))
    p2, s2 = nvfp4_encode(x, one, "stochastic", torch.Generator().manual_seed(7))
    assert torch.equal(p1, p2) and torch.equal(s1, s2)
    out = nvfp4_decode(p1, s1, one).double()
    grid = torch.tensor(sorted({v * sgn for v in _E2M1 for sgn in (1, -1)}), dtype=torch.float64)
    for j, v in enumerate(block.double().tolist()):
        lo, hi = grid[grid <= v].max().item(), grid[grid >= v].min().item()
        assert set(torch.unique(out[:, j]).tolist()) <= {lo, hi}
        if lo == hi:
            assert (out[:, j] == v).all()
            continue
        p = (v - lo) / (hi - lo)
        se = (hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(out[:, j].mean().item() - v) <= 5 * se


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nvfp4_nan_inf_and_zero(rounding):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, NVFP4_BLOCK, generator=gen)
    x[1, 5] = math.nan
    x[2, 0] = math.inf
    out = nvfp4_decode(*nvfp4_encode(x, torch.tensor(0.01), rounding, gen), torch.tensor(0.01))
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    assert torch.isfinite(out[[0, 3]]).all()
    # the global scale of a non-finite tensor is NaN and the whole tensor decodes to NaN
    gs = nvfp4_global_scale(x.abs().amax())
    assert torch.isnan(gs)
    assert torch.isnan(nvfp4_decode(*nvfp4_encode(x, gs, rounding, gen), gs)).all()
    z = torch.zeros(3, NVFP4_BLOCK)
    gz = nvfp4_global_scale(z.abs().amax())
    assert gz.item() == 1.0
    outz = nvfp4_decode(*nvfp4_encode(z, gz, rounding, gen), gz)
    assert torch.equal(outz, z)


def test_nvfp4_global_scale_and_shape_errors():
    assert nvfp4_global_scale(torch.tensor(448.0 * 6)).item() == 1.0
    assert torch.isnan(nvfp4_global_scale(torch.tensor([math.nan, math.inf]))).all()
    with pytest.raises(ValueError):
        nvfp4_encode(torch.zeros(2, 8), torch.tensor(1.0))
    with pytest.raises(ValueError):
        nvfp4_encode(torch.zeros(3, 16), torch.ones(3))  # [nblk] does not broadcast to [nblk, 1]
    with pytest.raises(ValueError):
        nvfp4_decode(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8), torch.tensor(1.0))


def test_bytes_per_element_comes_from_the_registry_entries():
    for dtype, settings, want in (
        ("fp32", {}, 4.0),
        ("bf16", {}, 2.0),
        ("fp8_e4m3", {}, 1.0),
        ("fp8_e5m2", {"scaling": "block", "block_size": 128}, 1.0 + 4 / 128),
        ("nvfp4", {}, 0.5 + 1 / 16),
    ):
        assert get_format(dtype).bytes_per_element(comm_view(dtype=dtype, **settings)) == want
    with pytest.raises(ValueError, match="choose one of fp32, bf16, fp8_e4m3, fp8_e5m2, nvfp4"):
        get_format("int8")


# -- Hadamard -------------------------------------------------------------------------------------
def _sylvester(b):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_signs():
    s = hadamard_signs(64, 11)
    assert s.dtype == torch.float32 and s.shape == (64,)
    assert set(s.tolist()) == {1.0, -1.0}
    assert torch.equal(s, hadamard_signs(64, 11)) and not torch.equal(s, hadamard_signs(64, 12))


@pytest.mark.parametrize("b", [1, 2, 4, 16, 128, 256])
def test_block_hadamard_matches_matrix_and_inverts(b):
    g = torch.Generator().manual_seed(b)
    x = torch.randn(37, b, generator=g)
    signs = hadamard_signs(b, 3)
    y = block_hadamard(x, signs)
    assert y.shape == x.shape and y.dtype == torch.float32
    ref = (x.double() * signs.double()) @ _sylvester(b).T / math.sqrt(b)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(block_hadamard_inverse(y, signs), x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.linalg.norm(y, dim=1), torch.linalg.norm(x, dim=1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("b", [3, 12, 24])
def test_block_hadamard_rejects_non_power_of_two(b):
    with pytest.raises(ValueError, match=f"b={b}"):
        block_hadamard(torch.zeros(2, b), torch.ones(b))
    with pytest.raises(ValueError, match=f"b={b}"):
        block_hadamard_inverse(torch.zeros(2, b), torch.ones(b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_nearest():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(512, NVFP4_BLOCK, generator=g) * 10
    for fmt in FMTS:
        s = fp8_scale_from_amax(x.abs().amax(dim=1, keepdim=True), fmt)
        c_cpu = fp8_encode(x, s, fmt)
        c_gpu = fp8_encode(x.cuda(), s.cuda(), fmt)
        assert torch.equal(c_cpu, c_gpu.cpu())
        gen = torch.Generator(device="cuda").manual_seed(1)
        out = fp8_decode(fp8_encode(x.cuda(), s.cuda(), fmt, "stochastic", gen), s.cuda(), fmt)
        assert ((out.cpu() - x).abs() <= s * 2**5).all()
    gs = nvfp4_global_scale(x.abs().amax())
    p, sc = nvfp4_encode(x, gs)
    pg, scg = nvfp4_encode(x.cuda(), gs.cuda())
    assert torch.equal(p, pg.cpu()) and torch.equal(sc, scg.cpu())
    assert torch.equal(nvfp4_decode(p, sc, gs), nvfp4_decode(pg, scg, gs.cuda()).cpu())
    signs = hadamard_signs(64, 0)
    xh = torch.randn(8, 64, generator=g)
    torch.testing.assert_close(block_hadamard(xh.cuda(), signs.cuda()).cpu(), block_hadamard(xh, signs))
