#!/usr/bin/env python
"""GeoFP8's cost over Euclidean FP8 of the same dtype and scaling, measured side by side in one run.

Step time: the tiny config (or any config + overrides) with ``--nproc`` gloo processes, alternating
rounds of ``fp8`` (E4M3, tensor scaling, error feedback) and ``geofp8`` (the same plus
``comm.transform=geo``), each round ``--steps`` steps so that refresh and non-refresh steps are both
averaged in (``geo.refresh_interval`` is set to ``--refresh-interval``). Prints the mean step time of
each, the added time in percent of the fp8 step, and the time of refresh steps alone.

Memory: bytes of GeoFP8 state (U and D of every selected layer, plus the K-FAC factors held
transiently during a refresh) against the training memory of the model (FP32 params, FP32 main grads,
FP32 main params, two FP32 optimizer moments), computed from the shapes of ``--memory-config``.

    python benchmarks/geo_overhead.py [--config configs/tiny.yaml] [--steps 20] [--rounds 2] [key=value ...]
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
from megatron_geo.parallel import build_groups  # noqa: E402
from megatron_geo.training.step import train_step  # noqa: E402
from megatron_geo.training.trainer import build_model_and_optimizer  # noqa: E402

MODES = {"fp8": ["comm.dtype=fp8_e4m3", "comm.error_feedback=true"],
         "geofp8": ["comm.dtype=fp8_e4m3", "comm.error_feedback=true", "comm.transform=geo"]}


def _run_mode(args, mode, pctx):
    cfg = load_config(args.config, ["logging.wandb=disabled", f"geo.refresh_interval={args.refresh_interval}"]
                      + args.overrides + MODES[mode])
    model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    geo = getattr(reducer, "geo", None)
    times, refresh_times = [], []
    for s in range(args.steps + 1):
        mbs = synthetic_batches(cfg, pctx.dp_rank, pctx.dp_size, s)
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, mbs, sync, opt, pctx, 1.0, 1.0, geo=geo, step=s)
        dt = time.perf_counter() - t0
        if s == 0:
            continue  # warm-up (and the first refresh is also at s=0 for geo: measured below)
        times.append(dt)
        if geo is not None and geo.last_refresh == s:
            refresh_times.append(dt)
    sync.remove_hooks()
    return times, refresh_times


def _worker(rank, world, args):
    pctx = build_groups(rank, world, 1, torch.device("cpu"), "gloo")
    res = {m: ([], []) for m in MODES}
    for _ in range(args.rounds):
        for m in MODES:
            t, r = _run_mode(args, m, pctx)
            res[m][0].extend(t)
            res[m][1].extend(r)
    return res


def geo_memory(cfg) -> dict:
    """GeoFP8 state bytes vs training memory for the selected layers of ``cfg`` (TP=1, DP=1 worst case)."""
    from megatron_geo.model import count_parameters
    import fnmatch

    h, f, L = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_layers
    shapes = {}
    for i in range(L):
        hd = h // cfg.model.num_attention_heads
        for name, shape in (("attn.q_proj", (cfg.model.num_attention_heads * hd, h)),
                            ("attn.k_proj", (cfg.model.num_kv_heads * hd, h)),
                            ("attn.v_proj", (cfg.model.num_kv_heads * hd, h)),
                            ("attn.o_proj", (h, cfg.model.num_attention_heads * hd)),
                            ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)), ("mlp.down_proj", (h, f))):
            shapes[f"layers.{i}.{name}.weight"] = shape
    pats = [p.strip() for p in cfg.geo.layers.split(",")]
    sel = {n: s for n, s in shapes.items() if any(fnmatch.fnmatchcase(n, p) for p in pats)}
    r = cfg.geo.rank
    persistent = sum(4 * (s[1] * r + r) for s in sel.values())
    g = cfg.geo

    def factor_bytes(d_in):  # what InputStats holds per layer during a refresh (geo.statistics)
        sketch = g.statistics == "sketch" or (g.statistics == "auto" and d_in > 1024 and d_in > 4 * g.sketch_size)
        return 4 * d_in * (min(g.sketch_size, d_in) if sketch else d_in)

    transient = sum(factor_bytes(s[1]) for s in sel.values())
    n = count_parameters(cfg.model)
    training = 4 * n * 5  # params, main grads, main params, two optimizer moments (FP32)
    return {"layers": len(sel), "persistent_bytes": persistent, "refresh_transient_bytes": transient,
            "training_bytes_excl_activations": training, "parameters": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--refresh-interval", type=int, default=10)
    p.add_argument("--memory-config", default="configs/llama_300m.yaml")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    args.config = args.config or ["configs/tiny.yaml"]
    res = run_gloo(_worker, args.nproc, args)
    fp8, geo = statistics.mean(res["fp8"][0]), statistics.mean(res["geofp8"][0])
    print(f"config: {' '.join(args.config)} {' '.join(args.overrides)} | {args.nproc} DP processes (gloo, CPU) | "
          f"{args.rounds} rounds x {args.steps} steps, geo.refresh_interval={args.refresh_interval}")
    print(f"fp8    (E4M3 tensor + EF)       mean step {fp8 * 1e3:8.1f} ms")
    print(f"geofp8 (same + transform=geo)   mean step {geo * 1e3:8.1f} ms   added {100 * (geo - fp8) / fp8:+.2f}% "
          f"of the fp8 step (target <= 1%)")
    if res["geofp8"][1]:
        print(f"  refresh steps alone: mean {statistics.mean(res['geofp8'][1]) * 1e3:.1f} ms "
              f"({len(res['geofp8'][1])} refreshes)")
    cfg = load_config([args.memory_config])
    mem = geo_memory(cfg)
    print(f"memory ({args.memory_config}, {mem['parameters']:,} parameters, {mem['layers']} GeoFP8 layers, "
          f"rank {cfg.geo.rank}, geo.statistics={cfg.geo.statistics}): persistent state {mem['persistent_bytes'] / 2**20:.1f} MiB = "
          f"{100 * mem['persistent_bytes'] / mem['training_bytes_excl_activations']:.3f}% of "
          f"{mem['training_bytes_excl_activations'] / 2**30:.2f} GiB training state (FP32 params, grads, main params, "
          f"2 moments; activations excluded, so the true share is lower); K-FAC factors during a refresh "
          f"{mem['refresh_transient_bytes'] / 2**20:.1f} MiB = "
          f"{100 * mem['refresh_transient_bytes'] / mem['training_bytes_excl_activations']:.2f}% (transient)")


if __name__ == "__main__":
    main()
