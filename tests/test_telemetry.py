"""Live quantization error (comm.telemetry_interval) against an independent computation of the same round trip:
per-parameter FP8 scales and torch's own float8 casts, per rank, then the mean over the DP group."""

from __future__ import annotations

import math

import pytest
import torch

from dist_harness import run_distributed

NUMELS = [300, 37, 1, 0, 250, 64]
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def _grads(rank: int, plan) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank + 11)
    buf = torch.zeros(plan.buffer_numel)
    for off, n in zip(plan.offsets, NUMELS):
        buf[off : off + n] = torch.randn(n, generator=g) * 10.0 ** (rank + (off % 3))
    return buf


def _measure(rank, world, fmt):
    from helpers import pctx_for
    from megatron_geo.comm import build_reducer
    from megatron_geo.config.schema import CommConfig
    from megatron_geo.distributed.shard_plan import plan_shards
    from megatron_geo.training import telemetry

    pctx = pctx_for(1)
    red = build_reducer(CommConfig(dtype=fmt, error_feedback=True), pctx)
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
    bucket = red.register_bucket(0, plan.offsets, NUMELS, plan.chunk, "cpu")
    assert not telemetry.arm(red, 0, 50) and telemetry.arm(red, 49, 50)
    buf = _grads(rank, plan)
    red.reduce_scatter(buf.clone(), bucket).wait()
    out = telemetry.collect(red, pctx.dp_group, world)
    assert red.telemetry is None
    return out, [p for p in plan.offsets]


def _reference(rank, plan_offsets, fmt, plan):
    dt, fmax = FP8[fmt]
    buf = _grads(rank, plan).double()
    q = torch.zeros_like(buf)
    for off, n in zip(plan_offsets, NUMELS):
        if n:
            x = buf[off : off + n].float()
            s = x.abs().max() / fmax
            q[off : off + n] = ((x / s).clamp(-fmax, fmax).to(dt).float() * s).double()
    return math.sqrt(((q - buf) ** 2).sum() / (buf**2).sum())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_rel_err_equals_an_independent_round_trip_averaged_over_dp(fmt):
    from megatron_geo.distributed.shard_plan import plan_shards

    world = 2
    res = run_distributed(_measure, world, fmt)
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, 16)
    want = sum(_reference(r, res[0][1], fmt, plan) for r in range(world)) / world
    for out, _ in res:
        assert list(out) == ["comm/rel_err/bucket0"]
        assert out["comm/rel_err/bucket0"] == pytest.approx(want, rel=1e-5)
    assert 1e-3 < want < 0.2  # an FP8 figure: E4M3 about 2-3%, E5M2 about 5%
