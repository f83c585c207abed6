#!/usr/bin/env python
"""Tokens/s of megatron-geo's training step against a plain PyTorch DDP reference, side by side.

Both run in the same 2 gloo processes, on the same model (our Llama at TP=1, same init), the same
synthetic batches (global batch, micro batch, sequence length from the config) and the same number of
steps. The reference is the textbook loop: ``torch.nn.parallel.DistributedDataParallel`` (FP32
all-reduce, ``no_sync`` on all but the last micro-batch), ``torch.optim.AdamW``, clip_grad_norm_.
The two loops alternate in rounds so that machine noise hits both alike; the median step time is used.

    python benchmarks/throughput.py [--config configs/tiny.yaml] [--steps 20] [--rounds 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import run_gloo, synthetic_batches  # noqa: E402

from megatron_geo.config import load_config  # noqa: E402
from megatron_geo.model import Llama  # noqa: E402
from megatron_geo.parallel import build_groups  # noqa: E402
from megatron_geo.training.setup import build_model_and_optimizer  # noqa: E402
from megatron_geo.training.step import StepContext, train_step  # noqa: E402


def _ours(cfg, pctx, steps):
    model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad)
    times = []
    for s in range(steps + 1):
        mbs = synthetic_batches(cfg, pctx.dp_rank, pctx.dp_size, s)
        dist.barrier()
        t0 = time.perf_counter()
        train_step(ctx, s, mbs)
        times.append(time.perf_counter() - t0)
    sync.remove_hooks()
    return times[1:], reducer.reset_bytes() / (steps + 1)


def _reference(cfg, pctx, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Llama(cfg.model, pctx.tp_group, cfg.train.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    times = []
    for s in range(steps + 1):
        mbs = synthetic_batches(cfg, pctx.dp_rank, pctx.dp_size, s)
        dist.barrier()
        t0 = time.perf_counter()
        for i, mb in enumerate(mbs):
            ctx = model.no_sync() if i < len(mbs) - 1 else torch.enable_grad()
            with ctx:
                (model(mb["tokens"], mb["labels"]).mean() / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _worker(rank, world, args):
    cfg = load_config(args.config, ["logging.wandb=disabled"] + args.overrides)
    pctx = build_groups(rank, world, 1, torch.device("cpu"), "gloo")
    ours, ref, sent = [], [], 0.0
    for _ in range(args.rounds):
        t, sent = _ours(cfg, pctx, args.steps)
        ours += t
        ref += _reference(cfg, pctx, args.steps)
    return (ours, ref, sent)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    args.config = args.config or ["configs/tiny.yaml"]
    if not any(o.startswith("comm.dtype=") for o in args.overrides):
        args.overrides.append("comm.dtype=bf16")
    cfg = load_config(args.config, args.overrides)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    ours, ref, sent = run_gloo(_worker, args.nproc, args)
    mo, mr = statistics.median(ours), statistics.median(ref)
    print(
        f"config: {' '.join(args.config)} {' '.join(args.overrides)} | {args.nproc} DP processes (gloo, CPU), "
        f"global batch {cfg.train.global_batch_size} x seq {cfg.model.seq_length} = {tokens} tokens/step, "
        f"{args.rounds} rounds x {args.steps} steps each"
    )
    print(
        f"megatron-geo ({cfg.comm.dtype} reducer, distributed_optimizer={cfg.parallel.distributed_optimizer}): "
        f"median step {mo * 1e3:8.1f} ms  {tokens / mo:10,.0f} tokens/s  ({sent:,.0f} grad bytes sent/step/rank)"
    )
    print(
        f"plain PyTorch DDP (fp32 all-reduce, AdamW):          "
        f"median step {mr * 1e3:8.1f} ms  {tokens / mr:10,.0f} tokens/s"
    )
    print(f"ratio megatron-geo / DDP tokens/s: {mr / mo:.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
