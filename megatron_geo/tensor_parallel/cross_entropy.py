"""Cross entropy over vocab-sharded logits without gathering them (Megatron's vocab-parallel CE).

Math (per token, logits z over the full vocab V, target t): loss = log sum_j exp(z_j - m) - (z_t - m)
with m = max_j z_j; each reduction over j is a local reduction plus an all-reduce over the TP group.
Gradient: softmax(z) - onehot(t). Padded vocab columns (index >= ``vocab_size``) are excluded, so the
result equals ``torch.nn.functional.cross_entropy`` over the true vocab.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import collectives as C


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        logits = logits.float()
        n_local = logits.shape[-1]
        if vocab_start + n_local > vocab_size:  # this shard holds padded columns (decided on the host)
            cols = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)
            logits = logits.masked_fill(cols >= vocab_size, torch.finfo(logits.dtype).min)
        m = logits.max(dim=-1).values
        if dist.get_world_size(group) > 1:
            C.all_reduce(m, group, op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        in_range = (target >= vocab_start) & (target < vocab_start + n_local)
        local_t = (target - vocab_start).clamp(0, n_local - 1)
        t_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * in_range
        if dist.get_world_size(group) > 1:
            stacked = torch.stack([sum_exp, t_logit])
            C.all_reduce(stacked, group)
            sum_exp, t_logit = stacked[0], stacked[1]
        loss = sum_exp.log() - t_logit
        ctx.save_for_backward(exp, sum_exp, local_t, in_range)
        return loss

    @staticmethod
    def backward(ctx, g):
        exp, sum_exp, local_t, in_range = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -in_range.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """Per-token loss (nats, float32) from this rank's logit shard.

    Args:
        logits: ``[..., padded_vocab / tp]`` this rank's slice (rank r holds columns
            ``r * n .. (r + 1) * n - 1``); any float dtype, computed in float32.
        target: int64 ``[...]`` token ids in ``[0, vocab_size)``.
        vocab_size: the true vocab; columns at or beyond it are padding and excluded.
        group: the TP process group.

    Returns:
        float32 ``[...]`` per-token loss, identical on all TP ranks.
    """
    start = dist.get_rank(group) * logits.shape[-1]
    return _VocabParallelCE.apply(logits, target, start, vocab_size, group)
