"""The run's ``comm`` label: which communication precision a run used, in one short string.

Runs are compared by it (wandb group and tag, run name, ``config.yaml``, the start-up line, the summary,
``tools/compare_runs.py``), so it must tell every setting apart and give equal settings the same name:
``comm.dtype`` alone does not (fp8, fp8_ef, fp8_hadamard, fp8_shared_scale, geofp8 and geofp8_search are all
``fp8_e4m3``). Only what travels on the wire counts: ``comm.compile`` and ``comm.telemetry_interval`` (how the
run executes and reports) do not, nor do ``geo.*`` keys while ``comm.transform`` is not ``geo``.

In order:

1. ``comm.label=...`` given as an override wins (``comm.label=null`` or an empty value: derived by the rules
   below, without any file's label).
2. A label read from a file (e.g. a run's ``config.yaml`` loaded again) is kept while the settings still equal
   the ones that file described; a later change of a counted key, or a later file with a null or empty
   ``comm.label``, re-derives it.
3. The name of a ``configs/comm/<name>.yaml`` preset whose settings equal the run's: the preset the run was
   given first, then every preset next to it (so ``fp8`` + ``comm.error_feedback=true`` is ``fp8_ef``).
4. Else a compact label of the counted keys that differ from the defaults (:func:`derive_label`), e.g.
   ``fp8_e4m3+ef+geo(r32,p=search)`` or ``fp8_e4m3+ef+geo(r32,p=0.5,refresh=10)``.

A quantised parameter gather (``comm.param_gather=fp8`` / ``nvfp4``) appends ``+pg=fp8`` / ``+pg=nvfp4`` to the
preset's name or the derived label (``fp8+pg=fp8``); the plain gathers add nothing.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

from .errors import ConfigError
from .schema import CommConfig, Config, GeoConfig, parse_power

PRESET_DIR = "comm"  # a YAML file in a folder of this name is a comm preset (configs/comm/*.yaml)
# comm keys that say how the run executes or reports, not what travels on the wire: not part of the label
NOT_LABELLED = ("label", "compile", "telemetry_interval")
# geo keys shown inside geo(...) when they differ from the defaults (rank, power and select have their own forms)
_GEO_SHORT = {
    "layers": "layers",
    "num_layers": "n",
    "profile_steps": "profile",
    "damping": "damp",
    "refresh_interval": "refresh",
    "ef_on_refresh": "ef_refresh",
    "statistics": "stats",
    "sketch_size": "sketch",
}


def preset_name(path: str | Path) -> str | None:
    """``configs/comm/fp8.yaml`` -> ``"fp8"``; None for a file outside a ``comm`` folder."""
    p = Path(path)
    return p.stem if p.parent.name == PRESET_DIR else None


def gather_suffix(cfg: Config) -> str:
    """``+pg=fp8`` / ``+pg=nvfp4`` for a quantised parameter gather (``comm.param_gather``), else empty: the part of
    the label that says what the parameters travel in (the plain gathers ``auto`` and ``bf16`` add nothing)."""
    pg = cfg.comm.param_gather
    return "" if pg in ("auto", "bf16") else f"+pg={pg}"


def wire_settings(cfg: Config) -> dict:
    """The counted settings: comm keys but :data:`NOT_LABELLED` and ``param_gather`` (a suffix of the label, see
    :func:`gather_suffix`), and the geo section only with ``transform=geo``."""
    comm = {k: v for k, v in asdict(cfg.comm).items() if k not in NOT_LABELLED and k != "param_gather"}
    if cfg.comm.reduce_op != "wire_sum":  # pre-division only matters to the FP8 sum in the collective
        comm.pop("wire_sum_prediv")
    geo = asdict(cfg.geo) if cfg.comm.transform == "geo" else {}
    if geo:
        geo["power"] = _power_text(cfg.geo)
    return {"comm": comm, "geo": geo}


def _power_text(geo: GeoConfig) -> str:
    """``geo.power`` in one spelling (``0.50`` and ``5e-1`` are ``0.5``; ``auto`` stays) by :func:`parse_power`; a
    value it rejects as written (validation reports it; the label is taken before validation)."""
    try:
        power = parse_power(geo.power)
    except ConfigError:
        return f"{geo.power}"
    return power if isinstance(power, str) else format(power, "g")


def derive_label(cfg: Config) -> str:
    """A compact label of the counted comm and geo keys that differ from the defaults.

    ``dtype`` first, then ``block<N>`` (block scaling), ``sr`` (stochastic rounding), ``ef`` (error feedback),
    ``shared`` (MAX-shared scales), ``wiresum`` / ``wiresum-noprediv`` (FP8 sum in the collective), ``had<N>`` (Hadamard
    rotation), ``geo(r<rank>,p=<power>|auto,...)`` (GeoFP8;
    ``search`` with ``geo.power_search``, ``auto`` with ``geo.power=auto``; ``sel=auto`` / ``sel=gain`` with
    profiled / predicted-gain layer selection; any other geo key that
    differs from its default as ``short=value``), joined by ``+``; then :func:`gather_suffix`.
    """
    c, g = cfg.comm, cfg.geo
    parts = [c.dtype]
    if c.scaling == "block":  # only formats with block scaling accept it (comm.formats, checked by validation)
        parts.append(f"block{c.block_size}")
    if c.rounding == "stochastic":
        parts.append("sr")
    if c.error_feedback:
        parts.append("ef")
    if c.scale_sync == "max":
        parts.append("shared")
    if c.reduce_op == "wire_sum":
        parts.append("wiresum" if c.wire_sum_prediv else "wiresum-noprediv")
    if c.transform == "hadamard":
        parts.append(f"had{c.hadamard_block}")
    elif c.transform == "geo":
        d = GeoConfig()
        inner = [f"r{g.rank}", f"p={'search' if g.power_search else _power_text(g)}"]
        if g.select != "layers":
            inner.append(f"sel={g.select}")
        for f in fields(GeoConfig):
            if f.name in _GEO_SHORT and getattr(g, f.name) != getattr(d, f.name):
                v = getattr(g, f.name)
                inner.append(f"{_GEO_SHORT[f.name]}={format(v, 'g') if isinstance(v, float) else v}")
        parts.append(f"geo({','.join(inner)})")
    return "+".join(parts) + gather_suffix(cfg)


def reset_comm_sections(cfg: Config) -> None:
    """A preset sets the whole comm and geo sections: start both from the defaults."""
    cfg.comm, cfg.geo = CommConfig(), GeoConfig()


def resolve_label(
    cfg: Config, explicit: str | None, file_label: tuple[str, dict] | None, presets: list[tuple[str, Config]]
) -> str:
    """The label of ``cfg`` by the rules of the module docstring.

    Args:
        explicit: a ``comm.label=...`` override, or None.
        file_label: ``(label, wire_settings when that file was read)`` of the last file that set ``comm.label``.
        presets: ``(name, preset loaded alone)``, the run's own preset first.
    """
    if explicit:
        return explicit
    now = wire_settings(cfg)
    suffix = gather_suffix(cfg)
    # a file's label (a run's config.yaml) names its parameter gather too: kept while that is unchanged
    same_gather = file_label is not None and (file_label[0].endswith(suffix) if suffix else "+pg=" not in file_label[0])
    if file_label is not None and file_label[1] == now and same_gather:
        return file_label[0]
    for name, preset_cfg in presets:
        if wire_settings(preset_cfg) == now:
            return name + suffix
    return derive_label(cfg)
