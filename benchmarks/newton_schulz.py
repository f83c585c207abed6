#!/usr/bin/env python
"""Newton-Schulz time per step on CPU, quintic against Gram (``optimizer.muon_ns``), side by side in one run.

For each config (default: configs/tiny.yaml and configs/llama_600m.yaml, both with ``optimizer.name=muon``) the
Muon matrices are those the trainer gives Muon (2-D weights inside the blocks, shapes from the model built on the
meta device). Each distinct shape is orthogonalised in FP32 (5 quintic steps, torch.optim.Muon's coefficients)
by both forms, alternating quintic and Gram in every repeat so machine noise hits both alike. The table uses the
fastest repeat (load on the shared machine only adds time; the medians are in the JSON too). A square matrix runs
the quintic under both settings (``MuonNS`` uses the Gram form on rectangular matrices only), so its repeats of
both are pooled into one figure, marked ``=``.
Per step = the sum over the model's Muon matrices. One intra-op thread by default (``--threads``): on the
shared 2-core machine two OpenMP threads spin against each other and a 128x384 orthogonalisation took 100x
longer. For a config with more than ``--max-layers-timed`` layers only layer 0 is timed and the sum is
multiplied by ``num_layers`` (every layer has the same shapes); the output says so.

The Newton-Schulz share of a step is measured for the tiny config: fastest of whole CPU training steps
(DP = 1, one process, synthetic batches, :func:`megatron_geo.training.step.train_step`) with each form. Multiply-add
counts per matrix are analytic (wide orientation ``m <= n``; quintic ``5 (2 m^2 n + m^3)``; Gram with its one
restart ``4 m^2 n + 14 m^3``; square matrices use the quintic in both, as ``MuonNS`` does).

    python benchmarks/newton_schulz.py [--repeats 3] [--tiny-repeats 20] [--step-repeats 8]
        [--out docs/bench/newton_schulz_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import synthetic_batches  # noqa: E402

from megatron_geo.analysis.plan_report import meta_model_params  # noqa: E402
from megatron_geo.config import load_config  # noqa: E402
from megatron_geo.optim.muon import NS_CHOICES, orthogonalize  # noqa: E402

COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
STEPS = 5
EPS = 1e-7


def muon_shapes(cfg) -> list[tuple[str, tuple[int, int]]]:
    """``(name, shape)`` of every Muon matrix of ``cfg``'s model (TP = 1), registration order."""
    return [(n, s) for n, s, use in meta_model_params(cfg).infos if use]  # type: ignore[misc]


def macs(shape: tuple[int, int], ns: str) -> int:
    """Multiply-adds of one orthogonalisation of a ``shape`` matrix by ``ns`` (see the module docstring)."""
    m, n = min(shape), max(shape)
    if ns == "gram" and m != n:
        return 4 * m * m * n + 14 * m**3
    return STEPS * (2 * m * m * n + m**3)


