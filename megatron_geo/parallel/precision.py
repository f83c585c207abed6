"""IEEE FP32 on demand: :func:`exact_fp32` switches off TF32 and autocast for the matmuls launched inside it.

The fixed Hadamard rotation of the reducer (:mod:`megatron_geo.comm.hadamard`), the GeoFP8 statistics, refreshes
and every application of its transforms (:mod:`megatron_geo.geometry`) run under it, so their results do not
depend on the caller's matmul precision or autocast (NGC images may switch TF32 on for cuBLAS; TF32 would make a
rotation only ~1e-3 accurate).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

# device types whose autocast :func:`exact_fp32` switches off where it is active
_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu", "mtia", "maia", "xla")
# torch >= 2.9 per-backend FP32 precision settings (``fp32_precision``), parents before children
_FP32_PRECISION_PATHS = (
    "",
    "cuda.matmul",
    "cudnn",
    "cudnn.conv",
    "cudnn.rnn",
    "mkldnn",
    "mkldnn.matmul",
    "mkldnn.conv",
    "mkldnn.rnn",
)


_precision_objects: list | None = None  # the backend modules with an ``fp32_precision`` (cached)
_inside = threading.local()  # .depth: how many exact_fp32 bodies this thread is in


def _active_autocast() -> list[str]:
    """The device types whose autocast is enabled in this thread."""
    any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
    if any_enabled is not None and not any_enabled():
        return []
    types = list(_AUTOCAST_DEVICE_TYPES)
    try:
        types.append(torch._C._get_privateuse1_backend_name())
    except (AttributeError, RuntimeError):
        pass
    out = []
    for dt in dict.fromkeys(types):
        try:
            if torch.amp.is_autocast_available(dt) and torch.is_autocast_enabled(dt):
                out.append(dt)
        except (AttributeError, RuntimeError, TypeError, ValueError):  # a device type this build does not know
            continue
    return out


def _precision_backends() -> list:
    """``(backend module, fp32_precision)`` for every per-backend setting this torch has (none before 2.9)."""
    global _precision_objects
    if _precision_objects is None:
        objs = []
        for path in _FP32_PRECISION_PATHS:
            obj = torch.backends
            for part in filter(None, path.split(".")):
                obj = getattr(obj, part, None)
            try:
                _ = obj.fp32_precision
                objs.append(obj)
            except (AttributeError, RuntimeError):
                continue
        _precision_objects = objs
    return [(obj, obj.fp32_precision) for obj in _precision_objects]


def _read(getter):
    """A legacy TF32 flag, or None where torch refuses to read it (legacy and new APIs mixed, torch >= 2.9)."""
    try:
        return getter()
    except RuntimeError:
        return None


def _legacy_flags() -> list[tuple]:
    """``(name, getter, setter)`` of the legacy switches, the global matmul precision first."""
    cuda_mm, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return [
        ("float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        ("cuda.matmul.allow_tf32", lambda: cuda_mm.allow_tf32, lambda v: setattr(cuda_mm, "allow_tf32", v)),
        ("cudnn.allow_tf32", lambda: cudnn.allow_tf32, lambda v: setattr(cudnn, "allow_tf32", v)),
    ]


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """Run the body with IEEE FP32 matmuls and without autocast, then restore the caller's settings.

    Inside: ``torch.set_float32_matmul_precision("highest")``, ``torch.backends.cuda.matmul.allow_tf32 = False``
    and ``torch.backends.cudnn.allow_tf32 = False`` (so no TF32 in cuBLAS / cuDNN and no BF16 in oneDNN FP32
    matmuls), and autocast disabled for every device type where it is active (ops run in their inputs'
    dtypes). On exit every legacy switch and every torch >= 2.9 ``fp32_precision`` setting is put back as it
    was, also when the body raises.

    The precision switches are process-global, not per thread or per CUDA stream: they apply to every
    matmul *launched* from the host while the body runs, whichever stream it is queued on (the reducer's
    side stream included), and also to matmuls another host thread launched meanwhile. Kernels already
    queued are unaffected. ``NVIDIA_TF32_OVERRIDE=1`` in the environment forces TF32 inside cuBLAS below
    torch and cannot be undone here. Inside a ``torch.compile`` trace it does nothing (the settings are global
    host state, not part of a graph). Nested in another ``exact_fp32`` of the same thread it only switches off
    an autocast entered in between (the outer one holds the settings), so wrapping a loop of calls is cheap.
    """
    if torch.compiler.is_compiling():
        yield
        return
    depth = getattr(_inside, "depth", 0)
    if depth:
        with contextlib.ExitStack() as stack:
            for dt in _active_autocast():
                stack.enter_context(torch.autocast(dt, enabled=False))
            _inside.depth = depth + 1
            try:
                yield
            finally:
                _inside.depth = depth
        return
    legacy = [(name, _read(get), get, set_) for name, get, set_ in _legacy_flags()]
    backends = _precision_backends()
    with contextlib.ExitStack() as stack:
        for dt in _active_autocast():
            stack.enter_context(torch.autocast(dt, enabled=False))
        try:
            torch.set_float32_matmul_precision("highest")
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            _inside.depth = 1
            yield
        finally:
            _inside.depth = 0
            for _name, old, get, set_ in legacy:
                # the first restores the others' defaults; set one again only where it now reads differently
                # (setting a legacy switch that already matches would mix the legacy and new APIs)
                if old is not None and _read(get) != old:
                    set_(old)
            for obj, old in backends:
                if obj.fp32_precision != old:
                    obj.fp32_precision = old
