"""The wire-format registry: one :class:`WireFormat` entry per ``comm.dtype`` value (the reducer for a ``comm``
section is :func:`.factory.build_reducer`'s).

Everything that lists, checks or sizes wire formats reads :data:`FORMATS`: config validation
(:meth:`WireFormat.check`), the run label, the per-tensor codec round trip (:mod:`.roundtrip`), the codec table,
the plan report's alignment and wire bytes, and the low-precision reducer, which builds its encoder with
:attr:`WireFormat.make_wire`. Adding a format is a wire class (the :class:`Wire` protocol), one
:func:`register_format` call and a preset YAML (``docs/extending.md``).

A ``comm`` argument is a :class:`~megatron_geo.config.schema.CommConfig` or anything with its attributes
(:func:`comm_view` builds one from keyword arguments or a codec dict).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..config.errors import ConfigError
from ..config.schema import CommConfig
from .codecs import NVFP4_BLOCK, fp8_max
from .scale_layout import ScaleLayout
from .wire_cast import CastWire
from .wire_fp8 import FP8Wire
from .wire_nvfp4 import NVFP4Wire


@runtime_checkable
class Wire(Protocol):
    """Encode / decode of FP32 bucket buffers in one wire format, as the low-precision reducer drives it.

    A buffer is ``[numel]`` FP32 cut into DP-rank ranges and scale segments by a :class:`.scale_layout.ScaleLayout`
    (every segment a whole number of ``layout.granule``-element blocks). All methods are pure tensor code: no host
    sync, no data-dependent shape.
    """

    def encode_ranges(self, x: Tensor, layout: ScaleLayout, sync_amax=None, residual: Tensor | None = None):
        """Encode all of ``x`` for the reduce-scatter's all-to-all: ``(codes, scales, shared)``; ``codes`` a list of
        ``(uint8 payload, split sizes in bytes per destination DP rank)``, ``scales`` ``(FP32 payload, split sizes
        per destination DP rank)`` (what each rank needs to decode its range; ``layout.scale_splits()``) or None,
        ``shared`` the MAX-synchronised ``[dp, K]`` scales (with ``sync_amax``) or None. ``residual``
        (``[numel]``, optional) <- ``x - decode(codes)`` in place."""

    def roundtrip(self, x: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``[numel]`` ``decode(encode(x))`` with this rank's own scales, round to nearest."""

    def decode_own(self, recv: list[Tensor], scales, layout: ScaleLayout, r: int, out: Tensor) -> Tensor:
        """``out`` (FP32 ``[own]``, returned) <- the DP mean of range ``r`` from every source's payloads ``recv``
        and scales ``[dp, K']``, K' at least range r's segments (summed in FP32 in rank order, divided by dp once)."""

    def encode_chunk(self, x: Tensor, layout: ScaleLayout, r: int) -> Tensor:
        """uint8 ``[1, bytes]``: range ``r`` (``x``) encoded with its own scales, scales appended (the all-gather
        stage of an all-reduce, and the per-tensor round trip), with the wire's configured rounding."""

    def decode_all(self, out: Tensor, layout: ScaleLayout) -> Tensor:
        """FP32 ``[numel]`` of the gathered :meth:`encode_chunk` payloads ``out`` ``[dp, bytes]`` (even plan)."""

    def saturated(self, x: Tensor, payload: Tensor, layout: ScaleLayout) -> Tensor:
        """bool ``[numel]``: the elements of ``x`` whose :meth:`encode_chunk` code (``payload`` ``[1, bytes]``, one
        range) is the format's largest magnitude (clipped or rounded onto the top of the range)."""


def _one(comm) -> int:
    return 1


def _tensor_scaling(comm) -> str:
    return "tensor"


