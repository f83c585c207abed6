#!/usr/bin/env python
"""Project the step time of every gradient-precision x parameter-gather-precision pair, per network fabric, with the
overlap windows a data-parallel step really has.

    python tools/project_scaling.py [--models configs/llama_300m.yaml configs/llama_600m.yaml] [--gpus 64 256]
        [--fabrics nvlink ndr400 ndr200] [--params bf16 fp8] [--layout even|plan] [--mfu 0.4] [--device gh200]
        [--gpu-check gpu_check.json] [--markdown]

Model (docs/design.md section 6), TP = 1, one GPU per node, data parallel over n ranks, per rank and step:

- compute T_c = flops_per_token x tokens per rank / (peak x MFU), ``megatron_geo.model.flops_per_token`` (Megatron-LM's
  convention, 6 W + 12 L s h); the rank's samples run as m micro-batches of the config's micro batch (fewer samples
  than that: one micro-batch of all of them); each micro-batch takes T_c / m, its forward 1/3 and its backward 2/3
  of that (2 and 4 FLOPs per weight and token), shared among the buckets in proportion to their parameters' FLOPs
  (every GEMM weight 6 per token, each layer's 12 s h of attention spread over that layer's weights; the embedding
  lookup and the norms none);
- buckets: the trainer's (``megatron_geo.analysis.plan_report.plan_layout``: ``parallel.bucket_size``, backward
  order), their collectives one after another on one communicator;
- gradient reduce-scatter, hidden only behind the LAST micro-batch's backward (earlier micro-batches accumulate
  locally): bucket i's collective starts when its backward part is done and the previous bucket's collective has
  finished; exposed = how far the chain runs past the end of that backward (:func:`grad_exposed`);
- parameter all-gather, hidden only behind the FIRST micro-batch's forward of the next step: every bucket's gather
  is started right after the optimizer step, in forward order, one after another (the trainer's
  ``overlap_param_gather``); bucket i's forward waits for its gather; exposed = how much later that forward ends
  than without gathers (:func:`param_exposed`);
- a collective's time: (n - 1) alpha + the busiest rank's bytes / B per bucket: a ring reduce-scatter or all-gather
  and a balanced all-to-all move (n - 1)/n of the bucket per rank; with ``--layout plan`` the trainer's shard plan is
  used for our reducer's rows (whole Muon matrices owned by one rank: an all-to-all owner receives (n - 1) x its
  range, the reduce or gather of a range moves the bucket minus the smallest range). NCCL's FP8 sum runs a ring up to
  8 ranks and PAT above (ceil(log2 n) alpha). B and alpha are the fabric's (:data:`FABRICS`);
- bytes per element from the wire-format registry (``megatron_geo.comm.formats``, ``WireFormat.bytes_per_element``)
  of the preset's ``comm`` section (``configs/comm/<preset>.yaml``) or of the parameter gather's format (fp8: E4M3 with
  one FP32 scale per ``comm.block_size`` elements; nvfp4: E2M1 with one E4M3 scale per 16);
- codec, not hidden (it takes the GPU from the compute): the reducer's reduce stage as traced bytes read + written
  per element (``benchmarks/codec.py``'s ``fused_traffic_bytes_per_element``) at the device memory bandwidth, or the
  measured GPU time of ``gpu_check.json``; the baselines' casts as formulas; a low-precision parameter gather's
  encode and decode as a formula (:func:`param_codec_bytes`). GeoFP8 adds its own measured work.

Step time = T_c + exposed reduce-scatter + exposed all-gather + codec. Not modelled: the optimizer step (the same
for every row; Muon's Newton-Schulz overlaps the reductions with ``optimizer.muon_overlap``), data loading,
stragglers, congestion beyond the busiest rank's bytes.

Rows: the native baselines (:data:`BASELINES`, each gathering BF16 parameters) and our reducer's gradient formats
(:data:`GRAD_MODES`) x the parameter-gather formats (``--params``). Every input is printed with its source and
whether it is measured or assumed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_geo.comm.formats import comm_view, get_format  # noqa: E402
from megatron_geo.config import load_config  # noqa: E402
from megatron_geo.model.llama import FLOPS_CONVENTION, count_parameters, flops_per_token  # noqa: E402


class ProjectionError(ValueError):
    """A missing or unreadable benchmark output or a bad parameter; the message names the fix."""


# -- fabrics ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fabric:
    """A network carrying the DP traffic: ``line_gbs`` GB/s per GPU per direction (the link's rate), ``alpha_us``
    microseconds per collective step (hop), ``what`` (the hardware and where the figure comes from)."""

    name: str
    line_gbs: float
    alpha_us: float
    what: str

    def gbs(self, efficiency: float) -> float:
        """GB/s a collective reaches per GPU per direction: ``line_gbs x efficiency``."""
        return self.line_gbs * efficiency


FABRICS: dict[str, Fabric] = {
    "nvlink": Fabric(
        "nvlink",
        450.0,
        2.0,
        "NVLink 4 (Hopper: 18 links x 25 GB/s = 450 GB/s per GPU per direction) inside one NVLink Switch System "
        "domain (DGX GH200 joins up to 256 GH200 in one): the DP group's traffic never leaves NVLink. The users' "
        "cluster has one GPU per node, so at DP 64 its DP traffic crosses InfiniBand instead; this row is what a "
        "single NVLink domain of that size would give",
    ),
    "ndr400": Fabric(
        "ndr400",
        50.0,
        5.0,
        "InfiniBand NDR 400 Gb/s, one ConnectX-7 per GPU (50 GB/s per direction), a non-blocking fat tree",
    ),
    "ndr200": Fabric(
        "ndr200",
        25.0,
        5.0,
        "InfiniBand NDR200-class, 200 Gb/s per GPU (25 GB/s per direction; e.g. one NDR port split in two, or HDR "
        "200), a non-blocking fat tree",
    ),
}
EFFICIENCY = 0.9  # share of the line rate a large NCCL collective reaches (bus bandwidth), every fabric


# -- wire bytes: the registry's ----------------------------------------------------------------------------------------
# our reducer's gradient formats: row name -> the comm preset (configs/comm/<preset>.yaml) that sets it
GRAD_MODES = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "geofp8": "geofp8", "nvfp4": "nvfp4"}
# parameter-gather formats: name -> the comm settings whose registry entry sizes them. fp8: E4M3 codes with one FP32
# scale per comm.block_size elements (the parameter gather's per-block scales); nvfp4: E2M1 with one E4M3 per 16
PARAM_FORMATS = {
    "fp32": {"dtype": "fp32"},
    "bf16": {"dtype": "bf16"},
    "fp8": {"dtype": "fp8_e4m3", "scaling": "block"},
    "nvfp4": {"dtype": "nvfp4"},
}


@functools.cache
def preset_comm(preset: str):
    """The ``comm`` section of ``configs/comm/<preset>.yaml`` over the defaults."""
    from megatron_geo.config.presets import preset_config

    return preset_config(preset).comm


def grad_bytes_per_element(preset: str) -> float:
    """Wire bytes per gradient element of comm preset ``preset``: the wire-format registry's
    ``WireFormat.bytes_per_element`` of its ``comm`` section (codes plus block scales; a per-parameter FP32 scale,
    a few bytes per tensor, is left out there and here)."""
    comm = preset_comm(preset)
    return get_format(comm.dtype).bytes_per_element(comm)


def param_bytes_per_element(fmt: str) -> float:
    """Wire bytes per parameter element gathered in ``fmt`` (:data:`PARAM_FORMATS`), from the registry.

    Raises:
        ProjectionError: an unknown format.
    """
    if fmt not in PARAM_FORMATS:
        raise ProjectionError(f"unknown parameter-gather format '{fmt}'; use one of {sorted(PARAM_FORMATS)}")
    view = comm_view(PARAM_FORMATS[fmt])
    return get_format(view.dtype).bytes_per_element(view)


# -- the rows --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scheme:
    """One row: how the gradient is reduce-scattered and in what the parameters are gathered.

    ``collective``: a :func:`collective_time` kind: ``nccl`` (NCCL's reduce-scatter: FP32, BF16 symmetric, FP8 sum),
    ``all_to_all`` (our reducer's low-precision path and Megatron's BF16 all-to-all), ``ring`` (our FP32 path: one
    ring reduce per owner's range). ``codec``: a :data:`TRAFFIC_PRESET` key (traced bytes or GPU time) or a
    formula key of :data:`FORMULA_CODEC`. ``planned``: our reducer (the shard plan applies with ``--layout plan``)."""

    name: str
    grad_bytes: float
    collective: str
    codec: str
    params: str
    param_bytes: float
    planned: bool
    geo: bool = False


BASELINES = {
    "fp32_rs": "FP32 gradients reduce-scattered by NCCL's ring, FP32 sums (Megatron-Core's default for BF16 training)",
    "bf16_a2a": "BF16 gradients through an all-to-all, summed in FP32 on the owner (Megatron-Core "
    "--ddp-reduce-scatter-with-fp32-accumulation; our bf16 preset takes the same path)",
    "bf16_sym": "BF16 gradients reduce-scattered by NCCL's symmetric-memory kernels, FP32 accumulators inside the "
    "kernel (NCCL >= 2.27 over NVLink / NVLS; across the network NCCL >= 2.29's LSA + GIN ReduceScatter kernels)",
    "nccl_fp8": "NCCL's native FP8 E4M3 sum (NCCL >= 2.24, SM >= 90): one scale shared by all ranks, every partial "
    "sum rounded to FP8 at each hop (ring: n - 1 roundings up to 8 ranks; PAT above: ~log2 n); a speed baseline, "
    "its sums are not FP32-accurate",
}
# the reduce stage's codec cost: benchmarks/codec.py preset whose traced bytes (and GPU time) a row uses
# (geofp8: fp8_ef's encode + error feedback; its per-128 amax pass and scales are a few % more, not counted here)
TRAFFIC_PRESET = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "geofp8": "fp8_ef", "nvfp4": "nvfp4"}
NEEDED_PRESETS = ("fp32", "bf16", "fp8", "fp8_ef", "nvfp4")
# formula codecs of the NCCL baselines, bytes read + written per element as (a, b): a + b / n
FORMULA_CODEC = {
    "none": (0.0, 0.0),  # FP32 in place: NCCL sums the gradient buffer itself
    "bf16_cast": (6.0, 6.0),  # FP32 -> BF16 cast (read 4, write 2); the shard back to FP32 (read 2, write 4)
    "fp8_cast": (9.0, 5.0),  # amax pass (read 4) + scaled cast (read 4, write 1); the shard decoded (read 1, write 4)
}
NCCL_RING_MAX_RANKS = 8


def schemes(params: list[str], modes: list[str] | None = None) -> list[Scheme]:
    """The baselines (BF16 parameter gather) then our gradient formats ``modes`` (default :data:`GRAD_MODES`) x the
    parameter-gather formats ``params``."""
    pb = param_bytes_per_element("bf16")
    out = [
        Scheme("fp32_rs", grad_bytes_per_element("fp32"), "nccl", "none", "bf16", pb, False),
        Scheme("bf16_a2a", grad_bytes_per_element("bf16"), "all_to_all", "bf16", "bf16", pb, False),
        Scheme("bf16_sym", grad_bytes_per_element("bf16"), "nccl", "bf16_cast", "bf16", pb, False),
        Scheme("nccl_fp8", grad_bytes_per_element("fp8"), "nccl", "fp8_cast", "bf16", pb, False),
    ]
    for mode in modes or list(GRAD_MODES):
        for p in params:
            out.append(
                Scheme(
                    mode,
                    grad_bytes_per_element(GRAD_MODES[mode]),
                    "ring" if mode == "fp32" else "all_to_all",
                    mode,
                    p,
                    param_bytes_per_element(p),
                    True,
                    geo=mode.startswith("geo"),
                )
            )
    return out


def label(s: Scheme) -> str:
    """``fp8 / fp8`` (gradient / parameters); a baseline's name with its BF16 gather."""
    return f"{s.name} / {s.params}" + (" (baseline)" if s.name in BASELINES else "")


# -- cluster and costs -----------------------------------------------------------------------------------------------
# Device memory bandwidth (datasheet peak, HBM) and dense BF16 peak. Sources: NVIDIA H100 Tensor Core GPU datasheet
# (H100 SXM5 80 GB HBM3: 3.35 TB/s, 989 TFLOP/s dense BF16), NVIDIA H200 datasheet (H200 SXM 141 GB HBM3e: 4.8 TB/s,
# 989 TFLOP/s), NVIDIA GH200 Grace Hopper Superchip datasheet (the 96 GB HBM3 part: 4.0 TB/s; 989 TFLOP/s). A fused
# codec pass is assumed to stream at the peak; measured copies reach about 85-90% of it.
DEVICES = {
    "h100": {"mem_gbs": 3350.0, "peak_tflops": 989.0, "name": "H100 SXM5 80GB HBM3"},
    "h200": {"mem_gbs": 4800.0, "peak_tflops": 989.0, "name": "H200 SXM 141GB HBM3e"},
    "gh200": {"mem_gbs": 4000.0, "peak_tflops": 989.0, "name": "GH200 (H100 96GB HBM3)"},
}
DEFAULT_MFU = 0.4
SENS_MFU = (0.3, 0.4, 0.5)
# the paper this repository reproduces (arXiv 2607.07494): Llama-600M on 64 GH200, one GPU per node, global batch
# 512, seq 2048; step time FP8 vs FP32 -10.8%, GeoFP8 vs FP32 -7.6% (no network figure stated)
PAPER = {"fp8_vs_fp32": 0.108, "geofp8_vs_fp32": 0.076, "gpus": 64, "model": "llama_600m"}


@dataclass
class Cluster:
    """The device and training assumptions (all printed): dense BF16 ``peak_tflops`` per GPU, ``mfu`` (a fraction
    of it), device memory bandwidth ``mem_gbs`` GB/s (bytes read + written), the fabrics' ``efficiency`` (share of the
    line rate), ``layout`` (``even``: every bucket split evenly over the ranks, as Megatron's buffers; ``plan``: the
    trainer's shard plan for our reducer's rows)."""

    peak_tflops: float = 989.0
    mfu: float = DEFAULT_MFU
    mem_gbs: float = DEVICES["gh200"]["mem_gbs"]
    efficiency: float = EFFICIENCY
    layout: str = "even"


@dataclass
class Costs:
    """Codec and GeoFP8 inputs.

    ``traffic``: preset -> bytes read + written per bucket element by the reduce stage (``benchmarks/codec.py``
    ``fused_traffic_bytes_per_element``); ``gpu_s_per_element``: preset -> the reducer's measured GPU seconds per
    element of the reduce stage (``gpu_check.json``), which replaces ``traffic`` where present; ``geo_overhead``:
    GeoFP8's added share of the compute time; ``geo_added_s_per_layer``: model name -> GPU seconds per transformed
    layer and step."""

    traffic: dict
    geo_overhead: float
    sources: dict
    geo_added_s_per_layer: dict | None = None
    gpu_s_per_element: dict = field(default_factory=dict)


# -- measured inputs ---------------------------------------------------------------------------------------------
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
    - ``mfu``: ``llama_<size>`` -> ``train_<size>.dp64_equivalent.mfu`` (the measured step with a DP 64 rank's share
      of Muon's Newton-Schulz; else ``train_<size>.mfu``; eager, Euclidean training phases only). Megatron-LM's FLOP
      convention, the same as :func:`megatron_geo.model.flops_per_token` here.

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
        if not (key.startswith("train_") and isinstance(val, dict)) or "compile" in key or "geofp8" in key:
            continue
        dp64 = (val.get("dp64_equivalent") or {}).get("mfu")
        if isinstance(dp64, (int, float)):  # the step with a DP 64 rank's share of Newton-Schulz
            out["mfu"]["llama_" + key[len("train_") :]] = float(dp64)
        elif isinstance(val.get("mfu"), (int, float)):
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


# -- the model and its buckets -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    """One bucket as its collectives see it: ``numel`` elements (the plan's buffer, padding included), the largest
    and smallest DP rank range ``own_max`` / ``own_min`` (elements; ``numel / n`` each on an even split) and
    ``flops_share``, its parameters' share of the model's FLOPs per token (so of each forward and backward)."""

    numel: float
    own_max: float
    own_min: float
    flops_share: float


@dataclass(frozen=True)
class Batch:
    """A step's batch: ``samples`` (the global batch) of ``seq`` tokens, ``micro`` samples per micro-batch."""

    samples: int
    seq: int
    micro: int


@dataclass
class Model:
    """One model: ``params`` (elements), FLOPs per token (:func:`megatron_geo.model.flops_per_token`), its
    :class:`Batch`, ``groups``: the trainer's buckets in launch (backward) order as ``(parameter names, elements,
    FLOPs per token)``, ``param_flops``: FLOPs per token of each parameter (:func:`param_flops_per_token`),
    ``geo_layers``: layers the geofp8 preset transforms, ``config_path``: the config (the shard plan's source; empty:
    even buckets only)."""

    name: str
    params: int
    flops_per_token: float
    batch: Batch
    groups: list[tuple[tuple[str, ...], int, float]]
    param_flops: dict = field(default_factory=dict)
    geo_layers: int = 0
    config_path: str = ""


def param_flops_per_token(infos: list, num_layers: int, seq: int, q_width: int) -> dict[str, float]:
    """FLOPs per token of each parameter, ``{name: FLOPs}`` from ``(name, shape, ...)`` of every parameter: 6 per
    element of a GEMM weight (2-D, not ``embed.weight``), plus each layer's attention square ``12 s q`` spread over that
    layer's GEMM weights by their element counts; 0 for the embedding lookup and the norms. The values add up to
    :func:`megatron_geo.model.flops_per_token` (Megatron-LM's convention)."""
    out: dict[str, float] = {}
    layer_numel: dict[str, int] = {}
    for name, shape, *_ in infos:
        gemm = len(shape) == 2 and name != "embed.weight"
        numel = math.prod(shape)
        out[name] = 6.0 * numel if gemm else 0.0
        m = re.match(r"layers\.(\d+)\.", name)
        if gemm and m:
            layer_numel[m.group(1)] = layer_numel.get(m.group(1), 0) + numel
    for name, shape, *_ in infos:
        m = re.match(r"layers\.(\d+)\.", name)
        if out[name] and m:
            out[name] += 12.0 * seq * q_width * math.prod(shape) / layer_numel[m.group(1)]
    return out


@functools.cache
def _meta(config_path: str, preset: str | None):
    """(config, its parameters on the meta device) of ``config_path`` with comm preset ``preset`` laid over it."""
    from megatron_geo.analysis.plan_report import meta_model_params

    files = [config_path] + ([str(ROOT / "configs" / "comm" / f"{preset}.yaml")] if preset else [])
    cfg = load_config(files)
    return cfg, meta_model_params(cfg, 1)


def model_from_config(path: str, global_batch: int | None = None) -> Model:
    """:class:`Model` of a config file: parameters, FLOPs and the buckets of its trainer (the config's own ``comm``)."""
    from megatron_geo.analysis.plan_report import plan_layout

    cfg, mp = _meta(str(path), None)
    mc = cfg.model
    pf = param_flops_per_token(mp.infos, mc.num_layers, mc.seq_length, mc.hidden_size)
    numel = {n: math.prod(shape) for n, shape, *_ in mp.infos}
    groups = [
        (tuple(names), sum(numel[x] for x in names), sum(pf[x] for x in names)) for names, _ in plan_layout(cfg, 1, mp)
    ]
    gcfg, gmp = _meta(str(path), "geofp8")
    batch = Batch(global_batch or cfg.train.global_batch_size, mc.seq_length, cfg.train.micro_batch_size)
    return Model(
        Path(path).stem, count_parameters(mc), flops_per_token(mc), batch, groups, pf, len(gmp.geo_layers), str(path)
    )


def micro_batches(m: Model, n: int) -> tuple[int, int]:
    """(micro-batches per rank, samples per micro-batch) at DP ``n``: the rank's ``samples / n`` in micro-batches of
    ``m.batch.micro``; fewer samples than that: one micro-batch of all of them.

    Raises:
        ProjectionError: the global batch does not split evenly over ``n`` ranks.
    """
    if n < 1 or m.batch.samples % n:
        raise ProjectionError(f"global batch {m.batch.samples} does not split over {n} DP ranks; choose a divisor")
    per_rank = m.batch.samples // n
    micro = min(m.batch.micro, per_rank)
    if per_rank % micro:
        raise ProjectionError(f"{per_rank} samples per rank are not whole micro-batches of {micro}")
    return per_rank // micro, micro


def even_buckets(m: Model, n: int) -> list[Bucket]:
    """The trainer's buckets at DP ``n`` (``m.groups`` for a model without a config), each split evenly over ``n``
    ranks with no padding (Megatron's layout)."""
    if m.config_path and n > 1:
        numel = _numels(m.config_path)
        groups = [
            (sum(numel[x] for x in names), sum(m.param_flops.get(x, 0.0) for x in names))
            for names, *_ in _plan(m.config_path, None, n)
        ]
    else:
        groups = [(e, f) for _, e, f in m.groups]
    total = sum(f for _, f in groups) or 1.0
    return [Bucket(float(e), e / n, e / n, f / total) for e, f in groups]


@functools.cache
def _numels(config_path: str) -> dict[str, int]:
    return {name: math.prod(shape) for name, shape, *_ in _meta(config_path, None)[1].infos}


@functools.cache
def _plan(config_path: str, preset: str | None, n: int) -> tuple[tuple[tuple[str, ...], int, int, int], ...]:
    from megatron_geo.analysis.plan_report import plan_layout

    cfg, mp = _meta(config_path, preset)
    return tuple((tuple(names), pl.buffer_numel, max(pl.sizes), min(pl.sizes)) for names, pl in plan_layout(cfg, n, mp))


def plan_buckets(m: Model, n: int, preset: str) -> list[Bucket]:
    """The trainer's buckets at DP ``n`` for comm preset ``preset`` (``tools/plan_report.py``'s shard plan: padding
    and uneven ranges included)."""
    total = sum(m.param_flops.values()) or 1.0
    return [
        Bucket(float(s), float(hi), float(lo), sum(m.param_flops.get(x, 0.0) for x in names) / total)
        for names, s, hi, lo in _plan(m.config_path, preset, n)
    ]


def buckets_for(s: Scheme, m: Model, n: int, c: Cluster) -> list[Bucket]:
    """The buckets row ``s`` moves: the shard plan for our reducer with ``layout="plan"``, else even."""
    if c.layout == "plan" and s.planned and m.config_path and n > 1:
        return plan_buckets(m, n, GRAD_MODES[s.name])
    return even_buckets(m, n)


# -- collectives -------------------------------------------------------------------------------------------------------
def collective_time(kind: str, n: int, b: Bucket, bytes_per_el: float, fabric: tuple[float, float]) -> float:
    """Seconds of one bucket's collective at DP ``n``: latency + the busiest rank's bytes / bandwidth.

    ``fabric`` = (bytes/s per GPU per direction, seconds per step). A rank of a reduce-scatter or all-gather moves
    the bucket less its smallest range, ``numel - own_min`` elements ((n - 1)/n of the bucket when even). ``kind``:

    - ``nccl``: NCCL's own reduce-scatter / all-gather of an even bucket: a ring (n - 1 steps) up to
      :data:`NCCL_RING_MAX_RANKS` ranks, PAT above (NCCL >= 2.23 with one GPU per node: ceil(log2 n) steps, the
      ring's bytes);
    - ``ring``: one ring collective per owner's range (our FP32 reduce: ``reduce_ranges``; the gather of uneven
      ranges: grouped broadcasts), n - 1 steps, the same bytes;
    - ``all_to_all``: n - 1 pairwise exchanges; the owner of the largest range receives (n - 1) x ``own_max``, a rank
      sends ``numel - own_min``: the larger sets the time.

    0 at n = 1.

    Raises:
        ProjectionError: an unknown ``kind`` or ``n < 1``.
    """
    bw, alpha = fabric
    if n < 1:
        raise ProjectionError(f"GPU count {n} must be >= 1")
    if n == 1:
        return 0.0
    ring_bytes = (b.numel - b.own_min) * bytes_per_el
    if kind == "nccl":
        steps = n - 1 if n <= NCCL_RING_MAX_RANKS else math.ceil(math.log2(n))
        return steps * alpha + ring_bytes / bw
    if kind == "ring":
        return (n - 1) * alpha + ring_bytes / bw
    if kind == "all_to_all":
        return (n - 1) * alpha + max(ring_bytes, (n - 1) * b.own_max * bytes_per_el) / bw
    raise ProjectionError(f"unknown collective '{kind}'")


# -- the windows -------------------------------------------------------------------------------------------------------
def grad_exposed(backward_s: list[float], comm_s: list[float]) -> float:
    """Seconds the gradient collectives run past the end of the last micro-batch's backward.

    Buckets in launch (backward) order: bucket i's gradient is complete when the backward of its parameters,
    ``backward_s[i]`` seconds after the previous bucket's, is done; its collective (``comm_s[i]`` seconds) starts then
    or when bucket i - 1's collective ends, whichever is later (one communicator runs them one at a time). Returns
    ``end of the last collective - end of the backward`` (>= 0: the last bucket's collective always starts at the end
    of the backward)."""
    ready = end = 0.0
    for b, c in zip(backward_s, comm_s, strict=True):
        ready += b
        end = max(end, ready) + c
    return end - ready


def param_exposed(forward_s: list[float], comm_s: list[float]) -> float:
    """Seconds the parameter gathers add to the first micro-batch's forward.

    Buckets in forward order: every gather starts right after the optimizer step, one at a time, so gather i ends at
    ``sum(comm_s[:i + 1])``; bucket i's forward (``forward_s[i]`` seconds) starts when the previous bucket's forward
    ended and its own gather has. Returns ``end of the last forward - sum(forward_s)`` (>= 0)."""
    gathered = done = 0.0
    for f, c in zip(forward_s, comm_s, strict=True):
        gathered += c
        done = max(done, gathered) + f
    return done - sum(forward_s)


def lump_exposed(comm_s: float, window_s: float) -> float:
    """The no-bucket estimate: ``max(0, comm_s - window_s)`` seconds (a chain of infinitely small buckets)."""
    return max(0.0, comm_s - window_s)


# -- codec -------------------------------------------------------------------------------------------------------------
def param_codec_bytes(fmt: str, n: int) -> float:
    """Bytes read + written per parameter element by a low-precision parameter gather's codec at DP ``n``: every
    rank decodes every gathered element into its BF16 replica (read the code b and the replica 2, write the replica
    2: b + 4) and encodes the difference of its own 1/n (read the new BF16 value 2 and the replica 2, write the code b
    and the replica 2: (b + 6) / n). 0 for ``bf16`` / ``fp32`` (gathered in place)."""
    if fmt in ("bf16", "fp32"):
        return 0.0
    b = param_bytes_per_element(fmt)
    return (b + 4.0) + (b + 6.0) / n


def _reduce_stage_s(preset: str, numel: float, c: Cluster, costs: Costs) -> float:
    """Seconds of our reducer's reduce stage for ``numel`` elements: measured GPU time where given, else the traced
    bytes at the memory bandwidth."""
    if preset in costs.gpu_s_per_element:
        return costs.gpu_s_per_element[preset] * numel
    return costs.traffic[preset] * numel / (c.mem_gbs * 1e9)


def codec_time(s: Scheme, n: int, m: Model, c: Cluster, costs: Costs) -> float:
    """Codec seconds per step of row ``s`` at DP ``n`` (not hidden): the gradient's reduce stage (our reducer:
    :func:`_reduce_stage_s` of :data:`TRAFFIC_PRESET`; a baseline: :data:`FORMULA_CODEC`, or Megatron's BF16
    all-to-all priced as our bf16 preset, which takes the same path) plus the parameter gather's
    (:func:`param_codec_bytes`), both at the memory bandwidth. 0 at n = 1."""
    if n == 1:
        return 0.0
    bw = c.mem_gbs * 1e9
    if s.codec in FORMULA_CODEC:
        a, per_n = FORMULA_CODEC[s.codec]
        grad = (a + per_n / n) * m.params / bw
    else:
        grad = _reduce_stage_s(TRAFFIC_PRESET[s.codec], m.params, c, costs)
    return grad + param_codec_bytes(s.params, n) * m.params / bw


# -- one step ----------------------------------------------------------------------------------------------------------
def step_breakdown(s: Scheme, n: int, m: Model, fabric: Fabric, c: Cluster, costs: Costs) -> dict[str, float]:
    """Seconds per step of row ``s`` at DP ``n`` on ``fabric``: ``compute``; the windows ``last_backward`` and
    ``first_forward``; ``reduce_scatter`` and ``all_gather`` (the collectives' chains, summed); ``exposed_rs`` /
    ``exposed_ag`` (:func:`grad_exposed` / :func:`param_exposed`); ``codec`` (GeoFP8's own work included); ``step``.

    Raises:
        ProjectionError: as :func:`micro_batches` or :func:`collective_time`.
    """
    mb, _ = micro_batches(m, n)
    tokens = m.batch.samples * m.batch.seq / n
    tc = m.flops_per_token * tokens / (c.peak_tflops * 1e12 * c.mfu)
    fwd, bwd = tc / mb / 3.0, 2.0 * tc / mb / 3.0
    link = (fabric.gbs(c.efficiency) * 1e9, fabric.alpha_us * 1e-6)
    bks = buckets_for(s, m, n, c)  # the gather moves the same buckets' ranges as the reduction
    rs = [collective_time(s.collective, n, b, s.grad_bytes, link) for b in bks]
    ag = [collective_time("nccl" if b.own_max == b.own_min else "ring", n, b, s.param_bytes, link) for b in bks]
    exp_rs = grad_exposed([bwd * b.flops_share for b in bks], rs)
    exp_ag = param_exposed([fwd * b.flops_share for b in reversed(bks)], ag[::-1])
    codec = codec_time(s, n, m, c, costs)
    if s.geo and n > 1:
        per_layer = (costs.geo_added_s_per_layer or {}).get(m.name)
        codec += m.geo_layers * per_layer if per_layer is not None else costs.geo_overhead * tc
    return {
        "compute": tc,
        "micro_batches": float(mb),
        "last_backward": bwd,
        "first_forward": fwd,
        "reduce_scatter": sum(rs),
        "all_gather": sum(ag),
        "exposed_rs": exp_rs,
        "exposed_ag": exp_ag,
        "codec": codec,
        "step": tc + exp_rs + exp_ag + codec,
    }


def projection_table(models: list[Model], gpus: list[int], fabrics: list[Fabric], c: Cluster, costs: Costs, rows):
    """One dict per (model, GPUs, fabric, row): :func:`step_breakdown`, ``row`` (:func:`label`), ``vs_fp32_rs``
    (1 - step / the fp32_rs baseline's step; positive = faster) and ``strongest`` (the fastest baseline's name)."""
    out = []
    for m in models:
        for n in gpus:
            for f in fabrics:
                steps = {r: step_breakdown(r, n, m, f, c, costs) for r in rows}
                ref = next(v["step"] for r, v in steps.items() if r.name == "fp32_rs")
                strongest = min((r for r in rows if r.name in BASELINES), key=lambda r: steps[r]["step"]).name
                for r, v in steps.items():
                    out.append(
                        {
                            "model": m.name,
                            "gpus": n,
                            "fabric": f.name,
                            "row": label(r),
                            "scheme": r,
                            **v,
                            "vs_fp32_rs": 1.0 - v["step"] / ref,
                            "strongest": strongest,
                        }
                    )
    return out


def monotonic_violations(rows_out: list[dict], fabrics: list[Fabric], efficiency: float) -> list[str]:
    """Where a fabric with more bandwidth and no more latency projects a longer step for the same model, DP size and
    row (empty = none)."""
    by = {(r["model"], r["gpus"], r["row"], r["fabric"]): r["step"] for r in rows_out}
    bad = []
    for fast in fabrics:
        for slow in fabrics:
            if fast.gbs(efficiency) > slow.gbs(efficiency) and fast.alpha_us <= slow.alpha_us:
                for (mname, n, row, fab), t in by.items():
                    if fab == fast.name and t > by[(mname, n, row, slow.name)] * (1 + 1e-12):
                        bad.append(f"{mname} DP {n} {row}: {fast.name} {t * 1e3:.2f} ms > {slow.name}")
    return bad


# -- output ------------------------------------------------------------------------------------------------------------
def _table(head: list[str], body: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for cells in body:
            print("| " + " | ".join(cells) + " |")
    else:
        print("  ".join(head))
        for cells in body:
            print("  ".join(cells))


def _fabric_head(f: Fabric, c: Cluster) -> str:
    return f"{f.name} {f.gbs(c.efficiency):g} GB/s"


def print_inputs(models: list[Model], fabrics: list[Fabric], rows: list[Scheme], c: Cluster, costs: Costs, src: dict):
    """Every input with its value and whether it is measured or assumed (``src``: where the MFU, memory bandwidth and
    peak came from)."""
    print("inputs (value | measured, computed or assumed, and the source):")
    print(f"  FLOPs per token: {FLOPS_CONVENTION} | megatron_geo.model.flops_per_token")
    for m in models:
        size = _meta(m.config_path, None)[0].parallel.bucket_size if m.config_path else 0
        print(
            f"  {m.name}: {m.params:,} parameters, {m.flops_per_token / 1e9:.3f} GFLOP/token, global batch "
            f"{m.batch.samples} x seq {m.batch.seq}, micro batch {m.batch.micro}, buckets of {size:,} elements, "
            f"GeoFP8 (geofp8 preset) transforms {m.geo_layers} layers | config "
            f"({m.config_path and _show(Path(m.config_path))}) and megatron_geo.analysis.plan_report.plan_layout"
        )
    print(f"  peak {c.peak_tflops:g} TFLOP/s dense BF16 per GPU | {src['peak']}")
    print(f"  MFU {c.mfu:.3f} of the compute (the step without exposed communication and codec) | {src['mfu']}")
    print(f"  device memory bandwidth {c.mem_gbs:.0f} GB/s (codec passes stream at it) | {src['mem']}")
    for f in fabrics:
        print(
            f"  fabric {f.name}: {f.line_gbs:g} GB/s line rate per GPU per direction x {c.efficiency:g} = "
            f"{f.gbs(c.efficiency):g} GB/s, {f.alpha_us:g} us per collective step | assumption: {f.what}"
        )
    print(
        f"  collective efficiency {c.efficiency:g} of the line rate (a large NCCL collective's bus bandwidth) "
        "| assumption"
    )
    print(
        "  per-bucket timing: a micro-batch's forward 1/3 and backward 2/3 of its compute (2 and 4 FLOPs per weight "
        "and token), each bucket's part in proportion to its parameters' FLOPs (6 per GEMM weight and token, each "
        "layer's 12 s h of attention over that layer's weights, embedding and norms 0) | assumption"
    )
    print(
        "  windows: the gradient reduce-scatter hides only behind the last micro-batch's backward, bucket i's "
        "collective starting when its backward part is done; the parameter all-gather only behind the first "
        "micro-batch's forward, all gathers started after the optimizer step in forward order; one collective at a "
        "time | the trainer's schedule (GradSync, DistributedOptimizer.publish with overlap_param_gather)"
    )
    print(
        f"  layout: {c.layout} ("
        + (
            "every bucket split evenly over the ranks, as Megatron's buffers; --layout plan for the trainer's shard "
            "plan"
            if c.layout == "even"
            else "our reducer's rows on the trainer's shard plan, whole Muon matrices owned by one rank; the baselines "
            "split evenly"
        )
        + ") | computed"
    )
    print(
        "  bytes per element | the wire-format registry (megatron_geo/comm/formats.py, WireFormat.bytes_per_element):"
    )
    for mode, preset in GRAD_MODES.items():
        comm = preset_comm(preset)
        print(f"    gradient {mode}: {grad_bytes_per_element(preset):.4f} (configs/comm/{preset}.yaml, {comm.dtype})")
    for p in dict.fromkeys(r.params for r in rows):
        print(f"    parameters {p}: {param_bytes_per_element(p):.4f} ({PARAM_FORMATS[p]})")
    print("  codec (not hidden), bytes read + written per element at the memory bandwidth, or measured GPU time:")
    for mode in GRAD_MODES:
        p = TRAFFIC_PRESET[mode]
        if p in costs.gpu_s_per_element:
            what = f"{costs.gpu_s_per_element[p] * 1e12:.2f} ps/element (measured: {costs.sources['gpu']}, preset {p})"
        else:
            what = f"{costs.traffic[p]:.2f} B/element (traced: {costs.sources['codec']}, preset {p})"
        print(f"    gradient {mode}: {what}")
    for name, (a, per_n) in FORMULA_CODEC.items():
        print(f"    baseline codec {name}: {a:g} + {per_n:g} / n B/element (formula)")
    for p in dict.fromkeys(r.params for r in rows):
        if param_codec_bytes(p, 64):
            print(
                f"    parameters {p}: (b + 4) + (b + 6) / n, {param_codec_bytes(p, 64):.2f} B/element at DP 64 "
                "(formula)"
            )
    if costs.geo_added_s_per_layer:
        for name, sec in costs.geo_added_s_per_layer.items():
            per = f"{sec * 1e3:.3f} ms per transformed layer and step ({name})"
            print(f"  GeoFP8 added {per} | {costs.sources['geo_layer']}")
    print(
        f"  GeoFP8 added {costs.geo_overhead:+.2%} of the compute time | measured: {costs.sources['geo']} (the tiny "
        f"config on CPU at 1024 tokens per rank; its transforms do not grow with tokens, so an upper bound here)"
        + ("; used only for models without a per-layer figure" if costs.geo_added_s_per_layer else "")
    )
    print("  baselines (each gathers BF16 parameters):")
    for k, v in BASELINES.items():
        print(f"    {k}: {v}")
    print(
        "  not modelled: the optimizer step (the same for every row), data loading, stragglers, congestion beyond the "
        "busiest rank's bytes, the codec's latency ahead of each bucket's collective"
    )


def print_tables(out: list[dict], models: list[Model], gpus: list[int], fabrics: list[Fabric], c: Cluster, md: bool):
    """Per model and DP size: the windows, then one row per scheme and one column per fabric."""
    for m in models:
        for n in gpus:
            sel = [r for r in out if r["model"] == m.name and r["gpus"] == n]
            one = sel[0]
            mb, micro = micro_batches(m, n)
            print(
                f"\n{m.name}, DP {n}: {mb} micro-batch(es) of {micro} per rank, {len(even_buckets(m, n))} buckets, "
                f"compute {one['compute'] * 1e3:.1f} ms; "
                f"windows: last backward {one['last_backward'] * 1e3:.1f} ms (reduce-scatter), first forward "
                f"{one['first_forward'] * 1e3:.1f} ms (all-gather). Each cell: step ms (exposed reduce-scatter + "
                f"exposed all-gather + codec, ms; vs fp32_rs, positive = faster)"
            )
            head = ["gradient / parameters"] + [_fabric_head(f, c) for f in fabrics]
            body = []
            for row in dict.fromkeys(r["row"] for r in sel):
                cells = [row]
                for f in fabrics:
                    r = next(x for x in sel if x["row"] == row and x["fabric"] == f.name)
                    cells.append(
                        f"{r['step'] * 1e3:.1f} ({r['exposed_rs'] * 1e3:.1f} + {r['exposed_ag'] * 1e3:.1f} + "
                        f"{r['codec'] * 1e3:.1f}; {r['vs_fp32_rs']:+.1%})"
                    )
                body.append(cells)
            _table(head, body, md)
            strongest = ", ".join(
                f"{f.name} {next(x['strongest'] for x in sel if x['fabric'] == f.name)}" for f in fabrics
            )
            ref = {x["fabric"]: x for x in sel if x["scheme"].name == "fp32_rs"}
            chains = ", ".join(
                f"{f.name} RS {ref[f.name]['reduce_scatter'] * 1e3:.1f} / AG {ref[f.name]['all_gather'] * 1e3:.1f}"
                for f in fabrics
            )
            print(f"strongest baseline per fabric: {strongest}; fp32_rs collectives in full (ms): {chains}")


def no_bucket_check(m: Model, fabric: Fabric, c: Cluster, costs: Costs) -> dict:
    """The check against the no-bucket arithmetic at DP 64 on ``fabric``: for fp32_rs, fp8 / bf16 and fp8 / fp8, the
    collectives in full, the windows, the exposed times both ways (:func:`lump_exposed` and per bucket) and the step
    reduction vs fp32_rs."""
    rows = {s.name + "/" + s.params: s for s in schemes(["bf16", "fp8"], ["fp8"])}
    picks = {"fp32_rs": rows["fp32_rs/bf16"], "fp8 / bf16": rows["fp8/bf16"], "fp8 / fp8": rows["fp8/fp8"]}
    out = {}
    for key, s in picks.items():
        v = step_breakdown(s, 64, m, fabric, c, costs)
        lump_rs = lump_exposed(v["reduce_scatter"], v["last_backward"])
        lump_ag = lump_exposed(v["all_gather"], v["first_forward"])
        out[key] = {**v, "lump_rs": lump_rs, "lump_ag": lump_ag, "lump_step": v["compute"] + lump_rs + lump_ag}
    for key in picks:
        out[key]["vs_fp32_rs"] = 1 - out[key]["step"] / out["fp32_rs"]["step"]
        out[key]["lump_vs_fp32_rs"] = 1 - out[key]["lump_step"] / out["fp32_rs"]["lump_step"]
    if m.config_path:  # the same no-bucket arithmetic with 6 x every parameter (embedding and norms too) + 12 L s h
        mc = _meta(m.config_path, None)[0].model
        alt = replace(m, flops_per_token=6.0 * m.params + 12.0 * mc.num_layers * mc.seq_length * mc.hidden_size)
        for key, s in picks.items():
            v = step_breakdown(s, 64, alt, fabric, c, costs)
            rs, ag = (
                lump_exposed(v["reduce_scatter"], v["last_backward"]),
                lump_exposed(v["all_gather"], v["first_forward"]),
            )
            out[key]["all_params"] = {
                "compute": v["compute"],
                "lump_rs": rs,
                "lump_ag": ag,
                "lump_step": v["compute"] + rs + ag,
            }
        for key in picks:
            x = out[key]["all_params"]
            x["lump_vs_fp32_rs"] = 1 - x["lump_step"] / out["fp32_rs"]["all_params"]["lump_step"]
    return out


def print_no_bucket_check(m: Model, fabric: Fabric, c: Cluster, costs: Costs) -> None:
    chk = no_bucket_check(m, fabric, c, costs)
    ref = chk["fp32_rs"]
    print(
        f"\ncheck against the no-bucket arithmetic ({m.name}, DP 64, {fabric.name} {fabric.gbs(c.efficiency):g} GB/s, "
        f"MFU {c.mfu:g}): compute {ref['compute'] * 1e3:.1f} ms, windows: last backward "
        f"{ref['last_backward'] * 1e3:.1f} ms, first forward {ref['first_forward'] * 1e3:.1f} ms"
    )
    for key, v in chk.items():
        print(
            f"  {key}: reduce-scatter {v['reduce_scatter'] * 1e3:.1f} ms, all-gather {v['all_gather'] * 1e3:.1f} ms; "
            f"no buckets: exposed {v['lump_rs'] * 1e3:.1f} + {v['lump_ag'] * 1e3:.1f} ms, step "
            f"{v['lump_step'] * 1e3:.1f} ms ({v['lump_vs_fp32_rs']:+.1%}); per bucket: exposed "
            f"{v['exposed_rs'] * 1e3:.1f} + {v['exposed_ag'] * 1e3:.1f} ms, codec {v['codec'] * 1e3:.1f} ms, step "
            f"{v['step'] * 1e3:.1f} ms ({v['vs_fp32_rs']:+.1%})"
        )
    if "all_params" in ref:
        a = ref["all_params"]
        print(
            f"  counting 6 x every parameter (embedding and norms too) + 12 L s h instead: compute "
            f"{a['compute'] * 1e3:.1f} ms; no buckets: fp32_rs exposed {a['lump_rs'] * 1e3:.1f} + "
            f"{a['lump_ag'] * 1e3:.1f} ms of a {a['lump_step'] * 1e3:.1f} ms step; "
            + ", ".join(f"{k} {v['all_params']['lump_vs_fp32_rs']:+.1%}" for k, v in chk.items() if k != "fp32_rs")
        )


def print_sensitivity(m: Model, fabrics: list[Fabric], c: Cluster, costs: Costs, md: bool) -> None:
    """fp8 / bf16, fp8 / fp8 and geofp8 / fp8 vs fp32_rs at DP 64 per fabric and MFU; the paper's figures beside."""
    rows = {s.name + "/" + s.params: s for s in schemes(["bf16", "fp8"], ["fp8", "geofp8"])}
    print(
        f"\nsensitivity to MFU ({m.name}, DP {PAPER['gpus']}); each cell: fp8 / bf16, fp8 / fp8, geofp8 / fp8 step "
        f"reduction vs fp32_rs"
    )
    head = ["MFU"] + [_fabric_head(f, c) for f in fabrics]
    body = []
    for mfu in SENS_MFU:
        cc = replace(c, mfu=mfu)
        cells = [f"{mfu:g}"]
        for f in fabrics:
            ref = step_breakdown(rows["fp32_rs/bf16"], PAPER["gpus"], m, f, cc, costs)["step"]
            red = [
                1 - step_breakdown(rows[k], PAPER["gpus"], m, f, cc, costs)["step"] / ref
                for k in ("fp8/bf16", "fp8/fp8", "geofp8/fp8")
            ]
            cells.append(" / ".join(f"{x:+.1%}" for x in red))
        body.append(cells)
    _table(head, body, md)
    print(
        f"paper (arXiv 2607.07494, Llama-600M on 64 GH200, network not stated): FP8 vs FP32 {PAPER['fp8_vs_fp32']:.1%} "
        f"and GeoFP8 vs FP32 {PAPER['geofp8_vs_fp32']:.1%} shorter steps"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=["configs/llama_300m.yaml", "configs/llama_600m.yaml"])
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 256], help="DP sizes (one GPU per node)")
    ap.add_argument("--fabrics", nargs="+", choices=sorted(FABRICS), default=list(FABRICS))
    ap.add_argument("--params", nargs="+", choices=sorted(PARAM_FORMATS), default=["bf16", "fp8"])
    ap.add_argument("--layout", choices=["even", "plan"], default="even", help="even buckets or the trainer's plan")
    ap.add_argument("--global-batch", type=int, default=None, help="samples per step (default: each config's)")
    ap.add_argument("--device", choices=sorted(DEVICES), default="gh200", help="memory bandwidth and peak")
    ap.add_argument("--mem-gbs", type=float, default=None, help="device memory bandwidth, GB/s (replaces --device's)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense BF16 peak per GPU (default: --device's)")
    ap.add_argument("--mfu", type=float, default=None, help=f"MFU (default {DEFAULT_MFU}, or --gpu-check's)")
    ap.add_argument("--efficiency", type=float, default=EFFICIENCY, help="share of the line rate collectives reach")
    ap.add_argument(
        "--codec-output",
        default=str(ROOT / "docs" / "bench" / "codec_cpu.json"),
        help="benchmarks/codec.py --json OUT: its traced bytes per element (default: the committed run)",
    )
    ap.add_argument("--geo-output", default=str(ROOT / "docs" / "bench" / "geo_overhead_cpu.txt"))
    ap.add_argument("--geo-overhead", type=float, default=None, help="GeoFP8 added compute fraction (overrides)")
    ap.add_argument("--run-benchmarks", action="store_true", help="measure codec traffic and geo overhead now")
    ap.add_argument(
        "--gpu-check",
        default=None,
        help="gpu_check.json of benchmarks/gpu_check.sh: the reducers' GPU times, the device copy bandwidth, "
        "GeoFP8 ms per layer and the measured MFU of llama_600m replace the traffic model and defaults",
    )
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    a = ap.parse_args(argv)
    bad = [f"--gpus {n} must be >= 1" for n in a.gpus if n < 1]
    if a.mfu is not None and not 0 < a.mfu <= 1:
        bad.append(f"--mfu {a.mfu} must be in (0, 1] (a fraction of the peak)")
    if not 0 < a.efficiency <= 1:
        bad.append(f"--efficiency {a.efficiency} must be in (0, 1] (a share of the line rate)")
    for name in ("peak_tflops", "mem_gbs"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            bad.append(f"--{name.replace('_', '-')} {v} must be > 0")
    if bad:
        print(f"error: {bad[0]}", file=sys.stderr)
        return 2
    dev = DEVICES[a.device]
    src = {"peak": f"assumption: dense BF16 datasheet peak (--device {a.device})"}
    try:
        gpu = load_gpu_check(a.gpu_check) if a.gpu_check else None
        src["mfu"] = "assumption (--mfu to change it)"
        if a.mfu is None:
            if gpu and "llama_600m" in gpu["mfu"]:
                a.mfu = gpu["mfu"]["llama_600m"]
                src["mfu"] = f"measured: {a.gpu_check} (train_600m, one GPU, a DP 64 rank's Newton-Schulz share)"
            else:
                a.mfu = DEFAULT_MFU
        else:
            src["mfu"] = "--mfu (given)"
        src["mem"] = f"assumption: {dev['name']} datasheet peak (--device {a.device})"
        mem = dev["mem_gbs"]
        if a.mem_gbs is not None:
            mem, src["mem"] = a.mem_gbs, "--mem-gbs (given)"
        elif gpu and "mem_gbs" in gpu:
            mem, src["mem"] = gpu["mem_gbs"], f"measured: {a.gpu_check} ({gpu['device_name']}, 2 x device copy GB/s)"
        if a.peak_tflops is not None:
            src["peak"] = "--peak-tflops (given)"
        costs = load_costs(a.codec_output, a.geo_output, a.run_benchmarks, a.geo_overhead)
        if gpu:
            costs.gpu_s_per_element = {p: v for p, v in gpu["gpu_s_per_element"].items() if p in NEEDED_PRESETS}
            costs.sources["gpu"] = a.gpu_check
            if gpu["geo_added_s_per_layer"]:
                costs.geo_added_s_per_layer = gpu["geo_added_s_per_layer"]
                costs.sources["geo_layer"] = f"measured: {a.gpu_check} (GPU, G T + T^-1 per layer)"
        models = [model_from_config(p, a.global_batch) for p in a.models]
        fabrics = [FABRICS[f] for f in a.fabrics]
        c = Cluster(a.peak_tflops or dev["peak_tflops"], a.mfu, mem, a.efficiency, a.layout)
        rows = schemes(a.params)
        for m in models:
            for n in a.gpus:
                micro_batches(m, n)
        out = projection_table(models, a.gpus, fabrics, c, costs, rows)
    except ProjectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_inputs(models, fabrics, rows, c, costs, src)
    print_tables(out, models, a.gpus, fabrics, c, a.markdown)
    paper = next((m for m in models if m.name == PAPER["model"]), None)
    if paper is not None and paper.batch.samples % PAPER["gpus"] == 0:
        print_no_bucket_check(paper, FABRICS["ndr200"], c, costs)
        print_sensitivity(paper, fabrics, c, costs, a.markdown)
    viol = monotonic_violations(out, fabrics, c.efficiency)
    print(
        "check: a faster fabric (more bandwidth, no more latency) never projects a longer step: "
        + (
            "holds for every model, DP size and row above"
            if not viol
            else f"{len(viol)} violations: " + "; ".join(viol[:5])
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
