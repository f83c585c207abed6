"""Overlapped parameter gather (``parallel.overlap_param_gather``): each bucket's gather starts right after the
update and is waited in a forward pre-hook; on CPU the results equal the non-overlapped path bit for bit."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg


def _train(rank, world, overrides, steps):
    """The same run with the blocking and with the overlapped gather, one after the other in this process."""
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    out = []
    for overlap in ("false", "true"):
        cfg = tiny_cfg(*overrides, f"parallel.overlap_param_gather={overlap}")
        pctx = pctx_for(1)
        model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
        ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad, geo=reducer.geo)
        losses, pending_after_step = [], []
        for step in range(steps):
            mbs = rank_micro_batches(global_batch(cfg, step), 2, pctx.dp_rank, pctx.dp_size)
            losses.append(train_step(ctx, step, mbs).loss)
            pending_after_step.append(len(opt._gathers))
        opt.wait_param_gather()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append((losses, params, pending_after_step, len(opt._hooks), len(buckets)))
    return out


CASES = {
    "muon-uneven-bf16-params": ["optimizer.name=muon", "train.param_dtype=bf16"],
    "adamw-geofp8-rows": [
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "comm.error_feedback=true",
        "geo.layers=layers.*.mlp.*_proj.weight",
        "geo.rank=4",
        "geo.refresh_interval=2",
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_param_gather_equals_blocking_gather(name):
    ranks = run_distributed(_train, 2, CASES[name], 3)
    for (l0, p0, pend0, h0, nb), (l1, p1, pend1, h1, _) in ranks:
        assert pend0 == [0, 0, 0] and h0 == 0  # blocking: nothing in flight after a step
        assert pend1 == [nb] * 3 and h1 > 0  # overlapped: every bucket's gather in flight
        assert l0 == l1, (name, l0, l1)  # the hooks waited before each use: same losses
        for n in p0:
            assert torch.equal(p0[n], p1[n]), (name, n)
    for n in ranks[0][1][1]:
        assert torch.equal(ranks[0][1][1][n], ranks[1][1][1][n]), n  # replicas identical
