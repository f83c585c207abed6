"""``comm.reduce_op=wire_sum`` decodes to the documented ``p * s / N`` on both reducer paths, also where the
pre-divided scale ``s / N`` would be an FP32 subnormal (gradients near 3e-39 or 1e-36: ``s / N`` then carries
fewer significant bits than ``s``, so decoding with it rounds differently from ``p * s`` divided by N).

The reference is written here independently of the code under test: FP8 rounding by hand (frexp / ldexp on
float64), the ring sum in float64 with a re-rounding at every hop, and the decode as the correctly rounded
FP32 product ``p * s`` followed by the correctly rounded FP32 quotient by N, both formed in float64."""

import numpy as np
import pytest

from dist_harness import run_distributed
from helpers import pctx_for
from megatron_geo.comm import build_reducer
from megatron_geo.comm.wire_sum import simulate_wire_sum
from megatron_geo.config.schema import CommConfig
from megatron_geo.distributed.shard_plan import plan_shards

# mantissa bits, smallest normal exponent, largest finite value
GRID = {"fp8_e4m3": (3, -6, 448.0), "fp8_e5m2": (2, -14, 57344.0)}
NUMELS = [40, 7, 61]
# gradient magnitudes: FP32-subnormal gradients (the shared scale clamps to 2^-126), a small normal range,
# an ordinary one and a large one
MAGNITUDES = [3e-39, 1e-36, 1e-3, 30.0]
CASES = [(fmt, prediv) for fmt in GRID for prediv in (True, False)]


def rne_sat(v: np.ndarray, fmt: str) -> np.ndarray:
    """float64 ``v`` rounded to the nearest FP8 value (ties to even, subnormals included), clamped to +-max."""
    mbits, emin, fmax = GRID[fmt]
    a = np.abs(v)
    _, ex = np.frexp(a)
    quantum = np.ldexp(1.0, np.maximum(ex - 1, emin) - mbits)
    return np.copysign(np.minimum(np.round(a / quantum) * quantum, fmax), v)


def ref_scale(amax: float, n: int, fmt: str, prediv: bool) -> np.float32:
    """``amax (* N) / max`` in FP32 (subnormal where it falls there); 0 -> 1; a quotient that underflows to 0
    -> the smallest normal FP32."""
    a = np.float32(np.float32(amax) * np.float32(n)) if prediv else np.float32(amax)
    if a == 0:
        return np.float32(1.0)
    s = np.float32(a / np.float32(GRID[fmt][2]))
    return s if s != 0 else np.finfo(np.float32).tiny


