"""Fixed, data-independent block rotation: random signs followed by a Sylvester-Hadamard transform.

``y = H_b (D x) / sqrt(b)`` per row, ``D = diag(signs)``, ``H_b`` the Sylvester Hadamard matrix
(``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``). ``H_b / sqrt(b)`` is symmetric and orthogonal,
so the rotation preserves norms and its inverse is ``D H_b y / sqrt(b)``. It spreads outliers across
a block before quantization (the randomized Hadamard transform of QuaRot / "Hadamard incoherence"
processing) and uses no statistics of the data, so every rank applies the same map.

The reducer applies it as one batched matmul per bucket, ``x.view(-1, b) @ M`` with
``M = D H_b / sqrt(b)`` in FP32 (:func:`hadamard_matrix`; inverse ``y @ M^T``): one pass over the bucket
instead of the ``2 log2(b)`` passes of the butterfly (:func:`block_hadamard`, kept as a reference). The
two agree to FP32 rounding (``tests/test_codecs.py``), not bitwise. The reducer runs those matmuls
inside :func:`exact_fp32`, so they stay IEEE FP32 even where TF32 was switched on for cuBLAS (NGC images
may do so; TF32 would make the rotation only ~1e-3 accurate), and FP32 under any active autocast.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import Tensor

# device types whose autocast :func:`exact_fp32` switches off where it is active
_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu", "mtia", "maia", "xla")
# torch >= 2.9 per-backend FP32 precision settings (``fp32_precision``), parents before children
_FP32_PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
                         "mkldnn.conv", "mkldnn.rnn")


_precision_objects: list | None = None      # the backend modules with an ``fp32_precision`` (cached)
_inside = threading.local()                 # .depth: how many exact_fp32 bodies this thread is in


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
                obj.fp32_precision
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
    return [("float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
            ("cuda.matmul.allow_tf32", lambda: cuda_mm.allow_tf32, lambda v: setattr(cuda_mm, "allow_tf32", v)),
            ("cudnn.allow_tf32", lambda: cudnn.allow_tf32, lambda v: setattr(cudnn, "allow_tf32", v))]


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
            for name, old, get, set_ in legacy:
                # the first restores the others' defaults; set one again only where it now reads differently
                # (setting a legacy switch that already matches would mix the legacy and new APIs)
                if old is not None and _read(get) != old:
                    set_(old)
            for obj, old in backends:
                if obj.fp32_precision != old:
                    obj.fp32_precision = old


def hadamard_signs(block_size: int, seed: int) -> Tensor:
    """float32 ``[block_size]`` of +-1 drawn from ``torch.Generator().manual_seed(seed)`` (CPU).

    Identical on every rank and machine for the same ``(block_size, seed)``.

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (block_size,), generator=g, device="cpu")
    return (1 - 2 * bits).to(torch.float32)


def hadamard_matrix(signs: Tensor) -> Tensor:
    """float32 ``[b, b]`` ``M = diag(signs) H_b / sqrt(b)`` on ``signs``' device, so that a row vector rotates
    as ``x @ M`` (the same map as :func:`block_hadamard`) and ``(x @ M) @ M.T == x`` up to FP32 rounding.
    Built in FP64 and rounded once per entry.

    Raises:
        ValueError: ``b`` not a power of two.
    """
    b = signs.numel()
    if b < 1 or b & (b - 1):
        raise ValueError(f"block size b={b} is not a power of two")
    h = torch.ones((1, 1), dtype=torch.float64, device="cpu")
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    m = signs.to(device="cpu", dtype=torch.float64).view(b, 1) * h * b ** -0.5
    return m.to(dtype=torch.float32, device=signs.device)


def _check(x: Tensor, signs: Tensor) -> int:
    if x.dim() != 2:
        raise ValueError(f"expected x of shape [nblk, b], got {tuple(x.shape)}")
    b = x.shape[1]
    if b < 1 or b & (b - 1):
        raise ValueError(f"block size b={b} is not a power of two")
    if signs.shape != (b,):
        raise ValueError(f"signs must have shape [{b}], got {tuple(signs.shape)}")
    return b


def _fwht(x: Tensor) -> Tensor:
    """Unnormalized Walsh-Hadamard transform along dim 1 in Sylvester (natural) order, O(b log b).

    ``x`` must be contiguous ``[n, b]``; it is used as scratch space (callers pass a fresh tensor).
    Stage ``h`` pairs element ``j`` with ``j + h`` inside each group of ``2h``: ``(u, v) -> (u+v, u-v)``.
    """
    n, b = x.shape
    out = torch.empty_like(x)
    h = 1
    while h < b:  # log2(b) butterfly stages; each is two vectorized ops over the whole tensor
        v = x.view(n, b // (2 * h), 2, h)
        o = out.view(n, b // (2 * h), 2, h)
        torch.add(v[:, :, 0], v[:, :, 1], out=o[:, :, 0])
        torch.sub(v[:, :, 0], v[:, :, 1], out=o[:, :, 1])
        x, out = out, x
        h *= 2
    return x


def block_hadamard(x: Tensor, signs: Tensor) -> Tensor:
    """Rotate each row: ``H_b (signs * x) / sqrt(b)``.

    Args:
        x: floating ``[nblk, b]`` (float32 in practice), ``b`` a power of two.
        signs: ``[b]`` of +-1 (:func:`hadamard_signs`).

    Returns:
        tensor of ``x``'s shape and dtype.

    Raises:
        ValueError: ``x`` not 2-D, ``b`` not a power of two, or ``signs`` not ``[b]``.
    """
    b = _check(x, signs)
    return _fwht((x * signs.to(x.dtype)).contiguous()).mul_(b ** -0.5)


def block_hadamard_inverse(y: Tensor, signs: Tensor) -> Tensor:
    """Exact inverse of :func:`block_hadamard`: ``signs * (H_b y / sqrt(b))`` per row.

    Raises:
        ValueError: as :func:`block_hadamard`.
    """
    b = _check(y, signs)
    return _fwht(y.clone(memory_format=torch.contiguous_format)).mul_(signs.to(y.dtype) * (b ** -0.5))
