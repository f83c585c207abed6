"""YAML text -> plain data for the config loader, one meaning per spelling.

- Scalars stay their text (no implicit typing: ``007``, ``yes`` and ``1e3`` are strings); the loader types them
  against the schema field.
- A plain (unquoted) ``~``, ``null``, ``Null``, ``NULL`` or an empty value is ``None``: the key's default.
  Quoted (``"null"``, ``''``) they are text.
- Merge keys as YAML 1.1 defines them: ``<<: MAPPING`` or ``<<: [M1, M2, ...]`` (usually aliases, ``<<: *a``)
  adds the keys of the merged mappings; keys written in the mapping itself override merged ones, and among
  several merged mappings the earlier one wins.
- A key written twice in one mapping, at any depth, is an error naming both lines (plain YAML readers keep the
  last one silently).
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .errors import ConfigError

NULL_WORDS = ("~", "null", "Null", "NULL")  # and the empty value
_NULL_TAG = "tag:yaml.org,2002:null"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.BaseLoader):
    """PyYAML's base parser and composer; of the implicit types only null and the merge key are recognised."""


_Loader.add_implicit_resolver(_NULL_TAG, re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
_Loader.add_implicit_resolver(_MERGE_TAG, re.compile(r"^<<$"), ["<"])


def read_yaml(text: str, where: str) -> Any:
    """The one YAML document in ``text`` as nested dicts / lists of ``str`` and ``None`` (None for an empty text).

    Args:
        text: YAML source.
        where: how error messages name the source, e.g. ``config file 'a.yaml'``.

    Raises:
        yaml.YAMLError: a syntax error (or several documents).
        ConfigError: a duplicate key, a key that is not a plain scalar, a merge key whose value is not a mapping
            or list of mappings, or a structure that contains itself.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    finally:
        loader.dispose()
    return None if node is None else _Converter(where).value(node, "")


def _place(node: Node, other: Node) -> str:
    """Where ``node`` is, as ``line L`` (with the column when ``other`` is on the same line)."""
    m = node.start_mark
    return f"line {m.line + 1}" + (f", column {m.column + 1}" if m.line == other.start_mark.line else "")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Converter:
    """Composed YAML nodes -> data, resolving merge keys and rejecting duplicate keys on the way."""

    def __init__(self, where: str):
        self.where = where
        self.open: set[int] = set()  # nodes being converted (an alias back into one of them is a cycle)

    def at(self, node: Node) -> str:
        return f"{self.where}, line {node.start_mark.line + 1}"

    def enter(self, node: Node, path: str) -> None:
        if id(node) in self.open:
            raise ConfigError(
                f"{self.at(node)}: '{path or 'the top level'}' contains itself through an alias; "
                f"an alias may only repeat a finished block"
            )
        self.open.add(id(node))

    def value(self, node: Node, path: str) -> Any:
        if isinstance(node, ScalarNode):
            return None if node.tag == _NULL_TAG else node.value
        self.enter(node, path)
        try:
            if isinstance(node, SequenceNode):
                return [self.value(v, f"{path}[{i}]") for i, v in enumerate(node.value)]
            return {k: self.value(v, _join(path, k)) for k, v in self.pairs(node, path).items()}
        finally:
            self.open.discard(id(node))

    def key(self, node: Node, path: str) -> str:
        if not isinstance(node, ScalarNode) or node.tag == _NULL_TAG:
            shown = "an empty (null)" if isinstance(node, ScalarNode) else f"a {node.id}"
            raise ConfigError(
                f"{self.at(node)}: {shown} key in '{path or 'the top level'}'; keys are plain names (e.g. steps: 20)"
            )
        return node.value

    def pairs(self, node: MappingNode, path: str) -> dict[str, Node]:
        """``key -> value node`` of a mapping after its merge keys: own keys first, then earlier merges."""
        own: dict[str, Node] = {}
        merged: dict[str, Node] = {}
        first: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key = self.key(key_node, path)
            if key in first:
                raise ConfigError(
                    f"{self.at(key_node)}: duplicate key '{_join(path, key)}' (first at "
                    f"{_place(first[key], key_node)}); a YAML reader keeps only the last one, so write "
                    f"each key once"
                )
            first[key] = key_node
            if key_node.tag != _MERGE_TAG:
                own[key] = value_node
                continue
            for source in self.merge_sources(value_node, path):
                self.enter(source, path)
                try:
                    for k, v in self.pairs(source, path).items():
                        merged.setdefault(k, v)
                finally:
                    self.open.discard(id(source))
        return {**merged, **own}

    def merge_sources(self, node: Node, path: str) -> list[MappingNode]:
        items = node.value if isinstance(node, SequenceNode) else [node]
        if not all(isinstance(n, MappingNode) for n in items):
            raise ConfigError(
                f"{self.at(node)}: the merge key '<<' in '{path or 'the top level'}' takes a mapping or "
                f"a list of mappings (e.g. <<: *defaults or <<: [*a, *b])"
            )
        return items
