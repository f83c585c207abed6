#!/usr/bin/env python
"""Shard plan, buffer memory, wire bytes and optimizer balance of a config at any DP size, without GPUs.

    python tools/plan_report.py --config configs/llama_600m.yaml --dp 64 [--tp N] [--json OUT] [key=value ...]
    python tools/plan_report.py --config configs/llama_600m.yaml --dp 8 16 64 128 --markdown

Prints rank 0, the rank with the most wire bytes and the rank with the most persistent memory (figures defined in
``megatron_geo/analysis/plan_report.py``), and the DP bytes per rank per step both ways (gradient reduce + parameter
gather) as a ratio to BF16 both ways (``comm.param_gather=fp8`` sends the parameters' quantised difference); ``--json``
writes one object per DP size (a list when several are given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_geo.analysis.plan_report import (  # noqa: E402
    meta_model_params,
    plan_figures,
    resolve_tensor_parallel,
)
from megatron_geo.config import ConfigError, load_config  # noqa: E402
from megatron_geo.training.validate import (
    output_file_problem,  # noqa: E402
    validate_config,  # noqa: E402
)

GiB = 2**30


def _fmt_rank(tag: str, r: dict) -> list[str]:
    b = r["bytes"]
    return [
        f"  {tag}: owns {r['elements_owned']:,} elements, optimizer {r['optimizer_flops'] / 1e9:,.1f} GFLOP/step, "
        f"persistent {r['persistent_bytes'] / GiB:.2f} GiB (grad buffer {b['grad_buffer'] / GiB:.2f}, param buffer "
        f"{b['param_buffer'] / GiB:.2f}, main params {b['main_params'] / GiB:.2f}, optimizer state "
        f"{b['optimizer_state'] / GiB:.2f}, error feedback {b['error_feedback'] / GiB:.2f}, GeoFP8 "
        f"{b['geo_state'] / GiB:.3f}); codec index tables {r.get('codec_table_bytes', 0) / 2**20:.2f} MiB",
        f"         reduce sends {r['reduce_sent_bytes'] / 1e9:.3f} GB, "
        f"receives {r['reduce_received_bytes'] / 1e9:.3f} GB;"
        f" gather sends {r['gather_sent_bytes'] / 1e9:.3f} GB per step",
    ]


def _fmt_split(f: dict) -> list[str]:
    s = f.get("muon_split", {})
    if not s.get("matrices"):
        return []
    return [
        f"  Muon split: {s['matrices']} matrices by rows over groups of {s['group_size']} DP ranks, "
        f"{s['member_flops_min'] / 1e9:,.1f}-{s['member_flops_max'] / 1e9:,.1f} GFLOP per member; group traffic "
        f"(Gram all-reduces + wide re-layouts) {s['group_bytes_per_rank'] / 1e6:,.1f} MB per rank per step"
    ]


def _fmt_auto_split(f: dict) -> list[str]:
    d = f.get("muon_split_auto")
    if not d:
        return []
    w, s, c = d["whole"], d["split"], d["assumed"]
    assumed = (
        f"assumed {c['flops_per_s'] / 1e12:,.0f} TFLOP/s, {c['link_bytes_per_s'] / 1e9:,.0f} GB/s group links, "
        f"{c['collective_latency_s'] * 1e6:,.0f} us per collective"
    )
    if s is None:
        return [f"  Muon split auto: whole matrices (no candidate matrix can be split); {assumed}"]
    return [
        f"  Muon split auto: {'split' if d['chosen'] == 'split' else 'whole matrices'}: over groups of "
        f"{s['group_size']}, the busiest rank's optimizer work {w['max_flops'] / 1e9:,.1f} -> "
        f"{s['max_flops'] / 1e9:,.1f} GFLOP saves {d['compute_saved_s'] * 1e3:.3f} ms and the group collectives "
        f"add {d['collectives_added_s'] * 1e3:.3f} ms (rank {s['rank']}: {s['collectives']} synchronous "
        f"collectives, {s['group_bytes'] / 1e6:,.1f} MB); estimated step {w['time_s'] * 1e3:.3f} ms whole vs "
        f"{s['time_s'] * 1e3:.3f} ms split; {assumed}"
    ]


def report_text(f: dict) -> str:
    lines = [
        f"DP={f['dp']} TP={f['tp']} | {f['config']['optimizer']} | comm.dtype={f['config']['comm.dtype']} "
        f"transform={f['config']['comm.transform']} | bucket_size={f['config']['bucket_size']:,}",
        f"  parameters {f['parameters']:,}; {f['buckets']} buckets ({f['uneven_buckets']} with uneven owner ranges); "
        f"buffer {f['buffer_elements_per_rank']:,} elements per rank; padding_ratio {f['padding_ratio']:.4f}",
        f"  wire bytes per rank per step (reduce) {f['wire_bytes_per_rank'] / 1e9:.3f} GB vs even reduce-scatter "
        f"{f['even_reduce_scatter_bytes'] / 1e9:.3f} GB "
        f"(x{f['wire_bytes_per_rank'] / max(f['even_reduce_scatter_bytes'], 1):.3f});"
        + (
            f" gather {f['gather_bytes_per_rank'] / 1e9:.3f} GB vs {f['even_all_gather_bytes'] / 1e9:.3f} GB"
            f" (comm.param_gather={f['config']['comm.param_gather']}, {f['gather_bytes_per_element']:.4g} "
            f"bytes/element)"
            if f["config"]["distributed_optimizer"]
            else " an all-reduce (reduce-scatter + all-gather of the averaged ranges, both counted above); no "
            "parameter gather (parallel.distributed_optimizer=false)"
        ),
        f"  DP bytes per rank per step, both ways (reduce + gather) {f['dp_bytes_per_rank'] / 1e9:.3f} GB"
        + (
            f" = x{f['dp_bytes_vs_bf16']:.3f} of BF16 both ways ({f['bf16_dp_bytes_per_rank'] / 1e9:.3f} GB: BF16 "
            f"gradients, BF16 parameters gathered as they are)"
            if "dp_bytes_vs_bf16" in f
            else ""
        ),
        f"  optimizer FLOPs max/mean {f['optimizer_flops_max_over_mean']:.3f}; owned elements max/mean "
        f"{f['elements_owned_max_over_mean']:.3f}; codec scratch (largest bucket, transient) "
        f"{f['codec_scratch_bytes'] / GiB:.2f} GiB"
        + (
            f"; parameter gather records (all buckets, transient) {f['param_gather_scratch_bytes'] / GiB:.2f} GiB"
            if f.get("param_gather_scratch_bytes")
            else ""
        ),
        *_fmt_auto_split(f),
        *_fmt_split(f),
        *_fmt_rank("rank 0", f["rank0"]),
        *_fmt_rank(f"rank {f['worst_rank']['rank']} (most wire bytes)", f["worst_rank"]),
        *_fmt_rank(f"rank {f['most_memory_rank']['rank']} (most persistent memory)", f["most_memory_rank"]),
    ]
    return "\n".join(lines)


def markdown_row(name: str, f: dict) -> str:
    s = f.get("muon_split", {})
    split = f"{s['matrices']} x {s['group_size']}" if s.get("matrices") else "-"
    return (
        f"| {name} | {f['dp']} | {f['padding_ratio']:.4f} | {f['optimizer_flops_max_over_mean']:.3f} | "
        f"{f['optimizer_flops_max'] / 1e9:,.1f} | {f['elements_owned_max_over_mean']:.3f} | {split} | "
        f"{f['wire_bytes_per_rank'] / max(f['even_reduce_scatter_bytes'], 1):.3f} | "
        f"{f['gather_bytes_per_rank'] / max(f['even_all_gather_bytes'], 1):.3f} | "
        f"{f['persistent_bytes_per_rank'] / GiB:.2f} | {f.get('dp_bytes_vs_bf16', float('nan')):.3f} |"
    )


MD_HEADER = (
    "| config | DP | padding_ratio | optimizer FLOPs max/mean | max GFLOP | owned elements max/mean | "
    "Muon split (matrices x group) | wire bytes / even reduce-scatter | gather bytes / even all-gather | "
    "persistent GiB per rank | DP bytes / BF16 both ways |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """``key=value`` tokens are overrides wherever they stand (``--dp 8 16 key=value`` must not read the override
    as a DP size); everything else goes to argparse."""
    over = [a for a in argv if "=" in a and not a.startswith("-")]
    return [a for a in argv if a not in over], over


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="overrides: dotted key=value anywhere on the line, e.g. optimizer.name=adamw",
    )
    ap.add_argument("--config", action="append", required=True, metavar="FILE", help="YAML config(s), merged in order")
    ap.add_argument("--dp", type=int, nargs="+", required=True, help="data-parallel size(s)")
    ap.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size (default: parallel.tensor of the config)"
    )
    ap.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON here")
    ap.add_argument("--markdown", action="store_true", help="one Markdown table row per DP size")
    argv = sys.argv[1:] if argv is None else argv
    rest, overrides = _split_overrides(argv)
    args = ap.parse_args(rest)
    bad = [d for d in args.dp if d < 1]
    if bad:
        print(f"error: --dp {bad[0]}: data-parallel sizes must be >= 1", file=sys.stderr)
        return 2
    problem = output_file_problem("--json", args.json)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, overrides)
        tp = resolve_tensor_parallel(cfg, args.tp, overrides)
        for d in args.dp:  # every DP size must be a valid job (global batch, heads, ...)
            validate_config(cfg, tp * d)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = meta_model_params(cfg, tp)
    figs = [plan_figures(cfg, d, params, tp) for d in args.dp]
    name = (
        " + ".join(Path(c).stem for c in args.config)
        + (" " + " ".join(overrides) if overrides else "")
        + (f" (TP={tp})" if tp > 1 else "")
    )
    if args.markdown:
        print(MD_HEADER)
        for f in figs:
            print(markdown_row(name, f))
    else:
        print("\n\n".join(report_text(f) for f in figs))
    if args.json:
        Path(args.json).write_text(json.dumps(figs[0] if len(figs) == 1 else figs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
