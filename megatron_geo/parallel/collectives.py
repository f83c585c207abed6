"""Every collective of the package goes through this module, which checks each tensor's device first.

NCCL accepts only CUDA tensors and gloo only CPU tensors; a control tensor created without
``device=pctx.device`` (a checksum, a profile, a checkpoint flag) works with gloo on CPU and crashes the
first NCCL collective on GPUs. Here every tensor handed to a collective is checked against the device
type its process group's backend needs, so the mistake is a clear :class:`CollectiveDeviceError` naming
the collective and the tensor, on every backend.

:func:`strict_devices` is the CPU test mode for the same class of bug: inside it, a tensor factory
(``torch.tensor``, ``zeros``, ``empty``, ``randint``, ...) called from this package *without* a
``device=`` argument creates its tensor on the ``meta`` device. On a GPU such a tensor would be on the CPU
while the process group wants CUDA; under the test mode it is on ``meta`` while gloo wants CPU, so the
device check (or the first op mixing it with real data) fails just as NCCL would.

Uneven collectives (whole-parameter ownership, see :mod:`megatron_geo.distributed.shard_plan`):
:func:`reduce_ranges` (one reduce per owned range, onto its owner; on NCCL all of them in one coalesced group,
so a step pays one launch and one pipeline fill instead of one per owner) and :func:`all_gather_ranges`
(the owners' ranges to everyone: coalesced broadcasts, which is how ``torch.distributed.all_gather``
handles uneven sizes on NCCL; gloo has no uneven all-gather, so there a broadcast per owner is issued).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective is not on the device type its process group's backend needs."""


class _Works:
    """Several async works waited as one."""

    def __init__(self, works):
        self.works = [w for w in works if w is not None]

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def required_device_type(group) -> str | None:
    """``"cuda"`` for an NCCL group, ``"cpu"`` for gloo, None for backends that take any (``fake``)."""
    try:
        backend = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return None
    return _BACKEND_DEVICE.get(backend)


# FP8 sums on NCCL need all three: torch >= 2.8 (the release whose ProcessGroupNCCL maps float8_e4m3fn /
# float8_e5m2 to ncclFloat8e4m3 / ncclFloat8e5m2 and accepts them in reductions; earlier ones send FP8 as
# uint8 and refuse FP8 reductions), NCCL >= 2.24 (where those types appear; torch.cuda.nccl.version() is the
# NCCL torch was built against, which decides whether torch's mapping is compiled in), and SM >= 90 (NCCL
# reduces FP8 only on Hopper and newer GPUs).
_FP8_SUM_TORCH = (2, 8)
_FP8_SUM_NCCL = (2, 24, 0)
_FP8_SUM_SM = 9


def _torch_release() -> tuple[int, int]:
    """``(major, minor)`` of the running torch (``"2.8.0+cu128"`` -> ``(2, 8)``)."""
    parts = str(torch.__version__).split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


def _group_cuda_device(group, device=None) -> torch.device:
    """The CUDA device ``group`` runs on: ``device`` when given, else the group's bound device, else the current
    CUDA device (what :func:`~megatron_geo.parallel.context.init_parallel` selected)."""
    if device is not None:
        return torch.device(device)
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and bound.type == "cuda":
        return bound
    return torch.device("cuda", torch.cuda.current_device())


def supports_fp8_sum(group, device=None) -> bool:
    """Whether ``group`` sums ``float8_e4m3fn`` / ``float8_e5m2`` tensors natively: an NCCL group, torch >= 2.8
    (its NCCL backend maps the FP8 dtypes to ``ncclFloat8e4m3`` / ``ncclFloat8e5m2``), NCCL >= 2.24 and a GPU of
    compute capability >= 9.0 (``device``, default: the group's device). gloo and the fake backend never do.

    Returns:
        bool; False (never an exception) when any of it cannot be determined.
    """
    if required_device_type(group) != "cuda" or not torch.cuda.is_available():
        return False
    if _torch_release() < _FP8_SUM_TORCH:
        return False
    try:
        if tuple(torch.cuda.nccl.version())[:3] < _FP8_SUM_NCCL:
            return False
        major, _ = torch.cuda.get_device_capability(_group_cuda_device(group, device))
    except (RuntimeError, AttributeError, AssertionError, TypeError, ValueError):
        return False
    return major >= _FP8_SUM_SM


