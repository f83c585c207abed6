"""GeoFP8 wiring: the ``geometry`` state built from the config, given what it needs from ``comm`` (the codec round
trip that ``geo.power_search`` scores with, the FP8 limits of ``comm.dtype``) through its constructor, and its
coordinate transform handed to the reducer. ``comm`` and ``geometry`` never import each other; this module
connects them."""

from __future__ import annotations

import functools

import torch

from ..comm.formats import get_format
from ..comm.roundtrip import quantize_roundtrip
from ..config import Config, ConfigError
from ..config.schema import parse_power, parse_power_search
from ..geometry import GeoState, GeoTransform
from ..model.compile import eager_calls
from ..parallel import ParallelContext

# limits for a wire without FP8 codes (fp32 / bf16 / nvfp4 behind GeoFP8): the bound-hit profile counts E4M3's
_DEFAULT_FP8 = "fp8_e4m3"


def _log0(pctx: ParallelContext, msg: str) -> None:
    if pctx.is_main:
        print(msg, flush=True)


def codec_roundtrip(comm):
    """``x -> decode(encode(x))`` of one tensor through ``comm``'s codec (round to nearest, its own tensor or block
    scales, no reduce; :func:`~megatron_geo.comm.roundtrip.quantize_roundtrip`): what ``geo.power_search`` scores
    candidate transforms with. Float tensor in, FP32 tensor of the same shape out."""
    return functools.partial(
        quantize_roundtrip, codec={"dtype": comm.dtype, "scaling": comm.scaling, "block_size": comm.block_size}
    )


def fp8_limits(comm) -> tuple[float, float]:
    """``(fp8_max, underflow_below)`` of ``comm.dtype`` for the bound-hit counts (E4M3: 448 and 2**-10, E5M2: 57344
    and 2**-17; formats without FP8 codes count against E4M3's)."""
    fmt = get_format(comm.dtype)
    if fmt.fp8_max is None:
        fmt = get_format(_DEFAULT_FP8)
    assert fmt.fp8_max is not None and fmt.underflow_below is not None  # an FP8 format has both
    return fmt.fp8_max, fmt.underflow_below


def build_geo(cfg: Config, model: torch.nn.Module, pctx: ParallelContext) -> GeoState:
    """GeoFP8 state for ``comm.transform=geo``: the layers of ``geo.layers``, the K-FAC input statistics and their
    refresh schedule, with the codec round trip and FP8 limits of ``cfg.comm`` (compiled blocks that enclose a
    selected layer run eagerly while its statistics are armed).

    Raises:
        ConfigError: a ``geo.layers`` pattern matches no linear weight.
    """
    g = cfg.geo
    if parse_power_search(g.power_search) and parse_power(g.power) != 0.5:
        _log0(
            pctx,
            f"note: geo.power={g.power} is not used: geo.power_search={g.power_search} chooses the power "
            f"per layer at every refresh",
        )
    try:
        return GeoState(
            g,
            model,
            pctx.dp_group,
            fp8_limits=fp8_limits(cfg.comm),
            log=lambda m: _log0(pctx, m),
            roundtrip=codec_roundtrip(cfg.comm),
            run_eagerly=eager_calls,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def attach_geo(reducer, geo: GeoState, buckets) -> None:
    """Let ``reducer`` communicate the selected layers' gradients as ``G T``
    (:class:`~megatron_geo.geometry.GeoTransform` over ``buckets``' layout; the error-feedback re-base at each
    refresh goes with it)."""
    reducer.set_transform(GeoTransform(geo, buckets))
