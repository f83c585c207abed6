"""Start-up checks of the ``geo`` section (GeoFP8, ``comm.transform=geo``): its cross-key rules and its keys that
the other settings give no effect. ``geo.power`` and ``geo.power_search`` are parsed by their own functions in
:mod:`megatron_geo.config.schema`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..config.checks import InertRule
from ..config.errors import ConfigError
from ..config.schema import CommConfig, GeoConfig, parse_power_search


def check_geo_config(g: GeoConfig, comm: CommConfig, fp8_dtypes: Sequence[str]) -> None:
    """Check the ``geo`` keys against each other and the wire format, where ``comm.transform=geo``
    (``fp8_dtypes``: the registered FP8 ``comm.dtype`` values).

    Checked: ``geo.select=auto`` needs ``geo.num_layers >= 1``, ``geo.profile_steps >= 1`` and an FP8
    ``comm.dtype`` (it profiles FP8 bound hits); ``geo.select=gain`` needs ``geo.num_layers >= 1``;
    ``geo.sketch_size >= geo.rank`` (with sketched statistics); ``geo.rank`` and ``geo.refresh_interval >= 1``;
    ``geo.damping > 0``.

    Raises:
        ConfigError: naming the key, the bad value and the fix.
    """
    if comm.transform != "geo":
        return
    if g.select == "auto" and (g.num_layers < 1 or g.profile_steps < 1):
        raise ConfigError(
            f"geo.select=auto needs geo.num_layers={g.num_layers} >= 1 and geo.profile_steps={g.profile_steps} >= 1"
        )
    if g.select == "gain" and g.num_layers < 1:
        raise ConfigError(
            f"geo.select=gain needs geo.num_layers={g.num_layers} >= 1 (how many layers keep the transform)"
        )
    if comm.dtype not in fp8_dtypes and g.select == "auto":
        raise ConfigError(f"geo.select=auto profiles FP8 bound hits; use comm.dtype={' or '.join(fp8_dtypes)}")
    if g.statistics != "full" and g.sketch_size < g.rank:
        raise ConfigError(
            f"geo.sketch_size={g.sketch_size} must be >= geo.rank={g.rank}; raise geo.sketch_size (2 x geo.rank is a "
            f"good choice) or set geo.statistics=full"
        )
    for key, v in (("rank", g.rank), ("refresh_interval", g.refresh_interval)):
        if v < 1:
            raise ConfigError(f"geo.{key}={v} must be >= 1")
    if not g.damping > 0:
        raise ConfigError(f"geo.damping={g.damping} must be > 0 (relative to the mean eigenvalue of A, e.g. 1e-3)")


def geo_inert_keys(g: GeoConfig, comm: CommConfig) -> list[InertRule]:
    """The ``geo`` keys that the settings give no effect: every one without ``comm.transform=geo``; with it,
    ``geo.num_layers`` with ``geo.select=layers``, ``geo.profile_steps`` without ``geo.select=auto``, ``geo.power``
    with ``geo.power_search``, ``geo.sketch_size`` with ``geo.statistics=full`` and ``geo.ef_on_refresh`` without
    error feedback.

    Raises:
        ConfigError: a malformed ``geo.power_search``.
    """
    if comm.transform != "geo":
        return [
            (
                tuple(f"geo.{f.name}" for f in dataclasses.fields(g)),
                f"comm.transform={comm.transform}",
                "set comm.transform=geo",
            )
        ]
    rules: list[InertRule] = []
    if g.select == "layers":
        rules.append(
            (("geo.num_layers",), "geo.select=layers (geo.layers alone chooses)", "set geo.select=auto or gain")
        )
    if g.select != "auto":
        rules.append((("geo.profile_steps",), f"geo.select={g.select} (nothing is profiled)", "set geo.select=auto"))
    if parse_power_search(g.power_search):
        rules.append(
            (
                ("geo.power",),
                f"geo.power_search={g.power_search} (the search picks each layer's power)",
                "drop geo.power_search",
            )
        )
    if g.statistics == "full":
        rules.append((("geo.sketch_size",), "geo.statistics=full", "set geo.statistics=sketch or auto"))
    if not comm.error_feedback:
        rules.append(
            (
                ("geo.ef_on_refresh",),
                "comm.error_feedback=false (no residual to carry over)",
                "set comm.error_feedback=true",
            )
        )
    return rules
