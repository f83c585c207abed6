"""``comm.compile``: each codec's encode and decode compiles to one graph (``fullgraph=True``: a graph break is
an error) and gives codes and values bitwise equal to eager; the reducer with ``comm.compile=true`` reduces
bitwise like the eager one (DP = 2, gloo, tensor- and block-scaled FP8, error feedback, shared scales,
Hadamard, NVFP4).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _inductor_vector_width_of_the_host():
    """Compile the codec graphs for the host's widest vector unit, as a training run does.

    tests/cpu_pin.py pins ATen's CPU kernels to AVX2 for the recorded wire bytes (``ATEN_CPU_CAPABILITY``), and
    Inductor's C++ backend reads the same variable while ``cpp.simdlen`` is unset: it then writes AVX2 code and
    compiles it with ``-march=native``, which on an AVX-512 host (torch 2.13) inverts int32 selects (``where(m >= c,
    a, b)`` returns b where the mask holds), and its FX graph cache key leaves the vector width out, so processes of
    either width would load each other's code. An explicit ``cpp.simdlen`` (part of the key) avoids both."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    widths = [isa.bit_width() for isa in valid_vec_isa_list()]
    with config.patch({"cpp.simdlen": max(widths)} if widths else {}):
        yield


def _inputs(nb: int, granule: int, seed: int) -> torch.Tensor:
    """float32 ``[nb, granule]``: normal values over 12 decades, exact zeros, one all-zero row, NaN and inf rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nb, granule, generator=g) * torch.logspace(-6, 6, nb).unsqueeze(1)
    x[3] = 0.0
    x[5, 1] = float("nan")
    x[7, 0] = float("inf")
    x[9, 2] = 0.0
    return x


def _scales(x: torch.Tensor, fmax: float) -> torch.Tensor:
    from megatron_geo.comm.codecs import _scale_from_amax

    return _scale_from_amax(x.abs().amax(1), fmax)


def _fresh():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    return counters


def _same_fp8_codes(a: torch.Tensor, b: torch.Tensor, dt) -> bool:
    """Bitwise equal, except that a NaN code may differ in its sign bit (x / NaN takes the sign of x in one
    backend and not in the other; both decode to NaN)."""
    na, nb = a.view(dt).float().isnan(), b.view(dt).float().isnan()
    return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])


def _compiled_graphs(counters) -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_wire_functions_compile_to_one_graph_each_and_match_eager_bitwise(fmt):
    from megatron_geo.comm import wire_fp8 as W
    from megatron_geo.comm.codecs import dp_divisor

    counters = _fresh()
    fmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[fmt]
    for granule, nb in ((16, 64), (128, 40)):  # the second shape reuses the dynamic-shape graphs
        x = _inputs(nb, granule, 0)
        s = _scales(x, fmax)
        eager, comp = W.FP8Wire(fmt, "nearest", None, False), W.FP8Wire(fmt, "nearest", None, True)
        a_e, a_c = eager.amax(x), comp.amax(x)
        assert torch.equal(a_c.nan_to_num(), a_e.nan_to_num()) and torch.equal(a_c.isnan(), a_e.isnan())
        dt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
        codes = eager.encode(x, s)
        assert codes.dtype == torch.uint8 and _same_fp8_codes(comp.encode(x, s), codes, dt)
        r_e, r_c = torch.empty_like(x), torch.empty_like(x)
        assert _same_fp8_codes(comp.encode_ef(x, s, r_c), eager.encode_ef(x, s, r_e), dt)
        assert torch.equal(r_c.nan_to_num(), r_e.nan_to_num()) and torch.equal(r_c.isnan(), r_e.isnan())
        recv = torch.stack([codes, eager.encode(x * 0.5, s)])
        s2 = torch.stack([s, s])
        # the compiled decode writes into a range of a larger buffer (the bucket), as the reducer calls it
        big = torch.full((3 * nb * granule,), 7.0)
        two = dp_divisor(2, "cpu")
        d_e = eager.decode_sum(recv, s2, torch.empty(nb * granule), two)
        d_c = comp.decode_sum(recv, s2, big[nb * granule : 2 * nb * granule], two)
        assert d_c.data_ptr() == big[nb * granule :].data_ptr()
        assert (big[: nb * granule] == 7).all() and (big[2 * nb * granule :] == 7).all()
        assert torch.equal(d_c.nan_to_num(), d_e.nan_to_num()) and torch.equal(d_c.isnan(), d_e.isnan())
        # reference: torch's FP8 upcast times the scale per source, added in FP32 in source order, halved
        ref = (
            ((recv[0].view(dt).float() * s.unsqueeze(1)) + (recv[1].view(dt).float() * s.unsqueeze(1))).div(2).view(-1)
        )
        assert torch.equal(d_e.nan_to_num(), ref.nan_to_num())
        # the codes are torch's own casts of x / scale (independent reference)
        want = (x / s.unsqueeze(1)).clamp(-fmax, fmax).to(dt).view(torch.uint8)
        assert _same_fp8_codes(codes, want, dt)
    assert _compiled_graphs(counters) >= 4 and not counters["graph_break"], "amax, encode, encode_ef, decode_sum"


def test_nvfp4_wire_functions_compile_to_one_graph_each_and_match_eager_bitwise():
    from megatron_geo.comm import wire_nvfp4 as W
    from megatron_geo.comm.codecs import dp_divisor, nvfp4_decode, nvfp4_encode, nvfp4_global_scale

    counters = _fresh()
    eager, comp = W.NVFP4Wire("nearest", None, False), W.NVFP4Wire("nearest", None, True)
    for nb in (96, 48):
        x = _inputs(nb, 16, 1)
        g = nvfp4_global_scale(x.abs().amax(1)) * torch.linspace(0.5, 1, nb)  # per-block global scales
        bamax = eager.amax(x)
        assert torch.equal(comp.amax(x).nan_to_num(), bamax.nan_to_num())
        p_e, b_e = eager._encode(x, bamax, g, None)
        p_c, b_c = comp._encode(x, bamax, g, None)
        p_ref, b_ref = nvfp4_encode(x, g.unsqueeze(1))  # the reference codec, one call
        assert torch.equal(p_c, p_e) and torch.equal(b_c, b_e)
        assert torch.equal(p_e, p_ref) and torch.equal(b_e, b_ref)
        r_e, r_c = torch.empty_like(x), torch.empty_like(x)
        comp._encode(x, bamax, g, r_c)
        eager._encode(x, bamax, g, r_e)
        want = x - nvfp4_decode(p_ref, b_ref, g.unsqueeze(1))
        assert torch.equal(r_c.nan_to_num(), r_e.nan_to_num()) and torch.equal(r_e.nan_to_num(), want.nan_to_num())
        pk, bk, gk = torch.stack([p_e, p_e.flip(0)]), torch.stack([b_e, b_e.flip(0)]), torch.stack([g, g.flip(0)])
        two = dp_divisor(2, "cpu")
        d_e = eager.sum_sources(eager.unpack(pk).view(2, nb, 16), bk, gk, torch.empty(nb * 16), two)
        d_c = comp.sum_sources(comp.unpack(pk).view(2, nb, 16), bk, gk, torch.empty(nb * 16), two)
        ref = (nvfp4_decode(pk[0], bk[0], gk[0].unsqueeze(1)) + nvfp4_decode(pk[1], bk[1], gk[1].unsqueeze(1))) / 2
        # the one-graph form GPUs use (unpacking inside the sum), the same values
        for w in (eager, comp):
            d_p = w.sum_packed(pk, bk, gk, torch.empty(nb * 16), two)
            assert torch.equal(d_p.nan_to_num(), ref.view(-1).nan_to_num()) and torch.equal(
                d_p.isnan(), ref.view(-1).isnan()
            )
        assert torch.equal(d_c.nan_to_num(), d_e.nan_to_num()) and torch.equal(d_c.isnan(), d_e.isnan())
        assert torch.equal(d_e.nan_to_num(), ref.view(-1).nan_to_num()) and torch.equal(
            d_e.isnan(), ref.view(-1).isnan()
        )
    assert _compiled_graphs(counters) >= 5 and not counters["graph_break"]


def test_nibble_packing_matches_the_pair_layout_for_every_code_pair():
    """``pack_nibbles`` (an int64 view, little-endian) puts element 2i in the low nibble and 2i+1 in the high one,
    like the plain pair formula, eagerly and compiled; ``unpack_nibbles`` inverts it for all 256 bytes."""
    from megatron_geo.comm.codecs import pack_nibbles, unpack_nibbles
    from megatron_geo.comm.compiled import maybe_compile

    _fresh()
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack((lo.reshape(-1), hi.reshape(-1)), dim=1).reshape(-1, 16).to(torch.uint8)  # [32, 16]
    want = (codes[:, 0::2].int() | (codes[:, 1::2].int() << 4)).to(torch.uint8)  # [32, 8]
    assert torch.equal(pack_nibbles(codes), want)
    assert torch.equal(maybe_compile(pack_nibbles, True)(codes), want)
    assert torch.equal(want.view(-1).sort().values, torch.arange(256, dtype=torch.uint8))  # every byte
    assert torch.equal(unpack_nibbles(want), codes)
    assert torch.equal(maybe_compile(unpack_nibbles, True)(want), codes)


def test_comm_compile_setting():
    from megatron_geo.comm.compiled import resolve_compile
    from megatron_geo.config import ConfigError, load_config
    from megatron_geo.training.validate import validate_config

    assert resolve_compile("auto", "cpu") is False and resolve_compile("auto", "cuda") is True
    assert resolve_compile("true", "cpu") is True and resolve_compile(False, "cuda") is False
    with pytest.raises(ValueError, match="comm.compile='maybe'"):
        resolve_compile("maybe", "cpu")
    assert load_config([str(ROOT / "configs/comm/fp8.yaml")], ["comm.compile=on"]).comm.compile == "true"
    with pytest.raises(ConfigError, match="comm.compile"):
        validate_config(load_config([str(ROOT / "configs/comm/fp8.yaml")], ["comm.compile=maybe"]), 1)


PRESETS = ["fp8", "fp8_block", "fp8_ef", "fp8_shared_scale", "fp8_hadamard", "nvfp4"]
NUMELS = [3000, 37, 1, 0, 2500, 130, 16, 700]


def _eager_vs_compiled(rank, world):
    from helpers import pctx_for
    from megatron_geo.comm import build_reducer
    from megatron_geo.config import load_config
    from megatron_geo.distributed.shard_plan import plan_shards

    pctx = pctx_for(1)
    out = {}
    for preset in PRESETS:
        comm = load_config([str(ROOT / "configs/comm" / f"{preset}.yaml")]).comm
        res = {}
        for mode in ("false", "true"):
            red = build_reducer(dataclasses.replace(comm, compile=mode), pctx, seed=1)
            plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
            red.register_bucket(0, plan.offsets, NUMELS, plan.chunk, "cpu")
            g = torch.Generator().manual_seed(rank)
            steps = []
            for step in range(2):  # two steps: the error-feedback residual feeds the second
                buf = torch.randn(plan.buffer_numel, generator=g) * (10.0 ** (rank * 3))
                (red.reduce_scatter if step == 0 else red.all_reduce)(buf, 0).wait()
                steps.append(buf[: plan.chunk].clone() if step == 0 else buf.clone())
            res[mode] = steps
        out[preset] = res
    return out


def test_reducer_with_comm_compile_reduces_bitwise_like_eager():
    ranks = run_distributed(_eager_vs_compiled, 2)
    for r, out in enumerate(ranks):
        for preset in PRESETS:
            for e, c in zip(out[preset]["false"], out[preset]["true"]):
                assert torch.equal(e, c), (preset, r, (e - c).abs().max())


def test_compiled_nvfp4_decode_equals_the_table_for_every_byte():
    """The compiled decode computes E2M1 values arithmetically; every byte (both nibbles, -0.0 included) must
    give the eager table's value and sign."""
    from megatron_geo.comm.codecs import _e2m1_values, nvfp4_decode
    from megatron_geo.comm.compiled import maybe_compile

    codes = torch.arange(16, dtype=torch.int32)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    want = torch.cat([grid, -grid])  # OCP E2M1: sign bit 3, magnitude bits 0-2
    got = _e2m1_values(codes)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    _fresh()
    packed = torch.arange(256, dtype=torch.uint8).view(-1, 8)
    bscale = torch.tensor([0x38, 0x01, 0x7E, 0x40] * 8, dtype=torch.uint8)
    g = torch.full((32, 1), 0.37)
    e, c = nvfp4_decode(packed, bscale, g), maybe_compile(nvfp4_decode, True)(packed, bscale, g)
    assert torch.equal(c, e) and torch.equal(c.signbit(), e.signbit())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_values_from_integer_arithmetic_equal_torchs_casts_for_every_code(fmt):
    """What compiled graphs decode with (``fp8_values``) against torch's own FP8 upcast, all 256 codes, eagerly
    and compiled: equal values, the same NaNs and infinities, the sign of zero kept."""
    from megatron_geo.comm.codecs import FP8_FORMATS, fp8_values
    from megatron_geo.comm.compiled import maybe_compile

    _fresh()
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(FP8_FORMATS[fmt]).float()
    for got in (fp8_values(codes, fmt), maybe_compile(fp8_values, True)(codes, fmt)):
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]) and torch.equal(got[ok].signbit(), want[ok].signbit())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_from_integer_arithmetic_equal_torchs_casts_on_every_rounding_boundary(fmt):
    """What compiled graphs encode with (``fp8_codes``) against torch's own FP8 cast: every grid point, every
    midpoint between neighbours (the ties) and the FP32 values just either side of both, random values in the
    normal and subnormal range, zeros, NaNs and the range ends, eagerly and compiled."""
    from megatron_geo.comm.codecs import FP8_FORMATS, fp8_codes, fp8_max
    from megatron_geo.comm.compiled import maybe_compile

    _fresh()
    dt, m = FP8_FORMATS[fmt], fp8_max(fmt)
    grid = torch.arange(256, dtype=torch.uint8).view(dt).float()
    grid = grid[grid.isfinite()].unique()
    pts = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    g = torch.Generator().manual_seed(0)
    y = torch.cat(
        [
            pts,
            torch.nextafter(pts, torch.tensor(float("inf"))),
            torch.nextafter(pts, torch.tensor(-float("inf"))),
            torch.randn(20000, generator=g) * m / 4,
            torch.rand(20000, generator=g) * 2.0**-5,
            torch.tensor([0.0, -0.0, float("nan"), -float("nan"), m, -m, 1e-45, -1e-45]),
        ]
    ).clamp(-m, m)
    want = y.to(dt).view(torch.uint8)
    assert torch.equal(fp8_codes(y, fmt), want)
    assert torch.equal(maybe_compile(fp8_codes, True)(y, fmt), want)


