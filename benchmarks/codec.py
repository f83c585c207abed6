#!/usr/bin/env python
"""The reducer's own encode + decode of one bucket, per preset, eager and compiled, next to a same-size copy.

    python benchmarks/codec.py [--numel 16777216] [--dp 2] [--repeats 5] [--threads 1]
                               [--device cpu|cuda] [--presets fp8 nvfp4 ...] [--compile both|eager|compiled]
                               [--json OUT] [--baseline TREE]

This times exactly what a bucket costs in training: ``reducer.reduce_scatter(bucket).wait()`` of the preset's
reducer (``configs/comm/<preset>.yaml``) on a bucket of four parameters (two 6.29M-element matrices, a norm
weight, the rest one matrix), DP rank 0 of a ``--dp`` job on torch's ``fake`` process group: transform, error
feedback, scales, encode, the all-to-all (the fake backend moves no bytes; it zero-fills the receive buffer
and copies this rank's own part, about 2 bytes per element), decode, FP32 sum over sources, the division by
DP and the write-back. Each preset runs eagerly and with ``comm.compile=true`` (``torch.compile`` of each
codec's encode and decode; the first call compiles and is not timed). The copy reference is
``dst.copy_(src)`` of the FP32 bucket (8 bytes per element read + written), timed round-robin with the
presets in the same run (median of ``--repeats``).

Per preset and mode: ``ms``, ``memcpy_ms``, ``ratio_to_memcpy`` (= ms / memcpy_ms), and from one run under
:class:`megatron_geo.comm.op_trace.OpRecorder`: ``ops_per_bucket`` (kernel-launching aten ops the dispatcher
sees; traced on the eager path only, because ``torch.compile`` cannot run under a dispatch mode: compiled
rows have timings and ``bitwise_equal_eager`` only), ``syncs_per_bucket`` (ops that force a host sync or a
data-dependent shape),
``traffic_bytes_per_element`` (bytes of the inputs and outputs of those ops per bucket element: what an
unfused eager execution moves), ``fused_traffic_bytes_per_element`` (the same with each codec step that
``comm.compile`` compiles counted as one pass over its arguments and results) and
``traffic_bound_ratio_to_memcpy`` (that over the 8 bytes per element of a copy: the best ratio a device whose
codec kernels run at copy bandwidth reaches; a projection, not a GPU measurement). Compiled rows also say
whether the reduced shard is bitwise equal to eager (``bitwise_equal_eager``: the shards of two consecutive
reductions, so that error feedback's residual is part of the comparison). ``index_table_bytes_per_element``: the bytes
of the scale-layout tables the reducer keeps for the bucket (``LowPrecisionReducer.index_table_bytes``; 0 for the
plain reducers) per bucket element. GeoFP8 presets are left out (their transform
cost is
``benchmarks/geo_overhead.py``'s). The JSON holds ``presets_eager`` and/or ``presets_compiled`` and, as
``presets``, the first mode run (eager unless ``--compile compiled``). ``tools/project_scaling.py --codec-output
OUT.json`` reads the JSON.

``--baseline TREE``: also time the reducers of another source tree (a folder holding an earlier revision's
``megatron_geo/``, e.g. ``git archive <rev> megatron_geo | tar -x -C TREE``), loaded as a second package in the
same process and timed round-robin with the current ones and the copy: per row ``baseline_ms``,
``baseline_ratio_to_memcpy``, ``baseline_index_table_bytes_per_element`` and ``bitwise_equal_baseline`` (the two
trees' shards of two consecutive reductions equal), so a change is measured against its predecessor under the same
machine load.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dataclasses  # noqa: E402

from megatron_geo.comm import build_reducer  # noqa: E402
from megatron_geo.comm.op_trace import OpRecorder  # noqa: E402
from megatron_geo.config import ConfigError, load_config  # noqa: E402
from megatron_geo.config.presets import codec_presets, comm_presets  # noqa: E402
from megatron_geo.distributed.shard_plan import plan_shards  # noqa: E402
from megatron_geo.parallel import collectives as C  # noqa: E402

PRESETS = codec_presets()  # every configs/comm preset without a learned transform (comm.transform=geo)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


MIN_NUMEL = 3073  # two matrices of numel // 4, the 1536-element norm weight and at least one element left


def bucket_numels(numel: int) -> list[int]:
    """Element counts of the four parameters of the timed bucket (two matrices of at most 6.29M elements, a
    1536-element norm weight, the rest one matrix).

    Raises:
        ValueError: ``numel < MIN_NUMEL``.
    """
    if numel < MIN_NUMEL:
        raise ValueError(f"--numel {numel} is too small; use at least {MIN_NUMEL}")
    big = min(6291456, numel // 4)
    return [big, big, 1536, numel - 2 * big - 1536]


def _baseline_build_reducer(tree: str):
    """``build_reducer`` of ``tree/megatron_geo`` loaded as the package ``megatron_geo_baseline`` (its modules import
    each other relatively, so both trees live side by side in this process)."""
    import importlib
    import importlib.util

    pkg = os.path.join(os.path.abspath(tree), "megatron_geo")
    spec = importlib.util.spec_from_file_location(
        "megatron_geo_baseline", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["megatron_geo_baseline"] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module("megatron_geo_baseline.comm").build_reducer


def _build(build, comm, pctx, dev):
    """A reducer from ``build``: this tree's ``build_reducer`` (it takes the parallel context) or an earlier tree's
    that took the DP group, size and rank."""
    if "pctx" in inspect.signature(build).parameters:
        return build(comm, pctx, device=dev)
    return build(comm, pctx.dp_group, pctx.dp_size, pctx.dp_rank, device=dev)


def _table_bytes(red) -> int:
    """Bytes of the reducer's scale-layout tables: ``index_table_bytes()`` where it has one, else the tensors of its
    layouts' attributes (an earlier tree's reducer), 0 for the plain reducers."""
    if hasattr(red, "index_table_bytes"):
        return red.index_table_bytes()
    total = 0
    for lay in getattr(red, "layouts", {}).values():
        for v in vars(lay).values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 2**20)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument(
        "--compile",
        choices=["both", "eager", "compiled"],
        default="both",
        help="time the eager codecs, the compiled ones (comm.compile=true), or both (default)",
    )
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--baseline", default=None, metavar="TREE", help="time TREE/megatron_geo's reducers too")
    a = ap.parse_args(argv)
    bad = (
        ([f"--dp {a.dp} must be >= 2"] if a.dp < 2 else [])
        + ([f"--repeats {a.repeats} must be >= 1"] if a.repeats < 1 else [])
        + ([f"--threads {a.threads} must be >= 1"] if a.threads < 1 else [])
    )
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        bad.append(f"--device {a.device}: no CUDA device is visible; use --device cpu")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        bad.append(f"--json {a.json}: folder {os.path.dirname(a.json)} does not exist")
    elif a.json and os.path.isdir(a.json):
        bad.append(f"--json {a.json} is a folder; give a file name, e.g. {os.path.join(a.json, 'codec.json')}")
    try:
        dev_type = torch.device(a.device).type
    except RuntimeError:
        dev_type = None
    if dev_type not in ("cpu", "cuda"):
        bad.append(f"--device {a.device}: use cpu or cuda (cuda:N)")
    elif a.compile != "eager":
        from megatron_geo.comm.compiled import compiler_problem

        problem = compiler_problem(a.device)
        if problem:
            bad.append(f"--compile {a.compile}: {problem}; install g++ (or set CXX) or use --compile eager")
    geo = [p for p in a.presets if p in comm_presets() and p not in PRESETS]
    if geo:
        bad.append(
            f"--presets {geo[0]}: the geometry-aware presets are not timed here (their transform cost is "
            f"benchmarks/geo_overhead.py's); the codec itself is the fp8 / nvfp4 row"
        )
    if a.baseline and not os.path.isfile(os.path.join(a.baseline, "megatron_geo", "comm", "__init__.py")):
        bad.append(f"--baseline {a.baseline}: no megatron_geo/comm/__init__.py there; give a source tree's root")
    if bad:
        print(f"error: {bad[0]}", file=sys.stderr)
        return 2
    unknown = [p for p in a.presets if p not in comm_presets()]
    if unknown:
        print(f"error: --presets {unknown[0]}: no configs/comm/{unknown[0]}.yaml", file=sys.stderr)
        return 2
    try:
        numels = bucket_numels(a.numel)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    from megatron_geo.parallel import build_groups, indexed_device

    dev = indexed_device(a.device)  # cuda -> cuda:N, as the trainer's devices
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.dp)
    pctx = build_groups(0, a.dp, 1, dev, "fake")  # DP rank 0 of a.dp
    g = torch.Generator().manual_seed(0)
    src = torch.randn(a.numel, generator=g).to(dev)
    dst = torch.empty_like(src)
    modes = {"both": ["eager", "compiled"], "eager": ["eager"], "compiled": ["compiled"]}[a.compile]
    base_build = _baseline_build_reducer(a.baseline) if a.baseline else None
    runs = {}
    for p in a.presets:
        try:
            comm = load_config([os.path.join(ROOT, "configs", "comm", f"{p}.yaml")]).comm
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if comm.transform == "geo":
            continue
        for mode in modes:
            c = dataclasses.replace(comm, compile="true" if mode == "compiled" else "false")
            red = _build(build_reducer, c, pctx, dev)
            plan = plan_shards(numels, [False] * len(numels), a.dp, red.alignment())
            red.register_bucket(0, plan.offsets, numels, getattr(plan, "bounds", None) or plan.chunk, dev)
            buf = torch.zeros(plan.buffer_numel, device=dev)
            runs[(p, mode)] = (red, buf, plan)
            if base_build is not None:
                old = _build(base_build, c, pctx, dev)
                old.register_bucket(0, plan.offsets, numels, getattr(plan, "bounds", None) or plan.chunk, dev)
                runs[(p, mode + "@baseline")] = (old, torch.zeros(plan.buffer_numel, device=dev), plan)

    def reduce_once(red, buf) -> float:
        buf[: a.numel].copy_(src)
        _sync(dev)
        t0 = time.perf_counter()
        red.reduce_scatter(buf, 0).wait()  # the bucket's key: a baseline tree's reducers take it too
        _sync(dev)
        return time.perf_counter() - t0

    def copy_once() -> float:
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        return time.perf_counter() - t0

    shards = {}
    for k, (red, buf, plan) in runs.items():  # warm-up (constant tables, allocator, compilation)
        own = plan.bounds[1] if getattr(plan, "bounds", None) else plan.chunk
        # two reductions, both kept: the second starts from the first one's error-feedback residual
        reduce_once(red, buf)
        first = buf[:own].clone()
        reduce_once(red, buf)
        shards[k] = torch.cat([first, buf[:own]])
    copy_once()
    times = {k: [] for k in runs}
    copies = []
    for _ in range(a.repeats):
        copies.append(copy_once())
        for k, (red, buf, _) in runs.items():
            times[k].append(reduce_once(red, buf))
    memcpy = statistics.median(copies)
    out: dict = {m: {} for m in modes}
    for (p, mode), (red, buf, _) in runs.items():
        if mode.endswith("@baseline"):
            continue
        ms = statistics.median(times[(p, mode)])
        row = {
            "ms": ms * 1e3,
            "memcpy_ms": memcpy * 1e3,
            "ratio_to_memcpy": ms / memcpy,
            "index_table_bytes_per_element": _table_bytes(red) / a.numel,
        }
        if mode == "eager":  # torch.compile refuses to run under a dispatch mode: compiled rows are not traced
            buf[: a.numel].copy_(src)
            rec = OpRecorder()
            wire = getattr(red, "wire", None)
            # the codec steps that comm.compile turns into graphs are the wire's plain-function attributes
            steps = {k: v for k, v in vars(wire).items() if inspect.isfunction(v)} if wire is not None else {}
            for k, fn in steps.items():
                setattr(wire, k, rec.fused(fn))
            loopback = C._loopback  # the fake backend's stand-in for the network: not codec traffic
            C._loopback = rec.collective(loopback)
            try:
                with rec:
                    red.reduce_scatter(buf, 0).wait()  # the bucket's key: a baseline tree's reducers take it too
            finally:
                C._loopback = loopback
                for k, fn in steps.items():
                    setattr(wire, k, fn)
            fused = rec.fused_traffic_bytes / a.numel
            row.update(
                {
                    "ops_per_bucket": rec.work,
                    "syncs_per_bucket": len(rec.bad),
                    "traffic_bytes_per_element": rec.traffic_bytes / a.numel,
                    "fused_traffic_bytes_per_element": fused,
                    "traffic_bound_ratio_to_memcpy": fused / 8.0,
                }
            )
        if mode == "compiled" and (p, "eager") in shards:
            row["bitwise_equal_eager"] = bool(torch.equal(shards[(p, mode)], shards[(p, "eager")]))
        if (p, mode + "@baseline") in runs:
            old_red = runs[(p, mode + "@baseline")][0]
            base = statistics.median(times[(p, mode + "@baseline")])
            row["baseline_ms"] = base * 1e3
            row["baseline_ratio_to_memcpy"] = base / memcpy
            row["baseline_index_table_bytes_per_element"] = _table_bytes(old_red) / a.numel
            row["bitwise_equal_baseline"] = bool(torch.equal(shards[(p, mode)], shards[(p, mode + "@baseline")]))
        out[mode][p] = row
    print(
        f"reducer encode + decode of one {a.numel:,}-element bucket, DP={a.dp} (rank 0, fake process group), "
        f"{dev}, {a.threads} thread(s); memcpy {memcpy * 1e3:.2f} ms"
    )
    head = f"{'preset':<18}"
    for mode in modes:
        head += f" {mode + ' ms':>12} {'x memcpy':>9}"
    print(
        head
        + f" {'ops':>5} {'syncs':>6} {'bytes/el':>9} {'fused':>6} {'tables':>7}"
        + ("  compiled == eager" if len(modes) == 2 else "")
    )
    for p in out[modes[0]]:
        line = f"{p:<18}"
        for mode in modes:
            r = out[mode][p]
            line += f" {r['ms']:12.2f} {r['ratio_to_memcpy']:9.1f}"
        r = out[modes[0]][p]
        if "ops_per_bucket" in r:
            line += (
                f" {r['ops_per_bucket']:5d} {r['syncs_per_bucket']:6d} {r['traffic_bytes_per_element']:9.1f}"
                f" {r['fused_traffic_bytes_per_element']:6.1f}"
            )
        else:
            line += f" {'-':>5} {'-':>6} {'-':>9} {'-':>6}"
        line += f" {r['index_table_bytes_per_element']:7.4f}"
        if len(modes) == 2:
            line += f"  {'bitwise' if out['compiled'][p]['bitwise_equal_eager'] else 'DIFFERS'}"
        print(line)
    print("tables: bytes of the scale-layout tables the reducer keeps per bucket element")
    if base_build is not None:
        print(f"--baseline {a.baseline}, timed round-robin in the same run:")
        print(
            f"{'preset':<18} {'mode':<9} {'baseline ms':>12} {'x memcpy':>9} {'tables':>7} {'now ms':>9}"
            f" {'x memcpy':>9} {'tables':>7}  shards"
        )
        for mode in modes:
            for p, r in out[mode].items():
                same = "bitwise" if r["bitwise_equal_baseline"] else "DIFFER"
                print(
                    f"{p:<18} {mode:<9} {r['baseline_ms']:12.2f} {r['baseline_ratio_to_memcpy']:9.1f}"
                    f" {r['baseline_index_table_bytes_per_element']:7.4f} {r['ms']:9.2f} {r['ratio_to_memcpy']:9.1f}"
                    f" {r['index_table_bytes_per_element']:7.4f}  {same}"
                )
    if "eager" not in modes:
        print("ops, syncs, bytes/el, fused: traced on the eager path only; run with --compile both or eager")
    else:
        print(
            "ops, syncs, bytes/el: op trace of the eager path (torch.compile cannot run under the trace; the "
            "compiled path runs the same Python code with each codec step fused into one fullgraph graph)"
        )
    if "eager" in modes:
        print(
            "fused: bytes read + written per bucket element when each codec step is one pass (its tensor "
            "arguments and results once) and the ops between steps run as they are, the collective left out; "
            "/ 8 (a copy's bytes) it is the ratio to memcpy a bandwidth-bound device reaches at best"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "numel": a.numel,
                    "dp": a.dp,
                    "device": str(dev),
                    "threads": a.threads,
                    "presets": out[modes[0]],
                    **{f"presets_{m}": out[m] for m in modes},
                },
                f,
                indent=1,
            )
            f.write("\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
