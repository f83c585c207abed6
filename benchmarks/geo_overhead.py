#!/usr/bin/env python
"""GeoFP8's cost over Euclidean FP8 of the same dtype and scaling, measured side by side in one run.

Step time: the tiny config (or any config + overrides) with ``--nproc`` gloo processes, alternating
rounds of ``fp8`` (E4M3, tensor scaling, error feedback) and ``geofp8`` (the same plus
``comm.transform=geo``), each round ``--steps`` steps so that refresh and non-refresh steps are both
averaged in (``geo.refresh_interval`` is set to ``--refresh-interval``). Prints:

- end to end: the mean step time of each mode and the added time in percent of the fp8 step;
- GeoFP8's own work, timed inside the geofp8 steps (low noise: only that code is on the clock): the
  transform into and out of wire coordinates in the reducer (minus the same hooks' time in the fp8
  steps), the refresh (statistics reduce, eigendecomposition, broadcast, power search, checksum, error
  feedback re-basing; timed after a barrier, so the skew between ranks arriving from backward is not
  booked to it) and the statistics hooks of refresh-step forwards; per step and in percent of the
  fp8 step. Not on that clock: the overlap lost on refresh steps, whose bucket reductions wait for the
  end of backward (in the end-to-end figure);
- the per-step transform FLOPs against the model's (``(4 + 4 / dp) d_out d_in r`` per selected layer vs
  ``6 N tokens``), which sets the ratio on any hardware.

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

from bench_common import WorkerError, run_gloo, synthetic_batches  # noqa: E402

from megatron_geo.config import ConfigError, load_config  # noqa: E402
from megatron_geo.parallel import build_groups  # noqa: E402
from megatron_geo.training.setup import build_model_and_optimizer  # noqa: E402
from megatron_geo.training.step import StepContext, train_step  # noqa: E402
from megatron_geo.training.validate import validate_config  # noqa: E402

MODES = {
    "fp8": ["comm.dtype=fp8_e4m3", "comm.error_feedback=true"],
    "geofp8": ["comm.dtype=fp8_e4m3", "comm.error_feedback=true", "comm.transform=geo"],
}


class _Clock:
    """Accumulates the wall time spent inside wrapped callables (seconds, this process)."""

    def __init__(self):
        self.total = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t0

        return timed


def _instrument(reducer, geo, dp_group) -> dict:
    """Clocks on the reducer's coordinate transform (to and from the wire coordinates) and, with GeoFP8, on the
    refresh and statistics hooks."""
    clocks = {"wire": _Clock(), "refresh": _Clock(), "hooks": _Clock()}
    transform = reducer.transform
    transform.to_wire = clocks["wire"].wrap(transform.to_wire)
    transform.from_wire = clocks["wire"].wrap(transform.from_wire)
    if geo is not None:
        timed = clocks["refresh"].wrap(geo.refresh)

        def refresh(step):
            dist.barrier(group=dp_group)  # off the clock: ranks arrive unevenly from backward, and that
            return timed(step)  # wait would otherwise be booked to the refresh's first collective

        geo.refresh = refresh
        make = geo.stats._hook
        geo.stats._hook = lambda name: clocks["hooks"].wrap(make(name))
    return clocks


def _transform_flops(model, geo, rank: int, dp: int) -> float:
    """FLOPs per step of GeoFP8's transforms: G T on every selected gradient (4 d_out d_in r), T^-1 on
    this rank's share of them (4 d_out d_in r / dp)."""
    if geo is None:
        return 0.0
    return sum((4 + 4 / dp) * p.shape[0] * p.shape[1] * rank for p in geo.params.values())


def _mode_config(args, mode):
    """The resolved config of ``mode``: the mode's comm keys first, so the user's overrides win."""
    return load_config(
        args.config,
        ["logging.wandb=disabled", f"geo.refresh_interval={args.refresh_interval}"] + MODES[mode] + args.overrides,
    )


def _label(cfg) -> str:
    c = cfg.comm
    scaling = "tensor" if c.scaling == "tensor" else f"block {c.block_size}"
    return f"{c.dtype} {scaling}{' + EF' if c.error_feedback else ''}{' + geo' if c.transform == 'geo' else ''}"


