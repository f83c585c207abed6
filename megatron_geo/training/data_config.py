"""Pre-flight checks of the ``data`` section: which prefixes a run reads, and that blends, splits and their
combinations are well-formed (before any process group starts; errors name the key, the value and the fix).

Which keys combine (docs/data.md, "Bring your Megatron data"):

- training documents: ``data.train_prefix`` (one prefix) or ``data.train_blend`` (Megatron-LM's ``--data-path``
  spelling), not both;
- validation documents: ``data.valid_prefix`` or ``data.valid_blend``, or the second part of ``data.split``
  (a split with a non-zero validation part and a separate validation prefix or blend is ambiguous, an error).
"""

from __future__ import annotations

from ..config.loader import ConfigError
from ..config.schema import Config, DataConfig


def blend_entries(text: str, key: str) -> list[tuple[float | None, str]]:
    """``(weight or None, prefix)`` pairs of a blend key (:func:`megatron_geo.data.blending.parse_blend`).

    Raises:
        ConfigError: naming ``key``, the bad token and the fix.
    """
    from ..data.blending import parse_blend

    try:
        return parse_blend(text)
    except ValueError as e:
        raise ConfigError(f"{key}={text!r}: {e}") from None


def split_weights(text: str) -> tuple[float, float, float] | None:
    """``data.split`` normalised to (train, valid, test) fractions, or None when empty.

    Raises:
        ConfigError: naming ``data.split``, the value and the fix.
    """
    if not str(text).strip():
        return None
    from ..data.splits import parse_split

    try:
        return tuple(parse_split(text))  # type: ignore[return-value]
    except ValueError as e:
        raise ConfigError(f"data.split={text!r}: {e}") from None


def train_sources(d: DataConfig) -> tuple[str, list[tuple[float | None, str]]]:
    """The config key and the ``(weight, prefix)`` entries of the training documents (empty list: none given)."""
    if d.train_blend.strip():
        return "data.train_blend", blend_entries(d.train_blend, "data.train_blend")
    return "data.train_prefix", [(None, d.train_prefix)] if d.train_prefix else []


def valid_sources(d: DataConfig) -> tuple[str, list[tuple[float | None, str]]]:
    """The config key and entries of the validation documents given by prefix or blend (a split's validation
    part is not listed here: it comes from the training prefixes)."""
    if d.valid_blend.strip():
        return "data.valid_blend", blend_entries(d.valid_blend, "data.valid_blend")
    return "data.valid_prefix", [(None, d.valid_prefix)] if d.valid_prefix else []


def data_files(cfg: Config) -> list[tuple[str, str]]:
    """``(config key, prefix)`` of every indexed dataset the run reads (none for the embedded corpus)."""
    d = cfg.data
    if d.source != "indexed":
        return []
    out = []
    for key, entries in (train_sources(d), valid_sources(d)):
        name = key if key.endswith("_prefix") else f"{key} entry"  # one prefix of a blend, not the whole value
        out += [(name, prefix) for _, prefix in entries]
    return out


def validate_data_config(cfg: Config) -> None:
    """Check the ``data`` keys against each other (no file is opened here; see ``check_inputs``).

    Raises:
        ConfigError: both a prefix and a blend for the same documents, a malformed blend or split, a split whose
            validation part competes with a validation prefix or blend, ``data.source=indexed`` without
            training documents or tokenizer, or ``data.tokenizer_type=huggingface`` without a tokenizer folder.
    """
    d = cfg.data
    for what in ("train", "valid"):
        prefix, blend = getattr(d, f"{what}_prefix"), getattr(d, f"{what}_blend")
        if prefix and blend.strip():
            raise ConfigError(
                f"data.{what}_prefix={prefix!r} and data.{what}_blend={blend!r} both name the {what} documents; "
                f"give one (a single prefix is a blend of one)"
            )
    for key, entries in (train_sources(d), valid_sources(d)):
        for _, prefix in entries:
            if prefix.endswith((".bin", ".idx")):
                raise ConfigError(
                    f"{key} names {prefix!r}: give the prefix without its .bin/.idx suffix "
                    f"({prefix[:-4]!r} for {prefix[:-4]}.bin and {prefix[:-4]}.idx)"
                )
    train_key, train = train_sources(d)
    _, valid = valid_sources(d)
    split = split_weights(d.split)
    if d.source == "indexed" and not (train and d.tokenizer_model):
        raise ConfigError(
            "data.source=indexed needs data.train_prefix (or data.train_blend) and data.tokenizer_model "
            "(make them with tools/train_tokenizer.py and tools/preprocess_data.py)"
        )
    if d.tokenizer_type == "huggingface" and not d.tokenizer_model:
        raise ConfigError(
            "data.tokenizer_type=huggingface needs data.tokenizer_model=FOLDER, the folder of a Hugging Face "
            "tokenizer (tokenizer.json, as save_pretrained writes it)"
        )
    if split is not None:
        if split[0] <= 0:
            raise ConfigError(f"data.split={d.split!r} gives the training part no documents; e.g. data.split=969,30,1")
        if split[1] > 0 and valid:
            raise ConfigError(
                f"data.split={d.split!r} takes validation sequences from {train_key} while "
                f"{'data.valid_blend' if d.valid_blend.strip() else 'data.valid_prefix'} names others; drop one, or "
                "give the split no validation part (e.g. data.split=99,0,1)"
            )
