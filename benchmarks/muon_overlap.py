#!/usr/bin/env python
"""Newton-Schulz per step with and without early Muon updates (``optimizer.muon_overlap``), quintic against Gram
(``optimizer.muon_ns``): four settings side by side in one run, whole training steps on CPU.

DP = 2 gloo processes (one intra-op thread each) run the same config under all four settings, interleaved step by
step so that machine noise hits all alike; step 0 of each is a warm-up. Per step and rank it measures

- ``step_ms``: the whole :func:`~megatron_geo.training.step.train_step`;
- ``after_backward_ms``: from the end of the last backward to the end of the step (``GradSync.finish``, the
  gradient norm, the optimizer step and the parameter gather): the part of the step that Newton-Schulz lengthens
  when it runs only after the whole backward;
- ``ns_ms``: the time spent orthogonalising (every call of the optimizer's Newton-Schulz, wherever it runs);
- ``early_hits``: matrices whose update came from the early orthogonalisation.

Reported per setting: the median over steps of rank 0's figures, and the fastest. ``clip_grad`` is 0 so that no
step clips (a clipping step discards its early updates; see ``megatron_geo/distributed/early_muon.py``).

Configs: ``configs/tiny.yaml`` as it is, and ``configs/llama_600m.yaml`` cut to ``--llama-layers`` layers with a short
sequence and a 512-token vocabulary (the Muon matrices keep the 600M model's shapes, 1536x4096, 1536x1536 and
768x1536; what changes is their number; the embedding and output layer are AdamW's).
What CPU figures cannot show: on a GPU the early orthogonalisation runs on a stream of its own beside the rest of
backward and the later buckets' reductions, which a CPU process (one thread doing backward and Newton-Schulz in
turn) cannot do; here it can only overlap the gloo transfers of later buckets.

    python benchmarks/muon_overlap.py [--steps 4] [--llama-layers 2] [--out docs/bench/muon_overlap_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import run_gloo, synthetic_batches  # noqa: E402

from megatron_geo.optim.muon import NS_CHOICES  # noqa: E402

SETTINGS = [(ns, overlap) for ns in NS_CHOICES for overlap in (False, True)]


def _label(ns: str, overlap: bool) -> str:
    return f"{ns}, {'early' if overlap else 'after backward'}"


def _worker(rank: int, world: int, args: dict) -> dict:
    from megatron_geo.config import load_config
    from megatron_geo.parallel import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    torch.set_num_threads(1)
    pctx = build_groups(rank, world, 1, torch.device("cpu"), "gloo")
    runs = []
    for ns, overlap in SETTINGS:
        over = [
            "logging.wandb=disabled",
            "optimizer.name=muon",
            "optimizer.clip_grad=0",
            f"optimizer.muon_ns={ns}",
            f"optimizer.muon_overlap={str(overlap).lower()}",
            *args["overrides"],
        ]
        cfg = load_config([os.path.join(ROOT, args["config"])], over)
        model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
        ns_time = [0.0]
        for o in opt.optimizers:
            if hasattr(o, "_orthogonalize"):
                inner = o._orthogonalize

                def timed(*args, inner=inner):
                    t = time.perf_counter()
                    out = inner(*args)
                    ns_time[0] += time.perf_counter() - t
                    return out

                o._orthogonalize = timed
        marks = {}
        finish = sync.finish

        def timed_finish(finish=finish, marks=marks):
            marks["backward_end"] = time.perf_counter()
            finish()

        sync.finish = timed_finish
        runs.append((ns, overlap, cfg, model, sync, opt, ns_time, marks, []))
    for s in range(args["steps"] + 1):
        for _ns, _overlap, cfg, model, sync, opt, ns_time, marks, rows in runs:
            mbs = synthetic_batches(cfg, pctx.dp_rank, pctx.dp_size, s)
            hits0 = sync.early_updates.hits if sync.early_updates else 0
            ns_time[0] = 0.0
            torch.distributed.barrier()
            t0 = time.perf_counter()
            train_step(StepContext(model, sync, opt, pctx, 0.0, autocast_dtype="none"), s, mbs)
            t1 = time.perf_counter()
            if s:
                hits = (sync.early_updates.hits if sync.early_updates else 0) - hits0
                rows.append(
                    {
                        "step_ms": 1e3 * (t1 - t0),
                        "after_backward_ms": 1e3 * (t1 - marks["backward_end"]),
                        "ns_ms": 1e3 * ns_time[0],
                        "early_hits": hits,
                    }
                )
    out = {}
    for ns, overlap, *_, rows in runs:
        keys = ("step_ms", "after_backward_ms", "ns_ms")
        out[_label(ns, overlap)] = {
            "muon_ns": ns,
            "muon_overlap": overlap,
            **{f"median_{k}": statistics.median(r[k] for r in rows) for k in keys},
            **{f"min_{k}": min(r[k] for r in rows) for k in keys},
            "early_hits_per_step": statistics.median(r["early_hits"] for r in rows),
            "steps": rows,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per setting (after one warm-up)")
    ap.add_argument("--llama-layers", type=int, default=2, help="layers of the llama_600m-shaped model")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    if a.steps < 1 or a.llama_layers < 1:
        ap.error(f"--steps={a.steps} and --llama-layers={a.llama_layers} must be >= 1")
    configs = [
        ("configs/tiny.yaml", []),
        (
            "configs/llama_600m.yaml",
            [
                f"model.num_layers={a.llama_layers}",
                "model.seq_length=32",
                "train.global_batch_size=2",
                "train.micro_batch_size=1",
                "train.param_dtype=fp32",
                "model.vocab_size=512",  # the embedding is not a Muon matrix; a small one keeps 4 models in memory
            ],
        ),
    ]
    t_start = time.perf_counter()
    result = {"device": "cpu", "dp": 2, "threads_per_rank": 1, "torch": torch.__version__, "configs": []}
    for config, overrides in configs:
        res = run_gloo(_worker, 2, {"config": config, "overrides": overrides, "steps": a.steps})
        result["configs"].append({"config": config, "overrides": overrides, "settings": res})
        print(f"\n{config} {' '.join(overrides)}  (DP = 2, CPU, rank 0, median of {a.steps} steps)")
        print("| setting | step ms | after backward ms | Newton-Schulz ms | NS share of step | early hits |")
        print("|---|---|---|---|---|---|")
        base = res[_label("quintic", False)]
        for label, r in res.items():
            print(
                f"| {label} | {r['median_step_ms']:,.1f} | {r['median_after_backward_ms']:,.1f} | "
                f"{r['median_ns_ms']:,.1f} | {r['median_ns_ms'] / r['median_step_ms']:.2f} | "
                f"{r['early_hits_per_step']:g} |"
            )
        for label, r in res.items():
            print(
                f"  {label}: step x{r['median_step_ms'] / base['median_step_ms']:.3f}, after backward "
                f"x{r['median_after_backward_ms'] / base['median_after_backward_ms']:.3f} vs quintic after backward"
            )
    result["wall_s"] = time.perf_counter() - t_start
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
