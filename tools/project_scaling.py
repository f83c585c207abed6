#!/usr/bin/env python
"""Project the step time of every gradient-communication mode to a GPU cluster (alpha-beta model).

    python tools/project_scaling.py [--gpus 8 16 32 64 128 256] [--device gh200] [--net-gbs 50] [--mfu 0.4]
                                    [--overlap 0.4] [--gpu-check gpu_check.json] [--markdown] [--plot FILE]

Model (docs/design.md section 6), TP = 1, data parallel over all n GPUs, per step:

- compute  T_c = flops_per_token(model) * global_batch * seq_length / (n * peak * MFU)
  (``megatron_geo.model.llama.flops_per_token``: 6 N + 6 L s h, Kaplan et al. 2020 / PaLM app. B);
- gradient all-reduce in the mode's wire format (reduce stage + gather stage, both in the wire format), ring:
  2 [(n-1) alpha + (n-1)/n * N b w / B], w = the shard plan's wire bytes over an even unpadded ring
  (``tools/plan_report.py``; 1.0 without padding or imbalance), b = bytes per element (FP32 4, BF16 2, FP8 1 + 4
  bytes per parameter tensor scale, NVFP4 0.5 + 1/16 + 4 per 1024-element chunk), B = per-GPU network bandwidth
  (``--net-gbs``; NVLink ``--intra-gbs`` when n <= GPUs per node). The NCCL FP8 sum row uses NCCL's algorithm
  instead: ring up to 8 ranks, tree above (see :func:`nccl_fp8_allreduce_time`). ``--gather params`` models the
  trainer's distributed optimizer instead: the reduce-scatter in the wire format (NCCL FP8 sum: ring, PAT above 8
  ranks), then the parameters all-gathered at ``--param-bytes`` (the configs' ``model.param_dtype`` fp32: 4) for
  every mode, with no gather-stage codec;
- exposed communication = T_comm - min(overlap * T_comm, window * T_c), ``--overlap`` the fraction of the
  collective that can hide behind compute, window = 2/3 (the backward pass, where bucket reductions start);
- codec, not hidden: the reduce stage's bytes read + written per element, as traced by ``benchmarks/codec.py``
  (``fused_traffic_bytes_per_element``: each compiled codec step one pass over its arguments and results), plus
  the gather stage's decode of the gathered codes into FP32 and encode of the averaged shard
  (b + 4 + (b + 4) / n bytes per element, a formula), at the device's memory bandwidth (:data:`DEVICES`,
  datasheet peaks). With ``--gpu-check gpu_check.json`` the reduce stage is the reducer's measured GPU time
  per element instead, and the bandwidth the measured device copy. A CPU throughput is never carried to a GPU;
- GeoFP8 / GeoNVFP4 = the Euclidean mode with error feedback plus GeoFP8's own work: ``x (1 + o)``, o the
  added step time measured by ``benchmarks/geo_overhead.py``, or with ``--gpu-check`` the measured milliseconds
  per transformed layer.

Step time = T_c + exposed comm + codec. Reduction vs a reference mode = 1 - T_mode / T_ref.

Baselines (the rows a verdict is measured against; the fastest of them at each point is "the strongest"):
``fp32`` is Megatron-Core's default for BF16 training (gradients reduced in FP32); ``bf16`` is Megatron-Core's
``--ddp-reduce-scatter-with-fp32-accumulation`` (BF16 sent through an all-to-all, summed in FP32 on the owner),
which is also what this repository's ``bf16`` preset does; ``nccl_fp8_sum`` is NCCL's native FP8 (e4m3) sum
(NCCL >= 2.24 on SM >= 90). No overlap or MFU is solved for: the sensitivity table spans network bandwidth,
MFU and overlap at the paper's setting (arXiv 2607.07494: Llama-600M on 64 GH200, one GPU per node, global
batch 512, seq 2048; FP8 vs FP32 -10.8% step time, GeoFP8 vs FP32 -7.6%) and marks the cell nearest to it.

Every input is printed with its source and whether it is measured or assumed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_geo.config import load_config  # noqa: E402
from megatron_geo.model.llama import count_parameters, flops_per_token  # noqa: E402

MODES = ["fp32", "bf16", "nccl_fp8_sum", "fp8", "fp8_ef", "fp8_hadamard", "geofp8", "nvfp4", "geonvfp4"]
BASELINES = {
    "fp32": "Megatron-Core's default for BF16 training: FP32 gradient reduction",
    "bf16": "Megatron-Core --ddp-reduce-scatter-with-fp32-accumulation: BF16 all-to-all, FP32 sum on the owner "
    "(our bf16 preset does the same)",
    "nccl_fp8_sum": "NCCL >= 2.24 native FP8 e4m3 sum (SM >= 90): ring <= 8 ranks, tree above; one shared scale, "
    "sums rounded to FP8 at every step (a speed baseline: its accuracy is not that of an FP32 sum)",
}
PAPER = {
    "fp8_vs_fp32": 0.108,
    "geofp8_vs_fp32": 0.076,
    "gpus": 64,
    "model": "configs/llama_600m.yaml",
    "global_batch": 512,
    "device": "gh200",
}
# Device memory bandwidth (datasheet peak, HBM) and dense BF16 peak. Sources: NVIDIA H100 Tensor Core GPU
# datasheet (H100 SXM5 80 GB HBM3: 3.35 TB/s, 989 TFLOP/s dense BF16), NVIDIA H200 datasheet (H200 SXM 141 GB
# HBM3e: 4.8 TB/s, 989 TFLOP/s), NVIDIA GH200 Grace Hopper Superchip datasheet (the 96 GB HBM3 part: 4.0 TB/s;
# the 144 GB HBM3e part has 4.9 TB/s; 989 TFLOP/s). A fused codec pass is assumed to stream at the peak;
# measured copies reach about 85-90% of it, so the codec times are lower bounds by that much.
DEVICES = {
    "h100": {"mem_gbs": 3350.0, "peak_tflops": 989.0, "name": "H100 SXM5 80GB HBM3"},
    "h200": {"mem_gbs": 4800.0, "peak_tflops": 989.0, "name": "H200 SXM 141GB HBM3e"},
    "gh200": {"mem_gbs": 4000.0, "peak_tflops": 989.0, "name": "GH200 (H100 96GB HBM3)"},
}
# benchmarks/codec.py preset whose traced reduce-stage traffic (and GPU time) a mode uses; geonvfp4 adds error
# feedback's share (fp8_ef - fp8) to nvfp4; the NCCL FP8 sum is a formula (NCCL_FP8_REDUCE_BYTES)
TRAFFIC_PRESET = {
    "fp32": "fp32",
    "bf16": "bf16",
    "fp8": "fp8",
    "fp8_ef": "fp8_ef",
    "fp8_hadamard": "fp8_hadamard",
    "geofp8": "fp8_ef",
    "nvfp4": "nvfp4",
    "geonvfp4": "nvfp4",
}
NEEDED_PRESETS = ("fp32", "bf16", "fp8", "fp8_ef", "fp8_hadamard", "nvfp4")
# NCCL FP8 sum, reduce stage: an amax pass (read 4) and the scaled cast (read 4, write 1) before the collective;
# the sum itself runs inside NCCL's kernels (their traffic is not counted for any mode)
NCCL_FP8_REDUCE_BYTES = 9.0
NCCL_RING_MAX_RANKS = 8
SENS_NET_GBS = (25.0, 50.0, 100.0)
SENS_MFU = (0.3, 0.4, 0.5)
SENS_OVERLAP = (0.0, 0.4, 0.8)
PAPER_CELL = (50.0, 0.4, 0.4)  # net GB/s (NDR 400 Gb/s, docs/design.md section 6), MFU, overlap: middle values


class ProjectionError(ValueError):
    """A missing or unreadable benchmark output or a bad parameter; the message names the fix."""


# -- collectives (alpha-beta) --------------------------------------------------------------------------------
def ring_phase_time(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """One ring reduce-scatter / all-gather, or a pairwise all-to-all, of ``nbytes`` (the full buffer) per
    rank: (n-1) alpha + (n-1)/n * nbytes / bw seconds (bw in bytes/s, alpha in s). 0 for n = 1.

    Raises:
        ProjectionError: ``n < 1``.
    """
    if n < 1:
        raise ProjectionError(f"GPU count {n} must be >= 1")
    return 0.0 if n == 1 else (n - 1) * alpha + (n - 1) / n * nbytes / bw


def allreduce_time(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """Ring all-reduce = reduce-scatter + all-gather: 2 [(n-1) alpha + (n-1)/n * nbytes / bw] seconds."""
    return 2.0 * ring_phase_time(n, nbytes, bw, alpha)


def nccl_fp8_algorithm(n: int) -> str:
    """NCCL's all-reduce algorithm assumed for the native FP8 sum at ``n`` ranks: ``ring`` up to
    :data:`NCCL_RING_MAX_RANKS`, else ``tree``. A ring sums in FP8 at each of its n - 1 hops, so its rounding
    grows with n; a tree (or PAT, NCCL >= 2.23, for reduce-scatter / all-gather with one GPU per node) rounds
    about log2(n) times. NCCL's tuner picks by message size and topology (``NCCL_ALGO`` forces it); above 8 ranks
    this projection assumes the tree is forced for accuracy."""
    return "ring" if n <= NCCL_RING_MAX_RANKS else "tree"


def nccl_fp8_allreduce_time(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """The NCCL FP8 sum all-reduce of ``nbytes`` per rank in seconds: the ring (:func:`allreduce_time`) up to
    8 ranks; a pipelined tree above, reduce up and broadcast down, each ceil(log2 n) alpha + nbytes / bw (NCCL's
    double binary tree moves every byte once per direction)."""
    if nccl_fp8_algorithm(n) == "ring":
        return allreduce_time(n, nbytes, bw, alpha)
    return 2.0 * (math.ceil(math.log2(n)) * alpha + nbytes / bw)


def nccl_fp8_reduce_scatter_time(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """The NCCL FP8 sum reduce-scatter of ``nbytes`` per rank in seconds: the ring (:func:`ring_phase_time`) up to
    8 ranks; PAT above (NCCL >= 2.23, one GPU per node), ceil(log2 n) alpha + (n-1)/n * nbytes / bw, about log2 n
    FP8 roundings."""
    if nccl_fp8_algorithm(n) == "ring":
        return ring_phase_time(n, nbytes, bw, alpha)
    return math.ceil(math.log2(n)) * alpha + (n - 1) / n * nbytes / bw


def bytes_per_element(mode: str, numel: int, n_tensors: int) -> float:
    """Wire bytes per gradient element of ``mode`` including its scales (FP32 4, BF16 2, FP8 1 + 4 bytes per
    tensor, NVFP4 0.5 + 1/16 + 4/1024).

    Raises:
        ProjectionError: an unknown mode.
    """
    base = {
        "fp32": "fp32",
        "bf16": "bf16",
        "nccl_fp8_sum": "fp8",
        "fp8": "fp8",
        "fp8_ef": "fp8",
        "fp8_hadamard": "fp8",
        "geofp8": "fp8",
        "nvfp4": "nvfp4",
        "geonvfp4": "nvfp4",
    }.get(mode)
    if base == "fp32":
        return 4.0
    if base == "bf16":
        return 2.0
    if base == "fp8":
        return 1.0 + 4.0 * n_tensors / numel
    if base == "nvfp4":
        return 0.5 + 1.0 / 16 + 4.0 / 1024
    raise ProjectionError(f"unknown mode '{mode}'; use one of {MODES}")


def gather_stage_bytes(mode: str, n: int, b: float) -> float:
    """Bytes read + written per gradient element by the gather stage's codec: the averaged shard encoded
    ((4 + b) / n) and every gathered code decoded into FP32 (b + 4). 0 for ``fp32`` (gathered in place)."""
    return 0.0 if mode == "fp32" else (4.0 + b) * (1.0 + 1.0 / n)


# -- inputs ----------------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    """The cluster and training assumptions (all stated in the output)."""

    gpus_per_node: int = 1
    net_gbs: float = 50.0  # per-GPU network bandwidth, GB/s (NDR 400 Gb/s)
    intra_gbs: float = 450.0  # NVLink per GPU, GB/s (used when n <= gpus_per_node)
    alpha_us: float = 5.0  # per-hop latency, microseconds
    peak_tflops: float = 989.0  # dense BF16 peak per GPU, TFLOP/s
    mfu: float = 0.4
    overlap: float = 0.4  # fraction of the collective hidden behind compute
    window: float = 2.0 / 3.0  # share of T_c during which reductions can overlap (backward)
    mem_gbs: float = DEVICES["gh200"]["mem_gbs"]  # device memory bandwidth, GB/s (bytes read + written)
    # wire: the gradient all-reduced, both stages in the wire format (the paper's setting); params: the trainer's
    # distributed optimizer, gradient reduce-scatter in the wire format, then a parameter all-gather
    gather: str = "wire"
    param_bytes: float = 4.0  # bytes per gathered parameter with gather="params" (model.param_dtype; fp32 4)


@dataclass
class Costs:
    """Codec and GeoFP8 inputs.

    ``traffic``: preset -> bytes read + written per bucket element by the reduce stage (``benchmarks/codec.py``
    ``fused_traffic_bytes_per_element``); ``gpu_s_per_element``: preset -> the reducer's measured GPU seconds per
    element of the reduce stage (``gpu_check.json``), which replaces ``traffic`` where present; ``geo_overhead``:
    GeoFP8's added step fraction; ``geo_added_s_per_layer``: model name -> GPU seconds per transformed layer."""

    traffic: dict
    geo_overhead: float
    sources: dict
    geo_added_s_per_layer: dict | None = None
    gpu_s_per_element: dict = field(default_factory=dict)


