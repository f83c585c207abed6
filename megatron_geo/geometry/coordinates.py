"""GeoFP8's coordinate transform for the low-precision reducer: each selected layer's weight gradient ``G``
(``[rows, cols]``, a row-major slot of a bucket buffer) travels as ``G T`` and comes back as ``G^ T^-1``.

It implements the reducer's coordinate-transform interface (``megatron_geo.comm.transforms.CoordinateTransform``;
this package does not import ``comm``): the reducer calls :meth:`GeoTransform.to_wire` before the encode and
:meth:`GeoTransform.write_back` after the decode of the reduced mean, and hands over its error-feedback residuals
(:meth:`GeoTransform.track_residuals`), which this class re-bases at every refresh of the :class:`~.geo.GeoState`
(R <- R T_old^-1 T_new, or R <- 0 with ``geo.ef_on_refresh=reset``). While ``geo.select=auto`` profiles, the
gradient stays Euclidean and :meth:`GeoTransform.to_wire` records the bound hits of each candidate instead.

``T`` mixes columns only, so every owner inverts its own rows: the shard plan must cut a selected layer only
between rows (``granule_fn`` of the buckets). All matmuls run in IEEE FP32
(:func:`~megatron_geo.parallel.precision.exact_fp32`).
"""

from __future__ import annotations

import torch

from ..parallel.precision import exact_fp32
from ..parallel.trace import trace_range
from .geo import GeoState


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.device == b.device


class GeoTransform:
    """``G T`` for the selected layers of ``geo`` found in ``buckets``.

    Args:
        geo: the GeoFP8 state (selection, current transforms, refresh).
        buckets: the gradient buckets (``megatron_geo.distributed.buckets.Bucket``: ``index``, ``params`` and
            ``plan.offsets``, each parameter's start in the bucket buffer).
    """

    name = "geo"

    def __init__(self, geo: GeoState, buckets):
        self.geo = geo
        want = {id(p): n for n, p in geo.params.items()}
        # bucket key -> (parameter name, offset in the bucket buffer, rows, cols) of every candidate in it
        self.slots: dict[int, list[tuple[str, int, int, int]]] = {}
        for b in buckets:
            slots = [
                (want[id(p)], off, p.shape[0], p.shape[1]) for p, off in zip(b.params, b.plan.offsets) if id(p) in want
            ]
            if slots:
                self.slots[b.index] = slots
        self._residuals: dict[int, torch.Tensor] = {}
        geo.add_refresh_listener(self._rebase)

    # -- the reducer's interface ----------------------------------------------------------------------
    def alignment(self) -> int:
        """1: rows stay whole through the buckets' granule, not through the alignment."""
        return 1

    def register_bucket(self, key, offsets, numels, bounds, device) -> None:
        """Check that every candidate slot of bucket ``key`` lies inside it.

        Raises:
            ValueError: a slot reaches past the bucket (the buckets given to the constructor are not these).
        """
        for name, off, rows, cols in self.slots.get(key, []):
            if off + rows * cols > bounds[-1]:
                raise ValueError(
                    f"GeoFP8 layer {name} ends at {off + rows * cols}, past bucket {key} ({bounds[-1]} elements)"
                )

    def to_wire(self, x: torch.Tensor, key, record: bool = True) -> torch.Tensor:
        """``x`` with each selected layer's slot replaced by ``G T``, in place (``x`` is the bucket's gradient
        buffer, consumed by the reduction: the reduced result overwrites it before it is read again). While
        profiling: ``x`` unchanged, and with ``record`` each candidate's bound hits are accumulated."""
        slots = self.slots.get(key)
        if not slots:
            return x
        geo = self.geo
        if geo.profiling:
            if record:
                for name, off, rows, cols in slots:
                    geo.record_bound_hits(name, x[off : off + rows * cols])
            return x
        with exact_fp32():  # G T in IEEE FP32: one precision switch for the bucket's layers
            for name, off, rows, cols in slots:
                if name not in geo.selected:
                    continue
                geo.transforms[name].apply_(x[off : off + rows * cols].view(rows, cols))
        return x

    def from_wire(self, y: torch.Tensor, key, start: int) -> torch.Tensor:
        """``y`` (the buffer range ``[start, start + len(y))``, whole rows of each layer) with ``G^ T^-1`` per
        selected layer, in place; returns ``y``.

        Raises:
            RuntimeError: the range cuts a selected layer inside a row.
        """
        slots = self.slots.get(key)
        if not slots:
            return y
        end = start + y.numel()
        geo = self.geo
        with exact_fp32():  # G^ T^-1 in IEEE FP32: one precision switch for the range's layers
            for name, off, rows, cols in slots:
                lo, hi = max(off, start), min(off + rows * cols, end)
                if name not in geo.selected or lo >= hi:
                    continue
                if (lo - off) % cols or (hi - off) % cols:
                    raise RuntimeError(
                        f"GeoFP8 layer {name} is cut inside a row by the shard plan; its rows must "
                        f"stay whole on their owner (granule {cols})"
                    )
                geo.transforms[name].apply_inverse_(y[lo - start : hi - start].view(-1, cols))  # rows independent
        return y

    def decode_target(self, buf: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """The bucket's own range: the inverse maps it back in place."""
        return buf[start : start + n]

    def write_back(self, buf: torch.Tensor, start: int, y: torch.Tensor, key) -> None:
        dest = buf[start : start + y.numel()]
        out = self.from_wire(y, key, start)
        if not _same_memory(dest, out):
            dest.copy_(out)

    def transformed_layers(self, key) -> list[tuple[str, int, int, int]]:
        """The selected layers' slots of bucket ``key`` (none while profiling)."""
        if self.geo.profiling:
            return []
        return [s for s in self.slots.get(key, []) if s[0] in self.geo.selected]

    def track_residuals(self, residuals: dict[int, torch.Tensor]) -> None:
        """Re-base these residuals (bucket key -> FP32 ``[numel]``, the reducer's live tensors; the dict is kept until
        the next call) at every refresh."""
        self._residuals = residuals

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """:meth:`GeoState.state_dict` of the state behind it (the slots follow from the buckets)."""
        return self.geo.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.geo.load_state_dict(sd)

    # -- refresh ----------------------------------------------------------------------------------------
    def _rebase(self, old: dict, new: dict) -> None:
        """At a refresh: R <- R T_old^-1 T_new (``geo.ef_on_refresh=rebase``) or R <- 0 (``reset``), per layer."""
        with trace_range("transform"):
            for key, slots in self.slots.items():
                if key not in self._residuals:
                    continue
                res = self._residuals[key]
                for name, off, rows, cols in slots:
                    if name not in new:
                        continue
                    view = res[off : off + rows * cols].view(rows, cols)
                    if self.geo.ef_on_refresh == "reset":
                        view.zero_()
                    else:
                        view.copy_(new[name].apply(old[name].apply_inverse(view)))
