#!/usr/bin/env python
"""Project the step time of every gradient-communication mode to a GPU cluster (alpha-beta model).

    python tools/project_scaling.py [--gpus 8 16 32 64 128 256] [--net-gbs 50] [--mfu 0.4] [--plot FILE]

Model (docs/design.md section 6), TP = 1, data parallel over all n GPUs, per step:

- compute  T_c = flops_per_token(model) * global_batch * seq_length / (n * peak * MFU)
  (``megatron_geo.model.llama.flops_per_token``: 6 N + 6 L s h, Kaplan et al. 2020 / PaLM app. B);
- gradient all-reduce in the mode's wire format, ring: 2 [(n-1) alpha + (n-1)/n * N b w / B], w = the shard plan's
  wire bytes over an even unpadded ring (``tools/plan_report.py``; 1.0 without padding or imbalance)
  (reduce-scatter or all-to-all + all-gather, each (n-1) alpha + (n-1)/n S / B), b = bytes per element
  (FP32 4, BF16 2, FP8 1 + 4 bytes per parameter tensor scale, NVFP4 0.5 + 1/16 + 4 per 1024-element chunk);
  B = per-GPU network bandwidth (``--net-gbs``; NVLink ``--intra-gbs`` when n <= GPUs per node);
- exposed communication = T_comm - min(overlap * T_comm, window * T_c) with ``--overlap`` the fraction of
  the collective that can hide behind compute and window = 2/3 (the backward pass, where bucket reductions
  start); exposed-comm fraction = 1 - overlap;
- codec: two quantize+dequantize round trips of the N-element gradient per step (the reduce stage encodes
  the whole buffer and decodes every source's chunk, the all-gather stage the same for the averaged shard),
  time = 2 * 4N / (ratio_to_copy * ``--copy-gbs``), ``ratio_to_copy`` = the mode's codec throughput over a
  plain memory copy measured on the reducer's own path by ``benchmarks/codec.py --json`` (so the CPU measurement is
  carried to the GPU as a
  fraction of its copy bandwidth); Hadamard adds two rotations (forward and inverse), error feedback one
  extra copy-speed pass;
- GeoFP8 / GeoNVFP4 = the Euclidean mode with error feedback times (1 + o), o = the added step time measured
  by ``benchmarks/geo_overhead.py`` (geofp8 vs fp8 + EF, side by side).

Step time = T_c + exposed comm + codec. Reduction vs a reference mode = 1 - T_mode / T_ref.

Calibration (``--calibrate``, on by default): the paper (arXiv 2607.07494) reports, for Llama-600M on 64
GH200 (one GPU per node, global batch 512, seq 2048), an end-to-end time reduction of 10.8% for Euclidean
FP8 vs FP32 gradient communication and 7.6% for GeoFP8. With MFU fixed (``--mfu``), the overlap that makes
the model's FP8 reduction equal 10.8% is found by bisection (if none in [0, 1], the MFU is solved instead
with no overlap); GeoFP8's reduction is then projected with our measured overhead.

Every input is printed with its source. Benchmark outputs are read from ``--codec-output`` and
``--geo-output`` (saved stdout of the two benchmarks; default ``docs/bench/*_cpu.txt``) or measured now with
``--run-benchmarks``. ``--gpu-check gpu_check.json`` (from ``benchmarks/gpu_check.sh`` on a GPU) replaces them
with GPU figures: codec ratios, the device copy GB/s, GeoFP8's added ms per transformed layer (then a GeoFP8
step = the fp8+EF step + layers x that time, layers = the matches of the config's ``geo.layers``) and the
measured single-GPU MFU of Llama-600M.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_geo.config import load_config  # noqa: E402
from megatron_geo.model.llama import count_parameters, flops_per_token  # noqa: E402

MODES = ["fp32", "bf16", "fp8", "fp8_ef", "fp8_hadamard", "geofp8", "nvfp4", "geonvfp4"]
PAPER = {"fp8_vs_fp32": 0.108, "geofp8_vs_fp32": 0.076, "gpus": 64, "model": "configs/llama_600m.yaml"}
# codec benchmark row used by each mode ("ratio to copy"); None = no codec
CODEC_ROW = {
    "fp32": None,
    "bf16": "bf16 cast",
    "fp8": "fp8_e4m3 tensor",
    "fp8_ef": "fp8_e4m3 tensor",
    "fp8_hadamard": "fp8_e4m3 tensor",
    "geofp8": "fp8_e4m3 tensor",
    "nvfp4": "nvfp4",
    "geonvfp4": "nvfp4",
}


class ProjectionError(ValueError):
    """A missing or unreadable benchmark output or a bad parameter; the message names the fix."""


# -- collectives (alpha-beta) --------------------------------------------------------------------------------
def ring_phase_time(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """One ring reduce-scatter / all-gather, or a pairwise all-to-all, of ``nbytes`` (the full buffer) per
    rank: (n-1) alpha + (n-1)/n * nbytes / bw seconds (bw in bytes/s, alpha in s). 0 for n = 1."""
    if n < 1:
        raise ProjectionError(f"GPU count {n} must be >= 1")
    return 0.0 if n == 1 else (n - 1) * alpha + (n - 1) / n * nbytes / bw


def allreduce_time(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """Ring all-reduce = reduce-scatter + all-gather: 2 [(n-1) alpha + (n-1)/n * nbytes / bw]."""
    return 2.0 * ring_phase_time(n, nbytes, bw, alpha)


def bytes_per_element(mode: str, numel: int, n_tensors: int) -> float:
    """Wire bytes per gradient element of ``mode`` including its scales."""
    base = {
        "fp32": "fp32",
        "bf16": "bf16",
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
    raise ProjectionError(f"unknown mode '{mode}'")


# -- inputs ----------------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    gpus_per_node: int = 1
    net_gbs: float = 50.0  # per-GPU network bandwidth, GB/s (NDR 400 Gb/s)
    intra_gbs: float = 450.0  # NVLink per GPU, GB/s (used when n <= gpus_per_node)
    alpha_us: float = 5.0  # per-hop latency, microseconds
    peak_tflops: float = 989.0  # dense BF16 peak per GPU (H100/GH200 SXM), TFLOP/s
    mfu: float = 0.4
    overlap: float = 0.0  # fraction of the collective hidden behind compute
    window: float = 2.0 / 3.0  # share of T_c during which reductions can overlap (backward)
    copy_gbs: float = 2000.0  # device memory-copy throughput (bytes of FP32 input per second / 1e9)


@dataclass
class Costs:
    """Measured inputs: codec throughput ratios to a memory copy, and the GeoFP8 step overhead."""

    ratio_to_copy: dict
    geo_overhead: float
    sources: dict
    geo_added_s_per_layer: dict = None  # model name -> seconds per selected layer and step (GPU measurement)


def parse_codec_output(text: str, source: str) -> dict[str, float]:
    """``{operation: ratio to copy}`` from benchmarks/codec_kernels.py stdout (bare kernels, one scale)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(\S.*?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if m and not line.startswith("operation"):
            rows[m.group(1).strip()] = float(m.group(4))
    need = {r for r in CODEC_ROW.values() if r} | {"hadamard128 rot+inv", "copy"}
    missing = need - rows.keys()
    if missing:
        raise ProjectionError(
            f"{source}: benchmarks/codec_kernels.py output lacks rows {sorted(missing)}; rerun "
            f"`python benchmarks/codec_kernels.py > {source}` or pass --run-benchmarks"
        )
    return rows


def parse_codec_json(text: str, source: str) -> dict[str, float]:
    """``{operation: throughput / copy}`` from ``benchmarks/codec.py --json OUT`` (the reducer's real path per
    preset): ``memcpy_ms / ms`` of the compiled rows when present (``comm.compile``, the default on CUDA),
    else the eager ones. The Hadamard row is the rotation alone: the fp8_hadamard preset minus fp8.

    Raises:
        ProjectionError: not JSON, or presets bf16, fp8, fp8_hadamard or nvfp4 missing.
    """
    import json

    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProjectionError(f"{source}: not the JSON of benchmarks/codec.py --json ({e.msg})") from None
    rows = d.get("presets_compiled") or d.get("presets") or {}
    missing = {"bf16", "fp8", "fp8_hadamard", "nvfp4"} - rows.keys()
    if missing:
        raise ProjectionError(
            f"{source}: benchmarks/codec.py JSON lacks presets {sorted(missing)}; rerun "
            f"`python benchmarks/codec.py --json {source}` or pass --run-benchmarks"
        )
    ratio = {k: float(r["memcpy_ms"]) / float(r["ms"]) for k, r in rows.items()}
    rot_ms = float(rows["fp8_hadamard"]["ms"]) - float(rows["fp8"]["ms"])
    return {
        "copy": 1.0,
        "bf16 cast": ratio["bf16"],
        "fp8_e4m3 tensor": ratio["fp8"],
        "nvfp4": ratio["nvfp4"],
        "hadamard128 rot+inv": float(rows["fp8"]["memcpy_ms"]) / rot_ms if rot_ms > 0 else 1e9,
    }


def parse_geo_output(text: str, source: str) -> float:
    """GeoFP8's added step time as a fraction, from benchmarks/geo_overhead.py stdout: its own work timed
    inside the step at the default refresh interval ("at geo.refresh_interval=50: ... = +X% of the fp8
    step", low noise) when present, else the end-to-end difference ("added +X% ...")."""
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
    """Figures from ``benchmarks/gpu_check.sh`` (``gpu_check.json``): ``ratio_to_copy`` per codec,
    ``copy_gbs`` (device-to-device copy), ``geo_added_s_per_layer`` per model, ``mfu`` per model (the
    training phase), each only where present and not a dry run."""
    import json

    p = Path(path)
    if not p.is_file():
        raise ProjectionError(f"--gpu-check '{path}' not found; pass the gpu_check.json of benchmarks/gpu_check.sh")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ProjectionError(f"--gpu-check '{path}' is not JSON ({e.msg})") from None
    if d.get("dry_run"):
        raise ProjectionError(f"--gpu-check '{path}' is a dry run (CPU stand-in figures); use a GPU run's output")
    out: dict = {"ratio_to_copy": {}, "geo_added_s_per_layer": {}, "mfu": {}}
    ops = (d.get("codec") or {}).get("ops") or {}
    for name, row in ops.items():
        out["ratio_to_copy"][name] = float(row["ratio_to_copy"])
    if "copy" in ops:
        out["copy_gbs"] = float(ops["copy"]["gbps"])
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
    sources = {}
    if run:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "codec.json"
            subprocess.run(
                [sys.executable, str(ROOT / "benchmarks" / "codec.py"), "--numel", "4194304", "--json", str(out)],
                capture_output=True,
                text=True,
                check=True,
            )
            codec_text = out.read_text()
        sources["codec"] = "benchmarks/codec.py --numel 4194304 --json (run now)"
        codec_path = "codec.json"
    else:
        p = Path(codec_path)
        if not p.is_file():
            raise ProjectionError(
                f"codec benchmark output '{p}' not found; write it with `python benchmarks/codec.py "
                f"--json {p}`, pass --codec-output FILE, or --run-benchmarks"
            )
        codec_text, sources["codec"] = p.read_text(), _show(p)
    if str(codec_path).endswith(".json"):
        ratios = parse_codec_json(codec_text, sources["codec"])
    else:  # saved stdout of benchmarks/codec_kernels.py (the bare kernels on one scale)
        ratios = parse_codec_output(codec_text, sources["codec"])
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
    return Costs(ratios, max(o, 0.0), sources)


# -- the step-time model -------------------------------------------------------------------------------------
@dataclass
class Model:
    name: str
    params: int
    n_tensors: int
    flops_per_token: float
    tokens_per_step: int
    geo_layers: int = 0  # layers GeoFP8 transforms (geo.layers of the config)
    config_path: str = ""  # the config; wire bytes then come from its shard plan (tools/plan_report.py)


_META: dict[str, list] = {}


@functools.cache
def wire_ratio(config_path: str, n: int, all_to_all: bool) -> float:
    """Wire bytes per rank per step of the plan's reduce + gather over those of an even, unpadded ring
    reduce-scatter + all-gather of the same parameters (``tools/plan_report.py``; 1.0 = no padding and balanced).
    ``all_to_all``: the low-precision path (receives ``(n - 1) x own``), else the FP32 per-owner reduce."""
    from megatron_geo.analysis.plan_report import meta_model_params, plan_figures

    cfg = load_config([config_path], [] if not all_to_all else ["comm.dtype=bf16"])
    if config_path not in _META:
        _META[config_path] = meta_model_params(cfg, 1)
    f = plan_figures(cfg, n, _META[config_path])
    red = f["wire_bytes_per_rank"] / f["even_reduce_scatter_bytes"]
    gat = f["gather_bytes_per_rank"] / f["even_all_gather_bytes"] if f["even_all_gather_bytes"] else red
    return 0.5 * (red + gat)


def model_from_config(path: str, global_batch: int | None = None) -> Model:
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


def step_breakdown(mode: str, n: int, m: Model, c: Cluster, costs: Costs) -> dict[str, float]:
    """Seconds per step: ``compute``, ``comm`` (full collective), ``exposed``, ``codec``, ``step``."""
    tc = m.flops_per_token * m.tokens_per_step / (n * c.peak_tflops * 1e12 * c.mfu)
    bw = (c.intra_gbs if n <= c.gpus_per_node else c.net_gbs) * 1e9
    b = bytes_per_element(mode, m.params, m.n_tensors)
    ratio = wire_ratio(m.config_path, n, mode != "fp32") if m.config_path and n > 1 else 1.0
    comm = allreduce_time(n, m.params * b * ratio, bw, c.alpha_us * 1e-6)
    exposed = comm - min(c.overlap * comm, c.window * tc)
    buf = 4.0 * m.params  # FP32 gradient bytes: the unit of the codec throughput
    copy_s = buf / (c.copy_gbs * 1e9)
    codec = 0.0
    row = CODEC_ROW[mode]
    if row:
        codec = 2 * copy_s / costs.ratio_to_copy[row]
    if mode == "fp8_hadamard":
        codec += 2 * copy_s / costs.ratio_to_copy["hadamard128 rot+inv"]  # rotation + inverse, both stages
    if mode.endswith("_ef") or mode.startswith("geo"):
        codec += copy_s
    step = tc + exposed + codec
    if mode.startswith("geo"):
        per_layer = (costs.geo_added_s_per_layer or {}).get(m.name)
        if per_layer is not None:  # measured on the GPU for this model's layer shape
            codec += m.geo_layers * per_layer
            step += m.geo_layers * per_layer
        else:
            step *= 1.0 + costs.geo_overhead
    return {"compute": tc, "comm": comm, "exposed": exposed, "codec": codec, "step": step}


def reduction(mode: str, ref: str, n: int, m: Model, c: Cluster, costs: Costs) -> float:
    """1 - T_mode / T_ref (positive = faster than the reference)."""
    return 1.0 - step_breakdown(mode, n, m, c, costs)["step"] / step_breakdown(ref, n, m, c, costs)["step"]


def _bisect(f, lo: float, hi: float, iters: int = 100) -> float | None:
    flo, fhi = f(lo), f(hi)
    if flo * fhi > 0:
        return None
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) * flo > 0:
            lo, flo = mid, f(mid)
        else:
            hi = mid
    return 0.5 * (lo + hi)


