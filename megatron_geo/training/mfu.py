"""Model FLOPs utilisation (MFU) and achieved TFLOP/s per GPU from the model's FLOPs per token.

    from megatron_geo.model import flops_per_token
    from megatron_geo.training.mfu import gpu_flops_metrics
    m = gpu_flops_metrics(tokens_per_sec_global, num_gpus, flops_per_token(cfg.model), torch.cuda.get_device_name())
    # {"tflops_per_gpu": 412.3, "mfu": 0.417, "peak_tflops": 989.4, "gpu": "H100/H200/GH200 (SXM)"}

MFU = achieved model FLOP/s per GPU / the GPU's peak dense BF16 tensor FLOP/s (PaLM, Chowdhery et al.
2022, appendix B). FLOPs per token in Megatron-LM's convention, from the one function
:func:`megatron_geo.model.llama.flops_per_token`: 6 x the GEMM weights + 12 L s h (the full attention square, no
causal halving, no recomputation), as Megatron-LM's ``num_floating_point_operations`` and PaLM count; the
training loop's metrics, ``benchmarks/gpu_check.sh`` and ``tools/project_scaling.py`` all use it.
"""

from __future__ import annotations

import math

# Peak dense (no 2:4 sparsity) BF16 tensor-core FLOP/s from NVIDIA's data sheets, matched in order against
# torch.cuda.get_device_name() (case-insensitive substrings; the more specific names come first).
PEAK_BF16_FLOPS: list[tuple[tuple[str, ...], str, float]] = [
    (("gb200",), "GB200 (per GPU)", 2.5e15),
    (("b200",), "B200", 2.25e15),
    (("gh200",), "GH200 (H100/H200 die)", 989.4e12),
    (("h200 nvl",), "H200 NVL", 835.5e12),
    (("h200",), "H200 SXM", 989.4e12),
    (("h100 nvl",), "H100 NVL", 835.5e12),
    (("h100 pcie",), "H100 PCIe", 756.0e12),
    (("h100", "h800"), "H100/H800 SXM", 989.4e12),
    (("a100", "a800"), "A100/A800", 312.0e12),
    (("l40s",), "L40S", 362.05e12),
    (("l4",), "L4", 121.0e12),
    (("a10g",), "A10G", 70.0e12),
    (("a10",), "A10", 125.0e12),
]


def peak_bf16_flops(device_name: str) -> tuple[str, float] | None:
    """(table name, peak dense BF16 FLOP/s) for a CUDA device name such as ``"NVIDIA GH200 480GB"``,
    or None when the device is not in :data:`PEAK_BF16_FLOPS` (then pass the peak yourself)."""
    low = device_name.lower()
    for keys, name, peak in PEAK_BF16_FLOPS:
        if any(k in low for k in keys):
            return name, peak
    return None


def tflops_per_gpu(tokens_per_sec_per_gpu: float, flops_per_token: float) -> float:
    """Achieved model TFLOP/s (1e12 FLOP/s) of one GPU.

    Raises:
        ValueError: negative or non-finite inputs.
    """
    for name, v in (("tokens_per_sec_per_gpu", tokens_per_sec_per_gpu), ("flops_per_token", flops_per_token)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v} must be a finite number >= 0")
    return tokens_per_sec_per_gpu * flops_per_token / 1e12


def mfu(tokens_per_sec_per_gpu: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1+): achieved FLOP/s per GPU / ``peak_flops`` (FLOP/s, > 0).

    Raises:
        ValueError: ``peak_flops`` <= 0, or negative/non-finite inputs.
    """
    if not (math.isfinite(peak_flops) and peak_flops > 0):
        raise ValueError(f"peak_flops={peak_flops} must be > 0 (FLOP/s, e.g. 989.4e12 for an H100 SXM in BF16)")
    return tflops_per_gpu(tokens_per_sec_per_gpu, flops_per_token) * 1e12 / peak_flops


def gpu_flops_metrics(
    tokens_per_sec_global: float,
    num_gpus: int,
    flops_per_token: float,
    device_name: str,
    peak_flops: float | None = None,
) -> dict:
    """``tflops_per_gpu``, ``mfu`` (None when the peak is unknown), ``peak_tflops`` and ``gpu`` (table name).

    ``tokens_per_sec_global`` counts every token of the global batch once (TP ranks share tokens, so
    with TP > 1 pass the number of GPUs anyway: the FLOPs are split over all of them).
    ``peak_flops`` (FLOP/s) overrides the table, e.g. for a GPU that is not in it.

    Raises:
        ValueError: ``num_gpus`` < 1, or as :func:`mfu`.
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} must be >= 1")
    per_gpu = tokens_per_sec_global / num_gpus
    found = peak_bf16_flops(device_name)
    if peak_flops is None and found is not None:
        peak_flops = found[1]
    name = found[0] if found else device_name
    return {
        "tflops_per_gpu": tflops_per_gpu(per_gpu, flops_per_token),
        "mfu": mfu(per_gpu, flops_per_token, peak_flops) if peak_flops else None,
        "peak_tflops": peak_flops / 1e12 if peak_flops else None,
        "gpu": name,
    }
