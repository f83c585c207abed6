"""Per-token loss: uneven valid tokens across DP ranks give the single-process mean-over-tokens gradient."""

import torch

from dist_harness import run_distributed
from helpers import pctx_for, tiny_cfg
from megatron_geo.training.setup import build_model_and_optimizer


def _batch(cfg):
    g = torch.Generator().manual_seed(3)
    s, v = cfg.model.seq_length, cfg.model.vocab_size
    data = torch.randint(0, v, (2, s + 1), generator=g)
    mask = torch.zeros(2, s)
    mask[0, 5] = 1.0  # rank 0: 1 valid token
    mask[1, 2:11] = 1.0  # rank 1: 9 valid tokens
    return data[:, :-1], data[:, 1:], mask


def _grads(rank, world):
    cfg = tiny_cfg("parallel.distributed_optimizer=false", "train.global_batch_size=2", "train.micro_batch_size=1")
    pctx = pctx_for(1)
    model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
    tokens, labels, mask = _batch(cfg)
    if world == 2:
        tokens, labels, mask = tokens[rank : rank + 1], labels[rank : rank + 1], mask[rank : rank + 1]
    from megatron_geo.training.step import StepContext, train_step

    # lr 0 and no clipping: read the reduced gradient the optimizer saw
    ctx = StepContext(model, sync, opt, pctx, 0.0, lr_schedule=lambda step: 0.0)
    train_step(ctx, 0, [{"tokens": tokens, "labels": labels, "loss_mask": mask}])
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


def _reference():
    """Direct single-process autograd of (sum of masked token losses) / 10, no project gradient path."""
    cfg = tiny_cfg()

    from megatron_geo.model import Llama

    pctx = pctx_for(1)
    model = Llama(cfg.model, pctx.tp_group, cfg.train.seed)
    tokens, labels, mask = _batch(cfg)
    loss = (model(tokens, labels) * mask).sum() / mask.sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _ref_worker(rank, world):
    return _reference()


def test_uneven_valid_tokens_match_single_process():
    ref = run_distributed(_ref_worker, 1)[0]
    for grads in run_distributed(_grads, 2):
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