def check_devices(op: str, group, *tensors: torch.Tensor) -> None:
    """Raise :class:`CollectiveDeviceError` when a tensor is not on the device type ``group`` needs, or, for an
    NCCL group, on another GPU than this process's current device (the index matters, not only the type).

    Also rejects ``meta`` tensors on any backend (they hold no data; under :func:`strict_devices` they are
    tensors this package created without naming a device).
    """
    need = required_device_type(group)
    index = torch.cuda.current_device() if need == "cuda" else None  # NCCL runs on this process's own GPU
    for i, t in enumerate(tensors):
        dev = t.device.type
        if need == "cuda" and dev == "cuda" and t.device.index != index:
            raise CollectiveDeviceError(
                f"{op}: tensor {i} ({t.dtype}, shape {tuple(t.shape)}) is on {t.device} but this process's NCCL "
                f"collectives run on cuda:{index}; create it with device=pctx.device (the indexed device, not "
                f"'cuda' or another GPU)"
            )
        if dev == "meta" or (need is not None and dev != need):
            raise CollectiveDeviceError(
                f"{op}: tensor {i} ({t.dtype}, shape {tuple(t.shape)}) is on {t.device} but the process group's "
                f"backend ({dist.get_backend(group)}) needs {need or 'real'} tensors; create it with "
                f"device=pctx.device (or move it with .to(device)) before the collective"
            )


# -- even collectives -------------------------------------------------------------------------------------------


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    check_devices("all_reduce", group, t)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, group, group_src: int, async_op: bool = False):
    """Broadcast from the rank with index ``group_src`` within ``group``."""
    check_devices("broadcast", group, t)
    return dist.broadcast(t, src=dist.get_global_rank(group, group_src), group=group, async_op=async_op)


