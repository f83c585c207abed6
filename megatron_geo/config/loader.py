"""YAML loading, ordered merge of several files, dotted ``key=value`` overrides, type checking.

One meaning per spelling:

- A YAML null (plain ``~``, ``null``, ``Null``, ``NULL`` or an empty value) and an override ``section.key=null``
  (or ``=~``) set the key to its schema default, also over a value an earlier file gave. An empty override
  ``section.key=`` is the empty text: the "not given" value of keys whose default is empty, an error for a
  required path or a number.
- A section written as null or with no keys sets nothing. Top-level keys starting with ``x-`` are ignored: a
  place for YAML anchors that sections merge in (``<<: *name``, see :mod:`.yaml_read`).
- Path keys (:func:`~megatron_geo.config.schema.path_field`) and the prefixes of a blend are resolved once, after
  the last override: ``~``, ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${VAR-default}`` expanded and the path
  made absolute, so the config a run records (``config.yaml``, the checkpoint) names the files it read; an unset
  variable without a default or an empty required path is an error.

Errors are :class:`ConfigError` with a message that names the offending file/key/value and the fix.
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import functools
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from .checks import check_choice, literal_values
from .errors import ConfigError
from .renamed import renamed_hint
from .schema import Config
from .yaml_read import NULL_WORDS, read_yaml

__all__ = [
    "ConfigError",
    "config_to_dict",
    "dump_config",
    "expand_blend",
    "expand_path",
    "load_config",
    "resolve_paths",
]


def _section_fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _suggest(name: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{prefix}{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(options))}."


_LIST_KEYS = (
    "geo.layers",
    "geo.power_search",
    "checkpoint.allow_changes",
)  # comma-separated strings that may be written as YAML lists
# keys whose values are auto, true or false: a YAML boolean (or yes / on / no / off) is read as true or false
_AUTO_BOOL_KEYS = ("parallel.overlap_param_gather", "comm.compile")


def _int_from_text(text: str) -> int | None:
    """``"20"``, ``"4_000_000"``, ``"1e3"``, ``"2.0"`` -> int; ``"2.5e0"``, ``"2.5"``, ``"x"`` -> None (never
    truncated)."""
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


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert ``value`` to the schema field's type ``typ`` or raise ConfigError.

    Values are typed against the field, never guessed first: YAML files are read without implicit typing
    (every scalar is its text) and overrides are their text, so a string key keeps the text exactly as written
    and a non-integral number for an integer key is an error in every spelling (``2.5``, ``2.5e0``). A ``Literal``
    key is a string that must be one of the values the schema lists for it.
    """
    values = literal_values(typ)
    if values is not None:
        text = _coerce(value, str, where)
        check_choice(where, text, values)
        return text
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
                value = read_yaml(value, where)  # an override written as a YAML list
            except yaml.YAMLError:
                raise ConfigError(f"{where}: {value!r} is not a valid list; e.g. [0.5, 0.25, 0]") from None
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, list) and where.endswith(_LIST_KEYS):
            if any(v is None or (isinstance(v, str) and not v.strip()) for v in value):
                raise ConfigError(f"{where}: the list {value!r} has an empty element; e.g. [0.5, 0.25, 0]")
            if all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                return ",".join(str(v) for v in value)  # a YAML list of patterns / numbers = the comma-separated form
            raise ConfigError(f"{where}: expected a list of numbers or strings, got {value!r}; e.g. [0.5, 0.25, 0]")
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported field type {typ}")