def parse_codec_json(text: str, source: str) -> dict[str, float]:
    """``{preset: fused bytes read + written per element}`` from ``benchmarks/codec.py --json OUT``: the
    ``fused_traffic_bytes_per_element`` of ``presets_eager`` (else ``presets``; the op trace runs on the eager
    path only).

    Raises:
        ProjectionError: not JSON, or a preset of :data:`NEEDED_PRESETS` (or its traffic figure) missing.
    """
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProjectionError(f"{source}: not the JSON of benchmarks/codec.py --json ({e.msg})") from None
    rows = d.get("presets_eager") or d.get("presets") or {}
    out = {
        p: float(r["fused_traffic_bytes_per_element"])
        for p, r in rows.items()
        if "fused_traffic_bytes_per_element" in r
    }
    missing = [p for p in NEEDED_PRESETS if p not in out]
    if missing:
        raise ProjectionError(
            f"{source}: benchmarks/codec.py JSON lacks fused_traffic_bytes_per_element for presets {missing}; "
            f"rerun `python benchmarks/codec.py --compile both --json {source}` (the eager trace reports it) or "
            f"pass --run-benchmarks"
        )
    return out


def parse_geo_output(text: str, source: str) -> float:
    """GeoFP8's added step time as a fraction, from benchmarks/geo_overhead.py stdout: its own work timed
    inside the step at the default refresh interval ("at geo.refresh_interval=50: ... = +X% of the fp8 step",
    low noise) when present, else the end-to-end difference ("added +X% ...").

    Raises:
        ProjectionError: neither line present.
    """
    import re

    m = re.search(r"at geo\.refresh_interval=50: .*?= ([+-]?[\d.]+)% of the fp8 step", text) or re.search(
        r"added\s+([+-]?[\d.]+)%", text
    )
    if not m:
        raise ProjectionError(
            f"{source}: no 'added ...%' line from benchmarks/geo_overhead.py; rerun "
            f"`python benchmarks/geo_overhead.py > {source}` or pass --run-benchmarks"
        )
    return float(m.group(1)) / 100.0


