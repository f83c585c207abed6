"""Moved: :func:`megatron_geo.comm.formats.build_reducer`."""

from .formats import build_reducer  # noqa: F401