@dataclass(frozen=True)
class WireFormat:
    """One wire format (a ``comm.dtype`` value) and what the rest of the stack needs to know about it.

    Attributes:
        name: the ``comm.dtype`` value (``fp8_e4m3``).
        make_wire: ``(comm, generator, compile) -> Wire``: the encoder/decoder for a bucket buffer; ``generator``
            (a ``torch.Generator`` on the buffer's device) feeds stochastic rounding, ``compile`` (bool) turns on
            the ``torch.compile`` graphs (:mod:`.compiled`).
        bytes_per_element: ``comm -> float``: wire bytes per gradient element, codes plus block scales (a
            per-parameter FP32 scale is left out: FP8 tensor scaling 1.0, block scaling ``1 + 4 / block_size``).
        alignment: ``comm -> int``: elements a parameter's start (and each DP rank range) must be a multiple of for
            this format with its scaling, before any transform (FP8 tensor scaling 16, FP8 block scaling
            ``comm.block_size``, NVFP4 16, plain casts 1, the default).
        scaled: the wire carries codes with scales (a quantiser: error feedback and stochastic rounding apply, and
            ``comm.compile`` compiles it); False for the plain casts fp32 / bf16.
        block_scaling: ``comm.scaling=block`` (one FP32 scale per ``comm.block_size`` elements) is supported.
        scale_sync: ``comm.scale_sync=max`` (DP-shared scales) is supported.
        wire_sum: ``comm.reduce_op=wire_sum`` (codes summed in the format inside the collective) is supported; such a
            wire also offers ``decode(codes [blocks, granule], block scales [blocks]) -> FP32 [numel]`` for the
            summed codes (:class:`.wire_fp8.FP8Wire`).
        fp8_max: largest finite magnitude for FP8 formats (E4M3 448.0, E5M2 57344.0), else None.
        underflow_below: half the smallest subnormal for FP8 formats (E4M3 2**-10, E5M2 2**-17: magnitudes below it
            flush to zero after scaling), else None.
        granule: ``comm -> int`` elements per block of the scale layout's block tables, or None for
            :func:`comm_alignment` (the wire views the buffer as ``[numel // granule, granule]``; NVFP4: 16).
        fixed_scales: for a scaled format without block scaling, what its scales are (the error text of a rejected
            ``comm.scaling=block``).
        extra_check: ``comm -> None`` run after the generic checks of :meth:`check` (raises ConfigError), or None.
    """

    name: str
    make_wire: Callable[[Any, torch.Generator | None, bool], Wire]
    bytes_per_element: Callable[[Any], float]
    alignment: Callable[[Any], int] = _one
    scaled: bool = True
    block_scaling: bool = False
    scale_sync: bool = False
    wire_sum: bool = False
    fp8_max: float | None = None
    underflow_below: float | None = None
    granule: Callable[[Any], int] | None = None
    fixed_scales: str = ""
    extra_check: Callable[[Any], None] | None = None

    def layout_scaling(self, comm) -> str:
        """``tensor`` or ``block``: the scale groups of :func:`.scale_layout.build_scale_layout` for ``comm``
        (block only where the format has block scaling and ``comm.scaling=block``)."""
        return "block" if self.block_scaling and comm.scaling == "block" else "tensor"

    def check(self, comm) -> None:
        """Reject ``comm`` settings this format cannot honour (the ``comm`` keys that concern the wire format).

        Raises:
            ConfigError: naming the bad key and value and the fix: ``comm.error_feedback`` /
                ``comm.scale_sync`` / ``comm.rounding`` on an unscaled cast, ``comm.scaling=block`` without
                block scaling, ``comm.reduce_op=wire_sum`` or ``comm.scale_sync=max`` where unsupported.
        """
        if not self.scaled:
            scaled = ", ".join(f.name for f in FORMATS.values() if f.scaled)
            for key, v, default in (
                ("error_feedback", comm.error_feedback, False),
                ("scale_sync", comm.scale_sync, "none"),
                ("rounding", comm.rounding, "nearest"),
            ):
                if v != default:
                    raise ConfigError(
                        f"comm.{key}={str(v).lower()} needs a low-precision comm.dtype ({scaled}), got "
                        f"comm.dtype={self.name}; drop comm.{key} or change comm.dtype"
                    )
        elif not self.block_scaling and comm.scaling != "tensor":
            why = f" ({self.fixed_scales})" if self.fixed_scales else ""
            raise ConfigError(
                f"comm.scaling={comm.scaling} does not apply to comm.dtype={self.name}{why}; drop "
                f"comm.scaling or use an fp8 comm.dtype"
            )
        if comm.reduce_op == "wire_sum" and not self.wire_sum:
            names = " or ".join(f.name for f in FORMATS.values() if f.wire_sum)
            raise ConfigError(
                f"comm.reduce_op=wire_sum sums FP8 codes in the collective; it needs comm.dtype={names}, "
                f"got comm.dtype={self.name} (or use comm.reduce_op=fp32_sum)"
            )
        if self.scaled and comm.scale_sync != "none" and not self.scale_sync:
            names = ", ".join(f.name for f in FORMATS.values() if f.scale_sync)
            raise ConfigError(
                f"comm.scale_sync=max is supported for {names} only; use comm.scale_sync=none with {self.name}"
            )
        if self.extra_check is not None:
            self.extra_check(comm)