def calibrate(m: Model, c: Cluster, costs: Costs, target: float = PAPER["fp8_vs_fp32"], n: int = PAPER["gpus"]):
    """Cluster with the overlap (given c.mfu) or, failing that, the MFU (no overlap) for which the fp8 vs fp32
    reduction equals ``target``; returns (cluster, what was solved)."""
    ov = _bisect(lambda o: reduction("fp8", "fp32", n, m, replace(c, overlap=o), costs) - target, 0.0, 1.0)
    if ov is not None:
        return replace(c, overlap=ov), "overlap"
    mfu = _bisect(lambda u: reduction("fp8", "fp32", n, m, replace(c, overlap=0.0, mfu=u), costs) - target, 1e-3, 1.0)
    if mfu is None:
        raise ProjectionError(
            f"no MFU in (0, 1] and overlap in [0, 1] reproduce {target:.1%} for fp8 vs fp32; "
            f"check --net-gbs/--peak-tflops"
        )
    return replace(c, overlap=0.0, mfu=mfu), "mfu"


def projection_table(models: list[Model], gpus: list[int], c: Cluster, costs: Costs) -> list[dict]:
    rows = []
    for m in models:
        for n in gpus:
            for mode in MODES:
                s = step_breakdown(mode, n, m, c, costs)
                rows.append(
                    {
                        "model": m.name,
                        "gpus": n,
                        "mode": mode,
                        **s,
                        "vs_fp32": reduction(mode, "fp32", n, m, c, costs),
                        "vs_bf16": reduction(mode, "bf16", n, m, c, costs),
                    }
                )
    return rows