def _show(p: Path) -> str:
    """``p`` relative to the working folder when it lies inside it (for printing sources)."""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def load_gpu_check(path: str) -> dict:
    """GPU figures from ``benchmarks/gpu_check.sh``'s ``gpu_check.json`` (written by benchmarks/gpu_check.py,
    its ``codec`` phase in benchmarks/gpu_check_phases.py), each only where present:

    - ``gpu_s_per_element``: preset -> seconds per bucket element of the reducer's reduce stage,
      ``codec.reducer.presets[p].compiled.ms`` (else ``.eager.ms``) / 1e3 / ``codec.reducer.numel``;
    - ``mem_gbs``: 2 x ``codec.ops.copy.gbps`` (that figure counts the FP32 bytes copied; a copy reads and writes
      each once), with ``device_name``;
    - ``geo_added_s_per_layer``: config stem -> ``geo.layers[cfg].geo_added_ms_per_layer`` / 1e3 (>= 0);
    - ``mfu``: ``llama_<size>`` -> ``train_<size>.mfu`` (eager, Euclidean training phases only).

    Raises:
        ProjectionError: the file is missing, not JSON, or a dry run (CPU stand-in figures).
    """
    p = Path(path)
    if not p.is_file():
        raise ProjectionError(f"--gpu-check '{path}' not found; pass the gpu_check.json of benchmarks/gpu_check.sh")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ProjectionError(f"--gpu-check '{path}' is not JSON ({e.msg})") from None
    if d.get("dry_run"):
        raise ProjectionError(f"--gpu-check '{path}' is a dry run (CPU stand-in figures); use a GPU run's output")
    out: dict = {"gpu_s_per_element": {}, "geo_added_s_per_layer": {}, "mfu": {}}
    codec = d.get("codec") or {}
    copy = ((codec.get("ops") or {}).get("copy") or {}).get("gbps")
    if isinstance(copy, (int, float)) and copy > 0:
        out["mem_gbs"] = 2.0 * float(copy)
        out["device_name"] = str(codec.get("device_name", "GPU"))
    reducer = codec.get("reducer") or {}
    numel = reducer.get("numel")
    for name, row in (reducer.get("presets") or {}).items():
        timed = row.get("compiled") or row.get("eager")
        if isinstance(numel, int) and numel > 0 and timed and isinstance(timed.get("ms"), (int, float)):
            out["gpu_s_per_element"][name] = float(timed["ms"]) / 1e3 / numel
    for cfg_name, layer in ((d.get("geo") or {}).get("layers") or {}).items():
        if "geo_added_ms_per_layer" in layer:
            out["geo_added_s_per_layer"][Path(cfg_name).stem] = max(float(layer["geo_added_ms_per_layer"]), 0.0) / 1e3
    for key, val in d.items():
        if (
            key.startswith("train_")
            and isinstance(val, dict)
            and isinstance(val.get("mfu"), (int, float))
            and "compile" not in key
            and "geofp8" not in key
        ):
            out["mfu"]["llama_" + key[len("train_") :]] = float(val["mfu"])
    return out


