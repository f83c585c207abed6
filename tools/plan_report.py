#!/usr/bin/env python
"""Shard plan, buffer memory, wire bytes and optimizer balance of a config at any DP size, without GPUs.

    python tools/plan_report.py --config configs/llama_600m.yaml --dp 64 [--tp 1] [--json OUT] [key=value ...]
    python tools/plan_report.py --config configs/llama_600m.yaml --dp 8 16 64 128 --markdown

Prints rank 0 and the worst rank (figures defined in ``megatron_geo/distributed/plan_report.py``); ``--json``
writes one object per DP size (a list when several are given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_geo.config import ConfigError, load_config, validate_config  # noqa: E402
from megatron_geo.distributed.plan_report import meta_model_params, plan_figures  # noqa: E402

GiB = 2 ** 30


def _fmt_rank(tag: str, r: dict) -> list[str]:
    b = r["bytes"]
    return [f"  {tag}: owns {r['elements_owned']:,} elements, optimizer {r['optimizer_flops'] / 1e9:,.1f} GFLOP/step, "
            f"persistent {r['persistent_bytes'] / GiB:.2f} GiB (grad buffer {b['grad_buffer'] / GiB:.2f}, param buffer "
            f"{b['param_buffer'] / GiB:.2f}, main params {b['main_params'] / GiB:.2f}, optimizer state "
            f"{b['optimizer_state'] / GiB:.2f}, error feedback {b['error_feedback'] / GiB:.2f}, GeoFP8 "
            f"{b['geo_state'] / GiB:.3f})",
            f"         reduce sends {r['reduce_sent_bytes'] / 1e9:.3f} GB, receives {r['reduce_received_bytes'] / 1e9:.3f} GB;"
            f" gather sends {r['gather_sent_bytes'] / 1e9:.3f} GB per step"]


def report_text(f: dict) -> str:
    lines = [f"DP={f['dp']} TP={f['tp']} | {f['config']['optimizer']} | comm.dtype={f['config']['comm.dtype']} "
             f"transform={f['config']['comm.transform']} | bucket_size={f['config']['bucket_size']:,}",
             f"  parameters {f['parameters']:,}; {f['buckets']} buckets ({f['uneven_buckets']} with uneven owner ranges); "
             f"buffer {f['buffer_elements_per_rank']:,} elements per rank; padding_ratio {f['padding_ratio']:.4f}",
             f"  wire bytes per rank per step (reduce) {f['wire_bytes_per_rank'] / 1e9:.3f} GB vs even reduce-scatter "
             f"{f['even_reduce_scatter_bytes'] / 1e9:.3f} GB (x{f['wire_bytes_per_rank'] / max(f['even_reduce_scatter_bytes'], 1):.3f});"
             f" gather {f['gather_bytes_per_rank'] / 1e9:.3f} GB vs {f['even_all_gather_bytes'] / 1e9:.3f} GB",
             f"  optimizer FLOPs max/mean {f['optimizer_flops_max_over_mean']:.3f}; owned elements max/mean "
             f"{f['elements_owned_max_over_mean']:.3f}; codec scratch (largest bucket, transient) "
             f"{f['codec_scratch_bytes'] / GiB:.2f} GiB",
             *_fmt_rank("rank 0", f["rank0"]), *_fmt_rank(f"worst rank {f['worst_rank']['rank']}", f["worst_rank"])]
    return "\n".join(lines)


def markdown_row(name: str, f: dict) -> str:
    return (f"| {name} | {f['dp']} | {f['padding_ratio']:.4f} | {f['optimizer_flops_max_over_mean']:.3f} | "
            f"{f['wire_bytes_per_rank'] / max(f['even_reduce_scatter_bytes'], 1):.3f} | "
            f"{f['gather_bytes_per_rank'] / max(f['even_all_gather_bytes'], 1):.3f} | "
            f"{f['persistent_bytes_per_rank'] / GiB:.2f} |")


MD_HEADER = ("| config | DP | padding_ratio | optimizer FLOPs max/mean | wire bytes / even reduce-scatter | "
             "gather bytes / even all-gather | persistent GiB per rank |\n|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True, metavar="FILE", help="YAML config(s), merged in order")
    ap.add_argument("--dp", type=int, nargs="+", required=True, help="data-parallel size(s)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON here")
    ap.add_argument("--markdown", action="store_true", help="one Markdown table row per DP size")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides + [f"parallel.tensor={args.tp}"])
        validate_config(cfg, args.tp * max(args.dp))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [d for d in args.dp if d < 1]
    if bad or args.tp < 1:
        print(f"error: --dp {bad[0] if bad else ''} --tp {args.tp}: sizes must be >= 1", file=sys.stderr)
        return 2
    params = meta_model_params(cfg, args.tp)
    figs = [plan_figures(cfg, d, params, args.tp) for d in args.dp]
    name = " + ".join(Path(c).stem for c in args.config) + (" " + " ".join(args.overrides) if args.overrides else "")
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
