"""Non-finite gradients are never laundered into finite ones, in every preset.

DP = 2, the tiny model: one element of one parameter's gradient on rank 1 only is +inf, -inf or NaN. The
global gradient norm after the reduction must be non-finite on both ranks (so every rank skips the step,
as ``train.nonfinite`` documents); a finite control step must stay finite.
"""

from __future__ import annotations

import math
from pathlib import Path

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "comm").glob("*.yaml"))
VALUES = (float("inf"), float("-inf"), float("nan"), 1.0)


def _norms(rank, world, preset, which):
    from megatron_geo.config import load_config
    from megatron_geo.training.setup import build_model_and_optimizer

    cfg = tiny_cfg("parallel.overlap_grad_reduce=false")
    cfg.comm = load_config([str(ROOT / "configs" / "comm" / f"{preset}.yaml")]).comm
    if cfg.comm.transform == "geo":
        cfg.geo.layers, cfg.geo.rank = "layers.*.mlp.down_proj.weight", 4
    pctx = pctx_for(1)
    model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    named = dict(model.named_parameters())
    target = named[
        "layers.0.mlp.down_proj.weight"
        if which == "geo-layer"
        else "layers.0.attn_norm.weight"
        if "layers.0.attn_norm.weight" in named
        else next(iter(named))
    ]
    mb = rank_micro_batches(global_batch(cfg, 0), 4, rank, world)[0]
    norms = []
    for value in VALUES:
        sync.start_step()
        model(mb["tokens"], mb["labels"]).mean().backward()
        if rank == 1:
            target.main_grad.view(-1)[3] = value
        sync.finish()
        norms.append(opt.grad_norm())
        reducer.reset_error_feedback()
    return norms


def _all_presets(rank, world):
    out = {}
    for preset in PRESETS:
        out[(preset, "norm-weight")] = _norms(rank, world, preset, "norm-weight")
        if preset.startswith("geo"):  # the element inside a GeoFP8-transformed layer
            out[(preset, "geo-layer")] = _norms(rank, world, preset, "geo-layer")
    return out


def test_a_non_finite_element_on_one_rank_makes_the_norm_non_finite_everywhere():
    out = run_distributed(_all_presets, 2)
    assert {p for p, _ in out[0]} == set(PRESETS)
    for rank, res in enumerate(out):
        for (preset, which), norms in res.items():
            for value, norm in zip(VALUES, norms):
                if math.isfinite(value):
                    assert math.isfinite(norm), (preset, which, rank, value, norm)
                else:
                    assert not math.isfinite(norm), (preset, which, rank, value, norm)


def _overflow(rank, world):
    import torch

    from megatron_geo.comm import build_reducer
    from megatron_geo.config import load_config

    pctx = pctx_for(1)
    out = {}
    for preset in ("fp32", "bf16", "fp8", "fp8_shared_scale", "nvfp4"):
        comm = load_config([str(ROOT / "configs" / "comm" / f"{preset}.yaml")]).comm
        red = build_reducer(comm, pctx)
        n = 64
        red.register_bucket(0, [0], [n], n // world, "cpu")
        buf = torch.full((n,), 3e38)
        red.reduce_scatter(buf, 0).wait()
        out[preset] = buf[rank * (n // world) : (rank + 1) * (n // world)].clone()
    return out


def test_an_fp32_sum_that_overflows_is_non_finite_and_the_step_is_skipped():
    """The documented decision: every rank sends 3e38, the FP32 sum (6e38) overflows to inf before the single
    division by DP; the norm is then non-finite and every rank skips the step (nothing is silently clipped)."""
    for out in run_distributed(_overflow, 2):
        for preset, vals in out.items():
            assert bool((vals == float("inf")).all()), (preset, vals[:4])