def rank_grads(world: int, magnitude: float, seed: int) -> np.ndarray:
    """``[world, sum(NUMELS)]`` float32 gradients of about ``magnitude`` (some spread over two decades)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(sum(NUMELS)) * np.logspace(0, -2, sum(NUMELS))
    x = base + 0.3 * rng.standard_normal((world, sum(NUMELS))) * np.abs(base).mean()
    return (x * magnitude).astype(np.float32)


def reference_mean(x: np.ndarray, fmt: str, prediv: bool, plan) -> np.ndarray:
    """The collective's result per element of the bucket: one scale per parameter (over its padded extent),
    ring sum per owner range ending at the owner, decode ``fp32(fp32(p * s) / N)``."""
    world = x.shape[0]
    bufs = np.zeros((world, plan.buffer_numel), dtype=np.float32)
    scales = np.ones(plan.buffer_numel, dtype=np.float32)
    pos = 0
    for off, n in zip(plan.offsets, NUMELS):
        bufs[:, off : off + n] = x[:, pos : pos + n]
        pos += n
        ext = -(-n // 16) * 16
        scales[off : off + ext] = ref_scale(float(np.abs(bufs[:, off : off + ext]).max()), world, fmt, prediv)
    codes = rne_sat((bufs / scales).astype(np.float64), fmt)  # the FP32 quotient, then FP8 rounding
    out = np.zeros(plan.buffer_numel, dtype=np.float32)
    c = plan.chunk
    for o in range(world):
        order = [(o + 1 + i) % world for i in range(world)]
        p = codes[order[0], o * c : (o + 1) * c].copy()
        for src in order[1:]:
            p = rne_sat(p + codes[src, o * c : (o + 1) * c], fmt)
        prod = np.float32(p * scales[o * c : (o + 1) * c].astype(np.float64))  # one rounding of the exact product
        out[o * c : (o + 1) * c] = np.float32(prod.astype(np.float64) / world)  # one rounding of the quotient
    return out


def _bucket(flat: np.ndarray, plan):
    import torch

    buf = torch.zeros(plan.buffer_numel)
    pos = 0
    for off, n in zip(plan.offsets, NUMELS):
        buf[off : off + n] = torch.from_numpy(flat[pos : pos + n].copy())
        pos += n
    return buf


def _reduce_all(rank, world):
    """Every case on this rank: the all-reduce path (distributed_optimizer=false) and the reduce-scatter path."""
    out = []
    pctx = pctx_for(1)
    for fmt, prediv in CASES:
        for i, mag in enumerate(MAGNITUDES):
            x = rank_grads(world, mag, seed=100 * world + i)
            res = {}
            for mode in ("ar", "rs"):
                red = build_reducer(CommConfig(dtype=fmt, reduce_op="wire_sum", wire_sum_prediv=prediv), pctx)
                plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
                red.register_bucket(0, plan.offsets, NUMELS, plan.chunk, "cpu")
                buf = _bucket(x[rank], plan)
                (red.all_reduce if mode == "ar" else red.reduce_scatter)(buf, 0).wait()
                res[mode] = buf.numpy().copy()
            out.append((fmt, prediv, mag, res))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_wire_sum_all_reduce_decodes_to_p_s_over_n(world):
    per_rank = run_distributed(_reduce_all, world)
    failures = []
    for k, (fmt, prediv, mag, _) in enumerate(per_rank[0]):
        x = rank_grads(world, mag, seed=100 * world + MAGNITUDES.index(mag))
        plan = plan_shards(NUMELS, [False] * len(NUMELS), world, 16)
        want = reference_mean(x, fmt, prediv, plan)
        c = plan.chunk
        for r in range(world):
            got = per_rank[r][k][3]
            # reduce-scatter: this rank's own range; all-reduce: the whole bucket, on every rank
            if not np.array_equal(got["rs"][r * c : (r + 1) * c], want[r * c : (r + 1) * c]):
                failures.append(f"reduce-scatter {fmt} prediv={prediv} |g|~{mag:g} rank {r}")
            if not np.array_equal(got["ar"], want):
                bad = got["ar"] != want
                tiny = np.finfo(np.float32).smallest_subnormal
                rel = np.max(np.abs(got["ar"][bad] - want[bad]) / np.maximum(np.abs(want[bad]), tiny))
                failures.append(
                    f"all-reduce {fmt} prediv={prediv} |g|~{mag:g} rank {r}: {bad.sum()} elements "
                    f"differ, max relative {rel:.2e}"
                )
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("fmt", list(GRID))
@pytest.mark.parametrize("n", [2, 3, 5])
def test_simulation_decodes_to_p_s_over_n_for_subnormal_quotients(fmt, n):
    """The single-process simulation of the same collective, against the same reference (one parameter)."""
    import torch

    x = rank_grads(n, 3e-39, seed=n)[:, : NUMELS[0]]
    got, _ = simulate_wire_sum([torch.from_numpy(r.copy()) for r in x], fmt, prediv=True)
    scale = ref_scale(float(np.abs(x).max()), n, fmt, True)
    assert np.float32(scale / np.float32(n)) < np.finfo(np.float32).tiny  # the case where s / N is subnormal
    codes = rne_sat((x / scale).astype(np.float64), fmt)
    want = np.zeros(x.shape[1], dtype=np.float32)
    for o, idx in enumerate(np.array_split(np.arange(x.shape[1]), n)):
        order = [(o + 1 + i) % n for i in range(n)]
        p = codes[order[0], idx]
        for src in order[1:]:
            p = rne_sat(p + codes[src, idx], fmt)
        want[idx] = np.float32(np.float32(p * np.float64(scale)).astype(np.float64) / n)
    np.testing.assert_array_equal(got.numpy(), want)
