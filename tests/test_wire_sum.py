"""``comm.reduce_op=wire_sum`` (the paper's FP8 sum inside the collective) against an independent FP64 simulation
of the same ring: a hand-written round-to-nearest-even onto the FP8 grid (frexp / ldexp, no torch FP8 cast),
float64 partial sums, saturation at every hop, the ring order of a reduce-scatter."""

import numpy as np
import pytest
import torch

from dist_harness import run_distributed
from helpers import pctx_for
from megatron_geo.comm import build_reducer
from megatron_geo.comm.op_trace import OpRecorder
from megatron_geo.comm.wire_sum import ring_order, simulate_wire_sum
from megatron_geo.config import ConfigError
from megatron_geo.config.label import derive_label
from megatron_geo.config.schema import CommConfig, Config
from megatron_geo.distributed.shard_plan import plan_shards
from megatron_geo.training import telemetry
from megatron_geo.training.validate import validate_config

# mantissa bits, smallest normal exponent, largest finite value
GRID = {"fp8_e4m3": (3, -6, 448.0), "fp8_e5m2": (2, -14, 57344.0)}
NUMELS = [40, 7, 1, 0, 61]


def rne_sat(v: np.ndarray, fmt: str) -> np.ndarray:
    """float64 ``v`` rounded to the nearest FP8 value (ties to even), clamped to +-max."""
    mbits, emin, fmax = GRID[fmt]
    a = np.abs(v)
    _, ex = np.frexp(a)  # a = m * 2**ex, 0.5 <= m < 1
    quantum = np.ldexp(1.0, np.maximum(ex - 1, emin) - mbits)
    r = np.minimum(np.round(a / quantum) * quantum, fmax)  # np.round: half to even
    return np.copysign(r, v)