def time_shapes(shapes: list[tuple[int, int]], repeats: int, seed: int = 0) -> dict[tuple[int, int], dict]:
    """Seconds of each distinct shape's orthogonalisation, quintic and Gram alternating per repeat:
    ``{shape: {"quintic": min, "gram": min, "median": {"quintic": ..., "gram": ...}}}`` (square: pooled)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for shape in sorted(set(shapes)):
        u = torch.randn(*shape, generator=gen)
        t: dict[str, list[float]] = {ns: [] for ns in NS_CHOICES}
        if u.numel() < 1 << 20:  # warm-up (allocator, caches) where one call is short
            for ns in t:
                orthogonalize(u, ns, COEFFS, STEPS, EPS, torch.float32)
        for _ in range(repeats):
            for ns in t:
                t0 = time.perf_counter()
                orthogonalize(u, ns, COEFFS, STEPS, EPS, torch.float32)
                t[ns].append(time.perf_counter() - t0)
        if shape[0] == shape[1]:  # the same computation under both settings
            t = {ns: t["quintic"] + t["gram"] for ns in t}
        out[shape] = {ns: min(v) for ns, v in t.items()}
        out[shape]["median"] = {ns: statistics.median(v) for ns, v in t.items()}
    return out


def step_times(config: str, repeats: int) -> dict[str, float]:
    """Fastest of ``repeats`` whole CPU training steps (DP = 1) of ``config`` under Muon, seconds, per ``muon_ns``."""
    from megatron_geo.parallel import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pctx = build_groups(0, 1, 1, torch.device("cpu"), "gloo")
    runs = {}
    for ns in NS_CHOICES:
        cfg = load_config([config], ["logging.wandb=disabled", "optimizer.name=muon", f"optimizer.muon_ns={ns}"])
        model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
        runs[ns] = (cfg, model, sync, opt, [])
    for s in range(repeats + 1):  # step 0 is a warm-up; the two forms alternate step by step
        for cfg, model, sync, opt, times in runs.values():
            mbs = synthetic_batches(cfg, 0, 1, s)
            t0 = time.perf_counter()
            train_step(StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad), s, mbs)
            if s:
                times.append(time.perf_counter() - t0)
    for _, _, sync, _, _ in runs.values():
        sync.remove_hooks()
    return {ns: min(r[4]) for ns, r in runs.items()}


def bench_config(config: str, repeats: int, max_layers_timed: int) -> dict:
    cfg = load_config([config], ["logging.wandb=disabled", "optimizer.name=muon"])
    layers = cfg.model.num_layers
    named = muon_shapes(cfg)
    scale = 1
    if layers > max_layers_timed:
        named = [(n, s) for n, s in named if n.startswith("layers.0.")]
        scale = layers
    shapes = [s for _, s in named]
    timed = time_shapes(shapes, repeats)
    per_step = {ns: scale * sum(timed[s][ns] for s in shapes) for ns in NS_CHOICES}
    return {
        "config": os.path.relpath(config, ROOT),
        "num_layers": layers,
        "timed_layers": "layer 0 only, multiplied by num_layers" if scale > 1 else "all",
        "matrices_per_step": len(shapes) * scale,
        "shapes": [
            {
                "name": n,
                "shape": list(s),
                "quintic_ms": 1e3 * timed[s]["quintic"],
                "gram_ms": 1e3 * timed[s]["gram"],
                "median_quintic_ms": 1e3 * timed[s]["median"]["quintic"],
                "median_gram_ms": 1e3 * timed[s]["median"]["gram"],
                "same_computation": s[0] == s[1],
                "quintic_macs": macs(s, "quintic"),
                "gram_macs": macs(s, "gram"),
            }
            for n, s in named
        ],
        "ns_per_step_ms": {ns: 1e3 * v for ns, v in per_step.items()},
        "macs_per_step": {ns: scale * sum(macs(s, ns) for s in shapes) for ns in NS_CHOICES},
        "gram_over_quintic_time": per_step["gram"] / per_step["quintic"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["configs/tiny.yaml", "configs/llama_600m.yaml"])
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per shape of the large configs")
    ap.add_argument("--tiny-repeats", type=int, default=20, help="timed repeats per shape of configs/tiny.yaml")
    ap.add_argument("--step-repeats", type=int, default=8, help="timed training steps of configs/tiny.yaml")
    ap.add_argument("--max-layers-timed", type=int, default=4, help="more layers: time layer 0 only and scale")
    ap.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1: several on shared cores spin against each other)"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "newton_schulz_cpu.json"))
    args = ap.parse_args()
    for key in ("repeats", "tiny_repeats", "step_repeats", "threads", "max_layers_timed"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    for c in args.configs:
        if not os.path.isfile(c if os.path.isabs(c) else os.path.join(ROOT, c)):
            ap.error(f"--configs: {c} is not a file (give a YAML config, relative to the repository or absolute)")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    results = []
    for c in args.configs:
        path = c if os.path.isabs(c) else os.path.join(ROOT, c)
        reps = args.tiny_repeats if os.path.basename(c) == "tiny.yaml" else args.repeats
        r = bench_config(path, reps, args.max_layers_timed)
        r["repeats"] = reps
        if os.path.basename(c) == "tiny.yaml":
            st = step_times(path, args.step_repeats)
            r["train_step_ms"] = {ns: 1e3 * v for ns, v in st.items()}
            r["ns_share_of_step"] = {ns: r["ns_per_step_ms"][ns] / r["train_step_ms"][ns] for ns in st}
        results.append(r)
    doc = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "dtype": "fp32",
        "ns_steps": STEPS,
        "coefficients": list(COEFFS),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - t_start,
        "configs": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"Newton-Schulz on CPU, FP32, {STEPS} steps, {doc['threads']} thread(s) (fastest repeat; = : same code)")
    head = f"{'config':<22} {'shape':>12} {'count':>5} {'quintic ms':>11} {'gram ms':>9} {'gram/q':>7} {'MAC g/q':>8}"
    print(head)
    for r in results:
        name = os.path.basename(r["config"])
        scale = r["num_layers"] if r["timed_layers"] != "all" else 1
        counts: dict[tuple, int] = {}
        for s in r["shapes"]:
            counts[tuple(s["shape"])] = counts.get(tuple(s["shape"]), 0) + scale
        seen = set()
        for s in r["shapes"]:
            key = tuple(s["shape"])
            if key in seen:
                continue
            seen.add(key)
            ratio = "=" if s["same_computation"] else f"{s['gram_ms'] / s['quintic_ms']:.3f}"
            print(
                f"{name:<22} {'x'.join(map(str, key)):>12} {counts[key]:>5} {s['quintic_ms']:>11.2f} "
                f"{s['gram_ms']:>9.2f} {ratio:>7} "
                f"{s['gram_macs'] / s['quintic_macs']:>8.3f}"
            )
        q, g = r["ns_per_step_ms"]["quintic"], r["ns_per_step_ms"]["gram"]
        mq, mg = r["macs_per_step"]["quintic"], r["macs_per_step"]["gram"]
        print(
            f"{name:<22} {'per step':>12} {r['matrices_per_step']:>5} {q:>11.1f} {g:>9.1f} {g / q:>7.3f} "
            f"{mg / mq:>8.3f}   ({r['timed_layers']})"
        )
        if "train_step_ms" in r:
            ts, sh = r["train_step_ms"], r["ns_share_of_step"]
            print(
                f"{name:<22} training step (DP=1): quintic {ts['quintic']:.1f} ms "
                f"(Newton-Schulz {100 * sh['quintic']:.1f}%), gram {ts['gram']:.1f} ms "
                f"(Newton-Schulz {100 * sh['gram']:.1f}%)"
            )
    print(f"wrote {os.path.relpath(args.out, ROOT)} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
