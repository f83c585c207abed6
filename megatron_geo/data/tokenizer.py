"""SentencePiece tokenizer: training (`train_tokenizer`) and a thin wrapper (`Tokenizer`).

Trained models follow Llama conventions: BPE, identity normalization (text is kept
as-is, whitespace included), digits split, byte fallback for unseen characters,
``unk=0 bos=1 eos=2``, no pad piece. A newline is its own piece (``"\\n"``), so
``decode(encode(text)) == text`` for any text made of characters seen in training
(and for any text at all when byte fallback is on).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

MODEL_TYPES = ("bpe", "unigram", "char", "word")
# Below this vocab size byte fallback is off by default: its 256 byte pieces would
# take more than a quarter of the vocabulary.
BYTE_FALLBACK_MIN_VOCAB = 1024
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def _starts_with_bom(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(3) == b"\xef\xbb\xbf"


def _copy_without_bom(path: str, folder: str, i: int) -> str:
    out = os.path.join(folder, f"{i}-{os.path.basename(path)}")
    with open(path, "rb") as src, open(out, "wb") as dst:
        src.read(3)
        while chunk := src.read(1 << 24):
            dst.write(chunk)
    return out


def _check_inputs(input_files: Sequence[str], vocab_size: int, model_type: str) -> list[str]:
    if isinstance(input_files, (str, os.PathLike)):
        input_files = [input_files]
    files = [str(f) for f in input_files]
    if not files:
        raise ValueError("train_tokenizer: input_files is empty; pass at least one text file.")
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"train_tokenizer: input file not found: {f!r}; check the path.")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 8:
        raise ValueError(f"train_tokenizer: vocab_size={vocab_size!r} must be an int >= 8 (e.g. 32000).")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"train_tokenizer: model_type={model_type!r} is not one of {MODEL_TYPES}.")
    return files


def _explain_failure(err: RuntimeError, vocab_size: int, byte_fallback: bool, files: list[str]) -> ValueError:
    msg = str(err)
    too_high = re.search(r"value <= (\d+)", msg)
    if too_high:
        return ValueError(
            f"vocab_size={vocab_size} is too large for this training text: SentencePiece can build at "
            f"most {too_high.group(1)} pieces from {len(files)} file(s). Use a vocab_size <= "
            f"{too_high.group(1)} or train on more text."
        )
    too_low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
    if too_low:
        hint = " or byte_fallback=False (saves 256 pieces)" if byte_fallback else ""
        return ValueError(
            f"vocab_size={vocab_size} is smaller than the {too_low.group(2)} pieces that are required "
            f"(every character of the text plus special{'/byte' if byte_fallback else ''} pieces). "
            f"Use vocab_size >= {too_low.group(2)}{hint}."
        )
    return ValueError(f"SentencePiece training failed for inputs {files[:3]}...: {msg}")


BOM = "\ufeff"


def strip_bom(text: str) -> str:
    """``text`` without a leading UTF-8 byte-order mark (U+FEFF), as ``encoding="utf-8-sig"`` reads a file:
    the mark says how the file was saved, it is not part of the document."""
    return text[1:] if text.startswith(BOM) else text


def train_tokenizer(
    input_files: list[str],
    model_prefix: str,
    vocab_size: int,
    model_type: str = "bpe",
    *,
    byte_fallback: bool | None = None,
    input_sentence_size: int = 2_000_000,
    character_coverage: float = 1.0,
) -> str:
    """Train a SentencePiece model on plain-text files (one sentence per line).

    Args:
        input_files: paths of UTF-8 text files.
        model_prefix: output path without extension; ``PREFIX.model`` and ``PREFIX.vocab``
            are written (parent directories are created).
        vocab_size: exact number of pieces (for ``model_type="char"`` an upper bound).
        model_type: one of ``"bpe"``, ``"unigram"``, ``"char"``, ``"word"``.
        byte_fallback: encode unseen characters as UTF-8 byte pieces; ``None`` turns it
            on when ``vocab_size >= 1024``.
        input_sentence_size: at most this many lines (randomly sampled) are used; the
            result is deterministic when the text has fewer lines (Shakespeare: ~250k).
        character_coverage: fraction of characters that get their own piece.

    Returns:
        Path of the ``.model`` file (str).

    Raises:
        FileNotFoundError: an input file is missing.
        ValueError: bad arguments, or SentencePiece refused the vocab size (too large for
            the text, or too small for its characters); the message gives the valid bound.
    """
    files = _check_inputs(input_files, vocab_size, model_type)
    bom_free = tempfile.TemporaryDirectory(prefix="mg-tok-") if any(_starts_with_bom(f) for f in files) else None
    if bom_free is not None:  # SentencePiece reads the files itself: give it copies without the byte-order mark
        files = [_copy_without_bom(f, bom_free.name, i) if _starts_with_bom(f) else f for i, f in enumerate(files)]
    if byte_fallback is None:
        byte_fallback = vocab_size >= BYTE_FALLBACK_MIN_VOCAB
    Path(model_prefix).parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=files,
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=byte_fallback,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=-1,
            user_defined_symbols=["\n"],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=character_coverage,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise _explain_failure(err, vocab_size, byte_fallback, files) from err
    return f"{model_prefix}.model"


def checked_ids(ids: Iterable[int], vocab_size: int, who: str) -> list[int]:
    """``ids`` as Python ints. Raises ValueError (naming ``who``) if an id is outside ``[0, vocab_size)``."""
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{who}: ids {bad[:5]} are outside [0, {vocab_size}); wrong tokenizer for this data?")
    return out


# an indexed dataset's index: MMIDIDX, or the MGEOIDX of earlier releases (refused by indexed_dataset.py)
_INDEX_MAGICS = (b"MMIDIDX\x00\x00", b"MGEOIDX\x00")


def _what_the_file_is(path: str) -> str | None:
    """What a file that SentencePiece cannot load looks like, when it is a known mistake (else None)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if head.startswith(_INDEX_MAGICS):
        return "an indexed dataset's index (.idx), not a tokenizer"
    root, ext = os.path.splitext(path)
    if ext == ".bin" and os.path.isfile(root + ".idx"):
        return "an indexed dataset's token file (.bin), not a tokenizer"
    if head.lstrip()[:1] in (b"{", b"["):
        return "a JSON file (a Hugging Face tokenizer.json?), not a SentencePiece model"
    return None