def ref_ring(codes: np.ndarray, owner: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """codes ``[N, n]`` float64 FP8 values; the ring that ends at ``owner`` (starts at owner + 1)."""
    n = codes.shape[0]
    order = [(owner + 1 + i) % n for i in range(n)]
    p = codes[order[0]].copy()
    sat = np.zeros(p.shape, dtype=bool)
    for src in order[1:]:
        s = p + codes[src]
        sat |= np.abs(s) > GRID[fmt][2]
        p = rne_sat(s, fmt)
    return p, sat


def ref_scale(amax: np.float32, n: int, fmt: str, prediv: bool) -> np.float32:
    a = np.float32(amax * np.float32(n)) if prediv else np.float32(amax)
    return np.float32(1.0) if a == 0 else np.float32(a / np.float32(GRID[fmt][2]))


def ref_encode(x: np.ndarray, scale: np.float32, fmt: str) -> np.ndarray:
    return rne_sat((x.astype(np.float32) / scale).astype(np.float64), fmt)


def coherent_grads(n: int, numel: int, seed: int, noise: float = 0.3) -> list[torch.Tensor]:
    """Rank gradients close to their mean (the sum of N codes leaves the range without pre-division)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g) * torch.logspace(0, -4, numel)[torch.randperm(numel, generator=g)]
    return [base + noise * base.abs().mean() * torch.randn(numel, generator=g) for _ in range(n)]


def test_ring_order_ends_at_the_owner():
    assert ring_order(4, 1) == [2, 3, 0, 1]
    assert ring_order(3, 2) == [0, 1, 2]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("prediv", [True, False])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_simulate_wire_sum_equals_fp64_ring(fmt, prediv, n):
    grads = coherent_grads(n, 203, seed=n)
    got, hits = simulate_wire_sum(grads, fmt, prediv)
    x = np.stack([g.numpy() for g in grads])
    scale = ref_scale(np.abs(x).max(), n, fmt, prediv)
    codes = np.stack([ref_encode(xr, scale, fmt) for xr in x])
    want, sats = [], []
    for o, idx in enumerate(np.array_split(np.arange(x.shape[1]), n)):
        p, s = ref_ring(codes[:, idx], o, fmt)
        want.append(p)
        sats.append(s)
    want = (np.concatenate(want).astype(np.float32) * scale) / np.float32(n)
    np.testing.assert_array_equal(got.numpy(), want)
    assert hits["saturated"] == pytest.approx(np.concatenate(sats).mean())
    assert hits["flushed"] == pytest.approx(((codes == 0) & (x != 0)).sum() / x.size)
    if not prediv and n == 8:
        assert hits["saturated"] > 0, "coherent gradients summed without pre-division must hit the max"


def test_ring_fp8_sum_error_grows_with_ranks_where_fp32_accumulation_does_not():
    """The FP8 ring sum re-rounds at every hop, so its error grows with N."""

    def rel(n):
        g = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(n)]
        ref = torch.stack(g).double().mean(0)
        avg, _ = simulate_wire_sum(g, "fp8_e4m3", prediv=True)
        return float((avg.double() - ref).norm() / ref.norm())

    assert rel(32) > 2 * rel(2)


# -- the reducer, DP = 2 and 3 with gloo -----------------------------------------------------------------------
def _bucket(flat: torch.Tensor, plan) -> torch.Tensor:
    buf = torch.zeros(plan.buffer_numel)
    pos = 0
    for off, n in zip(plan.offsets, NUMELS):
        buf[off : off + n] = flat[pos : pos + n]
        pos += n
    return buf


def _run(rank, world, fmt, prediv, mode):
    pctx = pctx_for(1)
    red = build_reducer(CommConfig(dtype=fmt, reduce_op="wire_sum", wire_sum_prediv=prediv), pctx)
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
    bucket = red.register_bucket(0, plan.offsets, NUMELS, plan.chunk, "cpu")
    buf = _bucket(coherent_grads(world, sum(NUMELS), seed=7)[rank], plan)
    telemetry.arm(red, 0, 1)
    rec = OpRecorder()
    with rec:  # bound-hit counting included: no host sync, no data-dependent shape
        (red.reduce_scatter if mode == "rs" else red.all_reduce)(buf, bucket).wait()
    assert rec.bad == [], rec.bad
    return buf, telemetry.collect(red, pctx.dp_group, world), plan.chunk, plan.offsets, red.bytes_sent


def _reference_bucket(world, fmt, prediv, plan):
    """Per parameter (tensor scaling): shared scale, hand-rounded codes, ring sum per owner range, decode."""
    bufs = np.stack([_bucket(g, plan).numpy() for g in coherent_grads(world, sum(NUMELS), seed=7)])
    out = np.zeros(plan.buffer_numel, dtype=np.float32)
    sat = np.zeros(plan.buffer_numel, dtype=bool)
    flushed = np.zeros(world)
    scales = np.ones(plan.buffer_numel, dtype=np.float32)
    codes = np.zeros(bufs.shape)
    for off, n in zip(plan.offsets, NUMELS):
        ext = -(-n // 16) * 16  # the scale group covers the alignment padding after the parameter
        if n:
            sl = slice(off, off + ext)
            scales[sl] = ref_scale(np.abs(bufs[:, sl]).max(), world, fmt, prediv)
    for r in range(world):
        codes[r] = rne_sat((bufs[r] / scales).astype(np.float64), fmt)
        flushed[r] = ((codes[r] == 0) & (bufs[r] != 0)).sum() / max((bufs[r] != 0).sum(), 1)
    c = plan.chunk
    for o in range(world):
        p, s = ref_ring(codes[:, o * c : (o + 1) * c], o, fmt)
        out[o * c : (o + 1) * c] = (p.astype(np.float32) * scales[o * c : (o + 1) * c]) / np.float32(world)
        sat[o * c : (o + 1) * c] = s
    return out, sat, flushed


CASES = {2: [("fp8_e4m3", True), ("fp8_e5m2", False)], 3: [("fp8_e4m3", False), ("fp8_e5m2", True)]}


def _run_cases(rank, world):
    return [
        (_run(rank, world, fmt, prediv, "rs"), _run(rank, world, fmt, prediv, "ar")) for fmt, prediv in CASES[world]
    ]


@pytest.mark.parametrize("world", [2, 3])
def test_reducer_wire_sum_equals_fp64_ring(world):
    per_rank = run_distributed(_run_cases, world)
    for i, (fmt, prediv) in enumerate(CASES[world]):
        _check_case(world, fmt, prediv, [p[i] for p in per_rank])


def _check_case(world, fmt, prediv, res):
    chunk = res[0][0][2]
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, 16)
    assert plan.chunk == chunk
    want, sat, flushed = _reference_bucket(world, fmt, prediv, plan)
    for r, ((buf, _hits, _, _, sent), (ar_buf, _, _, _, _)) in enumerate(res):
        sl = slice(r * chunk, (r + 1) * chunk)
        np.testing.assert_array_equal(buf[sl].numpy(), want[sl])  # bitwise: same codes, same decode
        # one byte per element but the own range, plus the MAX all-reduce of one FP32 amax per scale group
        # (each parameter and the padding group)
        amax_bytes = 4 * (len(NUMELS) + 1)
        assert sent == (world - 1) * chunk + 2 * (world - 1) * amax_bytes // world
        # all-reduce: the summed codes gathered as they are, decoded as the reduce-scatter path does (scale,
        # then one division by N): identical on every rank and bitwise equal to the reference
        assert torch.equal(ar_buf, res[0][1][0])
        np.testing.assert_array_equal(ar_buf.numpy(), want)
    # bound hits, DP-averaged: saturated over each owner's range, flushed over each rank's own non-zero inputs
    sat_mean = np.mean([sat[r * chunk : (r + 1) * chunk].mean() for r in range(world)])
    assert res[0][0][1]["comm/bound_hits/saturated/bucket0"] == pytest.approx(sat_mean)
    assert res[0][0][1]["comm/bound_hits/flushed/bucket0"] == pytest.approx(flushed.mean())
    if not prediv:
        assert sat_mean > 0, "coherent gradients without pre-division must saturate somewhere"


def test_wire_sum_config_errors_and_label():
    cfg = Config()
    cfg.comm.reduce_op = "wire_sum"
    with pytest.raises(ConfigError, match="comm.reduce_op=wire_sum .*fp8_e4m3"):
        validate_config(cfg, 1)
    cfg.comm.dtype = "fp8_e4m3"
    validate_config(cfg, 1)
    assert derive_label(cfg) == "fp8_e4m3+wiresum"
    cfg.comm.wire_sum_prediv = False
    assert derive_label(cfg) == "fp8_e4m3+wiresum-noprediv"
    cfg.comm.reduce_op = "fp32_sum"  # pre-division without the wire sum means nothing: one error, not silence
    with pytest.raises(ConfigError, match="comm.wire_sum_prediv=false only changes comm.reduce_op=wire_sum"):
        validate_config(cfg, 1)
    cfg.comm.reduce_op = "ring"
    with pytest.raises(ConfigError, match="comm.reduce_op='ring'"):
        validate_config(cfg, 1)


# -- the NCCL-native branch (NCCL >= 2.24 sums FP8 itself), with the collective faked on gloo --------------------
class _Done:
    def wait(self):
        return True


def _fake_fp8_collectives(fmt):
    """Stand-ins for NCCL's FP8 reduce-scatter / reduce: gather every rank's codes, sum them in the ring order
    of :func:`ring_sum` (NCCL's own order may differ; the test checks the branch's wiring, not NCCL)."""
    import torch.distributed as dist

    from megatron_geo.comm.wire_sum import ring_sum

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    def reduce_scatter_into(out, inp, group, async_op=False):
        assert out.dtype == inp.dtype and inp.dtype.itemsize == 1 and inp.dtype != torch.uint8  # an FP8 dtype
        r, n = dist.get_rank(group), out.numel()
        total, _ = ring_sum(gather(inp.view(torch.uint8), group)[:, r * n : (r + 1) * n], r, fmt)
        out.view(torch.uint8).copy_(total)
        return _Done()

    def reduce_ranges(buf, bounds, group, async_op=True):
        assert buf.dtype.itemsize == 1 and buf.dtype != torch.uint8
        r = dist.get_rank(group)
        allc = gather(buf.view(torch.uint8), group)
        lo, hi = bounds[r], bounds[r + 1]
        total, _ = ring_sum(allc[:, lo:hi], r, fmt)
        buf.view(torch.uint8)[lo:hi].copy_(total)
        return _Done()

    return reduce_scatter_into, reduce_ranges


def _run_native_vs_emulated(rank, world, fmt, uneven):
    from megatron_geo.parallel import collectives as C

    pctx = pctx_for(1)
    outs = []
    for native in (False, True):
        red = build_reducer(CommConfig(dtype=fmt, reduce_op="wire_sum"), pctx)
        plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
        bounds = [0, 48, plan.buffer_numel] if uneven else plan.chunk
        bucket = red.register_bucket(0, plan.offsets, NUMELS, bounds, "cpu")
        red.native_wire_sum = native
        buf = _bucket(coherent_grads(world, sum(NUMELS), seed=11)[rank], plan)
        saved = C.reduce_scatter_into, C.reduce_ranges
        if native:
            C.reduce_scatter_into, C.reduce_ranges = _fake_fp8_collectives(fmt)
        try:
            red.reduce_scatter(buf, bucket).wait()
        finally:
            C.reduce_scatter_into, C.reduce_ranges = saved
        b = bucket.bounds
        outs.append((buf[b[rank] : b[rank + 1]].clone(), red.bytes_sent))
    return outs


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven-owner-ranges"])
def test_native_fp8_branch_decodes_like_the_emulation(uneven):
    for (emulated, sent_e), (native, sent_n) in run_distributed(_run_native_vs_emulated, 2, "fp8_e4m3", uneven):
        assert torch.equal(native, emulated) and sent_n == sent_e
