"""Pre-flight checks of the ``data`` section: which prefixes a run reads, that blends, splits and their
combinations are well-formed, which data keys the chosen source gives no effect, and that the files the keys name
exist (before any process group starts; errors name the key, the value and the fix).

Which keys combine (docs/data.md, "Bring your Megatron data"):

- training documents: ``data.train_prefix`` (one prefix) or ``data.train_blend`` (Megatron-LM's ``--data-path``
  spelling), not both;
- validation documents: ``data.valid_prefix`` or ``data.valid_blend``, or the second part of ``data.split``
  (a split with a non-zero validation part and a separate validation prefix or blend is ambiguous, an error).
"""

from __future__ import annotations

import os

from ..config.checks import InertRule
from ..config.loader import ConfigError
from ..config.schema import Config, DataConfig
from .train_config import check_output_folder


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
            training documents or tokenizer, ``data.tokenizer_type=huggingface`` without a tokenizer folder, or a
            ``data.cache_dir`` that a file is in the way of.
    """
    d = cfg.data
    check_output_folder("data.cache_dir", d.cache_dir)
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


def data_inert_keys(d: DataConfig) -> list[InertRule]:
    """The ``data`` keys that ``data.source`` gives no effect: the prefixes, blends, split and (with SentencePiece)
    ``data.tokenizer_model`` with the embedded corpus; ``data.cache_dir`` with ``data.source=indexed``."""
    if d.source == "shakespeare":
        # a Hugging Face tokenizer tokenizes the embedded corpus: its folder is then in use
        tok = ("data.tokenizer_model",) if d.tokenizer_type == "sentencepiece" else ()
        keys = ("data.train_prefix", "data.valid_prefix", *tok, "data.train_blend", "data.valid_blend", "data.split")
        return [
            (keys, "data.source=shakespeare (the embedded corpus)", "set data.source=indexed to train on your files")
        ]
    if d.source == "indexed":
        why = "data.source=indexed (only the embedded corpus is prepared there)"
        return [(("data.cache_dir",), why, "set data.source=shakespeare")]
    return []


def check_data_paths(cfg: Config) -> None:
    """The files the ``data`` keys name exist: with ``data.source=indexed`` the ``.bin`` and ``.idx`` of every
    prefix (and their headers and sizes, :func:`megatron_geo.data.indexed_dataset.check_dataset_files`) and a
    SentencePiece ``data.tokenizer_model``; with ``data.tokenizer_type=huggingface`` (either source) the
    tokenizer's folder (:func:`megatron_geo.data.hf_tokenizer.check_tokenizer_folder`).

    Raises:
        ConfigError: naming the key, the missing or malformed file and the fix.
    """
    from ..data.hf_tokenizer import check_tokenizer_folder
    from ..data.indexed_dataset import check_dataset_files

    d = cfg.data
    if d.source == "indexed":
        for key, prefix in data_files(cfg):
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ConfigError(
                    f"{key}={prefix!r}: {' and '.join(repr(m) for m in missing)} not found; write them with "
                    f"tools/preprocess_data.py --output-prefix {prefix} or fix the path"
                )
            check_dataset_files(key, prefix)  # format, header and sizes of both files
        if d.tokenizer_type == "sentencepiece" and d.tokenizer_model and not os.path.exists(d.tokenizer_model):
            raise ConfigError(
                f"data.tokenizer_model={d.tokenizer_model!r} not found; train one with "
                f"tools/train_tokenizer.py or fix the path"
            )
    if d.tokenizer_type == "huggingface":  # with either source: the embedded corpus is tokenized with it too
        check_tokenizer_folder(d.tokenizer_model, "data.tokenizer_model")
