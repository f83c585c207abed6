"""No codec scale, block or rotation spans two parameters.

TP-replicated parameters: with TP = 2, a TP-replicated parameter (the norm weights) must stay bitwise
identical on the two TP ranks of a DP rank after several steps, in every preset: its reduced gradient may not
depend on the TP-sharded neighbours in its bucket (NVFP4's global scale, FP8 scale blocks, Hadamard blocks).

Neighbours: a small parameter between two large ones, reduced with block codecs (Hadamard, block scaling, NVFP4),
must come back as accurate as if it were reduced alone with the same codec (the reference: the same
reducer on a bucket holding only that parameter, both against the FP64 mean).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "comm").glob("*.yaml"))


def _tp_replicas(rank, world, presets):
    from megatron_geo.config import load_config
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    out = {}
    for preset in presets:
        # hidden 24: a norm weight is not a multiple of the 16- or 128-element codec blocks
        cfg = tiny_cfg("parallel.tensor=2", "model.hidden_size=24", "comm.block_size=16")
        comm = load_config([str(ROOT / "configs" / "comm" / f"{preset}.yaml")]).comm
        comm.block_size, comm.hadamard_block = 16, 16
        cfg.comm = comm
        if comm.transform == "geo":
            cfg.geo.layers, cfg.geo.rank, cfg.geo.refresh_interval = "layers.*.mlp.down_proj.weight", 4, 2
        pctx = pctx_for(2)
        model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
        ctx = StepContext(model, sync, opt, pctx, 1.0, geo=reducer.geo)
        for step in range(3):
            mbs = rank_micro_batches(global_batch(cfg, step), 2, pctx.dp_rank, pctx.dp_size)
            train_step(ctx, step, mbs)
        out[preset] = {
            n: p.detach().clone() for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)
        }
    return out


def test_tp_replicated_parameters_stay_bitwise_identical_in_every_preset():
    ranks = run_distributed(_tp_replicas, 4, PRESETS)  # rank = dp_rank * 2 + tp_rank
    for preset in PRESETS:
        names = list(ranks[0][preset])
        assert any("norm" in n for n in names)
        for dp in range(2):
            a, b = ranks[2 * dp][preset], ranks[2 * dp + 1][preset]
            for n in names:
                assert torch.equal(a[n], b[n]), (preset, dp, n, (a[n] - b[n]).abs().max().item())


NUMELS = [40, 7, 61]  # the middle parameter is 100x smaller than its neighbours


def _grads(world):
    g = torch.Generator().manual_seed(5)
    return [
        [torch.randn(n, generator=g, dtype=torch.float64) * (0.01 if i == 1 else 1.0) for i, n in enumerate(NUMELS)]
        for _ in range(world)
    ]


def _small_param(rank, world, kw):
    from megatron_geo.comm.lowp import LowPrecisionReducer
    from megatron_geo.config.schema import CommConfig
    from megatron_geo.distributed.shard_plan import plan_shards

    pctx = pctx_for(1)
    out = []
    for numels, idx in ((NUMELS, [0, 1, 2]), ([NUMELS[1]], [1])):  # the bucket, then the small one alone
        red = LowPrecisionReducer(CommConfig(**{"dtype": "fp8_e4m3", **kw}), pctx.dp_group, world, rank)
        plan = plan_shards(numels, [False] * len(numels), world, red.alignment())
        bucket = red.register_bucket(0, plan.offsets, numels, plan.bounds, "cpu")
        buf = torch.zeros(plan.buffer_numel)
        for j, i in enumerate(idx):
            buf[plan.offsets[j] : plan.offsets[j] + numels[j]] = _grads(world)[rank][i].float()
        red.all_reduce(buf, bucket).wait()
        j = idx.index(1)
        out.append(buf[plan.offsets[j] : plan.offsets[j] + NUMELS[1]].clone())
    return out


@pytest.mark.parametrize(
    "kw",
    [{"transform": "hadamard", "hadamard_block": 16}, {"scaling": "block", "block_size": 16}, {"dtype": "nvfp4"}],
    ids=["hadamard16", "block16", "nvfp4"],
)
def test_a_small_parameter_is_reduced_as_accurately_as_alone(kw):
    out = run_distributed(_small_param, 2, kw)
    ref = (_grads(2)[0][1] + _grads(2)[1][1]) / 2
    in_bucket, alone = out[0]
    rel = lambda x: ((x.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert torch.equal(in_bucket, alone), (rel(in_bucket), rel(alone))  # the neighbours change nothing
    assert rel(alone) < 0.3
