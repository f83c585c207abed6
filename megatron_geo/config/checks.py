"""Checks that every section of the config shares: a key's value among the choices its ``Literal`` field lists in
the schema (the one list of them), a number that must be positive, and the form of a rule of keys without effect.

Each section's own rules live next to the code that owns the section, as ``check_<section>_config`` (cross-key
rules, raising :class:`ConfigError`) and ``<section>_inert_keys`` (:data:`InertRule` tuples);
:func:`megatron_geo.training.validate.validate_config` and ``reject_inert_keys`` run them in a fixed order.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterable, Mapping
from typing import Literal

from .errors import ConfigError
from .schema import Config

#: ``(keys, the setting that gives them no effect, how to give them one)``: one rule of keys without effect
InertRule = tuple[tuple[str, ...], str, str]


def literal_values(typ: object) -> tuple[str, ...] | None:
    """The values of a ``Literal[...]`` type in the order written, or None for any other type."""
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else None


@functools.cache
def _hints(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def choices_of(cls: type, key: str) -> tuple[str, ...]:
    """The values the schema allows for the ``Literal`` field ``key`` of the section class ``cls``, in the order it
    writes them (``choices_of(CommConfig, "scaling")`` -> ``("tensor", "block")``).

    Raises:
        KeyError: ``key`` is not a field of ``cls``.
        TypeError: the field is not a ``Literal``.
    """
    values = literal_values(_hints(cls)[key])
    if values is None:
        raise TypeError(f"{cls.__name__}.{key} is not a Literal field")
    return values


@functools.cache
def choice_fields() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """``(section, key, values)`` of every ``Literal`` field of the schema, in schema order."""
    out = []
    for sec in dataclasses.fields(Config):
        cls = _hints(Config)[sec.name]
        for f in dataclasses.fields(cls):
            values = literal_values(_hints(cls)[f.name])
            if values is not None:
                out.append((sec.name, f.name, values))
    return tuple(out)


def check_choice(where: str, value: object, values: tuple[str, ...]) -> None:
    """``value`` is one of ``values``.

    Raises:
        ConfigError: ``<where>=<value!r> is not supported; choose one of a, b, c`` (``where`` names the key, and
            for the loader the file or override it came from).
    """
    if value not in values:
        raise ConfigError(f"{where}={value!r} is not supported; choose one of {', '.join(values)}")


def check_choices(cfg: Config) -> None:
    """Every ``Literal`` field of ``cfg`` holds one of the values the schema lists for it. The loader checks each
    such key as it reads it; this covers a config built or changed in code.

    Raises:
        ConfigError: ``section.key='value' is not supported; choose one of a, b, c``, for the first field in
            schema order whose value is not allowed.
    """
    for sec, key, values in choice_fields():
        check_choice(f"{sec}.{key}", getattr(getattr(cfg, sec), key), values)


def check_positive(section: str, obj: object, keys: Iterable[str], hints: Mapping[str, str] | None = None) -> None:
    """Each of ``keys`` of the section ``obj`` (named ``section``) is > 0.

    Raises:
        ConfigError: ``section.key=value must be positive`` for the first key that is not, followed by
            ``hints[key]`` where ``hints`` has one.
    """
    for key in keys:
        v = getattr(obj, key)
        if v <= 0:
            raise ConfigError(f"{section}.{key}={v} must be positive{(hints or {}).get(key, '')}")
