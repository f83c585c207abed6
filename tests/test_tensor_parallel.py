"""TP=2 against TP=1 from the same seed, vocab-parallel CE against torch's, TP gradient norm."""

import torch
import torch.nn.functional as F

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg
from megatron_geo.tensor_parallel import vocab_parallel_cross_entropy
from megatron_geo.training.setup import build_model_and_optimizer


def _loss_and_grads(rank, world, tp):
    """One forward/backward on the whole batch (DP=1); return the loss, full grads (gathered) and norm."""
    cfg = tiny_cfg("parallel.distributed_optimizer=false")
    pctx = pctx_for(tp)
    model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    batch = rank_micro_batches(global_batch(cfg, 0), 8, 0, 1)[0]
    sync.start_step()
    per_tok = model(batch["tokens"], batch["labels"])
    loss = per_tok.mean()
    loss.backward()
    sync.finish()
    grads = {}
    for n, p in model.named_parameters():
        g = p.main_grad.clone()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            torch.distributed.all_gather(parts, g, group=pctx.tp_group)
            g = torch.cat(parts, dim=p.partition_dim)
        grads[n] = g
    return loss.item(), grads, opt.grad_norm()


def test_tp2_matches_tp1():
    """Tolerance: FP32, only the order of the TP sums differs -> loss atol 1e-6, grads atol 1e-6 + rtol 1e-4."""
    ref_loss, ref_grads, ref_norm = run_distributed(_loss_and_grads, 1, 1)[0]
    for loss, grads, norm in run_distributed(_loss_and_grads, 2, 2):
        assert abs(loss - ref_loss) < 1e-6
        assert grads.keys() == ref_grads.keys()
        for n in grads:
            # padded vocab is the same for TP 1 and 2 here (131 padded to a multiple of 2 -> 132 vs 131):
            ref = ref_grads[n]
            g = grads[n][: ref.shape[0]] if grads[n].shape != ref.shape else grads[n]
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
        # the TP=2 norm counts every parameter once (norm weights are replicated over TP)
        assert abs(norm - ref_norm) / ref_norm < 1e-5, (norm, ref_norm)


def _vocab_ce(rank, world, vocab):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, vocab, dtype=torch.float64)
    target = torch.randint(0, vocab, (3, 5))
    target[0, 0], target[0, 1] = 0, vocab - 1  # both ends of the vocab
    ref = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none").reshape(3, 5)
    lg = logits.clone().requires_grad_()
    ref = F.cross_entropy(lg.reshape(-1, vocab), target.reshape(-1), reduction="none").reshape(3, 5)
    (ref * torch.arange(15, dtype=torch.float64).reshape(3, 5)).sum().backward()
    ref_grad = lg.grad
    padded = (vocab + world - 1) // world * world
    full = torch.cat([logits, torch.full((3, 5, padded - vocab), 7.0, dtype=torch.float64)], dim=-1)  # junk pad
    shard = full.chunk(world, dim=-1)[rank].clone().float().requires_grad_()
    pctx = pctx_for(world)
    loss = vocab_parallel_cross_entropy(shard, target, vocab, pctx.tp_group)
    (loss * torch.arange(15, dtype=torch.float32).reshape(3, 5)).sum().backward()
    ref_grad_shard = torch.cat([ref_grad, torch.zeros(3, 5, padded - vocab, dtype=torch.float64)], -1)
    ref_grad_shard = ref_grad_shard.chunk(world, dim=-1)[rank]
    return loss.detach().double(), ref.detach(), shard.grad.double(), ref_grad_shard


def test_vocab_parallel_cross_entropy_matches_torch():
    """Vocab 131 is not divisible by TP=2: the padded column must not count. FP32 vs torch FP64: 1e-5."""
    for loss, ref, grad, ref_grad in run_distributed(_vocab_ce, 2, 131):
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
