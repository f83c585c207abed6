"""The run's ``comm`` label: which communication precision a run used, in one short string.

Runs are compared by it (wandb group and tag, run name, ``config.yaml``, the start-up line, the summary,
``tools/compare_runs.py``), so it must tell every preset apart: ``comm.dtype`` alone does not (fp8, fp8_ef,
fp8_hadamard, fp8_shared_scale, geofp8 and geofp8_search are all ``fp8_e4m3``).

- A run given one ``configs/comm/<name>.yaml`` preset and no ``comm.*`` / ``geo.*`` change after it is
  labelled ``<name>``.
- Otherwise the label lists what differs from the defaults (:func:`derive_label`), e.g. ``fp8_e4m3+ef+geo(r32,p=auto)``.
- ``comm.label=...`` set explicitly wins.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from .schema import CommConfig, Config, GeoConfig

PRESET_DIR = "comm"  # a YAML file in a folder of this name is a comm preset (configs/comm/*.yaml)


def preset_name(path: str | Path) -> str | None:
    """``configs/comm/fp8.yaml`` -> ``"fp8"``; None for a file outside a ``comm`` folder."""
    p = Path(path)
    return p.stem if p.parent.name == PRESET_DIR else None


def derive_label(cfg: Config) -> str:
    """A compact label of the comm and geo keys that differ from the defaults.

    ``dtype`` first, then ``block<N>`` (block scaling), ``sr`` (stochastic rounding), ``ef`` (error feedback),
    ``shared`` (MAX-shared scales), ``had<N>`` (Hadamard rotation), ``geo(r<rank>,p=<power>|auto)`` (GeoFP8;
    ``auto`` with ``geo.power_search``; ``,sel=auto`` with profiled layer selection), joined by ``+``.
    """
    c, g = cfg.comm, cfg.geo
    parts = [c.dtype]
    if c.scaling == "block" and c.dtype in ("fp8_e4m3", "fp8_e5m2"):
        parts.append(f"block{c.block_size}")
    if c.rounding == "stochastic":
        parts.append("sr")
    if c.error_feedback:
        parts.append("ef")
    if c.scale_sync == "max":
        parts.append("shared")
    if c.transform == "hadamard":
        parts.append(f"had{c.hadamard_block}")
    elif c.transform == "geo":
        p = "auto" if g.power_search else f"{g.power:g}"
        parts.append(f"geo(r{g.rank},p={p}{',sel=auto' if g.select == 'auto' else ''})")
    return "+".join(parts)


# comm keys that say how the run executes or reports, not what travels on the wire: not part of the label
NOT_LABELLED = ("label", "compile", "telemetry_interval")


def _sections(cfg: Config) -> dict:
    comm = {k: v for k, v in asdict(cfg.comm).items() if k not in NOT_LABELLED}
    return {"comm": comm, "geo": asdict(cfg.geo)}


def resolve_label(cfg: Config, preset: str | None, preset_only: Config | None) -> str:
    """The label of ``cfg``: ``comm.label`` if set; the preset's name if ``cfg``'s comm and geo sections equal
    ``preset_only`` (the preset loaded alone); else :func:`derive_label`."""
    if cfg.comm.label:
        return cfg.comm.label
    if preset is not None and preset_only is not None and _sections(cfg) == _sections(preset_only):
        return preset
    return derive_label(cfg)


def reset_comm_sections(cfg: Config) -> None:
    """A preset sets the whole comm and geo sections: start both from the defaults."""
    cfg.comm, cfg.geo = CommConfig(), GeoConfig()
