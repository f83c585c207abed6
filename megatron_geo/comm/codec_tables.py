"""The scale layouts the low-precision reducer keeps for its buckets, for a ``comm`` config: built
(:func:`bucket_scale_layout`, what :meth:`~.lowp.LowPrecisionReducer.register_bucket` keeps) or only counted
(:func:`codec_table_bytes`, for a memory plan made without a model, a device or a process group).

A parameter's scale group covers the alignment padding after it: parameters start aligned, so its last (rotation
or scale) block ends there, and that block's rotated values belong to it alone. The layout's granule is the
format's (:func:`.formats.layout_granule`): NVFP4 reads its buffer as 16-element blocks whatever the alignment (a
Hadamard rotation aligns parameters to 128, and the 128-multiples are whole 16-element blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .formats import comm_alignment, get_format, layout_granule
from .scale_layout import ScaleLayout, build_scale_layout, layout_table_bytes


def _layout_args(comm, numels: Sequence[int], alignment: int | None) -> tuple[list[int], str, int]:
    a = comm_alignment(comm) if alignment is None else alignment
    extents = [int(n) if a == 1 or n == 0 else -(-int(n) // a) * a for n in numels]
    return extents, get_format(comm.dtype).layout_scaling(comm), layout_granule(comm)


def bucket_scale_layout(
    comm, offsets: Sequence[int], numels: Sequence[int], bounds, dp_size: int, device, alignment: int | None = None
) -> ScaleLayout:
    """The :class:`~.scale_layout.ScaleLayout` the low-precision reducer keeps for one bucket.

    Args:
        comm: the ``comm`` config section (or :func:`.formats.comm_view`).
        offsets, numels: each parameter's start in the bucket and its elements (without padding).
        bounds: the ``dp_size + 1`` rank-range boundaries (elements, from 0) or an even chunk (int).
        device: where the layout's tensors live.
        alignment: the reducer's alignment (:meth:`~.lowp.LowPrecisionReducer.alignment`); None:
            :func:`.formats.comm_alignment` of ``comm``, which it equals.

    Raises:
        ValueError: as :func:`.scale_layout.build_scale_layout` (misaligned segments or ranges), or an unknown
            ``comm.dtype``.
    """
    extents, scaling, granule = _layout_args(comm, numels, alignment)
    return build_scale_layout(
        list(offsets), extents, bounds, dp_size, scaling, comm.block_size, device, granule=granule
    )


def codec_table_bytes(comm, buckets: Iterable[tuple[Sequence[int], Sequence[int], object]], dp_size: int) -> int:
    """Bytes of the scale-layout tensors the reducer for ``comm`` keeps on each rank (identical on every rank) for
    ``buckets``, counted from python ints: no model, no tensor, no process group. Equals the sum of
    :meth:`~.scale_layout.ScaleLayout.table_bytes` over the buckets the reducer registered (its
    :meth:`~.lowp.LowPrecisionReducer.index_table_bytes`); 0 where ``comm`` gets a plain FP32 / BF16 reducer
    (``comm.transform=none``), which keeps no layout.

    Args:
        comm: the ``comm`` config section (or :func:`.formats.comm_view`).
        buckets: per bucket ``(offsets, numels, bounds)``: each parameter's start in the bucket buffer and its
            elements without padding (a shard plan's ``offsets`` and the parameters' numels), and the
            ``dp_size + 1`` rank-range boundaries in elements (or an even chunk, an int).
        dp_size: data-parallel ranks.

    Returns:
        bytes (int): per bucket, tensor scaling ``13 * dp_size * K`` (K: scale segments of
        the fullest rank range), block scaling ``12 * dp_size + 4 * K`` (K: blocks of the largest range).

    Raises:
        ValueError: misaligned offsets or ranges (as :func:`.scale_layout.build_scale_layout`), an unknown
            ``comm.dtype``.
    """
    get_format(comm.dtype)
    if comm.dtype in ("fp32", "bf16") and comm.transform == "none":
        return 0
    total = 0
    for offsets, numels, bounds in buckets:
        extents, scaling, granule = _layout_args(comm, numels, None)
        total += layout_table_bytes(list(offsets), extents, bounds, dp_size, scaling, comm.block_size, granule)
    return total