def reduce(t: torch.Tensor, group, group_dst: int, async_op: bool = False):
    """Sum onto the rank with index ``group_dst`` within ``group`` (other ranks' ``t`` is undefined after)."""
    check_devices("reduce", group, t)
    return dist.reduce(t, dst=dist.get_global_rank(group, group_dst), group=group, async_op=async_op)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``out`` (``[world * n]``) = every rank's ``inp`` (``[n]``) in rank order."""
    check_devices("all_gather", group, out, inp)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``out`` (``[n]``) = sum over ranks of chunk ``rank`` of ``inp`` (``[world * n]``)."""
    check_devices("reduce_scatter", group, out, inp)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def all_gather_list(parts: list[torch.Tensor], t: torch.Tensor, group, async_op: bool = False):
    check_devices("all_gather", group, t, *parts)
    return dist.all_gather(parts, t, group=group, async_op=async_op)


def all_to_all_single(
    out: torch.Tensor,
    inp: torch.Tensor,
    group,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
    async_op: bool = False,
):
    """``torch.distributed.all_to_all_single`` (split sizes in elements of dim 0, ``None`` = even)."""
    check_devices("all_to_all", group, out, inp)
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)
    if str(dist.get_backend(group)) == "fake":
        _loopback(out, inp, group, out_splits, in_splits)
    return work


def _loopback(out: torch.Tensor, inp: torch.Tensor, group, out_splits, in_splits) -> None:
    """Fake backend (dry runs): this rank "receives" its own part from itself and zeros from every other rank,
    so received buffers hold defined values and a sum over sources equals this rank's own contribution --
    the same as the fake ``reduce`` (which leaves this rank's data in place)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    ins = in_splits or [inp.shape[0] // world] * world
    outs = out_splits or [out.shape[0] // world] * world
    lo, pos = sum(ins[:me]), sum(outs[:me])
    out.zero_()
    if outs[me] == ins[me]:
        out[pos : pos + outs[me]].copy_(inp[lo : lo + ins[me]])


def barrier(group) -> None:
    dist.barrier(group=group)


# -- uneven collectives over contiguous owner ranges --------------------------------------------------------------


def coalesces(group, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` groups several collectives into one launch (NCCL: one
    ``ncclGroupStart`` / ``ncclGroupEnd``; gloo and the fake backend do not)."""
    try:
        return bool(group._get_backend(device).supports_coalescing)
    except (AttributeError, RuntimeError, ValueError):  # a torch without the property: NCCL is the one that does
        try:
            return str(dist.get_backend(group)).lower() == "nccl"
        except (RuntimeError, ValueError):
            return False


def reduce_ranges(buf: torch.Tensor, bounds: list[int], group, async_op: bool = True):
    """Sum ``buf[bounds[r]:bounds[r + 1]]`` over ``group`` onto rank r, for every r with a non-empty range.

    Each reduce is one ring collective of that range's size, so a rank sends about as many bytes as an even
    reduce-scatter of ``buf`` would, without any padding. Where the backend coalesces (:func:`coalesces`: NCCL)
    all of one call's reduces are issued as one group, so they run in one launch instead of one latency-bound
    collective per owner; each range is still reduced on its own, in the same order, so the sums are the same
    bits. Other ranks' copies of a range are undefined afterwards (the reduce's scratch).

    Args:
        buf: 1-D tensor on the device ``group``'s backend needs.
        bounds: ``world + 1`` non-decreasing offsets into ``buf``; rank r owns ``[bounds[r], bounds[r + 1])``.

    Returns:
        One waitable (``.wait()``) for every reduce of the call (already waited when ``async_op=False``).
    """
    check_devices("reduce", group, buf)
    owners = [r for r in range(len(bounds) - 1) if bounds[r + 1] > bounds[r]]
    if len(owners) > 1 and coalesces(group, buf.device):
        with dist._coalescing_manager(group, buf.device, async_ops=True) as cm:
            for r in owners:
                reduce(buf[bounds[r] : bounds[r + 1]], group, r, async_op=True)
        w = _Works(cm.works)
    else:
        w = _Works([reduce(buf[bounds[r] : bounds[r + 1]], group, r, async_op=True) for r in owners])
    if not async_op:
        w.wait()
    return w


def all_gather_ranges(buf: torch.Tensor, bounds: list[int], group, async_op: bool = True):
    """Every rank's range ``buf[bounds[r]:bounds[r + 1]]`` from its owner r to all ranks, in place."""
    check_devices("all_gather", group, buf)
    world = len(bounds) - 1
    sizes = [bounds[r + 1] - bounds[r] for r in range(world)]
    if len(set(sizes)) == 1:  # even: one all-gather
        w = all_gather_into(
            buf[bounds[0] : bounds[-1]],
            buf[bounds[dist.get_rank(group)] : bounds[dist.get_rank(group) + 1]].clone(),
            group,
            async_op=True,
        )
    elif dist.get_backend(group) == "nccl":  # torch coalesces uneven all-gathers into grouped broadcasts
        me = dist.get_rank(group)
        parts = [buf[bounds[r] : bounds[r + 1]] for r in range(world)]
        w = all_gather_list(parts, parts[me].clone(), group, async_op=True)
    else:
        w = _Works(
            [broadcast(buf[bounds[r] : bounds[r + 1]], group, r, async_op=True) for r in range(world) if sizes[r]]
        )
    if not async_op:
        w.wait()
    return w


# -- the CPU test mode ----------------------------------------------------------------------------------------------

_FACTORIES = {
    torch.tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.eye,
    torch.linspace,
}


class _ImplicitToMeta(TorchFunctionMode):
    def __init__(self, packages: tuple[str, ...]):
        super().__init__()
        self.packages = packages

    def _from_package(self) -> bool:
        """True when the factory's direct caller is a module of ``packages`` (torch's own calls are not ours)."""
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__", "") in (__name__, "torch.overrides"):
            f = f.f_back
        return f is not None and f.f_globals.get("__name__", "").startswith(self.packages)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None and self._from_package():
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def strict_devices(packages: tuple[str, ...] = ("megatron_geo",)):
    """Test mode: tensor factories called from ``packages`` without ``device=`` make ``meta`` tensors.

    Any such tensor that reaches a collective raises :class:`CollectiveDeviceError`; one that meets real
    data raises torch's device-mismatch error. A factory that is meant to run on the host names
    ``device="cpu"`` explicitly.
    """
    with _ImplicitToMeta(packages):
        yield