def _run_mode(args, mode, pctx):
    cfg = _mode_config(args, mode)
    model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    geo = reducer.geo
    clocks = _instrument(reducer, geo, pctx.dp_group)
    ctx = StepContext(model, sync, opt, pctx, 1.0, geo=geo)
    times, refresh_times, parts = [], [], {k: [] for k in clocks}
    for s in range(args.steps + 1):
        mbs = synthetic_batches(cfg, pctx.dp_rank, pctx.dp_size, s)
        dist.barrier()
        before = {k: c.total for k, c in clocks.items()}
        t0 = time.perf_counter()
        train_step(ctx, s, mbs)
        dt = time.perf_counter() - t0
        if s == 0:
            continue  # warm-up (and the first refresh is also at s=0 for geo: measured below)
        times.append(dt)
        for k, c in clocks.items():
            parts[k].append(c.total - before[k])
        if geo is not None and geo.last_refresh == s:
            refresh_times.append(dt)
    sync.remove_hooks()
    tokens = cfg.train.global_batch_size // pctx.dp_size * cfg.model.seq_length
    from megatron_geo.model import count_parameters

    model_flops = 6.0 * count_parameters(cfg.model) * tokens
    return (
        times,
        refresh_times,
        parts,
        {
            "transform_flops": _transform_flops(model, geo, cfg.geo.rank, pctx.dp_size),
            "model_flops": model_flops,
            "tokens_per_rank": tokens,
        },
    )