def load_costs(codec_path: str | None, geo_path: str | None, run: bool, geo_overhead: float | None) -> Costs:
    """The codec traffic (``benchmarks/codec.py --json``) and GeoFP8 overhead (``benchmarks/geo_overhead.py``
    stdout), read from the given files or measured now (``run``).

    Raises:
        ProjectionError: a file missing or unreadable (the message names the command that writes it).
    """
    sources = {}
    if run:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "codec.json"
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "codec.py"),
                    "--numel",
                    "4194304",
                    "--compile",
                    "eager",
                    "--repeats",
                    "1",
                    "--json",
                    str(out),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            codec_text = out.read_text()
        sources["codec"] = "benchmarks/codec.py --numel 4194304 --compile eager --json (run now)"
    else:
        p = Path(codec_path)
        if not p.is_file():
            raise ProjectionError(
                f"codec benchmark output '{p}' not found; write it with `python benchmarks/codec.py "
                f"--json {p}`, pass --codec-output FILE, or --run-benchmarks"
            )
        codec_text, sources["codec"] = p.read_text(), _show(p)
    traffic = parse_codec_json(codec_text, sources["codec"])
    if geo_overhead is not None:
        o, sources["geo"] = geo_overhead, "--geo-overhead (given)"
    elif run:
        text = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "geo_overhead.py")],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        o, sources["geo"] = parse_geo_output(text, "geo_overhead"), "benchmarks/geo_overhead.py (run now)"
    else:
        p = Path(geo_path)
        if not p.is_file():
            raise ProjectionError(
                f"geo overhead output '{p}' not found; save `python benchmarks/geo_overhead.py` "
                f"stdout there, pass --geo-output FILE, --geo-overhead PCT/100, or --run-benchmarks"
            )
        o, sources["geo"] = parse_geo_output(p.read_text(), str(p)), _show(p)
    return Costs(traffic, max(o, 0.0), sources)


# -- the step-time model -------------------------------------------------------------------------------------
@dataclass
class Model:
    """One model's figures: parameters, tensors (per-tensor scales), FLOPs per token, tokens per step."""

    name: str
    params: int
    n_tensors: int
    flops_per_token: float
    tokens_per_step: int
    geo_layers: int = 0  # layers GeoFP8 transforms (geo.layers of the config)
    config_path: str = ""  # the config; wire bytes then come from its shard plan (tools/plan_report.py)


_META: dict[str, list] = {}


@functools.cache
def wire_ratios(config_path: str, n: int, all_to_all: bool) -> tuple[float, float]:
    """(reduce, gather): wire bytes per rank of the plan's gradient reduction and of its parameter gather over
    those of an even, unpadded ring reduce-scatter / all-gather of the same parameters (``tools/plan_report.py``;
    1.0 = no padding and balanced). ``all_to_all``: the low-precision path (receives ``(n - 1) x own``), else the
    FP32 per-owner reduce."""
    from megatron_geo.analysis.plan_report import meta_model_params, plan_figures

    cfg = load_config([config_path], [] if not all_to_all else ["comm.dtype=bf16"])
    if config_path not in _META:
        _META[config_path] = meta_model_params(cfg, 1)
    f = plan_figures(cfg, n, _META[config_path])
    red = f["wire_bytes_per_rank"] / f["even_reduce_scatter_bytes"]
    gat = f["gather_bytes_per_rank"] / f["even_all_gather_bytes"] if f["even_all_gather_bytes"] else red
    return red, gat


def wire_ratio(config_path: str, n: int, all_to_all: bool) -> float:
    """The mean of :func:`wire_ratios` (both stages in the wire format: the all-reduce layout)."""
    red, gat = wire_ratios(config_path, n, all_to_all)
    return 0.5 * (red + gat)


def model_from_config(path: str, global_batch: int | None = None) -> Model:
    """:class:`Model` of a config file (parameters and FLOPs from megatron_geo.model.llama)."""
    cfg = load_config([path])
    n_tensors = 2 + 9 * cfg.model.num_layers + 1  # embed, output, final norm; 7 linears + 2 norms per layer
    gb = global_batch or cfg.train.global_batch_size
    from fnmatch import fnmatchcase

    from megatron_geo.checkpoint.consolidated import expected_shapes

    pats = [p.strip() for p in cfg.geo.layers.split(",") if p.strip()]
    geo_layers = sum(any(fnmatchcase(n, p) for p in pats) for n in expected_shapes(cfg.model))
    return Model(
        Path(path).stem,
        count_parameters(cfg.model),
        n_tensors,
        flops_per_token(cfg.model),
        gb * cfg.model.seq_length,
        geo_layers,
        str(path),
    )


def _reduce_stage_s(preset: str, numel: int, c: Cluster, costs: Costs) -> float:
    """Seconds of the reduce stage's codec for ``numel`` elements: measured GPU time where given, else the
    traced bytes at the memory bandwidth."""
    if preset in costs.gpu_s_per_element:
        return costs.gpu_s_per_element[preset] * numel
    return costs.traffic[preset] * numel / (c.mem_gbs * 1e9)


