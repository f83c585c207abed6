"""DP / TP / accumulation equivalences against a single-process reference (CPU, gloo).

Tolerance: FP32 everywhere (on CPU Muon's Newton-Schulz runs in FP32 too); DP changes the summation
order only, so losses and parameters agree to atol 1e-5.
"""

import pytest
import torch

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg
from megatron_geo.training.setup import build_model_and_optimizer
from megatron_geo.training.step import StepContext, train_step


def _train(rank, world, overrides, tp, steps, micro):
    cfg = tiny_cfg(*overrides, f"train.micro_batch_size={micro}")
    pctx = pctx_for(tp)
    model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad)
    losses = []
    for step in range(steps):
        mbs = rank_micro_batches(global_batch(cfg, step), micro, pctx.dp_rank, pctx.dp_size)
        losses.append(train_step(ctx, step, mbs).loss)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, init


CASES = [
    ("adamw-distopt", ["optimizer.name=adamw", "parallel.distributed_optimizer=true"]),
    ("adamw-allreduce", ["optimizer.name=adamw", "parallel.distributed_optimizer=false"]),
    ("muon-distopt", ["optimizer.name=muon", "parallel.distributed_optimizer=true"]),
    ("muon-allreduce", ["optimizer.name=muon", "parallel.distributed_optimizer=false"]),
]


@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_dp2_matches_single_process(name, overrides):
    ref_losses, ref_params, init = run_distributed(_train, 1, overrides, 1, 3, 2)[0]
    out = run_distributed(_train, 2, overrides, 1, 3, 2)
    for losses, params, _ in out:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
        for n, p in params.items():
            assert not torch.equal(p, init[n]), f"{name}: {n} did not train"
            torch.testing.assert_close(p, ref_params[n], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {n}: {m}")
    # replicas identical bit for bit
    for n in out[0][1]:
        assert torch.equal(out[0][1][n], out[1][1][n]), n


def test_accumulation_equivalence():
    a = run_distributed(_train, 1, [], 1, 2, 1)[0]  # micro batch 1 x accumulation 8
    b = run_distributed(_train, 1, [], 1, 2, 8)[0]  # micro batch 8 x accumulation 1
    torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), rtol=0, atol=1e-5)
    for n in a[1]:  # AdamW: FP32 throughout
        torch.testing.assert_close(a[1][n], b[1][n], rtol=0, atol=1e-5)
