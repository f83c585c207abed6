"""``comm.compile``: the codecs' encode and decode as ``torch.compile(fullgraph=True)`` graphs.

The scaled wire formats (:mod:`.wire_fp8`, :mod:`.wire_nvfp4`; the plain casts of :mod:`.wire_cast` are single
eager ops and are not compiled) write their hot path as pure tensor functions with no data-dependent shapes and
no host syncs; :func:`maybe_compile` turns each into one graph
(``fullgraph=True``: a graph break is an error, not a silent fallback) with dynamic sizes, so buckets of
different lengths share the graph. Inductor fuses the scale broadcast, the division, the clamp and the cast
into one pass over the bucket (encode) and the FP8 upcast, the scale and the sum over DP into one pass
(decode); the codes, and the decoded DP mean at any DP size, are bitwise equal to eager
(``tests/test_codec_compile.py`` on the CPU backend at DP 2, 3 and 64; ``benchmarks/gpu_check.sh``'s ``codec``
phase on a GPU).

The DP mean is written so that no backend can choose its own arithmetic (:func:`.codecs.mean_over_sources`): the
sources are added left to right in a Python loop (unrolled in the graph; ``Tensor.sum(dim=0)`` would leave the
order to eager CPU, which switches to a cascade past 16 rows, and to Inductor, which unrolls only small
reductions), and the division is by a float32 tensor passed into the graph as an argument
(:func:`.codecs.dp_divisor`): Inductor lowers a division by a graph constant to a multiplication by its reciprocal
on every device but the CPU, one rounding more.

Bitwise equality on GPUs needs Inductor's eager-numerics settings, which each codec graph gets through
``torch.compile(options=...)`` (:func:`eager_numerics_options`; no global config changes): by default Triton
lowers an FP32 ``x / y`` to an approximate division (up to 2 ulp off) and lets LLVM contract ``a * b + c`` into
one FMA, so a quotient on an FP8 / E2M1 rounding boundary would round to the neighbouring code, and the FP32
sum over DP sources (a product of each source added to the running sum) would be contracted too. The CPU backend
divides exactly and does not contract, so CPU tests match with or without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def resolve_compile(setting: str | bool, device) -> bool:
    """``comm.compile`` (``auto`` | ``true`` | ``false``, or a bool) -> whether to compile on ``device``.

    ``auto`` is on with CUDA and off on CPU.

    Raises:
        ValueError: any other value.
    """
    if isinstance(setting, bool):
        return setting
    s = str(setting).strip().lower()
    if s == "auto":
        return torch.device(device if device is not None else "cpu").type == "cuda"
    if s in ("true", "false"):
        return s == "true"
    raise ValueError(f"comm.compile={setting!r} is not valid; choose auto, true or false")


def compiler_problem(device) -> str | None:
    """Why ``comm.compile`` cannot work on ``device``, or None: on CPU inductor builds C++ code, so it needs a working
    C++ compiler (``torch._inductor.cpp_builder.get_cpp_compiler``: ``$CXX``, else g++/clang++). GPUs compile with
    Triton, which ships with torch."""
    if torch.device(device if device is not None else "cpu").type != "cpu":
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 -- InvalidCxxCompiler, or an import problem: both mean "cannot compile"
        return f"comm.compile on CPU builds C++ code and no working C++ compiler was found ({e})"
    return None


# Inductor settings under which a compiled graph rounds like eager, by the names torch releases have used
# (torch/_inductor/config.py); eager_numerics_options keeps those the running torch knows.
_EAGER_NUMERICS: dict[str, str | int | bool] = {
    # keep every requested cast's rounding; on Triton also enable_fp_fusion=False: no FMA contraction
    "emulate_precision_casts": True,
    # FP32 x / y as IEEE division (Triton div_rn) instead of the approximate div.full
    "eager_numerics.division_rounding": True,  # the name in newer torch
    "emulate_divison_rounding": True,  # the same switch in older torch (spelled so there)
    # no flush of subnormals to zero in Triton's math library calls (eager CUDA keeps them)
    "eager_numerics.disable_ftz": True,
    # no fast-math variants even when TORCHINDUCTOR_USE_FAST_MATH=1 is set
    "use_fast_math": False,
    # the CPU backend's C++ flags: no FMA contraction even when the environment asks for it
    "cpp.enable_floating_point_contract_flag": "off",
}


def eager_numerics_options() -> dict[str, str | int | bool | Callable[..., Any]]:
    """The ``torch.compile(options=...)`` that make Inductor compute a codec graph like eager, limited to the names
    (and value types) the running torch's ``torch._inductor.config`` knows: torch rejects unknown options, and
    the division-rounding switch has been renamed between releases.

    Returns:
        ``{option name: value}``, e.g. ``{"emulate_precision_casts": True, "eager_numerics.division_rounding":
        True, ...}``; empty where Inductor cannot be imported.
    """
    try:
        from torch._inductor import config
    except Exception:  # noqa: BLE001 -- no inductor: torch.compile fails on its own with its own message
        return {}
    known = config.get_config_copy()
    return {k: v for k, v in _EAGER_NUMERICS.items() if k in known and type(known[k]) is type(v)}


def maybe_compile(fn: Callable, enabled: bool, static: dict[int, tuple[int, ...]] | None = None) -> Callable:
    """``torch.compile(fn, fullgraph=True, dynamic=True, options=eager_numerics_options())`` when ``enabled``,
    else ``fn`` itself (the options: see :func:`eager_numerics_options`).

    Args:
        static: ``{argument index: dims}`` of sizes that are constant for a run (the DP size, the 16- or
            128-element block): marked static (``torch._dynamo.mark_static``) on every call, so the graph is
            specialised to them while the bucket length stays symbolic. With the block size known, inductor's
            CPU code runs whole vectors per block instead of a loop with a symbolic tail (a measurable part of the
            codec speed in ``docs/bench/codec_cpu.txt``).
    """
    if not enabled:
        return fn
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, options=eager_numerics_options())
    if not static:
        return compiled
    mark = torch._dynamo.mark_static

    def call(*args):
        for i, dims in static.items():
            for d in dims:
                mark(args[i], d)
        return compiled(*args)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
