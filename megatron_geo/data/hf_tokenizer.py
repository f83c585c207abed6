"""A Hugging Face tokenizer as the data pipeline's tokenizer (Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer``)
and the factory every part of the pipeline makes its tokenizer with (:func:`load_tokenizer`).

:class:`HFTokenizer` has the interface of the SentencePiece :class:`~megatron_geo.data.tokenizer.Tokenizer`, with
the semantics of Megatron-LM's ``_HuggingFaceTokenizer``: ``vocab_size`` is ``len(tokenizer)`` (the whole
vocabulary, added tokens included), the end-of-document id is the tokenizer's ``eos_token_id``. Text is encoded
without special tokens (no BOS/EOS added: the pipeline appends the end-of-document id itself) and decoded without
skipping any, so ``decode(encode(text)) == text`` for a byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM2, ...).

``transformers`` (the ``hf`` extra) is imported only when such a tokenizer is loaded.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

from ..config.checks import choices_of
from ..config.errors import ConfigError
from ..config.schema import DataConfig
from .tokenizer import Tokenizer, checked_ids

TOKENIZER_TYPES = choices_of(DataConfig, "tokenizer_type")  # data.tokenizer_type, as the schema lists them
# Megatron-LM's --tokenizer-type spellings of the two
MEGATRON_TOKENIZER_TYPES = {"SentencePieceTokenizer": "sentencepiece", "HuggingFaceTokenizer": "huggingface"}
# Files a transformers tokenizer folder may hold (save_pretrained, a hub snapshot): at least one must be there;
# all that are there make the fingerprint.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
_INSTALL = "pip install -e '.[hf]' (or pip install 'transformers>=4.46')"


def tokenizer_type_name(name: str) -> str:
    """``sentencepiece`` or ``huggingface`` for our spelling or Megatron-LM's (``SentencePieceTokenizer``,
    ``HuggingFaceTokenizer``), in any case.

    Raises:
        ValueError: any other name (lists the accepted ones).
    """
    text = str(name).strip().lower()
    for megatron, ours in MEGATRON_TOKENIZER_TYPES.items():
        if text in (ours, megatron.lower()):
            return ours
    accepted = ", ".join([*MEGATRON_TOKENIZER_TYPES, *TOKENIZER_TYPES])
    raise ValueError(f"tokenizer type {name!r} is not one of {accepted}")


def check_tokenizer_folder(path: str, label: str = "tokenizer") -> None:
    """What can be checked of a Hugging Face tokenizer folder without loading it: it is a folder, it holds
    tokenizer files, and ``transformers`` is installed.

    ``label`` names the setting in the message (``data.tokenizer_model``, ``--tokenizer-model``).

    Raises:
        ConfigError: one line naming the path and the fix.
    """
    import importlib.util

    where = f"{label} {path!r}"
    if not path:
        raise ConfigError(f"{label} is empty; give the folder of a Hugging Face tokenizer (holding tokenizer.json)")
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.isfile(path) else "not found"
        raise ConfigError(
            f"{where}: {what}; a Hugging Face tokenizer is the folder save_pretrained writes (or a downloaded hub "
            f"snapshot) holding tokenizer.json; fix the path, or use the SentencePiece type for a .model file"
        )
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(
            f"{where}: no tokenizer files in that folder (none of tokenizer.json, tokenizer_config.json, "
            f"tokenizer.model, vocab.json); save the tokenizer there with tokenizer.save_pretrained(FOLDER) or "
            f"point at the folder that holds them"
        )
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"{where}: a Hugging Face tokenizer needs the transformers package; install it with {_INSTALL}"
        )


class HFTokenizer:
    """A ``transformers`` tokenizer loaded from a local folder (``AutoTokenizer.from_pretrained``, no download).

    Attributes:
        model_path: the folder.

    Raises (at construction):
        ConfigError: the folder is missing or holds no tokenizer files, ``transformers`` is not installed, or
            ``from_pretrained`` fails (its reason on the same line).
    """

    def __init__(self, path: str, label: str = "tokenizer"):
        self.model_path = str(path)
        self._label = label
        check_tokenizer_folder(self.model_path, label)
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ConfigError(
                f"{label} {self.model_path!r}: a Hugging Face tokenizer needs transformers ({e.name} cannot be "
                f"imported); install it with {_INSTALL}"
            ) from None
        try:
            self._tok = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, json and tokenizers errors alike
            reason = " ".join(str(e).split())[:300]
            raise ConfigError(
                f"{label} {self.model_path!r}: transformers cannot load the tokenizer ({type(e).__name__}: "
                f"{reason}); save it again with tokenizer.save_pretrained(FOLDER)"
            ) from None
        # documents are longer than the model's context; the pipeline cuts them into samples itself
        self._tok.model_max_length = 1 << 62
        self._vocab_size = len(self._tok)
        self._fingerprint: str | None = None

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: the base vocabulary and the added tokens; ids are in ``[0, vocab_size)``."""
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        """End-of-document id: the tokenizer's ``eos_token_id``. Raises ConfigError if it has none."""
        eos = self._tok.eos_token_id
        if eos is None:
            raise ConfigError(
                f"{self._label} {self.model_path!r}: the tokenizer has no EOS token to end documents with; set one "
                f"(tokenizer.eos_token = '...'; tokenizer.save_pretrained(FOLDER)) or use another tokenizer"
            )
        return int(eos)

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (-1 if the tokenizer has none)."""
        bos = self._tok.bos_token_id
        return -1 if bos is None else int(bos)

    @property
    def unk_id(self) -> int:
        """Unknown-token id (-1 if the tokenizer has none: byte-level BPE needs none)."""
        unk = self._tok.unk_token_id
        return -1 if unk is None else int(unk)

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the tokenizer files in the folder, the vocabulary size and the end-of-document id:
        another tokenizer (or the same files with other added tokens) gives another fingerprint. Computed once."""
        if self._fingerprint is not None:
            return self._fingerprint
        h = hashlib.sha256()
        for name in TOKENIZER_FILES:
            p = os.path.join(self.model_path, name)
            if os.path.isfile(p):
                h.update(f"{name}\0".encode())
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                h.update(b"\0")
        eos = self._tok.eos_token_id
        h.update(f"vocab={self._vocab_size} eos={eos}".encode())
        self._fingerprint = h.hexdigest()
        return self._fingerprint

    def _ids(self, texts: list[str]) -> list[list[int]]:
        out = self._tok(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
        return [list(ids) for ids in out["input_ids"]]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special token added. Raises TypeError for non-str."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode expects str, got {type(text).__name__}")
        return self._ids([text])[0] if text else []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` in one call (a fast tokenizer uses all CPU threads)."""
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"HFTokenizer.encode_batch expects str items, got {type(t).__name__}")
        return self._ids(texts) if texts else []

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (list, numpy array or 1-D tensor), special tokens kept, spaces as encoded.

        Raises ValueError if an id is outside ``[0, vocab_size)``.
        """
        ids = checked_ids(ids, self.vocab_size, "HFTokenizer.decode")
        return self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load_tokenizer(tokenizer_type: str, path: str, label: str = "tokenizer") -> Tokenizer | HFTokenizer:
    """The pipeline's tokenizer: a SentencePiece ``.model`` (``sentencepiece``) or a Hugging Face tokenizer folder
    (``huggingface``; Megatron-LM's spellings ``SentencePieceTokenizer`` / ``HuggingFaceTokenizer`` too).

    ``label`` names the setting in a Hugging Face tokenizer's error messages.

    Raises:
        ConfigError: an unknown type, or a Hugging Face folder that cannot be loaded (:class:`HFTokenizer`).
        FileNotFoundError / ValueError: a missing or invalid SentencePiece model (:class:`Tokenizer`).
    """
    try:
        kind = tokenizer_type_name(tokenizer_type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if kind == "huggingface":
        return HFTokenizer(path, label)
    return Tokenizer(path)