FORMATS: dict[str, WireFormat] = {}


def register_format(fmt: WireFormat) -> WireFormat:
    """Add ``fmt`` to :data:`FORMATS` under ``fmt.name`` (replacing an entry of that name) and return it."""
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> WireFormat:
    """The registered format ``name`` (a ``comm.dtype`` value).

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
    """
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"comm.dtype={name!r} is not supported; choose one of {', '.join(FORMATS)}") from None


def comm_alignment(comm) -> int:
    """The reducer's alignment for ``comm``: max(the format's :attr:`WireFormat.alignment`, ``comm.hadamard_block``
    when ``comm.transform == "hadamard"``), in elements (both powers of two, or the block size divides the rotation
    block; config validation checks that).

    Raises:
        ValueError: unknown ``comm.dtype``.
    """
    a = get_format(comm.dtype).alignment(comm)
    if comm.transform == "hadamard":
        a = max(a, comm.hadamard_block)
    return a


def layout_granule(comm) -> int:
    """Elements per block of the bucket's scale layout for ``comm``: the format's :attr:`WireFormat.granule`, else
    :func:`comm_alignment` (block scaling: ``build_scale_layout`` uses the block size itself)."""
    fmt = get_format(comm.dtype)
    return fmt.granule(comm) if fmt.granule is not None else comm_alignment(comm)


_COMM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CommConfig)}


def comm_view(settings: dict | None = None, **kw) -> SimpleNamespace:
    """A ``comm``-like object: the :class:`~megatron_geo.config.schema.CommConfig` defaults overlaid with
    ``settings`` (e.g. a codec dict of :mod:`.roundtrip`; keys CommConfig lacks, such as ``seed``, are kept) and
    ``kw``."""
    return SimpleNamespace(**{**_COMM_DEFAULTS, **(settings or {}), **kw})


# -- the built-in formats -------------------------------------------------------------------------------------------


def _cast(name: str, dtype: torch.dtype) -> WireFormat:
    def make_wire(comm, generator: torch.Generator | None = None, compile: bool = False) -> Wire:
        return CastWire(dtype)

    return WireFormat(
        name=name,
        make_wire=make_wire,
        bytes_per_element=lambda comm: float(dtype.itemsize),
        scaled=False,
    )


def _fp8_alignment(comm) -> int:
    # tensor scaling: scales reach the elements one per 16-element block, so parameters start 16-aligned
    return comm.block_size if comm.scaling == "block" else 16


def _fp8(name: str, underflow_below: float) -> WireFormat:
    return WireFormat(
        name=name,
        make_wire=lambda comm, generator, compile: FP8Wire(name, comm.rounding, generator, compile),
        alignment=_fp8_alignment,
        bytes_per_element=lambda comm: 1.0 + (4.0 / comm.block_size if comm.scaling == "block" else 0.0),
        block_scaling=True,
        scale_sync=True,
        wire_sum=True,
        fp8_max=fp8_max(name),
        underflow_below=underflow_below,
    )


register_format(_cast("fp32", torch.float32))
register_format(_cast("bf16", torch.bfloat16))
register_format(_fp8("fp8_e4m3", 2.0**-10))
register_format(_fp8("fp8_e5m2", 2.0**-17))
register_format(
    WireFormat(
        name="nvfp4",
        make_wire=lambda comm, generator, compile: NVFP4Wire(comm.rounding, generator, compile),
        alignment=lambda comm: NVFP4_BLOCK,
        bytes_per_element=lambda comm: 0.5 + 1.0 / NVFP4_BLOCK,
        granule=lambda comm: NVFP4_BLOCK,
        fixed_scales="its scales are fixed: one E4M3 per 16 elements and one FP32 per parameter",
    )
)