def codec_time(mode: str, n: int, m: Model, c: Cluster, costs: Costs) -> float:
    """Codec seconds per step of ``mode`` at ``n`` GPUs: reduce stage (:func:`_reduce_stage_s` of
    :data:`TRAFFIC_PRESET`; ``geonvfp4`` adds error feedback's share, fp8_ef - fp8; ``nccl_fp8_sum``
    :data:`NCCL_FP8_REDUCE_BYTES`) plus the gather stage (:func:`gather_stage_bytes` at the memory bandwidth).
    0 at n = 1 (nothing is reduced)."""
    if n == 1:
        return 0.0
    numel, bw = m.params, c.mem_gbs * 1e9
    b = bytes_per_element(mode, m.params, m.n_tensors)
    if mode == "nccl_fp8_sum":
        red = NCCL_FP8_REDUCE_BYTES * numel / bw
    else:
        red = _reduce_stage_s(TRAFFIC_PRESET[mode], numel, c, costs)
        if mode == "geonvfp4":
            red += _reduce_stage_s("fp8_ef", numel, c, costs) - _reduce_stage_s("fp8", numel, c, costs)
    if c.gather == "params":  # the parameter copy and gather are the same for every mode: not a codec cost
        return red
    return red + gather_stage_bytes(mode, n, b) * numel / bw


def step_breakdown(mode: str, n: int, m: Model, c: Cluster, costs: Costs) -> dict[str, float]:
    """Seconds per step: ``compute``, ``comm`` (full collective), ``exposed``, ``codec``, ``step``; and
    ``carried``: bytes per gradient element the rank's collectives carry, both stages, the plan's ratios included.

    Raises:
        ProjectionError: an unknown mode or ``n < 1``.
    """
    tc = m.flops_per_token * m.tokens_per_step / (n * c.peak_tflops * 1e12 * c.mfu)
    bw = (c.intra_gbs if n <= c.gpus_per_node else c.net_gbs) * 1e9
    b = bytes_per_element(mode, m.params, m.n_tensors)
    alpha = c.alpha_us * 1e-6
    # the shard plan's (reduce, gather) ratios; NCCL's FP8 sum runs over one flat buffer (no shard plan)
    planned = bool(m.config_path) and n > 1 and mode != "nccl_fp8_sum"
    red_r, gat_r = wire_ratios(m.config_path, n, mode != "fp32") if planned else (1.0, 1.0)
    if c.gather == "params":  # reduce-scatter in the wire format, then the parameter all-gather
        carried = b * red_r + c.param_bytes * gat_r
        if n == 1:
            comm = 0.0
        else:
            rs = (nccl_fp8_reduce_scatter_time if mode == "nccl_fp8_sum" else ring_phase_time)(
                n, m.params * b * red_r, bw, alpha
            )
            comm = rs + ring_phase_time(n, m.params * c.param_bytes * gat_r, bw, alpha)
    else:
        ratio = 0.5 * (red_r + gat_r)
        carried = 2 * b * ratio
        if n == 1:
            comm = 0.0
        elif mode == "nccl_fp8_sum":
            comm = nccl_fp8_allreduce_time(n, m.params * b, bw, alpha)
        else:
            comm = allreduce_time(n, m.params * b * ratio, bw, alpha)
    exposed = comm - min(c.overlap * comm, c.window * tc)
    codec = codec_time(mode, n, m, c, costs)
    step = tc + exposed + codec
    if mode.startswith("geo") and n > 1:
        per_layer = (costs.geo_added_s_per_layer or {}).get(m.name)
        if per_layer is not None:  # measured on the GPU for this model's layer shape
            codec += m.geo_layers * per_layer
            step += m.geo_layers * per_layer
        else:
            step *= 1.0 + costs.geo_overhead
    return {"compute": tc, "comm": comm, "exposed": exposed, "codec": codec, "step": step, "carried": carried}


def reduction(mode: str, ref: str, n: int, m: Model, c: Cluster, costs: Costs) -> float:
    """1 - T_mode / T_ref (positive = faster than the reference)."""
    return 1.0 - step_breakdown(mode, n, m, c, costs)["step"] / step_breakdown(ref, n, m, c, costs)["step"]


def strongest_baseline(n: int, m: Model, c: Cluster, costs: Costs) -> str:
    """The fastest of :data:`BASELINES` at ``n`` GPUs (ties: the first in BASELINES' order)."""
    return min(BASELINES, key=lambda b: step_breakdown(b, n, m, c, costs)["step"])


# wire-byte orderings the projection must respect: our reducer's formats on one path, and the baselines
ORDERED_CHAINS = (("fp32", "bf16", "fp8", "nvfp4"), ("fp32", "bf16", "nccl_fp8_sum"))


def ordering_violations(n: int, m: Model, c: Cluster, costs: Costs, chains=ORDERED_CHAINS) -> list[str]:
    """Pairs within each chain of ``chains`` where the mode whose collectives carry fewer bytes per element
    (``carried`` of :func:`step_breakdown`: the wire format times the shard plan's ratios) projects slower (empty =
    none). The chains keep like with like: our reducer's formats share one path (all-to-all, FP32 sum); the NCCL
    FP8 sum runs another collective and is compared with the other baselines."""
    bad = []
    for modes in chains:
        s = {x: step_breakdown(x, n, m, c, costs) for x in modes}
        for lo in modes:
            for hi in modes:
                b_lo, b_hi, t_lo, t_hi = s[lo]["carried"], s[hi]["carried"], s[lo]["step"], s[hi]["step"]
                if b_lo < b_hi and t_lo > t_hi * (1 + 1e-12):
                    bad.append(f"{lo} ({b_lo:.3f} B) {t_lo * 1e3:.2f} ms > {hi} ({b_hi:.3f} B) {t_hi * 1e3:.2f} ms")
    return bad


def projection_table(models: list[Model], gpus: list[int], c: Cluster, costs: Costs) -> list[dict]:
    """One row per (model, GPUs, mode): :func:`step_breakdown`, ``vs_fp32``, ``baseline`` (the strongest) and
    ``vs_baseline``."""
    rows = []
    for m in models:
        for n in gpus:
            base = strongest_baseline(n, m, c, costs)
            for mode in MODES:
                s = step_breakdown(mode, n, m, c, costs)
                rows.append(
                    {
                        "model": m.name,
                        "gpus": n,
                        "mode": mode,
                        **s,
                        "vs_fp32": reduction(mode, "fp32", n, m, c, costs),
                        "baseline": base,
                        "vs_baseline": reduction(mode, base, n, m, c, costs),
                    }
                )
    return rows


