"""YAML loading, ordered merge of several files, dotted ``key=value`` overrides, type checking.

Errors are :class:`ConfigError` with a message that names the offending file/key/value and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import decimal
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from .schema import Config


class ConfigError(ValueError):
    """A bad config file, key, value or combination of sizes."""


def _section_fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _suggest(name: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{prefix}{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(options))}."


_LIST_KEYS = ("geo.layers", "geo.power_search")  # comma-separated strings that may be written as YAML lists
_EMPTY_OK = ("geo.power_search",)                 # strings whose empty value means "off"
_AUTO_BOOL_KEYS = ("parallel.overlap_param_gather", "comm.compile")  # str keys whose values are auto, true or false


def _int_from_text(text: str) -> int | None:
    """``"20"``, ``"4_000_000"``, ``"1e3"``, ``"2.0"`` -> int; ``"2.5e0"``, ``"2.5"``, ``"x"`` -> None (never truncated)."""
    t = text.strip()
    try:
        return int(t, 10)
    except ValueError:
        pass
    try:
        d = decimal.Decimal(t.replace("_", ""))  # exact: 1e30 is 10**30, not the nearest float
    except decimal.InvalidOperation:
        return None
    return int(d) if d.is_finite() and d == d.to_integral_value() else None


def _coerce(value: Any, typ: type, where: str) -> Any:
    """Convert ``value`` to the schema field's type ``typ`` or raise ConfigError.

    Values are typed against the field, never guessed first: YAML files are read without implicit typing
    (every scalar is its text) and overrides are their text, so a string key keeps the text exactly as written
    and a non-integral number for an integer key is an error in every spelling (``2.5``, ``2.5e0``).
    """
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.strip().lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and (n := _int_from_text(value)) is not None:
            return n
        raise ConfigError(f"{where}: expected an integer, got {value!r} (a whole number, e.g. 20 or 1e3)")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, bool) and where.endswith(_AUTO_BOOL_KEYS):  # auto | true | false keys
            return "true" if value else "false"
        if isinstance(value, str) and where.endswith(_AUTO_BOOL_KEYS):
            low = value.strip().lower()
            return {"yes": "true", "on": "true", "no": "false", "off": "false"}.get(low, low)
        if isinstance(value, str) and where.endswith(_LIST_KEYS) and value.strip().startswith("["):
            try:
                value = yaml.load(value, Loader=yaml.BaseLoader)  # an override written as a YAML list
            except yaml.YAMLError:
                raise ConfigError(f"{where}: {value!r} is not a valid list; e.g. [0.5, 0.25, 0]") from None
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if value is None and where.endswith(_EMPTY_OK):
            return ""  # `geo.power_search=` (an empty override) = off
        scalars = isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                                  for v in value)
        if scalars and where.endswith(_LIST_KEYS):
            if any(str(v).strip() == "" for v in value):
                raise ConfigError(f"{where}: the list {value!r} has an empty element; e.g. [0.5, 0.25, 0]")
            return ",".join(str(v) for v in value)  # a YAML list of patterns / numbers = the comma-separated form
        if isinstance(value, list) and where.endswith(_LIST_KEYS):
            raise ConfigError(f"{where}: expected a list of numbers or strings, got {value!r}; e.g. [0.5, 0.25, 0]")
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported field type {typ}")


def _apply(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    sections = _section_fields(cfg)
    if section not in sections:
        raise ConfigError(f"{origin}: unknown section '{section}'.{_suggest(section, sections)}")
    sec = getattr(cfg, section)
    fields = _section_fields(sec)
    if key not in fields:
        raise ConfigError(f"{origin}: unknown key '{section}.{key}'.{_suggest(key, fields, section + '.')}")
    hints = typing.get_type_hints(type(sec))
    setattr(sec, key, _coerce(value, hints[key], f"{origin}: {section}.{key}"))


def load_config(files: list[str] | tuple[str, ...] = (), overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a :class:`Config`: defaults, then each YAML file in order, then ``section.key=value`` overrides.

    Raises:
        ConfigError: missing file, YAML syntax error, unknown section/key (with the closest valid
            key suggested), a value of the wrong type, or a malformed override.
    """
    from .label import resolve_label

    cfg, preset, file_label, explicit = _build(files, overrides)
    cfg.comm.label = resolve_label(cfg, explicit, file_label, _presets(preset))
    return cfg


