#!/usr/bin/env python
"""Phases of benchmarks/gpu_check.sh; each writes one JSON object to ``--out``.

    python benchmarks/gpu_check.py env     --out env.json
    python benchmarks/gpu_check.py codec   --out codec.json  [--dry-run]
    python benchmarks/gpu_check.py geo     --out geo.json    [--dry-run]
    python benchmarks/gpu_check.py train   --out train_300m.json --config configs/llama_300m.yaml [--dry-run]
    python benchmarks/gpu_check.py merge   --out gpu_check.json part1.json part2.json ...

Without CUDA every phase needs ``--dry-run``: it then runs the same code on the CPU with small sizes (so
the script itself is tested) and records ``"skipped": "<reason>"`` for the CUDA figures.

Units: GB/s = 1e9 bytes of FP32 input per second; ``ratio_to_copy`` = GB/s / GB/s of a device-to-device
``copy_`` of the same buffer in the same run; tokens/s counts the tokens of the global batch; peak memory
in GiB (``torch.cuda.max_memory_allocated``); TFLOP/s and MFU from :mod:`megatron_geo.training.mfu`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

NO_CUDA = "CUDA is not available on this machine"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_ops(ops: dict, repeats: int, dev: torch.device) -> dict[str, float]:
    """Median seconds per call of every op, timed round-robin after one warm-up call each."""
    times = {k: [] for k in ops}
    for rep in range(repeats + 1):
        for name, fn in ops.items():
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def phase_env(args) -> dict:
    cuda = torch.cuda.is_available()
    out = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "cuda_available": cuda}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=p.total_memory / 2**30,
                   cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}", nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:
        import transformer_engine  # noqa: F401
        out["transformer_engine"] = getattr(transformer_engine, "__version__", "importable")
    except Exception as e:  # noqa: BLE001
        out["transformer_engine"] = f"not importable ({type(e).__name__})"
    return out


def _device(args) -> tuple[torch.device, str | None]:
    if torch.cuda.is_available() and not args.dry_run:
        return torch.device("cuda", 0), None
    if not args.dry_run:
        raise SystemExit(f"error: {NO_CUDA}; run with --dry-run to exercise the script on the CPU")
    return torch.device("cpu"), (NO_CUDA if not torch.cuda.is_available() else "--dry-run") + \
        ": ran on the CPU with small sizes instead"


def phase_codec(args) -> dict:
    from codec_kernels import make_ops

    dev, skipped = _device(args)
    numel = args.numel if skipped is None else 1 << 18
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dev)
    med = _time_ops(make_ops(x, torch.empty_like(x)), args.repeats if skipped is None else 2, dev)
    nbytes = 4 * numel
    copy = nbytes / med["copy"] / 1e9
    rows = {k: {"ms": v * 1e3, "gbps": nbytes / v / 1e9, "ratio_to_copy": nbytes / v / 1e9 / copy} for k, v in med.items()}
    return {"device": str(dev), "numel": numel, "ops": rows, "skipped": skipped}


def phase_geo(args) -> dict:
    """GeoFP8's extra work per selected layer (G T before encoding, G^ T^-1 after decoding) on the
    gradient shapes of the MLP down projections, next to the FP8 round trip and a copy of the same gradient."""
    from megatron_geo.comm.codecs import fp8_decode, fp8_encode, fp8_scale_from_amax
    from megatron_geo.config import load_config
    from megatron_geo.geometry.transform import build_transform

    dev, skipped = _device(args)
    out = {"device": str(dev), "skipped": skipped, "layers": {}}
    for cfg_path in (["configs/tiny.yaml"] if skipped else ["configs/llama_300m.yaml", "configs/llama_600m.yaml"]):
        cfg = load_config([cfg_path])
        d_out, d_in, r = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.geo.rank
        gen = torch.Generator().manual_seed(1)
        a = torch.randn(4 * d_in, d_in, generator=gen)
        A = (a.T @ a / a.shape[0]).to(dev)
        T = build_transform(A, r, cfg.geo.damping)
        g = torch.randn(d_out, d_in, generator=gen).to(dev)
        dst = torch.empty_like(g)

        def fp8_rt():
            s = fp8_scale_from_amax(g.abs().amax(), "fp8_e4m3")
            return fp8_decode(fp8_encode(g, s, "fp8_e4m3"), s, "fp8_e4m3")

        def geo_rt():
            gt = T.apply(g)
            s = fp8_scale_from_amax(gt.abs().amax(), "fp8_e4m3")
            return T.apply_inverse(fp8_decode(fp8_encode(gt, s, "fp8_e4m3"), s, "fp8_e4m3"))

        ops = {"copy": lambda: dst.copy_(g), "fp8_e4m3 round trip": fp8_rt, "transform G T": lambda: T.apply(g),
               "inverse G T^-1": lambda: T.apply_inverse(g), "geofp8 round trip": geo_rt}
        med = _time_ops(ops, args.repeats if skipped is None else 2, dev)
        nbytes = 4 * g.numel()
        copy = nbytes / med["copy"] / 1e9
        rel = (geo_rt() - g).norm() / g.norm()
        out["layers"][os.path.basename(cfg_path)] = {
            "shape": [d_out, d_in], "rank": r,
            "ops": {k: {"ms": v * 1e3, "gbps": nbytes / v / 1e9, "ratio_to_copy": nbytes / v / 1e9 / copy}
                    for k, v in med.items()},
            "geo_added_ms_per_layer": (med["geofp8 round trip"] - med["fp8_e4m3 round trip"]) * 1e3,
            "geofp8_rel_l2": float(rel)}
    return out


def phase_train(args) -> dict:
    """A few optimizer steps of a config on one device with synthetic tokens: tokens/s, peak memory, MFU."""
    import torch.distributed as dist

    from bench_common import synthetic_batches
    from megatron_geo.config import load_config
    from megatron_geo.model import count_parameters, flops_per_token
    from megatron_geo.parallel import init_parallel
    from megatron_geo.parallel.launch_env import LaunchEnv
    from megatron_geo.training.mfu import gpu_flops_metrics
    from megatron_geo.training.step import train_step
    from megatron_geo.training.trainer import build_model_and_optimizer

    dev, skipped = _device(args)
    overrides = ["logging.wandb=disabled", f"train.global_batch_size={args.global_batch}",
                 f"train.micro_batch_size={args.micro_batch}"]
    if skipped:  # the same code path with a model the CPU runs in seconds
        overrides += ["model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=128",
                      "model.seq_length=64", "model.vocab_size=512", "train.global_batch_size=4",
                      "train.micro_batch_size=2", "optimizer.muon_ns_dtype=fp32"]
    cfg = load_config([args.config] + (["configs/comm/" + args.comm + ".yaml"] if args.comm else []),
                      overrides + args.overrides)
    env = LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single")
    pctx = init_parallel(1, dev.type, "auto", env=env)
    t_build = time.perf_counter()
    model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
    if args.compile:
        from megatron_geo.model.compile import compile_blocks

        compile_blocks(model, backend="inductor" if dev.type == "cuda" else "eager")
    build_s = time.perf_counter() - t_build
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, losses = [], []
    steps = args.steps if skipped is None else 2
    for s in range(steps + 1):
        mbs = synthetic_batches(cfg, 0, 1, s)
        _sync(dev)
        t0 = time.perf_counter()
        res = train_step(model, mbs, sync, opt, pctx, 1.0, cfg.optimizer.clip_grad, cfg.train.autocast_dtype)
        _sync(dev)
        if s:
            times.append(time.perf_counter() - t0)
        losses.append(res.loss)
    sync.remove_hooks()
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    tps = tokens / statistics.median(times)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    m = gpu_flops_metrics(tps, 1, flops_per_token(cfg.model), name)
    out = {"config": args.config, "comm": args.comm or cfg.comm.dtype, "device": str(dev), "skipped": skipped,
           "parameters": count_parameters(cfg.model), "seq_length": cfg.model.seq_length,
           "global_batch": cfg.train.global_batch_size, "micro_batch": cfg.train.micro_batch_size,
           "optimizer": cfg.optimizer.name, "compile": args.compile, "build_s": build_s,
           "timed_steps": len(times), "step_time_s_median": statistics.median(times), "tokens_per_sec": tps,
           "tflops_per_gpu": m["tflops_per_gpu"], "mfu": m["mfu"], "peak_tflops": m["peak_tflops"],
           "first_loss": losses[0], "last_loss": losses[-1]}
    if dev.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    dist.destroy_process_group()
    return out


def phase_merge(args) -> dict:
    out = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dry_run": args.dry_run}
    for path in args.parts:
        key = os.path.splitext(os.path.basename(path))[0]
        try:
            with open(path) as f:
                out[key] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=["env", "codec", "geo", "train", "merge"])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="no CUDA needed: run on the CPU with small sizes")
    p.add_argument("--numel", type=int, default=64 * 2**20, help="codec: FP32 elements (default 64M = 256 MiB)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--config", default="configs/llama_300m.yaml")
    p.add_argument("--comm", default="", help="train: a configs/comm preset name (default: the config's own)")
    p.add_argument("--steps", type=int, default=5, help="train: timed steps after one warm-up step")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--compile", action="store_true", help="train: torch.compile every transformer block")
    p.add_argument("overrides", nargs="*", help="train: dotted key=value overrides; merge: the part files")
    args = p.parse_intermixed_args(argv)
    if args.phase == "merge":
        args.parts, args.overrides = args.overrides, []
    t0 = time.perf_counter()
    result = {"env": phase_env, "codec": phase_codec, "geo": phase_geo, "train": phase_train,
              "merge": phase_merge}[args.phase](args)
    if args.phase != "merge":
        result["phase_seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, allow_nan=False, default=str)
    if result.get("skipped"):
        print(f"[gpu_check] {args.phase}: CUDA part skipped: {result['skipped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