def sensitivity(m: Model, n: int, c: Cluster, costs: Costs) -> list[dict]:
    """Grid over :data:`SENS_NET_GBS` x :data:`SENS_MFU` x :data:`SENS_OVERLAP` (the rest of ``c`` kept): per
    cell fp8 and geofp8 vs fp32, the strongest baseline and geofp8 vs it."""
    out = []
    for net in SENS_NET_GBS:
        for mfu in SENS_MFU:
            for ov in SENS_OVERLAP:
                cc = replace(c, net_gbs=net, mfu=mfu, overlap=ov)
                base = strongest_baseline(n, m, cc, costs)
                out.append(
                    {
                        "net_gbs": net,
                        "mfu": mfu,
                        "overlap": ov,
                        "fp8_vs_fp32": reduction("fp8", "fp32", n, m, cc, costs),
                        "geofp8_vs_fp32": reduction("geofp8", "fp32", n, m, cc, costs),
                        "baseline": base,
                        "geofp8_vs_baseline": reduction("geofp8", base, n, m, cc, costs),
                        "violations": ordering_violations(n, m, cc, costs),
                    }
                )
    return out


def plot(rows: list[dict], path: str, note: str = "") -> None:
    """Reduction vs fp32 over the GPU count, one panel per model (PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.6), squeeze=False)
    for ax, mname in zip(axes[0], models):
        for i, mode in enumerate(MODES[1:]):
            pts = [(r["gpus"], 100 * r["vs_fp32"]) for r in rows if r["model"] == mname and r["mode"] == mode]
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode, color=plt.get_cmap("tab10")(i + 1)
            )
        ax.set_xscale("log", base=2)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel("GPUs (data parallel)")
        ax.set_ylabel("projected step-time reduction vs fp32 (%)")
        ax.set_title(mname)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(head: list[str], body: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for cells in body:
            print("| " + " | ".join(cells) + " |")
    else:
        print("  ".join(head))
        for cells in body:
            print("  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Cluster()
    ap.add_argument("--models", nargs="+", default=["configs/llama_300m.yaml", "configs/llama_600m.yaml"])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--global-batch", type=int, default=None, help="samples per step (default: each config's)")
    ap.add_argument("--device", choices=sorted(DEVICES), default=PAPER["device"], help="memory bandwidth and peak")
    ap.add_argument("--mem-gbs", type=float, default=None, help="device memory bandwidth, GB/s (replaces --device's)")
    ap.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    ap.add_argument("--net-gbs", type=float, default=d.net_gbs, help="per-GPU network bandwidth, GB/s")
    ap.add_argument("--intra-gbs", type=float, default=d.intra_gbs, help="intra-node bandwidth per GPU, GB/s")
    ap.add_argument("--alpha-us", type=float, default=d.alpha_us, help="latency per ring hop, microseconds")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense BF16 peak per GPU (default: --device's)")
    ap.add_argument("--mfu", type=float, default=None, help=f"MFU (default {d.mfu}, or the --gpu-check measurement)")
    ap.add_argument("--overlap", type=float, default=d.overlap, help="fraction of the collective hidden by compute")
    ap.add_argument(
        "--codec-output",
        default=str(ROOT / "docs" / "bench" / "codec_cpu.json"),
        help="benchmarks/codec.py --json OUT: its traced bytes per element (default: the committed run)",
    )
    ap.add_argument("--geo-output", default=str(ROOT / "docs" / "bench" / "geo_overhead_cpu.txt"))
    ap.add_argument(
        "--gather",
        choices=["wire", "params"],
        default="wire",
        help="wire: the gradient all-reduced in the wire format (the paper's setting, default); params: the "
        "trainer's distributed optimizer (gradient reduce-scatter, then the parameters gathered in "
        "--param-bytes)",
    )
    ap.add_argument("--param-bytes", type=float, default=4.0, help="bytes per gathered parameter (fp32 4, bf16 2)")
    ap.add_argument("--geo-overhead", type=float, default=None, help="GeoFP8 added step fraction (overrides)")
    ap.add_argument("--run-benchmarks", action="store_true", help="measure codec traffic and geo overhead now")
    ap.add_argument(
        "--gpu-check",
        default=None,
        help="gpu_check.json of benchmarks/gpu_check.sh: the reducers' GPU times, the device copy bandwidth, "
        "GeoFP8 ms per layer and the measured MFU of llama_600m replace the traffic model and defaults",
    )
    ap.add_argument("--plot", default=None, help="write the reduction-vs-GPUs plot (PNG) here")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    a = ap.parse_args(argv)
    bad = [f"--gpus {n} must be >= 1" for n in a.gpus if n < 1]
    if a.mfu is not None and not 0 < a.mfu <= 1:
        bad.append(f"--mfu {a.mfu} must be in (0, 1] (a fraction of the peak)")
    if not 0 <= a.overlap <= 1:
        bad.append(f"--overlap {a.overlap} must be in [0, 1] (the fraction of the collective hidden)")
    if a.plot and not Path(a.plot).resolve().parent.is_dir():
        bad.append(f"--plot {a.plot}: folder {Path(a.plot).parent} does not exist; create it or choose another path")
    for name in ("net_gbs", "intra_gbs", "peak_tflops", "mem_gbs", "param_bytes"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            bad.append(f"--{name.replace('_', '-')} {v} must be > 0")
    if bad:
        print(f"error: {bad[0]}", file=sys.stderr)
        return 2
    dev = DEVICES[a.device]
    try:
        gpu = load_gpu_check(a.gpu_check) if a.gpu_check else None
        mfu_src = "assumption (middle of the sensitivity range)"
        if a.mfu is None:
            if gpu and "llama_600m" in gpu["mfu"]:
                a.mfu, mfu_src = gpu["mfu"]["llama_600m"], f"measured: {a.gpu_check} (train_600m, one GPU)"
            else:
                a.mfu = d.mfu
        else:
            mfu_src = "--mfu (given)"
        mem_src = f"assumption: {dev['name']} datasheet peak (--device {a.device})"
        mem = dev["mem_gbs"]
        if a.mem_gbs is not None:
            mem, mem_src = a.mem_gbs, "--mem-gbs (given)"
        elif gpu and "mem_gbs" in gpu:
            mem, mem_src = gpu["mem_gbs"], f"measured: {a.gpu_check} ({gpu['device_name']}, 2 x device copy GB/s)"
        peak = a.peak_tflops or dev["peak_tflops"]
        costs = load_costs(a.codec_output, a.geo_output, a.run_benchmarks, a.geo_overhead)
        if gpu:
            costs.gpu_s_per_element = {p: v for p, v in gpu["gpu_s_per_element"].items() if p in NEEDED_PRESETS}
            costs.sources["gpu"] = a.gpu_check
            if gpu["geo_added_s_per_layer"]:
                costs.geo_added_s_per_layer = gpu["geo_added_s_per_layer"]
                costs.sources["geo_layer"] = f"measured: {a.gpu_check} (GPU, G T + T^-1 per layer)"
        models = [model_from_config(p, a.global_batch) for p in a.models]
        paper_model = model_from_config(PAPER["model"], PAPER["global_batch"])
    except ProjectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = Cluster(
        a.gpus_per_node,
        a.net_gbs,
        a.intra_gbs,
        a.alpha_us,
        peak,
        a.mfu,
        a.overlap,
        mem_gbs=mem,
        gather=a.gather,
        param_bytes=a.param_bytes,
    )

    print("inputs (value | measured or assumed, and the source):")
    for m in list({m.name: m for m in models + [paper_model]}.values()):
        print(
            f"  {m.name}: {m.params:,} parameters, {m.n_tensors} tensors, {m.flops_per_token / 1e9:.3f} GFLOP/token, "
            f"{m.tokens_per_step:,} tokens/step | config: megatron_geo.model.llama count_parameters / flops_per_token"
        )
    for m in models:
        rs = ", ".join(
            f"{n} GPUs x{wire_ratio(m.config_path, n, False):.3f}/x{wire_ratio(m.config_path, n, True):.3f}"
            for n in a.gpus
            if n > 1
        )
        print(
            f"  {m.name}: wire bytes per rank over an even unpadded ring (fp32 / all-to-all): {rs} | "
            f"computed: shard plan of the config (tools/plan_report.py)"
        )
    print(
        f"  network {c.net_gbs:g} GB/s per GPU, intra-node {c.intra_gbs:g} GB/s, {c.gpus_per_node} GPU(s)/node, "
        f"alpha {c.alpha_us:g} us | assumption (docs/design.md section 6: NDR 400 Gb/s)"
    )
    print(f"  peak {c.peak_tflops:g} TFLOP/s per GPU | assumption: dense BF16 datasheet peak (--device {a.device})")
    print(f"  MFU {c.mfu:.3f} | {mfu_src}")
    print(f"  overlap {c.overlap:.2f} of the collective hidden, at most 2/3 of compute | assumption (--overlap)")
    print(f"  device memory bandwidth {c.mem_gbs:.0f} GB/s | {mem_src}")
    if c.gather == "params":
        print(
            f"  collective: gradient reduce-scatter in the wire format, then the parameters all-gathered at "
            f"{c.param_bytes:g} B/element (the trainer's distributed optimizer; --gather params) | assumption"
        )
    else:
        print(
            "  collective: gradient all-reduce, both stages in the wire format (the paper's setting; the trainer's "
            "distributed optimizer gathers parameters instead: --gather params) | assumption"
        )
    print(
        "  datasheet bandwidths: "
        + ", ".join(f"{k} {v['name']} {v['mem_gbs'] / 1e3:g} TB/s" for k, v in DEVICES.items())
        + " (a fused codec pass assumed to stream at the peak: codec times are lower bounds by ~10-15%)"
    )
    for mode in MODES:
        if mode == "nccl_fp8_sum":
            red = f"{NCCL_FP8_REDUCE_BYTES:g} B/element (formula: amax read 4 + scaled cast read 4, write 1)"
        else:
            p = TRAFFIC_PRESET[mode]
            if p in costs.gpu_s_per_element:
                red = (
                    f"{costs.gpu_s_per_element[p] * 1e12:.2f} ps/element (measured: {costs.sources['gpu']}, preset {p})"
                )
            else:
                red = f"{costs.traffic[p]:.2f} B/element (traced: {costs.sources['codec']}, preset {p})"
            if mode == "geonvfp4":
                red += " + error feedback's share (fp8_ef - fp8)"
        b = bytes_per_element(mode, models[-1].params, models[-1].n_tensors)
        gat = (
            "none (parameters gathered)"
            if c.gather == "params"
            else f"{gather_stage_bytes(mode, 64, b):.2f} B/element at 64 GPUs (formula (b + 4)(1 + 1/n))"
        )
        print(f"  {mode}: wire {b:.4f} B/element ({models[-1].name}); codec reduce stage {red}; gather stage {gat}")
    if costs.gpu_s_per_element:
        missing = [p for p in NEEDED_PRESETS if p not in costs.gpu_s_per_element]
        if missing:
            print(f"  GPU codec rows missing for {missing}: those use the traced bytes at the bandwidth above")
    if costs.geo_added_s_per_layer:
        for name, sec in costs.geo_added_s_per_layer.items():
            print(
                f"  GeoFP8 added {sec * 1e3:.3f} ms per transformed layer and step ({name}) | "
                f"{costs.sources['geo_layer']}"
            )
    print(
        f"  GeoFP8 added step time {costs.geo_overhead:+.2%} of fp8+EF | measured: {costs.sources['geo']} (the tiny "
        f"config on CPU; a large model's ratio of transform to step work may differ)"
        + ("; used only for models without a per-layer figure" if costs.geo_added_s_per_layer else "")
    )
    for m in models:
        print(f"  {m.name}: GeoFP8 transforms {m.geo_layers} layers | config: geo.layers")
    print("  baselines:")
    for k, v in BASELINES.items():
        print(f"    {k}: {v}")
    print(
        f"    nccl_fp8_sum algorithm: ring at <= {NCCL_RING_MAX_RANKS} ranks ((n - 1) FP8 roundings), tree above "
        f"(~log2 n roundings; assumed forced with NCCL_ALGO=Tree, NCCL's tuner may pick ring for large messages)"
    )

    rows = projection_table(models, a.gpus, c, costs)
    print(
        f"\nprojected step time, {c.net_gbs:g} GB/s per GPU, MFU {c.mfu:.2f}, overlap {c.overlap:.2f}, "
        f"{c.mem_gbs:.0f} GB/s memory; each cell: ms (vs fp32 / vs the strongest baseline; positive = faster)"
    )
    head = ["model", "GPUs", "strongest baseline"] + list(MODES)
    body = []
    for mname in dict.fromkeys(r["model"] for r in rows):
        for n in a.gpus:
            sel = {r["mode"]: r for r in rows if r["model"] == mname and r["gpus"] == n}
            body.append(
                [mname, str(n), sel["fp32"]["baseline"]]
                + [
                    f"{sel[x]['step'] * 1e3:.1f} ({sel[x]['vs_fp32']:+.1%} / {sel[x]['vs_baseline']:+.1%})"
                    for x in MODES
                ]
            )
    _table(head, body, a.markdown)
    print()
    for m in models:
        parts = []
        for n in a.gpus:
            sel = {r["mode"]: r for r in rows if r["model"] == m.name and r["gpus"] == n}
            parts.append(
                f"{n}: {sel['fp32']['baseline']}; geofp8 {sel['geofp8']['vs_baseline']:+.1%}, "
                f"fp8 {sel['fp8']['vs_baseline']:+.1%}, nvfp4 {sel['nvfp4']['vs_baseline']:+.1%}"
            )
        print(
            f"verdict {m.name}: per GPU count, the strongest baseline, then geofp8, fp8, nvfp4 vs it: "
            + " | ".join(parts)
        )
    viol = [f"{m.name} {n} GPUs: {v}" for m in models for n in a.gpus for v in ordering_violations(n, m, c, costs)]

    n0 = PAPER["gpus"]
    pc = replace(c, gpus_per_node=1, peak_tflops=a.peak_tflops or DEVICES[PAPER["device"]]["peak_tflops"])
    if a.mem_gbs is None and not (gpu and "mem_gbs" in gpu):
        pc = replace(pc, mem_gbs=DEVICES[PAPER["device"]]["mem_gbs"])
    grid = sensitivity(paper_model, n0, pc, costs)
    print(
        f"\nsensitivity at the paper's setting ({paper_model.name}, {n0} GPUs, 1 GPU/node, global batch "
        f"{PAPER['global_batch']}, seq 2048, {pc.mem_gbs:.0f} GB/s memory, collective --gather {pc.gather}); each "
        f"cell: fp8 vs fp32 / geofp8 vs fp32 / geofp8 vs the strongest baseline (its name); * = the cell nearest to "
        f"the paper's setting"
    )
    head = ["net GB/s", "MFU"] + [f"overlap {ov:g}" for ov in SENS_OVERLAP]
    body = []
    for net in SENS_NET_GBS:
        for mfu in SENS_MFU:
            cells = [f"{net:g}", f"{mfu:g}"]
            for ov in SENS_OVERLAP:
                g = next(x for x in grid if (x["net_gbs"], x["mfu"], x["overlap"]) == (net, mfu, ov))
                mark = "*" if (net, mfu, ov) == PAPER_CELL else ""
                cells.append(
                    f"{mark}{g['fp8_vs_fp32']:+.1%} / {g['geofp8_vs_fp32']:+.1%} / "
                    f"{g['geofp8_vs_baseline']:+.1%} ({g['baseline']})"
                )
            body.append(cells)
    _table(head, body, a.markdown)
    pcell = next(x for x in grid if (x["net_gbs"], x["mfu"], x["overlap"]) == PAPER_CELL)
    near = [
        f"({x['net_gbs']:g} GB/s, MFU {x['mfu']:g}, overlap {x['overlap']:g}): {x['fp8_vs_fp32']:+.1%}"
        for x in grid
        if abs(x["fp8_vs_fp32"] - PAPER["fp8_vs_fp32"]) <= 0.015
    ]
    print(
        f"paper (arXiv 2607.07494, {n0} GH200): FP8 vs FP32 {PAPER['fp8_vs_fp32']:.1%} and GeoFP8 vs FP32 "
        f"{PAPER['geofp8_vs_fp32']:.1%} shorter steps. Nearest cell *: {PAPER_CELL[0]:g} GB/s per GPU (the NDR "
        f"400 Gb/s assumption; the paper states no network figure), MFU {PAPER_CELL[1]:g} and overlap "
        f"{PAPER_CELL[2]:g} (not stated by the paper: the middle values): here fp8 {pcell['fp8_vs_fp32']:+.1%}, "
        f"geofp8 {pcell['geofp8_vs_fp32']:+.1%} vs fp32, strongest baseline {pcell['baseline']} "
        f"(geofp8 {pcell['geofp8_vs_baseline']:+.1%} vs it)"
    )
    print("cells within 1.5 points of the paper's FP8 figure: " + ("; ".join(near) if near else "none"))
    viol += [
        f"sensitivity ({x['net_gbs']:g} GB/s, MFU {x['mfu']:g}, overlap {x['overlap']:g}): {v}"
        for x in grid
        for v in x["violations"]
    ]
    print(
        "ordering check (bytes carried per element, plan ratios included, among fp32, bf16, fp8, nvfp4 on our "
        "reducer's path and among fp32, bf16, nccl_fp8_sum): "
        + (
            "no mode carrying fewer bytes projects slower, in every row and cell above"
            if not viol
            else f"{len(viol)} violations: " + "; ".join(viol[:5])
        )
    )
    if a.plot:
        plot(
            rows,
            a.plot,
            f"alpha-beta projection, {c.net_gbs:g} GB/s per GPU, MFU {c.mfu:.2f}, overlap {c.overlap:.2f}, "
            f"memory {c.mem_gbs:.0f} GB/s; codec: traced bytes ({costs.sources['codec']})"
            + (f" / GPU times ({costs.sources['gpu']})" if costs.gpu_s_per_element else ""),
        )
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