# the repository's presets: named when a run's settings equal one of them (also without --config configs/comm/...)
_PRESET_FOLDER = Path(__file__).resolve().parents[2] / "configs" / "comm"


def _presets(preset: tuple[str, str] | None) -> list[tuple[str, Config]]:
    """``(name, preset loaded alone)``: the run's own preset first, then every other preset in its folder (the
    repository's ``configs/comm`` without one); a preset that does not load is left out."""
    folder = Path(preset[1]).parent if preset is not None else _PRESET_FOLDER
    paths = [Path(preset[1])] if preset is not None else []
    if folder.is_dir():
        paths += [p for p in sorted(folder.glob("*.yaml")) if preset is None or p.resolve() != Path(preset[1]).resolve()]
    out = []
    for p in paths:
        try:
            out.append((p.stem, _load_preset(str(p.resolve()), p.stat().st_mtime_ns)))
        except (ConfigError, OSError):
            continue
    return out


@functools.lru_cache(maxsize=64)
def _load_preset(path: str, mtime_ns: int) -> Config:
    return _build([path], ())[0]


def _build(files, overrides):
    """Defaults, files, overrides -> ``(cfg, (preset name, file) or None, (label, wire settings) of the last file
    that set comm.label or None, the comm.label override or None)``; ``cfg.comm.label`` is left empty."""
    from .label import preset_name, reset_comm_sections, wire_settings

    cfg = Config()
    preset = file_label = explicit = None
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"config file '{f}' not found (pass an existing YAML file to --config)")
        name = preset_name(path)
        if name is not None:
            if preset is not None:
                raise ConfigError(f"config files '{preset[1]}' and '{f}' are both comm presets; a preset sets the "
                                  f"whole comm and geo sections, so pass one and change keys with overrides "
                                  f"(e.g. comm.error_feedback=true)")
            preset = (name, f)
            reset_comm_sections(cfg)  # a preset replaces comm and geo (never a silent merge with earlier files)
        try:
            # no implicit typing: every scalar stays its text and is typed against the schema (_coerce)
            data = yaml.load(path.read_text(encoding="utf-8-sig"), Loader=yaml.BaseLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{f}' is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{f}': top level must be a mapping of sections, got {type(data).__name__}")
        # a model config after a preset would silently replace part of it (an overlay of comm/geo keys alone is
        # a deliberate change and allowed)
        if preset is not None and name is None and "model" in data and ({"comm", "geo"} & set(data)):
            raise ConfigError(f"model config '{f}' sets {'/'.join(sorted({'comm', 'geo'} & set(data)))} keys after the "
                              f"comm preset '{preset[1]}', which would silently replace part of it; pass the preset "
                              f"last (--config MODEL.yaml --config {preset[1]}) or change keys with overrides")
        for section, body in data.items():
            if not isinstance(body, dict):
                raise ConfigError(f"{f}: section '{section}' must be a mapping of key: value")
            for key, value in body.items():
                _apply(cfg, section, key, value, f)
        if cfg.comm.label:  # e.g. a run's config.yaml: its label describes the settings it was written with
            file_label = (cfg.comm.label, wire_settings(cfg))
            cfg.comm.label = ""
    for ov in overrides:
        if "=" not in ov or "." not in ov.split("=", 1)[0]:
            raise ConfigError(f"override '{ov}' is not of the form section.key=value (e.g. train.steps=20)")
        dotted, value = ov.split("=", 1)
        section, key = dotted.split(".", 1)
        _apply(cfg, section.strip(), key.strip(), value, "override")
        if (section.strip(), key.strip()) == ("comm", "label"):
            explicit, cfg.comm.label = cfg.comm.label, ""
    return cfg, preset, file_label, explicit


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict (YAML/JSON serialisable) of a config."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML text, loadable again by :func:`load_config`."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