# -- eager numerics on every backend -------------------------------------------------------------------------------


def test_every_codec_graph_is_compiled_with_the_eager_numerics_options(monkeypatch):
    """Each codec graph reaches ``torch.compile`` with ``fullgraph=True`` and Inductor's eager-numerics options
    (IEEE FP32 division, no FMA contraction): what keeps CUDA codes equal to eager at rounding boundaries."""
    from megatron_geo.comm import compiled, wire_fp8, wire_nvfp4

    calls = []

    def recording_compile(fn, **kw):
        calls.append((fn.__name__, kw))
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    wire_fp8.FP8Wire("fp8_e4m3", "nearest", None, True)
    wire_nvfp4.NVFP4Wire("nearest", None, True)
    names = {n for n, _ in calls}
    assert {"block_amax", "encode", "encode_ef", "decode", "decode_sum"} <= names
    assert {"nvfp4_block_scales", "unpack_nibbles", "_sum_sources", "_sum_packed", "_decode"} <= names
    known = torch._inductor.config.get_config_copy()
    for name, kw in calls:
        opts = kw.get("options") or {}
        assert kw.get("fullgraph") is True and opts.get("emulate_precision_casts") is True, (name, kw)
        assert opts.get("eager_numerics.division_rounding", opts.get("emulate_divison_rounding")) is True, (name, kw)
        assert all(k in known for k in opts), (name, opts)
        assert opts == compiled.eager_numerics_options()
    # no codec module compiles around maybe_compile
    for path in (ROOT / "megatron_geo" / "comm").glob("*.py"):
        if path.name != "compiled.py":
            assert "torch.compile(" not in path.read_text(), path