def plot(rows: list[dict], path: str, note: str = "") -> None:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Cluster()
    ap.add_argument("--models", nargs="+", default=["configs/llama_300m.yaml", "configs/llama_600m.yaml"])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--global-batch", type=int, default=None, help="samples per step (default: each config's)")
    ap.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    ap.add_argument("--net-gbs", type=float, default=d.net_gbs, help="per-GPU network bandwidth, GB/s")
    ap.add_argument("--intra-gbs", type=float, default=d.intra_gbs, help="intra-node bandwidth per GPU, GB/s")
    ap.add_argument("--alpha-us", type=float, default=d.alpha_us, help="latency per ring hop, microseconds")
    ap.add_argument("--peak-tflops", type=float, default=d.peak_tflops, help="dense BF16 peak per GPU")
    ap.add_argument(
        "--mfu",
        type=float,
        default=None,
        help=f"model FLOPs utilisation of the compute (default {d.mfu}, or the --gpu-check measurement)",
    )
    ap.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="fraction of the collective hidden behind compute (default: calibrated to the paper)",
    )
    ap.add_argument(
        "--copy-gbs",
        type=float,
        default=None,
        help=f"device memory-copy throughput, GB/s (default {d.copy_gbs}, or the --gpu-check measurement)",
    )
    ap.add_argument(
        "--codec-output",
        default=str(ROOT / "docs" / "bench" / "codec_cpu.json"),
        help="benchmarks/codec.py --json OUT (the reducer path; default: the committed CPU run), or "
        "saved stdout of benchmarks/codec_kernels.py",
    )
    ap.add_argument("--geo-output", default=str(ROOT / "docs" / "bench" / "geo_overhead_cpu.txt"))
    ap.add_argument(
        "--codec-ratio",
        type=float,
        default=None,
        help="assume every codec runs at this fraction of copy speed (e.g. 0.5 for fused GPU kernels) "
        "instead of the measured ratios",
    )
    ap.add_argument("--geo-overhead", type=float, default=None, help="GeoFP8 added step fraction (overrides)")
    ap.add_argument("--run-benchmarks", action="store_true", help="measure codec and geo overhead now")
    ap.add_argument(
        "--gpu-check",
        default=None,
        help="gpu_check.json of benchmarks/gpu_check.sh: GPU codec ratios, copy GB/s, GeoFP8 ms per "
        "layer and the measured MFU of llama_600m replace the CPU figures and defaults",
    )
    ap.add_argument("--plot", default=None, help="write the reduction-vs-GPUs plot (PNG) here")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    a = ap.parse_args(argv)
    bad = [f"--gpus {n} must be >= 1" for n in a.gpus if n < 1]
    if a.mfu is not None and not 0 < a.mfu <= 1:
        bad.append(f"--mfu {a.mfu} must be in (0, 1] (a fraction of the peak)")
    if a.plot and not Path(a.plot).resolve().parent.is_dir():
        bad.append(f"--plot {a.plot}: folder {Path(a.plot).parent} does not exist; create it or choose another path")
    if bad:
        print(f"error: {bad[0]}", file=sys.stderr)
        return 2
    try:
        gpu = load_gpu_check(a.gpu_check) if a.gpu_check else None
        mfu_src = copy_src = "assumption"
        if a.mfu is None:
            if gpu and "llama_600m" in gpu["mfu"]:
                a.mfu, mfu_src = gpu["mfu"]["llama_600m"], f"{a.gpu_check} (train_600m, one GPU)"
            else:
                a.mfu = d.mfu
        else:
            mfu_src = "--mfu"
        if a.copy_gbs is None:
            if gpu and "copy_gbs" in gpu:
                a.copy_gbs, copy_src = gpu["copy_gbs"], f"{a.gpu_check} (device-to-device copy)"
            else:
                a.copy_gbs = d.copy_gbs
        else:
            copy_src = "--copy-gbs"
        for name in ("net_gbs", "intra_gbs", "peak_tflops", "mfu", "copy_gbs"):
            if getattr(a, name) <= 0:
                raise ProjectionError(f"--{name.replace('_', '-')} {getattr(a, name)} must be > 0")
        if a.overlap is not None and not 0 <= a.overlap <= 1:
            raise ProjectionError(f"--overlap {a.overlap} must be in [0, 1]")
        costs = load_costs(a.codec_output, a.geo_output, a.run_benchmarks, a.geo_overhead)
        if gpu and gpu["ratio_to_copy"]:
            missing = ({r for r in CODEC_ROW.values() if r} | {"hadamard128 rot+inv"}) - gpu["ratio_to_copy"].keys()
            if missing:
                raise ProjectionError(f"--gpu-check '{a.gpu_check}': codec rows {sorted(missing)} missing")
            costs.ratio_to_copy, costs.sources["codec"] = gpu["ratio_to_copy"], f"{a.gpu_check} (GPU codec)"
        if gpu and gpu["geo_added_s_per_layer"]:
            costs.geo_added_s_per_layer = gpu["geo_added_s_per_layer"]
            costs.sources["geo_layer"] = f"{a.gpu_check} (GPU, G T + T^-1 per layer)"
        if a.codec_ratio is not None:
            if not a.codec_ratio > 0:
                raise ProjectionError(f"--codec-ratio {a.codec_ratio} must be > 0")
            costs.ratio_to_copy = {k: a.codec_ratio for k in costs.ratio_to_copy}
            costs.sources["codec"] = f"--codec-ratio {a.codec_ratio} (assumption, replaces the measured ratios)"
        models = [model_from_config(p, a.global_batch) for p in a.models]
        paper_model = model_from_config(PAPER["model"], 512)
    except ProjectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = Cluster(
        a.gpus_per_node, a.net_gbs, a.intra_gbs, a.alpha_us, a.peak_tflops, a.mfu, a.overlap or 0.0, copy_gbs=a.copy_gbs
    )

    print("inputs (value | source):")
    for m in list({m.name: m for m in models + [paper_model]}.values()):
        print(
            f"  {m.name}: {m.params:,} parameters, {m.n_tensors} tensors, {m.flops_per_token / 1e9:.3f} GFLOP/token, "
            f"{m.tokens_per_step:,} tokens/step | megatron_geo.model.llama count_parameters / flops_per_token"
        )
    for m in models:
        rs = ", ".join(
            f"{n} GPUs x{wire_ratio(m.config_path, n, False):.3f}/x{wire_ratio(m.config_path, n, True):.3f}"
            for n in a.gpus
            if n > 1
        )
        print(
            f"  {m.name}: wire bytes per rank over an even unpadded ring (fp32 / low-precision): {rs} | "
            f"shard plan of the config (tools/plan_report.py)"
        )
    print(
        f"  network {c.net_gbs} GB/s per GPU, intra-node {c.intra_gbs} GB/s, {c.gpus_per_node} GPU(s)/node, "
        f"alpha {c.alpha_us} us | assumption (docs/design.md section 6: NDR 400 Gb/s)"
    )
    print(f"  peak {c.peak_tflops} TFLOP/s per GPU | assumption (H100/GH200 dense BF16)")
    print(f"  MFU {c.mfu:.3f} | {mfu_src}")
    print(f"  device copy {c.copy_gbs:.0f} GB/s | {copy_src}")
    for row in sorted({r for r in CODEC_ROW.values() if r} | {"hadamard128 rot+inv"}):
        print(f"  codec '{row}' throughput / copy = {costs.ratio_to_copy[row]:.3f} | {costs.sources['codec']}")
    if costs.geo_added_s_per_layer:
        for name, sec in costs.geo_added_s_per_layer.items():
            print(
                f"  GeoFP8 added {sec * 1e3:.3f} ms per transformed layer and step ({name}) | "
                f"{costs.sources['geo_layer']}"
            )
    print(
        f"  GeoFP8 added step time {costs.geo_overhead:+.2%} of fp8+EF | {costs.sources['geo']} (measured on the "
        f"tiny config; a large model's ratio of transform to step work may differ)"
        + ("; used only for models without a per-layer figure" if costs.geo_added_s_per_layer else "")
    )
    for m in models:
        print(f"  {m.name}: GeoFP8 transforms {m.geo_layers} layers | geo.layers of its config")
    for mode in MODES:
        print(
            f"  {mode}: {bytes_per_element(mode, models[-1].params, models[-1].n_tensors):.4f} bytes/element "
            f"({models[-1].name}) | wire format incl. scales"
        )

    # calibration to the paper's setting
    pc = replace(c, gpus_per_node=1)
    solved_what = "given"
    if a.overlap is None:
        try:
            pc, solved_what = calibrate(paper_model, pc, costs)
        except ProjectionError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    n0 = PAPER["gpus"]
    fp8_red = reduction("fp8", "fp32", n0, paper_model, pc, costs)
    geo_red = reduction("geofp8", "fp32", n0, paper_model, pc, costs)
    print(
        f"\ncalibration (Llama-600M, {n0} GPUs, 1 GPU/node, global batch 512, seq 2048): solved {solved_what}: "
        f"MFU {pc.mfu:.3f}, overlap {pc.overlap:.3f} (exposed-comm fraction {1 - pc.overlap:.3f}); "
        f"fp8 vs fp32 {fp8_red:+.1%} (paper {PAPER['fp8_vs_fp32']:.1%}); "
        f"geofp8 vs fp32 {geo_red:+.1%} with our overhead (paper {PAPER['geofp8_vs_fp32']:.1%})"
    )
    bd = {mode: step_breakdown(mode, n0, paper_model, pc, costs) for mode in ("fp32", "fp8", "geofp8")}
    for mode, s in bd.items():
        print(
            f"  {mode}: compute {s['compute'] * 1e3:.1f} ms, all-reduce {s['comm'] * 1e3:.1f} ms "
            f"(exposed {s['exposed'] * 1e3:.1f}), codec {s['codec'] * 1e3:.2f} ms, step {s['step'] * 1e3:.1f} ms"
        )
    print("  other (MFU, exposed fraction) pairs reproducing the same 10.8%:", end="")
    for u in (0.2, 0.3, 0.5):
        ov = _bisect(
            lambda o: (
                reduction("fp8", "fp32", n0, paper_model, replace(pc, mfu=u, overlap=o), costs) - PAPER["fp8_vs_fp32"]
            ),
            0.0,
            1.0,
        )
        print(f" ({u:.2f}, {1 - ov:.3f})" if ov is not None else f" ({u:.2f}, none)", end="")
    print()

    rows = projection_table(models, a.gpus, pc if a.overlap is None else c, costs)
    sep = " | " if a.markdown else "  "
    head = ["model", "GPUs"] + [f"{m} ms (vs fp32 / vs bf16)" for m in MODES]
    print("\nprojected step time (calibrated cluster) and end-to-end reduction:")
    src = costs.sources["codec"]
    if a.codec_ratio is not None:
        print(f"codec cost: assumed {a.codec_ratio:g} x copy speed for every codec (--codec-ratio), not measured")
    elif "GPU" in src:
        print(f"codec cost: measured on a GPU ({src}); this is the figure to believe for a GPU cluster")
    else:
        print(
            f"codec cost: measured on a CPU ({src}), carried to the GPU as a fraction of copy speed; a GPU "
            f"codec is usually relatively faster, so read this as an upper bound on the codec's share and "
            f"prefer --gpu-check gpu_check.json from benchmarks/gpu_check.sh"
        )
    if a.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    else:
        print(sep.join(head))
    for mname in dict.fromkeys(r["model"] for r in rows):
        for n in a.gpus:
            cells = [mname, str(n)]
            for mode in MODES:
                r = next(x for x in rows if x["model"] == mname and x["gpus"] == n and x["mode"] == mode)
                cells.append(f"{r['step'] * 1e3:.1f} ({r['vs_fp32']:+.1%} / {r['vs_bf16']:+.1%})")
            print(("| " if a.markdown else "") + sep.join(cells) + (" |" if a.markdown else ""))
    if a.plot:
        cal = pc if a.overlap is None else c
        plot(
            rows,
            a.plot,
            f"alpha-beta projection, {cal.net_gbs:g} GB/s per GPU, MFU {cal.mfu:.2f}, overlap "
            f"{cal.overlap:.3f}; codec: {costs.sources['codec']}; GeoFP8 overhead "
            f"{costs.geo_overhead:+.2%}",
        )
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
