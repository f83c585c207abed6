"""Coordinate transforms of the low-precision reducer: the coordinates a bucket's FP32 gradient is quantised in.

The reducer holds exactly one :class:`CoordinateTransform` and calls it around the codec (each call names the
bucket by its int key, under which a transform keeps whatever per-bucket state it has):
:meth:`~CoordinateTransform.to_wire` before the encode (error feedback is added and kept in those coordinates),
:meth:`~CoordinateTransform.decode_target`
and :meth:`~CoordinateTransform.write_back` after the decode of the reduced mean. Implementations here:

- :class:`IdentityTransform`: the gradient itself (``comm.transform=none``, and ``geo`` until the GeoFP8 state is
  attached);
- :class:`HadamardTransform`: the fixed block-Hadamard rotation ``y = x M`` per ``comm.hadamard_block`` elements
  (:mod:`.hadamard`), ``x = y M^T`` back, in IEEE FP32.

GeoFP8's ``G T`` per selected layer is ``megatron_geo.geometry.GeoTransform`` (this package does not import
``geometry``; ``megatron_geo.training.geo_setup`` hands it to the reducer).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .hadamard import exact_fp32, hadamard_matrix, hadamard_signs


class CoordinateTransform(Protocol):
    """The reducer's view of a coordinate transform (tensors are FP32 bucket buffers ``[numel]`` or ranges of them).

    ``name``: ``comm.transform`` (``none``, ``hadamard``, ``geo``). ``geo``: the GeoFP8 state behind the transform
    (``geometry.GeoState``), else ``None``.
    """

    name: str

    @property
    def geo(self): ...

    def alignment(self) -> int:
        """Elements a parameter's start (and each DP rank's range) must be a multiple of for this transform."""

    def register_bucket(self, key: int, offsets: list[int], numels: list[int], bounds: list[int], device) -> None:
        """The layout of bucket ``key`` (parameter offsets and sizes, ``dp_size + 1`` range boundaries)."""

    def to_wire(self, x: torch.Tensor, key, record: bool = True) -> torch.Tensor:
        """Bucket ``key``'s buffer ``x`` in the quantised coordinates. May transform ``x`` in place or return a
        scratch tensor valid until the next call. ``record=False``: no side effects (telemetry's trial round trip)."""

    def from_wire(self, y: torch.Tensor, key, start: int) -> torch.Tensor:
        """Undo :meth:`to_wire` on ``y``, the buffer range ``[start, start + len(y))`` of bucket ``key`` (may work in
        place on ``y``)."""

    def decode_target(self, buf: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """FP32 ``[n]`` where the decoder writes the reduced range ``[start, start + n)`` of ``buf`` before
        :meth:`write_back`: the range itself, or a scratch tensor."""

    def write_back(self, buf: torch.Tensor, start: int, y: torch.Tensor, key) -> None:
        """``buf[start:start + len(y)] = from_wire(y)`` (``y`` may be that range itself)."""

    def transformed_layers(self, key) -> list[tuple[str, int, int, int]]:
        """``(name, offset, rows, cols)`` of the layers of bucket ``key`` whose gradient currently goes through a
        layer-specific transform (telemetry compares them with the plain codec); empty for the fixed transforms."""

    def track_residuals(self, residuals: dict[int, torch.Tensor]) -> None:
        """The reducer's error-feedback residuals (bucket key -> FP32 ``[numel]``, the live tensors, in this
        transform's coordinates), handed over again whenever a bucket with a residual is registered: a transform
        whose coordinates change (GeoFP8 at a refresh) re-expresses them in the new ones."""


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.device == b.device


class IdentityTransform:
    """The gradient's own coordinates: nothing to do."""

    name = "none"
    geo = None

    def alignment(self) -> int:
        return 1

    def register_bucket(self, key, offsets, numels, bounds, device) -> None:
        pass

    def to_wire(self, x, key, record=True):
        return x

    def from_wire(self, y, key, start):
        return y

    def decode_target(self, buf, start, n):
        return buf[start : start + n]

    def write_back(self, buf, start, y, key) -> None:
        dest = buf[start : start + y.numel()]
        if not _same_memory(dest, y):
            dest.copy_(y)

    def transformed_layers(self, key):
        return []

    def track_residuals(self, residuals) -> None:
        pass


class HadamardTransform:
    """Fixed block-Hadamard rotation (``comm.transform=hadamard``): ``y = x M`` per block row, ``x = y M^T``.

    ``M = diag(signs) H_b / sqrt(b)`` float32 ``[b, b]`` (:func:`.hadamard.hadamard_matrix`), the signs drawn on the
    host from ``seed`` (identical on every machine) and kept on ``device``. Every matmul runs in IEEE FP32
    (:func:`.hadamard.exact_fp32`). The rotated bucket and the decoded mean live in one workspace shared by all
    buckets (:meth:`_workspace`).

    Raises:
        ValueError: ``block`` not a power of two.
    """

    name = "hadamard"
    geo = None

    def __init__(self, block: int, seed: int, device=None):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.block = block
        self.signs = hadamard_signs(block, seed).to(dev)
        self.rotation = hadamard_matrix(self.signs)
        self.rotation_t = self.rotation.t().contiguous()
        self._ws: torch.Tensor | None = None

    def alignment(self) -> int:
        return self.block

    def register_bucket(self, key, offsets, numels, bounds, device) -> None:
        pass

    def _workspace(self, n: int, device) -> torch.Tensor:
        """FP32 ``[n]`` scratch shared by all buckets (the rotation's output, and the decoded mean before the inverse
        rotation), allocated once at the largest size asked for. Each use lies inside one call of the reducer
        (rotate then encode; decode then rotate back in its epilogue), and calls run one after another on the host
        and in order on the device's stream, so no two buckets hold it live."""
        ws = self._ws
        if ws is None or ws.numel() < n or ws.device != torch.device(device):
            ws = self._ws = torch.empty(n, dtype=torch.float32, device=device)
        return ws[:n]

    def to_wire(self, x, key, record=True):
        """``x`` rotated into the workspace (valid until the next call; no new bucket-sized buffer per reduction)."""
        b = self.block
        ws = self._workspace(x.numel(), x.device)
        with exact_fp32():  # IEEE FP32 (never TF32) whatever the caller's matmul precision
            torch.mm(x.view(-1, b), self.rotation, out=ws.view(-1, b))
        return ws

    def from_wire(self, y, key, start):
        """A new FP32 tensor: ``y`` rotated back."""
        with exact_fp32():
            return torch.mm(y.view(-1, self.block), self.rotation_t).view(-1)

    def decode_target(self, buf, start, n):
        return self._workspace(n, buf.device)

    def write_back(self, buf, start, y, key) -> None:
        """The inverse rotation writes straight into ``buf``'s range."""
        b = self.block
        dest = buf[start : start + y.numel()]
        with exact_fp32():
            torch.mm(y.view(-1, b), self.rotation_t, out=dest.view(-1, b))

    def transformed_layers(self, key):
        return []

    def track_residuals(self, residuals) -> None:
        pass


def build_transform(name: str, hadamard_block: int = 128, seed: int = 0, device=None) -> CoordinateTransform:
    """The fixed transform for ``comm.transform``: ``hadamard`` -> :class:`HadamardTransform`, ``none`` and ``geo``
    (whose layer transforms are attached later) -> :class:`IdentityTransform`.

    Raises:
        ValueError: an unknown ``name``.
    """
    if name == "hadamard":
        return HadamardTransform(hadamard_block, seed, device)
    if name in ("none", "geo"):
        return IdentityTransform()
    raise ValueError(f"comm.transform={name!r} is not supported; choose none, hadamard or geo")
