#!/usr/bin/env python
"""Quantize + dequantize throughput of the gradient codecs, next to a plain memory copy.

Each operation takes an FP32 buffer of ``--numel`` elements (standard-normal values) through one
encode/decode round trip with the project's kernels (megatron_geo/comm/codecs.py, hadamard.py), the way
the low-precision reducer does it (scale from the amax, encode, decode):

- ``fp8_e4m3 tensor``: one FP32 scale (amax / 448) for the whole buffer;
- ``fp8_e4m3 block128``: one FP32 scale per 128 elements;
- ``fp8_e5m2 tensor``;
- ``nvfp4``: FP32 global scale, E4M3 scale per 16 elements, E2M1 elements;
- ``fp8_e4m3 stochastic``: tensor scaling with unbiased stochastic rounding;
- ``hadamard128``: block-Hadamard rotation and its inverse (no quantization);
- ``bf16 cast``: ``x.to(bfloat16).float()``;
- ``copy``: ``dst.copy_(src)`` of the same buffer (the memory-bandwidth reference).

Throughput = bytes of the FP32 input (4 * numel) / time, in GB/s (1e9 bytes); the median over
``--repeats`` timed runs after one warm-up run. The operations are timed round-robin (each repeat runs
every operation once), so load changes on the machine affect all of them alike. ``ratio`` = throughput /
copy throughput. On CUDA, ``torch.cuda.synchronize()`` is called before and after each timed run.

    python benchmarks/codec_kernels.py [--numel 16777216] [--repeats 5] [--device cpu|cuda]

The bare kernels on one scale; ``benchmarks/codec.py`` times the reducer's real path per preset.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_geo.comm.codecs import (NVFP4_BLOCK, fp8_decode, fp8_encode, fp8_scale_from_amax,  # noqa: E402
                                      nvfp4_decode, nvfp4_encode, nvfp4_global_scale)
from megatron_geo.comm.hadamard import block_hadamard, block_hadamard_inverse, hadamard_signs  # noqa: E402


def make_ops(x: torch.Tensor, dst: torch.Tensor) -> dict:
    """name -> zero-argument callable running one round trip of ``x`` (FP32, 1-D, numel % 128 == 0)."""
    gen = torch.Generator(device=x.device).manual_seed(0)
    signs = hadamard_signs(128, 0).to(x.device)

    def fp8_tensor(fmt, rounding="nearest"):
        def run():
            s = fp8_scale_from_amax(x.abs().amax(), fmt)
            return fp8_decode(fp8_encode(x, s, fmt, rounding, gen if rounding == "stochastic" else None), s, fmt)
        return run

    def fp8_block():
        v = x.view(-1, 128)
        s = fp8_scale_from_amax(v.abs().amax(dim=1, keepdim=True), "fp8_e4m3")
        return fp8_decode(fp8_encode(v, s, "fp8_e4m3"), s, "fp8_e4m3")

    def nvfp4():
        g = nvfp4_global_scale(x.abs().amax())
        packed, bs = nvfp4_encode(x.view(-1, NVFP4_BLOCK), g)
        return nvfp4_decode(packed, bs, g)

    def hadamard():
        return block_hadamard_inverse(block_hadamard(x.view(-1, 128), signs), signs)

    return {
        "copy": lambda: dst.copy_(x),
        "fp8_e4m3 tensor": fp8_tensor("fp8_e4m3"),
        "fp8_e4m3 block128": fp8_block,
        "fp8_e5m2 tensor": fp8_tensor("fp8_e5m2"),
        "nvfp4": nvfp4,
        "fp8_e4m3 stochastic": fp8_tensor("fp8_e4m3", "stochastic"),
        "hadamard128 rot+inv": hadamard,
        "bf16 cast": lambda: x.to(torch.bfloat16).float(),
    }


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
    print(f"codec round trip (quantize + dequantize), {args.numel:,} FP32 elements ({nbytes / 2**20:.0f} MiB), "
          f"median of {args.repeats}, {dev}, torch {torch.__version__}")
    print(f"{'operation':<22} {'median ms':>10} {'GB/s':>9} {'ratio to copy':>14}")
    copy_gbs = nbytes / statistics.median(times["copy"]) / 1e9
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = nbytes / med / 1e9
        print(f"{name:<22} {med * 1e3:>10.2f} {gbs:>9.2f} {gbs / copy_gbs:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