def test_eager_numerics_options_keep_only_what_the_running_torch_knows(monkeypatch):
    """An older torch (the division switch under its old spelling, no ``eager_numerics`` section, a bool where
    newer torch has a string): the unknown names and mismatched types are left out, so torch.compile accepts
    the options (the compiled-equals-eager tests above compile with the running torch's own options)."""
    import types

    import torch._inductor as inductor

    from megatron_geo.comm import compiled as CM

    current = torch._inductor.config.get_config_copy()
    old = {k: v for k, v in current.items() if not k.startswith("eager_numerics.")}
    old["emulate_divison_rounding"] = False
    old["cpp.enable_floating_point_contract_flag"] = False
    monkeypatch.setattr(inductor, "config", types.SimpleNamespace(get_config_copy=lambda: dict(old)))
    opts = CM.eager_numerics_options()
    assert opts["emulate_divison_rounding"] is True and opts["emulate_precision_casts"] is True
    assert not any(k.startswith("eager_numerics.") for k in opts)
    assert "cpp.enable_floating_point_contract_flag" not in opts
    assert all(k in old and type(old[k]) is type(v) for k, v in opts.items())


# -- the mean over DP sources: one summation order and one division, eager and compiled, at any DP size -----------

# every decode-and-mean graph a preset compiles: FP8 on 16-element blocks (tensor scaling) and 128-element ones (block
# scaling), NVFP4 from unpacked codes (the CPU path) and from packed ones (the GPU path)
DECODERS = ["fp8_e4m3/16", "fp8_e4m3/128", "fp8_e5m2/16", "nvfp4/sources", "nvfp4/packed"]
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP / NVIDIA E2M1 magnitudes by 3-bit code
VALUES = 16384  # per source


