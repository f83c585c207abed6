"""Muon updates started per bucket (``optimizer.muon_overlap``): bitwise the plain order's values.

References: the same optimizer without early updates (one process, same inputs), and torch.optim.Muon itself for
``MuonNS(ns="torch")``. Each comparison also checks that the early path was really taken (hits) or really
discarded (misses), so a silently disabled speculation cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg
from megatron_geo.optim import MuonNS

SHAPES = [(24, 40), (40, 24), (32, 32)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * (1 + step) for s in SHAPES]


@pytest.mark.parametrize("ns", ["quintic", "gram"])
def test_precomputed_update_is_bitwise_the_plain_step_and_clipping_invalidates_it(ns):
    plain_p, early_p = _params(0), _params(0)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    plain, early = MuonNS(plain_p, ns=ns, **kw), MuonNS(early_p, ns=ns, **kw)
    clip_steps = {2, 4}
    for step in range(6):
        for p, q, gr in zip(plain_p, early_p, _grads(step)):
            p.grad, q.grad = gr.clone(), gr.clone()
        assert early.precompute(early_p) == len(SHAPES)
        if step in clip_steps:  # the clip's in-place scale comes after the precompute
            for p, q in zip(plain_p, early_p):
                p.grad.mul_(0.5)
                q.grad.mul_(0.5)
        plain.step()
        early.step()
        for p, q in zip(plain_p, early_p):
            assert torch.equal(p, q), (ns, step)
            assert torch.equal(plain.state[p]["momentum_buffer"], early.state[q]["momentum_buffer"])
    assert early.precompute_hits == len(SHAPES) * (6 - len(clip_steps))
    assert early.precompute_misses == len(SHAPES) * len(clip_steps)


def test_precompute_changes_no_state_and_a_discarded_result_is_not_used():
    ps = _params(1)
    opt = MuonNS(ps, lr=0.02, weight_decay=0.0, momentum=0.9)
    for p, gr in zip(ps, _grads(0)):
        p.grad = gr
    before = [p.detach().clone() for p in ps]
    opt.precompute(ps)
    assert all(torch.equal(p, b) for p, b in zip(ps, before)) and len(opt.state) == 0
    opt.discard_precomputed()
    opt.step()
    assert opt.precompute_hits == 0 and opt.precompute_misses == len(SHAPES)


def test_torch_form_is_torch_muon_operation_for_operation():
    """``MuonNS(ns="torch")`` (the early-update optimizer where torch's Muon would run) equals torch.optim.Muon
    bitwise, with and without a precomputed update (BF16 Newton-Schulz, run on CPU on small matrices)."""
    ref_p, ours_p = _params(2), _params(2)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ref, ours = torch.optim.Muon(ref_p, **kw), MuonNS(ours_p, ns_dtype=torch.bfloat16, ns="torch", **kw)
    for step in range(3):
        for p, q, gr in zip(ref_p, ours_p, _grads(step)):
            p.grad, q.grad = gr.clone(), gr.clone()
        if step % 2:
            ours.precompute(ours_p)
        ref.step()
        ours.step()
        for p, q in zip(ref_p, ours_p):
            assert torch.equal(p, q), step
    assert ours.precompute_hits == len(SHAPES)


def _train(overlap: bool, clip: float, steps: int = 5):
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    cfg = tiny_cfg(
        "optimizer.name=muon", f"optimizer.muon_overlap={str(overlap).lower()}", f"optimizer.clip_grad={clip}"
    )
    pctx = pctx_for()
    model, _buckets, _reducer, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
    assert (grad_sync.early_updates is not None) == overlap
    ctx = StepContext(model, grad_sync, opt, pctx, clip, autocast_dtype="none")
    out = []
    for step in range(steps):
        mbs = rank_micro_batches(global_batch(cfg, step), cfg.train.micro_batch_size, pctx.dp_rank, pctx.dp_size)
        res = train_step(ctx, step, mbs)
        out.append((res.loss, res.grad_norm))
    params = [p.detach().clone() for p in model.parameters()]
    early = grad_sync.early_updates
    return out, params, (early.hits, early.misses) if early else (0, 0)


def _both(rank, world, clip):
    a = _train(False, clip)
    b = _train(True, clip)
    return a[0], b[0], all(torch.equal(x, y) for x, y in zip(a[1], b[1])), b[2]


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_training_with_early_muon_updates_is_bitwise_the_plain_order(world):
    """Tiny Llama, Muon, distributed optimizer (gloo), 5 steps: losses, gradient norms and final parameters are
    bitwise equal with and without early updates. With ``clip_grad`` between the steps' norms some steps clip
    (their early updates are discarded, the next step does not speculate) and others do not (early updates used);
    with no clipping every step after the first uses them."""
    for clip, expect_misses in ((0.0, False), (None, True)):
        if clip is None:  # a threshold inside the range of this run's norms
            norms = [n for _, n in run_distributed(_both, world, 0.0)[0][0]]
            clip = sorted(norms)[len(norms) // 2]
        for plain, early, same, (hits, misses) in run_distributed(_both, world, clip):
            assert plain == early, (world, clip)
            assert same, (world, clip)
            assert hits > 0, (world, clip, hits, misses)
            assert (misses > 0) == expect_misses, (world, clip, hits, misses)


def _train_cuda(overlap: bool, steps: int = 4):
    import torch.distributed as dist

    from megatron_geo.parallel import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    cfg = tiny_cfg("optimizer.name=muon", f"optimizer.muon_overlap={str(overlap).lower()}", "optimizer.clip_grad=0")
    pctx = build_groups(0, 1, 1, torch.device("cuda:0"), "nccl")
    torch.manual_seed(0)
    model, _, _, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
    assert grad_sync._stream is not None and (grad_sync.early_updates is not None) == overlap
    assert (grad_sync._ns_stream is not None) == overlap  # the early Newton-Schulz runs on a stream of its own
    ctx = StepContext(model, grad_sync, opt, pctx, 0.0)
    for step in range(steps):
        mbs = rank_micro_batches(global_batch(cfg, step), cfg.train.micro_batch_size, 0, 1)
        train_step(ctx, step, mbs)
    torch.cuda.synchronize()
    grad_sync.remove_hooks()
    return [p.detach().cpu() for p in model.parameters()], grad_sync.early_updates


# run in a fresh interpreter: CUBLAS_WORKSPACE_CONFIG only takes effect before the process's first cuBLAS handle.
# warn_only stays False: with warn_only=True torch keeps the nondeterministic backward of the flash and
# memory-efficient attention kernels (it only warns) and may still pick cuDNN attention, so two runs could differ
# in the attention gradients alone; strict mode makes those backwards deterministic (cuDNN attention is not
# chosen), and an op with no deterministic implementation raises, naming itself, instead of passing unnoticed.
_DETERMINISTIC_CUDA_RUNS = """
import json, sys
sys.path[:0] = sys.argv[1:3]
import torch
import test_early_muon as t

torch.use_deterministic_algorithms(True)
plain, _ = t._train_cuda(False)
again, _ = t._train_cuda(False)
early_params, early = t._train_cuda(True)
print(json.dumps({
    "plain_repeats_bitwise": all(torch.equal(a, b) for a, b in zip(plain, again)),
    "early_equals_plain_bitwise": all(torch.equal(a, b) for a, b in zip(plain, early_params)),
    "hits": early.hits,
    "misses": early.misses,
}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run benchmarks/gpu_check.sh on a GPU machine)")
def test_cuda_early_updates_in_the_side_stream_equal_torch_muon_after_backward():
    """On CUDA the early orthogonalisation runs on the gradient sync's Newton-Schulz stream, behind an event recorded
    after each bucket's decode, with torch.optim.Muon's own iteration; the parameters after 4 steps equal those of
    torch.optim.Muon run after the whole backward (the same kernels on another stream), and every step after the
    first used the early result.

    All three runs (plain, plain again, early) use deterministic algorithms in strict mode and cuBLAS workspaces
    (``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``), in a process of their own;
    the two plain runs must agree bitwise first, or a difference from the early run would say nothing about it. An op
    without a deterministic CUDA implementation makes the child fail with torch's error naming it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    r = subprocess.run(
        [sys.executable, "-c", _DETERMINISTIC_CUDA_RUNS, str(tests.parent), str(tests)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["plain_repeats_bitwise"], "two plain runs under deterministic algorithms differ"
    assert res["hits"] > 0 and res["misses"] == 0, res
    assert res["early_equals_plain_bitwise"], res
