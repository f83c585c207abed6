#!/usr/bin/env python
"""The reducer's own encode + decode of one bucket, per preset, next to a same-size memory copy.

    python benchmarks/reducer_codec.py [--numel 16777216] [--dp 2] [--repeats 5] [--threads 1]
                                       [--device cpu|cuda] [--presets fp8 nvfp4 ...] [--json OUT]

Unlike ``benchmarks/codec.py`` (one scale, the bare kernels), this times exactly what a bucket costs in
training: ``reducer.reduce_scatter(bucket).wait()`` of the preset's reducer (``configs/comm/<preset>.yaml``)
on a bucket of four parameters (two 6.29M-element matrices, a norm weight, the rest one matrix), DP rank 0 of
a ``--dp`` job on torch's ``fake`` process group: transform, error feedback, scales, encode, the all-to-all
(the fake backend moves no bytes; it zero-fills the receive buffer and copies this rank's own part, about 2
bytes per element), decode, FP32 sum over sources, the division by DP and the write-back. The copy
reference is ``dst.copy_(src)`` of the FP32 bucket (8 bytes per element read + written), timed round-robin
with the presets in the same run (median of ``--repeats``).

Per preset: ``ms``, ``memcpy_ms``, ``ratio_to_memcpy`` (= ms / memcpy_ms), and from one run under
:class:`megatron_geo.comm.op_trace.OpRecorder`: ``ops_per_bucket`` (kernel-launching aten ops),
``syncs_per_bucket`` (ops that force a host sync or a data-dependent shape) and
``traffic_bytes_per_element`` (bytes of the inputs and outputs of those ops per bucket element: what an
unfused eager execution moves; a fused kernel needs about 8-18). GeoFP8 presets are left out (their
transform cost is ``benchmarks/geo_overhead.py``'s).
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

from megatron_geo.comm import build_reducer  # noqa: E402
from megatron_geo.comm.op_trace import OpRecorder  # noqa: E402
from megatron_geo.config import ConfigError, load_config  # noqa: E402
from megatron_geo.distributed.shard_plan import plan_shards  # noqa: E402

PRESETS = ["fp32", "bf16", "fp8", "fp8_e5m2", "fp8_block", "fp8_ef", "fp8_shared_scale", "fp8_hadamard", "nvfp4"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bucket_numels(numel: int) -> list[int]:
    big = min(6291456, max(numel // 4, 1))
    rest = numel - 2 * big - 1536
    if rest < 1:
        raise ValueError(f"--numel {numel} is too small; use at least {2 * big + 1537}")
    return [big, big, 1536, rest]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 2 ** 20)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--json", default=None, metavar="OUT")
    a = ap.parse_args(argv)
    if a.dp < 2 or a.repeats < 1 or a.threads < 1:
        print(f"error: --dp {a.dp} must be >= 2, --repeats {a.repeats} and --threads {a.threads} >= 1", file=sys.stderr)
        return 2
    unknown = [p for p in a.presets if not os.path.isfile(os.path.join(ROOT, "configs", "comm", f"{p}.yaml"))]
    if unknown:
        print(f"error: --presets {unknown[0]}: no configs/comm/{unknown[0]}.yaml", file=sys.stderr)
        return 2
    try:
        numels = bucket_numels(a.numel)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.dp)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(a.numel, generator=g).to(dev)
    dst = torch.empty_like(src)
    runs = {}
    for p in a.presets:
        try:
            comm = load_config([os.path.join(ROOT, "configs", "comm", f"{p}.yaml")]).comm
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if comm.transform == "geo":
            continue
        red = build_reducer(comm, dist.group.WORLD, a.dp, 0, device=dev)
        plan = plan_shards(numels, [False] * len(numels), a.dp, red.alignment())
        red.register_bucket(0, plan.offsets, numels, getattr(plan, "bounds", None) or plan.chunk, dev)
        buf = torch.zeros(plan.buffer_numel, device=dev)
        runs[p] = (red, buf)

    def reduce_once(red, buf) -> float:
        buf[: a.numel].copy_(src)
        _sync(dev)
        t0 = time.perf_counter()
        red.reduce_scatter(buf, key=0).wait()
        _sync(dev)
        return time.perf_counter() - t0

    def copy_once() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        return time.perf_counter() - t0

    for red, buf in runs.values():  # warm-up (constant tables, allocator)
        reduce_once(red, buf)
    copy_once()
    times = {p: [] for p in runs}
    copies = []
    for _ in range(a.repeats):
        copies.append(copy_once())
        for p, (red, buf) in runs.items():
            times[p].append(reduce_once(red, buf))
    memcpy = statistics.median(copies)
    out = {}
    for p, (red, buf) in runs.items():
        buf[: a.numel].copy_(src)
        rec = OpRecorder()
        with rec:
            red.reduce_scatter(buf, key=0).wait()
        ms = statistics.median(times[p])
        out[p] = {"ms": ms * 1e3, "memcpy_ms": memcpy * 1e3, "ratio_to_memcpy": ms / memcpy,
                  "ops_per_bucket": rec.work, "syncs_per_bucket": len(rec.bad),
                  "traffic_bytes_per_element": rec.traffic_bytes / a.numel}
    print(f"reducer encode + decode of one {a.numel:,}-element bucket, DP={a.dp} (rank 0, fake process group), "
          f"{dev}, {a.threads} thread(s); memcpy {memcpy * 1e3:.2f} ms")
    print(f"{'preset':<18} {'ms':>9} {'x memcpy':>9} {'ops':>5} {'syncs':>6} {'bytes/el':>9}")
    for p, r in out.items():
        print(f"{p:<18} {r['ms']:9.2f} {r['ratio_to_memcpy']:9.1f} {r['ops_per_bucket']:5d} "
              f"{r['syncs_per_bucket']:6d} {r['traffic_bytes_per_element']:9.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"numel": a.numel, "dp": a.dp, "device": str(dev), "threads": a.threads, "presets": out}, f,
                      indent=1)
            f.write("\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