def _apply(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    """Set ``section.key`` from a file's or an override's ``value``; ``None`` (a null) sets the schema default."""
    sections = _section_fields(cfg)
    if section not in sections:
        raise ConfigError(f"{origin}: unknown section '{section}'.{_suggest(section, sections)}")
    sec = getattr(cfg, section)
    fields = _section_fields(sec)
    if key not in fields:
        raise ConfigError(f"{origin}: unknown key '{section}.{key}'.{_suggest(key, fields, section + '.')}")
    default = getattr(type(sec)(), key)
    if value is None:
        setattr(sec, key, default)
        return
    typ, where = typing.get_type_hints(type(sec))[key], f"{origin}: {section}.{key}"
    if typ is not str and isinstance(value, str) and not value.strip():
        shown = str(default).lower() if isinstance(default, bool) else default
        raise ConfigError(f"{where}: empty value; give a value, or null for the default ({shown})")
    setattr(sec, key, _coerce(value, typ, where))


def _override_value(text: str) -> str | None:
    """An override's value: ``null`` / ``Null`` / ``NULL`` / ``~`` -> None (the default), anything else as written."""
    return None if text.strip() in NULL_WORDS else text


# $NAME, ${NAME} and the shell's ${NAME:-default} / ${NAME-default} (default: any text without a closing brace)
_VAR = re.compile(r"\$(?:(\w+)|\{(\w+)(?:(:?-)([^${}]*))?\})")  # innermost first: a default holds no ${...}
_MALFORMED = re.compile(r"\$\{[^}]*\}?")


def expand_path(value: str, key: str) -> str:
    """``value`` with a leading ``~`` / ``~user`` and every variable expanded as a POSIX shell would, made absolute
    (relative to the working directory of the launch).

    Forms: ``$NAME``, ``${NAME}``, ``${NAME:-default}`` (the default when NAME is unset or empty) and
    ``${NAME-default}`` (the default when NAME is unset). What a run reads is then recorded resolved: a relaunch
    under another environment or working directory is compared with the files the run was started on.

    Raises:
        ConfigError: a variable that is not set and has no default, or a ``${...}`` that is none of these forms
            (naming ``key`` and the variable).
    """

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        op, default = m.group(3), m.group(4)
        got = os.environ.get(name)
        if op == ":-" and not got:
            return default
        if op == "-" and got is None:
            return default
        if got is None:
            raise ConfigError(
                f"{key}={value!r}: the environment variable {name!r} is not set; set it (export {name}=...), "
                f"give a default (${{{name}:-DEFAULT}}) or write the path out"
            )
        return got

    home = os.path.expanduser(value)
    out = home
    for _ in range(8):  # a default may name a variable: ${A:-${HOME}/x} expands ${HOME} first, then ${A:-...}
        nxt = _VAR.sub(one, out)
        if nxt == out:
            break
        out = nxt
    bad = _MALFORMED.search(out if "${" in home else "")
    if bad and "${" in bad.group(0):
        raise ConfigError(
            f"{key}={value!r}: {bad.group(0)!r} is not a variable form this loader expands ($NAME, ${{NAME}}, "
            f"${{NAME:-default}} or ${{NAME-default}}); write the path out"
        )
    return os.path.abspath(os.path.expanduser(out)) if out else out


def expand_blend(value: str, key: str) -> str:
    """A Megatron ``--data-path`` style blend (``"W1 PREFIX1 W2 PREFIX2"`` or prefixes alone) with every prefix
    expanded by :func:`expand_path` and the weights as written (their parsing and errors belong to
    ``megatron_geo.data.blending.blend_entries``).

    Raises:
        ConfigError: as :func:`expand_path`.
    """
    out = []
    for tok in value.split():
        try:
            float(tok)
        except ValueError:
            out.append(expand_path(tok, key))
        else:
            out.append(tok)
    return " ".join(out)


def _resolve_path(value: str, key: str, field: dataclasses.Field) -> str:
    """One path key's final value: keywords (e.g. ``auto``) as written, empty as ``""``, a path expanded."""
    keywords, default = field.metadata["keywords"], field.default
    if value in keywords:
        return value
    if not value.strip():
        if field.metadata["required"]:
            words = f"{', '.join(keywords)} or " if keywords else ""
            raise ConfigError(f"{key} is empty; give {words}a path, or null for the default ({default})")
        return ""
    out = expand_path(value, key)
    if not out:  # written, but its variables are empty: never the working directory or "not given" by accident
        raise ConfigError(
            f"{key}={value!r} expands to an empty path (its variables are empty); set them, or write the path out"
        )
    return out


def resolve_paths(cfg: Config) -> None:
    """Expand every path key of ``cfg`` in place (the schema marks them with ``path_field``), and the prefixes of
    ``data.train_blend`` / ``data.valid_blend``: absolute, with ``~`` and variables expanded.

    Raises:
        ConfigError: an empty required path or an unset ``$VAR``.
    """
    for sec_field in dataclasses.fields(cfg):
        sec = getattr(cfg, sec_field.name)
        for f in dataclasses.fields(sec):
            if f.metadata.get("path"):
                setattr(sec, f.name, _resolve_path(getattr(sec, f.name), f"{sec_field.name}.{f.name}", f))
    for key in ("train_blend", "valid_blend"):
        setattr(cfg.data, key, expand_blend(getattr(cfg.data, key), f"data.{key}"))


def load_config(files: list[str] | tuple[str, ...] = (), overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a :class:`Config`: defaults, then each YAML file in order, then ``section.key=value`` overrides.

    A null sets a key to its schema default; path keys come back expanded (see the module docstring).

    Raises:
        ConfigError: missing file, YAML syntax error, a duplicate key (naming both lines), unknown section/key
            (with the closest valid key suggested), a value of the wrong type, a value outside a ``Literal`` key's
            choices (``<file or override>: section.key='value' is not supported; choose one of a, b, c``), a
            malformed override, an empty required path, or an unset ``$VAR`` in a path.
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
        paths += [
            p for p in sorted(folder.glob("*.yaml")) if preset is None or p.resolve() != Path(preset[1]).resolve()
        ]
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
            raise ConfigError(f"config file '{f}' not found (pass an existing YAML file to --config){renamed_hint(f)}")
        name = preset_name(path)
        if name is not None:
            if preset is not None:
                raise ConfigError(
                    f"config files '{preset[1]}' and '{f}' are both comm presets; a preset sets the "
                    f"whole comm and geo sections, so pass one and change keys with overrides "
                    f"(e.g. comm.error_feedback=true)"
                )
            preset = (name, f)
            reset_comm_sections(cfg)  # a preset replaces comm and geo (never a silent merge with earlier files)
        try:
            # no implicit typing: every scalar stays its text (or None, a null) and is typed against the schema
            data = read_yaml(path.read_text(encoding="utf-8-sig"), f"config file '{f}'")
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{f}' is not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file '{f}' is not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); "
                f"save it as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)"
            ) from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{f}': top level must be a mapping of sections, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if not k.startswith("x-")}  # anchors for merge keys, not settings
        # a model config after a preset would silently replace part of it (an overlay of comm/geo keys alone is
        # a deliberate change and allowed)
        if preset is not None and name is None and "model" in data and ({"comm", "geo"} & set(data)):
            raise ConfigError(
                f"model config '{f}' sets {'/'.join(sorted({'comm', 'geo'} & set(data)))} keys after the "
                f"comm preset '{preset[1]}', which would silently replace part of it; pass the preset "
                f"last (--config MODEL.yaml --config {preset[1]}) or change keys with overrides"
            )
        for section, body in data.items():
            if body is None:  # `train:` with every key commented out
                continue
            if not isinstance(body, dict):
                raise ConfigError(f"{f}: section '{section}' must be a mapping of key: value")
            for key, value in body.items():
                _apply(cfg, section, key, value, f)
        if "label" in (data.get("comm") or {}):  # e.g. a run's config.yaml: its label describes its settings;
            # a null or empty label drops an earlier file's (the label is derived again)
            file_label = (cfg.comm.label, wire_settings(cfg)) if cfg.comm.label else None
            cfg.comm.label = ""
    for ov in overrides:
        if "=" not in ov or "." not in ov.split("=", 1)[0]:
            raise ConfigError(f"override '{ov}' is not of the form section.key=value (e.g. train.steps=20)")
        dotted, value = ov.split("=", 1)
        section, key = dotted.split(".", 1)
        _apply(cfg, section.strip(), key.strip(), _override_value(value), "override")
        if (section.strip(), key.strip()) == ("comm", "label"):
            explicit, cfg.comm.label = cfg.comm.label, ""
            if not explicit:  # comm.label=null or comm.label=: derived, whatever a file said
                explicit = file_label = None
    resolve_paths(cfg)
    return cfg, preset, file_label, explicit


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict (YAML/JSON serialisable) of a config."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML text, loadable again by :func:`load_config`."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