def _fp64_reference_mean(vals: torch.Tensor) -> torch.Tensor:
    """float32 ``[...]``: the mean over dim 0 of the float64 values ``vals`` ``[dp, ...]`` as the codecs define it,
    computed in FP64: each value rounded to FP32 once, then (((+0.0 + v_0) + v_1) + ...) with every sum rounded to
    FP32, then the quotient by dp rounded to FP32 (FP64 carries more than 2 * 24 + 2 bits, so each of these double
    roundings is the correctly rounded FP32 operation)."""
    v = vals.float().double()
    acc = torch.zeros(vals.shape[1:], dtype=torch.float64)
    for i in range(vals.shape[0]):
        acc = (acc + v[i]).float().double()
    return (acc / vals.shape[0]).float()


def _dp_sources(decoder: str, dp: int, seed: int = 0):
    """Random finite payloads of ``dp`` sources for ``decoder`` (one block of every source all -0.0) and their
    reference mean: ``(run, reference)``, ``run(compile: bool, divisor)`` -> float32 ``[VALUES]`` through the wire
    class's own decode-and-mean function, ``reference`` float32 ``[VALUES]`` (:func:`_fp64_reference_mean`)."""
    from megatron_geo.comm.wire_fp8 import FP8Wire
    from megatron_geo.comm.wire_nvfp4 import NVFP4Wire

    g = torch.Generator().manual_seed(seed * 100 + dp)
    fmt, form = decoder.split("/")
    if fmt != "nvfp4":
        blk = int(form)
        nb = VALUES // blk
        codes = torch.randint(0, 256, (dp, nb, blk), generator=g, dtype=torch.int32)
        nonfinite = (codes & 0x7F) == 0x7F if fmt == "fp8_e4m3" else (codes & 0x7F) >= 0x7C
        codes = torch.where(nonfinite, 0, codes).to(torch.uint8)
        codes[:, 1] = 0x80  # -0.0 from every source: the mean is +0.0
        scale = torch.exp2(torch.rand(dp, nb, generator=g) * 40 - 30)  # 2^-30 .. 2^10, 24 significant bits
        dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        ref = _fp64_reference_mean(codes.view(dt).double() * scale.double().unsqueeze(-1)).view(-1)

        def run(compile: bool, divisor: torch.Tensor) -> torch.Tensor:
            return FP8Wire(fmt, "nearest", None, compile).decode_sum(codes, scale, torch.empty(VALUES), divisor)

        return run, ref
    nb = VALUES // 16
    packed = torch.randint(0, 256, (dp, nb, 8), generator=g, dtype=torch.int32).to(torch.uint8)
    packed[:, 1] = 0x88  # -0.0 in both nibbles
    bscale = torch.randint(0, 0x7F, (dp, nb), generator=g, dtype=torch.int32).to(torch.uint8)  # finite E4M3
    gscale = torch.exp2(torch.rand(dp, nb, generator=g) * 40 - 30)
    nibbles = torch.stack((packed & 15, packed >> 4), dim=-1).view(dp, nb, 16).long()  # low nibble first
    e2m1 = torch.tensor(_E2M1_GRID + tuple(-v for v in _E2M1_GRID), dtype=torch.float64)[nibbles]
    blockwise = e2m1 * bscale.view(torch.float8_e4m3fn).double().unsqueeze(-1)  # exact in FP32 as well
    ref = _fp64_reference_mean(blockwise * gscale.double().unsqueeze(-1)).view(-1)

    def run(compile: bool, divisor: torch.Tensor) -> torch.Tensor:
        w = NVFP4Wire("nearest", None, compile)
        if form == "packed":
            return w.sum_packed(packed, bscale, gscale, torch.empty(VALUES), divisor)
        return w.sum_sources(w.unpack(packed).view(dp, nb, 16), bscale, gscale, torch.empty(VALUES), divisor)

    return run, ref


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Values whose FP32 bit patterns differ (the sign of zero included)."""
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


def _check_dp_mean(decoder: str, dp: int) -> None:
    """Every decode-and-mean function gives the reference's bits eagerly and compiled: one left-to-right FP32 sum
    from +0.0, one IEEE division (so a block of -0.0 from every source averages to +0.0)."""
    from megatron_geo.comm.codecs import dp_divisor

    counters = _fresh()
    run, ref = _dp_sources(decoder, dp)
    assert ref.isfinite().all() and not ref.signbit()[ref == 0].any()
    eager = run(False, dp_divisor(dp, "cpu"))
    compiled = run(True, dp_divisor(dp, "cpu"))
    assert (_differing(eager, ref), _differing(compiled, eager)) == (0, 0)
    assert not counters["graph_break"]


@pytest.mark.parametrize("decoder", DECODERS)
def test_dp3_mean_is_bitwise_one_value_eager_compiled_and_by_the_fp64_reference(decoder):
    """DP 3: a divisor that is no power of two (a reciprocal multiply would be one ulp off for about a third of the
    values), and three sources of -0.0 (a sum seeded with the first source would stay -0.0)."""
    _check_dp_mean(decoder, 3)


@pytest.mark.parametrize("decoder", DECODERS)
def test_dp64_mean_is_bitwise_one_value_eager_compiled_and_by_the_fp64_reference(decoder):
    """DP 64: past the 16 rows after which eager CPU ``sum(dim=0)`` switches to a cascade of partial sums, and past
    Inductor's unrolling of small reductions (a reduction loop of its own order)."""
    _check_dp_mean(decoder, 64)