def _worker(rank, world, args):
    pctx = build_groups(rank, world, 1, torch.device("cpu"), "gloo")
    res = {m: ([], [], {"wire": [], "refresh": [], "hooks": []}, {}) for m in MODES}
    for _ in range(args.rounds):
        for m in MODES:
            t, r, parts, flops = _run_mode(args, m, pctx)
            res[m][0].extend(t)
            res[m][1].extend(r)
            for k, v in parts.items():
                res[m][2][k].extend(v)
            res[m][3].update(flops)
    # the slowest rank sets the pace: report the per-step maximum over ranks of GeoFP8's own work
    for m in MODES:
        for k, v in res[m][2].items():
            t = torch.tensor(v, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res[m][2][k] = t.tolist()
    return res


def geo_memory(cfg) -> dict:
    """GeoFP8 state bytes vs training memory for the selected layers of ``cfg`` (TP=1, DP=1 worst case)."""
    import fnmatch

    from megatron_geo.model import count_parameters

    h, f, L = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_layers
    shapes = {}
    for i in range(L):
        hd = h // cfg.model.num_attention_heads
        for name, shape in (
            ("attn.q_proj", (cfg.model.num_attention_heads * hd, h)),
            ("attn.k_proj", (cfg.model.num_kv_heads * hd, h)),
            ("attn.v_proj", (cfg.model.num_kv_heads * hd, h)),
            ("attn.o_proj", (h, cfg.model.num_attention_heads * hd)),
            ("mlp.gate_proj", (f, h)),
            ("mlp.up_proj", (f, h)),
            ("mlp.down_proj", (h, f)),
        ):
            shapes[f"layers.{i}.{name}.weight"] = shape
    pats = [p.strip() for p in cfg.geo.layers.split(",")]
    sel = {n: s for n, s in shapes.items() if any(fnmatch.fnmatchcase(n, p) for p in pats)}
    r = cfg.geo.rank
    persistent = sum(4 * (s[1] * r + r) for s in sel.values())
    g = cfg.geo

    def factor_bytes(d_in):  # what InputStats holds per layer during a refresh (geo.statistics)
        sketch = g.statistics == "sketch" or (g.statistics == "auto" and d_in > 4 * g.sketch_size)
        return 4 * d_in * (min(g.sketch_size, d_in) if sketch else d_in)

    transient = sum(factor_bytes(s[1]) for s in sel.values())
    n = count_parameters(cfg.model)
    training = 4 * n * 5  # params, main grads, main params, two optimizer moments (FP32)
    return {
        "layers": len(sel),
        "persistent_bytes": persistent,
        "refresh_transient_bytes": transient,
        "training_bytes_excl_activations": training,
        "parameters": n,
    }


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
    for name in ("steps", "rounds", "nproc", "refresh_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    try:  # every config error before any worker starts
        cfgs = {m: _mode_config(args, m) for m in MODES}
        for c in cfgs.values():
            validate_config(c, args.nproc)
        if cfgs["geofp8"].comm.transform != "geo":
            raise ConfigError("the overrides turn comm.transform=geo off in the geofp8 mode; drop comm.transform")
        mem_cfg = load_config([args.memory_config])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        res = run_gloo(_worker, args.nproc, args)
    except WorkerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    fp8, geo = statistics.mean(res["fp8"][0]), statistics.mean(res["geofp8"][0])
    print(
        f"config: {' '.join(args.config)} {' '.join(args.overrides)} | {args.nproc} DP processes (gloo, CPU) | "
        f"{args.rounds} rounds x {args.steps} steps, geo.refresh_interval={args.refresh_interval}"
    )
    print(f"fp8    ({_label(cfgs['fp8'])})".ljust(32) + f" mean step {fp8 * 1e3:8.1f} ms")
    print(
        f"geofp8 ({_label(cfgs['geofp8'])})".ljust(32) + f" mean step {geo * 1e3:8.1f} ms   added "
        f"{100 * (geo - fp8) / fp8:+.2f}% of the fp8 step (target <= 1%)"
    )
    if res["geofp8"][1]:
        print(
            f"  refresh steps alone: mean {statistics.mean(res['geofp8'][1]) * 1e3:.1f} ms "
            f"({len(res['geofp8'][1])} refreshes)"
        )
    gp, fp = res["geofp8"][2], res["fp8"][2]
    wire = statistics.mean(gp["wire"]) - statistics.mean(fp["wire"])
    refresh, hooks = statistics.mean(gp["refresh"]), statistics.mean(gp["hooks"])
    own = wire + refresh + hooks
    print(
        f"GeoFP8's own work per step, timed inside the geofp8 steps (max over ranks, mean over steps): "
        f"{own * 1e3:.2f} ms = {100 * own / fp8:+.2f}% of the fp8 step (target <= 1%)"
    )
    print(
        f"  transforms in the reducer {wire * 1e3:.2f} ms ({100 * wire / fp8:.2f}%), refresh {refresh * 1e3:.2f} ms "
        f"({100 * refresh / fp8:.2f}%; {max(gp['refresh']) * 1e3:.1f} ms per refresh), statistics hooks "
        f"{hooks * 1e3:.2f} ms ({100 * hooks / fp8:.2f}%)"
    )
    n_ref = max(len(res["geofp8"][1]), 1)
    per_refresh = (sum(gp["refresh"]) + sum(gp["hooks"])) / n_ref
    for k in sorted({args.refresh_interval, 50}):
        proj = wire + per_refresh / k
        print(
            f"  at geo.refresh_interval={k}: transforms + (refresh + hooks) / {k} = {proj * 1e3:.2f} ms = "
            f"{100 * proj / fp8:+.2f}% of the fp8 step"
        )
    fl = res["geofp8"][3]
    print(
        f"  transform FLOPs per step {fl['transform_flops'] / 1e9:.3f} GFLOP vs model {fl['model_flops'] / 1e9:.1f} "
        f"GFLOP ({fl['tokens_per_rank']} tokens per rank): {100 * fl['transform_flops'] / fl['model_flops']:.2f}% "
        f"(falls as 1 / tokens per rank)"
    )
    cfg = mem_cfg
    mem = geo_memory(cfg)
    print(
        f"memory ({args.memory_config}, {mem['parameters']:,} parameters, {mem['layers']} GeoFP8 layers, "
        f"rank {cfg.geo.rank}, geo.statistics={cfg.geo.statistics}): "
        f"persistent state {mem['persistent_bytes'] / 2**20:.1f} MiB = "
        f"{100 * mem['persistent_bytes'] / mem['training_bytes_excl_activations']:.3f}% of "
        f"{mem['training_bytes_excl_activations'] / 2**30:.2f} GiB training state (FP32 params, grads, main params, "
        f"2 moments; activations excluded, so the true share is lower); K-FAC factors during a refresh "
        f"{mem['refresh_transient_bytes'] / 2**20:.1f} MiB = "
        f"{100 * mem['refresh_transient_bytes'] / mem['training_bytes_excl_activations']:.2f}% (transient)"
    )


if __name__ == "__main__":
    main()
