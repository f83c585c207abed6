#!/usr/bin/env python
"""Quantize + dequantize throughput of the gradient codecs, next to a plain memory copy.

Each operation takes an FP32 buffer of ``--numel`` elements (standard-normal values) through one encode/decode
round trip of a registered wire format (megatron_geo/comm/formats.py): the format's own wire class, the one the
low-precision reducer sends buckets with, on the buffer as one parameter of a one-rank bucket (scales from the
amax, ``encode_ranges``, ``decode_own``: the reduce-scatter without its all-to-all). One row per registered
format that compresses (fewer than 4 bytes per element), named from its registry entry:

- ``<fmt> tensor`` / ``<fmt> block128`` / ``<fmt> stochastic`` for formats with block scaling (FP8: one FP32 scale
  for the whole buffer, one per 128 elements, tensor scaling with unbiased stochastic rounding);
- ``<fmt>`` and ``<fmt> stochastic`` for the other scaled formats (``nvfp4``: FP32 global scale, E4M3 scale per
  16 elements, E2M1 elements);
- ``<fmt> cast`` for plain casts (``bf16 cast``: ``x.to(bfloat16).float()``);
- ``hadamard128 rot+inv``: the reducer's block-Hadamard rotation and its inverse (no quantization);
- ``copy``: ``dst.copy_(src)`` of the same buffer (the memory-bandwidth reference).

Throughput = bytes of the FP32 input (4 * numel) / time, in GB/s (1e9 bytes); the median over
``--repeats`` timed runs after one warm-up run. The operations are timed round-robin (each repeat runs
every operation once), so load changes on the machine affect all of them alike. ``ratio`` = throughput /
copy throughput. On CUDA, ``torch.cuda.synchronize()`` is called before and after each timed run.

    python benchmarks/codec_kernels.py [--numel 16777216] [--repeats 5] [--device cpu|cuda]

Eager codecs on one parameter; ``benchmarks/codec.py`` times the reducer's real path per preset.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_geo.comm.formats import FORMATS, comm_view  # noqa: E402
from megatron_geo.comm.hadamard import exact_fp32, hadamard_matrix, hadamard_signs  # noqa: E402
from megatron_geo.comm.roundtrip import normalize_codec, tensor_layout, tensor_wire  # noqa: E402


def wire_roundtrip(x: torch.Tensor, codec: dict | str):
    """Zero-argument callable: ``x`` (FP32 ``[numel]``, a multiple of the codec's block) through the codec's wire
    class as a one-parameter, one-rank bucket (``encode_ranges`` then ``decode_own``), into a buffer of its own."""
    c = normalize_codec(codec)
    layout = tensor_layout(c, x.numel(), x.device)
    wire = tensor_wire(c, 0, x.device)  # stochastic rounding: the seeded stream of DP rank 0
    out = torch.empty_like(x)

    def run():
        codes, scales, _ = wire.encode_ranges(x, layout)
        per_rank = None if scales is None else scales[0].view(1, -1)  # one rank: its scales as a [1, n] row
        return wire.decode_own([p for p, _ in codes], per_rank, layout, 0, out)

    return run


def codec_rows() -> dict[str, dict]:
    """``{row name: codec dict}`` of every registered format that compresses (module docstring)."""
    rows = {}
    for name, fmt in FORMATS.items():
        if fmt.bytes_per_element(comm_view(dtype=name)) >= 4.0:
            continue
        if not fmt.scaled:
            rows[f"{name} cast"] = {"dtype": name}
            continue
        rows[f"{name} tensor" if fmt.block_scaling else name] = {"dtype": name}
        if fmt.block_scaling:
            rows[f"{name} block128"] = {"dtype": name, "scaling": "block", "block_size": 128}
        rows[f"{name} stochastic"] = {"dtype": name, "rounding": "stochastic"}
    return rows


def make_ops(x: torch.Tensor, dst: torch.Tensor) -> dict:
    """name -> zero-argument callable running one round trip of ``x`` (FP32, 1-D, numel % 128 == 0)."""
    m = hadamard_matrix(hadamard_signs(128, 0).to(x.device))
    mt = m.t().contiguous()
    rot = torch.empty_like(x)

    def hadamard():
        with exact_fp32():
            torch.mm(x.view(-1, 128), m, out=rot.view(-1, 128))
            return torch.mm(rot.view(-1, 128), mt, out=dst.view(-1, 128))

    ops = {"copy": lambda: dst.copy_(x)}
    ops.update({name: wire_roundtrip(x, c) for name, c in codec_rows().items()})
    ops["hadamard128 rot+inv"] = hadamard
    return ops


def bench(numel: int, repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per run of every operation, ``repeats`` values each (after one warm-up run)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dev)
    ops = make_ops(x, torch.empty_like(x))
    times: dict[str, list[float]] = {k: [] for k in ops}
    for rep in range(repeats + 1):
        for name, fn in ops.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if rep:  # repeat 0 is the warm-up
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=16 * 2**20, help="FP32 elements (multiple of 128; default 16M)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per operation (median; default 5)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    if args.numel <= 0 or args.numel % 128:
        p.error("--numel must be a positive multiple of 128")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    times = bench(args.numel, args.repeats, args.device)
    nbytes = 4 * args.numel
    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"codec round trip (quantize + dequantize), {args.numel:,} FP32 elements ({nbytes / 2**20:.0f} MiB), "
        f"median of {args.repeats}, {dev}, torch {torch.__version__}"
    )
    print(f"{'operation':<22} {'median ms':>10} {'GB/s':>9} {'ratio to copy':>14}")
    copy_gbs = nbytes / statistics.median(times["copy"]) / 1e9
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = nbytes / med / 1e9
        print(f"{name:<22} {med * 1e3:>10.2f} {gbs:>9.2f} {gbs / copy_gbs:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