@pytest.mark.parametrize("decoder", DECODERS)
def test_the_dp_mean_divides_by_a_runtime_tensor_in_eager_and_compiled_code(decoder, monkeypatch):
    """The division by dp never sees a Python number: eager CUDA multiplies by the reciprocal of a CPU-scalar divisor,
    and Inductor lowers a division by a graph constant to a reciprocal multiply on every device but the CPU (both
    one rounding more: ~1/3 of the quotients one ulp off at DP 3). Eagerly the divisor is a one-element tensor on the
    values' device; in the graph Inductor receives (aten level) the one division divides by a graph input."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.overrides import TorchFunctionMode

    from megatron_geo.comm.codecs import dp_divisor

    dp = 3
    run, _ = _dp_sources(decoder, dp)
    divisions = []

    class Divisions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("div", "div_", "true_divide", "__truediv__", "__itruediv__"):
                divisions.append(args[1])
            return func(*args, **(kwargs or {}))

    with Divisions():
        run(False, dp_divisor(dp, "cpu"))
    assert divisions and all(isinstance(d, torch.Tensor) and d.shape == (1,) for d in divisions), divisions

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    _fresh()
    aten = torch.ops.aten
    real_compile = torch.compile
    backend = aot_autograd(fw_compiler=keep)  # keeps the aten graph that Inductor would lower
    # the codec graphs as maybe_compile makes them (fullgraph, dynamic sizes, static DP), on that backend
    monkeypatch.setattr(torch, "compile", lambda fn, options=None, **kw: real_compile(fn, backend=backend, **kw))
    run(True, dp_divisor(dp, "cpu"))
    divs = [
        n
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in (aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar)
    ]
    assert len(divs) == 1, [str(n) for n in divs]
    assert isinstance(divs[0].args[1], torch.fx.Node) and divs[0].args[1].op == "placeholder", divs[0].args
    scalars = [a for gm in graphs for n in gm.graph.nodes if n.op == "call_function" for a in n.args]
    assert not any(isinstance(a, float) and abs(a - 1 / dp) < 1e-6 for a in scalars)  # no multiply by 1/3


def test_dp_divisor_is_one_cached_float32_element_per_size_and_device():
    from megatron_geo.comm.codecs import dp_divisor

    d = dp_divisor(3, "cpu")
    assert d.dtype == torch.float32 and d.shape == (1,) and d.device.type == "cpu" and d.item() == 3.0
    assert dp_divisor(3, "cpu") is d and dp_divisor(64, "cpu").item() == 64.0
    with pytest.raises(ValueError, match="DP size must be >= 1, got 0"):
        dp_divisor(0, "cpu")


def test_wire_sum_mean_divides_by_a_runtime_tensor_and_rounds_once():
    """``ring_mean`` (the paper's collective, eager): the IEEE quotient by a one-element tensor, equal to the FP64
    quotient rounded to FP32, at DP 3 and 96."""
    from torch.overrides import TorchFunctionMode

    from megatron_geo.comm.wire_sum import ring_mean

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-40, 30, 4096)
    seen = []

    class Divisions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("div", "div_"):
                seen.append(args[1])
            return func(*args, **(kwargs or {}))

    for dp in (3, 96):
        with Divisions():
            got = ring_mean(x.clone(), dp)
        assert torch.equal(got.view(torch.int32), (x.double() / dp).float().view(torch.int32))
    assert len(seen) == 2 and all(isinstance(d, torch.Tensor) and d.shape == (1,) for d in seen), seen


@pytest.mark.parametrize("dp", [1, 2, 3, 17, 64])
def test_both_eager_row_sums_add_the_sources_left_to_right_from_plus_zero(dp):
    """The eager CPU form (one ``index_add_``) and the form that eager GPUs run (a loop of additions) give the
    left-to-right FP32 sum from +0.0 (a column of -0.0 sums to +0.0), past 16 rows as well."""
    from megatron_geo.comm.codecs import _row_sum_index_add, _row_sum_loop

    g = torch.Generator().manual_seed(dp)
    vals = torch.randn(dp, 4096, generator=g) * torch.exp2(torch.randint(-30, 30, (dp, 4096), generator=g).float())
    vals[:, 7] = -0.0
    acc = torch.zeros(4096, dtype=torch.float64)  # each FP32 addition as the FP64 sum rounded to FP32
    for i in range(dp):
        acc = (acc + vals[i].double()).float().double()
    want = acc.float()
    assert _differing(_row_sum_index_add(vals), want) == 0 and _differing(_row_sum_loop(vals), want) == 0
    assert want[7].item() == 0.0 and not want[7].signbit()