def check_tokenizer_file(path: str, label: str = "data.tokenizer_model") -> Tokenizer:
    """Load the SentencePiece model at ``path`` as the data pipeline will, for a start-up check: one error line
    instead of a traceback on every rank after the process group started.

    Args:
        path: the ``.model`` file (a SentencePiece ``ModelProto``, as :func:`train_tokenizer` writes it).
        label: the setting that names it in the message (``data.tokenizer_model``, ``--tokenizer-model``).

    Returns:
        The loaded :class:`Tokenizer` (its ``vocab_size`` and ``eod_id`` are checked to exist).

    Raises:
        ConfigError: one line naming ``label``, the path, what is wrong (missing, a folder, an indexed dataset's
            ``.idx`` / ``.bin``, a JSON file, another file SentencePiece cannot parse, no EOS piece) and the fix.
    """
    from ..config.errors import ConfigError

    where = f"{label}={str(path)!r}"
    model = "the .model file tools/train_tokenizer.py writes (PREFIX.model)"
    if not path or not os.path.exists(path):
        raise ConfigError(f"{where} not found; train one with tools/train_tokenizer.py or fix the path")
    if os.path.isdir(path):
        raise ConfigError(
            f"{where} is a folder; a SentencePiece tokenizer is {model}, and a Hugging Face tokenizer's folder "
            f"needs data.tokenizer_type=huggingface"
        )
    try:
        tok = Tokenizer(path)
    except (ValueError, OSError) as err:
        what = _what_the_file_is(path)
        if what is None:
            cause = err.__cause__ if err.__cause__ is not None else err
            what = f"not a SentencePiece model (sentencepiece: {' '.join(str(cause).split())[:200]})"
        hint = ""
        if what.startswith("an indexed dataset"):
            hint = "; the dataset's prefix (without .bin/.idx) goes in data.train_prefix"
        elif what.startswith("a JSON file"):
            hint = "; for a Hugging Face tokenizer set data.tokenizer_type=huggingface and give its folder"
        raise ConfigError(f"{where} is {what}; give {model}{hint}") from None
    try:
        _ = tok.eod_id
    except ValueError:
        raise ConfigError(
            f"{where} has no EOS piece to end documents with; train the tokenizer with an EOS piece "
            f"(tools/train_tokenizer.py does: eos id {EOS_ID})"
        ) from None
    return tok


class Tokenizer:
    """Wrapper around a trained SentencePiece ``.model`` file.

    Round trip: ``decode(encode(text)) == text`` for every string whose characters the model knows (with
    byte fallback, the default from a 1,024-piece vocabulary, every character), with one exception by
    construction of SentencePiece: U+2581 (LOWER ONE EIGHTH BLOCK, SentencePiece's whitespace marker)
    comes back as a space U+0020. Without byte fallback an unknown character comes back as `` ⁇ `` (the
    unknown piece). ``tests/test_data.py`` pins both.

    Raises:
        FileNotFoundError: ``model_path`` does not exist.
        ValueError: the file is not a SentencePiece model.
    """

    def __init__(self, model_path: str):
        self.model_path = str(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(
                f"Tokenizer model not found: {self.model_path!r}. Train one with "
                f"`python tools/train_tokenizer.py --input FILE... --model-prefix PREFIX "
                f"--vocab-size N` (it writes PREFIX.model) or pass an existing .model path."
            )
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (RuntimeError, OSError) as err:
            raise ValueError(f"{self.model_path!r} is not a valid SentencePiece model: {err}") from err

    @property
    def vocab_size(self) -> int:
        """Number of pieces; token ids are in ``[0, vocab_size)``."""
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        """End-of-document id (the EOS piece). Raises ValueError if the model has none."""
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"Tokenizer {self.model_path!r} has no EOS piece to use as end-of-document.")
        return eos

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (-1 if the model has none)."""
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added). Raises TypeError for non-str."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects str, got {type(text).__name__}")
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, using all CPU threads."""
        return self._sp.encode(list(texts), out_type=int, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (list, numpy array or 1-D tensor).

        Raises ValueError if an id is outside ``[0, vocab_size)``.
        """
        return self._sp.decode(checked_ids(ids, self.vocab_size, "Tokenizer.decode"))
